//! `Abort` of a frozen source against a scripted broker: the thaw runs to its end even
//! when the caller goes away in the middle of it (a gRPC call whose client disconnects,
//! the operator's leader killed, drops its handler's future), so the source is resumed
//! and the next `Abort` (the next leader's) answers that it is; the same for `Fence`.

use super::prepare_tests::{UID, agent, prepare_target, registers_then};
use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use std::time::Duration;

#[tokio::test]
async fn an_abort_whose_caller_went_away_in_the_thaw_still_resumes_the_source() {
    let d = Scratch::new("abort");
    // The broker holds the thaw's first step until the test lets it go.
    let (release, held) = std::sync::mpsc::channel::<()>();
    let mut first = true;
    let broker = FakeBroker::start(&d.0, move |r| match r {
        Request::ReleaseTcpRepair { .. } if first => {
            first = false;
            held.recv().unwrap();
            Answer::Reply(Reply::Done)
        }
        _ => registers_then(
            r,
            Answer::Reply(Reply::NetnsPath {
                path: "/run/netns/x".into(),
            }),
        ),
    });
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(prepare_target()).await.unwrap();
    // A source its final dump left frozen.
    let freeze = {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.role = Role::Source;
        m.phase = Phase::Dumped;
        m.freeze.set(FROZEN);
        Arc::clone(&m.freeze)
    };
    // The operator's call goes away while the broker holds the thaw.
    let cut = tokio::time::timeout(Duration::from_millis(200), a.abort_impl(UID)).await;
    assert!(
        cut.is_err(),
        "answered while the broker held the thaw: {cut:?}"
    );
    release.send(()).unwrap();
    // Nobody asks again: the thaw goes on to its end all the same.
    let t0 = std::time::Instant::now();
    while freeze.get() != THAWED && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        freeze.get(),
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
    let d = Scratch::new("fence-cut");
    let (release, held) = std::sync::mpsc::channel::<()>();
    let broker = FakeBroker::start(&d.0, move |r| match r {
        Request::Fence { .. } => {
            held.recv().unwrap();
            Answer::Reply(Reply::Done)
        }
        _ => registers_then(
            r,
            Answer::Reply(Reply::NetnsPath {
                path: "/run/netns/x".into(),
            }),
        ),
    });
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(prepare_target()).await.unwrap();
    let freeze = {
        let m = a.get(UID).unwrap();
        let mut m = m.lock().await;
        m.role = Role::Source;
        m.phase = Phase::Sent;
        m.freeze.set(FROZEN);
        Arc::clone(&m.freeze)
    };
    let cut = tokio::time::timeout(Duration::from_millis(200), a.fence_impl(UID)).await;
    assert!(
        cut.is_err(),
        "answered while the broker held the fence: {cut:?}"
    );
    release.send(()).unwrap();
    let t0 = std::time::Instant::now();
    while freeze.get() != FENCED && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(freeze.get(), FENCED, "broker asked {:?}", broker.ops());
    let st = tokio::time::timeout(Duration::from_secs(5), a.fence_impl(UID))
        .await
        .expect("the next Fence answers")
        .expect("the next Fence succeeds");
    assert!(st.fenced);
}
