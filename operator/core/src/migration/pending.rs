//! The facts of a `Pending` migration, gathered from the cluster's objects: the load
//! on every node, the source pod's claims, the other PodMigrations (one migration per
//! pod, first come first served), and the concurrency slot. Pure: the controller hands
//! in what it read, and [`evaluate`] returns the pre-flight verdict and whether a slot
//! is free.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube_core::{Resource, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::condition_types;

use super::machine::Preflight;
use super::preflight::{
    self, ClaimFacts, Limits, Me, NodeFacts, OtherMigration, PodFacts, Resources, SlotHolder,
};

/// What a non-terminal pod bound to a node takes from it: the projection the
/// controller's cluster-wide pod cache keeps (a few strings, not the pod), and the
/// source pod's progress that can make a waiting migration movable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodLoad {
    pub node: String,
    pub requests: Resources,
    pub running: bool,
}

impl PodLoad {
    /// `None` for a pod that loads no node: not bound yet, or terminal.
    pub fn from_pod(p: &Pod) -> Option<PodLoad> {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            return None;
        }
        let node = p
            .spec
            .as_ref()?
            .node_name
            .clone()
            .filter(|n| !n.is_empty())?;
        Some(PodLoad {
            node,
            requests: preflight::pod_requests(p),
            running: phase == Some("Running"),
        })
    }

    /// Whether going from `old` to `new` (`None`: gone) frees capacity on a node: the
    /// only pod changes that can make a waiting migration's target fit.
    pub fn frees_capacity(old: Option<&PodLoad>, new: Option<&PodLoad>) -> bool {
        match (old, new) {
            (Some(_), None) => true,
            (Some(o), Some(n)) => {
                o.node != n.node
                    || n.requests.cpu_millis < o.requests.cpu_millis
                    || n.requests.memory_bytes < o.requests.memory_bytes
            }
            (None, _) => false,
        }
    }
}

/// Requested resources of the non-terminal pods, summed per node.
pub fn requested_by_node<'a>(
    loads: impl IntoIterator<Item = &'a PodLoad>,
) -> BTreeMap<String, Resources> {
    let mut requested: BTreeMap<String, Resources> = BTreeMap::new();
    for l in loads {
        let r = requested.entry(l.node.clone()).or_default();
        *r = r.plus(l.requests);
    }
    requested
}

/// A node's facts without its load and agent (what the controller's node cache keeps:
/// a heartbeat changes none of it).
pub fn node_view(n: &Node) -> NodeFacts {
    NodeFacts::from_node(n, Resources::default(), false)
}

/// Every node's facts (in name order), with its load and whether a Ready agent serves
/// it.
pub fn node_facts<'a>(
    nodes: impl IntoIterator<Item = &'a NodeFacts>,
    requested: &BTreeMap<String, Resources>,
    has_agent: impl Fn(&str) -> bool,
) -> Vec<NodeFacts> {
    let mut out: Vec<NodeFacts> = nodes
        .into_iter()
        .map(|n| NodeFacts {
            requested: requested.get(&n.name).copied().unwrap_or_default(),
            has_ready_agent: has_agent(&n.name),
            ..n.clone()
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The facts of the claims the controller read, by claim name: each claim with the
/// PersistentVolume it is bound to (`None` when unbound or not found). Claims that do
/// not exist are simply absent.
pub fn claim_facts(
    read: &[(PersistentVolumeClaim, Option<PersistentVolume>)],
) -> BTreeMap<String, ClaimFacts> {
    read.iter()
        .map(|(pvc, pv)| (pvc.name_any(), ClaimFacts::from_objects(pvc, pv.as_ref())))
        .collect()
}

/// When `m` was created; one the API server has not stored yet (no timestamp) is the
/// newest of all, as it would be, without reading the clock.
fn created(m: &PodMigration) -> Timestamp {
    m.meta()
        .creation_timestamp
        .as_ref()
        .map_or(Timestamp::MAX, |t| t.0)
}

/// What of the installation the pre-flight checks: the operator's own
/// namespace (whose pods never move) and whether exec probes may run.
#[derive(Clone, Copy, Debug)]
pub struct Installation<'a> {
    pub namespace: &'a str,
    /// The agents' namespace (migration agents, attach Jobs): its pods never move either.
    pub agents_namespace: &'a str,
    pub exec_probes: bool,
}

/// The verdict for `pm` and whether a concurrency slot is free for it, given its
/// source pod and its claims, the nodes, every PodMigration the controller knows and
/// the installation (the operator's namespace, whether exec probes may run).
pub fn evaluate(
    pm: &PodMigration,
    source: Option<&Pod>,
    claims: &BTreeMap<String, ClaimFacts>,
    nodes: &[NodeFacts],
    all: &[PodMigration],
    limits: Limits,
    operator: Installation<'_>,
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
        operator_namespace: operator.namespace.to_string(),
        agents_namespace: operator.agents_namespace.to_string(),
        exec_probes: operator.exec_probes,
    };
    let facts = source.map(|p| PodFacts::from_pod(p).with_claims(claims));
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

    fn loads(pods: &[Pod]) -> Vec<PodLoad> {
        pods.iter().filter_map(PodLoad::from_pod).collect()
    }

    #[test]
    fn requests_are_summed_per_node_and_unscheduled_or_finished_pods_count_nowhere() {
        let mut unscheduled = pod_on("x", "1");
        unscheduled.spec.as_mut().unwrap().node_name = None;
        let mut finished = pod_on("n1", "2");
        finished.status = Some(serde_json::from_value(json!({"phase": "Succeeded"})).unwrap());
        let r = requested_by_node(&loads(&[
            pod_on("n1", "1"),
            pod_on("n1", "500m"),
            unscheduled,
            finished,
        ]));
        assert_eq!(r.len(), 1);
        assert_eq!(r["n1"], pod_on_requests("1").plus(pod_on_requests("500m")));
    }

    #[test]
    fn only_a_pod_that_leaves_or_shrinks_frees_capacity() {
        let on = |node: &str, cpu: &str| PodLoad::from_pod(&pod_on(node, cpu)).unwrap();
        let (a, bigger, moved) = (on("n1", "1"), on("n1", "2"), on("n2", "1"));
        assert!(
            PodLoad::frees_capacity(Some(&a), None),
            "deleted or finished"
        );
        assert!(PodLoad::frees_capacity(Some(&bigger), Some(&a)), "shrunk");
        assert!(PodLoad::frees_capacity(Some(&a), Some(&moved)), "rebound");
        assert!(!PodLoad::frees_capacity(None, Some(&a)), "a new pod takes");
        assert!(!PodLoad::frees_capacity(Some(&a), Some(&bigger)), "grown");
        let running = PodLoad {
            running: true,
            ..a.clone()
        };
        assert!(
            !PodLoad::frees_capacity(Some(&a), Some(&running)),
            "started"
        );
    }

    #[test]
    fn nodes_get_their_load_and_agent_in_name_order() {
        use crate::migration::fixtures::node;
        let views = [node("n1").build(), node("n0").build()];
        let requested = requested_by_node(&loads(&[pod_on("n1", "1")]));
        let facts = node_facts(&views, &requested, |n| n == "n0");
        let names: Vec<&str> = facts.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["n0", "n1"]);
        assert!(facts[0].has_ready_agent && !facts[1].has_ready_agent);
        assert_eq!(facts[1].requested, pod_on_requests("1"));
        assert_eq!(facts[0].requested, Resources::default());
    }

    #[test]
    fn the_verdict_uses_the_claims_read_and_the_operators_namespace() {
        use crate::migration::fixtures::{migration, node};
        use podmotion_api::names::reasons;
        let pm = migration("move-web", "web-0");
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "apps", "uid": "u-1"},
            "spec": {"nodeName": "n0", "containers": [{"name": "app"}],
                "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": "data"}}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        let claim = |mode: &str| -> PersistentVolumeClaim {
            serde_json::from_value(json!({"metadata": {"name": "data", "namespace": "apps"},
                "spec": {"accessModes": [mode]}}))
            .unwrap()
        };
        let nodes = vec![node("n0").build(), node("n1").build()];
        let limits = Limits {
            per_cluster: 5,
            per_source_node: 2,
        };
        let reason = |claims: &[(PersistentVolumeClaim, Option<PersistentVolume>)],
                      operator_ns: &str| {
            match evaluate(
                &pm,
                Some(&pod),
                &claim_facts(claims),
                &nodes,
                &[],
                limits,
                Installation {
                    namespace: operator_ns,
                    agents_namespace: "podmotion-agents",
                    exec_probes: false,
                },
            )
            .0
            {
                Preflight::Migratable(_) => reasons::MIGRATABLE,
                Preflight::NotMigratable { reason, .. } => reason,
            }
        };
        let rwx = [(claim("ReadWriteMany"), None)];
        assert_eq!(reason(&rwx, "podmotion-system"), reasons::MIGRATABLE);
        assert_eq!(
            reason(&[(claim("ReadWriteOnce"), None)], "podmotion-system"),
            reasons::LOCAL_DATA
        );
        assert_eq!(reason(&[], "podmotion-system"), reasons::LOCAL_DATA);
        assert_eq!(reason(&rwx, "apps"), reasons::PROTECTED_NAMESPACE);
    }

    fn pod_on_requests(cpu: &str) -> Resources {
        preflight::pod_requests(&pod_on("n", cpu))
    }
}
