//! Leader election with a `coordination.k8s.io/v1` Lease.
//!
//! Every replica runs the controllers' watches (caches stay warm), but only the holder
//! of a *current* lease writes. "Current" means the holder is us *and* the lease has not
//! expired by our own monotonic clock: [`Leadership::ensure`] checks both before every
//! write, so a replica that stalled past its lease cannot act on stale leadership
//! (split brain). Losing a lease we held is fatal: [`Leadership::run`] returns an error
//! and the binary exits, so the pod restarts as a clean follower.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::Stream;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};
use tokio::sync::watch;

use crate::config::LeaderConfig;

/// Returned by [`Leadership::ensure`] when this replica may not write.
#[derive(Debug, thiserror::Error)]
#[error("not the leader: this replica does not hold a current lease")]
pub struct NotLeader;

/// This replica's view of the lease, shared by every controller.
#[derive(Clone)]
pub struct Leadership {
    /// `Some(deadline)` while we hold the lease; it is valid until `deadline`.
    valid_until: watch::Sender<Option<Instant>>,
    always: bool,
}

impl Leadership {
    /// Leadership that is always held (leader election off).
    pub fn always() -> Self {
        let (tx, _) = watch::channel(Some(Instant::now()));
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
                .is_some_and(|d| d > Instant::now())
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
        loop {
            let started = Instant::now();
            let held = self.valid_until.borrow().is_some();
            match try_acquire(&api, &cfg.lease_name, identity, duration).await {
                Ok(true) => {
                    if !held {
                        tracing::info!(lease = %cfg.lease_name, %identity, "acquired leadership");
                    }
                    self.valid_until.send_replace(Some(started + duration));
                }
                Ok(false) => {
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
                            .is_some_and(|d| d <= Instant::now())
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

/// One attempt to take or renew the lease. `Ok(true)`: we hold it now.
async fn try_acquire(
    api: &Api<Lease>,
    name: &str,
    identity: &str,
    duration: Duration,
) -> kube::Result<bool> {
    let now = Timestamp::now();
    let seconds = i32::try_from(duration.as_secs()).unwrap_or(i32::MAX);
    let Some(mut lease) = api.get_opt(name).await? else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(identity.into()),
                lease_duration_seconds: Some(seconds),
                acquire_time: Some(MicroTime(now)),
                renew_time: Some(MicroTime(now)),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    let ours = spec.holder_identity.as_deref() == Some(identity);
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renew), Some(secs)) => renew.0 + SignedDuration::from_secs(i64::from(secs)) < now,
        _ => true,
    };
    if !ours && !expired {
        return Ok(false);
    }
    if !ours {
        spec.holder_identity = Some(identity.into());
        spec.acquire_time = Some(MicroTime(now));
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.renew_time = Some(MicroTime(now));
    spec.lease_duration_seconds = Some(seconds);
    // `replace` carries the resourceVersion we read: a concurrent writer makes it 409.
    match api.replace(name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
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
            .send_replace(Some(Instant::now() + Duration::from_secs(60)));
        assert!(l.is_leader());
        l.valid_until
            .send_replace(Some(Instant::now() - Duration::from_millis(1)));
        assert!(
            !l.is_leader(),
            "an expired lease must not count as leadership"
        );
    }

    #[tokio::test]
    async fn on_acquire_fires_on_each_acquisition() {
        let l = Leadership::elected();
        let mut s = Box::pin(l.on_acquire());
        l.valid_until
            .send_replace(Some(Instant::now() + Duration::from_secs(60)));
        assert_eq!(s.next().await, Some(()));
        l.valid_until.send_replace(None);
        tokio::task::yield_now().await;
        l.valid_until
            .send_replace(Some(Instant::now() + Duration::from_secs(60)));
        assert_eq!(s.next().await, Some(()));
    }
}
