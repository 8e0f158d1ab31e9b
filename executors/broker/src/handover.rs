//! The pod address hand-over, the broker's side (issue 15): on nodes whose pods share
//! one L2 segment, the source pod's address can move to the target pod, so that the
//! connections CRIU restores keep their local address and come back established.
//!
//! - `adopt_address` (target) adds one of the source's addresses to the target holder's
//!   network namespace (`/32`, or `/128` with `nodad`, on the link of that family's
//!   default route). The source's links are down by then (`lock_network`), so it no
//!   longer answers for it. The address is announced (gratuitous ARP, unsolicited
//!   Neighbour Advertisement with Override: the same sends as `unlock_network`'s) only
//!   once the restored tree runs (`move_cgroup`): announced before the restore, the
//!   node would send the clients' SYNs to a namespace where nothing listens yet, and
//!   each would be refused (issue 39).
//! - `release_address` (target, rollback) withdraws it again.
//! - A successful `move_cgroup` marks the migration's adoptions **restored**: from then on
//!   they outlive the migration's registration (after a commit the agent forgets it while
//!   the moved connections run) until the **sweep** ([`Broker::sweep`]) finds no
//!   connection using them, or their deadline (`--address-linger-seconds` after the
//!   adoption) passes. Adoptions not yet restored end with the registration (`forget`,
//!   the lease's end, a broker restart).
//!
//! **Held neighbours** (issue 39). With the hand-over on, `lock_network` (source) first
//! sets the node's neighbour entries for the source's addresses in the hand-over
//! CIDRs to `INCOMPLETE` (`ip neigh replace <a> dev <d> nud incomplete` in the node's
//! network namespace, `<d>` the device the node routes `<a>` through), then takes the
//! pod's links down. A packet the node sends to a held address waits in that entry's
//! queue (the kernel's `unres_qlen_bytes`, about 200 KiB by default; past it the
//! oldest go) instead of being dropped at the pod's dead link: a client's SYN sent
//! during the freeze is not lost and retransmitted a second later, it is delivered
//! the moment an announcement names the address's place again — the target's, once
//! its restored tree runs, or the source's at `unlock_network` (a rollback). An entry
//! set `INCOMPLETE` by hand has no resolution timer, so nothing else ends the wait:
//! whatever is still `INCOMPLETE` when the lock ends (`unlock_network`) or the
//! registration does (a commit: the source's kill, `forget`, the lease's end) is
//! deleted, and the node resolves it afresh. Only the node the source runs on holds
//! (clients elsewhere on the segment still retransmit); best effort throughout: a
//! failure is logged and the lock goes on as before. Not journalled: a broker that
//! restarts during a freeze rolls the lock back, and the unlock's announcements end
//! the wait.
//!
//! Every adoption is recorded in the journal `<run>/netns/.handover/<uid>` (0600, one file
//! per migration, its path computed from the UID) before it is reported done, and taken
//! out only once the address is gone: a broker that starts loads its predecessor's
//! records and sweeps them.
//!
//! Locking: each migration's adoptions have their own lock (a [`List`]); the table of
//! lists and the claimed addresses (an address is adopted by one migration at most) are
//! held only to look up, insert or remove, never across kernel work. Lock order: a
//! registration's `state`, then its list, then the table or the claims (never both at
//! once) or the registrations' map; never two lists at once. The sweep takes a list only
//! if it is free (`try_lock`), so one migration's slow `ip` call never holds it up.

mod neigh;
mod records;

pub use neigh::Held;
use neigh::*;
pub use records::{
    Adoption, Cidr, MAX_ADOPTED, check_address, journal_body, never_a_pods, parse_cidrs,
    parse_journal_body,
};

use crate::netlock::addr_lines;
use crate::os::Kernel;
use crate::{Broker, Entry, err, kerr};
use podmotion_wire::broker::{BrokerError, BrokerRole, ErrorKind, Reply};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

/// One migration's adoptions, under its own lock.
#[derive(Debug, Default)]
pub(crate) struct List {
    /// Out of the table (emptied): whoever took it before must look it up again.
    gone: bool,
    records: Vec<Adoption>,
}

/// Every migration's adoptions, and which migration claims each address.
#[derive(Debug, Default)]
pub(crate) struct Table {
    lists: Mutex<BTreeMap<MigrationUid, Arc<Mutex<List>>>>,
    claims: Mutex<BTreeMap<IpAddr, MigrationUid>>,
    /// The links made to answer no ARP request until their restored trees run (see
    /// [`silence`]), by (network namespace inode, link): one entry per link however
    /// many adoptions silenced it, so the `arp_ignore` it had is read once and given
    /// back once, when the last of them is restored or withdrawn.
    silenced: Mutex<BTreeMap<(String, String), Silenced>>,
}

/// A link silenced by [`Broker::silence`]: the `arp_ignore` it had, and the adoptions
/// (holder pid, address) still waiting for their restored tree.
#[derive(Debug)]
struct Silenced {
    was: u8,
    waiting: BTreeSet<(i32, IpAddr)>,
}

/// `arp_ignore` that makes a link answer no ARP request ("do not reply for all local
/// addresses").
const ARP_SILENT: u8 = 8;

fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why the sweep withdraws an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    Deadline,
    LeaseEnded,
    ConnectionsEnded,
}

impl<K: Kernel> Broker<K> {
    fn handover_dir(&self) -> PathBuf {
        self.cfg.run_dir.join("netns").join(".handover")
    }

    /// Runs `f` on the adoptions of `uid` (created if `create`; `None` if there are none
    /// and not `create`), and takes an emptied list out of the table.
    fn with_list<T>(
        &self,
        uid: &MigrationUid,
        create: bool,
        f: impl FnOnce(&mut List) -> T,
    ) -> Option<T> {
        loop {
            let arc = {
                let mut lists = locked(&self.handover.lists);
                match lists.get(uid) {
                    Some(a) => Arc::clone(a),
                    None if create => Arc::clone(lists.entry(uid.clone()).or_default()),
                    None => return None,
                }
            };
            let mut l = locked(&arc);
            if l.gone {
                continue;
            }
            let out = f(&mut l);
            self.retire_if_empty(uid, &arc, &mut l);
            return Some(out);
        }
    }

    fn retire_if_empty(&self, uid: &MigrationUid, arc: &Arc<Mutex<List>>, l: &mut List) {
        if l.records.is_empty() && !l.gone {
            l.gone = true;
            let mut lists = locked(&self.handover.lists);
            if lists.get(uid).is_some_and(|x| Arc::ptr_eq(x, arc)) {
                lists.remove(uid);
            }
        }
    }

    /// Writes the journal record of `uid`'s adoptions (removed when there are none).
    fn write_adoptions(&self, uid: &MigrationUid, records: &[Adoption]) -> Result<(), BrokerError> {
        let dir = self.handover_dir();
        if records.is_empty() {
            self.kernel.remove_file(&dir.join(uid.as_str()));
            return Ok(());
        }
        self.kernel
            .journal_write(&dir, uid.as_str(), &journal_body(records))
    }

    /// Replaces `uid`'s adoptions by `next`: journal first, then memory (a journal that
    /// cannot be written leaves both as they were); the addresses no record names any
    /// more are unclaimed.
    fn set_adoptions(
        &self,
        uid: &MigrationUid,
        l: &mut List,
        next: Vec<Adoption>,
    ) -> Result<(), BrokerError> {
        if next == l.records {
            return Ok(());
        }
        self.write_adoptions(uid, &next)?;
        let gone: Vec<IpAddr> = l
            .records
            .iter()
            .map(|r| r.address)
            .filter(|a| !next.iter().any(|n| n.address == *a))
            .collect();
        l.records = next;
        let mut claims = locked(&self.handover.claims);
        for a in gone {
            if claims.get(&a) == Some(uid) {
                claims.remove(&a);
            }
        }
        Ok(())
    }

    /// `adopt_address`: `a` into the registered holder's network namespace (see the
    /// module docs). Recorded before it is added; done once it is there.
    pub(crate) fn adopt_address(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        a: IpAddr,
    ) -> Result<Reply, BrokerError> {
        if self.cfg.handover_cidrs.is_empty() {
            return Err(err(
                ErrorKind::HandoverOff,
                "the address hand-over is off on this node (no --address-handover-cidrs)",
            ));
        }
        check_address(&self.cfg.handover_cidrs, a)?;
        let holder = e.process;
        self.with_list(uid, true, |l| {
            if let Some(r) = l.records.iter().find(|r| r.address == a) {
                if r.holder == holder {
                    // Adopted already; there still, unless a withdrawal whose record
                    // could not be dropped took it (then it goes back).
                    return self.readopt(holder, a);
                }
                return Err(err(
                    ErrorKind::AddressNotAllowed,
                    format!(
                        "{a} is still adopted by {uid} for an earlier holder (pid {})",
                        r.holder.pid
                    ),
                ));
            }
            if l.records.len() >= MAX_ADOPTED {
                return Err(err(
                    ErrorKind::AddressNotAllowed,
                    format!(
                        "{uid} already adopted {MAX_ADOPTED} addresses, the most one migration may"
                    ),
                ));
            }
            {
                let mut claims = locked(&self.handover.claims);
                if let Some(other) = claims.get(&a).filter(|o| *o != uid) {
                    return Err(err(
                        ErrorKind::AddressNotAllowed,
                        format!("{a} is adopted by migration {other}"),
                    ));
                }
                claims.insert(a, uid.clone());
            }
            let r = self.adopt_claimed(uid, l, holder, a);
            if !l.records.iter().any(|r| r.address == a) {
                let mut claims = locked(&self.handover.claims);
                if claims.get(&a) == Some(uid) {
                    claims.remove(&a);
                }
            }
            r
        })
        .expect("created")
    }

    /// The kernel part of `adopt_address`, `a` claimed for `uid`.
    fn adopt_claimed(
        &self,
        uid: &MigrationUid,
        l: &mut List,
        holder: ProcRef,
        a: IpAddr,
    ) -> Result<Reply, BrokerError> {
        let link = match self
            .kernel
            .in_netns(holder.pid, move |ip| plan(ip, a))
            .map_err(kerr)?
        {
            // There natively (not ours): done, and nothing to take back later.
            Plan::Present => return Ok(Reply::Done),
            Plan::Onto(link) => link,
        };
        let rec_link = link.name.clone();
        let rec = Adoption {
            holder,
            address: a,
            link: link.name.clone(),
            deadline: self
                .kernel
                .unix_now()
                .saturating_add(self.cfg.address_linger.as_secs()),
            restored: false,
        };
        let mut next = l.records.clone();
        next.push(rec);
        self.set_adoptions(uid, l, next)?;
        if let Err(k) = self
            .kernel
            .in_netns(holder.pid, move |ip| add(ip, &link, a))
        {
            // Not added: the record goes again (if the journal cannot drop it, it stays,
            // and its withdrawal later finds nothing to remove).
            let next = l
                .records
                .iter()
                .filter(|r| r.address != a)
                .cloned()
                .collect();
            let _ = self.set_adoptions(uid, l, next);
            return Err(kerr(k));
        }
        self.silence(holder, &rec_link, a);
        tracing::info!(%uid, address = %a, holder = holder.pid, "address adopted");
        Ok(Reply::Done)
    }

    /// An adopted IPv4 address is not answered for before the restored tree runs: the
    /// holder's link answers no ARP request until [`Broker::mark_restored`] announces
    /// it. Otherwise the node, probing for the address the locked source no longer
    /// answers (or holding its entry, `--address-handover-hold-neighbours`), learns the
    /// target's MAC at once, and a moved connection's segment reaches the target before
    /// CRIU restored its socket and is reset (measured on the real nodes: CRIU's
    /// restore then failed). Best effort: logged. IPv6 has no such switch here; its
    /// neighbours are not held (see [`Broker::hold_neighbours`]).
    fn silence(&self, holder: ProcRef, link: &str, a: IpAddr) {
        if !a.is_ipv4() {
            return;
        }
        // Keyed by namespace, not holder: two holders in one namespace silencing one
        // link must not record each other's silence as the value to give back.
        let ns = match self.kernel.netns_inode(holder.pid) {
            Ok(ns) => ns,
            Err(e) => {
                tracing::warn!(address = %a, link, error = %e, "the holder's link still answers ARP before the restore");
                return;
            }
        };
        let mut silenced = locked(&self.handover.silenced);
        if let Some(s) = silenced.get_mut(&(ns.clone(), link.to_owned())) {
            s.waiting.insert((holder.pid, a));
            return;
        }
        let name = link.to_owned();
        match self
            .kernel
            .in_netns(holder.pid, move |ip| ip.arp_ignore(&name, ARP_SILENT))
        {
            Ok(was) => {
                let waiting = BTreeSet::from([(holder.pid, a)]);
                silenced.insert((ns, link.to_owned()), Silenced { was, waiting });
            }
            Err(e) => {
                tracing::warn!(address = %a, link, error = %e, "the holder's link still answers ARP before the restore");
            }
        }
    }

    /// The adoptions `gone` picks stop waiting; a link none waits on any more answers ARP
    /// again with the `arp_ignore` it had (set from `pid`'s namespace). Whether any
    /// adoption `gone` picked was waiting.
    fn stop_waiting(&self, pid: i32, gone: impl Fn(&(i32, IpAddr)) -> bool) -> bool {
        let (found, emptied) = {
            let mut silenced = locked(&self.handover.silenced);
            let mut found = false;
            for s in silenced.values_mut() {
                let before = s.waiting.len();
                s.waiting.retain(|w| !gone(w));
                found |= s.waiting.len() != before;
            }
            let emptied: Vec<(String, u8)> = silenced
                .iter()
                .filter(|(_, s)| s.waiting.is_empty())
                .map(|((_, link), s)| (link.clone(), s.was))
                .collect();
            silenced.retain(|_, s| !s.waiting.is_empty());
            (found, emptied)
        };
        for (link, was) in emptied {
            self.give_back_arp(pid, link, was);
        }
        found
    }

    fn give_back_arp(&self, pid: i32, link: String, was: u8) {
        let name = link.clone();
        if let Err(e) = self
            .kernel
            .in_netns(pid, move |ip| ip.arp_ignore(&name, was).map(|_| ()))
        {
            tracing::warn!(link, error = %e, "the holder's link not given back its arp_ignore");
        }
    }

    /// When an adoption not yet restored is withdrawn: it stops waiting (see
    /// [`Broker::stop_waiting`]); if it was not waiting (this broker restarted since it
    /// silenced the link), the link gets the kernel's default 0. Best effort: logged.
    fn unsilence_withdrawn(&self, r: &Adoption) {
        if r.restored || !r.address.is_ipv4() {
            return;
        }
        let key = (r.holder.pid, r.address);
        if !self.stop_waiting(r.holder.pid, |w| *w == key) {
            self.give_back_arp(r.holder.pid, r.link.clone(), 0);
        }
    }

    /// The holder's restored tree runs: none of its adoptions waits any more (before the
    /// announcement). Best effort: logged.
    fn unsilence(&self, holder: ProcRef) {
        self.stop_waiting(holder.pid, |(pid, _)| *pid == holder.pid);
    }

    /// `adopt_address` of an address this registration adopted already: done once it is
    /// in the holder's namespace.
    fn readopt(&self, holder: ProcRef, a: IpAddr) -> Result<Reply, BrokerError> {
        let plan = self
            .kernel
            .in_netns(holder.pid, move |ip| plan(ip, a))
            .map_err(kerr)?;
        if let Plan::Onto(link) = plan {
            self.kernel
                .in_netns(holder.pid, move |ip| add(ip, &link, a))
                .map_err(kerr)?;
        }
        Ok(Reply::Done)
    }

    /// `release_address`: withdraws `a` if this registration adopted it; done if not.
    pub(crate) fn release_address(
        &self,
        uid: &MigrationUid,
        e: &Entry,
        a: IpAddr,
    ) -> Result<Reply, BrokerError> {
        let holder = e.process;
        self.with_list(uid, false, |l| {
            if !l
                .records
                .iter()
                .any(|r| r.address == a && r.holder == holder)
            {
                return Ok(Reply::Done);
            }
            self.kernel
                .in_netns(holder.pid, move |ip| withdraw(ip, a))
                .map_err(kerr)?;
            let next = l
                .records
                .iter()
                .filter(|r| !(r.address == a && r.holder == holder))
                .cloned()
                .collect();
            if let Some(r) = l
                .records
                .iter()
                .find(|r| r.address == a && r.holder == holder)
            {
                self.unsilence_withdrawn(r);
            }
            self.set_adoptions(uid, l, next)?;
            tracing::info!(%uid, address = %a, "adopted address released");
            Ok(Reply::Done)
        })
        .unwrap_or(Ok(Reply::Done))
    }

    /// After a successful `move_cgroup`: the adoptions of `uid` for `holder` are
    /// restored (journal first). They now outlive the registration, and are announced:
    /// the restored tree listens, the node's held entries (and every neighbour) may
    /// send to it now.
    pub(crate) fn mark_restored(
        &self,
        uid: &MigrationUid,
        holder: ProcRef,
    ) -> Result<(), BrokerError> {
        self.with_list(uid, false, |l| {
            let mut next = l.records.clone();
            for r in next.iter_mut().filter(|r| r.holder == holder) {
                r.restored = true;
            }
            self.set_adoptions(uid, l, next)?;
            let adopted: Vec<(IpAddr, String)> = l
                .records
                .iter()
                .filter(|r| r.holder == holder)
                .map(|r| (r.address, r.link.clone()))
                .collect();
            // The restored tree listens: the link answers again, then says so.
            self.unsilence(holder);
            if !adopted.is_empty()
                && let Err(e) = self
                    .kernel
                    .in_netns(holder.pid, move |ip| announce_adopted(ip, &adopted))
            {
                tracing::warn!(%uid, error = %e, "adopted addresses not announced");
            }
            Ok(())
        })
        .unwrap_or(Ok(()))
    }

    /// `lock_network`, the hand-over on: holds the node's neighbour entries for the
    /// addresses of `pid`'s namespace in the hand-over CIDRs (see the module docs).
    /// Best effort: what could not be held is logged and left as it was.
    /// The addresses of `pid`'s network namespace a client can reach: IPv4, and global
    /// IPv6 (what the lock's hold and its sweep act on).
    pub(crate) fn pod_addresses(&self, pid: i32) -> std::io::Result<Vec<IpAddr>> {
        self.kernel.in_netns(pid, |ip| {
            Ok(addr_lines(&ip.ip(&["-o", "addr", "show"])?)
                .into_iter()
                .filter(|l| !l.v6 || l.global)
                .filter_map(|l| l.address().parse::<IpAddr>().ok())
                .collect::<Vec<_>>())
        })
    }

    pub(crate) fn hold_neighbours(&self, pid: i32) -> Vec<Held> {
        if self.cfg.handover_cidrs.is_empty() || !self.cfg.hold_neighbours {
            return Vec::new();
        }
        let cidrs = self.cfg.handover_cidrs.clone();
        let addrs = match self.pod_addresses(pid) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(error = %e, "lock: the pod's addresses not listed, nothing held");
                return Vec::new();
            }
        };
        // IPv4 only: a target answers no ARP request for an adopted IPv4 address until
        // its restored tree runs (see `silence`); for IPv6 nothing keeps it from
        // answering the node's solicitations early, so its SYNs are dropped as before.
        let addrs: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|a| a.is_ipv4() && check_address(&cidrs, *a).is_ok())
            .collect();
        if addrs.is_empty() {
            return Vec::new();
        }
        match self.kernel.in_node_netns(move |ip| Ok(hold(ip, &addrs))) {
            Ok(held) => {
                if !held.is_empty() {
                    tracing::info!(
                        ?held,
                        "lock: the node holds what it sends to the pod's addresses"
                    );
                }
                held
            }
            Err(e) => {
                tracing::warn!(error = %e, "lock: the node's namespace not entered, nothing held");
                Vec::new()
            }
        }
    }

    /// Ends what [`Broker::hold_neighbours`] held: an entry still `INCOMPLETE` is
    /// deleted (best effort, logged).
    pub(crate) fn release_neighbours(&self, held: Vec<Held>) {
        if held.is_empty() {
            return;
        }
        if let Err(e) = self.kernel.in_node_netns(move |ip| release(ip, &held)) {
            tracing::warn!(error = %e, "the node's held neighbour entries not released");
        }
    }

    /// The registration of `uid` ends (`forget`, the lease's end): its adoptions not yet
    /// restored are withdrawn (a holder that is gone took its namespace with it); the
    /// restored ones linger. The first failure is returned; what failed stays recorded
    /// (the sweep withdraws it once no registration holds it).
    pub(crate) fn end_adoptions(&self, uid: &MigrationUid) -> Result<(), BrokerError> {
        self.with_list(uid, false, |l| {
            let mut first_err = None;
            let mut next = Vec::new();
            for r in &l.records {
                if r.restored {
                    next.push(r.clone());
                    continue;
                }
                if self.kernel.check_live(r.holder).is_err() {
                    self.stop_waiting(r.holder.pid, |w| *w == (r.holder.pid, r.address));
                    continue;
                }
                let a = r.address;
                match self.kernel.in_netns(r.holder.pid, move |ip| withdraw(ip, a)) {
                    Ok(()) => {
                        self.unsilence_withdrawn(r);
                        tracing::info!(%uid, address = %a, "adopted address withdrawn: its migration ended before the restored tree was moved");
                    }
                    Err(e) => {
                        first_err.get_or_insert(kerr(e));
                        next.push(r.clone());
                    }
                }
            }
            if let Err(j) = self.set_adoptions(uid, l, next) {
                first_err.get_or_insert(j);
            }
            first_err.map_or(Ok(()), Err)
        })
        .unwrap_or(Ok(()))
    }

    /// Whether `uid` is registered here, as a target, for `holder`.
    fn registered_for(&self, uid: &MigrationUid, holder: ProcRef) -> bool {
        self.map()
            .get(uid)
            .is_some_and(|e| e.role == BrokerRole::Target && e.process == holder)
    }

    /// Whether a TCP connection in `holder`'s network namespace still uses `a` as its
    /// local address (a socket in any state but listening, `TIME_WAIT` or closed). Not
    /// readable: counted as used.
    fn in_use(&self, holder: ProcRef, a: IpAddr) -> bool {
        use crate::procfs::{TCP_CLOSE, TCP_LISTEN, TCP_TIME_WAIT};
        match self.kernel.tcp_states(holder.pid) {
            Ok(socks) => socks
                .iter()
                .any(|(l, st)| *l == a && ![TCP_LISTEN, TCP_TIME_WAIT, TCP_CLOSE].contains(st)),
            Err(e) => {
                tracing::warn!(error = %e, address = %a, holder = holder.pid, "the holder's TCP sockets cannot be read: adopted address kept");
                true
            }
        }
    }

    /// One pass over every adoption: a record whose holder is gone (dead, or its pid
    /// reused) is dropped — its namespace went with it; past its deadline, or not
    /// restored and no longer registered (its lease ended, or a previous broker's), or
    /// restored with no connection using it any more, the address is withdrawn and the
    /// record dropped. A migration whose adoptions are busy (an op under way) is
    /// looked at in the next pass. The background thread ([`Broker::spawn_sweeper`]) runs
    /// it every `sweep_interval`; a starting broker runs it once.
    pub fn sweep(&self) {
        let lists: Vec<(MigrationUid, Arc<Mutex<List>>)> = locked(&self.handover.lists)
            .iter()
            .map(|(u, l)| (u.clone(), Arc::clone(l)))
            .collect();
        let now = self.kernel.unix_now();
        for (uid, arc) in lists {
            let mut l = match arc.try_lock() {
                Ok(l) => l,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => continue,
            };
            if l.gone {
                continue;
            }
            let mut next = Vec::new();
            for r in &l.records {
                if self.sweep_keeps(&uid, now, r) {
                    next.push(r.clone());
                }
            }
            if let Err(e) = self.set_adoptions(&uid, &mut l, next) {
                tracing::warn!(%uid, error = %e, "hand-over journal not updated; next sweep");
            }
            self.retire_if_empty(&uid, &arc, &mut l);
        }
    }

    /// The sweep of one adoption of `uid` at unix time `now`: whether its record stays
    /// (nothing to withdraw yet, or the withdrawal failed and the next sweep retries).
    fn sweep_keeps(&self, uid: &MigrationUid, now: u64, r: &Adoption) -> bool {
        let a = r.address;
        if self.kernel.check_live(r.holder).is_err() {
            tracing::info!(%uid, address = %a, holder = r.holder.pid, "adopted address forgotten: its holder is gone, and its network namespace with it");
            self.stop_waiting(r.holder.pid, |w| *w == (r.holder.pid, a));
            return false;
        }
        let Some(why) = self.why_withdrawn(uid, now, r) else {
            return true;
        };
        if let Err(e) = self
            .kernel
            .in_netns(r.holder.pid, move |ip| withdraw(ip, a))
        {
            tracing::warn!(%uid, address = %a, error = %e, "adopted address not withdrawn; next sweep");
            return true;
        }
        self.unsilence_withdrawn(r);
        match why {
            Why::Deadline => {
                tracing::warn!(%uid, address = %a, restored = r.restored, "adopted address withdrawn: its linger deadline passed (connections still using it lose it)")
            }
            Why::LeaseEnded => {
                tracing::info!(%uid, address = %a, "adopted address withdrawn: its migration ended before the restored tree was moved")
            }
            Why::ConnectionsEnded => {
                tracing::info!(%uid, address = %a, "adopted address withdrawn: moved connections ended")
            }
        }
        false
    }

    /// Why the sweep withdraws the live holder's adoption `r` of `uid` at `now`: past
    /// its deadline, not restored and no longer registered, or restored with no
    /// connection using it any more; `None`: it stays.
    fn why_withdrawn(&self, uid: &MigrationUid, now: u64, r: &Adoption) -> Option<Why> {
        if now >= r.deadline {
            Some(Why::Deadline)
        } else if !r.restored && !self.registered_for(uid, r.holder) {
            Some(Why::LeaseEnded)
        } else if r.restored && !self.in_use(r.holder, r.address) {
            Some(Why::ConnectionsEnded)
        } else {
            None
        }
    }

    /// Loads the adoptions a previous broker journalled (only records of a pod's
    /// process that parse; anything else is removed, never acted on). Its registrations
    /// ended with it: the sweep that follows withdraws what was not restored.
    pub(crate) fn load_adoptions(&self) {
        let dir = self.handover_dir();
        for (name, path) in self.kernel.read_dir(&dir) {
            let uid = MigrationUid::parse(&name).ok();
            let records = uid
                .as_ref()
                .and_then(|_| parse_journal_body(&self.kernel.read_file(&path)?));
            let (Some(uid), Some(records)) = (uid, records) else {
                tracing::warn!(file = %path.display(), "unreadable hand-over record removed");
                self.kernel.remove_file(&path);
                continue;
            };
            let n = records.len();
            let kept: Vec<Adoption> = records
                .into_iter()
                .filter(|r| self.a_pods_adoption(&uid, r))
                .collect();
            if kept.len() != n {
                let _ = self.write_adoptions(&uid, &kept);
            }
            if kept.is_empty() {
                continue;
            }
            {
                let mut claims = locked(&self.handover.claims);
                for r in &kept {
                    claims.entry(r.address).or_insert_with(|| uid.clone());
                }
            }
            tracing::warn!(%uid, addresses = kept.len(), "a previous broker left adopted addresses: sweeping them");
            let list = List {
                gone: false,
                records: kept,
            };
            locked(&self.handover.lists).insert(uid, Arc::new(Mutex::new(list)));
        }
    }

    /// A journalled adoption the broker may act on: an address that can be a pod's, of a
    /// live pod's process (as at registration: under the pods cgroup root, not in the
    /// node's network namespace). A holder gone since is dropped (its namespace went
    /// with it); anything else is ignored, never acted on.
    fn a_pods_adoption(&self, uid: &MigrationUid, r: &Adoption) -> bool {
        if self.kernel.check_live(r.holder).is_err() {
            tracing::info!(%uid, address = %r.address, pid = r.holder.pid, "journalled adoption dropped: its holder is gone");
            return false;
        }
        let in_pod = self
            .kernel
            .cgroup_of(r.holder.pid)
            .is_ok_and(|cg| crate::under_pods_root(&cg, &self.cfg.pods_cgroup_root))
            && self
                .kernel
                .netns_inode(r.holder.pid)
                .is_ok_and(|n| n != self.kernel.node_netns());
        if !in_pod || never_a_pods(r.address).is_some() {
            tracing::warn!(%uid, address = %r.address, pid = r.holder.pid, "hand-over record names no pod's address or process: ignored");
            return false;
        }
        true
    }

    /// Starts the background sweep: every `sweep_interval`, for as long as the broker
    /// lives ([`Broker::serve`] starts it).
    pub fn spawn_sweeper(self: &Arc<Self>) -> std::thread::JoinHandle<()> {
        let me = Arc::downgrade(self);
        let every = self.cfg.sweep_interval;
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(every);
                let Some(b) = me.upgrade() else { return };
                b.sweep();
            }
        })
    }

    /// The adoptions the broker holds, by migration (tests).
    pub fn adoptions(&self) -> BTreeMap<String, Vec<Adoption>> {
        let lists: Vec<(MigrationUid, Arc<Mutex<List>>)> = locked(&self.handover.lists)
            .iter()
            .map(|(u, l)| (u.clone(), Arc::clone(l)))
            .collect();
        lists
            .into_iter()
            .map(|(u, l)| (u.as_str().to_owned(), locked(&l).records.clone()))
            .filter(|(_, r)| !r.is_empty())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_and_contain_their_addresses_only() {
        let v4: Cidr = "198.18.0.0/15".parse().unwrap();
        assert!(v4.contains(ip("198.18.0.1")));
        assert!(v4.contains(ip("198.19.255.254")));
        assert!(!v4.contains(ip("198.20.0.1")));
        assert!(!v4.contains(ip("198.17.255.255")));
        assert!(!v4.contains(ip("::ffff:198.18.0.1")), "another family");
        let v6: Cidr = "2001:db8::/32".parse().unwrap();
        assert!(v6.contains(ip("2001:db8:ffff::1")));
        assert!(!v6.contains(ip("2001:db9::1")));
        assert!(!v6.contains(ip("198.18.0.1")));
        let host: Cidr = "10.213.1.10/32".parse().unwrap();
        assert!(host.contains(ip("10.213.1.10")) && !host.contains(ip("10.213.1.11")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("203.0.113.9")) && !all.contains(ip("::1")));
        let all6: Cidr = "::/0".parse().unwrap();
        assert!(all6.contains(ip("2001:db8::1")));
        let one6: Cidr = "2001:db8::5/128".parse().unwrap();
        assert!(one6.contains(ip("2001:db8::5")) && !one6.contains(ip("2001:db8::4")));
        assert_eq!(v4.to_string(), "198.18.0.0/15");
        assert_eq!(v6.to_string(), "2001:db8::/32");
    }

    #[test]
    fn invalid_cidrs_are_refused_naming_them() {
        for bad in [
            "198.18.0.0",
            "198.18.0.0/33",
            "2001:db8::/129",
            "198.18.1.0/15",
            "198.18.0.0/",
            "198.18.0.0/+8",
            "198.18.0.0/-1",
            "198.18.0.0/ 8",
            "/8",
            "x/8",
            "198.18.0/15",
            "2001:db8::1/32",
            "198.18.0.0/15/1",
            "fe80::%eth0/64",
        ] {
            let e = bad.parse::<Cidr>().expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
        let e = parse_cidrs("198.18.0.0/15, 10.0.0.0/33").unwrap_err();
        assert!(e.contains("10.0.0.0/33"), "{e}");
        assert_eq!(parse_cidrs("").unwrap(), []);
        assert_eq!(parse_cidrs(" , ").unwrap(), []);
        assert_eq!(
            parse_cidrs("198.18.0.0/15,2001:db8::/32,").unwrap(),
            [
                "198.18.0.0/15".parse().unwrap(),
                "2001:db8::/32".parse::<Cidr>().unwrap()
            ]
        );
    }

    #[test]
    fn addresses_that_are_never_a_pods_are_refused_whatever_the_cidrs() {
        let all = parse_cidrs("0.0.0.0/0,::/0").unwrap();
        for a in [
            "127.0.0.1",
            "127.9.9.9",
            "0.0.0.0",
            "224.0.0.1",
            "239.255.255.250",
            "169.254.1.1",
            "255.255.255.255",
            "::1",
            "::",
            "ff02::1",
            "fe80::1",
            "febf::1",
            "::ffff:198.18.0.5",
        ] {
            let e = check_address(&all, ip(a)).expect_err(a);
            assert_eq!(e.kind, ErrorKind::AddressNotAllowed, "{a}");
        }
        for a in ["198.18.0.5", "10.0.0.1", "2001:db8::5", "fec0::1"] {
            assert!(check_address(&all, ip(a)).is_ok(), "{a}");
        }
        let some = parse_cidrs("198.18.0.0/15").unwrap();
        let e = check_address(&some, ip("10.0.0.1")).unwrap_err();
        assert_eq!(e.kind, ErrorKind::AddressNotAllowed);
        assert!(e.message.contains("198.18.0.0/15"), "{e}");
        assert!(check_address(&some, ip("2001:db8::5")).is_err());
    }

    #[test]
    fn journal_bodies_round_trip_and_hostile_ones_are_refused() {
        let r = Adoption {
            holder: ProcRef {
                pid: 4242,
                start_time: 77,
            },
            address: ip("2001:db8::5"),
            link: "eth0".into(),
            deadline: 1_900_000_000,
            restored: true,
        };
        let v4 = Adoption {
            address: ip("198.18.2.20"),
            restored: false,
            ..r.clone()
        };
        let body = journal_body(&[r.clone(), v4.clone()]);
        assert_eq!(parse_journal_body(&body), Some(vec![r, v4]));
        for bad in [
            r#"{"adoptions":[{"pid":1,"start_time":1,"address":"198.18.0.1","link":"eth0","deadline":1,"restored":false}]}"#,
            r#"{"adoptions":[{"pid":9,"start_time":1,"address":"198.18.0.1/32","link":"eth0","deadline":1,"restored":false}]}"#,
            r#"{"adoptions":[{"pid":9,"start_time":1,"address":"198.18.0.1","link":"../x","deadline":1,"restored":false}]}"#,
            r#"{"adoptions":[{"pid":9,"start_time":1,"address":"198.18.0.1","link":"a b","deadline":1,"restored":false}]}"#,
            r#"{"adoptions":[{"pid":9,"start_time":1,"address":"198.18.0.1","link":"eth0","restored":false}]}"#,
            r#"{"adoptions":{}}"#,
            r#"[]"#,
            "garbage",
        ] {
            assert_eq!(parse_journal_body(bad.as_bytes()), None, "{bad}");
        }
    }
}
