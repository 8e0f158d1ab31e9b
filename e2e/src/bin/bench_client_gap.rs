//! Benchmark (not a test): what the clients of a migrated pod see (issue 39, item 4),
//! beside the migration's `status.downtime`, on the real nodes through the chart.
//!
//!     eval "$(hack/cluster.sh env)"       # the cluster with real nodes, images pushed
//!     cargo build -p podmotion-e2e --bin bench_client_gap
//!     PODMOTION_IMAGES_VALUES=… PODMOTION_IMAGES_LIST=… \
//!       target/debug/bench_client_gap [--rounds 10] [--ballast 16] [--configs defaults,handover]
//!
//! For each configuration — `defaults` (the chart's defaults) and `handover` (the
//! chart with `migrationAgent.broker.addressHandover.cidrs={198.18.0.0/16}`, the real
//! nodes' shared L2 segment) — it installs the chart from our images with the
//! real-node tests' fixture ([`World`]: one testload replica, `--ballast` MiB, uid 0,
//! readiness probe, behind a ClusterIP Service), then, each round, moves that pod to
//! the other real node with a Cold and then a PreCopy PodMigration (the pod moves again
//! and again: A → B → A …). Around each migration two clients of the Service run on this
//! machine ([`Clients`]): one opening a fresh connection every 10 ms (3 s connect
//! timeout, 3 s answer timeout), one holding a connection and asking on it every 10 ms
//! (a new connection through the Service when it ends). They start before the
//! PodMigration is created and stop once both answer again after it succeeded; what
//! they see counts from the moment both answer, just before the PodMigration is created
//! ([`Clients::serving`]). Per migration it prints `status.downtimeMillis` and, for
//! each client, the gap (the longest time without an answer in that window),
//! gap − downtime, the failed reads and how held
//! connections ended; then per configuration and mode the medians and the largest
//! gap − downtime.
#![forbid(unsafe_code)]

use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::from_json;
use podmotion_e2e::real::copies::{ClientView, Clients};
use podmotion_e2e::real::testload::{POD_TIMEOUT, World, ended, node_of};
use podmotion_e2e::real::timeline::Timeline;
use podmotion_e2e::wait_list;
use serde_json::json;

const APP: &str = "gapped";

struct Args {
    rounds: usize,
    ballast: u32,
    configs: Vec<String>,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        rounds: 10,
        ballast: 16,
        configs: vec!["defaults".into(), "handover".into()],
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().context("a value after the flag");
        match arg.as_str() {
            "--rounds" => a.rounds = value()?.parse()?,
            "--ballast" => a.ballast = value()?.parse()?,
            "--configs" => a.configs = value()?.split(',').map(str::to_owned).collect(),
            other => bail!(
                "unknown argument {other}; usage: bench_client_gap [--rounds N] [--ballast MiB] [--configs defaults,handover]"
            ),
        }
    }
    Ok(a)
}

/// One migration's figures.
struct Row {
    config: String,
    mode: &'static str,
    round: usize,
    downtime: u64,
    fresh: ClientView,
    held: ClientView,
}

fn over(v: &ClientView, downtime: u64) -> i64 {
    v.gap_ms() as i64 - downtime as i64
}

fn print_row(r: &Row) {
    println!(
        "| {} | {} | {} | {} | {} ({:+}) | {} | {} ({:+}) | {} | {} |",
        r.config,
        r.mode,
        r.round,
        r.downtime,
        r.fresh.gap_ms(),
        over(&r.fresh, r.downtime),
        r.fresh.failures.len(),
        r.held.gap_ms(),
        over(&r.held, r.downtime),
        r.held.failures.len(),
        if r.held.ends.is_empty() {
            "continued".to_string()
        } else {
            r.held
                .ends
                .iter()
                .map(|(_, why)| why.clone())
                .collect::<Vec<_>>()
                .join(", ")
        },
    );
    eprintln!("  fresh: {}", r.fresh.summary());
    eprintln!("  held:  {}", r.held.summary());
}

fn median(mut v: Vec<i64>) -> i64 {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let mut rows: Vec<Row> = vec![];
    println!(
        "| config | mode | round | downtime ms | fresh gap ms (− downtime) | fresh failed | held gap ms (− downtime) | held failed | held connection |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---|");
    for config in &args.configs {
        bench_config(&args, config, &mut rows).await?;
    }
    print_medians(&args, &rows);
    Ok(())
}

/// The chart's extra arguments for a configuration.
fn chart_args(config: &str) -> anyhow::Result<&'static [&'static str]> {
    Ok(match config {
        "defaults" => &[],
        "handover" => &[
            "--set",
            "migrationAgent.broker.addressHandover.cidrs={198.18.0.0/16}",
        ],
        other => bail!("unknown configuration {other}: defaults or handover"),
    })
}

/// Which migration of the run: its configuration, mode and round.
#[derive(Clone, Copy)]
struct Round<'a> {
    config: &'a str,
    mode: &'static str,
    round: usize,
}

/// One configuration: the chart installed with it, then each round a Cold and a
/// PreCopy migration of the pod to the other real node (the pod moves again and
/// again), each migration's row printed and kept in `rows`.
async fn bench_config(args: &Args, config: &str, rows: &mut Vec<Row>) -> anyhow::Result<()> {
    let extra = chart_args(config)?;
    let Some(w) = World::new(&format!("gap-{config}"), APP, args.ballast, extra).await else {
        bail!("no real nodes (PODMOTION_REAL_NODES=0?)");
    };
    let svc = w.service(APP).await;
    let pods: Api<Pod> = w.app.api();
    let pms: Api<PodMigration> = w.app.api();
    let mut pod = w.source.clone();
    for round in 1..=args.rounds {
        for mode in ["Cold", "PreCopy"] {
            let at = Round {
                config,
                mode,
                round,
            };
            // `None`: rolled back, and the next one moves the same pod.
            if let Some((row, target)) = migrate(&w, &svc, &pods, &pms, &pod, at).await? {
                rows.push(row);
                pod = pods.get(&target).await?;
            }
        }
    }
    drop(w);
    Ok(())
}

/// The real node `pod` is not on.
fn other_node(w: &World, pod: &Pod) -> anyhow::Result<String> {
    Ok(w.nodes
        .iter()
        .find(|n| **n != node_of(pod))
        .context("a second real node")?
        .clone())
}

/// The PodMigration of `pod` to the node `to`.
fn migration(pod: &Pod, to: &str, name: &str, mode: &str) -> PodMigration {
    let mut spec = json!({"podName": pod.name_any(), "targetNode": to,
        "mode": mode, "freezeBudgetMillis": 20000,
        "probe": {"tcpSocket": {"port": 8080}}});
    if mode == "PreCopy" {
        spec["preCopy"] = json!({"maxRounds": 3});
    }
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": spec
    }))
}

/// One migration of `pod` to the other real node, the two clients running around it.
/// Its row (printed) and the target pod's name; `None` if it rolled back (reported,
/// not counted).
async fn migrate(
    w: &World,
    svc: &str,
    pods: &Api<Pod>,
    pms: &Api<PodMigration>,
    pod: &Pod,
    at: Round<'_>,
) -> anyhow::Result<Option<(Row, String)>> {
    let Round {
        config,
        mode,
        round,
    } = at;
    let to = other_node(w, pod)?;
    let name = format!("gap-{round}-{}", mode.to_lowercase());
    let pm = migration(pod, &to, &name, mode);
    let mut clients = Clients::start(svc)
        .watching(w.app.client.clone(), &w.app.name, APP, &name)
        .serving()
        .await;
    let timeline = clients.timeline.take().context("the timeline")?;
    let created = clients.t0.elapsed().as_millis();
    pms.create(&PostParams::default(), &pm).await?;
    let st = ended(pms, &name).await;
    if st.phase != MigrationPhase::Succeeded {
        // Rolled back: the source serves on; the round is reported, not
        // counted, and the next one moves the same pod.
        drop(timeline);
        clients.fresh.finish();
        clients.held.finish();
        print_rollback(at, &name, &st);
        return Ok(None);
    }
    let target = st.target_pod.clone().context("status.targetPod")?;
    wait_list(
        pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "only the target pod left",
        |ps| ps.len() == 1 && ps[0].name_any() == target,
    )
    .await?;
    let (fresh, held) =
        tokio::task::spawn_blocking(move || clients.finish_after(Duration::from_millis(500)))
            .await?;
    let row = Row {
        config: config.to_string(),
        mode,
        round,
        downtime: st.downtime_millis.unwrap_or(0).max(0) as u64,
        fresh,
        held,
    };
    print_row(&row);
    print_timeline(&row, created, &timeline);
    Ok(Some((row, target)))
}

/// The row of a migration that rolled back, and why.
fn print_rollback(at: Round<'_>, name: &str, st: &PodMigrationStatus) {
    let Round {
        config,
        mode,
        round,
    } = at;
    println!(
        "| {config} | {mode} | {round} | {:?}: {} | | | | | |",
        st.phase,
        st.failure_reason.clone().unwrap_or_default()
    );
    eprintln!("  {name}: {:?}", st.failure_message);
}

/// When the migration was created and the clients' gaps were, and its timeline.
fn print_timeline(row: &Row, created: u128, timeline: &Timeline) {
    eprintln!(
        "  timeline (ms on the clients' clock): created {created}; fresh gap {}..{}; held gap {}..{}",
        row.fresh.gap_from.as_millis(),
        (row.fresh.gap_from + row.fresh.gap).as_millis(),
        row.held.gap_from.as_millis(),
        (row.held.gap_from + row.held.gap).as_millis(),
    );
    eprint!("{}", timeline.render());
}

/// Per configuration and mode: the medians and the largest gap − downtime.
fn print_medians(args: &Args, rows: &[Row]) {
    println!();
    println!(
        "| config | mode | n | downtime ms p50 | fresh gap − downtime p50 / max | fresh failed (sum) | held gap − downtime p50 / max | held failed (sum) | held continued |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for config in &args.configs {
        for mode in ["Cold", "PreCopy"] {
            let rs: Vec<&Row> = rows
                .iter()
                .filter(|r| &r.config == config && r.mode == mode)
                .collect();
            if rs.is_empty() {
                continue;
            }
            let f: Vec<i64> = rs.iter().map(|r| over(&r.fresh, r.downtime)).collect();
            let h: Vec<i64> = rs.iter().map(|r| over(&r.held, r.downtime)).collect();
            println!(
                "| {config} | {mode} | {} | {} | {} / {} | {} | {} / {} | {} | {} |",
                rs.len(),
                median(rs.iter().map(|r| r.downtime as i64).collect()),
                median(f.clone()),
                f.iter().max().unwrap(),
                rs.iter().map(|r| r.fresh.failures.len()).sum::<usize>(),
                median(h.clone()),
                h.iter().max().unwrap(),
                rs.iter().map(|r| r.held.failures.len()).sum::<usize>(),
                rs.iter().filter(|r| r.held.ends.is_empty()).count(),
            );
        }
    }
}
