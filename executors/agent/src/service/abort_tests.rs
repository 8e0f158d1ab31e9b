//! `Abort` of a frozen source against a scripted broker: the thaw runs to its end even
//! when the caller goes away in the middle of it (a gRPC call whose client disconnects,
//! the operator's leader killed, drops its handler's future), so the source is resumed
//! and the next `Abort` (the next leader's) answers that it is; the same for `Fence`.

use super::freeze::{FENCED, FROZEN, Freeze, THAWED, THAWING};
use super::prepare_tests::{UID, agent, prepare_target, registers_then};
use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use podmotion_wire::broker::Reply;
use std::time::Duration;

/// An agent whose broker holds the first request `held` matches until the returned
/// sender lets it go, with a source in `phase` that its final dump left frozen; the
/// source's freeze state.
async fn frozen_source_with_a_held_broker(
    name: &str,
    phase: Phase,
    held: fn(&Request) -> bool,
) -> (
    Scratch,
    FakeBroker,
    Agent,
    std::sync::mpsc::Sender<()>,
    Arc<Freeze>,
) {
    let d = Scratch::new(name);
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let mut first = true;
    let broker = FakeBroker::start(&d.0, move |r| {
        if first && held(r) {
            first = false;
            wait.recv().unwrap();
            return Answer::Reply(Reply::Done);
        }
        registers_then(
            r,
            Answer::Reply(Reply::NetnsPath {
                path: "/run/netns/x".into(),
            }),
        )
    });
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(prepare_target()).await.unwrap();
    let freeze = {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.role = Role::Source;
        m.phase = phase;
        m.freeze.set(FROZEN);
        Arc::clone(&m.freeze)
    };
    (d, broker, a, release, freeze)
}

/// Waits (5 s at most) for the freeze to reach `state` with nobody asking again.
async fn settles_at(freeze: &Freeze, state: u8) -> u8 {
    let t0 = std::time::Instant::now();
    while freeze.get() != state && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    freeze.get()
}

#[tokio::test]
async fn an_abort_whose_caller_went_away_in_the_thaw_still_resumes_the_source() {
    // The broker holds the thaw's first step until the test lets it go.
    let (_d, broker, a, release, freeze) =
        frozen_source_with_a_held_broker("abort", Phase::Dumped, |r| {
            matches!(r, Request::ReleaseTcpRepair { .. })
        })
        .await;
    // The operator's call goes away while the broker holds the thaw.
    let cut = tokio::time::timeout(Duration::from_millis(200), a.abort_impl(UID)).await;
    assert!(
        cut.is_err(),
        "answered while the broker held the thaw: {cut:?}"
    );
    release.send(()).unwrap();
    assert_eq!(
        settles_at(&freeze, THAWED).await,
        THAWED,
        "the source was left stopped with its freeze claimed (THAWING = {THAWING}); broker asked {:?}",
        broker.ops()
    );
    // The next leader's Abort is told the source runs again.
    let st = tokio::time::timeout(Duration::from_secs(5), a.abort_impl(UID))
        .await
        .expect("the next Abort answers")
        .expect("the next Abort succeeds");
    assert_eq!(st.phase, Phase::Aborted as i32);
    assert_eq!(
        broker.ops()[2..],
        ["release_tcp_repair", "unlock_network", "resume"],
        "after register and bind_netns: the thaw, each step once"
    );
}

/// The same for `Fence`: one whose caller went away inside the broker's call still
/// ends fenced (never left claimed, neither fenced nor abortable).
#[tokio::test]
async fn a_fence_whose_caller_went_away_still_ends_fenced() {
    let (_d, broker, a, release, freeze) =
        frozen_source_with_a_held_broker("fence-cut", Phase::Sent, |r| {
            matches!(r, Request::Fence { .. })
        })
        .await;
    let cut = tokio::time::timeout(Duration::from_millis(200), a.fence_impl(UID)).await;
    assert!(
        cut.is_err(),
        "answered while the broker held the fence: {cut:?}"
    );
    release.send(()).unwrap();
    assert_eq!(
        settles_at(&freeze, FENCED).await,
        FENCED,
        "broker asked {:?}",
        broker.ops()
    );
    let st = tokio::time::timeout(Duration::from_secs(5), a.fence_impl(UID))
        .await
        .expect("the next Fence answers")
        .expect("the next Fence succeeds");
    assert!(st.fenced);
}
