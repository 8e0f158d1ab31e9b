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

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams};
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use podmotion_api::names::{finalizers, labels, managers};
use podmotion_api::{RunnerPool, RunnerPoolStatus};

use super::controller_config;
use super::shell::{self, Outcome, ReconcileError, Reconciler, api_err};
use crate::context::Context;
use crate::runner_pool::priority::{self, Referenced};
use crate::runner_pool::status;
use crate::runner_pool::{Applied, Facts, Inputs, ServerEndpoint, render, server_namespace};

const NAME: &str = "runner-pool";

/// Preflight image used when a RunnerPool names none (`PODMOTION_PREFLIGHT_IMAGE`).
pub const DEFAULT_PREFLIGHT_IMAGE: &str = concat!(
    "ghcr.io/podmotion/podmotion-preflight:",
    env!("CARGO_PKG_VERSION")
);

/// Resync period: picks up changes of things not watched (the Server's Service, the
/// namespace's PodSecurity labels, other NetworkPolicies, node labels).
const RESYNC: Duration = Duration::from_secs(300);

struct Shared {
    ctx: Arc<Context>,
    cfg: RunnerPoolConfig,
}

/// Settings of the RunnerPool controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerPoolConfig {
    /// Preflight image when a RunnerPool names none (`PODMOTION_PREFLIGHT_IMAGE`).
    pub preflight_image: String,
    /// Reconcile RunnerPools of this namespace only (`PODMOTION_RUNNER_POOL_NAMESPACE`;
    /// default: all namespaces).
    pub watch_namespace: Option<String>,
    /// The highest PriorityClass value a pool may create or reference
    /// (`PODMOTION_RUNNER_POOL_MAX_PRIORITY`, chart value `runnerPool.maxPriority`).
    pub max_priority: i32,
    /// Whether the operator may read Secrets (in `watch_namespace`). The chart grants
    /// get/list/watch on Secrets only through a Role in the watch namespace, so this
    /// is true exactly when a watch namespace is set.
    pub read_secrets: bool,
}

impl RunnerPoolConfig {
    /// The settings from the environment.
    pub fn from_env() -> anyhow::Result<RunnerPoolConfig> {
        let max_priority = match std::env::var("PODMOTION_RUNNER_POOL_MAX_PRIORITY") {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e| {
                anyhow::anyhow!("PODMOTION_RUNNER_POOL_MAX_PRIORITY={v:?} is not a number: {e}")
            })?,
            _ => priority::DEFAULT_CEILING,
        };
        Ok(RunnerPoolConfig {
            max_priority,
            preflight_image: std::env::var("PODMOTION_PREFLIGHT_IMAGE")
                .unwrap_or_else(|_| DEFAULT_PREFLIGHT_IMAGE.to_string()),
            watch_namespace: std::env::var("PODMOTION_RUNNER_POOL_NAMESPACE")
                .ok()
                .filter(|s| !s.is_empty()),
            read_secrets: false,
        }
        .with_secret_reads_where_granted())
    }

    /// `read_secrets` as the chart grants it: only with a watch namespace.
    pub fn with_secret_reads_where_granted(mut self) -> RunnerPoolConfig {
        self.read_secrets = self.watch_namespace.is_some();
        self
    }
}

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    run_with(ctx, RunnerPoolConfig::from_env()?).await
}

fn scoped<K>(client: &kube::Client, ns: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
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

impl Shared {
    /// Whether the operator may read Secrets: only in its watch namespace (the chart
    /// grants get/list/watch there through a Role, and nowhere else).
    fn reads_secrets(&self) -> bool {
        self.cfg.read_secrets && self.cfg.watch_namespace.is_some()
    }

    /// The facts rendering needs: eligible nodes, the Server's Service, the token.
    async fn inputs(&self, pool: &RunnerPool) -> Result<Inputs, ReconcileError> {
        let client = self.ctx.client.clone();
        let nodes = &pool.spec.nodes;
        let eligible = Api::<Node>::all(client.clone())
            .list_metadata(
                &ListParams::default()
                    .labels(&format!("{}={}", nodes.label_key, nodes.label_value)),
            )
            .await
            .map_err(api_err("list", "Runner nodes"))?
            .items
            .len();
        let server_ns = server_namespace(pool);
        let service = Api::<Service>::namespaced(client.clone(), &server_ns)
            .get_opt(&pool.spec.server.service_name)
            .await
            .map_err(api_err("get", "the Server's Service"))?;
        Ok(Inputs {
            preflight_image: self.cfg.preflight_image.clone(),
            eligible_nodes: eligible,
            server: ServerEndpoint::resolve(pool, &server_ns, service),
            credential_token: self.credential_token(pool).await?,
        })
    }

    /// The generated Secret's token: the existing one where Secrets may be read, else
    /// a fresh one (used only when the Secret is created, once); `None` when the pool
    /// references its own Secret.
    async fn credential_token(&self, pool: &RunnerPool) -> Result<Option<String>, ReconcileError> {
        if pool.spec.credentials.secret_name.is_some() {
            return Ok(None);
        }
        if !self.reads_secrets() {
            return Ok(Some(children::fresh_token()));
        }
        let (name, key) = render::credential_secret(pool);
        let existing = Api::<Secret>::namespaced(
            self.ctx.client.clone(),
            &pool.namespace().unwrap_or_default(),
        )
        .get_opt(&name)
        .await
        .map_err(api_err("get", "the credential Secret"))?
        .and_then(|s| s.data)
        .and_then(|d| d.get(&key).cloned())
        .filter(|v| !v.0.is_empty());
        Ok(Some(match existing {
            Some(token) => String::from_utf8_lossy(&token.0).into_owned(),
            None => children::fresh_token(),
        }))
    }

    /// The value of the PriorityClass the pool references (nothing is read when the
    /// pool creates its own).
    async fn referenced_priority(&self, pool: &RunnerPool) -> Result<Referenced, ReconcileError> {
        let pc = &pool.spec.priority_class;
        if pc.create {
            return Ok(Referenced::NotRead);
        }
        let class = Api::<PriorityClass>::all(self.ctx.client.clone())
            .get_opt(&pc.name)
            .await
            .map_err(api_err("get", format!("PriorityClass {}", pc.name)))?;
        Ok(class.map_or(Referenced::Missing, |c| {
            Referenced::Value(c.value.unwrap_or(0))
        }))
    }

    /// The facts the status needs: namespace labels, Runner pods, NetworkPolicies.
    async fn facts(&self, pool: &RunnerPool) -> Result<Facts, ReconcileError> {
        let client = self.ctx.client.clone();
        let ns = pool.namespace().unwrap_or_default();
        let namespace = Api::<Namespace>::all(client.clone())
            .get_metadata_opt(&ns)
            .await
            .map_err(api_err("get", format!("Namespace {ns}")))?;
        let selector = render::pod_selector(pool)
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",");
        let pods = Api::<Pod>::namespaced(client.clone(), &ns)
            .list(&ListParams::default().labels(&selector))
            .await
            .map_err(api_err("list", "Runner pods"))?;
        let policies = Api::<NetworkPolicy>::namespaced(client.clone(), &ns)
            .list(&ListParams::default())
            .await
            .map_err(api_err("list", "NetworkPolicies"))?;
        Ok(Facts {
            namespace_labels: namespace.map(|n| n.labels().clone()).unwrap_or_default(),
            pods: pods.items,
            policies: policies.items,
        })
    }
}

/// What a live pool's round reads.
struct Observation {
    inputs: Inputs,
    facts: Facts,
    priority: Referenced,
}

impl Reconciler for Shared {
    type Object = RunnerPool;
    type Status = RunnerPoolStatus;
    /// `None` in cleanup, which reads nothing.
    type Observed = Option<Observation>;
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
    ) -> Result<Option<Observation>, ReconcileError> {
        if cleanup {
            return Ok(None);
        }
        let (inputs, facts, priority) = tokio::try_join!(
            self.inputs(pool),
            self.facts(pool),
            self.referenced_priority(pool)
        )?;
        Ok(Some(Observation {
            inputs,
            facts,
            priority,
        }))
    }

    async fn apply(
        &self,
        pool: &RunnerPool,
        observed: Option<Observation>,
        _cleanup: bool,
    ) -> Result<Outcome<RunnerPoolStatus>, ReconcileError> {
        let Some(o) = observed else {
            // Cleanup: the cluster-scoped PriorityClass has no owner reference.
            children::delete_priority_classes(&self.ctx, pool, &BTreeSet::new()).await?;
            return Ok(Outcome::new(None));
        };
        if let Err(why) = priority::check(pool, self.cfg.max_priority, o.priority) {
            let new = status::refused(
                pool,
                podmotion_api::names::reasons::PRIORITY_CLASS_REFUSED,
                &why,
                Timestamp::now(),
            );
            let old = pool.status.clone().unwrap_or_default();
            let mut out = Outcome::new(Some(new));
            if let Some(new) = &out.status {
                out.notes.extend(status::health_change(&old, new));
            }
            out.requeue = Some(RESYNC);
            return Ok(out);
        }
        let applied = self.apply_children(pool, &o.inputs).await?;
        let (desired, applied) = applied;
        let drift = status::drift_note(&applied.drift);
        let observed =
            crate::runner_pool::status_inputs(pool, &desired, &o.inputs, &o.facts, applied);
        let new = status::compute(pool, &observed, Timestamp::now());
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

impl Shared {
    /// Renders the pool and applies every child that changed; returns what was
    /// rendered and what the applies left behind.
    async fn apply_children(
        &self,
        pool: &RunnerPool,
        inputs: &Inputs,
    ) -> Result<(crate::runner_pool::Desired, Applied), ReconcileError> {
        let ctx = &self.ctx;
        let ns = pool.namespace().unwrap_or_default();
        let desired = render::render(pool, inputs);
        let client = &ctx.client;
        let sa = desired.service_account.clone();
        children::apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), sa).await?;
        let credential_secret = children::ensure_credential_secret(self, pool, &desired).await?;
        let np = desired.network_policy.clone();
        children::apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), np).await?;
        let pdb = desired.pdb.clone();
        children::apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), pdb).await?;
        let mut conflicts = vec![];
        if let Some(pc) = desired.priority_class.clone()
            && let Some(conflict) = children::apply_priority_class(ctx, pool, pc).await?
        {
            conflicts.push(conflict);
        }
        let keep_pc: BTreeSet<String> = desired
            .priority_class
            .iter()
            .map(|p| p.name_any())
            .collect();
        children::delete_priority_classes(ctx, pool, &keep_pc).await?;
        // The DaemonSet: drift is judged on the live object before the apply.
        let (daemonset, drift) = children::apply_daemonset(ctx, pool, &desired).await?;
        let applied = Applied {
            daemonset,
            drift,
            conflicts,
            credential_secret,
        };
        Ok((desired, applied))
    }
}
