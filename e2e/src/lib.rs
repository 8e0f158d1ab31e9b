//! Harness for tests against the local control plane started by `hack/cluster.sh up`.
//!
//! * [`TestNamespace::new`] connects through `$KUBECONFIG` (default
//!   `${PODMOTION_RUN:-/tmp/podmotion-cluster}/admin.kubeconfig`, the file `hack/cluster.sh`
//!   writes) and creates a namespace with a random name and a PodSecurity `enforce` level.
//!   When no cluster is reachable it panics, so the test fails; set `PODMOTION_E2E=0` to
//!   skip the cluster tests instead (then `new` returns `None`).
//! * When a test panics, dropping the [`TestNamespace`] prints the namespace's objects and
//!   events (through `kubectl` from the binary cache) and the nodes, then the namespace is
//!   deleted unless `PODMOTION_KEEP=1`.
//! * [`wait_for`] and [`wait_list`] follow a watch until a condition holds, with a bounded
//!   timeout; no fixed sleeps.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Context, anyhow, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Config, Resource, ResourceExt};
use serde::de::DeserializeOwned;

pub mod bench_attach;
pub mod bench_migration;
pub mod chaos;
pub mod kwok_agents;
pub mod operator;
pub mod plugin;
pub mod real;

/// Default bound of every wait in these tests.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// PodSecurity admission level enforced on a test namespace
/// (label `pod-security.kubernetes.io/enforce`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodSecurity {
    Privileged,
    Baseline,
    Restricted,
}

impl PodSecurity {
    pub fn as_str(self) -> &'static str {
        match self {
            PodSecurity::Privileged => "privileged",
            PodSecurity::Baseline => "baseline",
            PodSecurity::Restricted => "restricted",
        }
    }
}

/// Root of the repository (parent of this crate).
pub fn repo_root() -> PathBuf {
    podmotion_api::samples::repo_root()
}

/// Removes from `cmd`'s environment what cargo set for this test's own crate
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, `CARGO_CRATE_NAME`, `OUT_DIR`, …), for a build
/// nested in a test (a `cargo build`, or `hack/release.sh` and `hack/images.sh`). Build
/// scripts declare some of them (ring: `rerun-if-env-changed=CARGO_MANIFEST_DIR`) and
/// cargo compares its own environment: left set, ring's build reruns and everything above
/// it is rebuilt (19 min for the image binaries here), and the next build from a shell
/// does it all again.
pub fn without_crate_env(cmd: &mut Command) -> &mut Command {
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        let set_for_crate = [
            "CARGO_MANIFEST_",
            "CARGO_PKG_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_PACKAGE",
            "CARGO_TARGET_TMPDIR",
            "CARGO_CFG_",
        ]
        .iter()
        .any(|p| k.starts_with(p))
            || k == "OUT_DIR";
        if set_for_crate {
            cmd.env_remove(k);
        }
    }
    cmd
}

/// The cluster's runtime directory (`hack/cluster.sh`'s `PODMOTION_RUN`).
pub fn run_dir() -> PathBuf {
    std::env::var_os("PODMOTION_RUN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp/podmotion-cluster"))
}

/// Kubeconfig used by the tests: `$KUBECONFIG`, else the one `hack/cluster.sh up` writes.
pub fn kubeconfig_path() -> PathBuf {
    match std::env::var_os("KUBECONFIG") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => run_dir().join("admin.kubeconfig"),
    }
}

/// Whether this run is CI's (`CI` set to anything but empty, `0` or `false`). Skip
/// switches are for developers' local runs: under CI a test that cannot run its real
/// body fails, naming what was missing, instead of reporting ok.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false"))
}

/// Panics when the skip switch `name` (set to `0`) is used under CI; see [`under_ci`].
pub fn refuse_skip_under_ci(name: &str) {
    assert!(
        !under_ci(),
        "{name}=0 is set under CI: skip switches are for local runs only, and this test \
         must run its real body (unset {name}, and provide what it needs)"
    );
}

/// `false` when `PODMOTION_E2E=0`: cluster tests are skipped instead of failing (a
/// local run only: under CI the switch fails the test).
pub fn e2e_enabled() -> bool {
    let skip = std::env::var("PODMOTION_E2E").is_ok_and(|v| v == "0");
    if skip {
        refuse_skip_under_ci("PODMOTION_E2E");
    }
    !skip
}

/// Path of our `kubectl` (the binary cache, never the one on `$PATH`).
pub fn kubectl_path() -> anyhow::Result<PathBuf> {
    let out = Command::new("bash")
        .arg(repo_root().join("hack/build-k8s.sh"))
        .arg("--print")
        .output()
        .context("running hack/build-k8s.sh --print")?;
    if !out.status.success() {
        bail!(
            "hack/build-k8s.sh --print failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let bin = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    Ok(bin.join("kubectl"))
}

/// A client for the local control plane; fails with an explanation when it is unreachable.
pub async fn connect() -> anyhow::Result<Client> {
    connect_with(true).await
}

/// As [`connect`], without kube's default retry of 429 and 503 answers: for tests that
/// read such an answer (an eviction a webhook answers 429 would otherwise be retried,
/// with backoff, for a minute).
pub async fn connect_without_retry() -> anyhow::Result<Client> {
    connect_with(false).await
}

/// The local cluster's client configuration (its admin kubeconfig), for a client
/// built otherwise than [`connect`]'s (the operator's own, in the benchmarks).
pub async fn kube_config() -> anyhow::Result<Config> {
    let path = kubeconfig_path();
    let hint = "start it with `hack/cluster.sh up` (or set PODMOTION_E2E=0 to skip cluster tests)";
    let kubeconfig = Kubeconfig::read_from(&path)
        .with_context(|| format!("reading kubeconfig {}; {hint}", path.display()))?;
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("loading kubeconfig {}", path.display()))
}

async fn connect_with(retry: bool) -> anyhow::Result<Client> {
    let hint = "start it with `hack/cluster.sh up` (or set PODMOTION_E2E=0 to skip cluster tests)";
    let mut config = kube_config().await?;
    config.default_retry = retry;
    let server = config.cluster_url.to_string();
    let client = Client::try_from(config)?;
    tokio::time::timeout(Duration::from_secs(10), client.apiserver_version())
        .await
        .map_err(|_| anyhow!("no answer from {server} within 10s; {hint}"))?
        .with_context(|| format!("no cluster reachable at {server}; {hint}"))?;
    Ok(client)
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A short random suffix (no extra dependency: std's randomly keyed hasher).
pub fn random_suffix() -> String {
    use std::hash::{BuildHasher, RandomState};
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let seed = (
        nanos,
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
    );
    format!("{:08x}", RandomState::new().hash_one(seed) as u32)
}

/// A namespace owned by one test. Dumps its objects if the test panics, then deletes it
/// (unless `PODMOTION_KEEP=1`).
pub struct TestNamespace {
    pub client: Client,
    pub name: String,
    kubectl: Option<PathBuf>,
    strip_finalizers: bool,
}

/// Resources whose finalizers [`TestNamespace`]'s cleanup removes (PodMotion's kinds).
pub const CLEANUP_FINALIZER_RESOURCES: &[&str] = &[
    "podmigrations.podmotion.io",
    "nodeagentattachments.podmotion.io",
    "runnerpools.podmotion.io",
];

impl TestNamespace {
    /// Creates `e2e-<prefix>-<random>` with PodSecurity `enforce=<level>` and waits for its
    /// `default` ServiceAccount (pods cannot be created before it exists).
    /// Returns `None` only when `PODMOTION_E2E=0`; panics if the cluster is unreachable.
    pub async fn new(prefix: &str, level: PodSecurity) -> Option<TestNamespace> {
        if !e2e_enabled() {
            eprintln!("PODMOTION_E2E=0: skipping cluster test {prefix}");
            return None;
        }
        let client = connect().await.unwrap_or_else(|e| panic!("{e:#}"));
        let name = format!("e2e-{prefix}-{}", random_suffix());
        let labels = BTreeMap::from([
            ("podmotion.io/e2e".to_string(), "true".to_string()),
            (
                "pod-security.kubernetes.io/enforce".to_string(),
                level.as_str().to_string(),
            ),
            (
                "pod-security.kubernetes.io/enforce-version".to_string(),
                "latest".to_string(),
            ),
        ]);
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some(labels),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating namespace {name}: {e}"));
        let this = TestNamespace {
            client,
            name,
            kubectl: kubectl_path().ok(),
            strip_finalizers: true,
        };
        let sas: Api<ServiceAccount> = this.api();
        wait_for(
            &sas,
            "default",
            TIMEOUT,
            "the namespace's default ServiceAccount",
            |sa| sa.is_some(),
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        Some(this)
    }

    /// A namespaced API in this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Runs our kubectl with `args` and returns stdout+stderr (for dumps).
    pub fn kubectl(&self, args: &[&str]) -> String {
        kubectl_text(self.kubectl.as_deref(), args)
    }

    /// Keep finalizers on PodMotion objects when the namespace is cleaned up (by default
    /// they are removed, see [`CLEANUP_FINALIZER_RESOURCES`]); for a test whose operator
    /// outlives the namespace and must run its own cleanup.
    pub fn keep_finalizers_on_cleanup(&mut self) {
        self.strip_finalizers = false;
    }

    /// Best effort: after the namespace's deletion was requested, drops the finalizers of
    /// PodMotion objects in it. The operator that owns them is usually stopped together
    /// with the test, and the namespace would otherwise stay Terminating forever.
    fn strip_podmotion_finalizers(&self) {
        let ns = self.name.as_str();
        let kinds = CLEANUP_FINALIZER_RESOURCES.join(",");
        let names = self.kubectl(&["-n", ns, "get", &kinds, "-o", "name", "--ignore-not-found"]);
        for obj in names
            .lines()
            .filter(|l| l.contains('/') && !l.contains(' '))
        {
            self.kubectl(&[
                "-n",
                ns,
                "patch",
                obj,
                "--type=merge",
                "-p",
                r#"{"metadata":{"finalizers":null}}"#,
            ]);
        }
    }

    /// Prints what is needed to understand a failure ([`dump_namespace`]).
    pub fn dump(&self) {
        eprintln!("{}", dump_namespace(&self.name, self.kubectl.as_deref()));
    }
}

/// Runs kubectl `kubectl` (None: not built) with `args` against the local cluster and
/// returns stdout+stderr (for dumps).
pub fn kubectl_text(kubectl: Option<&Path>, args: &[&str]) -> String {
    let Some(kubectl) = kubectl else {
        return "(kubectl not found in the binary cache)\n".into();
    };
    match Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .output()
    {
        Ok(out) => {
            let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
            s.push_str(&String::from_utf8_lossy(&out.stderr));
            s
        }
        Err(e) => format!("(kubectl {args:?}: {e})\n"),
    }
}

/// What is needed to understand a failure in namespace `ns`: its workload objects, pods
/// in detail, events in order, and the nodes (`kubectl`: as for [`kubectl_text`]).
pub fn dump_namespace(ns: &str, kubectl: Option<&Path>) -> String {
    let mut out = format!("===== e2e dump of namespace {ns} =====\n");
    for (title, args) in [
        (
            "objects",
            vec![
                "-n",
                ns,
                "get",
                "all,jobs,daemonsets,serviceaccounts,endpointslices,poddisruptionbudgets",
                "-o",
                "wide",
            ],
        ),
        ("pods (yaml)", vec!["-n", ns, "get", "pods", "-o", "yaml"]),
        (
            "workloads (yaml)",
            vec![
                "-n",
                ns,
                "get",
                "deployments,replicasets,daemonsets,jobs",
                "-o",
                "yaml",
            ],
        ),
        (
            "events",
            vec![
                "-n",
                ns,
                "get",
                "events",
                "--sort-by=.metadata.creationTimestamp",
            ],
        ),
        ("nodes", vec!["get", "nodes", "-o", "wide", "--show-labels"]),
    ] {
        out.push_str(&format!("----- {title} -----\n"));
        out.push_str(&kubectl_text(kubectl, &args));
    }
    out.push_str(&format!(
        "===== end of dump; control-plane logs in {} =====\n",
        run_dir().join("logs").display()
    ));
    out
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
        if std::env::var("PODMOTION_KEEP").as_deref() == Ok("1") {
            eprintln!("PODMOTION_KEEP=1: keeping namespace {}", self.name);
            return;
        }
        // Drop cannot await; kubectl returns as soon as the deletion is accepted.
        let out = self.kubectl(&[
            "delete",
            "namespace",
            &self.name,
            "--wait=false",
            "--ignore-not-found",
        ]);
        if !out.contains("deleted") && !out.trim().is_empty() {
            eprintln!("cleanup of namespace {}: {out}", self.name);
        }
        if self.strip_finalizers {
            self.strip_podmotion_finalizers();
        }
    }
}

/// Waits, following a watch on `name`, until `cond` holds for the object (`None` = absent).
/// Returns the object as last seen. Errors after `timeout` with `what` and the last state.
pub async fn wait_for<K>(
    api: &Api<K>,
    name: &str,
    timeout: Duration,
    what: &str,
    cond: impl Fn(Option<&K>) -> bool,
) -> anyhow::Result<Option<K>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut last: Option<K> = None;
    let mut stream = watcher::watcher(api.clone(), config).boxed();
    let mut init: Option<K> = None;
    let mut synced = false;
    let mut away: Option<String> = None;
    let res = tokio::time::timeout(timeout, async {
        while let Some(ev) = next_event(&mut stream, &mut away).await? {
            match ev {
                Event::Init => init = None,
                Event::InitApply(o) => init = Some(o),
                Event::InitDone => {
                    last = init.take();
                    synced = true;
                }
                Event::Apply(o) => last = Some(o),
                Event::Delete(_) => last = None,
            }
            // Only judge complete states: after the initial list, then after every change.
            if synced && cond(last.as_ref()) {
                return Ok::<_, anyhow::Error>(());
            }
        }
        bail!("watch ended")
    })
    .await;
    match res {
        Ok(Ok(())) => Ok(last),
        Ok(Err(e)) => Err(e.context(format!("waiting for {what} ({name})"))),
        Err(_) => Err(anyhow!(
            "timed out after {timeout:?} waiting for {what} ({name}); last seen: {}{}",
            describe(last.as_ref()),
            last_away(&away)
        )),
    }
}

/// Waits, following a watch of the objects matching `label_selector`, until `cond` holds
/// for the complete set. Returns that set (sorted by name).
pub async fn wait_list<K>(
    api: &Api<K>,
    label_selector: &str,
    timeout: Duration,
    what: &str,
    cond: impl Fn(&[K]) -> bool,
) -> anyhow::Result<Vec<K>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let config = watcher::Config::default().labels(label_selector);
    let mut stream = watcher::watcher(api.clone(), config).boxed();
    let mut objects: BTreeMap<String, K> = BTreeMap::new();
    let mut init: BTreeMap<String, K> = BTreeMap::new();
    let mut synced = false;
    let mut away: Option<String> = None;
    let res = tokio::time::timeout(timeout, async {
        while let Some(ev) = next_event(&mut stream, &mut away).await? {
            match ev {
                Event::Init => init.clear(),
                Event::InitApply(o) => {
                    init.insert(o.name_any(), o);
                }
                Event::InitDone => {
                    objects = std::mem::take(&mut init);
                    synced = true;
                }
                Event::Apply(o) => {
                    objects.insert(o.name_any(), o);
                }
                Event::Delete(o) => {
                    objects.remove(&o.name_any());
                }
            }
            if synced {
                let list: Vec<K> = objects.values().cloned().collect();
                if cond(&list) {
                    return Ok::<_, anyhow::Error>(list);
                }
            }
        }
        bail!("watch ended")
    })
    .await;
    match res {
        Ok(r) => r.map_err(|e| e.context(format!("waiting for {what} ({label_selector})"))),
        Err(_) => Err(anyhow!(
            "timed out after {timeout:?} waiting for {what} ({label_selector}); last seen {} object(s): {}{}",
            objects.len(),
            objects
                .values()
                .map(|o| describe(Some(o)))
                .collect::<Vec<_>>()
                .join("; "),
            last_away(&away)
        )),
    }
}

/// The next event of a watch, riding out an API server that is away for a while (a
/// restart in a chaos test, a leader election of etcd): connection errors, 5xx, 429
/// and 410 are retried after a pause, and the last one is kept for the timeout's
/// message. An answer that will not change by waiting (403, 404, 422 …) ends the wait.
async fn next_event<K>(
    stream: &mut (impl futures::Stream<Item = Result<Event<K>, watcher::Error>> + Unpin),
    away: &mut Option<String>,
) -> anyhow::Result<Option<Event<K>>> {
    loop {
        match stream.next().await {
            None => return Ok(None),
            Some(Ok(ev)) => return Ok(Some(ev)),
            Some(Err(e)) if watch_error_passes(&e) => {
                *away = Some(e.to_string());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Some(Err(e)) => return Err(e.into()),
        }
    }
}

fn watch_error_passes(e: &watcher::Error) -> bool {
    let passes = |code: u16| code >= 500 || code == 429 || code == 410;
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => match e {
            kube::Error::Api(status) => passes(status.code),
            _ => true,
        },
        watcher::Error::WatchError(status) => passes(status.code),
        watcher::Error::NoResourceVersion => false,
    }
}

fn last_away(away: &Option<String>) -> String {
    away.as_ref()
        .map(|e| format!("; the watch last failed with: {e}"))
        .unwrap_or_default()
}

fn describe<K: Resource + Debug>(obj: Option<&K>) -> String {
    match obj {
        None => "absent".into(),
        Some(o) => {
            let s = format!("{o:?}");
            if s.len() > 2000 {
                format!(
                    "{}…",
                    &s[..(0..=2000)
                        .rev()
                        .find(|&i| s.is_char_boundary(i))
                        .unwrap_or(0)]
                )
            } else {
                s
            }
        }
    }
}

/// Pod is Running and its Ready condition is True.
pub fn pod_running_ready(pod: &Pod) -> bool {
    let Some(status) = &pod.status else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Pod phase, "" if unknown.
pub fn pod_phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

/// Deletes an object and waits until it is gone.
pub async fn delete_and_wait<K>(api: &Api<K>, name: &str, dp: &DeleteParams) -> anyhow::Result<()>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    match api.delete(name, dp).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    wait_for(api, name, TIMEOUT, "deletion", |o| o.is_none())
        .await
        .map(|_| ())
}

/// Builds a typed object from JSON (tests read best as manifests).
pub fn from_json<K: DeserializeOwned>(v: serde_json::Value) -> K {
    serde_json::from_value(v).expect("test manifest matches the type")
}

/// A Deployment `name` (pods labelled `app=<name>`) of `replicas` pods that may run only
/// on `nodes`: one container, no probes, small requests.
pub fn deployment_on_nodes(
    name: &str,
    replicas: usize,
    nodes: &[&str],
) -> k8s_openapi::api::apps::v1::Deployment {
    from_json(serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}
                        ]}]
                    }}},
                    "containers": [{"name": "app", "image": "registry.example/web:1",
                        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]
                }
            }
        }
    }))
}

/// A container spec that satisfies the `restricted` PodSecurity level.
pub fn restricted_container(name: &str) -> serde_json::Value {
    serde_json::json!({
        "name": name,
        "image": "registry.example/podmotion/e2e:1",
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": 1000,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"}
        }
    })
}

/// `kubectl wait --for=condition=<condition>` on `resource` (such as
/// `runnerpool/runners`) in `namespace`, through our kubectl: what a user's script or CI
/// job runs. Async, so a controller running in the same test runtime keeps working
/// while kubectl waits. `Err` carries kubectl's output.
pub async fn kubectl_wait(
    namespace: &str,
    resource: &str,
    condition: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(kubectl_path()?)
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(["-n", namespace, "wait", resource])
        .arg(format!("--for=condition={condition}"))
        .arg(format!("--timeout={}s", timeout.as_secs()))
        .output()
        .await
        .context("running kubectl wait")?;
    if out.status.success() {
        Ok(())
    } else {
        bail!(
            "kubectl wait {resource} --for=condition={condition} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

/// A client that acts as `subject` (a user name, or
/// `system:serviceaccount:<ns>:<name>`), by impersonation from the admin's kubeconfig:
/// what the API server allows it is what RBAC grants that subject, nothing more.
pub async fn impersonating(subject: &str) -> anyhow::Result<Client> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let kubeconfig = Kubeconfig::read_from(kubeconfig_path())?;
    let mut config =
        kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(subject.into());
    Ok(Client::try_from(config)?)
}

/// Grants user `user` the `rules` in `ns` (a Role and its RoleBinding, both named
/// after the user; they go with the namespace).
pub async fn grant_user(
    ns: &TestNamespace,
    user: &str,
    rules: serde_json::Value,
) -> anyhow::Result<()> {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let pp = kube::api::PostParams::default();
    let role: Role = from_json(serde_json::json!({"metadata": {"name": user}, "rules": rules}));
    ns.api::<Role>().create(&pp, &role).await?;
    let binding: RoleBinding = from_json(serde_json::json!({
        "metadata": {"name": user},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }));
    ns.api::<RoleBinding>().create(&pp, &binding).await?;
    // The authorizer learns of a new Role and RoleBinding from its own watch, a moment
    // later: until then the user is refused with "role not found". Wait for the grant to
    // be in force, checked on the first rule's first group, resource and verb.
    let first = &rules[0];
    wait_until_allowed(
        &ns.client,
        user,
        Some(&ns.name),
        first["apiGroups"][0].as_str().unwrap_or(""),
        first["resources"][0].as_str().unwrap_or(""),
        first["verbs"][0].as_str().unwrap_or("get"),
    )
    .await
}

/// Waits (up to 30 s) until the API server's authorizer allows `user` to `verb`
/// `group`/`resource` (in `namespace`, or cluster-wide): RBAC objects just created take
/// effect only once the authorizer's cache has them.
pub async fn wait_until_allowed(
    client: &Client,
    user: &str,
    namespace: Option<&str>,
    group: &str,
    resource: &str,
    verb: &str,
) -> anyhow::Result<()> {
    use k8s_openapi::api::authorization::v1::SubjectAccessReview;
    let review: SubjectAccessReview = from_json(serde_json::json!({
        "spec": {
            "user": user,
            "resourceAttributes": {
                "namespace": namespace.unwrap_or(""),
                "group": group,
                "resource": resource,
                "verb": verb
            }
        }
    }));
    let reviews = kube::Api::<SubjectAccessReview>::all(client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let answer = reviews
            .create(&kube::api::PostParams::default(), &review)
            .await?;
        if answer.status.is_some_and(|s| s.allowed) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{user} is still not allowed to {verb} {resource}.{group} after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: u16) -> Box<kube::core::Status> {
        Box::new(serde_json::from_value(serde_json::json!({ "code": code })).unwrap())
    }

    #[test]
    fn a_watch_rides_out_an_api_server_away_but_not_a_refusal() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let connect = kube::Error::Service(Box::new(refused));
        assert!(watch_error_passes(&watcher::Error::WatchStartFailed(
            connect
        )));
        for code in [500, 503, 429, 410] {
            let e = watcher::Error::InitialListFailed(kube::Error::Api(status(code)));
            assert!(watch_error_passes(&e), "{code} should be retried");
            assert!(watch_error_passes(&watcher::Error::WatchError(status(
                code
            ))));
        }
        for code in [401, 403, 404, 422] {
            let e = watcher::Error::InitialListFailed(kube::Error::Api(status(code)));
            assert!(!watch_error_passes(&e), "{code} should end the wait");
        }
        assert!(!watch_error_passes(&watcher::Error::NoResourceVersion));
    }
}
