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
//! wedge the controller), the DaemonSet (content is needed: status counts and drift),
//! the Runner pods (preflight verdicts), and the ServiceAccount, Secret,
//! NetworkPolicy and PDB as metadata (`PartialObjectMeta`; kube 5 without its
//! unstable stream feature still lists those objects in full, but keeps only their
//! metadata).

mod children;
mod observe;
mod settings;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Pod, Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use podmotion_api::names::{finalizers, labels, managers};
use podmotion_api::{RunnerPool, RunnerPoolStatus};

use super::shell::{self, Outcome, ReconcileError, Reconciler};
use super::{controller_config, scoped};
use crate::context::Context;
use crate::runner_pool::priority;
use crate::runner_pool::status;

pub use settings::{DEFAULT_PREFLIGHT_IMAGE, RunnerPoolConfig};

const NAME: &str = "runner-pool";

/// Resync period: picks up changes of things not watched (the Server's Service, the
/// namespace's PodSecurity labels, other NetworkPolicies, node labels).
const RESYNC: Duration = Duration::from_secs(300);

struct Shared {
    ctx: Arc<Context>,
    cfg: RunnerPoolConfig,
}

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    run_with(ctx, RunnerPoolConfig::from_env()?).await
}

/// Runs the controller with explicit settings.
pub async fn run_with(ctx: Arc<Context>, cfg: RunnerPoolConfig) -> anyhow::Result<()> {
    let client = ctx.client.clone();
    let ns = cfg.watch_namespace.as_deref();
    let children = watcher::Config::default().labels(&format!("{}=RunnerPool", labels::OWNER_KIND));
    let children_cfg = children.clone();
    let pools: Api<DeserializeGuard<RunnerPool>> = scoped(&client, ns);
    let controller = Controller::new(pools, watcher::Config::default().any_semantic())
        .owns(scoped::<DaemonSet>(&client, ns), children.clone())
        .owns(
            scoped::<PartialObjectMeta<ServiceAccount>>(&client, ns),
            children.clone(),
        )
        .owns(
            scoped::<PartialObjectMeta<NetworkPolicy>>(&client, ns),
            children.clone(),
        )
        .owns(
            scoped::<PartialObjectMeta<PodDisruptionBudget>>(&client, ns),
            children.clone(),
        )
        // Runner pods belong to the DaemonSet, not to the pool: map them by the pool
        // name label every Runner pod carries.
        .watches(scoped::<Pod>(&client, ns), children, |pod: Pod| {
            let pool = pod.labels().get(labels::INSTANCE)?.clone();
            Some(ObjectRef::<DeserializeGuard<RunnerPool>>::new(&pool).within(&pod.namespace()?))
        })
        .reconcile_all_on(ctx.leader.on_acquire())
        .with_config(controller_config(&ctx))
        .graceful_shutdown_on(ctx.shutdown());
    // Secrets are read only where the operator may read them: in its watch namespace.
    let controller = match ns.filter(|_| cfg.read_secrets) {
        Some(_) => controller.owns(
            scoped::<PartialObjectMeta<Secret>>(&client, ns),
            children_cfg,
        ),
        None => controller,
    };
    super::mark_ready_when_synced(&ctx, NAME, controller.store());
    let shared = Arc::new(Shared {
        ctx: ctx.clone(),
        cfg,
    });
    shell::run(controller, shared).await;
    Ok(())
}

impl Reconciler for Shared {
    type Object = RunnerPool;
    type Status = RunnerPoolStatus;
    /// `None` in cleanup, which reads nothing.
    type Observed = Option<observe::Observation>;
    type Then = ();
    const NAME: &'static str = NAME;
    const FINALIZER: &'static str = finalizers::RUNNER_POOL_CLEANUP;
    const MANAGER: &'static str = managers::RUNNER_POOL;

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
        Ok(Some(
            observe::observation(&self.ctx, &self.cfg, pool).await?,
        ))
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
            let old = pool.status.clone().unwrap_or_default();
            let mut out = Outcome::new(Some(new));
            if let Some(new) = &out.status {
                out.notes.extend(status::health_change(&old, new));
            }
            out.requeue = Some(RESYNC);
            return Ok(out);
        }
        let (desired, applied) =
            children::apply_all(&self.ctx, self.cfg.reads_secrets(), pool, &o.inputs).await?;
        let drift = status::drift_note(&applied.drift);
        if !applied.drift.is_empty() {
            self.ctx.metrics.runner_pool_shape_drift.inc();
        }
        let observed =
            crate::runner_pool::status_inputs(pool, &desired, &o.inputs, &o.facts, applied);
        let new = status::compute(pool, &observed, Timestamp::now());
        self.ctx.metrics.runner_pool(&key, Some(&new));
        let old = pool.status.clone().unwrap_or_default();
        let mut out = Outcome::new(Some(new));
        out.notes.extend(drift);
        if let Some(new) = &out.status {
            out.notes.extend(status::health_change(&old, new));
        }
        out.requeue = Some(RESYNC);
        Ok(out)
    }
}
