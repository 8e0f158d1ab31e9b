//! The ops: `Broker::handle` and one method per request, each under its migration's
//! lock (see `Entries` in the crate root for the locking).

use crate::forward::check_held_services;
use crate::netlock::{addr_lines, lock, unlock};
use crate::{
    Broker, Entries, Entry, Kernel, State, err, kerr, names_container, release_repair, signal_tree,
    under_pods_root,
};
use nix::sys::signal::Signal;
use podmotion_wire::broker::*;
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::sync::{Arc, Mutex};

impl<K: Kernel> Broker<K> {
    /// Executes one validated request for connection `conn`.
    pub fn handle(&self, conn: u64, req: Request) -> Result<Reply, BrokerError> {
        const SOURCE: Option<BrokerRole> = Some(BrokerRole::Source);
        const TARGET: Option<BrokerRole> = Some(BrokerRole::Target);
        const ANY: Option<BrokerRole> = None;
        // Each op names the role it needs of the registration it acts on, held by this
        // connection.
        match &req {
            Request::Register {
                uid,
                role,
                process,
                container,
            } => self.register(conn, uid.clone(), *role, *process, container),
            Request::Forget { uid } => self.forget(conn, uid),
            Request::NetnsAddrs { uid } => {
                self.with_entry(uid, conn, ANY, |e, _| self.netns_addrs(e))
            }
            Request::BindNetns { uid } => {
                self.with_entry(uid, conn, TARGET, |e, s| self.bind_netns(uid, e, s))
            }
            Request::UnbindNetns { uid } => {
                self.with_entry(uid, conn, TARGET, |_, s| self.unbind_netns(uid, s))
            }
            Request::MoveCgroup { uid, process } => {
                self.with_entry(uid, conn, TARGET, |e, _| self.move_cgroup(uid, e, *process))
            }
            Request::ChargeRestore { uid, process } => {
                self.with_entry(uid, conn, TARGET, |e, _| self.charge_restore(e, *process))
            }
            Request::AdoptAddress { uid, address } => self.with_entry(uid, conn, TARGET, |e, _| {
                self.adopt_address(uid, e, *address)
            }),
            Request::ReleaseAddress { uid, address } => {
                self.with_entry(uid, conn, TARGET, |e, _| {
                    self.release_address(uid, e, *address)
                })
            }
            Request::LockNetwork { uid, hold } => self.with_entry(uid, conn, SOURCE, |e, s| {
                self.lock_network(uid, e, s, hold.as_deref())
            }),
            Request::UnlockNetwork { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.unlock_network(uid, e, s))
            }
            Request::ListSockets { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, _| self.list_sockets(e))
            }
            Request::ReleaseTcpRepair { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, _| self.release_tcp_repair(e))
            }
            Request::Resume { uid } => self.with_entry(uid, conn, SOURCE, |e, s| self.resume(e, s)),
            Request::Kill { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.kill(uid, e, s))
            }
            Request::Fence { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.fence(uid, e, s))
            }
            Request::Unfence { uid } => {
                self.with_entry(uid, conn, SOURCE, |e, s| self.unfence(uid, e, s))
            }
            Request::ForwardConnections {
                uid,
                targets,
                services,
            } => self.with_entry(uid, conn, SOURCE, |_, s| {
                self.forward_connections(uid, s, targets, services)
            }),
            Request::StopForwarding { uid } => self.with_entry(uid, conn, SOURCE, |_, s| {
                self.end_forward(uid, s).map(|()| Reply::Done)
            }),
        }
    }

    /// Pins `process`, a process of `container`, to `uid` for this connection.
    /// Registering the same thing again (same process, role and container) on the same
    /// connection is a no-op; anything else already registered is refused.
    fn register(
        &self,
        conn: u64,
        uid: MigrationUid,
        role: BrokerRole,
        process: ProcRef,
        container: &ContainerId,
    ) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        let pin = Pin {
            role,
            process,
            container,
        };
        if let Some(again) = taken(&self.map(), conn, &uid, &pin)? {
            return Ok(again);
        }
        // Read from /proc without the map; checked again with the insert, so that of
        // two registrations of one UID or one process racing, one wins.
        let cgroup = self.pod_cgroup_of(process.pid)?;
        if self.cfg.container_cgroups
            && !names_container(&cgroup, &self.cfg.pods_cgroup_root, container)
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {} (cgroup {cgroup}) does not belong to container {container}",
                    process.pid
                ),
            ));
        }
        let mut m = self.map();
        if let Some(again) = taken(&m, conn, &uid, &pin)? {
            return Ok(again);
        }
        m.insert(
            uid,
            Arc::new(Entry {
                role,
                process,
                container: container.clone(),
                cgroup: cgroup.clone(),
                conn,
                state: Mutex::new(State::default()),
            }),
        );
        Ok(Reply::Registered { cgroup })
    }

    /// The cgroup of a process the broker may act on: in a pod's cgroup (never the
    /// broker's own) and not in the node's network namespace.
    fn pod_cgroup_of(&self, pid: i32) -> Result<String, BrokerError> {
        let cgroup = self.kernel.cgroup_of(pid)?;
        let root = &self.cfg.pods_cgroup_root;
        let inside = under_pods_root(&cgroup, root);
        let mine = self.kernel.cgroup_of(self.kernel.self_pid()).ok();
        if !inside || mine.as_deref() == Some(cgroup.as_str()) {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!("pid {pid} is not in a pod cgroup under {root}"),
            ));
        }
        // A hostNetwork pod shares the node's network namespace: locking it would
        // take the node's own links down, binding it would hand out the node's.
        if self.kernel.netns_inode(pid)? == self.kernel.node_netns() {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {pid} shares the node's network namespace (a hostNetwork pod): never locked, bound or migrated"
                ),
            ));
        }
        Ok(cgroup)
    }

    fn bind_netns(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
    ) -> Result<Reply, BrokerError> {
        let path = self.netns_path(uid);
        if !s.netns_bound {
            self.kernel.bind_netns(e.process.pid, &path)?;
            s.netns_bound = true;
        }
        Ok(Reply::NetnsPath {
            path: path.to_string_lossy().into_owned(),
        })
    }

    fn unbind_netns(&self, uid: &MigrationUid, s: &mut State) -> Result<Reply, BrokerError> {
        if s.netns_bound {
            self.unbind(uid)?;
            s.netns_bound = false;
        }
        Ok(Reply::Done)
    }

    /// The addresses (without prefix length) of the registered process's namespace.
    fn netns_addrs(&self, e: &Entry) -> Result<Reply, BrokerError> {
        let addrs = self
            .kernel
            .in_netns(e.process.pid, |ip| {
                let out = ip.ip(&["-o", "addr", "show"])?;
                Ok(addr_lines(&out)
                    .into_iter()
                    .map(|a| a.address().to_owned())
                    .collect::<Vec<_>>())
            })
            .map_err(kerr)?;
        Ok(Reply::Addrs { addrs })
    }

    fn lock_network(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
        hold: Option<&[ForwardedService]>,
    ) -> Result<Reply, BrokerError> {
        check_held_services(hold.unwrap_or_default())?;
        if s.locked.is_none() {
            // What clients send to the pod through a Service while it is locked: their
            // next SYN goes where the Service points then. Its addresses are read
            // before the links go down (the kernel drops IPv6 ones with the link), the
            // sweep starts once they are down (nothing of the pod answers then).
            let staying = self.addresses_that_stay(e.process.pid);
            // The hold of new connections before the links go down: from here a new
            // SYN to the pod waits in the node's queue (installing the hold takes a
            // few process starts; after the links, a SYN in between was dropped and
            // retransmitted a second later — seen on the real nodes).
            s.hold = hold.and_then(|services| self.hold_new_connections(uid, &staying, services));
            let l = match lock(&self.kernel, e.process.pid) {
                Ok(l) => l,
                Err(err) => {
                    // Nothing locked: the held SYNs go on to the running source.
                    self.end_hold(uid, s, crate::synhold::End::Release);
                    return Err(err);
                }
            };
            // Once the links are down (before, the source itself would answer the
            // node's probe and take the held SYN, which its freeze then strands): from
            // here the node holds what it sends to the pod (a client's SYN waits, it
            // is not dropped) until an announcement names the address's new place. A
            // SYN sent between the two is dropped at the dead link and retransmitted.
            s.held.extend(self.hold_neighbours(e.process.pid));
            if let Err(j) = self.journal_write(uid, e.process, &l, s.fenced) {
                // Never report a lock that a broker restart could not undo. If
                // the undo fails too, the lock stays known in memory, so that
                // unlock, forget or the lease rollback retry it.
                if unlock(&self.kernel, e.process.pid, &l).is_err() {
                    s.locked = Some(l);
                } else {
                    self.end_hold(uid, s, crate::synhold::End::Release);
                }
                return Err(j);
            }
            s.locked = Some(l);
            s.staying = staying.clone();
            s.sweep = self.forget_unanswered(staying);
        } else if let Some(l) = &s.locked {
            // Already locked (perhaps by a lock whose journal write and undo both
            // failed): done only once the journal holds it.
            self.journal_write(uid, e.process, l, s.fenced)?;
        }
        Ok(Reply::Done)
    }

    fn unlock_network(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        s: &mut State,
    ) -> Result<Reply, BrokerError> {
        // New connections go to the source again before it can answer them (a
        // rollback), or it is about to be killed (a commit).
        self.end_forward_logged(uid, s);
        // The saved lock is dropped only once it is restored: after a failed
        // unlock, a retry, `forget` or the lease rollback still knows what to undo.
        if let Some(l) = &s.locked {
            unlock(&self.kernel, e.process.pid, l)?;
            s.locked = None;
            // The pod answers again (a rollback), or is about to be killed (a commit).
            s.sweep = None;
        }
        // The unlock announced the addresses: what the node held goes to the source.
        self.release_neighbours(std::mem::take(&mut s.held));
        // The held SYNs: to the source again after a rollback; never to a source
        // about to be killed (it would reset them; dropped, they are retransmitted).
        let how = if s.fenced {
            crate::synhold::End::Drop
        } else {
            crate::synhold::End::Release
        };
        self.end_hold(uid, s, how);
        self.journal_remove(uid);
        Ok(Reply::Done)
    }

    /// The addresses of every TCP socket of the source's process tree, each socket
    /// once (whichever processes of the tree hold it). The broker reads them itself:
    /// no descriptor of the workload leaves it.
    fn list_sockets(&self, e: &Entry) -> Result<Reply, BrokerError> {
        // Inventory first, then refuse a set larger than one answer lists rather than
        // list part of it: a socket left out would be lost silently.
        let mut seen = std::collections::BTreeSet::new();
        let mut found = Vec::new();
        for pid in self.kernel.tree(e.process.pid) {
            for (fd, ino) in self.kernel.tcp_fds(pid) {
                if seen.insert(ino) {
                    found.push((pid, fd));
                }
            }
        }
        if found.len() > MAX_SOCKETS {
            return Err(err(
                ErrorKind::TooManySockets,
                format!(
                    "the source holds {} TCP sockets; at most {MAX_SOCKETS} can be listed",
                    found.len()
                ),
            ));
        }
        let sockets = found
            .into_iter()
            .map(|(pid, fd)| self.kernel.socket_addrs(pid, fd).map_err(kerr))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Reply::Sockets { sockets })
    }

    fn release_tcp_repair(&self, e: &Entry) -> Result<Reply, BrokerError> {
        release_repair(&self.kernel, e.process.pid)?;
        Ok(Reply::Done)
    }

    /// Moves a restored tree into the cgroups of the target pod's registered process;
    /// only a tree in that pod's network namespace, never the registered process itself.
    /// The migration's adopted addresses are restored from then on (journalled: if that
    /// fails, the move is reported failed, since its addresses would not outlive it).
    fn move_cgroup(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        process: ProcRef,
    ) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        if process.pid == e.process.pid
            || self.kernel.netns_inode(process.pid)? != self.kernel.netns_inode(e.process.pid)?
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!(
                    "pid {} is not a restored tree in the target pod's network namespace",
                    process.pid
                ),
            ));
        }
        let tree = self.kernel.tree(process.pid);
        self.kernel
            .move_into_cgroups_of(e.process.pid, &e.cgroup, &tree)?;
        self.mark_restored(uid, e.process).map_err(|j| {
            err(
                j.kind,
                format!(
                    "{} pids moved, but the adopted addresses could not be journalled as restored: {}",
                    tree.len(),
                    j.message
                ),
            )
        })?;
        Ok(Reply::Moved {
            pids: tree.len() as u32,
        })
    }

    /// Moves the agent's launcher of CRIU's restore into the holder's memory cgroup
    /// before it starts CRIU, so what the restore allocates is charged to the pod. Only
    /// a process of the agent's own pod (the broker's network namespace, where peers
    /// must share it: see [`Config::same_netns_peers`]), never the broker itself, and
    /// that one process (what it forks later follows it).
    fn charge_restore(&self, e: &Entry, process: ProcRef) -> Result<Reply, BrokerError> {
        self.kernel.check_live(process)?;
        let me = self.kernel.self_pid();
        if process.pid == me
            || (self.cfg.same_netns_peers
                && self.kernel.netns_inode(process.pid)? != self.kernel.netns_inode(me)?)
        {
            return Err(err(
                ErrorKind::ForeignProcess,
                format!("pid {} is not a process of the agent's pod", process.pid),
            ));
        }
        self.kernel
            .charge_memory_to(e.process.pid, &e.cgroup, process.pid)?;
        Ok(Reply::Moved { pids: 1 })
    }

    fn resume(&self, e: &Entry, s: &State) -> Result<Reply, BrokerError> {
        if s.fenced {
            return Err(err(
                ErrorKind::Fenced,
                "the source is fenced (its copy may be restored on the target): only unfence, the operator's abort, lets it resume",
            ));
        }
        signal_tree(&self.kernel, e.process.pid, Signal::SIGCONT)?;
        Ok(Reply::Done)
    }

    /// The restore fence: done only once the journal holds it, so that neither a lost
    /// lease nor a broker restart can resume this source any more.
    fn fence(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        let (Some(l), false) = (&s.locked, s.killed) else {
            return Err(err(
                ErrorKind::NotLocked,
                format!("{uid}: no frozen, locked source to fence"),
            ));
        };
        self.journal_write(uid, e.process, l, true)?;
        s.fenced = true;
        Ok(Reply::Done)
    }

    /// Lifts the fence (the operator's abort): in the journal first, then in memory,
    /// so that a failure leaves it fenced (the safe side).
    fn unfence(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        if !s.fenced {
            return Ok(Reply::Done);
        }
        if let (Some(l), false) = (&s.locked, s.killed) {
            self.journal_write(uid, e.process, l, false)?;
        }
        s.fenced = false;
        Ok(Reply::Done)
    }

    fn kill(&self, uid: &MigrationUid, e: &Entry, s: &mut State) -> Result<Reply, BrokerError> {
        signal_tree(&self.kernel, e.process.pid, Signal::SIGKILL)?;
        s.killed = true;
        // The commit's kill: the Service no longer lists the source.
        self.end_forward_logged(uid, s);
        self.end_hold(uid, s, crate::synhold::End::Drop);
        self.journal_remove(uid);
        Ok(Reply::Done)
    }

    /// Ends a registration (a no-op if there is none) once its mount and lock are undone
    /// and its adoptions not yet restored withdrawn.
    fn forget(&self, conn: u64, uid: &MigrationUid) -> Result<Reply, BrokerError> {
        let Some(e) = self.held(uid, conn)? else {
            return Ok(Reply::Done);
        };
        let mut s = e.state();
        if s.gone {
            return Ok(Reply::Done);
        }
        // Adoptions not yet restored end with the registration; restored ones linger
        // (a commit: the moved connections run on) until the sweep withdraws them.
        // First, so that a failure here has undone nothing else.
        self.end_adoptions(uid)?;
        // The registration goes only once its mount and lock are undone: a
        // failed forget keeps the lease, so a retry or the rollback still can.
        if s.netns_bound {
            self.unbind(uid)?;
            s.netns_bound = false;
        }
        // Before the unlock lets the source answer again.
        self.end_forward_logged(uid, &mut s);
        if let (Some(l), false) = (&s.locked, s.killed)
            && self.kernel.check_live(e.process).is_ok()
        {
            unlock(&self.kernel, e.process.pid, l)?;
        }
        self.remove(uid, &e, &mut s);
        Ok(Reply::Done)
    }

    pub(crate) fn unbind(&self, uid: &MigrationUid) -> Result<(), BrokerError> {
        self.kernel.unbind(&self.netns_path(uid))
    }
}

/// What a `register` asks to pin.
struct Pin<'a> {
    role: BrokerRole,
    process: ProcRef,
    container: &'a ContainerId,
}

/// For `register`, under the map: `Some` (the answer to repeat) if this connection
/// already registered this pin (process, role and container) under `uid`,
/// `AlreadyRegistered` if `uid` or the process belongs to another registration (another
/// container named for the same process and UID included), `None` if both are free.
fn taken(
    m: &Entries,
    conn: u64,
    uid: &MigrationUid,
    pin: &Pin<'_>,
) -> Result<Option<Reply>, BrokerError> {
    let process = pin.process;
    if let Some(e) = m.get(uid) {
        if e.process == process
            && e.role == pin.role
            && e.container == *pin.container
            && e.conn == conn
        {
            return Ok(Some(Reply::Registered {
                cgroup: e.cgroup.clone(),
            }));
        }
        return Err(err(
            ErrorKind::AlreadyRegistered,
            format!("{uid} is already registered"),
        ));
    }
    if m.values().any(|e| e.process.pid == process.pid) {
        return Err(err(
            ErrorKind::AlreadyRegistered,
            "process belongs to another migration",
        ));
    }
    Ok(None)
}
