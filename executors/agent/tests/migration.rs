//! Real migrations on this machine's kernel, as root: two agents for two "nodes", each
//! in its own network namespace, CRIU through its RPC, the netns broker, cgroup v2.
//! Run with `cargo test -p podmotion-agent --test migration -- --test-threads=1`
//! (they serialize themselves anyway). `PODMOTION_ROOT_TESTS=0` skips them; otherwise
//! a missing CRIU fails them.

use podmotion_agent::testbed::{POD_IP, Testbed, ask};
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::client::AgentClient;
use podmotion_wire::ids::ProcRef;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

fn testbed(name: &str) -> Testbed {
    let mut tb = Testbed::new(
        name,
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    tb
}

fn counter(s: &mut std::net::TcpStream) -> u64 {
    ask(s, "get").expect("get").parse().expect("number")
}

/// The operator's `Prepare` for the agent of `node` (0: source, 1: target): the
/// process `pid` stands for a container the runtime (the testbed's container table)
/// knows; only its container ID crosses the wire.
fn prepare(tb: &Testbed, uid: &str, node: usize, pid: i32, tcp: TcpPreservation) -> PrepareRequest {
    let id = tb.container(&format!("{uid}-{node}"), pid);
    tb.prepare_request(uid, node, &id, tcp)
}

fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && (l.contains("S (") || l.contains("R (")))
        })
        .unwrap_or(false)
}

#[test]
fn migration_moves_state_listener_and_established_connection() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("mig");
    let src = tb.start_workload(16, 64);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    assert_eq!(ask(&mut conn, "total").unwrap(), "2");

    let uid = "6f1c1e1a-3b7e-4d0e-9a3c-0d1f2e3a4b5c";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::Strict);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::Strict);
    let s_st = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        // Idempotent: a second Prepare answers with the same migration.
        assert_eq!(a.prepare(prep_src.clone()).await.unwrap().phase(), Phase::Prepared);
        b.prepare(prep_tgt.clone()).await.unwrap();
        // Pre-copy: a round while the workload runs, streamed to the target ahead of
        // the freeze.
        let p1 = a.pre_dump(uid).await.unwrap();
        assert_eq!(p1.iteration, 1);
        assert!(p1.last_round_bytes > 16 << 20, "the warm copy holds the ballast");
        let warm = a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        assert_eq!(warm.phase(), Phase::PreDumping);
        assert!(warm.bytes_sent >= p1.last_round_bytes / 2);
        let d = a.dump(uid).await.unwrap();
        assert_eq!(d.phase(), Phase::Dumped);
        assert_eq!(a.dump(uid).await.unwrap().phase(), Phase::Dumped, "dump is idempotent");
        let s = a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        let during_freeze = s.bytes_sent - warm.bytes_sent;
        assert!(
            during_freeze < d.final_dump_bytes / 4,
            "only what changed since the warm copy crosses the wire in the freeze: {during_freeze} of {}",
            d.final_dump_bytes
        );
        s
    });
    assert!(
        !running(src.pid),
        "source must stay frozen between dump and commit"
    );
    let listeners = s_st.sockets.iter().filter(|s| s.listening).count();
    let established: Vec<_> = s_st.sockets.iter().filter(|s| !s.listening).collect();
    assert_eq!(listeners, 1, "{:?}", s_st.sockets);
    assert_eq!(established.len(), 1, "{:?}", s_st.sockets);
    assert!(established[0].local.starts_with(POD_IP));

    // A client connecting during the freeze must wait, not be reset.
    let tbp = tb.ns("cli");
    let during = std::thread::spawn(move || {
        let file = std::fs::File::open(format!("/run/netns/{tbp}")).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut s = std::net::TcpStream::connect_timeout(
            &format!("{POD_IP}:8080").parse().unwrap(),
            Duration::from_secs(15),
        )?;
        s.set_read_timeout(Some(Duration::from_secs(15)))?;
        ask(&mut s, "echo during-freeze")
    });
    std::thread::sleep(Duration::from_millis(200));

    tb.add_address_to_target();
    let restored =
        tb.operator(move |tls| async move { tls.agent(1).await.restore(uid).await.unwrap() });
    tb.route_to_target();
    assert_eq!(restored.phase(), Phase::Restored);
    assert_eq!(
        restored.count(SocketOutcome::Preserved),
        1,
        "{:?}",
        restored.sockets
    );
    assert_eq!(restored.count(SocketOutcome::ListenerRestored), 1);
    let rpid = restored.restored_pid;
    assert!(running(rpid));
    assert_eq!(
        procfs::netns_inode(rpid).unwrap(),
        procfs::netns_inode(holder.pid).unwrap(),
        "restored into the target netns"
    );
    assert_eq!(
        procfs::cgroup_of(rpid).unwrap(),
        format!("/{}/tgt", tb.p),
        "restored into the target cgroup"
    );

    // The established connection survived, with its per-connection state, and the
    // counter kept counting (in-memory state carried over).
    let after = counter(&mut conn);
    assert!(after > before, "counter went from {before} to {after}");
    assert_eq!(ask(&mut conn, "total").unwrap(), "4");
    // The listener answers on the target, and the client from the freeze got through.
    let mut fresh = tb.connect_timeout(Duration::from_secs(5)).unwrap();
    assert!(counter(&mut fresh) >= after);
    assert_eq!(during.join().unwrap().unwrap(), "during-freeze");

    let (commit, t_status) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        let c = a.commit(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        let t = b.cleanup(uid).await.unwrap();
        (c, t)
    });
    assert_eq!(commit.phase(), Phase::Committed);
    assert_eq!(t_status.phase(), Phase::CleanedUp);
    assert!(procfs::check_live(src).is_err(), "source killed on commit");
    let t = s_st.timings();
    let downtime_ms = (restored
        .timings()
        .resumed_us
        .saturating_sub(t.freeze_started_us))
        / 1000;
    eprintln!(
        "dump {} ms, send {} ms, restore {} ms, downtime {downtime_ms} ms",
        t.dump_us / 1000,
        t.send_us / 1000,
        restored.timings().restore_us / 1000
    );
    assert!(counter(&mut conn) > after, "still counting after commit");
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
fn abort_after_dump_resumes_the_source_with_its_connections() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("abt");
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "abort-after-dump";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        // Cleanup refuses while the source is frozen: it must be committed or aborted.
        assert!(a.cleanup(uid).await.is_err());
        assert_eq!(a.abort(uid).await.unwrap().phase(), Phase::Aborted);
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
    assert!(running(src.pid), "source resumed");
    let after = counter(&mut conn);
    assert!(after > before, "{before} → {after}");
    assert!(
        tb.connect_timeout(Duration::from_secs(3)).is_ok(),
        "listener back on the source"
    );
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

#[test]
fn failed_restore_resumes_the_source() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("rsf");
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    // Something already listens on the workload's port in the target pod: the restore
    // cannot bind its listener and must fail.
    let squatter = tb.in_netns("tgt", || {
        std::net::TcpListener::bind(("0.0.0.0", 8080)).unwrap()
    });
    tb.add_address_to_target();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "restore-fails";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let err = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        let err = b.restore(uid).await.unwrap_err();
        a.abort(uid).await.unwrap();
        b.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
        err.to_string()
    });
    drop(squatter);
    assert!(err.contains("restore"), "{err}");
    assert!(running(src.pid));
    assert!(counter(&mut conn) > before);
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

#[test]
fn killed_source_agent_mid_dump_leaves_the_workload_running() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("kil");
    // Big enough that the dump is still writing pages when the agent dies.
    let src = tb.start_workload(384, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "agent-killed";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.prepare(prep_src.clone()).await.unwrap();
        // Fire the dump and do not wait for it.
        let mut a2 = a.clone();
        tokio::spawn(async move {
            let _ = a2.dump(uid).await;
        });
        tokio::time::sleep(Duration::from_millis(150)).await;
    });
    let frozen_seen = std::fs::read_dir(tb.checkpoints(0).join(uid).join("final"))
        .map(|d| d.count())
        .unwrap_or(0);
    tb.kill_agent(0);
    eprintln!("agent killed with {frozen_seen} image files written");
    // The broker notices the lease is gone, waits for CRIU to detach, rolls back.
    // The workload must run on with its state (its counter past `before`). Its
    // connection is kept in most runs; in about one run of four on a fresh machine
    // (2026-12-07), with the agent killed 150 ms into the dump and one image file
    // written, the workload had closed it (running, links up, only its listener
    // left): not yet explained, so the test then asks on a new connection and says so
    // (docs/reliability.md, "Known limits").
    let mut ok = false;
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut reconnected = false;
    for _ in 0..100 {
        let answer = ask(&mut conn, "get");
        if let Err(e) = &answer
            && matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
            )
            && let Ok(c) = tb.connect_timeout(Duration::from_secs(2))
        {
            eprintln!("the workload's connection ended ({e}); asking on a new one");
            let _ = c.set_read_timeout(Some(Duration::from_millis(500)));
            conn = c;
            reconnected = true;
            continue;
        }
        if running(src.pid)
            && answer
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v > before)
        {
            ok = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("workload answered: {ok}; on a new connection: {reconnected}");
    assert!(
        ok,
        "workload did not keep running after its agent died mid-dump: {:?}",
        std::fs::read_to_string(format!("/proc/{}/status", src.pid)).map(|s| s
            .lines()
            .filter(|l| l.starts_with("State") || l.starts_with("TracerPid"))
            .collect::<Vec<_>>()
            .join(" "))
    );
    assert!(tb.connect_timeout(Duration::from_secs(3)).is_ok());
    // A restarted agent sweeps what the dead one left on tmpfs.
    tb.start_agent(0);
    tb.operator(|tls| async move {
        let mut a = tls.agent(0).await;
        assert_eq!(
            a.status("agent-killed").await.unwrap_err().category(),
            "MigrationUnknown"
        );
        // The new agent cannot know what became of the source: its Abort answers
        // "unknown", never "aborted" (which the operator would report as resumed).
        assert_eq!(
            a.abort("agent-killed").await.unwrap_err().category(),
            "MigrationUnknown"
        );
    });
    assert!(
        tb.checkpoint_files(0).is_empty(),
        "{:?}",
        tb.checkpoint_files(0)
    );
}

#[test]
fn connections_close_cleanly_when_the_address_does_not_move() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("cls");
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    tb.give_target_its_own_address();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "no-address-move";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let restored = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        // Strict refuses: the pod address is not in the target.
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        let r = b.restore(uid).await.unwrap();
        let closing = r.count(SocketOutcome::ClosedCleanly) > 0;
        a.commit_closing(uid, closing).await.unwrap();
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
        r
    });
    assert_eq!(
        restored.count(SocketOutcome::ClosedCleanly),
        1,
        "{:?}",
        restored.sockets
    );
    assert_eq!(restored.count(SocketOutcome::ListenerRestored), 1);
    // The peer sees an orderly close (FIN: a read returns EOF), not a reset, not a hang.
    use std::io::Read;
    let mut buf = [0u8; 16];
    assert_eq!(conn.read(&mut buf).expect("orderly close, not a reset"), 0);
    // The state moved: the listener answers on the target's own address.
    let mut fresh = tb
        .connect_to(podmotion_agent::testbed::TARGET_OWN_IP)
        .unwrap();
    assert!(counter(&mut fresh) > before);
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

/// Waits (bounded) until the workload runs and counts again.
fn resumes(src: i32, conn: &mut std::net::TcpStream, before: u64, tries: u32) -> bool {
    conn.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    for _ in 0..tries {
        if running(src)
            && ask(conn, "get")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .is_some_and(|v| v > before)
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

#[test]
fn a_source_frozen_past_its_budget_is_resumed_by_the_agent_watchdog() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "wdg",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.agent_args = vec!["--freeze-watchdog-margin-ms".into(), "500".into()];
    tb.start_agent(0);
    let src = tb.start_workload(4, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "freeze-watchdog";
    let mut prep = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    // Long enough that a dump slowed by a loaded machine still returns before the
    // watchdog resumes the source (1 s + 500 ms failed once under a parallel build).
    prep.freeze_budget_ms = 3000;
    let dumped = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.prepare(prep).await.unwrap();
        a.dump(uid).await.unwrap()
    });
    assert_eq!(dumped.phase(), Phase::Dumped);
    assert!(
        !running(src.pid),
        "the final dump leaves the source stopped"
    );
    // Nobody commits or aborts (operator gone, API server gone): the agent itself
    // resumes the source after budget + margin.
    assert!(
        resumes(src.pid, &mut conn, before, 150),
        "the source stayed frozen past its budget and margin\n{}",
        tb.agent_log(0)
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        assert_eq!(
            recorded(&mut a, uid, Phase::Aborted).await.phase(),
            Phase::Aborted
        );
        let c = a.commit(uid).await.unwrap_err();
        assert_eq!(c.category(), "WrongPhase", "{c}");
        // Abort after the watchdog: aborted, the source still runs.
        assert_eq!(a.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.cleanup(uid).await.unwrap();
    });
    assert!(running(src.pid));
    assert!(tb.connect_timeout(Duration::from_secs(3)).is_ok());
}

#[test]
fn a_terminated_agent_resumes_the_source_it_froze_before_exiting() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "trm",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    let src = tb.start_workload(4, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "agent-terminated";
    let prep = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.prepare(prep).await.unwrap();
        a.dump(uid).await.unwrap();
    });
    assert!(
        !running(src.pid),
        "the final dump leaves the source stopped"
    );
    let st = tb.terminate_agent(0).expect("agent was running");
    let log = tb.agent_log(0);
    assert!(
        st.success(),
        "the agent did not exit cleanly on SIGTERM: {st}\n{log}"
    );
    assert!(
        log.contains("resumed the frozen source before exiting"),
        "the agent did not resume the source itself\n{log}"
    );
    assert!(
        resumes(src.pid, &mut conn, before, 50),
        "the source stayed frozen\n{log}"
    );
}

/// Live (not zombie) processes of the workload's executable in the target pod's
/// network namespace: a restored copy, whatever its cgroup or pid namespace.
fn copies_in_target(tb: &Testbed) -> Vec<i32> {
    use std::os::unix::fs::MetadataExt;
    let ino = |p: &std::path::Path| std::fs::metadata(p).map(|m| m.ino()).ok();
    let tgt = ino(format!("/run/netns/{}", tb.ns("tgt")).as_ref()).expect("target netns");
    let exe = std::fs::canonicalize(&tb.testload_bin).expect("testload");
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let zombie = std::fs::read_to_string(e.path().join("stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('Z')))
            .unwrap_or(true);
        if std::fs::read_link(e.path().join("exe")).ok().as_deref() == Some(exe.as_path())
            && ino(&e.path().join("ns/net")) == Some(tgt)
            && !zombie
        {
            out.push(pid);
        }
    }
    out
}

/// A CRIU that starts a second late (a wrapper around the testbed's), so a call can be
/// abandoned while the checkpoint or restore is certainly under way.
fn slow_criu(tb: &Testbed) -> std::path::PathBuf {
    let slow = tb.dir.join("slow-criu");
    std::fs::write(
        &slow,
        format!("#!/bin/sh\nsleep 1\nexec {} \"$@\"\n", tb.criu.display()),
    )
    .unwrap();
    std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    slow
}

/// The operator's rollback of `uid`: the target's Abort (which must answer Aborted: no
/// restored copy runs), then the source's, then both cleanups.
fn roll_back(tb: &Testbed, uid: &'static str) {
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
}

/// The chaos run's two copies (docs/reliability.md): the operator's `Restore` call
/// went away (its leader was killed) while CRIU restored the tree. The agent dropped
/// the call's work with it and never learned of the copy CRIU had started; a retried
/// `Restore` ran CRIU again, which failed ("Can't connect inet socket back: Cannot
/// assign requested address": the first copy held the connection), `Abort` had
/// nothing to kill and answered `Aborted`, and the source was thawed beside the copy.
#[test]
fn a_restore_whose_caller_went_away_is_finished_and_killed_by_abort() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "rcx",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    // The target's CRIU starts a second late, so the call is abandoned while the
    // restore is certainly under way.
    let slow = slow_criu(&tb);
    tb.start_agent(0);
    tb.criu = slow;
    tb.start_agent(1);
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    tb.add_address_to_target();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "restore-caller-gone";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let abandoned = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        tokio::time::timeout(Duration::from_millis(300), b.restore(uid))
            .await
            .is_err()
    });
    assert!(abandoned, "the first Restore answered within 300 ms");
    // The operator asks again: the answer is the restore that ran, not a second one.
    let second = tb.operator(move |tls| async move {
        let mut b = tls.agent(1).await;
        b.restore(uid).await
    });
    let copies = copies_in_target(&tb);
    let second = second.unwrap_or_else(|e| {
        panic!("the retried Restore failed: {e}; copies in the target: {copies:?}")
    });
    assert_eq!(second.phase(), Phase::Restored);
    assert_eq!(
        copies,
        vec![second.restored_pid],
        "exactly the copy the agent reports runs in the target"
    );
    // The rollback: the target's Abort kills the copy before it answers, then the
    // source is thawed.
    roll_back(&tb, uid);
    assert_eq!(
        copies_in_target(&tb),
        Vec::<i32>::new(),
        "a copy outlived Abort"
    );
    // The copy that ran had the client's connection (its kill reset it): the source
    // answers on a new one.
    drop(conn);
    let mut fresh = tb.connect_timeout(Duration::from_secs(5)).unwrap();
    assert!(
        resumes(src.pid, &mut fresh, before, 50),
        "the source resumed"
    );
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

/// A restore that fails after CRIU forked the tree (the pod address is in the target,
/// the client is not reachable from there: the established connection's repair-mode
/// connect fails with "Network is unreachable", as in the chaos run) leaves no process.
#[test]
fn a_restore_failing_late_leaves_no_restored_process() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("rlt");
    let src = tb.start_workload(8, 0);
    let holder = tb.start_holder();
    tb.add_address_to_target();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let tgt = tb.ns("tgt");
    assert!(
        std::process::Command::new("ip")
            .args(["-n", &tgt, "route", "flush", "table", "main"])
            .status()
            .unwrap()
            .success()
    );
    let uid = "restore-fails-late";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let err = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        b.restore(uid).await.unwrap_err().to_string()
    });
    assert!(err.contains("Can't connect inet socket back"), "{err}");
    assert_eq!(copies_in_target(&tb), Vec::<i32>::new(), "{err}");
    roll_back(&tb, uid);
    assert!(
        resumes(src.pid, &mut conn, before, 50),
        "the source resumed"
    );
    assert_eq!(copies_in_target(&tb), Vec::<i32>::new());
}

/// The final dump's call goes away while CRIU stops the tree (the operator's call
/// deadline, its leader killed): the dump still completes and records its freeze, so
/// the agent's watchdog resumes the source that nobody commits or aborts. (Before, the
/// agent dropped the dump's work with the call: the tree stayed stopped and its
/// network locked with no freeze on record, so nothing on the node resumed it.)
#[test]
fn a_dump_whose_caller_went_away_is_still_resumed_by_the_watchdog() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "dcx",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    let slow = slow_criu(&tb);
    tb.criu = slow;
    tb.agent_args = vec!["--freeze-watchdog-margin-ms".into(), "500".into()];
    tb.start_agent(0);
    let src = tb.start_workload(4, 0);
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "dump-caller-gone";
    let mut prep = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    prep.freeze_budget_ms = 1000;
    let abandoned = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.prepare(prep).await.unwrap();
        tokio::time::timeout(Duration::from_millis(300), a.dump(uid))
            .await
            .is_err()
    });
    assert!(abandoned, "the Dump answered within 300 ms");
    assert!(
        resumes(src.pid, &mut conn, before, 150),
        "the source stayed frozen after an abandoned dump\n{}",
        tb.agent_log(0)
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        assert_eq!(
            recorded(&mut a, uid, Phase::Aborted).await.phase(),
            Phase::Aborted
        );
        assert_eq!(a.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.cleanup(uid).await.unwrap();
    });
    assert!(running(src.pid));
}

/// The chaos run's stuck transfer (issue 21): the operator's leader was killed while
/// the source's `Send` streamed, so the stream to the target was cut and the HTTP/2
/// server dropped the target's receive. The target stayed `Receiving` with half-written
/// files, and the next leader's `Send` (a new stream, every file from offset 0) was
/// refused ("offset 0 but have N"). A new `Send` after an abandoned one must store the
/// whole set, and an abort must leave no image behind.
#[test]
fn a_send_abandoned_mid_stream_is_sent_again_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("scx");
    let src = tb.start_workload(32, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "send-caller-gone";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let (abandoned, phase) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        // 4 MiB/s for an image of over 32 MiB: the stream is cut in its first tenth.
        let slow = SendRequest {
            migration_uid: uid.into(),
            target_endpoint: Testbed::endpoint(1),
            target_server_name: "agent-b".into(),
            bandwidth_limit: 4 << 20,
        };
        let abandoned = tokio::time::timeout(Duration::from_secs(1), a.raw().send(slow))
            .await
            .is_err();
        (abandoned, b.status(uid).await.unwrap().phase())
    });
    assert!(abandoned, "the throttled Send answered within a second");
    assert_ne!(
        phase,
        Phase::Received,
        "the cut stream was taken as complete"
    );
    let (sent, received) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        let sent = a.send(uid, &Testbed::endpoint(1), "agent-b").await;
        (sent, b.status(uid).await.unwrap())
    });
    let sent = sent.unwrap_or_else(|e| {
        panic!(
            "the second Send failed: {e}; target {:?}\n{}",
            received.phase(),
            tb.agent_log(1)
        )
    });
    assert_eq!(sent.phase(), Phase::Sent);
    assert_eq!(received.phase(), Phase::Received);
    assert_eq!(
        received.bytes_received, sent.bytes_sent,
        "the target holds exactly the set the source sent"
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        assert_eq!(a.abort(uid).await.unwrap().phase(), Phase::Aborted);
    });
    assert!(
        tb.checkpoint_files(1).is_empty(),
        "images left on the target after its abort: {:?}",
        tb.checkpoint_files(1)
    );
    assert!(
        resumes(src.pid, &mut conn, before, 50),
        "the source resumed"
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

/// Neither a Status nor an Abort waits for a paced transfer to end: a `Send` and its
/// image stream hold their migration on both agents for their whole length (a minute and a half for
/// 96 MiB at 1 MiB/s: seen on the real nodes, where a `helm uninstall`'s rollback ran
/// out of time behind one and left the source stopped). The target's Abort cuts the
/// stream it receives, the source's the send; the send answers "aborted" instead of
/// completing, the target keeps no image, and the source resumes.
#[test]
fn an_abort_cuts_a_paced_transfer_short_and_resumes_the_source() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("cut");
    let src = tb.start_workload(32, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "abort-cuts-send";
    let prep_src = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let prep_tgt = prepare(&tb, uid, 1, holder.pid, TcpPreservation::BestEffort);
    let (send, target, source) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src.clone()).await.unwrap();
        b.prepare(prep_tgt.clone()).await.unwrap();
        a.dump(uid).await.unwrap();
        // Over 32 MiB at 1 MiB/s: half a minute of stream, unless cut.
        let slow = SendRequest {
            migration_uid: uid.into(),
            target_endpoint: Testbed::endpoint(1),
            target_server_name: "agent-b".into(),
            bandwidth_limit: 1 << 20,
        };
        let mut sender = tls.agent(0).await;
        let send = tokio::spawn(async move {
            sender
                .raw()
                .send(slow)
                .await
                .map(|r| r.into_inner().phase())
        });
        // Let the stream start (the target is then receiving, holding its migration).
        tokio::time::sleep(Duration::from_secs(1)).await;
        // Both agents answer a status while the transfer holds their migrations (the
        // operator's reports, which carried a deletion's rollback, waited for its end).
        let receiving = b.status(uid).await.unwrap().phase();
        let sending = a.status(uid).await.unwrap().phase();
        assert!(
            !send.is_finished(),
            "the statuses were answered only once the send had ended"
        );
        assert_eq!(receiving, Phase::Receiving);
        assert_eq!(sending, Phase::Dumped);
        // The operator's rollback order: the target's kill first, then the source.
        let target = b.abort(uid).await.map(|s| s.phase());
        let source = a.abort(uid).await.map(|s| s.phase());
        (send.await.unwrap(), target, source)
    });
    assert_eq!(target.as_ref().ok(), Some(&Phase::Aborted), "{target:?}");
    assert_eq!(source.as_ref().ok(), Some(&Phase::Aborted), "{source:?}");
    assert!(
        send.is_err(),
        "the paced send ran to its end before the aborts were served: {send:?}"
    );
    assert!(
        tb.checkpoint_files(1).is_empty(),
        "images left on the target after its abort: {:?}",
        tb.checkpoint_files(1)
    );
    assert!(
        resumes(src.pid, &mut conn, before, 50),
        "the source resumed"
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

/// Prepares both agents for `uid`, dumps the source, sends its images to the target and
/// takes the restore fence on the source (what the operator does before it asks the
/// target to restore); the source agent's answer to `Fence`.
fn fenced(
    tb: &Testbed,
    uid: &'static str,
    src: i32,
    holder: i32,
    budget_ms: u64,
) -> MigrationStatus {
    let mut prep_src = prepare(tb, uid, 0, src, TcpPreservation::BestEffort);
    prep_src.freeze_budget_ms = budget_ms;
    let prep_tgt = prepare(tb, uid, 1, holder, TcpPreservation::BestEffort);
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        a.prepare(prep_src).await.unwrap();
        b.prepare(prep_tgt).await.unwrap();
        a.dump(uid).await.unwrap();
        a.send(uid, &Testbed::endpoint(1), "agent-b").await.unwrap();
        let f = a.fence(uid).await.unwrap();
        // Idempotent: a retry answers the same.
        assert_eq!(a.fence(uid).await.unwrap(), f);
        f
    })
}

/// The agent's status of `uid`, asked again (up to 5 s) until its phase is `want`: a
/// test sees the watchdog's effect on the process (resumed, dead) a moment before the
/// agent records it (its freeze is still THAWING or KILLING, reported as the phase it
/// had). The caller asserts on the phase.
async fn recorded(a: &mut AgentClient, uid: &str, want: Phase) -> MigrationStatus {
    let mut st = a.status(uid).await.unwrap();
    for _ in 0..50 {
        if st.phase() == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = a.status(uid).await.unwrap();
    }
    st
}

/// Whether the source tree's root died (killed, not resumed) within `tries` × 100 ms.
fn dies(src: ProcRef, tries: u32) -> bool {
    (0..tries).any(|_| {
        let dead = procfs::check_live(src).is_err();
        if !dead {
            std::thread::sleep(Duration::from_millis(100));
        }
        dead
    })
}

/// The restore fence (issue 16 finding 6): once the operator has fenced the source
/// before asking the target to restore, a watchdog that fires (the operator gone past
/// budget + margin) kills the source instead of resuming it — never two copies.
#[test]
fn a_fenced_source_past_its_budget_is_killed_not_resumed_by_the_agent_watchdog() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "fwd",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.agent_args = vec!["--freeze-watchdog-margin-ms".into(), "500".into()];
    tb.start_agent(0);
    tb.start_agent(1);
    let src = tb.start_workload(4, 0);
    let holder = tb.start_holder();
    let uid = "fenced-watchdog";
    let f = fenced(&tb, uid, src.pid, holder.pid, 1000);
    assert_eq!(f.phase(), Phase::Sent);
    assert!(f.fenced, "the answer says the fence holds");
    assert!(!running(src.pid), "still frozen");
    assert!(
        dies(src, 150),
        "the fenced source was not killed past its budget and margin\n{}",
        tb.agent_log(0)
    );
    let log = tb.agent_log(0);
    assert!(log.contains("the fenced source is still frozen"), "{log}");
    assert!(
        !log.contains("resuming it"),
        "the watchdog must never resume a fenced source\n{log}"
    );
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let st = recorded(&mut a, uid, Phase::Killed).await;
        assert_eq!(
            st.phase(),
            Phase::Killed,
            "never reported as aborted/resumed"
        );
        assert!(st.fenced);
        // The commit finds its work done; an abort cannot resume what is dead.
        assert_eq!(a.commit(uid).await.unwrap().phase(), Phase::Killed);
        let e = a.abort(uid).await.unwrap_err();
        assert_eq!(e.category(), "WrongPhase", "{e}");
        let mut b = tls.agent(1).await;
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
    assert!(tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty());
}

/// The kubelet stops the source agent (SIGTERM) after the fence: it kills the frozen
/// source before it exits, it does not resume it beside the copy the target may run.
#[test]
fn a_terminated_agent_kills_the_fenced_source_instead_of_resuming_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("ftr");
    let src = tb.start_workload(4, 0);
    let holder = tb.start_holder();
    let uid = "fenced-terminated";
    assert!(fenced(&tb, uid, src.pid, holder.pid, 0).fenced);
    let st = tb.terminate_agent(0).expect("agent was running");
    let log = tb.agent_log(0);
    assert!(st.success(), "the agent did not exit cleanly: {st}\n{log}");
    assert!(
        log.contains("killed the fenced source before exiting"),
        "the agent did not kill the fenced source itself\n{log}"
    );
    assert!(
        !log.contains("resumed the frozen source"),
        "a fenced source was resumed\n{log}"
    );
    assert!(dies(src, 50), "the fenced source still lives\n{log}");
    tb.operator(move |tls| async move {
        let mut b = tls.agent(1).await;
        b.abort(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
}

/// The source agent is killed outright (SIGKILL: no shutdown) after the fence: its
/// broker, which journalled the fence, kills the source when the agent's lease ends.
#[test]
fn a_killed_agent_s_broker_kills_the_fenced_source_instead_of_thawing_it() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("fkl");
    let src = tb.start_workload(4, 0);
    let holder = tb.start_holder();
    let uid = "fenced-agent-killed";
    assert!(fenced(&tb, uid, src.pid, holder.pid, 0).fenced);
    tb.kill_agent(0);
    assert!(
        dies(src, 100),
        "the broker did not kill the fenced source when the agent's lease ended\n{}",
        tb.agent_log(0)
    );
    tb.operator(move |tls| async move {
        let mut b = tls.agent(1).await;
        b.abort(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
}

/// A rollback before the restore: the operator's Abort (after the target's answer) is
/// the one thing that lifts the fence, and the source resumes with its connections.
#[test]
fn an_abort_lifts_the_fence_and_resumes_the_source_with_its_connections() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("fab");
    let src = tb.start_workload(4, 0);
    let holder = tb.start_holder();
    let mut conn = tb.connect_timeout(Duration::from_secs(2)).unwrap();
    let before = counter(&mut conn);
    let uid = "fenced-aborted";
    assert!(fenced(&tb, uid, src.pid, holder.pid, 0).fenced);
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let mut b = tls.agent(1).await;
        assert_eq!(b.abort(uid).await.unwrap().phase(), Phase::Aborted);
        let st = a.abort(uid).await.unwrap();
        assert_eq!(st.phase(), Phase::Aborted);
        assert!(!st.fenced, "the abort lifted the fence");
        // A fence after the abort is refused: the source runs again.
        assert!(a.fence(uid).await.is_err());
        a.cleanup(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
    });
    assert!(
        resumes(src.pid, &mut conn, before, 50),
        "the source did not resume after the abort"
    );
}

/// Prepares of one migration that arrive together (an operator's retry racing its
/// first call): one prepares it, the others answer that one is under way or with the
/// prepared migration, and the migration is whole — its checkpoint directory is there
/// and the source dumps. Before the guard, a loser's failed registration undid the
/// winner's work (its checkpoint directory zeroized) and the dump failed.
#[test]
fn concurrent_prepares_of_one_migration_leave_it_whole() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed("cpr");
    let src = tb.start_workload(4, 0);
    let uid = "concurrent-prepare";
    let p = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let checkpoints = tb.checkpoints(0);
    let (answers, dumped, dir_after) = tb.operator(move |tls| async move {
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(tls.agent(0).await);
        }
        let calls = clients.iter_mut().map(|c| {
            let p = p.clone();
            async move {
                c.prepare(p)
                    .await
                    .map(|s| s.phase())
                    .map_err(|e| e.category())
            }
        });
        let answers = futures::future::join_all(calls).await;
        let dir_after = checkpoints.join(uid).is_dir();
        let a = &mut clients[0];
        let dumped = a
            .dump(uid)
            .await
            .map(|s| s.phase())
            .map_err(|e| e.to_string());
        a.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
        (answers, dumped, dir_after)
    });
    assert!(answers.contains(&Ok(Phase::Prepared)), "{answers:?}");
    for a in &answers {
        assert!(
            *a == Ok(Phase::Prepared) || *a == Err("AgentUnavailable"),
            "{answers:?}"
        );
    }
    assert!(
        dir_after,
        "the checkpoint directory was removed: {answers:?}"
    );
    assert_eq!(
        dumped,
        Ok(Phase::Dumped),
        "{answers:?}\n{}",
        tb.agent_log(0)
    );
    assert!(running(src.pid));
}

/// A commit that finds the fenced source already dead (the chaos run's leftover images,
/// issue 21: a leader killed while its `Commit` ran — after the broker's kill, before
/// the agent recorded it — and the next leader's `Commit` then failed on the broker's
/// refusal of a process that is gone; the source stayed `Sent`, so every `Cleanup` was
/// refused and its checkpoint images stayed). A root that is gone counts as killed: the
/// commit is `Committed`, and the cleanup removes the images.
#[test]
fn a_commit_that_finds_the_fenced_source_dead_commits_and_cleans_up() {
    commit_finds_the_source_dead("cdd", false);
}

/// The same when the commit closes the connections that do not move (the real nodes'
/// default: the address stays): the tree died with its network locked (its kubelet's
/// SIGKILL at the end of a grace period shorter than the commit's wait, 4 of 19 commits
/// on the real nodes with a 2 s grace period), so there is nothing to take out of TCP
/// repair or unlock, and the broker refuses both for a process that is gone. The
/// commit used to fail on that refusal, and every `Cleanup` after it was refused.
#[test]
fn a_closing_commit_that_finds_the_source_dead_commits_and_cleans_up() {
    commit_finds_the_source_dead("cdc", true);
}

fn commit_finds_the_source_dead(name: &str, closing: bool) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = testbed(name);
    let src = tb.start_workload(4, 0);
    let holder = tb.start_holder();
    let uid = if closing {
        "closing-commit-finds-dead"
    } else {
        "commit-finds-dead"
    };
    let f = fenced(&tb, uid, src.pid, holder.pid, 60_000);
    assert!(f.fenced);
    // The tree's root dies before the commit (here: SIGKILL from outside).
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(src.pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(dies(src, 50), "the source did not die");
    let (committed, cleaned) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        let committed = a
            .commit_closing(uid, closing)
            .await
            .map(|s| s.phase())
            .map_err(|e| e.to_string());
        let cleaned = a
            .cleanup(uid)
            .await
            .map(|s| s.phase())
            .map_err(|e| e.to_string());
        let mut b = tls.agent(1).await;
        b.abort(uid).await.unwrap();
        b.cleanup(uid).await.unwrap();
        (committed, cleaned)
    });
    assert_eq!(committed, Ok(Phase::Committed), "{}", tb.agent_log(0));
    assert_eq!(cleaned, Ok(Phase::CleanedUp));
    assert!(
        tb.checkpoint_files(0).is_empty(),
        "{:?}",
        tb.checkpoint_files(0)
    );
}

/// A CRIU that logs `start` and `end` around each run (after a second's wait, so a
/// call can be abandoned before CRIU starts); returns it and its log.
fn logging_criu(tb: &Testbed) -> (std::path::PathBuf, std::path::PathBuf) {
    let (wrapper, log) = (tb.dir.join("logging-criu"), tb.dir.join("criu-runs"));
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nsleep 1\necho start >> {log}\n{criu} \"$@\"\nrc=$?\necho end >> {log}\nexit $rc\n",
            log = log.display(),
            criu = tb.criu.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    (wrapper, log)
}

/// A review finding (issue 16): a `PreDump` whose caller went away (the operator's
/// call deadline, a leader killed) dropped the call's hold on the migration while its
/// CRIU ran on, so the next round (or the final dump) started a second CRIU on the
/// same tree. The round now finishes in a task that holds the migration: the next call
/// waits for it, and CRIU never runs twice at once on one source.
#[test]
fn a_pre_dump_whose_caller_went_away_holds_off_the_next_round() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "pdx",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    let (criu, runs) = logging_criu(&tb);
    tb.criu = criu;
    tb.start_agent(0);
    let src = tb.start_workload(16, 0);
    let uid = "pre-dump-caller-gone";
    let prep = prepare(&tb, uid, 0, src.pid, TcpPreservation::BestEffort);
    let (abandoned, second) = tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.prepare(prep).await.unwrap();
        let abandoned = tokio::time::timeout(Duration::from_millis(300), a.pre_dump(uid))
            .await
            .is_err();
        (abandoned, a.pre_dump(uid).await)
    });
    assert!(abandoned, "the PreDump answered within 300 ms");
    let second =
        second.unwrap_or_else(|e| panic!("the second round failed: {e}\n{}", tb.agent_log(0)));
    assert_eq!(second.phase(), Phase::PreDumping);
    assert_eq!(second.iteration, 2, "both rounds ran, one after the other");
    // Each round may run CRIU more than once (a feature check before the dump); never
    // two at once: every start is followed by its end.
    let log = std::fs::read_to_string(&runs).unwrap();
    let runs: Vec<&str> = log.lines().collect();
    assert!(runs.len() >= 4, "two rounds ran CRIU: {runs:?}");
    assert!(
        runs.chunks(2).all(|r| r == ["start", "end"]),
        "two CRIUs ran at once on one source: {runs:?}"
    );
    assert!(running(src.pid));
    tb.operator(move |tls| async move {
        let mut a = tls.agent(0).await;
        a.abort(uid).await.unwrap();
        a.cleanup(uid).await.unwrap();
    });
}
