//! What an eviction of a pod becomes: the pure decision behind the `pods/eviction`
//! webhook (`crate::webhook`). A pod asks to be live-migrated instead of evicted with
//! the annotation `podmotion.io/eviction-strategy` on its template (`LiveMigrate`,
//! `LiveMigrateIfPossible`, or `Evict` to opt out of its namespace's default); the
//! installer may give namespaces carrying a label a default strategy. For an opted-in
//! pod the eviction is answered 429 (TooManyRequests) with a message naming the
//! PodMigration that moves it — created by the first eviction, with a name derived
//! from the pod's UID so every retry and every replica names the same one — until the
//! pod has left; a `LiveMigrate` pod that cannot move is refused with the pre-flight's
//! reason (the drain blocks, loudly), a `LiveMigrateIfPossible` one is evicted.
//!
//! No I/O and no clock: the webhook reads the pod, its namespace's labels, the
//! PodMigrations of the pod and the static pre-flight verdict, and hands them in as
//! plain values.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use kube_core::ResourceExt;
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{annotations, condition_types, eviction_strategies, labels, reasons};

use k8s_openapi::jiff::Timestamp;

use crate::meta::short_hash;
use crate::migration::machine::Preflight;
use crate::migration::preflight::{Me, PodFacts, preflight};

/// What an eviction of a pod should do, as the pod (or its namespace) asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// Wait for a live migration; a pod that cannot move blocks the eviction.
    LiveMigrate,
    /// Live-migrate when the pod can move, evict it otherwise.
    LiveMigrateIfPossible,
    /// A plain eviction.
    Evict,
}

impl Strategy {
    /// The strategy an annotation or flag value names (exact spelling).
    pub fn parse(s: &str) -> Option<Strategy> {
        match s {
            eviction_strategies::LIVE_MIGRATE => Some(Strategy::LiveMigrate),
            eviction_strategies::LIVE_MIGRATE_IF_POSSIBLE => Some(Strategy::LiveMigrateIfPossible),
            eviction_strategies::EVICT => Some(Strategy::Evict),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::LiveMigrate => eviction_strategies::LIVE_MIGRATE,
            Strategy::LiveMigrateIfPossible => eviction_strategies::LIVE_MIGRATE_IF_POSSIBLE,
            Strategy::Evict => eviction_strategies::EVICT,
        }
    }
}

/// The installer's default strategy for the pods of namespaces carrying a label
/// (`key` present, or `key=value`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceDefault {
    pub key: String,
    pub value: Option<String>,
    pub strategy: Strategy,
}

impl NamespaceDefault {
    /// From the flags: a selector `key` or `key=value`, and a strategy.
    pub fn parse(selector: &str, strategy: &str) -> Result<NamespaceDefault, String> {
        let strategy = Strategy::parse(strategy).ok_or_else(|| {
            format!(
                "unknown eviction strategy {strategy:?}: use one of {}",
                eviction_strategies::ALL.join(", ")
            )
        })?;
        let (key, value) = match selector.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim().to_string())),
            None => (selector.trim(), None),
        };
        if key.is_empty() || selector.contains(',') {
            return Err(format!(
                "namespace label selector {selector:?} must be one label: key or key=value"
            ));
        }
        Ok(NamespaceDefault {
            key: key.to_string(),
            value,
            strategy,
        })
    }

    fn applies(&self, ns_labels: &BTreeMap<String, String>) -> bool {
        match (ns_labels.get(&self.key), &self.value) {
            (Some(_), None) => true,
            (Some(v), Some(want)) => v == want,
            (None, _) => false,
        }
    }
}

/// What the installer decided.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// Namespaces whose pods PodMotion never touches (`kube-system` is always one):
    /// the operator's and the agents'. The webhook's namespace selector leaves them
    /// out already; this is the second lock.
    pub protected_namespaces: Vec<String>,
    pub namespace_default: Option<NamespaceDefault>,
    /// `freezeBudgetMillis` of the PodMigrations evictions start (`None`: the
    /// PodMigration's default). A drain takes the node away: a pod asked to be kept
    /// is better frozen a few seconds than aborted at the manual default's 500 ms.
    pub freeze_budget_millis: Option<i64>,
}

/// What the decision reads of the pod being evicted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictedPod {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
    /// Already being deleted: nothing is left to save.
    pub terminating: bool,
    /// Phase `Running`: a pod that runs no process (Pending, Succeeded, Failed) has no
    /// state to keep.
    pub running: bool,
}

impl EvictedPod {
    pub fn from_pod(pod: &Pod) -> EvictedPod {
        EvictedPod {
            name: pod.name_any(),
            namespace: pod.namespace().unwrap_or_default(),
            uid: pod.uid().unwrap_or_default(),
            annotations: pod.annotations().clone(),
            terminating: pod.metadata.deletion_timestamp.is_some(),
            running: pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        }
    }
}

/// The pre-flight's verdict on the pod, as far as the webhook knows it before any
/// PodMigration exists (the checks that read only the pod: host namespaces, owner,
/// local data…).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing in the pod stops it from moving (the target is chosen later).
    Movable,
    /// `Migratable=False` with this reason and message.
    CannotMove { reason: String, message: String },
}

/// A PodMigration, as far as the decision needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KnownMigration {
    pub name: String,
    pub pod_name: String,
    pub pod_uid: Option<String>,
    pub dry_run: bool,
    pub phase: MigrationPhase,
    /// The `Migratable` condition: `(status, reason, message)`.
    pub migratable: Option<(bool, String, String)>,
    pub failure: Option<(String, String)>,
}

impl KnownMigration {
    pub fn from_migration(m: &PodMigration) -> KnownMigration {
        let status = m.status.clone().unwrap_or_default();
        let migratable = status
            .conditions
            .iter()
            .find(|c| c.type_ == condition_types::MIGRATABLE)
            .map(|c| (c.status == "True", c.reason.clone(), c.message.clone()));
        KnownMigration {
            name: m.name_any(),
            pod_name: m.spec.pod_name.clone(),
            pod_uid: m.spec.pod_uid.clone(),
            dry_run: m.spec.dry_run,
            phase: status.phase,
            migratable,
            failure: status
                .failure_reason
                .map(|r| (r, status.failure_message.unwrap_or_default())),
        }
    }

    fn moves(&self, pod: &EvictedPod) -> bool {
        !self.dry_run
            && self.pod_name == pod.name
            && self.pod_uid.as_ref().is_none_or(|u| *u == pod.uid)
    }

    /// `Pending` and refused by the pre-flight: `(reason, message)`.
    fn refused(&self) -> Option<(&str, &str)> {
        match (&self.phase, &self.migratable) {
            (MigrationPhase::Pending, Some((false, r, m))) => Some((r, m)),
            _ => None,
        }
    }
}

/// Why an eviction goes ahead.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EvictWhy {
    /// The pod did not ask (no annotation, no namespace default, or `Evict`).
    NotOptedIn,
    /// `kube-system` or PodMotion's own namespaces: never ours to hold up.
    ProtectedNamespace,
    /// The pod is already being deleted.
    Terminating,
    /// The pod runs nothing (not `Running`): there is no state to keep.
    NotRunning,
    /// `LiveMigrateIfPossible` and the pod cannot move (the pre-flight's reason).
    CannotMove { reason: String },
    /// `LiveMigrateIfPossible` and the migration the eviction started ended without
    /// moving the pod.
    MigrationEnded { migration: String },
    /// The migration succeeded; what is left of the source is PodMotion's to remove.
    Migrated { migration: String },
}

/// The answer to one eviction.
#[derive(Clone, Debug)]
pub enum Answer {
    /// Let the eviction proceed (PodDisruptionBudgets still apply).
    Evict(EvictWhy),
    /// 429 TooManyRequests: the pod is live-migrating; retry. `create` is the
    /// PodMigration to create first when none exists yet.
    Migrating {
        migration: String,
        create: Option<Box<PodMigration>>,
        message: String,
    },
    /// Refused, with why: a `LiveMigrate` pod that cannot move, a failed migration,
    /// an annotation that names no strategy. `cause` is a bounded reason (a
    /// pre-flight reason or one of the eviction reasons).
    Blocked { cause: String, message: String },
}

// `PodMigration` has no `PartialEq` (kube's derive): compare the created object as JSON.
impl PartialEq for Answer {
    fn eq(&self, other: &Self) -> bool {
        let json = |m: &Option<Box<PodMigration>>| m.as_ref().map(|m| serde_json::to_value(m).ok());
        match (self, other) {
            (Answer::Evict(a), Answer::Evict(b)) => a == b,
            (
                Answer::Migrating {
                    migration: a,
                    create: ca,
                    message: ma,
                },
                Answer::Migrating {
                    migration: b,
                    create: cb,
                    message: mb,
                },
            ) => a == b && ma == mb && json(ca) == json(cb),
            (
                Answer::Blocked {
                    cause: a,
                    message: ma,
                },
                Answer::Blocked {
                    cause: b,
                    message: mb,
                },
            ) => a == b && ma == mb,
            _ => false,
        }
    }
}

/// The strategy the pod asks for: its annotation, else its namespace's default;
/// `Err` with a message when the annotation names no strategy.
pub fn strategy(
    pod: &EvictedPod,
    ns_labels: &BTreeMap<String, String>,
    settings: &Settings,
) -> Result<Strategy, String> {
    if let Some(v) = pod.annotations.get(annotations::EVICTION_STRATEGY) {
        return Strategy::parse(v).ok_or_else(|| {
            format!(
                "pod {} has {}: {v:?}, which is not a strategy (use {}); the eviction is \
                 refused so that a pod that asked to be kept is not killed by a typo: fix \
                 the annotation on its template",
                pod.name,
                annotations::EVICTION_STRATEGY,
                eviction_strategies::ALL.join(", ")
            )
        });
    }
    Ok(settings
        .namespace_default
        .as_ref()
        .filter(|d| d.applies(ns_labels))
        .map_or(Strategy::Evict, |d| d.strategy))
}

/// The PodMigration an eviction of `pod` creates: the same name for every retry and
/// every replica (derived from the pod's UID, at most 63 characters), pinned to the
/// pod's UID, the target left to the placement (never the cordoned source).
pub fn migration_name(pod: &EvictedPod) -> String {
    let suffix = format!("-evict-{}", short_hash(&pod.uid, 8));
    let mut prefix: String = pod.name.chars().take(63 - suffix.len()).collect();
    while prefix.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        prefix.pop();
    }
    format!("{prefix}{suffix}")
}

/// The PodMigration to create for `pod`.
pub fn new_migration(pod: &EvictedPod, settings: &Settings) -> PodMigration {
    let mut value = serde_json::json!({
        "apiVersion": "podmotion.io/v1alpha1",
        "kind": "PodMigration",
        "metadata": {
            "name": migration_name(pod),
            "namespace": pod.namespace,
            "labels": {
                labels::MANAGED_BY: labels::MANAGED_BY_VALUE,
                labels::COMPONENT: labels::EVICTION_COMPONENT,
                labels::EVICTED_POD_UID: pod.uid,
            },
        },
        "spec": { "podName": pod.name, "podUID": pod.uid },
    });
    if let Some(b) = settings.freeze_budget_millis {
        value["spec"]["freezeBudgetMillis"] = b.into();
    }
    serde_json::from_value(value).expect("an eviction's PodMigration is a valid PodMigration")
}

/// The answer to an eviction of `pod`. `verdict` is the pre-flight's on the pod alone
/// (`None`: not known); `migrations` are the PodMigrations in the pod's namespace
/// (those of other pods are ignored).
pub fn decide(
    pod: &EvictedPod,
    ns_labels: &BTreeMap<String, String>,
    settings: &Settings,
    verdict: Option<&Verdict>,
    migrations: &[KnownMigration],
) -> Answer {
    if pod.namespace == "kube-system" || settings.protected_namespaces.contains(&pod.namespace) {
        return Answer::Evict(EvictWhy::ProtectedNamespace);
    }
    if pod.terminating {
        return Answer::Evict(EvictWhy::Terminating);
    }
    if !pod.running {
        return Answer::Evict(EvictWhy::NotRunning);
    }
    let strategy = match strategy(pod, ns_labels, settings) {
        Ok(Strategy::Evict) => return Answer::Evict(EvictWhy::NotOptedIn),
        Ok(s) => s,
        Err(message) => {
            return Answer::Blocked {
                cause: reasons::INVALID_EVICTION_STRATEGY.into(),
                message,
            };
        }
    };
    let mine: Vec<&KnownMigration> = migrations.iter().filter(|m| m.moves(pod)).collect();
    let in_flight: Vec<&KnownMigration> = mine
        .iter()
        .copied()
        .filter(|m| !m.phase.is_terminal())
        .collect();
    // A migration under way (or queued, or not judged yet) is what the eviction waits
    // for; a refused one is the pre-flight's verdict.
    if let Some(m) = in_flight.iter().find(|m| m.refused().is_none()) {
        return migrating(pod, &m.name, Some(m.phase), None);
    }
    let refusal = in_flight
        .iter()
        .find(|m| m.name == migration_name(pod))
        .or(in_flight.first())
        .and_then(|m| m.refused());
    if let Some((reason, message)) = refusal {
        return cannot_move(pod, strategy, reason, message);
    }
    let ours = migration_name(pod);
    if let Some(m) = mine.iter().find(|m| m.name == ours) {
        return ended(pod, strategy, m);
    }
    if let Some(Verdict::CannotMove { reason, message }) = verdict {
        return cannot_move(pod, strategy, reason, message);
    }
    migrating(
        pod,
        &ours,
        None,
        Some(Box::new(new_migration(pod, settings))),
    )
}

/// The pre-flight's verdict on what the pod alone decides (host namespaces, owner,
/// containers, devices, local data, exec probes…), before any PodMigration exists:
/// the checks that need the nodes (an agent, a target) are left to the PodMigration,
/// whose `Migratable` condition later retries bring in.
pub fn pod_verdict(
    pod: &PodFacts,
    operator_namespace: &str,
    agents_namespace: &str,
    exec_probes: bool,
) -> Verdict {
    let evicted = EvictedPod {
        name: pod.name.clone(),
        namespace: pod.namespace.clone(),
        uid: pod.uid.clone(),
        ..Default::default()
    };
    let m = new_migration(&evicted, &Settings::default());
    let me = Me {
        name: migration_name(&evicted),
        uid: String::new(),
        created: Timestamp::UNIX_EPOCH,
        operator_namespace: operator_namespace.to_string(),
        agents_namespace: agents_namespace.to_string(),
        exec_probes,
    };
    // No nodes: a pod every check passes is refused next for its source node's agent.
    match preflight(&m.spec, &me, Some(pod), &[], &[]) {
        Preflight::NotMigratable { reason, .. }
            if reason == reasons::NO_AGENT_ON_NODE || reason == reasons::SOURCE_POD_NOT_RUNNING =>
        {
            Verdict::Movable
        }
        Preflight::NotMigratable { reason, message } => Verdict::CannotMove {
            reason: reason.to_string(),
            message,
        },
        Preflight::Migratable(_) => Verdict::Movable,
    }
}

fn migrating(
    pod: &EvictedPod,
    migration: &str,
    phase: Option<MigrationPhase>,
    create: Option<Box<PodMigration>>,
) -> Answer {
    let state = match phase {
        Some(p) => format!("phase {p:?}"),
        None => "starting".into(),
    };
    Answer::Migrating {
        migration: migration.to_string(),
        create,
        message: format!(
            "pod {}/{} is being live-migrated instead of evicted by PodMigration {} ({state}); \
             the eviction goes through once the pod has left this node: retry \
             (kubectl get podmigration -n {} {} to follow it)",
            pod.namespace, pod.name, migration, pod.namespace, migration
        ),
    }
}

fn cannot_move(pod: &EvictedPod, strategy: Strategy, reason: &str, message: &str) -> Answer {
    match strategy {
        Strategy::LiveMigrateIfPossible | Strategy::Evict => Answer::Evict(EvictWhy::CannotMove {
            reason: reason.to_string(),
        }),
        Strategy::LiveMigrate => Answer::Blocked {
            cause: reason.to_string(),
            message: format!(
                "pod {}/{} asks to be live-migrated instead of evicted ({}: {}) and cannot \
                 move: {reason}: {message}. The eviction is refused and the pod keeps running; \
                 remove the cause, set the annotation to {} to let it be evicted, or delete \
                 the pod yourself",
                pod.namespace,
                pod.name,
                annotations::EVICTION_STRATEGY,
                eviction_strategies::LIVE_MIGRATE,
                eviction_strategies::LIVE_MIGRATE_IF_POSSIBLE,
            ),
        },
    }
}

/// The eviction's own migration has ended and the pod is still here.
fn ended(pod: &EvictedPod, strategy: Strategy, m: &KnownMigration) -> Answer {
    if m.phase == MigrationPhase::Succeeded {
        return Answer::Evict(EvictWhy::Migrated {
            migration: m.name.clone(),
        });
    }
    if strategy != Strategy::LiveMigrate {
        return Answer::Evict(EvictWhy::MigrationEnded {
            migration: m.name.clone(),
        });
    }
    let why = match &m.failure {
        Some((r, msg)) => format!("{r}: {msg}"),
        None => "no reason recorded".into(),
    };
    Answer::Blocked {
        cause: reasons::EVICTION_MIGRATION_FAILED.into(),
        message: format!(
            "pod {}/{} asks to be live-migrated instead of evicted and its PodMigration {} \
             ended {:?} ({why}); the pod keeps running here. Delete that PodMigration to \
             try again (the next eviction starts a new one), or delete the pod yourself",
            pod.namespace, pod.name, m.name, m.phase
        ),
    }
}

/// Reasons a blocked eviction is counted under: the pre-flight's refusals and the
/// eviction's own; anything else is `Other` (metric labels stay bounded).
pub const BLOCK_CAUSES: &[&str] = &[
    reasons::INVALID_EVICTION_STRATEGY,
    reasons::EVICTION_MIGRATION_FAILED,
    reasons::SOURCE_POD_NOT_RUNNING,
    reasons::UNSUPPORTED_OWNER,
    reasons::STATIC_POD,
    reasons::PROTECTED_NAMESPACE,
    reasons::NON_ROOT_WORKLOAD,
    reasons::HOST_NAMESPACES,
    reasons::MULTIPLE_CONTAINERS,
    reasons::EXTENDED_RESOURCES,
    reasons::LOCAL_DATA,
    reasons::NO_AGENT_ON_NODE,
    reasons::NO_TARGET_NODE,
    reasons::TARGET_DOES_NOT_FIT,
    reasons::ALREADY_MIGRATING,
    crate::migration::preflight::EXEC_PROBE_DISABLED,
];

/// `cause` as a metric label: itself when known, `Other` otherwise.
pub fn bounded_cause(cause: &str) -> &'static str {
    BLOCK_CAUSES
        .iter()
        .find(|c| **c == cause)
        .copied()
        .unwrap_or("Other")
}

#[cfg(test)]
#[path = "eviction_tests.rs"]
mod tests;
