//! `Prepare`: a new migration checked, its process resolved through the container
//! runtime, its checkpoint dir made and its broker registration taken; every failure
//! undoes what was done so far ([`undo_prepare`]).

use super::helpers::{blocking, broker_call, held_source};
use super::parts;
use super::state::{Config, Migration, Placement};
use crate::containers::Resolved;
use crate::creds;
use crate::images;
use crate::pod::PodPlan;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::{PrepareRequest, Role};
use podmotion_wire::broker::Request;
use podmotion_wire::identity;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use podmotion_wire::transfer;
use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex as StdMutex};
use tonic::Status;

/// A `Prepare` under way, marked in [`Agent::preparing`] until dropped (on every way
/// out of the call, an abandoned one included).
pub(super) struct Preparing<'a> {
    set: &'a StdMutex<HashSet<String>>,
    uid: String,
}

impl<'a> Preparing<'a> {
    /// `None` if a `Prepare` of `uid` is already under way.
    pub(super) fn claim(set: &'a StdMutex<HashSet<String>>, uid: &MigrationUid) -> Option<Self> {
        let uid = uid.to_string();
        // The guard is made only once the set's lock is released: a guard dropped
        // under it (`then_some` builds its value eagerly) would deadlock on it.
        let claimed = set.lock().expect("preparing").insert(uid.clone());
        if claimed {
            Some(Preparing { set, uid })
        } else {
            None
        }
    }
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("preparing").remove(&self.uid);
    }
}

/// A new migration (none of `uid` here yet), prepared: checked, placed, registered with
/// the node's broker, and the pod's other containers with it. Nothing of it is left
/// behind when it fails.
pub(super) async fn prepare(
    cfg: &Config,
    own_node: Option<&str>,
    uid: MigrationUid,
    r: PrepareRequest,
) -> Result<Migration, Status> {
    let role = check_prepare(&r, own_node)?;
    let plan = check_pod(&r, role)?;
    let placed = place(cfg, &plan, &uid, role, r.post_copy).await?;
    let dir = placed.dir.clone();
    // From here every failure undoes what this Prepare did so far, in one place:
    // the checkpoint dir, and the broker registration (a target's netns bind
    // with it) on the lease that made it.
    let mut lease = None;
    let mut m = match connect_and_register(cfg, &uid, role, r, placed, &mut lease).await {
        Ok(m) => m,
        Err(e) => {
            undo_prepare(&uid, &dir, lease).await;
            return Err(e);
        }
    };
    if plan.is_multi()
        && let Err(e) = prepare_parts(cfg, &plan, &mut m).await
    {
        undo_prepare(&uid, &dir, lease).await;
        return Err(e);
    }
    match m.held_by {
        Some(h) => {
            tracing::info!(%uid, ?role, pid = m.process.pid, holder = h.pid, peer = %m.peer, "prepared: the container's PID 1 is PodMotion's holder, its restored workload is the tree to migrate")
        }
        None => tracing::info!(%uid, ?role, pid = m.process.pid, peer = %m.peer, "prepared"),
    }
    Ok(m)
}

/// The checks of a new `Prepare` (a migration already prepared answers its status
/// before them); its role.
pub(super) fn check_prepare(r: &PrepareRequest, own_node: Option<&str>) -> Result<Role, Status> {
    let role = Role::try_from(r.role).unwrap_or(Role::Unspecified);
    if role == Role::Unspecified {
        return Err(Status::invalid_argument("role must be Source or Target"));
    }
    if r.transfer_key.len() != transfer::KEY_LEN {
        return Err(Status::invalid_argument("transfer key must be 32 bytes"));
    }
    if !identity::valid_node_name(&r.peer_node) {
        return Err(Status::invalid_argument(format!(
            "peer_node {:?} is not a node name: name the other agent's node",
            r.peer_node
        )));
    }
    if own_node == Some(r.peer_node.as_str()) {
        return Err(Status::invalid_argument(format!(
            "peer_node {:?} is this agent's own node",
            r.peer_node
        )));
    }
    super::forward::service_ports(&r.hold_services, false)
        .map_err(|m| Status::invalid_argument(format!("hold_services: {m}")))?;
    Ok(role)
}

/// The pod's containers, by name (the single-container wire is the one-element case):
/// the first as a one-container pod's, the others as its parts (see `parts`). A
/// PostCopy is refused here, before anything is resolved or frozen, where it cannot
/// run.
fn check_pod(r: &PrepareRequest, role: Role) -> Result<PodPlan, Status> {
    if r.post_copy {
        // Refused here, before anything is frozen: the source serves the pages,
        // the target restores them through a userfaultfd.
        match role {
            Role::Source => crate::lazy::pipe_room(),
            _ => crate::lazy::uffd_room(),
        }
        .map_err(Status::failed_precondition)?;
    }
    let plan = PodPlan::from_request(r)?;
    if plan.is_multi() && r.post_copy {
        // Refused before anything is resolved or frozen.
        return Err(Status::failed_precondition(format!(
            "PostCopy moves one container's memory lazily, and the pod has the \
             containers {}: use PreCopy or Cold",
            plan.names()
        )));
    }
    Ok(plan)
}

/// Where the migration's process and images are: the first container resolved, the
/// tree to migrate pinned, and its checkpoint dir created.
async fn place(
    cfg: &Config,
    plan: &PodPlan,
    uid: &MigrationUid,
    role: Role,
    post_copy: bool,
) -> Result<Placement, Status> {
    // No PID on the wire: the containers the operator names are resolved here,
    // through the node's container runtime (a malformed ID is InvalidArgument).
    let Resolved { container, pid, fs } = cfg
        .containers
        .resolve(std::slice::from_ref(&plan.first().id))
        .await?;
    // A pod PodMotion moved before: the source container's PID 1 is the holder,
    // and the tree to dump is the workload it holds.
    let (pid, held_by) = match role {
        Role::Source => held_source(pid)?,
        _ => (pid, None),
    };
    let start_time = procfs::start_time(pid).map_err(|e| Status::not_found(e.to_string()))?;
    let process = ProcRef { pid, start_time };
    if role == Role::Source {
        check_source_owner(pid, post_copy)?;
    }
    let dir = images::create(&cfg.checkpoints_root, uid.as_str())
        .map_err(|e| Status::internal(e.to_string()))?;
    Ok(Placement {
        process,
        container,
        held_by,
        fs,
        dir,
    })
}

/// Refused here, before anything is frozen: a tree CRIU cannot dump as one user on
/// this node (see crate::creds), or a PostCopy of a tree not root's.
fn check_source_owner(pid: i32, post_copy: bool) -> Result<(), Status> {
    let owner = creds::tree_owner(pid).map_err(Status::failed_precondition)?;
    if post_copy && !owner.is_root() {
        return Err(Status::failed_precondition(format!(
            "PostCopy of a container running as {owner} is not supported: its lazy \
             dump runs CRIU as root, which cannot read that user's resource limits \
             without CAP_SYS_RESOURCE; use PreCopy or Cold"
        )));
    }
    Ok(())
}

/// The broker steps of a `Prepare`: a connection (this migration's lease, also
/// left in `lease` for [`undo_prepare`]) and the registration on it.
async fn connect_and_register(
    cfg: &Config,
    uid: &MigrationUid,
    role: Role,
    r: PrepareRequest,
    placed: Placement,
    lease: &mut Option<Arc<StdMutex<BrokerClient>>>,
) -> Result<Migration, Status> {
    let sock = cfg.broker_socket.clone();
    let deadline = cfg.broker_call_timeout;
    let client = blocking(move || {
        BrokerClient::connect_with_deadline(&sock, deadline)
            .map_err(|e| Status::unavailable(format!("broker: {e}")))
    })
    .await?;
    let freeze_limit = cfg.freeze_watchdog.limit(r.freeze_budget_ms);
    let mut m = Migration::prepared(uid.clone(), role, r, placed, client, freeze_limit);
    *lease = Some(Arc::clone(&m.broker));
    m.register().await?;
    Ok(m)
}

/// The pod's other containers, prepared beside the first (each on a lease of its
/// own); on failure those prepared so far are forgotten.
async fn prepare_parts(cfg: &Config, plan: &PodPlan, m: &mut Migration) -> Result<(), Status> {
    let mut prepared = Vec::new();
    let res = parts::prepare(
        &cfg.containers,
        cfg.broker_socket.clone(),
        cfg.broker_call_timeout,
        plan,
        &m.uid,
        m.role,
        &mut prepared,
    )
    .await;
    if let Err(e) = res {
        parts::forget_all(&prepared).await;
        return Err(e);
    }
    if m.role == Role::Source {
        *m.freeze.others.lock().expect("others") =
            prepared.iter().map(|p| p.lease.clone()).collect();
    }
    m.parts = prepared;
    tracing::info!(uid = %m.uid, role = ?m.role, containers = %plan.names(), "prepared the pod's other containers");
    Ok(())
}

/// Undoes a failed `Prepare`: the broker forgets the migration on its lease (unbinding
/// a target's netns; nothing registered is a no-op, and a registration another
/// connection holds is not this one's), the lease ends when `lease` is dropped, and the
/// checkpoint dir is zeroized.
async fn undo_prepare(uid: &MigrationUid, dir: &Path, lease: Option<Arc<StdMutex<BrokerClient>>>) {
    if let Some(b) = lease
        && let Err(e) = broker_call(&b, Request::Forget { uid: uid.clone() }).await
    {
        tracing::warn!(%uid, error = %e, "failed prepare: the broker did not forget it (the lease's end does)");
    }
    if let Err(e) = images::zeroize(dir) {
        tracing::warn!(%uid, error = %e, "failed prepare: its checkpoint dir could not be removed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_prepare_needs_a_role_a_key_and_another_node_as_peer() {
        let ok = PrepareRequest {
            migration_uid: "u".into(),
            role: Role::Target as i32,
            transfer_key: vec![1; transfer::KEY_LEN],
            peer_node: "node-b".into(),
            ..Default::default()
        };
        assert_eq!(check_prepare(&ok, Some("node-a")).unwrap(), Role::Target);
        assert_eq!(check_prepare(&ok, None).unwrap(), Role::Target);
        let refused = |r: PrepareRequest, own: Option<&str>| {
            let e = check_prepare(&r, own).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            e.message().to_string()
        };
        let no_role = PrepareRequest {
            role: Role::Unspecified as i32,
            ..ok.clone()
        };
        assert_eq!(refused(no_role, None), "role must be Source or Target");
        let short_key = PrepareRequest {
            transfer_key: vec![1; 16],
            ..ok.clone()
        };
        assert_eq!(refused(short_key, None), "transfer key must be 32 bytes");
        let bad_peer = PrepareRequest {
            peer_node: "Node_B".into(),
            ..ok.clone()
        };
        assert!(refused(bad_peer, None).contains("is not a node name"));
        // The Services the lock holds: addresses and ports, the endpoint's port unused.
        let port = |address: &str, port: u32| podmotion_wire::agent::ForwardedPort {
            address: address.into(),
            port,
            target_port: 0,
        };
        let held = PrepareRequest {
            hold_services: vec![port("198.19.0.10", 80), port("fd00::10", 443)],
            ..ok.clone()
        };
        assert_eq!(check_prepare(&held, None).unwrap(), Role::Target);
        for bad in [port("198.19.0.10; flush", 80), port("198.19.0.10", 0)] {
            let r = PrepareRequest {
                hold_services: vec![bad],
                ..ok.clone()
            };
            assert!(refused(r, None).starts_with("hold_services: "));
        }
        let many = PrepareRequest {
            hold_services: vec![port("198.19.0.10", 80); 65],
            ..ok.clone()
        };
        assert!(refused(many, None).contains("at most 64"));
        assert!(refused(ok, Some("node-b")).contains("this agent's own node"));
    }
}
