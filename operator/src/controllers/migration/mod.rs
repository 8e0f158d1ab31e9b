//! The PodMigration controller: the wiring around `crate::migration`.
//!
//! One reconcile: observe the facts ([`observe`]: the source and target pods, the
//! transfer-key Secret, both agents' reports, and in `Pending` the nodes and the other
//! migrations), call `machine::next`, hand its status and notes to the shell, which
//! writes the status first, then carry out its actions in order ([`act`]). Every
//! action is idempotent, so a reconcile interrupted anywhere (operator killed, API
//! server restarted) is simply repeated. The finalizer is the shell's: deleting a
//! PodMigration runs the machine's rollback, and the finalizer goes when the machine
//! says so. Agents are polled while a migration is active (they own the status of the
//! steps they run); nothing polls the API server.

mod act;
mod observe;

use std::collections::BTreeMap;
use std::sync::Arc;

use clap::{Args, Parser};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, Store, reflector};
use kube::runtime::watcher;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{finalizers, labels, managers};
use podmotion_api::{PodMigration, PodMigrationStatus};
use rand::RngCore;

use super::controller_config;
use super::shell::{self, Outcome, ReconcileError, Reconciler};
use crate::context::Context;
use crate::migration::agent::AgentClient;
use crate::migration::key::{KEY_LEN, MasterKey};
use crate::migration::machine::{self, Action};
use crate::migration::render::Holder;

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

    /// Image whose entrypoint is `podmotion-agent` (the migration agent's image): a
    /// target pod's init container copies the holder program out of it. Default: the
    /// agent image of this version.
    #[arg(long = "migration-holder-image", env = "PODMOTION_HOLDER_IMAGE")]
    pub holder_image: Option<String>,
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
        match &self.holder_image {
            Some(i) if !i.is_empty() => Holder {
                installer_image: i.clone(),
            },
            _ => Holder::default(),
        }
    }
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

impl<A> Shared<A> {
    /// Records that this process created (`Some(true)`) or deleted (`Some(false)`) the
    /// migration's key Secret, or forgets the migration (`None`).
    fn remember_key_secret(&self, pm: &PodMigration, exists: Option<bool>) {
        let mut memo = self.key_secrets.lock().expect("key secrets");
        let uid = pm.uid().unwrap_or_default();
        match exists {
            Some(e) => memo.insert(uid, e),
            None => memo.remove(&uid),
        };
    }

    /// Whether the migration's key Secret exists, as far as this process knows.
    fn key_present(&self, pm: &PodMigration, phase: MigrationPhase) -> bool {
        self.key_secrets
            .lock()
            .expect("key secrets")
            .get(&pm.uid().unwrap_or_default())
            .copied()
            .unwrap_or(phase != MigrationPhase::Pending)
    }
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
    let agents = crate::agents::WireAgents::new(ctx.client.clone(), tls);
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
    shell::run(controller, shared).await;
    Ok(())
}

/// What the machine decided that must follow the status write.
#[derive(Default)]
struct Deferred {
    actions: Vec<Action>,
    source: Option<Pod>,
    target: Option<Pod>,
    status: PodMigrationStatus,
}

impl<A: AgentClient> Reconciler for Shared<A> {
    type Object = PodMigration;
    type Status = PodMigrationStatus;
    type Observed = observe::Observation;
    type Then = Deferred;
    const NAME: &'static str = NAME;
    const FINALIZER: &'static str = finalizers::MIGRATION_CLEANUP;
    const MANAGER: &'static str = managers::MIGRATION;

    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn status(pm: &PodMigration) -> Option<&PodMigrationStatus> {
        pm.status.as_ref()
    }

    async fn observe(
        &self,
        pm: &PodMigration,
        _cleanup: bool,
    ) -> Result<observe::Observation, ReconcileError> {
        observe::observe(self, pm).await
    }

    async fn apply(
        &self,
        pm: &PodMigration,
        o: observe::Observation,
        _cleanup: bool,
    ) -> Result<Outcome<PodMigrationStatus, Deferred>, ReconcileError> {
        let t = machine::next(&o.machine);
        let before = pm.status.clone().unwrap_or_default();
        if t.status.phase != before.phase && t.status.phase.is_terminal() {
            record_outcome(&self.ctx, &t.status);
        }
        Ok(Outcome {
            status: Some(t.status.clone()),
            notes: t.notes,
            requeue: t.requeue_after,
            cleaned_up: t.actions.contains(&Action::RemoveFinalizer),
            then: Deferred {
                actions: t.actions,
                source: o.source,
                target: o.target,
                status: t.status,
            },
        })
    }

    async fn after_status(&self, pm: &PodMigration, d: Deferred) -> Result<(), ReconcileError> {
        for action in &d.actions {
            act::execute(self, pm, action, &d).await?;
        }
        Ok(())
    }
}

fn record_outcome(ctx: &Context, st: &PodMigrationStatus) {
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
