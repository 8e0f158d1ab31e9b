//! The harness's ops and its model of what the agents were told (registrations,
//! adoptions), with the broker's configuration and the shape of each reply.

use super::kernel::*;
use super::world::*;
use crate::handover::parse_cidrs;
use crate::{Broker, Config};
use podmotion_wire::broker::{BrokerRole, Reply, Request};
use podmotion_wire::ids::{ContainerId, ProcRef};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// One step: a request from agent connection 1 or 2, or something that happens on the
/// node.
#[derive(Clone, Debug)]
pub enum Op {
    Req {
        conn: u64,
        req: Request,
    },
    /// The connection closes (the agent died): its lease ends.
    LeaseLost {
        conn: u64,
    },
    /// CRIU dumps the tree with `leave_stopped`: stopped, traced, sockets in repair.
    Dump {
        pid: i32,
    },
    /// CRIU detaches from the tree.
    Detach {
        pid: i32,
    },
    /// The process exits and is reaped.
    Exit {
        pid: i32,
    },
    /// A new process gets `pid` (a new start time), in `like`'s cgroup and netns.
    Reuse {
        pid: i32,
        like: i32,
    },
    /// A new child of `parent` with one TCP socket.
    Spawn {
        parent: i32,
    },
    Fault(Fault),
    /// A symlink is planted at the netns path of UIDS[uid], or at the journal dir, or
    /// at the hand-over journal's.
    Symlink {
        uid: usize,
        journal: bool,
        handover: bool,
    },
    /// The broker process dies and starts again over the same node (`recover`).
    Restart,
    DetachOnSleep(bool),
    /// `secs` seconds pass on the node's clocks, then the broker's sweep of adopted
    /// addresses runs.
    Sweep {
        secs: u64,
    },
    /// A live `pid` opens a TCP connection from `address` (a moved connection, when
    /// the address is adopted in its namespace).
    Connect {
        pid: i32,
        address: IpAddr,
    },
}

#[derive(Clone, Debug)]
pub(super) struct Reg {
    pub(super) conn: u64,
    pub(super) role: BrokerRole,
    pub(super) process: ProcRef,
    pub(super) container: ContainerId,
    pub(super) netns: u32,
    pub(super) cgroup: String,
    pub(super) bound: bool,
    pub(super) locked: bool,
    /// A lock_network failed: the broker may still hold the lock (its undo failed).
    pub(super) maybe_locked: bool,
    pub(super) killed: bool,
    /// `fence` succeeded (and no `unfence` since): never resumed, killed on a lost
    /// lease or (while locked: the journal holds it) a restart.
    pub(super) fenced: bool,
    /// `forward_connections` succeeded (and no `stop_forwarding`, unlock or kill
    /// since): the only state in which the node may hold the migration's forward.
    pub(super) forwarding: bool,
}

impl Reg {
    /// A registration the broker accepted: `pin` is (role, process, container).
    pub(super) fn new(
        conn: u64,
        pin: (BrokerRole, ProcRef, &ContainerId),
        netns: u32,
        cgroup: &str,
    ) -> Reg {
        let (role, process, container) = pin;
        Reg {
            conn,
            role,
            process,
            container: container.clone(),
            netns,
            cgroup: cgroup.to_owned(),
            bound: false,
            locked: false,
            maybe_locked: false,
            killed: false,
            fenced: false,
            forwarding: false,
        }
    }

    /// What a request that succeeded on this registration tells the agents' model
    /// (`killed_netns`: the namespaces left locked by a kill); an answer it cannot
    /// have given is the violation.
    pub(super) fn apply(
        &mut self,
        req: &Request,
        killed_netns: &mut BTreeSet<u32>,
    ) -> Result<(), String> {
        let r = self;
        match req {
            Request::BindNetns { .. } => r.bound = true,
            Request::UnbindNetns { .. } => r.bound = false,
            Request::LockNetwork { .. } => r.locked = true,
            Request::UnlockNetwork { .. } => {
                r.locked = false;
                r.forwarding = false;
            }
            Request::Kill { .. } => {
                r.killed = true;
                r.forwarding = false;
                killed_netns.insert(r.netns);
            }
            Request::ForwardConnections { .. } => {
                if (!r.locked && !r.maybe_locked) || r.killed || !r.fenced {
                    return Err(format!("{req:?} done on a source not locked and fenced"));
                }
                r.forwarding = true;
            }
            Request::StopForwarding { .. } => r.forwarding = false,
            Request::Fence { .. } => {
                if !r.locked && !r.maybe_locked {
                    return Err(format!("{req:?} done on a source never locked"));
                }
                // Done proves the broker holds the lock (and journals it).
                r.locked = true;
                r.fenced = true;
            }
            Request::Unfence { .. } => r.fenced = false,
            _ => {}
        }
        Ok(())
    }
}

/// One broker over a [`FakeKernel`] on [`World::standard`], a model of what the
/// agents were told, and the invariants checked after every step.
pub struct Harness {
    pub(super) k: FakeKernel,
    pub(super) broker: Arc<Broker<FakeKernel>>,
    pub(super) model: BTreeMap<String, Reg>,
    pub(super) baseline: BTreeMap<u32, Net>,
    /// Pod netns left locked on purpose (a killed source: commit) or by the known gap
    /// (the pinned process died while locked).
    pub(super) killed_netns: BTreeSet<u32>,
    pub(super) cfg: Config,
    /// The adoptions the broker must hold, by (uid, address).
    pub(super) adopted: BTreeMap<(String, IpAddr), Adopted>,
    /// Adopted addresses left in a namespace whose holder died (a real namespace goes
    /// with its last process and the runtime's mount; the fake's stays): (netns, address).
    pub(super) abandoned: BTreeSet<(u32, IpAddr)>,
    /// Namespaces where a source was locked, and where an address was adopted: a
    /// namespace that is both (a target and a source pinned in one pod's namespace,
    /// never a migration) is exempt from the network checks, a known gap: a lock
    /// takes the IPv6 adoptions down with its links, and the unlock puts them back.
    pub(super) ever_locked: BTreeSet<u32>,
    pub(super) ever_adopted: BTreeSet<u32>,
    /// Forward tables (by UID) whose removal an injected `nft` failure stopped after
    /// their registration ended: they stay, journalled, until a restart removes them.
    pub(super) stranded_forwards: BTreeSet<String>,
}

/// One adoption as the harness expects the broker to hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Adopted {
    pub(super) netns: u32,
    pub(super) holder: ProcRef,
    pub(super) restored: bool,
    pub(super) deadline: u64,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

/// The harness's broker configuration: the simulated node's run directory and pods
/// root, the address hand-over on for [`HANDOVER_CIDRS`], lingering [`LINGER_SECS`].
pub fn config() -> Config {
    Config {
        run_dir: PathBuf::from(RUN_DIR),
        pods_cgroup_root: PODS_ROOT.into(),
        allowed_uid: 0,
        same_netns_peers: true,
        container_cgroups: true,
        handover_cidrs: parse_cidrs(HANDOVER_CIDRS).expect("valid CIDRs"),
        address_linger: Duration::from_secs(LINGER_SECS),
        sweep_interval: Duration::from_secs(2),
        hold_neighbours: true,
        forward_new_connections: true,
    }
}

pub(super) fn reply_fits(req: &Request, r: &Reply) -> bool {
    matches!(
        (req, r),
        (Request::Register { .. }, Reply::Registered { .. })
            | (Request::BindNetns { .. }, Reply::NetnsPath { .. })
            | (Request::NetnsAddrs { .. }, Reply::Addrs { .. })
            | (Request::ListSockets { .. }, Reply::Sockets { .. })
            | (Request::MoveCgroup { .. }, Reply::Moved { .. })
            | (Request::ChargeRestore { .. }, Reply::Moved { .. })
            | (
                Request::UnbindNetns { .. }
                    | Request::LockNetwork { .. }
                    | Request::UnlockNetwork { .. }
                    | Request::ReleaseTcpRepair { .. }
                    | Request::Resume { .. }
                    | Request::Kill { .. }
                    | Request::Fence { .. }
                    | Request::Unfence { .. }
                    | Request::AdoptAddress { .. }
                    | Request::ReleaseAddress { .. }
                    | Request::ForwardConnections { .. }
                    | Request::StopForwarding { .. }
                    | Request::Forget { .. },
                Reply::Done
            )
    )
}
