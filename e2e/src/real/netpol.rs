//! What the tests under enforced NetworkPolicies share (kube-router's policy controller
//! on the real nodes, started by `hack/cluster.sh netpol-up`; hack/test.sh runs those
//! tests, `#[ignore]`d in the workspace run, after it): that enforcement runs, that a
//! pod's rules are programmed, and whether a connection from a pod gets through.

use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};

use super::{output_text, pin};

/// How long kube-router may take to program a new pod, and kube-proxy a new Service.
pub const PROGRAM_TIMEOUT: Duration = Duration::from_secs(90);

/// What one connection attempt from a pod did.
#[derive(Debug, PartialEq)]
pub enum Reach {
    /// The TCP connection was accepted (whatever was said on it).
    Connected,
    /// The connection was refused, timed out or had no route: blocked.
    Blocked(String),
}

/// `podmotion-testload get <addr>` inside `pod`, through `kubectl exec`.
pub async fn probe(ns: &str, pod: &str, binary: &str, addr: &str) -> Reach {
    let kubectl_bin = crate::kubectl_path().expect("kubectl");
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(kubectl_bin)
            .arg("--kubeconfig")
            .arg(crate::kubeconfig_path())
            .args(["-n", ns, "exec", pod, "--", binary, "get", addr])
            .output(),
    )
    .await
    .unwrap_or_else(|_| panic!("kubectl exec {pod} -- get {addr} did not return in 60s"))
    .expect("running kubectl");
    let text = output_text(&out);
    if out.status.success() {
        return Reach::Connected;
    }
    assert!(
        text.contains(&format!("podmotion-testload get {addr}:")),
        "kubectl exec in {ns}/{pod} failed before the probe ran: {text}"
    );
    // Errors of connect() mean blocked; anything later (a TLS server's binary answer, a
    // read timeout) happened on an accepted connection.
    if text.contains("os error 111")
        || text.contains("os error 113")
        || text.contains("timed out")
        || text.contains("os error 101")
    {
        Reach::Blocked(text.trim().to_owned())
    } else {
        Reach::Connected
    }
}

/// Retries until `pod` connects to `addr` (kube-proxy may still be programming a new
/// Service); fails with the last answer.
pub async fn expect_reaches(ns: &str, pod: &str, binary: &str, addr: &str, what: &str) {
    let deadline = tokio::time::Instant::now() + PROGRAM_TIMEOUT;
    loop {
        match probe(ns, pod, binary, addr).await {
            Reach::Connected => return,
            Reach::Blocked(e) if tokio::time::Instant::now() > deadline => panic!(
                "{ns}/{pod} must reach {what} ({addr}) but did not within {PROGRAM_TIMEOUT:?}: {e}"
            ),
            Reach::Blocked(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// `pod` is blocked from `addr`, twice in a row (the policy is already programmed for it).
pub async fn expect_blocked(ns: &str, pod: &str, binary: &str, addr: &str, what: &str) {
    for attempt in 1..=2 {
        let r = probe(ns, pod, binary, addr).await;
        assert!(
            matches!(r, Reach::Blocked(_)),
            "{ns}/{pod} must not reach {what} ({addr}), but connected (attempt {attempt})"
        );
    }
}

/// Waits until kube-router has a firewall chain for `ns/pod` (its rules name the pod).
pub async fn wait_programmed(ns: &str, pod: &str) {
    let needle = format!("POD name:{pod} namespace: {ns}");
    let deadline = tokio::time::Instant::now() + PROGRAM_TIMEOUT;
    loop {
        let rules = iptables_save_filter();
        if rules.contains(&needle) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "kube-router programmed no chain for {ns}/{pod} within {PROGRAM_TIMEOUT:?}; \
             its log: {}/logs/kube-router.log",
            crate::run_dir().display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fails with what to do unless a NetworkPolicy implementation runs on the real nodes.
pub fn require_enforcement() {
    let out = Command::new("iptables")
        .args(["-w", "-t", "filter", "-S", "KUBE-ROUTER-FORWARD"])
        .output();
    let running = out.as_ref().is_ok_and(|o| o.status.success());
    assert!(
        running,
        "no NetworkPolicy implementation runs on the real nodes (no KUBE-ROUTER-FORWARD \
         chain): start kube-router (hack/cluster.sh netpol-up, which hack/test.sh runs before this test) \
         must run as root. {}",
        out.map(|o| output_text(&o))
            .unwrap_or_else(|e| e.to_string())
    );
}

/// `iptables-save -t filter`: kube-router's rules.
fn iptables_save_filter() -> String {
    let out = Command::new("iptables-save")
        .args(["-t", "filter"])
        .output()
        .expect("running iptables-save");
    assert!(out.status.success(), "iptables-save: {}", output_text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Pod `name` of the testload image on `node`, serving `port`, ready when it listens.
pub fn testload_pod(name: &str, image: &str, node: &str, port: u16, labels: Value) -> Value {
    let mut spec = json!({
        "enableServiceLinks": false,
        "automountServiceAccountToken": false,
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": image, "args": ["serve", port.to_string()],
            "ports": [{"containerPort": port}],
            "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1}}]
    });
    pin(&mut spec, node);
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec})
}
