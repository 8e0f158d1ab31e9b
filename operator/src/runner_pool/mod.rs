//! The RunnerPool core, pure: from a RunnerPool and a few observed facts it renders
//! the Runner's object contract (`render`), sizes the pod for its session capacity
//! (`sizing`), judges drift of the live DaemonSet (`drift`), whether the namespace's
//! PodSecurity level admits the pods (`pod_security`), reads the node preflight
//! verdicts (`preflight`) and computes the status (`status`). No I/O: the controller
//! (`crate::controllers::runner_pool`) fetches the inputs and applies the outputs.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use podmotion_api::RunnerPool;

pub mod drift;
pub mod pod_security;
pub mod policies;
pub mod preflight;
pub mod priority;
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

impl ServerEndpoint {
    /// The Server's Service `svc` (in `namespace`) resolved for `pool`: its pod selector
    /// and the target of the pool's server port. `None` when the Service is missing,
    /// selects no pods or has no such port.
    pub fn resolve(pool: &RunnerPool, namespace: &str, svc: Option<Service>) -> Option<Self> {
        let spec = svc?.spec?;
        let selector = spec.selector.filter(|s| !s.is_empty())?;
        let port = spec
            .ports?
            .into_iter()
            .find(|p| p.port == pool.spec.server.port)?;
        Some(ServerEndpoint {
            namespace: namespace.into(),
            selector,
            target_port: port.target_port.unwrap_or(IntOrString::Int(port.port)),
        })
    }
}

/// Namespace of the pool's Server Service (the pool's own unless it names one).
pub fn server_namespace(pool: &RunnerPool) -> String {
    pool.spec
        .server
        .namespace
        .clone()
        .unwrap_or_else(|| pool.namespace().unwrap_or_default())
}

/// Why the Runner pods get no egress to the Server, when `server` did not resolve.
pub fn server_problem(pool: &RunnerPool, server: Option<&ServerEndpoint>) -> Result<(), String> {
    match server {
        Some(_) => Ok(()),
        None => Err(format!(
            "Service {}/{} is missing, has no pod selector or no port {}: the Runner pods get no egress to the Server",
            server_namespace(pool),
            pool.spec.server.service_name,
            pool.spec.server.port
        )),
    }
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

/// What the status is computed from besides the pool: the facts read before this
/// round's applies and what the applies left behind.
#[derive(Clone, Debug, Default)]
pub struct Facts {
    /// Labels of the pool's namespace (its PodSecurity level).
    pub namespace_labels: BTreeMap<String, String>,
    /// The Runner pods.
    pub pods: Vec<Pod>,
    /// Every NetworkPolicy of the pool's namespace.
    pub policies: Vec<NetworkPolicy>,
}

/// What this round's applies left behind.
#[derive(Clone, Debug)]
pub struct Applied {
    pub daemonset: DaemonSet,
    pub drift: Vec<String>,
    pub conflicts: Vec<String>,
    pub credential_secret: Option<String>,
}

/// The status inputs: PodSecurity verdict for the rendered pod, preflight verdicts and
/// scheduling problems of the Runner pods, other policies selecting them, and whether
/// the Server resolved.
pub fn status_inputs(
    pool: &RunnerPool,
    desired: &Desired,
    inputs: &Inputs,
    facts: &Facts,
    applied: Applied,
) -> status::Observed {
    let ns = pool.namespace().unwrap_or_default();
    let template = &desired.daemonset.spec.template;
    let pod_spec = template.spec.clone().unwrap_or_default();
    let pod_labels = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    status::Observed {
        daemonset: Some(applied.daemonset),
        drift: applied.drift,
        pod_security: pod_security::check(&ns, &facts.namespace_labels, &pod_spec),
        preflight: facts.pods.iter().map(preflight::from_pod).collect(),
        server: server_problem(pool, inputs.server.as_ref()),
        foreign_policies: policies::foreign_policies(
            &render::child_name(pool),
            &pod_labels,
            &facts.policies,
        ),
        conflicts: applied.conflicts,
        unschedulable: facts
            .pods
            .iter()
            .filter_map(status::unschedulable)
            .collect(),
        credential_secret: applied.credential_secret,
    }
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
