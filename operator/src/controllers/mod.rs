//! Thin controllers: wiring, an observe step and an apply step around a pure core.
//! Each exposes `run(ctx) -> anyhow::Result<()>` and is enabled by `--controllers`.
//!
//! What every controller does the same way has one home:
//! - [`shell`]: the reconcile itself (deserialize guard, finalizer, status by
//!   server-side apply, Events from the core's notes, one error policy), and
//!   [`error`], the one error type; the shell's claim gate makes one PodMotion
//!   release own each object;
//! - [`controller_config`]: explicit concurrency (kube-rs's default is unlimited);
//! - [`reconcile_guard`]: followers keep their caches warm but never reconcile;
//! - [`mark_ready_when_synced`]: `/readyz` once the controller's store has listed;
//! - [`crate::client::scoped`]: the API of a kind in the watch namespace, or in all of them.

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::controller::{Action, Config};
use kube::runtime::reflector::Store;

use crate::context::Context;

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
    (!ctx.writer.leads()).then(|| Action::requeue(ctx.config.leader.lease_duration()))
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

pub mod attachment;
pub mod error;
pub mod migration;
pub mod runner_pool;
pub mod shell;
