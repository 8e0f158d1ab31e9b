//! Forwarding a locked source's new connections to its restored target (issue 39,
//! "what a client sees").
//!
//! Without the address hand-over the source pod's address does not move. Between the
//! commit's two endpoint changes (target in, source out) kube-proxy keeps sending a
//! share of the Service's new connections to the source for up to its `minSyncPeriod`
//! (1 s): their SYNs are dropped at the locked links and retransmitted a second (then
//! three seconds) later. Once the operator has proven the target (its probe passed) it
//! asks the source's broker (`forward_connections`) to send those connections to the
//! target instead, in the node's network namespace, with one nftables table of the
//! migration's own, `inet podmotion-fwd-<uid>`:
//!
//! - `prerouting` and `output`, type nat, priority -110 (ahead of kube-proxy's dstnat
//!   at -100: the first NAT binding of a connection is the one it keeps): a new TCP
//!   connection to one of the source pod's addresses (clients on other nodes, whose own
//!   kube-proxy already picked the source) is DNATed to the target's address of that
//!   family, same port; a new TCP connection to a Service address and port whose
//!   endpoints list the source (clients on this node: the node itself, its pods) is
//!   DNATed to the target's address and endpoint port before kube-proxy could pick the
//!   source.
//! - `postrouting`, type nat, priority 90: a connection first sent to the source's
//!   address and now going to the target is masqueraded, so the target's answers come
//!   back through this node, whose conntrack gives them the source's address again (the
//!   client's node expects the answer from there).
//!
//! Only new connections: an established one keeps its binding. The lock's conntrack
//! sweep ([`crate::conntrack`]) deletes the unanswered entries to the source every
//! 50 ms, so a retransmitted SYN is a new connection and meets these rules.
//!
//! The source's addresses are the broker's own reading at the lock (those that stay:
//! an address the hand-over moves needs no forward); the client names only the target's
//! addresses and the Services' ports, all checked to be unicast addresses and real
//! ports. The table is journalled (`<run>/netns/.forward/<uid>`) before it is added and
//! the record removed only once it is gone, so a broker that starts again deletes every
//! table its predecessor left ([`Broker::recover_forwards`]); the table's name is the
//! migration's, so deleting it touches nothing else. It ends with `stop_forwarding`,
//! the unlock, the kill and the registration's end (forget, a lost lease).

use crate::handover::never_a_pods;
use crate::{Broker, State, err, kerr};
use podmotion_wire::broker::{BrokerError, ErrorKind, ForwardedService, Reply};
use podmotion_wire::ids::MigrationUid;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;

use crate::os::Kernel;
use crate::synhold::{self, End, Held, Hold};

/// The Services a lock's hold names: the forward's own check of Service addresses
/// (never one that is never a pod's or a Service's), before anything is locked.
pub(crate) fn check_held_services(services: &[ForwardedService]) -> Result<(), BrokerError> {
    check(&[], services, &[])
}

/// Where the forwarding rules go relative to kube-proxy's (nat, dstnat = -100).
pub const DNAT_PRIORITY: i32 = -110;
/// The masquerade of forwarded connections (nat, srcnat = 100).
pub const SNAT_PRIORITY: i32 = 90;

/// The nftables table (family `inet`) of migration `uid`'s forward.
pub fn table_name(uid: &MigrationUid) -> String {
    format!("podmotion-fwd-{}", uid.as_str())
}

/// What one forward sends where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forward {
    /// The source pod's addresses (the broker's reading).
    pub sources: Vec<IpAddr>,
    /// The target pod's addresses, one per family at most.
    pub targets: Vec<IpAddr>,
    pub services: Vec<ForwardedService>,
}

impl Forward {
    fn target_of(&self, a: IpAddr) -> Option<IpAddr> {
        self.targets
            .iter()
            .copied()
            .find(|t| t.is_ipv4() == a.is_ipv4())
    }

    /// The DNAT rules, one a line (the same in `prerouting` and `output`).
    fn dnat_rules(&self) -> Vec<String> {
        let fam = |a: IpAddr| if a.is_ipv4() { "ip" } else { "ip6" };
        let at = |a: IpAddr, port: Option<u16>| match (a, port) {
            (IpAddr::V4(v), Some(p)) => format!("{v}:{p}"),
            (IpAddr::V6(v), Some(p)) => format!("[{v}]:{p}"),
            (a, None) => a.to_string(),
        };
        let mut out = Vec::new();
        for s in &self.sources {
            if let Some(t) = self.target_of(*s) {
                let f = fam(*s);
                out.push(format!(
                    "{f} daddr {s} meta l4proto tcp ct state new dnat {f} to {}",
                    at(t, None)
                ));
            }
        }
        for svc in &self.services {
            if let Some(t) = self.target_of(svc.address) {
                let f = fam(svc.address);
                out.push(format!(
                    "{f} daddr {} tcp dport {} ct state new dnat {f} to {}",
                    svc.address,
                    svc.port,
                    at(t, Some(svc.target_port))
                ));
            }
        }
        out
    }

    /// The masquerade rules of connections first sent to a source address.
    fn snat_rules(&self) -> Vec<String> {
        self.sources
            .iter()
            .filter_map(|s| {
                let t = self.target_of(*s)?;
                let f = if s.is_ipv4() { "ip" } else { "ip6" };
                Some(format!(
                    "ct original {f} daddr {s} {f} daddr {t} meta l4proto tcp masquerade"
                ))
            })
            .collect()
    }

    /// Whether the forward has any rule (none: no address of a family the target has).
    pub fn is_empty(&self) -> bool {
        self.dnat_rules().is_empty()
    }
}

/// The `nft -f` script that replaces table `table` by `f`'s rules, atomically (one
/// transaction: the table is declared, deleted and written again).
pub fn ruleset(table: &str, f: &Forward) -> String {
    let mut s = delete_script(table);
    let _ = writeln!(s, "table inet {table} {{");
    for (chain, hook, prio, rules) in [
        ("prerouting", "prerouting", DNAT_PRIORITY, f.dnat_rules()),
        ("output", "output", DNAT_PRIORITY, f.dnat_rules()),
        ("postrouting", "postrouting", SNAT_PRIORITY, f.snat_rules()),
    ] {
        let _ = writeln!(s, "\tchain {chain} {{");
        let _ = writeln!(
            s,
            "\t\ttype nat hook {hook} priority {prio}; policy accept;"
        );
        for r in rules {
            let _ = writeln!(s, "\t\t{r}");
        }
        let _ = writeln!(s, "\t}}");
    }
    let _ = writeln!(s, "}}");
    s
}

/// The `nft -f` script that deletes table `table`, whether or not it exists.
pub fn delete_script(table: &str) -> String {
    format!("table inet {table}\ndelete table inet {table}\n")
}

/// Checks the client's part of a forward: the target's addresses and the Services'.
fn check(
    targets: &[IpAddr],
    services: &[ForwardedService],
    sources: &[IpAddr],
) -> Result<(), BrokerError> {
    let named = targets
        .iter()
        .map(|a| ("target", *a))
        .chain(services.iter().map(|s| ("service", s.address)));
    for (what, a) in named {
        if let Some(why) = never_a_pods(a) {
            return Err(err(
                ErrorKind::AddressNotAllowed,
                format!("{what} address {a} is {why}: never forwarded to or from"),
            ));
        }
        if sources.contains(&a) {
            return Err(err(
                ErrorKind::AddressNotAllowed,
                format!("{what} address {a} is the source pod's own"),
            ));
        }
    }
    Ok(())
}

impl<K: Kernel> Broker<K> {
    fn forward_dir(&self) -> PathBuf {
        self.cfg.run_dir.join("netns").join(".forward")
    }

    /// `forward_connections`: the migration's table set to forward to `targets` (see
    /// the module docs). Journalled before it is added; a failure leaves no table.
    pub(crate) fn forward_connections(
        &self,
        uid: &MigrationUid,
        s: &mut State,
        targets: &[IpAddr],
        services: &[ForwardedService],
    ) -> Result<Reply, BrokerError> {
        if !self.cfg.forward_new_connections {
            return Err(err(
                ErrorKind::ForwardOff,
                "forwarding new connections is off on this node (--forward-new-connections)",
            ));
        }
        // Only a source whose copy the target was asked to restore (the fence): the
        // operator asks once that copy passed its probe.
        if s.locked.is_none() || s.killed || !s.fenced {
            return Err(err(
                ErrorKind::NotLocked,
                format!("{uid}: no locked, fenced source whose connections to forward"),
            ));
        }
        check(targets, services, &s.staying)?;
        let f = Forward {
            sources: s.staying.clone(),
            targets: targets.to_vec(),
            services: services.to_vec(),
        };
        let table = table_name(uid);
        self.kernel
            .journal_write(&self.forward_dir(), uid.as_str(), table.as_bytes())?;
        s.forwarding = true;
        let script = ruleset(&table, &f);
        if let Err(e) = self.kernel.in_node_netns(move |ip| ip.nft(&script)) {
            // Nothing half-done stays: the transaction failed whole, and the journal
            // record goes once the table is surely gone.
            let _ = self.end_forward(uid, s);
            return Err(kerr(e));
        }
        tracing::info!(%uid, rules = f.dnat_rules().len(), "new connections to the locked source go to its target");
        // The DNAT is in: the SYNs held since the lock meet it.
        self.end_hold(uid, s, End::Release);
        Ok(Reply::Done)
    }

    /// Deletes the migration's forward, if any: the journal record goes only once the
    /// table is gone (a failure leaves both, for a retry, the registration's end or a
    /// restart).
    pub(crate) fn end_forward(&self, uid: &MigrationUid, s: &mut State) -> Result<(), BrokerError> {
        if !s.forwarding {
            return Ok(());
        }
        let script = delete_script(&table_name(uid));
        self.kernel
            .in_node_netns(move |ip| ip.nft(&script))
            .map_err(kerr)?;
        self.kernel
            .remove_file(&self.forward_dir().join(uid.as_str()));
        s.forwarding = false;
        Ok(())
    }

    /// [`Broker::end_forward`] where nothing can be refused (the unlock, the kill, the
    /// registration's end): a failure is logged; the record stays for a restart.
    pub(crate) fn end_forward_logged(&self, uid: &MigrationUid, s: &mut State) {
        if let Err(e) = self.end_forward(uid, s) {
            tracing::warn!(%uid, error = %e, "forward of new connections not removed yet");
        }
    }

    fn hold_dir(&self) -> PathBuf {
        self.cfg.run_dir.join("netns").join(".hold")
    }

    /// At the lock, with forwarding on: new connections to the source's staying
    /// addresses and to `services` wait in a queue of the node's ([`crate::synhold`])
    /// instead of being dropped at the locked links. Its chain is journalled
    /// (`<run>/netns/.hold/<uid>`) before it is added, so a broker that starts again
    /// removes what its predecessor left, and only that (nodes sharing a network
    /// namespace each have their own). A hold that cannot start is logged and the lock
    /// goes on without it (the clients retransmit, as before).
    pub(crate) fn hold_new_connections(
        &self,
        uid: &MigrationUid,
        staying: &[IpAddr],
        services: &[ForwardedService],
    ) -> Option<Hold> {
        if !self.cfg.forward_new_connections {
            return None;
        }
        let held = Held {
            addresses: staying.to_vec(),
            services: services.iter().map(|s| (s.address, s.port)).collect(),
        };
        if held.addresses.is_empty() && held.services.is_empty() {
            return None;
        }
        let chain = synhold::chain_name(uid);
        let started = self
            .kernel
            .journal_write(&self.hold_dir(), uid.as_str(), chain.as_bytes())
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|()| self.kernel.hold_syns(chain, held));
        match started {
            Ok(h) => {
                tracing::info!(%uid, "lock: new connections to the source wait in the node's queue");
                Some(h)
            }
            Err(e) => {
                self.kernel.remove_file(&self.hold_dir().join(uid.as_str()));
                tracing::warn!(%uid, error = %e, "lock: new connections not held (dropped at the lock, retransmitted)");
                None
            }
        }
    }

    /// Ends the migration's hold, if any: its SYNs released or dropped; its record
    /// goes once its chain did.
    pub(crate) fn end_hold(&self, uid: &MigrationUid, s: &mut State, how: End) {
        let Some(h) = s.hold.take() else {
            return;
        };
        match h.end(how) {
            Ok(n) => {
                self.kernel.remove_file(&self.hold_dir().join(uid.as_str()));
                tracing::info!(%uid, ?how, released = n, "hold of new connections ended");
            }
            Err(e) => {
                tracing::warn!(%uid, ?how, error = %e, "hold of new connections ended badly; its record stays for a restart")
            }
        }
    }

    /// At start: removes the hold chains a previous broker process recorded.
    pub(crate) fn recover_holds(&self) {
        for (name, path) in self.kernel.read_dir(&self.hold_dir()) {
            let chain = self
                .kernel
                .read_file(&path)
                .and_then(|b| String::from_utf8(b).ok())
                .filter(|c| {
                    MigrationUid::parse(&name).is_ok_and(|u| *c == synhold::chain_name(&u))
                });
            let Some(chain) = chain else {
                // A temporary file of an interrupted write, or nothing of ours.
                self.kernel.remove_file(&path);
                continue;
            };
            match self.kernel.remove_hold(&chain) {
                Ok(()) => {
                    self.kernel.remove_file(&path);
                    tracing::warn!(%chain, "a previous broker left this hold of new connections: removed");
                }
                Err(e) => {
                    tracing::warn!(%chain, error = %e, "a previous broker's hold not removed yet")
                }
            }
        }
    }

    /// At start: deletes every forward table a previous broker process recorded.
    /// Returns the migrations whose table was deleted.
    pub(crate) fn recover_forwards(&self) -> Vec<String> {
        let mut done = Vec::new();
        for (name, path) in self.kernel.read_dir(&self.forward_dir()) {
            let Ok(uid) = MigrationUid::parse(&name) else {
                // A temporary file of an interrupted write, or nothing of ours.
                self.kernel.remove_file(&path);
                continue;
            };
            let script = delete_script(&table_name(&uid));
            match self.kernel.in_node_netns(move |ip| ip.nft(&script)) {
                Ok(_) => {
                    self.kernel.remove_file(&path);
                    tracing::warn!(%uid, "a previous broker left this forward of new connections: removed");
                    done.push(name);
                }
                Err(e) => {
                    tracing::warn!(%uid, error = %e, "a previous broker's forward not removed yet")
                }
            }
        }
        done
    }
}
