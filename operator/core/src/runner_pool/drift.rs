//! `ShapeConformant`: does the live DaemonSet still carry the contract?
//!
//! Two checks, both naming what differs. (1) Every field the renderer sets must have
//! the rendered value in the live object (the API server adds defaults, so extra
//! fields are fine, except extra *named* list items — a container, volume, mount or
//! env var nobody rendered is drift). (2) The live pod template must hold nothing from
//! the contract's forbidden list, whoever put it there: a field we never render
//! (`capabilities.add`, say) would slip past the first check.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::Value;

/// Host paths that hand a container the node's container runtime.
const RUNTIME_SOCKET_MARKERS: [&str; 6] = [
    "containerd",
    "crio",
    "docker",
    "cri-dockerd",
    "podman",
    "kubelet",
];

fn containers(pod: &PodSpec) -> impl Iterator<Item = &Container> {
    pod.init_containers
        .iter()
        .flatten()
        .chain(pod.containers.iter())
}

fn is_under(path: &str, dir: &str) -> bool {
    let path = path.trim_end_matches('/');
    path == dir || path.starts_with(&format!("{dir}/"))
}

/// Everything in `pod` that the contract's "explicitly absent" list (and its
/// exactly-two-hostPath rule) forbids. Empty for a conformant pod.
pub fn forbidden_items(pod: &PodSpec) -> Vec<String> {
    let mut found = host_namespace_items(pod);
    found.extend(host_path_items(pod));
    for c in containers(pod) {
        found.extend(container_items(c));
    }
    found
}

/// The host's namespaces shared with the pod, or its user namespace not separate.
fn host_namespace_items(pod: &PodSpec) -> Vec<String> {
    let mut found = vec![];
    for (on, what) in [
        (pod.host_network, "hostNetwork"),
        (pod.host_pid, "hostPID"),
        (pod.host_ipc, "hostIPC"),
        (pod.share_process_namespace, "shareProcessNamespace"),
    ] {
        if on == Some(true) {
            found.push(format!("spec.template.spec.{what} is true"));
        }
    }
    if pod.host_users != Some(false) {
        found.push("spec.template.spec.hostUsers is not false".into());
    }
    found
}

/// Other than exactly two hostPath volumes, or one that reaches the host's devices or
/// a container runtime or kubelet socket.
fn host_path_items(pod: &PodSpec) -> Vec<String> {
    let mut found = vec![];
    let volumes = pod.volumes.as_deref().unwrap_or_default();
    let host_paths: Vec<_> = volumes
        .iter()
        .filter_map(|v| v.host_path.as_ref().map(|h| (&v.name, &h.path)))
        .collect();
    if host_paths.len() != 2 {
        found.push(format!(
            "{} hostPath volumes (the contract has exactly 2)",
            host_paths.len()
        ));
    }
    for (name, path) in &host_paths {
        if is_under(path, "/dev") {
            found.push(format!("volume {name} mounts /dev from the host ({path})"));
        }
        let lower = path.to_ascii_lowercase();
        if lower.ends_with(".sock") || RUNTIME_SOCKET_MARKERS.iter().any(|m| lower.contains(m)) {
            found.push(format!(
                "volume {name} reaches a container runtime or kubelet socket ({path})"
            ));
        }
    }
    found
}

/// A mount over /dev, a hostPort, or a securityContext that is missing or lets the
/// container be privileged, escalate, keep or add capabilities, or run as root.
fn container_items(c: &Container) -> Vec<String> {
    let mut found = vec![];
    let n = &c.name;
    for m in c.volume_mounts.iter().flatten() {
        if is_under(&m.mount_path, "/dev") {
            found.push(format!("container {n} mounts {} over /dev", m.mount_path));
        }
    }
    if c.ports
        .iter()
        .flatten()
        .any(|p| p.host_port.is_some_and(|h| h != 0))
    {
        found.push(format!("container {n} has a hostPort"));
    }
    let Some(sc) = &c.security_context else {
        found.push(format!("container {n} has no securityContext"));
        return found;
    };
    if sc.privileged == Some(true) {
        found.push(format!("container {n} is privileged"));
    }
    if sc.allow_privilege_escalation != Some(false) {
        found.push(format!("container {n} allows privilege escalation"));
    }
    let caps = sc.capabilities.as_ref();
    if let Some(add) = caps.and_then(|c| c.add.as_ref()).filter(|a| !a.is_empty()) {
        found.push(format!(
            "container {n} adds capabilities {}",
            add.join(", ")
        ));
    }
    if !caps
        .and_then(|c| c.drop.as_ref())
        .is_some_and(|d| d.iter().any(|x| x == "ALL"))
    {
        found.push(format!("container {n} does not drop ALL capabilities"));
    }
    if sc.run_as_user == Some(0) || sc.run_as_non_root != Some(true) {
        found.push(format!("container {n} may run as root"));
    }
    found
}

/// Parses a Kubernetes quantity into a number (enough for comparing ours).
fn quantity(s: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 12] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("m", 0.001),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("", 1.0),
    ];
    SUFFIXES.iter().find_map(|(suffix, mult)| {
        let num = s.strip_suffix(suffix)?;
        num.parse::<f64>().ok().map(|n| n * mult)
    })
}

fn named(list: &[Value]) -> bool {
    !list.is_empty()
        && list
            .iter()
            .all(|v| v.get("name").and_then(Value::as_str).is_some())
}

fn name_of(v: &Value) -> &str {
    v.get("name").and_then(Value::as_str).unwrap_or_default()
}

fn compare(path: &str, want: &Value, have: Option<&Value>, out: &mut Vec<String>) {
    let Some(have) = have.filter(|h| !h.is_null()) else {
        // The API server drops Go zero values of plain fields (`hostNetwork: false`,
        // `hostPID: false`): absent is what we asked for.
        let zero = matches!(want, Value::Null | Value::Bool(false)) || want.as_i64() == Some(0);
        if !zero {
            out.push(format!("{path} is missing"));
        }
        return;
    };
    match (want, have) {
        (Value::Object(w), Value::Object(h)) => {
            for (k, wv) in w {
                compare(&format!("{path}.{k}"), wv, h.get(k), out);
            }
        }
        (Value::Array(w), Value::Array(h)) if named(w) => {
            for wv in w {
                let found = h.iter().find(|hv| name_of(hv) == name_of(wv));
                compare(&format!("{path}[{}]", name_of(wv)), wv, found, out);
            }
            for hv in h {
                if !w.iter().any(|wv| name_of(wv) == name_of(hv)) {
                    out.push(format!("{path}[{}] is not in the contract", name_of(hv)));
                }
            }
        }
        (Value::Array(w), Value::Array(h)) => {
            if w.len() != h.len() {
                out.push(format!("{path} has {} items, want {}", h.len(), w.len()));
                return;
            }
            for (i, (wv, hv)) in w.iter().zip(h).enumerate() {
                compare(&format!("{path}[{i}]"), wv, Some(hv), out);
            }
        }
        (Value::String(w), Value::String(h))
            if path.contains(".resources.") && quantity(w) != quantity(h) =>
        {
            out.push(format!("{path} is {h}, want {w}"));
        }
        (Value::String(_), Value::String(_)) if path.contains(".resources.") => {}
        (w, h) if w != h => out.push(format!("{path} is {h}, want {w}")),
        _ => {}
    }
}

/// Every difference between the live DaemonSet and the rendered one, each naming the
/// field. Empty means conformant.
pub fn shape_drift(desired: &DaemonSet, live: &DaemonSet) -> Vec<String> {
    let want = serde_json::to_value(&desired.spec).unwrap_or_default();
    let have = serde_json::to_value(&live.spec).unwrap_or_default();
    let mut out = vec![];
    compare("spec", &want, Some(&have), &mut out);
    if let Some(pod) = live.spec.template.spec.as_ref() {
        for item in forbidden_items(pod) {
            if !out.contains(&item) {
                out.push(item);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner_pool::fixtures::{inputs, pool};
    use crate::runner_pool::render;
    use k8s_openapi::api::core::v1::{Capabilities, HostPathVolumeSource, Volume};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    fn rendered() -> DaemonSet {
        render(&pool("rp").build(), &inputs()).daemonset
    }
    fn pod(ds: &mut DaemonSet) -> &mut PodSpec {
        ds.spec.template.spec.as_mut().unwrap()
    }

    #[test]
    fn the_rendered_daemonset_conforms_to_itself() {
        assert_eq!(shape_drift(&rendered(), &rendered()), Vec::<String>::new());
    }

    #[test]
    fn server_defaults_and_canonical_quantities_are_not_drift() {
        let mut live = rendered();
        let p = pod(&mut live);
        p.dns_policy = Some("ClusterFirst".into());
        p.scheduler_name = Some("default-scheduler".into());
        let c = &mut p.containers[0];
        c.termination_message_path = Some("/dev/termination-log".into());
        let limits = c.resources.as_mut().unwrap().limits.as_mut().unwrap();
        let mib = limits["memory"]
            .0
            .trim_end_matches("Mi")
            .parse::<i64>()
            .unwrap();
        assert_eq!(mib % 16, 0, "fixture memory should be expressible in Ki");
        limits.insert("memory".into(), Quantity(format!("{}Ki", mib * 1024)));
        assert_eq!(shape_drift(&rendered(), &live), Vec::<String>::new());
    }

    #[test]
    fn false_host_namespaces_dropped_by_the_api_server_are_not_drift() {
        let mut live = rendered();
        let p = pod(&mut live);
        (p.host_network, p.host_pid, p.host_ipc) = (None, None, None);
        assert_eq!(shape_drift(&rendered(), &live), Vec::<String>::new());
        pod(&mut live).host_ipc = Some(true);
        assert!(!shape_drift(&rendered(), &live).is_empty());
    }

    #[test]
    fn a_changed_memory_limit_is_named() {
        let mut live = rendered();
        let limits = pod(&mut live).containers[0]
            .resources
            .as_mut()
            .unwrap()
            .limits
            .as_mut()
            .unwrap();
        limits.insert("memory".into(), Quantity("1Gi".into()));
        let d = shape_drift(&rendered(), &live);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(
            d[0].starts_with(
                "spec.template.spec.containers[runner].resources.limits.memory is 1Gi"
            ),
            "{d:?}"
        );
    }

    #[test]
    fn an_added_capability_is_named_even_though_we_never_render_add() {
        let mut live = rendered();
        let sc = pod(&mut live).containers[0]
            .security_context
            .as_mut()
            .unwrap();
        sc.capabilities = Some(Capabilities {
            add: Some(vec!["SYS_ADMIN".into()]),
            drop: Some(vec!["ALL".into()]),
        });
        let d = shape_drift(&rendered(), &live);
        assert!(
            d.iter()
                .any(|x| x == "container runner adds capabilities SYS_ADMIN"),
            "{d:?}"
        );
    }

    #[test]
    fn an_extra_dev_host_path_is_named_three_ways() {
        let mut live = rendered();
        pod(&mut live).volumes.as_mut().unwrap().push(Volume {
            name: "dev".into(),
            host_path: Some(HostPathVolumeSource {
                path: "/dev".into(),
                type_: None,
            }),
            ..Default::default()
        });
        let d = shape_drift(&rendered(), &live);
        assert!(
            d.iter()
                .any(|x| x == "spec.template.spec.volumes[dev] is not in the contract"),
            "{d:?}"
        );
        assert!(d.iter().any(|x| x.contains("3 hostPath volumes")), "{d:?}");
        assert!(
            d.iter().any(|x| x.contains("mounts /dev from the host")),
            "{d:?}"
        );
    }

    #[test]
    fn privileged_and_host_network_flips_are_named() {
        let mut live = rendered();
        let p = pod(&mut live);
        p.host_network = Some(true);
        p.containers[0]
            .security_context
            .as_mut()
            .unwrap()
            .privileged = Some(true);
        let d = shape_drift(&rendered(), &live);
        assert!(
            d.iter()
                .any(|x| x.starts_with("spec.template.spec.hostNetwork is true")),
            "{d:?}"
        );
        assert!(
            d.iter().any(|x| x == "container runner is privileged"),
            "{d:?}"
        );
    }

    #[test]
    fn a_runtime_socket_mount_is_forbidden() {
        let mut ds = rendered();
        let p = pod(&mut ds);
        p.volumes.as_mut().unwrap()[0]
            .host_path
            .as_mut()
            .unwrap()
            .path = "/run/containerd/containerd.sock".into();
        assert!(
            forbidden_items(p)
                .iter()
                .any(|x| x.contains("container runtime"))
        );
    }

    #[test]
    fn quantities_compare_by_value() {
        assert_eq!(quantity("1Gi"), quantity("1024Mi"));
        assert_eq!(quantity("1500m"), Some(1.5));
        assert_ne!(quantity("1G"), quantity("1Gi"));
    }
}
