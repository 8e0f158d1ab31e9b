//! `NodeAgentAttachment`: attach a node-hosted agent to every admissible replica of
//! a workload without mutating or restarting it.
//!
//! DRAFT shape from the foundation issue; the attachment-controller issue refines it
//! against `node-hosted-traffic-agent.txt`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Attaches a node-hosted agent (one node-pinned Job per target pod, in the operator's
/// namespace) to every admissible Running and Ready replica of a workload. The
/// workload and its pods are never mutated or restarted.
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
    printcolumn(name = "Attached", type_ = "string", json_path = ".status.readySummary"),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct NodeAgentAttachmentSpec {
    /// The workload whose replicas get an agent. Immutable.
    #[x_kube(validation = Rule::new("self == oldSelf").message("workloadRef is immutable: create a new NodeAgentAttachment for another workload"))]
    pub workload_ref: WorkloadRef,
    /// What the agent does with the target's traffic.
    #[serde(default)]
    pub mode: AttachMode,
}

/// Reference to a workload in the attachment's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRef {
    /// `Deployment`, `StatefulSet`, `ReplicaSet` or `DaemonSet` (group `apps`).
    pub kind: WorkloadKind,
    /// Name of the workload.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253").message("workloadRef.name must be a workload name"))]
    pub name: String,
}

/// Kinds of workload an agent can be attached to.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    ReplicaSet,
    DaemonSet,
}

/// What the agent does.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema)]
pub enum AttachMode {
    /// Redirect matching incoming traffic to a client.
    #[default]
    Intercept,
    /// Copy traffic to a client while the application still answers it.
    Wiretap,
    /// Read the pod's environment and files (one pod).
    Ingest,
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
    /// `ready/total` agents, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_summary: Option<String>,
    /// `Ready`, `Reconciling`, `Stalled`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
