//! RunnerPool against the real API server (hack/cluster.sh): the RunnerPool controller
//! runs in this process, scoped to the test's namespace; kwok plays the kubelets of
//! pm-node-0..2 (pm-node-2 is the labelled and tainted Runner node).
//!
//! kwok marks pods Running and Ready without running their containers, so the
//! preflight verdicts are not exercised here (executors/preflight/tests does that on
//! this machine's kernel); everything the API server, the DaemonSet controller, the
//! scheduler, PodSecurity admission and the garbage collector do is real.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Event as CoreEvent, Node, Pod, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::RunnerPool;
use podmotion_api::conditions::{find, is_true};
use podmotion_api::names::{condition_types as ct, labels, reasons};
use podmotion_e2e::kubectl_wait;
use podmotion_e2e::operator::{InProcessController, install_crds, test_config};
use podmotion_e2e::{PodSecurity, TIMEOUT, TestNamespace, from_json, wait_for, wait_list};
use podmotion_operator::config::ControllerKind;
use podmotion_operator::controllers::runner_pool::{RunnerPoolConfig, run_with};
use serde_json::{Value, json};

const IMAGE: &str = "registry.example/compass/runner@sha256:4f1c3a2b5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708";

/// The RunnerPool controller, running in this test process.
struct Operator;

impl Operator {
    fn start(client: &Client, ns: &str) -> InProcessController {
        Operator::start_with(client, ns, true)
    }

    fn start_with(client: &Client, ns: &str, read_secrets: bool) -> InProcessController {
        let cfg = RunnerPoolConfig {
            preflight_image: "registry.example/podmotion/preflight@sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff".into(),
            watch_namespace: Some(ns.into()),
            max_priority: podmotion_operator::runner_pool::priority::DEFAULT_CEILING,
            read_secrets,
        };
        InProcessController::spawn(client, test_config(ns, ControllerKind::RunnerPool), |ctx| {
            run_with(ctx, cfg)
        })
    }
}

async fn ensure_crd(client: &Client) {
    install_crds(client).await;
}

/// The namespace, the CRD, the Server's Service and the controller.
async fn setup(prefix: &str, level: PodSecurity) -> Option<(TestNamespace, InProcessController)> {
    let ns = TestNamespace::new(prefix, level).await?;
    ensure_crd(&ns.client).await;
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443, "targetPort": 9443}]}
    }));
    ns.api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let op = Operator::start(&ns.client, &ns.name);
    Some((ns, op))
}

/// A RunnerPool with a PriorityClass unique to the namespace.
fn pool(ns: &TestNamespace, name: &str, extra: Value) -> RunnerPool {
    let mut spec = json!({
        "image": IMAGE,
        "sessionsPerNode": 2,
        "session": {"memoryMiB": 1024, "milliCPU": 500},
        "server": {"serviceName": "compass-server", "port": 8443},
        "priorityClass": {"name": format!("{}-runner", ns.name), "value": 100000},
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    from_json(
        json!({"apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool", "metadata": {"name": name}, "spec": spec}),
    )
}

fn condition_true(rp: Option<&RunnerPool>, type_: &str) -> bool {
    rp.and_then(|r| r.status.as_ref())
        .is_some_and(|s| is_true(&s.conditions, type_))
}

fn runner_pods_selector(pool: &str) -> String {
    format!("{}=runner,{}={pool}", labels::NAME, labels::INSTANCE)
}

/// One Runner pod per runner node; at least one runner node must exist for the test
/// to mean anything.
fn runner_pods_count_expected(runner_nodes: &BTreeSet<String>) -> usize {
    assert!(
        !runner_nodes.is_empty(),
        "the cluster has no node labelled {}=true",
        labels::RUNNER_NODE
    );
    runner_nodes.len()
}

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

fn has_controller_ref_to<K: Resource>(obj: &K, pool: &RunnerPool) -> bool {
    obj.meta().owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && r.kind == "RunnerPool"
            && Some(&r.uid) == pool.meta().uid.as_ref()
    })
}

fn memory_limit(ds: &DaemonSet) -> String {
    let spec = ds.spec.template.spec.as_ref().unwrap();
    let c = spec.containers.iter().find(|c| c.name == "runner").unwrap();
    c.resources.as_ref().unwrap().limits.as_ref().unwrap()["memory"]
        .0
        .clone()
}

#[tokio::test]
async fn runner_pods_land_only_on_runner_nodes_with_every_child_owned() {
    let Some((ns, op)) = setup("rp-shape", PodSecurity::Privileged).await else {
        return;
    };
    let runner_nodes: BTreeSet<String> = Api::<Node>::all(ns.client.clone())
        .list_metadata(&ListParams::default().labels(&format!("{}=true", labels::RUNNER_NODE)))
        .await
        .unwrap()
        .items
        .iter()
        .map(|n| n.name_any())
        .collect();
    let expected = runner_pods_count_expected(&runner_nodes);
    let pools = ns.api::<RunnerPool>();
    let created = pools
        .create(&PostParams::default(), &pool(&ns, "runners", json!({})))
        .await
        .unwrap();

    // The real API server admitted the pod shape (hostUsers: false, Unmasked procMount,
    // Localhost seccomp, AppArmor Unconfined, the KVM resource) and the scheduler put
    // the pods on the labelled, tainted nodes only.
    let pods = wait_list(
        &ns.api::<Pod>(),
        &runner_pods_selector("runners"),
        TIMEOUT,
        "a Runner pod per runner node",
        |ps| ps.len() == expected && ps.iter().all(|p| !node_of(p).is_empty()),
    )
    .await
    .unwrap();
    let nodes: BTreeSet<String> = pods.iter().map(node_of).collect();
    assert_eq!(
        nodes, runner_nodes,
        "Runner pods on every runner node and nowhere else"
    );
    let spec = pods[0].spec.as_ref().unwrap();
    assert_eq!(spec.host_users, Some(false));
    assert_eq!(
        spec.priority,
        Some(100000),
        "the PriorityClass was resolved by admission"
    );

    let capacity = 2 * i32::try_from(expected).unwrap();
    let ready = wait_for(
        &pools,
        "runners",
        TIMEOUT,
        "Ready with the fleet's capacity",
        |rp| {
            condition_true(rp, ct::READY)
                && rp
                    .and_then(|r| r.status.as_ref())
                    .is_some_and(|s| s.session_capacity == capacity)
        },
    )
    .await
    .unwrap()
    .unwrap();
    kubectl_wait(&ns.name, "runnerpool/runners", "Ready", TIMEOUT)
        .await
        .unwrap();
    let status = ready.status.as_ref().unwrap();
    let n = i32::try_from(runner_nodes.len()).unwrap();
    assert_eq!((status.desired_nodes, status.ready_nodes), (n, n));
    assert!(is_true(&status.conditions, ct::SHAPE_CONFORMANT));
    assert!(is_true(&status.conditions, ct::POD_SECURITY_ADMITTED));
    assert_eq!(status.observed_generation, created.metadata.generation);

    let ds = ns.api::<DaemonSet>().get("runners").await.unwrap();
    assert!(has_controller_ref_to(&ds, &created));
    assert!(has_controller_ref_to(
        &ns.api::<ServiceAccount>().get("runners").await.unwrap(),
        &created
    ));
    assert!(has_controller_ref_to(
        &ns.api::<NetworkPolicy>().get("runners").await.unwrap(),
        &created
    ));
    assert!(has_controller_ref_to(
        &ns.api::<PodDisruptionBudget>()
            .get("runners")
            .await
            .unwrap(),
        &created
    ));
    let secret = ns.api::<Secret>().get("runners-credentials").await.unwrap();
    assert!(has_controller_ref_to(&secret, &created));
    assert_eq!(
        secret.data.unwrap()["token"].0.len(),
        64,
        "a generated 32-byte hex token"
    );
    let pc = Api::<PriorityClass>::all(ns.client.clone())
        .get(&format!("{}-runner", ns.name))
        .await
        .unwrap();
    assert!(pc.metadata.owner_references.is_none());
    assert_eq!(pc.labels()[labels::OWNER_UID], created.uid().unwrap());

    // The Server's egress rule follows the Service's selector and targetPort.
    let np = ns.api::<NetworkPolicy>().get("runners").await.unwrap();
    let egress = serde_json::to_value(np.spec.unwrap().egress.unwrap()).unwrap();
    assert!(
        egress.to_string().contains("\"app\":\"compass-server\""),
        "{egress}"
    );
    assert!(egress.to_string().contains("9443"), "{egress}");
    op.stop().await;
}

#[tokio::test]
async fn a_settled_pool_is_not_rewritten() {
    let Some((ns, op)) = setup("rp-quiet", PodSecurity::Privileged).await else {
        return;
    };
    let pools = ns.api::<RunnerPool>();
    pools
        .create(&PostParams::default(), &pool(&ns, "quiet", json!({})))
        .await
        .unwrap();
    let settled = wait_for(&pools, "quiet", TIMEOUT, "Ready", |rp| {
        condition_true(rp, ct::READY)
    })
    .await
    .unwrap()
    .unwrap();
    let ds_rv = ns
        .api::<DaemonSet>()
        .get("quiet")
        .await
        .unwrap()
        .resource_version();
    // Wake the controller without changing anything it renders: an annotation on the pool.
    let patch = json!({"metadata": {"annotations": {"e2e.podmotion.io/poke": "1"}}});
    pools
        .patch("quiet", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    // Give it a reconcile to make a change, then compare: the absence of a change can
    // only be checked after the fact. (This catches churn — a status or hash that moves
    // on every reconcile — not no-op requests, which leave no trace in the objects.)
    tokio::time::sleep(Duration::from_secs(3)).await;
    let now = pools.get("quiet").await.unwrap();
    assert_eq!(
        now.status, settled.status,
        "status rewritten without a change"
    );
    assert_eq!(
        ns.api::<DaemonSet>()
            .get("quiet")
            .await
            .unwrap()
            .resource_version(),
        ds_rv,
        "DaemonSet rewritten"
    );
    op.stop().await;
}

#[tokio::test]
async fn changing_capacity_rolls_the_daemonset_within_max_unavailable() {
    let Some((ns, op)) = setup("rp-roll", PodSecurity::Privileged).await else {
        return;
    };
    // Three Runner nodes for this pool: a label of its own on every kwok node.
    let key = format!("e2e.podmotion.io/{}", ns.name);
    let nodes_api = Api::<Node>::all(ns.client.clone());
    let node_names = ["pm-node-0", "pm-node-1", "pm-node-2"];
    for n in node_names {
        let patch = json!({"metadata": {"labels": {key.clone(): "runner"}}});
        nodes_api
            .patch(n, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }
    let pools = ns.api::<RunnerPool>();
    let extra = json!({
        "nodes": {"labelKey": key, "labelValue": "runner", "taintKey": labels::RUNNER_NODE, "taintValue": "true"},
        "rollout": {"maxUnavailable": 1},
    });
    pools
        .create(&PostParams::default(), &pool(&ns, "fleet", extra))
        .await
        .unwrap();
    let before = wait_for(&pools, "fleet", TIMEOUT, "Ready on 3 nodes", |rp| {
        condition_true(rp, ct::READY)
            && rp
                .and_then(|r| r.status.as_ref())
                .is_some_and(|s| s.ready_nodes == 3)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(before.status.as_ref().unwrap().session_capacity, 6);
    let dss = ns.api::<DaemonSet>();
    let old_memory = memory_limit(&dss.get("fleet").await.unwrap());

    // Record, from a watch, the most Runner pods ever missing during the rollout.
    let worst = Arc::new(Mutex::new(0i32));
    let w = worst.clone();
    let pods = ns.api::<Pod>();
    let selector = runner_pods_selector("fleet");
    let observer = tokio::spawn(async move {
        let mut stream =
            watcher::watcher(pods, watcher::Config::default().labels(&selector)).boxed();
        let mut ready: std::collections::BTreeMap<String, bool> = Default::default();
        while let Ok(Some(ev)) = stream.try_next().await {
            match ev {
                Event::Apply(p) | Event::InitApply(p) => {
                    let r = podmotion_e2e::pod_running_ready(&p)
                        && p.metadata.deletion_timestamp.is_none();
                    ready.insert(node_of(&p) + "/" + &p.name_any(), r);
                }
                Event::Delete(p) => {
                    ready.remove(&(node_of(&p) + "/" + &p.name_any()));
                }
                _ => {}
            }
            let nodes_ready: BTreeSet<&str> = ready
                .iter()
                .filter(|(_, r)| **r)
                .map(|(k, _)| k.split('/').next().unwrap())
                .collect();
            let missing = 3 - nodes_ready.len() as i32;
            let mut w = w.lock().unwrap();
            *w = (*w).max(missing);
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    *worst.lock().unwrap() = 0;

    let patch = json!({"spec": {"sessionsPerNode": 3}});
    let updated = pools
        .patch("fleet", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let after = wait_for(
        &pools,
        "fleet",
        Duration::from_secs(120),
        "rolled out and Ready",
        |rp| {
            rp.and_then(|r| r.status.as_ref()).is_some_and(|s| {
                s.observed_generation == updated.metadata.generation
                    && is_true(&s.conditions, ct::READY)
                    && s.updated_nodes == 3
                    && s.session_capacity == 9
            })
        },
    )
    .await
    .unwrap()
    .unwrap();
    observer.abort();
    let ds = dss.get("fleet").await.unwrap();
    assert_ne!(
        memory_limit(&ds),
        old_memory,
        "the pod was resized for the new capacity"
    );
    let ru = ds.spec.update_strategy.unwrap().rolling_update.unwrap();
    assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
    let worst = *worst.lock().unwrap();
    assert!(
        worst <= 1,
        "{worst} Runner nodes were without a ready Runner at once (maxUnavailable 1)"
    );
    assert_eq!(after.status.unwrap().session_capacity, 9);

    for n in node_names {
        let patch = json!({"metadata": {"labels": {key.clone(): null}}});
        nodes_api
            .patch(n, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .unwrap();
    }
    op.stop().await;
}

/// The notes of every ShapeDrift event, joined.
fn drift_notes(events: &[CoreEvent]) -> String {
    events
        .iter()
        .filter(|e| e.reason.as_deref() == Some(reasons::SHAPE_DRIFT))
        .filter_map(|e| e.message.clone())
        .collect::<Vec<_>>()
        .join(" | ")
}

#[tokio::test]
async fn a_hand_edited_daemonset_is_reported_and_repaired() {
    let Some((ns, op)) = setup("rp-drift", PodSecurity::Privileged).await else {
        return;
    };
    let pools = ns.api::<RunnerPool>();
    pools
        .create(&PostParams::default(), &pool(&ns, "drift", json!({})))
        .await
        .unwrap();
    wait_for(&pools, "drift", TIMEOUT, "Ready", |rp| {
        condition_true(rp, ct::READY)
    })
    .await
    .unwrap();

    // What `kubectl edit` would do: privileged on (which the API server only accepts
    // with privilege escalation allowed), a capability added, memory changed.
    let dss = ns.api::<DaemonSet>();
    let edit = json!({"spec": {"template": {"spec": {"containers": [{
        "name": "runner",
        "securityContext": {
            "privileged": true,
            "allowPrivilegeEscalation": true,
            "capabilities": {"add": ["SYS_ADMIN"]},
        },
        "resources": {"limits": {"memory": "1Gi"}, "requests": {"memory": "1Gi"}},
    }]}}}});
    dss.patch("drift", &PatchParams::default(), &Patch::Strategic(&edit))
        .await
        .unwrap();

    let repaired = wait_for(&dss, "drift", TIMEOUT, "the contract restored", |ds| {
        ds.is_some_and(|ds| {
            let c = &ds.spec.template.spec.as_ref().unwrap().containers[0];
            let sc = c.security_context.as_ref().unwrap();
            sc.privileged != Some(true)
                && sc.allow_privilege_escalation == Some(false)
                && sc
                    .capabilities
                    .as_ref()
                    .and_then(|c| c.add.as_ref())
                    .is_none_or(Vec::is_empty)
                && c.resources.as_ref().unwrap().limits.as_ref().unwrap()["memory"].0 != "1Gi"
        })
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        repaired.spec.template.spec.as_ref().unwrap().containers[0]
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .as_ref()
            .unwrap()
            .drop,
        Some(vec!["ALL".to_string()])
    );
    // The drift was reported, naming the fields.
    let events = wait_list(
        &ns.api::<CoreEvent>(),
        "",
        TIMEOUT,
        "ShapeDrift events naming the edited fields",
        |evs| {
            let notes = drift_notes(evs);
            ["privileged", "SYS_ADMIN", "limits.memory"]
                .iter()
                .all(|f| notes.contains(f))
        },
    )
    .await
    .unwrap();
    // One reconcile normally repairs everything; if the DaemonSet controller raced the
    // replace, a second one finishes it. Together the notes name every edited field.
    let note = drift_notes(&events);
    assert!(note.contains("privileged"), "{note}");
    assert!(note.contains("SYS_ADMIN"), "{note}");
    assert!(note.contains("limits.memory"), "{note}");
    wait_for(&pools, "drift", TIMEOUT, "conformant again", |rp| {
        condition_true(rp, ct::SHAPE_CONFORMANT) && condition_true(rp, ct::READY)
    })
    .await
    .unwrap();
    op.stop().await;
}

#[tokio::test]
async fn deleting_the_pool_removes_everything_the_priority_class_included() {
    let Some((ns, op)) = setup("rp-delete", PodSecurity::Privileged).await else {
        return;
    };
    let pools = ns.api::<RunnerPool>();
    pools
        .create(&PostParams::default(), &pool(&ns, "gone", json!({})))
        .await
        .unwrap();
    wait_for(&pools, "gone", TIMEOUT, "Ready", |rp| {
        condition_true(rp, ct::READY)
    })
    .await
    .unwrap();
    let pcs = Api::<PriorityClass>::all(ns.client.clone());
    let pc_name = format!("{}-runner", ns.name);
    assert!(pcs.get_opt(&pc_name).await.unwrap().is_some());
    let with_finalizer = pools.get("gone").await.unwrap();
    assert!(
        with_finalizer
            .finalizers()
            .iter()
            .any(|f| f == "podmotion.io/runner-pool-cleanup")
    );

    pools
        .delete("gone", &DeleteParams::foreground())
        .await
        .unwrap();
    wait_for(&pools, "gone", TIMEOUT, "the RunnerPool gone", |rp| {
        rp.is_none()
    })
    .await
    .unwrap();
    wait_for(&pcs, &pc_name, TIMEOUT, "the PriorityClass gone", |pc| {
        pc.is_none()
    })
    .await
    .unwrap();
    wait_for(
        &ns.api::<DaemonSet>(),
        "gone",
        TIMEOUT,
        "the DaemonSet gone",
        |d| d.is_none(),
    )
    .await
    .unwrap();
    for (what, present) in [
        (
            "ServiceAccount",
            ns.api::<ServiceAccount>()
                .get_opt("gone")
                .await
                .unwrap()
                .is_some(),
        ),
        (
            "NetworkPolicy",
            ns.api::<NetworkPolicy>()
                .get_opt("gone")
                .await
                .unwrap()
                .is_some(),
        ),
        (
            "PodDisruptionBudget",
            ns.api::<PodDisruptionBudget>()
                .get_opt("gone")
                .await
                .unwrap()
                .is_some(),
        ),
        (
            "Secret",
            ns.api::<Secret>()
                .get_opt("gone-credentials")
                .await
                .unwrap()
                .is_some(),
        ),
    ] {
        assert!(
            !present,
            "{what} survived its RunnerPool (foreground deletion waits for dependents)"
        );
    }
    wait_list(
        &ns.api::<Pod>(),
        &runner_pods_selector("gone"),
        TIMEOUT,
        "Runner pods gone",
        |p| p.is_empty(),
    )
    .await
    .unwrap();
    op.stop().await;
}

#[tokio::test]
async fn a_baseline_namespace_is_reported_instead_of_failing_silently() {
    let Some((ns, op)) = setup("rp-baseline", PodSecurity::Baseline).await else {
        return;
    };
    let pools = ns.api::<RunnerPool>();
    pools
        .create(&PostParams::default(), &pool(&ns, "blocked", json!({})))
        .await
        .unwrap();
    let rp = wait_for(&pools, "blocked", TIMEOUT, "Stalled on PodSecurity", |rp| {
        condition_true(rp, ct::STALLED)
    })
    .await
    .unwrap()
    .unwrap();
    let c = find(
        &rp.status.as_ref().unwrap().conditions,
        ct::POD_SECURITY_ADMITTED,
    )
    .unwrap()
    .clone();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::POD_SECURITY_REJECTS)
    );
    assert!(
        c.message.contains("enforce=privileged") && c.message.contains("hostPath"),
        "{}",
        c.message
    );
    // And the API server agrees: the DaemonSet exists but no Runner pod was admitted.
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&runner_pods_selector("blocked")))
        .await
        .unwrap();
    assert!(pods.items.is_empty());
    op.stop().await;
}

#[tokio::test]
async fn a_tag_or_max_unavailable_of_100_percent_is_rejected_with_a_clear_message() {
    let Some(ns) = TestNamespace::new("rp-reject", PodSecurity::Privileged).await else {
        return;
    };
    ensure_crd(&ns.client).await;
    let pools = ns.api::<RunnerPool>();
    let mut tagged = pool(&ns, "tagged", json!({}));
    tagged.spec.image = "registry.example/compass/runner:1.4.2".into();
    let all = pool(
        &ns,
        "all-at-once",
        json!({"rollout": {"maxUnavailable": "100%"}}),
    );
    for (rp, want) in [
        (tagged, "image must be pinned by digest"),
        (all, "100% is rejected"),
    ] {
        match pools.create(&PostParams::default(), &rp).await {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422);
                assert!(e.message.contains(want), "{}", e.message);
            }
            other => panic!("{} accepted: {other:?}", rp.name_any()),
        }
    }
}

#[tokio::test]
async fn a_runner_too_big_for_its_nodes_stalls_with_the_schedulers_reason() {
    let Some((ns, op)) = setup("rp-toobig", PodSecurity::Privileged).await else {
        return;
    };
    let pools = ns.api::<RunnerPool>();
    // 64 sessions of 4 GiB: far beyond any kwok node's allocatable memory.
    let big = json!({"sessionsPerNode": 64, "session": {"memoryMiB": 4096, "milliCPU": 100}});
    pools
        .create(&PostParams::default(), &pool(&ns, "big", big))
        .await
        .unwrap();
    let rp = wait_for(&pools, "big", TIMEOUT, "Stalled: unschedulable", |rp| {
        rp.and_then(|r| r.status.as_ref())
            .and_then(|s| find(&s.conditions, ct::STALLED))
            .is_some_and(|c| c.status == "True" && c.reason == reasons::RUNNER_UNSCHEDULABLE)
    })
    .await
    .unwrap()
    .unwrap();
    let msg = find(&rp.status.unwrap().conditions, ct::STALLED)
        .unwrap()
        .message
        .clone();
    assert!(msg.contains("Insufficient memory"), "{msg}");
    op.stop().await;
}

/// A client that acts as ServiceAccount `sa` of `ns` (impersonation by the admin).
async fn impersonating(ns: &str, sa: &str) -> Client {
    podmotion_e2e::impersonating(&format!("system:serviceaccount:{ns}:{sa}"))
        .await
        .unwrap()
}

/// The cluster-wide rules the chart gives the operator for RunnerPool when it watches
/// every namespace: Secrets may be created, patched and deleted, never read.
fn operator_rules() -> Value {
    json!([
        {"apiGroups": ["podmotion.io"], "resources": ["runnerpools"], "verbs": ["get", "list", "watch", "patch", "update"]},
        {"apiGroups": ["podmotion.io"], "resources": ["runnerpools/status"], "verbs": ["get", "patch", "update"]},
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"]},
        {"apiGroups": [""], "resources": ["pods", "nodes", "namespaces"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["serviceaccounts"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        {"apiGroups": ["policy"], "resources": ["poddisruptionbudgets"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
        {"apiGroups": ["scheduling.k8s.io"], "resources": ["priorityclasses"], "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    ])
}

#[tokio::test]
async fn without_secret_reads_the_credential_is_created_once_and_removed_by_name() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let Some(ns) = TestNamespace::new("rp-noread", PodSecurity::Privileged).await else {
        return;
    };
    ensure_crd(&ns.client).await;
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"port": 8443, "targetPort": 9443}]}
    }));
    ns.api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let sa: ServiceAccount = from_json(json!({"metadata": {"name": "rp-operator"}}));
    ns.api::<ServiceAccount>()
        .create(&PostParams::default(), &sa)
        .await
        .unwrap();
    let role_name = format!("{}-runner-pool", ns.name);
    let roles = Api::<ClusterRole>::all(ns.client.clone());
    let bindings = Api::<ClusterRoleBinding>::all(ns.client.clone());
    roles
        .create(
            &PostParams::default(),
            &from_json(json!({"metadata": {"name": role_name}, "rules": operator_rules()})),
        )
        .await
        .unwrap();
    bindings
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": {"name": role_name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
                "subjects": [{"kind": "ServiceAccount", "name": "rp-operator", "namespace": ns.name}]
            })),
        )
        .await
        .unwrap();
    podmotion_e2e::wait_until_allowed(
        &ns.client,
        &format!("system:serviceaccount:{}:rp-operator", ns.name),
        None,
        "podmotion.io",
        "runnerpools",
        "list",
    )
    .await
    .unwrap();
    let client = impersonating(&ns.name, "rp-operator").await;
    // The premise: this identity cannot read a Secret.
    match Api::<Secret>::namespaced(client.clone(), &ns.name)
        .get_opt("anything")
        .await
    {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403),
        other => panic!("the operator identity can read Secrets: {other:?}"),
    }
    let op = Operator::start_with(&client, &ns.name, false);

    let pools = ns.api::<RunnerPool>();
    pools
        .create(&PostParams::default(), &pool(&ns, "noread", json!({})))
        .await
        .unwrap();
    let rp = wait_for(&pools, "noread", TIMEOUT, "Ready", |rp| {
        condition_true(rp, ct::READY)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        rp.status.unwrap().credential_secret.as_deref(),
        Some("noread-credentials")
    );
    let secret = ns.api::<Secret>().get("noread-credentials").await.unwrap();
    let token = secret.data.unwrap()["token"].clone();
    assert_eq!(token.0.len(), 64);

    // Switch to a Secret of the user's: the generated one is deleted by name.
    let mine: Secret =
        from_json(json!({"metadata": {"name": "my-token"}, "stringData": {"token": "t0k3n"}}));
    ns.api::<Secret>()
        .create(&PostParams::default(), &mine)
        .await
        .unwrap();
    let patch = json!({"spec": {"credentials": {"secretName": "my-token"}}});
    pools
        .patch("noread", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    wait_for(
        &ns.api::<Secret>(),
        "noread-credentials",
        TIMEOUT,
        "the generated Secret deleted",
        |s| s.is_none(),
    )
    .await
    .unwrap();
    let rp = wait_for(
        &pools,
        "noread",
        TIMEOUT,
        "status without a generated Secret",
        |rp| {
            rp.and_then(|r| r.status.as_ref())
                .is_some_and(|s| s.credential_secret.is_none() && is_true(&s.conditions, ct::READY))
        },
    )
    .await
    .unwrap()
    .unwrap();
    assert!(rp.status.unwrap().credential_secret.is_none());
    let ds = ns.api::<DaemonSet>().get("noread").await.unwrap();
    let vols = serde_json::to_string(&ds.spec.template.spec.unwrap().volumes).unwrap();
    assert!(vols.contains("my-token"), "{vols}");
    op.stop().await;
    bindings
        .delete(&role_name, &DeleteParams::default())
        .await
        .ok();
    roles
        .delete(&role_name, &DeleteParams::default())
        .await
        .ok();
}

#[tokio::test]
async fn a_tenants_pool_cannot_use_a_priority_class_above_the_installers_ceiling() {
    let Some((ns, op)) = setup("rp-ceiling", PodSecurity::Privileged).await else {
        return;
    };
    // A tenant who may manage RunnerPools in this namespace, and nothing else.
    let user = format!("tenant-{}", ns.name);
    podmotion_e2e::grant_user(
        &ns,
        &user,
        json!([{"apiGroups": ["podmotion.io"], "resources": ["runnerpools"], "verbs": ["get", "list", "watch", "create", "delete"]}]),
    )
    .await
    .unwrap();
    let tenant =
        Api::<RunnerPool>::namespaced(podmotion_e2e::impersonating(&user).await.unwrap(), &ns.name);
    // A reserved class is rejected at admission, created or referenced.
    let system = pool(
        &ns,
        "system",
        json!({"priorityClass": {"name": "system-node-critical", "create": false}}),
    );
    match tenant.create(&PostParams::default(), &system).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 422, "{}", e.message);
            assert!(
                e.message.contains("must not start with 'system-'"),
                "{}",
                e.message
            );
        }
        other => panic!("a system-* class was accepted: {other:?}"),
    }
    // A class above the ceiling is admitted (its value is not known at admission when
    // referenced) but refused by the operator: Stalled, and nothing is created.
    let pc_name = format!("{}-preempts-all", ns.name);
    let high = pool(
        &ns,
        "high",
        json!({"priorityClass": {"name": pc_name, "value": 999_999_999}}),
    );
    tenant.create(&PostParams::default(), &high).await.unwrap();
    let pools = ns.api::<RunnerPool>();
    let rp = wait_for(
        &pools,
        "high",
        TIMEOUT,
        "Stalled: PriorityClassRefused",
        |rp| {
            rp.and_then(|r| r.status.as_ref())
                .and_then(|s| find(&s.conditions, ct::STALLED))
                .is_some_and(|c| c.status == "True" && c.reason == reasons::PRIORITY_CLASS_REFUSED)
        },
    )
    .await
    .unwrap()
    .unwrap();
    let msg = find(&rp.status.unwrap().conditions, ct::STALLED)
        .unwrap()
        .message
        .clone();
    assert!(msg.contains("runnerPool.maxPriority"), "{msg}");
    assert!(
        ns.api::<DaemonSet>()
            .get_opt("high")
            .await
            .unwrap()
            .is_none(),
        "no DaemonSet for a refused pool"
    );
    assert!(
        Api::<PriorityClass>::all(ns.client.clone())
            .get_opt(&pc_name)
            .await
            .unwrap()
            .is_none(),
        "no PriorityClass was created"
    );
    op.stop().await;
}
