//! A `Prepare` that fails leaves nothing behind: no checkpoint dir, no registration
//! with the broker (a target's netns bind with it), whichever step failed.

use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use crate::containers::Containers;
use crate::criu::Criu;
use podmotion_wire::broker::{ErrorKind, Reply};
use podmotion_wire::client::TlsFiles;
use podmotion_wire::transfer;
use std::path::PathBuf;

pub(super) const UID: &str = "5f0c2a9e-1b7d-4c3e-8a6f-0d9e8c7b6a51";

/// A certificate naming this agent `agent/node-a` (all `Agent::new` reads of it).
fn agent_tls() -> TlsFiles {
    use rcgen::{CertificateParams, KeyPair, SanType};
    let k = KeyPair::generate().unwrap();
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names.push(SanType::URI(
        identity::agent_uri("node-a").try_into().unwrap(),
    ));
    let c = p.self_signed(&k).unwrap();
    let pem = c.pem().into_bytes();
    TlsFiles::from_pem(pem.clone(), pem, k.serialize_pem().into_bytes())
}

/// An agent whose container `c1` is this test process, with its checkpoints under `dir`.
pub(super) fn agent(dir: &Path, broker_socket: PathBuf) -> Agent {
    let table = dir.join("containers");
    std::fs::write(&table, format!("c1 {}\n", std::process::id())).unwrap();
    Agent::new(Config {
        criu: Criu {
            binary: "/nonexistent/criu".into(),
        },
        containers: Containers::Table { path: table },
        track_mem: false,
        broker_socket,
        checkpoints_root: dir.join("checkpoints"),
        tls: agent_tls(),
        legacy_shared_identity: false,
        freeze_watchdog: FreezeWatchdog {
            margin: std::time::Duration::from_secs(60),
            default_budget: std::time::Duration::from_secs(30),
        },
        broker_call_timeout: std::time::Duration::from_secs(30),
    })
    .unwrap()
}

pub(super) fn prepare_target() -> PrepareRequest {
    PrepareRequest {
        migration_uid: UID.into(),
        role: Role::Target as i32,
        transfer_key: vec![7; transfer::KEY_LEN],
        peer_node: "node-b".into(),
        container_ids: vec!["c1".into()],
        ..Default::default()
    }
}

/// A broker that registers, and answers `BindNetns` with `bind`.
pub(super) fn registers_then(req: &Request, bind: Answer) -> Answer {
    match req {
        Request::Register { .. } => Answer::Reply(Reply::Registered {
            cgroup: "/pods/tgt".into(),
        }),
        Request::BindNetns { .. } => bind,
        _ => Answer::Reply(Reply::Done),
    }
}

#[tokio::test]
async fn a_failed_prepare_leaves_no_checkpoint_dir_and_no_registration() {
    type Case = (&'static str, fn(&Request) -> Answer, tonic::Code);
    let cases: [Case; 3] = [
        (
            "register refused",
            |_| Answer::Refuse(ErrorKind::NoSuchProcess),
            tonic::Code::FailedPrecondition,
        ),
        (
            "bind refused",
            |r| registers_then(r, Answer::Refuse(ErrorKind::Kernel)),
            tonic::Code::FailedPrecondition,
        ),
        (
            "bind answered with something other than a netns path",
            |r| registers_then(r, Answer::Reply(Reply::Done)),
            tonic::Code::Internal,
        ),
    ];
    for (what, script, code) in cases {
        let d = Scratch::new("prepare");
        let broker = FakeBroker::start(&d.0, script);
        let a = agent(&d.0, broker.socket.clone());
        let e = a.prepare_impl(prepare_target()).await.unwrap_err();
        assert_eq!(e.code(), code, "{what}: {e}");
        assert!(
            !d.0.join("checkpoints").join(UID).exists(),
            "{what}: the checkpoint dir was left behind"
        );
        assert!(
            broker.registered().is_empty(),
            "{what}: the broker still holds the registration when Prepare answers ({:?})",
            broker.ops()
        );
        assert!(a.get(UID).is_err(), "{what}: the migration was recorded");
    }
}

#[tokio::test]
async fn a_prepare_that_cannot_reach_the_broker_leaves_no_checkpoint_dir() {
    let d = Scratch::new("prepare");
    let a = agent(&d.0, d.0.join("no-broker.sock"));
    let e = a.prepare_impl(prepare_target()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    assert!(
        !d.0.join("checkpoints").join(UID).exists(),
        "the new checkpoint dir was left behind"
    );
}

#[tokio::test]
async fn a_prepare_that_succeeds_keeps_its_dir_and_registration() {
    let d = Scratch::new("prepare");
    let broker = FakeBroker::start(&d.0, |r| {
        let path = "/run/netns/x".into();
        registers_then(r, Answer::Reply(Reply::NetnsPath { path }))
    });
    let a = agent(&d.0, broker.socket.clone());
    let st = a.prepare_impl(prepare_target()).await.unwrap();
    assert_eq!(st.phase, Phase::Prepared as i32);
    assert!(d.0.join("checkpoints").join(UID).is_dir());
    assert_eq!(broker.registered().len(), 1);
    assert_eq!(broker.ops(), ["register", "bind_netns"]);
}

/// The broker is told the container the operator named (the bare ID, runtime prefix
/// stripped), with the pid it resolved to: the broker pins that pid only if its cgroup
/// is that container's.
#[tokio::test]
async fn the_registration_names_the_container_the_operator_named() {
    let d = Scratch::new("prepare");
    let asked = Arc::new(StdMutex::new(vec![]));
    let asked2 = Arc::clone(&asked);
    let broker = FakeBroker::start(&d.0, move |r| {
        if let Request::Register {
            container, process, ..
        } = r
        {
            asked2
                .lock()
                .unwrap()
                .push((container.to_string(), process.pid));
        }
        let path = "/run/netns/x".into();
        registers_then(r, Answer::Reply(Reply::NetnsPath { path }))
    });
    let a = agent(&d.0, broker.socket.clone());
    let mut r = prepare_target();
    r.container_ids = vec!["containerd://c1".into(), "containerd://c2".into()];
    a.prepare_impl(r).await.unwrap();
    assert_eq!(
        *asked.lock().unwrap(),
        [("c1".to_string(), std::process::id() as i32)]
    );
}

/// A container ID that could not be a runtime's (a path, `..`) fails the Prepare as an
/// invalid argument before the broker is asked anything or a checkpoint dir is made.
#[tokio::test]
async fn a_malformed_container_id_is_refused_before_anything_is_registered() {
    for bad in [
        "containerd://../x",
        "c1/../../etc",
        "containerd://..",
        "a b",
    ] {
        let d = Scratch::new("prepare");
        let table = d.0.join("containers");
        let broker = FakeBroker::start(&d.0, |r| registers_then(r, Answer::Reply(Reply::Done)));
        let a = agent(&d.0, broker.socket.clone());
        // The table would resolve it: only its form refuses it.
        std::fs::write(&table, format!("{bad} {}\n", std::process::id())).unwrap();
        let mut r = prepare_target();
        r.container_ids = vec![bad.into()];
        let e = a.prepare_impl(r).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}: {e}");
        assert!(broker.ops().is_empty(), "{bad:?}: {:?}", broker.ops());
        assert!(!d.0.join("checkpoints").join(UID).exists(), "{bad:?}");
        assert!(a.get(UID).is_err(), "{bad:?}: the migration was recorded");
    }
}
