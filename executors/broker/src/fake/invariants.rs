//! The invariants checked after every step: effects allowed, registrations, mounts,
//! journal, adoptions and networks as the model says.

use super::kernel::*;
use super::model::*;
use super::world::*;
use crate::under_pods_root;
use nix::sys::signal::Signal;
use podmotion_wire::broker::SocketAddrs;
use podmotion_wire::ids::ProcRef;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

impl Harness {
    /// The invariants after a step: every effect allowed, the registrations the agents
    /// were told of, rolled-back trees thawed, mounts, journal and networks as the
    /// registrations say.
    pub(super) fn check(&self, pre: &BTreeMap<i32, Proc>, allowed: &Allowed) -> Result<(), String> {
        let w = self.k.world();
        for e in &w.effects {
            if !allowed.permits(e, pre, &w.nets, w.node_netns) {
                return Err(format!("effect not allowed: {e:?}"));
            }
        }
        if self.broker.registrations() != self.model.len() {
            return Err(format!(
                "broker holds {} registrations, the agents were told {}",
                self.broker.registrations(),
                self.model.len()
            ));
        }
        check_thawed(&w, pre, &allowed.rolled_back)?;
        check_killed(&w, pre, &allowed.killed)?;
        self.check_mounts_and_journal(&w)?;
        self.check_adoptions(&w)?;
        self.check_forwards(&w)?;
        self.check_networks(&w)
    }

    /// The forward tables in the node, by UID (`podmotion-fwd-<uid>`; `None` for a
    /// table of another name).
    pub(super) fn forward_tables(w: &World) -> Vec<Option<String>> {
        w.nets[&w.node_netns]
            .nft
            .keys()
            .map(|t| t.strip_prefix("podmotion-fwd-").map(str::to_owned))
            .collect()
    }

    /// After a step whose injected fault may have stopped a removal: the tables no
    /// registration holds any more are known strays (until a restart).
    pub(super) fn strand_forwards(&mut self) {
        let w = self.k.world();
        for u in Self::forward_tables(&w).into_iter().flatten() {
            if !self.model.get(&u).is_some_and(|r| r.forwarding) {
                self.stranded_forwards.insert(u);
            }
        }
    }

    /// Forwards: the node holds a migration's table only while its source is locked,
    /// not killed, and the broker said `forward_connections` done (or a known stray of
    /// an injected failure), never one of another name, and each one journalled.
    pub(super) fn check_forwards(&self, w: &World) -> Result<(), String> {
        let jdir = Path::new(RUN_DIR).join("netns").join(".forward");
        for t in Self::forward_tables(w) {
            let Some(u) = t else {
                return Err("a table in the node that is no migration's forward".into());
            };
            let held = self
                .model
                .get(&u)
                .is_some_and(|r| r.forwarding && r.locked && !r.killed);
            if !held && !self.stranded_forwards.contains(&u) {
                return Err(format!(
                    "the node forwards for {u}, which is not forwarding"
                ));
            }
            if !w.files.contains_key(&jdir.join(&u)) {
                return Err(format!("the forward of {u} is not journalled"));
            }
        }
        Ok(())
    }

    /// Adoptions: the hand-over journal holds exactly the adoptions the harness expects
    /// (address, holder, restored, deadline), and the broker's memory exactly the
    /// journal.
    pub(super) fn check_adoptions(&self, w: &World) -> Result<(), String> {
        let journal = self.handover_journal(w)?;
        let have: BTreeMap<(String, IpAddr), Adopted> = journal
            .iter()
            .flat_map(|(u, list)| {
                list.iter().map(|r| {
                    let netns = self
                        .adopted
                        .get(&(u.clone(), r.address))
                        .map_or(0, |x| x.netns);
                    (
                        (u.clone(), r.address),
                        Adopted {
                            netns,
                            holder: r.holder,
                            restored: r.restored,
                            deadline: r.deadline,
                        },
                    )
                })
            })
            .collect();
        if have != self.adopted {
            return Err(format!(
                "hand-over journal {have:?}, expected {:?}",
                self.adopted
            ));
        }
        let memory = self.broker.adoptions();
        // With the journal's directory a planted symlink, a record the broker dropped
        // (a holder gone, nothing to withdraw) may stay in the journal.
        let subset = memory.iter().all(|(u, l)| {
            journal
                .get(u)
                .is_some_and(|j| l.iter().all(|r| j.contains(r)))
        });
        if memory != journal && !(self.handover_blocked() && subset) {
            return Err(format!(
                "the broker holds the adoptions {memory:?}, its journal {journal:?}"
            ));
        }
        Ok(())
    }

    /// Mounts: exactly those of the bound target registrations. Journal: exactly the
    /// locked, not killed sources.
    pub(super) fn check_mounts_and_journal(&self, w: &World) -> Result<(), String> {
        let want: BTreeSet<PathBuf> = self
            .model
            .iter()
            .filter(|(_, r)| r.bound)
            .map(|(u, _)| Self::netns_path(u))
            .collect();
        let have: BTreeSet<PathBuf> = w.mounts.keys().cloned().collect();
        if want != have {
            return Err(format!("mounts {have:?}, expected {want:?}"));
        }
        let jdir = Path::new(RUN_DIR).join("netns").join(".journal");
        let want: BTreeSet<PathBuf> = self
            .model
            .iter()
            .filter(|(_, r)| r.locked && !r.killed)
            .map(|(u, _)| jdir.join(u))
            .collect();
        let have: BTreeSet<PathBuf> = w
            .files
            .keys()
            .filter(|p| p.parent() == Some(&jdir))
            .cloned()
            .collect();
        if want != have {
            return Err(format!("journal {have:?}, expected {want:?}"));
        }
        Ok(())
    }

    /// Networks: the node's is never touched; a pod's is as it was once no
    /// registration holds it (unless its source was killed: commit), but for the
    /// addresses adopted in it; and in no namespace is there an address the pod did
    /// not have that is not an adoption the broker holds (or one whose holder died).
    pub(super) fn check_networks(&self, w: &World) -> Result<(), String> {
        let node = w.node_netns;
        for (n, net) in &w.nets {
            if *n != node && self.ever_locked.contains(n) && self.ever_adopted.contains(n) {
                continue;
            }
            let adopted: BTreeSet<IpAddr> = self
                .adopted
                .iter()
                .filter(|(_, x)| x.netns == *n)
                .map(|((_, a), _)| *a)
                .chain(
                    self.abandoned
                        .iter()
                        .filter(|(x, _)| x == n)
                        .map(|(_, a)| *a),
                )
                .collect();
            let base = &self.baseline[n];
            let mut stripped = net.canonical();
            // The node's forward tables: see `check_forwards`.
            stripped.nft = base.nft.clone();
            for set in [&mut stripped.addrs4, &mut stripped.addrs6] {
                for (cidr, link) in set.clone() {
                    let extra = !base.addrs4.contains(&(cidr.clone(), link.clone()))
                        && !base.addrs6.contains(&(cidr.clone(), link.clone()));
                    if !extra {
                        continue;
                    }
                    let a = cidr
                        .split('/')
                        .next()
                        .and_then(|a| a.parse::<IpAddr>().ok());
                    if !a.is_some_and(|a| adopted.contains(&a)) {
                        return Err(format!(
                            "netns {n} holds {cidr} on {link}, an address nobody adopted"
                        ));
                    }
                    set.remove(&(cidr, link));
                }
            }
            // A link silenced for an adoption stays so exactly when the adoption's
            // address may stay (its holder died before the broker could undo either).
            if !adopted.is_empty() {
                stripped.arp_ignore = base.arp_ignore.clone();
            }
            let held = self.model.values().any(|r| r.netns == *n);
            let exempt = *n != node && (held || self.killed_netns.contains(n));
            if !exempt && stripped != *base {
                return Err(format!(
                    "netns {n} left changed: {:?}, was {:?}",
                    net.canonical(),
                    self.baseline[n]
                ));
            }
        }
        Ok(())
    }
}

/// What one step may do to the world, checked against the effects it recorded.
#[derive(Default)]
pub(super) struct Allowed {
    /// Roots (with their netns) whose trees may be signalled or have sockets touched.
    pub(super) roots: Vec<(ProcRef, u32)>,
    /// The signals allowed on those trees.
    pub(super) sigs: &'static [Signal],
    /// The netns whose links may go down.
    pub(super) may_lock: Option<u32>,
    /// The addresses of the source's network namespace (before the step) that a lock
    /// may have the node forget unanswered connections to.
    pub(super) may_sweep: Option<Vec<String>>,
    /// The one netns bind mount allowed: path and netns.
    pub(super) may_mount: Option<(PathBuf, u32)>,
    /// The restored root that may move, its netns, the cgroup it may move to, and the
    /// registered holder (which must not move).
    pub(super) may_move: Option<(ProcRef, u32, String, i32)>,
    /// The process whose memory may be charged to a holder's cgroup, that cgroup, and
    /// the broker's pid and netns (the process must be of the broker's pod, not it).
    pub(super) may_charge: Option<(ProcRef, String, i32, u32)>,
    /// Sources rolled back in this step: nothing of their trees may stay frozen.
    pub(super) rolled_back: Vec<ProcRef>,
    /// Fenced roots (with their netns) whose trees may only be SIGKILLed.
    pub(super) kill_roots: Vec<(ProcRef, u32)>,
    /// Fenced sources whose lease ended in this step: nothing of their trees may live.
    pub(super) killed: Vec<ProcRef>,
    /// The one address that may be adopted, and the netns it may go into.
    pub(super) adopt_into: Option<(u32, IpAddr)>,
    /// The adopted addresses that may be withdrawn (netns, address).
    pub(super) may_withdraw: BTreeSet<(u32, IpAddr)>,
    /// Adopted addresses that may be announced though gone at the step's end (netns,
    /// address): see [`Harness::step`].
    pub(super) announced_adoptions: BTreeSet<(u32, IpAddr)>,
}

impl Allowed {
    pub(super) fn permits(
        &self,
        e: &Effect,
        pre: &BTreeMap<i32, Proc>,
        nets: &BTreeMap<u32, Net>,
        node: u32,
    ) -> bool {
        let in_a_tree = |pid: i32| {
            self.roots
                .iter()
                .any(|(r, _)| valid_root(pre, node, r) && tree_in(pre, r.pid).contains(&pid))
        };
        let in_a_fenced_tree = |pid: i32| {
            self.kill_roots
                .iter()
                .any(|(r, _)| valid_root(pre, node, r) && tree_in(pre, r.pid).contains(&pid))
        };
        match e {
            Effect::Signal {
                pid,
                sig: Signal::SIGKILL,
            } if in_a_fenced_tree(*pid) => true,
            Effect::Signal { pid, sig } => self.sigs.contains(sig) && in_a_tree(*pid),
            Effect::ReadAddrs { pid, .. } | Effect::RepairOff { pid, .. } => in_a_tree(*pid),
            Effect::LinkDown { netns, .. } => self.may_lock == Some(*netns) && *netns != node,
            // Only a pod's own address, on its own link, never from the node.
            Effect::Announced { netns, link, addr } => {
                *netns != node && self.may_announce(nets, *netns, link, addr)
            }
            // Only the addresses of the source a lock names, from the node.
            Effect::Swept { addrs } => self.may_sweep.as_ref().is_some_and(|had| {
                addrs
                    .iter()
                    .all(|a| had.iter().any(|x| same_addr(x, &a.to_string())))
            }),
            // A hold at a lock: the same source addresses a sweep may name; ending
            // one only gives back what it held.
            Effect::HoldStarted { held, .. } => self.may_sweep.as_ref().is_some_and(|had| {
                held.addresses
                    .iter()
                    .all(|a| had.iter().any(|x| same_addr(x, &a.to_string())))
            }),
            Effect::HoldEnded { .. } => true,
            Effect::Mounted { path, netns } => {
                self.may_mount.as_ref() == Some(&(path.clone(), *netns)) && *netns != node
            }
            // Only into the namespace of this agent's target holder, only the address
            // asked for, only one the hand-over allows.
            Effect::AddrAdded { netns, addr, .. } => {
                *netns != node && self.adopt_into == Some((*netns, *addr)) && may_adopt(*addr)
            }
            // Only an address the broker adopted, from where it adopted it.
            Effect::AddrRemoved { netns, addr, .. } => {
                *netns != node && self.may_withdraw.contains(&(*netns, *addr))
            }
            Effect::Charged { pid, to } => self.may_charge_to(pre, *pid, to),
            Effect::Moved { pid, to } => self.may_move_to(pre, node, *pid, to),
        }
    }

    /// Whether `addr` may be announced on `link` of `netns`: an address the pod has on
    /// that link, or an adoption gone by the step's end (see
    /// [`Allowed::announced_adoptions`]).
    fn may_announce(&self, nets: &BTreeMap<u32, Net>, netns: u32, link: &str, addr: &str) -> bool {
        let gone_adoption = addr
            .parse()
            .is_ok_and(|a| self.announced_adoptions.contains(&(netns, a)));
        gone_adoption
            || nets.get(&netns).is_some_and(|n| {
                n.addrs4
                    .iter()
                    .chain(&n.addrs6)
                    .any(|(a, l)| l == link && same_addr(a, addr))
            })
    }

    /// Whether `pid`'s memory may be charged to cgroup `to`: the one process allowed,
    /// alive as pinned in the broker's network namespace but not the broker, to the
    /// holder's cgroup under the pods' root.
    fn may_charge_to(&self, pre: &BTreeMap<i32, Proc>, pid: i32, to: &str) -> bool {
        self.may_charge
            .as_ref()
            .is_some_and(|(p, cg, broker, broker_netns)| {
                pre.get(&pid).is_some_and(|x| {
                    !x.zombie && x.start_time == p.start_time && x.netns == *broker_netns
                }) && p.pid == pid
                    && pid != *broker
                    && to == cg
                    && under_pods_root(to, PODS_ROOT)
            })
    }

    /// Whether `pid` may move to cgroup `to`: in the tree of the restored root allowed
    /// (alive as pinned, in its pod's namespace, not the node's), not the holder, to
    /// the holder's cgroup under the pods' root.
    fn may_move_to(&self, pre: &BTreeMap<i32, Proc>, node: u32, pid: i32, to: &str) -> bool {
        self.may_move
            .as_ref()
            .is_some_and(|(root, ns, cg, holder)| {
                let root_ok = pre.get(&root.pid).is_some_and(|x| {
                    !x.zombie
                        && x.start_time == root.start_time
                        && x.netns == *ns
                        && x.netns != node
                });
                root_ok
                    && root.pid != *holder
                    && tree_in(pre, root.pid).contains(&pid)
                    && to == cg
                    && under_pods_root(to, PODS_ROOT)
            })
    }
}

/// Whether process `p` is alive with its pinned start time.
pub(super) fn live_as(procs: &BTreeMap<i32, Proc>, p: ProcRef) -> bool {
    procs
        .get(&p.pid)
        .is_some_and(|x| !x.zombie && x.start_time == p.start_time)
}

/// Whether `net` has address `a` (any link, any prefix length).
pub(super) fn net_has(net: &Net, a: IpAddr) -> bool {
    net.addrs4
        .iter()
        .chain(&net.addrs6)
        .any(|(c, _)| same_addr(c, &a.to_string()))
}

/// Whether the broker cannot tell which link of `net` takes `a`: not there already, no
/// default route of its family, and not exactly one link but `lo`.
pub(super) fn no_link_for(net: &Net, a: IpAddr) -> bool {
    let routes = if a.is_ipv4() {
        &net.routes4
    } else {
        &net.routes6
    };
    !net_has(net, a)
        && !routes.iter().any(|r| r.starts_with("default "))
        && net.links.keys().filter(|l| *l != "lo").count() != 1
}

/// A root the broker may act on: live with its pinned start time, in a pod cgroup, not
/// in the node's network namespace.
pub(super) fn valid_root(pre: &BTreeMap<i32, Proc>, node: u32, p: &ProcRef) -> bool {
    pre.get(&p.pid).is_some_and(|x| {
        !x.zombie
            && x.start_time == p.start_time
            && under_pods_root(&x.cgroup, PODS_ROOT)
            && x.netns != node
    })
}

/// The addresses of the TCP sockets of the live processes of the tree rooted at `root`,
/// each socket once (by inode), in tree order: what `list_sockets` must answer.
pub(super) fn sockets_in(procs: &BTreeMap<i32, Proc>, root: i32) -> Vec<SocketAddrs> {
    let mut seen = BTreeSet::new();
    tree_in(procs, root)
        .iter()
        .filter_map(|pid| procs.get(pid).filter(|p| !p.zombie))
        .flat_map(|p| &p.sockets)
        .filter(|s| seen.insert(s.ino))
        .map(|s| s.addrs.clone())
        .collect()
}

/// After a fenced source's lease ended, nothing of its tree runs or stays stopped: it
/// was killed, never thawed.
pub(super) fn check_killed(
    w: &World,
    pre: &BTreeMap<i32, Proc>,
    killed: &[ProcRef],
) -> Result<(), String> {
    for p in killed.iter().filter(|p| valid_root(pre, w.node_netns, p)) {
        for pid in tree_in(pre, p.pid) {
            if let Some(x) = w.procs.get(&pid).filter(|x| !x.zombie) {
                return Err(format!(
                    "pid {pid} of a fenced source still alive after its lease ended: {x:?}"
                ));
            }
        }
    }
    Ok(())
}

/// After a rollback, nothing of the rolled-back trees stays stopped or in repair.
pub(super) fn check_thawed(
    w: &World,
    pre: &BTreeMap<i32, Proc>,
    rolled_back: &[ProcRef],
) -> Result<(), String> {
    for p in rolled_back
        .iter()
        .filter(|p| valid_root(pre, w.node_netns, p))
    {
        for pid in w.tree(p.pid) {
            if let Some(x) = w.procs.get(&pid).filter(|x| !x.zombie)
                && (x.stopped || x.sockets.iter().any(|s| s.repair))
            {
                return Err(format!("pid {pid} still frozen after the rollback: {x:?}"));
            }
        }
    }
    Ok(())
}
