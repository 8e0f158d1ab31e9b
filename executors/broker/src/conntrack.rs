//! While a source's network is locked, the node forgets the connections to the
//! source's addresses that never got an answer, so that a client's next SYN is sent
//! where the Service points at that moment.
//!
//! Why: a connection a client opened through a Service while the source was frozen was
//! DNATed, at its first SYN, to the source's address by the node's conntrack; its SYN
//! was dropped at the locked link and its retransmissions (1 s apart on kernels since
//! 6.7, `tcp_syn_linear_timeouts`) follow that entry — to the source, even after the
//! Service's endpoints moved to the target. kube-proxy clears such entries for UDP
//! only. Deleting the entry (TCP `SYN_SENT`, reply from the source's address) makes the
//! next retransmission a new connection to the node's Service rules: once kube-proxy
//! programmed the switch, the target; before, the source again — dropped at the lock
//! as it would have been, and forgotten again. Nothing that could be answered is
//! touched: while the links are down nothing from the pod reaches the node, so every
//! such entry is one whose SYN was dropped.
//!
//! It runs from the lock to the unlock (a commit's unlock comes after the source pod's
//! deletion has been programmed by kube-proxy: the kill waits for the kubelet, about
//! 1.5 s, kube-proxy at most `minSyncPeriod`, 1 s by default). It stops at the unlock:
//! after a rollback the source answers its clients again, and an entry deleted between
//! a client's SYN and the source's answer would break that connection. Only an address
//! that does not move is swept: one the target adopts (the address hand-over) is where
//! the client's entry already points.
//!
//! Only this node's conntrack table: clients whose traffic is DNATed here (the node
//! itself, its pods). A client on another node keeps its entry (docs/broker-ops.md).

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::Broker;
use crate::handover::check_address;
use crate::os::Kernel;
pub use crate::os::{SWEEP_AT_MOST, SweepFlag};

/// How often the locked source's unanswered connections are forgotten.
pub const SWEEP_EVERY: Duration = Duration::from_millis(50);

/// A running sweep of a locked source: it stops when this is dropped (the unlock, the
/// registration's end).
#[derive(Debug)]
pub struct Sweep(SweepFlag);

impl Sweep {
    fn start() -> (Sweep, SweepFlag) {
        let f = SweepFlag(Arc::new(AtomicBool::new(true)));
        (Sweep(f.clone()), f)
    }
}

impl Drop for Sweep {
    fn drop(&mut self) {
        (self.0).0.store(false, Ordering::SeqCst);
    }
}

impl<K: Kernel> Broker<K> {
    /// The addresses of `pid`'s network namespace that do not move (none when they
    /// cannot be listed: logged, the lock goes on without the sweep).
    pub(crate) fn addresses_that_stay(&self, pid: i32) -> Vec<IpAddr> {
        let addrs = match self.pod_addresses(pid) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(pid, error = %e, "lock: the pod's addresses not listed, no unanswered connection forgotten");
                return Vec::new();
            }
        };
        addrs
            .into_iter()
            .filter(|a| !a.is_loopback())
            .filter(|a| {
                self.cfg.handover_cidrs.is_empty()
                    || check_address(&self.cfg.handover_cidrs, *a).is_err()
            })
            .collect()
    }

    /// Starts forgetting (in the background, until the returned [`Sweep`] is dropped)
    /// the node's unanswered connections to `staying` (see
    /// [`Broker::addresses_that_stay`]).
    pub(crate) fn forget_unanswered(&self, staying: Vec<IpAddr>) -> Option<Sweep> {
        if staying.is_empty() {
            return None;
        }
        let (sweep, flag) = Sweep::start();
        self.kernel.sweep_unanswered(staying, flag, SWEEP_EVERY);
        Some(sweep)
    }
}
