//! Thin controllers: wiring, fetching inputs, calling a pure core, applying its output.
//! Each exposes `run(ctx) -> anyhow::Result<()>` and is enabled by `--controllers`.
//!
//! What every controller does the same way lives here, so there is one way of doing it:
//! - [`controller_config`]: explicit concurrency (kube-rs's default is unlimited);
//! - [`reconcile_guard`]: followers keep their caches warm but never reconcile;
//! - [`timed`]: reconcile metrics (duration, result, error category);
//! - [`error_policy`]: log with the error's category, requeue with a bounded delay.

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::{Action, Config};
use kube::runtime::reflector::Store;

use crate::context::Context;

/// An error of one reconcile stage, with a bounded CamelCase category used as metric
/// label and Event reason.
pub trait CategorizedError: Display {
    fn category(&self) -> &'static str;
}

impl CategorizedError for crate::children::ChildError {
    fn category(&self) -> &'static str {
        crate::children::ChildError::category(self)
    }
}

/// Controller settings every PodMotion controller uses.
pub fn controller_config(ctx: &Context) -> Config {
    Config::default()
        .concurrency(ctx.config.concurrency)
        .debounce(Duration::from_millis(200))
}

/// `Some(action)` when this replica must not reconcile (it is not the leader): the
/// object is looked at again after a lease period, and `Leadership::on_acquire` makes
/// the controller reconcile everything once this replica wins the lease.
pub fn reconcile_guard(ctx: &Context) -> Option<Action> {
    (!ctx.leader.is_leader()).then(|| Action::requeue(ctx.config.leader.lease_duration()))
}

/// Runs one reconcile with metrics.
pub async fn timed<F, E>(ctx: &Context, controller: &'static str, reconcile: F) -> Result<Action, E>
where
    F: Future<Output = Result<Action, E>>,
    E: CategorizedError,
{
    let timer = ctx.metrics.reconcile(controller);
    let res = reconcile.await;
    timer.done(res.as_ref().map(|_| ()).map_err(|e| e.category()));
    res
}

/// Marks `name` ready on `/readyz` once `store` has its first complete list.
///
/// The store's readiness future is re-polled every second instead of awaited once:
/// kube-runtime's `Store::wait_until_ready` wakes only the last task that polled it,
/// and the controller's own applier polls it too, so a single long await could sleep
/// forever.
pub fn mark_ready_when_synced<K>(ctx: &Arc<Context>, name: &'static str, store: Store<K>)
where
    K: kube::Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    ctx.readiness.register(name);
    let ctx = ctx.clone();
    tokio::spawn(async move {
        loop {
            match tokio::time::timeout(Duration::from_secs(1), store.wait_until_ready()).await {
                Ok(Ok(())) => {
                    ctx.readiness.set_ready(name);
                    return;
                }
                Ok(Err(_)) => return,
                Err(_) => continue,
            }
        }
    });
}

/// Requeue delay after a failed reconcile: short for conflicts and API hiccups.
pub fn error_policy<K, E: CategorizedError>(_obj: Arc<K>, err: &E, _ctx: Arc<Context>) -> Action {
    tracing::warn!(category = err.category(), error = %err, "reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

pub mod attachment;
pub mod migration;
pub mod migration_agents;
pub mod runner_pool;
