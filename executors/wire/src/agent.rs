//! Messages of `podmotion.agent.v1.MigrationAgent`. Field numbers are the wire
//! contract: never renumber, never reuse a retired tag, only add.
//!
//! The operator drives each agent step by step; every call names the migration by its
//! UID and is idempotent: repeating a step that already happened returns the current
//! [`MigrationStatus`] instead of doing it twice.
//!
//! Who may call what is decided per call from the caller's certificate
//! ([`crate::identity`]): every call but `ReceiveImages` is the operator's;
//! `ReceiveImages` is the source agent's, named by the operator at `Prepare`.
//!
//! The restore fence: before the operator asks the target to `Restore`, it asks the
//! source agent to `Fence` (a `MigrationRef`; answered with the status, `fenced` set).
//! From the acknowledgement on, nothing on the source node resumes the frozen source
//! but the operator's `Abort`: the freeze watchdog and the agent's shutdown kill it,
//! and so does the broker when the agent's lease ends or the broker restarts.
//!
//! The leader's term: with leader election on, the operator sends the transition count
//! of the lease it holds as request metadata ([`LEADER_TERM_METADATA`], decimal) on
//! every call. An agent refuses a commanding call whose term is lower than the highest
//! it has seen: a replica that still believes it leads after another took over (a
//! paused process, a partition) commands nothing. No metadata: no term (leader election
//! off), accepted and not counted.

/// Request metadata naming the operator's leader term (see the module docs).
pub const LEADER_TERM_METADATA: &str = "podmotion-leader-term";

/// The leader term in `meta`: `Ok(None)` when absent, an error when not a decimal.
pub fn leader_term(meta: &tonic::metadata::MetadataMap) -> Result<Option<u64>, String> {
    let Some(v) = meta.get(LEADER_TERM_METADATA) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Some)
        .ok_or_else(|| format!("{LEADER_TERM_METADATA}: not a term: {v:?}"))
}

/// Which side of a migration an agent plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Role {
    Unspecified = 0,
    Source = 1,
    Target = 2,
}

/// What to do with established TCP connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum TcpPreservation {
    /// Preserve when the pod address moved to the target; otherwise close cleanly.
    BestEffort = 0,
    /// Preserve, or fail the restore (the source then resumes).
    Strict = 1,
    /// Close every established connection cleanly (the peer sees FIN).
    None = 2,
}

/// Step of one migration on one agent. Never runs backwards except to `Prepared` after
/// a failed dump (the source was resumed by CRIU) or to `Aborted`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Phase {
    Unknown = 0,
    Prepared = 1,
    PreDumping = 2,
    /// Final dump done; the source tree is stopped and its network locked.
    Dumped = 3,
    Sent = 4,
    Receiving = 5,
    Received = 6,
    Restored = 7,
    Committed = 8,
    Aborted = 9,
    CleanedUp = 10,
    /// Source: fenced (`Fence`) and then killed by the agent itself (its freeze
    /// watchdog) instead of resumed: a fenced source is resumed only by the
    /// operator's `Abort`. The images the target holds are all that is left of the
    /// state. `Commit` answers it as done (the source is gone); `Abort` is refused.
    Killed = 11,
}

/// Outcome of one socket of the workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum SocketOutcome {
    Pending = 0,
    /// A listener, bound again on the target.
    ListenerRestored = 1,
    /// Established connection restored with its sequence numbers (address moved).
    Preserved = 2,
    /// Established connection closed cleanly (FIN), the address did not move.
    ClosedCleanly = 3,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MigrationRef {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
}

impl MigrationRef {
    pub fn new(uid: impl Into<String>) -> Self {
        Self {
            migration_uid: uid.into(),
        }
    }
}

/// Only the operator calls `Prepare`. There is no PID on the wire (tags 3 and 4, the
/// caller's `pid` and its start time, are retired): the agent resolves the
/// containers the operator names through the node's container runtime.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareRequest {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
    #[prost(enumeration = "Role", tag = "2")]
    pub role: i32,
    /// The per-migration transfer key (32 bytes), from the migration's Secret.
    #[prost(bytes = "vec", tag = "5")]
    pub transfer_key: Vec<u8>,
    #[prost(enumeration = "TcpPreservation", tag = "6")]
    pub tcp: i32,
    /// Container IDs of the pod as the kubelet reports them (`containerd://…`),
    /// first the one whose process tree migrates (source) or holds the namespaces
    /// (target). The agent resolves them to host PIDs through the node's runtime.
    #[prost(string, repeated, tag = "7")]
    pub container_ids: Vec<String>,
    /// The node of the other agent of this migration (a Kubernetes node name): the
    /// target accepts the image stream only from `spiffe://podmotion.io/agent/<peer>`,
    /// and the source streams only to a server with that identity. Never this node.
    #[prost(string, tag = "8")]
    pub peer_node: String,
    /// The PodMigration's freeze budget in milliseconds (source). The source agent's
    /// freeze watchdog resumes a source still frozen this long plus the agent's margin
    /// after its final dump, whatever the operator and the API server do. 0: the
    /// agent's default budget.
    #[prost(uint64, tag = "9")]
    pub freeze_budget_ms: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SendRequest {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
    /// `https://host:port` of the target agent. Where to dial only: the source
    /// streams only to a server whose certificate identifies the peer named at
    /// `Prepare` (`spiffe://podmotion.io/agent/<peer_node>`).
    #[prost(string, tag = "2")]
    pub target_endpoint: String,
    /// TLS server name (SNI) sent when dialling; not what is trusted (see
    /// `target_endpoint`).
    #[prost(string, tag = "3")]
    pub target_server_name: String,
    /// Bytes per second, 0 = unlimited.
    #[prost(uint64, tag = "4")]
    pub bandwidth_limit: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitRequest {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
    /// The target closed (did not preserve) established connections: let the source
    /// send FIN on them before it is killed, so peers see a clean close.
    #[prost(bool, tag = "2")]
    pub close_connections: bool,
}

/// One sealed piece of a checkpoint image file, agent to agent (`ReceiveImages`, the
/// only call an agent makes to another agent; accepted only from the peer named at
/// `Prepare`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImageChunk {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
    /// Strictly increasing from 0 over the whole stream (the AEAD nonce is the
    /// stream id followed by it).
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    /// Relative path inside the checkpoint dir (`<dir>/<file>`, `[A-Za-z0-9._-]`).
    #[prost(string, tag = "3")]
    pub path: String,
    #[prost(uint64, tag = "4")]
    pub offset: u64,
    #[prost(bytes = "vec", tag = "5")]
    pub sealed: Vec<u8>,
    /// Last chunk of the stream: `path` is empty and `sealed` authenticates the count.
    #[prost(bool, tag = "6")]
    pub end: bool,
    /// The entry is a symlink (CRIU's `parent` link between image dirs); `sealed`
    /// holds its target.
    #[prost(bool, tag = "7")]
    pub symlink: bool,
    /// Delta instruction: create `path` as a copy of `base` (an image the target
    /// already holds from an earlier round), resized to the length in `sealed` (u64
    /// big-endian); the following chunks of `path` patch it at their offsets.
    #[prost(string, tag = "8")]
    pub base: String,
    /// The stream's random id (`transfer::STREAM_ID_LEN` bytes), on the first chunk
    /// (seq 0) only: the first part of every nonce of this stream, so no two streams
    /// under one migration key share a nonce.
    #[prost(bytes = "vec", tag = "9")]
    pub stream_id: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ReceiveSummary {
    #[prost(uint64, tag = "1")]
    pub files: u64,
    #[prost(uint64, tag = "2")]
    pub bytes: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct SocketReport {
    #[prost(string, tag = "1")]
    pub local: String,
    #[prost(string, tag = "2")]
    pub remote: String,
    #[prost(bool, tag = "3")]
    pub listening: bool,
    #[prost(enumeration = "SocketOutcome", tag = "4")]
    pub outcome: i32,
}

/// Wall-clock instants in microseconds since the Unix epoch; 0 = not yet.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Timings {
    #[prost(uint64, tag = "1")]
    pub freeze_started_us: u64,
    #[prost(uint64, tag = "2")]
    pub dump_finished_us: u64,
    #[prost(uint64, tag = "3")]
    pub send_finished_us: u64,
    #[prost(uint64, tag = "4")]
    pub restore_started_us: u64,
    /// The restored tree runs on the target (or, after an abort, the source resumed).
    #[prost(uint64, tag = "5")]
    pub resumed_us: u64,
    #[prost(uint64, tag = "6")]
    pub last_pre_dump_us: u64,
    #[prost(uint64, tag = "7")]
    pub pre_dump_total_us: u64,
    #[prost(uint64, tag = "8")]
    pub dump_us: u64,
    #[prost(uint64, tag = "9")]
    pub send_us: u64,
    #[prost(uint64, tag = "10")]
    pub restore_us: u64,
    /// Duration of the last pre-dump round (what the final dump will roughly cost).
    #[prost(uint64, tag = "11")]
    pub last_round_us: u64,
    /// Time spent streaming pre-copy rounds to the target, in total.
    #[prost(uint64, tag = "12")]
    pub pre_copy_send_us: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MigrationStatus {
    #[prost(string, tag = "1")]
    pub migration_uid: String,
    #[prost(enumeration = "Role", tag = "2")]
    pub role: i32,
    #[prost(enumeration = "Phase", tag = "3")]
    pub phase: i32,
    /// Pre-dump rounds done.
    #[prost(uint32, tag = "4")]
    pub iteration: u32,
    /// Bytes written by the last pre-dump round (a dirty-rate estimate).
    #[prost(uint64, tag = "5")]
    pub last_round_bytes: u64,
    /// Total image bytes on this node.
    #[prost(uint64, tag = "6")]
    pub image_bytes: u64,
    #[prost(uint64, tag = "7")]
    pub bytes_sent: u64,
    #[prost(uint64, tag = "8")]
    pub bytes_received: u64,
    #[prost(message, optional, tag = "9")]
    pub timings: Option<Timings>,
    #[prost(message, repeated, tag = "10")]
    pub sockets: Vec<SocketReport>,
    /// Target: pid of the restored root.
    #[prost(int32, tag = "11")]
    pub restored_pid: i32,
    /// Bytes of the final dump (what the freeze had to write).
    #[prost(uint64, tag = "12")]
    pub final_dump_bytes: u64,
    /// Bytes the last pre-copy round had to stream (what changed since the round
    /// before: the dirty set the final transfer will roughly have to move).
    #[prost(uint64, tag = "13")]
    pub last_round_sent_bytes: u64,
    /// Bytes streamed to the target while the workload still ran.
    #[prost(uint64, tag = "14")]
    pub pre_copy_sent_bytes: u64,
    /// Source: the restore fence holds (`Fence` acknowledged, no `Abort` since): the
    /// agent's freeze watchdog, its shutdown and its broker (a lost lease, a restart)
    /// kill this source instead of resuming it.
    #[prost(bool, tag = "15")]
    pub fenced: bool,
}

impl MigrationStatus {
    pub fn timings(&self) -> Timings {
        self.timings.unwrap_or_default()
    }
    pub fn count(&self, outcome: SocketOutcome) -> usize {
        self.sockets
            .iter()
            .filter(|s| s.outcome == outcome as i32)
            .count()
    }
}

/// Checkpoint manifest sent with the images (`manifest.json` in the checkpoint dir):
/// what the target needs to decide per-socket outcomes before restoring.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Manifest {
    /// Directory of the final dump; pre-dump dirs are its parents.
    pub final_dir: String,
    pub sockets: Vec<ManifestSocket>,
    pub tcp: i32,
    /// A container's dump: the mount points dumped as external (bound to the target
    /// holder's mounts at the same points on restore). Empty for a process that shares
    /// the node's mount namespace.
    #[serde(default)]
    pub external_mounts: Vec<String>,
    /// The dumped tree's standard streams that were pipes to the runtime: `(fd, CRIU
    /// key "pipe:[inode]")`; on restore they become the holder's own streams, so the
    /// container's log continues on the target.
    #[serde(default)]
    pub stdio_pipes: Vec<(i32, String)>,
    /// A container's dump: the process its runtime started (from the runtime's spec),
    /// which the target's holder executes when the adopted container is restarted.
    #[serde(default)]
    pub workload: Option<Workload>,
}

/// Where a migration target pod's containers mount the holder's directory (an
/// `emptyDir`): the holder binary and, after restore, its restart file.
pub const HOLDER_DIR: &str = "/.podmotion";
/// The holder binary in [`HOLDER_DIR`].
pub const HOLDER_BIN: &str = "/.podmotion/hold";
/// The restart file in [`HOLDER_DIR`]: the [`Workload`] the holder executes when an
/// adopted container is started again.
pub const HOLDER_RESTART: &str = "/.podmotion/restart.json";

/// A container's original process, as its runtime started it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Workload {
    pub args: Vec<String>,
    #[serde(default)]
    pub cwd: String,
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ManifestSocket {
    pub local: String,
    pub remote: String,
    pub listening: bool,
}
