//! The target's side of the address hand-over, against a scripted broker: before the
//! restore the target asks the broker to take over the source pod's addresses that the
//! dumped connections use, and gives back what it took whenever the restore is undone
//! (before anything would kill the holder), so the resumed source is the only one
//! answering for its address.

use super::prepare_tests::{UID, agent, prepare_target, registers_then};
use super::testkit::{Answer, FakeBroker, Scratch, manifest};
use super::*;
use podmotion_wire::agent::ManifestSocket;
use podmotion_wire::broker::{ErrorKind, Reply};
use std::path::PathBuf;

/// The source's address (where its connection was) and the target's own.
const SOURCE_IP: &str = "198.18.0.7";
const TARGET_IP: &str = "198.18.1.9";

fn socket(local: &str, listening: bool) -> ManifestSocket {
    ManifestSocket {
        local: local.into(),
        remote: if listening { "" } else { "198.18.255.1:41000" }.into(),
        listening,
    }
}

/// A target agent that has received a dump of `sockets` under `tcp` (its CRIU does not
/// exist: a restore that gets that far fails there).
async fn received(
    d: &Scratch,
    broker: &FakeBroker,
    tcp: TcpPreservation,
    sockets: Vec<ManifestSocket>,
) -> Agent {
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(prepare_target()).await.unwrap();
    let m = a.get(UID).unwrap();
    let mut m = m.lock().await;
    std::fs::create_dir_all(m.dir.join("final")).unwrap();
    let manifest = manifest(tcp, sockets);
    std::fs::write(
        m.dir.join("manifest.json"),
        serde_json::to_vec(&manifest).unwrap(),
    )
    .unwrap();
    m.phase = Phase::Received;
    drop(m);
    a
}

/// A broker for a target whose namespace has only its own address; `adopt` answers
/// each `adopt_address` (its count so far given).
fn broker(
    d: &Scratch,
    netns: PathBuf,
    mut adopt: impl FnMut(usize) -> Answer + Send + 'static,
) -> FakeBroker {
    let mut adopted = 0;
    FakeBroker::start(&d.0, move |r| match r {
        Request::NetnsAddrs { .. } => Answer::Reply(Reply::Addrs {
            addrs: vec![TARGET_IP.into()],
        }),
        Request::AdoptAddress { .. } => {
            adopted += 1;
            adopt(adopted)
        }
        _ => registers_then(
            r,
            Answer::Reply(Reply::NetnsPath {
                path: netns.display().to_string(),
            }),
        ),
    })
}

fn restore_ops(b: &FakeBroker) -> Vec<&'static str> {
    b.ops().into_iter().skip(2).collect() // after register, bind_netns
}

#[tokio::test]
async fn strict_without_the_hand_over_is_refused_and_takes_nothing() {
    let d = Scratch::new("handover");
    let b = broker(&d, d.0.join("netns"), |_| {
        Answer::Refuse(ErrorKind::HandoverOff)
    });
    let conn = socket(&format!("{SOURCE_IP}:8080"), false);
    let a = received(&d, &b, TcpPreservation::Strict, vec![conn]).await;
    let e = a.restore_impl(UID).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("Strict"), "{e}");
    assert_eq!(restore_ops(&b), ["netns_addrs", "adopt_address"]);
}

#[tokio::test]
async fn a_strict_restore_that_could_take_only_some_addresses_gives_them_back() {
    let d = Scratch::new("handover");
    let b = broker(&d, d.0.join("netns"), |n| {
        if n == 1 {
            Answer::Reply(Reply::Done)
        } else {
            Answer::Refuse(ErrorKind::AddressNotAllowed)
        }
    });
    let sockets = vec![
        socket("0.0.0.0:8080", true),
        socket(&format!("{SOURCE_IP}:8080"), false),
        socket(&format!("{SOURCE_IP}:8081"), false),
        socket("198.18.0.8:9000", false),
    ];
    let a = received(&d, &b, TcpPreservation::Strict, sockets).await;
    let e = a.restore_impl(UID).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    // Each missing address asked once; the one taken given back.
    assert_eq!(
        restore_ops(&b),
        [
            "netns_addrs",
            "adopt_address",
            "adopt_address",
            "release_address"
        ]
    );
}

#[tokio::test]
async fn a_restore_that_fails_after_the_take_over_gives_the_address_back() {
    let d = Scratch::new("handover");
    let netns = d.0.join("netns");
    std::fs::write(&netns, b"").unwrap();
    let b = broker(&d, netns, |_| Answer::Reply(Reply::Done));
    let conn = socket(&format!("{SOURCE_IP}:8080"), false);
    let a = received(&d, &b, TcpPreservation::BestEffort, vec![conn]).await;
    // CRIU does not exist here: the restore fails after the address was taken.
    a.restore_impl(UID).await.unwrap_err();
    assert_eq!(
        restore_ops(&b),
        ["netns_addrs", "adopt_address", "release_address"]
    );
    // Nothing left to give back: an abort asks nothing more of the broker's addresses.
    a.abort_impl(UID).await.unwrap();
    assert!(
        !restore_ops(&b)
            .iter()
            .skip(3)
            .any(|o| o.contains("address"))
    );
}

#[tokio::test]
async fn an_abort_of_a_restored_copy_gives_the_address_back() {
    let d = Scratch::new("handover");
    let b = broker(&d, d.0.join("netns"), |_| Answer::Reply(Reply::Done));
    let conn = socket(&format!("{SOURCE_IP}:8080"), false);
    let a = received(&d, &b, TcpPreservation::BestEffort, vec![conn]).await;
    {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.adopted.push(SOURCE_IP.parse().unwrap());
        m.phase = Phase::Restored;
    }
    a.abort_impl(UID).await.unwrap();
    assert_eq!(restore_ops(&b), ["release_address"]);
}

#[tokio::test]
async fn none_never_asks_for_the_address() {
    let d = Scratch::new("handover");
    let b = broker(&d, d.0.join("netns"), |_| Answer::Reply(Reply::Done));
    let conn = socket(&format!("{SOURCE_IP}:8080"), false);
    let a = received(&d, &b, TcpPreservation::None, vec![conn]).await;
    a.restore_impl(UID).await.unwrap_err(); // no CRIU
    assert_eq!(restore_ops(&b), ["netns_addrs"]);
}
