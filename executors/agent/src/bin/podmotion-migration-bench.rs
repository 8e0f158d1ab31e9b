//! Migration benchmark (not a timed test): for each workload size, one raw CRIU
//! checkpoint/restore and one migration through the agents in Cold and PreCopy mode,
//! all in the same run on the same testbed layout, printed side by side.
//!
//! `cargo build -p podmotion-agent --features testbed --bins &&
//! target/debug/podmotion-migration-bench [MiB…]` (root; CRIU from
//! hack/install-criu.sh). Default sizes: 64 512. Needs the `testbed` feature.
#![forbid(unsafe_code)]

use podmotion_agent::testbed::{Testbed, ask, criu_path};
use podmotion_wire::agent::*;
use podmotion_wire::ids::ProcRef;
use std::path::Path;
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

#[derive(Default, Clone, Copy)]
struct Row {
    dump_ms: f64,
    transfer_ms: f64,
    restore_ms: f64,
    downtime_ms: f64,
    freeze_bytes: u64,
    /// The larger agent's peak RSS (VmHWM) over the whole migration, KiB.
    agent_rss_kib: Option<u64>,
    /// CPU time of both agents' own threads over the migration, ms.
    agent_cpu_ms: Option<u64>,
    ok: bool,
}

fn bins() -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::current_exe()
        .expect("exe")
        .parent()
        .expect("dir")
        .to_path_buf();
    (dir.join("podmotion-agent"), dir.join("podmotion-testload"))
}

const DIRTY_KIB_S: usize = 1024;

/// One checkpoint/restore with the criu binary alone (no agent): dump on node 0, copy
/// the images to node 1's tmpfs, restore there into the target's network namespace.
fn raw(mib: usize) -> Row {
    let (agent, load) = bins();
    let mut tb = Testbed::new("bR", &agent, &load);
    let src = tb.start_workload(mib, DIRTY_KIB_S);
    tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(5)).expect("connect");
    let before: u64 = ask(&mut conn, "get").expect("get").parse().expect("n");
    let img = tb.checkpoints(0).join("raw");
    std::fs::create_dir_all(&img).expect("dir");
    let criu = criu_path();
    let t0 = Instant::now();
    let st = criu_dump(&criu, src, &img);
    let dump = t0.elapsed();
    assert!(st.success(), "raw criu dump failed");
    // The same-host lower bound of a transfer: copy the images to the other node's tmpfs.
    let t1 = Instant::now();
    let dst = tb.checkpoints(1).join("raw");
    copy_images(&img, &dst);
    let copy = t1.elapsed();
    wait_reaped(src);
    tb.add_address_to_target();
    let t2 = Instant::now();
    let st = criu_restore(&criu, &dst, &tb.ns("tgt"));
    let restore = t2.elapsed();
    tb.route_to_target();
    let answer = ask(&mut conn, "get");
    let ok = st.success()
        && answer
            .as_ref()
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v > before);
    if !ok {
        eprintln!(
            "raw {mib} MiB: restore {st}, connection: {answer:?}; {}",
            podmotion_agent::criu::log_tail(&dst.join("restore.log"))
        );
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Row {
        dump_ms: ms(dump),
        transfer_ms: ms(copy),
        restore_ms: ms(restore),
        downtime_ms: ms(dump + copy + restore),
        freeze_bytes: podmotion_agent::images::size(&dst),
        agent_rss_kib: None,
        agent_cpu_ms: None,
        ok,
    }
}

/// `criu dump` of the workload's tree into `img`, its network namespace external (as
/// the agent dumps it).
fn criu_dump(criu: &Path, src: ProcRef, img: &Path) -> ExitStatus {
    let ino: String = std::fs::read_link(format!("/proc/{}/ns/net", src.pid))
        .expect("ns")
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect();
    Command::new(criu)
        .args(["dump", "-t", &src.pid.to_string(), "-D"])
        .arg(img)
        .args([
            "--tcp-established",
            "--skip-in-flight",
            "--network-lock",
            "skip",
            "--manage-cgroups=ignore",
            "-o",
            "dump.log",
        ])
        .arg(format!("--external=net[{ino}]:podnet"))
        .status()
        .expect("criu")
}

fn copy_images(img: &Path, dst: &Path) {
    assert!(
        Command::new("cp")
            .arg("-r")
            .arg(img)
            .arg(dst)
            .status()
            .expect("cp")
            .success()
    );
}

/// Waits (up to ~1 s) for the dumped tree to be reaped before its pids come back.
fn wait_reaped(src: ProcRef) {
    for _ in 0..200 {
        if podmotion_broker::procfs::check_live(src).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `criu restore` of `dst`, detached, into the network namespace `netns`.
fn criu_restore(criu: &Path, dst: &Path, netns: &str) -> ExitStatus {
    let script = format!(
        "exec {} restore -D {} -d --tcp-established --manage-cgroups=ignore -o restore.log --inherit-fd fd[5]:podnet 5</run/netns/{}",
        criu.display(),
        dst.display(),
        netns
    );
    Command::new("sh")
        .args(["-c", &script])
        .status()
        .expect("criu")
}

/// The migration id the bench's migrations use.
const UID: &str = "bench";

fn agents(mib: usize, precopy: bool) -> Row {
    let (agent, load) = bins();
    let mut tb = Testbed::new(if precopy { "bP" } else { "bC" }, &agent, &load);
    let (src, holder) = start_pods_and_agents(&mut tb, mib);
    let mut conn = tb.connect_timeout(Duration::from_secs(5)).expect("connect");
    let before: u64 = ask(&mut conn, "get").expect("get").parse().expect("n");
    tb.add_address_to_target();
    let [prep_src, prep_tgt] = prepare_requests(&tb, src, holder);
    let cpu = |tb: &Testbed| Some(tb.agent_cpu_ms(0)? + tb.agent_cpu_ms(1)?);
    let cpu_before = cpu(&tb);
    let (s, sent_in_freeze, r) = migrate(&tb, precopy, prep_src, prep_tgt);
    tb.route_to_target();
    let ok = ask(&mut conn, "get")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|v| v > before);
    commit_and_clean_up(&tb);
    let agent_cpu_ms = cpu(&tb).zip(cpu_before).map(|(a, b)| a - b);
    let agent_rss_kib = tb.agent_peak_rss_kib(0).max(tb.agent_peak_rss_kib(1));
    Row {
        agent_rss_kib,
        agent_cpu_ms,
        ok,
        ..timings_row(&s, &r, sent_in_freeze)
    }
}

/// Starts the workload (`mib` of ballast) and the target's holder pod, then both
/// agents: the workload's process and the holder's.
fn start_pods_and_agents(tb: &mut Testbed, mib: usize) -> (ProcRef, ProcRef) {
    let src = tb.start_workload(mib, DIRTY_KIB_S);
    let holder = tb.start_holder();
    tb.start_agent(0);
    tb.start_agent(1);
    (src, holder)
}

/// The `Prepare` of the source's agent (for the workload's container) and of the
/// target's (for the holder's).
fn prepare_requests(tb: &Testbed, src: ProcRef, holder: ProcRef) -> [PrepareRequest; 2] {
    [("workload", src, 0), ("holder", holder, 1)].map(|(name, pod, node)| {
        tb.prepare_request(
            UID,
            node,
            &tb.container(name, pod.pid),
            TcpPreservation::Strict,
        )
    })
}

/// The operator's side of the migration up to the restore (a warm pre-dump and send
/// first with `precopy`): the final send's status, the bytes it sent while frozen, and
/// the restore's status.
fn migrate(
    tb: &Testbed,
    precopy: bool,
    prep_src: PrepareRequest,
    prep_tgt: PrepareRequest,
) -> (MigrationStatus, u64, MigrationStatus) {
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src).await.expect("prepare");
        b.prepare(prep_tgt).await.expect("prepare");
        let mut warm = 0;
        if precopy {
            a.pre_dump(UID).await.expect("pre-dump");
            warm = a
                .send(UID, &Testbed::endpoint(1), "agent-b")
                .await
                .expect("warm send")
                .bytes_sent;
        }
        a.dump(UID).await.expect("dump");
        let s = a
            .send(UID, &Testbed::endpoint(1), "agent-b")
            .await
            .expect("send");
        let r = b.restore(UID).await.expect("restore");
        (s.clone(), s.bytes_sent - warm, r)
    })
}

/// Commits the migration on the source and cleans up on both agents.
fn commit_and_clean_up(tb: &Testbed) {
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.commit(UID).await.expect("commit");
        a.cleanup(UID).await.expect("cleanup");
        b.cleanup(UID).await.expect("cleanup");
    });
}

/// The row's timings, from the source's send status `s` and the target's restore
/// status `r`.
fn timings_row(s: &MigrationStatus, r: &MigrationStatus, freeze_bytes: u64) -> Row {
    let (st, rt) = (s.timings(), r.timings());
    Row {
        dump_ms: st.dump_us as f64 / 1000.0,
        transfer_ms: st.send_us as f64 / 1000.0,
        restore_ms: rt.restore_us as f64 / 1000.0,
        downtime_ms: rt.resumed_us.saturating_sub(st.freeze_started_us) as f64 / 1000.0,
        freeze_bytes,
        ..Row::default()
    }
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![64, 512]
    } else {
        sizes
    };
    println!(
        "| workload | method | dump ms | transfer ms | restore ms | downtime ms | ÷ raw | bytes moved in freeze | agent peak RSS | agents' CPU ms | state kept |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for mib in sizes {
        let raw_row = raw(mib);
        let rows = [
            ("raw criu dump/cp/restore", raw_row),
            ("agents Cold", agents(mib, false)),
            ("agents PreCopy", agents(mib, true)),
        ];
        for (name, r) in rows {
            println!(
                "| {mib} MiB | {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} | {:.1} MiB | {} | {} | {} |",
                r.dump_ms,
                r.transfer_ms,
                r.restore_ms,
                r.downtime_ms,
                r.downtime_ms / raw_row.downtime_ms,
                r.freeze_bytes as f64 / (1 << 20) as f64,
                r.agent_rss_kib.map_or("–".to_string(), |k| format!(
                    "{:.0} MiB",
                    k as f64 / 1024.0
                )),
                r.agent_cpu_ms.map_or("–".to_string(), |c| c.to_string()),
                if r.ok { "yes" } else { "NO" }
            );
        }
    }
}
