//! The RunnerPool controller: the thin I/O shell around `crate::runner_pool`.
//!
//! One reconcile: make sure the cleanup finalizer is on; fetch the facts (eligible
//! node count, the Server's Service, the existing token, the namespace's PodSecurity
//! labels, the live DaemonSet, the Runner pods, the namespace's NetworkPolicies);
//! render; apply each child whose rendered form changed (a hash annotation for the
//! small children, the drift check for the DaemonSet), so a settled pool costs no
//! writes; delete children no longer rendered; write the status if it changed. On
//! deletion the finalizer removes the cluster-scoped PriorityClass (the namespaced
//! children go with their owner reference).
//!
//! Watches: RunnerPools (through `DeserializeGuard`, so one malformed object cannot
//! wedge the controller), the DaemonSet (content is needed: status counts and drift),
//! the Runner pods (preflight verdicts), and the ServiceAccount, Secret,
//! NetworkPolicy and PDB as metadata (`PartialObjectMeta`; kube 5 without its
//! unstable stream feature still lists those objects in full, but keeps only their
//! metadata).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use podmotion_api::RunnerPool;
use podmotion_api::names::{annotations, finalizers, labels, managers, reasons};
use rand::RngCore;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::json;

use super::{CategorizedError, controller_config, reconcile_guard, timed};
use crate::children::{self, ChildError, owner_selector, short_hash};
use crate::context::Context;
use crate::events::publish;
use crate::leader::NotLeader;
use crate::runner_pool::status::{self, Observed};
use crate::runner_pool::{
    Desired, Inputs, ServerEndpoint, drift, pod_security, policies, preflight, render,
};

const NAME: &str = "runner-pool";

/// Preflight image used when a RunnerPool names none (`PODMOTION_PREFLIGHT_IMAGE`).
pub const DEFAULT_PREFLIGHT_IMAGE: &str = "ghcr.io/podmotion/preflight@sha256:0000000000000000000000000000000000000000000000000000000000000000";

/// Resync period: picks up changes of things not watched (the Server's Service, the
/// namespace's PodSecurity labels, other NetworkPolicies, node labels).
const RESYNC: Duration = Duration::from_secs(300);

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum RunnerPoolError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error(transparent)]
    Child(#[from] ChildError),
    #[error("{verb} {what}: {source}")]
    Api {
        verb: &'static str,
        what: String,
        source: kube::Error,
    },
}

impl CategorizedError for RunnerPoolError {
    fn category(&self) -> &'static str {
        match self {
            RunnerPoolError::NotLeader(_) => "NotLeader",
            RunnerPoolError::Child(e) => e.category(),
            RunnerPoolError::Api { .. } => "ApiError",
        }
    }
}

fn api_err(
    verb: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> RunnerPoolError {
    let what = what.into();
    move |source| RunnerPoolError::Api { verb, what, source }
}

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
    /// Whether the operator may read Secrets (in `watch_namespace`). The chart grants
    /// get/list/watch on Secrets only through a Role in the watch namespace, so this
    /// is true exactly when a watch namespace is set.
    pub read_secrets: bool,
}

impl RunnerPoolConfig {
    /// The settings from the environment.
    pub fn from_env() -> RunnerPoolConfig {
        RunnerPoolConfig {
            preflight_image: std::env::var("PODMOTION_PREFLIGHT_IMAGE")
                .unwrap_or_else(|_| DEFAULT_PREFLIGHT_IMAGE.to_string()),
            watch_namespace: std::env::var("PODMOTION_RUNNER_POOL_NAMESPACE")
                .ok()
                .filter(|s| !s.is_empty()),
            read_secrets: false,
        }
        .with_secret_reads_where_granted()
    }

    /// `read_secrets` as the chart grants it: only with a watch namespace.
    pub fn with_secret_reads_where_granted(mut self) -> RunnerPoolConfig {
        self.read_secrets = self.watch_namespace.is_some();
        self
    }
}

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    run_with(ctx, RunnerPoolConfig::from_env()).await
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
    controller
        .run(reconcile, error_policy, shared)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "runner-pool reconcile");
            }
        })
        .await;
    Ok(())
}

fn error_policy(
    _rp: Arc<DeserializeGuard<RunnerPool>>,
    err: &RunnerPoolError,
    _s: Arc<Shared>,
) -> Action {
    tracing::warn!(category = err.category(), error = %err, "runner-pool reconcile failed");
    Action::requeue(Duration::from_secs(5))
}

async fn reconcile(
    guard: Arc<DeserializeGuard<RunnerPool>>,
    s: Arc<Shared>,
) -> Result<Action, RunnerPoolError> {
    if let Some(wait) = reconcile_guard(&s.ctx) {
        return Ok(wait);
    }
    let pool = match &guard.0 {
        Ok(pool) => pool,
        Err(invalid) => {
            tracing::warn!(name = ?invalid.metadata.name, error = %invalid.error, "RunnerPool does not deserialize");
            publish(
                &s.ctx,
                guard.as_ref(),
                EventType::Warning,
                reasons::INVALID_SPEC,
                "Reconcile",
                invalid.error.clone(),
            )
            .await;
            return Ok(Action::await_change());
        }
    };
    timed(&s.ctx, NAME, reconcile_pool(pool, &s)).await
}

fn has_finalizer(pool: &RunnerPool) -> bool {
    pool.finalizers()
        .iter()
        .any(|f| f == finalizers::RUNNER_POOL_CLEANUP)
}

async fn set_finalizers(
    ctx: &Context,
    pool: &RunnerPool,
    list: Vec<String>,
) -> Result<(), RunnerPoolError> {
    ctx.ensure_leader()?;
    let api: Api<RunnerPool> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    // The resourceVersion makes a concurrent change fail (and retry), not be overwritten.
    let patch =
        json!({"metadata": {"finalizers": list, "resourceVersion": pool.resource_version()}});
    match api
        .patch(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(e) => Err(api_err("set finalizers of", pool.name_any())(e)),
    }
}

async fn reconcile_pool(pool: &RunnerPool, s: &Shared) -> Result<Action, RunnerPoolError> {
    let ctx = &s.ctx;
    if pool.metadata.deletion_timestamp.is_some() {
        if has_finalizer(pool) {
            delete_priority_classes(ctx, pool, &BTreeSet::new()).await?;
            let keep = pool
                .finalizers()
                .iter()
                .filter(|f| *f != finalizers::RUNNER_POOL_CLEANUP)
                .cloned()
                .collect();
            set_finalizers(ctx, pool, keep).await?;
        }
        return Ok(Action::await_change());
    }
    if !has_finalizer(pool) {
        let mut all = pool.finalizers().to_vec();
        all.push(finalizers::RUNNER_POOL_CLEANUP.into());
        set_finalizers(ctx, pool, all).await?;
        // The patch changes the object: the watch brings it back with the finalizer.
        return Ok(Action::await_change());
    }

    let client = ctx.client.clone();
    let ns = pool.namespace().unwrap_or_default();
    let inputs = fetch_inputs(s, pool).await?;
    let desired = render::render(pool, &inputs);

    // The small children: applied when missing or when their rendered form changed.
    apply_if_changed(
        ctx,
        &Api::namespaced(client.clone(), &ns),
        desired.service_account.clone(),
    )
    .await?;
    let credential_secret = ensure_credential_secret(s, pool, &desired).await?;
    apply_if_changed(
        ctx,
        &Api::namespaced(client.clone(), &ns),
        desired.network_policy.clone(),
    )
    .await?;
    apply_if_changed(
        ctx,
        &Api::namespaced(client.clone(), &ns),
        desired.pdb.clone(),
    )
    .await?;
    let mut conflicts = vec![];
    if let Some(pc) = desired.priority_class.clone()
        && let Some(conflict) = apply_priority_class(ctx, pool, pc).await?
    {
        conflicts.push(conflict);
    }
    let keep_pc: BTreeSet<String> = desired
        .priority_class
        .iter()
        .map(|p| p.name_any())
        .collect();
    delete_priority_classes(ctx, pool, &keep_pc).await?;
    // The DaemonSet: drift is judged on the live object before the apply.
    let (live, drift) = apply_daemonset(ctx, pool, &desired).await?;
    if !drift.is_empty() {
        publish(
            ctx,
            pool,
            EventType::Warning,
            reasons::SHAPE_DRIFT,
            "Repair",
            format!(
                "live DaemonSet differed from the contract, re-applied: {}",
                drift.join("; ")
            ),
        )
        .await;
    }

    let applied = Applied {
        daemonset: live,
        drift,
        conflicts,
        credential_secret,
    };
    let observed = observe(s, pool, &desired, &inputs, applied).await?;
    let new_status = status::compute(pool, &observed, Timestamp::now());
    let old_status = pool.status.clone().unwrap_or_default();
    if serde_json::to_value(&new_status).ok() != serde_json::to_value(&old_status).ok() {
        ctx.ensure_leader()?;
        let api: Api<RunnerPool> = Api::namespaced(client.clone(), &ns);
        api.patch_status(
            &pool.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status_patch(&old_status, &new_status)})),
        )
        .await
        .map_err(api_err("update status of", pool.name_any()))?;
        announce_health_change(ctx, pool, &old_status, &new_status).await;
    }
    Ok(Action::requeue(RESYNC))
}

async fn fetch_inputs(s: &Shared, pool: &RunnerPool) -> Result<Inputs, RunnerPoolError> {
    let client = s.ctx.client.clone();
    let ns = pool.namespace().unwrap_or_default();
    let nodes = &pool.spec.nodes;
    let eligible = Api::<Node>::all(client.clone())
        .list_metadata(
            &ListParams::default().labels(&format!("{}={}", nodes.label_key, nodes.label_value)),
        )
        .await
        .map_err(api_err("list", "Runner nodes"))?
        .items
        .len();
    let server_ns = pool
        .spec
        .server
        .namespace
        .clone()
        .unwrap_or_else(|| ns.clone());
    let service = Api::<Service>::namespaced(client.clone(), &server_ns)
        .get_opt(&pool.spec.server.service_name)
        .await
        .map_err(api_err("get", "the Server's Service"))?;
    let server = service.and_then(|svc| {
        let spec = svc.spec?;
        let selector = spec.selector.filter(|s| !s.is_empty())?;
        let port = spec
            .ports?
            .into_iter()
            .find(|p| p.port == pool.spec.server.port)?;
        Some(ServerEndpoint {
            namespace: server_ns.clone(),
            selector,
            target_port: port.target_port.unwrap_or(IntOrString::Int(port.port)),
        })
    });
    let credential_token = if pool.spec.credentials.secret_name.is_some() {
        None
    } else if s.reads_secrets() {
        let (name, key) = render::credential_secret(pool);
        let existing = Api::<Secret>::namespaced(client.clone(), &ns)
            .get_opt(&name)
            .await
            .map_err(api_err("get", "the credential Secret"))?
            .and_then(|s| s.data)
            .and_then(|d| d.get(&key).cloned())
            .filter(|v| !v.0.is_empty());
        Some(match existing {
            Some(token) => String::from_utf8_lossy(&token.0).into_owned(),
            None => fresh_token(),
        })
    } else {
        // Used only when the Secret is created (once, see `ensure_credential_secret`).
        Some(fresh_token())
    };
    Ok(Inputs {
        preflight_image: s.cfg.preflight_image.clone(),
        eligible_nodes: eligible,
        server,
        credential_token,
    })
}

impl Shared {
    /// Whether the operator may read Secrets: only in its watch namespace (the chart
    /// grants get/list/watch there through a Role, and nowhere else).
    fn reads_secrets(&self) -> bool {
        self.cfg.read_secrets && self.cfg.watch_namespace.is_some()
    }
}

/// Keeps the generated credential Secret: returns the name of the one the operator owns.
///
/// Where Secrets may be read, it is applied like the other children and stale ones are
/// deleted by label. Elsewhere the operator never reads a Secret: it creates the Secret
/// once (an existing one is kept: 409), records its name in the status, and deletes a
/// previously recorded one by name when the pool switches to its own Secret.
async fn ensure_credential_secret(
    s: &Shared,
    pool: &RunnerPool,
    desired: &Desired,
) -> Result<Option<String>, RunnerPoolError> {
    let ctx = &s.ctx;
    let api: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let want = desired.secret.as_ref().map(|x| x.name_any());
    if s.reads_secrets() {
        if let Some(secret) = desired.secret.clone() {
            apply_if_changed(ctx, &api, secret).await?;
        }
        let keep: BTreeSet<String> = want.iter().cloned().collect();
        children::delete_orphans(
            ctx,
            &api,
            &owner_selector(pool),
            &keep,
            PropagationPolicy::Background,
        )
        .await?;
        return Ok(want);
    }
    let recorded = pool
        .status
        .as_ref()
        .and_then(|st| st.credential_secret.clone());
    if let Some(old) = recorded.as_ref().filter(|old| want.as_ref() != Some(*old)) {
        children::delete(ctx, &api, old, PropagationPolicy::Background).await?;
    }
    if let Some(secret) = desired.secret.as_ref().filter(|_| recorded != want) {
        ctx.ensure_leader()?;
        let (secret, _) = stamp(secret.clone());
        match api.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(e) => {
                return Err(api_err("create", format!("Secret {}", secret.name_any()))(
                    e,
                ));
            }
        }
    }
    Ok(want)
}

/// 32 random bytes as hex.
fn fresh_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hash of a rendered object, recorded as an annotation on it.
fn stamp<K: Resource + Serialize>(mut obj: K) -> (K, String) {
    let hash = short_hash(&serde_json::to_string(&obj).unwrap_or_default(), 16);
    obj.annotations_mut()
        .insert(annotations::SPEC_HASH.into(), hash.clone());
    (obj, hash)
}

/// Applies `obj` unless the live one carries the same rendered hash (reads, no write).
async fn apply_if_changed<K>(ctx: &Context, api: &Api<K>, obj: K) -> Result<(), RunnerPoolError>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let (obj, hash) = stamp(obj);
    let name = obj.name_any();
    let live = api
        .get_metadata_opt(&name)
        .await
        .map_err(api_err("get", format!("{} {name}", K::kind(&()))))?;
    if live
        .as_ref()
        .and_then(|l| l.annotations().get(annotations::SPEC_HASH))
        == Some(&hash)
    {
        return Ok(());
    }
    children::apply(ctx, api, &obj, managers::RUNNER_POOL).await?;
    Ok(())
}

/// Applies the pool's PriorityClass. One of another owner is never taken over (that
/// is reported); the value of a PriorityClass is immutable, so ours is replaced when
/// the value changes. Returns a conflict message, if any.
async fn apply_priority_class(
    ctx: &Context,
    pool: &RunnerPool,
    pc: PriorityClass,
) -> Result<Option<String>, RunnerPoolError> {
    let api: Api<PriorityClass> = Api::all(ctx.client.clone());
    let name = pc.name_any();
    if let Some(live) = api
        .get_opt(&name)
        .await
        .map_err(api_err("get", format!("PriorityClass {name}")))?
    {
        let ours = live.labels().get(labels::OWNER_UID) == pool.uid().as_ref();
        if !ours {
            return Ok(Some(format!(
                "PriorityClass {name} exists and is not this pool's: set priorityClass.create=false to use it, or pick another name"
            )));
        }
        if live.value != pc.value {
            children::delete(ctx, &api, &name, PropagationPolicy::Background).await?;
        }
    }
    apply_if_changed(ctx, &api, pc).await?;
    Ok(None)
}

/// Deletes the pool's PriorityClasses not in `keep` (found by owner label).
async fn delete_priority_classes(
    ctx: &Context,
    pool: &RunnerPool,
    keep: &BTreeSet<String>,
) -> Result<(), RunnerPoolError> {
    let api: Api<PriorityClass> = Api::all(ctx.client.clone());
    children::delete_orphans(
        ctx,
        &api,
        &owner_selector(pool),
        keep,
        PropagationPolicy::Background,
    )
    .await?;
    Ok(())
}

/// Applies the DaemonSet when it is missing or has drifted; returns the live object
/// and the drift found before the apply.
async fn apply_daemonset(
    ctx: &Context,
    pool: &RunnerPool,
    desired: &Desired,
) -> Result<(DaemonSet, Vec<String>), RunnerPoolError> {
    let api: Api<DaemonSet> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let (ds, hash) = stamp(desired.daemonset.clone());
    let name = ds.name_any();
    let live = api
        .get_opt(&name)
        .await
        .map_err(api_err("get", format!("DaemonSet {name}")))?;
    let drift = live
        .as_ref()
        .map(|l| drift::shape_drift(&ds, l))
        .unwrap_or_default();
    let hash_matches = live
        .as_ref()
        .and_then(|l| l.annotations().get(annotations::SPEC_HASH))
        == Some(&hash);
    if let Some(live) = live.filter(|_| drift.is_empty() && hash_matches) {
        return Ok((live, drift));
    }
    let applied = children::apply(ctx, &api, &ds, managers::RUNNER_POOL).await?;
    // A forced apply restores every field we own, but cannot remove what another
    // manager added (an extra volume, a capability). Then replace the whole spec.
    if drift::shape_drift(&ds, &applied).is_empty() {
        return Ok((applied, drift));
    }
    let pp = PostParams {
        field_manager: Some(managers::RUNNER_POOL.into()),
        ..Default::default()
    };
    // The DaemonSet controller writes its status all the time, so the resourceVersion
    // may move between our read and the replace: retry a conflict on a fresh read.
    let mut current = applied;
    let mut attempts = 0;
    let replaced = loop {
        ctx.ensure_leader()?;
        let mut replacement = ds.clone();
        replacement.metadata.resource_version = current.resource_version();
        match api.replace(&name, &pp, &replacement).await {
            Ok(r) => break r,
            Err(kube::Error::Api(e)) if e.code == 409 && attempts < 5 => {
                attempts += 1;
                current = api
                    .get(&name)
                    .await
                    .map_err(api_err("get", format!("DaemonSet {name}")))?;
            }
            Err(e) => return Err(api_err("replace", format!("DaemonSet {name}"))(e)),
        }
    };
    Ok((replaced, drift))
}

/// What this round's applies left behind, for the status.
struct Applied {
    daemonset: DaemonSet,
    drift: Vec<String>,
    conflicts: Vec<String>,
    credential_secret: Option<String>,
}

async fn observe(
    s: &Shared,
    pool: &RunnerPool,
    desired: &Desired,
    inputs: &Inputs,
    applied: Applied,
) -> Result<Observed, RunnerPoolError> {
    let client = s.ctx.client.clone();
    let ns = pool.namespace().unwrap_or_default();
    let namespace = Api::<Namespace>::all(client.clone())
        .get_metadata_opt(&ns)
        .await
        .map_err(api_err("get", format!("Namespace {ns}")))?;
    let ns_labels: BTreeMap<String, String> =
        namespace.map(|n| n.labels().clone()).unwrap_or_default();
    let pod_spec = desired
        .daemonset
        .spec
        .template
        .spec
        .clone()
        .unwrap_or_default();
    let pod_security = pod_security::check(&ns, &ns_labels, &pod_spec);

    let selector = render::pod_selector(pool)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(api_err("list", "Runner pods"))?;
    let preflight = pods.items.iter().map(preflight::from_pod).collect();
    let unschedulable = pods
        .items
        .iter()
        .filter_map(status::unschedulable)
        .collect();

    let nps = Api::<NetworkPolicy>::namespaced(client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .map_err(api_err("list", "NetworkPolicies"))?;
    let pod_labels: BTreeMap<String, String> = desired
        .daemonset
        .spec
        .template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    let foreign = policies::foreign_policies(&render::child_name(pool), &pod_labels, &nps.items);

    let server = match &inputs.server {
        Some(_) => Ok(()),
        None => Err(format!(
            "Service {}/{} is missing, has no pod selector or no port {}: the Runner pods get no egress to the Server",
            pool.spec
                .server
                .namespace
                .clone()
                .unwrap_or_else(|| ns.clone()),
            pool.spec.server.service_name,
            pool.spec.server.port
        )),
    };
    Ok(Observed {
        daemonset: Some(applied.daemonset),
        drift: applied.drift,
        pod_security,
        preflight,
        server,
        foreign_policies: foreign,
        conflicts: applied.conflicts,
        unschedulable,
        credential_secret: applied.credential_secret,
    })
}

/// The merge patch from `old` to `new` status. Fields that went away (an empty list,
/// an unset option: not serialized) are set to null, or a merge patch would keep them.
fn status_patch(
    old: &podmotion_api::RunnerPoolStatus,
    new: &podmotion_api::RunnerPoolStatus,
) -> serde_json::Value {
    let mut patch = serde_json::to_value(new).unwrap_or_default();
    if let (Some(p), Ok(serde_json::Value::Object(o))) =
        (patch.as_object_mut(), serde_json::to_value(old))
    {
        for key in o.keys() {
            p.entry(key.clone()).or_insert(serde_json::Value::Null);
        }
    }
    patch
}

/// Records an Event when the pool's kstatus health changes.
async fn announce_health_change(
    ctx: &Context,
    pool: &RunnerPool,
    old: &podmotion_api::RunnerPoolStatus,
    new: &podmotion_api::RunnerPoolStatus,
) {
    use podmotion_api::conditions::find;
    use podmotion_api::names::condition_types as ct;
    let true_health = |s: &podmotion_api::RunnerPoolStatus| {
        [ct::READY, ct::RECONCILING, ct::STALLED]
            .into_iter()
            .filter_map(|t| find(&s.conditions, t).filter(|c| c.status == "True"))
            .map(|c| (c.type_.clone(), c.reason.clone(), c.message.clone()))
            .next()
    };
    let (before, after) = (true_health(old), true_health(new));
    let Some((type_, reason, message)) = after else {
        return;
    };
    if before.as_ref().map(|(t, r, _)| (t, r)) == Some((&type_, &reason)) {
        return;
    }
    let kind = if type_ == ct::STALLED {
        EventType::Warning
    } else {
        EventType::Normal
    };
    publish(ctx, pool, kind, &reason, "Reconcile", message).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_api::RunnerPoolStatus;

    #[test]
    fn a_status_field_that_went_away_is_nulled_in_the_patch() {
        let old = RunnerPoolStatus {
            credential_secret: Some("rp-credentials".into()),
            ready_nodes: 2,
            ..Default::default()
        };
        let new = RunnerPoolStatus {
            ready_nodes: 3,
            ..Default::default()
        };
        let p = status_patch(&old, &new);
        assert_eq!(p["credentialSecret"], serde_json::Value::Null);
        assert!(p.as_object().unwrap().contains_key("credentialSecret"));
        assert_eq!(p["readyNodes"], 3);
    }
}
