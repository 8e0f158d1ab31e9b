//! The printed tables: one row per round and mode, then per size and mode the medians
//! and the largest agent peaks, and PreCopy and PostCopy ÷ Cold.

use super::figures::{AgentPeaks, Mig, Mode, Raw, Reading, Row, mib};

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".into())
}

pub(super) fn print_table(rows: &[Row], loads: &[String]) {
    println!("load (1/5/15 min): {}", loads.join("; "));
    println!();
    println!(
        "| size | mode | round | raw node | raw dump / cp / restore ms | raw ms | raw bytes | PodMotion from → to | PodMotion downtime ms | warm-round stalls n / sum ms | total frozen ms | ÷ raw | final dump ms / bytes | restore ms | bytes sent | rounds | whole migration s | agent VmHWM src / tgt | agent container memory-cgroup peak incl. checkpoint tmpfs, src / tgt |"
    );
    println!(
        "|---|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|"
    );
    for r in rows {
        println!("{}", round_line(r));
    }
    println!();
    println!(
        "| size | mode | rounds ok | median raw ms | median PodMotion downtime ms | median warm-round stalls n / sum ms | median total frozen ms | median of per-round ÷ raw | max agent VmHWM src / tgt | max agent container memory-cgroup peak incl. checkpoint tmpfs, src / tgt |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|---|");
    let mut sizes: Vec<u32> = rows.iter().map(|r| r.size).collect();
    sizes.dedup();
    for &size in &sizes {
        for mode in Mode::ALL {
            println!("{}", median_line(rows, size, mode));
        }
        for mode in [Mode::PreCopy, Mode::PostCopy] {
            println!("{}", over_cold_line(rows, size, mode));
        }
    }
}

/// One round's row of the first table.
fn round_line(r: &Row) -> String {
    let (raw_node, raw_parts, raw_ms, raw_bytes) = match &r.raw {
        Ok(x) => (
            x.node.clone(),
            format!("{:.0} / {:.0} / {:.0}", x.dump_ms, x.copy_ms, x.restore_ms),
            format!("{:.0}", x.downtime_ms()),
            mib(x.bytes),
        ),
        Err(e) => ("–".into(), format!("failed: {e}"), "–".into(), "–".into()),
    };
    let mig = match &r.mig {
        Ok(m) => format!(
            "{} → {} | {} | {} | {} | {} | {} / {} | {} | {} | {} | {}",
            m.from,
            m.to,
            m.downtime_ms,
            m.warm.cell(),
            m.total_frozen_ms,
            match &r.raw {
                Ok(x) => format!("{:.2}", m.downtime_ms as f64 / x.downtime_ms()),
                Err(_) => "–".into(),
            },
            opt(m.final_dump_ms),
            opt(m.final_dump_bytes.map(mib)),
            opt(m.restore_ms),
            match m.lazy_bytes {
                Some(l) => format!(
                    "{} + {} lazy",
                    mib(m.bytes_sent.max(0) as u64),
                    mib(l.max(0) as u64)
                ),
                None => mib(m.bytes_sent.max(0) as u64),
            },
            m.iterations,
            m.total_s
        ),
        Err(e) => format!("failed: {e} | – | – | – | – | – | – | – | – | –"),
    };
    format!(
        "| {} MiB | {} | {} | {raw_node} | {raw_parts} | {raw_ms} | {raw_bytes} | {mig} | {} | {} |",
        r.size,
        r.mode.name(),
        r.round + 1,
        r.agents.rss_cell(),
        r.agents.cgroup_cell()
    )
}

/// The medians of the rounds of `size` and `mode` where both sides succeeded.
fn median_line(rows: &[Row], size: u32, mode: Mode) -> String {
    let ok: Vec<(&Raw, &Mig)> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .filter_map(|r| Some((r.raw.as_ref().ok()?, r.mig.as_ref().ok()?)))
        .collect();
    let f = |v: Option<f64>, p: usize| v.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "–".into());
    // Over every round of the PodMigration, whether or not raw CRIU succeeded.
    let agents: Vec<&AgentPeaks> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .map(|r| &r.agents)
        .collect();
    let max = |pick: fn(&AgentPeaks) -> &[Reading; 2]| {
        let side = |i: usize| {
            let max = agents.iter().filter_map(|a| pick(a)[i].as_ref().ok()).max();
            max.map_or_else(|| "n/a".into(), |b| mib(*b))
        };
        format!("{} / {}", side(0), side(1))
    };
    let of_mig = |pick: fn(&Mig) -> f64| f(median(ok.iter().map(|(_, m)| pick(m)).collect()), 0);
    format!(
        "| {size} MiB | {} | {} | {} | {} | {} / {} | {} | {} | {} | {} |",
        mode.name(),
        ok.len(),
        f(median(ok.iter().map(|(r, _)| r.downtime_ms()).collect()), 0),
        of_mig(|m| m.downtime_ms as f64),
        of_mig(|m| m.warm.count as f64),
        of_mig(|m| m.warm.sum_ms as f64),
        of_mig(|m| m.total_frozen_ms as f64),
        f(
            median(
                ok.iter()
                    .map(|(r, m)| m.downtime_ms as f64 / r.downtime_ms())
                    .collect()
            ),
            2
        ),
        max(|a| &a.rss),
        max(|a| &a.cgroup),
    )
}

/// `mode` ÷ Cold of the same round, for `size`: of the downtimes, and of every
/// freeze (the warm rounds' stalls counted).
fn over_cold_line(rows: &[Row], size: u32, mode: Mode) -> String {
    let pairs: Vec<(&Mig, &Mig)> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .filter_map(|p| {
            let c = rows
                .iter()
                .find(|c| c.size == size && c.mode == Mode::Cold && c.round == p.round)?;
            Some((p.mig.as_ref().ok()?, c.mig.as_ref().ok()?))
        })
        .collect();
    let ratio = |of: fn(&Mig) -> i64| {
        median(
            pairs
                .iter()
                .map(|(p, c)| of(p) as f64 / of(c) as f64)
                .collect(),
        )
        .map(|v| format!("{v:.2}"))
        .unwrap_or_else(|| "–".into())
    };
    format!(
        "| {size} MiB | {} ÷ Cold (PodMotion, same round) | {} | | {} | | {} | | | |",
        mode.name(),
        pairs.len(),
        ratio(|m| m.downtime_ms),
        ratio(|m| m.total_frozen_ms),
    )
}
