//! A pod of two containers moves as one between the two real nodes, through the chart
//! installed from our images (issue 39, item 2): the testload server and a sidecar
//! that relays to it over localhost (`podmotion-testload forward`), as a second regular
//! container and as a native sidecar (an init container with `restartPolicy: Always`).
//! Both containers are frozen, dumped, moved and restored into their own containers of
//! the target pod; a rollback leaves both running on the source.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::bounds::{DEFAULTS_BOUND, assert_clients};
use podmotion_e2e::real::copies::Clients;
use podmotion_e2e::real::testload::{
    self, FORWARD_PORT, POD_TIMEOUT, PORT, World, ask, counter, counter_when_reachable, ended,
    node_of, pod_ip, restart_counts, source_serves_alone, with_forwarder,
};
use podmotion_e2e::{from_json, wait_list};
use serde_json::json;

/// The sidecar's address in pod `p`.
fn forwarder(p: &Pod) -> String {
    format!("{}:{FORWARD_PORT}", pod_ip(p))
}

/// The counter asked through the sidecar of `p` (relayed over the pod's localhost).
fn counter_via_sidecar(p: &Pod, what: &str) -> u64 {
    let a = ask(&forwarder(p), "get").unwrap_or_else(|e| panic!("{what}: via the sidecar: {e}"));
    a.parse()
        .unwrap_or_else(|e| panic!("{what}: via the sidecar: {a:?}: {e}"))
}

/// How many lines the sidecar of `p` relayed so far: its own state, in its memory only.
fn forwarded(p: &Pod, what: &str) -> u64 {
    let a = ask(&forwarder(p), "forwarded")
        .unwrap_or_else(|e| panic!("{what}: the sidecar's count: {e}"));
    a.parse()
        .unwrap_or_else(|e| panic!("{what}: the sidecar's count: {a:?}: {e}"))
}

/// Both containers of `p` (`app` and `forward`; a target pod also has the holder's
/// installer) never restarted.
fn never_restarted(p: &Pod, what: &str) {
    let counts: Vec<(String, i32)> = restart_counts(p)
        .into_iter()
        .filter(|(n, _)| n == "app" || n == "forward")
        .collect();
    assert_eq!(counts.len(), 2, "{what}: both containers: {counts:?}");
    assert!(
        counts.iter().all(|(_, n)| *n == 0),
        "{what}: a container restarted: {counts:?}"
    );
}

/// The pod's ReplicaSet: (name, uid).
fn replica_set(p: &Pod) -> (String, Option<String>) {
    p.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "ReplicaSet")
        .map(|o| (o.name.clone(), Some(o.uid.clone())))
        .unwrap_or_default()
}

/// The testload server plus a `forward` sidecar (`native`: a native sidecar) in one
/// Deployment `app` on a real node. (1) A Cold PodMigration whose probe cannot pass
/// rolls back: both containers serve on in the same source pod, unrestarted, the
/// counter and the sidecar's own count carrying on. (2) A PodMigration in `mode` moves
/// the pod to the other real node: the same ReplicaSet adopts the target, only it is
/// left, neither container restarted; the counter continues read directly, through the
/// sidecar and through the Service, the ballast's digest is the same, and the sidecar's
/// count is exactly what it was plus the one line relayed since (it was not restarted
/// empty). Prints downtime, counters and what the Service's clients saw.
async fn moves_with_its_sidecar(prefix: &str, native: bool, mode: &str) {
    let started = Instant::now();
    let app = prefix;
    let Some(w) = World::with_deployment(prefix, &[], |images| {
        with_forwarder(
            testload::deployment(app, &images.testload().unwrap(), 16),
            native,
        )
    })
    .await
    else {
        return;
    };
    let what = if native {
        "a native sidecar"
    } else {
        "a sidecar container"
    };
    let svc = w.service(app).await;
    let pods: Api<Pod> = w.app.api();
    let pms: Api<PodMigration> = w.app.api();
    let source = w.source.clone();
    let (from, to) = (node_of(&source), w.target_node());
    let rs = replica_set(&source);
    assert!(rs.1.is_some(), "{what}: the source has a ReplicaSet");
    never_restarted(&source, what);
    let digest = ask(&testload::addr(&source), "digest").unwrap();
    let direct = counter(&testload::addr(&source));
    let relayed = counter_via_sidecar(&source, what);
    assert!(relayed >= direct, "{what}: {direct} then {relayed}");
    let fwd_before = forwarded(&source, what);
    assert_eq!(fwd_before, 1, "{what}: the sidecar relayed one line");

    // (1) A probe that cannot pass (nothing listens on 9): the restored copies are
    // killed and both containers of the source, thawed, serve on.
    let failing: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "bad-probe"},
        "spec": {"podName": source.name_any(), "targetNode": to, "mode": "Cold",
            "freezeBudgetMillis": 20000,
            "probe": {"tcpSocket": {"port": 9}, "failureThreshold": 1, "timeoutSeconds": 1}}
    }));
    pms.create(&PostParams::default(), &failing).await.unwrap();
    let st = ended(&pms, "bad-probe").await;
    let rollback_what = format!("{what}: the rollback");
    assert_ne!(
        st.phase,
        MigrationPhase::Succeeded,
        "{rollback_what}: {st:?}"
    );
    assert_eq!(
        st.failure_reason.as_deref(),
        Some("ProbeFailed"),
        "{rollback_what}: {st:?}"
    );
    let after_rollback = source_serves_alone(&pods, app, &source, relayed, &rollback_what).await;
    let src_now = pods.get(&source.name_any()).await.unwrap();
    never_restarted(&src_now, &rollback_what);
    let relayed_rb = counter_via_sidecar(&src_now, &rollback_what);
    assert!(
        relayed_rb >= after_rollback,
        "{rollback_what}: through the sidecar {relayed_rb} < {after_rollback}"
    );
    let fwd_rb = forwarded(&src_now, &rollback_what);
    assert_eq!(
        fwd_rb,
        fwd_before + 1,
        "{rollback_what}: the sidecar's own count carries on"
    );
    eprintln!(
        "{rollback_what}: {:?} ({}), counter {relayed} before, {after_rollback} after; the \
         sidecar relayed {fwd_before} then {fwd_rb}",
        st.phase,
        st.failure_reason.as_deref().unwrap_or("")
    );

    // (2) The move.
    let name = "move";
    let mut spec = json!({"podName": source.name_any(), "targetNode": to, "mode": mode,
        "freezeBudgetMillis": 20000,
        "probe": {"tcpSocket": {"port": PORT}, "failureThreshold": 3, "timeoutSeconds": 1}});
    if mode == "PreCopy" {
        spec["preCopy"] = json!({"maxRounds": 3});
    }
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": spec
    }));
    let before = counter(&testload::addr(&src_now));
    let clients = Clients::start(&svc)
        .watching(w.app.client.clone(), &w.app.name, app, name)
        .serving()
        .await;
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let st = ended(&pms, name).await;
    let move_what = format!("{what}: {mode} {from} → {to}");
    if st.phase != MigrationPhase::Succeeded {
        w.app.dump();
        panic!("{move_what}: {st:?}");
    }
    let target_name = st.target_pod.clone().expect("status.targetPod");
    wait_list(
        &pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        &format!("{move_what}: only the target pod left"),
        |ps| ps.len() == 1 && ps[0].name_any() == target_name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    assert_clients(clients, &st, DEFAULTS_BOUND, &move_what).await;
    let target = pods.get(&target_name).await.unwrap();
    assert_eq!(node_of(&target), to, "{move_what}");
    assert_eq!(
        replica_set(&target),
        rs,
        "{move_what}: adopted by the same ReplicaSet"
    );
    never_restarted(&target, &move_what);
    let after = counter_when_reachable(&testload::addr(&target), &move_what);
    assert!(
        after > before,
        "{move_what}: the counter went from {before} to {after}"
    );
    assert_eq!(
        ask(&testload::addr(&target), "digest").unwrap(),
        digest,
        "{move_what}: the ballast"
    );
    let relayed_after = counter_via_sidecar(&target, &move_what);
    assert!(
        relayed_after >= after,
        "{move_what}: through the sidecar {relayed_after} < {after}"
    );
    let fwd_after = forwarded(&target, &move_what);
    assert_eq!(
        fwd_after,
        fwd_rb + 1,
        "{move_what}: the sidecar's own count carries on (a restarted one would say 1)"
    );
    let via_service = counter_when_reachable(&svc, &move_what);
    assert!(via_service >= after, "{move_what}: {via_service} < {after}");
    eprintln!(
        "{move_what}: {:?}, downtime {} ms, {} bytes moved; counter {before} before, \
         {after} after (through the sidecar {relayed_after}, the Service {via_service}); \
         the sidecar relayed {fwd_rb} then {fwd_after}; test ran {} s",
        st.phase,
        st.downtime_millis.unwrap_or(0),
        st.progress.as_ref().map_or(0, |p| p.bytes_sent),
        started.elapsed().as_secs()
    );
}

/// A second regular container: Cold.
#[tokio::test]
async fn a_pod_with_a_sidecar_container_moves_as_one_and_a_rollback_keeps_both() {
    moves_with_its_sidecar("sidecar", false, "Cold").await;
}

/// A native sidecar (init container, `restartPolicy: Always`): PreCopy.
#[tokio::test]
async fn a_pod_with_a_native_sidecar_moves_as_one_and_a_rollback_keeps_both() {
    moves_with_its_sidecar("native", true, "PreCopy").await;
}
