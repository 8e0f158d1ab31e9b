//! `Forward` once it holds the migration: the source's node sends new connections that
//! would reach the frozen source to the target (the broker's `forward_connections`,
//! issue 39). Only a fenced source: the operator asks in the pass that sees the target's
//! restore (the restore fence), and the fence is what says the target was asked to
//! restore. The forward ends with the source: the broker removes it at the unlock (an
//! abort's thaw, a commit that closes connections), the kill (a commit) and the
//! registration's end.

use super::freeze::FENCED;
use super::state::Migration;
use podmotion_wire::agent::{ForwardRequest, ForwardedPort, MigrationStatus, Role};
use podmotion_wire::broker::{ForwardedService, MAX_FORWARDED_SERVICES, Request};
use std::net::IpAddr;
use tonic::Status;

/// The broker's request for `r`, or why `r` is not one.
pub(super) fn broker_request(m: &Migration, r: &ForwardRequest) -> Result<Request, Status> {
    let bad = |what: String| Status::invalid_argument(format!("Forward: {what}"));
    let targets = r
        .target_addresses
        .iter()
        .map(|a| {
            a.parse::<IpAddr>()
                .map_err(|_| bad(format!("target address {a:?} is not an IP address")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let families: std::collections::BTreeSet<bool> = targets.iter().map(|a| a.is_ipv4()).collect();
    if targets.is_empty() || families.len() != targets.len() {
        return Err(bad(format!(
            "one target address per family, one or two: {:?}",
            r.target_addresses
        )));
    }
    let services = service_ports(&r.services, true).map_err(bad)?;
    Ok(Request::ForwardConnections {
        uid: m.uid.clone(),
        targets,
        services,
    })
}

/// The broker's form of `ports`: at most [`MAX_FORWARDED_SERVICES`], each an IP
/// address and a port 1-65535, and the endpoint's port too where `target_port` (a
/// forward's; a lock's hold does not use it).
pub(super) fn service_ports(
    ports: &[ForwardedPort],
    target_port: bool,
) -> Result<Vec<ForwardedService>, String> {
    if ports.len() > MAX_FORWARDED_SERVICES {
        return Err(format!(
            "{} service ports, at most {MAX_FORWARDED_SERVICES}",
            ports.len()
        ));
    }
    let port = |p: u32| u16::try_from(p).ok().filter(|p| *p != 0);
    ports
        .iter()
        .map(|s| {
            let address = s.address.parse::<IpAddr>().ok();
            let to = if target_port {
                port(s.target_port)
            } else {
                Some(0)
            };
            match (address, port(s.port), to) {
                (Some(address), Some(port), Some(target_port)) => Ok(ForwardedService {
                    address,
                    port,
                    target_port,
                }),
                _ => Err(format!(
                    "service port {}:{} → {} is not an IP address and two ports 1-65535",
                    s.address, s.port, s.target_port
                )),
            }
        })
        .collect()
}

/// `Forward` once it holds the migration: done again when asked again (the broker
/// replaces the forward).
pub(super) async fn forward_locked(
    m: &mut Migration,
    r: &ForwardRequest,
) -> Result<MigrationStatus, Status> {
    m.sync_freeze();
    if m.role != Role::Source {
        return Err(Status::failed_precondition(
            "Forward is the source's: its node forwards to the target",
        ));
    }
    if !m.fenced || m.freeze.get() != FENCED {
        return Err(Status::failed_precondition(
            "the source is not fenced (not frozen for a restore, or already resumed, killed or committing): nothing to forward",
        ));
    }
    let req = broker_request(m, r)?;
    m.broker(req).await?;
    tracing::info!(uid = %m.uid, targets = ?r.target_addresses, services = r.services.len(), "new connections to the frozen source go to its target");
    Ok(m.status())
}
