//! Running an op: the request or the node event, what it may do, the model updated.

use super::invariants::*;
use super::kernel::*;
use super::model::*;
use super::world::*;
use crate::{Broker, Config, under_pods_root};
use nix::sys::signal::Signal;
use podmotion_wire::broker::{BrokerError, BrokerRole, ErrorKind, Reply, Request};
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};

impl Harness {
    pub fn new() -> Self {
        Self::with_config(config())
    }

    /// A harness whose broker runs with `cfg` (the hand-over off, say).
    pub fn with_config(cfg: Config) -> Self {
        let w = World::standard();
        let baseline = w.nets.iter().map(|(n, x)| (*n, x.canonical())).collect();
        let k = FakeKernel::new(w);
        let broker = Broker::with_kernel(cfg.clone(), k.clone());
        Self {
            k,
            broker,
            model: BTreeMap::new(),
            baseline,
            killed_netns: BTreeSet::new(),
            cfg,
            adopted: BTreeMap::new(),
            abandoned: BTreeSet::new(),
            ever_locked: BTreeSet::new(),
            ever_adopted: BTreeSet::new(),
            stranded_forwards: BTreeSet::new(),
        }
    }

    pub fn kernel(&self) -> &FakeKernel {
        &self.k
    }

    pub fn broker(&self) -> &Broker<FakeKernel> {
        &self.broker
    }

    /// The pids ops can name: every pid in the table (zombies too) and one that never
    /// existed.
    pub(super) fn pick(&self, b: u8) -> i32 {
        let w = self.k.world();
        let mut pids: Vec<i32> = w.procs.keys().copied().collect();
        pids.push(4242);
        pids[(b & 0x3f) as usize % pids.len()]
    }

    /// A pinned reference to `pid`: its real start time, or a wrong one.
    pub(super) fn pin(&self, pid: i32, wrong: bool) -> ProcRef {
        let st = self.k.world().procs.get(&pid).map_or(5, |p| p.start_time);
        ProcRef {
            pid,
            start_time: st + u64::from(wrong),
        }
    }

    /// Three bytes → one op over the current world (the fuzzer's encoding; the seed
    /// corpus is written in it): `[kind, a, b]`. A `register` names the pinned
    /// process's own container unless `b & 0x80`, then another one.
    pub fn op_from_bytes(&self, kind: u8, a: u8, b: u8) -> Op {
        let uid = MigrationUid::parse(UIDS[(a % 3) as usize]).expect("valid uid");
        let conn = 1 + u64::from(a >> 7);
        let req = |req| Op::Req { conn, req };
        match kind % 29 {
            0 => req(self.register_from_bytes(uid, a, b)),
            1 => req(Request::BindNetns { uid }),
            2 => req(Request::UnbindNetns { uid }),
            3 => req(Request::NetnsAddrs { uid }),
            4 => req(Request::LockNetwork { uid, hold: None }),
            5 => req(Request::UnlockNetwork { uid }),
            6 => req(Request::ListSockets { uid }),
            7 => req(Request::ReleaseTcpRepair { uid }),
            8 => req(Request::MoveCgroup {
                uid,
                process: self.pin(self.pick(b), b & 0x40 != 0),
            }),
            9 => req(Request::Resume { uid }),
            10 => req(Request::Kill { uid }),
            11 => req(Request::Forget { uid }),
            22 => req(Request::Fence { uid }),
            23 => req(Request::Unfence { uid }),
            24 => req(Request::AdoptAddress {
                uid,
                address: address(b),
            }),
            25 => req(Request::ReleaseAddress {
                uid,
                address: address(b),
            }),
            28 => req(Request::ChargeRestore {
                uid,
                process: self.pin(self.pick(b), b & 0x40 != 0),
            }),
            event => self.event_from_bytes(event, a, b),
        }
    }

    /// The `register` of [`Harness::op_from_bytes`]: of a pinned process (its start
    /// time wrong when `b & 0x40`), naming its own container unless `b & 0x80`, as a
    /// target when `a & 4`.
    fn register_from_bytes(&self, uid: MigrationUid, a: u8, b: u8) -> Request {
        let pid = self.pick(b);
        let container = if b & 0x80 != 0 {
            self.k.world().other_container(pid)
        } else {
            self.k.world().container_of(pid)
        };
        Request::Register {
            uid,
            role: if a & 4 != 0 {
                BrokerRole::Target
            } else {
                BrokerRole::Source
            },
            process: self.pin(pid, b & 0x40 != 0),
            container,
        }
    }

    /// The node events of [`Harness::op_from_bytes`] (`kind`, already taken modulo 29,
    /// is none of the requests').
    fn event_from_bytes(&self, kind: u8, a: u8, b: u8) -> Op {
        match kind {
            12 => Op::LeaseLost {
                conn: 1 + u64::from(a & 1),
            },
            13 => Op::Dump { pid: self.pick(b) },
            14 => Op::Detach { pid: self.pick(b) },
            15 => Op::Exit { pid: self.pick(b) },
            16 => Op::Reuse {
                pid: self.pick(b),
                like: self.pick(a),
            },
            17 => Op::Spawn {
                parent: self.pick(b),
            },
            18 => Op::Fault(match a % 5 {
                0 => Fault::Ip(b % 6),
                1 => Fault::Mount,
                2 => Fault::Journal,
                3 => Fault::Announce,
                _ => Fault::Cgroup,
            }),
            19 => Op::Symlink {
                uid: (a % 3) as usize,
                journal: b & 1 != 0,
                handover: b & 3 == 2,
            },
            20 => Op::Restart,
            21 => Op::DetachOnSleep(a & 1 != 0),
            26 => Op::Sweep {
                secs: [0, 1, 60, LINGER_SECS + 1][usize::from(b % 4)],
            },
            _ => Op::Connect {
                pid: self.pick(b),
                address: address(a),
            },
        }
    }

    /// Runs every 3-byte op of `data` (at most `max_ops`), checking the invariants
    /// after each; the first violation is returned.
    pub fn run_bytes(&mut self, data: &[u8], max_ops: usize) -> Result<(), String> {
        for c in data.chunks_exact(3).take(max_ops) {
            let op = self.op_from_bytes(c[0], c[1], c[2]);
            self.step(op)?;
        }
        Ok(())
    }

    pub(super) fn netns_path(uid: &str) -> PathBuf {
        Path::new(RUN_DIR).join("netns").join(uid)
    }

    /// Runs one op; the request's outcome (None for node events), or the invariant it
    /// broke.
    pub fn step(&mut self, op: Op) -> Result<Option<Result<Reply, ErrorKind>>, String> {
        let (pre, pre_nets, fault_pending) = {
            let mut w = self.k.world();
            w.effects.clear();
            (w.procs.clone(), w.nets.clone(), w.fault.is_some())
        };
        let pre_model = self.model.clone();
        let pre_adopted: BTreeSet<(u32, IpAddr)> = self
            .adopted
            .iter()
            .map(|((_, a), x)| (x.netns, *a))
            .collect();
        let mut outcome = None;
        let mut allowed = match op.clone() {
            Op::Req { conn, req } => {
                let allowed = self.allowed_by(conn, &req);
                outcome = Some(
                    self.request(conn, req, fault_pending, &pre, &pre_nets)
                        .map_err(|e| format!("after {op:?}: {e}"))?,
                );
                allowed
            }
            Op::LeaseLost { conn } => self
                .lose_lease(conn, &pre_model)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            Op::Restart => self
                .restart(&pre_model)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            Op::Sweep { secs } => self
                .sweep(secs, fault_pending)
                .map_err(|e| format!("after {op:?}: {e}"))?,
            other => {
                self.world_event(other);
                Allowed::default()
            }
        };
        // The known gap of a netns both locked as a source and holding adoptions: its
        // unlock announces the adoptions it brought back, which this very step (a
        // restart's sweep) may withdraw again.
        allowed.announced_adoptions = pre_adopted
            .into_iter()
            .filter(|(n, _)| self.ever_locked.contains(n) && self.ever_adopted.contains(n))
            .collect();
        self.exempt_networks_of_dead_locked_sources(&pre_model, &pre);
        if fault_pending {
            self.strand_forwards();
        }
        self.check(&pre, &allowed)
            .map_err(|e| format!("after {op:?}: {e}"))?;
        Ok(outcome)
    }

    /// What a request may do: signal or take sockets from the tree of this agent's
    /// source, lock its network, mount or move into its target's.
    pub(super) fn allowed_by(&self, conn: u64, req: &Request) -> Allowed {
        let uid = req.uid().as_str().to_owned();
        let mine = self.model.get(&uid).filter(|r| r.conn == conn).cloned();
        let src = mine.clone().filter(|r| r.role == BrokerRole::Source);
        let tgt = mine.clone().filter(|r| r.role == BrokerRole::Target);
        let mut a = Allowed::default();
        match req {
            Request::Resume { .. } => {
                // Never a fenced source.
                a.roots
                    .extend(src.filter(|r| !r.fenced).map(|r| (r.process, r.netns)));
                a.sigs = &[Signal::SIGCONT];
            }
            Request::Kill { .. } => {
                a.roots.extend(src.map(|r| (r.process, r.netns)));
                a.sigs = &[Signal::SIGKILL];
            }
            Request::ListSockets { .. } | Request::ReleaseTcpRepair { .. } => {
                a.roots.extend(src.map(|r| (r.process, r.netns)));
            }
            Request::LockNetwork { .. } => {
                a.may_lock = src.map(|r| r.netns);
                // The addresses it has before the lock (which drops IPv6 ones).
                a.may_sweep = a.may_lock.map(|ns| self.addresses_of(ns));
            }
            Request::BindNetns { .. } => {
                a.may_mount = tgt.map(|r| (Self::netns_path(&uid), r.netns))
            }
            Request::MoveCgroup { process, .. } => {
                a.may_move = tgt.map(|r| (*process, r.netns, r.cgroup, r.process.pid))
            }
            Request::ChargeRestore { process, .. } => {
                let w = self.k.world();
                let broker_netns = w.procs.get(&w.broker_pid).map_or(0, |p| p.netns);
                a.may_charge = tgt.map(|r| (*process, r.cgroup, w.broker_pid, broker_netns))
            }
            Request::AdoptAddress { address, .. } => {
                a.adopt_into = tgt.map(|r| (r.netns, *address))
            }
            Request::ReleaseAddress { address, .. } => {
                a.may_withdraw = self.adopted_by(&uid, *address, tgt.as_ref())
            }
            Request::Forget { .. } if mine.is_some() => {
                a.may_withdraw = self.unrestored_adoptions(&uid)
            }
            _ => {}
        }
        a
    }

    /// Every address (IPv4 and IPv6, with its prefix) of network namespace `ns` now.
    fn addresses_of(&self, ns: u32) -> Vec<String> {
        self.k.world().nets.get(&ns).map_or_else(Vec::new, |n| {
            n.addrs4
                .iter()
                .chain(&n.addrs6)
                .map(|(x, _)| x.clone())
                .collect()
        })
    }

    /// `address` as `uid` adopted it (netns, address), when `tgt`'s holder is the one
    /// it was adopted for.
    fn adopted_by(&self, uid: &str, address: IpAddr, tgt: Option<&Reg>) -> BTreeSet<(u32, IpAddr)> {
        self.adopted
            .get(&(uid.to_owned(), address))
            .filter(|x| tgt.is_some_and(|r| r.process == x.holder))
            .map(|x| (x.netns, address))
            .into_iter()
            .collect()
    }

    /// The adoptions of `uid` not restored yet (netns, address).
    fn unrestored_adoptions(&self, uid: &str) -> BTreeSet<(u32, IpAddr)> {
        self.adopted
            .iter()
            .filter(|((u, _), x)| u == uid && !x.restored)
            .map(|((_, addr), x)| (x.netns, *addr))
            .collect()
    }

    /// Sends `req` to the broker and checks the answer (a reply that fits the request,
    /// a socket list that is exactly the registered tree's sockets, no kernel error
    /// without a fault); the agents' model follows the answer.
    pub(super) fn request(
        &mut self,
        conn: u64,
        req: Request,
        fault_pending: bool,
        pre: &BTreeMap<i32, Proc>,
        pre_nets: &BTreeMap<u32, Net>,
    ) -> Result<Result<Reply, ErrorKind>, String> {
        let uid = req.uid().as_str().to_owned();
        let mine = self.model.get(&uid).filter(|r| r.conn == conn).cloned();
        match (&req, &mine) {
            (Request::LockNetwork { .. }, Some(r)) if r.role == BrokerRole::Source => {
                self.ever_locked.insert(r.netns);
            }
            (Request::AdoptAddress { .. }, Some(r)) if r.role == BrokerRole::Target => {
                self.ever_adopted.insert(r.netns);
            }
            _ => {}
        }
        let res = match self.broker.handle(conn, req.clone()) {
            Ok(reply) => {
                if !reply_fits(&req, &reply) {
                    return Err(format!("{req:?} answered with {reply:?}"));
                }
                if let Reply::Sockets { sockets } = &reply {
                    let root = self.model.get(req.uid().as_str()).map(|r| r.process.pid);
                    let want = root.map(|r| sockets_in(pre, r)).unwrap_or_default();
                    if *sockets != want {
                        return Err(format!(
                            "{req:?} listed {sockets:?}, the tree holds {want:?}"
                        ));
                    }
                }
                Ok(reply)
            }
            Err(e) => {
                // An adoption into a namespace where the broker cannot tell the link
                // (no default route of the family, several links) is the kernel
                // layer's refusal, without a fault.
                let no_link = match (&req, &mine) {
                    (Request::AdoptAddress { address, .. }, Some(r)) => {
                        no_link_for(&pre_nets[&r.netns], *address)
                    }
                    _ => false,
                };
                if e.kind == ErrorKind::Kernel && !fault_pending && !no_link {
                    return Err(format!("{req:?}: kernel error with no fault: {e}"));
                }
                self.check_refusal(&req, mine.as_ref(), &e)?;
                Err(e.kind)
            }
        };
        self.update_model(conn, &req, &res, pre)?;
        self.update_adoptions(&req, mine.as_ref(), &res, fault_pending, pre_nets)?;
        Ok(res)
    }

    /// An `adopt_address` refusal must have its reason: `HandoverOff` only with no
    /// CIDRs, `AddressNotAllowed` for an address it may adopt only when the migration
    /// has [`crate::handover::MAX_ADOPTED`] already, another migration holds it, or it
    /// holds it for another holder.
    pub(super) fn check_refusal(
        &self,
        req: &Request,
        mine: Option<&Reg>,
        e: &BrokerError,
    ) -> Result<(), String> {
        let Request::AdoptAddress { uid, address } = req else {
            return Ok(());
        };
        let on = !self.cfg.handover_cidrs.is_empty();
        match e.kind {
            ErrorKind::HandoverOff if on => Err(format!("{req:?}: {e} with the hand-over on")),
            ErrorKind::AddressNotAllowed if on && may_adopt(*address) => {
                let u = uid.as_str();
                let mine_n = self.adopted.keys().filter(|(x, _)| x == u).count();
                let elsewhere = self.adopted.iter().any(|((x, a), r)| {
                    a == address && (x != u || mine.is_none_or(|m| m.process != r.holder))
                });
                if mine_n >= crate::handover::MAX_ADOPTED || elsewhere {
                    Ok(())
                } else {
                    Err(format!("{req:?}: {e}, an address it may adopt"))
                }
            }
            _ => Ok(()),
        }
    }

    pub(super) fn world_event(&mut self, op: Op) {
        let mut w = self.k.world();
        match op {
            Op::Dump { pid } => w.dump(pid),
            Op::Detach { pid } => w.detach(pid),
            Op::Exit { pid } if pid != w.broker_pid && pid != 1 => w.exit(pid),
            Op::Reuse { pid, like } if pid != w.broker_pid && pid != 1 => w.reuse(pid, like),
            Op::Spawn { parent } => w.spawn(parent),
            Op::Fault(f) => w.fault = Some(f),
            Op::Symlink {
                uid,
                journal,
                handover,
            } => {
                let p = if journal {
                    Path::new(RUN_DIR).join("netns").join(".journal")
                } else if handover {
                    Path::new(RUN_DIR).join("netns").join(".handover")
                } else {
                    Self::netns_path(UIDS[uid])
                };
                w.symlinks.insert(p);
            }
            Op::DetachOnSleep(on) => w.detach_on_sleep = on,
            Op::Connect { pid, address } => w.connect(pid, address),
            _ => {}
        }
    }

    /// A registration the broker accepted: it must be one it may accept (a live pod
    /// process with its pinned start time, of the container named, not the broker's
    /// cgroup, not in the node's netns), not a second pin of the same process, and a
    /// repeat (of the same container too) only by the same agent.
    pub(super) fn registered(
        &mut self,
        conn: u64,
        uid: String,
        pin: (BrokerRole, ProcRef, &ContainerId),
        cgroup: &str,
        pre: &BTreeMap<i32, Proc>,
    ) -> Result<(), String> {
        let (role, process, container) = pin;
        let Some(p) = pre.get(&process.pid) else {
            return Err(format!(
                "registered pid {} that does not exist",
                process.pid
            ));
        };
        let broker_cg = pre
            .get(&self.k.world().broker_pid)
            .map(|b| b.cgroup.clone());
        // A repeated register of the same pin by the same agent is idempotent:
        // the pin was checked when it was made.
        let new = !self.model.contains_key(&uid);
        // The fake world's containers are its cgroups' last components.
        let its_container = p.cgroup.rsplit('/').next() == Some(container.as_str());
        if p.zombie
            || p.start_time != process.start_time
            || (new && !under_pods_root(&p.cgroup, PODS_ROOT))
            || (new && !its_container)
            || (new && Some(&p.cgroup) == broker_cg.as_ref())
            || (new && p.netns == self.k.world().node_netns)
        {
            return Err(format!("registered a process it must refuse: {p:?}"));
        }
        if let Some(r) = self.model.get(&uid) {
            if r.conn != conn || r.process != process || r.role != role || r.container != *container
            {
                return Err(format!("{uid} registered twice"));
            }
            return Ok(());
        }
        if self.model.values().any(|r| r.process.pid == process.pid) {
            return Err(format!("pid {} pinned by two migrations", process.pid));
        }
        let reg = Reg::new(conn, (role, process, container), p.netns, cgroup);
        self.model.insert(uid, reg);
        Ok(())
    }

    pub(super) fn update_model(
        &mut self,
        conn: u64,
        req: &Request,
        res: &Result<Reply, ErrorKind>,
        pre: &BTreeMap<i32, Proc>,
    ) -> Result<(), String> {
        let uid = req.uid().as_str().to_owned();
        let Ok(reply) = res else {
            if let (Request::LockNetwork { .. }, Some(r)) = (req, self.model.get_mut(&uid)) {
                r.maybe_locked = true;
            }
            return Ok(());
        };
        match req {
            Request::Register {
                role,
                process,
                container,
                ..
            } => {
                let Reply::Registered { cgroup } = reply else {
                    unreachable!("checked by reply_fits")
                };
                self.registered(conn, uid, (*role, *process, container), cgroup, pre)?;
            }
            Request::Forget { .. } => {
                self.model.remove(&uid);
            }
            _ => {
                let Some(r) = self.model.get_mut(&uid) else {
                    return Err(format!("{req:?} succeeded on an unregistered migration"));
                };
                r.apply(req, &mut self.killed_netns)?;
            }
        }
        Ok(())
    }
}
