//! The RunnerPool core, pure: from a RunnerPool and a few observed facts it renders
//! the Runner's object contract (`render`), sizes the pod for its session capacity
//! (`sizing`), judges drift of the live DaemonSet (`drift`), whether the namespace's
//! PodSecurity level admits the pods (`pod_security`), reads the node preflight
//! verdicts (`preflight`) and computes the status (`status`). No I/O: the controller
//! (`crate::controllers::runner_pool`) fetches the inputs and applies the outputs.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub mod drift;
pub mod pod_security;
pub mod policies;
pub mod preflight;
pub mod render;
pub mod sizing;
pub mod status;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod tests;

pub use render::render;

/// The Server's Service, resolved to what a NetworkPolicy can select.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerEndpoint {
    /// Namespace of the Service (and its pods).
    pub namespace: String,
    /// The Service's pod selector.
    pub selector: BTreeMap<String, String>,
    /// The port the Service forwards the Runner's port to (number or name).
    pub target_port: IntOrString,
}

/// Observed facts the rendering needs besides the RunnerPool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inputs {
    /// Preflight image when the RunnerPool names none (operator setting).
    pub preflight_image: String,
    /// Nodes carrying the pool's node label; caps `maxUnavailable` below all of them.
    pub eligible_nodes: usize,
    /// The Server's Service; `None` when it is missing or has no selector.
    pub server: Option<ServerEndpoint>,
    /// Token of the generated credential Secret: the existing one, or a fresh random
    /// one when the Secret does not exist yet. `None` when a Secret is referenced.
    pub credential_token: Option<String>,
}

/// Every object of the contract for one pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    pub daemonset: DaemonSet,
    pub service_account: ServiceAccount,
    /// The generated credential Secret (`None` when the pool references one).
    pub secret: Option<Secret>,
    pub network_policy: NetworkPolicy,
    pub pdb: PodDisruptionBudget,
    /// Cluster-scoped, cleaned up by the pool's finalizer (`None` when referenced).
    pub priority_class: Option<PriorityClass>,
}
