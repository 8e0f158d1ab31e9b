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
        let addrs = match self.kernel.in_netns(pid, |ip| {
            Ok(crate::addr_lines(&ip.ip(&["-o", "addr", "show"])?)
                .into_iter()
                .filter(|l| !l.v6 || l.global)
                .filter_map(|l| l.address().parse::<IpAddr>().ok())
                .collect::<Vec<_>>())
        }) {
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

/// `conntrack` arguments deleting the TCP connections to `addr` that never got an
/// answer (the reply direction's source is the DNAT target, `addr`).
pub fn delete_args(addr: IpAddr) -> Vec<String> {
    let family = if addr.is_ipv4() { "ipv4" } else { "ipv6" };
    [
        "-D",
        "-f",
        family,
        "-p",
        "tcp",
        "--reply-src",
        &addr.to_string(),
        "--state",
        "SYN_SENT",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The count `conntrack -D` reports on stderr (`… 3 flow entries have been deleted.`).
pub fn deleted_count(stderr: &str) -> u32 {
    stderr
        .lines()
        .find_map(|l| {
            let rest = l.strip_suffix(" flow entries have been deleted.")?;
            rest.rsplit(' ').next()?.parse().ok()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delete_names_the_family_the_reply_source_and_syn_sent() {
        assert_eq!(
            delete_args("198.18.0.5".parse().unwrap()).join(" "),
            "-D -f ipv4 -p tcp --reply-src 198.18.0.5 --state SYN_SENT"
        );
        assert_eq!(
            delete_args("2001:db8::5".parse().unwrap()).join(" "),
            "-D -f ipv6 -p tcp --reply-src 2001:db8::5 --state SYN_SENT"
        );
    }

    #[test]
    fn the_deleted_count_is_read_from_conntracks_report() {
        assert_eq!(
            deleted_count(
                "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted.\n"
            ),
            2
        );
        assert_eq!(
            deleted_count(
                "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"
            ),
            0
        );
        assert_eq!(deleted_count("conntrack: something else\n"), 0);
    }
}
