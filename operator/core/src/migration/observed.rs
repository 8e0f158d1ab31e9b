//! What the phase machine decides from (`Observed`: the status, the pods, the agents'
//! reports, the clock, the knobs) and what it hands back (`Transition`: the status, the
//! `Action`s, the Events). Below both the machine and `render` (which renders the
//! pods' facts), so neither names the other's types; `machine` re-exports them all.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use podmotion_api::migration::{MigrationMode, PodMigrationSpec, PodMigrationStatus};

use super::agent::{AgentView, Side, Step};
use crate::note::Note;

/// The spec settings the machine needs, with defaults applied, and the one cluster
/// setting it needs (the Services' sync period, from the operator's flags).
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    pub mode: MigrationMode,
    pub dry_run: bool,
    pub freeze_budget_millis: u64,
    pub max_rounds: u32,
    pub dirty_threshold_bytes: u64,
    pub deadline: Duration,
    pub progress_timeout: Duration,
    /// How long the Services' data plane may wait before it programs an endpoint
    /// change (kube-proxy's `minSyncPeriod`, [`DEFAULT_SERVICE_SYNC`] unless the
    /// operator is told otherwise).
    pub service_sync: Duration,
    /// Whether the source's node forwards the frozen source's new connections to the
    /// target once its probe passed (`--migration-forward-new-connections`).
    pub forward_new_connections: bool,
}

impl Knobs {
    pub fn from_spec(spec: &PodMigrationSpec) -> Knobs {
        let pre = spec.pre_copy.as_ref();
        Knobs {
            mode: spec.mode,
            dry_run: spec.dry_run,
            freeze_budget_millis: spec.freeze_budget_millis.max(0) as u64,
            max_rounds: pre.map_or(5, |p| p.max_rounds.max(1) as u32),
            dirty_threshold_bytes: pre.map_or(4 << 20, |p| p.dirty_threshold_bytes.max(0) as u64),
            deadline: Duration::from_secs(spec.deadline_seconds.max(1) as u64),
            progress_timeout: Duration::from_secs(spec.progress_timeout_seconds.max(1) as u64),
            service_sync: DEFAULT_SERVICE_SYNC,
            forward_new_connections: false,
        }
    }

    /// The same knobs where the source's node forwards new connections (`on`).
    pub fn with_forward_new_connections(self, on: bool) -> Knobs {
        Knobs {
            forward_new_connections: on,
            ..self
        }
    }

    /// The same knobs for a cluster whose Services program endpoint changes at most
    /// `service_sync` late.
    pub fn with_service_sync(self, service_sync: Duration) -> Knobs {
        Knobs {
            service_sync,
            ..self
        }
    }

    /// How long after the source pod's deletion was accepted (to the second, so up to
    /// [`API_TIME_UNIT`] early) its agent's kill waits: until its kubelet has seen the
    /// deletion ([`KUBELET_SETTLE`]) and the Services have programmed the source out
    /// (`service_sync` + [`SERVICE_SYNC_MARGIN`] after the true instant). Until the
    /// kill, a connection the Services still send to the source meets its locked
    /// network (a dropped SYN, retried by the client, which the broker's sweep lets
    /// reach the next rules); after the kill it would be refused.
    pub fn kill_settle(&self) -> Duration {
        KUBELET_SETTLE.max(API_TIME_UNIT + self.service_sync + SERVICE_SYNC_MARGIN)
    }
}

/// The source pod as observed (absent when it does not exist any more).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePodFacts {
    pub uid: String,
    /// Phase Running (its containers may be frozen by the agent; that is still Running).
    pub running: bool,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// `metadata.deletionGracePeriodSeconds` once terminating: 0 once a deletion with
    /// grace period 0 was accepted (a pod its own finalizers hold stays with it).
    pub deletion_grace_seconds: Option<i64>,
    /// When the API server accepted its (latest) deletion, once terminating:
    /// `deletionTimestamp − deletionGracePeriodSeconds`, to the second (the API's
    /// timestamps have no finer unit), so at most 1 s before the true instant.
    pub deletion_accepted: Option<Timestamp>,
    /// Its `pod-deletion-cost` already marks it as the one to remove.
    pub deletion_cost_lowered: bool,
}

/// The target pod as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TargetPodFacts {
    /// Its holder containers run (namespaces exist on the target node).
    pub running: bool,
    /// Why it can never run (rejected by the node, unschedulable, failed), if so.
    pub unusable: Option<String>,
    pub terminating: bool,
    /// The source's labels are on it and the PodMigration no longer controls it.
    pub handed_over: bool,
    /// Handed over and still waiting for the source's controller to adopt it.
    pub awaiting_adoption: bool,
}

/// The pre-flight checks' verdict (see `preflight`), evaluated in `Pending` only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Preflight {
    Migratable(Plan),
    NotMigratable {
        reason: &'static str,
        message: String,
    },
}

/// Where the migration goes, decided once in `Pending`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub source_node: String,
    pub target_node: String,
    pub source_pod_uid: String,
    pub target_pod: String,
}

/// Everything the machine decides from.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// The pod to migrate, as the spec names it (`spec.podName`, never empty): what
    /// the Events name, since the target pod has no name before `Preparing`.
    pub pod_name: String,
    pub now: Timestamp,
    pub created: Timestamp,
    pub generation: Option<i64>,
    pub knobs: Knobs,
    /// The persisted status (default for a new PodMigration).
    pub status: PodMigrationStatus,
    /// Our finalizer is on the object. The controller shell adds it before the machine
    /// ever runs, so the machine only removes it (`RemoveFinalizer`, once a deletion
    /// is cleaned up).
    pub has_finalizer: bool,
    /// `metadata.deletionTimestamp` is set: the user asked to abort.
    pub deletion_requested: bool,
    /// `None` outside `Pending` (the controller does not evaluate it there).
    pub preflight: Option<Preflight>,
    /// A concurrency slot (per cluster and per source node) is free for this migration.
    pub slot_available: bool,
    pub source_pod: Option<SourcePodFacts>,
    pub target_pod: Option<TargetPodFacts>,
    pub transfer_key_present: bool,
    pub source_agent: AgentView,
    pub target_agent: AgentView,
}

/// An idempotent thing for the controller to do, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Create the per-migration transfer-key Secret if it does not exist.
    EnsureTransferKey,
    /// Create the target pod (holders, pinned to the target node) if it does not exist.
    EnsureTargetPod,
    /// Start a step on one agent.
    Agent(Side, Step),
    /// Mark the source pod as the one its ReplicaSet removes.
    LowerSourceDeletionCost,
    /// Put the source's labels on the target pod and release it to the workload's
    /// controller.
    HandOverTargetPod,
    /// Delete the source pod (only the pod the migration pinned, by its UID) with this
    /// grace period: the commit's grace while its agent's kill is still to come, 0 when
    /// the deletion is the kill (see `Machine::committing`).
    DeleteSourcePod {
        grace_seconds: i64,
    },
    DeleteTargetPod,
    DeleteTransferKey,
    RemoveFinalizer,
}

/// What to do next.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// The status to write (always the whole status; unchanged when nothing happened).
    pub status: PodMigrationStatus,
    pub actions: Vec<Action>,
    /// Events to publish (phase changes, failures).
    pub notes: Vec<Note>,
    /// When to look again without a watch event (agents are polled while active).
    pub requeue_after: Option<Duration>,
}

/// How long after the source pod's deletion was accepted its agent's kill waits, so
/// that the source node's kubelet has seen the deletion through its watch (normally
/// within tens of milliseconds) and ends the pod rather than restarting a container
/// that died. Measured from [`SourcePodFacts::deletion_accepted`], which is up to 1 s
/// early: the true wait is between 0.5 and 1.5 s. It does not count as downtime (the
/// target serves from its resume on); it is time the source's memory is held longer.
pub const KUBELET_SETTLE: Duration = Duration::from_millis(1500);
/// The unit of the API's timestamps: an instant read from one is up to this early.
pub const API_TIME_UNIT: Duration = Duration::from_secs(1);
/// kube-proxy's `minSyncPeriod` default: it programs an endpoint change at most this
/// long after its previous sync. Here the commit's two changes (the target in, then
/// the source out, tens of milliseconds apart) were programmed one second apart.
pub const DEFAULT_SERVICE_SYNC: Duration = Duration::from_secs(1);
/// What a Service's change takes beyond the sync period: the EndpointSlice
/// controller's write and the data plane's own sync (tens to ~150 ms measured here).
pub const SERVICE_SYNC_MARGIN: Duration = Duration::from_millis(500);

impl Observed {
    pub(super) fn status_pod_name(&self) -> &str {
        self.status.target_pod.as_deref().unwrap_or("?")
    }
    /// The source pod by its pinned UID, for messages.
    pub(super) fn status_source_pod(&self) -> String {
        match &self.status.source_pod_uid {
            Some(uid) => format!("(uid {uid})"),
            None => "(uid ?)".into(),
        }
    }
}
