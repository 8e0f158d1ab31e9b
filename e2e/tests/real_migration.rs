//! PodMigration of a real container between the two real nodes, through the chart
//! installed from our images (issue 15): kubelet and containerd run the source pod on one
//! node; the operator, the agents and the brokers the chart installed checkpoint it there,
//! restore it into the holder container of a target pod on the other node, and hand the
//! target pod to the ReplicaSet.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::{
    Images, REAL_NODE_TAINT, helm_install, kubectl, output_text, real_nodes,
};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_for, wait_list,
};
use serde_json::json;

const POD_TIMEOUT: Duration = Duration::from_secs(240);
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);

/// One line to the testload server at `addr` on a new connection, and its answer.
fn ask(addr: &str, line: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    Ok(answer.trim_end().to_owned())
}

fn counter(addr: &str) -> u64 {
    let a = ask(addr, "get").unwrap_or_else(|e| panic!("get from {addr}: {e}"));
    a.parse()
        .unwrap_or_else(|e| panic!("counter from {addr}: {a:?}: {e}"))
}

/// Host PIDs of the node agents the chart started (the agent binary serving gRPC).
fn agent_pids() -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.starts_with("/usr/local/bin/podmotion-agent\0") && cmd.contains("--checkpoints-root")
        {
            out.push(pid);
        }
    }
    out
}

/// Files under an agent's checkpoint tmpfs.
fn checkpoint_files(agent_pid: u32) -> Vec<String> {
    let root = format!("/proc/{agent_pid}/root/run/podmotion/checkpoints");
    let mut out = vec![];
    let mut stack = vec![std::path::PathBuf::from(&root)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// The status of PodMigration `name` once its phase is final.
async fn ended(pms: &Api<PodMigration>, name: &str) -> PodMigrationStatus {
    let m = wait_for(
        pms,
        name,
        MIGRATION_TIMEOUT,
        "the PodMigration to end",
        |m| {
            m.and_then(|m| m.status.as_ref()).is_some_and(|s| {
                matches!(
                    s.phase,
                    MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Aborted
                )
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    m.and_then(|m| m.status).expect("status")
}

/// Restarts of the pod's first container.
fn restart_count(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map(|c| c.restart_count)
        .expect("container status")
}

fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// A testload Deployment (1 replica, a readiness probe, behind a Service) runs on a real
/// node. A PodMigration whose probe cannot pass rolls back: the source serves on, its
/// held connection too, and the target pod is gone. Then a PodMigration moves it to the
/// other real node (Cold). The ReplicaSet owns the
/// target pod and still has one replica, the source pod is gone, the counter continues
/// (read through a new connection and through the Service), the client's established
/// connection ended with a FIN (the pod address cannot move between these nodes), the
/// status carries downtime, bytes moved and the network outcome, the container's log
/// continues in the target pod's log, and no checkpoint image is left on either node.
#[tokio::test]
async fn a_real_container_moves_to_the_other_real_node_and_is_adopted() {
    let Some(op) = TestNamespace::new("mig-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // The workload runs as uid 0: see docs/migration-controller.md, "Container user".
    let Some(app) = TestNamespace::new("mig-app", PodSecurity::Baseline).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let release = format!("pm{}", random_suffix());
    let agents = format!("{}-agents", op.name);
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-migration",
        &[],
    );
    let ds: Api<DaemonSet> = Api::namespaced(op.client.clone(), &agents);
    let list = ds.list(&ListParams::default()).await.unwrap();
    let st = list.items[0].status.clone().unwrap();
    assert_eq!(st.number_ready, nodes.len() as i32, "agents: {st:?}");

    // The workloads: on the real nodes, any of them.
    let testload = images.testload().unwrap();
    let workload = |name: &str, mib: &str| -> Deployment {
        from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "nodeSelector": {"type": "real"},
                "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                "enableServiceLinks": false,
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "app", "image": testload,
                    "args": ["serve", "8080", mib],
                    "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2}}]}}}
        }))
    };
    for (name, mib) in [("mover", "16"), ("pre", "64")] {
        app.api::<Deployment>()
            .create(&PostParams::default(), &workload(name, mib))
            .await
            .unwrap();
    }
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "mover"},
        "spec": {"selector": {"app": "mover"}, "ports": [{"port": 8080}]}
    }));
    let svc = app
        .api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let svc_addr = format!("{}:8080", svc.spec.unwrap().cluster_ip.unwrap());
    let pods: Api<Pod> = app.api();
    let ready = wait_list(&pods, "app=mover", POD_TIMEOUT, "the replica Ready", |ps| {
        ps.len() == 1 && pod_running_ready(&ps[0])
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let source = ready[0].clone();
    let source_node = node_of(&source);
    let target_node = nodes.iter().find(|n| **n != source_node).unwrap().clone();
    let source_addr = format!("{}:8080", pod_ip(&source));

    // A client holds an established connection and has seen the counter.
    let mut held = TcpStream::connect(&source_addr).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    writeln!(held, "get").unwrap();
    let mut line = String::new();
    let mut held_reader = BufReader::new(held.try_clone().unwrap());
    held_reader.read_line(&mut line).unwrap();
    let before: u64 = line.trim().parse().unwrap();
    assert!(before > 0, "the counter runs");

    let pms: Api<PodMigration> = app.api();

    // A probe that cannot pass (nothing listens on 9): the restored copy is killed, the
    // migration rolls back, and the source, thawed, serves the same counter, larger.
    let failing: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "bad-probe"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": 20000,
            "probe": {"tcpSocket": {"port": 9}, "failureThreshold": 1, "timeoutSeconds": 1}}
    }));
    pms.create(&PostParams::default(), &failing).await.unwrap();
    let st = ended(&pms, "bad-probe").await;
    assert_ne!(st.phase, MigrationPhase::Succeeded, "{st:?}");
    assert_eq!(st.failure_reason.as_deref(), Some("ProbeFailed"), "{st:?}");
    let after_rollback = counter(&source_addr);
    assert!(
        after_rollback > before,
        "the source serves its own counter again: {before} then {after_rollback}"
    );
    wait_list(
        &pods,
        "app=mover",
        POD_TIMEOUT,
        "only the source pod, never restarted",
        |ps| ps.len() == 1 && ps[0].uid() == source.uid(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    // The rolled-back target pod goes (it is being deleted when the phase is final).
    wait_list(
        &pods,
        "",
        POD_TIMEOUT,
        "the rolled-back target pod gone",
        |ps| {
            !ps.iter().any(|p| {
                p.name_any()
                    .starts_with(&format!("{}-pm-", source.name_any()))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let src_now = pods.get(&source.name_any()).await.unwrap();
    assert_eq!(restart_count(&src_now), 0, "the source was not restarted");
    // The held connection lost nothing: it still answers, with a larger counter.
    writeln!(held, "get").unwrap();
    line.clear();
    held_reader.read_line(&mut line).unwrap();
    let held_after: u64 = line.trim().parse().unwrap();
    assert!(
        held_after >= after_rollback,
        "{held_after} < {after_rollback}"
    );
    for pid in agent_pids() {
        let left = checkpoint_files(pid);
        assert!(
            left.is_empty(),
            "agent {pid} keeps checkpoint files after the rollback: {left:?}"
        );
    }

    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-mover"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": 20000, "probe": {"tcpSocket": {"port": 8080}}}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let st = ended(&pms, "move-mover").await;
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("migration failed: {st:?}");
    }

    // The target pod: on the target node, owned by the ReplicaSet, the only replica.
    let target_name = st.target_pod.clone().expect("status.targetPod");
    let target = pods.get(&target_name).await.unwrap();
    assert_eq!(node_of(&target), target_node);
    let owner = target
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .cloned()
        .expect("the target pod has a controller");
    assert_eq!(owner.kind, "ReplicaSet");
    let rs: Api<ReplicaSet> = app.api();
    let rs = rs.get(&owner.name).await.unwrap();
    assert_eq!(rs.spec.replicas, Some(1));
    wait_list(
        &pods,
        "app=mover",
        POD_TIMEOUT,
        "only the target pod left",
        |ps| ps.len() == 1 && ps[0].name_any() == target_name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    // Still the same container: never restarted, running the source's image.
    assert_eq!(restart_count(&target), 0);
    assert_eq!(
        target.spec.as_ref().unwrap().containers[0].image.as_deref(),
        Some(testload.as_str())
    );

    // The counter continued: larger than before the freeze, through a new connection to
    // the target and through the Service.
    let target_addr = format!("{}:8080", pod_ip(&target));
    let after = counter(&target_addr);
    assert!(after > before, "counter went from {before} to {after}");
    let via_service = counter(&svc_addr);
    assert!(
        via_service >= after,
        "through the Service: {via_service} < {after}"
    );

    // The held connection: the address did not move, so it ended cleanly (FIN: EOF,
    // not a reset).
    let mut rest = vec![];
    match held_reader.read_to_end(&mut rest) {
        Ok(_) => {}
        Err(e) => panic!("the held connection was not closed cleanly: {e}"),
    }
    drop(held);

    let net = st.network.clone().expect("status.network");
    assert!(net.listeners_restored >= 1, "{net:?}");
    assert_eq!(net.connections_reset, 0, "{net:?}");
    assert!(
        net.connections_closed + net.connections_preserved >= 1,
        "the held connection is accounted for: {net:?}"
    );
    assert!(st.downtime_millis.unwrap_or(0) > 0, "{st:?}");
    assert!(
        st.progress.as_ref().map(|p| p.bytes_sent).unwrap_or(0) > 0,
        "{st:?}"
    );

    // No checkpoint image is left on either node.
    let agents_pids = agent_pids();
    assert!(agents_pids.len() >= 2, "agents found: {agents_pids:?}");
    for pid in agents_pids {
        let left = checkpoint_files(pid);
        assert!(
            left.is_empty(),
            "agent {pid} keeps checkpoint files: {left:?}"
        );
    }

    // `kubectl logs` of the adopted pod works (the container's own log).
    let out = kubectl(&["-n", &app.name, "logs", &target_name]);
    assert!(out.status.success(), "kubectl logs: {}", output_text(&out));

    // PreCopy, 64 MiB of state: rounds while it runs, then the final freeze.
    let pre = wait_list(
        &pods,
        "app=pre",
        POD_TIMEOUT,
        "the pre replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    let pre_target = nodes.iter().find(|n| **n != node_of(&pre)).unwrap().clone();
    let pre_before = counter(&format!("{}:8080", pod_ip(&pre)));
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-pre"},
        "spec": {"podName": pre.name_any(), "targetNode": pre_target, "mode": "PreCopy",
            "freezeBudgetMillis": 20000, "preCopy": {"maxRounds": 3},
            "probe": {"tcpSocket": {"port": 8080}}}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let st = ended(&pms, "move-pre").await;
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("PreCopy migration did not succeed: {st:?}");
    }
    let moved = pods.get(st.target_pod.as_deref().unwrap()).await.unwrap();
    assert_eq!(node_of(&moved), pre_target);
    let pre_after = counter(&format!("{}:8080", pod_ip(&moved)));
    assert!(pre_after > pre_before, "{pre_before} then {pre_after}");
    assert!(
        st.progress.as_ref().map(|p| p.bytes_sent).unwrap_or(0) > 64 << 20,
        "the 64 MiB ballast moved: {st:?}"
    );
}
