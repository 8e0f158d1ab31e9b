//! `kubectl podmotion` (the `kubectl-podmotion` crate, issue 22) driven as a user drives
//! it: `kubectl podmotion …` with the plugin on `$PATH` and the user's `$KUBECONFIG`,
//! against the real nodes and the chart installed from our images.
//!
//! The plugin binary: `CARGO_BIN_EXE_*` only exists for binaries of this crate, so build
//! it first with `cargo build -p kubectl-podmotion` (same `CARGO_TARGET_DIR`); the test
//! takes `kubectl-podmotion` from the target directory it runs from and refuses it when
//! it is older than the plugin's sources. `PODMOTION_PLUGIN_BIN` overrides the path.
//!
//! The operator: each test helm-installs its own release from our images, scoped to the
//! test's namespace, as `tests/real_migration.rs` does, and uninstalls it after. Next to
//! a release that watches every namespace (`hack/install.sh`'s, the demo's) it fails,
//! naming that release: the two would race for the test's objects, and the test could
//! pass on the other release's images (`podmotion_e2e::real::helm_install`).
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::migration::MigrationPhase;
use podmotion_api::{NodeAgentAttachment, PodMigration};
use podmotion_e2e::plugin::{kubectl_podmotion, plugin_bin, spawn_lines};
use podmotion_e2e::real::{
    Images, REAL_NODE_TAINT, Uninstall, helm_install, output_text, real_nodes,
};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_for, wait_list,
};
use serde_json::json;

const POD_TIMEOUT: Duration = Duration::from_secs(240);

fn run(bin: &std::path::Path, args: &[&str]) -> Output {
    kubectl_podmotion(bin, args)
        .output()
        .expect("running kubectl podmotion")
}

/// The test's world: the app namespace with one Ready testload pod on a real node, the
/// real nodes, and the guards that clean up. Fields drop in declaration order: the
/// release goes first, so its operator cannot re-add finalizers the app namespace's
/// cleanup strips.
struct World {
    _uninstall: Uninstall,
    _op: TestNamespace,
    app: TestNamespace,
    nodes: Vec<String>,
    pod: Pod,
}

impl World {
    async fn new(prefix: &str) -> Option<World> {
        let app = TestNamespace::new(prefix, PodSecurity::Baseline).await?;
        let nodes = real_nodes(&app.client).await?;
        assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
        let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
        let op = TestNamespace::new("plugin-op", PodSecurity::Restricted).await?;
        let release = format!("pm{}", random_suffix());
        let uninstall = helm_install(
            &release,
            &images,
            &op.name,
            &app.name,
            "podmotion-e2e-plugin",
            &[],
        );
        // A testload server on the first real node (preferred, not required, so the
        // target pod may be placed elsewhere), as uid 0: see docs/migration-controller.md.
        let testload = images.testload().unwrap();
        let d: Deployment = from_json(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "mover"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "mover"}},
                "template": {"metadata": {"labels": {"app": "mover"}}, "spec": {
                    "nodeSelector": {"type": "real"},
                    "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 100, "preference": {"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": [nodes[0]]}]}}]}},
                    "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                    "enableServiceLinks": false,
                    "automountServiceAccountToken": false,
                    "terminationGracePeriodSeconds": 2,
                    "containers": [{"name": "app", "image": testload,
                        "args": ["serve", "8080", "16"],
                        // Read back by `kubectl podmotion env` (quoted: a space and a `$`).
                        "env": [{"name": "PLUGIN_MARK", "value": "mark with $pace"}],
                        "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                        "ports": [{"containerPort": 8080}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2}}]}}}
        }));
        app.api::<Deployment>()
            .create(&PostParams::default(), &d)
            .await
            .unwrap();
        let pods: Api<Pod> = app.api();
        let ready = wait_list(&pods, "app=mover", POD_TIMEOUT, "the replica Ready", |ps| {
            ps.len() == 1 && pod_running_ready(&ps[0])
        })
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        Some(World {
            app,
            nodes,
            pod: ready[0].clone(),
            _op: op,
            _uninstall: uninstall,
        })
    }

    fn pod_node(&self) -> String {
        self.pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default()
    }

    fn other_real_node(&self) -> String {
        let here = self.pod_node();
        self.nodes.iter().find(|n| **n != here).unwrap().clone()
    }
}

/// `kubectl podmotion migrate <pod> --mode Cold` moves the pod to another real node:
/// exit code 0, a downtime line, the PodMigration it created is `Succeeded` with the
/// same downtime, and `kubectl podmotion status` lists it with that downtime and
/// nothing needing attention.
#[tokio::test]
async fn migrate_through_the_plugin_succeeds_and_prints_the_downtime() {
    let Some(w) = World::new("plugin-mig").await else {
        return;
    };
    let bin = plugin_bin();
    let pod = w.pod.name_any();
    let target = w.other_real_node();
    let name = format!("plugin-{}", random_suffix());
    let out = run(
        &bin,
        &[
            "migrate",
            &pod,
            "-n",
            &w.app.name,
            "--mode",
            "Cold",
            "--to",
            &target,
            "--name",
            &name,
            "--timeout",
            "5m",
            // A Cold freeze spans the whole dump and copy: as in real_migration.rs.
            "--freeze-budget-millis",
            "20000",
        ],
    );
    let text = output_text(&out);
    eprintln!("kubectl podmotion migrate:\n{text}");
    assert!(out.status.success(), "exit {:?}: {text}", out.status.code());
    let pm = w
        .app
        .api::<PodMigration>()
        .get(&name)
        .await
        .unwrap_or_else(|e| panic!("the plugin's PodMigration {name}: {e}"));
    let st = pm.status.expect("status");
    assert_eq!(st.phase, MigrationPhase::Succeeded, "{st:?}");
    assert_eq!(pm.spec.pod_name, pod);
    assert_eq!(
        pm.spec.pod_uid, w.pod.metadata.uid,
        "the plugin pins the pod's UID"
    );
    let downtime = st.downtime.clone().expect("status.downtime");
    assert!(
        text.lines()
            .any(|l| l.ends_with(&format!("downtime: {downtime}"))),
        "no `downtime: {downtime}` line: {text}"
    );
    assert!(
        text.lines().filter(|l| l.contains("] phase ")).count() >= 2,
        "phase changes are shown: {text}"
    );
    assert!(
        text.contains("network: "),
        "the network outcome is shown: {text}"
    );
    assert!(
        text.contains(&format!("-> {target}")),
        "the target node is shown: {text}"
    );

    let out = run(&bin, &["status", "-n", &w.app.name]);
    let table = output_text(&out);
    eprintln!("kubectl podmotion status:\n{table}");
    assert!(out.status.success(), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains(&format!("pmig/{name}")))
        .unwrap_or_else(|| panic!("status does not list pmig/{name}:\n{table}"));
    assert!(row.contains("Succeeded"), "{row}");
    assert!(row.contains(&format!("downtime {downtime}")), "{row}");
    assert!(
        row.trim_end().ends_with(" -"),
        "nothing needs attention: {row}"
    );
}

/// A migration that cannot start — the target node has no migration agent — is shown
/// as waiting with the operator's Stalled message; Ctrl-C leaves the PodMigration and
/// the plugin exits 130 naming `migrate-cancel`, which deletes it (the operator's
/// finalizer rolls back) and exits 0 once it is gone. Meanwhile `status` flags it in
/// the ATTENTION column with the same message.
#[tokio::test]
async fn ctrl_c_on_a_stalled_migration_leaves_it_and_migrate_cancel_rolls_it_back() {
    let Some(w) = World::new("plugin-int").await else {
        return;
    };
    let bin = plugin_bin();
    // A kwok node: it never runs a migration agent.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(w.app.client.clone());
    let no_agent = nodes
        .list(&ListParams::default().labels("type=kwok"))
        .await
        .unwrap()
        .items
        .first()
        .map(|n| n.name_any())
        .expect("a kwok node (hack/cluster.sh starts pm-node-*)");
    let name = format!("plugin-{}", random_suffix());
    let pod = w.pod.name_any();
    let (mut child, rx) = spawn_lines(
        &bin,
        &[
            "migrate",
            &pod,
            "-n",
            &w.app.name,
            "--mode",
            "Cold",
            "--to",
            &no_agent,
            "--name",
            &name,
        ],
    );
    let mut seen = vec![];
    let stalled = loop {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(l) => {
                let hit = l.contains("stalled: ");
                seen.push(l.clone());
                if hit {
                    break l;
                }
            }
            Err(e) => {
                let _ = child.kill();
                panic!("no `stalled:` line ({e}); so far: {seen:#?}");
            }
        }
    };
    let message = stalled.split("stalled: ").nth(1).unwrap().to_owned();

    let out = run(&bin, &["status", "-n", &w.app.name]);
    let table = output_text(&out);
    let row = table
        .lines()
        .find(|l| l.contains(&format!("pmig/{name}")))
        .unwrap_or_else(|| panic!("status does not list pmig/{name}:\n{table}"));
    assert!(
        row.contains(&format!("Stalled: {message}")),
        "ATTENTION shows the Stalled condition `{message}`: {row}"
    );

    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    // Every line up to the end of its stdout (the reader thread ends there).
    seen.extend(rx.iter());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(130), "{seen:#?}\n{err}");
    // As virtctl: Ctrl-C ends the watching, not the migration, and names the cancel.
    let cancel = format!("kubectl podmotion migrate-cancel {name} -n {}", w.app.name);
    assert!(seen.iter().any(|l| l.ends_with(&cancel)), "{seen:#?}");
    let pms: Api<PodMigration> = w.app.api();
    let pm = pms
        .get(&name)
        .await
        .expect("Ctrl-C leaves the PodMigration");
    assert!(
        pm.metadata.deletion_timestamp.is_none(),
        "not being deleted"
    );

    // The cancel: the operator's finalizer rolls it back; the plugin waits for it.
    let out = run(&bin, &["migrate-cancel", &name, "-n", &w.app.name]);
    let said = output_text(&out);
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("is gone"), "{said}");
    wait_for(
        &pms,
        &name,
        Duration::from_secs(5),
        "the PodMigration gone",
        |m| m.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("the plugin said it was gone: {e:#}"));
}

/// Errors a person can act on, from the real API server: a user who may read pods but
/// not create PodMigrations is told the verb, the resource, the namespace and what to
/// ask for; a pod that does not exist is named; `status` without list rights says which
/// kinds it could not list. No operator or real node needed: the plugin stops before.
#[tokio::test]
async fn missing_rights_and_a_missing_pod_are_said_plainly() {
    let Some(ns) = TestNamespace::new("plugin-rbac", PodSecurity::Baseline).await else {
        return;
    };
    let bin = plugin_bin();
    let user = format!("plugin-user-{}", random_suffix());
    podmotion_e2e::grant_user(
        &ns,
        &user,
        json!([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    // A pod to name; a kwok node runs it (the plugin only reads it here).
    let pod: Pod = from_json(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web-0"},
        "spec": {"nodeName": "pm-node-0", "containers": [{"name": "app", "image": "example.invalid/app:1"}]}
    }));
    ns.api::<Pod>()
        .create(&PostParams::default(), &pod)
        .await
        .unwrap();

    let out = run(&bin, &["migrate", "web-0", "-n", &ns.name, "--as", &user]);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "you may not create podmigrations.podmotion.io in namespace {}: ask",
            ns.name
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "kubectl auth can-i create podmigrations.podmotion.io -n {}",
            ns.name
        )),
        "{text}"
    );

    let out = run(&bin, &["migrate", "no-such-pod", "-n", &ns.name]);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "pod no-such-pod not found in namespace {}",
            ns.name
        )),
        "{text}"
    );

    let out = run(&bin, &["status", "-n", &ns.name, "--as", &user]);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    for kind in [
        "podmigrations.podmotion.io",
        "nodeagentattachments.podmotion.io",
        "runnerpools.podmotion.io",
    ] {
        assert!(
            text.contains(&format!("you may not list {kind} in namespace {}", ns.name)),
            "{kind}: {text}"
        );
    }
}

/// One line to a testload-protocol server at `addr` and its answer.
fn ask(addr: &str, line: &str) -> std::io::Result<String> {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    Ok(answer.trim_end().to_owned())
}

/// A local server standing in for the developer's process: answers `echo X` with
/// `local X` on every connection and reports each line it received.
fn local_line_server() -> (u16, mpsc::Receiver<String>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for s in l.incoming().map_while(Result::ok) {
            let tx = tx.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let mut w = s.try_clone().unwrap();
                for line in BufReader::new(s).lines().map_while(Result::ok) {
                    let reply = match line.split_once(' ') {
                        Some(("echo", x)) => format!("local {x}"),
                        _ => "?".into(),
                    };
                    let _ = tx.send(line);
                    if writeln!(w, "{reply}").is_err() {
                        break;
                    }
                }
            });
        }
    });
    (port, rx)
}

/// Reads the plugin's stdout lines on a thread.
fn lines_of(child: &mut std::process::Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            eprintln!("plugin: {l}");
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

/// `kubectl podmotion intercept WORKLOAD --port 8080:LOCAL [EXTRA…] -n NAMESPACE` in the
/// background, its stdout read line by line ([`lines_of`]).
fn spawn_intercept(
    bin: &std::path::Path,
    workload: &str,
    local: u16,
    extra: &[&str],
    namespace: &str,
) -> (std::process::Child, mpsc::Receiver<String>) {
    let port = format!("8080:{local}");
    let mut args = vec!["intercept", workload, "--port", &port];
    args.extend_from_slice(extra);
    args.extend(["-n", namespace]);
    let mut child = kubectl_podmotion(bin, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kubectl podmotion intercept");
    let rx = lines_of(&mut child);
    (child, rx)
}

/// Waits for a line containing `what`; kills the child and fails otherwise.
fn wait_line(
    child: &mut std::process::Child,
    rx: &mpsc::Receiver<String>,
    what: &str,
    seen: &mut Vec<String>,
) -> String {
    loop {
        match rx.recv_timeout(POD_TIMEOUT) {
            Ok(l) => {
                seen.push(l.clone());
                if l.contains(what) {
                    return l;
                }
            }
            Err(e) => {
                let _ = child.kill();
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("no line with {what:?} ({e}); so far: {seen:#?}\nstderr: {err}");
            }
        }
    }
}

/// `kubectl podmotion intercept deploy/mover --port 8080:LOCAL`: the plugin creates the
/// attachment, shows the agents coming up, and a request sent to the workload's Service
/// reaches the local server, whose answer goes back to the caller; a replica added
/// meanwhile is intercepted too once its agent runs. Ctrl-C stops the
/// intercept (the application answers again), deletes the attachment it created and
/// exits 0; no NodeAgentAttachment is left.
#[tokio::test]
async fn intercept_delivers_service_traffic_to_a_local_port_and_ctrl_c_leaves_nothing() {
    let Some(w) = World::new("plugin-icp").await else {
        return;
    };
    let bin = plugin_bin();
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "mover"},
        "spec": {"selector": {"app": "mover"}, "ports": [{"port": 8080}]}
    }));
    let svc = w
        .app
        .api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let svc_addr = format!("{}:8080", svc.spec.unwrap().cluster_ip.unwrap());
    service_reachable(&svc_addr);
    assert_eq!(ask(&svc_addr, "echo before").unwrap(), "before");
    let (local, received) = local_line_server();

    let (mut child, rx) = spawn_intercept(&bin, "deploy/mover", local, &[], &w.app.name);
    let mut seen = vec![];
    let created = wait_line(&mut child, &rx, "created in namespace", &mut seen);
    let name = created
        .split("nodeagentattachment.podmotion.io/")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{created}"))
        .to_owned();
    wait_line(&mut child, &rx, "intercepting every connection", &mut seen);
    assert!(
        seen.iter().any(|l| l.contains("agents 1/1 ready")),
        "the agents' progress is shown: {seen:#?}"
    );

    // Through the Service: the local server answers, and saw the request.
    let answer = ask(&svc_addr, "echo hello").unwrap();
    assert_eq!(answer, "local hello", "{seen:#?}");
    let got: Vec<String> = received.try_iter().collect();
    assert!(got.contains(&"echo hello".to_string()), "{got:?}");

    // A second replica: the plugin follows the attachment and intercepts there too.
    let deploys: Api<Deployment> = w.app.api();
    deploys
        .patch(
            "mover",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"replicas": 2}})),
        )
        .await
        .unwrap();
    let joined = wait_line(&mut child, &rx, "joined: intercepting there too", &mut seen);
    let pods: Api<Pod> = w.app.api();
    let second = pods
        .list(&ListParams::default().labels("app=mover"))
        .await
        .unwrap()
        .items
        .into_iter()
        .find(|p| p.name_any() != w.pod.name_any())
        .expect("the second replica");
    assert!(joined.contains(&second.name_any()), "{joined}");
    let second_addr = format!(
        "{}:8080",
        second.status.as_ref().unwrap().pod_ip.clone().unwrap()
    );
    assert_eq!(ask(&second_addr, "echo two").unwrap(), "local two");

    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    seen.extend(rx.iter());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{seen:#?}\n{err}");
    assert!(
        seen.iter()
            .any(|l| l.contains(&format!("nodeagentattachment.podmotion.io/{name} is gone"))),
        "{seen:#?}"
    );
    let left = w
        .app
        .api::<NodeAgentAttachment>()
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "attachments left after Ctrl-C: {:?}",
        left.items.iter().map(|a| a.name_any()).collect::<Vec<_>>()
    );
    assert_eq!(
        ask(&svc_addr, "echo after").unwrap(),
        "after",
        "the application answers again"
    );
}

/// The test-only HTTP server image (`podmotion-runner-standin`: `/healthz`, `/report`,
/// `404 not found` otherwise, each answer with `Connection: close`), from the list of
/// images hack/images.sh printed.
fn http_app_image() -> String {
    podmotion_e2e::real::runner::standin_image()
}

/// A local keep-alive HTTP server standing in for the developer's process: answers
/// every request with `200` and `local <path>`, and reports each request line.
fn local_http_server() -> (u16, mpsc::Receiver<String>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for s in l.incoming().map_while(Result::ok) {
            let tx = tx.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let mut w = s.try_clone().unwrap();
                let mut r = BufReader::new(s);
                loop {
                    let mut request_line = String::new();
                    if r.read_line(&mut request_line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                            break;
                        }
                    }
                    let path = request_line
                        .split_whitespace()
                        .nth(1)
                        .unwrap_or("?")
                        .to_owned();
                    let _ = tx.send(request_line.trim_end().to_owned());
                    let body = format!("local {path}");
                    if write!(
                        w,
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    )
                    .is_err()
                    {
                        return;
                    }
                }
            });
        }
    });
    (port, rx)
}

/// Reads one HTTP response framed by Content-Length: (status line, body).
fn read_http_response(r: &mut BufReader<std::net::TcpStream>) -> (String, String) {
    let mut status = String::new();
    r.read_line(&mut status).expect("a response");
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h == "\r\n" || h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0; len];
    std::io::Read::read_exact(r, &mut body).unwrap();
    (
        status.trim_end().to_owned(),
        String::from_utf8_lossy(&body).into_owned(),
    )
}

/// `kubectl podmotion intercept deploy/web --port 8080:LOCAL --header X-Dev=me`: on one
/// keep-alive connection to the Service, the request carrying the header is answered
/// by the local server and the next one, without it, by the application; the local
/// server never sees the second. Ctrl-C leaves no attachment. Needs an attach image
/// with filtered intercepts (the plugin refuses an older agent).
#[tokio::test]
async fn filtered_intercept_sends_only_matching_requests_to_the_local_server() {
    let Some(w) = World::new("plugin-hdr").await else {
        return;
    };
    let bin = plugin_bin();
    let d: Deployment = from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                "nodeSelector": {"type": "real"},
                "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                "enableServiceLinks": false,
                "automountServiceAccountToken": false,
                "terminationGracePeriodSeconds": 2,
                "containers": [{"name": "app", "image": http_app_image(),
                    "env": [{"name": "COMPASS_METRICS_ADDR", "value": ":8080"}],
                    "ports": [{"containerPort": 8080}],
                    "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2}}]}}}
    }));
    w.app
        .api::<Deployment>()
        .create(&PostParams::default(), &d)
        .await
        .unwrap();
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080}]}
    }));
    let svc = w
        .app
        .api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();
    let svc_addr = format!("{}:8080", svc.spec.unwrap().cluster_ip.unwrap());
    let pods: Api<Pod> = w.app.api();
    wait_list(
        &pods,
        "app=web",
        POD_TIMEOUT,
        "the web replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    service_reachable(&svc_addr);
    let (local, received) = local_http_server();

    let (mut child, rx) = spawn_intercept(
        &bin,
        "deploy/web",
        local,
        &["--header", "X-Dev=me"],
        &w.app.name,
    );
    let mut seen = vec![];
    wait_line(
        &mut child,
        &rx,
        "intercepting HTTP requests with X-Dev: me",
        &mut seen,
    );

    // One keep-alive connection through the Service, two requests.
    let conn = std::net::TcpStream::connect(&svc_addr).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut wr = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    use std::io::Write;
    write!(wr, "GET /mine HTTP/1.1\r\nHost: web\r\nX-Dev: me\r\n\r\n").unwrap();
    assert_eq!(
        read_http_response(&mut r),
        ("HTTP/1.1 200 OK".to_string(), "local /mine".to_string()),
        "{seen:#?}"
    );
    write!(wr, "GET /theirs HTTP/1.1\r\nHost: web\r\n\r\n").unwrap();
    assert_eq!(
        read_http_response(&mut r),
        (
            "HTTP/1.1 404 Not Found".to_string(),
            "not found\n".to_string()
        ),
        "the application answers the request without the header"
    );
    let got: Vec<String> = received.try_iter().collect();
    assert_eq!(
        got,
        ["GET /mine HTTP/1.1"],
        "only the matching request reached the local server"
    );

    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    seen.extend(rx.iter());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{seen:#?}\n{err}");
    let left = w
        .app
        .api::<NodeAgentAttachment>()
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(left.items.is_empty(), "attachments left after Ctrl-C");
}

/// `kubectl podmotion env deploy/mover --container app`: with no attachment of the
/// workload, the plugin creates an Ingest attachment, prints the container's real
/// environment as dotenv on stdout (progress on stderr), and deletes the attachment.
#[tokio::test]
async fn env_prints_the_replicas_environment_as_dotenv_and_leaves_nothing() {
    let Some(w) = World::new("plugin-env").await else {
        return;
    };
    let bin = plugin_bin();
    let out = run(
        &bin,
        &[
            "env",
            "deploy/mover",
            "--container",
            "app",
            "-n",
            &w.app.name,
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    eprintln!("kubectl podmotion env:\n{stdout}\n--- stderr:\n{stderr}");
    assert!(
        out.status.success(),
        "exit {:?}: {stderr}",
        out.status.code()
    );
    assert!(
        stdout.lines().any(|l| l == "PLUGIN_MARK='mark with $pace'"),
        "{stdout}"
    );
    assert!(
        stdout.lines().all(|l| l.contains('=')),
        "only assignment lines on stdout: {stdout}"
    );
    assert!(stderr.contains("Ingest of Deployment/mover"), "{stderr}");
    let left = w
        .app
        .api::<NodeAgentAttachment>()
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "the Ingest attachment is left behind"
    );
}

/// `kubectl podmotion wiretap deploy/mover --port 8080 -w FILE.pcapng`: while the plugin
/// taps, the application still answers a request; after Ctrl-C the file is read by
/// `tshark` (Debian's, a client nobody here wrote) without malformed packets, and its
/// TCP payloads hold the request and the application's answer. No attachment is left.
#[tokio::test]
async fn wiretap_writes_a_pcapng_that_tshark_reads_with_the_request_and_the_answer() {
    let Some(w) = World::new("plugin-tap").await else {
        return;
    };
    let bin = plugin_bin();
    let tshark = which("tshark").expect("tshark (apt-get install tshark)");
    let dir = std::env::temp_dir().join(format!("pm-tap-{}", random_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("mover.pcapng");
    let app_addr = format!(
        "{}:8080",
        w.pod.status.as_ref().unwrap().pod_ip.clone().unwrap()
    );
    let mut child = kubectl_podmotion(
        &bin,
        &[
            "wiretap",
            "deploy/mover",
            "--port",
            "8080",
            "-w",
            file.to_str().unwrap(),
            "-n",
            &w.app.name,
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawning kubectl podmotion wiretap");
    let rx = lines_of(&mut child);
    let mut seen = vec![];
    wait_line(&mut child, &rx, "tapping port 8080", &mut seen);
    assert_eq!(
        ask(&app_addr, "echo tapped-by-the-plugin").unwrap(),
        "tapped-by-the-plugin",
        "the application answers while tapped"
    );
    // The frames travel agent -> port-forward -> file; give them a moment, then stop.
    std::thread::sleep(Duration::from_secs(2));
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    seen.extend(rx.iter());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{seen:#?}\n{err}");
    assert!(seen.iter().any(|l| l.starts_with("wrote ")), "{seen:#?}");

    let payloads = Command::new(&tshark)
        .args([
            "-r",
            file.to_str().unwrap(),
            "-Y",
            "tcp.len > 0",
            "-T",
            "fields",
            "-e",
            "tcp.payload",
        ])
        .output()
        .unwrap();
    let text = output_text(&payloads);
    assert!(payloads.status.success(), "tshark: {text}");
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    let all: String = String::from_utf8_lossy(&payloads.stdout).replace(['\n', ':'], "");
    assert!(
        all.contains(&hex("echo tapped-by-the-plugin\n")),
        "the request is in the capture: {text}"
    );
    assert!(
        all.contains(&hex("tapped-by-the-plugin\n")),
        "the answer is in the capture: {text}"
    );
    let malformed = Command::new(&tshark)
        .args([
            "-r",
            file.to_str().unwrap(),
            "-Y",
            "_ws.malformed || _ws.expert.severity >= error",
        ])
        .output()
        .unwrap();
    assert!(
        malformed.stdout.is_empty(),
        "tshark finds malformed packets: {}",
        output_text(&malformed)
    );
    let summary = Command::new(&tshark)
        .args(["-r", file.to_str().unwrap()])
        .output()
        .unwrap();
    eprintln!("tshark -r {}:\n{}", file.display(), output_text(&summary));
    let left = w
        .app
        .api::<NodeAgentAttachment>()
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(left.items.is_empty(), "attachments left after Ctrl-C");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tool` on `$PATH`.
fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Waits until a new Service's address accepts connections (its endpoints are
/// programmed a moment after the pod is Ready; until then connections are refused).
fn service_reachable(addr: &str) {
    let addr: std::net::SocketAddr = addr.parse().unwrap();
    for _ in 0..120 {
        if std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    panic!("Service {addr} never accepted a connection");
}

/// The bytes of `path` in the image `reference` (`host/repo@sha256:…`, plain HTTP):
/// its layers fetched from the registry and unpacked.
fn file_of_image(reference: &str, path: &str) -> Vec<u8> {
    let dir = std::env::temp_dir().join(format!("pm-image-{}", random_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = r#"set -euo pipefail
ref=$1 dir=$2
host=${ref%%/*}; rest=${ref#*/}; repo=${rest%@*}; digest=${ref##*@}
m=$(curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$host/v2/$repo/manifests/$digest")
for l in $(jq -r '.layers[].digest' <<<"$m"); do
  curl -fsS "http://$host/v2/$repo/blobs/$l" | tar -xzf - -C "$dir"
done"#;
    let out = Command::new("bash")
        .args(["-c", script, "fetch", reference, dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let bytes = std::fs::read(dir.join(path.trim_start_matches('/'))).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    bytes
}

/// `kubectl podmotion cp`: the testload binary (the only file its `FROM scratch` image
/// has) arrives byte for byte as the registry's image layer holds it; `/etc/hostname`
/// (written by the kubelet) holds the pod's name; a ConfigMap volume, copied as a
/// directory, arrives as the kubelet projects it (keys are symlinks into `..data`,
/// archived as symlinks, readable locally); a missing path is named; the Ingest
/// attachment the command created is gone afterwards.
#[tokio::test]
async fn cp_copies_files_and_a_directory_out_of_the_replica_and_leaves_nothing() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let Some(w) = World::new("plugin-cp").await else {
        return;
    };
    let bin = plugin_bin();
    let marker = format!("podmotion cp {}", random_suffix());
    let cm: ConfigMap = from_json(json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cp-data"},
        "data": {"mark": marker, "other.txt": "second file\n"}
    }));
    w.app
        .api::<ConfigMap>()
        .create(&PostParams::default(), &cm)
        .await
        .unwrap();
    let deploys: Api<Deployment> = w.app.api();
    let patch = json!({"spec": {"template": {"spec": {
        "volumes": [{"name": "data", "configMap": {"name": "cp-data"}}],
        "containers": [{"name": "app", "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": true}]}]
    }}}});
    deploys
        .patch(
            "mover",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Strategic(&patch),
        )
        .await
        .unwrap();
    let old = w.pod.name_any();
    let pods: Api<Pod> = w.app.api();
    let ready = wait_list(
        &pods,
        "app=mover",
        POD_TIMEOUT,
        "the new replica Ready",
        |ps| ps.len() == 1 && ps[0].name_any() != old && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let pod = ready[0].name_any();

    let dir = std::env::temp_dir().join(format!("pm-cp-e2e-{}", random_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    let cp = |remote: &str, local: &std::path::Path| {
        let out = run(
            &bin,
            &[
                "cp",
                &format!("deploy/mover:{remote}"),
                local.to_str().unwrap(),
                "-n",
                &w.app.name,
            ],
        );
        let text = output_text(&out);
        eprintln!("kubectl podmotion cp deploy/mover:{remote}:\n{text}");
        (out.status.code(), text)
    };

    let testload = "/usr/local/bin/podmotion-testload";
    let (code, text) = cp(testload, &dir);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("Ingest of Deployment/mover"), "{text}");
    let image = Images::load().unwrap().testload().unwrap();
    let got = std::fs::read(dir.join("podmotion-testload")).unwrap();
    assert_eq!(
        got.len(),
        file_of_image(&image, testload).len(),
        "size of the copied binary"
    );
    assert!(
        got == file_of_image(&image, testload),
        "bytes of the copied binary"
    );
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("podmotion-testload"))
            .unwrap()
            .permissions()
            .mode();
        assert!(mode & 0o111 != 0, "the executable bit is kept: {mode:o}");
    }

    let (code, text) = cp("/etc/hostname", &dir.join("hostname"));
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(
        std::fs::read_to_string(dir.join("hostname"))
            .unwrap()
            .trim(),
        pod
    );

    let (code, text) = cp("/data", &dir.join("tree"));
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(
        std::fs::read_to_string(dir.join("tree/mark")).unwrap(),
        marker
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("tree/other.txt")).unwrap(),
        "second file\n"
    );
    assert!(
        std::fs::symlink_metadata(dir.join("tree/mark"))
            .unwrap()
            .file_type()
            .is_symlink(),
        "a projected key is a symlink into ..data, archived as a symlink"
    );

    let (code, text) = cp("/no/such/file", &dir.join("x"));
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("/no/such/file does not exist in the container"),
        "{text}"
    );
    let left = w
        .app
        .api::<NodeAgentAttachment>()
        .list(&ListParams::default())
        .await
        .unwrap();
    assert!(
        left.items.is_empty(),
        "the Ingest attachment is left behind"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A user who may read the attachments, the pods and the agent's token Secret but not
/// port-forward (to the target pod, where the agent serves) is told the verb, the
/// subresource, the namespace and the `kubectl auth can-i` line (kube reports the
/// refused websocket upgrade as a failed protocol switch, which the plugin printed as a
/// bare error before).
#[tokio::test]
async fn a_refused_port_forward_names_the_subresource_and_the_can_i_line() {
    let Some(w) = World::new("plugin-pf").await else {
        return;
    };
    let bin = plugin_bin();
    // As the cluster admin: an intercept holds a Ready attachment the user's `env` reuses.
    let (local, _received) = local_line_server();
    let (mut child, rx) = spawn_intercept(&bin, "deploy/mover", local, &[], &w.app.name);
    let mut seen = vec![];
    wait_line(&mut child, &rx, "intercepting every connection", &mut seen);
    let user = format!("plugin-pf-{}", random_suffix());
    // Everything the plugin reads in the workload's namespace, but no pods/portforward.
    podmotion_e2e::grant_user(
        &w.app,
        &user,
        json!([
            {"apiGroups": ["podmotion.io"], "resources": ["nodeagentattachments"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["pods", "secrets"], "verbs": ["get", "list"]}
        ]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let mut text = String::new();
    let mut code = None;
    for _ in 0..30 {
        let out = run(
            &bin,
            &["env", "deploy/mover", "-n", &w.app.name, "--as", &user],
        );
        text = output_text(&out);
        code = out.status.code();
        // Transient: the authorizer's cache, or the agent not running at that instant.
        if !text.contains("you may not get secrets") && !text.contains("not running yet") {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let _ = child.wait();
    eprintln!("as {user}:\n{text}");
    let ns = &w.app.name;
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(&format!(
            "you may not create pods/portforward in namespace {ns}: ask your cluster administrator"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "kubectl auth can-i create pods --subresource=portforward -n {ns}"
        )),
        "{text}"
    );
}

/// The plugin's release artifact, as a user installs it: `hack/images.sh` pushed it to the
/// local registry as an OCI artifact beside the chart (`$PODMOTION_RUN/plugin.txt`, a
/// reference pinned by digest). Fetched back with `hack/lib/plugin.sh` (manifest and
/// tarball checked against their digests), the tarball matches the `.sha256` written
/// beside it, holds one static binary, and that binary runs as `kubectl podmotion`.
#[test]
fn the_release_artifact_is_fetched_from_the_registry_and_runs_as_a_kubectl_plugin() {
    let run_dir = podmotion_e2e::run_dir();
    let reference = std::fs::read_to_string(run_dir.join("plugin.txt"))
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; build and push the images and the plugin first (hack/images.sh)",
                run_dir.join("plugin.txt").display()
            )
        })
        .trim()
        .to_owned();
    assert!(
        reference.contains("/podmotion/kubectl-podmotion@sha256:"),
        "{reference}"
    );
    let dir = std::env::temp_dir().join(format!("pm-plugin-artifact-{}", random_suffix()));
    let lib = podmotion_e2e::repo_root().join("hack/lib/plugin.sh");
    let out = Command::new("bash")
        .arg("-c")
        .arg(r#"set -e; source "$1"; plugin_fetch "$2" "$3""#)
        .args([
            "fetch",
            lib.to_str().unwrap(),
            &reference,
            dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
    let tgz = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let name = tgz.file_name().unwrap().to_str().unwrap().to_owned();
    // The tarball pushed is the one hack/images.sh left beside its .sha256.
    let sums =
        std::fs::read_to_string(run_dir.join("plugin").join(format!("{name}.sha256"))).unwrap();
    let local = Command::new("sha256sum").arg(&tgz).output().unwrap();
    assert_eq!(
        sums.split_whitespace().next(),
        String::from_utf8_lossy(&local.stdout)
            .split_whitespace()
            .next(),
        "the fetched tarball is not the one whose sha256 was published"
    );
    let list = Command::new("tar").arg("-tzf").arg(&tgz).output().unwrap();
    // The binary and the licence it is shipped under (krew's manifest names both).
    assert_eq!(
        String::from_utf8_lossy(&list.stdout),
        "LICENSE\nkubectl-podmotion\n"
    );
    let x = Command::new("tar")
        .arg("-xzf")
        .arg(&tgz)
        .arg("-C")
        .arg(&dir)
        .status()
        .unwrap();
    assert!(x.success());
    let bin = dir.join("kubectl-podmotion");
    let file = Command::new("file").arg("-b").arg(&bin).output().unwrap();
    let file = String::from_utf8_lossy(&file.stdout).into_owned();
    assert!(file.contains("static"), "not a static binary: {file}");
    // kubectl finds it on $PATH as a plugin.
    let out = run(&bin, &["--version"]);
    let text = output_text(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.starts_with("kubectl-podmotion "), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}
