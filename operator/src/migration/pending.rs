//! The facts of a `Pending` migration, gathered from the cluster's objects: the load
//! on every node, the other PodMigrations (one migration per pod, first come first
//! served), and the concurrency slot. Pure: the controller hands in what it read, and
//! [`evaluate`] returns the pre-flight verdict and whether a slot is free.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::{Resource, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::condition_types;

use super::machine::Preflight;
use super::preflight::{
    self, Limits, Me, NodeFacts, OtherMigration, PodFacts, Resources, SlotHolder,
};

/// Requested resources of the non-terminal `pods`, summed per node.
pub fn requested_by_node(pods: &[Pod]) -> BTreeMap<String, Resources> {
    let mut requested: BTreeMap<String, Resources> = BTreeMap::new();
    for p in pods {
        if let Some(n) = p.spec.as_ref().and_then(|s| s.node_name.clone()) {
            let r = requested.entry(n).or_default();
            *r = r.plus(preflight::pod_requests(p));
        }
    }
    requested
}

/// Every node's facts, with its load and whether a Ready agent serves it.
pub fn node_facts(
    nodes: &[Node],
    requested: &BTreeMap<String, Resources>,
    has_agent: impl Fn(&str) -> bool,
) -> Vec<NodeFacts> {
    nodes
        .iter()
        .map(|n| {
            let name = n.name_any();
            NodeFacts::from_node(
                n,
                requested.get(&name).copied().unwrap_or_default(),
                has_agent(&name),
            )
        })
        .collect()
}

fn created(m: &PodMigration) -> Timestamp {
    m.meta()
        .creation_timestamp
        .as_ref()
        .map_or(Timestamp::now(), |t| t.0)
}

/// The verdict for `pm` and whether a concurrency slot is free for it, given its
/// source pod, the nodes and every PodMigration the controller knows.
pub fn evaluate(
    pm: &PodMigration,
    source: Option<&Pod>,
    nodes: &[NodeFacts],
    all: &[PodMigration],
    limits: Limits,
) -> (Preflight, bool) {
    let ns = pm.namespace();
    let others: Vec<OtherMigration> = all
        .iter()
        .filter(|m| m.namespace() == ns)
        .map(|m| OtherMigration {
            name: m.name_any(),
            pod_name: m.spec.pod_name.clone(),
            created: created(m),
            terminal: m.status.as_ref().is_some_and(|st| st.phase.is_terminal()),
        })
        .collect();
    let me = Me {
        name: pm.name_any(),
        uid: pm.uid().unwrap_or_default(),
        created: created(pm),
    };
    let facts = source.map(PodFacts::from_pod);
    let verdict = preflight::preflight(&pm.spec, &me, facts.as_ref(), nodes, &others);
    let slot = match &verdict {
        Preflight::Migratable(plan) => {
            let me_slot = Me {
                name: qualified(pm),
                ..me
            };
            let holders: Vec<SlotHolder> = all.iter().map(slot_holder).collect();
            preflight::slot_available(&me_slot, &plan.source_node, &holders, limits)
        }
        Preflight::NotMigratable { .. } => true,
    };
    (verdict, slot)
}

fn qualified(m: &PodMigration) -> String {
    format!("{}/{}", m.namespace().unwrap_or_default(), m.name_any())
}

fn slot_holder(m: &PodMigration) -> SlotHolder {
    let st = m.status.clone().unwrap_or_default();
    SlotHolder {
        name: qualified(m),
        created: created(m),
        source_node: st.source_node.clone(),
        started: st.phase != MigrationPhase::Pending && !st.phase.is_terminal(),
        queued: st.phase == MigrationPhase::Pending
            && podmotion_api::conditions::is_true(&st.conditions, condition_types::MIGRATABLE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod_on(node: &str, cpu: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {"nodeName": node, "containers": [{"name": "c",
                "resources": {"requests": {"cpu": cpu}}}]}
        }))
        .unwrap()
    }

    #[test]
    fn requests_are_summed_per_node_and_unscheduled_pods_count_nowhere() {
        let mut unscheduled = pod_on("x", "1");
        unscheduled.spec.as_mut().unwrap().node_name = None;
        let r = requested_by_node(&[pod_on("n1", "1"), pod_on("n1", "500m"), unscheduled]);
        assert_eq!(r.len(), 1);
        assert_eq!(r["n1"], pod_on_requests("1").plus(pod_on_requests("500m")));
    }

    fn pod_on_requests(cpu: &str) -> Resources {
        preflight::pod_requests(&pod_on("n", cpu))
    }
}
