//! The real nodes of the local cluster run our images (hack/images.sh), and the chart
//! installed from them (hack/install.sh's values) works there: pods of every image start,
//! pods on different nodes reach each other by pod IP and through a Service, the API server
//! is reachable in-cluster, `kubectl logs` and `exec` work, and helm install, upgrade and
//! uninstall (with the pre-delete reap hook really running) succeed.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::{finalizers, labels};
use podmotion_e2e::real::testload::ready_pod;
use podmotion_e2e::real::{
    Images, PortForward, Uninstall, agent_call, agent_stream, chart_args, entrypoint, helm,
    kubectl, nft_tables, output_text, pin, real_nodes,
};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, kubeconfig_path, kubectl_path, pod_running_ready,
    random_suffix, wait_for, wait_list,
};
use serde_json::json;

/// Pulling an image the first time on a loaded machine takes a while.
const POD_TIMEOUT: Duration = Duration::from_secs(180);

fn pod(name: &str, image: &str, args: &[&str], node: &str, restart: &str) -> Pod {
    let mut spec = json!({
        "restartPolicy": restart,
        "enableServiceLinks": false,
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": image, "args": args}]
    });
    pin(&mut spec, node);
    from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": spec
    }))
}

fn terminated(p: &Pod) -> Option<(i32, String)> {
    let cs = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
    let t = cs.state.as_ref()?.terminated.as_ref()?;
    Some((t.exit_code, t.reason.clone().unwrap_or_default()))
}

async fn wait_terminated(api: &Api<Pod>, name: &str) -> (i32, String) {
    let p = wait_for(
        api,
        name,
        POD_TIMEOUT,
        "the container to run to its end",
        |p| p.and_then(terminated).is_some(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    terminated(p.as_ref().unwrap()).unwrap()
}

fn logs(ns: &str, pod: &str) -> String {
    let out = kubectl(&["-n", ns, "logs", pod]);
    assert!(
        out.status.success(),
        "kubectl logs {pod}: {}",
        output_text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One image's smoke run: its arguments, what its output must contain, and the exit
/// codes that mean the binary ran.
struct Case {
    name: &'static str,
    image: String,
    args: &'static [&'static str],
    expect: &'static str,
    codes: &'static [i32],
}

impl Case {
    fn new(
        name: &'static str,
        image: anyhow::Result<String>,
        args: &'static [&'static str],
        expect: &'static str,
        codes: &'static [i32],
    ) -> Case {
        let image = image.unwrap_or_else(|e| panic!("{name}: {e:#}"));
        Case {
            name,
            image,
            args,
            expect,
            codes,
        }
    }
}

/// A pod of every image we build starts on a real node, pulled from the local registry by
/// digest: the binary runs (its usage or verdict is in the log) with a known exit code.
#[tokio::test]
async fn a_pod_of_every_image_starts_on_a_real_node() {
    let Some(ns) = TestNamespace::new("images", PodSecurity::Privileged).await else {
        return;
    };
    let Some(nodes) = real_nodes(&ns.client).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let pods: Api<Pod> = ns.api();
    let cases = [
        Case::new("operator", images.operator(), &["--help"], "Usage", &[0]),
        Case::new("agent", images.agent(), &["--help"], "Usage", &[0]),
        Case::new("broker", images.broker(), &["--help"], "Usage", &[0]),
        Case::new("attach", images.attach(), &["--help"], "Usage", &[0]),
        // The preflight checks the node and prints its one-line verdict. This plain pod
        // has no /dev/kvm (only the device plugin injects it), so its `kvm` check fails
        // and it exits 1: the binary doing its job (the verdict is read below).
        Case::new("preflight", images.preflight(), &[], "kvm", &[1]),
        Case::new("testload", images.testload(), &["--help"], "usage", &[2]),
    ];
    for (i, c) in cases.iter().enumerate() {
        let node = &nodes[i % nodes.len()];
        pods.create(
            &PostParams::default(),
            &pod(c.name, &c.image, c.args, node, "Never"),
        )
        .await
        .unwrap_or_else(|e| panic!("creating pod {}: {e}", c.name));
    }
    for c in &cases {
        let (code, reason) = wait_terminated(&pods, c.name).await;
        let out = logs(&ns.name, c.name);
        assert!(
            c.codes.contains(&code),
            "{} ({}) exited {code} ({reason}):\n{out}",
            c.name,
            c.image
        );
        assert!(
            out.to_lowercase().contains(&c.expect.to_lowercase()),
            "{} ({}) printed no {:?}:\n{out}",
            c.name,
            c.image,
            c.expect
        );
    }
    // The preflight's verdict: one JSON line, failed, and failed by its `kvm` check for
    // the device this pod lacks.
    let out = logs(&ns.name, "preflight");
    let verdict: serde_json::Value = out
        .lines()
        .find_map(|l| {
            serde_json::from_str(l)
                .ok()
                .filter(|v: &serde_json::Value| v.get("checks").is_some())
        })
        .unwrap_or_else(|| panic!("no verdict line in the preflight's output:\n{out}"));
    assert_eq!(verdict["ok"], false, "{verdict}");
    let kvm = verdict["checks"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "kvm"))
        .unwrap_or_else(|| panic!("no kvm check in {verdict}"));
    assert_eq!(kvm["ok"], false, "{verdict}");
    assert!(
        kvm["detail"]
            .as_str()
            .is_some_and(|d| d.contains("/dev/kvm")),
        "the kvm check names the device it missed: {verdict}"
    );
    // The agent image carries CRIU, new enough for this kernel.
    pods.create(&PostParams::default(), &{
        let mut p = pod("criu", &images.agent().unwrap(), &[], &nodes[0], "Never");
        let spec = p.spec.as_mut().unwrap();
        spec.containers[0].command = Some(vec!["criu".into()]);
        spec.containers[0].args = Some(vec!["--version".into()]);
        p
    })
    .await
    .unwrap();
    let (code, _) = wait_terminated(&pods, "criu").await;
    let out = logs(&ns.name, "criu");
    assert_eq!(code, 0, "criu --version in the agent image:\n{out}");
    let version = out
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no version in {out}"));
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    assert!((major, minor) >= (4, 2), "CRIU {version} < 4.2");
}

/// Pods on two real nodes talk by pod IP and through a ClusterIP Service; a pod reaches
/// the API server through the `kubernetes` Service; `kubectl logs` and `exec` reach the
/// kubelets through the API server.
#[tokio::test]
async fn pods_on_two_real_nodes_reach_each_other_the_service_and_the_api_server() {
    let Some(ns) = TestNamespace::new("net", PodSecurity::Baseline).await else {
        return;
    };
    let Some(nodes) = real_nodes(&ns.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "needs two real nodes, found {nodes:?}");
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let testload = images.testload().unwrap();
    let binary = entrypoint(&testload).unwrap();
    let pods: Api<Pod> = ns.api();

    let mut server = pod("server", &testload, &["serve", "8080"], &nodes[0], "Always");
    let c = &mut server.spec.as_mut().unwrap().containers[0];
    c.ports = Some(vec![from_json(json!({"containerPort": 8080}))]);
    c.readiness_probe = Some(from_json(
        json!({"tcpSocket": {"port": 8080}, "periodSeconds": 1}),
    ));
    pods.create(&PostParams::default(), &server).await.unwrap();
    let server = ready_pod(&pods, "server").await;
    let server_ip = server.status.unwrap().pod_ip.expect("pod IP");
    assert!(
        server_ip.starts_with("198.18."),
        "pod IP {server_ip} not in 198.18.0.0/15"
    );

    let svc: Api<Service> = ns.api();
    let svc = svc
        .create(
            &PostParams::default(),
            &from_json(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "server"},
                "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": 8080}]}
            })),
        )
        .await
        .unwrap();
    let cluster_ip = svc.spec.unwrap().cluster_ip.expect("cluster IP");
    assert!(cluster_ip.starts_with("198.19."), "Service IP {cluster_ip}");

    // From the other node: by pod IP, then through the Service (kube-proxy's rules; the
    // endpoint may take a moment to be programmed, so the client retries by restarting).
    let by_ip = format!("{server_ip}:8080");
    let by_svc = format!("{cluster_ip}:80");
    for (name, target) in [("by-ip", by_ip.as_str()), ("by-svc", by_svc.as_str())] {
        pods.create(
            &PostParams::default(),
            &pod(name, &testload, &["get", target], &nodes[1], "OnFailure"),
        )
        .await
        .unwrap();
    }
    for name in ["by-ip", "by-svc"] {
        let (code, _) = wait_terminated(&pods, name).await;
        let out = logs(&ns.name, name);
        assert_eq!(code, 0, "{name}: {out}");
        let n: u64 = out
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}: not a counter: {out:?}"));
        assert!(n > 0, "{name}: counter {n}");
    }

    // kubectl exec runs inside the server's container (and its network namespace).
    let out = kubectl(&[
        "-n",
        &ns.name,
        "exec",
        "server",
        "--",
        &binary,
        "get",
        "127.0.0.1:8080",
    ]);
    assert!(out.status.success(), "kubectl exec: {}", output_text(&out));
    let n: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("exec output {}", output_text(&out)));
    assert!(n > 0);
    assert!(
        logs(&ns.name, "server").contains("ready"),
        "the server's log"
    );

    // In-cluster configuration: the API server's address through the kubernetes Service,
    // from the environment kubelet gives every pod.
    pods.create(&PostParams::default(), &{
        // Never restarted: its one run's exit code and log are what is checked.
        let mut p = pod("api", &testload, &[], &nodes[1], "Never");
        let spec = p.spec.as_mut().unwrap();
        spec.enable_service_links = Some(true);
        spec.containers[0].args = Some(vec![
            "get".into(),
            "$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)".into(),
        ]);
        p
    })
    .await
    .unwrap();
    // The API server speaks TLS: the plain-text `get` (4 bytes, less than a TLS record
    // header) is accepted and then left unanswered, the server waiting for the rest of
    // the record, so the client's read times out (5 s: EAGAIN) and it exits 1. A
    // connection that is refused, unroutable or never accepted fails at the connect
    // instead, with another error. So: exit 1 with exactly the read's timeout.
    let (code, _) = wait_terminated(&pods, "api").await;
    let out = kubectl(&["-n", &ns.name, "logs", "api"]);
    let out = output_text(&out);
    assert_eq!(code, 1, "the client's exit code: {out}");
    assert!(
        out.contains("Resource temporarily unavailable (os error 11)"),
        "the kubernetes Service did not lead to an accepting API server: {out}"
    );
}

/// `helm install` of the chart with our images on the real nodes: the operator (with its
/// in-cluster API access) and the migration agents and brokers run there; a
/// NodeAgentAttachment on real replicas starts our attach image; `helm upgrade` rolls; and
/// `helm uninstall` runs the pre-delete reap hook for real (the attachment Jobs are gone
/// afterwards, which only the hook does) and succeeds.
#[tokio::test]
async fn chart_installs_upgrades_and_uninstalls_on_the_real_nodes() {
    let Some(op) = TestNamespace::new("chart", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    let Some(app) = TestNamespace::new("chart-app", PodSecurity::Baseline).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let release = format!("pm{}", random_suffix());
    let agents = format!("{}-agents", op.name);
    let base = chart_args(&images, &op.name, &app.name, "podmotion-e2e");
    let mut common: Vec<&str> = base.iter().map(String::as_str).collect();
    common.extend_from_slice(&[
        "--take-ownership",
        "--force-conflicts",
        "--wait",
        "--timeout",
        "5m",
    ]);
    let mut args = vec!["install", release.as_str()];
    args.extend_from_slice(&common);
    let out = helm(&args);
    let uninstalled = Uninstall {
        release: release.clone(),
        namespace: op.name.clone(),
    };
    assert!(out.status.success(), "helm install: {}", output_text(&out));

    // The operator runs on a real node and is Ready: it reached the API server in-cluster
    // (CRDs established, Lease taken).
    let deploys: Api<Deployment> = op.api();
    let list = deploys.list(&ListParams::default()).await.unwrap();
    let operator = list.items.first().expect("the operator Deployment");
    assert_eq!(
        operator.status.as_ref().and_then(|s| s.ready_replicas),
        Some(1),
        "operator not Ready"
    );
    let op_pods: Api<Pod> = op.api();
    for p in op_pods.list(&ListParams::default()).await.unwrap() {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        assert!(
            nodes.contains(&node),
            "{} on {node}",
            p.metadata.name.unwrap_or_default()
        );
    }

    // One migration agent (agent + broker) Ready on every real node.
    let ds: Api<DaemonSet> = Api::namespaced(op.client.clone(), &agents);
    let list = ds.list(&ListParams::default()).await.unwrap();
    let agent = list.items.first().expect("the migration agent DaemonSet");
    let st = agent.status.as_ref().unwrap();
    assert_eq!(
        (st.desired_number_scheduled, st.number_ready),
        (nodes.len() as i32, nodes.len() as i32),
        "agents on {nodes:?}: {st:?}"
    );

    // A NodeAgentAttachment on two real replicas: one attach Job each, Running our image.
    let testload = images.testload().unwrap();
    let mark = format!("real-{}", random_suffix());
    let mut spec = json!({
        "containers": [{"name": "app", "image": testload, "args": ["serve", "8080"],
            "ports": [{"containerPort": 8080}],
            "env": [{"name": "PODMOTION_E2E_MARK", "value": mark}],
            "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}]
    });
    pin(&mut spec, &nodes[0]);
    spec.as_object_mut().unwrap().remove("nodeName");
    spec["nodeSelector"] = json!({"type": "real"});
    let web: Deployment = from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": spec}}
    }));
    app.api::<Deployment>()
        .create(&PostParams::default(), &web)
        .await
        .unwrap();
    let app_pods: Api<Pod> = app.api();
    wait_list(
        &app_pods,
        "app=web",
        POD_TIMEOUT,
        "two Ready web replicas",
        |ps| ps.iter().filter(|p| pod_running_ready(p)).count() == 2,
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let naa = json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": "web", "namespace": app.name},
        "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
    });
    kubectl_apply(&naa);
    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents);
    let attach_image = images.attach().unwrap();
    let running = attach_pods_running(&agent_pods, &attach_image, 2).await;
    assert_eq!(running.len(), 2);
    let before = app_containers(&app_pods).await;

    // Each agent, reached as a user reaches it (kubectl port-forward, the Job's token),
    // sees its replica: the environment, the files, intercepts and wiretaps real
    // traffic to the replica's pod IP, and the application is never restarted.
    let mut target_pids = vec![];
    for agent in &running {
        let target_uid = &agent.labels()[labels::TARGET_POD_UID];
        let (app_ip, _) = before
            .get(target_uid)
            .unwrap_or_else(|| panic!("no app pod with uid {target_uid}: {before:?}"));
        let pid = exercise_agent(&op.client, &app.name, agent, app_ip, &mark, &testload).await;
        target_pids.push(pid);
    }
    assert_eq!(
        app_containers(&app_pods).await,
        before,
        "the replicas' containers changed (restarted or replaced)"
    );

    // Deleting the attachment removes every Job and the redirect table in every replica.
    let out = kubectl(&[
        "delete",
        "naa",
        "web",
        "-n",
        &app.name,
        "--wait=true",
        "--timeout=120s",
    ]);
    assert!(
        out.status.success(),
        "delete attachment: {}",
        output_text(&out)
    );
    wait_list(
        &agent_pods,
        "batch.kubernetes.io/job-name",
        POD_TIMEOUT,
        "no attach Job pod left",
        |ps| ps.is_empty(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    for pid in &target_pids {
        let tables = nft_tables(*pid);
        assert!(
            !tables.contains("podmotion_agent"),
            "pid {pid} still has the agent's table: {tables}"
        );
    }
    // Attached again, for the uninstall hook below.
    kubectl_apply(&naa);
    attach_pods_running(&agent_pods, &attach_image, 2).await;

    // Upgrade: a changed value rolls the operator, and everything stays Ready.
    let mut args = vec!["upgrade", release.as_str()];
    args.extend_from_slice(&common[..common.len() - 3]);
    args.extend_from_slice(&[
        "--wait",
        "--timeout",
        "5m",
        "--set",
        "operator.concurrency=4",
    ]);
    let args: Vec<&str> = args
        .into_iter()
        .filter(|a| *a != "--take-ownership")
        .collect();
    let out = helm(&args);
    assert!(out.status.success(), "helm upgrade: {}", output_text(&out));
    // The upgrade rolled the operator: its template carries the new value, the rollout
    // is observed and complete, and the pods that run are the new template's.
    let operator = deploys
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .next()
        .expect("the operator Deployment");
    let args_now = operator
        .spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.args.clone())
        .unwrap_or_default();
    assert!(
        args_now.iter().any(|a| a == "--concurrency=4"),
        "the upgraded operator's args: {args_now:?}"
    );
    let st = operator.status.clone().unwrap_or_default();
    assert!(
        st.observed_generation >= operator.metadata.generation
            && st.updated_replicas == Some(1)
            && st.ready_replicas == Some(1)
            && st.replicas == Some(1),
        "the operator's rollout after the upgrade: {st:?}"
    );

    // Uninstall: the pre-delete hook (our operator image, `reap-all`) deletes every
    // attachment Job before the operator goes; uninstall fails if the hook fails.
    let out = helm(&[
        "uninstall",
        &release,
        "-n",
        &op.name,
        "--wait",
        "--timeout",
        "5m",
    ]);
    assert!(
        out.status.success(),
        "helm uninstall: {}",
        output_text(&out)
    );
    std::mem::forget(uninstalled);
    // What only the hook does: the attachment outlives the release (in the app's
    // namespace, which stays) without its finalizer. Uninstalling the operator leaves
    // the finalizer on, and the agents' namespace going takes its Jobs either way.
    let naas: Api<NodeAgentAttachment> = app.api();
    let web = naas
        .get_opt("web")
        .await
        .unwrap()
        .expect("the attachment outlives the release (the hook releases, never deletes)");
    assert!(
        !web.finalizers()
            .iter()
            .any(|f| f == finalizers::ATTACHMENT_CLEANUP),
        "the attachment still has {}: the reap hook did not run ({:?})",
        finalizers::ATTACHMENT_CLEANUP,
        web.finalizers()
    );
    let jobs: Api<Job> = Api::namespaced(op.client.clone(), &agents);
    let left = jobs
        .list(&ListParams::default().labels("podmotion.io/owner-kind=NodeAgentAttachment"))
        .await
        .unwrap()
        .items
        .len();
    assert_eq!(
        left, 0,
        "attachment Jobs left after uninstall: the reap hook did not run"
    );
}

/// `kubectl apply -f -` of one object.
fn kubectl_apply(obj: &serde_json::Value) {
    use std::io::Write;
    let mut child = Command::new(kubectl_path().unwrap())
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["apply", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(obj.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "kubectl apply: {}", output_text(&out));
}

/// Waits for `n` attach Job pods Running and Ready (their /healthz) with our image.
async fn attach_pods_running(agent_pods: &Api<Pod>, image: &str, n: usize) -> Vec<Pod> {
    let pods = wait_list(
        agent_pods,
        // Every Job pod in the agents' namespace is an attachment's.
        "batch.kubernetes.io/job-name",
        POD_TIMEOUT,
        "an attach Job pod Running and Ready (its /healthz) on each replica's node",
        |ps| {
            ps.iter()
                .filter(|p| {
                    pod_running_ready(p)
                        && p.spec
                            .as_ref()
                            .is_some_and(|s| s.containers[0].image.as_deref() == Some(image))
                })
                .count()
                == n
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    pods.into_iter().filter(pod_running_ready).collect()
}

/// The app pods by UID: pod IP, and each container's (ID, restart count).
async fn app_containers(pods: &Api<Pod>) -> BTreeMap<String, (String, Vec<(String, i32)>)> {
    pods.list(&ListParams::default().labels("app=web"))
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|p| {
            let st = p.status.clone().unwrap_or_default();
            let containers = st
                .container_statuses
                .unwrap_or_default()
                .into_iter()
                .map(|c| (c.container_id.unwrap_or_default(), c.restart_count))
                .collect();
            (
                p.uid().unwrap_or_default(),
                (st.pod_ip.unwrap_or_default(), containers),
            )
        })
        .collect()
}

/// One line to the testload server at `ip:8080` and its answer.
fn ask(ip: &str, line: &str) -> String {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::net::TcpStream::connect((ip, 8080)).expect("connect to the replica");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    writeln!(s, "{line}").unwrap();
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).unwrap();
    answer.trim_end().to_owned()
}

/// Drives one attach agent through its control API and returns its target's host PID:
/// the environment and files it reads are the replica's, its table is in the replica's
/// network namespace, an intercept takes a real connection to the replica's IP (and
/// stopping it gives the application its traffic back), a wiretap copies a request the
/// application still answers.
async fn exercise_agent(
    client: &kube::Client,
    app_ns: &str,
    agent: &Pod,
    app_ip: &str,
    mark: &str,
    testload: &str,
) -> u32 {
    use std::io::{BufRead, Read, Write};
    let name = agent.name_any();
    let job = &agent.labels()["batch.kubernetes.io/job-name"];
    // As a tenant reaches it: the credential in the workload's own namespace (named like
    // the Job), the control API on the target pod's loopback through a port-forward to
    // that pod.
    let secret = Api::<Secret>::namespaced(client.clone(), app_ns)
        .get(job)
        .await
        .unwrap();
    let data = secret.data.unwrap();
    let token = String::from_utf8(data["token"].0.clone()).unwrap();
    let control: u16 = String::from_utf8(data["port"].0.clone())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let target_uid = &agent.labels()[labels::TARGET_POD_UID];
    let target = Api::<Pod>::namespaced(client.clone(), app_ns)
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.uid().as_deref() == Some(target_uid.as_str()))
        .unwrap_or_else(|| panic!("{name}: no app pod with uid {target_uid}"))
        .name_any();
    let pf = PortForward::start(app_ns, &target, control).unwrap_or_else(|e| panic!("{e:#}"));
    let port = pf.local_port;
    // Wait until /healthz answers through the fresh port-forward.
    let mut tries = 0;
    while agent_call(port, "GET", "/healthz", "").is_err() {
        tries += 1;
        assert!(tries < 40, "{name}: no answer through kubectl port-forward");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let call = |method: &str, path: &str| {
        agent_call(port, method, path, &token).unwrap_or_else(|e| panic!("{name}: {e:#}"))
    };

    let (code, health) = call("GET", "/healthz");
    assert_eq!(code, 200, "{name} /healthz: {health}");
    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
    let pid = health["pid"].as_u64().expect("pid") as u32;
    assert!(
        health["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["port"] == 8080),
        "{health}"
    );
    // Unauthenticated calls are refused.
    assert_eq!(agent_call(port, "GET", "/v1/env", "wrong").unwrap().0, 401);

    let (code, env) = call("GET", "/v1/env");
    assert_eq!(code, 200, "{env}");
    let env: Vec<serde_json::Value> = serde_json::from_str(&env).unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"] == "PODMOTION_E2E_MARK" && e["value"] == mark),
        "{name}: the target's environment lacks its mark: {env:?}"
    );
    let (code, exports) = call("GET", "/v1/exports");
    assert_eq!(code, 200, "{exports}");
    let exports: serde_json::Value = serde_json::from_str(&exports).unwrap();
    let root = exports["exports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["container_path"] == "/")
        .unwrap_or_else(|| panic!("{exports}"));
    // Through the agent's pin of its target (an open /proc/<pid> directory), never a
    // re-resolved PID: /proc/<agent pid>/fd/<n>/root.
    let target = root["target"].as_str().unwrap();
    let parts: Vec<&str> = target.split('/').collect();
    assert!(
        matches!(parts.as_slice(), ["", "proc", a, "fd", n, "root"]
            if a.parse::<u32>().is_ok() && n.parse::<u32>().is_ok()),
        "{exports}"
    );
    let program = entrypoint(testload).unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{pid}/root{program}")).exists(),
        "the export's target does not hold the replica's {program}"
    );
    assert!(
        nft_tables(pid).contains("podmotion_agent"),
        "no agent table in pid {pid}'s netns"
    );

    // Intercept: a connection to the replica's IP reaches this client, not the app.
    assert_eq!(ask(app_ip, "echo before"), "before");
    let (code, body) = call("POST", "/v1/intercepts/8080");
    assert_eq!(code, 201, "{body}");
    let ip = app_ip.to_owned();
    let asker = std::thread::spawn(move || ask(&ip, "echo hello"));
    // The kubelet's readiness probe (a TCP connect to 8080) is intercepted too: take
    // connections until the one carrying our request arrives.
    let mut taken = None;
    for _ in 0..20 {
        let mut stream = agent_stream(port, "/v1/intercepts/8080/accept", &token)
            .unwrap_or_else(|e| panic!("{e:#}"));
        let mut meta = String::new();
        stream.read_line(&mut meta).unwrap();
        assert!(meta.contains("original_dst"), "{meta}");
        let mut request = String::new();
        stream.read_line(&mut request).unwrap();
        if request == "echo hello\n" {
            taken = Some(stream);
            break;
        }
    }
    let mut taken = taken.expect("our connection was never handed over");
    taken.get_mut().write_all(b"intercepted\n").unwrap();
    assert_eq!(asker.join().unwrap(), "intercepted");
    drop(taken);
    let (code, body) = call("DELETE", "/v1/intercepts/8080");
    assert!((200..300).contains(&code), "{code} {body}");
    assert_eq!(
        ask(app_ip, "echo after"),
        "after",
        "the app has its traffic back"
    );

    // Wiretap: the app answers, and the tap sees the request.
    let (code, body) = call("POST", "/v1/wiretaps/8080");
    assert!((200..300).contains(&code), "{code} {body}");
    let id = serde_json::from_str::<serde_json::Value>(&body).unwrap()["id"]
        .as_u64()
        .unwrap_or_else(|| panic!("{body}"));
    let mut tap = agent_stream(port, &format!("/v1/wiretaps/8080/{id}/stream"), &token)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(ask(app_ip, "echo tapped"), "tapped");
    let mut seen = Vec::new();
    loop {
        let mut head = [0u8; 9];
        tap.read_exact(&mut head).expect("a wiretap frame");
        let len = u32::from_be_bytes(head[5..9].try_into().unwrap()) as usize;
        let mut payload = vec![0; len];
        tap.read_exact(&mut payload).unwrap();
        if head[0] == 1 {
            seen.extend_from_slice(&payload);
            if seen.windows(11).any(|w| w == b"echo tapped") {
                break;
            }
        }
    }
    let (code, body) = call("DELETE", &format!("/v1/wiretaps/8080/{id}"));
    assert!((200..300).contains(&code), "{code} {body}");
    pid
}
