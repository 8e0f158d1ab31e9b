//! The PodMigration controller: the thin I/O shell around `crate::migration`.
//!
//! One reconcile: fetch the facts (the source and target pods, the transfer-key
//! Secret, both agents' reports, and in `Pending` the nodes and the other
//! migrations), call `machine::next`, write the status it returns, publish its
//! Events, then carry out its actions in order. Every action is idempotent, so a
//! reconcile interrupted anywhere (operator killed, API server restarted) is simply
//! repeated. Agents are polled while a migration is active (they own the status of
//! the steps they run); nothing polls the API server.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::core::DeserializeGuard;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::{Action as Requeue, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{condition_types, finalizers, labels, managers, reasons};
use rand::RngCore;
use serde_json::json;

use super::{CategorizedError, controller_config, reconcile_guard, timed};
use crate::context::Context;
use crate::events::publish;
use crate::leader::NotLeader;
use crate::migration::agent::{
    AgentCallError, AgentClient, AgentEndpoint, AgentView, Side, StepRequest,
};
use crate::migration::key::{KEY_LEN, MasterKey};
use crate::migration::machine::{self, EventKind, Knobs, Observed, Preflight, SourcePodFacts};
use crate::migration::preflight::{
    self, Limits, Me, NodeFacts, OtherMigration, PodFacts, Resources, SlotHolder,
};
use crate::migration::render::{self, Holder};

const NAME: &str = "migration";

/// Settings of the migration controller (flags with environment fallbacks).
#[derive(Args, Clone, Debug)]
pub struct MigrationConfig {
    /// Reach the agent of NODE at URL instead of through its agent pod (local runs
    /// where nodes are simulated): NODE=URL, repeatable or comma-separated.
    #[arg(long = "migration-agent-endpoint", env = "PODMOTION_AGENT_ENDPOINTS", value_delimiter = ',', value_parser = parse_endpoint)]
    pub agent_endpoints: Vec<(String, String)>,

    /// Namespace of the node-agent DaemonSet's pods.
    #[arg(
        long = "migration-agent-namespace",
        env = "PODMOTION_AGENT_NAMESPACE",
        default_value = "podmotion-system"
    )]
    pub agent_namespace: String,

    /// Label selector of the node-agent DaemonSet's pods.
    #[arg(
        long = "migration-agent-selector",
        env = "PODMOTION_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/name=podmotion-agent"
    )]
    pub agent_selector: String,

    /// gRPC port of the node agents.
    #[arg(
        long = "migration-agent-port",
        env = "PODMOTION_AGENT_PORT",
        default_value_t = 7443
    )]
    pub agent_port: u16,

    /// Most migrations past `Pending` at once in the cluster.
    #[arg(
        long = "migration-max-parallel",
        env = "PODMOTION_MIGRATION_MAX_PARALLEL",
        default_value_t = 5
    )]
    pub max_parallel: usize,

    /// Most migrations past `Pending` at once out of one source node.
    #[arg(
        long = "migration-max-per-node",
        env = "PODMOTION_MIGRATION_MAX_PER_NODE",
        default_value_t = 2
    )]
    pub max_per_node: usize,

    /// CA (PEM) that signs the node agents' certificates (mutual TLS).
    #[arg(long = "migration-agent-tls-ca", env = "PODMOTION_AGENT_TLS_CA")]
    pub agent_tls_ca: Option<String>,
    /// The operator's client certificate (PEM) for the node agents.
    #[arg(long = "migration-agent-tls-cert", env = "PODMOTION_AGENT_TLS_CERT")]
    pub agent_tls_cert: Option<String>,
    /// The operator's client key (PEM) for the node agents.
    #[arg(long = "migration-agent-tls-key", env = "PODMOTION_AGENT_TLS_KEY")]
    pub agent_tls_key: Option<String>,

    /// Reconcile PodMigrations of this namespace only (default: all namespaces).
    #[arg(
        id = "migration_namespace",
        long = "migration-namespace",
        env = "PODMOTION_MIGRATION_NAMESPACE"
    )]
    pub watch_namespace: Option<String>,

    /// File holding the master key per-migration transfer keys are derived from (at
    /// least 32 bytes). Without it a random key is used, and a migration in flight
    /// when the operator restarts fails its transfer and rolls back.
    #[arg(long = "migration-key-file", env = "PODMOTION_MIGRATION_KEY_FILE")]
    pub key_file: Option<std::path::PathBuf>,

    /// Image of the holder containers that keep a target pod's namespaces until restore.
    #[arg(
        long = "migration-holder-image",
        env = "PODMOTION_HOLDER_IMAGE",
        default_value = "registry.k8s.io/pause:3.10"
    )]
    pub holder_image: String,

    /// Command of the holder containers.
    #[arg(
        long = "migration-holder-command",
        env = "PODMOTION_HOLDER_COMMAND",
        value_delimiter = ' ',
        default_value = "/pause"
    )]
    pub holder_command: Vec<String>,
}

fn parse_endpoint(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((node, url)) if !node.is_empty() && !url.is_empty() => Ok((node.into(), url.into())),
        _ => Err(format!("expected NODE=URL, got {s:?}")),
    }
}

impl MigrationConfig {
    /// The settings from the environment alone (until the binary flattens the flags).
    pub fn from_env() -> anyhow::Result<MigrationConfig> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            m: MigrationConfig,
        }
        Ok(Only::try_parse_from(["podmotion-operator"])?.m)
    }
    fn holder(&self) -> Holder {
        Holder {
            image: self.holder_image.clone(),
            command: self.holder_command.clone(),
        }
    }
}

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("{verb} {what}: {source}")]
    Api {
        verb: &'static str,
        what: String,
        source: kube::Error,
    },
    #[error(transparent)]
    Agent(#[from] AgentCallError),
    #[error("{0}")]
    Inconsistent(String),
}

impl CategorizedError for MigrationError {
    fn category(&self) -> &'static str {
        match self {
            MigrationError::NotLeader(_) => "NotLeader",
            MigrationError::Api { .. } => "ApiError",
            MigrationError::Agent(_) => "AgentError",
            MigrationError::Inconsistent(_) => "Inconsistent",
        }
    }
}

fn api_err(
    verb: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> MigrationError {
    let what = what.into();
    move |source| MigrationError::Api { verb, what, source }
}

struct Shared<A> {
    ctx: Arc<Context>,
    /// Transfer keys are derived from it (see `migration::key`).
    master_key: MasterKey,
    /// Per migration UID: whether this process created (true) or deleted (false) its
    /// transfer-key Secret. The operator cannot read Secrets back, so after a restart
    /// a migration past `Pending` is assumed to have its key until cleanup deletes it.
    key_secrets: std::sync::Mutex<BTreeMap<String, bool>>,
    cfg: MigrationConfig,
    agents: Arc<A>,
    store: Store<DeserializeGuard<PodMigration>>,
    /// The node agents' pods (watched; endpoints come from their IPs).
    agent_pods: Store<Pod>,
}

/// Runs the controller with the settings from the environment, driving the agents
/// over the executors' gRPC wire client.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    run_configured(ctx, MigrationConfig::from_env()?).await
}

/// Runs the controller with explicit settings (the binary's flags), driving the agents
/// over the executors' gRPC wire client.
pub async fn run_configured(ctx: Arc<Context>, cfg: MigrationConfig) -> anyhow::Result<()> {
    let tls = match (&cfg.agent_tls_ca, &cfg.agent_tls_cert, &cfg.agent_tls_key) {
        (Some(ca), Some(cert), Some(key)) => Some(
            podmotion_wire::client::TlsFiles::load(ca, cert, key)
                .map_err(|e| anyhow::anyhow!("loading agent TLS material: {e}"))?,
        ),
        _ => None,
    };
    let agents = super::migration_agents::WireAgents::new(ctx.client.clone(), tls);
    run_with(ctx, cfg, Arc::new(agents)).await
}

/// The master key from `file`, or a random one (local runs) with a warning.
fn load_master_key(file: Option<&std::path::Path>) -> anyhow::Result<MasterKey> {
    match file {
        Some(f) => {
            let material = std::fs::read(f)
                .map_err(|e| anyhow::anyhow!("migration key file {}: {e}", f.display()))?;
            MasterKey::from_material(&material).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))
        }
        None => {
            tracing::warn!(
                "no --migration-key-file: transfer keys come from a random master key, so a migration in flight across an operator restart fails and rolls back"
            );
            let mut bytes = [0u8; KEY_LEN];
            rand::rng().fill_bytes(&mut bytes);
            Ok(MasterKey::from_bytes(bytes))
        }
    }
}

/// Runs the controller with explicit settings and agent client.
pub async fn run_with<A: AgentClient>(
    ctx: Arc<Context>,
    cfg: MigrationConfig,
    agents: Arc<A>,
) -> anyhow::Result<()> {
    let client = ctx.client.clone();
    // Through `DeserializeGuard`: one malformed PodMigration cannot wedge the controller.
    let (migrations, target_pods): (Api<DeserializeGuard<PodMigration>>, Api<Pod>) =
        match &cfg.watch_namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
    let controller = Controller::new(migrations, watcher::Config::default().any_semantic())
        .owns(
            target_pods,
            watcher::Config::default().labels(&format!("{}=PodMigration", labels::OWNER_KIND)),
        )
        // A replica that wins the lease reconciles everything once.
        .reconcile_all_on(ctx.leader.on_acquire())
        .with_config(controller_config(&ctx))
        .graceful_shutdown_on(ctx.shutdown());
    // The agents' pods are few: watch them rather than list them on every poll.
    let (agent_pods, writer) = reflector::store();
    let agent_api: Api<Pod> = Api::namespaced(client.clone(), &cfg.agent_namespace);
    let agent_watch = reflector(
        writer,
        watcher::watcher(
            agent_api,
            watcher::Config::default().labels(&cfg.agent_selector),
        )
        .default_backoff(),
    );
    tokio::spawn(agent_watch.for_each(|ev| async move {
        if let Err(e) = ev {
            tracing::debug!(error = %e, "agent pod watch");
        }
    }));
    let master_key = load_master_key(cfg.key_file.as_deref())?;
    let shared = Arc::new(Shared {
        master_key,
        key_secrets: Default::default(),
        agent_pods,
        ctx: ctx.clone(),
        cfg,
        agents,
        store: controller.store(),
    });
    super::mark_ready_when_synced(&ctx, NAME, shared.store.clone());
    controller
        .run(reconcile::<A>, error_policy::<A>, shared)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "migration reconcile");
            }
        })
        .await;
    Ok(())
}

fn error_policy<A: AgentClient>(
    _pm: Arc<DeserializeGuard<PodMigration>>,
    err: &MigrationError,
    _s: Arc<Shared<A>>,
) -> Requeue {
    tracing::warn!(category = err.category(), error = %err, "migration reconcile failed");
    Requeue::requeue(Duration::from_secs(2))
}

async fn reconcile<A: AgentClient>(
    guard: Arc<DeserializeGuard<PodMigration>>,
    s: Arc<Shared<A>>,
) -> Result<Requeue, MigrationError> {
    if let Some(wait) = reconcile_guard(&s.ctx) {
        return Ok(wait);
    }
    let pm = match &guard.0 {
        Ok(pm) => pm,
        Err(invalid) => {
            tracing::warn!(name = ?invalid.metadata.name, error = %invalid.error, "PodMigration does not deserialize");
            publish(
                &s.ctx,
                guard.as_ref(),
                EventType::Warning,
                reasons::INVALID_SPEC,
                "Reconcile",
                invalid.error.clone(),
            )
            .await;
            return Ok(Requeue::await_change());
        }
    };
    let ctx = s.ctx.clone();
    timed(&ctx, NAME, reconcile_one(pm, &s)).await
}

async fn reconcile_one<A: AgentClient>(
    pm: &PodMigration,
    s: &Shared<A>,
) -> Result<Requeue, MigrationError> {
    let ctx = &s.ctx;
    let client = ctx.client.clone();
    let ns = pm.namespace().unwrap_or_default();
    let name = pm.name_any();
    let uid = pm.uid().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let status = pm.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    let created = pm.meta().creation_timestamp.as_ref().map_or(now, |t| t.0);

    let source = pods
        .get_opt(&pm.spec.pod_name)
        .await
        .map_err(api_err("get", "source pod"))?;
    let target = match &status.target_pod {
        Some(t) => pods
            .get_opt(t)
            .await
            .map_err(api_err("get", "target pod"))?,
        None => None,
    };
    // The source of record is the pod the migration pinned (a pod recreated under the
    // same name is a different pod).
    let source_facts = source.as_ref().map(|p| SourcePodFacts {
        uid: p.uid().unwrap_or_default(),
        running: p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        terminating: p.meta().deletion_timestamp.is_some(),
        deletion_cost_lowered: render::deletion_cost_lowered(p),
    });
    let key_present = s
        .key_secrets
        .lock()
        .expect("key secrets")
        .get(&uid)
        .copied()
        .unwrap_or(status.phase != MigrationPhase::Pending);

    let mut preflight_verdict = None;
    let mut slot_available = true;
    if status.phase == MigrationPhase::Pending && pm.meta().deletion_timestamp.is_none() {
        let (verdict, slot) = evaluate_pending(pm, s, source.as_ref()).await?;
        preflight_verdict = Some(verdict);
        slot_available = slot;
    }

    let source_agent = agent_view(s, status.source_node.as_deref(), &uid).await?;
    let target_agent = agent_view(s, status.target_node.as_deref(), &uid).await?;

    let observed = Observed {
        now,
        created,
        generation: pm.meta().generation,
        knobs: Knobs::from_spec(&pm.spec),
        status: status.clone(),
        has_finalizer: pm
            .finalizers()
            .iter()
            .any(|f| f == finalizers::MIGRATION_CLEANUP),
        deletion_requested: pm.meta().deletion_timestamp.is_some(),
        preflight: preflight_verdict,
        slot_available,
        source_pod: source_facts,
        target_pod: target.as_ref().map(render::target_facts),
        transfer_key_present: key_present,
        source_agent,
        target_agent,
    };
    let t = machine::next(&observed);

    let migrations: Api<PodMigration> = Api::namespaced(client.clone(), &ns);
    let object_going = observed.deletion_requested && !observed.has_finalizer;
    // The finalizer patches compare-and-swap on resourceVersion: they use the version
    // the status write returns.
    let mut current = pm.clone();
    if t.status != status && !object_going {
        ctx.ensure_leader()?;
        let patch = json!({ "status": t.status });
        match migrations
            .patch_status(
                &name,
                &PatchParams::apply(managers::MIGRATION),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(updated) => current.metadata.resource_version = updated.metadata.resource_version,
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(Requeue::await_change()),
            Err(e) => return Err(api_err("patch status of", name.clone())(e)),
        }
    }
    for note in &t.notes {
        let kind = match note.kind {
            EventKind::Normal => EventType::Normal,
            EventKind::Warning => EventType::Warning,
        };
        publish(ctx, pm, kind, note.reason, "Migrate", note.message.clone()).await;
    }
    if t.status.phase != status.phase && t.status.phase.is_terminal() {
        record_outcome(ctx, &t.status);
    }

    for action in &t.actions {
        execute(
            &current,
            s,
            action,
            source.as_ref(),
            target.as_ref(),
            &t.status,
        )
        .await?;
    }
    Ok(match t.requeue_after {
        Some(d) => Requeue::requeue(d),
        None => Requeue::await_change(),
    })
}

fn record_outcome(ctx: &Context, st: &podmotion_api::PodMigrationStatus) {
    let outcome = match st.phase {
        MigrationPhase::Succeeded => "Succeeded",
        MigrationPhase::Failed => "Failed",
        _ => "Aborted",
    };
    ctx.metrics
        .migrations
        .get_or_create(&crate::metrics::OutcomeLabels { outcome })
        .inc();
    if let Some(ms) = st.downtime_millis {
        ctx.metrics.migration_downtime.observe(ms as f64 / 1000.0);
    }
    if let Some(p) = &st.progress {
        ctx.metrics
            .migration_bytes
            .inc_by(p.bytes_sent.max(0) as u64);
    }
}

/// Pre-flight inputs (nodes, their load, agents, other migrations) and the verdict,
/// plus whether a concurrency slot is free for it.
async fn evaluate_pending<A: AgentClient>(
    pm: &PodMigration,
    s: &Shared<A>,
    source: Option<&Pod>,
) -> Result<(Preflight, bool), MigrationError> {
    let client = s.ctx.client.clone();
    let node_list = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(api_err("list", "nodes"))?;
    let active = Api::<Pod>::all(client.clone())
        .list(&ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed"))
        .await
        .map_err(api_err("list", "pods"))?;
    let mut requested: BTreeMap<String, Resources> = BTreeMap::new();
    for p in &active.items {
        if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            let r = requested.entry(n).or_default();
            *r = r.plus(preflight::pod_requests(p));
        }
    }
    let endpoints = agent_endpoints(s).await?;
    let nodes: Vec<NodeFacts> = node_list
        .items
        .iter()
        .map(|n| {
            let name = n.name_any();
            NodeFacts::from_node(
                n,
                requested.get(&name).copied().unwrap_or_default(),
                endpoints.contains_key(&name),
            )
        })
        .collect();
    let ns = pm.namespace();
    let all: Vec<PodMigration> = s
        .store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned())
        .collect();
    let others: Vec<OtherMigration> = all
        .iter()
        .filter(|m| m.namespace() == ns)
        .map(|m| OtherMigration {
            name: m.name_any(),
            pod_name: m.spec.pod_name.clone(),
            created: m
                .meta()
                .creation_timestamp
                .as_ref()
                .map_or(Timestamp::now(), |t| t.0),
            terminal: m.status.as_ref().is_some_and(|st| st.phase.is_terminal()),
        })
        .collect();
    let me = Me {
        name: pm.name_any(),
        uid: pm.uid().unwrap_or_default(),
        created: pm
            .meta()
            .creation_timestamp
            .as_ref()
            .map_or(Timestamp::now(), |t| t.0),
    };
    let facts = source.map(PodFacts::from_pod);
    let verdict = preflight::preflight(&pm.spec, &me, facts.as_ref(), &nodes, &others);
    let slot = match &verdict {
        Preflight::Migratable(plan) => {
            let holders: Vec<SlotHolder> = all
                .iter()
                .map(|m| {
                    let st = m.status.clone().unwrap_or_default();
                    SlotHolder {
                        name: format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any()),
                        created: m
                            .meta()
                            .creation_timestamp
                            .as_ref()
                            .map_or(Timestamp::now(), |t| t.0),
                        source_node: st.source_node.clone(),
                        started: st.phase != MigrationPhase::Pending && !st.phase.is_terminal(),
                        queued: st.phase == MigrationPhase::Pending
                            && podmotion_api::conditions::is_true(
                                &st.conditions,
                                condition_types::MIGRATABLE,
                            ),
                    }
                })
                .collect();
            let me_slot = Me {
                name: format!("{}/{}", pm.namespace().unwrap_or_default(), pm.name_any()),
                ..me.clone()
            };
            let limits = Limits {
                per_cluster: s.cfg.max_parallel,
                per_source_node: s.cfg.max_per_node,
            };
            preflight::slot_available(&me_slot, &plan.source_node, &holders, limits)
        }
        Preflight::NotMigratable { .. } => true,
    };
    Ok((verdict, slot))
}

/// Node → agent endpoint: overrides first, then the Ready agent pods.
/// Node → agent endpoint: the Ready agent pods (from the watch), then the overrides.
async fn agent_endpoints<A>(s: &Shared<A>) -> Result<BTreeMap<String, String>, MigrationError> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    // With overrides (local runs) the watch may never sync (no RBAC, no namespace).
    if s.cfg.agent_endpoints.is_empty()
        && tokio::time::timeout(Duration::from_secs(5), s.agent_pods.wait_until_ready())
            .await
            .is_err()
    {
        return Err(MigrationError::Inconsistent(
            "the agent pod watch has not synced yet".into(),
        ));
    }
    for p in s.agent_pods.state() {
        let ready = p
            .status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let node = p.spec.as_ref().and_then(|sp| sp.node_name.clone());
        let ip = p.status.as_ref().and_then(|st| st.pod_ip.clone());
        if let (true, Some(node), Some(ip)) =
            (ready && p.metadata.deletion_timestamp.is_none(), node, ip)
        {
            out.insert(node, format!("https://{ip}:{}", s.cfg.agent_port));
        }
    }
    for (node, url) in &s.cfg.agent_endpoints {
        out.insert(node.clone(), url.clone());
    }
    Ok(out)
}

async fn endpoint_of<A>(
    s: &Shared<A>,
    node: &str,
) -> Result<Option<AgentEndpoint>, MigrationError> {
    let all = agent_endpoints(s).await?;
    Ok(all.get(node).map(|url| AgentEndpoint {
        node: node.into(),
        url: url.clone(),
    }))
}

async fn agent_view<A: AgentClient>(
    s: &Shared<A>,
    node: Option<&str>,
    uid: &str,
) -> Result<AgentView, MigrationError> {
    let Some(node) = node else {
        return Ok(AgentView::Missing);
    };
    let Some(endpoint) = endpoint_of(s, node).await? else {
        return Ok(AgentView::Missing);
    };
    Ok(match s.agents.report(&endpoint, uid).await {
        Ok(r) => AgentView::Reported(r),
        Err(e) => AgentView::Unreachable(e.message),
    })
}

async fn execute<A: AgentClient>(
    pm: &PodMigration,
    s: &Shared<A>,
    action: &machine::Action,
    source: Option<&Pod>,
    target: Option<&Pod>,
    status: &podmotion_api::PodMigrationStatus,
) -> Result<(), MigrationError> {
    use machine::Action as A_;
    let ctx = &s.ctx;
    ctx.ensure_leader()?;
    let client = ctx.client.clone();
    let ns = pm.namespace().unwrap_or_default();
    let name = pm.name_any();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let migrations: Api<PodMigration> = Api::namespaced(client.clone(), &ns);
    let merge = PatchParams::default();
    match action {
        A_::AddFinalizer | A_::RemoveFinalizer => {
            let mut list: Vec<String> = pm
                .finalizers()
                .iter()
                .filter(|f| *f != finalizers::MIGRATION_CLEANUP)
                .cloned()
                .collect();
            if *action == A_::AddFinalizer {
                list.push(finalizers::MIGRATION_CLEANUP.into());
            }
            if *action == A_::RemoveFinalizer {
                // The object goes: forget what we remembered of its key Secret.
                remember_key_secret(s, pm, None);
            }
            // resourceVersion makes this a compare-and-swap with other finalizer owners.
            let patch =
                json!({"metadata": {"finalizers": list, "resourceVersion": pm.resource_version()}});
            match migrations.patch(&name, &merge, &Patch::Merge(&patch)).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 && *action == A_::RemoveFinalizer => {
                    Ok(())
                }
                Err(e) => Err(api_err("patch finalizers of", name)(e)),
            }
        }
        A_::EnsureTransferKey => {
            let key = s.master_key.transfer_key(&pm.uid().unwrap_or_default());
            let secret = render::transfer_key_secret(pm, &key.0);
            create_if_absent(&secrets, &secret, "transfer key").await?;
            remember_key_secret(s, pm, Some(true));
            Ok(())
        }
        A_::EnsureTargetPod => {
            let (Some(src), Some(node)) = (source, status.target_node.as_deref()) else {
                return Err(MigrationError::Inconsistent(
                    "target pod wanted without source pod or target node".into(),
                ));
            };
            let pod = render::target_pod(pm, src, node, &s.cfg.holder());
            let pp = PostParams {
                field_manager: Some(managers::MIGRATION.into()),
                ..Default::default()
            };
            match pods.create(&pp, &pod).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
                Err(e) => Err(api_err("create", "target pod")(e)),
            }
        }
        A_::Agent(side, step) => {
            let node = match side {
                Side::Source => status.source_node.as_deref(),
                Side::Target => status.target_node.as_deref(),
            }
            .ok_or_else(|| MigrationError::Inconsistent(format!("no {side} node recorded")))?;
            let Some(endpoint) = endpoint_of(s, node).await? else {
                return Err(MigrationError::Inconsistent(format!(
                    "no agent endpoint for {node}"
                )));
            };
            let request = StepRequest {
                migration_uid: pm.uid().unwrap_or_default(),
                namespace: ns.clone(),
                source_pod: pm.spec.pod_name.clone(),
                source_pod_uid: status.source_pod_uid.clone().unwrap_or_default(),
                target_pod: status.target_pod.clone().unwrap_or_default(),
                source_node: status.source_node.clone().unwrap_or_default(),
                target_node: status.target_node.clone().unwrap_or_default(),
                transfer_key: s.master_key.transfer_key(&pm.uid().unwrap_or_default()),
                mode: pm.spec.mode,
                tcp_preservation: pm.spec.tcp_preservation,
                bandwidth_limit_bytes_per_second: pm.spec.bandwidth_limit_bytes_per_second,
                probe: source.and_then(|src| render::effective_probe(pm.spec.probe.as_ref(), src)),
                target_agent_url: match status.target_node.as_deref() {
                    Some(t) => endpoint_of(s, t).await?.map(|e| e.url),
                    None => None,
                },
                container_ids: match side {
                    Side::Source => source,
                    Side::Target => target,
                }
                .and_then(|p| p.status.as_ref())
                .and_then(|st| st.container_statuses.as_ref())
                .map(|cs| cs.iter().filter_map(|c| c.container_id.clone()).collect())
                .unwrap_or_default(),
                close_connections: status
                    .network
                    .as_ref()
                    .is_some_and(|n| n.connections_closed > 0),
                step: *step,
            };
            s.agents.start(&endpoint, &request).await?;
            Ok(())
        }
        A_::LowerSourceDeletionCost => {
            let Some(src) = source else { return Ok(()) };
            let patch = render::deletion_cost_patch();
            pods.patch(&src.name_any(), &merge, &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .or_else(ignore_404)
                .map_err(api_err("patch deletion cost of", "source pod"))
        }
        A_::HandOverTargetPod => {
            let Some(t) = target else { return Ok(()) };
            let patch = render::hand_over_patch(t);
            pods.patch(&t.name_any(), &merge, &Patch::Merge(&patch))
                .await
                .map(|_| ())
                .map_err(api_err("hand over", "target pod"))
        }
        A_::DeleteSourcePod => {
            // Only the pod this migration pinned, never a namesake.
            let dp = DeleteParams {
                preconditions: Some(Preconditions {
                    uid: status.source_pod_uid.clone(),
                    resource_version: None,
                }),
                ..Default::default()
            };
            pods.delete(&pm.spec.pod_name, &dp)
                .await
                .map(|_| ())
                .or_else(|e| match e {
                    kube::Error::Api(ref a) if a.code == 404 || a.code == 409 => Ok(()),
                    e => Err(e),
                })
                .map_err(api_err("delete", "source pod"))
        }
        A_::DeleteTargetPod => {
            let Some(t) = &status.target_pod else {
                return Ok(());
            };
            pods.delete(t, &DeleteParams::default())
                .await
                .map(|_| ())
                .or_else(ignore_404)
                .map_err(api_err("delete", "target pod"))
        }
        A_::DeleteTransferKey => {
            secrets
                .delete(&render::transfer_key_name(pm), &DeleteParams::default())
                .await
                .map(|_| ())
                .or_else(ignore_404)
                .map_err(api_err("delete", "transfer key"))?;
            remember_key_secret(s, pm, Some(false));
            Ok(())
        }
    }
}

/// Records that this process created (`Some(true)`) or deleted (`Some(false)`) the
/// migration's key Secret, or forgets the migration (`None`).
fn remember_key_secret<A>(s: &Shared<A>, pm: &PodMigration, exists: Option<bool>) {
    let mut memo = s.key_secrets.lock().expect("key secrets");
    let uid = pm.uid().unwrap_or_default();
    match exists {
        Some(e) => memo.insert(uid, e),
        None => memo.remove(&uid),
    };
}

fn ignore_404(e: kube::Error) -> Result<(), kube::Error> {
    match e {
        kube::Error::Api(ref a) if a.code == 404 => Ok(()),
        e => Err(e),
    }
}

async fn create_if_absent<K>(api: &Api<K>, obj: &K, what: &str) -> Result<(), MigrationError>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let pp = PostParams {
        field_manager: Some(managers::MIGRATION.into()),
        ..Default::default()
    };
    match api.create(&pp, obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(api_err("create", what)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_overrides_parse_as_node_equals_url() {
        assert_eq!(
            parse_endpoint("pm-node-0=http://127.0.0.1:7001").unwrap().0,
            "pm-node-0"
        );
        assert!(parse_endpoint("pm-node-0").is_err());
        assert!(parse_endpoint("=http://x").is_err());
    }

    #[test]
    fn settings_default_to_five_per_cluster_and_two_per_node() {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            m: MigrationConfig,
        }
        let c = Only::try_parse_from(["x"]).unwrap().m;
        assert_eq!((c.max_parallel, c.max_per_node), (5, 2));
        let c = Only::try_parse_from(["x", "--migration-agent-endpoint", "a=http://1,b=http://2"])
            .unwrap()
            .m;
        assert_eq!(c.agent_endpoints.len(), 2);
    }
}
