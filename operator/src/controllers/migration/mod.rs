//! The PodMigration controller: the wiring around `crate::migration`.
//!
//! One reconcile: observe the facts ([`observe`]: the source and target pods, the
//! transfer-key Secret, both agents' reports, and in `Pending` the nodes, their load
//! and the other migrations), call `machine::next`, hand its status and notes to the
//! shell, which writes the status first, then carry out its actions in order ([`act`]). Every
//! action is idempotent, so a reconcile interrupted anywhere (operator killed, API
//! server restarted) is simply repeated. The finalizer is the shell's: deleting a
//! PodMigration runs the machine's rollback, and the finalizer goes when the machine
//! says so. Agents are polled while a migration is active (they own the status of the
//! steps they run); nothing polls the API server.
//!
//! The `Pending` step reads caches, not lists: the migrations (the controller's store),
//! the agent pods (a reflector store), and projection caches ([`crate::cache`]) of
//! every node (its pre-flight facts) and of every non-terminal pod cluster-wide (its
//! node and requests: the load). A node whose facts change wakes every `Pending`
//! migration; a pod wakes the migrations of that pod, and every `Pending` one when it
//! frees capacity. A migration waiting for a slot (another migration to end) or for an
//! agent to become Ready is not woken by a watch: the machine's idle recheck
//! (`machine::IDLE_RECHECK`) stays as that trigger and as the safety net, and costs
//! cache reads only. Read per reconcile, by name: the source and target pods (the
//! machine acts on them and must see its own writes at once; the target also leaves
//! the target-pod watch, whose label selector it stops matching, at the hand-over),
//! and in `Pending` the source's PersistentVolumeClaims and their volumes (rare, few,
//! and only there).

mod act;
mod observe;
mod settings;
mod state;

use std::sync::Arc;

use futures::{StreamExt, stream};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::ResourceExt;
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::WatchStreamExt;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store, reflector};
use kube::runtime::watcher;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{finalizers, labels, managers};
use podmotion_api::{PodMigration, PodMigrationStatus};
use rand::RngCore;

use super::controller_config;
use super::shell::{self, Outcome, ReconcileError, Reconciler};
use crate::cache::{self, Change, Projection};
use crate::context::Context;
use crate::migration::agent::AgentClient;
use crate::migration::key::{KEY_LEN, MasterKey};
use crate::migration::machine::{self, Action};
use crate::migration::pending::{self, PodLoad};
use crate::migration::preflight::NodeFacts;
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
    let controller = Controller::new(migrations, watcher::Config::default().any_semantic());
    let store = controller.store();
    let (nodes, load, wakes) = pending_inputs(&ctx, &store);
    let s = store.clone();
    let step_ends = agents
        .step_ends()
        .filter_map(move |uid| std::future::ready(migration_with_uid(&s, &uid)));
    let controller = controller
        .owns(
            target_pods,
            watcher::Config::default().labels(&format!("{}=PodMigration", labels::OWNER_KIND)),
        )
        .reconcile_on(stream::select(wakes, step_ends))
        // A replica that wins the lease reconciles everything once.
        .reconcile_all_on(ctx.leader.on_acquire())
        // No debounce: a migration's next step starts as soon as the last one ended (a
        // frozen pod's downtime grows with every wait). Triggers that arrive while a
        // reconcile runs are coalesced into one rerun by the runtime.
        .with_config(controller_config(&ctx).debounce(std::time::Duration::ZERO))
        .graceful_shutdown_on(ctx.shutdown());
    let agent_pods = watch_agent_pods(&client, &cfg);
    let master_key = load_master_key(cfg.key_file.as_deref())?;
    let shared = Arc::new(Shared {
        master_key,
        key_secrets: Default::default(),
        written: Default::default(),
        agent_pods,
        ctx: ctx.clone(),
        cfg,
        agents,
        store,
        nodes,
        load,
    });
    super::mark_ready_when_synced(&ctx, NAME, shared.store.clone());
    shell::run(controller, shared).await;
    Ok(())
}

/// What a Pending migration decides on, cached: every node's pre-flight facts and every
/// running pod's load, cluster-wide whatever the watch namespace (a pod moves to any
/// node, and every pod on a node takes from its capacity), and the migrations their
/// changes wake.
fn pending_inputs(
    ctx: &Arc<Context>,
    store: &Store<DeserializeGuard<PodMigration>>,
) -> (
    Arc<Projection<NodeFacts>>,
    Arc<Projection<PodLoad>>,
    impl futures::Stream<Item = MigrationRef> + Send + 'static,
) {
    let client = ctx.client.clone();
    let nodes = Arc::new(Projection::new());
    let load = Arc::new(Projection::new());
    let s = store.clone();
    let node_triggers = cache::feed(
        ctx,
        "migration-nodes",
        watcher::watcher(Api::<Node>::all(client.clone()), cache::paged()),
        nodes.clone(),
        |n: &Node| Some(pending::node_view(n)),
        move |_| pending_migrations(&s),
    );
    let s = store.clone();
    let pod_triggers = cache::feed(
        ctx,
        "migration-pods",
        watcher::watcher(
            Api::<Pod>::all(client),
            // A pod that ends leaves the watch (a DELETED event).
            cache::paged().fields("status.phase!=Succeeded,status.phase!=Failed"),
        ),
        load.clone(),
        PodLoad::from_pod,
        move |c| woken_by_pod(&s, c),
    );
    (nodes, load, stream::select(node_triggers, pod_triggers))
}

/// The agents' pods, watched (they are few) rather than listed on every poll.
fn watch_agent_pods(client: &kube::Client, cfg: &MigrationConfig) -> Store<Pod> {
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
    agent_pods
}

type MigrationRef = ObjectRef<DeserializeGuard<PodMigration>>;

/// The migration whose UID is `uid`, if the cache has it (one that is gone needs no
/// reconcile).
fn migration_with_uid(
    store: &Store<DeserializeGuard<PodMigration>>,
    uid: &str,
) -> Option<MigrationRef> {
    store
        .state()
        .iter()
        .find(|g| g.uid().as_deref() == Some(uid))
        .map(|g| ObjectRef::from_obj(g.as_ref()))
}

/// Whether `pm` is waiting in `Pending` (not yet reconciled counts) and not deleted.
fn is_pending(pm: &PodMigration) -> bool {
    pm.metadata.deletion_timestamp.is_none()
        && pm
            .status
            .as_ref()
            .is_none_or(|st| st.phase == MigrationPhase::Pending)
}

/// Every `Pending` migration: a node's facts changed.
fn pending_migrations(store: &Store<DeserializeGuard<PodMigration>>) -> Vec<MigrationRef> {
    store
        .state()
        .iter()
        .filter(|g| g.0.as_ref().is_ok_and(is_pending))
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

/// The migrations a pod's change concerns: those of that pod (its node or state
/// changed) and, when it freed capacity, every `Pending` one.
fn woken_by_pod(
    store: &Store<DeserializeGuard<PodMigration>>,
    c: &Change<PodLoad>,
) -> Vec<MigrationRef> {
    let (ns, name) = &c.key;
    let frees = PodLoad::frees_capacity(c.old.as_deref(), c.new.as_deref());
    store
        .state()
        .iter()
        .filter(|g| {
            g.0.as_ref().is_ok_and(|pm| {
                let of_pod =
                    pm.namespace().as_deref() == Some(ns.as_str()) && pm.spec.pod_name == *name;
                (of_pod && !pm.status.as_ref().is_some_and(|st| st.phase.is_terminal()))
                    || (frees && is_pending(pm))
            })
        })
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

impl<A: AgentClient> Reconciler for Shared<A> {
    type Object = PodMigration;
    type Status = PodMigrationStatus;
    type Observed = observe::Observation;
    type Then = Deferred;
    const NAME: &'static str = NAME;
    const FINALIZER: Option<&'static str> = Some(finalizers::MIGRATION_CLEANUP);
    const MANAGER: &'static str = managers::MIGRATION;
    const CLAIMS: bool = true;

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
        // A round on a migration older than this replica's own last write would decide
        // on a past state (found by the chaos run: a watch broken by an API server
        // restart served a pre-commit status after the commit was written, and the
        // round rolled back a migration whose source pod was already being deleted).
        if self.behind_own_write(pm) {
            return Err(ReconcileError::wait(
                "the status this replica wrote last is not in its cache yet",
                std::time::Duration::from_millis(50),
            ));
        }
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
        if t.status.phase != before.phase {
            log_phase_change(pm, &before, &t.status);
            if t.status.phase.is_terminal() {
                record_outcome(&self.ctx, &t.status);
            }
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
        // Written (or already there): later rounds must not decide on anything older.
        let forget = d.actions.contains(&Action::RemoveFinalizer);
        self.remember_written(pm, (!forget).then_some(&d.status));
        for action in &d.actions {
            act::execute(self, pm, action, &d).await?;
        }
        Ok(())
    }
}

/// One info line per phase change, with what an operator's log reader needs to find the
/// migration (name, namespace, uid), where it moves and why (the failure reason, else the
/// `Ready` condition's reason): the chaos runs' failures were slow to explain without it.
fn log_phase_change(pm: &PodMigration, before: &PodMigrationStatus, after: &PodMigrationStatus) {
    let reason = after.failure_reason.as_deref().or_else(|| {
        after
            .conditions
            .iter()
            .find(|c| c.type_ == podmotion_api::names::condition_types::READY)
            .map(|c| c.reason.as_str())
    });
    tracing::info!(
        migration = %pm.name_any(),
        namespace = pm.namespace().as_deref().unwrap_or_default(),
        uid = pm.uid().as_deref().unwrap_or_default(),
        from = ?before.phase,
        to = ?after.phase,
        reason = reason.unwrap_or_default(),
        source = after.source_node.as_deref().unwrap_or_default(),
        target = after.target_node.as_deref().unwrap_or_default(),
        "migration phase changed"
    );
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
    use crate::migration::preflight::Resources;
    use serde_json::json;
    use std::collections::BTreeSet;

    fn pm(name: &str, pod: &str, phase: Option<&str>) -> PodMigration {
        let mut v = json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": name, "namespace": "apps"},
            "spec": {"podName": pod}
        });
        if let Some(phase) = phase {
            v["status"] = json!({"phase": phase});
        }
        serde_json::from_value(v).unwrap()
    }

    fn store(pms: Vec<PodMigration>) -> Store<DeserializeGuard<PodMigration>> {
        let (store, mut writer) = reflector::store();
        for p in pms {
            writer.apply_watcher_event(&watcher::Event::Apply(DeserializeGuard(Ok(p))));
        }
        store
    }

    fn load(node: &str, cpu_millis: u64) -> Option<Arc<PodLoad>> {
        Some(Arc::new(PodLoad {
            node: node.into(),
            requests: Resources {
                cpu_millis,
                memory_bytes: 0,
            },
            running: true,
        }))
    }

    fn woken(s: &Store<DeserializeGuard<PodMigration>>, c: Change<PodLoad>) -> Vec<String> {
        let mut n: Vec<String> = woken_by_pod(s, &c).into_iter().map(|r| r.name).collect();
        n.sort();
        n
    }

    #[test]
    fn a_pod_wakes_its_migrations_and_every_pending_one_when_it_frees_capacity() {
        let s = store(vec![
            pm("new", "web-0", None),
            pm("waiting", "web-1", Some("Pending")),
            pm("moving", "web-2", Some("Transferring")),
            pm("done", "web-2", Some("Succeeded")),
        ]);
        let key = |pod: &str| ("apps".to_string(), pod.to_string());
        let change = |pod: &str, old, new| Change {
            key: key(pod),
            old,
            new,
        };
        // Another pod appears: it takes capacity, it frees none.
        assert!(woken(&s, change("other", None, load("n1", 100))).is_empty());
        // The source of a running migration changes: that migration, not the ended one.
        assert_eq!(
            woken(&s, change("web-2", load("n1", 100), load("n2", 100))),
            ["moving", "new", "waiting"],
            "moving between nodes frees capacity on the first"
        );
        assert_eq!(
            woken(&s, change("web-2", load("n1", 100), load("n1", 200))),
            ["moving"]
        );
        // Another pod ends: every Pending migration may fit now.
        assert_eq!(
            woken(&s, change("other", load("n1", 100), None)),
            ["new", "waiting"]
        );
        assert_eq!(
            pending_migrations(&s)
                .into_iter()
                .map(|r| r.name)
                .collect::<BTreeSet<_>>(),
            BTreeSet::from(["new".to_string(), "waiting".to_string()])
        );
    }
}
