//! The harness's model of the address hand-over, lost leases and broker restarts.

use super::invariants::*;
use super::model::*;
use super::world::*;
use crate::Broker;
use crate::handover::{Adoption, parse_journal_body};
use crate::os::Kernel;
use nix::sys::signal::Signal;
use podmotion_wire::broker::{BrokerRole, ErrorKind, Reply, Request};
use podmotion_wire::ids::MigrationUid;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

impl Harness {
    /// The adoptions the broker must hold after `req` answered `res`.
    pub(super) fn update_adoptions(
        &mut self,
        req: &Request,
        mine: Option<&Reg>,
        res: &Result<Reply, ErrorKind>,
        fault_pending: bool,
        pre_nets: &BTreeMap<u32, Net>,
    ) -> Result<(), String> {
        let uid = req.uid().as_str().to_owned();
        if res.is_err() {
            // A failure changes nothing, unless a fault stopped it half-way (or the
            // journal cannot be written): then the journal says what is left, never
            // more than there was.
            if fault_pending || self.handover_blocked() {
                self.sync_from_journal(&uid)?;
            }
            return Ok(());
        }
        let Some(r) = mine else {
            return Ok(());
        };
        match req {
            Request::AdoptAddress { address, .. } => {
                self.adopted_now(req, uid, r, *address, pre_nets)?
            }
            Request::ReleaseAddress { address, .. } => self.released_now(req, uid, r, *address)?,
            Request::MoveCgroup { .. } => {
                for ((u, _), x) in self.adopted.iter_mut() {
                    if *u == uid && x.holder == r.process {
                        x.restored = true;
                    }
                }
            }
            Request::Forget { .. } => self.end_adoptions(&uid),
            _ => {}
        }
        Ok(())
    }

    /// `req` adopted `address` for `r` (its target holder): an address the hand-over
    /// allows, in the holder's namespace now; recorded unless it was the pod's own, and
    /// never for another holder.
    fn adopted_now(
        &mut self,
        req: &Request,
        uid: String,
        r: &Reg,
        address: IpAddr,
        pre_nets: &BTreeMap<u32, Net>,
    ) -> Result<(), String> {
        if !may_adopt(address) {
            return Err(format!("{req:?} done: an address it must refuse"));
        }
        let there = |nets: &BTreeMap<u32, Net>| net_has(&nets[&r.netns], address);
        if !there(&self.k.world().nets) {
            return Err(format!(
                "{req:?} done, the address is not in netns {}",
                r.netns
            ));
        }
        match self.adopted.get(&(uid.clone(), address)) {
            Some(x) if x.holder != r.process => {
                return Err(format!("{req:?} done for another holder: {x:?}"));
            }
            Some(_) => {}
            // There before (the pod's own): nothing recorded.
            None if there(pre_nets) => {}
            None => {
                let deadline = self.k.unix_now() + self.cfg.address_linger.as_secs();
                self.adopted.insert(
                    (uid, address),
                    Adopted {
                        netns: r.netns,
                        holder: r.process,
                        restored: false,
                        deadline,
                    },
                );
            }
        }
        Ok(())
    }

    /// `req` released `address` of `r` (its target holder): an adoption recorded for
    /// that holder is gone, from the model and from the holder's namespace.
    fn released_now(
        &mut self,
        req: &Request,
        uid: String,
        r: &Reg,
        address: IpAddr,
    ) -> Result<(), String> {
        let key = (uid, address);
        if self
            .adopted
            .get(&key)
            .is_some_and(|x| x.holder == r.process)
        {
            self.adopted.remove(&key);
            if net_has(&self.k.world().nets[&r.netns], address) {
                return Err(format!("{req:?} done, the address is still there"));
            }
        }
        Ok(())
    }

    /// A registration of `uid` ended: its adoptions not restored are gone (withdrawn,
    /// or left in the namespace of a holder that died).
    pub(super) fn end_adoptions(&mut self, uid: &str) {
        let live = self.k.world().procs.clone();
        let ended: Vec<(String, IpAddr)> = self
            .adopted
            .iter()
            .filter(|((u, _), x)| u == uid && !x.restored)
            .map(|(k, _)| k.clone())
            .collect();
        for k in ended {
            let x = self.adopted.remove(&k).expect("listed");
            if !live_as(&live, x.holder) {
                self.abandoned.insert((x.netns, k.1));
            }
        }
    }

    /// Whether a symlink was planted at the hand-over journal's directory: every write
    /// of a non-empty record is refused from then on, so what the broker withdraws it
    /// cannot always take out of its records.
    pub(super) fn handover_blocked(&self) -> bool {
        self.k
            .world()
            .symlinks
            .contains(&Path::new(RUN_DIR).join("netns").join(".handover"))
    }

    /// After a failure a fault cut short: the adoptions of `uid` are what the journal
    /// holds, which must be some of those there were, unchanged.
    pub(super) fn sync_from_journal(&mut self, uid: &str) -> Result<(), String> {
        let journal = self.handover_journal(&self.k.world())?;
        let now = journal.get(uid).cloned().unwrap_or_default();
        let procs = self.k.world().procs.clone();
        let before: Vec<(String, IpAddr)> = self
            .adopted
            .keys()
            .filter(|(u, _)| u == uid)
            .cloned()
            .collect();
        for r in &now {
            let key = (uid.to_owned(), r.address);
            match self.adopted.get(&key) {
                Some(x)
                    if x.holder == r.holder
                        && x.restored == r.restored
                        && x.deadline == r.deadline => {}
                other => {
                    return Err(format!(
                        "after a failure the hand-over journal holds {r:?}, which was {other:?}"
                    ));
                }
            }
        }
        for key in before {
            if !now.iter().any(|r| r.address == key.1) {
                let x = self.adopted.remove(&key).expect("listed");
                if !live_as(&procs, x.holder) {
                    self.abandoned.insert((x.netns, key.1));
                }
            }
        }
        Ok(())
    }

    /// Time passes (`secs`), then the broker's sweep runs: what it must withdraw is
    /// predicted from the adoptions, the clock, the registrations and the connections
    /// of each holder's namespace.
    pub(super) fn sweep(&mut self, secs: u64, fault_pending: bool) -> Result<Allowed, String> {
        self.k.world().clock += Duration::from_secs(secs);
        let a = Allowed {
            may_withdraw: self
                .adopted
                .iter()
                .map(|((_, ad), x)| (x.netns, *ad))
                .collect(),
            ..Allowed::default()
        };
        let keys: Vec<(String, IpAddr)> = self.adopted.keys().cloned().collect();
        self.broker.sweep();
        if fault_pending || self.handover_blocked() {
            for u in keys.iter().map(|(u, _)| u.clone()).collect::<BTreeSet<_>>() {
                self.sync_from_journal(&u)?;
            }
            return Ok(a);
        }
        self.predict_sweep();
        Ok(a)
    }

    /// What one sweep leaves of the adoptions (see [`Broker::sweep`]).
    pub(super) fn predict_sweep(&mut self) {
        let w = self.k.world();
        let now = UNIX_EPOCH_AT_START + w.clock.as_secs();
        let procs = w.procs.clone();
        drop(w);
        let model = &self.model;
        let mut abandoned = Vec::new();
        self.adopted.retain(|(u, a), x| {
            if !live_as(&procs, x.holder) {
                abandoned.push((x.netns, *a));
                return false;
            }
            let registered = model
                .get(u)
                .is_some_and(|r| r.role == BrokerRole::Target && r.process == x.holder);
            let used = procs.values().any(|p| {
                !p.zombie
                    && p.netns == x.netns
                    && p.sockets
                        .iter()
                        .any(|s| !s.addrs.listening && s.addrs.local.is_some_and(|l| l.ip() == *a))
            });
            !(now >= x.deadline || (!x.restored && !registered) || (x.restored && !used))
        });
        self.abandoned.extend(abandoned);
    }

    /// The hand-over journal, by migration (every record must parse, name a valid UID
    /// and hold at most [`crate::handover::MAX_ADOPTED`] addresses, each once).
    pub(super) fn handover_journal(
        &self,
        w: &World,
    ) -> Result<BTreeMap<String, Vec<Adoption>>, String> {
        let dir = Path::new(RUN_DIR).join("netns").join(".handover");
        let mut out = BTreeMap::new();
        for (p, body) in w.files.iter().filter(|(p, _)| p.parent() == Some(&dir)) {
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if MigrationUid::parse(&name).is_err() {
                return Err(format!("hand-over record at {p:?}"));
            }
            let list = parse_journal_body(body)
                .ok_or_else(|| format!("unreadable hand-over record {p:?}"))?;
            let addrs: BTreeSet<IpAddr> = list.iter().map(|r| r.address).collect();
            if list.is_empty()
                || list.len() > crate::handover::MAX_ADOPTED
                || addrs.len() != list.len()
            {
                return Err(format!("hand-over record {p:?}: {list:?}"));
            }
            out.insert(name, list);
        }
        Ok(out)
    }

    /// Connection `conn` ends: its locked (or maybe locked) sources are rolled back,
    /// its fenced ones killed.
    pub(super) fn lose_lease(
        &mut self,
        conn: u64,
        pre_model: &BTreeMap<String, Reg>,
    ) -> Result<Allowed, String> {
        self.k.world().fault = None;
        let mut a = Allowed {
            sigs: &[Signal::SIGCONT],
            ..Allowed::default()
        };
        for r in pre_model.values().filter(|r| r.conn == conn) {
            if r.role != BrokerRole::Source || r.killed {
                continue;
            }
            if r.fenced {
                a.kill_roots.push((r.process, r.netns));
                a.killed.push(r.process);
                self.killed_netns.insert(r.netns);
                continue;
            }
            if r.locked || r.maybe_locked {
                a.roots.push((r.process, r.netns));
            }
            if r.locked {
                a.rolled_back.push(r.process);
            }
        }
        self.broker.lease_lost(conn);
        let mut ended = Vec::new();
        self.model.retain(|u, r| {
            if r.conn == conn {
                ended.push(u.clone());
            }
            r.conn != conn
        });
        for u in &ended {
            a.may_withdraw.extend(
                self.adopted
                    .iter()
                    .filter(|((x, _), ad)| x == u && !ad.restored)
                    .map(|((_, addr), ad)| (ad.netns, *addr)),
            );
            if self.handover_blocked() {
                // Withdrawn, but perhaps still recorded: the journal says.
                self.sync_from_journal(u)?;
            } else {
                self.end_adoptions(u);
            }
        }
        Ok(a)
    }

    /// A new broker over the same node recovers what the old one had locked.
    pub(super) fn restart(&mut self, pre_model: &BTreeMap<String, Reg>) -> Result<Allowed, String> {
        self.k.world().fault = None;
        let mut a = Allowed {
            sigs: &[Signal::SIGCONT],
            ..Allowed::default()
        };
        for r in pre_model.values() {
            // The journal holds a fenced lock: killed, never thawed. (A fenced source
            // unlocked since is in no journal: it stays as it is, stopped.)
            if r.role == BrokerRole::Source && r.locked && !r.killed && r.fenced {
                a.kill_roots.push((r.process, r.netns));
                a.killed.push(r.process);
                self.killed_netns.insert(r.netns);
            } else if r.role == BrokerRole::Source && r.locked && !r.killed {
                a.roots.push((r.process, r.netns));
                a.rolled_back.push(r.process);
            }
            // Known gap: a lock whose journal write and undo both failed lives
            // only in the dead broker's memory.
            if r.maybe_locked && !r.locked {
                self.killed_netns.insert(r.netns);
            }
        }
        a.may_withdraw = self
            .adopted
            .iter()
            .map(|((_, ad), x)| (x.netns, *ad))
            .collect();
        self.broker = Broker::with_kernel(self.cfg.clone(), self.k.clone());
        self.broker.recover();
        // Every forward its predecessor journalled is gone now.
        self.stranded_forwards.clear();
        // Its registrations ended with the old broker; then one sweep (which drops
        // the records of holders that died, as the loading does).
        self.model.clear();
        if self.handover_blocked() {
            let uids: BTreeSet<String> = self.adopted.keys().map(|(u, _)| u.clone()).collect();
            for u in uids {
                self.sync_from_journal(&u)?;
            }
        } else {
            self.predict_sweep();
        }
        Ok(a)
    }

    /// A source whose pinned process died while locked cannot be entered any more
    /// (the broker reaches the netns through that pid): when its registration ends,
    /// its network stays locked. A known gap, exempted here and reported in
    /// docs/reliability.md, so that the fuzzer looks for everything else.
    pub(super) fn exempt_networks_of_dead_locked_sources(
        &mut self,
        pre_model: &BTreeMap<String, Reg>,
        pre: &BTreeMap<i32, Proc>,
    ) {
        for (u, r) in pre_model {
            let alive = pre
                .get(&r.process.pid)
                .is_some_and(|x| !x.zombie && x.start_time == r.process.start_time);
            if !self.model.contains_key(u) && r.locked && !r.killed && !alive {
                self.killed_netns.insert(r.netns);
            }
        }
    }
}
