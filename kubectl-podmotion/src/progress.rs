//! What `kubectl podmotion migrate` prints while a PodMigration runs, as pure functions
//! of its status: the lines that say what changed since the last status seen (phase,
//! pre-copy round, bytes, a Stalled or queued condition), the one line a terminal
//! rewrites in place, and the final report (downtime, network outcome, or the failure
//! reason and message). No I/O and no clock here, so every line is unit-tested.

use podmotion_api::PodMigration;
use podmotion_api::conditions::find;
use podmotion_api::migration::{MigrationPhase, NetworkOutcome, PodMigrationStatus};
use podmotion_api::names::condition_types::{RECONCILING, STALLED};

/// The parts of a status whose change is worth a line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub phase: MigrationPhase,
    pub iteration: i32,
    pub bytes_sent: i64,
    /// PostCopy: memory fetched after the resume.
    pub lazy_bytes: i64,
    /// `Stalled` (or queued) reason and message, while one is set.
    pub waiting: Option<String>,
    pub target_node: Option<String>,
}

impl Snapshot {
    pub fn of(status: &PodMigrationStatus) -> Snapshot {
        let p = status.progress.clone().unwrap_or_default();
        Snapshot {
            phase: status.phase,
            iteration: p.iteration,
            bytes_sent: p.bytes_sent,
            lazy_bytes: p.lazy_bytes.unwrap_or(0),
            waiting: waiting(status),
            target_node: status.target_node.clone(),
        }
    }
}

/// Why a migration that is not moving waits: a `Stalled=True` condition (no agent on
/// the node, no target fits, …) or a `Reconciling` reason of `Queued`.
pub fn waiting(status: &PodMigrationStatus) -> Option<String> {
    if status.phase.is_terminal() {
        return None;
    }
    if let Some(c) = find(&status.conditions, STALLED).filter(|c| c.status == "True") {
        return Some(format!("stalled: {}: {}", c.reason, c.message));
    }
    find(&status.conditions, RECONCILING)
        .filter(|c| c.status == "True" && c.reason == "Queued")
        .map(|c| format!("queued: {}", c.message))
}

/// Binary units, one decimal: `512 B`, `1.5 KiB`, `12.0 MiB`.
pub fn bytes(n: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n.max(0) as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{} B", n.max(0))
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// Round, bytes, rate and what is left, e.g.
/// `round 2, 12.0 MiB sent, 40.0 MiB/s, ~3.0 MiB left`. Empty when nothing moved yet.
pub fn transfer_summary(status: &PodMigrationStatus) -> String {
    let Some(p) = &status.progress else {
        return String::new();
    };
    let mut parts = vec![];
    if p.iteration > 0 {
        parts.push(format!("round {}", p.iteration));
    }
    if p.bytes_sent > 0 || p.iteration > 0 {
        parts.push(format!("{} sent", bytes(p.bytes_sent)));
    }
    if let Some(r) = p.transfer_rate_bytes_per_second.filter(|r| *r > 0) {
        parts.push(format!("{}/s", bytes(r)));
    }
    if let Some(left) = p.bytes_remaining_estimate.filter(|_| !parts.is_empty()) {
        parts.push(format!("~{} left", bytes(left)));
    }
    if let Some(lazy) = p.lazy_bytes.filter(|l| *l > 0) {
        parts.push(format!(
            "{} of memory fetched after the resume",
            bytes(lazy)
        ));
    }
    parts.join(", ")
}

/// Lines for what changed from `prev` (none before the first status) to `status`.
pub fn changes(prev: Option<&Snapshot>, status: &PodMigrationStatus) -> Vec<String> {
    let now = Snapshot::of(status);
    let mut out = vec![];
    let phase_changed = prev.is_none_or(|p| p.phase != now.phase);
    if phase_changed && !now.phase.is_terminal() {
        let mut line = format!("phase {:?}", now.phase);
        if let (Some(src), Some(dst)) = (&status.source_node, &status.target_node) {
            line.push_str(&format!(" ({src} -> {dst})"));
        }
        out.push(line);
    } else if prev.is_some_and(|p| p.target_node.is_none()) && now.target_node.is_some() {
        out.push(format!(
            "target node {}",
            now.target_node.as_deref().unwrap_or_default()
        ));
    }
    let moved = prev.is_none_or(|p| {
        p.iteration != now.iteration
            || p.bytes_sent != now.bytes_sent
            || p.lazy_bytes != now.lazy_bytes
    });
    if moved && !now.phase.is_terminal() {
        let t = transfer_summary(status);
        if !t.is_empty() {
            out.push(format!("  {t}"));
        }
    }
    if now.waiting != prev.and_then(|p| p.waiting.clone())
        && let Some(w) = &now.waiting
    {
        out.push(format!("  {w}"));
    }
    out
}

/// The line a terminal rewrites in place: phase, a bar when the remaining bytes are
/// known, and the transfer summary.
pub fn live_line(status: &PodMigrationStatus) -> String {
    let mut line = format!("[{:?}]", status.phase);
    if let Some(p) = &status.progress
        && let Some(left) = p.bytes_remaining_estimate
        && p.bytes_sent + left > 0
    {
        const WIDTH: i64 = 20;
        let done = (p.bytes_sent * WIDTH / (p.bytes_sent + left)).clamp(0, WIDTH);
        line.push_str(&format!(
            " [{}{}]",
            "#".repeat(done as usize),
            "-".repeat((WIDTH - done) as usize)
        ));
    }
    let t = transfer_summary(status);
    if !t.is_empty() {
        line.push(' ');
        line.push_str(&t);
    }
    if let Some(w) = waiting(status) {
        line.push_str(&format!(" ({w})"));
    }
    line
}

/// How a finished migration ended, for the exit code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Failed,
    Aborted,
}

impl Outcome {
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Succeeded => 0,
            Outcome::Failed => 1,
            Outcome::Aborted => 2,
        }
    }
}

/// `1 listener restored, 0 connections preserved, 1 closed, 0 reset`.
pub fn network_line(n: &NetworkOutcome) -> String {
    format!(
        "{} listener{} restored, {} connection{} preserved, {} closed, {} reset",
        n.listeners_restored,
        if n.listeners_restored == 1 { "" } else { "s" },
        n.connections_preserved,
        if n.connections_preserved == 1 {
            ""
        } else {
            "s"
        },
        n.connections_closed,
        n.connections_reset,
    )
}

/// Where the pod went, the downtime, the transfer and the network outcome of a
/// migration that succeeded (not a dry run).
fn succeeded_lines(pod: &str, s: &PodMigrationStatus) -> Vec<String> {
    let mut out = vec![format!(
        "Succeeded: pod {pod} moved from {} to {}{}",
        s.source_node.as_deref().unwrap_or("?"),
        s.target_node.as_deref().unwrap_or("?"),
        s.target_pod
            .as_deref()
            .map(|p| format!(" (now pod {p})"))
            .unwrap_or_default()
    )];
    out.push(match (&s.downtime, s.downtime_millis) {
        (Some(d), _) => format!("downtime: {d}"),
        (None, Some(ms)) => format!("downtime: {ms}ms"),
        (None, None) => "downtime: not measured".to_string(),
    });
    if let Some(line) = frozen_line(s) {
        out.push(line);
    }
    let t = transfer_summary(s);
    if !t.is_empty() {
        out.push(format!("transfer: {t}"));
    }
    if let Some(n) = &s.network {
        out.push(format!("network: {}", network_line(n)));
    }
    out
}

/// Every freeze of a migration whose pre-copy rounds also froze the pod (without
/// memory tracking each round stops it while CRIU collects its memory): the total and
/// each round's; `None` where the downtime was the only freeze.
fn frozen_line(s: &PodMigrationStatus) -> Option<String> {
    let warm: Vec<String> = s
        .freezes
        .iter()
        .filter(|f| !f.final_dump)
        .map(|f| format!("{}ms", f.frozen_millis))
        .collect();
    let total = s.total_frozen_millis?;
    (!warm.is_empty()).then(|| {
        format!(
            "frozen in all: {total}ms (the downtime and {} pre-copy round{}: {})",
            warm.len(),
            if warm.len() == 1 { "" } else { "s" },
            warm.join(", ")
        )
    })
}

/// The report of a migration in a terminal phase, or `None` while it runs.
pub fn final_report(m: &PodMigration) -> Option<(Outcome, Vec<String>)> {
    let s = m.status.as_ref()?;
    let name = m.metadata.name.as_deref().unwrap_or_default();
    let ns = m.metadata.namespace.as_deref().unwrap_or_default();
    let reason = || {
        format!(
            "reason: {}: {}",
            s.failure_reason.as_deref().unwrap_or("Unknown"),
            s.failure_message.as_deref().unwrap_or("(no message)")
        )
    };
    let mut out = vec![];
    let outcome = match s.phase {
        MigrationPhase::Succeeded if m.spec.dry_run => {
            out.push(format!(
                "dry run passed: {} can move from {} to {}; nothing was frozen",
                m.spec.pod_name,
                s.source_node.as_deref().unwrap_or("?"),
                s.target_node.as_deref().unwrap_or("?")
            ));
            Outcome::Succeeded
        }
        MigrationPhase::Succeeded => {
            out = succeeded_lines(&m.spec.pod_name, s);
            Outcome::Succeeded
        }
        MigrationPhase::Failed => {
            out.push(format!(
                "Failed: PodMigration {ns}/{name}; the source pod was resumed"
            ));
            out.push(reason());
            Outcome::Failed
        }
        MigrationPhase::Aborted => {
            out.push(format!(
                "Aborted: PodMigration {ns}/{name}; the source pod was resumed"
            ));
            out.push(reason());
            Outcome::Aborted
        }
        _ => return None,
    };
    Some((outcome, out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
    use k8s_openapi::jiff::Timestamp;
    use podmotion_api::migration::MigrationProgress;

    fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: None,
            last_transition_time: Time(Timestamp::UNIX_EPOCH),
        }
    }

    fn status(phase: MigrationPhase) -> PodMigrationStatus {
        PodMigrationStatus {
            phase,
            ..Default::default()
        }
    }

    fn progress(
        iteration: i32,
        sent: i64,
        rate: Option<i64>,
        left: Option<i64>,
    ) -> MigrationProgress {
        MigrationProgress {
            iteration,
            bytes_sent: sent,
            bytes_remaining_estimate: left,
            transfer_rate_bytes_per_second: rate,
            lazy_bytes: None,
            last_progress_time: None,
        }
    }

    fn migration(status: PodMigrationStatus, dry_run: bool) -> PodMigration {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "web-0-ab12c", "namespace": "shop"},
            "spec": {"podName": "web-0", "dryRun": dry_run},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn bytes_use_binary_units_with_one_decimal() {
        assert_eq!(bytes(0), "0 B");
        assert_eq!(bytes(1023), "1023 B");
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(12 * 1024 * 1024), "12.0 MiB");
        assert_eq!(bytes(-5), "0 B");
    }

    #[test]
    fn the_first_status_prints_its_phase() {
        assert_eq!(
            changes(None, &status(MigrationPhase::Pending)),
            ["phase Pending"]
        );
    }

    #[test]
    fn an_unchanged_status_prints_nothing() {
        let mut s = status(MigrationPhase::Transferring);
        s.progress = Some(progress(2, 1024, None, None));
        assert!(changes(Some(&Snapshot::of(&s)), &s).is_empty());
    }

    #[test]
    fn a_phase_change_names_both_nodes() {
        let prev = Snapshot::of(&status(MigrationPhase::Pending));
        let mut s = status(MigrationPhase::Preparing);
        s.source_node = Some("pm-real-0".into());
        s.target_node = Some("pm-real-1".into());
        assert_eq!(
            changes(Some(&prev), &s),
            ["phase Preparing (pm-real-0 -> pm-real-1)"]
        );
    }

    #[test]
    fn post_copy_pages_fetched_after_the_resume_print_as_they_grow() {
        let mut s = status(MigrationPhase::Restoring);
        s.progress = Some(progress(0, 300 * 1024, None, None));
        let prev = Snapshot::of(&s);
        assert!(changes(Some(&prev), &s).is_empty());
        s.progress.as_mut().unwrap().lazy_bytes = Some(48 * 1024 * 1024);
        assert_eq!(
            changes(Some(&prev), &s),
            ["  300.0 KiB sent, 48.0 MiB of memory fetched after the resume"]
        );
    }

    #[test]
    fn a_new_round_prints_bytes_rate_and_what_is_left() {
        let mut s = status(MigrationPhase::Checkpointing);
        s.progress = Some(progress(1, 8 * 1024 * 1024, None, None));
        let prev = Snapshot::of(&s);
        s.progress = Some(progress(
            2,
            12 * 1024 * 1024,
            Some(40 * 1024 * 1024),
            Some(3 * 1024 * 1024),
        ));
        assert_eq!(
            changes(Some(&prev), &s),
            ["  round 2, 12.0 MiB sent, 40.0 MiB/s, ~3.0 MiB left"]
        );
    }

    #[test]
    fn a_stalled_migration_says_why_once() {
        let mut s = status(MigrationPhase::Pending);
        s.conditions = vec![cond(
            STALLED,
            "True",
            "NoAgentOnNode",
            "no ready migration agent on node pm-real-0",
        )];
        let first = changes(Some(&Snapshot::of(&status(MigrationPhase::Pending))), &s);
        assert_eq!(
            first,
            ["  stalled: NoAgentOnNode: no ready migration agent on node pm-real-0"]
        );
        assert!(changes(Some(&Snapshot::of(&s)), &s).is_empty());
        assert!(
            live_line(&s)
                .ends_with("(stalled: NoAgentOnNode: no ready migration agent on node pm-real-0)")
        );
    }

    #[test]
    fn a_stalled_false_condition_is_not_a_wait() {
        let mut s = status(MigrationPhase::Pending);
        s.conditions = vec![cond(STALLED, "False", "Progressing", "fine")];
        assert_eq!(waiting(&s), None);
    }

    #[test]
    fn the_live_line_draws_a_bar_from_the_remaining_estimate() {
        let mut s = status(MigrationPhase::Transferring);
        s.progress = Some(progress(0, 3 * 1024, None, Some(1024)));
        assert_eq!(
            live_line(&s),
            "[Transferring] [###############-----] 3.0 KiB sent, ~1.0 KiB left"
        );
        assert_eq!(live_line(&status(MigrationPhase::Pending)), "[Pending]");
    }

    #[test]
    fn success_reports_downtime_and_network() {
        let mut s = status(MigrationPhase::Succeeded);
        s.source_node = Some("pm-real-0".into());
        s.target_node = Some("pm-real-1".into());
        s.target_pod = Some("web-0-x".into());
        s.downtime_millis = Some(620);
        s.downtime = Some("620ms".into());
        s.network = Some(NetworkOutcome {
            listeners_restored: 1,
            connections_preserved: 0,
            connections_closed: 2,
            connections_reset: 0,
        });
        let (o, lines) = final_report(&migration(s, false)).unwrap();
        assert_eq!(o, Outcome::Succeeded);
        assert_eq!(o.exit_code(), 0);
        assert_eq!(
            lines,
            [
                "Succeeded: pod web-0 moved from pm-real-0 to pm-real-1 (now pod web-0-x)",
                "downtime: 620ms",
                "network: 1 listener restored, 0 connections preserved, 2 closed, 0 reset",
            ]
        );
    }

    #[test]
    fn a_pre_copy_migration_reports_the_freezes_of_its_rounds_beside_the_downtime() {
        use podmotion_api::migration::{FreezeMeasure, MigrationFreeze};
        let freeze = |round, ms, final_dump| MigrationFreeze {
            round,
            final_dump,
            frozen_millis: ms,
            pages_written: None,
            bytes_written: None,
            measured_by: FreezeMeasure::Criu,
        };
        let mut s = status(MigrationPhase::Succeeded);
        s.downtime_millis = Some(612);
        s.freezes = vec![
            freeze(1, 450, false),
            freeze(2, 430, false),
            freeze(3, 380, true),
        ];
        s.total_frozen_millis = Some(1492);
        let (_, lines) = final_report(&migration(s.clone(), false)).unwrap();
        assert!(
            lines.contains(
                &"frozen in all: 1492ms (the downtime and 2 pre-copy rounds: 450ms, 430ms)"
                    .to_string()
            ),
            "{lines:?}"
        );
        // Cold: the downtime was the only freeze, said once.
        s.freezes = vec![freeze(1, 90, true)];
        s.total_frozen_millis = Some(612);
        let (_, lines) = final_report(&migration(s, false)).unwrap();
        assert!(!lines.iter().any(|l| l.starts_with("frozen")), "{lines:?}");
    }

    #[test]
    fn downtime_falls_back_to_the_millis_field() {
        let mut s = status(MigrationPhase::Succeeded);
        s.downtime_millis = Some(183);
        let (_, lines) = final_report(&migration(s, false)).unwrap();
        assert!(lines.contains(&"downtime: 183ms".to_string()), "{lines:?}");
    }

    #[test]
    fn failure_prints_reason_and_message_and_exits_non_zero() {
        let mut s = status(MigrationPhase::Failed);
        s.failure_reason = Some("ProbeFailed".into());
        s.failure_message = Some("tcp 9: connection refused".into());
        let (o, lines) = final_report(&migration(s, false)).unwrap();
        assert_ne!(o.exit_code(), 0);
        assert_eq!(
            lines,
            [
                "Failed: PodMigration shop/web-0-ab12c; the source pod was resumed",
                "reason: ProbeFailed: tcp 9: connection refused",
            ]
        );
        let (o, _) = final_report(&migration(status(MigrationPhase::Aborted), false)).unwrap();
        assert_ne!(o.exit_code(), 0);
    }

    #[test]
    fn a_dry_run_says_nothing_was_frozen() {
        let mut s = status(MigrationPhase::Succeeded);
        s.source_node = Some("a".into());
        s.target_node = Some("b".into());
        let (_, lines) = final_report(&migration(s, true)).unwrap();
        assert_eq!(
            lines,
            ["dry run passed: web-0 can move from a to b; nothing was frozen"]
        );
    }

    #[test]
    fn a_running_migration_has_no_final_report() {
        assert!(final_report(&migration(status(MigrationPhase::Restoring), false)).is_none());
    }
}
