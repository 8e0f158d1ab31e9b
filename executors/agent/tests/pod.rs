//! A pod of two containers moves as one, on this machine's kernel, as root (the
//! testbed of `tests/again.rs`): the testload workload (`app`, with a ballast) and a
//! sidecar (`side`, `podmotion-testload forward`) that forwards each request to it over
//! localhost and counts what it forwarded, each the init of its own container (own PID
//! and mount namespaces) in one pod's network namespace. Every target pod has a holder
//! in each container.
//!
//! The pod moves A → B (Cold), B → A (PreCopy), then A → B again rolled back after the
//! restore (both copies on B killed, both source containers thawed), then A → B
//! (Cold): after each step the workload's counter, its ballast's digest, the sidecar's
//! own count and its forwarding over localhost carry on, and (Cold, PreCopy) the
//! client's held connection to the workload with them. `PODMOTION_ROOT_TESTS=0` skips
//! it; otherwise a missing CRIU fails it.

use podmotion_agent::testbed::{AGENT_NAMES, POD_IP, Testbed, ask};
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::ids::ProcRef;
use std::net::TcpStream;
use std::time::Duration;

const SIDE_PORT: u16 = 8081;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Cold,
    PreCopy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Commit,
    RollBack,
}

/// One container of a pod: its ID and PID 1.
#[derive(Clone, Debug)]
struct Container {
    id: String,
    init: ProcRef,
}

/// Where the pod is: its name, node, and its two containers (`app`, `side`).
#[derive(Clone, Debug)]
struct Pod {
    name: String,
    node: usize,
    app: Container,
    side: Container,
}

fn uid(n: usize) -> String {
    format!("5e0c0a1d-0000-4000-8000-00000c{n:06}")
}

fn refs(pod: &Pod) -> Vec<ContainerRef> {
    vec![
        ContainerRef {
            name: "app".into(),
            id: pod.app.id.clone(),
        },
        ContainerRef {
            name: "side".into(),
            id: pod.side.id.clone(),
        },
    ]
}

fn request(tb: &Testbed, uid: &str, node: usize, role: Role, pod: &Pod) -> PrepareRequest {
    PrepareRequest {
        migration_uid: uid.into(),
        role: role as i32,
        transfer_key: vec![42; 32],
        tcp: TcpPreservation::Strict as i32,
        container_ids: vec![],
        peer_node: tb.tls.nodes[1 - node].clone(),
        freeze_budget_ms: 0,
        post_copy: false,
        containers: refs(pod),
        hold_services: vec![],
    }
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

/// The tree a move dumps for a container: the workload nested below its holder, or
/// its PID 1.
fn tree_of(c: &Container) -> i32 {
    match nested_inits(c.init.pid).as_slice() {
        [w] => *w,
        _ => c.init.pid,
    }
}

/// `pid` is gone (or a zombie), waiting up to 5 s.
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

/// A fresh connection to the sidecar through the pod address.
fn sidecar(tb: &Testbed) -> TcpStream {
    tb.in_netns("cli", || {
        let s = TcpStream::connect_timeout(
            &format!("{POD_IP}:{SIDE_PORT}").parse().expect("addr"),
            Duration::from_secs(5),
        )
        .expect("connect to the sidecar");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s
    })
}

/// The sidecar's own count, and the workload's counter asked through it.
fn through_sidecar(tb: &Testbed) -> (u64, u64) {
    let mut s = sidecar(tb);
    let counter = ask(&mut s, "get").expect("get via the sidecar");
    let counter = counter
        .parse()
        .unwrap_or_else(|_| panic!("the sidecar answered {counter:?}"));
    let forwarded = ask(&mut s, "forwarded")
        .expect("forwarded")
        .parse()
        .expect("number");
    (forwarded, counter)
}

struct Moved {
    downtime_ms: u64,
    dump_ms: u64,
    restore_ms: u64,
}

/// Moves the pod `from` to a new pod `to` on the other node (two holders) and ends
/// the move as `end` says; returns where the pod is after it.
fn move_pod(
    tb: &mut Testbed,
    mode: Mode,
    uid: &str,
    from: &Pod,
    to: &str,
    end: End,
) -> (Pod, Moved) {
    let to_node = 1 - from.node;
    tb.add_pod(to);
    let h_app = tb.start_holder_container(to);
    let h_side = tb.start_holder_container(to);
    let target = Pod {
        name: to.into(),
        node: to_node,
        app: Container {
            id: tb.container_with_rootfs(&format!("{to}-app"), h_app.pid),
            init: h_app,
        },
        side: Container {
            id: tb.container_with_rootfs(&format!("{to}-side"), h_side.pid),
            init: h_side,
        },
    };
    let p_src = request(tb, uid, from.node, Role::Source, from);
    let p_tgt = request(tb, uid, to_node, Role::Target, &target);
    let (src, u) = (from.node, uid.to_owned());
    let dumped = tb.operator(move |tls| async move {
        let (mut s, mut t) = (tls.agent(src).await, tls.agent(1 - src).await);
        s.prepare(p_src).await.expect("source Prepare");
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
    let (app_tree, side_tree) = (tree_of(&from.app), tree_of(&from.side));
    tb.pod_address_in(to);
    let u = uid.to_owned();
    let restored = tb.operator(move |tls| async move {
        tls.agent(to_node).await.restore(&u).await.expect("Restore")
    });
    assert_eq!(restored.phase(), Phase::Restored);
    let app_copy = restored.restored_pid;
    assert_eq!(
        nested_inits(h_app.pid),
        [app_copy],
        "the workload's copy is nested below the target's app holder"
    );
    let side_copies = nested_inits(h_side.pid);
    assert_eq!(
        side_copies.len(),
        1,
        "the sidecar's copy is nested below the target's side holder\n{}",
        tb.agent_log(to_node)
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
    match end {
        End::Commit => {
            tb.route_pod_address_to(to);
            let u = uid.to_owned();
            let committed = tb.operator(move |tls| async move {
                let (mut s, mut t) = (tls.agent(src).await, tls.agent(1 - src).await);
                let c = s.commit(&u).await.expect("Commit");
                s.cleanup(&u).await.expect("source Cleanup");
                t.cleanup(&u).await.expect("target Cleanup");
                c
            });
            assert_eq!(committed.phase(), Phase::Committed);
            assert!(gone(app_tree), "the source workload was killed on commit");
            assert!(gone(side_tree), "the source sidecar was killed on commit");
            (target, moved)
        }
        End::RollBack => {
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
            assert!(gone(app_copy), "the target's workload copy was killed");
            assert!(gone(side_copies[0]), "the target's sidecar copy was killed");
            assert_eq!(tree_of(&from.app), app_tree, "the same workload runs on");
            assert_eq!(tree_of(&from.side), side_tree, "the same sidecar runs on");
            (from.clone(), moved)
        }
    }
}

#[test]
fn a_pod_with_a_sidecar_moves_as_one_and_a_rollback_keeps_both_containers() {
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut tb = Testbed::new(
        "pod2",
        env!("CARGO_BIN_EXE_podmotion-agent").as_ref(),
        env!("CARGO_BIN_EXE_podmotion-testload").as_ref(),
    );
    tb.start_agent(0);
    tb.start_agent(1);
    let app = tb.start_workload_container("src", 16, 0);
    let bin = env!("CARGO_BIN_EXE_podmotion-testload").to_string();
    let side = tb.start_container(
        "src",
        &[bin, "forward".into(), SIDE_PORT.to_string(), "8080".into()],
    );
    let mut at = Pod {
        name: "src".into(),
        node: 0,
        app: Container {
            id: tb.container_with_rootfs("src-app", app.pid),
            init: app,
        },
        side: Container {
            id: tb.container_with_rootfs("src-side", side.pid),
            init: side,
        },
    };
    let mut held = tb.connect_timeout(Duration::from_secs(5)).expect("connect");
    let digest = ask(&mut held, "digest").expect("digest");
    let (mut forwarded, mut counter) = (0, 0);
    // A few requests through the sidecar: its own count is state to carry.
    for _ in 0..3 {
        (forwarded, counter) = through_sidecar(&tb);
    }
    assert_eq!(forwarded, 3, "the sidecar counts what it forwarded");
    let plan = [
        ("p1", Mode::Cold, End::Commit),
        ("p2", Mode::PreCopy, End::Commit),
        ("p3", Mode::Cold, End::RollBack),
        ("p4", Mode::Cold, End::Commit),
    ];
    let mut report = Vec::new();
    for (n, (to, mode, end)) in plan.into_iter().enumerate() {
        let before = at.clone();
        let (now, moved) = move_pod(&mut tb, mode, &uid(n), &at, to, end);
        let (f, c) = through_sidecar(&tb);
        let logs = || format!("{}\n{}", tb.agent_log(0), tb.agent_log(1));
        assert_eq!(
            f,
            forwarded + 1,
            "move {} ({mode:?} {} → {to}, {end:?}): the sidecar's own count went from {forwarded} to {f}\n{}",
            n + 1,
            before.name,
            logs()
        );
        assert!(
            c > counter,
            "move {}: the workload's counter through the sidecar went from {counter} to {c}",
            n + 1
        );
        assert_eq!(
            ask(&mut held, "echo still-here").expect("held connection"),
            "still-here",
            "move {}: the held connection to the workload carried on",
            n + 1
        );
        assert_eq!(
            ask(&mut held, "digest").expect("digest"),
            digest,
            "move {}: the ballast came across whole",
            n + 1
        );
        report.push(format!(
            "move {} {} (node {}) → {to}: {mode:?} {end:?}, dump {} ms, restore {} ms, downtime {} ms, counter {counter} → {c}, sidecar forwarded {forwarded} → {f}",
            n + 1,
            before.name,
            ["A", "B"][before.node],
            moved.dump_ms,
            moved.restore_ms,
            moved.downtime_ms
        ));
        (forwarded, counter) = (f, c);
        at = now;
    }
    assert_eq!((at.name.as_str(), at.node), ("p4", 1));
    eprintln!("two containers, 16 MiB:\n  {}", report.join("\n  "));
    assert!(
        tb.checkpoint_files(0).is_empty() && tb.checkpoint_files(1).is_empty(),
        "{:?} {:?}",
        tb.checkpoint_files(0),
        tb.checkpoint_files(1)
    );
}
