//! One cluster, two tenants (issue 41): each tenant's user holds only the chart's
//! plugin-user ClusterRole, bound by a RoleBinding in their own namespace — exactly the
//! rights docs/plugin.md ("Rights") tells an administrator to grant. Each uses
//! `kubectl podmotion intercept`, `env` and `cp` on their own workload through the real
//! nodes; every attempt on the other tenant's (the attachment, the agent's token, a
//! port-forward to its pod, anything in the agents' namespace) is refused by the API
//! server with a clear error, and even a cluster administrator who port-forwards into
//! the agents' namespace finds no control API and no token there.
//!
//! The plugin binary is found as in `tests/real_plugin.rs`; the operator is one release
//! per tenant namespace, helm-installed from our images (`hack/images.sh`) and
//! uninstalled after (the test fails next to a release that watches every namespace:
//! `podmotion_e2e::real::helm_install`).
//!
//! ```console
//! $ cargo build -p kubectl-podmotion
//! $ PODMOTION_IMAGES_VALUES=/tmp/podmotion-cluster/images-values.yaml \
//!   cargo test -p podmotion-e2e --test real_tenants -- --test-threads=1
//! ```

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret, Service};
use k8s_openapi::api::rbac::v1::{ClusterRole, RoleBinding};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::NodeAgentAttachment;
use podmotion_e2e::plugin::{kubectl_podmotion, plugin_bin};
use podmotion_e2e::real::{
    Images, REAL_NODE_TAINT, Uninstall, helm_install, output_text, real_nodes,
};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, kubeconfig_path, kubectl_path, pod_running_ready,
    random_suffix, wait_list, wait_until_allowed,
};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const POD_TIMEOUT: Duration = Duration::from_secs(240);

/// `kubectl podmotion <args> --as <user>` with the plugin first on `$PATH`.
fn plugin_as(bin: &Path, user: &str, args: &[&str]) -> Command {
    let mut cmd = kubectl_podmotion(bin, args);
    cmd.args(["--as", user]);
    cmd
}

fn run_as(bin: &Path, user: &str, args: &[&str]) -> Output {
    plugin_as(bin, user, args)
        .output()
        .expect("running kubectl podmotion")
}

/// Plain `kubectl <args> --as <user>`.
fn kubectl_as(user: &str, args: &[&str]) -> Output {
    Command::new(kubectl_path().expect("kubectl"))
        .env("KUBECONFIG", kubeconfig_path())
        .args(args)
        .args(["--as", user])
        .output()
        .expect("running kubectl")
}

/// One tenant: a namespace with one Ready testload replica carrying a value only this
/// tenant should ever see, a Service, and a user bound to the plugin-user ClusterRole
/// in this namespace only.
struct Tenant {
    _uninstall: Uninstall,
    _op: TestNamespace,
    ns: TestNamespace,
    user: String,
    mark: String,
    pod: Pod,
    svc_addr: String,
}

impl Tenant {
    async fn new(prefix: &str, images: &Images) -> Option<Tenant> {
        let ns = TestNamespace::new(prefix, PodSecurity::Baseline).await?;
        let nodes = real_nodes(&ns.client).await?;
        let op = TestNamespace::new(&format!("{prefix}-op"), PodSecurity::Restricted).await?;
        let release = format!("pm{}", random_suffix());
        let uninstall = helm_install(
            &release,
            images,
            &op.name,
            &ns.name,
            &format!("podmotion-e2e-{prefix}"),
            &[],
        );
        let mark = format!("{prefix}-secret-{}", random_suffix());
        let d: Deployment = from_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "app"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "app"}},
                "template": {"metadata": {"labels": {"app": "app"}}, "spec": {
                    "nodeSelector": {"type": "real"},
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "preference": {"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": [nodes[0]]}]}}]}},
                    "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                    "enableServiceLinks": false,
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "app", "image": images.testload().unwrap(),
                        "args": ["serve", "8080", "1"],
                        "env": [{"name": "TENANT_MARK", "value": mark}],
                        "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2}}]}}}
        }));
        ns.api::<Deployment>()
            .create(&PostParams::default(), &d)
            .await
            .unwrap();
        let svc: Service = from_json(json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "app"},
            "spec": {"selector": {"app": "app"}, "ports": [{"port": 8080}]}
        }));
        let svc = ns
            .api::<Service>()
            .create(&PostParams::default(), &svc)
            .await
            .unwrap();
        let svc_addr = format!("{}:8080", svc.spec.unwrap().cluster_ip.unwrap());
        let pods: Api<Pod> = ns.api();
        let ready = wait_list(&pods, "app=app", POD_TIMEOUT, "the replica Ready", |ps| {
            ps.len() == 1 && pod_running_ready(&ps[0])
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        let user = format!("{prefix}-user-{}", random_suffix());
        bind_plugin_user(&ns, &user).await;
        Some(Tenant {
            _uninstall: uninstall,
            _op: op,
            pod: ready[0].clone(),
            ns,
            user,
            mark,
            svc_addr,
        })
    }

    fn name(&self) -> &str {
        &self.ns.name
    }
}

/// Binds `user` to the chart's plugin-user ClusterRole (the one of the release that
/// serves this namespace) by a RoleBinding in `ns`, and waits until it is in force.
async fn bind_plugin_user(ns: &TestNamespace, user: &str) {
    let roles: Api<ClusterRole> = Api::all(ns.client.clone());
    let all = roles
        .list(&ListParams::default().labels("app.kubernetes.io/component=plugin-user"))
        .await
        .unwrap();
    // With a release per namespace there are several: any grants the same rules.
    let role = all
        .items
        .first()
        .expect("the chart's plugin-user ClusterRole (charts/podmotion/templates/plugin-user-rbac.yaml)")
        .name_any();
    let binding: RoleBinding = from_json(json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }));
    ns.api::<RoleBinding>()
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
    wait_until_allowed(&ns.client, user, Some(&ns.name), "", "pods", "get")
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
}

fn ask(addr: &str, line: &str) -> std::io::Result<String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    Ok(answer.trim_end().to_owned())
}

fn reachable(addr: &str) {
    let a: std::net::SocketAddr = addr.parse().unwrap();
    for _ in 0..120 {
        if std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!("{addr} never accepted a connection");
}

/// A local server answering `echo X` with `local X`.
fn local_line_server() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                use std::io::Write;
                let mut w = s.try_clone().unwrap();
                for line in BufReader::new(s).lines().map_while(Result::ok) {
                    let reply = match line.split_once(' ') {
                        Some(("echo", x)) => format!("local {x}"),
                        _ => "?".into(),
                    };
                    if writeln!(w, "{reply}").is_err() {
                        break;
                    }
                }
            });
        }
    });
    port
}

/// `intercept deploy/app --port 8080:<local>` as the tenant's user, until its agents
/// intercept: the child and its stdout lines.
fn start_intercept(bin: &Path, t: &Tenant, local: u16) -> (std::process::Child, Vec<String>) {
    let port = format!("8080:{local}");
    let mut child = plugin_as(
        bin,
        &t.user,
        &["intercept", "deploy/app", "--port", &port, "-n", t.name()],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawning kubectl podmotion intercept");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let mut seen = vec![];
    loop {
        match rx.recv_timeout(POD_TIMEOUT) {
            Ok(l) => {
                let done = l.contains("intercepting every connection");
                seen.push(l);
                if done {
                    return (child, seen);
                }
            }
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let mut err = String::new();
                if let Some(mut s) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut s, &mut err);
                }
                panic!("intercept as {} never ran ({e}): {seen:#?}\n{err}", t.user);
            }
        }
    }
}

fn stop(mut child: std::process::Child) {
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "Ctrl-C ends the intercept cleanly");
}

/// Asserts the output failed and says the user may not do `verb resource` in `ns`.
fn refused(out: &Output, what: &str, verb: &str, resource: &str, ns: &str) {
    let text = output_text(out);
    eprintln!("{what}:\n{text}");
    assert!(!out.status.success(), "{what} succeeded: {text}");
    let plugin = format!("you may not {verb} {resource} in namespace {ns}");
    let kubectl = "forbidden";
    assert!(
        text.contains(&plugin) || (text.contains(kubectl) && text.contains(ns)),
        "{what}: not a clear refusal naming {verb} {resource} in {ns}: {text}"
    );
}

/// `kubectl auth can-i <verb> <resource> [--subresource] -n <ns> --as <user>` says no.
fn assert_cannot(user: &str, verb: &str, resource: &str, sub: Option<&str>, ns: &str) {
    let sub = sub.map(|s| format!("--subresource={s}"));
    let mut args = vec!["auth", "can-i", verb, resource, "-n", ns];
    if let Some(s) = &sub {
        args.push(s);
    }
    let out = kubectl_as(user, &args);
    let text = output_text(&out);
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "no",
        "{user} may {verb} {resource} {sub:?} in {ns}: {text}"
    );
}

/// Each tenant uses intercept, env and cp on their own workload with only the
/// documented rights; every way into the other tenant's agent is refused.
#[tokio::test]
async fn each_tenant_uses_its_own_agents_and_cannot_reach_the_others() {
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let Some(a) = Tenant::new("tenant-a", &images).await else {
        return;
    };
    let Some(b) = Tenant::new("tenant-b", &images).await else {
        return;
    };
    let bin = plugin_bin();
    let admin = a.ns.client.clone();

    // 1. Each uses `env` on their own workload: their own value, read from the container.
    for t in [&a, &b] {
        let out = run_as(&bin, &t.user, &["env", "deploy/app", "-n", t.name()]);
        let text = output_text(&out);
        assert!(out.status.success(), "{} env: {text}", t.user);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("TENANT_MARK={}", t.mark)),
            "{stdout}"
        );
    }

    // 2. `cp` of their own pod's /etc/hostname.
    let dir = std::env::temp_dir().join(format!("pm-tenants-{}", random_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let dest = dir.join("hostname");
    let out = run_as(
        &bin,
        &a.user,
        &[
            "cp",
            "deploy/app:/etc/hostname",
            dest.to_str().unwrap(),
            "-n",
            a.name(),
        ],
    );
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        std::fs::read_to_string(&dest).unwrap().trim(),
        a.pod.name_any()
    );
    std::fs::remove_dir_all(&dir).unwrap();

    // 3. B intercepts its own workload: traffic to B's Service reaches B's local server.
    reachable(&b.svc_addr);
    let local = local_line_server();
    let (b_intercept, seen) = start_intercept(&bin, &b, local);
    assert_eq!(ask(&b.svc_addr, "echo b").unwrap(), "local b", "{seen:#?}");

    // 4. While B's agent runs, A tries every way in, each refused by the API server.
    let naa =
        b.ns.api::<NodeAgentAttachment>()
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .next()
            .expect("B's attachment");
    let target = naa.status.as_ref().unwrap().targets[0].clone();
    // a. The plugin on B's workload.
    refused(
        &run_as(&bin, &a.user, &["env", "deploy/app", "-n", b.name()]),
        "A's env on B's workload",
        "list",
        "nodeagentattachments.podmotion.io",
        b.name(),
    );
    refused(
        &run_as(
            &bin,
            &a.user,
            &[
                "intercept",
                "deploy/app",
                "--port",
                "8080:1",
                "-n",
                b.name(),
                "--timeout",
                "20s",
            ],
        ),
        "A's intercept of B's workload",
        "list",
        "nodeagentattachments.podmotion.io",
        b.name(),
    );
    // b. B's agent's token, a port-forward to B's pod, an attachment in B's namespace:
    //    the API server's own verdict for A, and an actual read of the token refused.
    refused(
        &kubectl_as(
            &a.user,
            &["get", "secret", &target.job, "-n", b.name(), "-o", "name"],
        ),
        "A reading B's agent token",
        "get",
        "secrets",
        b.name(),
    );
    for (verb, resource, sub) in [
        ("get", "secrets", None),
        ("create", "pods", Some("portforward")),
        ("create", "nodeagentattachments.podmotion.io", None),
        ("get", "pods", None),
    ] {
        assert_cannot(&a.user, verb, resource, sub, b.name());
    }
    // d. The agents' namespace: A has no right there, and it holds nothing of B's
    //    credential — only the token's SHA-256 on the Job's pod template.
    let jobs: Api<Job> = Api::all(admin.clone());
    let job = jobs
        .list(&ListParams::default().fields(&format!("metadata.name={}", target.job)))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|j| {
            j.labels()
                .get(podmotion_api::names::labels::TARGET_NAMESPACE)
                == Some(&b.name().to_string())
        })
        .expect("B's agent Job");
    let agents_ns = job.namespace().unwrap();
    refused(
        &kubectl_as(&a.user, &["get", "secrets", "-n", &agents_ns, "-o", "name"]),
        "A listing the agents' namespace's Secrets",
        "list",
        "secrets",
        &agents_ns,
    );
    for (verb, resource, sub) in [
        ("list", "secrets", None),
        ("list", "pods", None),
        ("create", "pods", Some("portforward")),
    ] {
        assert_cannot(&a.user, verb, resource, sub, &agents_ns);
        // B's own user has no more there than A.
        assert_cannot(&b.user, verb, resource, sub, &agents_ns);
    }
    let agent_secrets: Api<Secret> = Api::namespaced(admin.clone(), &agents_ns);
    assert!(
        agent_secrets.get_opt(&target.job).await.unwrap().is_none(),
        "no token Secret in the agents' namespace"
    );
    let token_secret: Api<Secret> = Api::namespaced(admin.clone(), b.name());
    let secret = token_secret
        .get(&target.job)
        .await
        .expect("B's token, beside B's workload");
    let token = String::from_utf8(secret.data.unwrap()["token"].0.clone()).unwrap();
    let template = serde_json::to_string(&job.spec.as_ref().unwrap().template).unwrap();
    assert!(
        !template.contains(&token),
        "the Job never carries the token"
    );
    // e. Even a cluster administrator port-forwarding to the agent's Job pod, with the
    //    right token, finds only /healthz there: the control API is not served in the
    //    agents' namespace.
    let agent_pods: Api<Pod> = Api::namespaced(admin.clone(), &agents_ns);
    let agent_pod = agent_pods
        .list(
            &ListParams::default().labels(&format!("batch.kubernetes.io/job-name={}", target.job)),
        )
        .await
        .unwrap()
        .items
        .into_iter()
        .find(pod_running_ready)
        .expect("B's agent pod");
    let answer = http_through_port_forward(
        &agent_pods,
        &agent_pod.name_any(),
        8400,
        &format!(
            "GET /v1/env HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 404"), "{answer}");
    // And B's own user, through B's pod, still has it (the same call the plugin makes).
    let b_pods: Api<Pod> = Api::namespaced(admin.clone(), b.name());
    let port: u16 = String::from_utf8_lossy(&secret_port(&token_secret, &target.job).await)
        .parse()
        .unwrap();
    let answer = http_through_port_forward(
        &b_pods,
        &target.pod,
        port,
        &format!(
            "GET /v1/env HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(&b.mark), "{answer}");
    assert!(!answer.contains(&a.mark), "{answer}");

    // 5. A intercepts its own workload meanwhile; both intercepts run side by side.
    reachable(&a.svc_addr);
    let local_a = local_line_server();
    let (a_intercept, seen) = start_intercept(&bin, &a, local_a);
    assert_eq!(ask(&a.svc_addr, "echo a").unwrap(), "local a", "{seen:#?}");
    assert_eq!(ask(&b.svc_addr, "echo b2").unwrap(), "local b2");
    stop(a_intercept);
    stop(b_intercept);
    assert_eq!(ask(&a.svc_addr, "echo after").unwrap(), "after");
    assert_eq!(ask(&b.svc_addr, "echo after").unwrap(), "after");
}

/// The `port` of an agent credential Secret.
async fn secret_port(secrets: &Api<Secret>, name: &str) -> Vec<u8> {
    secrets.get(name).await.unwrap().data.unwrap()["port"]
        .0
        .clone()
}

/// One HTTP/1.1 exchange with `pod:port` through the API server's port-forward (as the
/// test's administrator); the whole answer as text.
async fn http_through_port_forward(pods: &Api<Pod>, pod: &str, port: u16, request: &str) -> String {
    let mut pf = pods.portforward(pod, &[port]).await.expect("port-forward");
    let mut s = pf.take_stream(port).expect("the stream");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await;
    drop(s);
    let _ = pf.join().await;
    String::from_utf8_lossy(&out).into_owned()
}
