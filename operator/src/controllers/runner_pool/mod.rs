//! The RunnerPool controller: the wiring around `crate::runner_pool`.
//!
//! Observe: the facts (eligible node count, the Server's Service, the existing token
//! where Secrets may be read, the namespace's PodSecurity labels, the Runner pods, the
//! namespace's NetworkPolicies). Apply: render; apply each child whose rendered form
//! changed ([`children`]); delete children no longer rendered; compute the status from
//! what was applied. The shell writes the status and the core's notes (drift repaired,
//! health changed). On deletion the finalizer removes the cluster-scoped
//! PriorityClass (the namespaced children go with their owner reference).
//!
//! Watches: RunnerPools (through `DeserializeGuard`, so one malformed object cannot
//! wedge the controller), and the ServiceAccount, Secret and PDB as metadata
//! (`PartialObjectMeta`; kube 5 without its unstable stream feature still lists those
//! objects in full, but keeps only their metadata). What a round reads comes from
//! projection caches ([`crate::cache`], [`caches`]) fed by their own watches, whose
//! changes wake the pools they concern: the Runner DaemonSets (content is needed:
//! status counts and drift; wakes its owner), the Runner pods (preflight verdicts;
//! wakes its pool), every NetworkPolicy in the watch namespace (wakes the pools of its
//! namespace) and every node's labels, cluster-wide (wakes the pools whose eligible
//! count it changes). Nothing is decided before every cache has its first list.
//!
//! Still read per round, by name: the Server's Service (another namespace, any
//! Service: not worth a watch), the pool's Namespace labels (one small object), the
//! referenced PriorityClass, the children's metadata for their hash (`apply_if_changed`)
//! and, where Secrets may be read, the credential Secret (secrets are not cached).
//! The resync picks up changes of the first three.

mod caches;
mod children;
mod observe;
mod settings;
mod state;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::stream;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::{self, watcher};
use podmotion_api::names::{finalizers, labels, managers};
use podmotion_api::{RunnerPool, RunnerPoolStatus};

use super::controller_config;
use super::shell::{self, Outcome, ReconcileError, Reconciler};
use crate::cache::{self, Key, Projection};
use crate::client::scoped;
use crate::context::Context;
use crate::runner_pool::priority;
use crate::runner_pool::status;

pub use settings::{DEFAULT_PREFLIGHT_IMAGE, RunnerPoolConfig};
use state::Shared;

const NAME: &str = "runner-pool";

/// Resync period: picks up changes of things not watched (the Server's Service, the
/// namespace's PodSecurity labels, the referenced PriorityClass).
const RESYNC: Duration = Duration::from_secs(300);

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    run_with(ctx, RunnerPoolConfig::from_env()?).await
}

/// Runs the controller with explicit settings.
pub async fn run_with(ctx: Arc<Context>, cfg: RunnerPoolConfig) -> anyhow::Result<()> {
    let client = ctx.client.clone();
    let watch_namespace = cfg.watch_namespace.clone();
    let ns = watch_namespace.as_deref();
    let children = watcher::Config::default().labels(&format!("{}=RunnerPool", labels::OWNER_KIND));
    let pools: Api<DeserializeGuard<RunnerPool>> = scoped(&client, ns);
    let controller = Controller::new(pools, watcher::Config::default().any_semantic());
    let store = controller.store();
    let shared = Arc::new(Shared {
        ctx: ctx.clone(),
        cfg,
        daemonsets: Arc::new(Projection::new()),
        pods: Arc::new(Projection::new()),
        policies: Arc::new(Projection::new()),
        nodes: Arc::new(Projection::new()),
    });
    let wakes = wakes(&ctx, &shared, &store, &children);
    let controller = controller
        .owns(
            scoped::<PartialObjectMeta<ServiceAccount>>(&client, ns),
            children.clone(),
        )
        .owns(
            scoped::<PartialObjectMeta<PodDisruptionBudget>>(&client, ns),
            children.clone(),
        )
        .reconcile_on(wakes)
        .reconcile_all_on(ctx.leader.on_acquire())
        .with_config(controller_config(&ctx))
        .graceful_shutdown_on(ctx.shutdown());
    // Secrets are read only where the operator may read them: in its watch namespace.
    let controller = match ns.filter(|_| shared.cfg.read_secrets) {
        Some(_) => controller.owns(scoped::<PartialObjectMeta<Secret>>(&client, ns), children),
        None => controller,
    };
    super::mark_ready_when_synced(&ctx, NAME, store);
    shell::run(controller, shared).await;
    Ok(())
}

/// The pools to reconcile when what their status and children are read from changes:
/// the caches of their DaemonSets, Runner pods (mapped by the pool name label every
/// Runner pod carries: they belong to the DaemonSet, not to the pool), the namespace's
/// NetworkPolicies and the nodes' labels (cluster-wide whatever the watch namespace).
fn wakes(
    ctx: &Arc<Context>,
    shared: &Shared,
    store: &Store<DeserializeGuard<RunnerPool>>,
    children: &watcher::Config,
) -> impl futures::Stream<Item = caches::PoolRef> + Send + 'static {
    let client = ctx.client.clone();
    let ns = shared.cfg.watch_namespace.as_deref();
    let daemonset_triggers = cache::feed(
        ctx,
        "runner-pool-daemonsets",
        watcher(scoped::<DaemonSet>(&client, ns), children.clone()),
        shared.daemonsets.clone(),
        caches::daemonset,
        caches::pool_of_daemonset,
    );
    let pod_triggers = cache::feed(
        ctx,
        "runner-pool-pods",
        watcher(scoped::<Pod>(&client, ns), children.clone()),
        shared.pods.clone(),
        caches::runner_pod,
        caches::pool_of_pod,
    );
    let s = store.clone();
    let policy_triggers = cache::feed(
        ctx,
        "runner-pool-networkpolicies",
        watcher(scoped::<NetworkPolicy>(&client, ns), cache::paged()),
        shared.policies.clone(),
        caches::policy,
        move |c| caches::pools_in_namespace(&s, c),
    );
    let s = store.clone();
    let platform = ctx.config.platform();
    let node_triggers = cache::feed(
        ctx,
        "runner-pool-nodes",
        watcher(Api::<PartialObjectMeta<Node>>::all(client), cache::paged()),
        shared.nodes.clone(),
        caches::node_labels,
        move |c| caches::pools_of_node(&s, &platform, c),
    );
    stream::select(
        stream::select(daemonset_triggers, pod_triggers),
        stream::select(policy_triggers, node_triggers),
    )
}

impl Reconciler for Shared {
    type Object = RunnerPool;
    type Status = RunnerPoolStatus;
    /// `None` in cleanup, which reads nothing.
    type Observed = Option<observe::Observation>;
    type Then = ();
    const NAME: &'static str = NAME;
    const FINALIZER: Option<&'static str> = Some(finalizers::RUNNER_POOL_CLEANUP);
    const MANAGER: &'static str = managers::RUNNER_POOL;
    const CLAIMS: bool = true;

    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn status(pool: &RunnerPool) -> Option<&RunnerPoolStatus> {
        pool.status.as_ref()
    }

    async fn observe(
        &self,
        pool: &RunnerPool,
        cleanup: bool,
    ) -> Result<Option<observe::Observation>, ReconcileError> {
        if cleanup {
            return Ok(None);
        }
        if !self.caches_ready() {
            // A status from caches that have not listed yet would report no Runner pods
            // and no eligible nodes.
            return Err(ReconcileError::wait(
                "caches not synced",
                Duration::from_millis(250),
            ));
        }
        Ok(Some(observe::observation(self, pool).await?))
    }

    async fn apply(
        &self,
        pool: &RunnerPool,
        observed: Option<observe::Observation>,
        _cleanup: bool,
    ) -> Result<Outcome<RunnerPoolStatus>, ReconcileError> {
        let key = format!(
            "{}/{}",
            pool.namespace().unwrap_or_default(),
            pool.name_any()
        );
        let Some(o) = observed else {
            // Cleanup: the cluster-scoped PriorityClass has no owner reference.
            children::delete_priority_classes(&self.ctx, pool, &BTreeSet::new()).await?;
            self.ctx.metrics.runner_pool(&key, None);
            return Ok(Outcome::new(None));
        };
        if let Err(why) = priority::check(pool, self.cfg.max_priority, o.priority) {
            let new = status::refused(
                pool,
                podmotion_api::names::reasons::PRIORITY_CLASS_REFUSED,
                &why,
                Timestamp::now(),
            );
            self.ctx.metrics.runner_pool(&key, Some(&new));
            return Ok(resynced(pool, new, vec![]));
        }
        let ds_key: Key = (
            pool.namespace().unwrap_or_default(),
            crate::runner_pool::render::child_name(pool),
        );
        let live = self.daemonsets.get(&ds_key).map(|d| d.as_ref().clone());
        let (desired, applied) =
            children::apply_all(&self.ctx, self.cfg.reads_secrets(), pool, &o.inputs, live).await?;
        // Read our own write: a DaemonSet just created is not missing next round.
        if let Some(ds) = caches::daemonset(&applied.daemonset) {
            self.daemonsets.insert_if_absent(ds_key, ds);
        }
        let drift = status::drift_note(&applied.drift);
        if !applied.drift.is_empty() {
            self.ctx.metrics.runner_pool_shape_drift.inc();
        }
        let observed =
            crate::runner_pool::status_inputs(pool, &desired, &o.inputs, &o.facts, applied);
        let new = status::compute(pool, &observed, Timestamp::now());
        self.ctx.metrics.runner_pool(&key, Some(&new));
        Ok(resynced(pool, new, drift.into_iter().collect()))
    }
}

/// The outcome of a round that computed `new`: `notes`, then the health change from the
/// pool's current status, and the next look after `RESYNC`.
fn resynced(
    pool: &RunnerPool,
    new: RunnerPoolStatus,
    notes: Vec<crate::note::Note>,
) -> Outcome<RunnerPoolStatus> {
    let old = pool.status.clone().unwrap_or_default();
    let health = status::health_change(&old, &new);
    let mut out = Outcome::new(Some(new));
    out.notes.extend(notes);
    out.notes.extend(health);
    out.requeue = Some(RESYNC);
    out
}
