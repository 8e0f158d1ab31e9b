//! The pool's Server: its Service resolved to what the Runner's NetworkPolicy can
//! select, and why the Runner pods get no egress to it when it does not resolve.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::ResourceExt;
use podmotion_api::RunnerPool;

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
