//! The broker's locking (issue 16 finding 8): one migration's slow kernel work does not
//! hold up another migration's ops on the same node, while the ops of one migration
//! still run one at a time and a lease lost or a `forget` during an op undoes what the
//! op left. Over the simulated node (`podmotion_broker::fake`), with one `ip` call held
//! on purpose ([`FakeKernel::pause_in_netns`]). And a broker's recovery of what its
//! predecessor left: a broker that dies or is stopped in the middle of it leaves no
//! source frozen. No root needed.

use podmotion_broker::fake::{FakeKernel, PODS_ROOT, Pause, RUN_DIR, World};
use podmotion_broker::{Broker, Config};
use podmotion_wire::broker::{BrokerRole, ErrorKind, Reply, Request};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// How long a test waits for what must happen (reached only when it does not).
const PATIENCE: Duration = Duration::from_secs(10);
/// How long a test watches for what must not happen yet (it cannot fail a correct
/// broker, only miss a wrong one).
const A_WHILE: Duration = Duration::from_millis(200);

type Outcome = Result<Reply, ErrorKind>;

fn broker() -> (FakeKernel, Arc<Broker<FakeKernel>>) {
    let k = FakeKernel::new(World::standard());
    (k.clone(), broker_over(&k))
}

/// A broker over `k`'s node (a new one over the same node is a restarted broker).
fn broker_over(k: &FakeKernel) -> Arc<Broker<FakeKernel>> {
    let cfg = Config {
        run_dir: RUN_DIR.into(),
        pods_cgroup_root: PODS_ROOT.into(),
        allowed_uid: 0,
        same_netns_peers: true,
        container_cgroups: true,
        handover_cidrs: Vec::new(),
        address_linger: std::time::Duration::from_secs(3600),
        sweep_interval: std::time::Duration::from_secs(2),
        hold_neighbours: false,
        forward_new_connections: false,
    };
    Broker::with_kernel(cfg, k.clone())
}

fn uid(s: &str) -> MigrationUid {
    MigrationUid::parse(s).unwrap()
}

fn pin(k: &FakeKernel, pid: i32) -> ProcRef {
    let start_time = k.world().procs[&pid].start_time;
    ProcRef { pid, start_time }
}

fn call(b: &Broker<FakeKernel>, conn: u64, req: Request) -> Outcome {
    b.handle(conn, req).map_err(|e| e.kind)
}

fn register(
    b: &Broker<FakeKernel>,
    k: &FakeKernel,
    conn: u64,
    u: &str,
    role: BrokerRole,
    pid: i32,
) -> Outcome {
    let process = pin(k, pid);
    let container = k.world().container_of(pid);
    call(
        b,
        conn,
        Request::Register {
            uid: uid(u),
            role,
            process,
            container,
        },
    )
}

/// Runs `f` on its own thread; its result arrives on the returned channel.
fn spawn<T: Send + 'static>(
    b: &Arc<Broker<FakeKernel>>,
    f: impl FnOnce(&Broker<FakeKernel>) -> T + Send + 'static,
) -> Receiver<T> {
    let (tx, rx) = channel();
    let b = Arc::clone(b);
    std::thread::spawn(move || {
        let _ = tx.send(f(&b));
    });
    rx
}

fn links_up(k: &FakeKernel, netns: u32) -> Vec<String> {
    k.world().links_up(netns)
}

fn journal(k: &FakeKernel) -> Vec<String> {
    let w = k.world();
    w.files
        .keys()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// Source mig-a (pid 101, netns 10) registered by connection 1, and its
/// `lock_network` started on its own thread and held inside its `ip` calls.
fn a_lock_held(k: &FakeKernel, b: &Arc<Broker<FakeKernel>>) -> (Pause, Receiver<Outcome>) {
    assert!(matches!(
        register(b, k, 1, "mig-a", BrokerRole::Source, 101),
        Ok(Reply::Registered { .. })
    ));
    let pause = k.pause_in_netns(101);
    let lock = spawn(b, |b| {
        call(
            b,
            1,
            Request::LockNetwork {
                uid: uid("mig-a"),
                hold: None,
            },
        )
    });
    assert!(
        pause.arrived(PATIENCE),
        "mig-a's lock never reached its ip calls"
    );
    (pause, lock)
}

#[test]
fn a_slow_lock_of_one_migration_does_not_hold_up_another_migrations_ops() {
    let (k, b) = broker();
    let (pause, lock_a) = a_lock_held(&k, &b);
    // Meanwhile a second agent connection: a target's whole life (register, bind,
    // read its addresses, unbind, forget), and a third migration's source locked and
    // unlocked (its own `ip` calls, in another namespace).
    let k2 = k.clone();
    let others = spawn(&b, move |b| {
        let (t, c) = (uid("mig-b"), uid("mig-c"));
        vec![
            register(b, &k2, 2, "mig-b", BrokerRole::Target, 200),
            call(b, 2, Request::BindNetns { uid: t.clone() }),
            call(b, 2, Request::NetnsAddrs { uid: t.clone() }),
            call(b, 2, Request::UnbindNetns { uid: t.clone() }),
            call(b, 2, Request::Forget { uid: t }),
            register(b, &k2, 2, "mig-c", BrokerRole::Source, 80),
            call(
                b,
                2,
                Request::LockNetwork {
                    uid: c.clone(),
                    hold: None,
                },
            ),
            call(b, 2, Request::UnlockNetwork { uid: c.clone() }),
            call(b, 2, Request::Forget { uid: c }),
        ]
    });
    let done = others.recv_timeout(PATIENCE).expect(
        "the other migrations' ops did not complete while mig-a's lock was held: one migration's kernel work blocks the node's broker",
    );
    for (i, r) in done.iter().enumerate() {
        assert!(r.is_ok(), "op {i} of the other migrations: {r:?}");
    }
    assert_eq!(links_up(&k, 30), ["eth0", "lo"], "mig-c's network is back");
    // ...and all of that while mig-a's lock was still held.
    assert_eq!(lock_a.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty));
    pause.release();
    assert_eq!(lock_a.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    assert_eq!(links_up(&k, 10), ["lo"]);
    assert_eq!(journal(&k), ["mig-a"]);
    assert_eq!(b.registrations(), 1);
}

#[test]
fn the_ops_of_one_migration_still_run_one_at_a_time() {
    let (k, b) = broker();
    let (pause, lock) = a_lock_held(&k, &b);
    let unlock = spawn(&b, |b| {
        call(b, 1, Request::UnlockNetwork { uid: uid("mig-a") })
    });
    assert_eq!(
        unlock.recv_timeout(A_WHILE),
        Err(RecvTimeoutError::Timeout),
        "an unlock ran beside its migration's lock"
    );
    pause.release();
    assert_eq!(lock.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    // The unlock ran after the lock and undid it.
    assert_eq!(unlock.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    assert_eq!(links_up(&k, 10), ["eth0", "lo", "pm0"]);
    assert!(journal(&k).is_empty());
}

#[test]
fn a_lease_lost_during_an_op_rolls_back_what_the_op_left() {
    let (k, b) = broker();
    let (pause, lock) = a_lock_held(&k, &b);
    let lost = spawn(&b, |b| b.lease_lost(1));
    assert_eq!(
        lost.recv_timeout(A_WHILE),
        Err(RecvTimeoutError::Timeout),
        "the lease rollback ran beside the op it must undo"
    );
    // Until the rollback is done the process stays pinned: a new agent cannot lock
    // the network the rollback is about to restore.
    let k3 = k.clone();
    let again = spawn(&b, move |b| {
        register(b, &k3, 3, "mig-x", BrokerRole::Source, 101)
    });
    assert_eq!(
        again.recv_timeout(PATIENCE),
        Ok(Err(ErrorKind::AlreadyRegistered)),
        "a register on another connection waited for mig-a's lock"
    );
    pause.release();
    assert_eq!(lock.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    assert_eq!(lost.recv_timeout(PATIENCE), Ok(()));
    assert_eq!(links_up(&k, 10), ["eth0", "lo", "pm0"], "rolled back");
    assert!(journal(&k).is_empty());
    assert_eq!(b.registrations(), 0);
    assert_eq!(
        call(&b, 1, Request::NetnsAddrs { uid: uid("mig-a") }),
        Err(ErrorKind::NotRegistered)
    );
    assert!(matches!(
        register(&b, &k, 3, "mig-a", BrokerRole::Source, 101),
        Ok(Reply::Registered { .. })
    ));
}

#[test]
fn a_forget_during_an_op_undoes_what_the_op_left() {
    let (k, b) = broker();
    let (pause, lock) = a_lock_held(&k, &b);
    let forget = spawn(&b, |b| call(b, 1, Request::Forget { uid: uid("mig-a") }));
    assert_eq!(forget.recv_timeout(A_WHILE), Err(RecvTimeoutError::Timeout));
    pause.release();
    assert_eq!(lock.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    assert_eq!(forget.recv_timeout(PATIENCE), Ok(Ok(Reply::Done)));
    assert_eq!(links_up(&k, 10), ["eth0", "lo", "pm0"]);
    assert!(journal(&k).is_empty());
    assert_eq!(b.registrations(), 0);
}

#[test]
fn one_process_registered_from_two_connections_at_once_is_pinned_once() {
    for same_uid in [false, true] {
        for _ in 0..50 {
            let (k, b) = broker();
            let start = Arc::new(Barrier::new(2));
            let racers: Vec<_> = [(1, "mig-a"), (2, if same_uid { "mig-a" } else { "mig-b" })]
                .into_iter()
                .map(|(conn, u)| {
                    let (k, start) = (k.clone(), Arc::clone(&start));
                    spawn(&b, move |b| {
                        start.wait();
                        register(b, &k, conn, u, BrokerRole::Source, 101)
                    })
                })
                .collect();
            let mut outcomes: Vec<Outcome> = racers
                .iter()
                .map(|r| r.recv_timeout(PATIENCE).expect("register answered"))
                .collect();
            outcomes.sort_by_key(|o| o.is_err());
            assert!(
                matches!(outcomes[0], Ok(Reply::Registered { .. })),
                "{outcomes:?}"
            );
            assert_eq!(
                outcomes[1],
                Err(ErrorKind::AlreadyRegistered),
                "{outcomes:?}"
            );
            assert_eq!(b.registrations(), 1);
        }
    }
}

/// Source mig-a (pid 101, netns 10) locked by connection 1 and left stopped, as CRIU
/// leaves a dumped source; then its broker dies (dropped: no lease ends) and a new one
/// starts over the same node, its recovery held inside its `ip` calls for pid 101.
fn a_recovery_held(k: &FakeKernel) -> (Pause, Arc<Broker<FakeKernel>>, Receiver<Vec<String>>) {
    let dead = broker_over(k);
    assert!(matches!(
        register(&dead, k, 1, "mig-a", BrokerRole::Source, 101),
        Ok(Reply::Registered { .. })
    ));
    let lock = Request::LockNetwork {
        uid: uid("mig-a"),
        hold: None,
    };
    assert_eq!(call(&dead, 1, lock), Ok(Reply::Done));
    k.world().procs.get_mut(&101).expect("pid 101").stopped = true;
    drop(dead);
    assert_eq!(journal(k), ["mig-a"]);
    let next = broker_over(k);
    let pause = k.pause_in_netns(101);
    let recovered = spawn(&next, |b| b.recover());
    assert!(
        pause.arrived(PATIENCE),
        "the recovery never reached mig-a's ip calls"
    );
    (pause, next, recovered)
}

/// A broker that dies while it rolls back what its predecessor left (the agent pod
/// deleted while the restarted broker waits on the source: seen once in a rehearsal,
/// the source frozen for good) leaves the journal's record to the next broker, which
/// rolls the source back.
#[test]
fn a_broker_dying_in_its_recovery_leaves_the_source_to_the_next() {
    let k = FakeKernel::new(World::standard());
    let (pause, dying, _recovered) = a_recovery_held(&k);
    assert_eq!(
        journal(&k),
        ["mig-a"],
        "the record went before the rollback was done"
    );
    assert!(dying.recovering());
    // It dies here (its thread stays held): the next broker over the node.
    let third = broker_over(&k);
    assert_eq!(third.recover(), ["mig-a"]);
    assert_eq!(links_up(&k, 10), ["eth0", "lo", "pm0"], "rolled back");
    assert!(!k.world().procs[&101].stopped, "the source was not resumed");
    assert!(journal(&k).is_empty());
    drop(pause);
}

/// A broker told to stop while it recovers lets the recovery finish (within its
/// grace) before it ends, so that it leaves no source frozen behind it.
#[test]
fn a_broker_stopped_in_its_recovery_finishes_it_first() {
    let k = FakeKernel::new(World::standard());
    let (pause, b, recovered) = a_recovery_held(&k);
    let stopped = spawn(&b, |b| b.stop(PATIENCE));
    assert_eq!(
        stopped.recv_timeout(A_WHILE),
        Err(RecvTimeoutError::Timeout),
        "the broker stopped in the middle of its recovery"
    );
    pause.release();
    assert_eq!(
        recovered.recv_timeout(PATIENCE),
        Ok(vec!["mig-a".to_string()])
    );
    assert_eq!(stopped.recv_timeout(PATIENCE), Ok(0));
    assert!(!k.world().procs[&101].stopped, "the source was not resumed");
    assert!(journal(&k).is_empty());
    assert!(!b.recovering());
}
