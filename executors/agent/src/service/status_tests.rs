//! `Status` while a step holds the migration, against a scripted broker: it answers at
//! once with the state the migration last published (not waiting for the step), and a
//! thaw the freeze watchdog makes meanwhile shows in it.

use super::dump::{Backoff, watch_freeze};
use super::prepare_tests::{UID, agent};
use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long a test waits for something that takes milliseconds: past it, the thing is
/// hung (this bound detects a wait, it measures no speed).
const HUNG: Duration = Duration::from_secs(5);

/// A source agent whose container `c1` is this test process, prepared.
async fn prepared_source(d: &Scratch, broker: &FakeBroker) -> Arc<Agent> {
    let a = agent(&d.0, broker.socket.clone());
    a.prepare_impl(PrepareRequest {
        migration_uid: UID.into(),
        role: Role::Source as i32,
        transfer_key: vec![7; transfer::KEY_LEN],
        peer_node: "node-b".into(),
        container_ids: vec!["c1".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    Arc::new(a)
}

/// A broker that registers the source and answers everything else (no socket).
fn answers(req: &Request) -> Answer {
    match req {
        Request::Register { .. } => Answer::Reply(Reply::Registered {
            cgroup: "/pods/src".into(),
        }),
        Request::ListSockets { .. } => Answer::Reply(Reply::Sockets { sockets: vec![] }),
        _ => Answer::Reply(Reply::Done),
    }
}

/// `Status` of the migration, asked on a thread of its own: the test fails, rather
/// than hangs, if it waits for the step that holds the migration.
async fn status(a: &Arc<Agent>) -> Result<MigrationStatus, Status> {
    let a = Arc::clone(a);
    tokio::time::timeout(
        HUNG,
        tokio::task::spawn_blocking(move || a.status_impl(UID)),
    )
    .await
    .expect("Status waited for the step that holds the migration")
    .unwrap()
}

/// Waits until a step holds the migration.
async fn held(a: &Agent) {
    let m = a.get(UID).unwrap();
    tokio::time::timeout(HUNG, async {
        while m.try_lock().is_ok() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the step took the migration");
}

fn still_held(a: &Agent) -> bool {
    a.get(UID).unwrap().try_lock().is_err()
}

/// A final dump stuck in the broker (as one stuck in CRIU: the step holds the migration
/// until it ends) does not hold `Status`: it answers the phase the migration was in
/// when the dump took it, and the dump's outcome once it has ended.
#[tokio::test]
async fn status_answers_while_a_dump_is_stuck_with_the_phase_last_published() {
    let d = Scratch::new("status");
    let locking = Arc::new(AtomicBool::new(false));
    let (release, released) = std::sync::mpsc::channel::<()>();
    let reached = Arc::clone(&locking);
    let broker = FakeBroker::start(&d.0, move |req| {
        if let Request::LockNetwork { .. } = req {
            reached.store(true, Ordering::SeqCst);
            // Stuck until the test lets it go (or ends).
            let _ = released.recv();
        }
        answers(req)
    });
    let a = prepared_source(&d, &broker).await;
    let dumping = tokio::spawn({
        let a = Arc::clone(&a);
        async move { a.dump_impl(UID).await }
    });
    tokio::time::timeout(HUNG, async {
        while !locking.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await
    .expect("the dump asked the broker to lock the network");
    assert!(still_held(&a), "the dump does not hold the migration");

    let st = status(&a).await.unwrap();
    assert_eq!(st.migration_uid, UID);
    assert_eq!(st.role, Role::Source as i32);
    assert_eq!(st.phase, Phase::Prepared as i32, "{st:?}");
    assert!(!st.fenced);
    assert!(still_held(&a), "Status was answered after the dump ended");

    // The dump goes on, and fails at CRIU (there is none here): its answer is the
    // live status again, the source unfrozen.
    release.send(()).unwrap();
    let e = tokio::time::timeout(HUNG, dumping)
        .await
        .expect("the dump ends")
        .unwrap()
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Internal, "{e}");
    let st = status(&a).await.unwrap();
    assert_eq!(st.phase, Phase::Prepared as i32);
    assert_eq!(st.timings().freeze_started_us, 0, "{st:?}");

    // The published status goes with the migration.
    a.cleanup_impl(UID).await.unwrap();
    assert_eq!(status(&a).await.unwrap_err().code(), tonic::Code::NotFound);
}

/// A `Send` stuck on a target that never answers holds the migration; `Status` still
/// answers, with the phase the dump published, and once the freeze watchdog has resumed
/// the source (without the migration's lock) it says `Aborted`.
#[tokio::test]
async fn status_shows_a_watchdog_thaw_while_a_send_holds_the_migration() {
    let d = Scratch::new("status");
    let broker = FakeBroker::start(&d.0, answers);
    let a = prepared_source(&d, &broker).await;
    // The final dump ended: the source is frozen, its freeze not yet watched.
    let (freeze, lease, process) = {
        let mut m = a.hold(UID).await.unwrap();
        m.phase = Phase::Dumped;
        m.freeze.set(FROZEN);
        (Arc::clone(&m.freeze), Arc::clone(&m.broker), m.process)
    };
    // A target that takes the connection and never says a word (a TLS handshake that
    // never ends).
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sending = tokio::spawn({
        let a = Arc::clone(&a);
        let target_endpoint = format!("https://{}", silent.local_addr().unwrap());
        async move {
            a.send_impl(SendRequest {
                migration_uid: UID.into(),
                target_endpoint,
                target_server_name: String::new(),
                bandwidth_limit: 0,
            })
            .await
        }
    });
    held(&a).await;

    let st = status(&a).await.unwrap();
    assert_eq!(st.phase, Phase::Dumped as i32, "{st:?}");
    assert!(!st.fenced);

    let uid = MigrationUid::parse(UID).unwrap();
    let fast = Backoff {
        first: Duration::from_millis(1),
        max: Duration::from_millis(4),
    };
    let watchdog = watch_freeze(
        Arc::clone(&freeze),
        lease,
        uid,
        process,
        Duration::ZERO,
        fast,
    );
    tokio::time::timeout(HUNG, watchdog)
        .await
        .expect("the watchdog resumed the source");
    assert_eq!(freeze.get(), THAWED);
    assert!(still_held(&a), "the Send let go of the migration");

    let st = status(&a).await.unwrap();
    assert_eq!(st.phase, Phase::Aborted as i32, "{st:?}");
    assert!(still_held(&a), "Status was answered after the Send ended");
    sending.abort();
}
