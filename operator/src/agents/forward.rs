//! `Step::Forward` over the wire (issue 39): what the source agent is told to forward
//! to the target, and the memory of how the call stands.
//!
//! The request names the target pod's addresses (`status.podIPs`) and the Service
//! ports whose endpoints list the source pod: the EndpointSlices of the migration's
//! namespace with an endpoint whose `targetRef` is the source pod, each slice's
//! Service (`kubernetes.io/service-name`), its cluster IPs, and for each port of the
//! slice the Service port of the same name. Headless Services (no cluster IP) and
//! ports that are not TCP are left out: their clients reach the source's address
//! itself, which the source's node forwards anyway.
//!
//! The call's outcome is kept apart from the other steps' (`AgentProgress::forward`):
//! the agent's own status does not show it, and it must not stand as the source's
//! last step.

use std::collections::BTreeSet;

use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::ListParams;
use podmotion_wire::agent::{ForwardRequest, ForwardedPort};

use super::WireAgents;
use crate::migration::agent::{AgentCallError, AgentEndpoint, StepRequest, StepState};

/// The label naming an EndpointSlice's Service.
const SERVICE_NAME: &str = "kubernetes.io/service-name";

/// The Service names whose EndpointSlices (of `slices`) list the pod `source_uid`.
pub fn services_listing(source_uid: &str, slices: &[EndpointSlice]) -> BTreeSet<String> {
    slices
        .iter()
        .filter(|s| lists(s, source_uid))
        .filter_map(|s| s.metadata.labels.as_ref()?.get(SERVICE_NAME).cloned())
        .collect()
}

fn lists(slice: &EndpointSlice, pod_uid: &str) -> bool {
    slice.endpoints.iter().flatten().any(|e| {
        e.target_ref
            .as_ref()
            .is_some_and(|t| t.kind.as_deref() == Some("Pod") && t.uid.as_deref() == Some(pod_uid))
    })
}

/// What the source's node forwards: to `target`'s addresses, the TCP ports of
/// `services` whose EndpointSlices (of `slices`) list the pod `source_uid`. Pure.
pub fn forward_request(
    migration_uid: &str,
    target: Option<&Pod>,
    source_uid: &str,
    slices: &[EndpointSlice],
    services: &[Service],
) -> Result<ForwardRequest, String> {
    let status = target.and_then(|p| p.status.as_ref());
    let mut target_addresses: Vec<String> = status
        .and_then(|s| s.pod_ips.as_ref())
        .map(|ips| ips.iter().map(|ip| ip.ip.clone()).collect())
        .unwrap_or_default();
    if target_addresses.is_empty()
        && let Some(ip) = status.and_then(|s| s.pod_ip.clone())
    {
        target_addresses.push(ip);
    }
    if target_addresses.is_empty() {
        return Err("the target pod has no address".into());
    }
    Ok(ForwardRequest {
        migration_uid: migration_uid.into(),
        target_addresses,
        services: service_ports(source_uid, slices, services),
    })
}

/// The TCP ports of `services` whose EndpointSlices (of `slices`) list the pod
/// `source_uid`: what the source's node forwards, and what its lock holds. Pure.
pub fn service_ports(
    source_uid: &str,
    slices: &[EndpointSlice],
    services: &[Service],
) -> Vec<ForwardedPort> {
    let mut ports = BTreeSet::new();
    for slice in slices.iter().filter(|s| lists(s, source_uid)) {
        let name = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME));
        let Some(svc) = services.iter().find(|s| s.metadata.name.as_ref() == name) else {
            continue;
        };
        ports.extend(slice_ports(slice, svc));
    }
    ports
        .into_iter()
        .map(|(address, port, target_port)| ForwardedPort {
            address,
            port,
            target_port,
        })
        .collect()
}

/// (cluster IP, Service port, endpoint port) of each TCP port of `slice` that `svc`
/// names, for each of its cluster IPs.
fn slice_ports(slice: &EndpointSlice, svc: &Service) -> Vec<(String, u32, u32)> {
    let Some(spec) = &svc.spec else {
        return Vec::new();
    };
    let ips: Vec<&String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.iter().collect(),
        (_, Some(ip)) => vec![ip],
        _ => Vec::new(),
    };
    let tcp = |p: &Option<String>| p.as_deref().is_none_or(|p| p == "TCP");
    let mut out = Vec::new();
    for sp in slice.ports.iter().flatten().filter(|p| tcp(&p.protocol)) {
        let Some(endpoint_port) = sp.port.and_then(|p| u32::try_from(p).ok()) else {
            continue;
        };
        let named = spec.ports.iter().flatten().find(|p| {
            p.name.as_deref().unwrap_or("") == sp.name.as_deref().unwrap_or("") && tcp(&p.protocol)
        });
        let Some(service_port) = named.and_then(|p| u32::try_from(p.port).ok()) else {
            continue;
        };
        for ip in ips
            .iter()
            .filter(|ip| ip.as_str() != "None" && !ip.is_empty())
        {
            out.push(((*ip).clone(), service_port, endpoint_port));
        }
    }
    out
}

impl WireAgents {
    /// Starts `Step::Forward` on the source agent (a no-op while one runs); its
    /// outcome goes to the forward's own memory.
    pub(super) fn start_forward(
        &self,
        e: &AgentEndpoint,
        r: &StepRequest,
    ) -> Result<(), AgentCallError> {
        let key = (e.node.clone(), r.migration_uid.clone());
        {
            let mut forwards = self.forwards.lock().expect("forwards lock");
            if forwards.get(&key) == Some(&StepState::Running) {
                return Ok(());
            }
            forwards.insert(key.clone(), StepState::Running);
        }
        let this = self.clone();
        let (e, r) = (e.clone(), r.clone());
        tokio::spawn(async move {
            // Bounded like a connection: the commit waits for this answer.
            let res = tokio::time::timeout(this.call_timeout, this.forward(&e, &r))
                .await
                .unwrap_or_else(|_| {
                    Err((
                        "AgentUnreachable".into(),
                        format!("Forward: no answer within {}s", this.call_timeout.as_secs()),
                    ))
                });
            let state = match res {
                Ok(()) => StepState::Done,
                Err((category, message)) => {
                    tracing::warn!(uid = %r.migration_uid, %category, %message, "new connections to the frozen source are not forwarded");
                    StepState::Failed { category, message }
                }
            };
            this.forwards
                .lock()
                .expect("forwards lock")
                .insert(key, state);
            let _ = this.ended.unbounded_send(r.migration_uid);
        });
        Ok(())
    }

    /// How the forward of migration `uid` on node `node` stands, as far as this
    /// replica knows.
    pub(super) fn forward_state(&self, node: &str, uid: &str) -> Option<StepState> {
        self.forwards
            .lock()
            .expect("forwards lock")
            .get(&(node.to_string(), uid.to_string()))
            .cloned()
    }

    /// The EndpointSlices of the migration's namespace and the Services of those that
    /// list the source pod.
    pub(super) async fn source_services(
        &self,
        r: &StepRequest,
    ) -> Result<(Vec<EndpointSlice>, Vec<Service>), (String, String)> {
        let api = |m: kube::Error| ("ApiError".to_string(), m.to_string());
        let slices: Api<EndpointSlice> = Api::namespaced(self.client.clone(), &r.namespace);
        let slices = slices
            .list(&ListParams::default())
            .await
            .map_err(api)?
            .items;
        let svc_api: Api<Service> = Api::namespaced(self.client.clone(), &r.namespace);
        let mut services = Vec::new();
        for name in services_listing(&r.source_pod_uid, &slices) {
            if let Some(s) = svc_api.get_opt(&name).await.map_err(api)? {
                services.push(s);
            }
        }
        Ok((slices, services))
    }

    /// Reads what to forward and asks the source agent.
    async fn forward(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), (String, String)> {
        let api = |m: kube::Error| ("ApiError".to_string(), m.to_string());
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &r.namespace);
        let target = pods.get_opt(&r.target_pod).await.map_err(api)?;
        let (slices, services) = self.source_services(r).await?;
        let req = forward_request(
            &r.migration_uid,
            target.as_ref(),
            &r.source_pod_uid,
            &slices,
            &services,
        )
        .map_err(|m| ("NoTargetAddress".to_string(), m))?;
        let mut c = self.connect_within_deadline(e).await?;
        c.forward(req)
            .await
            .map(|_| ())
            .map_err(|x| (x.category().to_string(), x.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(service: &str, pod_uids: &[&str], ports: serde_json::Value) -> EndpointSlice {
        let endpoints: Vec<serde_json::Value> = pod_uids
            .iter()
            .map(|u| {
                serde_json::json!({"addresses": ["198.18.0.5"],
                    "targetRef": {"kind": "Pod", "name": "web-0", "uid": u}})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{service}-abc"), "labels": {SERVICE_NAME: service}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports,
        }))
        .unwrap()
    }

    fn service(name: &str, ips: &[&str], ports: serde_json::Value) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"clusterIP": ips[0], "clusterIPs": ips, "ports": ports},
        }))
        .unwrap()
    }

    fn target() -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-0-pm"},
            "status": {"podIP": "198.18.1.7",
                       "podIPs": [{"ip": "198.18.1.7"}, {"ip": "2001:db8::7"}]}
        }))
        .unwrap()
    }

    #[test]
    fn the_services_listing_the_source_are_forwarded_by_port_name_to_the_target() {
        let slices = [
            slice(
                "web",
                &["src-uid", "other"],
                serde_json::json!([{"name": "http", "port": 8080, "protocol": "TCP"},
                                   {"name": "dns", "port": 53, "protocol": "UDP"}]),
            ),
            // Another Service whose endpoints do not list the source.
            slice(
                "api",
                &["other"],
                serde_json::json!([{"name": "", "port": 9000}]),
            ),
            // A headless Service listing it.
            slice(
                "web-hl",
                &["src-uid"],
                serde_json::json!([{"name": "http", "port": 8080}]),
            ),
        ];
        let services = [
            service(
                "web",
                &["198.19.0.10", "fd00::10"],
                serde_json::json!([{"name": "http", "port": 80, "targetPort": "http"},
                                   {"name": "dns", "port": 53, "protocol": "UDP"}]),
            ),
            service("api", &["198.19.0.11"], serde_json::json!([{"port": 9000}])),
            service(
                "web-hl",
                &["None"],
                serde_json::json!([{"name": "http", "port": 8080}]),
            ),
        ];
        assert_eq!(
            services_listing("src-uid", &slices),
            BTreeSet::from(["web".to_string(), "web-hl".to_string()])
        );
        let r = forward_request("m-1", Some(&target()), "src-uid", &slices, &services).unwrap();
        assert_eq!(r.migration_uid, "m-1");
        assert_eq!(r.target_addresses, ["198.18.1.7", "2001:db8::7"]);
        let got: Vec<(&str, u32, u32)> = r
            .services
            .iter()
            .map(|p| (p.address.as_str(), p.port, p.target_port))
            .collect();
        assert_eq!(got, [("198.19.0.10", 80, 8080), ("fd00::10", 80, 8080)]);
    }

    #[test]
    fn a_target_without_an_address_is_no_forward_and_a_pod_ip_alone_is_one() {
        assert!(forward_request("m", None, "u", &[], &[]).is_err());
        let mut t = target();
        t.status.as_mut().unwrap().pod_ips = None;
        let r = forward_request("m", Some(&t), "u", &[], &[]).unwrap();
        assert_eq!(r.target_addresses, ["198.18.1.7"]);
        assert!(r.services.is_empty());
        t.status.as_mut().unwrap().pod_ip = None;
        assert!(forward_request("m", Some(&t), "u", &[], &[]).is_err());
    }
}
