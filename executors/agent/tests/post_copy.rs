//! PostCopy through the agents, on this machine's kernel, as root (the testbed of
//! `tests/migration.rs`: two agents, their brokers, a workload in its own PID and
//! network namespaces, the target pod's holder). The final dump leaves the memory with
//! the frozen source; the target restores at once and fetches the pages over
//! `LazyPages`. `PODMOTION_ROOT_TESTS=0` skips them; otherwise a missing CRIU fails them.

use podmotion_agent::testbed::{Testbed, ask};
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());
const UID: &str = "7a2c4e1b-3b7e-4d0e-9a3c-0d1f2e3a4b5c";

fn testbed(name: &str) -> Option<Testbed> {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return None;
    }
    podmotion_agent::testbed::ensure_lazy_pipe_room();
    let mut tb = Testbed::new(
        name,
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    Some(tb)
}

fn post_copy(tb: &Testbed, node: usize, pid: i32) -> PrepareRequest {
    let mut r = tb.prepare_request(
        UID,
        node,
        &tb.container(["src", "tgt"][node], pid),
        TcpPreservation::None,
    );
    r.post_copy = true;
    r
}

/// Status of `node` until `done` says so (30 s at most).
fn until(
    tb: &Testbed,
    node: usize,
    what: &str,
    done: fn(&MigrationStatus) -> bool,
) -> MigrationStatus {
    for _ in 0..300 {
        let st =
            tb.operator(move |tls| async move { tls.agent(node).await.status(UID).await.unwrap() });
        if done(&st) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{what} never came on node {node}\n{}", tb.agent_log(node));
}

/// A PostCopy up to the target's restore, its pages paced to `bandwidth` bytes per
/// second (the lazy phase then lasts); the target gets its own address. The restore's
/// answer.
fn restore_paced(
    tb: &Testbed,
    p_src: PrepareRequest,
    p_tgt: PrepareRequest,
    bandwidth: u64,
) -> MigrationStatus {
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(p_src).await.unwrap();
        b.prepare(p_tgt).await.unwrap();
        a.dump(UID).await.unwrap();
        let req = a.request(SendRequest {
            migration_uid: UID.into(),
            target_endpoint: Testbed::endpoint(1),
            target_server_name: "agent-b".into(),
            bandwidth_limit: bandwidth,
        });
        a.raw().send(req).await.unwrap();
        a.fence(UID).await.unwrap();
    });
    tb.give_target_its_own_address();
    tb.operator(|tls| async move { tls.agent(1).await.restore(UID).await.unwrap() })
}

/// What the source's checkpoint directory holds (each file and its size) and CRIU's
/// dump log lines about pages and laziness: printed when a lazy dump wrote the pages
/// it should have left with the source (seen twice in full CI runs, never alone).
fn explain_dump(tb: &Testbed) -> String {
    let mut out = String::new();
    for f in tb.checkpoint_files(0) {
        let len = std::fs::metadata(&f).map(|m| m.len()).unwrap_or(0);
        out.push_str(&format!("\n  {} ({len} bytes)", f.display()));
        if f.file_name().is_some_and(|n| n == "dump.log") {
            let log = std::fs::read_to_string(&f).unwrap_or_default();
            for l in log
                .lines()
                .filter(|l| {
                    let l = l.to_lowercase();
                    l.contains("lazy")
                        || l.contains("uffd")
                        || l.contains("error")
                        || l.contains("warn")
                        || l.contains("pages")
                })
                .take(60)
            {
                out.push_str(&format!("\n    {l}"));
            }
        }
    }
    out
}

/// `pid` is gone (or a zombie: dead, its parent not yet told), waiting up to 5 s.
fn gone(pid: i32) -> bool {
    for _ in 0..100 {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.trim().chars().next())
            });
        if matches!(state, None | Some('Z')) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

#[test]
fn post_copy_resumes_the_target_first_and_brings_every_page_after() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("pcm") else { return };
    let src = tb.start_workload(64, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let digest = ask(&mut conn, "digest").unwrap();
    let before: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    drop(conn);

    let (p_src, p_tgt) = (post_copy(&tb, 0, src.pid), post_copy(&tb, 1, holder.pid));
    let (dumped, sent) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        assert!(a.prepare(p_src).await.unwrap().post_copy);
        b.prepare(p_tgt).await.unwrap();
        let e = a.pre_dump(UID).await.unwrap_err();
        assert!(e.to_string().contains("no pre-copy rounds"), "{e}");
        let d = a.dump(UID).await.unwrap();
        let s = a.send(UID, &Testbed::endpoint(1), "agent-b").await.unwrap();
        a.fence(UID).await.unwrap();
        (d, s)
    });
    assert_eq!(dumped.phase(), Phase::Dumped);
    assert!(
        dumped.final_dump_bytes < 16 << 20,
        "the ballast stays with the frozen source: {} bytes dumped{}",
        dumped.final_dump_bytes,
        explain_dump(&tb)
    );
    assert_eq!(sent.phase(), Phase::Sent);
    assert!(!sent.lazy_done, "nothing was asked for yet");

    tb.give_target_its_own_address();
    let restored = tb.operator(|tls| async move { tls.agent(1).await.restore(UID).await.unwrap() });
    assert_eq!(restored.phase(), Phase::Restored);
    let rpid = restored.restored_pid;
    assert_eq!(
        procfs::netns_inode(rpid).unwrap(),
        procfs::netns_inode(holder.pid).unwrap()
    );
    // The copy answers with the source's state and memory, fetched as it touches it.
    let mut conn = tb
        .connect_to(podmotion_agent::testbed::TARGET_OWN_IP)
        .unwrap();
    let after: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(after >= before, "counter {after} < {before}");
    assert_eq!(
        ask(&mut conn, "digest").unwrap(),
        digest,
        "every page came across whole"
    );

    // Measured, never asserted: the freeze.
    let downtime_ms = restored
        .timings()
        .resumed_us
        .saturating_sub(dumped.timings().freeze_started_us)
        / 1000;
    eprintln!(
        "PostCopy 64 MiB: dump {} ms, images {} bytes, restore {} ms, downtime {downtime_ms} ms",
        dumped.timings().dump_us / 1000,
        sent.bytes_sent,
        restored.timings().restore_us / 1000
    );
    let t = until(&tb, 1, "lazy_done", |s| {
        s.lazy_done || !s.lazy_error.is_empty()
    });
    assert!(t.lazy_error.is_empty(), "{}", t.lazy_error);
    assert!(t.lazy_bytes >= 64 << 20, "pages received: {}", t.lazy_bytes);
    let s = until(&tb, 0, "lazy_done", |s| {
        s.lazy_done || !s.lazy_error.is_empty()
    });
    assert!(s.lazy_error.is_empty(), "{}", s.lazy_error);
    assert!(
        procfs::check_live(src).is_ok(),
        "served, the source waits stopped for the commit"
    );

    let committed = tb.operator(|tls| async move {
        let mut a = tls.agent(0).await;
        let c = a.commit(UID).await.unwrap();
        a.cleanup(UID).await.unwrap();
        tls.agent(1).await.cleanup(UID).await.unwrap();
        c
    });
    assert_eq!(committed.phase(), Phase::Committed);
    assert!(procfs::check_live(src).is_err(), "source killed on commit");
    let later: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(later > after, "the copy runs on");
    assert!(
        tb.checkpoint_files(0).is_empty(),
        "{:?}",
        tb.checkpoint_files(0)
    );
    assert!(
        tb.checkpoint_files(1).is_empty(),
        "{:?}",
        tb.checkpoint_files(1)
    );
}

#[test]
fn a_source_agent_lost_in_the_lazy_phase_ends_in_a_clear_failure_with_no_copy_left() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("pcl") else { return };
    let src = tb.start_workload(256, 0);
    let holder = tb.start_holder();
    let (p_src, p_tgt) = (post_copy(&tb, 0, src.pid), post_copy(&tb, 1, holder.pid));
    // Paced, so that the lazy phase is still on when the source agent dies.
    let restored = restore_paced(&tb, p_src, p_tgt, 16 << 20);
    let rpid = restored.restored_pid;
    assert!(procfs::tree(rpid).contains(&rpid), "the copy runs");
    let mid = tb.operator(|tls| async move { tls.agent(1).await.status(UID).await.unwrap() });
    assert!(
        !mid.lazy_done,
        "paced: the lazy phase is still on{}",
        explain_dump(&tb)
    );

    tb.kill_agent(0);
    let t = until(&tb, 1, "lazy_error", |s| {
        !s.lazy_error.is_empty() || s.lazy_done
    });
    assert!(!t.lazy_done);
    assert!(
        t.lazy_error.contains("the source was lost") && t.lazy_error.contains("the pod is lost"),
        "{}",
        t.lazy_error
    );
    assert!(gone(rpid), "the restored copy, missing pages, was killed");
    // And the fenced source does not run on: its broker kills it when the agent's
    // lease ends.
    for _ in 0..200 {
        if procfs::check_live(src).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        procfs::check_live(src).is_err(),
        "the fenced source was left alive"
    );
}

#[test]
fn a_rollback_in_the_lazy_phase_kills_the_copy_and_resumes_the_source_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed("pcr") else { return };
    let src = tb.start_workload(128, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let digest = ask(&mut conn, "digest").unwrap();
    drop(conn);
    let (p_src, p_tgt) = (post_copy(&tb, 0, src.pid), post_copy(&tb, 1, holder.pid));
    let restored = restore_paced(&tb, p_src, p_tgt, 8 << 20);
    let rpid = restored.restored_pid;
    // The operator rolls back (a probe failed, say): the copy first, then the source.
    let (t, s) = tb.operator(|tls| async move {
        let t = tls.agent(1).await.abort(UID).await.unwrap();
        let mut a = tls.agent(0).await;
        let mut s = a.abort(UID).await;
        for _ in 0..50 {
            if s.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            s = a.abort(UID).await;
        }
        (t, s.unwrap())
    });
    assert_eq!(t.phase(), Phase::Aborted);
    assert!(gone(rpid), "the copy is gone");
    assert_eq!(s.phase(), Phase::Aborted);
    assert!(
        !t.lazy_done,
        "the target never reports a killed copy complete"
    );
    // The source runs on, whole: its pages never left it.
    let mut conn = tb.connect_timeout(Duration::from_secs(5)).unwrap();
    let a: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let b: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    assert!(b > a, "the source counts on");
    assert_eq!(ask(&mut conn, "digest").unwrap(), digest);
}
