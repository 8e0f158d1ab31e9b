//! The nodes as the checks see them, and which one takes the pod: the explicit
//! `targetNode` if it qualifies, else the qualifying node with the most free memory;
//! a node qualifies when it has an agent, is schedulable, keeps the pod's placement
//! rules (node selector, required node affinity, its volumes' node affinity, taints)
//! and has room for its requests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, NodeSelector, NodeSelectorRequirement, Taint, Toleration};
use podmotion_api::migration::PodMigrationSpec;
use podmotion_api::names::reasons;

use super::Refusal;
use super::pod::PodFacts;
use super::resources::{Resources, bytes, cpu_millis};

/// What the checks need of a node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Ready and not cordoned.
    pub schedulable: bool,
    pub taints: Vec<Taint>,
    pub allocatable: Resources,
    /// Sum of the requests of the active pods bound to it.
    pub requested: Resources,
    /// A migration agent answers for this node (ready agent pod, or an endpoint override).
    pub has_ready_agent: bool,
}

impl NodeFacts {
    /// `requested` is the sum of the requests of the node's active pods (see
    /// [`pod_requests`](super::pod_requests)); `has_ready_agent` comes from the agent directory.
    pub fn from_node(node: &Node, requested: Resources, has_ready_agent: bool) -> NodeFacts {
        let spec = node.spec.clone().unwrap_or_default();
        let status = node.status.clone().unwrap_or_default();
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let alloc = status.allocatable.unwrap_or_default();
        NodeFacts {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            schedulable: ready && !spec.unschedulable.unwrap_or(false),
            taints: spec.taints.unwrap_or_default(),
            allocatable: Resources {
                cpu_millis: alloc.get("cpu").and_then(|q| cpu_millis(&q.0)).unwrap_or(0),
                memory_bytes: alloc.get("memory").and_then(|q| bytes(&q.0)).unwrap_or(0),
            },
            requested,
            has_ready_agent,
        }
    }
}

/// Whether `node` satisfies a required node selector (any term; every requirement of
/// the term, on labels and on `metadata.name`).
fn selector_matches(sel: &NodeSelector, node: &NodeFacts) -> bool {
    sel.node_selector_terms.iter().any(|term| {
        term.match_expressions
            .iter()
            .flatten()
            .all(|r| requirement_holds(r, &node.labels))
            && term.match_fields.iter().flatten().all(|r| {
                let fields = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
                requirement_holds(r, &fields)
            })
    })
}

/// Why one node cannot take the pod; `None` if it can.
pub fn unfit_reason(pod: &PodFacts, source: &str, node: &NodeFacts) -> Option<Refusal> {
    let n = &node.name;
    if n == source {
        return Some((reasons::TARGET_IS_SOURCE, format!("{n} is the source node")));
    }
    if !node.has_ready_agent {
        return Some((
            reasons::NO_AGENT_ON_NODE,
            format!("no ready migration agent on {n}"),
        ));
    }
    let misfit = (!node.schedulable)
        .then(|| format!("{n} is not Ready or is cordoned"))
        .or_else(|| placement_mismatch(pod, node))
        .or_else(|| too_little_free(pod, node))?;
    Some((reasons::TARGET_DOES_NOT_FIT, misfit))
}

/// What of the pod's placement rules the node breaks: node selector, required node
/// affinity, its volumes' node affinity, untolerated taints.
fn placement_mismatch(pod: &PodFacts, node: &NodeFacts) -> Option<String> {
    let n = &node.name;
    if let Some((k, v)) = pod
        .node_selector
        .iter()
        .find(|(k, v)| node.labels.get(*k) != Some(*v))
    {
        return Some(format!("{n} lacks the pod's node selector {k}={v}"));
    }
    if let Some(sel) = &pod.required_node_affinity
        && !selector_matches(sel, node)
    {
        return Some(format!(
            "{n} does not match the pod's required node affinity"
        ));
    }
    // The target pod is bound by name, past the scheduler's volume checks: a claim's
    // volume (a zonal disk) must be reachable from the node.
    if let Some(c) = pod.claims.iter().find(|c| {
        c.facts
            .as_ref()
            .and_then(|f| f.node_affinity.as_ref())
            .is_some_and(|sel| !selector_matches(sel, node))
    }) {
        return Some(format!(
            "{n} does not match the node affinity of the volume bound to claim {}",
            c.claim
        ));
    }
    let t = node
        .taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !pod.tolerations.iter().any(|tol| tolerates(tol, t)))?;
    Some(format!(
        "{n} has taint {}:{} that the pod does not tolerate",
        t.key, t.effect
    ))
}

/// The node's free CPU and memory (allocatable minus requested), if the pod's
/// requests do not fit in it.
fn too_little_free(pod: &PodFacts, node: &NodeFacts) -> Option<String> {
    let free = Resources {
        cpu_millis: node
            .allocatable
            .cpu_millis
            .saturating_sub(node.requested.cpu_millis),
        memory_bytes: node
            .allocatable
            .memory_bytes
            .saturating_sub(node.requested.memory_bytes),
    };
    (!pod.requests.fits_within(free)).then(|| {
        format!(
            "{} has {}m CPU and {} bytes of memory free; the pod requests {}m and {}",
            node.name,
            free.cpu_millis,
            free.memory_bytes,
            pod.requests.cpu_millis,
            pod.requests.memory_bytes
        )
    })
}

/// The target node: the explicit `targetNode` if it qualifies, else the qualifying node
/// (honouring `targetNodeSelector`) with the most free memory, name breaking ties.
pub fn select_target(
    spec: &PodMigrationSpec,
    pod: &PodFacts,
    source: &str,
    nodes: &[NodeFacts],
) -> Result<String, Refusal> {
    if let Some(want) = &spec.target_node {
        let Some(node) = nodes.iter().find(|n| &n.name == want) else {
            return Err((
                reasons::NO_TARGET_NODE,
                format!("target node {want} does not exist"),
            ));
        };
        return match unfit_reason(pod, source, node) {
            Some(why) => Err(why),
            None => Ok(want.clone()),
        };
    }
    let selector = spec.target_node_selector.clone().unwrap_or_default();
    let mut rejected = vec![];
    let mut best: Option<&NodeFacts> = None;
    for node in nodes {
        if let Some((k, v)) = selector
            .iter()
            .find(|(k, v)| node.labels.get(*k) != Some(*v))
        {
            rejected.push(format!("{}: lacks {k}={v}", node.name));
            continue;
        }
        if let Some((_, why)) = unfit_reason(pod, source, node) {
            rejected.push(why);
            continue;
        }
        let free = |n: &NodeFacts| {
            n.allocatable
                .memory_bytes
                .saturating_sub(n.requested.memory_bytes)
        };
        best = match best {
            Some(b) if free(b) > free(node) || (free(b) == free(node) && b.name < node.name) => {
                Some(b)
            }
            _ => Some(node),
        };
    }
    best.map(|n| n.name.clone()).ok_or_else(|| {
        (
            reasons::NO_TARGET_NODE,
            format!("no node can take the pod: {}", rejected.join("; ")),
        )
    })
}

fn requirement_holds(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.clone().unwrap_or_default();
    let num = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(|v| num(v)), values.first().and_then(|v| num(v))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(|v| num(v)), values.first().and_then(|v| num(v))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if let Some(e) = &tol.effect
        && !e.is_empty()
        && *e != taint.effect
    {
        return false;
    }
    match tol.operator.as_deref() {
        Some("Exists") => tol
            .key
            .as_deref()
            .is_none_or(|k| k.is_empty() || k == taint.key),
        _ => {
            tol.key.as_deref() == Some(taint.key.as_str())
                && tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or("")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::fixtures::{claim_volume, claims, k8s, node, pod, spec};

    #[test]
    fn a_claims_zonal_volume_limits_the_target_to_its_zone() {
        let zone_b = NodeSelector {
            node_selector_terms: vec![k8s_openapi::api::core::v1::NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "zone".into(),
                    operator: "In".into(),
                    values: Some(vec!["b".into()]),
                }]),
                match_fields: None,
            }],
        };
        let mut c = claims(&[("data", &["ReadWriteMany"])]);
        c.get_mut("data").unwrap().node_affinity = Some(zone_b);
        let p = k8s(claim_volume("data")).with_claims(&c);
        let nodes = vec![
            node("n0").label("zone", "b").build(),
            node("n1").label("zone", "a").build(),
            node("n2").label("zone", "b").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let err = select_target(&spec("web-0").target("n1").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::TARGET_DOES_NOT_FIT, "{}", err.1);
        assert!(err.1.contains("claim data"), "{}", err.1);
    }

    #[test]
    fn operator_picks_the_node_with_most_free_memory_honouring_the_selector() {
        let p = pod("web-0").on("n0").build();
        let nodes = vec![
            node("n0").build(),
            node("n1").label("zone", "a").used(0, 32 << 30).build(),
            node("n2").label("zone", "a").build(),
            node("n3").label("zone", "b").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let s = spec("web-0").selector("zone", "a").build();
        assert_eq!(select_target(&s, &p, "n0", &nodes).unwrap(), "n2");
        let nodes = vec![
            node("n0").build(),
            node("n1").label("zone", "a").used(0, 32 << 30).build(),
        ];
        assert_eq!(select_target(&s, &p, "n0", &nodes).unwrap(), "n1");
    }

    #[test]
    fn unschedulable_tainted_and_agentless_nodes_are_never_chosen() {
        let p = pod("web-0").on("n0").build();
        let nodes = vec![
            node("n0").build(),
            node("cordoned").cordoned().build(),
            node("tainted")
                .taint("dedicated", "gpu", "NoSchedule")
                .build(),
            node("agentless").without_agent().build(),
        ];
        let err = select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::NO_TARGET_NODE);
        for n in ["cordoned", "tainted", "agentless", "source node"] {
            assert!(err.1.contains(n), "{n} missing from {}", err.1);
        }
        let tolerant = pod("web-0").on("n0").tolerates("dedicated", "gpu").build();
        assert_eq!(
            select_target(&spec("web-0").build(), &tolerant, "n0", &nodes).unwrap(),
            "tainted"
        );
    }

    #[test]
    fn the_pods_own_node_selector_must_still_match_the_target() {
        let p = pod("web-0").on("n0").node_selector("disk", "ssd").build();
        let nodes = vec![
            node("n0").build(),
            node("n1").build(),
            node("n2").label("disk", "ssd").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
    }

    #[test]
    fn the_pods_required_node_affinity_must_still_match_the_target() {
        let mut p = pod("web-0").on("n0").build();
        p.required_node_affinity = Some(NodeSelector {
            node_selector_terms: vec![k8s_openapi::api::core::v1::NodeSelectorTerm {
                match_expressions: Some(vec![NodeSelectorRequirement {
                    key: "zone".into(),
                    operator: "In".into(),
                    values: Some(vec!["a".into()]),
                }]),
                match_fields: None,
            }],
        });
        let nodes = vec![
            node("n0").label("zone", "a").build(),
            node("n1").label("zone", "b").build(),
            node("n2").label("zone", "a").build(),
        ];
        assert_eq!(
            select_target(&spec("web-0").build(), &p, "n0", &nodes).unwrap(),
            "n2"
        );
        let err = select_target(&spec("web-0").target("n1").build(), &p, "n0", &nodes).unwrap_err();
        assert_eq!(err.0, reasons::TARGET_DOES_NOT_FIT);
    }
}
