//! Pre-flight checks and target selection: is this pod migratable, and to where?
//!
//! Runs before anything is frozen. The verdict becomes the `Migratable` condition; a
//! pod that fails a check keeps running untouched. Inputs are plain facts extracted
//! from the pod, its claims, the nodes and the other PodMigrations
//! (`PodFacts::from_pod`, `ClaimFacts::from_objects`, `NodeFacts::from_node`), so every
//! rule is tested without a cluster. What cannot move at all (host namespaces, data on
//! the node, devices, static pods, protected namespaces, a container that cannot move
//! with the pod's others) is refused here, each with its own reason.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Node, NodeSelector, NodeSelectorRequirement, PersistentVolume,
    PersistentVolumeClaim, Pod, PodSpec, Taint, Toleration, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::migration::{MigrationMode, PodMigrationSpec};
use podmotion_api::names::{annotations, reasons};

use super::machine::{Plan, Preflight};
use super::render::{HOLDER_INSTALLER, target_pod_name};

/// CPU in millicores and memory in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

impl Resources {
    pub fn plus(self, o: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(o.memory_bytes),
        }
    }
    fn fits_within(self, free: Resources) -> bool {
        self.cpu_millis <= free.cpu_millis && self.memory_bytes <= free.memory_bytes
    }
}

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
            readiness_exec_probe: super::render::effective_probe(None, pod)
                .is_some_and(|p| p.exec.is_some()),
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

/// What the checks need of a node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Ready and not cordoned.
    pub schedulable: bool,
    pub taints: Vec<Taint>,
    pub allocatable: Resources,
    /// Sum of the requests of the active pods bound to it.
    pub requested: Resources,
    /// A migration agent answers for this node (ready agent pod, or an endpoint override).
    pub has_ready_agent: bool,
}

impl NodeFacts {
    /// `requested` is the sum of the requests of the node's active pods (see
    /// [`pod_requests`]); `has_ready_agent` comes from the agent directory.
    pub fn from_node(node: &Node, requested: Resources, has_ready_agent: bool) -> NodeFacts {
        let spec = node.spec.clone().unwrap_or_default();
        let status = node.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let alloc = status.allocatable.unwrap_or_default();
        NodeFacts {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            schedulable: ready && !spec.unschedulable.unwrap_or(false),
            taints: spec.taints.unwrap_or_default(),
            allocatable: Resources {
                cpu_millis: alloc.get("cpu").and_then(|q| cpu_millis(&q.0)).unwrap_or(0),
                memory_bytes: alloc.get("memory").and_then(|q| bytes(&q.0)).unwrap_or(0),
            },
            requested,
            has_ready_agent,
        }
    }
}

/// Another PodMigration, as far as "one migration per pod" needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherMigration {
    pub name: String,
    pub pod_name: String,
    pub created: Timestamp,
    pub terminal: bool,
}

/// This PodMigration's identity (for tie-breaks and names), and the namespace of the
/// operator deciding it (whose pods are never moved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Me {
    pub name: String,
    pub uid: String,
    pub created: Timestamp,
    pub operator_namespace: String,
    /// The agents' namespace (migration agents and attach Jobs, with every tenant's
    /// checkpoints): its pods are never moved, and no exec probe runs there.
    pub agents_namespace: String,
    /// The installer enabled exec probes (`migration.execProbes.enabled`, the
    /// operator's `--migration-exec-probes`; it grants `pods/exec`).
    pub exec_probes: bool,
}

/// A PodMigration whose probe is an exec probe while exec probes are off.
pub const EXEC_PROBE_DISABLED: &str = "ExecProbeDisabled";

/// Why an exec probe (`what` names it) is refused while exec probes are off, and what
/// to do.
pub fn exec_probes_disabled_message(what: &str) -> String {
    format!(
        "{what} is an exec probe, and this installation has exec probes off: running a \
         command in the pods needs the operator to hold pods/exec create, so only the \
         installer can enable them (Helm value migration.execProbes.enabled=true, the \
         operator's --migration-exec-probes); or set spec.probe to an httpGet, tcpSocket \
         or grpc probe"
    )
}

/// How many migrations may be past `Pending` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub per_cluster: usize,
    pub per_source_node: usize,
}

/// Another migration, as far as the concurrency limits need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotHolder {
    pub name: String,
    pub created: Timestamp,
    pub source_node: Option<String>,
    /// Past `Pending` and not terminal: it holds a slot.
    pub started: bool,
    /// `Pending` with `Migratable=True`: queued for a slot.
    pub queued: bool,
}

/// Whether `me` (migrating from `source_node`) may start now: the started migrations
/// plus the older queued ones (first come, first served) leave a slot in the cluster
/// and on the source node.
pub fn slot_available(me: &Me, source_node: &str, others: &[SlotHolder], limits: Limits) -> bool {
    let ahead: Vec<&SlotHolder> = others
        .iter()
        .filter(|o| o.name != me.name)
        .filter(|o| o.started || (o.queued && (o.created, &o.name) < (me.created, &me.name)))
        .collect();
    let on_node = ahead
        .iter()
        .filter(|o| o.source_node.as_deref() == Some(source_node))
        .count();
    ahead.len() < limits.per_cluster && on_node < limits.per_source_node
}

/// Owner kinds whose controller adopts a pod of another name carrying its labels.
/// StatefulSet pods have identities (name, volumes) and DaemonSet/Job pods are tied to
/// their node or completion; none of those can be moved by adoption.
fn adoptable_owner(kind: &str) -> bool {
    kind == "ReplicaSet"
}

/// Why a pod cannot be migrated now: an Event/condition reason and a message.
pub type Refusal = (&'static str, String);

/// A check that found nothing to refuse passes.
fn unless(refusal: Option<Refusal>) -> Result<(), Refusal> {
    refusal.map_or(Ok(()), Err)
}

/// The pre-flight verdict: every check, then the target.
pub fn preflight(
    spec: &PodMigrationSpec,
    me: &Me,
    pod: Option<&PodFacts>,
    nodes: &[NodeFacts],
    others: &[OtherMigration],
) -> Preflight {
    match plan(spec, me, pod, nodes, others) {
        Ok(plan) => Preflight::Migratable(plan),
        Err((reason, message)) => Preflight::NotMigratable { reason, message },
    }
}

/// The checks in the order their refusals take precedence, then the target.
fn plan(
    spec: &PodMigrationSpec,
    me: &Me,
    pod: Option<&PodFacts>,
    nodes: &[NodeFacts],
    others: &[OtherMigration],
) -> Result<Plan, Refusal> {
    let pod = pod.ok_or_else(|| {
        (
            reasons::SOURCE_POD_NOT_FOUND,
            format!("pod {} does not exist", spec.pod_name),
        )
    })?;
    let source = running_source(spec, pod)?;
    unless(protected_or_static(me, pod))?;
    unless(exec_probe_refused(spec, me, pod))?;
    unless(unsupported_owner(pod))?;
    unless(cannot_move(spec, pod))?;
    unless(already_migrating(me, pod, others))?;
    source_agent_ready(&source, nodes)?;
    let target = select_target(spec, pod, &source, nodes)?;
    Ok(Plan {
        source_node: source,
        target_node: target,
        source_pod_uid: pod.uid.clone(),
        target_pod: target_pod_name(&pod.name, &me.uid),
    })
}

/// The source node of the pinned pod, if it is Running there.
fn running_source(spec: &PodMigrationSpec, pod: &PodFacts) -> Result<String, Refusal> {
    if let Some(uid) = &spec.pod_uid
        && *uid != pod.uid
    {
        return Err((
            reasons::POD_UID_MISMATCH,
            format!("pod {} has UID {}, not the pinned {uid}", pod.name, pod.uid),
        ));
    }
    if !pod.running || pod.terminating {
        return Err((
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not Running", pod.name),
        ));
    }
    pod.node.clone().ok_or_else(|| {
        (
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not bound to a node", pod.name),
        )
    })
}

/// The probe is checked before anything is frozen: an exec probe that cannot run
/// would roll every migration back after its freeze.
fn exec_probe_refused(spec: &PodMigrationSpec, me: &Me, pod: &PodFacts) -> Option<Refusal> {
    let exec_probe = match &spec.probe {
        Some(p) => p.exec.is_some().then_some("spec.probe"),
        None => pod
            .readiness_exec_probe
            .then_some("the pod's readiness probe (the check used when spec.probe is unset)"),
    };
    let what = exec_probe.filter(|_| !me.exec_probes)?;
    Some((EXEC_PROBE_DISABLED, exec_probes_disabled_message(what)))
}

fn unsupported_owner(pod: &PodFacts) -> Option<Refusal> {
    let owner = pod.owner.as_ref().filter(|o| !adoptable_owner(&o.kind))?;
    Some((
        reasons::UNSUPPORTED_OWNER,
        format!(
            "pod {} is controlled by {} {}; only ReplicaSet (Deployment) pods and bare pods can move",
            pod.name, owner.kind, owner.name
        ),
    ))
}

/// One migration per pod: the oldest non-terminal PodMigration of a pod wins
/// (name breaks ties), so two created together never both proceed.
fn already_migrating(me: &Me, pod: &PodFacts, others: &[OtherMigration]) -> Option<Refusal> {
    let first = others
        .iter()
        .filter(|m| m.pod_name == pod.name && !m.terminal && m.name != me.name)
        .find(|m| (m.created, &m.name) < (me.created, &me.name))?;
    Some((
        reasons::ALREADY_MIGRATING,
        format!(
            "pod {} is already being migrated by {}",
            pod.name, first.name
        ),
    ))
}

fn source_agent_ready(source: &str, nodes: &[NodeFacts]) -> Result<(), Refusal> {
    match nodes.iter().find(|n| n.name == source) {
        Some(n) if n.has_ready_agent => Ok(()),
        _ => Err((
            reasons::NO_AGENT_ON_NODE,
            format!("no ready migration agent on the source node {source}"),
        )),
    }
}

/// Pods that are never PodMotion's to move: those in the cluster's system namespace or
/// the operator's own, and static pods.
fn protected_or_static(me: &Me, pod: &PodFacts) -> Option<Refusal> {
    let name = &pod.name;
    if pod.namespace == "kube-system"
        || pod.namespace == me.operator_namespace
        || pod.namespace == me.agents_namespace
    {
        let whose = if pod.namespace == "kube-system" {
            "the cluster's system namespace"
        } else if pod.namespace == me.agents_namespace {
            "PodMotion's agents' namespace"
        } else {
            "PodMotion's own namespace"
        };
        return Some((
            reasons::PROTECTED_NAMESPACE,
            format!(
                "pod {name} is in {} ({whose}), whose pods PodMotion never migrates; \
                 reschedule it (delete the pod and let its controller recreate it) instead",
                pod.namespace
            ),
        ));
    }
    // Before the owner check: a mirror pod's controller is its Node.
    if pod.static_pod {
        return Some((
            reasons::STATIC_POD,
            format!(
                "pod {name} is a static pod: the kubelet runs it from a manifest on its node \
                 and the API server only shows a mirror; move the manifest to another node's \
                 static pod directory instead"
            ),
        ));
    }
    None
}

/// What the pod's spec makes impossible to move, cheapest and least negotiable first;
/// `None` if nothing. Local data comes last: it is the one a user may waive.
fn cannot_move(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    let name = &pod.name;
    if !pod.host_namespaces.is_empty() {
        return Some((
            reasons::HOST_NAMESPACES,
            format!(
                "pod {name} shares the node's namespaces ({}): its processes and sockets are \
                 the node's, which cannot be checkpointed and recreated on another node; \
                 reschedule it instead, or run it without {}",
                pod.host_namespaces.join(", "),
                pod.host_namespaces.join(" and ")
            ),
        ));
    }
    if let Some(r) = containers_refused(spec, pod) {
        return Some(r);
    }
    if !pod.extended_resources.is_empty() {
        let list: Vec<String> = pod
            .extended_resources
            .iter()
            .map(|(c, r)| format!("{r} (container {c})"))
            .collect();
        return Some((
            reasons::EXTENDED_RESOURCES,
            format!(
                "pod {name} uses {}: a device's state cannot be checkpointed and the target \
                 node's device would be another one; PodMotion moves pods that use only cpu, \
                 memory, ephemeral-storage and hugepages; reschedule it instead",
                list.join(", ")
            ),
        ));
    }
    if let Some(r) = non_root_refused(spec, pod) {
        return Some(r);
    }
    local_data(spec, pod).map(|m| (reasons::LOCAL_DATA, m))
}

/// The most containers one migration moves: the agents' bound
/// (`executors/agent/src/pod.rs`, `MAX_CONTAINERS`), refused here before any freeze.
pub const MAX_CONTAINERS: usize = 16;

/// What keeps a pod of several containers (native sidecars count) from moving as one,
/// naming the container concerned. Every container that runs is frozen, dumped and
/// restored into its own container of the target pod (finished init containers are
/// not restored: they ran to completion), except where the agents cannot:
/// PostCopy's lazy dump serves the pages of one process tree; a container with no
/// running process has nothing to dump, and its target container would start empty.
fn containers_refused(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    let (name, n) = (&pod.name, pod.containers.len());
    if n < 2 {
        return None;
    }
    if spec.mode == MigrationMode::PostCopy {
        return Some((
            reasons::MULTIPLE_CONTAINERS,
            format!(
                "pod {name} has {n} containers ({}; native sidecars count) and mode PostCopy \
                 moves one: its lazy dump serves the memory of a single process tree, and \
                 each container is a tree of its own; use mode PreCopy or Cold, which move \
                 every container of the pod together",
                pod.containers.join(", ")
            ),
        ));
    }
    if n > MAX_CONTAINERS {
        return Some((
            reasons::MULTIPLE_CONTAINERS,
            format!(
                "pod {name} has {n} containers ({}; native sidecars count): at most \
                 {MAX_CONTAINERS} move with one migration; reschedule it instead",
                pod.containers.join(", ")
            ),
        ));
    }
    let (container, why) = pod.not_running_containers.first()?;
    Some((
        reasons::MULTIPLE_CONTAINERS,
        format!(
            "pod {name}: container {container} is not running ({why}), so it has no process \
             to move with the pod's other containers and its copy on the target would start \
             afresh; wait until it runs (or fix it), then migrate"
        ),
    ))
}

/// A non-root container in a mode whose dump needs root privileges the agents lack.
/// PreCopy and Cold dump a non-root container as its own user (the agent runs CRIU
/// as that user with its own capabilities: docs/security.md, "Non-root workloads");
/// PostCopy's lazy dump runs CRIU as root, which reads another user's resource limits
/// only with CAP_SYS_RESOURCE and seizes its process only with CAP_SYS_PTRACE.
fn non_root_refused(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<Refusal> {
    if spec.mode != MigrationMode::PostCopy {
        return None;
    }
    let (container, uid) = pod.non_root_containers.first()?;
    Some((
        reasons::NON_ROOT_WORKLOAD,
        format!(
            "pod {}: container {container} runs as uid {uid}, and a PostCopy dump runs CRIU \
             as root, which needs CAP_SYS_RESOURCE and CAP_SYS_PTRACE to dump another \
             user's process; the agents hold neither (chart value \
             migrationAgent.agent.capabilities; CAP_SYS_RESOURCE must also be in the \
             node's capability bounding set). Use mode PreCopy or Cold, which dump it as \
             its own user",
            pod.name
        ),
    ))
}

/// Why the pod's data cannot follow it to another node, if it cannot. Pod-scoped
/// volumes may be waived with `leaveLocalDataBehind` (the target gets fresh ones);
/// disks and claims that cannot be mounted on the target node never are: the target
/// pod mounts the very same volume, so its holders would never start.
fn local_data(spec: &PodMigrationSpec, pod: &PodFacts) -> Option<String> {
    let name = &pod.name;
    let mut fixed: Vec<String> = pod
        .node_attached_disks
        .iter()
        .map(|(v, kind)| format!("volume {v} ({kind}) is a disk attached to one node at a time"))
        .collect();
    for c in &pod.claims {
        let (v, claim) = (&c.volume, &c.claim);
        match &c.facts {
            None => fixed.push(format!("volume {v}: claim {claim} does not exist")),
            Some(f) => {
                if let Some(kind) = f.node_local_kind {
                    fixed.push(format!(
                        "volume {v}: claim {claim} is bound to the {kind} PersistentVolume {}, \
                         whose data is on one node's disk",
                        f.volume_name.as_deref().unwrap_or("?")
                    ));
                } else if !f
                    .access_modes
                    .iter()
                    .any(|m| m == "ReadWriteMany" || m == "ReadOnlyMany")
                {
                    let modes = if f.access_modes.is_empty() {
                        "without access modes".to_string()
                    } else {
                        f.access_modes.join("/")
                    };
                    fixed.push(format!(
                        "volume {v}: claim {claim} is {modes}, so the target pod cannot mount \
                         it on another node while the source pod holds it"
                    ));
                }
            }
        }
    }
    if !fixed.is_empty() {
        return Some(format!(
            "pod {name} cannot take its storage along: {}; only ReadWriteMany or ReadOnlyMany \
             claims on volumes reachable from the target node follow a pod \
             (leaveLocalDataBehind does not change this); reschedule the pod instead",
            fixed.join("; ")
        ));
    }
    if spec.leave_local_data_behind || pod.local_volumes.is_empty() {
        return None;
    }
    let list: Vec<String> = pod
        .local_volumes
        .iter()
        .map(|(v, kind)| format!("{v} ({kind})"))
        .collect();
    Some(format!(
        "pod {name} keeps data on its node in {}; set spec.leaveLocalDataBehind: true to \
         migrate it with fresh, empty volumes on the target (that data is lost), or keep the \
         data on a ReadWriteMany claim",
        list.join(", ")
    ))
}

/// Whether `node` satisfies a required node selector (any term; every requirement of
/// the term, on labels and on `metadata.name`).
fn selector_matches(sel: &NodeSelector, node: &NodeFacts) -> bool {
    sel.node_selector_terms.iter().any(|term| {
        term.match_expressions
            .iter()
            .flatten()
            .all(|r| requirement_holds(r, &node.labels))
            && term.match_fields.iter().flatten().all(|r| {
                let fields = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
                requirement_holds(r, &fields)
            })
    })
}

/// Why one node cannot take the pod; `None` if it can.
pub fn unfit_reason(pod: &PodFacts, source: &str, node: &NodeFacts) -> Option<Refusal> {
    let n = &node.name;
    if n == source {
        return Some((reasons::TARGET_IS_SOURCE, format!("{n} is the source node")));
    }
    if !node.has_ready_agent {
        return Some((
            reasons::NO_AGENT_ON_NODE,
            format!("no ready migration agent on {n}"),
        ));
    }
    let misfit = (!node.schedulable)
        .then(|| format!("{n} is not Ready or is cordoned"))
        .or_else(|| placement_mismatch(pod, node))
        .or_else(|| too_little_free(pod, node))?;
    Some((reasons::TARGET_DOES_NOT_FIT, misfit))
}

/// What of the pod's placement rules the node breaks: node selector, required node
/// affinity, its volumes' node affinity, untolerated taints.
fn placement_mismatch(pod: &PodFacts, node: &NodeFacts) -> Option<String> {
    let n = &node.name;
    if let Some((k, v)) = pod
        .node_selector
        .iter()
        .find(|(k, v)| node.labels.get(*k) != Some(*v))
    {
        return Some(format!("{n} lacks the pod's node selector {k}={v}"));
    }
    if let Some(sel) = &pod.required_node_affinity
        && !selector_matches(sel, node)
    {
        return Some(format!(
            "{n} does not match the pod's required node affinity"
        ));
    }
    // The target pod is bound by name, past the scheduler's volume checks: a claim's
    // volume (a zonal disk) must be reachable from the node.
    if let Some(c) = pod.claims.iter().find(|c| {
        c.facts
            .as_ref()
            .and_then(|f| f.node_affinity.as_ref())
            .is_some_and(|sel| !selector_matches(sel, node))
    }) {
        return Some(format!(
            "{n} does not match the node affinity of the volume bound to claim {}",
            c.claim
        ));
    }
    let t = node
        .taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !pod.tolerations.iter().any(|tol| tolerates(tol, t)))?;
    Some(format!(
        "{n} has taint {}:{} that the pod does not tolerate",
        t.key, t.effect
    ))
}

/// The node's free CPU and memory (allocatable minus requested), if the pod's
/// requests do not fit in it.
fn too_little_free(pod: &PodFacts, node: &NodeFacts) -> Option<String> {
    let free = Resources {
        cpu_millis: node
            .allocatable
            .cpu_millis
            .saturating_sub(node.requested.cpu_millis),
        memory_bytes: node
            .allocatable
            .memory_bytes
            .saturating_sub(node.requested.memory_bytes),
    };
    (!pod.requests.fits_within(free)).then(|| {
        format!(
            "{} has {}m CPU and {} bytes of memory free; the pod requests {}m and {}",
            node.name,
            free.cpu_millis,
            free.memory_bytes,
            pod.requests.cpu_millis,
            pod.requests.memory_bytes
        )
    })
}

/// The target node: the explicit `targetNode` if it qualifies, else the qualifying node
/// (honouring `targetNodeSelector`) with the most free memory, name breaking ties.
pub fn select_target(
    spec: &PodMigrationSpec,
    pod: &PodFacts,
    source: &str,
    nodes: &[NodeFacts],
) -> Result<String, Refusal> {
    if let Some(want) = &spec.target_node {
        let Some(node) = nodes.iter().find(|n| &n.name == want) else {
            return Err((
                reasons::NO_TARGET_NODE,
                format!("target node {want} does not exist"),
            ));
        };
        return match unfit_reason(pod, source, node) {
            Some(why) => Err(why),
            None => Ok(want.clone()),
        };
    }
    let selector = spec.target_node_selector.clone().unwrap_or_default();
    let mut rejected = vec![];
    let mut best: Option<&NodeFacts> = None;
    for node in nodes {
        if let Some((k, v)) = selector
            .iter()
            .find(|(k, v)| node.labels.get(*k) != Some(*v))
        {
            rejected.push(format!("{}: lacks {k}={v}", node.name));
            continue;
        }
        if let Some((_, why)) = unfit_reason(pod, source, node) {
            rejected.push(why);
            continue;
        }
        let free = |n: &NodeFacts| {
            n.allocatable
                .memory_bytes
                .saturating_sub(n.requested.memory_bytes)
        };
        best = match best {
            Some(b) if free(b) > free(node) || (free(b) == free(node) && b.name < node.name) => {
                Some(b)
            }
            _ => Some(node),
        };
    }
    best.map(|n| n.name.clone()).ok_or_else(|| {
        (
            reasons::NO_TARGET_NODE,
            format!("no node can take the pod: {}", rejected.join("; ")),
        )
    })
}

fn requirement_holds(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.clone().unwrap_or_default();
    let num = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(|v| num(v)), values.first().and_then(|v| num(v))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(|v| num(v)), values.first().and_then(|v| num(v))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(e) = &tol.effect
        && !e.is_empty()
        && *e != taint.effect
    {
        return false;
    }
    match tol.operator.as_deref() {
        Some("Exists") => tol
            .key
            .as_deref()
            .is_none_or(|k| k.is_empty() || k == taint.key),
        _ => {
            tol.key.as_deref() == Some(taint.key.as_str())
                && tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
    }
}

/// Sum of a pod's container requests (limits stand in for missing requests, as the
/// API server defaults them), with init containers counted as their maximum.
pub fn pod_requests(pod: &Pod) -> Resources {
    let Some(spec) = &pod.spec else {
        return Resources::default();
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| {
        let r = c.resources.clone().unwrap_or_default();
        let get = |name: &str, parse: fn(&str) -> Option<u64>| {
            r.requests
                .as_ref()
                .and_then(|m| m.get(name))
                .or_else(|| r.limits.as_ref().and_then(|m| m.get(name)))
                .and_then(|q| parse(&q.0))
                .unwrap_or(0)
        };
        Resources {
            cpu_millis: get("cpu", cpu_millis),
            memory_bytes: get("memory", bytes),
        }
    };
    let main = spec
        .containers
        .iter()
        .map(of)
        .fold(Resources::default(), Resources::plus);
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(of)
        .fold(Resources::default(), |a, b| Resources {
            cpu_millis: a.cpu_millis.max(b.cpu_millis),
            memory_bytes: a.memory_bytes.max(b.memory_bytes),
        });
    Resources {
        cpu_millis: main.cpu_millis.max(init.cpu_millis),
        memory_bytes: main.memory_bytes.max(init.memory_bytes),
    }
}

/// A Kubernetes quantity in base units (`2`, `500m`, `1.5Gi`, `64M`, `1e3`).
pub fn quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    let suffixes: [(&str, f64); 13] = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("Pi", 1024f64.powi(5)),
        ("Ei", 1024f64.powi(6)),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in suffixes {
        if let Some(num) = s.strip_suffix(suffix) {
            return num
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v * factor);
        }
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

fn cpu_millis(s: &str) -> Option<u64> {
    quantity(s).map(|v| (v * 1000.0).ceil() as u64)
}

fn bytes(s: &str) -> Option<u64> {
    quantity(s).map(|v| v.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::fixtures::{node, pod, spec};
    use serde_json::{Value, json};

    fn me() -> Me {
        Me {
            name: "move-web".into(),
            uid: "0c5b5e52-0000-4000-8000-000000000001".into(),
            created: ts(100),
            operator_namespace: "podmotion-system".into(),
            agents_namespace: "podmotion-system-agents".into(),
            exec_probes: false,
        }
    }
    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }
    fn verdict_reason(p: &Preflight) -> &'static str {
        match p {
            Preflight::Migratable(_) => reasons::MIGRATABLE,
            Preflight::NotMigratable { reason, .. } => reason,
        }
    }
    fn three_nodes() -> Vec<NodeFacts> {
        vec![node("n0").build(), node("n1").build(), node("n2").build()]
    }

    #[test]
    fn a_running_pod_with_agents_everywhere_is_migratable_to_another_node() {
        let p = pod("web-0").on("n0").build();
        let v = preflight(&spec("web-0").build(), &me(), Some(&p), &three_nodes(), &[]);
        let Preflight::Migratable(plan) = v else {
            panic!("{v:?}")
        };
        assert_eq!(plan.source_node, "n0");
        assert_ne!(plan.target_node, "n0");
        assert_eq!(plan.source_pod_uid, p.uid);
        assert!(plan.target_pod.starts_with("web-0-"), "{}", plan.target_pod);
    }

    #[test]
    fn every_failed_check_names_its_reason() {
        let nodes = three_nodes();
        let s = spec("web-0").build();
        type Case = (
            &'static str,
            Option<PodFacts>,
            PodMigrationSpec,
            Vec<NodeFacts>,
            Vec<OtherMigration>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "missing pod",
                None,
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_FOUND,
            ),
            (
                "uid pin mismatch",
                Some(pod("web-0").on("n0").build()),
                spec("web-0")
                    .uid("ffffffff-0000-4000-8000-000000000000")
                    .build(),
                nodes.clone(),
                vec![],
                reasons::POD_UID_MISMATCH,
            ),
            (
                "pending pod",
                Some(pod("web-0").on("n0").pending().build()),
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_RUNNING,
            ),
            (
                "terminating pod",
                Some(pod("web-0").on("n0").terminating().build()),
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_RUNNING,
            ),
            (
                "statefulset pod",
                Some(pod("db-0").on("n0").owned_by("StatefulSet", "db").build()),
                spec("db-0").build(),
                nodes.clone(),
                vec![],
                reasons::UNSUPPORTED_OWNER,
            ),
            (
                "older migration of the same pod",
                Some(pod("web-0").on("n0").build()),
                s.clone(),
                nodes.clone(),
                vec![OtherMigration {
                    name: "earlier".into(),
                    pod_name: "web-0".into(),
                    created: ts(50),
                    terminal: false,
                }],
                reasons::ALREADY_MIGRATING,
            ),
            (
                "no agent on source",
                Some(pod("web-0").on("n0").build()),
                s.clone(),
                vec![node("n0").without_agent().build(), node("n1").build()],
                vec![],
                reasons::NO_AGENT_ON_NODE,
            ),
            (
                "target is the source",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n0").build(),
                nodes.clone(),
                vec![],
                reasons::TARGET_IS_SOURCE,
            ),
            (
                "explicit target without agent",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n1").build(),
                vec![node("n0").build(), node("n1").without_agent().build()],
                vec![],
                reasons::NO_AGENT_ON_NODE,
            ),
            (
                "explicit target unknown",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n9").build(),
                nodes.clone(),
                vec![],
                reasons::NO_TARGET_NODE,
            ),
            (
                "explicit target full",
                Some(pod("web-0").on("n0").requests(2000, 1 << 30).build()),
                spec("web-0").target("n1").build(),
                vec![
                    node("n0").build(),
                    node("n1").allocatable(1000, 8 << 30).build(),
                ],
                vec![],
                reasons::TARGET_DOES_NOT_FIT,
            ),
            (
                "selector matches nothing",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").selector("zone", "b").build(),
                nodes.clone(),
                vec![],
                reasons::NO_TARGET_NODE,
            ),
        ];
        // What cannot move: pods read from their manifests, each refused for its cause.
        let opt_in = spec("web-0").leave_local_data_behind().build();
        let rwo = claims(&[("data", &["ReadWriteOnce"])]);
        let cannot_move: Vec<(&str, PodFacts, PodMigrationSpec, &str)> = vec![
            (
                "kube-system pod",
                k8s(json!({"metadata": {"namespace": "kube-system"}})),
                s.clone(),
                reasons::PROTECTED_NAMESPACE,
            ),
            (
                "pod in the operator's namespace",
                k8s(json!({"metadata": {"namespace": "podmotion-system"}})),
                s.clone(),
                reasons::PROTECTED_NAMESPACE,
            ),
            (
                "pod in the agents' namespace",
                k8s(json!({"metadata": {"namespace": "podmotion-system-agents"}})),
                s.clone(),
                reasons::PROTECTED_NAMESPACE,
            ),
            (
                "mirror pod",
                k8s(json!({"metadata": {"annotations": {(annotations::CONFIG_MIRROR): "abc"}}})),
                s.clone(),
                reasons::STATIC_POD,
            ),
            (
                "static pod owned by its node",
                k8s(json!({"metadata": {"ownerReferences": [{"apiVersion": "v1",
                    "kind": "Node", "name": "n0", "uid": "node-uid", "controller": true}]}})),
                s.clone(),
                reasons::STATIC_POD,
            ),
            (
                "hostNetwork",
                k8s(json!({"spec": {"hostNetwork": true}})),
                s.clone(),
                reasons::HOST_NAMESPACES,
            ),
            (
                "hostPID",
                k8s(json!({"spec": {"hostPID": true}})),
                s.clone(),
                reasons::HOST_NAMESPACES,
            ),
            (
                "hostIPC",
                k8s(json!({"spec": {"hostIPC": true}})),
                s.clone(),
                reasons::HOST_NAMESPACES,
            ),
            (
                "two containers in PostCopy",
                two_running(json!({"spec": {"containers": [
                    {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]}})),
                spec("web-0").post_copy().build(),
                reasons::MULTIPLE_CONTAINERS,
            ),
            (
                "native sidecar in PostCopy",
                two_running(json!({"spec": {"initContainers": [
                    {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]}})),
                spec("web-0").post_copy().build(),
                reasons::MULTIPLE_CONTAINERS,
            ),
            (
                "a second container not running",
                k8s(json!({"spec": {"containers": [
                    {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]},
                    "status": {"containerStatuses": [running("app"), json!({"name": "proxy",
                        "state": {"waiting": {"reason": "CrashLoopBackOff"}}})]}})),
                s.clone(),
                reasons::MULTIPLE_CONTAINERS,
            ),
            (
                "gpu limit",
                k8s(
                    json!({"spec": {"containers": [{"name": "app", "image": "app:1",
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
                ),
                s.clone(),
                reasons::EXTENDED_RESOURCES,
            ),
            (
                "emptyDir",
                k8s(json!({"spec": {"volumes": [{"name": "scratch", "emptyDir": {}}]}})),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "memory emptyDir",
                k8s(
                    json!({"spec": {"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}]}}),
                ),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "hostPath",
                k8s(
                    json!({"spec": {"volumes": [{"name": "logs", "hostPath": {"path": "/var/log"}}]}}),
                ),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "generic ephemeral volume",
                k8s(json!({"spec": {"volumes": [{"name": "cache", "ephemeral": {
                    "volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}}}}}}]}})),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "writable inline csi volume",
                k8s(
                    json!({"spec": {"volumes": [{"name": "scratch", "csi": {"driver": "x.example"}}]}}),
                ),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "ReadWriteOnce claim",
                with_claim(k8s(claim_volume("data")), &rwo),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "ReadWriteOncePod claim",
                with_claim(
                    k8s(claim_volume("data")),
                    &claims(&[("data", &["ReadWriteOncePod"])]),
                ),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "ReadWriteOnce claim, even with the opt-in",
                with_claim(k8s(claim_volume("data")), &rwo),
                opt_in.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "claim that does not exist",
                k8s(claim_volume("data")),
                s.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "ReadWriteMany claim on a local volume",
                with_claim(k8s(claim_volume("data")), &{
                    let mut c = claims(&[("data", &["ReadWriteMany"])]);
                    c.get_mut("data").unwrap().node_local_kind = Some("local");
                    c
                }),
                opt_in.clone(),
                reasons::LOCAL_DATA,
            ),
            (
                "in-tree disk",
                k8s(json!({"spec": {"volumes": [{"name": "disk",
                    "gcePersistentDisk": {"pdName": "d1"}}]}})),
                opt_in.clone(),
                reasons::LOCAL_DATA,
            ),
        ];
        let base = preflight(&s, &me(), Some(&k8s(json!({}))), &nodes, &[]);
        assert_eq!(verdict_reason(&base), reasons::MIGRATABLE, "{base:?}");
        let cases = cases.into_iter().chain(
            cannot_move
                .into_iter()
                .map(|(what, p, s, want)| (what, Some(p), s, nodes.clone(), vec![], want)),
        );
        for (what, p, s, n, others, want) in cases {
            let v = preflight(&s, &me(), p.as_ref(), &n, &others);
            assert_eq!(verdict_reason(&v), want, "{what}: {v:?}");
        }
    }

    /// A running ReplicaSet pod `web-0` on n0 in `apps` with one container (100m/64Mi,
    /// no volumes), with `patch` merged into its manifest (objects merged, everything
    /// else replaced), read as the controller reads it.
    fn k8s(patch: Value) -> PodFacts {
        let mut pod = json!({
            "metadata": {"name": "web-0", "namespace": "apps",
                "uid": crate::migration::fixtures::SOURCE_UID,
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                    "name": "web-abc", "uid": "rs-uid", "controller": true}]},
            "spec": {"nodeName": "n0", "containers": [{"name": "app", "image": "app:1",
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}}]},
            "status": {"phase": "Running"}
        });
        merge(&mut pod, patch);
        PodFacts::from_pod(&serde_json::from_value(pod).unwrap())
    }
    fn merge(into: &mut Value, patch: Value) {
        match (into, patch) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }
    /// A pod patch mounting claim `claim` as volume `data`.
    fn claim_volume(claim: &str) -> Value {
        json!({"spec": {"volumes": [{"name": "data",
            "persistentVolumeClaim": {"claimName": claim}}]}})
    }
    /// Bound claims with these access modes, on network volumes.
    fn claims(list: &[(&str, &[&str])]) -> BTreeMap<String, ClaimFacts> {
        list.iter()
            .map(|(name, modes)| {
                (
                    name.to_string(),
                    ClaimFacts {
                        access_modes: modes.iter().map(|m| m.to_string()).collect(),
                        volume_name: Some(format!("pv-{name}")),
                        ..Default::default()
                    },
                )
            })
            .collect()
    }
    /// A container's status as the kubelet reports a running one.
    fn running(name: &str) -> Value {
        json!({"name": name, "containerID": format!("containerd://{name}"),
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}})
    }
    /// `k8s(patch)` with every container of `app` and `proxy` (regular or native
    /// sidecar) reported running.
    fn two_running(mut patch: Value) -> PodFacts {
        let sidecar = patch["spec"]["initContainers"].is_array();
        let status = if sidecar {
            json!({"containerStatuses": [running("app")],
                "initContainerStatuses": [running("proxy")]})
        } else {
            let names: Vec<Value> = patch["spec"]["containers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| running(c["name"].as_str().unwrap()))
                .collect();
            json!({"containerStatuses": names})
        };
        merge(&mut patch, json!({"status": status}));
        k8s(patch)
    }
    fn with_claim(p: PodFacts, c: &BTreeMap<String, ClaimFacts>) -> PodFacts {
        p.with_claims(c)
    }
    fn refusal(p: &PodFacts, s: &PodMigrationSpec) -> (&'static str, String) {
        match preflight(s, &me(), Some(p), &three_nodes(), &[]) {
            Preflight::NotMigratable { reason, message } => (reason, message),
            v => panic!("migratable: {v:?}"),
        }
    }
    fn assert_migratable(what: &str, p: &PodFacts, s: &PodMigrationSpec) {
        let v = preflight(s, &me(), Some(p), &three_nodes(), &[]);
        assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{what}: {v:?}");
    }

    #[test]
    fn refusals_name_the_cause_and_what_to_do() {
        let s = spec("web-0").build();
        let (_, m) = refusal(&k8s(json!({"spec": {"hostPID": true}})), &s);
        assert!(m.contains("hostPID") && !m.contains("hostNetwork"), "{m}");
        let (_, m) = refusal(
            &k8s(json!({"spec": {"hostNetwork": true, "hostIPC": true}})),
            &s,
        );
        assert!(m.contains("hostNetwork, hostIPC"), "{m}");
        let (_, m) = refusal(
            &k8s(
                json!({"spec": {"containers": [{"name": "train", "image": "t:1",
                "resources": {"requests": {"cpu": "1", "example.com/fpga": "2"}}}]}}),
            ),
            &s,
        );
        assert!(m.contains("example.com/fpga (container train)"), "{m}");
        assert!(!m.contains("cpu ("), "{m}");
        let (_, m) = refusal(
            &k8s(
                json!({"spec": {"volumes": [{"name": "scratch", "emptyDir": {}},
                {"name": "logs", "hostPath": {"path": "/var/log"}}]}}),
            ),
            &s,
        );
        assert!(
            m.contains("scratch (emptyDir), logs (hostPath)")
                && m.contains("spec.leaveLocalDataBehind: true"),
            "{m}"
        );
        let (_, m) = refusal(
            &with_claim(
                k8s(claim_volume("data")),
                &claims(&[("data", &["ReadWriteOnce"])]),
            ),
            &s,
        );
        assert!(
            m.contains("claim data is ReadWriteOnce") && m.contains("does not change this"),
            "{m}"
        );
        let (_, m) = refusal(
            &two_running(json!({"spec": {"containers": [{"name": "app"}, {"name": "envoy"}]}})),
            &spec("web-0").post_copy().build(),
        );
        assert!(
            m.contains("2 containers (app, envoy") && m.contains("PreCopy or Cold"),
            "{m}"
        );
        let (_, m) = refusal(&k8s(json!({"metadata": {"namespace": "kube-system"}})), &s);
        assert!(m.contains("kube-system"), "{m}");
    }

    #[test]
    fn a_non_root_container_is_refused_in_pending_only_where_its_dump_cannot_run() {
        let post_copy = spec("web-0").post_copy().build();
        let pre_copy = spec("web-0").build();
        // The image's own user, as the kubelet reports it: no securityContext says it.
        let reported = k8s(json!({"status": {"containerStatuses": [{"name": "app",
            "image": "app:1", "imageID": "", "ready": true, "restartCount": 0,
            "user": {"linux": {"uid": 65532, "gid": 65532}}}]}}));
        assert_eq!(
            reported.non_root_containers,
            vec![("app".to_string(), 65532)]
        );
        let (reason, m) = refusal(&reported, &post_copy);
        assert_eq!(reason, reasons::NON_ROOT_WORKLOAD);
        assert!(
            m.contains("container app runs as uid 65532")
                && m.contains("CAP_SYS_RESOURCE")
                && m.contains("migrationAgent.agent.capabilities")
                && m.contains("PreCopy or Cold"),
            "{m}"
        );
        // PreCopy and Cold dump it as its own user.
        assert_migratable("a non-root container in PreCopy", &reported, &pre_copy);
        // Declared in the spec (container over pod), when the kubelet does not report it.
        let declared = k8s(json!({"spec": {"securityContext": {"runAsUser": 1000},
            "containers": [{"name": "app", "image": "app:1"}]}}));
        assert_eq!(
            declared.non_root_containers,
            vec![("app".to_string(), 1000)]
        );
        assert_eq!(refusal(&declared, &post_copy).0, reasons::NON_ROOT_WORKLOAD);
        let root = k8s(json!({"spec": {"securityContext": {"runAsUser": 1000},
            "containers": [{"name": "app", "image": "app:1",
                "securityContext": {"runAsUser": 0}}]}}));
        assert!(root.non_root_containers.is_empty());
        assert_migratable("a root container in PostCopy", &root, &post_copy);
        // Neither tells: the agent checks the process at Prepare.
        assert!(k8s(json!({})).non_root_containers.is_empty());
    }

    #[test]
    fn an_exec_probe_is_refused_before_the_freeze_unless_the_installer_enabled_it() {
        use podmotion_api::migration::{ApplicationProbe, ExecProbe, TcpProbe};
        let probe = |exec: bool| ApplicationProbe {
            http_get: None,
            tcp_socket: (!exec).then_some(TcpProbe { port: 8080 }),
            grpc: None,
            exec: exec.then(|| ExecProbe {
                command: vec!["/bin/check".into()],
                container: None,
            }),
            timeout_seconds: 2,
            failure_threshold: 3,
        };
        let mut s = spec("web-0").build();
        s.probe = Some(probe(true));
        let p = k8s(json!({}));
        let (reason, m) = refusal(&p, &s);
        assert_eq!(reason, EXEC_PROBE_DISABLED);
        assert!(
            m.starts_with("spec.probe is an exec probe")
                && m.contains("migration.execProbes.enabled"),
            "{m}"
        );
        // Enabled by the installer: migratable.
        let on = Me {
            exec_probes: true,
            ..me()
        };
        let v = preflight(&s, &on, Some(&p), &three_nodes(), &[]);
        assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
        // Other probe kinds never need it.
        s.probe = Some(probe(false));
        assert_migratable("tcp probe", &p, &s);
        // Without spec.probe the pod's readiness probe is the check: an exec one is
        // refused the same way, a spec.probe of another kind overrides it.
        let exec_ready = k8s(
            json!({"spec": {"containers": [{"name": "app", "image": "app:1",
            "readinessProbe": {"exec": {"command": ["/bin/ready"]}}}]}}),
        );
        let (reason, m) = refusal(&exec_ready, &spec("web-0").build());
        assert_eq!(reason, EXEC_PROBE_DISABLED);
        assert!(m.starts_with("the pod's readiness probe"), "{m}");
        assert_migratable("tcp probe over exec readiness", &exec_ready, &s);
    }

    #[test]
    fn exec_probes_never_run_in_the_operators_or_the_agents_namespace_even_when_enabled() {
        use podmotion_api::migration::{ApplicationProbe, ExecProbe};
        let on = Me {
            exec_probes: true,
            ..me()
        };
        let mut s = spec("web-0").build();
        s.probe = Some(ApplicationProbe {
            http_get: None,
            tcp_socket: None,
            grpc: None,
            exec: Some(ExecProbe {
                command: vec!["/bin/cat".into(), "/var/run/secrets/master-key".into()],
                container: None,
            }),
            timeout_seconds: 2,
            failure_threshold: 3,
        });
        for ns in ["podmotion-system", "podmotion-system-agents"] {
            let p = k8s(json!({"metadata": {"namespace": ns}}));
            let v = preflight(&s, &on, Some(&p), &three_nodes(), &[]);
            assert_eq!(
                verdict_reason(&v),
                reasons::PROTECTED_NAMESPACE,
                "{ns}: {v:?}"
            );
        }
        let tenant = k8s(json!({}));
        let v = preflight(&s, &on, Some(&tenant), &three_nodes(), &[]);
        assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
    }

    #[test]
    fn leave_local_data_behind_lets_pod_scoped_volumes_through() {
        let p = k8s(json!({"spec": {"volumes": [
            {"name": "scratch", "emptyDir": {"medium": "Memory"}},
            {"name": "logs", "hostPath": {"path": "/var/log/app"}},
            {"name": "cache", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]}}));
        assert_eq!(refusal(&p, &spec("web-0").build()).0, reasons::LOCAL_DATA);
        assert_migratable(
            "opted in",
            &p,
            &spec("web-0").leave_local_data_behind().build(),
        );
    }

    /// A pod PodMotion restored (its holder's init container and volume, its
    /// container's command the holder) moves again: the agent dumps the workload the
    /// holder holds.
    #[test]
    fn a_pod_podmotion_restored_is_migratable_again() {
        let p = k8s(json!({"spec": {
            "initContainers": [{"name": HOLDER_INSTALLER, "image": "agent:1"}],
            "containers": [{"name": "app", "command": ["/.podmotion/hold", "hold"]}],
            "volumes": [{"name": HOLDER_INSTALLER, "emptyDir": {"sizeLimit": "64Mi"}}]}}));
        assert_eq!(
            p.containers,
            ["app"],
            "the finished installer is no container"
        );
        assert_migratable("pod PodMotion restored", &p, &spec("web-0").build());
    }

    #[test]
    fn the_holder_volume_alone_is_not_local_data() {
        // The volume PodMotion adds to a target pod, without its init container.
        let p = k8s(json!({"spec": {"volumes": [{"name": HOLDER_INSTALLER,
            "emptyDir": {"sizeLimit": "64Mi"}}]}}));
        assert!(p.local_volumes.is_empty(), "{:?}", p.local_volumes);
        assert_migratable("holder volume", &p, &spec("web-0").build());
    }

    #[test]
    fn volumes_that_follow_the_pod_keep_it_migratable() {
        let p = k8s(json!({"spec": {"volumes": [
            {"name": "config", "configMap": {"name": "web"}},
            {"name": "creds", "secret": {"secretName": "web"}},
            {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
            {"name": "info", "downwardAPI": {"items": []}},
            {"name": "certs", "csi": {"driver": "secrets-store.csi.k8s.io", "readOnly": true}},
            {"name": "shared", "nfs": {"server": "nfs.example", "path": "/export"}},
            {"name": "data", "persistentVolumeClaim": {"claimName": "shared-data"}}]}}))
        .with_claims(&claims(&[("shared-data", &["ReadWriteMany"])]));
        assert_migratable("volumes that follow", &p, &spec("web-0").build());
    }

    #[test]
    fn a_pod_of_several_containers_moves_unless_one_cannot_and_the_refusal_names_it() {
        let pre_copy = spec("web-0").build();
        let cold = spec("web-0").cold().build();
        let two = two_running(json!({"spec": {"containers": [
            {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]}}));
        assert_eq!(two.containers, vec!["app", "proxy"]);
        assert_migratable("two containers, PreCopy", &two, &pre_copy);
        assert_migratable("two containers, Cold", &two, &cold);
        // A native sidecar, and a finished ordinary init container beside it.
        let sidecar = two_running(json!({"spec": {"initContainers": [
            {"name": "setup", "image": "app:1"},
            {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]}}));
        assert_eq!(sidecar.containers, vec!["app", "proxy"]);
        assert!(
            sidecar.not_running_containers.is_empty(),
            "{:?}",
            sidecar.not_running_containers
        );
        assert_migratable("native sidecar, PreCopy", &sidecar, &pre_copy);
        // PostCopy: every container is named, and what to use instead.
        let (r, m) = refusal(&sidecar, &spec("web-0").post_copy().build());
        assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
        assert!(m.contains("(app, proxy") && m.contains("PostCopy"), "{m}");
        // A container that does not run is named with what its status says.
        let waiting = k8s(json!({"spec": {"initContainers": [
            {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]},
            "status": {"containerStatuses": [running("app")],
                "initContainerStatuses": [{"name": "proxy",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}));
        let (r, m) = refusal(&waiting, &pre_copy);
        assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
        assert!(
            m.contains("container proxy is not running (waiting: CrashLoopBackOff)"),
            "{m}"
        );
        let unreported = k8s(json!({"spec": {"containers": [
            {"name": "app", "image": "app:1"}, {"name": "log", "image": "log:1"}]},
            "status": {"containerStatuses": [running("app")]}}));
        let (_, m) = refusal(&unreported, &cold);
        assert!(
            m.contains("container log is not running (no status reported yet)"),
            "{m}"
        );
        // More containers than the agents move at once.
        let many: Vec<Value> = (0..=MAX_CONTAINERS)
            .map(|i| json!({"name": format!("c{i}"), "image": "app:1"}))
            .collect();
        let statuses: Vec<Value> = (0..=MAX_CONTAINERS)
            .map(|i| running(&format!("c{i}")))
            .collect();
        let (r, m) = refusal(
            &k8s(json!({"spec": {"containers": many},
                "status": {"containerStatuses": statuses}})),
            &pre_copy,
        );
        assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
        assert!(
            m.contains("17 containers") && m.contains("at most 16"),
            "{m}"
        );
        // One container: its status is the agent's to check, as before.
        assert_migratable("one container, no status", &k8s(json!({})), &pre_copy);
    }

    #[test]
    fn hugepages_ephemeral_storage_and_native_init_containers_are_not_refused() {
        let p = k8s(json!({"spec": {
            "containers": [{"name": "app", "image": "app:1", "resources": {
                "requests": {"cpu": "100m", "memory": "64Mi", "hugepages-2Mi": "128Mi",
                    "ephemeral-storage": "1Gi"},
                "limits": {"hugepages-1Gi": "1Gi", "memory": "128Mi"}}}],
            // An ordinary init container has finished: it is not a second container.
            "initContainers": [{"name": "migrate-db", "image": "app:1"}]}}));
        assert!(
            p.extended_resources.is_empty(),
            "{:?}",
            p.extended_resources
        );
        assert_eq!(p.containers, vec!["app"]);
        assert_migratable("hugepages", &p, &spec("web-0").build());
    }

    #[test]
    fn a_claims_zonal_volume_limits_the_target_to_its_zone() {
        let zone_b = NodeSelector {
            node_selector_terms: vec![k8s_openapi::api::core::v1::NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "zone".into(),
                    operator: "In".into(),
                    values: Some(vec!["b".into()]),
                }]),
                match_fields: None,
            }],
        };
        let mut c = claims(&[("data", &["ReadWriteMany"])]);
        c.get_mut("data").unwrap().node_affinity = Some(zone_b);
        let p = k8s(claim_volume("data")).with_claims(&c);
        let nodes = vec![
            node("n0").label("zone", "b").build(),
            node("n1").label("zone", "a").build(),
            node("n2").label("zone", "b").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let err = select_target(&spec("web-0").target("n1").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::TARGET_DOES_NOT_FIT, "{}", err.1);
        assert!(err.1.contains("claim data"), "{}", err.1);
    }

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
    fn a_newer_migration_of_the_same_pod_does_not_block_the_older_one() {
        let p = pod("web-0").on("n0").build();
        let newer = OtherMigration {
            name: "later".into(),
            pod_name: "web-0".into(),
            created: ts(200),
            terminal: false,
        };
        let finished = OtherMigration {
            name: "old".into(),
            pod_name: "web-0".into(),
            created: ts(1),
            terminal: true,
        };
        let v = preflight(
            &spec("web-0").build(),
            &me(),
            Some(&p),
            &three_nodes(),
            &[newer, finished],
        );
        assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
    }

    #[test]
    fn operator_picks_the_node_with_most_free_memory_honouring_the_selector() {
        let p = pod("web-0").on("n0").build();
        let nodes = vec![
            node("n0").build(),
            node("n1").label("zone", "a").used(0, 32 << 30).build(),
            node("n2").label("zone", "a").build(),
            node("n3").label("zone", "b").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let s = spec("web-0").selector("zone", "a").build();
        assert_eq!(select_target(&s, &p, "n0", &nodes).unwrap(), "n2");
        let nodes = vec![
            node("n0").build(),
            node("n1").label("zone", "a").used(0, 32 << 30).build(),
        ];
        assert_eq!(select_target(&s, &p, "n0", &nodes).unwrap(), "n1");
    }

    #[test]
    fn unschedulable_tainted_and_agentless_nodes_are_never_chosen() {
        let p = pod("web-0").on("n0").build();
        let nodes = vec![
            node("n0").build(),
            node("cordoned").cordoned().build(),
            node("tainted")
                .taint("dedicated", "gpu", "NoSchedule")
                .build(),
            node("agentless").without_agent().build(),
        ];
        let err = select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::NO_TARGET_NODE);
        for n in ["cordoned", "tainted", "agentless", "source node"] {
            assert!(err.1.contains(n), "{n} missing from {}", err.1);
        }
        let tolerant = pod("web-0").on("n0").tolerates("dedicated", "gpu").build();
        assert_eq!(
            select_target(&spec("web-0").build(), &tolerant, "n0", &nodes).unwrap(),
            "tainted"
        );
    }

    #[test]
    fn the_pods_own_node_selector_must_still_match_the_target() {
        let p = pod("web-0").on("n0").node_selector("disk", "ssd").build();
        let nodes = vec![
            node("n0").build(),
            node("n1").build(),
            node("n2").label("disk", "ssd").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
    }

    #[test]
    fn the_pods_required_node_affinity_must_still_match_the_target() {
        let mut p = pod("web-0").on("n0").build();
        p.required_node_affinity = Some(NodeSelector {
            node_selector_terms: vec![k8s_openapi::api::core::v1::NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "zone".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into()]),
                }]),
                match_fields: None,
            }],
        });
        let nodes = vec![
            node("n0").label("zone", "a").build(),
            node("n1").label("zone", "b").build(),
            node("n2").label("zone", "a").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let err = select_target(&spec("web-0").target("n1").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::TARGET_DOES_NOT_FIT);
    }

    #[test]
    fn concurrency_limits_count_started_migrations_and_older_queued_ones() {
        let limits = Limits {
            per_cluster: 5,
            per_source_node: 2,
        };
        let other = |name: &str, created: i64, node: &str, started: bool| SlotHolder {
            name: name.into(),
            created: ts(created),
            source_node: Some(node.into()),
            started,
            queued: !started,
        };
        // Two started from n0: n0 is full, n1 is not.
        let two_on_n0 = vec![other("a", 1, "n0", true), other("b", 2, "n0", true)];
        assert!(!slot_available(&me(), "n0", &two_on_n0, limits));
        assert!(slot_available(&me(), "n1", &two_on_n0, limits));
        // Five started across nodes: the cluster is full.
        let five: Vec<_> = (0..5)
            .map(|i| other(&format!("m{i}"), 1, &format!("x{i}"), true))
            .collect();
        assert!(!slot_available(&me(), "n1", &five, limits));
        // An older queued migration from n0 goes first; a younger one does not count.
        let older = vec![other("a", 1, "n0", true), other("early", 50, "n0", false)];
        assert!(!slot_available(&me(), "n0", &older, limits));
        let younger = vec![other("a", 1, "n0", true), other("late", 500, "n0", false)];
        assert!(slot_available(&me(), "n0", &younger, limits));
        // Itself never counts.
        let itself = vec![
            other("move-web", 100, "n0", true),
            other("a", 1, "n0", true),
        ];
        assert!(slot_available(&me(), "n0", &itself, limits));
    }

    #[test]
    fn quantities_parse_in_base_units() {
        assert_eq!(cpu_millis("500m"), Some(500));
        assert_eq!(cpu_millis("2"), Some(2000));
        assert_eq!(cpu_millis("0.25"), Some(250));
        assert_eq!(bytes("64Gi"), Some(64 << 30));
        assert_eq!(bytes("128M"), Some(128_000_000));
        assert_eq!(bytes("1e3"), Some(1000));
        assert_eq!(bytes("lots"), None);
        assert_eq!(bytes("-1"), None);
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
