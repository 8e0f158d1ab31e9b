//! Issue 40 on the real nodes, through the chart (`eviction.enabled=true`, two operator
//! replicas, as docs/security.md advises with `failurePolicy: Fail`) with our images:
//! `kubectl drain` live-migrates the pods that ask for it and evicts the rest.
//!
//! Three testload Deployments on node A — two whose template asks `LiveMigrate`, one
//! that does not. `kubectl drain A --ignore-daemonsets --delete-emptydir-data`
//! completes; the two run on B with their counters continuing, owned by the same
//! ReplicaSets at their size, never restarted; the third was evicted and recreated.
//! Uncordon A, drain B: the two move back. Then `kubectl podmotion drain A` (the
//! plugin binary) moves them a third time and prints one line per pod. A `LiveMigrate`
//! pod that cannot move (hostNetwork) blocks `kubectl drain` with its reason; a
//! `LiveMigrateIfPossible` one is evicted. With the operator scaled to zero, a drain is
//! refused (`failurePolicy: Fail`, docs/security.md, "Eviction webhook").
//!
//! The operator's two replicas run on the real nodes being drained, as the chart
//! places them here (`hack/install-values.yaml`): each drain evicts the replicas on
//! its node while the API server calls the webhook for the drain's other evictions,
//! which only a graceful stop survives (operator/src/graceful.rs; before it, `failed
//! calling webhook ... EOF` ended every such drain). The operator's
//! PodDisruptionBudget keeps one replica answering.
//!
//! The real nodes are shared: a guard uncordons them all at the end, also on failure
//! (real nodes beyond the first two are cordoned throughout). The
//! release's webhook selects only the test's namespace (`migration.watchNamespace`),
//! so other namespaces' evictions on the drained node go on as usual.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`), the images pushed
//! (`hack/images.sh`) and the plugin built (`cargo build -p kubectl-podmotion`).

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, EvictParams, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{annotations, labels};
use podmotion_e2e::real::testload::{
    self, POD_TIMEOUT, addr, counter_when_reachable, ended, node_of, restart_count, wait_ballast,
};
use podmotion_e2e::real::{Images, helm_install, kubectl, output_text, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, kubeconfig_path, pod_running_ready, random_suffix,
    wait_list,
};
use serde_json::json;

/// The two Deployments that ask to be live-migrated, and the one that does not.
const MOVERS: [&str; 2] = ["mover-1", "mover-2"];
const PLAIN: &str = "plain";

/// Uncordons the real nodes when dropped: the test's last act, whatever happened.
struct Uncordon(Vec<String>);

impl Drop for Uncordon {
    fn drop(&mut self) {
        for n in &self.0 {
            let out = kubectl(&["uncordon", n]);
            if !out.status.success() {
                eprintln!("uncordon {n}: {}", output_text(&out));
            }
        }
    }
}

fn cordon(node: &str, on: bool) {
    let out = kubectl(&[if on { "cordon" } else { "uncordon" }, node]);
    assert!(out.status.success(), "{}", output_text(&out));
}

/// `kubectl drain NODE --ignore-daemonsets --delete-emptydir-data` plus `extra`; its
/// output and how long it took.
fn kubectl_drain(node: &str, extra: &[&str]) -> (Output, Duration) {
    let mut args = vec![
        "drain",
        node,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
    ];
    args.extend_from_slice(extra);
    let start = Instant::now();
    let out = kubectl(&args);
    (out, start.elapsed())
}

/// MiB of ballast of each testload pod: two Cold moves of 16 MiB at once overran the
/// PodMigration's own default freeze budget (500 ms) on these two cores; an eviction's
/// PodMigration has the chart's `eviction.freezeBudgetMillis` (5000).
const BALLAST_MIB: u32 = 16;

/// The chart's default `eviction.freezeBudgetMillis`.
const EVICTION_FREEZE_BUDGET_MILLIS: i64 = 5000;

/// A testload Deployment whose template asks `strategy`.
fn workload(name: &str, image: &str, strategy: Option<&str>) -> Deployment {
    let mut d = serde_json::to_value(testload::deployment(name, image, BALLAST_MIB)).unwrap();
    if let Some(s) = strategy {
        d["spec"]["template"]["metadata"]["annotations"] =
            json!({annotations::EVICTION_STRATEGY: s});
    }
    from_json(d)
}

/// A testload Deployment with `hostNetwork` (which no migration can move), listening on
/// `port` of node `node`, asking `strategy`.
fn host_network_workload(
    name: &str,
    image: &str,
    strategy: &str,
    node: &str,
    port: u16,
) -> Deployment {
    let mut d = serde_json::to_value(workload(name, image, Some(strategy))).unwrap();
    let spec = &mut d["spec"]["template"]["spec"];
    spec["hostNetwork"] = json!(true);
    spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    let c = &mut spec["containers"][0];
    c["args"] = json!(["serve", port.to_string(), "1"]);
    c["ports"] = json!([{"containerPort": port}]);
    c["readinessProbe"] = json!({"tcpSocket": {"port": port}, "periodSeconds": 2});
    from_json(d)
}

/// The ReplicaSet controlling a pod: `(name, uid)`.
fn rs_of(p: &Pod) -> (String, String) {
    p.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "ReplicaSet")
        .map(|o| (o.name.clone(), o.uid.clone()))
        .expect("owned by a ReplicaSet")
}

/// The one Ready replica of `app`, on `node`.
async fn only_replica_on(pods: &Api<Pod>, app: &str, node: &str, what: &str) -> Pod {
    wait_list(
        pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        &format!("{what}: {app}'s only replica Ready on {node}"),
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]) && node_of(&ps[0]) == node,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone()
}

/// What a mover was before a drain.
#[derive(Clone)]
struct Before {
    pod: Pod,
    counter: u64,
}

/// The movers and the plain workload as they are now, all on `node`.
async fn snapshot(pods: &Api<Pod>, node: &str, what: &str) -> (Vec<Before>, Pod) {
    let mut movers = Vec::new();
    for app in MOVERS {
        let pod = only_replica_on(pods, app, node, what).await;
        wait_ballast(&pod);
        let counter = counter_when_reachable(&addr(&pod), what);
        movers.push(Before { pod, counter });
    }
    let plain = only_replica_on(pods, PLAIN, node, what).await;
    (movers, plain)
}

/// After a drain of the movers' node: each runs on `to` — the same ReplicaSet at its
/// size, a new pod never restarted, its counter on from before — through a Succeeded
/// PodMigration started by the eviction; the plain one was evicted and recreated on
/// `to`. Returns one line of figures per mover.
async fn moved(
    app_ns: &TestNamespace,
    before: &[Before],
    plain: &Pod,
    to: &str,
    what: &str,
) -> Vec<String> {
    let pods: Api<Pod> = app_ns.api();
    let pms: Api<PodMigration> = app_ns.api();
    let rss: Api<ReplicaSet> = app_ns.api();
    let mut figures = Vec::new();
    for (app, b) in MOVERS.iter().zip(before) {
        let now = only_replica_on(&pods, app, to, what).await;
        assert_ne!(now.uid(), b.pod.uid(), "{what}: {app} is a new pod");
        assert_eq!(
            rs_of(&now),
            rs_of(&b.pod),
            "{what}: {app} adopted by its ReplicaSet"
        );
        assert_eq!(restart_count(&now), 0, "{what}: {app} restarted");
        let c = counter_when_reachable(&addr(&now), what);
        assert!(
            c > b.counter,
            "{what}: {app}'s counter went from {} to {c}: not continued",
            b.counter
        );
        let rs = rss.get(&rs_of(&now).0).await.unwrap();
        let rs = serde_json::to_value(&rs).unwrap();
        assert_eq!(rs.pointer("/spec/replicas"), Some(&json!(1)), "{what}");
        assert_eq!(rs.pointer("/status/replicas"), Some(&json!(1)), "{what}");
        let started = pms
            .list(&ListParams::default().labels(&format!(
                "{}={}",
                labels::EVICTED_POD_UID,
                b.pod.uid().unwrap()
            )))
            .await
            .unwrap()
            .items;
        assert_eq!(
            started.len(),
            1,
            "{what}: one PodMigration for {app}: {started:?}"
        );
        // The drain ends once the source is gone; the commit's last steps (the phase
        // written) may still be under way: wait for the end.
        let st = ended(&pms, &started[0].name_any()).await;
        if st.phase != MigrationPhase::Succeeded {
            app_ns.dump();
            panic!("{what}: {app}: {st:?}");
        }
        assert_eq!(st.target_pod.as_deref(), Some(now.name_any().as_str()));
        assert_eq!(
            started[0].spec.freeze_budget_millis, EVICTION_FREEZE_BUDGET_MILLIS,
            "{what}: the chart's eviction.freezeBudgetMillis"
        );
        figures.push(format!(
            "{app}: {} -> {to}, downtime {} ms, counter {} -> {c}",
            node_of(&b.pod),
            st.downtime_millis.unwrap_or(-1),
            b.counter
        ));
    }
    let recreated = only_replica_on(&pods, PLAIN, to, what).await;
    assert_ne!(recreated.uid(), plain.uid(), "{what}: plain evicted");
    assert_eq!(
        rs_of(&recreated),
        rs_of(plain),
        "{what}: recreated by its ReplicaSet"
    );
    let none = pms
        .list(&ListParams::default().labels(&format!(
            "{}={}",
            labels::EVICTED_POD_UID,
            plain.uid().unwrap()
        )))
        .await
        .unwrap()
        .items;
    assert!(
        none.is_empty(),
        "{what}: no migration of the plain pod: {none:?}"
    );
    figures
}

/// The plugin binary of this tree: `PODMOTION_PLUGIN_BIN`, or `kubectl-podmotion` next
/// to this test's directory in the target directory (`cargo build -p kubectl-podmotion`).
fn plugin_bin() -> PathBuf {
    let bin = std::env::var_os("PODMOTION_PLUGIN_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let exe = std::env::current_exe().expect("the test's path");
            exe.parent()
                .and_then(|deps| deps.parent())
                .expect("the target directory")
                .join("kubectl-podmotion")
        });
    assert!(
        bin.exists(),
        "{}: build it first (cargo build -p kubectl-podmotion) or set PODMOTION_PLUGIN_BIN",
        bin.display()
    );
    bin
}

/// The plugin's line for `ns/pod` that contains `word`, if any.
fn line_of<'a>(out: &'a str, pod: &str, word: &str) -> Option<&'a str> {
    out.lines()
        .find(|l| l.split_whitespace().next() == Some(pod) && l.contains(word))
}

/// Waits (60 s at most) until the API server reaches the eviction webhook through its
/// Service: a dry-run eviction of `pod`, which asks nothing (so the webhook allows
/// it), is answered. What a drain does to the webhook while its replicas are evicted
/// is what this test measures, and it starts only once the webhook answered: a CI run
/// once failed its first drain at once, every eviction with `connect: connection
/// refused` from the Service's address (no endpoint in kube-proxy's rules), before
/// the evicted replica could have stopped. Prints how long it waited, and why, when
/// it did.
async fn webhook_answers(pods: &Api<Pod>, pod: &str, what: &str) {
    let dry = EvictParams {
        post_options: PostParams {
            dry_run: true,
            ..Default::default()
        },
        ..Default::default()
    };
    let start = Instant::now();
    let mut first_error: Option<String> = None;
    loop {
        match pods.evict(pod, &dry).await {
            Ok(_) => break,
            Err(e) => {
                let e = e.to_string();
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "{what}: the eviction webhook answered no dry-run eviction of {pod} in 60 s: {e}"
                );
                first_error.get_or_insert(e);
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if let Some(e) = first_error {
        eprintln!(
            "{what}: the eviction webhook answered after {} ms; until then: {e}",
            start.elapsed().as_millis()
        );
    }
}

/// The operator replicas on `node`.
async fn operator_replicas_on(op_pods: &Api<Pod>, node: &str) -> usize {
    op_pods
        .list(&ListParams::default().labels("app.kubernetes.io/component=operator"))
        .await
        .unwrap()
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && node_of(p) == node)
        .count()
}

#[tokio::test]
async fn kubectl_drain_live_migrates_the_pods_that_ask_and_evicts_the_rest() {
    let Some(op) = TestNamespace::new("drain-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // Privileged: the pod that cannot move uses the host's network.
    let Some(app) = TestNamespace::new("drain-app", PodSecurity::Privileged).await else {
        return;
    };
    let (a, b) = (nodes[0].clone(), nodes[1].clone());
    let _uncordon = Uncordon(nodes.clone());
    // More real nodes than two: the others are cordoned, so that A and B are the
    // only places a pod can go.
    for other in &nodes[2..] {
        cordon(other, true);
    }
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let release = format!("pm{}", random_suffix());
    // Two replicas on the real nodes (the chart's placement here), with the chart's
    // defaults for the webhook's graceful stop and the evictions' freeze budget.
    let values = "eviction.enabled=true,operator.replicas=2";
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-drain",
        &["--set", values],
    );
    let op_pods: Api<Pod> = op.api();
    let mut operator_evicted = 0;
    let image = images.testload().unwrap();
    let deployments: Api<Deployment> = app.api();
    let pods: Api<Pod> = app.api();

    // All three on A: B cordoned while they are scheduled.
    cordon(&b, true);
    for (name, strategy) in [
        (MOVERS[0], Some("LiveMigrate")),
        (MOVERS[1], Some("LiveMigrate")),
        (PLAIN, None),
    ] {
        deployments
            .create(&PostParams::default(), &workload(name, &image, strategy))
            .await
            .unwrap();
    }
    let (movers, plain) = snapshot(&pods, &a, "before the first drain").await;
    cordon(&b, false);
    let generations: Vec<Option<i64>> = {
        let mut g = Vec::new();
        for app_name in MOVERS {
            g.push(deployments.get(app_name).await.unwrap().metadata.generation);
        }
        g
    };
    let mut report = Vec::new();

    // 1. kubectl drain A: the two move to B, the plain one is evicted.
    webhook_answers(&pods, &plain.name_any(), "before the first drain").await;
    let on_a = operator_replicas_on(&op_pods, &a).await;
    operator_evicted += on_a;
    let (out, took) = kubectl_drain(&a, &["--timeout=600s"]);
    eprintln!(
        "kubectl drain {a} ({} ms):\n{}",
        took.as_millis(),
        output_text(&out)
    );
    if !out.status.success() {
        app.dump();
        op.dump();
        panic!("kubectl drain {a} failed: {}", output_text(&out));
    }
    report.push(format!(
        "kubectl drain {a}: {} ms (2 pods migrated, 1 evicted, {on_a} operator replica(s) evicted)",
        took.as_millis()
    ));
    report.extend(moved(&app, &movers, &plain, &b, &format!("drain {a}")).await);

    // 2. Uncordon A, drain B: they move back.
    cordon(&a, false);
    let (movers, plain) = snapshot(&pods, &b, "before the second drain").await;
    webhook_answers(&pods, &plain.name_any(), "before the second drain").await;
    let on_b = operator_replicas_on(&op_pods, &b).await;
    operator_evicted += on_b;
    let (out, took) = kubectl_drain(&b, &["--timeout=600s"]);
    eprintln!(
        "kubectl drain {b} ({} ms):\n{}",
        took.as_millis(),
        output_text(&out)
    );
    if !out.status.success() {
        app.dump();
        op.dump();
        panic!("kubectl drain {b} failed: {}", output_text(&out));
    }
    report.push(format!(
        "kubectl drain {b}: {} ms (2 pods migrated, 1 evicted, {on_b} operator replica(s) evicted)",
        took.as_millis()
    ));
    // Both nodes drained, the operator only on them: its replicas were evicted under
    // the drains' evictions at least once.
    assert!(
        operator_evicted >= 1,
        "no operator replica was on a drained node"
    );
    report.extend(moved(&app, &movers, &plain, &a, &format!("drain {b}")).await);
    cordon(&b, false);

    // 3. The plugin drains A: one line per pod, the two migrated with their downtime.
    let (movers, plain) = snapshot(&pods, &a, "before the plugin's drain").await;
    webhook_answers(&pods, &plain.name_any(), "before the plugin's drain").await;
    let on_a = operator_replicas_on(&op_pods, &a).await;
    let start = Instant::now();
    let out = Command::new("timeout")
        .arg("600")
        .arg(plugin_bin())
        .args(["drain", &a])
        .env("KUBECONFIG", kubeconfig_path())
        .output()
        .expect("running kubectl-podmotion");
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    eprintln!(
        "kubectl podmotion drain {a} ({} ms, {}):\n{}",
        took.as_millis(),
        out.status,
        output_text(&out)
    );
    assert_eq!(out.status.code(), Some(0), "{}", output_text(&out));
    assert_eq!(
        text.lines().next(),
        Some(format!("node/{a} cordoned").as_str())
    );
    for m in &movers {
        let key = format!("{}/{}", app.name, m.pod.name_any());
        assert!(
            line_of(&text, &key, "migrating").is_some(),
            "{key}:\n{text}"
        );
        let done = line_of(&text, &key, "migrated").unwrap_or_else(|| panic!("{key}:\n{text}"));
        assert!(
            done.contains(&format!("to {b}, downtime ")) && done.ends_with(" ms"),
            "{done}"
        );
    }
    let plain_key = format!("{}/{}", app.name, plain.name_any());
    assert!(
        line_of(&text, &plain_key, "evicted").is_some(),
        "{plain_key}:\n{text}"
    );
    report.push(format!(
        "kubectl podmotion drain {a}: {} ms (2 pods migrated, 1 evicted, {on_a} operator replica(s) evicted)",
        took.as_millis()
    ));
    report.extend(moved(&app, &movers, &plain, &b, &format!("plugin drain {a}")).await);
    cordon(&a, false);
    for (app_name, g) in MOVERS.iter().zip(&generations) {
        assert_eq!(
            deployments.get(app_name).await.unwrap().metadata.generation,
            *g,
            "{app_name}: no rollout in three moves"
        );
    }

    // 4. A LiveMigrate pod that cannot move blocks the drain, with its reason; a
    // LiveMigrateIfPossible one is evicted.
    let port = 20000 + (std::process::id() % 10000) as u16;
    for (name, strategy, p) in [
        ("host-hard", "LiveMigrate", port),
        ("host-soft", "LiveMigrateIfPossible", port + 1),
    ] {
        deployments
            .create(
                &PostParams::default(),
                &host_network_workload(name, &image, strategy, &a, p),
            )
            .await
            .unwrap();
    }
    let hard = only_replica_on(&pods, "host-hard", &a, "host-hard").await;
    let soft = only_replica_on(&pods, "host-soft", &a, "host-soft").await;
    let (out, took) = kubectl_drain(
        &a,
        &[
            "--pod-selector=app in (host-hard,host-soft)",
            "--timeout=120s",
        ],
    );
    let text = output_text(&out);
    eprintln!(
        "kubectl drain {a}, a pod that cannot move ({} ms):\n{text}",
        took.as_millis()
    );
    assert!(!out.status.success(), "the drain went through:\n{text}");
    assert!(
        text.contains(&hard.name_any())
            && text.contains("HostNamespaces")
            && text.contains("hostNetwork"),
        "the eviction's answer names the reason:\n{text}"
    );
    assert!(
        pods.get_opt(&hard.name_any())
            .await
            .unwrap()
            .is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
        "host-hard keeps running"
    );
    let gone = pods.get_opt(&soft.name_any()).await.unwrap();
    assert!(
        gone.is_none_or(|p| p.metadata.deletion_timestamp.is_some()),
        "host-soft was evicted"
    );
    cordon(&a, false);
    for name in ["host-hard", "host-soft"] {
        deployments.delete(name, &Default::default()).await.unwrap();
    }

    // 5. The operator scaled to zero: failurePolicy Fail refuses the drain, the pod stays.
    let operator = format!("{release}-podmotion");
    let out = kubectl(&["-n", &op.name, "scale", "deploy", &operator, "--replicas=0"]);
    assert!(out.status.success(), "{}", output_text(&out));
    wait_list(
        &op_pods,
        "app.kubernetes.io/component=operator",
        POD_TIMEOUT,
        "no operator pod left",
        |ps| ps.is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let plain_now = only_replica_on(&pods, PLAIN, &b, "the operator down").await;
    let (out, took) = kubectl_drain(&b, &["--pod-selector=app=plain", "--timeout=60s"]);
    let text = output_text(&out);
    eprintln!(
        "kubectl drain {b} with the operator at zero ({} ms):\n{text}",
        took.as_millis()
    );
    assert!(!out.status.success(), "the drain went through:\n{text}");
    assert!(text.contains("failed calling webhook"), "{text}");
    let still = pods.get(&plain_now.name_any()).await.unwrap();
    assert!(
        still.metadata.deletion_timestamp.is_none(),
        "plain was not evicted"
    );
    report.push(format!(
        "kubectl drain {b} with the operator at zero: refused after {} ms",
        took.as_millis()
    ));
    eprintln!("drains:\n  {}", report.join("\n  "));
}
