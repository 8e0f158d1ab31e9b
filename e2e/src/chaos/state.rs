//! What the chaos run's tasks share: its names, its phase, its tally of counters and
//! findings, and the constants the steps agree on.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Everything must settle within this long after the last fault, and every deleted
/// object be gone within this long after its deletion.
pub(crate) const CONVERGENCE: Duration = Duration::from_secs(60);
/// The replicas' log filter (`PODMOTION_CHAOS_RUST_LOG` replaces it): every reconcile's
/// start and end, and every pause of a controller's watches, besides the usual.
pub(crate) const REPLICA_LOG: &str = "info,kube=warn,kube_runtime::utils::stream_backoff=debug,podmotion_operator::controllers::shell=debug";
/// How often the invariants are sampled during the run.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// The replicas' Lease duration (renewed every third of it).
pub(crate) const LEASE_SECONDS: u32 = 4;
pub(crate) const ATTACHED: [&str; 2] = ["attach-a", "attach-b"];
pub(crate) const POOLS: [&str; 2] = ["pool-a", "pool-b"];
pub(crate) const MIG_NODES: [&str; 2] = ["pm-node-0", "pm-node-1"];
pub(crate) const AGENT_POLICY: &str = "podmotion-node-agent-deny-ingress";
/// The Deployment whose one pod's process the live migrations move.
pub(crate) const LIVE: &str = "live";
/// The live workload's memory, and the transfer rate its migrations are held to (a
/// few seconds in flight: deletions land in every phase).
pub(crate) const LIVE_BALLAST_MIB: usize = 8;
pub(crate) const LIVE_BANDWIDTH: u64 = 4 << 20;
/// How often the live workload's processes are sampled.
pub(crate) const LIVE_SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// Counters and findings shared by the run's tasks.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) leader_kills: u64,
    pub(crate) kill_rounds_without_leader: u64,
    pub(crate) self_exits: Vec<String>,
    pub(crate) replica_starts: u64,
    pub(crate) api_restarts: u64,
    pub(crate) api_restart_secs: Vec<f64>,
    pub(crate) failovers: Vec<f64>,
    pub(crate) checks: u64,
    pub(crate) sample_rounds: u64,
    pub(crate) sample_rounds_skipped: u64,
    /// Each distinct violation and how many times it was seen.
    pub(crate) violations: BTreeMap<String, u64>,
    pub(crate) churn: BTreeMap<&'static str, u64>,
    pub(crate) driver_errors: u64,
    pub(crate) deleted: Vec<Deleted>,
    pub(crate) deletion_secs: Vec<f64>,
    /// Migration children seen by the sampler (target pods, transfer keys).
    pub(crate) seen_migration_children: BTreeSet<String>,
    /// Live migrations (a process moved by the process-level agents), by outcome.
    pub(crate) live_outcomes: BTreeMap<String, u64>,
    /// Live migrations under faults that moved the process, that rolled back after
    /// the run deleted them in flight, and that rolled back by themselves (failed).
    pub(crate) live_committed: u64,
    pub(crate) live_rolled_back_deleted: u64,
    pub(crate) live_rolled_back_failed: u64,
    /// How the live migration without faults (before them) ended.
    pub(crate) live_control: Option<String>,
    /// Live migrations deleted before they ended, by the phase they were deleted in.
    pub(crate) live_deleted_in: BTreeMap<String, u64>,
    /// Samples of the live workload's processes (exactly one copy, at most one running).
    pub(crate) live_process_samples: u64,
    /// Per-round checks of the live workload (one copy, where its pod is; counter
    /// monotonic and advancing; no checkpoint image left).
    pub(crate) live_round_checks: u64,
    /// Client connections the live workload still served after a round / reconnects.
    pub(crate) live_conn_kept: u64,
    pub(crate) live_conn_reopened: u64,
    /// From the last fault to the end of the live migration in flight then.
    pub(crate) live_settle_secs: Option<f64>,
}

/// A PodMotion object whose deletion the run requested.
pub(crate) struct Deleted {
    pub(crate) kind: &'static str,
    pub(crate) name: String,
    pub(crate) uid: String,
    pub(crate) at: Instant,
    pub(crate) gone: bool,
    pub(crate) reported: bool,
}

pub(crate) type Shared = Arc<Mutex<Tally>>;

pub(crate) fn violation(t: &Shared, v: String) {
    let mut t = t.lock().unwrap();
    let seen = t.violations.entry(v.clone()).or_default();
    if *seen == 0 {
        eprintln!("[chaos] VIOLATION: {v}");
    }
    *seen += 1;
}

pub(crate) fn record_deletion(tally: &Shared, kind: &'static str, name: String, uid: String) {
    tally.lock().unwrap().deleted.push(Deleted {
        kind,
        name,
        uid,
        at: Instant::now(),
        gone: false,
        reported: false,
    });
}

/// The run's namespaces and names.
#[derive(Clone)]
pub(crate) struct Names {
    pub(crate) sys: String,
    pub(crate) app: String,
    pub(crate) lease: String,
    pub(crate) dir: PathBuf,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Phase {
    Chaos,
    Settle,
    Stop,
}
