//! Issue 39, part 3: the testload image run with its own user (uid 65532: no
//! `securityContext` says otherwise) and a PodMigration holding only `podName`, through
//! the chart with its default values, on the real nodes. It either migrates with its
//! counter continuing, or is refused in `Pending` (`Migratable=False`) with a reason
//! naming what is missing: never a late `AgentError` after the freeze.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::agents::no_checkpoint_files_left;
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, counter, counter_when_reachable, node_of, pod_ip,
    restart_count,
};
use podmotion_e2e::real::{Images, helm_install, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_for, wait_list,
};
use serde_json::json;

/// The testload Deployment as a user writes it: the image's own user decides.
fn own_user_deployment(name: &str, image: &str) -> Deployment {
    let mut d = serde_json::to_value(testload::deployment(name, image, 16)).unwrap();
    let c = &mut d["spec"]["template"]["spec"]["containers"][0];
    c.as_object_mut().unwrap().remove("securityContext");
    from_json(d)
}

#[tokio::test]
async fn the_image_s_own_non_root_user_migrates_or_is_refused_before_any_freeze() {
    let Some(op) = TestNamespace::new("nonroot-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    let Some(app) = TestNamespace::new("nonroot-app", PodSecurity::Baseline).await else {
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
        "podmotion-e2e-nonroot",
        &[],
    );
    let testload = images.testload().unwrap();
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &own_user_deployment("own-user", &testload),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = app.api();
    let ready = wait_list(
        &pods,
        "app=own-user",
        POD_TIMEOUT,
        "the replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let source = ready[0].clone();
    // The kubelet reports the image's user where the runtime tells it.
    let reported = source
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref()?.first()?.user.clone())
        .and_then(|u| u.linux)
        .map(|l| l.uid);
    eprintln!("kubelet-reported uid of the source container: {reported:?}");
    if let Some(uid) = reported {
        assert_eq!(uid, 65532, "the testload image's own user");
    }
    let source_addr = format!("{}:8080", pod_ip(&source));
    let before = counter_when_reachable(&source_addr, "before the migration");
    assert!(before > 0, "the counter runs");

    let pms: Api<PodMigration> = app.api();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-own-user"},
        // The freeze budget at 30 s, not the default 500 ms: this test is about the
        // image's own user, and on a loaded machine the final round's transfer alone
        // once took longer than 500 ms (FreezeBudgetExceeded, a late Aborted).
        "spec": {"podName": source.name_any(), "freezeBudgetMillis": 30000}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
    // Ends, or stays Pending with Migratable=False (a refusal waits for a change).
    let m = wait_for(
        &pms,
        "move-own-user",
        MIGRATION_TIMEOUT,
        "the PodMigration to end or to be refused in Pending",
        |m| {
            m.and_then(|m| m.status.as_ref()).is_some_and(|s| {
                s.phase.is_terminal()
                    || (s.phase == MigrationPhase::Pending
                        && s.conditions.iter().any(|c| {
                            c.type_ == podmotion_api::names::condition_types::MIGRATABLE
                                && c.status == "False"
                        }))
            })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let st = m.and_then(|m| m.status).expect("status");
    if st.phase == MigrationPhase::Pending {
        // Refused before anything was frozen: the reason names what is missing, and
        // the source serves on, never restarted.
        let c = st
            .conditions
            .iter()
            .find(|c| c.type_ == podmotion_api::names::condition_types::MIGRATABLE)
            .unwrap();
        assert!(
            c.message.contains("CAP_") && c.message.contains("migrationAgent."),
            "{c:?}"
        );
        let src = pods.get(&source.name_any()).await.unwrap();
        assert_eq!(restart_count(&src), 0);
        assert!(counter(&source_addr) > before);
        eprintln!("refused in Pending: {}: {}", c.reason, c.message);
        return;
    }
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("a late failure, after Pending: {st:?}");
    }
    let target_name = st.target_pod.clone().expect("status.targetPod");
    let target = pods.get(&target_name).await.unwrap();
    assert_ne!(
        node_of(&target),
        node_of(&source),
        "moved to the other node"
    );
    assert_eq!(restart_count(&target), 0);
    wait_list(
        &pods,
        "app=own-user",
        POD_TIMEOUT,
        "only the target pod left",
        |ps| ps.len() == 1 && ps[0].name_any() == target_name,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let after = counter(&format!("{}:8080", pod_ip(&target)));
    assert!(after > before, "counter went from {before} to {after}");
    eprintln!(
        "migrated as uid 65532: downtime {:?} ms, counter {before} -> {after}",
        st.downtime_millis
    );
    no_checkpoint_files_left("after the commit", &op.client, &agents, nodes.len()).await;
}
