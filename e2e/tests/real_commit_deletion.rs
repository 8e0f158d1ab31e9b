//! Deleting a PodMigration in `Committing`, on the real nodes, through the chart
//! installed from our images (issue 16, "Abort by deletion in every phase, end to end
//! with the real agents": the phase `real_abort.rs` cannot stop in). Past the probe the
//! source is given up, so a deletion there must roll forward to the commit: the target
//! serves, adopted by its ReplicaSet, the source is gone — never both, never neither.
//!
//! `Committing` lasts until the workload's controller adopts the handed-over target pod,
//! normally a few milliseconds. To delete the migration there, the test stops the
//! kube-controller-manager process (SIGSTOP; the local control plane runs it without
//! leader election, so a pause costs nothing but time) before the migration starts: the
//! ReplicaSet controller cannot adopt, the migration holds in `Committing` with the
//! target handed over. The PodMigration is deleted there; while the controller manager
//! stays stopped the deletion must not be completed and nothing may be rolled back (the
//! restored copy runs, the source does not). Then the controller manager continues
//! (SIGCONT; a guard does it if the test fails, and a detached `sleep; kill -CONT` if
//! the test process dies), the ReplicaSet adopts the target, the migration ends
//! `Succeeded` (its Event says so: the object goes in the same breath) and its
//! finalizer is released; no Event says it rolled back or aborted. Sampled every 200 ms from the start: never
//! two running copies of the state.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both. It pauses the cluster's controller
//! manager, so it has a test binary of its own (cargo runs binaries one at a time).

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_api::names::reasons;
use podmotion_e2e::real::copies::sample;
use podmotion_e2e::real::output_text;
use podmotion_e2e::real::procs::workload_processes;
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter, node_of, restart_count,
};
use podmotion_e2e::{from_json, pod_running_ready, run_dir, wait_list};
use serde_json::json;

const APP: &str = "committed";
const MIGRATION: &str = "commit-deleted";
/// How long the deleted migration is watched, held, before the controller manager
/// continues.
const HELD: Duration = Duration::from_secs(5);

/// The local control plane's kube-controller-manager, stopped (SIGSTOP) until dropped.
struct PausedControllerManager {
    pid: u32,
}

impl PausedControllerManager {
    fn pause() -> PausedControllerManager {
        let file = run_dir().join("pids/kube-controller-manager.pid");
        let pid: u32 = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
            .trim()
            .parse()
            .expect("a pid");
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        assert_eq!(comm.trim(), "kube-controller", "pid {pid} of {file:?}");
        // If this process dies before the guard is dropped, the controller manager
        // continues anyway.
        std::process::Command::new("setsid")
            .args(["-f", "sh", "-c", &format!("sleep 180; kill -CONT {pid}")])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("setsid the backstop");
        signal("-STOP", pid);
        PausedControllerManager { pid }
    }
}

impl Drop for PausedControllerManager {
    fn drop(&mut self) {
        signal("-CONT", self.pid);
    }
}

fn signal(sig: &str, pid: u32) {
    let out = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .output()
        .expect("kill");
    assert!(
        out.status.success(),
        "kill {sig} {pid}: {}",
        output_text(&out)
    );
}

#[tokio::test]
async fn deleting_a_migration_in_committing_rolls_forward_to_one_adopted_copy() {
    let Some(w) = World::new("commit", APP, 16, &[]).await else {
        return;
    };
    let (app, source) = (&w.app, &w.source);
    let pods: Api<Pod> = app.api();
    let source_uid = source.uid().unwrap();
    let target_node = w.target_node();
    let before = counter(&addr(source));
    let found = workload_processes(std::slice::from_ref(&source_uid));
    assert_eq!(found.len(), 1, "one workload process in the source pod");
    let source_proc = found[0].clone();

    let paused = PausedControllerManager::pause();
    let pms: Api<PodMigration> = app.api();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": MIGRATION},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": 120000,
            "probe": {"tcpSocket": {"port": testload::PORT}}}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();

    let mut paused = Some(paused);
    let mut deleted_at: Option<Instant> = None;
    let mut max_copies = 0usize;
    let mut samples = 0usize;
    let mut last = PodMigrationStatus::default();
    let start = Instant::now();
    loop {
        let m = pms.get_opt(MIGRATION).await.unwrap();
        let Some(m) = m else {
            break;
        };
        let st = m.status.clone().unwrap_or_default();
        let (procs, copies, target_uid) =
            sample(&pods, &source_proc, st.target_pod.as_deref()).await;
        samples += 1;
        max_copies = max_copies.max(copies.len());
        if copies.len() > 1 {
            app.dump();
            panic!(
                "two copies run at sample {samples} (phase {:?}): {copies:?}",
                st.phase
            );
        }
        match deleted_at {
            None if st.phase == MigrationPhase::Committing => {
                pms.delete(MIGRATION, &DeleteParams::default())
                    .await
                    .unwrap();
                deleted_at = Some(Instant::now());
                eprintln!(
                    "sample {samples}: Committing ({:?}); deleted the migration",
                    st.conditions
                        .iter()
                        .map(|c| c.message.as_str())
                        .collect::<Vec<_>>()
                );
            }
            None => {
                assert!(
                    !st.phase.is_terminal(),
                    "the migration ended before it could be deleted in Committing (the controller manager stopped): {st:?}"
                );
            }
            Some(at) if paused.is_some() => {
                // Held: the deletion waits for the commit; nothing is rolled back.
                assert!(
                    m.metadata.deletion_timestamp.is_some(),
                    "the deletion is not recorded: {m:?}"
                );
                assert_eq!(
                    st.phase,
                    MigrationPhase::Committing,
                    "a deletion in Committing left it before the commit: {st:?}"
                );
                assert!(
                    copies
                        .iter()
                        .all(|c| Some(c.pod_uid.as_str()) == target_uid.as_deref())
                        && copies.len() == 1,
                    "while held in Committing, the restored copy (only) runs: {procs:?}"
                );
                if at.elapsed() >= HELD {
                    eprintln!(
                        "sample {samples}: still Committing {} ms after the deletion; the controller manager continues",
                        at.elapsed().as_millis()
                    );
                    drop(paused.take());
                }
            }
            Some(_) => {}
        }
        last = st;
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "the migration was not released in {MIGRATION_TIMEOUT:?}: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(paused);
    eprintln!(
        "released; last seen {:?} ({:?}: {:?}); {samples} samples, max running copies {max_copies}",
        last.phase, last.failure_reason, last.failure_message
    );
    assert!(
        deleted_at.is_some(),
        "never deleted in Committing: {last:?}"
    );
    // The status that said so went with the object (the end and the release are one
    // reconcile apart): its Events say how it ended.
    let events = app
        .api::<Event>()
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=PodMigration,involvedObject.name={MIGRATION}"
        )))
        .await
        .unwrap()
        .items;
    let reasons_seen: Vec<String> = events.iter().filter_map(|e| e.reason.clone()).collect();
    eprintln!("the migration's Events: {reasons_seen:?}");
    assert!(
        reasons_seen.iter().any(|r| r == reasons::SUCCEEDED),
        "no {} Event: {reasons_seen:?}",
        reasons::SUCCEEDED
    );
    for r in [reasons::ROLLED_BACK, reasons::ABORTED] {
        assert!(
            !reasons_seen.iter().any(|s| s == r),
            "{r}: {reasons_seen:?}"
        );
    }

    // The target, adopted by the ReplicaSet, is the only pod of the app; never restarted,
    // the counter carried over; the source is gone and one workload process runs.
    let target_name = last.target_pod.clone().expect("status.targetPod");
    let left = wait_list(
        &pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "only the target pod, Ready and adopted",
        |ps| {
            ps.len() == 1
                && ps[0].name_any() == target_name
                && pod_running_ready(&ps[0])
                && ps[0]
                    .owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.kind == "ReplicaSet")
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let target = &left[0];
    assert_eq!(node_of(target), target_node);
    assert_eq!(restart_count(target), 0);
    let rs_name = target
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .unwrap()
        .name
        .clone();
    let rs = app.api::<ReplicaSet>().get(&rs_name).await.unwrap();
    assert_eq!(rs.spec.replicas, Some(1));
    let after = counter(&addr(target));
    assert!(after > before, "the counter went from {before} to {after}");
    let procs = workload_processes(&[target.uid().unwrap(), source_uid.clone()]);
    let running: Vec<_> = procs.iter().filter(|p| p.runs()).collect();
    assert_eq!(running.len(), 1, "{procs:?}");
    assert_eq!(running[0].pod_uid, target.uid().unwrap(), "{procs:?}");
    // Nothing of the migration is left in the app's namespace.
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(
        all.len(),
        1,
        "{:?}",
        all.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
}
