//! `helm uninstall` with PodMotion objects present releases every one of them: the
//! pre-delete hook (`reap-all`, our operator image) deletes the in-flight PodMigrations
//! and lets the operator roll them back, scales the operator to zero, then removes the
//! finalizers of the three kinds in the release's namespaces and reaps the attachment
//! Jobs. Afterwards no PodMotion finalizer is left and the namespaces that held the
//! objects delete instead of hanging in `Terminating`.
//!
//! The in-flight PodMigration is a real one: a Cold move of a testload replica, paced
//! so that its source is frozen in `Transferring` when the uninstall starts. The
//! uninstall must roll it back: the very source process runs again, no target pod is
//! left, the counter goes on.
//!
//! The hook must really run (it is a Job of the chart's operator image), so this runs
//! on the real nodes with the images of `hack/images.sh`, under the real-node lock.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_e2e::real::procs::workload_processes;
use podmotion_e2e::real::testload::{self, POD_TIMEOUT, addr, counter_when_reachable};
use podmotion_e2e::real::{Images, Uninstall, chart_args, helm, output_text, real_nodes};
use podmotion_e2e::{PodSecurity, TestNamespace, from_json, random_suffix, wait_for, wait_list};
use serde::de::DeserializeOwned;
use serde_json::json;

/// Bound on each wait for the operator to act on a new object (it runs on a real node).
const ACT_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on a namespace's deletion: far above what it takes, far below "hangs forever".
const NAMESPACE_TIMEOUT: Duration = Duration::from_secs(180);

fn ours(finalizers: &[String]) -> Vec<String> {
    finalizers
        .iter()
        .filter(|f| f.starts_with("podmotion.io/"))
        .cloned()
        .collect()
}

/// Waits until `name` carries a `podmotion.io/` finalizer and `extra` holds.
async fn await_finalized<K>(api: &Api<K>, name: &str, what: &str, extra: impl Fn(&K) -> bool)
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    wait_for(api, name, ACT_TIMEOUT, what, |o| {
        o.is_some_and(|o| !ours(o.finalizers()).is_empty() && extra(o))
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
}

fn phase(pm: &PodMigration) -> String {
    pm.status
        .as_ref()
        .map(|s| format!("{:?}", s.phase))
        .unwrap_or_default()
}

/// Finalizers of ours still on `name`, or `None` when it is gone.
async fn left_on<K>(api: &Api<K>, name: &str) -> Option<Vec<String>>
where
    K: kube::Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name)
        .await
        .unwrap_or_else(|e| panic!("get {name}: {e}"))
        .map(|o| ours(o.finalizers()))
}

#[tokio::test]
async fn helm_uninstall_releases_every_podmotion_object_and_no_namespace_hangs() {
    let Some(op) = TestNamespace::new("unin", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    let Some(app) = TestNamespace::new("unin-app", PodSecurity::Baseline).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let release = format!("pm{}", random_suffix());
    let lease = format!("podmotion-e2e-{}", random_suffix());
    let base = chart_args(&images, &op.name, &app.name, &lease);
    let mut args = vec!["install", release.as_str()];
    args.extend(base.iter().map(String::as_str));
    args.extend_from_slice(&[
        "--take-ownership",
        "--force-conflicts",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let out = helm(&args);
    let uninstalled = Uninstall {
        release: release.clone(),
        namespace: op.name.clone(),
    };
    assert!(out.status.success(), "helm install: {}", output_text(&out));

    // One of each kind, each holding its finalizer before the uninstall:
    // - a finished PodMigration (a dry run of a pod that does not exist ends Failed),
    // - an in-flight one: a testload replica's Cold move, its 96 MiB sent at 1 MiB/s,
    //   so that its source is frozen in Transferring for a minute and a half,
    // - a RunnerPool and a NodeAgentAttachment (whose workloads do not exist: the
    //   finalizer is put on before anything else).
    let pods: Api<Pod> = app.api();
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &testload::deployment("frozen", &images.testload().unwrap(), 96),
        )
        .await
        .unwrap();
    let source = testload::ready_replica(&pods, "frozen").await;
    let source_uid = source.uid().unwrap();
    let source_proc = workload_processes(std::slice::from_ref(&source_uid))
        .pop()
        .expect("the source's workload process");
    let before = counter_when_reachable(&addr(&source), "the source");
    let target_node = testload::other_node(&nodes, &source);
    let pms: Api<PodMigration> = app.api();
    let finished: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "finished"},
        "spec": {"podName": "no-such-pod", "dryRun": true}
    }));
    pms.create(&PostParams::default(), &finished).await.unwrap();
    let in_flight: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "in-flight"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": 600000, "progressTimeoutSeconds": 600,
            "deadlineSeconds": 3600, "bandwidthLimitBytesPerSecond": 1 << 20}
    }));
    pms.create(&PostParams::default(), &in_flight)
        .await
        .unwrap();
    await_finalized(&pms, "finished", "a finished PodMigration", |pm| {
        phase(pm) == "Failed"
    })
    .await;
    await_finalized(&pms, "in-flight", "an in-flight PodMigration", |pm| {
        phase(pm) == "Transferring"
    })
    .await;
    let frozen = || {
        workload_processes(std::slice::from_ref(&source_uid))
            .into_iter()
            .find(|p| p.same(&source_proc))
    };
    let deadline = std::time::Instant::now() + ACT_TIMEOUT;
    while frozen().is_none_or(|p| p.runs()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the source was never frozen: {:?} ({:?})",
            frozen(),
            pms.get("in-flight").await.unwrap().status
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let target_pod = pms
        .get("in-flight")
        .await
        .unwrap()
        .status
        .and_then(|s| s.target_pod);
    eprintln!("in-flight: source {source_proc:?} frozen, target pod {target_pod:?}");
    let pools: Api<RunnerPool> = app.api();
    let pool: RunnerPool = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
        "metadata": {"name": "runners"},
        "spec": {
            "image": format!("registry.invalid/runner@sha256:{}", "0".repeat(64)),
            "sessionsPerNode": 1,
            "server": {"serviceName": "compass-server", "port": 8443},
        }
    }));
    pools.create(&PostParams::default(), &pool).await.unwrap();
    await_finalized(&pools, "runners", "a RunnerPool", |_| true).await;
    let naas: Api<NodeAgentAttachment> = app.api();
    let naa: NodeAgentAttachment = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": "web"},
        "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
    }));
    naas.create(&PostParams::default(), &naa).await.unwrap();
    await_finalized(&naas, "web", "a NodeAgentAttachment", |_| true).await;

    // Uninstall, with the hook.
    let out = helm(&[
        "uninstall",
        &release,
        "-n",
        &op.name,
        "--wait",
        "--timeout",
        "5m",
    ]);
    let hook_logs = op.kubectl(&[
        "-n",
        &op.name,
        "logs",
        "-l",
        "app.kubernetes.io/component=reap-all",
    ]);
    if !out.status.success() {
        op.dump();
    }
    assert!(
        out.status.success(),
        "helm uninstall: {}\nhook logs:\n{hook_logs}",
        output_text(&out)
    );
    std::mem::forget(uninstalled);

    // No finalizer of ours is left; the in-flight migration was deleted and rolled back.
    let left = [
        ("PodMigration finished", left_on(&pms, "finished").await),
        ("PodMigration in-flight", left_on(&pms, "in-flight").await),
        ("RunnerPool runners", left_on(&pools, "runners").await),
        ("NodeAgentAttachment web", left_on(&naas, "web").await),
    ];
    let stuck: Vec<String> = left
        .iter()
        .filter(|(_, f)| f.as_ref().is_some_and(|f| !f.is_empty()))
        .map(|(what, f)| format!("{what}: {f:?}"))
        .collect();
    assert!(
        stuck.is_empty(),
        "finalizers left after helm uninstall: {stuck:?}\nhook logs:\n{hook_logs}"
    );
    assert_eq!(
        left[1].1, None,
        "the in-flight PodMigration was deleted by the hook and released by the operator"
    );
    assert!(
        left[0].1.is_some() && left[2].1.is_some() && left[3].1.is_some(),
        "the hook deletes only in-flight migrations; the rest stay (CRDs and objects are kept)"
    );
    // Rolled back, not abandoned: the very source process runs again (not a restart
    // from its image), the target pod is gone, and the counter goes on from the source.
    let now = frozen();
    assert!(
        now.as_ref().is_some_and(|p| p.runs()),
        "the in-flight migration's source does not run after the uninstall: {now:?} (was {source_proc:?})"
    );
    wait_list(
        &pods,
        "app=frozen",
        POD_TIMEOUT,
        "only the source pod",
        |ps| ps.len() == 1 && ps[0].uid().as_deref() == Some(source_uid.as_str()),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    if let Some(t) = &target_pod {
        assert!(
            pods.get_opt(t).await.unwrap().is_none(),
            "the target pod {t} outlived the rollback"
        );
    }
    let after = counter_when_reachable(&addr(&source), "the thawed source");
    assert!(after > before, "the counter went from {before} to {after}");

    // The hook's own permissions existed only while it ran.
    let selector =
        format!("app.kubernetes.io/instance={release},app.kubernetes.io/component=reap-all");
    let left_rbac = op.kubectl(&[
        "get",
        "clusterroles,clusterrolebindings,roles,rolebindings",
        "-A",
        "-l",
        &selector,
        "-o",
        "name",
    ]);
    assert!(
        !left_rbac.contains('/'),
        "the hook's RBAC outlived the uninstall: {left_rbac}"
    );

    // The namespace holding them deletes, and nothing keeps it Terminating.
    let namespaces: Api<Namespace> = Api::all(app.client.clone());
    namespaces
        .delete(&app.name, &DeleteParams::default())
        .await
        .unwrap();
    if let Err(e) = wait_for(
        &namespaces,
        &app.name,
        NAMESPACE_TIMEOUT,
        "the application namespace to be deleted",
        |n| n.is_none(),
    )
    .await
    {
        let objs = app.kubectl(&[
            "-n",
            &app.name,
            "get",
            "podmigrations,nodeagentattachments,runnerpools",
            "-o",
            "yaml",
        ]);
        panic!("namespace hangs: {e:#}\n{objs}");
    }
}
