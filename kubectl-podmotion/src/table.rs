//! `kubectl podmotion status`: one row per PodMigration, NodeAgentAttachment and
//! RunnerPool, and an ATTENTION column that says what needs a person — a `Stalled=True`
//! condition, a `Ready=False` that is not just work in progress, a migration that
//! ended `Failed` or `Aborted`, a RunnerPool node that failed preflight. Pure: rows
//! come from the typed objects, the table is plain aligned text.

use podmotion_api::conditions::{Condition, find};
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::condition_types::{READY, RECONCILING, STALLED};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};

/// One line of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub namespace: String,
    /// `kind/name` with the short name (`pmig/web-0-ab12c`).
    pub name: String,
    pub state: String,
    pub detail: String,
    /// Empty when nothing needs attention.
    pub attention: String,
}

/// What the kstatus conditions say needs attention: `Stalled=True`, or `Ready=False`
/// while not `Reconciling=True` (a resource at rest that is not ready).
pub fn condition_attention(conditions: &[Condition]) -> Option<String> {
    if let Some(c) = find(conditions, STALLED).filter(|c| c.status == "True") {
        return Some(format!("Stalled: {}: {}", c.reason, c.message));
    }
    let reconciling = find(conditions, RECONCILING).is_some_and(|c| c.status == "True");
    find(conditions, READY)
        .filter(|c| c.status == "False" && !reconciling)
        .map(|c| format!("not Ready: {}: {}", c.reason, c.message))
}

fn ns(meta: &kube::api::ObjectMeta) -> String {
    meta.namespace.clone().unwrap_or_default()
}

pub fn migration_row(m: &PodMigration) -> Row {
    let s = m.status.clone().unwrap_or_default();
    let mut detail = format!("pod {}", m.spec.pod_name);
    match (&s.source_node, &s.target_node) {
        (Some(a), Some(b)) => detail.push_str(&format!(" {a} -> {b}")),
        (None, Some(b)) => detail.push_str(&format!(" -> {b}")),
        _ => {}
    }
    if let Some(d) = &s.downtime {
        detail.push_str(&format!(", downtime {d}"));
    }
    // Pre-copy rounds froze the pod too: their freezes and the downtime together.
    if let Some(t) = s
        .total_frozen
        .as_ref()
        .filter(|_| s.freezes.iter().any(|f| !f.final_dump))
    {
        detail.push_str(&format!(", frozen {t} in all"));
    }
    if m.spec.dry_run {
        detail.push_str(" (dry run)");
    }
    let attention = match s.phase {
        MigrationPhase::Failed | MigrationPhase::Aborted => format!(
            "{:?}: {}: {}",
            s.phase,
            s.failure_reason.as_deref().unwrap_or("Unknown"),
            s.failure_message.as_deref().unwrap_or("(no message)")
        ),
        MigrationPhase::Succeeded => String::new(),
        _ => condition_attention(&s.conditions).unwrap_or_default(),
    };
    let mut state = format!("{:?}", s.phase);
    if m.metadata.deletion_timestamp.is_some() && !s.phase.is_terminal() {
        state.push_str(" (aborting)");
    }
    Row {
        namespace: ns(&m.metadata),
        name: format!("pmig/{}", m.metadata.name.as_deref().unwrap_or_default()),
        state,
        detail,
        attention,
    }
}

pub fn attachment_row(a: &NodeAgentAttachment) -> Row {
    let s = a.status.clone().unwrap_or_default();
    let state = if s.total_targets == 0 && s.conditions.is_empty() {
        "Pending".to_string()
    } else {
        format!("{}/{} agents ready", s.ready_targets, s.total_targets)
    };
    let mut detail = format!(
        "{}/{}, mode {}",
        a.spec.workload_ref.kind.as_str(),
        a.spec.workload_ref.name,
        a.spec.mode.as_str()
    );
    if !s.skipped.is_empty() {
        detail.push_str(&format!(", {} pod(s) skipped", s.skipped.len()));
    }
    Row {
        namespace: ns(&a.metadata),
        name: format!("naa/{}", a.metadata.name.as_deref().unwrap_or_default()),
        state,
        detail,
        attention: condition_attention(&s.conditions).unwrap_or_default(),
    }
}

pub fn runner_pool_row(p: &RunnerPool) -> Row {
    let s = p.status.clone().unwrap_or_default();
    let mut attention = condition_attention(&s.conditions).unwrap_or_default();
    if !s.preflight_failures.is_empty() {
        let nodes: Vec<String> = s
            .preflight_failures
            .iter()
            .map(|f| format!("{} ({})", f.node, f.checks.join(",")))
            .collect();
        let line = format!("preflight failed on {}", nodes.join(", "));
        attention = if attention.is_empty() {
            line
        } else {
            format!("{attention}; {line}")
        };
    }
    Row {
        namespace: ns(&p.metadata),
        name: format!("rp/{}", p.metadata.name.as_deref().unwrap_or_default()),
        state: format!("{}/{} nodes ready", s.ready_nodes, s.desired_nodes),
        detail: format!("{} sessions", s.session_capacity),
        attention,
    }
}

/// Aligned columns, a header, rows sorted by namespace then name; the last column is
/// not padded so long messages stay whole.
pub fn render(rows: &[Row]) -> String {
    let mut rows = rows.to_vec();
    rows.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let header = ["NAMESPACE", "NAME", "STATE", "DETAIL", "ATTENTION"];
    let cells: Vec<[String; 5]> = std::iter::once(header.map(String::from))
        .chain(rows.iter().map(|r| {
            // Every cell comes from the cluster: sanitised (`crate::sanitize`).
            [
                r.namespace.as_str(),
                &r.name,
                &r.state,
                &r.detail,
                if r.attention.is_empty() {
                    "-"
                } else {
                    &r.attention
                },
            ]
            .map(|c| crate::sanitize(c).into_owned())
        }))
        .collect();
    let mut width = [0usize; 4];
    for c in &cells {
        for (i, w) in width.iter_mut().enumerate() {
            *w = (*w).max(c[i].chars().count());
        }
    }
    let mut out = String::new();
    for c in &cells {
        for (i, w) in width.iter().enumerate() {
            out.push_str(&format!("{:<w$}   ", c[i], w = *w));
        }
        out.push_str(&c[4]);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pmig(status: serde_json::Value) -> PodMigration {
        serde_json::from_value(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "web-0-ab12c", "namespace": "shop"},
            "spec": {"podName": "web-0"},
            "status": status,
        }))
        .unwrap()
    }

    fn cond(t: &str, s: &str, reason: &str, message: &str) -> serde_json::Value {
        json!({"type": t, "status": s, "reason": reason, "message": message,
               "lastTransitionTime": "2026-12-02T00:00:00Z"})
    }

    #[test]
    fn a_succeeded_migration_needs_nothing() {
        let r = migration_row(&pmig(json!({
            "phase": "Succeeded", "sourceNode": "pm-real-0", "targetNode": "pm-real-1",
            "downtime": "620ms",
            "conditions": [cond("Ready", "True", "Succeeded", "done")]
        })));
        assert_eq!(r.name, "pmig/web-0-ab12c");
        assert_eq!(r.state, "Succeeded");
        assert_eq!(r.detail, "pod web-0 pm-real-0 -> pm-real-1, downtime 620ms");
        assert_eq!(r.attention, "");
    }

    #[test]
    fn a_pre_copy_migration_shows_all_its_freezes_beside_the_downtime() {
        let freezes = json!([
            {"round": 1, "frozenMillis": 450, "measuredBy": "CRIU"},
            {"round": 2, "finalDump": true, "frozenMillis": 90, "measuredBy": "CRIU"}
        ]);
        let r = migration_row(&pmig(json!({
            "phase": "Succeeded", "downtime": "620ms", "freezes": freezes,
            "totalFrozenMillis": 1070, "totalFrozen": "1070ms"
        })));
        assert_eq!(r.detail, "pod web-0, downtime 620ms, frozen 1070ms in all");
        let cold = migration_row(&pmig(json!({
            "phase": "Succeeded", "downtime": "620ms",
            "freezes": [{"round": 1, "finalDump": true, "frozenMillis": 90, "measuredBy": "CRIU"}],
            "totalFrozenMillis": 620, "totalFrozen": "620ms"
        })));
        assert_eq!(
            cold.detail, "pod web-0, downtime 620ms",
            "the downtime was the only freeze"
        );
    }

    #[test]
    fn a_failed_migration_shows_its_reason() {
        let r = migration_row(&pmig(json!({
            "phase": "Failed", "failureReason": "ProbeFailed", "failureMessage": "refused"
        })));
        assert_eq!(r.attention, "Failed: ProbeFailed: refused");
    }

    #[test]
    fn a_stalled_migration_shows_the_condition_message() {
        let r = migration_row(&pmig(json!({
            "phase": "Pending",
            "conditions": [
                cond("Ready", "False", "NoAgentOnNode", "no agent on pm-real-0"),
                cond("Stalled", "True", "NoAgentOnNode", "no agent on pm-real-0"),
            ]
        })));
        assert_eq!(r.attention, "Stalled: NoAgentOnNode: no agent on pm-real-0");
    }

    #[test]
    fn a_status_that_carries_terminal_controls_prints_them_escaped() {
        let r = migration_row(&pmig(json!({
            "phase": "Failed", "failureReason": "ProbeFailed",
            "failureMessage": "refused\x1b[2K\rSucceeded \u{9b}0m"
        })));
        let out = render(&[r]);
        assert!(!out.chars().any(|c| c.is_control() && c != '\n'), "{out:?}");
        assert!(
            out.contains("refused\\x1b[2K\\x0dSucceeded \\u{9b}0m"),
            "{out}"
        );
        assert_eq!(out.lines().count(), 2, "a header and one row: {out}");
    }

    #[test]
    fn work_in_progress_is_not_attention() {
        let c = vec![
            serde_json::from_value(cond("Ready", "False", "Transferring", "moving")).unwrap(),
            serde_json::from_value(cond("Reconciling", "True", "Transferring", "moving")).unwrap(),
        ];
        assert_eq!(condition_attention(&c), None);
        let c = vec![
            serde_json::from_value(cond("Ready", "False", "JobFailed", "agent exited")).unwrap(),
        ];
        assert_eq!(
            condition_attention(&c).as_deref(),
            Some("not Ready: JobFailed: agent exited")
        );
    }

    #[test]
    fn an_attachment_row_counts_agents() {
        let a: NodeAgentAttachment = serde_json::from_value(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
            "metadata": {"name": "tap", "namespace": "shop"},
            "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept",
                     "ports": [{"port": 8080}]},
            "status": {"readyTargets": 1, "totalTargets": 2,
                       "skipped": [{"pod": "web-x", "reason": "HostNetwork"}],
                       "conditions": [cond("Stalled", "True", "AgentImageMissing", "set attachment.agentImage")]}
        }))
        .unwrap();
        let r = attachment_row(&a);
        assert_eq!(r.name, "naa/tap");
        assert_eq!(r.state, "1/2 agents ready");
        assert_eq!(r.detail, "Deployment/web, mode Intercept, 1 pod(s) skipped");
        assert_eq!(
            r.attention,
            "Stalled: AgentImageMissing: set attachment.agentImage"
        );
    }

    #[test]
    fn the_table_is_aligned_and_sorted() {
        let rows = vec![
            Row {
                namespace: "b".into(),
                name: "pmig/x".into(),
                state: "Pending".into(),
                detail: "pod x".into(),
                attention: "Stalled: A: b".into(),
            },
            Row {
                namespace: "a".into(),
                name: "rp/longer-name".into(),
                state: "1/1 nodes ready".into(),
                detail: "4 sessions".into(),
                attention: String::new(),
            },
        ];
        let t = render(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(
            lines[0].starts_with("NAMESPACE   NAME             STATE"),
            "{t}"
        );
        assert!(
            lines[1].starts_with("a           rp/longer-name   1/1 nodes ready"),
            "{t}"
        );
        assert!(lines[1].ends_with("   -"), "{t}");
        assert!(lines[2].ends_with("Stalled: A: b"), "{t}");
        // Columns line up: ATTENTION starts at the same offset on every line.
        let at = lines[0].find("ATTENTION").unwrap();
        assert_eq!(&lines[2][at..], "Stalled: A: b");
    }
}
