//! RunnerPool status from what was observed: the DaemonSet's counts, the drift found
//! before the last apply, the PodSecurity verdict, the nodes' preflight verdicts and
//! whether the Server's Service resolved. Conditions settle: every state maps to
//! exactly one of Ready / Reconciling / Stalled, so Argo CD and `kubectl wait` never
//! see "progressing forever" for a pool that cannot make progress.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::jiff::Timestamp;
use kube_core::ResourceExt;
use podmotion_api::conditions::{Health, set_condition, set_health};
use podmotion_api::names::{condition_types as ct, reasons};
use podmotion_api::runner_pool::{PreflightFailure, RunnerPool, RunnerPoolStatus};

use super::pod_security::PodSecurityVerdict;
use super::preflight::NodePreflight;
use super::sizing::{max_unavailable_count, pod_size};
use crate::note::{EventKind, Note};
use podmotion_api::conditions::find;

/// Everything the status is computed from.
#[derive(Clone, Debug)]
pub struct Observed {
    /// The DaemonSet as it stands after this round's apply (`None`: not created yet).
    pub daemonset: Option<DaemonSet>,
    /// Fields that differed from the contract before this round's apply.
    pub drift: Vec<String>,
    pub pod_security: PodSecurityVerdict,
    /// Preflight outcome of each Runner pod.
    pub preflight: Vec<NodePreflight>,
    /// `Err(why)` when the Server's Service could not be resolved to pods.
    pub server: Result<(), String>,
    /// Other NetworkPolicies selecting the Runner pods.
    pub foreign_policies: Vec<String>,
    /// Children the pool cannot own (a PriorityClass of another owner), with why.
    pub conflicts: Vec<String>,
    /// Runner pods the scheduler cannot place, with its message.
    pub unschedulable: Vec<String>,
    /// The pool's node label against the platform of PodMotion's images
    /// ([`super::render::node_selector`]): every key it sets to another value, said in
    /// words (empty: none).
    pub platform_conflicts: Vec<String>,
    /// The credential Secret the operator generated (recorded in the status, so that
    /// an operator without Secret read access creates it only once).
    pub credential_secret: Option<String>,
}

/// First 12 hex digits of the image digest.
pub fn digest_short(image: &str) -> Option<String> {
    image
        .split_once("@sha256:")
        .map(|(_, d)| d.chars().take(12).collect())
}

/// `maxUnavailable` as a node count for `desired` nodes (percentages round up, as the
/// DaemonSet controller does).
/// `Some("<pod>: <scheduler message>")` when the scheduler reported `pod` unschedulable
/// (a Runner sized beyond what its node can allocate stays Pending forever otherwise).
pub fn unschedulable(pod: &k8s_openapi::api::core::v1::Pod) -> Option<String> {
    let c = pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| {
        c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
    })?;
    Some(format!(
        "{}: {}",
        pod.name_any(),
        c.message.clone().unwrap_or_default()
    ))
}

/// The Event for a change of the pool's kstatus health (`None` when the true health
/// condition and its reason stayed the same): Warning when stalled.
pub fn health_change(old: &RunnerPoolStatus, new: &RunnerPoolStatus) -> Option<Note> {
    let true_health = |s: &RunnerPoolStatus| {
        [ct::READY, ct::RECONCILING, ct::STALLED]
            .into_iter()
            .filter_map(|t| find(&s.conditions, t).filter(|c| c.status == "True"))
            .map(|c| (c.type_.clone(), c.reason.clone(), c.message.clone()))
            .next()
    };
    let (type_, reason, message) = true_health(new)?;
    if true_health(old).as_ref().map(|(t, r, _)| (t, r)) == Some((&type_, &reason)) {
        return None;
    }
    let kind = if type_ == ct::STALLED {
        EventKind::Warning
    } else {
        EventKind::Normal
    };
    Some(Note {
        kind,
        reason: reason.into(),
        action: "Reconcile",
        message,
    })
}

/// The Event for drift found (and repaired) on the live DaemonSet.
pub fn drift_note(drift: &[String]) -> Option<Note> {
    (!drift.is_empty()).then(|| {
        Note::warning(
            reasons::SHAPE_DRIFT,
            "Repair",
            format!(
                "live DaemonSet differed from the contract, re-applied: {}",
                drift.join("; ")
            ),
        )
    })
}

struct Counts {
    desired: i32,
    ready: i32,
    updated: i32,
    rolling: bool,
}

fn counts(ds: Option<&DaemonSet>) -> Counts {
    let Some(ds) = ds else {
        return Counts {
            desired: 0,
            ready: 0,
            updated: 0,
            rolling: true,
        };
    };
    let s = ds.status.clone().unwrap_or_default();
    let updated = s.updated_number_scheduled.unwrap_or(0);
    let seen = s.observed_generation.unwrap_or(0) >= ds.metadata.generation.unwrap_or(0);
    Counts {
        desired: s.desired_number_scheduled,
        ready: s.number_ready,
        updated,
        rolling: !seen
            || updated < s.desired_number_scheduled
            || s.number_ready < s.desired_number_scheduled,
    }
}

/// The status for `pool`, carrying over the previous conditions' transition times.
pub fn compute(pool: &RunnerPool, observed: &Observed, now: Timestamp) -> RunnerPoolStatus {
    let spec = &pool.spec;
    let generation = pool.metadata.generation;
    let previous = pool.status.clone().unwrap_or_default();
    let c = counts(observed.daemonset.as_ref());
    let size = pod_size(spec);
    let (failures, passed) = preflight_results(observed);
    let facts = Summary {
        preflight: failures
            .iter()
            .map(|f| format!("{}: {}", f.node, f.message))
            .collect::<Vec<_>>()
            .join("; "),
        nodes: format!(
            "{}/{} Runner nodes ready, {} updated",
            c.ready, c.desired, c.updated
        ),
        failed_nodes: failures.len(),
        c,
    };
    let mut conditions = previous.conditions;
    for (type_, status, reason, message) in condition_table(pool, observed, &facts) {
        set_condition(
            &mut conditions,
            type_,
            status,
            reason,
            &message,
            generation,
            now,
        );
    }
    let health = health(pool, observed, &facts);
    set_health(&mut conditions, &health, generation, now);
    let c = facts.c;
    RunnerPoolStatus {
        observed_generation: generation,
        image_digest_short: digest_short(&spec.image),
        desired_nodes: c.desired,
        ready_nodes: c.ready,
        updated_nodes: c.updated,
        session_capacity: c.ready.saturating_mul(spec.sessions_per_node),
        pod_memory: Some(size.memory_quantity()),
        pod_cpu: Some(size.cpu_quantity()),
        credential_secret: observed.credential_secret.clone(),
        preflight_passed: passed,
        preflight_failures: failures,
        foreign_network_policies: observed.foreign_policies.clone(),
        conditions,
    }
}

/// The nodes' preflight results: the failures as observed, and the nodes that passed
/// (sorted, each once).
fn preflight_results(observed: &Observed) -> (Vec<PreflightFailure>, Vec<String>) {
    let failures: Vec<PreflightFailure> = observed
        .preflight
        .iter()
        .filter_map(|p| match p {
            NodePreflight::Failed(f) => Some(f.clone()),
            _ => None,
        })
        .collect();
    let mut passed: Vec<String> = observed
        .preflight
        .iter()
        .filter_map(|p| match p {
            NodePreflight::Passed(node) => Some(node.clone()),
            _ => None,
        })
        .collect();
    passed.sort();
    passed.dedup();
    (failures, passed)
}

/// The status of a pool refused before anything was applied (its PriorityClass, see
/// [`super::priority`]): Stalled with `reason`, the rest of the previous status kept
/// (objects applied before stay as they were).
pub fn refused(pool: &RunnerPool, reason: &str, why: &str, now: Timestamp) -> RunnerPoolStatus {
    let generation = pool.metadata.generation;
    let mut status = pool.status.clone().unwrap_or_default();
    let message = format!("{why}; no DaemonSet is created or updated until this is fixed");
    set_health(
        &mut status.conditions,
        &Health::stalled(reason, message),
        generation,
        now,
    );
    status.observed_generation = generation;
    status
}

/// What several conditions and the health say alike.
struct Summary {
    c: Counts,
    /// `node: message` of every failed preflight.
    preflight: String,
    failed_nodes: usize,
    /// Ready, desired and updated nodes in words.
    nodes: String,
}

/// One kind-specific condition: (type, status, reason, message).
type ConditionRow = (&'static str, bool, &'static str, String);

/// The kind-specific conditions, in the order they are set.
fn condition_table(pool: &RunnerPool, observed: &Observed, f: &Summary) -> Vec<ConditionRow> {
    let ps = &observed.pod_security;
    let ps_reason = if ps.admitted() {
        reasons::POD_SECURITY_ALLOWS
    } else {
        reasons::POD_SECURITY_REJECTS
    };
    let c = &f.c;
    let progressing = if c.rolling {
        reasons::ROLLING_OUT
    } else {
        reasons::RECONCILED
    };
    vec![
        shape_condition(observed),
        (
            ct::POD_SECURITY_ADMITTED,
            ps.admitted(),
            ps_reason,
            ps.message(),
        ),
        degraded_condition(observed, f),
        available_condition(pool, observed, f),
        (ct::PROGRESSING, c.rolling, progressing, f.nodes.clone()),
    ]
}

/// `ShapeConformant`: false (with what differed) when the live DaemonSet had drifted.
fn shape_condition(observed: &Observed) -> ConditionRow {
    if observed.drift.is_empty() {
        (
            ct::SHAPE_CONFORMANT,
            true,
            reasons::SHAPE_MATCHES,
            "the live DaemonSet matches the Runner pod contract".to_string(),
        )
    } else {
        (
            ct::SHAPE_CONFORMANT,
            false,
            reasons::SHAPE_DRIFT,
            format!(
                "the live DaemonSet differed from the contract and was re-applied: {}",
                observed.drift.join("; ")
            ),
        )
    }
}

/// `Degraded`: the most important reason, and every reason's message.
fn degraded_condition(observed: &Observed, f: &Summary) -> ConditionRow {
    let degraded = degraded(observed, f);
    match degraded.first() {
        Some((reason, _)) => {
            let msg = degraded
                .iter()
                .map(|(_, m)| m.as_str())
                .collect::<Vec<_>>()
                .join("; ");
            (ct::DEGRADED, true, *reason, msg)
        }
        None => (
            ct::DEGRADED,
            false,
            reasons::RECONCILED,
            "no node failed preflight".to_string(),
        ),
    }
}

/// `Available`: some node, and no more than the rollout may take down, short of ready.
fn available_condition(pool: &RunnerPool, observed: &Observed, f: &Summary) -> ConditionRow {
    let c = &f.c;
    let allowed_down = max_unavailable_count(&pool.spec.rollout.max_unavailable, c.desired);
    let (status, reason, message) = if c.desired == 0 {
        (
            false,
            reasons::NO_ELIGIBLE_NODES,
            no_nodes_message(pool, observed),
        )
    } else if c.ready > 0 && c.ready >= c.desired - allowed_down {
        (true, reasons::MINIMUM_NODES_AVAILABLE, f.nodes.clone())
    } else {
        (false, reasons::ROLLING_OUT, f.nodes.clone())
    };
    (ct::AVAILABLE, status, reason, message)
}

/// Why the pool is degraded, most important first (empty: it is not).
fn degraded(observed: &Observed, f: &Summary) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = vec![];
    if f.failed_nodes > 0 {
        let msg = format!(
            "{} node(s) failed preflight: {}",
            f.failed_nodes, f.preflight
        );
        out.push((reasons::PREFLIGHT_FAILED, msg));
    }
    if let Err(why) = &observed.server {
        out.push((reasons::SERVER_UNRESOLVED, why.clone()));
    }
    if let Some(msg) = platform_message(observed) {
        out.push((reasons::PLATFORM_CONFLICT, msg));
    }
    if !observed.conflicts.is_empty() {
        out.push((
            reasons::PRIORITY_CLASS_CONFLICT,
            observed.conflicts.join("; "),
        ));
    }
    if !observed.unschedulable.is_empty() {
        let msg = format!(
            "Runner pods cannot be scheduled: {}",
            observed.unschedulable.join("; ")
        );
        out.push((reasons::RUNNER_UNSCHEDULABLE, msg));
    }
    if !observed.foreign_policies.is_empty() {
        let msg = format!(
            "other NetworkPolicies also select the Runner pods and can reopen traffic: {}",
            observed.foreign_policies.join(", ")
        );
        out.push((reasons::FOREIGN_NETWORK_POLICY, msg));
    }
    out
}

/// The pool's kstatus health: the first blocker stalls it, else drift or a rollout
/// keeps it reconciling, else it is ready.
fn health(pool: &RunnerPool, observed: &Observed, f: &Summary) -> Health {
    let ps = &observed.pod_security;
    let c = &f.c;
    if !ps.admitted() {
        Health::stalled(reasons::POD_SECURITY_REJECTS, ps.message())
    } else if let Some(msg) = platform_message(observed) {
        // Before the preflight failures: it is why those nodes' preflights fail.
        Health::stalled(reasons::PLATFORM_CONFLICT, msg)
    } else if f.failed_nodes > 0 {
        Health::stalled(
            reasons::PREFLIGHT_FAILED,
            format!("node preflight failed: {}", f.preflight),
        )
    } else if !observed.conflicts.is_empty() {
        Health::stalled(
            reasons::PRIORITY_CLASS_CONFLICT,
            observed.conflicts.join("; "),
        )
    } else if !observed.unschedulable.is_empty() {
        Health::stalled(
            reasons::RUNNER_UNSCHEDULABLE,
            format!(
                "Runner pods ({} per pod) cannot be scheduled: {}",
                describe_size(pool),
                observed.unschedulable.join("; ")
            ),
        )
    } else if let Err(why) = &observed.server {
        Health::stalled(reasons::SERVER_UNRESOLVED, why.clone())
    } else if observed.daemonset.is_some() && c.desired == 0 && !c.rolling {
        Health::stalled(reasons::NO_ELIGIBLE_NODES, no_nodes_message(pool, observed))
    } else if !observed.drift.is_empty() {
        Health::reconciling(
            reasons::SHAPE_DRIFT,
            "re-applied the contract over a drifted DaemonSet",
        )
    } else if c.rolling {
        Health::reconciling(reasons::ROLLING_OUT, f.nodes.clone())
    } else {
        Health::ready(
            reasons::RECONCILED,
            format!(
                "{}; capacity {} sessions",
                f.nodes,
                i64::from(c.ready) * i64::from(pool.spec.sessions_per_node)
            ),
        )
    }
}

fn describe_size(pool: &RunnerPool) -> String {
    let size = pod_size(&pool.spec);
    format!(
        "{} memory, {} CPU",
        size.memory_quantity(),
        size.cpu_quantity()
    )
}

/// Why no node runs a Runner: none carries every label of the pod's nodeSelector (the
/// pool's label and the platform's, as the DaemonSet applied them).
fn no_nodes_message(pool: &RunnerPool, observed: &Observed) -> String {
    let n = &pool.spec.nodes;
    let platform: Vec<String> = observed
        .daemonset
        .as_ref()
        .and_then(|ds| ds.spec.template.spec.as_ref()?.node_selector.clone())
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| *k != n.label_key)
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let platform = if platform.is_empty() {
        String::new()
    } else {
        format!(
            " on {} (the platform PodMotion's preflight image is built for)",
            platform.join(", ")
        )
    };
    format!(
        "no node of the cluster is labelled {}={}{platform} (RunnerPool {}): label the Runner nodes",
        n.label_key,
        n.label_value,
        pool.name_any()
    )
}

/// The `PlatformConflict` message, when the pool's node label clashes with the
/// platform PodMotion's preflight image is built for.
fn platform_message(observed: &Observed) -> Option<String> {
    (!observed.platform_conflicts.is_empty()).then(|| {
        format!(
            "the pool's node label sets {}; the pool's label is kept, so its Runner pods \
             go to those nodes, where PodMotion's preflight image cannot run: name a \
             preflight image built for them (spec.preflight.image), or select nodes of \
             PodMotion's platform",
            observed.platform_conflicts.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner_pool::fixtures::{inputs, pool};
    use crate::runner_pool::pod_security::{Level, PodSecurityVerdict};
    use crate::runner_pool::render;
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use podmotion_api::conditions::{find, is_true};
    use serde_json::json;

    fn t() -> Timestamp {
        Timestamp::from_second(1_800_000_000).unwrap()
    }
    fn ds(generation: i64, observed: i64, desired: i32, ready: i32, updated: i32) -> DaemonSet {
        let mut d = render(&pool("rp").build(), &inputs()).daemonset;
        d.metadata.generation = Some(generation);
        d.status = Some(
            serde_json::from_value(json!({
                "observedGeneration": observed, "desiredNumberScheduled": desired, "numberReady": ready,
                "updatedNumberScheduled": updated, "currentNumberScheduled": desired, "numberMisscheduled": 0,
            }))
            .unwrap(),
        );
        d
    }
    fn observed(d: Option<DaemonSet>) -> Observed {
        Observed {
            daemonset: d,
            drift: vec![],
            pod_security: PodSecurityVerdict {
                namespace: "runners".into(),
                enforced: Level::Privileged,
                baseline_violations: vec!["hostPath volumes sessions, runtime".into()],
            },
            preflight: vec![NodePreflight::Passed("pm-node-1".into())],
            server: Ok(()),
            foreign_policies: vec![],
            conflicts: vec![],
            unschedulable: vec![],
            platform_conflicts: vec![],
            credential_secret: Some("rp-credentials".into()),
        }
    }

    #[test]
    fn all_nodes_ready_and_updated_is_ready_with_capacity() {
        let s = compute(
            &pool("rp").sessions(4).generation(3).build(),
            &observed(Some(ds(2, 2, 3, 3, 3))),
            t(),
        );
        assert!(is_true(&s.conditions, ct::READY), "{:#?}", s.conditions);
        assert!(is_true(&s.conditions, ct::AVAILABLE));
        assert!(!is_true(&s.conditions, ct::PROGRESSING));
        assert!(is_true(&s.conditions, ct::SHAPE_CONFORMANT));
        assert_eq!(
            (s.desired_nodes, s.ready_nodes, s.session_capacity),
            (3, 3, 12)
        );
        assert_eq!(s.observed_generation, Some(3));
        assert!(
            s.conditions
                .iter()
                .all(|c| c.observed_generation == Some(3))
        );
        assert_eq!(s.image_digest_short.as_deref(), Some("4f1c3a2b5d6e"));
    }

    #[test]
    fn a_rollout_in_flight_is_reconciling_and_stays_available_within_max_unavailable() {
        let s = compute(&pool("rp").build(), &observed(Some(ds(3, 3, 3, 2, 1))), t());
        assert!(is_true(&s.conditions, ct::RECONCILING));
        assert!(is_true(&s.conditions, ct::PROGRESSING));
        assert!(
            is_true(&s.conditions, ct::AVAILABLE),
            "2 of 3 ready with maxUnavailable 1"
        );
        let s = compute(&pool("rp").build(), &observed(Some(ds(3, 3, 3, 1, 1))), t());
        assert!(
            !is_true(&s.conditions, ct::AVAILABLE),
            "1 of 3 ready exceeds maxUnavailable 1"
        );
    }

    #[test]
    fn an_unobserved_daemonset_generation_is_still_progressing() {
        let s = compute(&pool("rp").build(), &observed(Some(ds(4, 3, 3, 3, 3))), t());
        assert!(is_true(&s.conditions, ct::PROGRESSING));
        assert!(!is_true(&s.conditions, ct::READY));
    }

    #[test]
    fn a_rejecting_namespace_stalls_with_a_message_naming_privileged() {
        let mut o = observed(Some(ds(1, 1, 1, 0, 0)));
        o.pod_security.enforced = Level::Baseline;
        let s = compute(&pool("rp").build(), &o, t());
        assert!(is_true(&s.conditions, ct::STALLED));
        let c = find(&s.conditions, ct::POD_SECURITY_ADMITTED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", reasons::POD_SECURITY_REJECTS)
        );
        assert!(c.message.contains("enforce=privileged"), "{}", c.message);
    }

    #[test]
    fn failed_preflight_lists_the_node_degrades_and_stalls() {
        let mut o = observed(Some(ds(1, 1, 3, 2, 3)));
        o.preflight = vec![
            NodePreflight::Passed("pm-node-1".into()),
            NodePreflight::Failed(PreflightFailure {
                node: "pm-node-2".into(),
                checks: vec!["kvm".into()],
                message: "kvm: open /dev/kvm: Permission denied".into(),
            }),
        ];
        let s = compute(&pool("rp").build(), &o, t());
        assert_eq!(s.preflight_failures.len(), 1);
        assert_eq!(s.preflight_failures[0].node, "pm-node-2");
        assert_eq!(s.preflight_passed, vec!["pm-node-1".to_string()]);
        assert!(is_true(&s.conditions, ct::DEGRADED));
        assert!(is_true(&s.conditions, ct::STALLED));
        assert!(
            find(&s.conditions, ct::STALLED)
                .unwrap()
                .message
                .contains("pm-node-2")
        );
    }

    #[test]
    fn drift_is_reported_by_field_and_the_pool_reconciles() {
        let mut o = observed(Some(ds(1, 1, 1, 1, 1)));
        o.drift = vec!["spec.template.spec.containers[runner].image is x, want y".into()];
        let s = compute(&pool("rp").build(), &o, t());
        let c = find(&s.conditions, ct::SHAPE_CONFORMANT).unwrap();
        assert_eq!(c.status, "False");
        assert!(
            c.message.contains("containers[runner].image"),
            "{}",
            c.message
        );
        assert!(is_true(&s.conditions, ct::RECONCILING));
    }

    #[test]
    fn no_labelled_node_settles_as_stalled_not_progressing_forever() {
        let s = compute(&pool("rp").build(), &observed(Some(ds(1, 1, 0, 0, 0))), t());
        assert!(is_true(&s.conditions, ct::STALLED), "{:#?}", s.conditions);
        assert_eq!(
            find(&s.conditions, ct::STALLED).unwrap().reason,
            reasons::NO_ELIGIBLE_NODES
        );
        assert!(!is_true(&s.conditions, ct::AVAILABLE));
    }

    #[test]
    fn an_unresolved_server_and_foreign_policies_degrade() {
        let mut o = observed(Some(ds(1, 1, 1, 1, 1)));
        o.server = Err("Service compass/compass-server not found".into());
        o.foreign_policies = vec!["allow-all".into()];
        let s = compute(&pool("rp").build(), &o, t());
        let c = find(&s.conditions, ct::DEGRADED).unwrap();
        assert_eq!(c.status, "True");
        assert!(
            c.message.contains("allow-all") && c.message.contains("compass-server"),
            "{}",
            c.message
        );
    }

    #[test]
    fn a_priority_class_of_another_owner_stalls_the_pool() {
        let mut o = observed(Some(ds(1, 1, 1, 1, 1)));
        o.conflicts = vec!["PriorityClass high exists and is not this pool's".into()];
        let s = compute(&pool("rp").build(), &o, t());
        let c = find(&s.conditions, ct::STALLED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", reasons::PRIORITY_CLASS_CONFLICT)
        );
    }

    #[test]
    fn a_runner_too_big_for_its_node_stalls_with_the_schedulers_reason() {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "rp-abcde"},
            "status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/5 nodes are available: 1 Insufficient memory."
            }]}
        }))
        .unwrap();
        let mut o = observed(Some(ds(1, 1, 1, 0, 1)));
        o.unschedulable = unschedulable(&pod).into_iter().collect();
        let s = compute(&pool("rp").build(), &o, t());
        let c = find(&s.conditions, ct::STALLED).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("True", reasons::RUNNER_UNSCHEDULABLE)
        );
        assert!(
            c.message.contains("Insufficient memory") && c.message.contains("Mi memory"),
            "{}",
            c.message
        );
        let scheduled: k8s_openapi::api::core::v1::Pod = serde_json::from_value(
            json!({"metadata": {"name": "x"}, "status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}),
        )
        .unwrap();
        assert_eq!(unschedulable(&scheduled), None);
    }

    #[test]
    fn percentages_round_up_like_the_daemonset_controller() {
        assert_eq!(
            max_unavailable_count(&IntOrString::String("10%".into()), 15),
            2
        );
        assert_eq!(max_unavailable_count(&IntOrString::Int(2), 15), 2);
    }
}
