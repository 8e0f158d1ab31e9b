//! A migration with the chart's NetworkPolicies enforced (issue 45: "the chart's
//! NetworkPolicies are never enforced during a migration"). kube-router's policy
//! controller runs on the real nodes (hack/cluster.sh netpol-up; hack/test.sh runs this
//! test, `#[ignore]`d in the workspace run, right after it). The chart is installed with
//! its defaults — the operator's and the agents' policies on — and:
//!
//! * the policies are there and kube-router programmed them for the operator and every
//!   agent pod;
//! * they are enforced on the agents: a pod of no PodMotion component cannot open the
//!   agents' gRPC port, while it does reach the workload (application traffic is not
//!   policed here), so the refusal is the policy's;
//! * under them a Cold migration of a testload pod to the other real node succeeds:
//!   the operator reaches both agents, the agents each other, the probe the target; the
//!   restored copy serves the counter on, its ballast the same, the ReplicaSet owns it.
//!
//! Needs root, the cluster with real nodes, kube-router running and the images.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::entrypoint;
use podmotion_e2e::real::netpol::{
    expect_blocked, expect_reaches, require_enforcement, testload_pod, wait_programmed,
};
use podmotion_e2e::real::testload::{
    self, POD_TIMEOUT, World, addr, ask, counter, ended, moved_copy_continues, node_of, ready_pod,
};
use podmotion_e2e::{from_json, pod_running_ready, wait_list};
use serde_json::json;

const APP: &str = "guarded";
/// The port the probe pod serves (it only needs to be Ready).
const PROBE_PORT: u16 = 8081;

/// The policies of `namespace`'s release objects, by name; at least one.
async fn policies(client: &kube::Client, namespace: &str) -> Vec<String> {
    let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), namespace);
    let names: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert!(
        !names.is_empty(),
        "the chart's defaults render NetworkPolicies in {namespace}: none found"
    );
    names
}

/// A container port named `name` of pod `p`.
fn named_port(p: &Pod, name: &str) -> i32 {
    p.spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|port| port.name.as_deref() == Some(name))
        .map(|port| port.container_port)
        .unwrap_or_else(|| panic!("{}: no container port {name}", p.name_any()))
}

#[tokio::test]
#[ignore = "needs kube-router: hack/test.sh runs it after `hack/cluster.sh netpol-up`"]
async fn a_migration_succeeds_with_the_charts_network_policies_enforced() {
    let Some(w) = World::new("npmig", APP, 16, &[]).await else {
        return;
    };
    require_enforcement();
    let (app, op, source) = (&w.app, &w.op, &w.source);
    let agents_ns = w.agents();

    // The chart's policies, programmed for the operator and every agent.
    let op_policies = policies(&op.client, &op.name).await;
    let agent_policies = policies(&op.client, &agents_ns).await;
    eprintln!(
        "policies: {op_policies:?} in {}, {agent_policies:?} in {agents_ns}",
        op.name
    );
    let op_pods: Api<Pod> = op.api();
    for p in op_pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
        .await
        .unwrap()
    {
        wait_programmed(&op.name, &p.name_any()).await;
    }
    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents_ns);
    let agents = agent_pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=migration-agent"))
        .await
        .unwrap()
        .items;
    assert_eq!(agents.len(), w.nodes.len(), "one agent per real node");
    for a in &agents {
        wait_programmed(&agents_ns, &a.name_any()).await;
    }

    // Enforced on the agents: a pod of no PodMotion component reaches the workload but
    // not an agent's gRPC port.
    let testload_image = w.images.testload().unwrap();
    let binary = entrypoint(&testload_image).unwrap();
    let pods: Api<Pod> = app.api();
    pods.create(
        &PostParams::default(),
        &from_json(testload_pod(
            "outsider",
            &testload_image,
            &node_of(source),
            PROBE_PORT,
            json!({"app": "outsider"}),
        )),
    )
    .await
    .unwrap();
    ready_pod(&pods, "outsider").await;
    expect_reaches(
        &app.name,
        "outsider",
        &binary,
        &addr(source),
        "the workload",
    )
    .await;
    for a in &agents {
        let ip = a.status.as_ref().and_then(|s| s.pod_ip.clone()).unwrap();
        let grpc = format!("{ip}:{}", named_port(a, "grpc"));
        expect_blocked(
            &app.name,
            "outsider",
            &binary,
            &grpc,
            &format!("the gRPC port of agent {}", a.name_any()),
        )
        .await;
    }

    // A Cold migration under those policies.
    let before = counter(&addr(source));
    let digest = ask(&addr(source), "digest").unwrap();
    let target_node = w.target_node();
    let pms: Api<PodMigration> = app.api();
    pms.create(
        &PostParams::default(),
        &from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "guarded-move"},
            "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
                "freezeBudgetMillis": 20000,
                "probe": {"tcpSocket": {"port": testload::PORT}}}
        })),
    )
    .await
    .unwrap();
    let st = ended(&pms, "guarded-move").await;
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("the migration under the chart's NetworkPolicies ended {st:?}");
    }
    let target = st.target_pod.clone().expect("status.targetPod");
    let moved = wait_list(
        &pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "only the target pod, Ready",
        |ps| ps.len() == 1 && ps[0].name_any() == target && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    assert_eq!(node_of(&moved), target_node);
    assert!(
        moved
            .owner_references()
            .iter()
            .any(|o| o.kind == "ReplicaSet" && o.controller == Some(true)),
        "the ReplicaSet owns the target: {:?}",
        moved.owner_references()
    );
    let after = moved_copy_continues(&moved, before, &digest);
    eprintln!(
        "Cold under the chart's NetworkPolicies: downtime {:?} ms, counter {before} -> {after}",
        st.downtime_millis
    );
}
