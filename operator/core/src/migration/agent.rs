//! What the migration controller needs from the node agents, as plain data.
//!
//! The agents own the status of the work they execute: for each migration UID an agent
//! reports the last step it was asked to run and how that step stands. The operator
//! never remembers a step in memory; it asks both agents for their report on every
//! reconcile and decides from the reports (see `machine`). Every step is idempotent
//! per migration UID, so re-issuing one after an operator restart is always safe.
//!
//! [`AgentClient`] is the I/O boundary the controller drives. It is implemented over
//! the executors' wire client (`podmotion-wire`) once that exists; the pure core only
//! sees [`AgentView`]s.

use std::fmt;

use crate::migration::key::TransferKey;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::migration::{ApplicationProbe, MigrationMode, NetworkOutcome, TcpPreservation};

/// Which of the two agents of a migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    /// The agent on the node the pod runs on.
    Source,
    /// The agent on the node the pod moves to.
    Target,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Target => "target",
        })
    }
}

/// One step an agent runs for a migration. Each is idempotent per migration UID.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Source: find the pod's process trees, check CRIU, open the checkpoint dir.
    Prepare,
    /// Target: arm the receiver for the images (authenticated with the transfer key).
    Receive,
    /// Source: pre-copy round `n` (1-based) while the pod runs; pages stream to the target.
    PreDump(u32),
    /// Source: freeze every container of the pod, final dump, leave it frozen.
    Dump,
    /// Source: stream the remaining images to the target agent.
    Transfer,
    /// Source: the restore fence, acknowledged before the target is asked to restore.
    /// From then on the source's node (its agent's freeze watchdog and shutdown, its
    /// broker's lease loss and restart) kills the frozen source instead of resuming
    /// it; only `Abort` (sent once the target's copy is confirmed dead) resumes it.
    Fence,
    /// Target: restore into the target pod's namespaces and cgroup, resume.
    Restore,
    /// Target: run the application probe against the restored process.
    Probe,
    /// Source, fenced, once the target's copy passed its probe: the source's node
    /// sends new connections that would reach the frozen source to the target, until
    /// the source is killed (issue 39). Its outcome is reported apart from the other
    /// steps' ([`AgentProgress::forward`]): it neither replaces nor ends them.
    Forward,
    /// Source: kill the frozen source process tree (the point of no return).
    Commit,
    /// Source: thaw and resume the source. Target: kill the restored tree.
    Abort,
    /// Both: zeroize and remove the checkpoint images, forget the migration.
    Cleanup,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Step::PreDump(n) => write!(f, "PreDump({n})"),
            other => write!(f, "{other:?}"),
        }
    }
}

/// How the last step stands on the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepState {
    Running,
    Done,
    /// The step failed; `category` is a bounded CamelCase word from the agent.
    Failed {
        category: String,
        message: String,
    },
}

/// Counters and timings an agent reports for a migration. Absent values are unknown.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentProgress {
    /// Pre-copy rounds completed.
    pub iteration: u32,
    /// Image bytes sent to the target so far (source).
    pub bytes_sent: u64,
    /// Dirty bytes left after the last round (source).
    pub dirty_bytes: Option<u64>,
    /// Transfer rate measured in the last round, bytes per second (source).
    pub rate_bytes_per_second: Option<u64>,
    /// What the final dump itself will take, in milliseconds, whatever the dirty set:
    /// the last pre-copy round's duration (source). Without soft-dirty tracking the
    /// final dump writes the whole memory again, so this is most of the freeze.
    pub dump_millis: Option<u64>,
    /// When the pod was frozen for the final dump (source).
    pub frozen_at: Option<Timestamp>,
    /// When the restored process resumed (target).
    pub resumed_at: Option<Timestamp>,
    /// What happened to the sockets (target, after restore).
    pub network: Option<NetworkOutcome>,
    /// Source: the restore fence holds (the agent acknowledged `Fence`, no `Abort` since).
    pub fenced: bool,
    /// Source: the fenced source was killed on its node (its agent's freeze watchdog:
    /// nobody committed or aborted in time), never resumed. Nothing can thaw it; the
    /// target's images are all that is left of the state.
    pub killed_under_fence: bool,
    /// PostCopy. Target: every page is in and the restored copy runs on its own (it no
    /// longer depends on the source); source: the target's daemon ended the session.
    pub lazy_done: bool,
    /// PostCopy: why the lazy phase failed (on the target, the restored copy was
    /// killed first: its missing pages would read as zeros).
    pub lazy_error: Option<String>,
    /// PostCopy: page bytes sent (source) or received (target) after the resume.
    pub lazy_bytes: u64,
    /// Source: every freeze of the pod's trees so far, in order (the pre-copy
    /// rounds', then the final dump's).
    pub freezes: Vec<AgentFreeze>,
    /// Source: how `Step::Forward` stands, as far as the operator knows (`None`:
    /// never asked, or forgotten in an operator restart; asking again is harmless).
    pub forward: Option<StepState>,
}

/// One freeze of the source pod's process trees, as its agent measured it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentFreeze {
    /// The pre-copy round (1-based); for the final dump, the round after the last.
    pub round: u32,
    pub final_dump: bool,
    /// How long the trees were frozen, in microseconds, seizing included.
    pub micros: u64,
    /// Memory pages CRIU wrote, where it said.
    pub pages_written: Option<u64>,
    /// Bytes of memory images written, where known.
    pub bytes_written: Option<u64>,
    /// Measured by CRIU's own statistics; else by the agent's clock around the dump.
    pub by_criu: bool,
}

/// An agent's report for one migration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AgentReport {
    /// The last step asked for and its state; `None` if the agent knows nothing of
    /// this migration (never asked, or restarted and swept its state).
    pub last: Option<(Step, StepState)>,
    pub progress: AgentProgress,
}

impl AgentReport {
    /// Whether `step` has completed (it is the last step and it is done).
    pub fn done(&self, step: Step) -> bool {
        matches!(&self.last, Some((s, StepState::Done)) if *s == step)
    }
    /// Whether `step` is the last step and still running.
    pub fn running(&self, step: Step) -> bool {
        matches!(&self.last, Some((s, StepState::Running)) if *s == step)
    }
    /// The failure of the last step, if it failed.
    pub fn failure(&self) -> Option<(Step, &str, &str)> {
        match &self.last {
            Some((s, StepState::Failed { category, message })) => Some((*s, category, message)),
            _ => None,
        }
    }
    pub fn last_step(&self) -> Option<Step> {
        self.last.as_ref().map(|(s, _)| *s)
    }
}

/// What the operator could learn from one agent this round.
#[derive(Clone, Debug, PartialEq)]
pub enum AgentView {
    /// No agent is known for the node (no ready agent pod, no endpoint override).
    Missing,
    /// The agent did not answer.
    Unreachable(String),
    /// Boxed: a report is many times the size of the other variants.
    Reported(Box<AgentReport>),
}

impl AgentView {
    pub fn reported(r: AgentReport) -> Self {
        AgentView::Reported(Box::new(r))
    }

    pub fn report(&self) -> Option<&AgentReport> {
        match self {
            AgentView::Reported(r) => Some(r),
            _ => None,
        }
    }
}

/// Everything an agent needs to run a step; the same for every step of a migration.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRequest {
    /// UID of the PodMigration: the agents' key for all state of this migration.
    pub migration_uid: String,
    pub namespace: String,
    pub source_pod: String,
    pub source_pod_uid: String,
    pub target_pod: String,
    pub source_node: String,
    pub target_node: String,
    /// The key the images are sealed under (see `key`).
    pub transfer_key: TransferKey,
    pub mode: MigrationMode,
    pub tcp_preservation: TcpPreservation,
    pub bandwidth_limit_bytes_per_second: Option<i64>,
    /// The probe to run on the target; `None`: the pod's own readiness probe.
    pub probe: Option<ApplicationProbe>,
    /// Where the target agent is reached (the source streams the images there).
    pub target_agent_url: Option<String>,
    /// Container IDs (`containerd://…`) of the pod this step acts on: the source pod's
    /// for source steps, the target pod's holders for target steps. The agent resolves
    /// them to host PIDs through CRI; the operator never sees host PIDs.
    pub container_ids: Vec<String>,
    /// The same pod's containers by name, `(name, container ID)`, in the pod's order:
    /// native sidecars (init containers with `restartPolicy: Always`), then the
    /// regular containers; finished init containers and containers without an ID yet
    /// are left out. The agents pair a source container with the target container of
    /// its name.
    pub containers: Vec<(String, String)>,
    /// The target closed (did not preserve) established connections: at commit the
    /// source sends FIN on them before it dies.
    pub close_connections: bool,
    /// The PodMigration's freeze budget (ms): the source agent's freeze watchdog
    /// resumes a source still frozen this long plus its margin after the final dump.
    pub freeze_budget_millis: u64,
    pub step: Step,
}

/// Where an agent is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentEndpoint {
    pub node: String,
    /// `https://host:port` (or `http://` for local runs).
    pub url: String,
}

/// A failed call to an agent (transport, TLS, timeout or a refusal to start a step).
#[derive(Debug, thiserror::Error)]
#[error("agent on {node}: {message}")]
pub struct AgentCallError {
    pub node: String,
    pub message: String,
}

/// The calls the controller makes. Implementations do I/O; the state machine never
/// calls them.
pub trait AgentClient: Send + Sync + 'static {
    /// The agent's report for a migration UID (cheap, read-only).
    fn report(
        &self,
        endpoint: &AgentEndpoint,
        migration_uid: &str,
    ) -> impl Future<Output = Result<AgentReport, AgentCallError>> + Send;

    /// Starts `request.step` (returns once the agent accepted it; completion shows in
    /// later reports). Starting a step that already ran or runs is a no-op.
    fn start(
        &self,
        endpoint: &AgentEndpoint,
        request: &StepRequest,
    ) -> impl Future<Output = Result<(), AgentCallError>> + Send;

    /// The UIDs of migrations whose started step just ended (its outcome is in the next
    /// [`report`](Self::report)), so the controller reconciles them at once rather than
    /// at their next poll. The stream is handed out once; later calls, and clients that
    /// cannot tell, get an empty one (the polls still see every outcome).
    fn step_ends(&self) -> impl futures::Stream<Item = String> + Send + 'static {
        futures::stream::empty()
    }
}
