//! One PodMotion release owns each object (issue 45, "Operations"), against the real
//! API server (`hack/cluster.sh up`; no node does any work here, this is about the API
//! objects).
//!
//! Two releases are two operators, each with its own namespace (its identity is
//! `<namespace>/<lease name>`, `podmotion_core::claim`), both watching one application
//! namespace, run in this process as the binary runs them (`InProcessController`: a
//! `Context` of their own, their own metrics). What is checked:
//!
//! - the race (both running before the objects exist): every object gets exactly one
//!   claim (`podmotion.io/controller`), the claims won add up to the objects (a claim
//!   without the resourceVersion precondition lets both win), the release that lost
//!   the first one never reconciles it, and the release that lost each one says why: one `ClaimedElsewhere` Event from its reporting instance
//!   and nothing else from it about that object, a log line naming both releases, and
//!   `podmotion_claims_total{outcome="LeftAlone"}`;
//! - an object one release holds is never reconciled by a release started later (its
//!   reconcile count stays 0), the other release's uninstall hook does not strip its
//!   finalizer, and a hand-over by `kubectl annotate --overwrite` moves it: the new
//!   holder runs its cleanup on deletion while the old one leaves it alone;
//! - the same for a RunnerPool and a NodeAgentAttachment: one release renders the
//!   children (the DaemonSet; the agent Jobs, in its own namespace), the other never
//!   reconciles it and has no Job.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{annotations, finalizers, reasons};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_e2e::operator::{InProcessController, install_crds, test_config};
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, deployment_on_nodes, from_json, pod_running_ready,
    wait_for, wait_list,
};
use podmotion_operator::claim::release_identity;
use podmotion_operator::config::ControllerKind;
use podmotion_operator::controllers::{attachment, migration, runner_pool};
use podmotion_operator::metrics::{ClaimLabels, Metrics, ReconcileResult, ResultLabels};
use serde_json::json;

const LEASE: &str = "podmotion-operator";
const LEFT_ALONE_LOG: &str = "claimed by another PodMotion release: left alone";

// ------------------------------------------------------------------ logs

/// Every log line of this test process (both releases), as the binary would print them.
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_env_filter("info")
            .with_writer(move || Sink(sink.clone()))
            .init();
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log lines that mention every one of `needles`.
fn log_lines_with(needles: &[&str]) -> Vec<String> {
    let logs = logs();
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).to_string();
    text.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .map(str::to_string)
        .collect()
}

// -------------------------------------------------------------- releases

/// One release: its namespace (a real one), identity and running controller.
struct Release {
    /// The release namespace (its attachment Jobs are there), deleted with the release.
    ns: TestNamespace,
    identity: String,
    /// The Events' reporting instance (`--identity`, the pod name in a cluster).
    instance: String,
    op: InProcessController,
}

impl Release {
    async fn new(prefix: &str, kind: ControllerKind, app_ns: &str) -> Option<Release> {
        // Privileged: the attachment Jobs run in the release namespace here.
        let ns = TestNamespace::new(prefix, PodSecurity::Privileged).await?;
        let mut config = test_config(&ns.name, kind);
        config.leader.lease_name = LEASE.into();
        config.identity = format!("{}-0", ns.name);
        let instance = config.identity.clone();
        let identity = release_identity(&ns.name, LEASE);
        let op = match kind {
            ControllerKind::Migration => {
                #[derive(Parser)]
                struct Cli {
                    #[command(flatten)]
                    mig: migration::MigrationConfig,
                }
                let agents_ns = format!("{}-agents", ns.name);
                let cli = Cli::try_parse_from([
                    "podmotion-operator",
                    "--migration-namespace",
                    app_ns,
                    "--migration-agent-namespace",
                    &agents_ns,
                ])
                .unwrap();
                InProcessController::spawn(&ns.client, config, |ctx| {
                    migration::run_configured(ctx, cli.mig)
                })
            }
            ControllerKind::RunnerPool => {
                let cfg = runner_pool::RunnerPoolConfig {
                    preflight_image: "registry.example/podmotion/preflight@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff".into(),
                    watch_namespace: Some(app_ns.into()),
                    max_priority: podmotion_operator::runner_pool::priority::DEFAULT_CEILING,
                    read_secrets: true,
                };
                InProcessController::spawn(&ns.client, config, |ctx| {
                    runner_pool::run_with(ctx, cfg)
                })
            }
            ControllerKind::Attachment => {
                let cfg = podmotion_e2e::operator::test_attachment_config(app_ns);
                InProcessController::spawn(&ns.client, config, |ctx| attachment::run_with(ctx, cfg))
            }
        };
        Some(Release {
            ns,
            identity,
            instance,
            op,
        })
    }

    fn claims(&self, controller: &'static str, outcome: &'static str) -> u64 {
        self.op
            .metrics
            .claims
            .get_or_create(&ClaimLabels {
                controller,
                outcome,
            })
            .get()
    }

    /// Reconciles that got past the claim gate (any result).
    fn reconciles(&self, controller: &'static str) -> u64 {
        reconciles(&self.op.metrics, controller)
    }
}

fn reconciles(m: &Metrics, controller: &'static str) -> u64 {
    [ReconcileResult::Success, ReconcileResult::Error]
        .into_iter()
        .map(|result| {
            m.reconciles
                .get_or_create(&ResultLabels { controller, result })
                .get()
        })
        .sum()
}

/// Polls `cond` until it holds (metrics and Events have no watch here); panics with
/// `what` after [`TIMEOUT`].
async fn eventually(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let until = tokio::time::Instant::now() + TIMEOUT;
    while !cond().await {
        assert!(
            tokio::time::Instant::now() < until,
            "not within {TIMEOUT:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The Events about the object `name` in `ns`, as (reporting instance, reason).
async fn events_about(ns: &TestNamespace, name: &str) -> Vec<(String, String)> {
    let events: Api<CoreEvent> = ns.api();
    let lp = ListParams::default().fields(&format!("involvedObject.name={name}"));
    events
        .list(&lp)
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|e| {
            (
                e.reporting_instance.unwrap_or_default(),
                e.reason.unwrap_or_default(),
            )
        })
        .collect()
}

fn holder_of<K: ResourceExt>(o: &K) -> Option<String> {
    o.annotations().get(annotations::CONTROLLER).cloned()
}

fn migration_of(name: &str) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": {"podName": "no-such-pod"}
    }))
}

/// The PodMigration's status as the release that holds it decides it (its pod does not
/// exist), with the claim put.
async fn claimed_and_reconciled(api: &Api<PodMigration>, name: &str) -> PodMigration {
    wait_for(api, name, TIMEOUT, "claimed, finalizer and status", |m| {
        m.is_some_and(|m| {
            holder_of(m).is_some()
                && m.finalizers()
                    .iter()
                    .any(|f| f == finalizers::MIGRATION_CLEANUP)
                && m.status.as_ref().is_some_and(|st| {
                    st.phase == MigrationPhase::Pending
                        && st
                            .conditions
                            .iter()
                            .any(|c| c.reason == reasons::SOURCE_POD_NOT_FOUND)
                })
        })
    })
    .await
    .unwrap()
    .unwrap()
}

/// The release that did not claim `name` has said why, once, and nothing else.
async fn loser_told_why(app: &TestNamespace, name: &str, winner: &Release, loser: &Release) {
    // (The holder's decision is its status, `claimed_and_reconciled`: a migration of a
    // missing pod stays in Pending, which records no Event.)
    eventually(
        &format!("{} records ClaimedElsewhere on {name}", loser.identity),
        async || {
            events_about(app, name)
                .await
                .iter()
                .any(|(i, r)| *i == loser.instance && r == reasons::CLAIMED_ELSEWHERE)
        },
    )
    .await;
    let events = events_about(app, name).await;
    let from_loser: Vec<_> = events
        .iter()
        .filter(|(i, _)| *i == loser.instance)
        .collect();
    assert!(
        from_loser
            .iter()
            .all(|(_, r)| r == reasons::CLAIMED_ELSEWHERE),
        "{} wrote Events about {name} it does not hold: {from_loser:?}",
        loser.identity
    );
    assert_eq!(from_loser.len(), 1, "one notice per object generation");
    assert!(
        events
            .iter()
            .all(|(i, _)| *i == winner.instance || *i == loser.instance),
        "{events:?}"
    );
    let lines = log_lines_with(&[LEFT_ALONE_LOG, name, &loser.identity, &winner.identity]);
    assert!(
        !lines.is_empty(),
        "{} logs why it leaves {name} alone",
        loser.identity
    );
}

// ----------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_releases_racing_for_new_migrations_claim_each_exactly_once() {
    logs();
    let Some(app) = TestNamespace::new("claim-race", PodSecurity::Restricted).await else {
        return;
    };
    install_crds(&app.client).await;
    let a = Release::new("claim-rel-a", ControllerKind::Migration, &app.name)
        .await
        .unwrap();
    let b = Release::new("claim-rel-b", ControllerKind::Migration, &app.name)
        .await
        .unwrap();
    let api: Api<PodMigration> = app.api();
    const N: usize = 4;
    let names: Vec<String> = (0..N).map(|i| format!("move-{i}")).collect();
    // The first alone: the release that loses it holds nothing, so any round of its
    // own (a reconcile past the claim gate) would be a round on the other's object.
    api.create(&PostParams::default(), &migration_of(&names[0]))
        .await
        .unwrap();
    let first = holder_of(&claimed_and_reconciled(&api, &names[0]).await).unwrap();
    let first_loser = if first == a.identity { &b } else { &a };
    eventually("the first object's loser has left it alone", async || {
        first_loser.claims("migration", "LeftAlone") == 1
    })
    .await;
    assert_eq!(
        first_loser.reconciles("migration"),
        0,
        "{} reconciled a migration {first} holds",
        first_loser.identity
    );
    // Then the others at once.
    for n in &names[1..] {
        api.create(&PostParams::default(), &migration_of(n))
            .await
            .unwrap();
    }
    let mut held_by_a = 0;
    for n in &names {
        let pm = claimed_and_reconciled(&api, n).await;
        let holder = holder_of(&pm).unwrap();
        let (winner, loser) = if holder == a.identity {
            held_by_a += 1;
            (&a, &b)
        } else {
            assert_eq!(holder, b.identity, "claimed by one of the two releases");
            (&b, &a)
        };
        loser_told_why(&app, n, winner, loser).await;
    }
    let held_by_b = N - held_by_a;
    println!(
        "claims: {} held {held_by_a}, {} held {held_by_b}; races lost: {} and {}",
        a.identity,
        b.identity,
        a.claims("migration", "Lost"),
        b.claims("migration", "Lost")
    );
    // Exactly one claim won per object: with an unconditional claim both would win
    // (and both would count `Claimed`).
    assert_eq!(
        a.claims("migration", "Claimed") + b.claims("migration", "Claimed"),
        N as u64,
        "lost races: {} + {}",
        a.claims("migration", "Lost"),
        b.claims("migration", "Lost")
    );
    assert_eq!(a.claims("migration", "Claimed"), held_by_a as u64);
    eventually(
        "each release counted the objects it leaves alone",
        async || {
            a.claims("migration", "LeftAlone") == held_by_b as u64
                && b.claims("migration", "LeftAlone") == held_by_a as u64
        },
    )
    .await;
    // The claims stay put (no release takes over the other's).
    for n in &names {
        let pm = api.get(n).await.unwrap();
        assert!(
            [&a.identity, &b.identity].contains(&&holder_of(&pm).unwrap()),
            "{n}"
        );
    }
    a.op.stop().await;
    b.op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_migration_is_left_alone_by_a_later_release_until_handed_over() {
    logs();
    let Some(app) = TestNamespace::new("claim-hold", PodSecurity::Restricted).await else {
        return;
    };
    install_crds(&app.client).await;
    let a = Release::new("claim-rel-a", ControllerKind::Migration, &app.name)
        .await
        .unwrap();
    let api: Api<PodMigration> = app.api();
    api.create(&PostParams::default(), &migration_of("move-web"))
        .await
        .unwrap();
    let pm = claimed_and_reconciled(&api, "move-web").await;
    assert_eq!(holder_of(&pm).as_deref(), Some(a.identity.as_str()));

    // A second release starts over the same namespace.
    let b = Release::new("claim-rel-b", ControllerKind::Migration, &app.name)
        .await
        .unwrap();
    loser_told_why(&app, "move-web", &a, &b).await;
    assert_eq!(b.reconciles("migration"), 0, "B reconciled A's migration");
    assert_eq!(b.claims("migration", "Claimed"), 0);
    assert_eq!(b.claims("migration", "LeftAlone"), 1);

    // B's uninstall hook releases B's objects only: A's finalizer stays.
    let released = podmotion_operator::release::release_all::<PodMigration>(
        &app.client,
        Some(&app.name),
        finalizers::MIGRATION_CLEANUP,
        &b.identity,
    )
    .await
    .unwrap();
    assert_eq!(released, 0, "B's hook released A's migration");
    let pm = api.get("move-web").await.unwrap();
    assert!(
        pm.finalizers()
            .iter()
            .any(|f| f == finalizers::MIGRATION_CLEANUP)
    );

    // The hand-over the docs describe: `kubectl annotate --overwrite`.
    let patch = json!({"metadata": {"annotations": {annotations::CONTROLLER: b.identity}}});
    api.patch("move-web", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    eventually("B reconciles the migration handed to it", async || {
        b.reconciles("migration") > 0
    })
    .await;
    eventually("A now leaves it alone", async || {
        a.claims("migration", "LeftAlone") == 1
    })
    .await;
    let a_rounds = a.reconciles("migration");
    // Deleting it: B, the holder, runs the cleanup and releases the finalizer.
    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(&api, "move-web", TIMEOUT, "released by B and gone", |m| {
        m.is_none()
    })
    .await
    .unwrap();
    assert_eq!(
        a.reconciles("migration"),
        a_rounds,
        "A reconciled the migration it handed over"
    );
    a.op.stop().await;
    b.op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_releases_racing_for_a_runner_pool_leave_its_children_to_one() {
    logs();
    let Some(app) = TestNamespace::new("claim-rp", PodSecurity::Restricted).await else {
        return;
    };
    install_crds(&app.client).await;
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443, "targetPort": 9443}]}
    }));
    app.api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let a = Release::new("claim-rel-a", ControllerKind::RunnerPool, &app.name)
        .await
        .unwrap();
    let b = Release::new("claim-rel-b", ControllerKind::RunnerPool, &app.name)
        .await
        .unwrap();
    let pool: RunnerPool = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
        "metadata": {"name": "compass"},
        "spec": {
            "image": "registry.example/compass/runner@sha256:4f1c3a2b5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708",
            "sessionsPerNode": 2,
            "session": {"memoryMiB": 1024, "milliCPU": 500},
            "server": {"serviceName": "compass-server", "port": 8443},
            "priorityClass": {"name": format!("{}-runner", app.name), "value": 100000},
        }
    }));
    let pools: Api<RunnerPool> = app.api();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let rp = wait_for(&pools, "compass", TIMEOUT, "claimed and reconciled", |p| {
        p.is_some_and(|p| {
            holder_of(p).is_some()
                && p.status
                    .as_ref()
                    .is_some_and(|s| s.observed_generation.is_some())
        })
    })
    .await
    .unwrap()
    .unwrap();
    let holder = holder_of(&rp).unwrap();
    let (winner, loser) = if holder == a.identity {
        (&a, &b)
    } else {
        assert_eq!(holder, b.identity);
        (&b, &a)
    };
    println!("RunnerPool claimed by {holder}");
    let daemonsets: Api<DaemonSet> = app.api();
    wait_for(
        &daemonsets,
        "compass",
        TIMEOUT,
        "the Runner DaemonSet",
        |d| d.is_some(),
    )
    .await
    .unwrap();
    eventually(
        "the other release counts the pool it leaves alone",
        async || loser.claims("runner-pool", "LeftAlone") == 1,
    )
    .await;
    assert_eq!(
        loser.reconciles("runner-pool"),
        0,
        "{} reconciled the pool",
        loser.identity
    );
    assert_eq!(winner.claims("runner-pool", "Claimed"), 1);
    assert_eq!(loser.claims("runner-pool", "Claimed"), 0);
    let events = events_about(&app, "compass").await;
    assert!(
        events
            .iter()
            .filter(|(i, _)| *i == loser.instance)
            .all(|(_, r)| r == reasons::CLAIMED_ELSEWHERE),
        "{events:?}"
    );
    // Deleting the pool: the holder cleans up and releases it.
    pools
        .delete("compass", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(&pools, "compass", TIMEOUT, "RunnerPool gone", |p| {
        p.is_none()
    })
    .await
    .unwrap();
    assert_eq!(loser.reconciles("runner-pool"), 0);
    a.op.stop().await;
    b.op.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_releases_racing_for_an_attachment_leave_its_agent_jobs_to_one() {
    logs();
    let Some(app) = TestNamespace::new("claim-naa", PodSecurity::Baseline).await else {
        return;
    };
    install_crds(&app.client).await;
    let a = Release::new("claim-rel-a", ControllerKind::Attachment, &app.name)
        .await
        .unwrap();
    let b = Release::new("claim-rel-b", ControllerKind::Attachment, &app.name)
        .await
        .unwrap();
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &deployment_on_nodes("web", 2, &["pm-node-0", "pm-node-1"]),
        )
        .await
        .unwrap();
    wait_list(
        &app.api::<Pod>(),
        "app=web",
        TIMEOUT,
        "2 ready pods",
        |ps| ps.len() == 2 && ps.iter().all(pod_running_ready),
    )
    .await
    .unwrap();
    let naa: NodeAgentAttachment = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": "web"},
        "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
    }));
    let naas: Api<NodeAgentAttachment> = app.api();
    naas.create(&PostParams::default(), &naa).await.unwrap();
    let got = wait_for(&naas, "web", TIMEOUT, "claimed", |n| {
        n.is_some_and(|n| holder_of(n).is_some())
    })
    .await
    .unwrap()
    .unwrap();
    let holder = holder_of(&got).unwrap();
    let (winner, loser) = if holder == a.identity {
        (&a, &b)
    } else {
        assert_eq!(holder, b.identity);
        (&b, &a)
    };
    println!("NodeAgentAttachment claimed by {holder}");
    let agent_jobs = "app.kubernetes.io/component=node-agent";
    wait_list(
        &winner.ns.api::<Job>(),
        agent_jobs,
        TIMEOUT,
        "one agent Job per replica, in the holder's namespace",
        |js| js.len() == 2,
    )
    .await
    .unwrap();
    eventually(
        "the other release counts the attachment it leaves alone",
        async || loser.claims("attachment", "LeftAlone") == 1,
    )
    .await;
    assert_eq!(
        loser.reconciles("attachment"),
        0,
        "{} reconciled it",
        loser.identity
    );
    let theirs = loser
        .ns
        .api::<Job>()
        .list(&ListParams::default().labels(agent_jobs))
        .await
        .unwrap();
    assert!(
        theirs.items.is_empty(),
        "{} made agent Jobs for an attachment it does not hold",
        loser.identity
    );
    a.op.stop().await;
    b.op.stop().await;
}
