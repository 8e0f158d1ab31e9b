//! NodeAgentAttachment against the real API server (hack/cluster.sh): the attachment
//! controller runs in this process (scoped to the test's namespace, its Jobs in a
//! second, privileged namespace), kwok plays the kubelets.
//!
//! kwok runs the agent Jobs' pods as it runs node agents (Running and Ready until
//! reaped; `hack/kwok/stages.yaml`) without running the agent; these tests check the
//! Jobs themselves (existence, pinning, container IDs, IP, suspension and resumption,
//! replacement, reaping, foreground deletion), not the agent.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{SkipReason, TargetState};
use podmotion_api::names::{annotations, labels};
use podmotion_e2e::kubectl_wait;
use podmotion_e2e::operator::{InProcessController, install_crds, test_config};
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, from_json, pod_running_ready, restricted_container,
    wait_for, wait_list,
};
use podmotion_operator::config::ControllerKind;
use podmotion_operator::controllers::attachment::run_with;
use serde_json::{Value, json};

/// The attachment controller, running in this test process.
struct Operator;

impl Operator {
    async fn start(client: &Client, agents_ns: &str, watch_ns: &str) -> InProcessController {
        let cfg = podmotion_e2e::operator::test_attachment_config(watch_ns);
        let mut config = test_config(agents_ns, ControllerKind::Attachment);
        config.identity = format!("e2e-{watch_ns}");
        InProcessController::spawn(client, config, |ctx| run_with(ctx, cfg))
    }
}

/// Installs (or updates) the CRDs from the types and waits for them.
async fn ensure_crd(client: &Client) {
    install_crds(client).await;
}

/// Two namespaces (the workload's and the agents'), the CRD, and the controller.
async fn setup(
    prefix: &str,
    app_level: PodSecurity,
) -> Option<(TestNamespace, TestNamespace, InProcessController)> {
    let app = TestNamespace::new(prefix, app_level).await?;
    // The agents' namespace must admit hostPID, hostPath and added capabilities.
    let agents = TestNamespace::new(&format!("{prefix}-agents"), PodSecurity::Privileged).await?;
    ensure_crd(&app.client).await;
    let op = Operator::start(&app.client, &agents.name, &app.name).await;
    Some((app, agents, op))
}

fn deployment(name: &str, replicas: i32, host_network: bool) -> Deployment {
    let mut container = restricted_container("app");
    container["ports"] = json!([{"containerPort": 8080, "name": "http"}]);
    from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "hostNetwork": host_network,
                    "containers": [container],
                    // Every kwok node, the runner node included, and evenly spread; never
                    // the real nodes (this test's image exists nowhere).
                    "nodeSelector": {"type": "kwok"},
                    "tolerations": [{"operator": "Exists"}],
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": name}}
                    }]
                }
            }
        }
    }))
}

fn attachment(name: &str, workload: &str, extra: Value) -> NodeAgentAttachment {
    let mut spec =
        json!({"workloadRef": {"kind": "Deployment", "name": workload}, "mode": "Intercept"});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": name},
        "spec": spec
    }))
}

fn env_of(job: &Job) -> BTreeMap<String, String> {
    job.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|ps| &ps.containers[0])
        .and_then(|c| c.env.clone())
        .into_iter()
        .flatten()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect()
}

fn node_of_job(job: &Job) -> Option<String> {
    job.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|ps| ps.node_name.clone())
}

fn container_ids(p: &Pod) -> BTreeMap<String, String> {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.clone())
        .into_iter()
        .flatten()
        .filter_map(|c| c.container_id.map(|id| (c.name, id)))
        .collect()
}

fn target_of(job: &Job) -> String {
    job.annotations()
        .get(annotations::TARGET_POD)
        .cloned()
        .unwrap_or_default()
}

/// Waits until the workload has exactly `n` pods, all Running and Ready, none terminating.
/// Creates Deployment `name` and returns its pods once all are Running and Ready.
async fn deploy(ns: &TestNamespace, name: &str, replicas: i32, host_network: bool) -> Vec<Pod> {
    let deployments: Api<Deployment> = ns.api();
    deployments
        .create(
            &PostParams::default(),
            &deployment(name, replicas, host_network),
        )
        .await
        .unwrap();
    settled_pods(ns, name, usize::try_from(replicas).unwrap()).await
}

/// Deployment `web` with 3 replicas and an intercept attachment `web` on it, once every
/// replica has its Job.
async fn attached_web(app: &TestNamespace, agents: &TestNamespace) -> Vec<Pod> {
    let pods = deploy(app, "web", 3, false).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    naas.create(&PostParams::default(), &attachment("web", "web", json!({})))
        .await
        .unwrap();
    jobs_follow(agents, &app.name, &pods, "one Job per replica").await;
    pods
}

async fn settled_pods(ns: &TestNamespace, app: &str, n: usize) -> Vec<Pod> {
    let pods: Api<Pod> = ns.api();
    wait_list(
        &pods,
        &format!("app={app}"),
        TIMEOUT,
        &format!("{n} ready pods of {app}"),
        |ps| {
            ps.len() == n
                && ps
                    .iter()
                    .all(|p| pod_running_ready(p) && p.metadata.deletion_timestamp.is_none())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
}

/// Whether `jobs` are exactly one live Job per pod, pinned to its node, carrying its
/// container IDs and IP.
fn jobs_match(jobs: &[Job], pods: &[Pod]) -> Result<(), String> {
    let live: Vec<&Job> = jobs
        .iter()
        .filter(|j| j.metadata.deletion_timestamp.is_none())
        .collect();
    if live.len() != jobs.len() {
        return Err(format!("{} Job(s) terminating", jobs.len() - live.len()));
    }
    let want: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let have: BTreeSet<String> = live.iter().map(|j| target_of(j)).collect();
    if want != have || live.len() != pods.len() {
        return Err(format!("Jobs target {have:?}, pods are {want:?}"));
    }
    for p in pods {
        let j = live.iter().find(|j| target_of(j) == p.name_any()).unwrap();
        let env = env_of(j);
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        if node_of_job(j) != node {
            return Err(format!(
                "Job {} pinned to {:?}, pod {} on {node:?}",
                j.name_any(),
                node_of_job(j),
                p.name_any()
            ));
        }
        let ids: BTreeMap<String, String> =
            serde_json::from_str(&env["AGENT_CONTAINER_IDS"]).unwrap_or_default();
        if ids != container_ids(p) {
            return Err(format!(
                "Job {} carries {ids:?}, pod has {:?}",
                j.name_any(),
                container_ids(p)
            ));
        }
        let ip = p
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .unwrap_or_default();
        if env["AGENT_TARGET_POD_IP"] != ip {
            return Err(format!(
                "Job {} carries IP {:?}, pod has {ip}",
                j.name_any(),
                env["AGENT_TARGET_POD_IP"]
            ));
        }
    }
    Ok(())
}

/// Waits until the agent Jobs of the workload match `pods` exactly.
async fn jobs_follow(agents: &TestNamespace, app_ns: &str, pods: &[Pod], what: &str) -> Vec<Job> {
    let jobs: Api<Job> = agents.api();
    let sel = format!("{}={app_ns}", labels::TARGET_NAMESPACE);
    let last = Mutex::new(String::new());
    wait_list(&jobs, &sel, TIMEOUT, what, |js| {
        match jobs_match(js, pods) {
            Ok(()) => true,
            Err(why) => {
                *last.lock().unwrap() = why;
                false
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}\nlast mismatch: {}", last.lock().unwrap()))
}

async fn scale(ns: &TestNamespace, name: &str, replicas: i32) {
    let d: Api<Deployment> = ns.api();
    d.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": replicas}})),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn one_job_per_ready_replica_follows_scaling_restarts_and_container_changes() {
    let Some((app, agents, op)) = setup("naa", PodSecurity::Restricted).await else {
        return;
    };
    let deployments: Api<Deployment> = app.api();
    deployments
        .create(&PostParams::default(), &deployment("web", 5, false))
        .await
        .unwrap();
    let pods = settled_pods(&app, "web", 5).await;
    let nodes: BTreeSet<String> = pods
        .iter()
        .filter_map(|p| p.spec.as_ref()?.node_name.clone())
        .collect();
    assert!(
        nodes.len() >= 3,
        "replicas spread over at least 3 kwok nodes: {nodes:?}"
    );

    let naas: Api<NodeAgentAttachment> = app.api();
    naas.create(&PostParams::default(), &attachment("web", "web", json!({})))
        .await
        .unwrap();
    let jobs = jobs_follow(&agents, &app.name, &pods, "one Job per replica").await;

    // Every Job's token is a Secret in the attachment's namespace, owned by the target
    // pod, whose SHA-256 the Job's pod carries; none in the agents' namespace. One
    // policy denies ingress.
    let secrets: Api<Secret> = app.api();
    let agents_secrets: Api<Secret> = agents.api();
    for j in &jobs {
        let s = wait_for(&secrets, &j.name_any(), TIMEOUT, "the Job's Secret", |s| {
            s.is_some()
        })
        .await
        .unwrap()
        .unwrap();
        let owner = &s.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str()),
            ("Pod", j.labels()[labels::TARGET_POD_UID].as_str())
        );
        let j = wait_for(
            &agents.api::<Job>(),
            &j.name_any(),
            TIMEOUT,
            "resumed",
            |j| j.is_some_and(|j| j.spec.as_ref().and_then(|s| s.suspend) == Some(false)),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(
            verifier_of(&j),
            Some(token_verifier_of(&s)),
            "the Job holds the token's verifier"
        );
        assert!(
            agents_secrets
                .get_opt(&j.name_any())
                .await
                .unwrap()
                .is_none()
        );
        let ps = j.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(ps.host_pid, Some(true));
        assert_eq!(
            ps.security_context
                .as_ref()
                .and_then(|sc| sc.seccomp_profile.as_ref())
                .map(|p| p.type_.as_str()),
            Some("RuntimeDefault")
        );
        // The agent tolerates what its target tolerates, and nothing more.
        let target = pods
            .iter()
            .find(|p| p.name_any() == j.annotations()[annotations::TARGET_POD])
            .expect("the Job's target pod");
        assert_eq!(
            ps.tolerations,
            target.spec.as_ref().unwrap().tolerations,
            "Job {}",
            j.name_any()
        );
        assert_eq!(
            ps.containers[0].image.as_deref(),
            Some("registry.example/podmotion/attach:e2e"),
            "the installer's image"
        );
        let caps = ps.containers[0]
            .security_context
            .as_ref()
            .unwrap()
            .capabilities
            .as_ref()
            .unwrap();
        assert_eq!(
            caps.add.as_ref().unwrap(),
            &["SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "DAC_READ_SEARCH"]
        );
    }
    let np: Api<NetworkPolicy> = agents.api();
    let policy = np.get("podmotion-node-agent-deny-ingress").await.unwrap();
    assert_eq!(
        policy.spec.unwrap().policy_types.unwrap(),
        vec!["Ingress".to_string()]
    );

    // The status lists the five targets with node, IP and Job.
    let st = wait_for(&naas, "web", TIMEOUT, "status with 5 targets", |a| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.total_targets == 5)
    })
    .await
    .unwrap()
    .unwrap()
    .status
    .unwrap();
    for t in &st.targets {
        let p = pods.iter().find(|p| p.name_any() == t.pod).unwrap();
        assert_eq!(Some(&t.node), p.spec.as_ref().unwrap().node_name.as_ref());
        assert_eq!(t.pod_ip, p.status.as_ref().unwrap().pod_ip);
        assert!(jobs.iter().any(|j| j.name_any() == t.job));
    }

    // Scale 5 → 8 → 3: the Jobs follow.
    scale(&app, "web", 8).await;
    let pods = settled_pods(&app, "web", 8).await;
    jobs_follow(&agents, &app.name, &pods, "Jobs after scaling to 8").await;
    scale(&app, "web", 3).await;
    let pods = settled_pods(&app, "web", 3).await;
    jobs_follow(&agents, &app.name, &pods, "Jobs after scaling to 3").await;

    // Rolling restart: new pods, new Jobs, the old ones reaped.
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": {"metadata": {"annotations": {"e2e.podmotion.io/restart": "1"}}}}})),
        )
        .await
        .unwrap();
    let old: BTreeSet<String> = pods.iter().map(|p| p.name_any()).collect();
    let podapi: Api<Pod> = app.api();
    let pods = wait_list(&podapi, "app=web", TIMEOUT, "rolled-out pods", |ps| {
        ps.len() == 3
            && ps.iter().all(|p| {
                pod_running_ready(p)
                    && !old.contains(&p.name_any())
                    && p.metadata.deletion_timestamp.is_none()
            })
    })
    .await
    .unwrap();
    let jobs = jobs_follow(&agents, &app.name, &pods, "Jobs after a rolling restart").await;

    // A replica made un-Ready keeps its Job.
    let unready = pods[0].name_any();
    let kept = jobs.iter().find(|j| target_of(j) == unready).unwrap().uid();
    podapi
        .patch_status(
            &unready,
            &PatchParams::default(),
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
            ),
        )
        .await
        .unwrap();
    wait_for(&podapi, &unready, TIMEOUT, "pod un-Ready", |p| {
        p.is_some_and(|p| !pod_running_ready(p))
    })
    .await
    .unwrap();
    // A negative check needs time to fail in: give the controller a few reconciles.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let jobapi: Api<Job> = agents.api();
    let still = jobapi
        .list(&ListParams::default().labels(&format!("{}={}", labels::TARGET_NAMESPACE, app.name)))
        .await
        .unwrap();
    let j = still
        .items
        .iter()
        .find(|j| target_of(j) == unready)
        .expect("the un-Ready replica's Job is kept");
    assert_eq!(j.uid(), kept);
    assert!(j.metadata.deletion_timestamp.is_none());

    // A changed container ID replaces the Job; the old one (and its pods) is gone first.
    let target = pods[1].clone();
    let job_name = jobs
        .iter()
        .find(|j| target_of(j) == target.name_any())
        .unwrap()
        .name_any();
    let old_uid = jobs
        .iter()
        .find(|j| j.name_any() == job_name)
        .unwrap()
        .uid()
        .unwrap();
    let mut history = watcher::watcher(
        jobapi.clone(),
        watcher::Config::default().fields(&format!("metadata.name={job_name}")),
    )
    .boxed();
    let mut statuses = target.status.clone().unwrap().container_statuses.unwrap();
    statuses[0].container_id = Some("kwok://restarted/app".into());
    statuses[0].restart_count = 1;
    podapi
        .patch_status(
            &target.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"containerStatuses": statuses}})),
        )
        .await
        .unwrap();
    let mut old_gone = false;
    let new_job = tokio::time::timeout(TIMEOUT, async {
        while let Some(ev) = history.try_next().await.unwrap() {
            match ev {
                Event::Delete(j) if j.uid().as_deref() == Some(old_uid.as_str()) => old_gone = true,
                Event::Apply(j) | Event::InitApply(j)
                    if j.uid().as_deref() != Some(old_uid.as_str()) =>
                {
                    assert!(
                        old_gone,
                        "successor Job created before its predecessor was gone"
                    );
                    return j;
                }
                _ => {}
            }
        }
        panic!("watch ended")
    })
    .await
    .expect("the Job is replaced in time");
    let ids: BTreeMap<String, String> =
        serde_json::from_str(&env_of(&new_job)["AGENT_CONTAINER_IDS"]).unwrap();
    assert_eq!(ids["app"], "kwok://restarted/app");
    let agent_pods: Api<Pod> = agents.api();
    let leftovers = agent_pods
        .list(
            &ListParams::default().labels(&format!("batch.kubernetes.io/controller-uid={old_uid}")),
        )
        .await
        .unwrap();
    assert!(
        leftovers.items.is_empty(),
        "pods of the replaced Job remain: {:?}",
        leftovers
            .items
            .iter()
            .map(|p| p.name_any())
            .collect::<Vec<_>>()
    );

    // Deleting the attachment removes every Job, with foreground propagation.
    let mut all_jobs = watcher::watcher(
        jobapi.clone(),
        watcher::Config::default().labels(&format!("{}={}", labels::TARGET_NAMESPACE, app.name)),
    )
    .boxed();
    let foreground_seen = Arc::new(Mutex::new(false));
    let seen = foreground_seen.clone();
    let observer = tokio::spawn(async move {
        while let Ok(Some(ev)) = all_jobs.try_next().await {
            if let Event::Apply(j) = ev
                && j.metadata.deletion_timestamp.is_some()
                && j.finalizers().iter().any(|f| f == "foregroundDeletion")
            {
                *seen.lock().unwrap() = true;
            }
        }
    });
    naas.delete("web", &DeleteParams::default()).await.unwrap();
    wait_for(
        &naas,
        "web",
        TIMEOUT,
        "the attachment gone (after its Jobs)",
        |a| a.is_none(),
    )
    .await
    .unwrap();
    let left = jobapi
        .list(&ListParams::default().labels(&format!("{}={}", labels::TARGET_NAMESPACE, app.name)))
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "Jobs left after the attachment: {:?}",
        left.items.iter().map(|j| j.name_any()).collect::<Vec<_>>()
    );
    observer.abort();
    assert!(
        *foreground_seen.lock().unwrap(),
        "no Job was deleted with foreground propagation"
    );
    op.stop().await;
}

#[tokio::test]
async fn host_network_replicas_are_skipped_with_their_reason() {
    // hostNetwork needs the privileged level in the workload's namespace too.
    let Some((app, agents, op)) = setup("naa-hostnet", PodSecurity::Privileged).await else {
        return;
    };
    let pods = deploy(&app, "web", 3, false).await;
    deploy(&app, "edge", 2, true).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    naas.create(
        &PostParams::default(),
        &attachment("edge", "edge", json!({})),
    )
    .await
    .unwrap();
    naas.create(&PostParams::default(), &attachment("web", "web", json!({})))
        .await
        .unwrap();
    let a = wait_for(&naas, "edge", TIMEOUT, "edge attachment stalled", |a| {
        a.and_then(|a| a.status.as_ref()).is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Stalled" && c.status == "True" && c.reason == "NoAdmissibleTarget"
            })
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .unwrap();
    let st = a.status.unwrap();
    assert_eq!(st.skipped.len(), 2);
    assert!(
        st.skipped
            .iter()
            .all(|s| s.reason == SkipReason::HostNetwork),
        "{:?}",
        st.skipped
    );
    assert!(st.targets.is_empty());
    // The other workload is attached as usual, and the host-network pods got no Job.
    let jobs = jobs_follow(&agents, &app.name, &pods, "Jobs of web only").await;
    assert_eq!(jobs.len(), 3);
    // Every admissible replica has a running agent: kubectl sees the attachment Ready.
    kubectl_wait(&app.name, "nodeagentattachment/web", "Ready", TIMEOUT)
        .await
        .unwrap();
    op.stop().await;
}

#[tokio::test]
async fn sweep_reaps_the_jobs_of_an_attachment_deleted_while_the_operator_was_down() {
    let Some((app, agents, op)) = setup("naa-sweep", PodSecurity::Restricted).await else {
        return;
    };
    attached_web(&app, &agents).await;
    let naas: Api<NodeAgentAttachment> = app.api();

    op.stop().await;
    // The attachment disappears while no operator runs (its finalizer force-removed, as
    // an impatient user or a namespace teardown would).
    naas.delete("web", &DeleteParams::default()).await.unwrap();
    naas.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    wait_for(&naas, "web", TIMEOUT, "attachment gone", |a| a.is_none())
        .await
        .unwrap();
    let jobs: Api<Job> = agents.api();
    let sel = format!("{}={}", labels::TARGET_NAMESPACE, app.name);
    assert_eq!(
        jobs.list(&ListParams::default().labels(&sel))
            .await
            .unwrap()
            .items
            .len(),
        3,
        "orphans exist while the operator is down"
    );

    let op = Operator::start(&app.client, &agents.name, &app.name).await;
    wait_list(&jobs, &sel, TIMEOUT, "orphans reaped by the sweep", |js| {
        js.is_empty()
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    op.stop().await;
}

#[tokio::test]
async fn ingest_holds_one_job_until_its_lease_expires() {
    let Some((app, agents, op)) = setup("naa-ingest", PodSecurity::Restricted).await else {
        return;
    };
    deploy(&app, "web", 3, false).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    let ingest = attachment(
        "peek",
        "web",
        json!({"mode": "Ingest", "ingest": {"leaseDurationSeconds": 10}}),
    );
    naas.create(&PostParams::default(), &ingest).await.unwrap();
    let jobs: Api<Job> = agents.api();
    let sel = format!("{}={}", labels::TARGET_NAMESPACE, app.name);
    let one = wait_list(&jobs, &sel, TIMEOUT, "one Job for the ingest", |js| {
        js.len() == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let a = wait_for(&naas, "peek", TIMEOUT, "ingest status", |a| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.total_targets == 1 && s.targets[0].state != TargetState::Pending)
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(a.status.as_ref().unwrap().targets[0].job, one[0].name_any());
    // Nobody renews the Lease: the Job is reaped and the attachment says why.
    wait_list(
        &jobs,
        &sel,
        Duration::from_secs(40),
        "the Job reaped at lease expiry",
        |js| js.is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    wait_for(&naas, "peek", TIMEOUT, "LeaseExpired", |a| {
        a.and_then(|a| a.status.as_ref()).is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == "LeaseExpired")
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    op.stop().await;
}

#[tokio::test]
async fn reap_all_removes_every_agent_job_and_releases_the_attachments() {
    let Some((app, agents, op)) = setup("naa-reap", PodSecurity::Restricted).await else {
        return;
    };
    attached_web(&app, &agents).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    // As the Helm pre-delete hook runs it: the controllers are stopped first.
    op.stop().await;
    // The hook's release is the operator's: its namespace and lease name.
    let config = test_config(&agents.name, ControllerKind::Attachment);
    let release =
        podmotion_operator::claim::release_identity(&config.namespace, &config.leader.lease_name);
    let n = podmotion_operator::controllers::attachment::reap_all(
        app.client.clone(),
        &agents.name,
        &release,
        TIMEOUT,
    )
    .await
    .unwrap();
    assert_eq!(n, 3);
    let jobs: Api<Job> = agents.api();
    let left = jobs
        .list(&ListParams::default().labels("app.kubernetes.io/component=node-agent"))
        .await
        .unwrap();
    assert!(left.items.is_empty(), "reap-all returned with Jobs left");
    let a = naas.get("web").await.unwrap();
    assert!(
        !a.finalizers()
            .iter()
            .any(|f| f == podmotion_api::names::finalizers::ATTACHMENT_CLEANUP),
        "the attachment finalizer is released, so uninstalling cannot leave it stuck"
    );
}

/// The token's verifier on a Job's pod template.
fn verifier_of(j: &Job) -> Option<String> {
    j.spec
        .as_ref()?
        .template
        .metadata
        .as_ref()?
        .annotations
        .as_ref()?
        .get(podmotion_operator::attachment::render::TOKEN_VERIFIER_ANNOTATION)
        .cloned()
}

/// The SHA-256 of the token in a credential Secret, as the agent checks it.
fn token_verifier_of(s: &Secret) -> String {
    let token = String::from_utf8(s.data.as_ref().unwrap()["token"].0.clone()).unwrap();
    podmotion_attach::jobenv::token_verifier(&token)
}

/// Agent Jobs are created suspended and resumed once their credential Secret exists
/// (in the attachment's namespace) with the token's verifier. A Job left suspended, its
/// Secret missing (the operator stopped between the two), gets a new token after a
/// restart: a Secret and a running Job that agree; the operator never reads Secrets to
/// find out.
#[tokio::test]
async fn a_job_left_suspended_without_its_secret_is_resumed_after_a_restart() {
    let Some((app, agents, op)) = setup("naa-creds", PodSecurity::Restricted).await else {
        return;
    };
    attached_web(&app, &agents).await;
    let jobs: Api<Job> = agents.api();
    let secrets: Api<Secret> = app.api();
    let sel = format!("{}={}", labels::TARGET_NAMESPACE, app.name);
    let resumed = |j: &Job| j.spec.as_ref().and_then(|s| s.suspend) == Some(false);
    let all = wait_list(&jobs, &sel, TIMEOUT, "every Job resumed", |js| {
        js.len() == 3 && js.iter().all(resumed)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    for j in &all {
        let s = secrets
            .get_opt(&j.name_any())
            .await
            .unwrap()
            .expect("its Secret");
        assert_eq!(
            verifier_of(j),
            Some(token_verifier_of(&s)),
            "{}",
            j.name_any()
        );
    }

    // The state a crash between creating a Job and resuming it leaves.
    op.stop().await;
    let first = &all[0];
    secrets
        .delete(&first.name_any(), &DeleteParams::default())
        .await
        .unwrap();
    jobs.patch(
        &first.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"suspend": true}})),
    )
    .await
    .unwrap();
    wait_for(&secrets, &first.name_any(), TIMEOUT, "Secret gone", |s| {
        s.is_none()
    })
    .await
    .unwrap();

    let op = Operator::start(&app.client, &agents.name, &app.name).await;
    // Resumed with a new token (or, as this Job already ran once and its template is
    // immutable, replaced by one that has it): the Secret and the running Job agree.
    let now = wait_for(
        &jobs,
        &first.name_any(),
        TIMEOUT,
        "Job running again",
        |j| j.is_some_and(|j| resumed(j) && j.metadata.deletion_timestamp.is_none()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .unwrap();
    let s = wait_for(&secrets, &first.name_any(), TIMEOUT, "its Secret", |s| {
        s.is_some()
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        verifier_of(&now),
        Some(token_verifier_of(&s)),
        "the Secret is in place, with the Job's token"
    );
    let left = jobs
        .list(&ListParams::default().labels(&sel))
        .await
        .unwrap();
    assert_eq!(left.items.len(), 3, "one Job per replica");
    op.stop().await;
}

#[tokio::test]
async fn scaling_an_attached_workload_to_zero_empties_its_targets() {
    let Some((app, agents, op)) = setup("naa-zero", PodSecurity::Restricted).await else {
        return;
    };
    attached_web(&app, &agents).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    wait_for(&naas, "web", TIMEOUT, "three targets in status", |a| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.targets.len() == 3)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));

    scale(&app, "web", 0).await;
    settled_pods(&app, "web", 0).await;
    jobs_follow(&agents, &app.name, &[], "no Job left").await;
    let a = wait_for(&naas, "web", TIMEOUT, "no target in status", |a| {
        a.and_then(|a| a.status.as_ref())
            .is_some_and(|s| s.total_targets == 0 && s.targets.is_empty())
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .unwrap();
    // Gone from the stored object, not merely defaulted when it is read back.
    let raw: Api<kube::api::DynamicObject> = Api::namespaced_with(
        app.client.clone(),
        &app.name,
        &kube::api::ApiResource::erase::<NodeAgentAttachment>(&()),
    );
    let stored = raw.get("web").await.unwrap();
    assert!(
        stored.data["status"].get("targets").is_none(),
        "status still lists targets: {}",
        stored.data["status"]
    );
    assert!(a.status.unwrap().skipped.is_empty());
    op.stop().await;
}

#[tokio::test]
async fn a_tenant_cannot_choose_what_the_privileged_agent_runs() {
    let Some(app) = TestNamespace::new("naa-tenant", PodSecurity::Restricted).await else {
        return;
    };
    ensure_crd(&app.client).await;
    // A tenant who may manage attachments in their own namespace, and nothing else.
    let user = format!("tenant-{}", app.name);
    podmotion_e2e::grant_user(
        &app,
        &user,
        json!([{"apiGroups": ["podmotion.io"], "resources": ["nodeagentattachments"], "verbs": ["get", "list", "watch", "create", "update", "delete"]}]),
    )
    .await
    .unwrap();
    let tenant = Api::<NodeAgentAttachment>::namespaced(
        podmotion_e2e::impersonating(&user).await.unwrap(),
        &app.name,
    );
    let exploits = [
        (
            json!({"agent": {"image": "evil.example/rootkit:1"}}),
            "agent.image is not accepted",
        ),
        (
            json!({"agent": {"criSocketPath": "/"}}),
            "agent.criSocketPath is not accepted",
        ),
        (
            json!({"agent": {"podAnnotations": {"container.apparmor.security.beta.kubernetes.io/agent": "unconfined"}}}),
            "agent.podAnnotations is not accepted",
        ),
        (
            json!({"agent": {"config": {"blob": "x".repeat(449)}}}),
            "448",
        ),
        (
            json!({"agent": {"config": {"line": "a\nb"}}}),
            "without control characters",
        ),
    ];
    for (i, (extra, want)) in exploits.into_iter().enumerate() {
        let a = attachment(&format!("exploit-{i}"), "web", extra.clone());
        match tenant.create(&PostParams::default(), &a).await {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{extra}: {}", e.message);
                assert!(e.message.contains(want), "{extra}: {}", e.message);
            }
            other => panic!("{extra} accepted: {other:?}"),
        }
    }
    // The same tenant may create an attachment that chooses only what it may choose.
    let fine = attachment(
        "fine",
        "web",
        json!({"agent": {"gid": 4242, "config": {"log-level": "debug"}}}),
    );
    tenant.create(&PostParams::default(), &fine).await.unwrap();
}
