//! Abort by deletion in every phase, end to end with the real agents on the real nodes,
//! through the chart installed from our images (issue 16): a PodMigration of a testload
//! pod is deleted while it is Pending, Preparing, Checkpointing (during a pre-copy
//! round, and at the final dump), Restoring with a probe that keeps failing, and
//! Restoring with a probe that passes. After each deletion the PodMigration goes (its
//! finalizer is released) and exactly one copy of the workload serves the counter it
//! had, larger: the source (the same pod, never restarted) or, where the restore fence
//! rolled the deletion forward, the committed target (adopted by the ReplicaSet) —
//! never neither (a fresh replica would start its counter over), never both (one pod of
//! the app, and no target pod left beside it). Transferring and a target agent killed
//! while restoring are covered by real_migration.rs's interrupted-migration test.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter, node_of, restart_count,
    source_serves_alone, target_pods_of,
};
use podmotion_e2e::{from_json, pod_running_ready, wait_for, wait_list};
use serde_json::{Value, json};

const APP: &str = "victim";

/// One deletion: the migration's spec (beside podName/targetNode), and the moment to
/// delete it, judged on its status.
struct Case {
    name: &'static str,
    spec: Value,
    when: fn(&PodMigrationStatus) -> bool,
}

fn cases(pre_copy_rate: i64) -> Vec<Case> {
    let failing_probe =
        json!({"tcpSocket": {"port": 9}, "timeoutSeconds": 1, "failureThreshold": 20});
    let passing_probe = json!({"tcpSocket": {"port": testload::PORT}});
    vec![
        // A target node that does not exist: refused in Pending, nothing frozen.
        Case {
            name: "pending",
            spec: json!({"mode": "Cold", "targetNode": "pm-no-such-node"}),
            when: |s| s.phase == MigrationPhase::Pending && !s.conditions.is_empty(),
        },
        Case {
            name: "preparing",
            spec: json!({"mode": "Cold", "probe": passing_probe}),
            when: |s| s.phase == MigrationPhase::Preparing,
        },
        // A bandwidth limit makes each pre-copy round's transfer last.
        Case {
            name: "pre-copy-round",
            spec: json!({"mode": "PreCopy", "preCopy": {"maxRounds": 5},
                "bandwidthLimitBytesPerSecond": pre_copy_rate, "probe": passing_probe}),
            when: |s| {
                s.phase == MigrationPhase::Checkpointing
                    && s.progress.as_ref().is_some_and(|p| p.iteration >= 1)
            },
        },
        // Cold: the phase is the final dump; the deletion may land in the transfer after it.
        Case {
            name: "final-dump",
            spec: json!({"mode": "Cold", "bandwidthLimitBytesPerSecond": pre_copy_rate,
                "probe": passing_probe}),
            when: |s| s.phase == MigrationPhase::Checkpointing,
        },
        // Restored, probing a port nobody serves: the fence keeps the restored copy
        // until the probe decides; it fails, so the source comes back.
        Case {
            name: "restoring-probe-failing",
            spec: json!({"mode": "Cold", "probe": failing_probe}),
            when: |s| s.phase == MigrationPhase::Restoring,
        },
        // Restored and passing: the fence rolls the deletion forward to the commit.
        Case {
            name: "restoring-probe-passing",
            spec: json!({"mode": "Cold", "probe": passing_probe}),
            when: |s| {
                matches!(
                    s.phase,
                    MigrationPhase::Restoring | MigrationPhase::Committing
                )
            },
        },
    ]
}

#[tokio::test]
async fn deleting_a_migration_in_any_phase_leaves_exactly_one_copy_serving() {
    // 64 MiB of ballast, at 8 MiB/s: a pre-copy round or the final transfer lasts ~8 s.
    let Some(w) = World::new("abort", APP, 64, &[]).await else {
        return;
    };
    let app = &w.app;
    let nodes = &w.nodes;
    let pods: Api<Pod> = app.api();
    let pms: Api<PodMigration> = app.api();
    let mut source = w.source.clone();

    let mut outcomes = vec![];
    for case in cases(8 << 20) {
        let before = counter(&addr(&source));
        let target_node = nodes
            .iter()
            .find(|n| **n != node_of(&source))
            .unwrap()
            .clone();
        let mut spec = json!({"podName": source.name_any(), "targetNode": target_node,
            "freezeBudgetMillis": 120000});
        for (k, v) in case.spec.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let pm: PodMigration = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": case.name}, "spec": spec
        }));
        pms.create(&PostParams::default(), &pm).await.unwrap();
        let seen = wait_for(
            &pms,
            case.name,
            MIGRATION_TIMEOUT,
            &format!("{}: the moment to delete (or the end)", case.name),
            |m| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| (case.when)(s) || s.phase.is_terminal())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
        .and_then(|m| m.status)
        .unwrap();
        if seen.phase.is_terminal() {
            app.dump();
            panic!("{}: ended before it could be deleted: {seen:?}", case.name);
        }
        pms.delete(case.name, &DeleteParams::default())
            .await
            .unwrap();
        let last = wait_for(
            &pms,
            case.name,
            MIGRATION_TIMEOUT,
            &format!("{}: the deleted migration released", case.name),
            |m| m.is_none(),
        )
        .await;
        if let Err(e) = last {
            app.dump();
            panic!("{e:#}");
        }
        // Exactly one copy: the source, or the committed target.
        let left = wait_list(
            &pods,
            "",
            POD_TIMEOUT,
            &format!(
                "{}: one pod of the app, Ready, nothing beside it",
                case.name
            ),
            |ps| {
                let of_app: Vec<_> = ps
                    .iter()
                    .filter(|p| p.labels().get("app").map(String::as_str) == Some(APP))
                    .collect();
                of_app.len() == 1
                    && pod_running_ready(of_app[0])
                    && target_pods_of(ps, &source.name_any())
                        .iter()
                        .all(|t| t.uid() == of_app[0].uid())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        let one = left
            .into_iter()
            .find(|p| p.labels().get("app").map(String::as_str) == Some(APP))
            .unwrap();
        let outcome = if one.uid() == source.uid() {
            source_serves_alone(&pods, APP, &source, before, case.name).await;
            "source resumed"
        } else {
            // Rolled forward: the restored copy, adopted, on the target node, with the
            // counter it had (a fresh replica would have started over).
            assert!(
                one.name_any()
                    .starts_with(&format!("{}-pm-", source.name_any())),
                "{}: neither the source nor its target serves: {}",
                case.name,
                one.name_any()
            );
            assert_eq!(node_of(&one), target_node, "{}", case.name);
            assert!(
                one.owner_references()
                    .iter()
                    .any(|o| o.controller == Some(true) && o.kind == "ReplicaSet"),
                "{}: the target is adopted",
                case.name
            );
            assert_eq!(restart_count(&one), 0);
            let after = counter(&addr(&one));
            assert!(
                after > before,
                "{}: the committed copy lost the counter: {before} then {after}",
                case.name
            );
            source = one;
            "target committed"
        };
        eprintln!(
            "{}: deleted in {:?} (iteration {:?}) -> {outcome}",
            case.name,
            seen.phase,
            seen.progress.as_ref().map(|p| p.iteration)
        );
        outcomes.push((case.name, seen.phase, outcome));
    }
    // What only a deletion before the fence may do: the source comes back; past a
    // passing probe the deletion rolls forward.
    for (name, phase, outcome) in &outcomes {
        if matches!(
            phase,
            MigrationPhase::Pending | MigrationPhase::Preparing | MigrationPhase::Checkpointing
        ) {
            assert_eq!(*outcome, "source resumed", "{name}: deleted in {phase:?}");
        }
    }
    let (_, _, last) = outcomes.last().unwrap();
    assert_eq!(*last, "target committed", "{outcomes:?}");
}
