//! What the checks need of the source pod and the claims it mounts, read from the
//! objects (`PodFacts::from_pod`, `ClaimFacts::from_objects`): its owner, placement,
//! containers, volumes and the users its containers run as.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, NodeSelector, PersistentVolume, PersistentVolumeClaim, Pod, PodSpec, Toleration,
    Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use podmotion_api::names::annotations;

use super::resources::{Resources, pod_requests};
use crate::migration::render::{HOLDER_INSTALLER, effective_probe};

/// The controller of a pod (its controlling owner reference).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerFacts {
    pub kind: String,
    pub name: String,
    pub uid: String,
}

/// What the checks need of the source pod.
#[derive(Clone, Debug, PartialEq)]
pub struct PodFacts {
    pub name: String,
    pub uid: String,
    pub node: Option<String>,
    pub running: bool,
    pub terminating: bool,
    pub owner: Option<OwnerFacts>,
    pub requests: Resources,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    /// `affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`: the
    /// kubelet re-checks it when admitting the target pod.
    pub required_node_affinity: Option<NodeSelector>,
    pub namespace: String,
    /// A static pod's mirror: annotation `kubernetes.io/config.mirror` or owned by its
    /// Node.
    pub static_pod: bool,
    /// Which of `hostNetwork`, `hostPID` and `hostIPC` the pod sets.
    pub host_namespaces: Vec<&'static str>,
    /// The containers that run for the pod's life: `containers`, then native sidecars
    /// (init containers with `restartPolicy: Always`).
    pub containers: Vec<String>,
    /// `(container, resource)` for every requested or limited resource other than
    /// cpu, memory, ephemeral-storage and hugepages-*.
    pub extended_resources: Vec<(String, String)>,
    /// Volumes whose data stays on the node and which the target gets fresh:
    /// `(volume, kind)`.
    pub local_volumes: Vec<(String, &'static str)>,
    /// In-tree disks attached to one node at a time: `(volume, kind)`.
    pub node_attached_disks: Vec<(String, &'static str)>,
    /// The PersistentVolumeClaims the pod mounts, with what the controller read of them.
    pub claims: Vec<PodClaim>,
    /// The check a migration without `spec.probe` uses (the pod's readiness probe,
    /// `render::effective_probe`) is an exec probe.
    pub readiness_exec_probe: bool,
    /// `(container, uid)` for each container of [`PodFacts::containers`] known not to
    /// run as root: the uid the kubelet reports its process runs as
    /// (`status.containerStatuses[].user.linux.uid`, the image's `USER` resolved), else
    /// the pod's or container's `securityContext.runAsUser`. A container whose user
    /// neither tells (an image's `USER` on a runtime that does not report it) is not
    /// listed: its agent checks the process itself at `Prepare`, before any freeze.
    pub non_root_containers: Vec<(String, i64)>,
    /// `(container, why)` for each container of [`PodFacts::containers`] whose status
    /// does not report it running (waiting, terminated, or not reported yet): it has
    /// no process to dump, so a pod of several containers would lose it.
    pub not_running_containers: Vec<(String, String)>,
}

/// A claim mounted by the pod.
#[derive(Clone, Debug, PartialEq)]
pub struct PodClaim {
    pub volume: String,
    pub claim: String,
    /// `None`: the claim does not exist (or was not read), which never counts as
    /// movable.
    pub facts: Option<ClaimFacts>,
}

/// What the checks need of a PersistentVolumeClaim and the volume bound to it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClaimFacts {
    /// The modes the bound volume offers (`status.accessModes`, else the requested).
    pub access_modes: Vec<String>,
    /// The bound PersistentVolume.
    pub volume_name: Option<String>,
    /// `local` or `hostPath` when the bound volume is one: its data is on one node.
    pub node_local_kind: Option<&'static str>,
    /// The bound volume's `spec.nodeAffinity.required` (zonal disks, local volumes):
    /// the target node must satisfy it, as the scheduler would have checked.
    pub node_affinity: Option<NodeSelector>,
}

impl ClaimFacts {
    /// From the claim and, when bound and readable, its PersistentVolume.
    pub fn from_objects(pvc: &PersistentVolumeClaim, pv: Option<&PersistentVolume>) -> ClaimFacts {
        let spec = pvc.spec.clone().unwrap_or_default();
        let bound_modes = pvc
            .status
            .as_ref()
            .and_then(|s| s.access_modes.clone())
            .filter(|m| !m.is_empty());
        let pv_spec = pv.and_then(|v| v.spec.as_ref());
        ClaimFacts {
            access_modes: bound_modes
                .or(spec.access_modes.clone())
                .unwrap_or_default(),
            volume_name: spec.volume_name.clone().filter(|n| !n.is_empty()),
            node_local_kind: pv_spec.and_then(|s| {
                if s.local.is_some() {
                    Some("local")
                } else if s.host_path.is_some() {
                    Some("hostPath")
                } else {
                    None
                }
            }),
            node_affinity: pv_spec
                .and_then(|s| s.node_affinity.as_ref())
                .and_then(|a| a.required.clone()),
        }
    }
}

/// Resources a pod may request and still move: the node provides them alike everywhere.
fn movable_resource(name: &str) -> bool {
    matches!(name, "cpu" | "memory" | "ephemeral-storage") || name.starts_with("hugepages-")
}

/// Where a volume's data lives, as far as moving the pod goes.
enum VolumeKind {
    /// Pod-scoped data on the node; the target pod gets a fresh one.
    Local(&'static str),
    /// A disk attached to one node at a time.
    NodeAttached(&'static str),
    Claim(String),
    /// Content that follows the pod (configMap, secret, projected, downwardAPI, image,
    /// network file systems).
    Follows,
}

fn volume_kind(v: &Volume) -> VolumeKind {
    use VolumeKind::*;
    if let Some(c) = &v.persistent_volume_claim {
        return Claim(c.claim_name.clone());
    }
    if let Some(e) = &v.empty_dir {
        return Local(match e.medium.as_deref() {
            Some("Memory") => "emptyDir (Memory)",
            _ => "emptyDir",
        });
    }
    let local = [
        (v.host_path.is_some(), "hostPath"),
        (v.ephemeral.is_some(), "ephemeral"),
        (v.git_repo.is_some(), "gitRepo"),
        (
            v.csi.as_ref().is_some_and(|c| c.read_only != Some(true)),
            "csi",
        ),
    ];
    if let Some((_, kind)) = local.iter().find(|(set, _)| *set) {
        return Local(kind);
    }
    let attached = [
        (v.aws_elastic_block_store.is_some(), "awsElasticBlockStore"),
        (v.azure_disk.is_some(), "azureDisk"),
        (v.cinder.is_some(), "cinder"),
        (v.gce_persistent_disk.is_some(), "gcePersistentDisk"),
        (v.fc.is_some(), "fc"),
        (v.iscsi.is_some(), "iscsi"),
        (v.rbd.is_some(), "rbd"),
        (v.photon_persistent_disk.is_some(), "photonPersistentDisk"),
        (v.portworx_volume.is_some(), "portworxVolume"),
        (v.scale_io.is_some(), "scaleIO"),
        (v.storageos.is_some(), "storageos"),
        (v.vsphere_volume.is_some(), "vsphereVolume"),
    ];
    if let Some((_, kind)) = attached.iter().find(|(set, _)| *set) {
        return NodeAttached(kind);
    }
    Follows
}

/// The pod's controlling owner, if any.
fn controller_owner(meta: &ObjectMeta) -> Option<OwnerFacts> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .map(|o| OwnerFacts {
            kind: o.kind.clone(),
            name: o.name.clone(),
            uid: o.uid.clone(),
        })
}

/// A static pod: the kubelet's mirror annotation, or owned by a Node.
fn is_static_pod(meta: &ObjectMeta) -> bool {
    meta.annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(annotations::CONFIG_MIRROR))
        || meta
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.kind == "Node")
}

fn required_node_affinity(spec: &PodSpec) -> Option<NodeSelector> {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .clone()
        })
}

/// The host namespaces the pod shares, by field name.
fn host_namespaces(spec: &PodSpec) -> Vec<&'static str> {
    [
        (spec.host_network, "hostNetwork"),
        (spec.host_pid, "hostPID"),
        (spec.host_ipc, "hostIPC"),
    ]
    .into_iter()
    .filter(|(on, _)| *on == Some(true))
    .map(|(_, name)| name)
    .collect()
}

/// (container, resource) for each resource a container requests or limits that does
/// not move with the pod (devices and the like), each once per container.
fn extended_resources<'c>(
    containers: impl Iterator<Item = &'c Container>,
) -> Vec<(String, String)> {
    containers
        .flat_map(|c| {
            let r = c.resources.clone().unwrap_or_default();
            let mut names: Vec<String> = r
                .requests
                .into_iter()
                .chain(r.limits)
                .flat_map(|m| m.into_keys())
                .filter(|n| !movable_resource(n))
                .collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| (c.name.clone(), n))
        })
        .collect()
}

impl PodFacts {
    /// The pod's facts; its claims' facts are added by [`PodFacts::with_claims`].
    pub fn from_pod(pod: &Pod) -> PodFacts {
        let meta = &pod.metadata;
        let spec = pod.spec.clone().unwrap_or_default();
        let init: &[Container] = spec.init_containers.as_deref().unwrap_or_default();
        let volumes: &[Volume] = spec.volumes.as_deref().unwrap_or_default();
        PodFacts {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            node: spec.node_name.clone(),
            running: pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
            terminating: meta.deletion_timestamp.is_some(),
            owner: controller_owner(meta),
            requests: pod_requests(pod),
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
            required_node_affinity: required_node_affinity(&spec),
            namespace: meta.namespace.clone().unwrap_or_default(),
            static_pod: is_static_pod(meta),
            host_namespaces: host_namespaces(&spec),
            containers: running_containers(&spec.containers, init)
                .map(|c| c.name.clone())
                .collect(),
            extended_resources: extended_resources(spec.containers.iter().chain(init)),
            local_volumes: volumes
                .iter()
                .filter(|v| v.name != HOLDER_INSTALLER)
                .filter_map(|v| match volume_kind(v) {
                    VolumeKind::Local(kind) => Some((v.name.clone(), kind)),
                    _ => None,
                })
                .collect(),
            node_attached_disks: volumes
                .iter()
                .filter_map(|v| match volume_kind(v) {
                    VolumeKind::NodeAttached(kind) => Some((v.name.clone(), kind)),
                    _ => None,
                })
                .collect(),
            claims: claim_names(pod)
                .into_iter()
                .map(|(volume, claim)| PodClaim {
                    volume,
                    claim,
                    facts: None,
                })
                .collect(),
            readiness_exec_probe: effective_probe(None, pod).is_some_and(|p| p.exec.is_some()),
            non_root_containers: non_root_containers(pod, &spec, init),
            not_running_containers: not_running_containers(pod, &spec, init),
        }
    }

    /// With the facts of the claims the pod mounts (by claim name), as the controller
    /// read them; a claim missing from `claims` does not exist.
    pub fn with_claims(mut self, claims: &BTreeMap<String, ClaimFacts>) -> PodFacts {
        for c in &mut self.claims {
            c.facts = claims.get(&c.claim).cloned();
        }
        self
    }
}

/// The running containers whose process is known to run as a user other than root
/// (see [`PodFacts::non_root_containers`]).
fn non_root_containers(pod: &Pod, spec: &PodSpec, init: &[Container]) -> Vec<(String, i64)> {
    let statuses = pod.status.as_ref().map(|s| {
        s.container_statuses
            .iter()
            .flatten()
            .chain(s.init_container_statuses.iter().flatten())
            .collect::<Vec<_>>()
    });
    let pod_user = spec.security_context.as_ref().and_then(|s| s.run_as_user);
    running_containers(&spec.containers, init)
        .filter_map(|c| {
            let reported = statuses
                .iter()
                .flatten()
                .find(|st| st.name == c.name)
                .and_then(|st| st.user.as_ref()?.linux.as_ref())
                .map(|l| l.uid);
            let declared = c
                .security_context
                .as_ref()
                .and_then(|s| s.run_as_user)
                .or(pod_user);
            let uid = reported.or(declared)?;
            (uid != 0).then(|| (c.name.clone(), uid))
        })
        .collect()
}

/// The running containers whose status does not say they run (see
/// [`PodFacts::not_running_containers`]), each with what its status says instead.
fn not_running_containers(pod: &Pod, spec: &PodSpec, init: &[Container]) -> Vec<(String, String)> {
    let st = pod.status.as_ref();
    let sidecars = st.and_then(|s| s.init_container_statuses.as_ref());
    let regular = st.and_then(|s| s.container_statuses.as_ref());
    running_containers(&spec.containers, init)
        .filter_map(|c| {
            let list = if spec.containers.iter().any(|r| r.name == c.name) {
                regular
            } else {
                sidecars
            };
            let Some(status) = list.into_iter().flatten().find(|s| s.name == c.name) else {
                return Some((c.name.clone(), "no status reported yet".to_string()));
            };
            let state = status.state.as_ref();
            if state.and_then(|s| s.running.as_ref()).is_some() && status.container_id.is_some() {
                return None;
            }
            let why = if let Some(w) = state.and_then(|s| s.waiting.as_ref()) {
                format!(
                    "waiting: {}",
                    w.reason.as_deref().unwrap_or("no reason given")
                )
            } else if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
                format!(
                    "terminated: {} (exit code {})",
                    t.reason.as_deref().unwrap_or("no reason given"),
                    t.exit_code
                )
            } else {
                "its status reports no running process".to_string()
            };
            Some((c.name.clone(), why))
        })
        .collect()
}

/// The pod's containers that run for its whole life: its containers and its native
/// sidecars.
fn running_containers<'a>(
    containers: &'a [Container],
    init: &'a [Container],
) -> impl Iterator<Item = &'a Container> {
    containers.iter().chain(
        init.iter()
            .filter(|c| c.restart_policy.as_deref() == Some("Always")),
    )
}

/// `(volume, claim)` for every PersistentVolumeClaim the pod mounts: what the
/// controller reads before the checks.
pub fn claim_names(pod: &Pod) -> Vec<(String, String)> {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .filter_map(|v| match volume_kind(v) {
            VolumeKind::Claim(c) => Some((v.name.clone(), c)),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn claim_facts_read_the_bound_modes_and_the_volumes_node_binding() {
        let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
            "metadata": {"name": "data"},
            "spec": {"accessModes": ["ReadWriteOnce"], "volumeName": "pv-1"},
            "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce", "ReadWriteMany"]}
        }))
        .unwrap();
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": "pv-1"},
            "spec": {"local": {"path": "/mnt/disk"}, "nodeAffinity": {"required": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "kubernetes.io/hostname",
                    "operator": "In", "values": ["n0"]}]}]}}}
        }))
        .unwrap();
        let f = ClaimFacts::from_objects(&pvc, Some(&pv));
        assert_eq!(f.access_modes, vec!["ReadWriteOnce", "ReadWriteMany"]);
        assert_eq!(f.volume_name.as_deref(), Some("pv-1"));
        assert_eq!(f.node_local_kind, Some("local"));
        assert!(f.node_affinity.is_some());
        let unbound = ClaimFacts::from_objects(&pvc, None);
        assert_eq!(unbound.node_local_kind, None);
        assert!(unbound.node_affinity.is_none());
    }

    #[test]
    fn pod_facts_list_claims_and_only_the_containers_that_keep_running() {
        let raw: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "apps"},
            "spec": {"containers": [{"name": "app"}],
                "initContainers": [{"name": "setup"}, {"name": "mesh", "restartPolicy": "Always"}],
                "volumes": [{"name": "a", "persistentVolumeClaim": {"claimName": "c1"}},
                    {"name": "b", "emptyDir": {}}]}
        }))
        .unwrap();
        assert_eq!(claim_names(&raw), vec![("a".to_string(), "c1".to_string())]);
        let f = PodFacts::from_pod(&raw);
        assert_eq!(f.containers, vec!["app", "mesh"]);
        assert_eq!(f.namespace, "apps");
        assert_eq!(f.local_volumes, vec![("b".to_string(), "emptyDir")]);
        assert_eq!(f.claims[0].facts, None);
    }

    #[test]
    fn pod_facts_read_requests_owner_and_phase_from_the_pod() {
        let p = crate::migration::fixtures::k8s_pod("web-0", "n0", "ReplicaSet", "web-abc");
        let f = PodFacts::from_pod(&p);
        assert_eq!(f.node.as_deref(), Some("n0"));
        assert!(f.running);
        assert_eq!(
            f.owner.as_ref().map(|o| o.kind.as_str()),
            Some("ReplicaSet")
        );
        assert_eq!(
            f.requests,
            Resources {
                cpu_millis: 100,
                memory_bytes: 64 << 20
            }
        );
    }
}
