//! The real runner nodes (`hack/cluster.sh`, `REAL_RUNNER_NODES`, default 1:
//! pm-real-2, labelled and tainted `podmotion.io/runner-node=real`, with our KVM
//! device plugin, the Runner's Localhost seccomp profile and its two host trees) and
//! what a RunnerPool test on them starts from: the Runner stand-in image, a pool of
//! the seed's shape for those nodes, and the limits the kubelet gave a container (its
//! cgroup, read on this machine).

use std::path::PathBuf;

use kube::Client;
use podmotion_api::RunnerPool;
use serde_json::json;

use super::ready_nodes;
use crate::{from_json, run_dir};

/// Label (and taint) of the real runner nodes (hack/lib/real-nodes.sh).
pub const RUNNER_KEY: &str = "podmotion.io/runner-node";
pub const RUNNER_VALUE: &str = "real";
/// The KVM device the plugin on the runner nodes advertises.
pub const KVM: &str = "devices.kubevirt.io/kvm";
/// The Runner's seccomp profile in the kubelet's seccomp root.
pub const PROFILE: &str = "podmotion/compass-runner.json";
pub const SESSIONS: &str = "/var/lib/compass/sessions";
pub const RUNTIME: &str = "/run/compass";
/// The stand-in Runner's binary (its PID 1 in the `runner` container).
pub const STANDIN_BIN: &str = "/usr/local/bin/podmotion-runner-standin";

/// The Ready runner nodes, sorted; `None` when real-node tests are disabled. Panics
/// when there is none.
pub async fn runner_nodes(client: &Client) -> Option<Vec<String>> {
    ready_nodes(
        client,
        &format!("{RUNNER_KEY}={RUNNER_VALUE}"),
        "start the cluster with a runner node (REAL_RUNNER_NODES, default 1) or run \
         hack/cluster.sh add-runner-nodes",
    )
    .await
}

/// The Runner stand-in image from the list of every image hack/images.sh printed.
pub fn standin_image() -> String {
    let list = std::env::var_os("PODMOTION_IMAGES_LIST")
        .map(PathBuf::from)
        .unwrap_or_else(|| run_dir().join("images.txt"));
    let text = std::fs::read_to_string(&list)
        .unwrap_or_else(|e| panic!("reading {} (bash hack/images.sh > it): {e}", list.display()));
    text.lines()
        .map(str::trim)
        .find(|l| l.contains("/podmotion/podmotion-runner-standin@sha256:"))
        .unwrap_or_else(|| {
            panic!(
                "no podmotion/podmotion-runner-standin image in {}",
                list.display()
            )
        })
        .to_owned()
}

/// A pool `name` of the stand-in `image` on the runner nodes, of the seed's shape,
/// whose preflight does not require project quotas (the nodes' session tree has
/// none), with its own PriorityClass `<ns>-runner`; `spec` overrides its fields.
pub fn pool_manifest(name: &str, ns: &str, image: &str, spec: serde_json::Value) -> RunnerPool {
    let mut s = json!({
        "image": image,
        "sessionsPerNode": 1,
        "session": {"memoryMiB": 512, "milliCPU": 500},
        "nodes": {"labelKey": RUNNER_KEY, "labelValue": RUNNER_VALUE, "taintEffect": "NoSchedule"},
        "seccompProfile": PROFILE,
        "kvmResourceName": KVM,
        "hostPaths": {"sessionVolume": SESSIONS, "runtimeDir": RUNTIME},
        "preflight": {"requireProjectQuota": false},
        "priorityClass": {"name": format!("{ns}-runner"), "create": true, "value": 100000},
        "server": {"serviceName": "compass-server", "port": 8443},
        "metrics": {"port": 9090, "path": "/metrics", "scrapeNamespace": ns},
        "probes": {"readiness": {"path": "/readyz", "periodSeconds": 2}},
        "reapBudgetSeconds": 5,
    });
    for (k, v) in spec.as_object().expect("an object") {
        s[k] = v.clone();
    }
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
        "metadata": {"name": name}, "spec": s
    }))
}

/// The text of cgroup file `v1` of `controller` (cgroup v1), or of `v2` (cgroup v2)
/// when no v1 hierarchy has that controller, for the cgroup of process `pid`: where
/// the kubelet put a container's limits. The hierarchy is found through this
/// process's mount table, the path taken relative to the mount's root.
pub fn cgroup_value(pid: u32, controller: &str, v1: &str, v2: &str) -> anyhow::Result<String> {
    use anyhow::Context;
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .with_context(|| format!("the cgroups of {pid}"))?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo")?;
    // "id:controllers:path" lines; v2's has no controllers.
    let line = |v1: bool| {
        cgroups.lines().find_map(|l| {
            let mut parts = l.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let hit = if v1 {
                controllers.split(',').any(|c| c == controller)
            } else {
                controllers.is_empty()
            };
            hit.then(|| path.to_owned())
        })
    };
    let (path, mount, file) = match line(true) {
        Some(p) => (p, cgroup_mount(&mounts, Some(controller)), v1),
        None => (
            line(false).with_context(|| format!("no cgroup of {pid}:\n{cgroups}"))?,
            cgroup_mount(&mounts, None),
            v2,
        ),
    };
    let (point, root) = mount.with_context(|| format!("no mount of {path}'s hierarchy"))?;
    let rel = path.strip_prefix(root.as_str()).unwrap_or(&path);
    let full = format!("{point}/{}/{file}", rel.trim_matches('/'));
    let text = std::fs::read_to_string(&full).with_context(|| full.clone())?;
    Ok(text.trim().to_owned())
}

/// The mount point and root of the cgroup v1 hierarchy of `controller`, or of the
/// cgroup v2 hierarchy (`None`), from a mountinfo table.
fn cgroup_mount(mountinfo: &str, controller: Option<&str>) -> Option<(String, String)> {
    mountinfo.lines().find_map(|l| {
        let (fields, fs) = l.split_once(" - ")?;
        let f: Vec<&str> = fields.split_whitespace().collect();
        let fs: Vec<&str> = fs.split_whitespace().collect();
        let wanted = match controller {
            Some(c) => fs.first() == Some(&"cgroup") && fs.get(2)?.split(',').any(|o| o == c),
            None => fs.first() == Some(&"cgroup2"),
        };
        if !wanted {
            return None;
        }
        Some((f.get(4)?.to_string(), f.get(3)?.to_string()))
    })
}
