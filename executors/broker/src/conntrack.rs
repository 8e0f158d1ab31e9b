//! After the source's network comes back (`unlock_network`: a commit, or a rollback),
//! the node forgets the connections to the source's addresses that never got an
//! answer, for a few seconds, so that a client's next SYN is sent where the Service
//! points now.
//!
//! Why: a connection a client opened through a Service while the source was frozen was
//! DNATed, at its first SYN, to the source's address by the node's conntrack; its SYN
//! was dropped at the locked link and its retransmissions (1 s, then 3 s after the
//! first) follow that entry — to the source, which the commit kills, even after the
//! Service's endpoints moved to the target. kube-proxy clears such entries for UDP
//! only. Deleting the entry (TCP `SYN_SENT`, reply from the source's address) makes the
//! next retransmission a new connection to the node's Service rules: once kube-proxy
//! programmed the switch, the target; before, the source again (no worse than
//! keeping it). Only an address that does not move is swept: one the target adopts
//! (the address hand-over) is where the client's entry already points.
//!
//! Only this node's conntrack table: clients whose traffic is DNATed here (the node
//! itself, its pods). A client on another node keeps its entry (docs/broker-ops.md).

use std::net::IpAddr;
use std::time::Duration;

use crate::Broker;
use crate::handover::check_address;
use crate::os::Kernel;

/// How long the node forgets unanswered connections after an unlock: past the SYN
/// retransmission (1 s) of a connection opened at the freeze, and kube-proxy's
/// programming of the endpoint switch (at most once a second).
pub const SWEEP_FOR: Duration = Duration::from_secs(3);

/// How often within [`SWEEP_FOR`].
pub const SWEEP_EVERY: Duration = Duration::from_millis(50);

impl<K: Kernel> Broker<K> {
    /// Starts forgetting (in the background, [`SWEEP_FOR`]) the node's unanswered
    /// connections to the addresses of `pid`'s network namespace that do not move.
    /// Failures are logged, never returned: the unlock itself succeeded.
    pub(crate) fn forget_unanswered(&self, pid: i32) {
        let addrs = match self.pod_addresses(pid) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(pid, error = %e, "unlock: the pod's addresses not listed, no unanswered connection forgotten");
                return;
            }
        };
        let staying: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|a| !a.is_loopback())
            .filter(|a| {
                self.cfg.handover_cidrs.is_empty()
                    || check_address(&self.cfg.handover_cidrs, *a).is_err()
            })
            .collect();
        if !staying.is_empty() {
            self.kernel
                .sweep_unanswered(staying, SWEEP_FOR, SWEEP_EVERY);
        }
    }
}
