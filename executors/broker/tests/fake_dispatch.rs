//! The op dispatcher over the simulated node (`podmotion_broker::fake`): whole
//! migration sequences with their expected outcomes, the invariants the fuzz target
//! checks, and a replay of the fuzz target's committed seed corpus. No root needed,
//! nothing on the machine is touched.

use podmotion_broker::fake::{Effect, Fault, Harness, Op};
use podmotion_wire::broker::{BrokerRole, ErrorKind, Reply, Request, SocketAddrs};
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};

fn uid(s: &str) -> MigrationUid {
    MigrationUid::parse(s).unwrap()
}

fn pin(h: &Harness, pid: i32) -> ProcRef {
    let start_time = h.kernel().world().procs[&pid].start_time;
    ProcRef { pid, start_time }
}

/// A lock of migration `s` that holds nothing (the dispatcher's view: no forwarding).
fn lock(s: &str) -> Request {
    Request::LockNetwork {
        uid: uid(s),
        hold: None,
    }
}

fn req(h: &mut Harness, conn: u64, r: Request) -> Result<Reply, ErrorKind> {
    h.step(Op::Req { conn, req: r })
        .unwrap_or_else(|v| panic!("invariant violated: {v}"))
        .expect("a request has an outcome")
}

fn ev(h: &mut Harness, op: Op) {
    h.step(op)
        .unwrap_or_else(|v| panic!("invariant violated: {v}"));
}

fn register(
    h: &mut Harness,
    conn: u64,
    u: &str,
    role: BrokerRole,
    pid: i32,
) -> Result<Reply, ErrorKind> {
    let process = pin(h, pid);
    let container = h.kernel().world().container_of(pid);
    req(
        h,
        conn,
        Request::Register {
            uid: uid(u),
            role,
            process,
            container,
        },
    )
}

fn links_up(h: &Harness, netns: u32) -> Vec<String> {
    h.kernel().world().links_up(netns)
}

#[test]
fn a_committed_source_migration_locks_lists_releases_and_kills_only_its_tree() {
    let mut h = Harness::new();
    assert_eq!(
        register(&mut h, 1, "mig-a", BrokerRole::Source, 101),
        Ok(Reply::Registered {
            cgroup: "/kubepods/podA/app".into()
        })
    );
    assert_eq!(req(&mut h, 1, lock("mig-a")), Ok(Reply::Done));
    assert_eq!(links_up(&h, 10), ["lo"]);
    assert!(
        h.kernel()
            .world()
            .files
            .keys()
            .any(|p| p.ends_with(".journal/mig-a"))
    );
    ev(&mut h, Op::Dump { pid: 101 });
    let Ok(Reply::Sockets { sockets }) = req(&mut h, 1, Request::ListSockets { uid: uid("mig-a") })
    else {
        panic!("list_sockets refused")
    };
    assert_eq!(sockets.len(), 3, "{sockets:?}");
    assert_eq!(
        req(&mut h, 1, Request::ReleaseTcpRepair { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    assert!(
        h.kernel().world().procs[&102]
            .sockets
            .iter()
            .all(|s| !s.repair)
    );
    assert_eq!(
        req(&mut h, 1, Request::Kill { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    {
        let w = h.kernel().world();
        assert!(w.procs[&101].zombie && w.procs[&102].zombie);
        assert!(
            !w.procs[&100].zombie,
            "the pause process is not in the tree"
        );
        assert!(w.files.is_empty(), "kill ends the journal record");
    }
    assert_eq!(
        req(&mut h, 1, Request::Forget { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    assert_eq!(h.broker().registrations(), 0);
}

fn socket(local: &str, remote: Option<&str>) -> SocketAddrs {
    SocketAddrs {
        local: Some(local.parse().unwrap()),
        remote: remote.map(|r| r.parse().unwrap()),
        listening: remote.is_none(),
    }
}

/// `list_sockets` answers what the source's tree holds — each socket once, even one
/// two of its processes share, a listener without a peer — and nothing of any other
/// process; it only reads addresses (no other effect on the node), and reads a shared
/// socket once.
#[test]
fn the_sources_sockets_are_listed_by_their_addresses_each_once() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    {
        // 102 also holds 101's listener (inherited across a fork).
        let mut w = h.kernel().world();
        let mut shared = w.procs[&101].sockets[0].clone();
        shared.fd = 9;
        w.procs.get_mut(&102).unwrap().sockets.push(shared);
    }
    let listed = req(&mut h, 1, Request::ListSockets { uid: uid("mig-a") });
    assert_eq!(
        listed,
        Ok(Reply::Sockets {
            sockets: vec![
                socket("10.0.10.5:8003", None),
                socket("10.0.10.5:8080", Some("198.51.100.101:40004")),
                socket("[2001:db8:10::5]:8443", Some("[2001:db8:ffff::102]:40005")),
            ]
        })
    );
    let w = h.kernel().world();
    assert_eq!(
        w.effects,
        [
            Effect::ReadAddrs { pid: 101, fd: 3 },
            Effect::ReadAddrs { pid: 101, fd: 4 },
            Effect::ReadAddrs { pid: 102, fd: 5 },
        ]
    );
}

#[test]
fn an_agent_lost_mid_dump_leaves_the_source_running_and_its_network_as_it_was() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    ev(&mut h, Op::Dump { pid: 101 });
    ev(&mut h, Op::DetachOnSleep(true));
    ev(&mut h, Op::LeaseLost { conn: 1 });
    let w = h.kernel().world();
    for pid in [101, 102] {
        assert!(!w.procs[&pid].stopped && w.procs[&pid].tracer == 0);
        assert!(w.procs[&pid].sockets.iter().all(|s| !s.repair));
    }
    assert_eq!(w.nets[&10].canonical(), h_baseline(10));
    assert!(w.files.is_empty());
}

fn h_baseline(n: u32) -> podmotion_broker::fake::Net {
    podmotion_broker::fake::World::standard().nets[&n].canonical()
}

#[test]
fn a_restarted_broker_rolls_back_the_source_its_predecessor_left_locked() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    ev(&mut h, Op::Dump { pid: 101 });
    ev(&mut h, Op::Detach { pid: 101 });
    ev(&mut h, Op::Restart);
    let w = h.kernel().world();
    assert!(!w.procs[&101].stopped && !w.procs[&102].stopped);
    assert_eq!(w.nets[&10].canonical(), h_baseline(10));
    assert!(w.files.is_empty() && w.mounts.is_empty());
}

#[test]
fn processes_outside_the_pods_or_in_the_node_netns_are_never_registered() {
    let mut h = Harness::new();
    for (pid, want) in [
        (60, ErrorKind::ForeignProcess), // kubelet, /system.slice
        (1, ErrorKind::NoSuchProcess),   // init: pid ≤ 1
        (70, ErrorKind::ForeignProcess), // hostNetwork pod
        (2, ErrorKind::ForeignProcess),  // the broker itself
    ] {
        assert_eq!(
            register(&mut h, 1, "mig-a", BrokerRole::Source, pid),
            Err(want),
            "pid {pid}"
        );
    }
    let stale = ProcRef {
        pid: 101,
        start_time: 1,
    };
    let container = h.kernel().world().container_of(101);
    assert_eq!(
        req(
            &mut h,
            1,
            Request::Register {
                uid: uid("mig-a"),
                role: BrokerRole::Source,
                process: stale,
                container,
            }
        ),
        Err(ErrorKind::PidReused)
    );
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    assert_eq!(
        register(&mut h, 1, "mig-b", BrokerRole::Source, 101),
        Err(ErrorKind::AlreadyRegistered)
    );
    assert_eq!(
        req(&mut h, 2, Request::Kill { uid: uid("mig-a") }),
        Err(ErrorKind::Busy)
    );
    assert_eq!(
        req(&mut h, 1, Request::BindNetns { uid: uid("mig-a") }),
        Err(ErrorKind::WrongRole)
    );
    // The pinned pid is reused by a host process: nothing is signalled.
    ev(&mut h, Op::Reuse { pid: 101, like: 60 });
    assert_eq!(
        req(&mut h, 1, Request::Kill { uid: uid("mig-a") }),
        Err(ErrorKind::PidReused)
    );
    assert!(!h.kernel().world().procs[&101].zombie);
}

/// The broker pins a process only under the container the agent names (the operator's,
/// resolved through CRI): a live pod process of another container — a stale or reused
/// pid, a confused agent — is refused and nothing is registered.
#[test]
fn a_process_is_registered_only_under_its_own_container() {
    let mut h = Harness::new();
    let (app, pause) = {
        let w = h.kernel().world();
        (w.container_of(101), w.container_of(100))
    };
    assert_eq!((app.as_str(), pause.as_str()), ("app", "pause"));
    let register_as = |h: &mut Harness, u: &str, pid: i32, container: &ContainerId| {
        let process = pin(h, pid);
        req(
            h,
            1,
            Request::Register {
                uid: uid(u),
                role: BrokerRole::Source,
                process,
                container: container.clone(),
            },
        )
    };
    // The workload (podA/app) named as the pod's pause container, and the reverse.
    assert_eq!(
        register_as(&mut h, "mig-a", 101, &pause),
        Err(ErrorKind::ForeignProcess)
    );
    assert_eq!(
        register_as(&mut h, "mig-a", 100, &app),
        Err(ErrorKind::ForeignProcess)
    );
    assert_eq!(h.broker().registrations(), 0);
    assert_eq!(req(&mut h, 1, lock("mig-a")), Err(ErrorKind::NotRegistered));
    // Under its own container it registers; again with the same container is a no-op,
    // with another container it is not "the same thing" and is refused.
    assert_eq!(
        register_as(&mut h, "mig-a", 101, &app),
        Ok(Reply::Registered {
            cgroup: "/kubepods/podA/app".into()
        })
    );
    assert!(register_as(&mut h, "mig-a", 101, &app).is_ok());
    assert_eq!(
        register_as(&mut h, "mig-a", 101, &pause),
        Err(ErrorKind::AlreadyRegistered)
    );
    assert_eq!(h.broker().registrations(), 1);
}

#[test]
fn the_target_binds_its_netns_and_moves_only_a_tree_of_that_netns() {
    let mut h = Harness::new();
    assert_eq!(
        register(&mut h, 1, "mig-c", BrokerRole::Target, 200),
        Ok(Reply::Registered {
            cgroup: "/kubepods/podC/pause".into()
        })
    );
    assert_eq!(
        req(&mut h, 1, Request::BindNetns { uid: uid("mig-c") }),
        Ok(Reply::NetnsPath {
            path: "/fake/run/netns/mig-c".into()
        })
    );
    for pid in [80, 60, 200] {
        let process = pin(&h, pid);
        assert_eq!(
            req(
                &mut h,
                1,
                Request::MoveCgroup {
                    uid: uid("mig-c"),
                    process
                }
            ),
            Err(ErrorKind::ForeignProcess),
            "pid {pid}"
        );
    }
    let process = pin(&h, 201);
    assert_eq!(
        req(
            &mut h,
            1,
            Request::MoveCgroup {
                uid: uid("mig-c"),
                process
            }
        ),
        Ok(Reply::Moved { pids: 2 })
    );
    assert_eq!(
        h.kernel().world().procs[&202].cgroup,
        "/kubepods/podC/pause"
    );
    assert_eq!(h.kernel().world().procs[&80].cgroup, "/kubepods/podX/app");
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
    assert!(h.kernel().world().mounts.is_empty());
}

#[test]
fn the_target_charges_only_a_process_of_the_agents_pod_to_the_holders_memory_cgroup() {
    let mut h = Harness::new();
    let charge = |h: &mut Harness, conn, u: &str, pid| {
        let process = pin(h, pid);
        req(
            h,
            conn,
            Request::ChargeRestore {
                uid: uid(u),
                process,
            },
        )
    };
    // Nothing registered: nothing to charge to.
    assert_eq!(
        charge(&mut h, 1, "mig-c", 210),
        Err(ErrorKind::NotRegistered)
    );
    register(&mut h, 1, "mig-c", BrokerRole::Target, 200).unwrap();
    register(&mut h, 1, "mig-s", BrokerRole::Source, 101).unwrap();
    // A source has no pod to charge a restore to.
    assert_eq!(charge(&mut h, 1, "mig-s", 210), Err(ErrorKind::WrongRole));
    // Another tenant's process, a host process, the holder, the restored tree (the
    // pod's own netns) and the broker itself are not the agent's launcher.
    for pid in [80, 60, 70, 200, 201, 2] {
        assert_eq!(
            charge(&mut h, 1, "mig-c", pid),
            Err(ErrorKind::ForeignProcess),
            "pid {pid}"
        );
        assert!(h.kernel().world().effects.is_empty(), "pid {pid}");
    }
    // Another agent's connection does not hold the registration.
    assert_eq!(charge(&mut h, 2, "mig-c", 210), Err(ErrorKind::Busy));
    assert_eq!(
        charge(&mut h, 1, "mig-c", 210),
        Ok(Reply::Moved { pids: 1 })
    );
    assert_eq!(
        h.kernel().world().effects,
        vec![Effect::Charged {
            pid: 210,
            to: "/kubepods/podC/pause".into()
        }]
    );
}

#[test]
fn a_planted_symlink_is_refused_and_nothing_is_mounted() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-c", BrokerRole::Target, 200).unwrap();
    ev(
        &mut h,
        Op::Symlink {
            uid: 2,
            journal: false,
            handover: false,
        },
    );
    assert_eq!(
        req(&mut h, 1, Request::BindNetns { uid: uid("mig-c") }),
        Err(ErrorKind::UnsafePath)
    );
    assert!(h.kernel().world().mounts.is_empty());
}

#[test]
fn a_lock_that_fails_half_way_leaves_no_link_down() {
    // The hand-over off: only the lock's own `ip` calls (with it on, the hold of the
    // node's neighbour entries lists and routes the pod's addresses first).
    let mut h = Harness::with_config(podmotion_broker::Config {
        handover_cidrs: Vec::new(),
        ..podmotion_broker::fake::config()
    });
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    // The 6th ip call of the lock (the second link's `set down`) fails.
    ev(&mut h, Op::Fault(Fault::Ip(5)));
    assert_eq!(req(&mut h, 1, lock("mig-a")), Err(ErrorKind::Kernel));
    assert_eq!(links_up(&h, 10), ["eth0", "lo", "pm0"]);
    // And after forget the network is exactly as it was (the harness checks it).
    req(&mut h, 1, Request::Forget { uid: uid("mig-a") }).unwrap();
}

#[test]
fn a_failed_unlock_or_forget_keeps_what_is_needed_to_undo_the_lock() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    ev(&mut h, Op::Fault(Fault::Ip(0)));
    assert_eq!(
        req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }),
        Err(ErrorKind::Kernel)
    );
    ev(&mut h, Op::Fault(Fault::Ip(0)));
    assert_eq!(
        req(&mut h, 1, Request::Forget { uid: uid("mig-a") }),
        Err(ErrorKind::Kernel)
    );
    assert_eq!(
        h.broker().registrations(),
        1,
        "a failed forget keeps the lease"
    );
    // The lease still rolls the source back.
    ev(&mut h, Op::LeaseLost { conn: 1 });
    assert_eq!(h.kernel().world().nets[&10].canonical(), h_baseline(10));
}

#[test]
fn the_fuzz_targets_seed_corpus_replays_without_a_violation() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/dispatch");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let data = std::fs::read(e.unwrap().path()).unwrap();
        Harness::new().run_bytes(&data, 64).unwrap();
        n += 1;
    }
    assert!(n >= 4, "{n} seeds");
}

#[test]
fn a_lock_the_journal_cannot_hold_is_never_reported_done() {
    // The hand-over off: only the lock's own `ip` calls (see above).
    let mut h = Harness::with_config(podmotion_broker::Config {
        handover_cidrs: Vec::new(),
        ..podmotion_broker::fake::config()
    });
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    // The journal directory is a planted symlink and the undo of the lock fails too
    // (the 7th ip call: the first of the undo, after the listing of the pod's
    // addresses and the lock's five).
    ev(
        &mut h,
        Op::Symlink {
            uid: 0,
            journal: true,
            handover: false,
        },
    );
    ev(&mut h, Op::Fault(Fault::Ip(7)));
    assert_eq!(req(&mut h, 1, lock("mig-a")), Err(ErrorKind::UnsafePath));
    assert_eq!(links_up(&h, 10), ["lo"], "the undo failed: still down");
    // Asking again does not turn the unrecorded lock into a reported one.
    assert_eq!(req(&mut h, 1, lock("mig-a")), Err(ErrorKind::UnsafePath));
    // The broker still knows the lock: forget restores the network.
    assert_eq!(
        req(&mut h, 1, Request::Forget { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    assert_eq!(links_up(&h, 10), ["eth0", "lo", "pm0"]);
}

/// A source the final dump left stopped and locked, fenced (CRIU detached).
fn fenced_source(h: &mut Harness) {
    register(h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(h, 1, lock("mig-a")).unwrap();
    ev(h, Op::Dump { pid: 101 });
    ev(h, Op::Detach { pid: 101 });
    assert_eq!(
        req(h, 1, Request::Fence { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    let w = h.kernel().world();
    let record = w
        .files
        .iter()
        .find(|(p, _)| p.ends_with(".journal/mig-a"))
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
        .expect("journal record");
    assert!(record.contains("\"fenced\":true"), "{record}");
}

/// The tree of 101 is dead (killed, never thawed).
fn killed(h: &Harness) -> bool {
    let w = h.kernel().world();
    w.procs[&101].zombie && w.procs[&102].zombie
}

#[test]
fn a_fenced_source_is_never_resumed_and_its_lost_lease_kills_it() {
    let mut h = Harness::new();
    fenced_source(&mut h);
    assert_eq!(
        req(&mut h, 1, Request::Resume { uid: uid("mig-a") }),
        Err(ErrorKind::Fenced)
    );
    assert!(h.kernel().world().procs[&101].stopped, "still frozen");
    // Fencing again is answered the same.
    assert_eq!(
        req(&mut h, 1, Request::Fence { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    ev(&mut h, Op::LeaseLost { conn: 1 });
    assert!(killed(&h), "the lost lease kills a fenced source");
    assert_eq!(
        links_up(&h, 10),
        ["lo"],
        "its network stays locked, as after a commit"
    );
    let w = h.kernel().world();
    assert!(!w.procs[&100].zombie, "only its tree");
    assert!(w.files.is_empty(), "no journal record is left");
}

#[test]
fn a_restarted_broker_kills_the_fenced_source_its_predecessor_left() {
    let mut h = Harness::new();
    fenced_source(&mut h);
    ev(&mut h, Op::Restart);
    assert!(killed(&h), "recovery kills a fenced source, never thaws it");
    assert!(h.kernel().world().files.is_empty());
}

#[test]
fn an_unfenced_source_is_rolled_back_again_by_a_lost_lease_or_a_restart() {
    for restart in [false, true] {
        let mut h = Harness::new();
        fenced_source(&mut h);
        assert_eq!(
            req(&mut h, 1, Request::Unfence { uid: uid("mig-a") }),
            Ok(Reply::Done)
        );
        ev(
            &mut h,
            if restart {
                Op::Restart
            } else {
                Op::LeaseLost { conn: 1 }
            },
        );
        let w = h.kernel().world();
        for pid in [101, 102] {
            assert!(!w.procs[&pid].zombie && !w.procs[&pid].stopped, "{pid}");
        }
        assert_eq!(w.nets[&10].canonical(), h_baseline(10));
    }
}

#[test]
fn only_a_frozen_locked_source_can_be_fenced() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    assert_eq!(
        req(&mut h, 1, Request::Fence { uid: uid("mig-a") }),
        Err(ErrorKind::NotLocked)
    );
    register(&mut h, 1, "mig-b", BrokerRole::Target, 200).unwrap();
    assert_eq!(
        req(&mut h, 1, Request::Fence { uid: uid("mig-b") }),
        Err(ErrorKind::WrongRole)
    );
    // Not this connection's migration.
    req(&mut h, 1, lock("mig-a")).unwrap();
    assert_eq!(
        req(&mut h, 2, Request::Fence { uid: uid("mig-a") }),
        Err(ErrorKind::Busy)
    );
    // A fence whose journal write fails is not done, and the source stays resumable.
    ev(&mut h, Op::Fault(Fault::Journal));
    assert_eq!(
        req(&mut h, 1, Request::Fence { uid: uid("mig-a") }),
        Err(ErrorKind::Kernel)
    );
    assert_eq!(
        req(&mut h, 1, Request::Resume { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
}

fn announced(h: &Harness) -> Vec<(u32, String, String)> {
    h.kernel()
        .world()
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Announced { netns, link, addr } => Some((*netns, link.clone(), addr.clone())),
            _ => None,
        })
        .collect()
}

/// Every way a lock ends — unlock, a lost lease's rollback, a restarted broker's
/// recovery — ends with the pod announcing its IPv4 and global IPv6 addresses on the
/// links the lock took down (the node's neighbour entry for the pod failed while they
/// were down).
#[test]
fn an_unlocked_source_announces_its_addresses_however_the_lock_ends() {
    let both = vec![
        (10, "eth0".to_owned(), "10.0.10.5".to_owned()),
        (10, "pm0".to_owned(), "10.1.10.5".to_owned()),
        (10, "eth0".to_owned(), "2001:db8:10::5".to_owned()),
        (10, "pm0".to_owned(), "2001:db8:10:1::5".to_owned()),
    ];
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    assert_eq!(announced(&h), [], "nothing is announced while locked");
    req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }).unwrap();
    assert_eq!(announced(&h), both);
    // Nothing locked: nothing to announce.
    req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }).unwrap();
    assert_eq!(announced(&h), []);

    req(&mut h, 1, lock("mig-a")).unwrap();
    ev(&mut h, Op::LeaseLost { conn: 1 });
    assert_eq!(announced(&h), both);

    let mut h = Harness::new();
    register(&mut h, 1, "mig-b", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-b")).unwrap();
    ev(&mut h, Op::Restart);
    assert_eq!(announced(&h), both);
}

/// An announcement that cannot be sent never fails the unlock: the links are up, the
/// routes back and the lock gone; the other addresses are still announced.
#[test]
fn an_announcement_that_fails_never_fails_the_unlock() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    ev(&mut h, Op::Fault(Fault::Announce));
    assert_eq!(
        req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }),
        Ok(Reply::Done)
    );
    assert_eq!(
        announced(&h),
        [
            (10, "pm0".to_owned(), "10.1.10.5".to_owned()),
            (10, "eth0".to_owned(), "2001:db8:10::5".to_owned()),
            (10, "pm0".to_owned(), "2001:db8:10:1::5".to_owned()),
        ]
    );
    assert_eq!(h.kernel().world().nets[&10].canonical(), h_baseline(10));
    assert!(h.kernel().world().files.is_empty(), "the lock is gone");
}

// The address hand-over (`adopt_address`, `release_address`, the sweep). The harness's
// broker allows 10.0.0.0/15 and 2001:db8::/32; the source pod (netns 10) has 10.0.10.5,
// 10.1.10.5, 2001:db8:10::5 and 2001:db8:10:1::5, the target pod (netns 20, holder 200,
// restored tree 201 → 202) 10.0.20.5 and 2001:db8:20::5.

fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap()
}

fn adopt(h: &mut Harness, conn: u64, u: &str, a: &str) -> Result<Reply, ErrorKind> {
    req(
        h,
        conn,
        Request::AdoptAddress {
            uid: uid(u),
            address: ip(a),
        },
    )
}

fn release(h: &mut Harness, conn: u64, u: &str, a: &str) -> Result<Reply, ErrorKind> {
    req(
        h,
        conn,
        Request::ReleaseAddress {
            uid: uid(u),
            address: ip(a),
        },
    )
}

/// The host addresses (`/32`, `/128`) of netns `n`, by link.
fn host_addrs(h: &Harness, n: u32) -> Vec<(String, String)> {
    let w = h.kernel().world();
    let net = &w.nets[&n];
    net.addrs4
        .iter()
        .chain(&net.addrs6)
        .filter(|(c, _)| c.ends_with("/32") || c.ends_with("/128"))
        .map(|(c, l)| (c.clone(), l.clone()))
        .collect()
}

/// The hand-over journal record of `u`, as text.
fn handover_record(h: &Harness, u: &str) -> Option<String> {
    let w = h.kernel().world();
    w.files
        .iter()
        .find(|(p, _)| p.ends_with(format!(".handover/{u}")))
        .map(|(_, b)| String::from_utf8_lossy(b).into_owned())
}

fn addr_effects(h: &Harness) -> Vec<Effect> {
    h.kernel()
        .world()
        .effects
        .iter()
        .filter(|e| {
            matches!(
                e,
                Effect::AddrAdded { .. } | Effect::AddrRemoved { .. } | Effect::Announced { .. }
            )
        })
        .cloned()
        .collect()
}

fn target(h: &mut Harness) {
    register(h, 1, "mig-c", BrokerRole::Target, 200).unwrap();
}

#[test]
fn the_hand_over_is_off_unless_the_installer_gave_cidrs() {
    let mut cfg = podmotion_broker::fake::config();
    cfg.handover_cidrs.clear();
    let mut h = Harness::with_config(cfg);
    target(&mut h);
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.10.5"),
        Err(ErrorKind::HandoverOff)
    );
    assert_eq!(addr_effects(&h), []);
    assert_eq!(host_addrs(&h, 20), []);
    // Nothing was adopted: releasing is done, and changes nothing.
    assert_eq!(release(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    assert!(handover_record(&h, "mig-c").is_none());
}

#[test]
fn an_address_outside_the_cidrs_or_never_a_pods_is_refused() {
    let mut h = Harness::new();
    target(&mut h);
    for a in [
        "10.2.10.5",
        "192.0.2.1",
        "2001:db9::5",
        "127.0.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "169.254.1.1",
        "255.255.255.255",
        "::1",
        "::",
        "ff02::1",
        "fe80::1",
        "::ffff:10.0.10.5",
    ] {
        assert_eq!(
            adopt(&mut h, 1, "mig-c", a),
            Err(ErrorKind::AddressNotAllowed),
            "{a}"
        );
        assert_eq!(addr_effects(&h), [], "{a}");
    }
    assert_eq!(host_addrs(&h, 20), []);
    assert!(handover_record(&h, "mig-c").is_none());
}

#[test]
fn only_the_agent_holding_a_target_adopts_for_it() {
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    assert_eq!(
        adopt(&mut h, 1, "mig-a", "10.0.99.7"),
        Err(ErrorKind::WrongRole)
    );
    assert_eq!(
        release(&mut h, 1, "mig-a", "10.0.99.7"),
        Err(ErrorKind::WrongRole)
    );
    assert_eq!(
        adopt(&mut h, 1, "mig-b", "10.0.99.7"),
        Err(ErrorKind::NotRegistered)
    );
    target(&mut h);
    assert_eq!(adopt(&mut h, 2, "mig-c", "10.0.99.7"), Err(ErrorKind::Busy));
    // The pinned holder's pid now names another process.
    ev(&mut h, Op::Reuse { pid: 200, like: 80 });
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.99.7"),
        Err(ErrorKind::PidReused)
    );
    assert_eq!(host_addrs(&h, 20), []);
    assert_eq!(host_addrs(&h, 30), []);
}

#[test]
fn an_adoption_is_added_journalled_idempotent_and_announced_once_restored() {
    let mut h = Harness::new();
    target(&mut h);
    assert_eq!(adopt(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    assert_eq!(
        addr_effects(&h),
        [
            // Not announced yet: nothing listens there before the restore.
            Effect::AddrAdded {
                netns: 20,
                link: "eth0".into(),
                addr: ip("10.0.10.5")
            },
        ]
    );
    let record = handover_record(&h, "mig-c").expect("journalled");
    for part in [
        r#""address":"10.0.10.5""#,
        r#""link":"eth0""#,
        r#""pid":200"#,
        r#""restored":false"#,
        &format!(
            r#""deadline":{}"#,
            podmotion_broker::fake::UNIX_EPOCH_AT_START + podmotion_broker::fake::LINGER_SECS
        ),
    ] {
        assert!(record.contains(part), "{part} not in {record}");
    }
    // Again: done, and nothing more happens.
    assert_eq!(adopt(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    assert_eq!(addr_effects(&h), []);
    // The target's own address: done, not recorded (not the broker's to take back).
    assert_eq!(adopt(&mut h, 1, "mig-c", "10.0.20.5"), Ok(Reply::Done));
    assert_eq!(addr_effects(&h), []);
    assert!(!handover_record(&h, "mig-c").unwrap().contains("10.0.20.5"));
    // IPv6: a /128.
    assert_eq!(adopt(&mut h, 1, "mig-c", "2001:db8:10::5"), Ok(Reply::Done));
    assert_eq!(
        host_addrs(&h, 20),
        [
            ("10.0.10.5/32".to_owned(), "eth0".to_owned()),
            ("2001:db8:10::5/128".to_owned(), "eth0".to_owned())
        ]
    );
    // The restored tree moved into the holder's cgroup: now every adoption is
    // announced from its link.
    let process = pin(&h, 201);
    assert_eq!(
        req(
            &mut h,
            1,
            Request::MoveCgroup {
                uid: uid("mig-c"),
                process
            }
        ),
        Ok(Reply::Moved { pids: 2 })
    );
    assert_eq!(
        addr_effects(&h),
        [
            Effect::Announced {
                netns: 20,
                link: "eth0".into(),
                addr: "10.0.10.5".into()
            },
            Effect::Announced {
                netns: 20,
                link: "eth0".into(),
                addr: "2001:db8:10::5".into()
            },
        ]
    );
}

#[test]
fn release_withdraws_only_what_was_adopted() {
    let mut h = Harness::new();
    target(&mut h);
    adopt(&mut h, 1, "mig-c", "10.0.10.5").unwrap();
    assert_eq!(release(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    assert_eq!(
        addr_effects(&h),
        [Effect::AddrRemoved {
            netns: 20,
            link: "eth0".into(),
            addr: ip("10.0.10.5")
        }]
    );
    assert_eq!(host_addrs(&h, 20), []);
    assert!(handover_record(&h, "mig-c").is_none());
    // Idempotent; and the pod's own address is never the broker's to remove.
    assert_eq!(release(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    adopt(&mut h, 1, "mig-c", "10.0.20.5").unwrap();
    assert_eq!(release(&mut h, 1, "mig-c", "10.0.20.5"), Ok(Reply::Done));
    assert_eq!(addr_effects(&h), []);
    assert!(
        h.kernel().world().nets[&20]
            .addrs4
            .contains(&("10.0.20.5/24".to_owned(), "eth0".to_owned()))
    );
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
}

#[test]
fn forget_or_a_lost_lease_before_the_restored_tree_moved_withdraws_the_adoption() {
    for lease in [false, true] {
        let mut h = Harness::new();
        target(&mut h);
        adopt(&mut h, 1, "mig-c", "10.0.10.5").unwrap();
        adopt(&mut h, 1, "mig-c", "2001:db8:10::5").unwrap();
        if lease {
            ev(&mut h, Op::LeaseLost { conn: 1 });
        } else {
            req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
        }
        assert_eq!(host_addrs(&h, 20), [], "lease lost: {lease}");
        assert!(handover_record(&h, "mig-c").is_none());
        assert!(h.broker().adoptions().is_empty());
    }
}

/// The target after a restore: holder 200 with the adopted address, the restored tree
/// (201) moved into its cgroup, holding a connection from that address.
fn restored_with_a_connection(h: &mut Harness, a: &str) {
    target(h);
    adopt(h, 1, "mig-c", a).unwrap();
    let process = pin(h, 201);
    assert_eq!(
        req(
            h,
            1,
            Request::MoveCgroup {
                uid: uid("mig-c"),
                process
            }
        ),
        Ok(Reply::Moved { pids: 2 })
    );
    assert!(
        handover_record(h, "mig-c")
            .unwrap()
            .contains(r#""restored":true"#)
    );
    ev(
        h,
        Op::Connect {
            pid: 201,
            address: ip(a),
        },
    );
}

#[test]
fn a_restored_adoption_outlives_the_migration_while_a_connection_uses_it() {
    let mut h = Harness::new();
    restored_with_a_connection(&mut h, "10.0.10.5");
    // Commit: the agent forgets the target; the moved connection runs on.
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
    for secs in [0, 1, 60] {
        ev(&mut h, Op::Sweep { secs });
        assert_eq!(
            host_addrs(&h, 20),
            [("10.0.10.5/32".to_owned(), "eth0".to_owned())]
        );
    }
    assert!(handover_record(&h, "mig-c").is_some());
    // The connection ends (its process exits): the next sweep withdraws the address.
    ev(&mut h, Op::Exit { pid: 201 });
    ev(&mut h, Op::Sweep { secs: 1 });
    assert_eq!(host_addrs(&h, 20), []);
    assert!(handover_record(&h, "mig-c").is_none());
}

#[test]
fn the_deadline_withdraws_an_adoption_whatever_still_uses_it() {
    let mut h = Harness::new();
    restored_with_a_connection(&mut h, "2001:db8:10::5");
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
    ev(
        &mut h,
        Op::Sweep {
            secs: podmotion_broker::fake::LINGER_SECS - 1,
        },
    );
    assert_eq!(host_addrs(&h, 20).len(), 1, "before the deadline");
    ev(&mut h, Op::Sweep { secs: 1 });
    assert_eq!(host_addrs(&h, 20), [], "at the deadline");
    assert!(
        h.kernel().world().procs[&201].sockets.iter().any(|s| s
            .addrs
            .local
            .is_some_and(|l| l.ip() == ip("2001:db8:10::5"))),
        "the connection was still there"
    );
}

#[test]
fn a_restarted_broker_withdraws_unrestored_adoptions_and_keeps_restored_ones_in_use() {
    let mut h = Harness::new();
    restored_with_a_connection(&mut h, "10.0.10.5");
    // Another migration's target (the pod of pid 80, netns 30), not restored yet.
    register(&mut h, 2, "mig-b", BrokerRole::Target, 80).unwrap();
    adopt(&mut h, 2, "mig-b", "10.0.99.7").unwrap();
    assert_eq!(host_addrs(&h, 30).len(), 1);
    ev(&mut h, Op::Restart);
    assert_eq!(
        host_addrs(&h, 30),
        [],
        "its lease ended with the old broker"
    );
    assert_eq!(
        host_addrs(&h, 20),
        [("10.0.10.5/32".to_owned(), "eth0".to_owned())],
        "a moved connection uses it"
    );
    assert_eq!(h.broker().adoptions().keys().collect::<Vec<_>>(), ["mig-c"]);
    ev(&mut h, Op::Exit { pid: 201 });
    ev(&mut h, Op::Sweep { secs: 0 });
    assert_eq!(host_addrs(&h, 20), []);
}

#[test]
fn at_most_eight_addresses_a_migration_and_one_migration_an_address() {
    let mut h = Harness::new();
    target(&mut h);
    for i in 1..=8 {
        assert_eq!(
            adopt(&mut h, 1, "mig-c", &format!("10.0.99.{i}")),
            Ok(Reply::Done)
        );
    }
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.99.9"),
        Err(ErrorKind::AddressNotAllowed)
    );
    register(&mut h, 2, "mig-b", BrokerRole::Target, 80).unwrap();
    assert_eq!(
        adopt(&mut h, 2, "mig-b", "10.0.99.1"),
        Err(ErrorKind::AddressNotAllowed),
        "adopted by mig-c"
    );
    assert_eq!(host_addrs(&h, 30), []);
    assert_eq!(adopt(&mut h, 2, "mig-b", "10.0.99.9"), Ok(Reply::Done));
}

#[test]
fn an_adoption_that_fails_half_way_leaves_nothing() {
    let mut h = Harness::new();
    target(&mut h);
    // The 4th `ip` call (after listing addresses, routes and links): the add.
    ev(&mut h, Op::Fault(Fault::Ip(3)));
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.10.5"),
        Err(ErrorKind::Kernel)
    );
    ev(&mut h, Op::Fault(Fault::Journal));
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.10.5"),
        Err(ErrorKind::Kernel)
    );
    ev(
        &mut h,
        Op::Symlink {
            uid: 0,
            journal: false,
            handover: true,
        },
    );
    assert_eq!(
        adopt(&mut h, 1, "mig-c", "10.0.10.5"),
        Err(ErrorKind::UnsafePath)
    );
    assert_eq!(host_addrs(&h, 20), []);
    assert!(handover_record(&h, "mig-c").is_none());
    // A failed announcement fails nothing.
    let mut h = Harness::new();
    target(&mut h);
    ev(&mut h, Op::Fault(Fault::Announce));
    assert_eq!(adopt(&mut h, 1, "mig-c", "10.0.10.5"), Ok(Reply::Done));
    assert_eq!(host_addrs(&h, 20).len(), 1);
}

#[test]
fn a_move_whose_restore_cannot_be_journalled_is_not_done() {
    let mut h = Harness::new();
    target(&mut h);
    adopt(&mut h, 1, "mig-c", "10.0.10.5").unwrap();
    ev(&mut h, Op::Fault(Fault::Journal));
    let process = pin(&h, 201);
    assert_eq!(
        req(
            &mut h,
            1,
            Request::MoveCgroup {
                uid: uid("mig-c"),
                process
            }
        ),
        Err(ErrorKind::Kernel)
    );
    // Not restored: the end of the registration withdraws it.
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
    assert_eq!(host_addrs(&h, 20), []);
}

#[test]
fn the_address_goes_on_the_default_routes_link_or_else_the_only_link() {
    // The source's holder namespace (netns 10: eth0 and pm0) as a target's: the
    // default route's link.
    let mut h = Harness::new();
    register(&mut h, 1, "mig-b", BrokerRole::Target, 100).unwrap();
    adopt(&mut h, 1, "mig-b", "10.0.99.7").unwrap();
    assert_eq!(
        host_addrs(&h, 10),
        [("10.0.99.7/32".to_owned(), "eth0".to_owned())]
    );
    // No default route: two links, and no telling which; refused, naming them.
    h.kernel()
        .world()
        .nets
        .get_mut(&10)
        .unwrap()
        .routes6
        .retain(|r| !r.starts_with("default"));
    let e = h
        .broker()
        .handle(
            1,
            Request::AdoptAddress {
                uid: uid("mig-b"),
                address: ip("2001:db8:99::7"),
            },
        )
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::Kernel);
    assert!(e.message.contains("eth0, pm0"), "{e}");
    // One link: that one.
    let mut h = Harness::new();
    target(&mut h);
    h.kernel()
        .world()
        .nets
        .get_mut(&20)
        .unwrap()
        .routes4
        .retain(|r| !r.starts_with("default"));
    adopt(&mut h, 1, "mig-c", "10.0.99.7").unwrap();
    assert_eq!(
        host_addrs(&h, 20),
        [("10.0.99.7/32".to_owned(), "eth0".to_owned())]
    );
}

#[test]
fn a_record_whose_holder_died_is_dropped_and_nothing_is_entered() {
    let mut h = Harness::new();
    restored_with_a_connection(&mut h, "10.0.10.5");
    req(&mut h, 1, Request::Forget { uid: uid("mig-c") }).unwrap();
    ev(&mut h, Op::Exit { pid: 200 });
    ev(&mut h, Op::Sweep { secs: 0 });
    assert!(handover_record(&h, "mig-c").is_none());
    assert_eq!(
        addr_effects(&h),
        [],
        "nothing done in a namespace it cannot enter"
    );
}

/// A release whose record cannot be dropped (a symlink planted at the hand-over
/// journal's directory) has withdrawn the address: adopting it again puts it back
/// before answering done (the fuzzer found it answered done with the address gone).
#[test]
fn adopting_again_after_a_release_the_journal_kept_puts_the_address_back() {
    let mut h = Harness::new();
    target(&mut h);
    adopt(&mut h, 1, "mig-c", "10.0.10.5").unwrap();
    adopt(&mut h, 1, "mig-c", "10.0.99.7").unwrap();
    ev(
        &mut h,
        Op::Symlink {
            uid: 0,
            journal: false,
            handover: true,
        },
    );
    assert_eq!(
        release(&mut h, 1, "mig-c", "10.0.99.7"),
        Err(ErrorKind::UnsafePath)
    );
    assert_eq!(host_addrs(&h, 20).len(), 1, "withdrawn, still recorded");
    assert_eq!(adopt(&mut h, 1, "mig-c", "10.0.99.7"), Ok(Reply::Done));
    assert_eq!(host_addrs(&h, 20).len(), 2, "back");
}

fn swept(h: &Harness) -> Vec<Vec<std::net::IpAddr>> {
    h.kernel()
        .world()
        .effects
        .iter()
        .filter_map(|e| match e {
            Effect::Swept { addrs } => Some(addrs.clone()),
            _ => None,
        })
        .collect()
}

/// Whether each sweep started so far is still on.
fn sweeps_on(h: &Harness) -> Vec<bool> {
    h.kernel().world().sweeps.iter().map(|f| f.on()).collect()
}

/// A lock has the node forget the unanswered connections to the pod's addresses that
/// stay (docs/broker-ops.md, `lock_network`) until the unlock: every one without the
/// hand-over, only those outside its CIDRs with it; a second lock starts no second
/// sweep; the unlock, or the registration's end, stops it.
#[test]
fn a_lock_forgets_unanswered_connections_to_the_addresses_that_stay_until_the_unlock() {
    let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
    let mut off = podmotion_broker::fake::config();
    off.handover_cidrs = Vec::new();
    let mut h = Harness::with_config(off.clone());
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    let all = vec![
        ip("10.0.10.5"),
        ip("10.1.10.5"),
        ip("2001:db8:10::5"),
        ip("2001:db8:10:1::5"),
    ];
    let mut got = swept(&h);
    got.iter_mut().for_each(|a| a.sort());
    assert_eq!(
        got,
        vec![{
            let mut a = all.clone();
            a.sort();
            a
        }]
    );
    assert_eq!(sweeps_on(&h), [true], "on while locked");
    req(&mut h, 1, lock("mig-a")).unwrap();
    // (Each step's effects are its own.)
    assert!(swept(&h).is_empty(), "a second lock starts no second sweep");
    assert_eq!(sweeps_on(&h), [true]);
    req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }).unwrap();
    assert!(swept(&h).is_empty(), "an unlock starts none");
    assert_eq!(sweeps_on(&h), [false], "the unlock stops it");

    // A registration that ends locked (forgotten) stops its sweep too.
    let mut h = Harness::with_config(off);
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    assert_eq!(sweeps_on(&h), [true]);
    req(&mut h, 1, Request::Forget { uid: uid("mig-a") }).unwrap();
    assert_eq!(sweeps_on(&h), [false], "the registration's end stops it");

    // The hand-over on for the IPv4 pod network only: the IPv6 addresses stay.
    let mut v4 = podmotion_broker::fake::config();
    v4.handover_cidrs = podmotion_broker::handover::parse_cidrs("10.0.0.0/15").unwrap();
    let mut h = Harness::with_config(v4);
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    let mut got = swept(&h);
    got.iter_mut().for_each(|a| a.sort());
    assert_eq!(
        got,
        vec![vec![ip("2001:db8:10::5"), ip("2001:db8:10:1::5")]]
    );

    // All of them moving (the harness's default CIDRs): nothing to forget.
    let mut h = Harness::new();
    register(&mut h, 1, "mig-a", BrokerRole::Source, 101).unwrap();
    req(&mut h, 1, lock("mig-a")).unwrap();
    req(&mut h, 1, Request::UnlockNetwork { uid: uid("mig-a") }).unwrap();
    assert_eq!(swept(&h), Vec::<Vec<std::net::IpAddr>>::new());
    assert!(sweeps_on(&h).is_empty());
}

fn arp_ignore(h: &Harness, n: u32, link: &str) -> u8 {
    h.kernel().world().nets[&n]
        .arp_ignore
        .get(link)
        .copied()
        .unwrap_or(0)
}

#[test]
fn two_holders_silencing_one_link_give_it_back_its_arp_ignore_in_either_order() {
    // Holders 200 and 201 share netns 20. The second silence once recorded the first's
    // 8 as the link's own value, so withdrawing them first-then-second left the link
    // silent for good (the fuzzer found it through a lost lease, which withdraws in
    // map order).
    for first_released in ["mig-c", "mig-a"] {
        let mut h = Harness::new();
        register(&mut h, 1, "mig-c", BrokerRole::Target, 200).unwrap();
        register(&mut h, 1, "mig-a", BrokerRole::Target, 201).unwrap();
        adopt(&mut h, 1, "mig-c", "10.0.10.5").unwrap();
        adopt(&mut h, 1, "mig-a", "10.0.99.7").unwrap();
        assert_eq!(arp_ignore(&h, 20, "eth0"), 8, "silenced before the restore");
        let (second_released, a1, a2) = if first_released == "mig-c" {
            ("mig-a", "10.0.10.5", "10.0.99.7")
        } else {
            ("mig-c", "10.0.99.7", "10.0.10.5")
        };
        release(&mut h, 1, first_released, a1).unwrap();
        assert_eq!(
            arp_ignore(&h, 20, "eth0"),
            8,
            "{second_released}'s adoption still waits for its restore"
        );
        release(&mut h, 1, second_released, a2).unwrap();
        assert_eq!(
            arp_ignore(&h, 20, "eth0"),
            0,
            "released {first_released} first: the link answers ARP as before"
        );
    }
}
