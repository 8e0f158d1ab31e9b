//! Status writes that cannot record a decision made on a stale read (issue 45),
//! against the real API server (`hack/cluster.sh up`).
//!
//! The shell writes a round's status by server-side apply with the resourceVersion
//! the round read as a precondition (`Writer::apply_status`). Here a round reads its
//! object from a cache forced behind (a reflector store fed the object as first seen,
//! then never again) while the object moves on (another writer records a newer
//! decision in its status, as the previous round of the controller does before its
//! watch catches up). The stale round must write nothing, end as "read again"
//! (`shell::STALE_READ`), and must not run the writes that wait for its status
//! (`after_status`); a round on a fresh read then writes its own decision.
//!
//! The round's decision is the reconciler's own (below): it names the resourceVersion
//! it decided from, so the test can tell which round's decision the server kept. The
//! shell, the writer and the API server are the real ones every controller uses.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::core::DeserializeGuard;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use podmotion_api::{PodMigration, PodMigrationStatus};
use podmotion_e2e::operator::{install_crds, test_config};
use podmotion_e2e::{PodSecurity, TestNamespace, from_json};
use podmotion_operator::config::ControllerKind;
use podmotion_operator::context::Context;
use podmotion_operator::controllers::shell::{
    self, Outcome, ReconcileError, Reconciler, STALE_READ,
};
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use serde_json::json;
use tokio::sync::watch;

const MANAGER: &str = "podmotion.io/e2e-stale-status";

/// A controller whose round decides `targetNode` from the object it read, and counts
/// the rounds whose status was persisted (`after_status`).
struct Decider {
    ctx: Arc<Context>,
    persisted: AtomicUsize,
}

fn decision_of(pm: &PodMigration) -> String {
    format!("decided-at-{}", pm.resource_version().unwrap_or_default())
}

impl Reconciler for Decider {
    type Object = PodMigration;
    type Status = PodMigrationStatus;
    type Observed = ();
    type Then = ();
    const NAME: &'static str = "e2e-stale-status";
    const FINALIZER: Option<&'static str> = None;
    const MANAGER: &'static str = MANAGER;

    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn status(pm: &PodMigration) -> Option<&PodMigrationStatus> {
        pm.status.as_ref()
    }

    async fn observe(&self, _pm: &PodMigration, _cleanup: bool) -> Result<(), ReconcileError> {
        Ok(())
    }

    async fn apply(
        &self,
        pm: &PodMigration,
        _observed: (),
        _cleanup: bool,
    ) -> Result<Outcome<PodMigrationStatus>, ReconcileError> {
        let mut status = pm.status.clone().unwrap_or_default();
        status.target_node = Some(decision_of(pm));
        Ok(Outcome::new(Some(status)))
    }

    async fn after_status(&self, _pm: &PodMigration, _then: ()) -> Result<(), ReconcileError> {
        self.persisted.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

async fn target_node(api: &Api<PodMigration>, name: &str) -> Option<String> {
    let pm = api.get(name).await.expect("reading the PodMigration");
    pm.status.and_then(|s| s.target_node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_decided_on_a_cache_behind_the_server_writes_no_status_and_reads_again() {
    let Some(ns) = TestNamespace::new("stale-status", PodSecurity::Baseline).await else {
        return;
    };
    install_crds(&ns.client).await;
    let api = ns.api::<PodMigration>();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-web"}, "spec": {"podName": "web-0"}
    }));
    api.create(&PostParams::default(), &pm)
        .await
        .expect("creating the PodMigration");
    let first = api.get("move-web").await.expect("reading it back");

    // The cache: fed the object as first seen, then forced to stay there.
    let (reader, mut writer) = reflector::store::<PodMigration>();
    writer.apply_watcher_event(&watcher::Event::Apply(first.clone()));
    let key = ObjectRef::from_obj(&first);

    // The object moves on: another round's decision lands in its status.
    let newer = json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-web"},
        "status": {"phase": "Pending", "targetNode": "newer-decision"},
    });
    api.patch_status(
        "move-web",
        &PatchParams::apply("podmotion.io/e2e-other-round").force(),
        &Patch::Apply(&newer),
    )
    .await
    .expect("writing the newer decision");
    let moved = api.get("move-web").await.unwrap();
    assert_ne!(
        moved.resource_version(),
        first.resource_version(),
        "the status write moved the object on"
    );

    let (_stop, stop_rx) = watch::channel(false);
    let ctx = Arc::new(Context::new(
        ns.client.clone(),
        test_config(&ns.name, ControllerKind::Migration),
        Leadership::always(),
        Arc::new(Metrics::new()),
        stop_rx,
    ));
    let r = Arc::new(Decider {
        ctx,
        persisted: AtomicUsize::new(0),
    });

    // The round on the stale cache: a conflict, nothing written, nothing after it.
    let stale = reader.get(&key).expect("the cache holds the object");
    assert_eq!(stale.resource_version(), first.resource_version());
    let res = shell::reconcile::<Decider>(
        Arc::new(DeserializeGuard(Ok(stale.as_ref().clone()))),
        r.clone(),
    )
    .await;
    match &res {
        Err(ReconcileError::Wait { why, .. }) => assert_eq!(*why, STALE_READ),
        other => panic!("a round on a stale read must end as a re-read, got {other:?}"),
    }
    assert_eq!(
        target_node(&api, "move-web").await.as_deref(),
        Some("newer-decision"),
        "the stale round's decision ({}) must not be recorded",
        decision_of(&stale)
    );
    assert_eq!(
        r.persisted.load(Ordering::SeqCst),
        0,
        "after_status ran for a status that was never written"
    );
    println!(
        "stale round (read at resourceVersion {:?}, server at {:?}): {res:?}",
        first.resource_version(),
        moved.resource_version()
    );

    // Read again (the cache catches up): the round's decision is written.
    let fresh = api.get("move-web").await.unwrap();
    writer.apply_watcher_event(&watcher::Event::Apply(fresh.clone()));
    let cached = reader.get(&key).unwrap();
    shell::reconcile::<Decider>(
        Arc::new(DeserializeGuard(Ok(cached.as_ref().clone()))),
        r.clone(),
    )
    .await
    .expect("a round on a fresh read writes its status");
    assert_eq!(
        target_node(&api, "move-web").await,
        Some(decision_of(&fresh)),
        "the fresh round's decision is recorded"
    );
    assert_eq!(r.persisted.load(Ordering::SeqCst), 1);
    let owner = api.get("move-web").await.unwrap();
    let managers: Vec<String> = owner
        .meta()
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|m| m.manager.clone())
        .collect();
    assert!(
        managers.iter().any(|m| m == MANAGER),
        "the status was applied under the round's field manager: {managers:?}"
    );
}
