//! Leader election with a `coordination.k8s.io/v1` Lease.
//!
//! Every replica runs the controllers' watches (caches stay warm), but only the holder
//! of a *current* lease writes. "Current" means the holder is us *and* the lease has not
//! expired by our own monotonic clock: [`Leadership::ensure`] checks both before every
//! write, so a replica that stalled past its lease cannot act on stale leadership
//! (split brain). Losing a lease we held is fatal: [`Leadership::run`] returns an error
//! and the binary exits, so the pod restarts as a clean follower.
//!
//! Whether *another* replica's lease has expired is never decided by comparing its
//! `renewTime` (the holder's wall clock) with ours: clocks differ between nodes, and a
//! skew larger than the lease would let two replicas lead at once. As in client-go, a
//! follower remembers when it last saw the lease record (holder, renew time,
//! transitions) change, on its own monotonic clock, and takes the lease only when the
//! record has stayed the same for a whole lease duration ([`Observation`], [`claim`]).
//! The holder's own validity is counted from *before* the renewal request was sent,
//! so it ends before any follower that saw that renewal may take over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;

use podmotion_wire::agent::LeaderTerm;

use crate::config::LeaderConfig;

/// Returned by [`Leadership::ensure`] when this replica may not write.
#[derive(Debug, thiserror::Error)]
#[error("not the leader: this replica does not hold a current lease")]
pub struct NotLeader;

/// A lease we hold: valid until `until` on our monotonic clock; `term` is the lease's
/// creation time and its `leaseTransitions` when we took it (the leadership term).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    until: Instant,
    term: LeaderTerm,
}

/// This replica's view of the lease, shared by every controller.
#[derive(Clone)]
pub struct Leadership {
    /// `Some` while we hold the lease.
    valid_until: watch::Sender<Option<Held>>,
    always: bool,
}

impl Leadership {
    /// Leadership that is always held (leader election off).
    pub fn always() -> Self {
        let (tx, _) = watch::channel(Some(Held {
            until: Instant::now(),
            term: LeaderTerm::default(),
        }));
        Leadership {
            valid_until: tx,
            always: true,
        }
    }

    /// Leadership to be won by [`Leadership::run`].
    pub fn elected() -> Self {
        let (tx, _) = watch::channel(None);
        Leadership {
            valid_until: tx,
            always: false,
        }
    }

    /// Whether we hold a lease that has not expired.
    pub fn is_leader(&self) -> bool {
        self.always
            || self
                .valid_until
                .borrow()
                .is_some_and(|h| h.until > Instant::now())
    }

    /// The term agent calls are fenced with (`podmotion_wire::agent::LeaderTerm`):
    /// `Ok(None)` with leader election off, the lease's creation time and transition
    /// count while we hold a current lease, and `NotLeader` otherwise — a replica that
    /// does not lead commands no agent.
    pub fn fencing_term(&self) -> Result<Option<LeaderTerm>, NotLeader> {
        if self.always {
            return Ok(None);
        }
        self.ensure()?;
        Ok(self.valid_until.borrow().map(|h| h.term))
    }

    /// `Ok` only while we hold a current lease. Call before every write.
    pub fn ensure(&self) -> Result<(), NotLeader> {
        if self.is_leader() {
            Ok(())
        } else {
            Err(NotLeader)
        }
    }

    /// Yields once each time this replica becomes the leader (and once at start when
    /// leadership is always held), so controllers can reconcile everything they skipped
    /// as followers (`Controller::reconcile_all_on`).
    pub fn on_acquire(&self) -> impl Stream<Item = ()> + Send + 'static {
        let mut rx = self.valid_until.subscribe();
        let always = self.always;
        async_stream_lite(move |tx| async move {
            if always {
                let _ = tx.send(()).await;
                return;
            }
            let mut was = false;
            loop {
                let now = rx.borrow_and_update().is_some();
                if now && !was && tx.send(()).await.is_err() {
                    return;
                }
                was = now;
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    /// Acquires and renews the lease until an error or the loss of a lease we held.
    pub async fn run(
        &self,
        client: Client,
        namespace: &str,
        identity: &str,
        cfg: &LeaderConfig,
    ) -> anyhow::Result<()> {
        if self.always {
            return std::future::pending().await;
        }
        let api: Api<Lease> = Api::namespaced(client, namespace);
        let duration = cfg.lease_duration();
        let mut seen = Observation::default();
        loop {
            let started = Instant::now();
            let held = self.valid_until.borrow().is_some();
            match try_acquire(&api, &cfg.lease_name, identity, duration, &mut seen).await {
                Ok(Some(term)) => {
                    let was = *self.valid_until.borrow();
                    if !held {
                        tracing::info!(lease = %cfg.lease_name, %identity, %term, "acquired leadership");
                    } else if was.is_some_and(|h| h.term.epoch != term.epoch) {
                        // Someone deleted the Lease and we created it again.
                        tracing::warn!(lease = %cfg.lease_name, %identity, %term, "the Lease was created again; leading in its new term");
                    }
                    self.valid_until.send_replace(Some(Held {
                        until: started + duration,
                        term,
                    }));
                }
                Ok(None) => {
                    if held {
                        self.valid_until.send_replace(None);
                        anyhow::bail!(
                            "lost leadership: lease {} is held by another replica",
                            cfg.lease_name
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lease renewal failed");
                    if held
                        && self
                            .valid_until
                            .borrow()
                            .is_some_and(|h| h.until <= Instant::now())
                    {
                        self.valid_until.send_replace(None);
                        anyhow::bail!(
                            "lost leadership: could not renew lease {} in time: {e}",
                            cfg.lease_name
                        );
                    }
                }
            }
            tokio::time::sleep(cfg.renew_every()).await;
        }
    }
}

/// The part of a lease record that changes while its holder is alive (client-go's
/// `LeaderElectionRecord` comparison).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    holder: Option<String>,
    renew_time: Option<Timestamp>,
    acquire_time: Option<Timestamp>,
    transitions: Option<i32>,
}

impl Record {
    fn of(spec: &LeaseSpec) -> Record {
        Record {
            holder: spec.holder_identity.clone(),
            renew_time: spec.renew_time.as_ref().map(|t| t.0),
            acquire_time: spec.acquire_time.as_ref().map(|t| t.0),
            transitions: spec.lease_transitions,
        }
    }
}

/// When this replica last saw the lease record change, on its own monotonic clock.
#[derive(Debug, Default)]
pub struct Observation {
    record: Option<Record>,
    changed_at: Option<Instant>,
}

impl Observation {
    fn see(&mut self, spec: &LeaseSpec, now: Instant) {
        let r = Record::of(spec);
        if self.record.as_ref() != Some(&r) {
            self.record = Some(r);
            self.changed_at = Some(now);
        }
    }

    /// The record has not changed for `duration` since we first saw it as it is.
    fn unchanged_for(&self, duration: Duration, now: Instant) -> bool {
        self.changed_at
            .is_some_and(|t| now.saturating_duration_since(t) >= duration)
    }
}

/// What to write to the lease, or nothing (another replica holds it).
#[derive(Debug, PartialEq)]
pub enum Claim {
    Wait,
    /// Create the lease (there is none) or replace it with this spec.
    Write(LeaseSpec),
}

/// Decides, without I/O, whether this replica takes or renews the lease `current`
/// (`None`: there is none). `now` is our monotonic clock and decides expiry; `wall` is
/// only what we write into `renewTime`/`acquireTime` for humans and other tools.
pub fn claim(
    current: Option<&LeaseSpec>,
    identity: &str,
    duration: Duration,
    seen: &mut Observation,
    now: Instant,
    wall: Timestamp,
) -> Claim {
    let seconds = i32::try_from(duration.as_secs()).unwrap_or(i32::MAX);
    let Some(current) = current else {
        return Claim::Write(LeaseSpec {
            holder_identity: Some(identity.into()),
            lease_duration_seconds: Some(seconds),
            acquire_time: Some(MicroTime(wall)),
            renew_time: Some(MicroTime(wall)),
            lease_transitions: Some(0),
            ..Default::default()
        });
    };
    seen.see(current, now);
    let mut spec = current.clone();
    let ours = spec.holder_identity.as_deref() == Some(identity);
    let vacant = spec.holder_identity.as_deref().is_none_or(str::is_empty);
    // The longer of ours and the holder's: a holder with a longer lease keeps it.
    let theirs = spec
        .lease_duration_seconds
        .map(|s| Duration::from_secs(u64::try_from(s).unwrap_or(0)))
        .unwrap_or_default();
    let expired = seen.unchanged_for(duration.max(theirs), now);
    if !ours && !vacant && !expired {
        return Claim::Wait;
    }
    if !ours {
        spec.holder_identity = Some(identity.into());
        spec.acquire_time = Some(MicroTime(wall));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(MicroTime(wall));
    spec.lease_duration_seconds = Some(seconds);
    Claim::Write(spec)
}

/// One attempt to take or renew the lease. `Ok(Some(term))`: we hold it now, in `term`.
async fn try_acquire(
    api: &Api<Lease>,
    name: &str,
    identity: &str,
    duration: Duration,
    seen: &mut Observation,
) -> kube::Result<Option<LeaderTerm>> {
    let current = api.get_opt(name).await?;
    let spec = current.as_ref().and_then(|l| l.spec.as_ref());
    let empty = LeaseSpec::default();
    let spec = match (&current, spec) {
        (Some(_), None) => Some(&empty),
        (_, s) => s,
    };
    let Claim::Write(spec) = claim(
        spec,
        identity,
        duration,
        seen,
        Instant::now(),
        Timestamp::now(),
    ) else {
        return Ok(None);
    };
    let term = spec.lease_transitions.unwrap_or(0);
    let res = match current {
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    ..Default::default()
                },
                spec: Some(spec),
            };
            api.create(&PostParams::default(), &lease).await
        }
        // `replace` carries the resourceVersion we read: a concurrent writer makes it 409.
        Some(mut lease) => {
            lease.spec = Some(spec);
            api.replace(name, &PostParams::default(), &lease).await
        }
    };
    match res {
        Ok(written) => Ok(Some(term_of(&written, term))),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
        Err(e) => Err(e),
    }
}

/// The term of the lease `written` (as the API server answered our write) with
/// `transitions`: its creation time (set by the API server, so every replica reads the
/// same) first, so a Lease deleted and created again, whose count restarts at 0, is a
/// newer term than every one of the Lease it replaced.
fn term_of(written: &Lease, transitions: i32) -> LeaderTerm {
    let epoch = written
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| u64::try_from(t.0.as_second()).unwrap_or(0));
    LeaderTerm::new(epoch, u64::try_from(transitions).unwrap_or(0))
}

/// A tiny generator: runs `f` with a channel and yields what it sends.
fn async_stream_lite<F, Fut>(f: F) -> impl Stream<Item = ()> + Send + 'static
where
    F: FnOnce(tokio::sync::mpsc::Sender<()>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(f(tx));
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|v| (v, rx)) })
}

/// Shared handle type.
pub type SharedLeadership = Arc<Leadership>;

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use k8s_openapi::jiff::SignedDuration;

    fn held(until: Instant) -> Held {
        Held {
            until,
            term: LeaderTerm::default(),
        }
    }

    #[tokio::test]
    async fn always_leader_is_leader_and_yields_once() {
        let l = Leadership::always();
        assert!(l.ensure().is_ok());
        let mut s = Box::pin(l.on_acquire());
        assert_eq!(s.next().await, Some(()));
    }

    #[tokio::test]
    async fn elected_leadership_expires_by_the_monotonic_clock() {
        let l = Leadership::elected();
        assert!(l.ensure().is_err());
        l.valid_until
            .send_replace(Some(held(Instant::now() + Duration::from_secs(60))));
        assert!(l.is_leader());
        l.valid_until
            .send_replace(Some(held(Instant::now() - Duration::from_millis(1))));
        assert!(
            !l.is_leader(),
            "an expired lease must not count as leadership"
        );
    }

    #[test]
    fn the_term_is_the_lease_s_creation_time_then_its_count() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let lease = |created: &str| Lease {
            metadata: ObjectMeta {
                creation_timestamp: Some(Time(created.parse().unwrap())),
                ..Default::default()
            },
            spec: None,
        };
        let replaced = term_of(&lease("2026-11-24T00:00:00Z"), 41);
        assert_eq!(replaced, LeaderTerm::new(1_795_478_400, 41));
        // Deleted and created again: the count restarts, the term is still newer.
        let recreated = term_of(&lease("2026-12-03T00:00:00Z"), 0);
        assert_eq!(recreated, LeaderTerm::new(1_796_256_000, 0));
        assert!(recreated > replaced);
        let unknown = Lease {
            metadata: ObjectMeta::default(),
            spec: None,
        };
        assert_eq!(term_of(&unknown, 3), LeaderTerm::new(0, 3));
    }

    #[test]
    fn agent_calls_are_fenced_with_the_term_only_while_it_leads() {
        assert_eq!(Leadership::always().fencing_term().ok(), Some(None));
        let l = Leadership::elected();
        assert!(l.fencing_term().is_err(), "not yet elected");
        let term = LeaderTerm::new(1_764_770_000, 7);
        l.valid_until.send_replace(Some(Held {
            until: Instant::now() + Duration::from_secs(60),
            term,
        }));
        assert_eq!(l.fencing_term().ok(), Some(Some(term)));
        l.valid_until.send_replace(Some(Held {
            until: Instant::now() - Duration::from_millis(1),
            term,
        }));
        assert!(
            l.fencing_term().is_err(),
            "an expired lease commands nothing"
        );
    }

    #[tokio::test]
    async fn on_acquire_fires_on_each_acquisition() {
        let l = Leadership::elected();
        let mut s = Box::pin(l.on_acquire());
        l.valid_until
            .send_replace(Some(held(Instant::now() + Duration::from_secs(60))));
        assert_eq!(s.next().await, Some(()));
        l.valid_until.send_replace(None);
        tokio::task::yield_now().await;
        l.valid_until
            .send_replace(Some(held(Instant::now() + Duration::from_secs(60))));
        assert_eq!(s.next().await, Some(()));
    }

    /// A replica in a simulated cluster: its own monotonic clock is the shared fake
    /// clock, its wall clock is that plus `skew`.
    struct Replica {
        id: &'static str,
        skew: i64,
        seen: Observation,
        until: Option<Instant>,
    }

    const D: Duration = Duration::from_secs(15);

    impl Replica {
        fn new(id: &'static str, skew_secs: i64) -> Replica {
            Replica {
                id,
                skew: skew_secs,
                seen: Observation::default(),
                until: None,
            }
        }

        /// One round of `run`, against the lease in `store`, at fake time `t`.
        fn tick(&mut self, store: &mut Option<LeaseSpec>, base: Instant, t: Duration) {
            let now = base + t;
            let wall = Timestamp::UNIX_EPOCH
                + SignedDuration::from_secs(1_800_000_000 + self.skew)
                + SignedDuration::try_from(t).unwrap();
            match claim(store.as_ref(), self.id, D, &mut self.seen, now, wall) {
                Claim::Write(spec) => {
                    *store = Some(spec);
                    self.until = Some(now + D);
                }
                Claim::Wait => self.until = None,
            }
        }

        fn leads(&self, base: Instant, t: Duration) -> bool {
            self.until.is_some_and(|u| u > base + t)
        }
    }

    /// Runs `a` (renewing until `a_dies`, if given) and `b` every third of a lease,
    /// half a step apart, for `steps` steps; fails at the first instant both lead.
    /// Returns when `b` first led.
    fn simulate(
        a: &mut Replica,
        b: &mut Replica,
        a_dies: Option<Duration>,
        steps: u32,
    ) -> Option<Duration> {
        let base = Instant::now();
        let mut store = None;
        let step = D / 3;
        let mut b_led = None;
        for k in 0..steps {
            for (who, t) in [(0, step * k), (1, step * k + step / 2)] {
                if who == 0 {
                    if a_dies.is_none_or(|d| t < d) {
                        a.tick(&mut store, base, t);
                    }
                } else {
                    b.tick(&mut store, base, t);
                }
                assert!(
                    !(a.leads(base, t) && b.leads(base, t)),
                    "two leaders at {t:?} (lease {store:?})"
                );
                if b_led.is_none() && b.leads(base, t) {
                    b_led = Some(t);
                }
            }
        }
        b_led
    }

    #[test]
    fn a_follower_whose_clock_runs_ahead_never_takes_a_renewed_lease() {
        let mut a = Replica::new("a", 0);
        let mut b = Replica::new("b", 3600);
        assert_eq!(simulate(&mut a, &mut b, None, 60), None);
        assert!(a.until.is_some(), "the holder kept its lease");
    }

    #[test]
    fn a_follower_whose_clock_runs_behind_takes_an_abandoned_lease_after_one_duration() {
        // The holder's renewTime is an hour in the follower's future: a wall-clock rule
        // would wait an hour; the monotonic rule waits one lease duration.
        let mut a = Replica::new("a", 3600);
        let mut b = Replica::new("b", 0);
        let dies = D * 2;
        let led = simulate(&mut a, &mut b, Some(dies), 30).expect("b never took over");
        assert!(led >= dies, "b led at {led:?} while a was alive");
        assert!(
            led <= dies + D + D / 3,
            "b took over only at {led:?}, a died at {dies:?}"
        );
    }

    #[test]
    fn a_holder_whose_clock_runs_behind_keeps_its_lease() {
        // renewTime looks an hour old to the follower; the lease is still renewed.
        let mut a = Replica::new("a", -3600);
        let mut b = Replica::new("b", 0);
        assert_eq!(simulate(&mut a, &mut b, None, 60), None);
    }

    #[test]
    fn a_vacant_or_missing_lease_is_taken_at_once_and_counts_a_transition() {
        let base = Instant::now();
        let mut b = Replica::new("b", 0);
        let mut store = Some(LeaseSpec {
            holder_identity: Some(String::new()),
            lease_transitions: Some(4),
            ..Default::default()
        });
        b.tick(&mut store, base, Duration::ZERO);
        assert!(b.leads(base, Duration::ZERO));
        assert_eq!(store.as_ref().unwrap().lease_transitions, Some(5));
        let mut c = Replica::new("c", 0);
        let mut none = None;
        c.tick(&mut none, base, Duration::ZERO);
        assert_eq!(none.unwrap().lease_transitions, Some(0));
    }
}
