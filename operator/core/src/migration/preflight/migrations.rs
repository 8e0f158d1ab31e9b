//! This PodMigration and the others: who it is (for tie-breaks and names), which
//! migration of a pod goes first, and whether a concurrency slot is free for it.

use k8s_openapi::jiff::Timestamp;

/// Another PodMigration, as far as "one migration per pod" needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherMigration {
    pub name: String,
    pub pod_name: String,
    pub created: Timestamp,
    pub terminal: bool,
}

/// This PodMigration's identity (for tie-breaks and names), and the namespace of the
/// operator deciding it (whose pods are never moved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Me {
    pub name: String,
    pub uid: String,
    pub created: Timestamp,
    pub operator_namespace: String,
    /// The agents' namespace (migration agents and attach Jobs, with every tenant's
    /// checkpoints): its pods are never moved, and no exec probe runs there.
    pub agents_namespace: String,
    /// The installer enabled exec probes (`migration.execProbes.enabled`, the
    /// operator's `--migration-exec-probes`; it grants `pods/exec`).
    pub exec_probes: bool,
}

/// How many migrations may be past `Pending` at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub per_cluster: usize,
    pub per_source_node: usize,
}

/// Another migration, as far as the concurrency limits need it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotHolder {
    pub name: String,
    pub created: Timestamp,
    pub source_node: Option<String>,
    /// Past `Pending` and not terminal: it holds a slot.
    pub started: bool,
    /// `Pending` with `Migratable=True`: queued for a slot.
    pub queued: bool,
}

/// Whether `me` (migrating from `source_node`) may start now: the started migrations
/// plus the older queued ones (first come, first served) leave a slot in the cluster
/// and on the source node.
pub fn slot_available(me: &Me, source_node: &str, others: &[SlotHolder], limits: Limits) -> bool {
    let ahead: Vec<&SlotHolder> = others
        .iter()
        .filter(|o| o.name != me.name)
        .filter(|o| o.started || (o.queued && (o.created, &o.name) < (me.created, &me.name)))
        .collect();
    let on_node = ahead
        .iter()
        .filter(|o| o.source_node.as_deref() == Some(source_node))
        .count();
    ahead.len() < limits.per_cluster && on_node < limits.per_source_node
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::fixtures::{me, ts};

    #[test]
    fn concurrency_limits_count_started_migrations_and_older_queued_ones() {
        let limits = Limits {
            per_cluster: 5,
            per_source_node: 2,
        };
        let other = |name: &str, created: i64, node: &str, started: bool| SlotHolder {
            name: name.into(),
            created: ts(created),
            source_node: Some(node.into()),
            started,
            queued: !started,
        };
        // Two started from n0: n0 is full, n1 is not.
        let two_on_n0 = vec![other("a", 1, "n0", true), other("b", 2, "n0", true)];
        assert!(!slot_available(&me(), "n0", &two_on_n0, limits));
        assert!(slot_available(&me(), "n1", &two_on_n0, limits));
        // Five started across nodes: the cluster is full.
        let five: Vec<_> = (0..5)
            .map(|i| other(&format!("m{i}"), 1, &format!("x{i}"), true))
            .collect();
        assert!(!slot_available(&me(), "n1", &five, limits));
        // An older queued migration from n0 goes first; a younger one does not count.
        let older = vec![other("a", 1, "n0", true), other("early", 50, "n0", false)];
        assert!(!slot_available(&me(), "n0", &older, limits));
        let younger = vec![other("a", 1, "n0", true), other("late", 500, "n0", false)];
        assert!(slot_available(&me(), "n0", &younger, limits));
        // Itself never counts.
        let itself = vec![
            other("move-web", 100, "n0", true),
            other("a", 1, "n0", true),
        ];
        assert!(slot_available(&me(), "n0", &itself, limits));
    }
}
