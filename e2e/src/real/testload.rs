//! The `testload` workload on the real nodes, shared by the real-node migration tests:
//! a one-replica Deployment of the counter server (`podmotion-testload serve`, a counter
//! incremented every 10 ms, ballast of N MiB), its Service, and what the tests read from
//! it — the counter on a new connection, the pod's address, node and restarts, a
//! migration's end, and "only the source serves, unrestarted" after a rollback — and
//! [`World`], what a real-node migration test starts from.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::PodMigrationStatus;
use serde_json::json;

use super::{Images, REAL_NODE_TAINT, Uninstall, helm_install, real_nodes};
use crate::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_for, wait_list,
};

/// How long a pod may take to be scheduled, pulled, started and Ready on a real node.
pub const POD_TIMEOUT: Duration = Duration::from_secs(240);
/// How long a PodMigration between the real nodes may take to end.
pub const MIGRATION_TIMEOUT: Duration = Duration::from_secs(300);
/// The server's port in the pod.
pub const PORT: u16 = 8080;

/// A Deployment `name` (label `app=<name>`) of one testload replica with `ballast_mib`
/// MiB of ballast, on any real node, Ready once it listens. It runs as uid 0: see
/// docs/migration-controller.md, "Container user".
pub fn deployment(name: &str, image: &str, ballast_mib: u32) -> Deployment {
    from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "nodeSelector": {"type": "real"},
                "tolerations": [{"key": REAL_NODE_TAINT, "operator": "Exists", "effect": "NoSchedule"}],
                "enableServiceLinks": false,
                "automountServiceAccountToken": false,
                // Longer than the commit's wait for the Services (about 2.5 s): a
                // ReplicaSet that deletes the frozen source first (its own grace
                // period) must not have its kubelet kill it before the agent's kill
                // sends its peers a FIN. The server exits at once on SIGTERM.
                "terminationGracePeriodSeconds": 10,
                "containers": [{"name": "app", "image": image,
                    "args": ["serve", PORT.to_string(), ballast_mib.to_string()],
                    "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                    "ports": [{"containerPort": PORT}],
                    "readinessProbe": {"tcpSocket": {"port": PORT}, "periodSeconds": 2}}]}}}
    }))
}

/// `deploy` (a [`deployment`]) on the host network of its node, its server (readiness
/// probe and container port too) on `port` instead of [`PORT`]: the real nodes share
/// this machine's network namespace, so a test picks a port nothing else uses. (The
/// namespace must admit `hostNetwork`: PodSecurity `privileged`.)
pub fn on_host_network(deploy: Deployment, port: u16) -> Deployment {
    let mut d = serde_json::to_value(deploy).unwrap();
    let spec = &mut d["spec"]["template"]["spec"];
    spec["hostNetwork"] = json!(true);
    let c = &mut spec["containers"][0];
    c["args"][1] = json!(port.to_string());
    c["ports"] = json!([{"containerPort": port}]);
    c["readinessProbe"]["tcpSocket"]["port"] = json!(port);
    from_json(d)
}

/// A port in 20000–29999 for a server on the host network, drawn at random.
pub fn random_host_port() -> u16 {
    20000 + u16::from_str_radix(&random_suffix()[..4], 16).unwrap() % 10000
}

/// The port of the `forward` sidecar [`with_forwarder`] adds.
pub const FORWARD_PORT: u16 = 8081;

/// `deploy` (a [`deployment`]) with a second container `forward`: the testload image's
/// `forward` mode on [`FORWARD_PORT`], which relays each line to the server over
/// localhost and counts what it relayed (`forwarded`). `native`: as a native sidecar
/// (an init container with `restartPolicy: Always`, started before `app`), else as a
/// second regular container.
pub fn with_forwarder(deploy: Deployment, native: bool) -> Deployment {
    let mut d = serde_json::to_value(deploy).unwrap();
    let spec = &mut d["spec"]["template"]["spec"];
    let app = spec["containers"][0].clone();
    let mut fwd = json!({"name": "forward", "image": app["image"],
        "args": ["forward", FORWARD_PORT.to_string(), PORT.to_string()],
        "securityContext": app["securityContext"],
        "ports": [{"containerPort": FORWARD_PORT}]});
    if native {
        fwd["restartPolicy"] = json!("Always");
        spec["initContainers"] = json!([fwd]);
    } else {
        spec["containers"].as_array_mut().unwrap().push(fwd);
    }
    from_json(d)
}

/// Every container's restart count (native sidecars included), by name.
pub fn restart_counts(p: &Pod) -> Vec<(String, i32)> {
    let st = p.status.as_ref();
    st.and_then(|s| s.init_container_statuses.as_ref())
        .into_iter()
        .flatten()
        .chain(
            st.and_then(|s| s.container_statuses.as_ref())
                .into_iter()
                .flatten(),
        )
        .map(|c| (c.name.clone(), c.restart_count))
        .collect()
}

/// A ClusterIP Service `name` in front of `app=<name>`.
pub fn service(name: &str) -> Service {
    from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": PORT}]}
    }))
}

/// One line to the testload server at `addr` on a new connection, and its answer.
pub fn ask(addr: &str, line: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    writeln!(s, "{line}")?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    Ok(answer.trim_end().to_owned())
}

/// The counter of the server at `addr`, on a new connection.
pub fn counter(addr: &str) -> u64 {
    let a = ask(addr, "get").unwrap_or_else(|e| panic!("get from {addr}: {e}"));
    a.parse()
        .unwrap_or_else(|e| panic!("counter from {addr}: {a:?}: {e}"))
}

/// The counter on a new connection to an address whose pod's network was just locked:
/// a source the migration's rollback has just thawed, or a Service right after a commit
/// (the moved copy's network was locked during its restore). The host's neighbour
/// entry for the pod's address failed while the network was locked; the broker's
/// unlock announces the address (gratuitous ARP, IPv6 Neighbour Advertisement) so that
/// the entry is settled at once (root test
/// `broker_binary_unlock_announces_the_pods_address_to_the_node`). Should the host
/// still answer EHOSTUNREACH, that is retried for up to 90 s and printed as a NOTE
/// with the neighbour entry, so a run shows that it happened and for how long; past
/// that the failure prints the host's whole neighbour table. (A CI rehearsal once saw
/// a Service unreachable this way for over 30 s right after a commit, undiagnosed:
/// the bound was 30 s and the message carried no neighbour table then.)
/// Anything else (a refused connection: the listener is gone) fails.
pub fn counter_when_reachable(addr: &str, what: &str) -> u64 {
    let start = std::time::Instant::now();
    let mut first_failure = None;
    loop {
        match ask(addr, "get") {
            Ok(a) => {
                if let Some(neigh) = first_failure {
                    eprintln!(
                        "NOTE {what}: {addr} unreachable for {} ms (the host's neighbour entry then: {neigh})",
                        start.elapsed().as_millis()
                    );
                }
                return a
                    .parse()
                    .unwrap_or_else(|e| panic!("counter from {addr}: {a:?}: {e}"));
            }
            Err(e)
                if e.raw_os_error() == Some(113) && start.elapsed() < Duration::from_secs(90) =>
            {
                if first_failure.is_none() {
                    let ip = addr.rsplit_once(':').map_or(addr, |(ip, _)| ip);
                    let out = std::process::Command::new("ip")
                        .args(["neigh", "show", ip])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                        .unwrap_or_else(|e| format!("ip neigh: {e}"));
                    first_failure = Some(out);
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!(
                "{what}: get from {addr}: {e} (after {} ms; the host's neighbour entry at the first failure: {first_failure:?}; its neighbour table now:\n{})",
                start.elapsed().as_millis(),
                neighbours()
            ),
        }
    }
}

/// The counter of a workload its container just started again (a restart after the
/// workload died): the kubelet may report the restarted container Ready before its
/// workload listens (seen once on these nodes, 2026-12-07: Ready 7 ms after
/// `StartContainer` returned, the next connection refused), so a refused connection
/// is tried again for up to 10 s and printed as a NOTE. Anything else, or a refusal
/// past that, fails.
pub fn counter_once_listening(addr: &str, what: &str) -> u64 {
    let start = std::time::Instant::now();
    loop {
        match ask(addr, "get") {
            Ok(a) => {
                if start.elapsed() > Duration::from_millis(50) {
                    eprintln!(
                        "NOTE {what}: {addr} refused connections for {} ms after its container was Ready",
                        start.elapsed().as_millis()
                    );
                }
                return a
                    .parse()
                    .unwrap_or_else(|e| panic!("counter from {addr}: {a:?}: {e}"));
            }
            Err(e)
                if e.kind() == std::io::ErrorKind::ConnectionRefused
                    && start.elapsed() < Duration::from_secs(10) =>
            {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!(
                "{what}: get from {addr}: {e} (after {} ms)",
                start.elapsed().as_millis()
            ),
        }
    }
}

/// The host's IPv4 neighbour table (the real nodes share the host's network namespace),
/// for a failure message.
fn neighbours() -> String {
    std::process::Command::new("ip")
        .args(["-4", "neigh", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_else(|e| format!("ip neigh: {e}"))
}

/// `<pod IP>:8080`.
pub fn addr(p: &Pod) -> String {
    format!("{}:{PORT}", pod_ip(p))
}

pub fn pod_ip(p: &Pod) -> String {
    p.status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .unwrap_or_default()
}

pub fn node_of(p: &Pod) -> String {
    p.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default()
}

/// Restarts of the pod's first container.
pub fn restart_count(p: &Pod) -> i32 {
    p.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .map(|c| c.restart_count)
        .expect("container status")
}

/// The status of PodMigration `name` once its phase is final.
pub async fn ended(pms: &Api<PodMigration>, name: &str) -> PodMigrationStatus {
    let m = wait_for(
        pms,
        name,
        MIGRATION_TIMEOUT,
        "the PodMigration to end",
        |m| {
            m.and_then(|m| m.status.as_ref())
                .is_some_and(|s| s.phase.is_terminal())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    m.and_then(|m| m.status).expect("status")
}

/// The pods whose name marks them as a migration's target pod of `source`.
pub fn target_pods_of<'a>(ps: &'a [Pod], source: &str) -> Vec<&'a Pod> {
    let prefix = format!("{source}-pm-");
    ps.iter()
        .filter(|p| p.name_any().starts_with(&prefix))
        .collect()
}

/// After an interrupted migration: of the pods labelled `app=<app>` only the source is
/// left (the same one, never restarted, Ready), no target pod of it exists, and it
/// serves the same counter, larger than `before`. Returns that counter.
pub async fn source_serves_alone(
    pods: &Api<Pod>,
    app: &str,
    source: &Pod,
    before: u64,
    what: &str,
) -> u64 {
    let name = source.name_any();
    wait_list(
        pods,
        "",
        POD_TIMEOUT,
        &format!("{what}: only the source pod, Ready, and no target pod"),
        |ps| {
            target_pods_of(ps, &name).is_empty()
                && ps
                    .iter()
                    .filter(|p| p.labels().get("app").map(String::as_str) == Some(app))
                    .map(|p| (p.uid(), pod_running_ready(p)))
                    .collect::<Vec<_>>()
                    == vec![(source.uid(), true)]
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let now = pods.get(&name).await.unwrap();
    assert_eq!(restart_count(&now), 0, "{what}: the source was restarted");
    let after = counter_when_reachable(&addr(&now), what);
    assert!(
        after > before,
        "{what}: the source serves its own counter on: {before} then {after}"
    );
    after
}

/// The moved copy `moved` serves the state it was moved with: its counter, read once
/// it is reachable, is not below `before`, and its ballast's digest is `digest`, page
/// for page. Returns the counter.
pub fn moved_copy_continues(moved: &Pod, before: u64, digest: &str) -> u64 {
    let after = counter_when_reachable(&addr(moved), "the restored copy");
    assert!(
        after >= before,
        "the counter went back: {before} -> {after}"
    );
    assert_eq!(
        ask(&addr(moved), "digest").unwrap(),
        digest,
        "the restored copy's memory is the source's, page for page"
    );
    after
}

/// Waits (60 s at most) until the testload pod `p` has written its whole ballast, so
/// nothing is dumped before it.
pub fn wait_ballast(p: &Pod) {
    for _ in 0..600 {
        if ask(&addr(p), "ballast").is_ok_and(|a| a == "filled") {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The one replica of the testload app `app`, once Ready with its ballast written.
pub async fn ready_replica(pods: &Api<Pod>, app: &str) -> Pod {
    let replica = wait_list(
        pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        "the replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    wait_ballast(&replica);
    replica
}

/// A real node of `nodes` other than `pod`'s.
pub fn other_node(nodes: &[String], pod: &Pod) -> String {
    let on = node_of(pod);
    nodes
        .iter()
        .find(|n| **n != on)
        .expect("a second real node")
        .clone()
}

/// What a real-node migration test runs against: the operator's and the application's
/// namespaces (deleted on drop), the real nodes, the chart release (uninstalled on
/// drop, before the namespaces go) and one testload replica, Ready on a real node with
/// its ballast written.
pub struct World {
    // Fields drop in this order: the release, then the namespaces.
    _uninstall: Uninstall,
    pub app: TestNamespace,
    pub op: TestNamespace,
    pub nodes: Vec<String>,
    pub images: Images,
    /// The testload pod, as it was once Ready.
    pub source: Pod,
}

impl World {
    /// Namespaces `e2e-<prefix>-op` (restricted) and `e2e-<prefix>-app` (baseline: the
    /// workload runs as uid 0, see docs/migration-controller.md, "Container user"), the
    /// chart installed with `extra` values (lease `podmotion-e2e-<prefix>`), and a
    /// Deployment `app` of one testload replica with `ballast_mib` MiB. `None` where
    /// there are no real nodes.
    pub async fn new(prefix: &str, app: &str, ballast_mib: u32, extra: &[&str]) -> Option<World> {
        World::with_deployment(prefix, extra, |images| {
            deployment(app, &images.testload().unwrap(), ballast_mib)
        })
        .await
    }

    /// As [`World::new`], with the Deployment `deploy` makes from the images (a
    /// [`deployment`], changed: its name is its `app` label, its first container the
    /// testload server).
    pub async fn with_deployment(
        prefix: &str,
        extra: &[&str],
        deploy: impl FnOnce(&Images) -> Deployment,
    ) -> Option<World> {
        let op = TestNamespace::new(&format!("{prefix}-op"), PodSecurity::Restricted).await?;
        let nodes = real_nodes(&op.client).await?;
        assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
        let app_ns = TestNamespace::new(&format!("{prefix}-app"), PodSecurity::Baseline).await?;
        let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
        let uninstall = helm_install(
            &format!("pm{}", random_suffix()),
            &images,
            &op.name,
            &app_ns.name,
            &format!("podmotion-e2e-{prefix}"),
            extra,
        );
        let deploy = deploy(&images);
        let app = deploy.name_any();
        app_ns
            .api::<Deployment>()
            .create(&PostParams::default(), &deploy)
            .await
            .unwrap();
        let source = ready_replica(&app_ns.api::<Pod>(), &app).await;
        Some(World {
            _uninstall: uninstall,
            app: app_ns,
            op,
            nodes,
            images,
            source,
        })
    }

    /// The chart release's name (in the operator's namespace).
    pub fn release(&self) -> &str {
        &self._uninstall.release
    }

    /// The namespace of the release's node agents.
    pub fn agents(&self) -> String {
        format!("{}-agents", self.op.name)
    }

    /// The phases the operator logged a migration entering, in order: its info lines
    /// "migration phase changed" (the chart's JSON log format) whose `uid` is `uid`,
    /// each as (`to`, `reason`).
    pub fn phase_changes_logged(&self, uid: &str) -> Vec<(String, String)> {
        let out = self.op.kubectl(&[
            "-n",
            &self.op.name,
            "logs",
            "-l",
            "app.kubernetes.io/component=operator",
            "--tail=-1",
        ]);
        out.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["message"] == "migration phase changed" && v["uid"] == uid)
            .map(|v| {
                let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                (text("to"), text("reason"))
            })
            .collect()
    }

    /// A real node other than the source's.
    pub fn target_node(&self) -> String {
        other_node(&self.nodes, &self.source)
    }

    /// A ClusterIP Service in front of the app `app`; its `ClusterIP:port`.
    pub async fn service(&self, app: &str) -> String {
        let svc = self
            .app
            .api::<Service>()
            .create(&PostParams::default(), &service(app))
            .await
            .unwrap();
        format!("{}:{PORT}", svc.spec.unwrap().cluster_ip.unwrap())
    }
}

/// Waits (POD_TIMEOUT) for pod `name` to be Running and Ready; the pod.
pub async fn ready_pod(api: &Api<Pod>, name: &str) -> Pod {
    wait_for(
        api,
        name,
        POD_TIMEOUT,
        "the pod to be Running and Ready",
        |p| p.is_some_and(pod_running_ready),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .unwrap()
}
