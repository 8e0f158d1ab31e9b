//! The real nodes of the local cluster (`hack/cluster.sh`, `REAL_NODES`) and the images
//! `hack/images.sh` built and pushed to the local registry.
//!
//! * [`real_nodes`] lists the nodes labelled `type=real`; none is a failure unless
//!   `PODMOTION_REAL_NODES=0` says the cluster was started without them (then `None`).
//! * [`Images`] reads the values file `hack/images.sh` writes
//!   (`$PODMOTION_IMAGES_VALUES`, default `$PODMOTION_RUN/images-values.yaml`) and the
//!   list of every image it printed; [`entrypoint`] reads an image's config from the
//!   registry.
//! * [`pin`] places a pod spec on one real node (node name, and the toleration of the
//!   real nodes' taint).

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};

use crate::run_dir;

pub mod agents;
pub mod attach;
pub mod bounds;
pub mod copies;
pub mod monitors;
pub mod netpol;
pub mod procs;
pub mod runner;
pub mod testload;
pub mod timeline;

/// Taint every real node carries, so that only pods asking for them land there.
pub const REAL_NODE_TAINT: &str = "podmotion.io/real-node";

/// `false` when `PODMOTION_REAL_NODES=0`: real-node tests are skipped instead of failing
/// (a local run only: under CI the switch fails the test).
pub fn real_nodes_enabled() -> bool {
    let skip = std::env::var("PODMOTION_REAL_NODES").is_ok_and(|v| v == "0");
    if skip {
        crate::refuse_skip_under_ci("PODMOTION_REAL_NODES");
    }
    !skip
}

/// Names of the Ready nodes labelled `type=real`, sorted. Panics when there are none
/// (the cluster must have been started with real nodes), unless real-node tests are
/// disabled, in which case it returns `None`.
pub async fn real_nodes(client: &Client) -> Option<Vec<String>> {
    ready_nodes(
        client,
        "type=real",
        "start the cluster with real nodes (hack/cluster.sh up, REAL_NODES defaults to 2) \
         or set PODMOTION_REAL_NODES=0",
    )
    .await
}

/// Names of the Ready nodes matching `selector`, sorted; `None` when real-node tests
/// are disabled. Panics with `hint` when none is Ready.
pub async fn ready_nodes(client: &Client, selector: &str, hint: &str) -> Option<Vec<String>> {
    if !real_nodes_enabled() {
        eprintln!("PODMOTION_REAL_NODES=0: skipping a real-node test");
        return None;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let list = nodes
        .list(&ListParams::default().labels(selector))
        .await
        .expect("listing nodes");
    let mut names: Vec<String> = list
        .items
        .iter()
        .filter(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .map(|n| n.name_any())
        .collect();
    names.sort();
    assert!(
        !names.is_empty(),
        "no Ready node labelled {selector}: {hint}"
    );
    Some(names)
}

/// `helm install <release>` of the chart from our images (`chart_args`) plus `extra`,
/// waiting for it (5 min); asserts success and returns the guard that uninstalls it.
pub fn helm_install(
    release: &str,
    images: &Images,
    operator_ns: &str,
    app_ns: &str,
    lease: &str,
    extra: &[&str],
) -> Uninstall {
    refuse_beside_a_cluster_wide_release();
    let mut args = vec!["install".to_string(), release.to_string()];
    args.extend(chart_args(images, operator_ns, app_ns, lease));
    args.extend(extra.iter().map(|a| a.to_string()));
    args.extend(
        [
            "--take-ownership",
            "--force-conflicts",
            "--wait",
            "--timeout",
            "5m",
        ]
        .map(String::from),
    );
    let out = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let guard = Uninstall {
        release: release.to_string(),
        namespace: operator_ns.to_string(),
    };
    if !out.status.success() {
        print_release_pods(operator_ns);
    }
    assert!(out.status.success(), "helm install: {}", output_text(&out));
    guard
}

/// Prints, for a release whose install did not become ready, its namespace and its
/// agents' (`<namespace>-agents`) as a failed test's namespace is dumped
/// ([`crate::dump_namespace`]), and the last lines of every container's log (a CI run
/// once saw one agent never ready, with nothing to say why).
fn print_release_pods(operator_ns: &str) {
    let agents_ns = format!("{operator_ns}-agents");
    let kubectl = crate::kubectl_path().ok();
    let mut out = String::new();
    for ns in [operator_ns, agents_ns.as_str()] {
        out.push_str(&crate::dump_namespace(ns, kubectl.as_deref()));
        let pods =
            crate::kubectl_text(kubectl.as_deref(), &["-n", ns, "get", "pods", "-o", "name"]);
        for pod in pods.lines().filter(|l| l.starts_with("pod/")) {
            let args = [
                "-n",
                ns,
                "logs",
                pod,
                "--all-containers",
                "--tail=40",
                "--prefix",
            ];
            out.push_str(&format!("----- kubectl {} -----\n", args.join(" ")));
            out.push_str(&crate::kubectl_text(kubectl.as_deref(), &args));
        }
    }
    eprintln!("===== the release's pods =====\n{out}===== end =====");
}

/// The PodMotion operators that watch every namespace for migrations or attachments
/// (no `PODMOTION_MIGRATION_NAMESPACE` or no `PODMOTION_ATTACHMENT_WATCH_NAMESPACE`), as
/// `namespace/name`.
pub fn cluster_wide_operators() -> Vec<String> {
    let out = kubectl(&[
        "get",
        "deployments",
        "--all-namespaces",
        "-l",
        "app.kubernetes.io/name=podmotion,app.kubernetes.io/component=operator",
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "listing operators: {}",
        output_text(&out)
    );
    let list: Value = serde_json::from_slice(&out.stdout).expect("kubectl's JSON");
    let empty = vec![];
    list["items"]
        .as_array()
        .unwrap_or(&empty)
        .iter()
        .filter(|d| {
            let names: Vec<&str> = d["spec"]["template"]["spec"]["containers"]
                .as_array()
                .unwrap_or(&empty)
                .iter()
                .flat_map(|c| c["env"].as_array().unwrap_or(&empty))
                .filter_map(|e| e["name"].as_str())
                .collect();
            !names.contains(&"PODMOTION_MIGRATION_NAMESPACE")
                || !names.contains(&"PODMOTION_ATTACHMENT_WATCH_NAMESPACE")
        })
        .map(|d| {
            format!(
                "{}/{}",
                d["metadata"]["namespace"].as_str().unwrap_or(""),
                d["metadata"]["name"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// A test's release is scoped to its namespaces; a release that watches every namespace
/// would race it for the test's objects (the claim goes to whichever operator sees an
/// object first), so the test could pass on that release's images, stale ones included.
/// Such a test fails here instead, naming the release to uninstall.
pub fn refuse_beside_a_cluster_wide_release() {
    let wide = cluster_wide_operators();
    assert!(
        wide.is_empty(),
        "a PodMotion release watching every namespace is installed ({}): it would race \
         this test's own release for the test's objects; uninstall it (helm uninstall -n \
         <namespace> <release>) and run again",
        wide.join(", ")
    );
}

/// Places a pod spec on `node`: `nodeName` and the toleration of the real nodes' taint.
pub fn pin(spec: &mut Value, node: &str) {
    spec["nodeName"] = json!(node);
    let mut tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
    tolerations.push(json!({"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}));
    spec["tolerations"] = Value::Array(tolerations);
}

/// The images `hack/images.sh` pushed, as the chart values it wrote.
pub struct Images {
    values: Value,
    pub path: PathBuf,
}

impl Images {
    pub fn values_path() -> PathBuf {
        std::env::var_os("PODMOTION_IMAGES_VALUES")
            .map(PathBuf::from)
            .unwrap_or_else(|| run_dir().join("images-values.yaml"))
    }

    /// Reads the values file; fails with what to run when it is missing.
    pub fn load() -> anyhow::Result<Images> {
        let path = Self::values_path();
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {}: build and push the images first (bash hack/images.sh)",
                path.display()
            )
        })?;
        let values: Value =
            serde_saphyr::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        Ok(Images { values, path })
    }

    fn repo_digest(&self, at: &str) -> anyhow::Result<String> {
        let img = self
            .values
            .pointer(at)
            .with_context(|| format!("{} has no {at}", self.path.display()))?;
        let repo = img["repository"].as_str().context("repository")?;
        let digest = img["digest"].as_str().context("digest")?;
        Ok(format!("{repo}@{digest}"))
    }

    fn string(&self, at: &str) -> anyhow::Result<String> {
        self.values
            .pointer(at)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .with_context(|| format!("{} has no {at}", self.path.display()))
    }

    pub fn operator(&self) -> anyhow::Result<String> {
        self.repo_digest("/image")
    }
    pub fn agent(&self) -> anyhow::Result<String> {
        self.repo_digest("/migrationAgent/agent/image")
    }
    pub fn broker(&self) -> anyhow::Result<String> {
        self.repo_digest("/migrationAgent/broker/image")
    }
    pub fn attach(&self) -> anyhow::Result<String> {
        self.string("/attachment/agentImage")
    }
    pub fn preflight(&self) -> anyhow::Result<String> {
        self.string("/runnerPool/preflightImage")
    }
    /// The test-only image (never in the chart's values), from the list of every image
    /// `hack/images.sh` printed (`$PODMOTION_IMAGES_LIST`, default
    /// `$PODMOTION_RUN/images.txt`, which hack/test.sh and hack/demo.sh save).
    pub fn testload(&self) -> anyhow::Result<String> {
        let list = std::env::var_os("PODMOTION_IMAGES_LIST")
            .map(PathBuf::from)
            .unwrap_or_else(|| run_dir().join("images.txt"));
        let text = std::fs::read_to_string(&list)
            .with_context(|| format!("reading {} (bash hack/images.sh > it)", list.display()))?;
        text.lines()
            .map(str::trim)
            .find(|l| l.contains("/podmotion/podmotion-testload@sha256:"))
            .map(str::to_owned)
            .with_context(|| {
                format!(
                    "no podmotion/podmotion-testload image in {}",
                    list.display()
                )
            })
    }
}

fn curl(url: &str, accept: Option<&str>) -> anyhow::Result<(String, Vec<u8>)> {
    let mut cmd = Command::new("curl");
    cmd.args(["-fsS", "--max-time", "10", "-D", "-", "-o", "-"]);
    if let Some(a) = accept {
        cmd.args(["-H", &format!("Accept: {a}")]);
    }
    let out = cmd.arg(url).output().context("running curl")?;
    if !out.status.success() {
        bail!("GET {url}: {}", String::from_utf8_lossy(&out.stderr));
    }
    // Headers, a blank line, then the body.
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no header end")?;
    let headers = String::from_utf8_lossy(&out.stdout[..split]).into_owned();
    Ok((headers, out.stdout[split + 4..].to_vec()))
}

const MANIFEST_TYPES: &str = "application/vnd.oci.image.manifest.v1+json,application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.index.v1+json";

/// The image config (`config` of the OCI image configuration) of `registry/repo@digest`.
pub fn image_config(image: &str) -> anyhow::Result<Value> {
    let (name, digest) = image.split_once('@').context("image pinned by digest")?;
    let (registry, repo) = name.split_once('/').context("registry/repository")?;
    let (_, body) = curl(
        &format!("http://{registry}/v2/{repo}/manifests/{digest}"),
        Some(MANIFEST_TYPES),
    )?;
    let manifest: Value = serde_json::from_slice(&body)?;
    let config_digest = manifest
        .pointer("/config/digest")
        .and_then(Value::as_str)
        .context("manifest without config")?;
    let (_, body) = curl(
        &format!("http://{registry}/v2/{repo}/blobs/{config_digest}"),
        None,
    )?;
    let config: Value = serde_json::from_slice(&body)?;
    Ok(config["config"].clone())
}

/// The first element of the image's entrypoint: the path of its binary.
pub fn entrypoint(image: &str) -> anyhow::Result<String> {
    let config = image_config(image)?;
    config
        .pointer("/Entrypoint/0")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .with_context(|| format!("{image} has no entrypoint"))
}

/// `kubectl port-forward` to a pod's port, as a user reaches an attach agent's control
/// API: the local port it listens on, and the process (killed on drop).
pub struct PortForward {
    child: std::process::Child,
    pub local_port: u16,
}

impl PortForward {
    pub fn start(namespace: &str, pod: &str, port: u16) -> anyhow::Result<PortForward> {
        use std::io::{BufRead, BufReader};
        let mut child = Command::new(crate::kubectl_path()?)
            .arg("--kubeconfig")
            .arg(crate::kubeconfig_path())
            .args(["port-forward", "--address", "127.0.0.1", "-n", namespace])
            .arg(format!("pod/{pod}"))
            .arg(format!(":{port}"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .context("kubectl port-forward")?;
        let stdout = child.stdout.take().context("stdout")?;
        // "Forwarding from 127.0.0.1:41234 -> 8400"
        let mut out = BufReader::new(stdout);
        let mut line = String::new();
        out.read_line(&mut line)?;
        // kubectl prints a line per connection: keep reading, or it dies of SIGPIPE.
        std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
        let local_port = line
            .split_once("127.0.0.1:")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|p| p.parse().ok());
        match local_port {
            Some(local_port) => Ok(PortForward { child, local_port }),
            None => {
                let _ = child.kill();
                let out = child.wait_with_output()?;
                bail!(
                    "kubectl port-forward printed {line:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            }
        }
    }
}

impl Drop for PortForward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes one HTTP/1.1 request (`Connection: close` unless `upgrade`) on a fresh
/// connection to `127.0.0.1:port` and reads the status line and headers.
fn http_head(
    port: u16,
    method: &str,
    path: &str,
    token: &str,
    upgrade: bool,
) -> anyhow::Result<(u16, std::io::BufReader<std::net::TcpStream>)> {
    use std::io::{BufRead, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(30)))?;
    let extra = if upgrade {
        "Connection: Upgrade\r\nUpgrade: podmotion-stream\r\n"
    } else {
        "Connection: close\r\nContent-Length: 0\r\n"
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {token}\r\n{extra}\r\n"
    )?;
    let mut r = std::io::BufReader::new(s);
    let mut status = String::new();
    r.read_line(&mut status)?;
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .with_context(|| format!("{method} {path}: status line {status:?}"))?;
    loop {
        let mut h = String::new();
        r.read_line(&mut h)?;
        if h.trim().is_empty() {
            break;
        }
    }
    Ok((code, r))
}

/// One request to an attach agent's control API; the status and the body.
pub fn agent_call(
    port: u16,
    method: &str,
    path: &str,
    token: &str,
) -> anyhow::Result<(u16, String)> {
    use std::io::Read;
    let (code, mut r) = http_head(port, method, path, token, false)?;
    let mut body = String::new();
    r.read_to_string(&mut body)?;
    // Chunked bodies: keep the JSON between the chunk sizes.
    let body = match (body.find(['{', '[']), body.rfind(['}', ']'])) {
        (Some(a), Some(b)) if b >= a => body[a..=b].to_owned(),
        _ => body,
    };
    Ok((code, body))
}

/// An upgraded stream of the control API (`GET …/accept`, `GET …/stream`).
pub fn agent_stream(
    port: u16,
    path: &str,
    token: &str,
) -> anyhow::Result<std::io::BufReader<std::net::TcpStream>> {
    let (code, r) = http_head(port, "GET", path, token, true)?;
    anyhow::ensure!(
        code == 101,
        "GET {path}: {code}, not 101 Switching Protocols"
    );
    Ok(r)
}

/// stdout and stderr of a finished command, for assertion messages.
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `kubectl` (ours) against the local cluster.
pub fn kubectl(args: &[&str]) -> std::process::Output {
    Command::new(crate::kubectl_path().expect("kubectl"))
        .arg("--kubeconfig")
        .arg(crate::kubeconfig_path())
        .args(args)
        .output()
        .expect("running kubectl")
}

/// Deletes pod `name` in `namespace` at once (`--grace-period=0 --force`, not waiting):
/// the API object goes now, its controller makes a new one, the kubelet stops the
/// containers with its minimum grace.
pub fn force_delete_pod(namespace: &str, name: &str) {
    let out = kubectl(&[
        "-n",
        namespace,
        "delete",
        "pod",
        name,
        "--grace-period=0",
        "--force",
        "--wait=false",
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
}

/// The nftables tables in the network namespace of host PID `pid` (an attach agent's
/// redirect table is `podmotion_agent`).
pub fn nft_tables(pid: u32) -> String {
    let out = Command::new("nsenter")
        .arg(format!("--net=/proc/{pid}/ns/net"))
        .args(["nft", "list", "tables"])
        .output()
        .expect("nsenter nft");
    assert!(
        out.status.success(),
        "nft list tables in {pid}: {}",
        output_text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `helm` (the one `hack/build-helm.sh` built) against the local cluster.
pub fn helm(args: &[&str]) -> std::process::Output {
    let out = Command::new("bash")
        .arg(crate::repo_root().join("hack/build-helm.sh"))
        .arg("--print")
        .output()
        .expect("hack/build-helm.sh");
    let bin = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Command::new(bin)
        .env("KUBECONFIG", crate::kubeconfig_path())
        .args(args)
        .output()
        .expect("running helm")
}

/// Uninstalls a release a failed test left (without hooks), unless `PODMOTION_KEEP=1`.
pub struct Uninstall {
    pub release: String,
    pub namespace: String,
}

impl Drop for Uninstall {
    fn drop(&mut self) {
        if std::env::var("PODMOTION_KEEP").as_deref() == Ok("1") {
            return;
        }
        let _ = helm(&[
            "uninstall",
            &self.release,
            "-n",
            &self.namespace,
            "--no-hooks",
            "--wait=false",
        ]);
    }
}

/// Helm arguments (after `install|upgrade <release>`) for the chart with our images and
/// hack/install.sh's values, in `operator_ns`, its controllers scoped to `app_ns` (other
/// tests run their own controllers meanwhile) and its own leader-election `lease`.
pub fn chart_args(images: &Images, operator_ns: &str, app_ns: &str, lease: &str) -> Vec<String> {
    let root = crate::repo_root();
    vec![
        root.join("charts/podmotion").to_string_lossy().into_owned(),
        "-n".into(),
        operator_ns.into(),
        "--values".into(),
        root.join("hack/install-values.yaml")
            .to_string_lossy()
            .into_owned(),
        "--values".into(),
        images.path.to_string_lossy().into_owned(),
        "--set".into(),
        format!(
            "migration.watchNamespace={app_ns},attachment.watchNamespace={app_ns},runnerPool.watchNamespace={app_ns}"
        ),
        "--set".into(),
        format!("operator.leaderElection.leaseName={lease}"),
    ]
}
