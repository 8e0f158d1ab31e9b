//! The chaos run's objects: the namespaces, workloads, attachments and pools it sets
//! up, the PodMigrations its churn creates, and the negative control's plant.

use anyhow::Context as _;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use podmotion_api::names::labels;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use serde_json::json;

use super::state::{ATTACHED, LIVE, MIG_NODES, Names, POOLS};
use crate::{TIMEOUT, from_json, pod_running_ready, restricted_container, wait_list};

pub(crate) fn deployment(name: &str, replicas: i32, nodes: Option<&[&str]>) -> Deployment {
    let mut container = restricted_container("app");
    container["ports"] = json!([{"containerPort": 8080, "name": "http"}]);
    let placement = match nodes {
        Some(nodes) => json!({"nodeSelector": {"type": "kwok"}, "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}}}),
        None => json!({"nodeSelector": {"type": "kwok"}, "tolerations": [{"operator": "Exists"}]}),
    };
    let mut spec = json!({"containers": [container]});
    for (k, v) in placement.as_object().unwrap() {
        spec[k] = v.clone();
    }
    from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}
    }))
}

pub(crate) fn attachment(name: &str) -> NodeAgentAttachment {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": name},
        "spec": {"workloadRef": {"kind": "Deployment", "name": name}, "mode": "Intercept"}
    }))
}

pub(crate) fn pool(app: &str, name: &str, sessions: i32) -> RunnerPool {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
        "metadata": {"name": name},
        "spec": {
            "image": "registry.example/compass/runner@sha256:4f1c3a2b5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708",
            "sessionsPerNode": sessions,
            "session": {"memoryMiB": 512, "milliCPU": 250},
            "server": {"serviceName": "compass-server", "port": 8443},
            "priorityClass": {"name": format!("{app}-{name}"), "value": 100000},
        }
    }))
}

/// A PodMigration of `pod`: a dry run, or a real one whose agents are unreachable
/// (it prepares a target pod and a transfer key, fails at the agent and rolls back).
pub(crate) fn migration(name: &str, pod: &str, dry_run: bool) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod, "dryRun": dry_run, "progressTimeoutSeconds": 10}
    }))
}

async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let ns: Namespace = from_json(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {
            "podmotion.io/e2e": "chaos",
            "pod-security.kubernetes.io/enforce": "privileged",
        }}
    }));
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

pub(crate) async fn setup(client: &Client, n: &Names, live: bool) -> anyhow::Result<Vec<Pod>> {
    crate::operator::install_crds(client).await;
    create_namespace(client, &n.sys).await?;
    create_namespace(client, &n.app).await?;
    let pp = PostParams::default();
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443, "targetPort": 9443}]}
    }));
    Api::<Service>::namespaced(client.clone(), &n.app)
        .create(&pp, &svc)
        .await?;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), &n.app);
    for d in ATTACHED {
        deps.create(&pp, &deployment(d, 2, None)).await?;
        Api::<NodeAgentAttachment>::namespaced(client.clone(), &n.app)
            .create(&pp, &attachment(d))
            .await?;
    }
    deps.create(&pp, &deployment("mig", 2, Some(&MIG_NODES)))
        .await?;
    if live {
        deps.create(&pp, &deployment(LIVE, 1, Some(&MIG_NODES)))
            .await?;
    }
    for p in POOLS {
        Api::<RunnerPool>::namespaced(client.clone(), &n.app)
            .create(&pp, &pool(&n.app, p, 2))
            .await?;
    }
    wait_list(
        &Api::<Pod>::namespaced(client.clone(), &n.app),
        "app=mig",
        TIMEOUT,
        "the migrated workload's 2 pods Running",
        |ps| ps.len() == 2 && ps.iter().all(pod_running_ready),
    )
    .await
}

/// The negative control: a DaemonSet labelled as a second child of `pool-a` (and so an
/// orphan the operator does not know of). The sampled check and the final convergence
/// must both report it.
pub(crate) async fn plant_violation(client: &Client, n: &Names) -> anyhow::Result<()> {
    let pool = Api::<RunnerPool>::namespaced(client.clone(), &n.app)
        .get(POOLS[0])
        .await?;
    let ds: DaemonSet = from_json(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "planted-second-daemonset", "labels": {
            labels::OWNER_KIND: "RunnerPool",
            labels::OWNER_UID: pool.uid().unwrap_or_default(),
        }},
        "spec": {
            "selector": {"matchLabels": {"app": "planted"}},
            "template": {"metadata": {"labels": {"app": "planted"}}, "spec": {
                "nodeSelector": {"podmotion.io/chaos-nowhere": "true"},
                "containers": [restricted_container("app")]
            }}
        }
    }));
    Api::<DaemonSet>::namespaced(client.clone(), &n.app)
        .create(&PostParams::default(), &ds)
        .await?;
    eprintln!(
        "[chaos] planted a second DaemonSet of {} (negative control)",
        POOLS[0]
    );
    Ok(())
}

pub(crate) fn write_proxy_kubeconfig(
    path: &std::path::Path,
    addr: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let cfg = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: chaos\n  cluster:\n    server: http://{addr}\nusers:\n- name: chaos\n  user: {{}}\ncontexts:\n- name: chaos\n  context:\n    cluster: chaos\n    user: chaos\ncurrent-context: chaos\n"
    );
    std::fs::write(path, cfg)?;
    Ok(())
}
