//! The freeze watchdog against a scripted broker: it keeps retrying a failing resume
//! while the freeze is unclaimed, stops as soon as something claims it, and gives up
//! only where no retry can succeed, saying so.

use super::dump::{Backoff, watch_freeze};
use super::freeze::{COMMITTING, FROZEN, Freeze, THAWED};
use super::testkit::{Answer, FakeBroker, Scratch};
use super::*;
use podmotion_broker::client::BrokerClient;
use podmotion_wire::broker::{ErrorKind, Reply};
use podmotion_wire::ids::ProcRef;
use std::time::Duration;

const UID: &str = "2d4e6f80-9a1b-4c3d-8e5f-60718293a4b5";

/// Milliseconds instead of seconds: 40 failures take well under a second.
const FAST: Backoff = Backoff {
    first: Duration::from_millis(1),
    max: Duration::from_millis(4),
};

/// This test process: a live "source" for the broker's and the watchdog's checks.
fn me() -> ProcRef {
    let pid = std::process::id() as i32;
    ProcRef {
        pid,
        start_time: procfs::start_time(pid).unwrap(),
    }
}

/// A frozen source behind `broker`, its watchdog started with no wait.
fn watched(broker: &FakeBroker, process: ProcRef) -> (Arc<Freeze>, tokio::task::JoinHandle<()>) {
    let client = BrokerClient::connect(&broker.socket).unwrap();
    let freeze: Arc<Freeze> = Arc::default();
    freeze.set(FROZEN);
    let uid = MigrationUid::parse(UID).unwrap();
    let b = Arc::new(StdMutex::new(client));
    let w = watch_freeze(Arc::clone(&freeze), b, uid, process, Duration::ZERO, FAST);
    (freeze, tokio::spawn(w))
}

/// How many times `op` was asked.
fn asked(broker: &FakeBroker, op: &str) -> usize {
    broker.ops().iter().filter(|o| **o == op).count()
}

/// `podmotion_agent_watchdog_gave_up_total{reason}` now.
fn gave_up(reason: &str) -> u64 {
    let line = format!(r#"podmotion_agent_watchdog_gave_up_total{{reason="{reason}"}} "#);
    crate::metrics::global()
        .encode(&[])
        .lines()
        .find_map(|l| l.strip_prefix(&line)?.parse().ok())
        .unwrap()
}

#[tokio::test]
async fn the_watchdog_keeps_retrying_a_failing_resume_until_the_source_runs() {
    let d = Scratch::new("watchdog");
    let mut refused = 0;
    let broker = FakeBroker::start(&d.0, move |req| match req {
        // The broker fails the first step of the resume 40 times, then recovers.
        Request::ReleaseTcpRepair { .. } if refused < 40 => {
            refused += 1;
            Answer::Refuse(ErrorKind::Kernel)
        }
        _ => Answer::Reply(Reply::Done),
    });
    let (freeze, watchdog) = watched(&broker, me());
    tokio::time::timeout(Duration::from_secs(20), watchdog)
        .await
        .expect("the watchdog ends once it resumed the source")
        .unwrap();
    assert_eq!(
        freeze.get(),
        THAWED,
        "still frozen after {} tries to resume it",
        asked(&broker, "release_tcp_repair")
    );
    assert_eq!(asked(&broker, "release_tcp_repair"), 41);
    assert_eq!(asked(&broker, "resume"), 1);
}

#[tokio::test]
async fn a_claimed_freeze_stops_the_watchdog_s_retries_at_once() {
    let d = Scratch::new("watchdog");
    let broker = FakeBroker::start(&d.0, |_| Answer::Refuse(ErrorKind::Busy));
    let (freeze, watchdog) = watched(&broker, me());
    while asked(&broker, "release_tcp_repair") < 3 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // A Commit claims the freeze (between two of the watchdog's attempts: during one
    // the watchdog holds it).
    while !freeze.claim(COMMITTING) {
        tokio::task::yield_now().await;
    }
    let tries = asked(&broker, "release_tcp_repair");
    tokio::time::timeout(Duration::from_secs(1), watchdog)
        .await
        .expect("the watchdog ends once the freeze is claimed")
        .unwrap();
    assert_eq!(freeze.get(), COMMITTING);
    assert_eq!(
        asked(&broker, "release_tcp_repair"),
        tries,
        "no try after the claim"
    );
}

#[tokio::test]
async fn the_watchdog_gives_up_only_where_no_retry_can_succeed_and_counts_it() {
    // The broker ends the lease (it restarted): it rolls the source back itself.
    let d = Scratch::new("watchdog");
    let broker = FakeBroker::start(&d.0, |req| match req {
        Request::ReleaseTcpRepair { .. } => Answer::Close,
        _ => Answer::Reply(Reply::Done),
    });
    let before = gave_up("broker_lease_ended");
    let (freeze, watchdog) = watched(&broker, me());
    tokio::time::timeout(Duration::from_secs(5), watchdog)
        .await
        .expect("the watchdog gives up on a closed lease")
        .unwrap();
    assert_eq!(freeze.get(), FROZEN, "nothing claimed it");
    assert!(!freeze.held(), "a freeze given up is not counted as held");
    assert_eq!(asked(&broker, "release_tcp_repair"), 1);
    assert_eq!(gave_up("broker_lease_ended"), before + 1);

    // The source process is gone: nothing is frozen any more.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let gone = ProcRef {
        pid: child.id() as i32,
        start_time: procfs::start_time(child.id() as i32).unwrap_or(1),
    };
    child.wait().unwrap();
    let d = Scratch::new("watchdog");
    let broker = FakeBroker::start(&d.0, |_| Answer::Refuse(ErrorKind::NoSuchProcess));
    let before = gave_up("source_gone");
    let (freeze, watchdog) = watched(&broker, gone);
    tokio::time::timeout(Duration::from_secs(5), watchdog)
        .await
        .expect("the watchdog gives up on a source that is gone")
        .unwrap();
    assert_eq!(gave_up("source_gone"), before + 1);
    assert!(!freeze.held(), "a freeze given up is not counted as held");
}
