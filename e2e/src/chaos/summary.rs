//! The chaos run's summary table.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::ProxyStats;
use super::opts::Opts;
use super::state::{Shared, Tally};

/// What the run measured besides its tally: the proxy's counters, how long the
/// baseline took to settle, convergence after the last fault (`None`: it did not
/// converge), and how long the faults lasted.
pub struct Measured {
    pub proxy: Arc<ProxyStats>,
    pub baseline: Option<Duration>,
    pub conv: Option<Duration>,
    pub faults_secs: Duration,
}

/// Prints the summary table and the findings; whether the run found no violation.
pub(crate) fn print_summary(o: &Opts, tally: &Shared, m: &Measured, started: Instant) -> bool {
    let t = tally.lock().unwrap();
    print_faults(o, &t, m);
    print_churn(&t);
    print_live(o, &t);
    print_checks(&t);
    print_times(&t, m, started);
    for e in &t.self_exits {
        println!("self-exit: {e}");
    }
    for (v, times) in &t.violations {
        println!("VIOLATION (seen {times}x): {v}");
    }
    t.violations.is_empty()
}

/// The faults by kind, the proxy's traffic, the replicas.
fn print_faults(o: &Opts, t: &Tally, m: &Measured) {
    let Measured {
        proxy, faults_secs, ..
    } = m;
    let conflicts = proxy.conflicts.load(Ordering::Relaxed);
    let throttles = proxy.throttles.load(Ordering::Relaxed);
    let total = t.leader_kills + conflicts + throttles + t.api_restarts;
    println!();
    println!(
        "chaos run: {} ({} s of faults, write fault share {}‰, seed {})",
        if o.long { "long" } else { "short" },
        faults_secs.as_secs(),
        o.share_per_mille,
        o.seed
    );
    println!("{:<44} {:>8}", "fault", "count");
    println!("{:<44} {:>8}", "leader SIGKILLed", t.leader_kills);
    println!(
        "{:<44} {:>8}",
        "write answered 409 Conflict (proxy)", conflicts
    );
    println!(
        "{:<44} {:>8}",
        "write answered 429 Too Many Requests (proxy)", throttles
    );
    println!("{:<44} {:>8}", "API server restarted", t.api_restarts);
    println!("{:<44} {:>8}", "total faults", total);
    println!(
        "{:<44} {:>8}",
        "writes forwarded",
        proxy.writes_forwarded.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "reads/watches forwarded",
        proxy.reads_forwarded.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "proxy: API server unreachable (503)",
        proxy.upstream_errors.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "replicas started (after the first two)", t.replica_starts
    );
    println!(
        "{:<44} {:>8}",
        "replicas that exited by themselves",
        t.self_exits.len()
    );
    println!(
        "{:<44} {:>8}",
        "kill rounds without a live leader (retried)", t.kill_rounds_without_leader
    );
}

/// The churn's changes, the migrations' children seen, the live migrations' outcomes.
fn print_churn(t: &Tally) {
    for (what, c) in &t.churn {
        println!("{:<44} {:>8}", format!("churn: {what}"), c);
    }
    println!(
        "{:<44} {:>8}",
        "migration target pods seen",
        t.seen_migration_children
            .iter()
            .filter(|c| c.starts_with("target pod"))
            .count()
    );
    println!(
        "{:<44} {:>8}",
        "migration transfer keys seen",
        t.seen_migration_children
            .iter()
            .filter(|c| c.starts_with("transfer-key"))
            .count()
    );
    for (what, c) in &t.live_outcomes {
        println!("{:<44} {:>8}", format!("live migration: {what}"), c);
    }
    for (at, c) in &t.live_deleted_in {
        println!(
            "{:<44} {:>8}",
            format!("live migration deleted in phase {at}"),
            c
        );
    }
}

/// The live migrations' counts (or that they were skipped).
fn print_live(o: &Opts, t: &Tally) {
    if o.live {
        println!(
            "{:<44} {:>8}",
            "live migration without faults (live-0)",
            t.live_control.as_deref().unwrap_or("-")
        );
        println!(
            "{:<44} {:>8}",
            "live under faults: committed / rolled back",
            format!(
                "{} / {}",
                t.live_committed,
                t.live_rolled_back_deleted + t.live_rolled_back_failed
            )
        );
        println!(
            "{:<44} {:>8}",
            "  rolled back: deleted in flight / failed",
            format!(
                "{} / {}",
                t.live_rolled_back_deleted, t.live_rolled_back_failed
            )
        );
        println!(
            "{:<44} {:>8}",
            "live: client connection kept / reopened",
            format!("{} / {}", t.live_conn_kept, t.live_conn_reopened)
        );
        println!(
            "{:<44} {:>8}",
            "live: process samples (one copy, ≤1 running)", t.live_process_samples
        );
        println!(
            "{:<44} {:>8}",
            "live: per-round checks (copy, counter, images)", t.live_round_checks
        );
        println!(
            "{:<44} {:>8}",
            "live: last migration ended after last fault (s)",
            t.live_settle_secs
                .map(|s| format!("{s:.1}"))
                .unwrap_or_else(|| "-".into())
        );
    } else {
        println!("live migrations: skipped (--no-live-migrations or PODMOTION_ROOT_TESTS=0)");
    }
}

/// What was checked, and what was found.
fn print_checks(t: &Tally) {
    println!(
        "{:<44} {:>8}",
        "churn writes failed (API server away)", t.driver_errors
    );
    println!(
        "{:<44} {:>8}",
        "sampled rounds (skipped: API away)",
        format!("{} ({})", t.sample_rounds, t.sample_rounds_skipped)
    );
    println!(
        "{:<44} {:>8}",
        "invariant checks",
        t.checks + t.live_process_samples + t.live_round_checks
    );
    println!("{:<44} {:>8}", "violations (distinct)", t.violations.len());
}

/// How long things took: failovers, deletions, the API server's restart, settling.
fn print_times(t: &Tally, m: &Measured, started: Instant) {
    let Measured { baseline, conv, .. } = m;
    println!(
        "{:<44} {:>8}",
        "failover after a kill: median / max (s)",
        format!("{:.1} / {:.1}", median(&t.failovers), max(&t.failovers))
    );
    println!(
        "{:<44} {:>8}",
        "deletion latency: median / max (s)",
        format!(
            "{:.1} / {:.1}",
            median(&t.deletion_secs),
            max(&t.deletion_secs)
        )
    );
    if !t.api_restart_secs.is_empty() {
        println!(
            "{:<44} {:>8}",
            "API server restart took (s)",
            format!("{:.1}", max(&t.api_restart_secs))
        );
    }
    println!(
        "{:<44} {:>8}",
        "baseline settled in (s)",
        format!("{:.1}", baseline.unwrap_or_default().as_secs_f64())
    );
    println!(
        "{:<44} {:>8}",
        "converged after the last fault in (s)",
        conv.map(|d| format!("{:.1}", d.as_secs_f64()))
            .unwrap_or_else(|| "NO".into())
    );
    println!(
        "{:<44} {:>8}",
        "run length (s)",
        started.elapsed().as_secs()
    );
}

fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn max(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(0.0, f64::max)
}
