//! `NodeAgentAttachment`: attach a node-hosted agent to every admissible replica of
//! a workload without mutating or restarting it.
//!
//! The spec names the workload (immutable), what the agent does (`mode`, immutable),
//! which containers and ports it works on, the agent's own settings, how an injected
//! traffic-agent sidecar is recognised, and the session lease of an ingest. The status
//! lists every target (pod, node, IP, Job, state) and every skipped pod with its
//! reason. Semantics: `node-hosted-traffic-agent.txt` and `docs/attachment.md`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use crate::names;

/// Attaches a node-hosted agent (one node-pinned Job per target pod, in the operator's
/// namespace) to every admissible Running and Ready replica of a workload. The
/// workload and its pods are never mutated or restarted. Pods on the host network,
/// pods that already carry an injected traffic-agent sidecar and pods in their own
/// user namespace (`hostUsers: false`) are skipped and listed in `status.skipped`.
// clippy's duplicated_attributes misreads the repeated `type_ = "string"` of the
// printer columns inside the derive attribute.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "podmotion.io",
    version = "v1alpha1",
    kind = "NodeAgentAttachment",
    namespaced,
    status = "NodeAgentAttachmentStatus",
    shortname = "naa",
    category = "podmotion",
    doc = "Attaches a node-hosted agent to every admissible replica of a workload, without mutating it.",
    printcolumn(name = "Workload", type_ = "string", json_path = ".status.workload"),
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Ready", type_ = "string", json_path = ".status.readySummary"),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(
    validation = Rule::new("(has(self.mode) && self.mode == 'Ingest') || !has(self.ingest)").message("ingest settings apply only to mode Ingest"),
    validation = Rule::new("!(has(self.mode) && self.mode == 'Ingest') || !has(self.ports) || self.ports.size() == 0").message("ports apply only to modes Intercept and Wiretap: an ingest reads environment and files, not traffic"),
)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentAttachmentSpec {
    /// The workload whose replicas get an agent, in this attachment's namespace.
    /// Immutable: create a new NodeAgentAttachment for another workload.
    #[x_kube(validation = Rule::new("self == oldSelf").message("workloadRef is immutable: create a new NodeAgentAttachment for another workload"))]
    pub workload_ref: WorkloadRef,

    /// What the agent does. `Intercept` (default) redirects matching incoming traffic
    /// to a client; `Wiretap` copies it while the application still answers; `Ingest`
    /// reads one pod's environment and files (a single Job, shared with other
    /// attachments of the workload and kept only while the session lease is renewed).
    /// Immutable.
    #[serde(default)]
    #[x_kube(validation = Rule::new("self == oldSelf").message("mode is immutable: create a new NodeAgentAttachment for another mode"))]
    pub mode: AttachMode,

    /// Containers of the target pods whose container IDs are passed to the agent (it
    /// enters their namespaces and reads their environment and files). Empty: every
    /// container of the pod except an injected traffic-agent sidecar.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 63)))]
    #[x_kube(
        validation = Rule::new("self.all(c, c.size() <= 63 && c.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'))").message("containers must be container names (lowercase letters, digits and '-', at most 63 characters)"),
        validation = Rule::new("self.all(c, self.filter(d, d == c).size() == 1)").message("containers must not repeat a name"),
    )]
    pub containers: Vec<String>,

    /// Ports whose traffic the agent intercepts or wiretaps (modes `Intercept` and
    /// `Wiretap`). Empty: every port the selected containers declare. Two `Intercept`
    /// attachments of one workload that share a port conflict; the younger one is
    /// rejected with reason `PortConflict`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[x_kube(validation = Rule::new("self.all(p, self.filter(q, q == p).size() == 1)").message("ports must not repeat an entry"))]
    pub ports: Vec<AgentPort>,

    /// Settings of the agent the Jobs run. Attachments that share a workload's Jobs
    /// must agree on them (and on `containers` and `sidecar`); a younger attachment
    /// that differs is rejected with reason `AgentConflict`.
    #[serde(default)]
    pub agent: AgentSettings,

    /// How a pod that already carries an injected traffic-agent sidecar is recognised.
    /// Such pods are skipped (reason `InjectedSidecar`): a sidecar and a node agent
    /// would program the same nftables table and bind the same ports.
    #[serde(default)]
    pub sidecar: SidecarRecognition,

    /// Session lease of an ingest (mode `Ingest` only). The client renews the
    /// `coordination.k8s.io` Lease; once it expires the ingest no longer holds its
    /// Job, which is reaped unless another attachment still wants it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingest: Option<IngestSession>,
}

/// Reference to a workload in the attachment's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// `Deployment`, `StatefulSet`, `ReplicaSet` or `DaemonSet` (group `apps`).
    pub kind: WorkloadKind,
    /// Name of the workload.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("workloadRef.name must be a workload name (lowercase letters, digits, '-' and '.')"))]
    #[schemars(length(max = 253))]
    pub name: String,
}

/// Kinds of workload an agent can be attached to.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    schemars::JsonSchema,
)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    ReplicaSet,
    DaemonSet,
}

impl WorkloadKind {
    /// The kind's name, as in `workloadRef.kind`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::StatefulSet => "StatefulSet",
            WorkloadKind::ReplicaSet => "ReplicaSet",
            WorkloadKind::DaemonSet => "DaemonSet",
        }
    }
}

/// What the agent does.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
pub enum AttachMode {
    /// Redirect matching incoming traffic to a client.
    #[default]
    Intercept,
    /// Copy traffic to a client while the application still answers it.
    Wiretap,
    /// Read the pod's environment and files (one pod).
    Ingest,
}

impl AttachMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AttachMode::Intercept => "Intercept",
            AttachMode::Wiretap => "Wiretap",
            AttachMode::Ingest => "Ingest",
        }
    }
}

/// One port of the target containers, by number or by name (set exactly one).
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, KubeSchema,
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.port) != has(self.name)").message("a port sets exactly one of port (a number) and name"))]
pub struct AgentPort {
    /// Container port number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("port must be between 1 and 65535"))]
    pub port: Option<i32>,
    /// Name of a container port (`spec.containers[].ports[].name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && self.size() <= 15").message("a port name is an IANA service name: at most 15 lowercase letters, digits and '-'"))]
    #[schemars(length(max = 15))]
    pub name: Option<String>,
    /// `TCP` (default) or `UDP`.
    #[serde(default)]
    pub protocol: PortProtocol,
}

/// Transport protocol of a port.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    schemars::JsonSchema,
)]
pub enum PortProtocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
}

/// Settings of the node agent. What runs with privilege on the node (the agent
/// image, the container-runtime socket mounted into it, annotations on its pod) is
/// chosen by whoever installed the operator (chart values `attachment.agentImage`,
/// `attachment.criSocketPath`, `attachment.podAnnotations`), never by an attachment:
/// the agent Job runs as root with hostPID and SYS_ADMIN in the agents' namespace.
// `image`, `criSocketPath` and `podAnnotations` stay in the schema only so that setting
// them is rejected with a message that says where the setting moved (objects stored
// before keep validating under CRD validation ratcheting while those fields are
// unchanged). The operator never reads them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(
    validation = Rule::new("!has(self.image)").message("agent.image is not accepted: the agent image is chosen by the operator's installer (chart value attachment.agentImage), since the agent runs as root with hostPID on the node; remove agent.image"),
    validation = Rule::new("!has(self.criSocketPath)").message("agent.criSocketPath is not accepted: the host path mounted into the agent is chosen by the operator's installer (chart value attachment.criSocketPath); remove agent.criSocketPath"),
    validation = Rule::new("!has(self.podAnnotations)").message("agent.podAnnotations is not accepted: annotations on the privileged agent pod (AppArmor, policy exemptions) are chosen by the operator's installer (chart value attachment.podAnnotations); remove agent.podAnnotations"),
)]
pub struct AgentSettings {
    /// Not accepted: chosen by the operator's installer (chart value `attachment.agentImage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub image: Option<String>,

    /// Extra agent configuration, passed to the agent in `AGENT_CONFIG` next to the
    /// workload, mode, containers and ports (the same configuration a sidecar would
    /// receive). At most 64 entries; keys are at most 63 characters of letters,
    /// digits, `-`, `_` and `.`; values at most 448 characters without control
    /// characters, so that `AGENT_CONFIG` always fits in one environment value
    /// (128 KiB on Linux).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64, "additionalProperties" = {"type": "string", "maxLength": 448}))]
    #[x_kube(
        validation = Rule::new("self.all(k, k.size() <= 63 && k.matches('^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$'))").message("agent.config keys must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"),
        validation = Rule::new("self.all(k, self[k].size() <= 448 && !self[k].matches('[\\x00-\\x1f\\x7f]'))").message("agent.config values must be at most 448 characters without control characters (the whole configuration is passed in one environment value)"),
    )]
    pub config: BTreeMap<String, String>,

    /// Group ID the agent runs with (`runAsGroup`). The redirect rules in the target
    /// network namespace exempt sockets of this group (the sidecar's owner match), so
    /// it must not be a group the application uses. Default 7777.
    #[serde(default = "default_agent_gid")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 2147483647").message("agent.gid must be between 1 and 2147483647 (not root's group)"))]
    pub gid: i64,

    /// Not accepted: chosen by the operator's installer (chart value `attachment.criSocketPath`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 255))]
    pub cri_socket_path: Option<String>,

    /// Not accepted: chosen by the operator's installer (chart value `attachment.podAnnotations`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub pod_annotations: BTreeMap<String, String>,
}

impl Default for AgentSettings {
    fn default() -> Self {
        AgentSettings {
            image: None,
            config: BTreeMap::new(),
            gid: default_agent_gid(),
            cri_socket_path: None,
            pod_annotations: BTreeMap::new(),
        }
    }
}

fn default_agent_gid() -> i64 {
    7777
}

/// How an injected traffic-agent sidecar is recognised on a pod: a container of this
/// name, or this annotation with value `"true"` (either suffices).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SidecarRecognition {
    /// Container name of an injected sidecar. Default `traffic-agent`.
    #[serde(default = "default_sidecar_container")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$') && self.size() <= 63").message("sidecar.containerName must be a container name"))]
    #[schemars(length(max = 63))]
    pub container_name: String,
    /// Pod annotation marking an injected sidecar. Default `telepresence.io/agent-injected`.
    #[serde(default = "default_sidecar_annotation")]
    #[x_kube(validation = Rule::new("self.matches('^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$') && self.size() <= 316").message("sidecar.annotation must be an annotation key such as example.com/agent-injected"))]
    #[schemars(length(max = 316))]
    pub annotation: String,
}

impl Default for SidecarRecognition {
    fn default() -> Self {
        SidecarRecognition {
            container_name: default_sidecar_container(),
            annotation: default_sidecar_annotation(),
        }
    }
}

fn default_sidecar_container() -> String {
    "traffic-agent".into()
}
fn default_sidecar_annotation() -> String {
    names::annotations::INJECTED_AGENT.into()
}

/// Session lease of an ingest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct IngestSession {
    /// Name of the `coordination.k8s.io` Lease, in this attachment's namespace, that
    /// the client renews while its session lives. The operator creates it (owned by
    /// this attachment) if it does not exist. Unset: the attachment's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("ingest.leaseName must be a Lease name (lowercase letters, digits, '-' and '.')"))]
    #[schemars(length(max = 253))]
    pub lease_name: Option<String>,
    /// Seconds after the last renewal at which the session counts as gone. Used when
    /// the Lease itself does not say (`spec.leaseDurationSeconds`). Default 60.
    #[serde(default = "default_lease_seconds")]
    #[x_kube(validation = Rule::new("self >= 10 && self <= 86400").message("ingest.leaseDurationSeconds must be between 10 and 86400"))]
    pub lease_duration_seconds: i32,
}

fn default_lease_seconds() -> i32 {
    60
}

/// Observed state of a NodeAgentAttachment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentAttachmentStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Kind/name` of the workload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// Pods that have an agent Job (or are getting one), sorted by pod name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<TargetStatus>,
    /// Pods of the workload that get no agent, each with the reason.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedPod>,
    /// Targets whose agent Job has a ready pod.
    #[serde(default)]
    pub ready_targets: i32,
    /// Number of targets.
    #[serde(default)]
    pub total_targets: i32,
    /// `ready/total` agents, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_summary: Option<String>,
    /// `Ready`, `Reconciling`, `Stalled`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// One target pod and its agent Job.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TargetStatus {
    /// Pod name.
    pub pod: String,
    /// Node the pod (and its agent Job) runs on.
    pub node: String,
    /// The pod's IP.
    #[serde(default, rename = "podIP", skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    /// Name of the agent Job, in the operator's namespace.
    pub job: String,
    /// Where the agent stands.
    pub state: TargetState,
}

/// Where a target's agent stands.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    schemars::JsonSchema,
)]
pub enum TargetState {
    /// The Job is about to be created.
    #[default]
    Pending,
    /// The previous Job (outdated target or failed agent) is being deleted; the new
    /// one is created once it is gone.
    Replacing,
    /// The Job exists; its pod is not ready yet.
    Starting,
    /// The Job's pod is ready.
    Running,
    /// The agent exited on its own (it should not); see the Job.
    Exited,
}

/// A pod of the workload that gets no agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SkippedPod {
    /// Pod name.
    pub pod: String,
    /// Why it is skipped.
    pub reason: SkipReason,
    /// Details, for humans.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

/// Why a pod gets no agent.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    schemars::JsonSchema,
)]
pub enum SkipReason {
    /// The pod uses the host network: its namespace is the node's.
    HostNetwork,
    /// The pod already carries an injected traffic-agent sidecar.
    InjectedSidecar,
    /// The pod runs in its own user namespace (`hostUsers: false`); not supported yet.
    UserNamespace,
    /// The pod's node runs another operating system or CPU architecture than the agent
    /// image is built for (its `kubernetes.io/os` or `kubernetes.io/arch` label against
    /// the operator's `--node-arch`, chart value `global.nodeArch`): an agent Job there
    /// could not start.
    UnsupportedPlatform,
    /// The pod is not Running and Ready yet (or is terminating or has failed); it gets
    /// its Job once it is Running and Ready.
    NotReady,
}
