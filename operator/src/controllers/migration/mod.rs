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
mod settings;
mod state;

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, reflector};
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
use act::Deferred;
use state::Shared;

pub use settings::MigrationConfig;

const NAME: &str = "migration";

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
    let agents = crate::agents::WireAgents::new(ctx.client.clone(), tls)
        .with_settings(cfg.exec_probes, cfg.agent_call_timeout())
        .with_leader(ctx.leader.clone());
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
