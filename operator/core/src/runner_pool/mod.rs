//! The RunnerPool core, pure: from a RunnerPool and a few observed facts it renders
//! the Runner's object contract (`render`), sizes the pod for its session capacity
//! (`sizing`), judges drift of the live DaemonSet (`drift`), whether the namespace's
//! PodSecurity level admits the pods (`pod_security`), reads the node preflight
//! verdicts (`preflight`), resolves the Server's Service (`server`) and computes the
//! status (`status`). No I/O: the controller
//! (`crate::controllers::runner_pool`) fetches the inputs and applies the outputs.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube_core::ResourceExt;
use podmotion_api::RunnerPool;

pub mod drift;
pub mod pod_security;
pub mod policies;
pub mod preflight;
pub mod priority;
pub mod render;
pub mod server;
pub mod sizing;
pub mod status;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod platform_tests;
#[cfg(test)]
mod tests;

pub use render::{Desired, Inputs, render};
pub use server::{ServerEndpoint, server_namespace, server_problem};

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
        platform_conflicts: render::node_selector(pool, &inputs.platform)
            .1
            .iter()
            .map(ToString::to_string)
            .collect(),
        credential_secret: applied.credential_secret,
    }
}
