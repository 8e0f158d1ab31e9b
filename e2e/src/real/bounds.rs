//! What a migration's clients may see (issue 39): the bounds the real-node tests hold
//! the clients of [`super::copies::Clients`] to, beside the migration's downtime.

use std::time::Duration;

use podmotion_api::migration::PodMigrationStatus;

use super::copies::{CONNECT_TIMEOUT, Clients, jump_back};

/// What the clients of a migration's Service may see, beside its `status.downtime`
/// (issue 39): the most gap past the downtime, the most failed reads of the client on
/// fresh connections, and whether the held connection must go on (and within which gap).
#[derive(Clone, Copy, Debug)]
pub struct ClientBound {
    pub gap: GapRule,
    pub failures: usize,
    pub held: Option<GapRule>,
}

impl ClientBound {
    /// Failed requests allowed after a migration of `downtime`: `failures`, and one
    /// more when the gap this bound allows passes the client's [`CONNECT_TIMEOUT`]: a
    /// SYN the source's lock holds is let go at the forward, so a connection opened at
    /// the lock can wait as long as the gap, and past its connect timeout no hold saves
    /// it. With the defaults' + 700 ms that is a downtime over 2.3 s. (Until 2026-12-07
    /// the forward waited for the probe's and the commit's passes, ≈ 1 s more under
    /// load, and one failure was allowed from a downtime of 1 s: PreCopy migrations of
    /// 1,423, 1,927 and 2,087 ms beside other migrations each had one connect time out.)
    pub fn failures_after(&self, downtime: Duration) -> usize {
        self.failures + usize::from(self.gap.most(downtime).0 > CONNECT_TIMEOUT)
    }
}

/// How long a client may go without an answer, given the migration's downtime.
#[derive(Clone, Copy, Debug)]
pub enum GapRule {
    /// At most the downtime and this.
    PastDowntime(Duration),
    /// At most twice (the downtime and this), and [`MIN_RTO`]: what a held connection's
    /// request sent as the freeze began may wait. Nothing answers it until the copy
    /// does, and the client's kernel sends it again only on its retransmission timer,
    /// which starts at [`MIN_RTO`] or more and doubles each time (RFC 6298); the first
    /// of those sendings after the copy answers at `t` comes before `2t + MIN_RTO`.
    Retransmitted(Duration),
}

/// Linux's least retransmission timeout (`TCP_RTO_MIN`, 200 ms).
pub const MIN_RTO: Duration = Duration::from_millis(200);

impl GapRule {
    /// The longest gap this rule allows after a migration of `downtime`, and a line
    /// saying how it was reckoned.
    pub fn most(&self, downtime: Duration) -> (Duration, String) {
        match *self {
            GapRule::PastDowntime(slack) => (
                downtime + slack,
                format!(
                    "the downtime {} ms + {} ms",
                    downtime.as_millis(),
                    slack.as_millis()
                ),
            ),
            GapRule::Retransmitted(slack) => (
                (downtime + slack) * 2 + MIN_RTO,
                format!(
                    "twice the downtime {} ms + {} ms, + {} ms (the client's retransmission timer)",
                    downtime.as_millis(),
                    slack.as_millis(),
                    MIN_RTO.as_millis()
                ),
            ),
        }
    }
}

/// With the chart's defaults (the pod address does not move; `migration.forwardNewConnections`
/// on): no failed request and a gap of at most the downtime + 700 ms, as the issue
/// asks, counted from just before the PodMigration is created ([`Clients::serving`]).
/// Once the target is restored and before the source's pod is handed over, the
/// source's node DNATs every new connection to the source's address (and the
/// Service's ClusterIP) to the target (`forward_connections`, docs/broker-ops.md), and
/// a SYN sent during the freeze waits in the source node's queue until then (the
/// lock's hold): docs/benchmarks.md, "What a client sees", run 8, gaps of the downtime
/// plus 129–188 ms (before the hold, run 7, the SYN's retransmission 1 s later: plus
/// 622–796 ms).
pub const DEFAULTS_BOUND: ClientBound = ClientBound {
    gap: GapRule::PastDowntime(Duration::from_millis(700)),
    failures: 0,
    held: None,
};

/// With the address hand-over on (`migrationAgent.broker.addressHandover.cidrs`): no
/// failed request and the held connection goes on, as the issue asks. The issue's gap
/// (the downtime + 300 ms) is what the benchmark holds over ≥ 10 rounds
/// (docs/benchmarks.md, "What a client sees", run 9: fresh connections the downtime +
/// 131–170 ms in 20 of 20); this one sample per run allows + 500 ms, because the first
/// migration on a just-started cluster once came to + 279 ms (2026-12-07, downtime 720
/// ms), too close to + 300 for a check that must not fail on one noisy round. The held
/// connection's gap is its kernel's retransmission's ([`GapRule::Retransmitted`]): it
/// mostly goes on within ± 15 ms of the downtime (run 9: p50 − 11 ms), but a request
/// whose sendings all fell in the freeze waits for the next doubling of the timer (run
/// 9's max + 512 ms; CI of 2026-12-07, + 565 ms at a downtime of 1,167 ms).
pub const HANDOVER_BOUND: ClientBound = ClientBound {
    gap: GapRule::PastDowntime(Duration::from_millis(500)),
    failures: 0,
    held: Some(GapRule::Retransmitted(Duration::from_millis(500))),
};

/// Stops `clients` once they answer again after the migration whose final status is
/// `st`, prints what each saw beside its downtime, and checks `bound`: the fresh
/// connections' client within it, the held connection gone on if the bound says so.
/// Panics with the figures otherwise.
pub async fn assert_clients(
    clients: Clients,
    st: &PodMigrationStatus,
    bound: ClientBound,
    what: &str,
) {
    let mut clients = clients;
    let timeline = clients.timeline.take();
    let (fresh, held) =
        tokio::task::spawn_blocking(move || clients.finish_after(Duration::from_millis(500)))
            .await
            .expect("the clients' thread");
    let downtime = Duration::from_millis(st.downtime_millis.unwrap_or(0).max(0) as u64);
    eprintln!(
        "{what}: downtime {} ms; fresh connections: {}; held connection: {}",
        downtime.as_millis(),
        fresh.summary(),
        held.summary()
    );
    if let Some(t) = timeline {
        eprintln!(
            "{what}: the timeline (ms on the clients' clock):\n{}",
            t.render()
        );
    }
    if let Err(e) = fresh.within_failing(bound.gap.most(downtime), bound.failures_after(downtime)) {
        panic!("{what}: the client on fresh connections: {e}");
    }
    if let Some((i, a, b)) = jump_back(&held.values) {
        panic!("{what}: the held client: two copies served: read {i} saw {a}, then {b}");
    }
    if let Some(rule) = bound.held {
        assert!(
            held.ends.is_empty() && held.failures.is_empty(),
            "{what}: the held connection did not go on: {}",
            held.summary()
        );
        if let Err(e) = held.within(rule.most(downtime)) {
            panic!("{what}: the held connection: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::real::copies::{ClientView, FAILED_REQUEST_WAIT};

    fn view(gap_ms: u64, failures: usize) -> ClientView {
        ClientView {
            values: vec![1, 2],
            answers: 2,
            gap: Duration::from_millis(gap_ms),
            gap_from: Duration::ZERO,
            failures: (0..failures)
                .map(|_| (Duration::ZERO, "read: timed out".into()))
                .collect(),
            ends: vec![],
        }
    }

    #[test]
    fn an_allowed_failed_request_may_add_its_timeout_to_the_gap_and_no_more() {
        let most =
            || GapRule::PastDowntime(Duration::from_millis(2500)).most(Duration::from_millis(487));
        // The rehearsal's run: one failed read, a gap of downtime + 3,073 ms.
        assert!(view(3560, 1).within_failing(most(), 1).is_ok());
        // Without a failure the same gap is past the bound.
        let e = view(3560, 0).within_failing(most(), 1).unwrap_err();
        assert!(e.contains("past the downtime 487 ms + 2500 ms"), "{e}");
        // With one, no more than its timeout.
        let over = 487 + 2500 + FAILED_REQUEST_WAIT.as_millis() as u64 + 1;
        let e = view(over, 1).within_failing(most(), 1).unwrap_err();
        assert!(e.contains("for the 1 failed request(s)' timeout"), "{e}");
        // A failure past the allowance fails whatever the gap.
        assert!(view(100, 2).within_failing(most(), 1).is_err());
    }

    #[test]
    fn the_bounds_are_the_issues_past_the_downtime() {
        let ms = Duration::from_millis;
        let (most, how) = DEFAULTS_BOUND.gap.most(ms(415));
        assert_eq!(most, ms(1115), "{how}");
        assert!(view(1115, 0).within_failing((most, how.clone()), 0).is_ok());
        let e = view(1116, 0).within_failing((most, how), 0).unwrap_err();
        assert!(e.contains("past the downtime 415 ms + 700 ms"), "{e}");
        assert_eq!(HANDOVER_BOUND.gap.most(ms(415)).0, ms(915));
        // The held connection: its retransmission's doubling, from CI's + 565 ms at a
        // downtime of 1,167 ms (allowed: 2 × 1,667 + 200 ms).
        let held = HANDOVER_BOUND
            .held
            .expect("the hand-over's held connection goes on");
        let (most, how) = held.most(ms(1167));
        assert_eq!(most, ms(3534), "{how}");
        assert!(view(1732, 0).within((most, how.clone())).is_ok());
        let e = view(3535, 0).within((most, how)).unwrap_err();
        assert!(e.contains("twice the downtime 1167 ms + 500 ms"), "{e}");
        // No failed request unless the gap allowed outlasts the client's connect
        // timeout.
        assert_eq!(DEFAULTS_BOUND.failures_after(ms(2300)), 0);
        assert_eq!(DEFAULTS_BOUND.failures_after(ms(2301)), 1);
        assert_eq!(HANDOVER_BOUND.failures_after(ms(2500)), 0);
        // No failed request, and the held connection goes on with the hand-over.
        assert_eq!((DEFAULTS_BOUND.failures, HANDOVER_BOUND.failures), (0, 0));
        assert!(DEFAULTS_BOUND.held.is_none());
    }
}
