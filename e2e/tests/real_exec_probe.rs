//! Exec application probes on the real nodes (issue 15): with
//! `migration.execProbes.enabled=true` the operator runs a PodMigration's exec probe in
//! the restored target pod through the API server's `pods/exec` (which enters the holder
//! container's namespaces, so the restored tree's network is there). A probe that exits
//! 0 commits the migration; one that exits 1 rolls it back, and the source serves on.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::testload::{
    POD_TIMEOUT, World, counter, counter_when_reachable, ended, node_of, pod_ip, restart_count,
};
use podmotion_e2e::{from_json, wait_for, wait_list};
use serde_json::json;

/// The testload binary in its image (a scratch image: nothing else is in it).
const TESTLOAD: &str = "/usr/local/bin/podmotion-testload";

/// A Cold PodMigration of `pod` to `node` whose probe runs `testload get ADDR` in the
/// restored container: it exits 0 only when a counter server answers at ADDR inside the
/// pod's network namespace.
fn migration(name: &str, pod: &str, node: &str, probe_addr: &str) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod, "targetNode": node, "mode": "Cold",
            "freezeBudgetMillis": 20000,
            "probe": {"exec": {"command": [TESTLOAD, "get", probe_addr]},
                "timeoutSeconds": 10, "failureThreshold": 1}}
    }))
}

/// A testload Deployment on the real nodes (installed with exec probes enabled). An
/// exec probe that exits 1 (`testload get 127.0.0.1:9`: nothing listens there) rolls the
/// migration back with the exit status in its message: the same source pod serves a
/// larger counter and no target pod is left. An exec probe that exits 0 (`testload get
/// 127.0.0.1:8080`: the restored server answers in the target pod's network namespace)
/// lets the migration succeed: the target pod on the other node serves the counter on.
#[tokio::test]
async fn exec_probes_run_in_the_restored_pod_and_decide_commit_or_rollback() {
    let Some(w) = World::new(
        "exec",
        "probed",
        16,
        &["--set", "migration.execProbes.enabled=true"],
    )
    .await
    else {
        return;
    };
    let (app, source) = (&w.app, &w.source);
    let pods: Api<Pod> = app.api();
    let target_node = w.target_node();
    let source_addr = format!("{}:8080", pod_ip(source));
    let before = counter(&source_addr);
    let pms: Api<PodMigration> = app.api();

    // Exit status 1: rolled back, the source serves on.
    let bad = migration(
        "exec-fails",
        &source.name_any(),
        &target_node,
        "127.0.0.1:9",
    );
    pms.create(&PostParams::default(), &bad).await.unwrap();
    let st = ended(&pms, "exec-fails").await;
    assert_ne!(st.phase, MigrationPhase::Succeeded, "{st:?}");
    assert_eq!(st.failure_reason.as_deref(), Some("ProbeFailed"), "{st:?}");
    let message = st.failure_message.clone().unwrap_or_default();
    assert!(
        message.contains("exit status 1") && message.contains("127.0.0.1:9"),
        "the exit status and the command's stderr: {message:?}"
    );
    let after_rollback = counter_when_reachable(&source_addr, "after the failing exec probe");
    assert!(
        after_rollback > before,
        "the source serves its own counter again: {before} then {after_rollback}"
    );
    wait_list(
        &pods,
        "",
        POD_TIMEOUT,
        "only the source pod, the rolled-back target gone",
        |ps| ps.len() == 1 && ps[0].uid() == source.uid(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        restart_count(&pods.get(&source.name_any()).await.unwrap()),
        0,
        "the source was not restarted"
    );

    // Exit status 0: committed, the target pod serves the counter on.
    let good = migration(
        "exec-passes",
        &source.name_any(),
        &target_node,
        "127.0.0.1:8080",
    );
    pms.create(&PostParams::default(), &good).await.unwrap();
    let st = ended(&pms, "exec-passes").await;
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("migration with a passing exec probe did not succeed: {st:?}");
    }
    let target_name = st.target_pod.clone().expect("status.targetPod");
    let target = pods.get(&target_name).await.unwrap();
    assert_eq!(node_of(&target), target_node);
    wait_list(
        &pods,
        "app=probed",
        POD_TIMEOUT,
        "only the target pod left",
        |ps| ps.len() == 1 && ps[0].name_any() == target_name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let after = counter(&format!("{}:8080", pod_ip(&target)));
    assert!(
        after > after_rollback,
        "counter went from {after_rollback} to {after}"
    );
}

/// With the chart's default (`migration.execProbes.enabled=false`: no pods/exec for the
/// operator), a PodMigration whose probe is an exec probe is refused before anything
/// freezes: `Migratable=False` with reason `ExecProbeDisabled` naming the value, the
/// migration stays `Pending`, no target pod is created and the source serves on.
#[tokio::test]
async fn an_exec_probe_is_refused_before_anything_freezes_while_exec_probes_are_off() {
    let Some(w) = World::new("noexec", "probed", 16, &[]).await else {
        return;
    };
    let (app, source) = (&w.app, &w.source);
    let target_node = w.target_node();
    let source_addr = format!("{}:8080", pod_ip(source));
    let before = counter(&source_addr);
    let pms: Api<PodMigration> = app.api();
    let pm = migration(
        "exec-off",
        &source.name_any(),
        &target_node,
        "127.0.0.1:8080",
    );
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let refused = |m: Option<&PodMigration>| {
        m.and_then(|m| m.status.as_ref()).is_some_and(|s| {
            s.conditions.iter().any(|c| {
                c.type_ == "Migratable" && c.status == "False" && c.reason == "ExecProbeDisabled"
            })
        })
    };
    let m = wait_for(&pms, "exec-off", POD_TIMEOUT, "Migratable=False", refused)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
        .expect("the PodMigration");
    let st = m.status.unwrap();
    assert_eq!(st.phase, MigrationPhase::Pending, "{st:?}");
    let c = st
        .conditions
        .iter()
        .find(|c| c.type_ == "Migratable")
        .unwrap();
    assert!(
        c.message.contains("migration.execProbes.enabled"),
        "{}",
        c.message
    );
    // Nothing froze and nothing was created: one pod, the source, serving on.
    let pods: Api<Pod> = app.api();
    let all = pods.list(&Default::default()).await.unwrap().items;
    assert_eq!(
        all.len(),
        1,
        "{:?}",
        all.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    assert_eq!(all[0].uid(), source.uid());
    assert_eq!(restart_count(&all[0]), 0);
    assert!(counter_when_reachable(&source_addr, "after the rollback") > before);
}
