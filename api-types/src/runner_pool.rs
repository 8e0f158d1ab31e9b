//! `RunnerPool`: a microVM Runner on every eligible node, as a DaemonSet with an
//! exact, unprivileged, sized and network-locked pod shape.
//!
//! DRAFT shape from the foundation issue; the RunnerPool issue refines it against
//! `runner-daemonset-design-record.txt` and `agent-pods-in-own-namespace.txt`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Runs the microVM Runner on every eligible node as a DaemonSet whose pod shape is
/// fixed by PodMotion: unprivileged, user-namespaced, sized for the node's session
/// capacity and locked down by a NetworkPolicy.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "podmotion.io",
    version = "v1alpha1",
    kind = "RunnerPool",
    namespaced,
    status = "RunnerPoolStatus",
    shortname = "rp",
    category = "podmotion",
    doc = "Runs the microVM Runner on every eligible node as an unprivileged, sized, network-locked DaemonSet.",
    printcolumn(name = "Image", type_ = "string", json_path = ".status.imageDigestShort"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredNodes"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyNodes"),
    printcolumn(name = "Capacity", type_ = "integer", json_path = ".status.sessionCapacity"),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct RunnerPoolSpec {
    /// Runner image, pinned by digest (`registry/runner@sha256:<64 hex>`). A tag is
    /// not accepted: the digest names the whole KVM userland and guest assets.
    #[x_kube(validation = Rule::new("self.matches('^[^@\\\\s]+@sha256:[0-9a-f]{64}$')").message("image must be pinned by digest, e.g. registry.example/runner@sha256:<64 hex digits>; tags are not accepted"))]
    pub image: String,
    /// Concurrent microVM sessions per node.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 256").message("sessionsPerNode must be between 1 and 256"))]
    pub sessions_per_node: i32,
}

/// Observed state of a RunnerPool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerPoolStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// First 12 hex digits of the image digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest_short: Option<String>,
    /// Nodes that should run a Runner.
    #[serde(default)]
    pub desired_nodes: i32,
    /// Nodes whose Runner is ready.
    #[serde(default)]
    pub ready_nodes: i32,
    /// Ready nodes × sessions per node.
    #[serde(default)]
    pub session_capacity: i32,
    /// Standard and RunnerPool conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
