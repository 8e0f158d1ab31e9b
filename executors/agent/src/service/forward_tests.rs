//! `Forward` against a scripted broker: a fenced source asks its broker to forward new
//! connections to the target, with what the operator named; anything else (a source
//! not fenced, a target, addresses or ports that are not ones) is refused before the
//! broker is asked.

use super::freeze::{FENCED, FROZEN};
use super::prepare_tests::{UID, agent, prepare_target, registers_then};
use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use podmotion_wire::broker::{ErrorKind, ForwardedService, Reply};

/// An agent with a source in `freeze` (fenced when FENCED), whose broker answers
/// `forward_connections` with `answer`; the requests the broker was sent.
async fn source(
    name: &str,
    freeze: u8,
    answer: Answer,
) -> (Scratch, FakeBroker, Agent, Arc<StdMutex<Vec<Request>>>) {
    let d = Scratch::new(name);
    let seen: Arc<StdMutex<Vec<Request>>> = Arc::default();
    let seen2 = Arc::clone(&seen);
    let mut answer = Some(answer);
    let broker = FakeBroker::start(&d.0, move |r| {
        seen2.lock().unwrap().push(r.clone());
        match r {
            Request::ForwardConnections { .. } => answer.take().expect("one forward"),
            _ => registers_then(
                r,
                Answer::Reply(Reply::NetnsPath {
                    path: "/run/netns/x".into(),
                }),
            ),
        }
    });
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(prepare_target()).await.unwrap();
    {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.role = Role::Source;
        m.phase = Phase::Sent;
        m.freeze.set(freeze);
        m.fenced = freeze == FENCED;
    }
    (d, broker, a, seen)
}

fn request() -> ForwardRequest {
    ForwardRequest {
        migration_uid: UID.into(),
        target_addresses: vec!["198.18.1.7".into(), "2001:db8::7".into()],
        services: vec![ForwardedPort {
            address: "198.19.0.10".into(),
            port: 80,
            target_port: 8080,
        }],
    }
}

fn forwards(seen: &StdMutex<Vec<Request>>) -> Vec<Request> {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|r| matches!(r, Request::ForwardConnections { .. }))
        .cloned()
        .collect()
}

#[tokio::test]
async fn a_fenced_source_asks_its_broker_to_forward_to_the_target() {
    let (_d, _b, a, seen) = source("fwd-ok", FENCED, Answer::Reply(Reply::Done)).await;
    let st = a.forward_impl(request()).await.expect("forward");
    assert!(st.fenced);
    assert_eq!(
        forwards(&seen),
        [Request::ForwardConnections {
            uid: MigrationUid::parse(UID).unwrap(),
            targets: vec![
                "198.18.1.7".parse().unwrap(),
                "2001:db8::7".parse().unwrap()
            ],
            services: vec![ForwardedService {
                address: "198.19.0.10".parse().unwrap(),
                port: 80,
                target_port: 8080,
            }],
        }]
    );
}

#[tokio::test]
async fn the_brokers_refusal_is_the_answer() {
    let (_d, _b, a, _seen) = source("fwd-off", FENCED, Answer::Refuse(ErrorKind::ForwardOff)).await;
    let e = a.forward_impl(request()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message().contains("ForwardOff"), "{e}");
}

#[tokio::test]
async fn only_a_fenced_source_forwards() {
    let (_d, _b, a, seen) = source("fwd-frozen", FROZEN, Answer::Reply(Reply::Done)).await;
    let e = a.forward_impl(request()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.role = Role::Target;
        m.freeze.set(FENCED);
        m.fenced = true;
    }
    let e = a.forward_impl(request()).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    assert!(forwards(&seen).is_empty());
}

#[tokio::test]
async fn a_forward_naming_what_is_no_address_or_port_is_refused_before_the_broker() {
    let (_d, _b, a, seen) = source("fwd-bad", FENCED, Answer::Reply(Reply::Done)).await;
    let bad: [fn(&mut ForwardRequest); 6] = [
        |r| r.target_addresses = vec![],
        |r| r.target_addresses = vec!["target-pod".into()],
        |r| r.target_addresses = vec!["198.18.1.7".into(), "198.18.1.8".into()],
        |r| r.services[0].address = "svc.ns".into(),
        |r| r.services[0].port = 0,
        |r| r.services[0].target_port = 70000,
    ];
    for (i, spoil) in bad.iter().enumerate() {
        let mut r = request();
        spoil(&mut r);
        let e = a.forward_impl(r).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "case {i}: {e}");
    }
    assert!(forwards(&seen).is_empty());
}
