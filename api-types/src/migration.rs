//! `PodMigration`: live-migrate one running pod to another node.
//!
//! The spec says which pod, where to, and what the user accepts (freeze budget,
//! deadlines, bandwidth, what happens to TCP connections); the status reports the
//! phase machine, progress that never runs backwards and the measured downtime.
//! The whole spec is immutable: a migration is aborted by deleting it.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Live-migrates a running pod to another node with CRIU: pre-copy rounds while the
/// pod runs, a short freeze for the final dump, restore on the target node, and
/// commit only after the restored pod passes its application probe. Deleting a
/// PodMigration before it commits aborts it and resumes the source pod.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "podmotion.io",
    version = "v1alpha1",
    kind = "PodMigration",
    namespaced,
    status = "PodMigrationStatus",
    shortname = "pmig",
    category = "podmotion",
    doc = "Live-migrates a running pod to another node (CRIU checkpoint and restore).",
    printcolumn(name = "Pod", type_ = "string", json_path = ".spec.podName"),
    printcolumn(name = "Source", type_ = "string", json_path = ".status.sourceNode"),
    printcolumn(name = "Target", type_ = "string", json_path = ".status.targetNode"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Downtime", type_ = "string", json_path = ".status.downtime"),
    printcolumn(
        name = "Frozen",
        type_ = "string",
        json_path = ".status.totalFrozen",
        description = "Every freeze of the pod: the pre-copy rounds' and the downtime",
        priority = "1"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 63").message("metadata.name must be at most 63 characters: it labels the migration's target pod and Secret"),
)]
#[x_kube(
    validation = Rule::new("self == oldSelf").message("spec is immutable: delete this PodMigration (which aborts it and resumes the source pod) and create a new one"),
    validation = Rule::new("!(has(self.targetNode) && has(self.targetNodeSelector))").message("set at most one of targetNode and targetNodeSelector"),
    validation = Rule::new("self.mode == 'PreCopy' || !has(self.preCopy)").message("preCopy settings apply only to mode PreCopy"),
)]
#[serde(rename_all = "camelCase")]
pub struct PodMigrationSpec {
    /// Name of the pod to migrate, in this PodMigration's namespace.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("podName must be a DNS subdomain name (lowercase letters, digits, '-' and '.')"))]
    #[schemars(length(max = 253))]
    pub pod_name: String,

    /// UID of the pod. When set, the migration refuses to touch a different pod
    /// that later reused the same name.
    #[serde(default, rename = "podUID", skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$')").message("podUID must be a UID such as 1f0e6c2a-3c1d-4a53-9a1f-7d2f0c9e8b11"))]
    #[schemars(length(max = 36))]
    pub pod_uid: Option<String>,

    /// Node to migrate to. Leave unset (and optionally set `targetNodeSelector`) to
    /// let the operator pick a schedulable node with a ready migration agent that
    /// fits the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253").message("targetNode must be a node name"))]
    #[schemars(length(max = 253))]
    pub target_node: Option<String>,

    /// Labels the target node must carry when the operator picks it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node_selector: Option<BTreeMap<String, String>>,

    /// How memory is moved. `PreCopy` (default) copies memory in rounds while the pod
    /// runs and freezes it only for the last, small round; `Cold` freezes the pod for
    /// the whole dump and copy. `PostCopy` (opt-in) freezes it only to dump everything
    /// but its memory, resumes it on the target at once and moves the memory after, on
    /// demand (lazy pages): the shortest freeze, flat in the pod's memory, but until
    /// every page is in (`status.progress.lazyBytes` grows, then the commit) the
    /// restored pod depends on the frozen source: if the source's node or agent is lost
    /// in that window, the pod's in-memory state is lost with it (the migration ends
    /// `Failed`, the restored copy is killed, and the source's container restarts from
    /// its image). Up to the resume it rolls back like the other modes. It needs the
    /// source node's `fs.pipe-max-size` at least 3354624 (refused at `Prepare`
    /// otherwise, with the pod left running).
    #[serde(default)]
    pub mode: MigrationMode,

    /// Bounds of the pre-copy rounds (mode `PreCopy` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre_copy: Option<PreCopy>,

    /// The longest freeze (downtime) you accept, in milliseconds. If the final round
    /// cannot fit at the measured transfer rate after the last pre-copy round, the
    /// migration aborts with reason `FreezeBudgetExceeded` and the pod keeps running
    /// on its node; the budget is never silently exceeded.
    #[serde(default = "default_freeze_budget_millis")]
    #[x_kube(validation = Rule::new("self >= 10 && self <= 600000").message("freezeBudgetMillis must be between 10 and 600000"))]
    pub freeze_budget_millis: i64,

    /// Most bytes per second the checkpoint transfer may use. Unset: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self >= 1048576").message("bandwidthLimitBytesPerSecond must be at least 1048576 (1 MiB/s)"))]
    pub bandwidth_limit_bytes_per_second: Option<i64>,

    /// What happens to established TCP connections. `Strict`: they must survive
    /// (the pod IP must move with the pod) or the migration fails and the source is
    /// resumed; `BestEffort` (default): they survive where the IP moves and are closed
    /// cleanly otherwise; `None`: they are closed cleanly. Listeners always come back
    /// bound. The IP moves only where the installer enabled the address hand-over
    /// (chart value `migrationAgent.broker.addressHandover.cidrs`) for the pod's
    /// subnet.
    #[serde(default)]
    pub tcp_preservation: TcpPreservation,

    /// Check that must pass against the restored pod on the target node before the
    /// source is given up. Default: the pod's own readiness probe. A failed probe
    /// rolls the migration back to the source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe: Option<ApplicationProbe>,

    /// Run every pre-flight check, freeze nothing, and report whether the migration
    /// would proceed (condition `Migratable`).
    #[serde(default)]
    pub dry_run: bool,

    /// Migrate even though the pod keeps data on its node: in `emptyDir`, `hostPath`,
    /// `gitRepo` or generic ephemeral volumes, or writable inline CSI volumes. The
    /// target gets fresh, empty local volumes (a `hostPath` is the target node's own
    /// directory); data in the source's emptyDir/hostPath is lost, and a process that
    /// holds one of its files open may fail to restore (the migration then rolls
    /// back). Default `false`: such a pod is refused with reason `LocalData`.
    /// PersistentVolumeClaims that cannot be mounted on another node are refused
    /// whatever this says.
    #[serde(default)]
    pub leave_local_data_behind: bool,

    /// Abort (and resume the source) if the migration has not committed this many
    /// seconds after it was created.
    #[serde(default = "default_deadline_seconds")]
    #[x_kube(validation = Rule::new("self >= 10 && self <= 86400").message("deadlineSeconds must be between 10 and 86400"))]
    pub deadline_seconds: i64,

    /// Abort (and resume the source) if no progress (phase change, pre-copy round or
    /// transferred bytes) is seen for this many seconds.
    #[serde(default = "default_progress_timeout_seconds")]
    #[x_kube(validation = Rule::new("self >= 5 && self <= 3600").message("progressTimeoutSeconds must be between 5 and 3600"))]
    pub progress_timeout_seconds: i64,
}

fn default_freeze_budget_millis() -> i64 {
    500
}
fn default_deadline_seconds() -> i64 {
    900
}
fn default_progress_timeout_seconds() -> i64 {
    150
}

/// How memory is moved to the target node.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum MigrationMode {
    /// Iterative pre-dumps while the pod runs, then a short final dump.
    #[default]
    PreCopy,
    /// Stop, dump everything, copy, restore.
    Cold,
    /// Dump all but the memory, restore at once, then fetch the memory on demand from
    /// the frozen source (lazy pages). Shortest freeze; a source lost before every page
    /// is in loses the pod's state.
    PostCopy,
}

/// Bounds for the pre-copy rounds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreCopy {
    /// Most pre-dump rounds before the final dump.
    #[serde(default = "default_max_rounds")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 30").message("preCopy.maxRounds must be between 1 and 30"))]
    pub max_rounds: i32,

    /// Stop pre-copying once a round leaves at most this many dirty bytes.
    #[serde(default = "default_dirty_threshold_bytes")]
    #[x_kube(validation = Rule::new("self >= 0").message("preCopy.dirtyThresholdBytes must not be negative"))]
    pub dirty_threshold_bytes: i64,
}

fn default_max_rounds() -> i32 {
    5
}
fn default_dirty_threshold_bytes() -> i64 {
    4 * 1024 * 1024
}

/// What happens to established TCP connections.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum TcpPreservation {
    /// Connections must survive; refuse the migration when they cannot.
    Strict,
    /// Keep them where the pod IP moves with the pod; close them cleanly otherwise.
    #[default]
    BestEffort,
    /// Close them cleanly.
    None,
}

/// An application-level check, in the shape of a Kubernetes probe. Set exactly one
/// of `httpGet`, `tcpSocket`, `grpc` and `exec`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.httpGet), has(self.tcpSocket), has(self.grpc), has(self.exec)].filter(x, x).size() == 1").message("probe must set exactly one of httpGet, tcpSocket, grpc and exec"))]
pub struct ApplicationProbe {
    /// HTTP GET against the restored pod; any 2xx or 3xx passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_get: Option<HttpProbe>,
    /// TCP connect to the restored pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_socket: Option<TcpProbe>,
    /// gRPC health check (grpc.health.v1) against the restored pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<GrpcProbe>,
    /// Command run in the restored container; exit status 0 passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exec: Option<ExecProbe>,
    /// Seconds one attempt may take.
    #[serde(default = "default_probe_timeout")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 60").message("probe.timeoutSeconds must be between 1 and 60"))]
    pub timeout_seconds: i32,
    /// Attempts before the probe counts as failed (and the migration rolls back).
    #[serde(default = "default_probe_failure_threshold")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 30").message("probe.failureThreshold must be between 1 and 30"))]
    pub failure_threshold: i32,
}

fn default_probe_timeout() -> i32 {
    2
}
fn default_probe_failure_threshold() -> i32 {
    3
}

/// HTTP GET probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpProbe {
    /// Path to request.
    #[serde(default = "default_http_path")]
    #[x_kube(
        validation = Rule::new("self.startsWith('/')").message("probe.httpGet.path must start with '/'"),
        validation = Rule::new("self.size() <= 2048 && self.matches('^[!-~]*$')").message("probe.httpGet.path must be at most 2048 printable ASCII characters, without spaces or control characters such as CR and LF: it is sent as the HTTP request line (percent-encode anything else)")
    )]
    pub path: String,
    /// Container port number.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("probe port must be between 1 and 65535"))]
    pub port: i32,
    /// `HTTP` or `HTTPS`.
    #[serde(default)]
    pub scheme: HttpScheme,
}

fn default_http_path() -> String {
    "/".into()
}

/// Scheme of an HTTP probe.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "UPPERCASE")]
pub enum HttpScheme {
    #[default]
    Http,
    Https,
}

/// TCP connect probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct TcpProbe {
    /// Container port number.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("probe port must be between 1 and 65535"))]
    pub port: i32,
}

/// gRPC health probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct GrpcProbe {
    /// Container port number.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("probe port must be between 1 and 65535"))]
    pub port: i32,
    /// Service name sent in the health check request; empty checks the server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() <= 253 && self.matches('^[!-~]*$')").message("probe.grpc.service must be at most 253 printable ASCII characters without spaces"))]
    pub service: Option<String>,
}

/// Command probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExecProbe {
    /// Command and arguments, run without a shell.
    #[x_kube(validation = Rule::new("self.size() >= 1").message("probe.exec.command must not be empty"))]
    pub command: Vec<String>,
    /// Container to run it in; default: the pod's first container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() <= 63 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("probe.exec.container must be a container name (lowercase letters, digits and '-', at most 63 characters)"))]
    pub container: Option<String>,
}

/// Phase of a migration. `Succeeded`, `Failed` and `Aborted` are terminal.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, schemars::JsonSchema,
)]
pub enum MigrationPhase {
    /// Accepted, not yet validated.
    #[default]
    Pending,
    /// Checks run, target chosen, target pod and transfer key being prepared.
    Preparing,
    /// Pre-copy rounds and the final dump on the source node.
    Checkpointing,
    /// Checkpoint images streaming to the target node.
    Transferring,
    /// Restore on the target node and the application probe.
    Restoring,
    /// Source given up, target handed to the workload's controller.
    Committing,
    /// Done: the pod runs on the target node.
    Succeeded,
    /// Stopped by an error; the source pod was resumed.
    Failed,
    /// Stopped by the user (deletion) or by a deadline; the source pod was resumed.
    Aborted,
}

impl MigrationPhase {
    /// Whether the phase is final.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Aborted)
    }
}

/// When a phase was entered.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PhaseTransition {
    /// The phase entered.
    pub phase: MigrationPhase,
    /// When it was entered.
    pub time: Time,
}

/// Progress of the checkpoint and transfer. Every counter only grows.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationProgress {
    /// Pre-copy rounds completed (0 for Cold).
    #[serde(default)]
    pub iteration: i32,
    /// Bytes of checkpoint images sent to the target so far.
    #[serde(default)]
    pub bytes_sent: i64,
    /// Estimate of the bytes still to send (dirty memory plus the final dump).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_remaining_estimate: Option<i64>,
    /// Measured transfer rate of the last round, bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_rate_bytes_per_second: Option<i64>,
    /// PostCopy: bytes of memory the restored pod fetched from the source after it
    /// resumed (lazy pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy_bytes: Option<i64>,
    /// When progress (a phase change, a pre-copy round, transferred bytes) was last
    /// seen; `progressTimeoutSeconds` counts from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_progress_time: Option<Time>,
}

/// One freeze of the source pod's process trees (`status.freezes`): a pre-copy
/// round's or the final dump's. Without memory tracking in the node's kernel
/// (soft-dirty), a pre-copy round is a full dump that stops the pod while CRIU collects
/// its memory, then resumes it: the pod stalls for `frozenMillis`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MigrationFreeze {
    /// The pre-copy round (1-based); for the final dump, the round after the last
    /// pre-copy round.
    pub round: i32,
    /// The final dump: the pod stays frozen from it to the restore on the target
    /// (`downtimeMillis`), of which `frozenMillis` is the part CRIU itself held it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub final_dump: bool,
    /// How long the pod was frozen, in milliseconds, rounded up: from CRIU seizing its
    /// first task to the pod's resume (the final dump: to CRIU leaving it stopped).
    /// With several containers, the longest one's.
    pub frozen_millis: i64,
    /// Memory pages CRIU wrote in this dump, where it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages_written: Option<i64>,
    /// Bytes of memory images CRIU wrote in this dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_written: Option<i64>,
    /// How `frozenMillis` was measured.
    pub measured_by: FreezeMeasure,
}

/// How a freeze was measured.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum FreezeMeasure {
    /// CRIU's own statistics of the dump (its freezing and frozen times).
    #[default]
    #[serde(rename = "CRIU")]
    Criu,
    /// The node agent's clock around the dump, where CRIU left no statistics: an
    /// upper bound (it includes CRIU's start and exit, while the pod runs).
    AgentClock,
}

/// What happened to the pod's sockets.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NetworkOutcome {
    /// Listening sockets restored and accepting on the target.
    #[serde(default)]
    pub listeners_restored: i32,
    /// Established TCP connections that survived the move.
    #[serde(default)]
    pub connections_preserved: i32,
    /// Established TCP connections closed cleanly (FIN) because they could not move.
    #[serde(default)]
    pub connections_closed: i32,
    /// Connections that were reset. Non-zero means a peer saw an error.
    #[serde(default)]
    pub connections_reset: i32,
}

/// Observed state of a PodMigration.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodMigrationStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Current phase.
    #[serde(default)]
    pub phase: MigrationPhase,
    /// When each phase was entered, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phase_transition_timestamps: Vec<PhaseTransition>,
    /// UID of the source pod, pinned when the migration started.
    #[serde(
        default,
        rename = "sourcePodUID",
        skip_serializing_if = "Option::is_none"
    )]
    pub source_pod_uid: Option<String>,
    /// The mode this migration runs in (`spec.mode`), recorded once it started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<MigrationMode>,
    /// Node the pod ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_node: Option<String>,
    /// Node the pod moves to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_node: Option<String>,
    /// Name of the pod created on the target node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_pod: Option<String>,
    /// Checkpoint and transfer progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<MigrationProgress>,
    /// Measured freeze of the pod, from the final dump's freeze to the restored
    /// process running, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime_millis: Option<i64>,
    /// `downtimeMillis` for humans (`183ms`), shown by `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downtime: Option<String>,
    /// Every freeze of the source pod, in order: each pre-copy round's (the pod
    /// stalled while CRIU collected its memory), then the final dump's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub freezes: Vec<MigrationFreeze>,
    /// All the time the pod was frozen, in milliseconds: the pre-copy rounds'
    /// freezes plus the final freeze (`downtimeMillis` once measured; before, or if
    /// it never is, the final dump's own freeze). Grows with each round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_frozen_millis: Option<i64>,
    /// `totalFrozenMillis` for humans (`640ms`), shown by `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_frozen: Option<String>,
    /// What happened to the pod's sockets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkOutcome>,
    /// CamelCase reason of a failure or abort (also the Event reason).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_reason: Option<String>,
    /// Human-readable detail of a failure or abort.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_message: Option<String>,
    /// `Ready`, `Reconciling`, `Stalled` and `Migratable`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}
