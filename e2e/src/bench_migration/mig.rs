//! The PodMigration side's pieces: the PodMigration object, its figures from its status
//! and the agents' log lines, and the `--timeline` of one migration.

use std::time::Duration;

use anyhow::Context;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use podmotion_api::PodMigration;
use podmotion_api::migration::{FreezeMeasure, PodMigrationStatus};
use serde_json::json;

use super::figures::{Mig, Mode, WarmStalls};
use crate::from_json;
use crate::real::kubectl;

/// `key=value` or `"key":value` in a log line.
fn log_field(line: &str, key: &str) -> Option<u64> {
    for pat in [format!("{key}="), format!("\"{key}\":")] {
        if let Some(i) = line.find(&pat) {
            let rest = &line[i + pat.len()..];
            let digits: String = rest
                .trim_start_matches('"')
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            return digits.parse().ok();
        }
    }
    None
}

/// Generous bounds of one PodMigration (`spec`; the largest pods take minutes), and how
/// long the bench waits for its end.
const DEADLINE_S: u64 = 900;
const PROGRESS_TIMEOUT_S: u64 = 600;
pub(super) const MIGRATION_WAIT: Duration = Duration::from_secs(DEADLINE_S + 120);

/// The PodMigration `name` of `pod` to the node `to` in `mode`.
pub(super) fn migration(name: &str, pod: &Pod, to: &str, mode: Mode) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod.name_any(), "targetNode": to, "mode": mode.name(),
            "freezeBudgetMillis": 600000, "deadlineSeconds": DEADLINE_S,
            "progressTimeoutSeconds": PROGRESS_TIMEOUT_S,
            "probe": {"tcpSocket": {"port": 8080}}}
    }))
}

/// The migration's figures from its status and the agents' log lines of its final
/// dump and its restore.
pub(super) fn mig_of(
    from: String,
    to: String,
    st: &PodMigrationStatus,
    dumped: Option<String>,
    restored: Option<String>,
) -> anyhow::Result<Mig> {
    let progress = st.progress.clone().unwrap_or_default();
    let downtime_ms = st.downtime_millis.context("status.downtimeMillis")?;
    let warm = warm_stalls(st);
    Ok(Mig {
        from,
        to,
        downtime_ms,
        total_frozen_ms: st.total_frozen_millis.unwrap_or(downtime_ms + warm.sum_ms),
        warm,
        bytes_sent: progress.bytes_sent,
        lazy_bytes: progress.lazy_bytes,
        iterations: progress.iteration,
        final_dump_ms: dumped.as_deref().and_then(|l| log_field(l, "dump_ms")),
        final_dump_bytes: dumped.as_deref().and_then(|l| log_field(l, "bytes")),
        restore_ms: restored.as_deref().and_then(|l| log_field(l, "restore_ms")),
        total_s: whole_migration_s(st),
    })
}

/// The pre-copy rounds' freezes the status records (the final dump's is part of the
/// downtime).
fn warm_stalls(st: &PodMigrationStatus) -> WarmStalls {
    let warm = st.freezes.iter().filter(|f| !f.final_dump);
    WarmStalls {
        count: warm.clone().count(),
        sum_ms: warm.clone().map(|f| f.frozen_millis).sum(),
        agent_clock: warm
            .clone()
            .any(|f| f.measured_by == FreezeMeasure::AgentClock),
    }
}

/// Creation of the PodMigration to its final phase, as `phaseTransitionTimestamps` say.
fn whole_migration_s(st: &PodMigrationStatus) -> i64 {
    let stamps = &st.phase_transition_timestamps;
    match (stamps.first(), stamps.last()) {
        (Some(a), Some(b)) => (b.time.0 - a.time.0).get_seconds(),
        _ => 0,
    }
}

/// The operator's and both migration agents' log lines that name the migration (by name
/// or uid), merged in the order of their kubelet timestamps, to stderr.
pub(super) fn print_timeline(agents_ns: &str, name: &str, uid: &str) {
    // The release's namespace is the agents' without its suffix (`helm_install`).
    let op_ns = agents_ns.strip_suffix("-agents").unwrap_or(agents_ns);
    let mut lines: Vec<String> = [
        (
            agents_ns,
            "app.kubernetes.io/component=migration-agent",
            "agent",
        ),
        (op_ns, "app.kubernetes.io/component=operator", "operator"),
    ]
    .iter()
    .flat_map(|(ns, selector, container)| {
        pod_logs(
            ns,
            selector,
            container,
            &["--timestamps", "--prefix", "--tail=4000"],
        )
        .lines()
        .filter(|l| l.contains(uid) || l.contains(name))
        .map(str::to_owned)
        .collect::<Vec<_>>()
    })
    .collect();
    // `--prefix` puts `[pod/<name>/<container>] ` before the timestamp.
    lines.sort_by_key(|l| {
        l.split_once("] ")
            .map_or(String::new(), |(_, t)| t.to_owned())
    });
    eprintln!("timeline of {name} ({uid}):");
    for l in lines {
        eprintln!("  {l}");
    }
}

/// The first line of the migration agents' logs (their last 2,000 lines) about the
/// migration `uid` that contains each of `what`.
pub(super) fn agent_log_lines<const N: usize>(
    agents_ns: &str,
    uid: &str,
    what: [&str; N],
) -> [Option<String>; N] {
    let logs = pod_logs(
        agents_ns,
        "app.kubernetes.io/component=migration-agent",
        "agent",
        &["--tail=2000"],
    );
    what.map(|what| {
        logs.lines()
            .find(|l| l.contains(uid) && l.contains(what))
            .map(str::to_owned)
    })
}

/// `kubectl logs` of `container` in the pods of `ns` that `selector` picks, with `flags`.
fn pod_logs(ns: &str, selector: &str, container: &str, flags: &[&str]) -> String {
    let mut args = vec!["-n", ns, "logs", "-l", selector, "-c", container];
    args.extend_from_slice(flags);
    String::from_utf8_lossy(&kubectl(&args).stdout).into_owned()
}
