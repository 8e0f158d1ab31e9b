//! A pod PodMotion moved moves again, as often as asked, on this machine's kernel, as
//! root (the testbed of `tests/migration.rs`, with containers: see
//! `podmotion_agent::testbed`). The workload starts as an ordinary container (its own
//! PID and mount namespaces, its own root) on node A; every target pod's container is
//! PodMotion's holder, so from the second move on the source container's PID 1 is a
//! holder and the tree to move is the restored workload nested below it. Each test
//! moves it A → B → A, then tries A → B and rolls that back after the restore (the
//! copy on B killed, the second copy thawed on A with its state), then moves it A → B:
//! the counter, the ballast's digest and (Cold, PreCopy) the client's established
//! connection carry on through every move. `PODMOTION_ROOT_TESTS=0` skips them;
//! otherwise a missing CRIU fails them.

use podmotion_agent::testbed::{AGENT_NAMES, Testbed, ask};
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::ids::ProcRef;
use std::net::TcpStream;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Cold,
    PreCopy,
    PostCopy,
}

impl Mode {
    /// PostCopy's tests run without TCP preservation (as `tests/post_copy.rs`): the
    /// client connects afresh after each move.
    fn tcp(self) -> TcpPreservation {
        match self {
            Mode::PostCopy => TcpPreservation::None,
            _ => TcpPreservation::Strict,
        }
    }
}

/// Where the workload is: its pod, that pod's node (0: A, 1: B), its container's ID
/// and PID 1 (the workload itself in the first pod, a holder after that).
#[derive(Clone, Debug)]
struct Pod {
    name: String,
    node: usize,
    container: String,
    init: ProcRef,
}

/// How a move ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Commit,
    /// The operator's rollback once the target restored its copy: the copy killed,
    /// then the source thawed.
    RollBack,
}

/// What a move measured.
struct Moved {
    downtime_ms: u64,
    dump_ms: u64,
    restore_ms: u64,
}

fn testbed(name: &str, mode: Mode) -> Option<Testbed> {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return None;
    }
    if mode == Mode::PostCopy {
        podmotion_agent::testbed::ensure_lazy_pipe_room();
    }
    let mut tb = Testbed::new(
        name,
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    Some(tb)
}

fn uid(mode: Mode, n: usize) -> String {
    format!("5e0c0a1d-0000-4000-8000-{:06}{n:06}", mode as usize)
}

/// The operator's `Prepare` for the agent of `node` in `role`, naming the other
/// node's agent as its peer.
fn request(
    tb: &Testbed,
    uid: &str,
    node: usize,
    role: Role,
    container: &str,
    mode: Mode,
) -> PrepareRequest {
    PrepareRequest {
        migration_uid: uid.into(),
        role: role as i32,
        transfer_key: vec![42; 32],
        tcp: mode.tcp() as i32,
        container_ids: vec![container.into()],
        peer_node: tb.tls.nodes[1 - node].clone(),
        freeze_budget_ms: 0,
        post_copy: mode == Mode::PostCopy,
        containers: vec![],
        hold_services: vec![],
    }
}

/// `pid` is gone (or a zombie: dead, its parent not yet told), waiting up to 5 s.
fn gone(pid: i32) -> bool {
    (0..100).any(|_| {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, r)| r.trim().chars().next())
            });
        let dead = matches!(state, None | Some('Z'));
        if !dead {
            std::thread::sleep(Duration::from_millis(50));
        }
        dead
    })
}

/// The children of `pid` that are the init of a PID namespace nested below its own.
fn nested_inits(pid: i32) -> Vec<i32> {
    let depth = procfs::ns_pids(pid).map(|n| n.len()).unwrap_or(0);
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let kids = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
        for k in kids
            .split_whitespace()
            .filter_map(|k| k.parse::<i32>().ok())
        {
            if procfs::ns_pids(k).is_some_and(|n| n.len() > depth && n.last() == Some(&1)) {
                out.push(k);
            }
        }
    }
    out
}

/// Status of the agent of `node` until `done` says so (30 s at most).
fn until(
    tb: &Testbed,
    node: usize,
    uid: &str,
    done: fn(&MigrationStatus) -> bool,
) -> MigrationStatus {
    for _ in 0..300 {
        let u = uid.to_owned();
        let st =
            tb.operator(move |tls| async move { tls.agent(node).await.status(&u).await.unwrap() });
        if done(&st) {
            return st;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("node {node} never got there\n{}", tb.agent_log(node));
}

/// Moves the workload from `from` to a new pod `to` on the other node, whose
/// container is a holder, and ends the move as `end` says. Returns where the workload
/// is after it, and what the move measured.
fn move_workload(
    tb: &mut Testbed,
    mode: Mode,
    uid: &str,
    from: &Pod,
    to: &str,
    end: End,
) -> (Pod, Moved) {
    let to_node = 1 - from.node;
    tb.add_pod(to);
    let holder = tb.start_holder_container(to);
    let container = tb.container_with_rootfs(to, holder.pid);
    let p_src = request(tb, uid, from.node, Role::Source, &from.container, mode);
    let p_tgt = request(tb, uid, to_node, Role::Target, &container, mode);
    let (src, u) = (from.node, uid.to_owned());
    let dumped = tb.operator(move |tls| async move {
        let (mut s, mut t) = (tls.agent(src).await, tls.agent(1 - src).await);
        let prepared = s.prepare(p_src).await.expect("source Prepare");
        assert_eq!(prepared.phase(), Phase::Prepared);
        t.prepare(p_tgt).await.expect("target Prepare");
        let (to_ep, to_name) = (Testbed::endpoint(1 - src), AGENT_NAMES[1 - src]);
        if mode == Mode::PreCopy {
            let p = s.pre_dump(&u).await.expect("PreDump");
            assert!(
                p.last_round_bytes > 16 << 20,
                "the warm copy holds the ballast"
            );
            s.send(&u, &to_ep, to_name).await.expect("warm Send");
        }
        let d = s.dump(&u).await.expect("Dump");
        assert_eq!(d.phase(), Phase::Dumped);
        s.send(&u, &to_ep, to_name).await.expect("Send");
        assert!(s.fence(&u).await.expect("Fence").fenced);
        d
    });
    // The source's workload is stopped, and a holder holding it is not ended by that.
    if from.init.pid != nested_or_self(from) {
        assert!(
            procfs::check_live(from.init).is_ok(),
            "the source's holder ended with its frozen workload"
        );
    }
    tb.pod_address_in(to);
    let u = uid.to_owned();
    let restored = tb.operator(move |tls| async move {
        tls.agent(to_node).await.restore(&u).await.expect("Restore")
    });
    assert_eq!(restored.phase(), Phase::Restored);
    let copy = restored.restored_pid;
    assert_eq!(
        nested_inits(holder.pid),
        [copy],
        "the copy is the init of a PID namespace nested below the target's holder"
    );
    let moved = Moved {
        downtime_ms: restored
            .timings()
            .resumed_us
            .saturating_sub(dumped.timings().freeze_started_us)
            / 1000,
        dump_ms: dumped.timings().dump_us / 1000,
        restore_ms: restored.timings().restore_us / 1000,
    };
    let source_tree = nested_or_self(from);
    match end {
        End::Commit => {
            tb.route_pod_address_to(to);
            if mode == Mode::PostCopy {
                let t = until(tb, to_node, uid, |s| {
                    s.lazy_done || !s.lazy_error.is_empty()
                });
                assert!(t.lazy_error.is_empty(), "{}", t.lazy_error);
                let s = until(tb, from.node, uid, |s| {
                    s.lazy_done || !s.lazy_error.is_empty()
                });
                assert!(s.lazy_error.is_empty(), "{}", s.lazy_error);
            }
            let u = uid.to_owned();
            let committed = tb.operator(move |tls| async move {
                let (mut s, mut t) = (tls.agent(src).await, tls.agent(1 - src).await);
                let c = s.commit(&u).await.expect("Commit");
                s.cleanup(&u).await.expect("source Cleanup");
                t.cleanup(&u).await.expect("target Cleanup");
                c
            });
            assert_eq!(committed.phase(), Phase::Committed);
            assert!(gone(source_tree), "the source tree was killed on commit");
            // A holder ends with its workload (the kubelet of a terminating pod does
            // not restart it).
            assert!(gone(from.init.pid), "the source container's PID 1 ended");
            let pod = Pod {
                name: to.to_owned(),
                node: to_node,
                container,
                init: holder,
            };
            (pod, moved)
        }
        End::RollBack => {
            // The target's copy holds the client's connection: the address it answers
            // from goes first (the order of the agent's hand-over), so that its kill
            // ends nothing the thawed source holds.
            tb.pod_address_gone_from(to);
            let u = uid.to_owned();
            tb.operator(move |tls| async move {
                let (mut s, mut t) = (tls.agent(src).await, tls.agent(1 - src).await);
                assert_eq!(
                    t.abort(&u).await.expect("target Abort").phase(),
                    Phase::Aborted
                );
                assert_eq!(
                    s.abort(&u).await.expect("source Abort").phase(),
                    Phase::Aborted
                );
                s.cleanup(&u).await.expect("source Cleanup");
                t.cleanup(&u).await.expect("target Cleanup");
            });
            assert!(gone(copy), "the target's copy was killed");
            assert!(gone(holder.pid), "the target's holder ended with its copy");
            assert!(
                procfs::check_live(from.init).is_ok(),
                "the source pod's PID 1 runs on"
            );
            assert_eq!(
                nested_or_self(from),
                source_tree,
                "the same source tree runs on"
            );
            (from.clone(), moved)
        }
    }
}

/// The tree a move of `pod` dumps: the workload nested below its holder, or its PID 1.
fn nested_or_self(pod: &Pod) -> i32 {
    match nested_inits(pod.init.pid).as_slice() {
        [w] => *w,
        _ => pod.init.pid,
    }
}

/// The client: the held connection (Cold, PreCopy: it must survive every move), or a
/// fresh one each time (PostCopy, without TCP preservation).
struct Client {
    held: Option<TcpStream>,
}

impl Client {
    fn conn(&mut self, tb: &Testbed, mode: Mode) -> TcpStream {
        if mode == Mode::PostCopy || self.held.is_none() {
            let c = tb.connect_timeout(Duration::from_secs(5)).expect("connect");
            if mode != Mode::PostCopy {
                self.held = Some(c.try_clone().expect("clone"));
            }
            return c;
        }
        self.held.as_ref().unwrap().try_clone().expect("clone")
    }
    fn counter(&mut self, tb: &Testbed, mode: Mode) -> u64 {
        let mut c = self.conn(tb, mode);
        ask(&mut c, "get").expect("get").parse().expect("number")
    }
    fn digest(&mut self, tb: &Testbed, mode: Mode) -> String {
        ask(&mut self.conn(tb, mode), "digest").expect("digest")
    }
}

fn again_and_again(mode: Mode, name: &str) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut tb) = testbed(name, mode) else {
        return;
    };
    let init = tb.start_workload_container("src", 16, 0);
    let container = tb.container_with_rootfs("src", init.pid);
    let mut at = Pod {
        name: "src".into(),
        node: 0,
        container,
        init,
    };
    let mut client = Client { held: None };
    let digest = client.digest(&tb, mode);
    let mut last = client.counter(&tb, mode);
    let mut report = Vec::new();
    let plan = [
        ("p1", End::Commit),
        ("p2", End::Commit),
        ("p3", End::RollBack),
        ("p4", End::Commit),
    ];
    for (n, (to, end)) in plan.into_iter().enumerate() {
        let before = at.clone();
        let (now, moved) = move_workload(&mut tb, mode, &uid(mode, n), &at, to, end);
        let counter = client.counter(&tb, mode);
        assert!(
            counter > last,
            "{mode:?} move {} ({} → {to}, {end:?}): the counter went from {last} to {counter}\n{}\n{}",
            n + 1,
            before.name,
            tb.agent_log(0),
            tb.agent_log(1)
        );
        assert_eq!(
            client.digest(&tb, mode),
            digest,
            "{mode:?} move {}: the ballast came across whole",
            n + 1
        );
        if mode != Mode::PostCopy {
            assert_eq!(
                ask(client.held.as_mut().unwrap(), "echo still-here").unwrap(),
                "still-here",
                "the established connection carried on"
            );
        }
        report.push(format!(
            "move {} {} (node {}) → {to}: {end:?}, dump {} ms, restore {} ms, downtime {} ms, counter {last} → {counter}",
            n + 1,
            before.name,
            ["A", "B"][before.node],
            moved.dump_ms,
            moved.restore_ms,
            moved.downtime_ms
        ));
        last = counter;
        at = now;
    }
    // Where the plan leaves it: the last move's pod, on node B.
    assert_eq!((at.name.as_str(), at.node), ("p4", 1));
    eprintln!("{mode:?}, 16 MiB:\n  {}", report.join("\n  "));
    assert!(
        tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty(),
        "{:?} {:?}",
        tb.checkpoint_files(0),
        tb.checkpoint_files(1)
    );
}

#[test]
fn a_cold_moved_pod_moves_again_and_again_and_a_rollback_keeps_the_second_copy() {
    again_and_again(Mode::Cold, "agc");
}

#[test]
fn a_pre_copied_pod_moves_again_and_again_and_a_rollback_keeps_the_second_copy() {
    again_and_again(Mode::PreCopy, "agp");
}

#[test]
fn a_post_copied_pod_moves_again_and_again_and_a_rollback_keeps_the_second_copy() {
    again_and_again(Mode::PostCopy, "agl");
}
