//! The `pods/eviction` webhook against the real API server (`hack/cluster.sh up`):
//! the operator's webhook runs in this process (its serving certificate from a
//! run-time CA it keeps in the test's namespace, as the binary does), and a
//! ValidatingWebhookConfiguration reaches it by URL on 127.0.0.1 (the API server runs
//! on this machine) for the test's own namespace only, so the shared cluster's other
//! evictions never meet it. The test writes no caBundle: the webhook does. The pods
//! are kwok's (no migration controller runs: the PodMigration is only created).
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, EvictParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::names::{annotations, reasons};
use podmotion_e2e::operator::{install_crds, test_config};
use podmotion_e2e::{PodSecurity, TIMEOUT, TestNamespace, from_json, pod_phase, wait_for};
use podmotion_operator::config::ControllerKind;
use podmotion_operator::context::Context;
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use podmotion_operator::pki::plan::{AgentPolicy, Lifetimes};
use podmotion_operator::pki::{Pki, PkiSettings};
use podmotion_operator::webhook::{Webhook, WebhookConfig};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const NODE: &str = "pm-node-0";

/// The webhook and its CA running in this process, and its configuration.
struct Served {
    tasks: Vec<JoinHandle<()>>,
    configuration: String,
    client: Client,
    metrics: Arc<Metrics>,
}

impl Served {
    /// The operator is gone: nothing answers on the webhook's port any more.
    fn stop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.stop();
        let api: Api<ValidatingWebhookConfiguration> = Api::all(self.client.clone());
        let name = self.configuration.clone();
        // Best effort from a destructor: the namespace selector names only this test's
        // namespace, so a leftover configuration matches nothing else.
        tokio::spawn(async move {
            let _ = api.delete(&name, &DeleteParams::default()).await;
        });
    }
}

fn free_port() -> u16 {
    podmotion_e2e::kwok_agents::free_ports::<1>()[0]
}

/// Starts the CA keeper and the webhook for evictions in `workloads`, with the
/// operator's namespace `operator_ns`, and creates the webhook configuration (no
/// caBundle) and waits until the webhook has written its CA bundle into it.
async fn serve(client: &Client, operator_ns: &str, workloads: &str) -> Served {
    let port = free_port();
    let configuration = format!("{workloads}-eviction");
    let vwc: ValidatingWebhookConfiguration = from_json(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": configuration},
        "webhooks": [{
            "name": "eviction.podmotion.io",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "NoneOnDryRun",
            "failurePolicy": "Fail",
            "timeoutSeconds": 5,
            "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate-pods-eviction")},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                "resources": ["pods/eviction"], "scope": "Namespaced"}],
            "namespaceSelector": {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                "operator": "In", "values": [workloads]}]},
        }],
    }));
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    vwcs.create(&PostParams::default(), &vwc)
        .await
        .expect("creating the webhook configuration");

    let (_stop, stop_rx) = watch::channel(false);
    let metrics = Arc::new(Metrics::new());
    let ctx = Arc::new(Context::new(
        client.clone(),
        test_config(operator_ns, ControllerKind::Migration),
        Leadership::always(),
        metrics.clone(),
        stop_rx,
    ));
    std::mem::forget(_stop);
    let pki = Pki::new(
        client.clone(),
        PkiSettings {
            namespace: operator_ns.into(),
            ca_secret: "agent-ca".into(),
            bundle_namespace: operator_ns.into(),
            bundle_configmap: "agent-ca".into(),
            agents: AgentPolicy {
                namespace: operator_ns.into(),
                service_account: "agent".into(),
                pod_labels: BTreeMap::new(),
            },
            life: Lifetimes {
                ca: 365 * 86400,
                leaf: 86400,
                propagation: 0,
            },
        },
        Leadership::always(),
    )
    .expect("PKI settings");
    let cfg = WebhookConfig {
        enabled: true,
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        configuration: configuration.clone(),
        names: vec!["127.0.0.1".into()],
        protected_namespaces: vec![],
        default_namespace_label: None,
        default_strategy: "LiveMigrateIfPossible".into(),
        // The flags' defaults.
        shutdown_propagation_seconds: 10,
        freeze_budget_millis: 5000,
    };
    let webhook = Arc::new(
        Webhook::new(ctx, cfg, false, "podmotion-e2e-agents".into()).expect("webhook settings"),
    );
    let p = pki.clone();
    let tasks = vec![
        tokio::spawn(async move {
            if let Err(e) = p.run().await {
                eprintln!("PKI ended: {e:#}");
            }
        }),
        tokio::spawn(async move {
            if let Err(e) = webhook.run(pki).await {
                eprintln!("webhook ended: {e:#}");
            }
        }),
    ];
    wait_for(
        &vwcs,
        &configuration,
        TIMEOUT,
        "the webhook's CA bundle",
        |v| {
            v.and_then(|v| v.webhooks.as_ref())
                .and_then(|w| w.first())
                .and_then(|w| w.client_config.ca_bundle.as_ref())
                .is_some_and(|b| String::from_utf8_lossy(&b.0).contains("BEGIN CERTIFICATE"))
        },
    )
    .await
    .expect("the webhook writes its caBundle");
    Served {
        tasks,
        configuration,
        client: client.clone(),
        metrics,
    }
}

/// A bare pod on the kwok node, asking for `strategy` (None: not at all).
fn pod(name: &str, strategy: Option<&str>, host_network: bool) -> Pod {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": NODE, "hostNetwork": host_network,
            "containers": [{"name": "app", "image": "registry.example/web:1"}]},
    });
    if let Some(s) = strategy {
        p["metadata"]["annotations"] = json!({"podmotion.io/eviction-strategy": s});
    }
    from_json(p)
}

async fn running(pods: &Api<Pod>, p: Pod) -> Pod {
    let name = p.name_any();
    pods.create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    wait_for(pods, &name, TIMEOUT, "pod Running", |p| {
        p.is_some_and(|p| pod_phase(p) == "Running")
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .expect("the pod")
}

/// The eviction's error: `(code, reason, message)`; panics when it was allowed.
async fn refused(pods: &Api<Pod>, name: &str) -> (u16, String, String) {
    match pods.evict(name, &EvictParams::default()).await {
        Ok(_) => panic!("the eviction of {name} went through"),
        Err(kube::Error::Api(e)) => (e.code, e.reason.clone(), e.message.clone()),
        Err(e) => panic!("evicting {name}: {e}"),
    }
}

async fn evicted(pods: &Api<Pod>, name: &str) {
    pods.evict(name, &EvictParams::default())
        .await
        .unwrap_or_else(|e| panic!("evicting {name}: {e}"));
    wait_for(pods, name, TIMEOUT, "pod gone", |p| {
        p.is_none_or(|p| p.metadata.deletion_timestamp.is_some())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
}

#[tokio::test]
async fn evictions_of_opted_in_pods_start_one_migration_and_the_rest_follow_their_strategy() {
    let Some(op) = TestNamespace::new("evict-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(ns) = TestNamespace::new("evict", PodSecurity::Privileged).await else {
        return;
    };
    install_crds(&ns.client).await;
    let mut served = serve(&ns.client, &op.name, &ns.name).await;
    let pods: Api<Pod> = ns.api();
    // Evictions through a client that does not retry 429 itself: the answers are the test.
    let evictor: Api<Pod> = Api::namespaced(
        podmotion_e2e::connect_without_retry().await.unwrap(),
        &ns.name,
    );
    let migrations: Api<PodMigration> = ns.api();

    // An opted-in pod: 429 naming its PodMigration, created once across retries.
    let web = running(&pods, pod("web", Some("LiveMigrate"), false)).await;
    let (code, reason, message) = refused(&evictor, "web").await;
    assert_eq!(
        (code, reason.as_str()),
        (429, "TooManyRequests"),
        "{message}"
    );
    let list = migrations.list(&Default::default()).await.unwrap().items;
    assert_eq!(list.len(), 1, "{list:?}");
    let m = &list[0];
    assert!(message.contains(&m.name_any()), "{message}");
    assert_eq!(m.spec.pod_name, "web");
    assert_eq!(m.spec.pod_uid, web.uid());
    // Created claimed by the release whose webhook answered: no other release's
    // operator races it for the claim.
    let cfg = test_config(&op.name, ControllerKind::Migration);
    let me = podmotion_operator::claim::release_identity(&cfg.namespace, &cfg.leader.lease_name);
    assert_eq!(
        m.annotations().get(annotations::CONTROLLER),
        Some(&me),
        "{:?}",
        m.annotations()
    );
    for _ in 0..2 {
        let (code, _, again) = refused(&evictor, "web").await;
        assert_eq!(code, 429, "{again}");
        assert!(again.contains(&m.name_any()), "{again}");
    }
    let after = migrations.list(&Default::default()).await.unwrap().items;
    assert_eq!(after.len(), 1, "retries create nothing more: {after:?}");
    assert_eq!(after[0].uid(), m.uid(), "the very same PodMigration");
    assert!(
        pods.get_opt("web").await.unwrap().is_some(),
        "web is not evicted"
    );

    // A pod that did not ask is evicted as usual.
    running(&pods, pod("plain", None, false)).await;
    evicted(&evictor, "plain").await;

    // A LiveMigrate pod that cannot move blocks with its reason; an IfPossible one goes.
    running(&pods, pod("host", Some("LiveMigrate"), true)).await;
    let (code, _, message) = refused(&evictor, "host").await;
    assert_eq!(code, 403, "{message}");
    assert!(message.contains(reasons::HOST_NAMESPACES), "{message}");
    assert!(message.contains("hostNetwork"), "{message}");
    running(&pods, pod("soft", Some("LiveMigrateIfPossible"), true)).await;
    evicted(&evictor, "soft").await;
    let names: Vec<String> = migrations
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|m| m.name_any())
        .collect();
    assert_eq!(
        names.len(),
        1,
        "no migration for pods that cannot move: {names:?}"
    );

    // A dry-run eviction of an opted-in pod creates nothing.
    running(&pods, pod("dry", Some("LiveMigrate"), false)).await;
    // As `kubectl drain --dry-run=server` asks: `?dryRun=All` on the eviction (kube-rs
    // 5.0 writes `delete_options` in snake case into the Eviction's body, which the API
    // server ignores, so its delete options cannot carry the dry run).
    let dry = EvictParams {
        post_options: PostParams {
            dry_run: true,
            ..Default::default()
        },
        ..Default::default()
    };
    match evictor.evict("dry", &dry).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 429, "{}", e.message),
        other => panic!("a dry run of an opted-in pod: {other:?}"),
    }
    assert_eq!(
        migrations
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .len(),
        1,
        "a dry run creates no PodMigration"
    );
    let text = served.metrics.encode();
    assert!(
        text.contains("podmotion_evictions_blocked_total{reason=\"HostNamespaces\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("podmotion_eviction_migrations_started_total 1"),
        "{text}"
    );

    // The operator is down: with failurePolicy Fail, evictions are refused, also of
    // pods that did not ask (docs/security.md, "Eviction webhook").
    served.stop();
    // Aborting the tasks leaves connections the API server keeps alive answering;
    // pointing the configuration at a port nobody serves is what a gone operator is.
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(ns.client.clone());
    let gone = json!({"webhooks": [{"name": "eviction.podmotion.io", "clientConfig": {
        "url": format!("https://127.0.0.1:{}/validate-pods-eviction", free_port())}}]});
    vwcs.patch(
        &served.configuration,
        &PatchParams::default(),
        &Patch::Strategic(&gone),
    )
    .await
    .expect("pointing the webhook at nothing");
    running(&pods, pod("late", None, false)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let err = loop {
        match evictor.evict("late", &EvictParams::default()).await {
            Err(kube::Error::Api(e)) => break e,
            // The listener may take a moment to close.
            Ok(_) => panic!("an eviction went through with the webhook down"),
            Err(e) if tokio::time::Instant::now() < deadline => {
                eprintln!("retrying: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("evicting late: {e}"),
        }
    };
    assert!(err.message.contains("failed calling webhook"), "{err:?}");
    assert!(pods.get_opt("late").await.unwrap().is_some());
    drop(op);
}
