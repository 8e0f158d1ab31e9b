//! Scrape targets found as Prometheus finds them: from the chart's own ServiceMonitor
//! and PodMonitor objects, read back from the API server, the way the Prometheus
//! Operator turns them into scrape configs — a ServiceMonitor's `namespaceSelector` and
//! `selector` pick Services, each endpoint's named `port` is looked up in the Service's
//! EndpointSlices (ready addresses only); a PodMonitor's pick pods (Running, with an IP),
//! each endpoint's named `port` is looked up in the pods' container ports. Each target
//! is then scraped at its address and `path` from the machine the nodes run on (the pod
//! network is routed there), not through a port-forward to a port the test names.
//!
//! The cluster here has no Prometheus Operator, so [`MonitoringCrds`] installs
//! stand-in CRDs of the same group, version and kinds (the two monitors and
//! PrometheusRule) without a schema (every field kept): enough for the chart's objects to be created and read back, not a check of
//! their fields against the upstream schema (the chart tests render them).

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::Value;

use super::{kubectl, output_text};

const GROUP: &str = "monitoring.coreos.com";
/// The kinds that name scrape targets.
const KINDS: [(&str, &str); 2] = [
    ("ServiceMonitor", "servicemonitors"),
    ("PodMonitor", "podmonitors"),
];
/// The stand-in CRDs: the monitors, and the PrometheusRule the chart renders beside
/// them once the group's version is served (its `auto` asks for the group, not a kind).
const CRDS: [(&str, &str); 3] = [KINDS[0], KINDS[1], ("PrometheusRule", "prometheusrules")];

/// The stand-in CRDs while it lives: created if the cluster has none, removed on drop
/// if this created them (declare it before the release's uninstall guard, so that the
/// release goes first).
pub struct MonitoringCrds {
    created: Vec<String>,
}

impl MonitoringCrds {
    pub fn ensure() -> MonitoringCrds {
        let mut created = vec![];
        for (kind, plural) in CRDS {
            let name = format!("{plural}.{GROUP}");
            if kubectl(&["get", "crd", &name]).status.success() {
                continue;
            }
            let crd = serde_json::json!({
                "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": name, "labels": {"podmotion.io/e2e-stand-in": "true"}},
                "spec": {"group": GROUP, "scope": "Namespaced",
                    "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(),
                        "listKind": format!("{kind}List")},
                    "versions": [{"name": "v1", "served": true, "storage": true,
                        "schema": {"openAPIV3Schema": {"type": "object",
                            "x-kubernetes-preserve-unknown-fields": true}}}]}
            });
            let path = std::env::temp_dir().join(format!("podmotion-e2e-{name}.json"));
            std::fs::write(&path, crd.to_string()).unwrap();
            let out = kubectl(&["create", "-f", path.to_str().unwrap()]);
            let _ = std::fs::remove_file(&path);
            assert!(
                out.status.success(),
                "creating {name}: {}",
                output_text(&out)
            );
            created.push(name);
        }
        for name in &created {
            let crd = format!("crd/{name}");
            let out = kubectl(&["wait", "--for=condition=Established", &crd, "--timeout=60s"]);
            assert!(out.status.success(), "{name}: {}", output_text(&out));
        }
        MonitoringCrds { created }
    }
}

impl Drop for MonitoringCrds {
    /// Waits for the CRDs to go: a release installed next with the chart's `auto`
    /// must not see the group still served and render objects of a kind then gone.
    fn drop(&mut self) {
        for name in &self.created {
            let crd = format!("crd/{name}");
            let out = kubectl(&["delete", &crd, "--wait=true", "--timeout=120s"]);
            if !out.status.success() {
                eprintln!("deleting {crd}: {}", output_text(&out));
            }
        }
    }
}

/// One scrape target: the monitor that names it, the pod behind it, and where.
#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// `<Kind>/<namespace>/<name>` of the monitor.
    pub monitor: String,
    pub namespace: String,
    pub pod: String,
    /// `ip:port`.
    pub address: String,
    pub path: String,
}

fn get_json(args: &[&str]) -> Value {
    let out = kubectl(args);
    assert!(
        out.status.success(),
        "kubectl {}: {}",
        args.join(" "),
        output_text(&out)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn items(v: &Value) -> &[Value] {
    v["items"].as_array().map(Vec::as_slice).unwrap_or_default()
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// `matchLabels` as a kubectl selector; `matchExpressions` is refused (the chart uses
/// none, and this discovery does not evaluate them).
fn label_selector(sel: &Value) -> String {
    assert!(
        sel.get("matchExpressions").is_none(),
        "matchExpressions is not evaluated here: {sel}"
    );
    let labels = sel["matchLabels"]
        .as_object()
        .unwrap_or_else(|| panic!("a monitor selects by matchLabels: {sel}"));
    assert!(!labels.is_empty(), "an empty selector selects everything");
    labels
        .iter()
        .map(|(k, v)| format!("{k}={}", text(v)))
        .collect::<Vec<_>>()
        .join(",")
}

/// The namespaces a monitor in `own` looks in (`namespaceSelector.matchNames`, else its
/// own namespace; `any` is refused: the chart never asks it).
fn namespaces(m: &Value, own: &str) -> Vec<String> {
    let ns = &m["spec"]["namespaceSelector"];
    assert!(ns.get("any").is_none(), "namespaceSelector.any: {ns}");
    match ns["matchNames"].as_array() {
        Some(names) => names.iter().map(|n| text(n).to_string()).collect(),
        None => vec![own.to_string()],
    }
}

/// Every target of every ServiceMonitor and PodMonitor in `namespace`.
pub fn targets(namespace: &str) -> Vec<Target> {
    let mut out = vec![];
    for (kind, plural) in KINDS {
        let list = get_json(&["-n", namespace, "get", plural, "-o", "json"]);
        for m in items(&list) {
            let id = format!("{kind}/{namespace}/{}", text(&m["metadata"]["name"]));
            let selector = label_selector(&m["spec"]["selector"]);
            for ns in namespaces(m, namespace) {
                if kind == "ServiceMonitor" {
                    out.extend(service_targets(&id, &ns, &selector, m));
                } else {
                    out.extend(pod_targets(&id, &ns, &selector, m));
                }
            }
        }
    }
    out
}

fn service_targets(id: &str, ns: &str, selector: &str, m: &Value) -> Vec<Target> {
    let mut out = vec![];
    let services = get_json(&["-n", ns, "get", "services", "-l", selector, "-o", "json"]);
    for svc in items(&services) {
        let name = text(&svc["metadata"]["name"]);
        let slices = get_json(&[
            "-n",
            ns,
            "get",
            "endpointslices",
            "-l",
            &format!("kubernetes.io/service-name={name}"),
            "-o",
            "json",
        ]);
        for ep in m["spec"]["endpoints"].as_array().into_iter().flatten() {
            let port_name = text(&ep["port"]);
            assert!(
                !port_name.is_empty(),
                "{id}: an endpoint without a port name"
            );
            for slice in items(&slices) {
                let Some(port) = slice["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| text(&p["name"]) == port_name)
                    .and_then(|p| p["port"].as_u64())
                else {
                    continue;
                };
                for e in slice["endpoints"].as_array().into_iter().flatten() {
                    if e["conditions"]["ready"] == false {
                        continue;
                    }
                    for a in e["addresses"].as_array().into_iter().flatten() {
                        out.push(Target {
                            monitor: id.to_string(),
                            namespace: ns.to_string(),
                            pod: text(&e["targetRef"]["name"]).to_string(),
                            address: format!("{}:{port}", text(a)),
                            path: path(ep),
                        });
                    }
                }
            }
        }
    }
    out
}

fn pod_targets(id: &str, ns: &str, selector: &str, m: &Value) -> Vec<Target> {
    let mut out = vec![];
    let pods = get_json(&["-n", ns, "get", "pods", "-l", selector, "-o", "json"]);
    for pod in items(&pods) {
        let ip = text(&pod["status"]["podIP"]);
        if text(&pod["status"]["phase"]) != "Running" || ip.is_empty() {
            continue;
        }
        for ep in m["spec"]["podMetricsEndpoints"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let port_name = text(&ep["port"]);
            assert!(
                !port_name.is_empty(),
                "{id}: an endpoint without a port name"
            );
            let port = pod["spec"]["containers"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|c| c["ports"].as_array().into_iter().flatten())
                .find(|p| text(&p["name"]) == port_name)
                .and_then(|p| p["containerPort"].as_u64());
            // Prometheus drops a pod without the named port: so does this.
            let Some(port) = port else { continue };
            out.push(Target {
                monitor: id.to_string(),
                namespace: ns.to_string(),
                pod: text(&pod["metadata"]["name"]).to_string(),
                address: format!("{ip}:{port}"),
                path: path(ep),
            });
        }
    }
    out
}

fn path(ep: &Value) -> String {
    match text(&ep["path"]) {
        "" => "/metrics".into(),
        p => p.into(),
    }
}

/// `GET <path>` on the target, as a scraper does (HTTP/1.1, no port-forward): the body
/// of a 200 answer. Retries a refused or failed connection for up to 40 s (a pod just
/// Ready).
pub fn scrape(t: &Target) -> String {
    let mut last = String::new();
    for _ in 0..20 {
        match get(t) {
            Ok(body) => return body,
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    panic!("scraping {t:?}: {last}");
}

fn get(t: &Target) -> anyhow::Result<String> {
    let addr = t.address.parse()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        s,
        "GET {} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
        t.path, t.address
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let (head, body) = out
        .split_once("\r\n\r\n")
        .ok_or_else(|| anyhow::anyhow!("no HTTP head in {out:?}"))?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "{head}");
    Ok(body.to_string())
}
