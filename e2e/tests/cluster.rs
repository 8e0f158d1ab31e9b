//! The local control plane (hack/cluster.sh) behaves like a cluster: controllers, scheduler,
//! kwok's simulated kubelets, garbage collection and admission are all real.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, from_json, pod_phase, pod_running_ready,
    restricted_container, wait_for, wait_list,
};
use serde_json::json;

const RUNNER_KEY: &str = "podmotion.io/runner-node";
const HOLD_FINALIZER: &str = "e2e.podmotion.io/hold";

/// Nodes that accept ordinary pods (no NoSchedule/NoExecute taint) and nodes that don't.
async fn node_sets(client: &Client) -> (BTreeSet<String>, BTreeSet<String>) {
    let nodes = Api::<Node>::all(client.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    let mut open = BTreeSet::new();
    let mut tainted = BTreeSet::new();
    for n in nodes {
        let repels = n
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|ts| {
                ts.iter()
                    .any(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
            });
        if repels {
            tainted.insert(n.name_any());
        } else {
            open.insert(n.name_any());
        }
    }
    (open, tainted)
}

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

fn job_condition(job: &Job, type_: &str) -> bool {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

fn pod_manifest(name: &str, container: serde_json::Value) -> Pod {
    from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [container]}
    }))
}

#[tokio::test]
async fn nodes_are_ready_with_kvm_resource_and_runner_taint() {
    let Some(ns) = TestNamespace::new("nodes", PodSecurity::Restricted).await else {
        return;
    };
    let nodes = Api::<Node>::all(ns.client.clone());
    let list = wait_list(&nodes, "type=kwok", TIMEOUT, "kwok nodes Ready", |ns| {
        !ns.is_empty()
            && ns.iter().all(|n| {
                n.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
    })
    .await
    .unwrap();
    let mut runners = 0;
    for n in &list {
        assert!(
            n.name_any().starts_with("pm-node-"),
            "unexpected node {}",
            n.name_any()
        );
        let status = n.status.as_ref().unwrap();
        for (what, res) in [
            ("capacity", &status.capacity),
            ("allocatable", &status.allocatable),
        ] {
            let kvm = res
                .as_ref()
                .and_then(|r| r.get("devices.kubevirt.io/kvm"))
                .map(|q| q.0.clone());
            assert_eq!(kvm.as_deref(), Some("110"), "{} {what}", n.name_any());
        }
        if n.labels().get(RUNNER_KEY).map(String::as_str) == Some("true") {
            runners += 1;
            let taints = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.clone())
                .unwrap_or_default();
            assert!(
                taints
                    .iter()
                    .any(|t| t.key == RUNNER_KEY && t.effect == "NoSchedule"),
                "runner node {} lacks its taint: {taints:?}",
                n.name_any()
            );
        }
        // kwok renews a Lease per node like a kubelet.
        let leases: Api<Lease> = Api::namespaced(ns.client.clone(), "kube-node-lease");
        wait_for(&leases, &n.name_any(), TIMEOUT, "node lease", |l| {
            l.and_then(|l| l.spec.as_ref())
                .and_then(|s| s.renew_time.as_ref())
                .is_some()
        })
        .await
        .unwrap();
    }
    assert!(
        runners >= 1,
        "no runner node (label {RUNNER_KEY}=true); default cluster has pm-node-2"
    );
}

#[tokio::test]
async fn deployment_pods_become_running_ready_and_scale_down_deletes_pods() {
    let Some(ns) = TestNamespace::new("deploy", PodSecurity::Restricted).await else {
        return;
    };
    let (_, tainted) = node_sets(&ns.client).await;
    let deploys: Api<Deployment> = ns.api();
    let pods: Api<Pod> = ns.api();
    let d: Deployment = from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 3,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [restricted_container("web")]}
            }
        }
    }));
    deploys.create(&PostParams::default(), &d).await.unwrap();

    let running = wait_list(
        &pods,
        "app=web",
        TIMEOUT,
        "3 pods Running and Ready",
        |ps| ps.len() == 3 && ps.iter().all(pod_running_ready),
    )
    .await
    .unwrap();
    for p in &running {
        let node = node_of(p);
        assert!(
            node.starts_with("pm-node-"),
            "pod {} not scheduled: {node:?}",
            p.name_any()
        );
        assert!(
            !tainted.contains(&node),
            "pod {} on tainted node {node}",
            p.name_any()
        );
        let st = p.status.as_ref().unwrap();
        assert!(
            st.pod_ip.is_some() && st.host_ip.is_some(),
            "pod {} has no IPs: {st:?}",
            p.name_any()
        );
    }
    wait_for(&deploys, "web", TIMEOUT, "deployment available 3/3", |d| {
        d.and_then(|d| d.status.as_ref())
            .is_some_and(|s| s.ready_replicas == Some(3) && s.available_replicas == Some(3))
    })
    .await
    .unwrap();

    // Scale down: two pods are deleted (really gone, not just terminating), none replaced.
    deploys
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 1}})),
        )
        .await
        .unwrap();
    let left = wait_list(&pods, "app=web", TIMEOUT, "1 pod left", |ps| ps.len() == 1)
        .await
        .unwrap();
    let before: BTreeSet<String> = running.iter().map(|p| p.name_any()).collect();
    assert!(
        before.contains(&left[0].name_any()),
        "survivor {} is a new pod",
        left[0].name_any()
    );
    assert!(pod_running_ready(&left[0]));
    wait_for(&deploys, "web", TIMEOUT, "deployment at 1 replica", |d| {
        d.and_then(|d| d.status.as_ref())
            .is_some_and(|s| s.replicas == Some(1) && s.ready_replicas == Some(1))
    })
    .await
    .unwrap();
}

#[tokio::test]
async fn daemonset_places_one_pod_per_matching_node_and_respects_taints() {
    let Some(ns) = TestNamespace::new("ds", PodSecurity::Restricted).await else {
        return;
    };
    let (open, tainted) = node_sets(&ns.client).await;
    assert!(
        !open.is_empty() && !tainted.is_empty(),
        "needs tainted and untainted nodes: {open:?} {tainted:?}"
    );
    let runner_nodes: BTreeSet<String> = Api::<Node>::all(ns.client.clone())
        .list(&ListParams::default().labels(&format!("{RUNNER_KEY}=true")))
        .await
        .unwrap()
        .iter()
        .map(|n| n.name_any())
        .collect();
    assert!(!runner_nodes.is_empty(), "no runner node");
    let dss: Api<DaemonSet> = ns.api();
    let pods: Api<Pod> = ns.api();

    let ds = |name: &str, extra: serde_json::Value| -> DaemonSet {
        let mut spec = json!({"containers": [restricted_container("agent")]});
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        from_json(json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": name},
            "spec": {
                "selector": {"matchLabels": {"ds": name}},
                "template": {"metadata": {"labels": {"ds": name}}, "spec": spec}
            }
        }))
    };

    // No toleration: every untainted node, none of the tainted ones.
    dss.create(&PostParams::default(), &ds("plain", json!({})))
        .await
        .unwrap();
    // Tolerates the runner taint, selects runner nodes: exactly the runner nodes.
    let runner_extra = json!({
        "nodeSelector": {RUNNER_KEY: "true"},
        "tolerations": [{"key": RUNNER_KEY, "operator": "Exists", "effect": "NoSchedule"}]
    });
    dss.create(&PostParams::default(), &ds("runner", runner_extra))
        .await
        .unwrap();

    for (name, expected) in [("plain", &open), ("runner", &runner_nodes)] {
        let ps = wait_list(
            &pods,
            &format!("ds={name}"),
            TIMEOUT,
            "one Ready pod per matching node",
            |ps| ps.len() == expected.len() && ps.iter().all(pod_running_ready),
        )
        .await
        .unwrap();
        let placed: BTreeSet<String> = ps.iter().map(node_of).collect();
        assert_eq!(&placed, expected, "daemonset {name} pods on {placed:?}");
        let d = wait_for(&dss, name, TIMEOUT, "daemonset status", |d| {
            d.and_then(|d| d.status.as_ref())
                .is_some_and(|s| s.number_ready as usize == expected.len())
        })
        .await
        .unwrap()
        .unwrap();
        let st = d.status.unwrap();
        assert_eq!(
            st.desired_number_scheduled as usize,
            expected.len(),
            "daemonset {name}: {st:?}"
        );
        assert_eq!(st.number_misscheduled, 0, "daemonset {name}: {st:?}");
    }
}

fn job_manifest(name: &str, completions: i32, annotations: serde_json::Value) -> Job {
    from_json(json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": 0,
            "template": {
                "metadata": {"annotations": annotations},
                "spec": {"restartPolicy": "Never", "containers": [restricted_container("work")]}
            }
        }
    }))
}

#[tokio::test]
async fn job_pod_runs_to_completion() {
    let Some(ns) = TestNamespace::new("job", PodSecurity::Restricted).await else {
        return;
    };
    let jobs: Api<Job> = ns.api();
    let pods: Api<Pod> = ns.api();
    jobs.create(&PostParams::default(), &job_manifest("once", 1, json!({})))
        .await
        .unwrap();
    let job = wait_for(&jobs, "once", TIMEOUT, "job Complete", |j| {
        j.is_some_and(|j| job_condition(j, "Complete"))
    })
    .await
    .unwrap()
    .unwrap();
    let st = job.status.as_ref().unwrap();
    assert_eq!(st.succeeded, Some(1), "{st:?}");
    assert!(st.completion_time.is_some(), "{st:?}");
    let ps = pods
        .list(&ListParams::default().labels("job-name=once"))
        .await
        .unwrap()
        .items;
    assert_eq!(ps.len(), 1);
    let pod = &ps[0];
    assert_eq!(pod_phase(pod), "Succeeded");
    let pst = pod.status.as_ref().unwrap();
    assert!(pst.start_time.is_some(), "pod never started: {pst:?}");
    let term = pst.container_statuses.as_ref().unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .terminated
        .clone()
        .unwrap();
    assert_eq!(
        (term.exit_code, term.reason.as_deref()),
        (0, Some("Completed"))
    );

    // A failing container (exit code from the kwok stage's annotation) fails the Job.
    jobs.create(
        &PostParams::default(),
        &job_manifest("fails", 1, json!({"sim.podmotion.io/exit-code": "3"})),
    )
    .await
    .unwrap();
    wait_for(&jobs, "fails", TIMEOUT, "job Failed", |j| {
        j.is_some_and(|j| job_condition(j, "Failed"))
    })
    .await
    .unwrap();
    let ps = pods
        .list(&ListParams::default().labels("job-name=fails"))
        .await
        .unwrap()
        .items;
    assert_eq!(ps.len(), 1);
    assert_eq!(pod_phase(&ps[0]), "Failed");
    let term = ps[0]
        .status
        .as_ref()
        .unwrap()
        .container_statuses
        .as_ref()
        .unwrap()[0]
        .state
        .as_ref()
        .unwrap()
        .terminated
        .clone()
        .unwrap();
    assert_eq!(term.exit_code, 3);
}

#[tokio::test]
async fn foreground_deletion_of_job_removes_its_pods_first() {
    let Some(ns) = TestNamespace::new("fg", PodSecurity::Restricted).await else {
        return;
    };
    let jobs: Api<Job> = ns.api();
    let pods: Api<Pod> = ns.api();
    jobs.create(&PostParams::default(), &job_manifest("batch", 2, json!({})))
        .await
        .unwrap();
    wait_for(&jobs, "batch", TIMEOUT, "job Complete", |j| {
        j.is_some_and(|j| job_condition(j, "Complete"))
    })
    .await
    .unwrap();
    let ps = pods
        .list(&ListParams::default().labels("job-name=batch"))
        .await
        .unwrap()
        .items;
    assert_eq!(ps.len(), 2);

    // Our own finalizer holds the pods, so the order is observable without racing.
    for p in &ps {
        pods.patch(
            &p.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"finalizers": [HOLD_FINALIZER]}})),
        )
        .await
        .unwrap();
    }
    jobs.delete("batch", &DeleteParams::foreground())
        .await
        .unwrap();

    // The garbage collector deletes the pods while the Job waits, foregroundDeletion-finalized.
    wait_list(
        &pods,
        "job-name=batch",
        TIMEOUT,
        "pods marked for deletion",
        |ps| ps.len() == 2 && ps.iter().all(|p| p.metadata.deletion_timestamp.is_some()),
    )
    .await
    .unwrap();
    let job = jobs.get("batch").await.expect("job must outlive its pods");
    assert!(job.metadata.deletion_timestamp.is_some());
    assert!(
        job.finalizers().iter().any(|f| f == "foregroundDeletion"),
        "{:?}",
        job.finalizers()
    );

    for p in pods
        .list(&ListParams::default().labels("job-name=batch"))
        .await
        .unwrap()
    {
        let rest: Vec<String> = p
            .finalizers()
            .iter()
            .filter(|f| *f != HOLD_FINALIZER)
            .cloned()
            .collect();
        pods.patch(
            &p.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": rest}})),
        )
        .await
        .unwrap();
    }
    wait_for(&jobs, "batch", TIMEOUT, "job deleted", |j| j.is_none())
        .await
        .unwrap();
    let left = pods
        .list(&ListParams::default().labels("job-name=batch"))
        .await
        .unwrap()
        .items;
    assert!(
        left.is_empty(),
        "pods outlived their foreground-deleted Job: {:?}",
        left.iter().map(|p| p.name_any())
    );
}

#[tokio::test]
async fn pod_violating_namespace_pod_security_is_rejected() {
    let Some(ns) = TestNamespace::new("psa", PodSecurity::Restricted).await else {
        return;
    };
    let pods: Api<Pod> = ns.api();
    let bad = pod_manifest(
        "privileged",
        json!({"name": "c", "image": "registry.example/x:1", "securityContext": {"privileged": true}}),
    );
    match pods.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(
                s.message
                    .contains("violates PodSecurity \"restricted:latest\""),
                "{}",
                s.message
            );
            assert!(s.message.contains("privileged"), "{}", s.message);
        }
        other => panic!("privileged pod in a restricted namespace was not rejected: {other:?}"),
    }
    // A compliant pod in the same namespace is admitted and runs.
    pods.create(
        &PostParams::default(),
        &pod_manifest("ok", restricted_container("c")),
    )
    .await
    .unwrap();
    wait_for(&pods, "ok", TIMEOUT, "pod Running and Ready", |p| {
        p.is_some_and(pod_running_ready)
    })
    .await
    .unwrap();
}

fn userns_unmasked_pod(name: &str, host_users: Option<bool>) -> Pod {
    let mut pod: Pod = from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [{
                "name": "runner",
                "image": "registry.example/podmotion/runner:1",
                "securityContext": {"procMount": "Unmasked"}
            }]
        }
    }));
    pod.spec.as_mut().unwrap().host_users = host_users;
    pod
}

#[tokio::test]
async fn pod_with_user_namespace_and_unmasked_procmount_is_accepted() {
    let Some(ns) = TestNamespace::new("userns", PodSecurity::Privileged).await else {
        return;
    };
    let pods: Api<Pod> = ns.api();
    let created = pods
        .create(
            &PostParams::default(),
            &userns_unmasked_pod("runner", Some(false)),
        )
        .await
        .unwrap();
    // Nothing was dropped (a disabled feature gate would silently clear these fields).
    let spec = created.spec.as_ref().unwrap();
    assert_eq!(spec.host_users, Some(false));
    let sc = spec.containers[0].security_context.as_ref().unwrap();
    assert_eq!(sc.proc_mount.as_deref(), Some("Unmasked"));
    wait_for(&pods, "runner", TIMEOUT, "pod Running and Ready", |p| {
        p.is_some_and(pod_running_ready)
    })
    .await
    .unwrap();

    // Validation is real: Unmasked without a user namespace is invalid.
    match pods
        .create(
            &PostParams::default(),
            &userns_unmasked_pod("hostusers", None),
        )
        .await
    {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 422, "{s:?}");
            assert!(s.message.contains("procMount"), "{}", s.message);
        }
        other => panic!("procMount Unmasked with host users was accepted: {other:?}"),
    }
}

/// Since Kubernetes 1.35 the baseline level allows `procMount: Unmasked` for pods in a user
/// namespace (`hostUsers: false`); restricted still forbids it.
#[tokio::test]
async fn unmasked_procmount_with_user_namespace_passes_baseline_but_not_restricted() {
    let Some(baseline) = TestNamespace::new("baseline", PodSecurity::Baseline).await else {
        return;
    };
    let pods: Api<Pod> = baseline.api();
    pods.create(
        &PostParams::default(),
        &userns_unmasked_pod("runner", Some(false)),
    )
    .await
    .unwrap();

    let Some(restricted) = TestNamespace::new("restricted", PodSecurity::Restricted).await else {
        return;
    };
    let pods: Api<Pod> = restricted.api();
    let mut pod = userns_unmasked_pod("runner", Some(false));
    // Otherwise restricted-compliant, so procMount is the only violation.
    let c = &mut pod.spec.as_mut().unwrap().containers[0];
    let mut compliant: Pod = pod_manifest("x", restricted_container("runner"));
    let mut sc = compliant.spec.as_mut().unwrap().containers[0]
        .security_context
        .take()
        .unwrap();
    sc.proc_mount = Some("Unmasked".into());
    c.security_context = Some(sc);
    match pods.create(&PostParams::default(), &pod).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 403, "{s:?}");
            assert!(
                s.message
                    .contains("violates PodSecurity \"restricted:latest\""),
                "{}",
                s.message
            );
            assert!(s.message.contains("procMount"), "{}", s.message);
        }
        other => panic!("Unmasked procMount admitted by restricted: {other:?}"),
    }
}
