//! `forward_connections` over the simulated node (`podmotion_broker::fake`): when the
//! node forwards a locked source's new connections to its target, and that every way a
//! migration ends takes the forward with it (stop, unlock, kill, forget, a lost lease,
//! the broker's SIGTERM, a broker restart), with the harness's invariants after every
//! step. No root needed.

use podmotion_broker::fake::{Fault, Harness, Op, RUN_DIR, config};
use podmotion_wire::broker::{BrokerRole, ErrorKind, ForwardedService, Reply, Request};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::net::IpAddr;
use std::path::Path;

const UID: &str = "mig-a";
const TABLE: &str = "podmotion-fwd-mig-a";
/// The target pod's address (the fake's netns 20).
const TARGET: &str = "10.0.20.5";

/// The chart's default: no address hand-over (the source's addresses stay).
fn harness() -> Harness {
    let mut cfg = config();
    cfg.handover_cidrs = Vec::new();
    Harness::with_config(cfg)
}

fn uid() -> MigrationUid {
    MigrationUid::parse(UID).unwrap()
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

fn forward(targets: &[&str]) -> Request {
    Request::ForwardConnections {
        uid: uid(),
        targets: targets.iter().map(|t| t.parse().unwrap()).collect(),
        services: vec![ForwardedService {
            address: "10.96.0.10".parse().unwrap(),
            port: 80,
            target_port: 8080,
        }],
    }
}

/// The source (pid 101, netns 10) registered on connection 1 and locked.
fn locked_source(h: &mut Harness) {
    registered_source(h);
    assert_eq!(
        req(
            h,
            1,
            Request::LockNetwork {
                uid: uid(),
                hold: Some(vec![])
            }
        ),
        Ok(Reply::Done)
    );
    assert_eq!(req(h, 1, Request::Fence { uid: uid() }), Ok(Reply::Done));
}

/// The node's forward table of the migration, if any.
fn table(h: &Harness) -> Option<String> {
    let w = h.kernel().world();
    w.nets[&w.node_netns].nft.get(TABLE).cloned()
}

fn journalled(h: &Harness) -> bool {
    let p = Path::new(RUN_DIR).join("netns").join(".forward").join(UID);
    h.kernel().world().files.contains_key(&p)
}

fn forwarding_source(h: &mut Harness) {
    locked_source(h);
    assert_eq!(req(h, 1, forward(&[TARGET])), Ok(Reply::Done));
    let t = table(h).expect("the node forwards once asked");
    assert!(journalled(h));
    // The source's own addresses (read by the broker at the lock, IPv4 here: the
    // target has no IPv6 address) and the Service's port, to the target.
    for rule in [
        "ip daddr 10.0.10.5 meta l4proto tcp ct state new dnat ip to 10.0.20.5",
        "ip daddr 10.1.10.5 meta l4proto tcp ct state new dnat ip to 10.0.20.5",
        "ip daddr 10.96.0.10 tcp dport 80 ct state new dnat ip to 10.0.20.5:8080",
        "ct original ip daddr 10.0.10.5 ip daddr 10.0.20.5 meta l4proto tcp masquerade",
    ] {
        assert!(t.contains(rule), "{rule} missing from {t}");
    }
    assert!(!t.contains("ip6"), "no IPv6 target, no IPv6 rule: {t}");
}

#[test]
fn a_locked_source_forwards_to_its_target_until_its_unlock() {
    let mut h = harness();
    forwarding_source(&mut h);
    // Asked again (the operator's retry): replaced, still one table.
    assert_eq!(
        req(&mut h, 1, forward(&[TARGET, "2001:db8:20::5"])),
        Ok(Reply::Done)
    );
    let t = table(&h).unwrap();
    assert!(
        t.contains(
            "ip6 daddr 2001:db8:10::5 meta l4proto tcp ct state new dnat ip6 to 2001:db8:20::5"
        ),
        "{t}"
    );
    assert_eq!(
        req(&mut h, 1, Request::UnlockNetwork { uid: uid() }),
        Ok(Reply::Done)
    );
    assert_eq!(table(&h), None, "the unlock ends the forward");
    assert!(!journalled(&h));
    // Unlocked: nothing to forward any more.
    assert_eq!(
        req(&mut h, 1, forward(&[TARGET])),
        Err(ErrorKind::NotLocked)
    );
    assert_eq!(table(&h), None);
}

#[test]
fn stop_kill_forget_a_lost_lease_and_sigterm_each_end_the_forward() {
    type End = (&'static str, fn(&mut Harness));
    let ends: [End; 5] = [
        ("stop_forwarding", |h| {
            assert_eq!(
                req(h, 1, Request::StopForwarding { uid: uid() }),
                Ok(Reply::Done)
            );
        }),
        ("kill", |h| {
            assert_eq!(req(h, 1, Request::Kill { uid: uid() }), Ok(Reply::Done));
        }),
        ("forget", |h| {
            assert_eq!(req(h, 1, Request::Forget { uid: uid() }), Ok(Reply::Done));
        }),
        ("lease lost", |h| ev(h, Op::LeaseLost { conn: 1 })),
        // SIGTERM, its grace over with the registration still held.
        ("the broker's stop", |h| {
            assert_eq!(h.broker().stop(std::time::Duration::ZERO), 1);
        }),
    ];
    for (what, end) in ends {
        let mut h = harness();
        forwarding_source(&mut h);
        end(&mut h);
        assert_eq!(table(&h), None, "{what} left the forward");
        assert!(!journalled(&h), "{what} left the forward's record");
    }
}

#[test]
fn a_restarted_broker_removes_the_forwards_its_predecessor_left() {
    let mut h = harness();
    forwarding_source(&mut h);
    ev(&mut h, Op::Restart);
    assert_eq!(table(&h), None);
    assert!(!journalled(&h));
}

#[test]
fn a_forward_the_node_refused_leaves_nothing_and_a_failed_removal_is_tried_again() {
    let mut h = harness();
    locked_source(&mut h);
    ev(&mut h, Op::Fault(Fault::Nft));
    assert_eq!(req(&mut h, 1, forward(&[TARGET])), Err(ErrorKind::Kernel));
    assert_eq!(table(&h), None);
    assert!(!journalled(&h), "a refused forward is not journalled");

    // `stop_forwarding` answers the failure, and the forward stays (journalled).
    assert_eq!(req(&mut h, 1, forward(&[TARGET])), Ok(Reply::Done));
    ev(&mut h, Op::Fault(Fault::Nft));
    assert_eq!(
        req(&mut h, 1, Request::StopForwarding { uid: uid() }),
        Err(ErrorKind::Kernel)
    );
    assert!(table(&h).is_some() && journalled(&h));
    // `forget`'s first removal (before the unlock) fails: the registration's end
    // tries again, and nothing is left.
    ev(&mut h, Op::Fault(Fault::Nft));
    assert_eq!(
        req(&mut h, 1, Request::Forget { uid: uid() }),
        Ok(Reply::Done)
    );
    assert_eq!(table(&h), None);
    assert!(!journalled(&h));
}

#[test]
fn only_a_locked_source_forwards_and_only_to_a_pods_address_where_the_installer_allows() {
    let mut h = harness();
    assert_eq!(
        req(&mut h, 1, forward(&[TARGET])),
        Err(ErrorKind::NotRegistered)
    );
    // A target's registration never forwards.
    let start_time = h.kernel().world().procs[&200].start_time;
    let container = h.kernel().world().container_of(200);
    let r = req(
        &mut h,
        2,
        Request::Register {
            uid: MigrationUid::parse("mig-t").unwrap(),
            role: BrokerRole::Target,
            process: ProcRef {
                pid: 200,
                start_time,
            },
            container,
        },
    );
    assert!(matches!(r, Ok(Reply::Registered { .. })));
    let mut to_target = forward(&[TARGET]);
    if let Request::ForwardConnections { uid, .. } = &mut to_target {
        *uid = MigrationUid::parse("mig-t").unwrap();
    }
    assert_eq!(req(&mut h, 2, to_target), Err(ErrorKind::WrongRole));

    locked_source(&mut h);
    // Never to a loopback, link-local or multicast address, nor the source's own.
    for bad in ["127.0.0.1", "169.254.1.1", "224.0.0.1", "10.0.10.5"] {
        assert_eq!(
            req(&mut h, 1, forward(&[bad])),
            Err(ErrorKind::AddressNotAllowed),
            "{bad}"
        );
    }
    let mut bad_service = forward(&[TARGET]);
    if let Request::ForwardConnections { services, .. } = &mut bad_service {
        services[0].address = "127.0.0.53".parse::<IpAddr>().unwrap();
    }
    assert_eq!(
        req(&mut h, 1, bad_service),
        Err(ErrorKind::AddressNotAllowed)
    );
    assert_eq!(table(&h), None);

    // The installer's switch.
    let mut cfg = config();
    cfg.handover_cidrs = Vec::new();
    cfg.forward_new_connections = false;
    let mut h = Harness::with_config(cfg);
    locked_source(&mut h);
    assert_eq!(
        req(&mut h, 1, forward(&[TARGET])),
        Err(ErrorKind::ForwardOff)
    );
    assert_eq!(table(&h), None);
}

/// With the address hand-over on, the source's addresses move with it: only the
/// Services' ports are forwarded (their DNAT would otherwise pick the source).
#[test]
fn with_the_hand_over_only_the_services_are_forwarded() {
    let mut h = Harness::new();
    locked_source(&mut h);
    assert_eq!(req(&mut h, 1, forward(&[TARGET])), Ok(Reply::Done));
    let t = table(&h).unwrap();
    assert!(t.contains("ip daddr 10.96.0.10 tcp dport 80"), "{t}");
    assert!(!t.contains("10.0.10.5") && !t.contains("masquerade"), "{t}");
}

/// Locked but not fenced (the target was never asked to restore): nothing forwarded.
#[test]
fn a_source_not_fenced_is_not_forwarded() {
    let mut h = harness();
    locked_source(&mut h);
    assert_eq!(
        req(&mut h, 1, Request::Unfence { uid: uid() }),
        Ok(Reply::Done)
    );
    assert_eq!(
        req(&mut h, 1, forward(&[TARGET])),
        Err(ErrorKind::NotLocked)
    );
    assert_eq!(table(&h), None);
}

// ---- The lock's hold of new connections (`synhold`): from the lock to the forward.

const CHAIN: &str = "pm-hold-mig-a";

fn lock_with(h: &mut Harness, services: Vec<ForwardedService>) -> Result<Reply, ErrorKind> {
    req(
        h,
        1,
        Request::LockNetwork {
            uid: uid(),
            hold: Some(services),
        },
    )
}

fn registered_source(h: &mut Harness) {
    let start_time = h.kernel().world().procs[&101].start_time;
    let container = h.kernel().world().container_of(101);
    let r = req(
        h,
        1,
        Request::Register {
            uid: uid(),
            role: BrokerRole::Source,
            process: ProcRef {
                pid: 101,
                start_time,
            },
            container,
        },
    );
    assert!(matches!(r, Ok(Reply::Registered { .. })), "{r:?}");
}

fn service() -> ForwardedService {
    ForwardedService {
        address: "10.96.0.10".parse().unwrap(),
        port: 80,
        target_port: 0,
    }
}

/// How the hold of `CHAIN` ended, if it did.
fn hold_end(h: &Harness) -> Option<podmotion_broker::synhold::End> {
    h.kernel()
        .world()
        .effects
        .iter()
        .rev()
        .find_map(|e| match e {
            podmotion_broker::fake::Effect::HoldEnded { chain, how } if chain == CHAIN => {
                Some(*how)
            }
            _ => None,
        })
}

fn holding(h: &Harness) -> Option<podmotion_broker::synhold::Held> {
    h.kernel().world().holds.get(CHAIN).cloned()
}

#[test]
fn a_lock_holds_new_connections_until_the_forward_lets_them_meet_it() {
    let mut h = harness();
    registered_source(&mut h);
    assert_eq!(lock_with(&mut h, vec![service()]), Ok(Reply::Done));
    let held = holding(&h).expect("the lock holds new connections");
    let ip = |a: &str| a.parse::<IpAddr>().unwrap();
    assert!(held.addresses.contains(&ip("10.0.10.5")), "{held:?}");
    assert_eq!(held.services, vec![(ip("10.96.0.10"), 80)]);
    assert_eq!(hold_end(&h), None);
    assert_eq!(
        req(&mut h, 1, Request::Fence { uid: uid() }),
        Ok(Reply::Done)
    );
    assert_eq!(req(&mut h, 1, forward(&[TARGET])), Ok(Reply::Done));
    assert!(table(&h).is_some());
    assert_eq!(holding(&h), None, "the forward ends the hold");
    assert_eq!(hold_end(&h), Some(podmotion_broker::synhold::End::Release));
}

#[test]
fn an_unlock_releases_the_held_to_a_rolled_back_source_and_drops_them_before_a_kill() {
    use podmotion_broker::synhold::End;
    for (fenced, expected) in [(false, End::Release), (true, End::Drop)] {
        let mut h = harness();
        registered_source(&mut h);
        assert_eq!(lock_with(&mut h, vec![]), Ok(Reply::Done));
        if fenced {
            assert_eq!(
                req(&mut h, 1, Request::Fence { uid: uid() }),
                Ok(Reply::Done)
            );
        }
        assert_eq!(
            req(&mut h, 1, Request::UnlockNetwork { uid: uid() }),
            Ok(Reply::Done)
        );
        assert_eq!(holding(&h), None, "fenced {fenced}");
        assert_eq!(hold_end(&h), Some(expected), "fenced {fenced}");
    }
}

#[test]
fn kill_forget_a_lost_lease_sigterm_and_a_restart_each_drop_the_hold() {
    type Ending = (&'static str, fn(&mut Harness));
    let ends: [Ending; 5] = [
        ("kill", |h| {
            assert_eq!(req(h, 1, Request::Kill { uid: uid() }), Ok(Reply::Done));
        }),
        ("forget", |h| {
            assert_eq!(req(h, 1, Request::Forget { uid: uid() }), Ok(Reply::Done));
        }),
        ("lease lost", |h| ev(h, Op::LeaseLost { conn: 1 })),
        ("the broker's stop", |h| {
            assert_eq!(h.broker().stop(std::time::Duration::ZERO), 1);
        }),
        ("a restart", |h| ev(h, Op::Restart)),
    ];
    for (what, end) in ends {
        let mut h = harness();
        locked_source(&mut h);
        assert!(holding(&h).is_some(), "{what}");
        end(&mut h);
        assert_eq!(holding(&h), None, "{what} left the hold");
        assert_eq!(
            hold_end(&h),
            Some(podmotion_broker::synhold::End::Drop),
            "{what}"
        );
    }
}

#[test]
fn without_forwarding_nothing_is_held_and_a_hostile_service_locks_nothing() {
    let mut cfg = config();
    cfg.handover_cidrs = Vec::new();
    cfg.forward_new_connections = false;
    let mut h = Harness::with_config(cfg);
    registered_source(&mut h);
    assert_eq!(lock_with(&mut h, vec![service()]), Ok(Reply::Done));
    assert_eq!(holding(&h), None);

    let mut h = harness();
    registered_source(&mut h);
    for bad in ["127.0.0.1", "0.0.0.0", "224.0.0.1"] {
        let s = ForwardedService {
            address: bad.parse().unwrap(),
            ..service()
        };
        assert_eq!(
            lock_with(&mut h, vec![s]),
            Err(ErrorKind::AddressNotAllowed),
            "{bad}"
        );
        assert_eq!(holding(&h), None, "{bad}");
        let w = h.kernel().world();
        assert!(
            !w.effects
                .iter()
                .any(|e| matches!(e, podmotion_broker::fake::Effect::LinkDown { .. })),
            "{bad}: locked"
        );
    }
}

#[test]
fn a_restarted_broker_removes_the_holds_it_recorded_and_no_other_brokers() {
    let mut h = harness();
    locked_source(&mut h);
    // Another broker's hold on a node sharing this network namespace.
    h.kernel()
        .world()
        .holds
        .insert("pm-hold-of-another-broker".into(), Default::default());
    ev(&mut h, Op::Restart);
    let w = h.kernel().world();
    assert!(!w.holds.contains_key(CHAIN), "its own hold stayed");
    assert!(
        w.holds.contains_key("pm-hold-of-another-broker"),
        "another broker's hold was removed"
    );
    let record = Path::new(RUN_DIR).join("netns").join(".hold").join(UID);
    assert!(!w.files.contains_key(&record), "its record stayed");
}
