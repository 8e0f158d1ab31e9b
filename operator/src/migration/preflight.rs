//! Pre-flight checks and target selection: is this pod migratable, and to where?
//!
//! Runs before anything is frozen. The verdict becomes the `Migratable` condition; a
//! pod that fails a check keeps running untouched. Inputs are plain facts extracted
//! from the pod, the nodes and the other PodMigrations (`PodFacts::from_pod`,
//! `NodeFacts::from_node`), so every rule is tested without a cluster.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, Pod, Taint, Toleration,
};
use k8s_openapi::jiff::Timestamp;
use podmotion_api::migration::PodMigrationSpec;
use podmotion_api::names::reasons;

use super::machine::{Plan, Preflight};
use super::render::target_pod_name;

/// CPU in millicores and memory in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

impl Resources {
    pub fn plus(self, o: Resources) -> Resources {
        Resources {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(o.memory_bytes),
        }
    }
    fn fits_within(self, free: Resources) -> bool {
        self.cpu_millis <= free.cpu_millis && self.memory_bytes <= free.memory_bytes
    }
}

/// The controller of a pod (its controlling owner reference).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerFacts {
    pub kind: String,
    pub name: String,
    pub uid: String,
}

/// What the checks need of the source pod.
#[derive(Clone, Debug, PartialEq)]
pub struct PodFacts {
    pub name: String,
    pub uid: String,
    pub node: Option<String>,
    pub running: bool,
    pub terminating: bool,
    pub owner: Option<OwnerFacts>,
    pub requests: Resources,
    pub node_selector: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
    /// `affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution`: the
    /// kubelet re-checks it when admitting the target pod.
    pub required_node_affinity: Option<NodeSelector>,
}

impl PodFacts {
    pub fn from_pod(pod: &Pod) -> PodFacts {
        let meta = &pod.metadata;
        let spec = pod.spec.clone().unwrap_or_default();
        let owner = meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| OwnerFacts {
                kind: o.kind.clone(),
                name: o.name.clone(),
                uid: o.uid.clone(),
            });
        PodFacts {
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
            node: spec.node_name.clone(),
            running: pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
            terminating: meta.deletion_timestamp.is_some(),
            owner,
            requests: pod_requests(pod),
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
            required_node_affinity: spec
                .affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .and_then(|n| {
                    n.required_during_scheduling_ignored_during_execution
                        .clone()
                }),
        }
    }
}

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
    /// [`pod_requests`]); `has_ready_agent` comes from the agent directory.
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

/// Another PodMigration, as far as "one migration per pod" needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtherMigration {
    pub name: String,
    pub pod_name: String,
    pub created: Timestamp,
    pub terminal: bool,
}

/// This PodMigration's identity (for tie-breaks and names).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Me {
    pub name: String,
    pub uid: String,
    pub created: Timestamp,
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

/// Owner kinds whose controller adopts a pod of another name carrying its labels.
/// StatefulSet pods have identities (name, volumes) and DaemonSet/Job pods are tied to
/// their node or completion; none of those can be moved by adoption.
fn adoptable_owner(kind: &str) -> bool {
    kind == "ReplicaSet"
}

/// The pre-flight verdict: every check, then the target.
pub fn preflight(
    spec: &PodMigrationSpec,
    me: &Me,
    pod: Option<&PodFacts>,
    nodes: &[NodeFacts],
    others: &[OtherMigration],
) -> Preflight {
    let no = |reason: &'static str, message: String| Preflight::NotMigratable { reason, message };
    let Some(pod) = pod else {
        return no(
            reasons::SOURCE_POD_NOT_FOUND,
            format!("pod {} does not exist", spec.pod_name),
        );
    };
    if let Some(uid) = &spec.pod_uid
        && *uid != pod.uid
    {
        return no(
            reasons::POD_UID_MISMATCH,
            format!("pod {} has UID {}, not the pinned {uid}", pod.name, pod.uid),
        );
    }
    if !pod.running || pod.terminating {
        return no(
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not Running", pod.name),
        );
    }
    let Some(source) = pod.node.clone() else {
        return no(
            reasons::SOURCE_POD_NOT_RUNNING,
            format!("pod {} is not bound to a node", pod.name),
        );
    };
    if let Some(owner) = &pod.owner
        && !adoptable_owner(&owner.kind)
    {
        return no(
            reasons::UNSUPPORTED_OWNER,
            format!(
                "pod {} is controlled by {} {}; only ReplicaSet (Deployment) pods and bare pods can move",
                pod.name, owner.kind, owner.name
            ),
        );
    }
    // One migration per pod: the oldest non-terminal PodMigration of a pod wins
    // (name breaks ties), so two created together never both proceed.
    if let Some(first) = others
        .iter()
        .filter(|m| m.pod_name == pod.name && !m.terminal && m.name != me.name)
        .find(|m| (m.created, &m.name) < (me.created, &me.name))
    {
        return no(
            reasons::ALREADY_MIGRATING,
            format!(
                "pod {} is already being migrated by {}",
                pod.name, first.name
            ),
        );
    }
    match nodes.iter().find(|n| n.name == source) {
        Some(n) if n.has_ready_agent => {}
        _ => {
            return no(
                reasons::NO_AGENT_ON_NODE,
                format!("no ready migration agent on the source node {source}"),
            );
        }
    }
    let target = match select_target(spec, pod, &source, nodes) {
        Ok(t) => t,
        Err((reason, message)) => return no(reason, message),
    };
    Preflight::Migratable(Plan {
        source_node: source,
        target_node: target,
        source_pod_uid: pod.uid.clone(),
        target_pod: target_pod_name(&pod.name, &me.uid),
    })
}

/// Why one node cannot take the pod; `None` if it can.
pub fn unfit_reason(
    pod: &PodFacts,
    source: &str,
    node: &NodeFacts,
) -> Option<(&'static str, String)> {
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
    if !node.schedulable {
        return Some((
            reasons::TARGET_DOES_NOT_FIT,
            format!("{n} is not Ready or is cordoned"),
        ));
    }
    if let Some((k, v)) = pod
        .node_selector
        .iter()
        .find(|(k, v)| node.labels.get(*k) != Some(*v))
    {
        return Some((
            reasons::TARGET_DOES_NOT_FIT,
            format!("{n} lacks the pod's node selector {k}={v}"),
        ));
    }
    if let Some(sel) = &pod.required_node_affinity
        && !sel.node_selector_terms.iter().any(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .all(|r| requirement_holds(r, &node.labels))
                && term.match_fields.iter().flatten().all(|r| {
                    let fields = BTreeMap::from([("metadata.name".to_string(), node.name.clone())]);
                    requirement_holds(r, &fields)
                })
        })
    {
        return Some((
            reasons::TARGET_DOES_NOT_FIT,
            format!("{n} does not match the pod's required node affinity"),
        ));
    }
    if let Some(t) = node
        .taints
        .iter()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .find(|t| !pod.tolerations.iter().any(|tol| tolerates(tol, t)))
    {
        return Some((
            reasons::TARGET_DOES_NOT_FIT,
            format!(
                "{n} has taint {}:{} that the pod does not tolerate",
                t.key, t.effect
            ),
        ));
    }
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
    if !pod.requests.fits_within(free) {
        return Some((
            reasons::TARGET_DOES_NOT_FIT,
            format!(
                "{n} has {}m CPU and {} bytes of memory free; the pod requests {}m and {}",
                free.cpu_millis,
                free.memory_bytes,
                pod.requests.cpu_millis,
                pod.requests.memory_bytes
            ),
        ));
    }
    None
}

/// The target node: the explicit `targetNode` if it qualifies, else the qualifying node
/// (honouring `targetNodeSelector`) with the most free memory, name breaking ties.
pub fn select_target(
    spec: &PodMigrationSpec,
    pod: &PodFacts,
    source: &str,
    nodes: &[NodeFacts],
) -> Result<String, (&'static str, String)> {
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

/// Sum of a pod's container requests (limits stand in for missing requests, as the
/// API server defaults them), with init containers counted as their maximum.
pub fn pod_requests(pod: &Pod) -> Resources {
    let Some(spec) = &pod.spec else {
        return Resources::default();
    };
    let of = |c: &k8s_openapi::api::core::v1::Container| {
        let r = c.resources.clone().unwrap_or_default();
        let get = |name: &str, parse: fn(&str) -> Option<u64>| {
            r.requests
                .as_ref()
                .and_then(|m| m.get(name))
                .or_else(|| r.limits.as_ref().and_then(|m| m.get(name)))
                .and_then(|q| parse(&q.0))
                .unwrap_or(0)
        };
        Resources {
            cpu_millis: get("cpu", cpu_millis),
            memory_bytes: get("memory", bytes),
        }
    };
    let main = spec
        .containers
        .iter()
        .map(of)
        .fold(Resources::default(), Resources::plus);
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .map(of)
        .fold(Resources::default(), |a, b| Resources {
            cpu_millis: a.cpu_millis.max(b.cpu_millis),
            memory_bytes: a.memory_bytes.max(b.memory_bytes),
        });
    Resources {
        cpu_millis: main.cpu_millis.max(init.cpu_millis),
        memory_bytes: main.memory_bytes.max(init.memory_bytes),
    }
}

/// A Kubernetes quantity in base units (`2`, `500m`, `1.5Gi`, `64M`, `1e3`).
pub fn quantity(s: &str) -> Option<f64> {
    let s = s.trim();
    let suffixes: [(&str, f64); 13] = [
        ("Ki", 1024f64),
        ("Mi", 1024f64.powi(2)),
        ("Gi", 1024f64.powi(3)),
        ("Ti", 1024f64.powi(4)),
        ("Pi", 1024f64.powi(5)),
        ("Ei", 1024f64.powi(6)),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
        ("E", 1e18),
    ];
    for (suffix, factor) in suffixes {
        if let Some(num) = s.strip_suffix(suffix) {
            return num
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v * factor);
        }
    }
    s.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

fn cpu_millis(s: &str) -> Option<u64> {
    quantity(s).map(|v| (v * 1000.0).ceil() as u64)
}

fn bytes(s: &str) -> Option<u64> {
    quantity(s).map(|v| v.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::fixtures::{node, pod, spec};

    fn me() -> Me {
        Me {
            name: "move-web".into(),
            uid: "0c5b5e52-0000-4000-8000-000000000001".into(),
            created: ts(100),
        }
    }
    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap()
    }
    fn verdict_reason(p: &Preflight) -> &'static str {
        match p {
            Preflight::Migratable(_) => reasons::MIGRATABLE,
            Preflight::NotMigratable { reason, .. } => reason,
        }
    }
    fn three_nodes() -> Vec<NodeFacts> {
        vec![node("n0").build(), node("n1").build(), node("n2").build()]
    }

    #[test]
    fn a_running_pod_with_agents_everywhere_is_migratable_to_another_node() {
        let p = pod("web-0").on("n0").build();
        let v = preflight(&spec("web-0").build(), &me(), Some(&p), &three_nodes(), &[]);
        let Preflight::Migratable(plan) = v else {
            panic!("{v:?}")
        };
        assert_eq!(plan.source_node, "n0");
        assert_ne!(plan.target_node, "n0");
        assert_eq!(plan.source_pod_uid, p.uid);
        assert!(plan.target_pod.starts_with("web-0-"), "{}", plan.target_pod);
    }

    #[test]
    fn every_failed_check_names_its_reason() {
        let nodes = three_nodes();
        let s = spec("web-0").build();
        type Case = (
            &'static str,
            Option<PodFacts>,
            PodMigrationSpec,
            Vec<NodeFacts>,
            Vec<OtherMigration>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                "missing pod",
                None,
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_FOUND,
            ),
            (
                "uid pin mismatch",
                Some(pod("web-0").on("n0").build()),
                spec("web-0")
                    .uid("ffffffff-0000-4000-8000-000000000000")
                    .build(),
                nodes.clone(),
                vec![],
                reasons::POD_UID_MISMATCH,
            ),
            (
                "pending pod",
                Some(pod("web-0").on("n0").pending().build()),
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_RUNNING,
            ),
            (
                "terminating pod",
                Some(pod("web-0").on("n0").terminating().build()),
                s.clone(),
                nodes.clone(),
                vec![],
                reasons::SOURCE_POD_NOT_RUNNING,
            ),
            (
                "statefulset pod",
                Some(pod("db-0").on("n0").owned_by("StatefulSet", "db").build()),
                spec("db-0").build(),
                nodes.clone(),
                vec![],
                reasons::UNSUPPORTED_OWNER,
            ),
            (
                "older migration of the same pod",
                Some(pod("web-0").on("n0").build()),
                s.clone(),
                nodes.clone(),
                vec![OtherMigration {
                    name: "earlier".into(),
                    pod_name: "web-0".into(),
                    created: ts(50),
                    terminal: false,
                }],
                reasons::ALREADY_MIGRATING,
            ),
            (
                "no agent on source",
                Some(pod("web-0").on("n0").build()),
                s.clone(),
                vec![node("n0").without_agent().build(), node("n1").build()],
                vec![],
                reasons::NO_AGENT_ON_NODE,
            ),
            (
                "target is the source",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n0").build(),
                nodes.clone(),
                vec![],
                reasons::TARGET_IS_SOURCE,
            ),
            (
                "explicit target without agent",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n1").build(),
                vec![node("n0").build(), node("n1").without_agent().build()],
                vec![],
                reasons::NO_AGENT_ON_NODE,
            ),
            (
                "explicit target unknown",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").target("n9").build(),
                nodes.clone(),
                vec![],
                reasons::NO_TARGET_NODE,
            ),
            (
                "explicit target full",
                Some(pod("web-0").on("n0").requests(2000, 1 << 30).build()),
                spec("web-0").target("n1").build(),
                vec![
                    node("n0").build(),
                    node("n1").allocatable(1000, 8 << 30).build(),
                ],
                vec![],
                reasons::TARGET_DOES_NOT_FIT,
            ),
            (
                "selector matches nothing",
                Some(pod("web-0").on("n0").build()),
                spec("web-0").selector("zone", "b").build(),
                nodes.clone(),
                vec![],
                reasons::NO_TARGET_NODE,
            ),
        ];
        for (what, p, s, n, others, want) in cases {
            let v = preflight(&s, &me(), p.as_ref(), &n, &others);
            assert_eq!(verdict_reason(&v), want, "{what}: {v:?}");
        }
    }

    #[test]
    fn a_newer_migration_of_the_same_pod_does_not_block_the_older_one() {
        let p = pod("web-0").on("n0").build();
        let newer = OtherMigration {
            name: "later".into(),
            pod_name: "web-0".into(),
            created: ts(200),
            terminal: false,
        };
        let finished = OtherMigration {
            name: "old".into(),
            pod_name: "web-0".into(),
            created: ts(1),
            terminal: true,
        };
        let v = preflight(
            &spec("web-0").build(),
            &me(),
            Some(&p),
            &three_nodes(),
            &[newer, finished],
        );
        assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
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

    #[test]
    fn quantities_parse_in_base_units() {
        assert_eq!(cpu_millis("500m"), Some(500));
        assert_eq!(cpu_millis("2"), Some(2000));
        assert_eq!(cpu_millis("0.25"), Some(250));
        assert_eq!(bytes("64Gi"), Some(64 << 30));
        assert_eq!(bytes("128M"), Some(128_000_000));
        assert_eq!(bytes("1e3"), Some(1000));
        assert_eq!(bytes("lots"), None);
        assert_eq!(bytes("-1"), None);
    }

    #[test]
    fn pod_facts_read_requests_owner_and_phase_from_the_pod() {
        let p = crate::migration::fixtures::k8s_pod("web-0", "n0", "ReplicaSet", "web-abc");
        let f = PodFacts::from_pod(&p);
        assert_eq!(f.node.as_deref(), Some("n0"));
        assert!(f.running);
        assert_eq!(
            f.owner.as_ref().map(|o| o.kind.as_str()),
            Some("ReplicaSet")
        );
        assert_eq!(
            f.requests,
            Resources {
                cpu_millis: 100,
                memory_bytes: 64 << 20
            }
        );
    }
}
