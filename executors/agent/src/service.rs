//! The `MigrationAgent` service. Each migration is a small state machine keyed by its
//! UID; a step that already happened returns the current status instead of running
//! again, a step out of order is `FailedPrecondition`. Every call is first authorized
//! from the caller's certificate ([`crate::authz`]): control calls are the operator's,
//! the image stream is the peer agent's the operator named at `Prepare`.

use crate::admission::{Admission, Step, admit};
use crate::authz::{self, Prepared, Rpc};
use crate::containers::{ContainerFs, Containers, Resolved};
use crate::criu::{self, Criu, Opts, Req};
use crate::images;
use crate::mounts;
use futures::Stream;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::broker::{BrokerError, BrokerRole, Reply, Request};
use podmotion_wire::client::TlsFiles;
use podmotion_wire::identity::{self, IdentityError, Peer, PeerVerifier};
use podmotion_wire::ids::{MigrationUid, ProcRef};
use podmotion_wire::proto::migration_agent_client::MigrationAgentClient;
use podmotion_wire::proto::migration_agent_server::MigrationAgent;
use podmotion_wire::transfer::{self, Sealer};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};

pub struct Config {
    pub criu: Criu,
    /// Where the container IDs of a `Prepare` are resolved to host PIDs.
    pub containers: Containers,
    /// The kernel tracks dirty pages (soft-dirty): pre-dumps are CRIU pre-dumps with
    /// parent images. Without it, a pre-dump is a full warm copy taken while the
    /// workload keeps running, and the final transfer sends only blocks that differ
    /// from it.
    pub track_mem: bool,
    pub broker_socket: PathBuf,
    pub checkpoints_root: PathBuf,
    /// Identity used when this agent sends images to a target agent. Its URI SAN is
    /// this agent's identity (`spiffe://podmotion.io/agent/<node>`).
    pub tls: TlsFiles,
    /// Also accept the chart's legacy certificates without a URI SAN: the shared agent
    /// certificate (CN `podmotion-agent`, any node) and the operator's (CN
    /// `podmotion-operator`). Off unless asked for: with it, any agent may stream
    /// images to any migration this agent receives.
    pub legacy_shared_identity: bool,
    /// How long a source may stay frozen after its final dump before this agent
    /// resumes it on its own (see [`FreezeWatchdog`]).
    pub freeze_watchdog: FreezeWatchdog,
}

/// The agent-side bound on a freeze: a source still frozen `budget + margin` after its
/// final dump (`budget`: the PodMigration's freeze budget from `Prepare`, else
/// `default_budget`) is resumed by the agent itself, on its own monotonic clock,
/// without the operator or the API server. A migration the operator has not committed
/// by then has overrun its budget, which the operator rolls back anyway. A **fenced**
/// source (the operator may have asked the target to restore it) is killed instead:
/// never two copies, at the cost of the state if the target never restored.
#[derive(Clone, Copy, Debug)]
pub struct FreezeWatchdog {
    pub margin: std::time::Duration,
    pub default_budget: std::time::Duration,
}

impl FreezeWatchdog {
    fn limit(&self, budget_ms: u64) -> std::time::Duration {
        let budget = if budget_ms == 0 {
            self.default_budget
        } else {
            std::time::Duration::from_millis(budget_ms)
        };
        budget + self.margin
    }
}

/// Who owns a source's freeze once the final dump left it stopped: the first of
/// Commit (kills it), Abort, the freeze watchdog or SIGTERM (resume it) to claim it.
/// An atomic, not the migration's lock: a Send stuck on a dead target holds that lock,
/// and the watchdog must not wait for it.
///
/// The restore fence (`Fence`) moves FROZEN to FENCED: from there the watchdog and
/// SIGTERM kill the source (KILLING, KILLED) instead of resuming it, and only Abort
/// (the operator's, after the target's copy was confirmed killed) or Commit claim it.
#[derive(Debug)]
struct Freeze(std::sync::atomic::AtomicU8);

impl Default for Freeze {
    fn default() -> Self {
        Freeze(std::sync::atomic::AtomicU8::new(NOT_FROZEN))
    }
}

const NOT_FROZEN: u8 = 0;
const FROZEN: u8 = 1;
const COMMITTING: u8 = 2;
const THAWING: u8 = 3;
const THAWED: u8 = 4;
/// `Fence` is telling the broker (the watchdog waits for the outcome).
const FENCING: u8 = 5;
const FENCED: u8 = 6;
const KILLING: u8 = 7;
/// A fenced source killed by the watchdog or at shutdown (never by a commit).
const KILLED: u8 = 8;

impl Freeze {
    fn get(&self) -> u8 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn set(&self, v: u8) {
        self.0.store(v, std::sync::atomic::Ordering::SeqCst)
    }
    /// Moves FROZEN to `to`; false if the freeze was already claimed (or never made).
    fn claim(&self, to: u8) -> bool {
        self.claim_from(FROZEN, to)
    }
    /// Moves `from` to `to`; false if the freeze is not in `from`.
    fn claim_from(&self, from: u8, to: u8) -> bool {
        self.0
            .compare_exchange(
                from,
                to,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            )
            .is_ok()
    }
}

struct Migration {
    uid: MigrationUid,
    role: Role,
    /// The other agent's node, as the operator named it at `Prepare`.
    peer: String,
    phase: Phase,
    process: ProcRef,
    key: Vec<u8>,
    tcp: TcpPreservation,
    dir: PathBuf,
    iteration: u32,
    last_round_bytes: u64,
    image_bytes: u64,
    final_dump_bytes: u64,
    last_round_sent_bytes: u64,
    pre_copy_sent_bytes: u64,
    bytes_sent: u64,
    bytes_received: u64,
    timings: Timings,
    sockets: Vec<SocketReport>,
    restored: Option<ProcRef>,
    /// Relative paths already streamed to the target (Send is incremental).
    sent: std::collections::BTreeSet<String>,
    broker: Arc<StdMutex<BrokerClient>>,
    netns_path: Option<String>,
    /// A real container (source: the dumped one; target: the holder): its mounts.
    fs: Option<ContainerFs>,
    freeze: Arc<Freeze>,
    /// The watchdog's bound on this source's freeze.
    freeze_limit: std::time::Duration,
    /// The restore fence was taken (`Fence`), and no `Abort` lifted it since.
    fenced: bool,
}

impl Migration {
    fn status(&self) -> MigrationStatus {
        // A source resumed by the watchdog or at shutdown is aborted, even while a call
        // that still holds the migration (a Send) has not seen it yet.
        let phase = match self.freeze.get() {
            THAWED => Phase::Aborted,
            KILLED => Phase::Killed,
            _ => self.phase,
        };
        MigrationStatus {
            migration_uid: self.uid.to_string(),
            role: self.role as i32,
            phase: phase as i32,
            iteration: self.iteration,
            last_round_bytes: self.last_round_bytes,
            image_bytes: self.image_bytes,
            bytes_sent: self.bytes_sent,
            bytes_received: self.bytes_received,
            timings: Some(self.timings),
            sockets: self.sockets.clone(),
            restored_pid: self.restored.map(|p| p.pid).unwrap_or(0),
            final_dump_bytes: self.final_dump_bytes,
            last_round_sent_bytes: self.last_round_sent_bytes,
            pre_copy_sent_bytes: self.pre_copy_sent_bytes,
            fenced: matches!(self.freeze.get(), FENCED | KILLING | KILLED)
                || (self.fenced && self.freeze.get() == COMMITTING),
        }
    }

    async fn broker(&self, req: Request) -> Result<Reply, Status> {
        broker_call(&self.broker, req).await
    }

    /// Takes over a phase change that a watchdog or shutdown thaw made while a call
    /// held the migration.
    fn sync_freeze(&mut self) {
        match self.freeze.get() {
            THAWED if self.phase != Phase::Aborted => self.phase = Phase::Aborted,
            KILLED if self.phase != Phase::Killed => {
                self.phase = Phase::Killed;
                let _ = images::zeroize(&self.dir);
                self.image_bytes = 0;
            }
            _ => {}
        }
    }
}

async fn broker_call(b: &Arc<StdMutex<BrokerClient>>, req: Request) -> Result<Reply, Status> {
    let b = Arc::clone(b);
    blocking(move || {
        let r = b.lock().expect("broker client").call(&req);
        crate::metrics::global().broker_op(req.name(), r.as_ref().map(|_| ()).map_err(|e| e.kind));
        r.map_err(broker_status)
    })
    .await
}

/// Resumes a source the final dump left frozen, if nothing else claimed it: `Ok(true)`
/// when this call resumed it. On failure the freeze is left to the next claimant.
async fn thaw_frozen(
    freeze: &Freeze,
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
) -> Result<bool, Status> {
    if !freeze.claim(THAWING) {
        return Ok(false);
    }
    match thaw_source(b, uid).await {
        Ok(()) => {
            freeze.set(THAWED);
            Ok(true)
        }
        Err(e) => {
            freeze.set(FROZEN);
            Err(e)
        }
    }
}

/// Kills a fenced source the final dump left frozen, if nothing else claimed it (the
/// freeze watchdog and shutdown: a fenced source is never resumed but by the
/// operator's Abort): `Ok(true)` when this call killed it. On failure the freeze stays
/// fenced for the next claimant.
async fn kill_fenced(
    freeze: &Freeze,
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
    process: ProcRef,
) -> Result<bool, Status> {
    if !freeze.claim_from(FENCED, KILLING) {
        return Ok(false);
    }
    match kill_source(b, uid, process).await {
        Ok(()) => {
            freeze.set(KILLED);
            Ok(true)
        }
        Err(e) => {
            freeze.set(FENCED);
            Err(e)
        }
    }
}

/// SIGKILLs the source tree (through the broker) and waits, bounded, until its root is
/// gone.
async fn kill_source(
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
    process: ProcRef,
) -> Result<(), Status> {
    broker_call(b, Request::Kill { uid: uid.clone() }).await?;
    blocking(move || {
        for _ in 0..500 {
            if procfs::check_live(process).is_err() {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        Err(Status::internal("source tree did not die"))
    })
    .await
}

/// Resumes a source: out of TCP repair, network back, then run, in that order so the
/// resumed workload's sockets work from its first instruction.
async fn thaw_source(b: &Arc<StdMutex<BrokerClient>>, uid: &MigrationUid) -> Result<(), Status> {
    broker_call(b, Request::ReleaseTcpRepair { uid: uid.clone() }).await?;
    broker_call(b, Request::UnlockNetwork { uid: uid.clone() }).await?;
    broker_call(b, Request::Resume { uid: uid.clone() }).await?;
    Ok(())
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

/// An error and its sources, `: `-separated (a refused TLS handshake says why only
/// in a source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let m = s.to_string();
        if !out.contains(&m) {
            out = format!("{out}: {m}");
        }
        src = s.source();
    }
    out
}

fn broker_status(e: BrokerError) -> Status {
    Status::failed_precondition(format!("broker: {e}"))
}

fn criu_status(e: criu::CriuError) -> Status {
    Status::internal(e.to_string())
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
}

fn netns_ino(pid: i32) -> Result<String, Status> {
    let l = std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .map_err(|e| Status::not_found(e.to_string()))?;
    Ok(l.to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect())
}

/// Name under which the pod's network namespace is external to the images: CRIU
/// neither dumps nor recreates it; the target passes its own namespace for this key.
const NETNS_KEY: &str = "podnet";

pub struct Agent {
    cfg: Arc<Config>,
    /// This agent's own identity, from its certificate.
    own: Peer,
    migrations: StdMutex<HashMap<String, Arc<Mutex<Migration>>>>,
    /// Every source this agent left frozen after a final dump (claimed or not).
    frozen: Arc<StdMutex<Vec<FrozenSource>>>,
}

#[derive(Clone)]
struct FrozenSource {
    freeze: Arc<Freeze>,
    broker: Arc<StdMutex<BrokerClient>>,
    uid: MigrationUid,
    /// The frozen tree's root (a fenced source is killed, not resumed).
    process: ProcRef,
    /// For the metrics: when the final dump froze it, and its freeze budget.
    since: std::time::Instant,
    budget: std::time::Duration,
}

impl Agent {
    /// Fails if the agent's certificate does not identify a node agent
    /// (`spiffe://podmotion.io/agent/<node>`; with `legacy_shared_identity`, the shared
    /// agent certificate also serves).
    pub fn new(cfg: Config) -> Result<Self, IdentityError> {
        let own = identity::from_pem(&cfg.tls.material().cert_pem, cfg.legacy_shared_identity)?;
        if !matches!(own, Peer::Agent(_) | Peer::SharedAgent) {
            return Err(IdentityError::Unknown(format!(
                "{own} (an agent's certificate must identify the agent)"
            )));
        }
        tracing::info!(identity = %own, legacy = cfg.legacy_shared_identity, "agent identity");
        Ok(Self {
            cfg: Arc::new(cfg),
            own,
            migrations: StdMutex::new(HashMap::new()),
            frozen: Arc::new(StdMutex::new(Vec::new())),
        })
    }

    /// This agent's node, if its identity names one.
    fn own_node(&self) -> Option<&str> {
        match &self.own {
            Peer::Agent(n) => Some(n),
            _ => None,
        }
    }

    /// The caller's identity, from its TLS client certificate.
    fn caller<T>(&self, r: &GrpcRequest<T>) -> Result<Peer, IdentityError> {
        let certs = r.peer_certs();
        identity::from_chain(
            certs.as_deref().map(Vec::as_slice),
            self.cfg.legacy_shared_identity,
        )
    }

    /// Authorizes a control call (its decision does not depend on the migration).
    fn authorize_control<T>(&self, r: &GrpcRequest<T>, rpc: Rpc) -> Result<(), Status> {
        let caller = self.caller(r);
        let state = authz::State {
            this_node: self.own_node(),
            migration: None,
        };
        authz::authorize(&caller, rpc, state).map_err(|d| {
            tracing::warn!(%rpc, denied = %d, "call refused");
            Status::from(d)
        })
    }

    /// Resumes every source this agent froze and nobody has committed or aborted, and
    /// kills every fenced one (its copy may run on the target): run before the agent
    /// exits (SIGTERM), so no freeze outlives its agent. Reads only the freezes' own
    /// parts, never a migration's lock (a stuck Send may hold it). Returns how many
    /// were resumed and how many killed. A fence in flight is left to the broker,
    /// which kills or rolls back by what it was told when this agent's lease ends.
    pub async fn thaw_frozen_sources(&self, why: &str) -> (usize, usize) {
        let all: Vec<_> = self.frozen.lock().expect("frozen").clone();
        let (mut thawed, mut killed) = (0, 0);
        for f in all {
            match thaw_frozen(&f.freeze, &f.broker, &f.uid).await {
                Ok(true) => {
                    thawed += 1;
                    tracing::warn!(uid = %f.uid, why, "resumed the frozen source before exiting");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(uid = %f.uid, why, error = %e, "could not resume the source")
                }
            }
            match kill_fenced(&f.freeze, &f.broker, &f.uid, f.process).await {
                Ok(true) => {
                    killed += 1;
                    tracing::warn!(uid = %f.uid, why, "killed the fenced source before exiting (restore fence: never resumed but by the operator's abort)");
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(uid = %f.uid, why, error = %e, "could not kill the fenced source; its broker kills it when this agent's lease ends")
                }
            }
        }
        (thawed, killed)
    }

    /// The sources this agent froze that are still frozen, for the metrics.
    pub fn frozen_sources(&self) -> Vec<crate::metrics::FrozenAge> {
        let all = self.frozen.lock().expect("frozen");
        all.iter()
            .filter(|f| matches!(f.freeze.get(), FROZEN | FENCING | FENCED))
            .map(|f| crate::metrics::FrozenAge {
                frozen_for: f.since.elapsed(),
                budget: f.budget,
            })
            .collect()
    }

    fn get(&self, uid: &str) -> Result<Arc<Mutex<Migration>>, Status> {
        self.migrations
            .lock()
            .expect("migrations")
            .get(uid)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no migration {uid:?} on this agent")))
    }

    async fn prepare_impl(&self, r: PrepareRequest) -> Result<MigrationStatus, Status> {
        let uid = MigrationUid::parse(&r.migration_uid)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        if let Ok(m) = self.get(uid.as_str()) {
            return Ok(m.lock().await.status());
        }
        let role = Role::try_from(r.role).unwrap_or(Role::Unspecified);
        if role == Role::Unspecified {
            return Err(Status::invalid_argument("role must be Source or Target"));
        }
        if r.transfer_key.len() != transfer::KEY_LEN {
            return Err(Status::invalid_argument("transfer key must be 32 bytes"));
        }
        if !identity::valid_node_name(&r.peer_node) {
            return Err(Status::invalid_argument(format!(
                "peer_node {:?} is not a node name: name the other agent's node",
                r.peer_node
            )));
        }
        if self.own_node() == Some(r.peer_node.as_str()) {
            return Err(Status::invalid_argument(format!(
                "peer_node {:?} is this agent's own node",
                r.peer_node
            )));
        }
        // No PID on the wire: the containers the operator names are resolved here,
        // through the node's container runtime.
        let Resolved { pid, fs } = self.cfg.containers.resolve(&r.container_ids).await?;
        let start_time = procfs::start_time(pid).map_err(|e| Status::not_found(e.to_string()))?;
        let process = ProcRef { pid, start_time };
        let dir = images::create(&self.cfg.checkpoints_root, uid.as_str())
            .map_err(|e| Status::internal(e.to_string()))?;
        let sock = self.cfg.broker_socket.clone();
        let client = blocking(move || {
            BrokerClient::connect(&sock).map_err(|e| Status::unavailable(format!("broker: {e}")))
        })
        .await?;
        let mut m = Migration {
            uid: uid.clone(),
            role,
            peer: r.peer_node,
            phase: Phase::Prepared,
            process,
            key: r.transfer_key,
            tcp: TcpPreservation::try_from(r.tcp).unwrap_or(TcpPreservation::BestEffort),
            dir: dir.clone(),
            iteration: 0,
            last_round_bytes: 0,
            image_bytes: 0,
            final_dump_bytes: 0,
            last_round_sent_bytes: 0,
            pre_copy_sent_bytes: 0,
            bytes_sent: 0,
            bytes_received: 0,
            timings: Timings::default(),
            sockets: vec![],
            restored: None,
            sent: Default::default(),
            broker: Arc::new(StdMutex::new(client)),
            netns_path: None,
            fs,
            freeze: Arc::default(),
            freeze_limit: self.cfg.freeze_watchdog.limit(r.freeze_budget_ms),
            fenced: false,
        };
        let broker_role = if role == Role::Source {
            BrokerRole::Source
        } else {
            BrokerRole::Target
        };
        let reg = m
            .broker(Request::Register {
                uid: uid.clone(),
                role: broker_role,
                process,
            })
            .await;
        if let Err(e) = reg {
            let _ = images::zeroize(&dir);
            return Err(e);
        }
        if role == Role::Target {
            match m.broker(Request::BindNetns { uid: uid.clone() }).await {
                Ok(Reply::NetnsPath { path }) => m.netns_path = Some(path),
                Ok(other) => return Err(Status::internal(format!("broker replied {other:?}"))),
                Err(e) => {
                    let _ = images::zeroize(&dir);
                    return Err(e);
                }
            }
        }
        let st = m.status();
        tracing::info!(%uid, ?role, pid = process.pid, peer = %m.peer, "prepared");
        self.migrations
            .lock()
            .expect("migrations")
            .insert(uid.to_string(), Arc::new(Mutex::new(m)));
        Ok(st)
    }

    fn dump_opts(
        &self,
        m: &Migration,
        dir: &Path,
        log: &str,
        external_mounts: &[String],
    ) -> Result<Opts, Status> {
        let mut o = Opts::new(dir, log);
        o.pid = Some(m.process.pid);
        o.external = vec![format!("net[{}]:{NETNS_KEY}", netns_ino(m.process.pid)?)];
        o.external
            .extend(mounts::dump_external_args(external_mounts));
        if self.cfg.track_mem {
            o.track_mem = Some(true);
            if m.iteration > 0 {
                o.parent_img = Some(format!("../pre-{}", m.iteration));
            }
        }
        Ok(o)
    }

    /// The mount points a container's dump declares external (none for a process in
    /// the node's mount namespace).
    fn external_mounts(&self, m: &Migration) -> Result<Vec<String>, Status> {
        let Some(fs) = &m.fs else {
            return Ok(vec![]);
        };
        let mi = std::fs::read_to_string(format!("/proc/{}/mountinfo", m.process.pid))
            .map_err(|e| Status::failed_precondition(format!("mounts of the source: {e}")))?;
        Ok(mounts::dump_externals(
            &fs.spec,
            &mounts::parse_mountinfo(&mi),
        ))
    }

    async fn pre_dump_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let m = self.get(uid)?;
        let mut m = m.lock().await;
        admit(m.role, m.phase, Step::PreDump)?;
        procfs::check_live(m.process).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let n = m.iteration + 1;
        let dir = m.dir.join(format!("pre-{n}"));
        std::fs::create_dir_all(&dir).map_err(|e| Status::internal(e.to_string()))?;
        let mut opts = self.dump_opts(&m, &dir, "pre-dump.log", &self.external_mounts(&m)?)?;
        let kind = if self.cfg.track_mem {
            criu::REQ_PRE_DUMP
        } else {
            // Warm copy: a full dump that leaves the workload running and does not
            // touch its connections (they are captured by the final dump only).
            opts.leave_running = Some(true);
            opts.tcp_close = Some(true);
            criu::REQ_DUMP
        };
        let criu = self.cfg.criu.clone();
        let t = Instant::now();
        let log = dir.join("pre-dump.log");
        blocking(move || {
            criu.call(
                Req {
                    r#type: kind,
                    opts: Some(opts),
                },
                Some(&log),
            )
            .map_err(criu_status)
        })
        .await?;
        m.timings.last_round_us = t.elapsed().as_micros() as u64;
        m.timings.pre_dump_total_us += m.timings.last_round_us;
        m.timings.last_pre_dump_us = now_us();
        m.iteration = n;
        m.phase = Phase::PreDumping;
        m.last_round_bytes = images::size(&dir);
        m.image_bytes = images::size(&m.dir);
        Ok(m.status())
    }

    async fn dump_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let mut m = self.get(uid)?.lock_owned().await;
        m.sync_freeze();
        if admit(m.role, m.phase, Step::Dump)? == Admission::Done {
            return Ok(m.status());
        }
        procfs::check_live(m.process).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let dir = m.dir.join("final");
        std::fs::create_dir_all(&dir).map_err(|e| Status::internal(e.to_string()))?;
        let external_mounts = self.external_mounts(&m)?;
        let stdio_pipes: Vec<(i32, String)> = if m.fs.is_some() {
            mounts::stdio_pipes(m.process.pid)
                .into_iter()
                .map(|p| (p.fd, p.key))
                .collect()
        } else {
            vec![]
        };
        let opts = {
            let mut o = self.dump_opts(&m, &dir, "dump.log", &external_mounts)?;
            o.tcp_established = Some(true);
            o.tcp_skip_in_flight = Some(true);
            o.leave_stopped = Some(true);
            o
        };
        // From the network lock on, the dump runs to its end in a task of its own
        // that holds the migration, even if the caller goes away (a dropped gRPC call
        // drops its handler's future): a dump cut off after CRIU stopped the tree
        // would leave the source stopped and its network locked with no record of the
        // freeze, so no watchdog would resume it.
        let dumped = DumpOutcome {
            dir,
            opts,
            external_mounts,
            stdio_pipes,
            criu: self.cfg.criu.clone(),
            frozen: Arc::clone(&self.frozen),
            margin: self.cfg.freeze_watchdog.margin,
        };
        tokio::spawn(dump_locked(m, dumped))
            .await
            .map_err(|e| Status::internal(format!("dump task: {e}")))?
    }

    async fn send_impl(&self, r: SendRequest) -> Result<MigrationStatus, Status> {
        let m = self.get(&r.migration_uid)?;
        let mut m = m.lock().await;
        m.sync_freeze();
        if admit(m.role, m.phase, Step::Send)? == Admission::Done {
            return Ok(m.status());
        }
        let t = Instant::now();
        // The endpoint says where to dial; what is trusted is the identity the
        // operator named at Prepare: the server must prove it is the peer's agent.
        let tls = self.cfg.tls.material();
        let verifier = PeerVerifier::new(
            &tls.ca_pem,
            Peer::Agent(m.peer.clone()),
            self.cfg.legacy_shared_identity,
        )
        .map_err(|e| Status::internal(format!("agents' CA: {e}")))?;
        let sni = if r.target_server_name.is_empty() {
            m.peer.clone()
        } else {
            r.target_server_name.clone()
        };
        let channel = tonic::transport::Endpoint::from_shared(r.target_endpoint.clone())
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .tls_config_with_verifier(
                tonic::transport::ClientTlsConfig::new()
                    .identity(tonic::transport::Identity::from_pem(
                        &tls.cert_pem,
                        &tls.key_pem,
                    ))
                    .domain_name(sni),
                Arc::new(verifier),
            )
            .map_err(|e| Status::invalid_argument(e.to_string()))?
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(8 << 20))
            .initial_connection_window_size(Some(16 << 20))
            .connect()
            .await
            .map_err(|e| Status::unavailable(format!("target agent: {}", error_chain(&e))))?;
        let mut client = MigrationAgentClient::new(channel).max_encoding_message_size(4 << 20);
        let (tx, rx) = tokio::sync::mpsc::channel::<ImageChunk>(8);
        let dir = m.dir.clone();
        let sealer = stream_sealer(&m.key, m.uid.as_str())?;
        let uid = m.uid.to_string();
        let already = m.sent.clone();
        let delta = !self.cfg.track_mem;
        let pace = Pace::new(r.bandwidth_limit);
        let producer = tokio::task::spawn_blocking(move || {
            produce(&dir, &uid, &sealer, &tx, &already, delta, &pace)
        });
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        let summary = client.receive_images(stream).await;
        let produced = producer
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        // The target's own error first: a target that refused the stream closed it,
        // and the producer's "target closed the stream" says nothing of why.
        let ((sent, paths), summary) = match (produced, summary) {
            (Err(e), Err(target)) if e.message() == TARGET_CLOSED => return Err(target),
            (Err(e), _) => return Err(e),
            (Ok(_), Err(target)) => return Err(target),
            (Ok(p), Ok(s)) => (p, s.into_inner()),
        };
        if summary.bytes != sent {
            return Err(Status::data_loss(format!(
                "target stored {} of {sent} bytes",
                summary.bytes
            )));
        }
        m.bytes_sent += sent;
        m.sent.extend(paths);
        if m.phase == Phase::PreDumping {
            // A pre-copy round streamed while the workload runs: its size is the
            // dirty set, its speed the link's, both what the freeze budget needs.
            m.last_round_sent_bytes = sent;
            m.pre_copy_sent_bytes += sent;
            m.timings.pre_copy_send_us += t.elapsed().as_micros() as u64;
        }
        if m.phase == Phase::Dumped {
            m.timings.send_us = t.elapsed().as_micros() as u64;
            m.timings.send_finished_us = now_us();
            m.phase = Phase::Sent;
        }
        Ok(m.status())
    }

    /// Receives one image stream on the target. The stream is stored by a task of its
    /// own that holds the migration until the stream ends, however it ends: a gRPC
    /// handler whose stream is cut (the source's `Send` abandoned when the operator's
    /// leader was killed) is dropped by the HTTP/2 server, and a receive dropped with it
    /// left the migration `Receiving` with half-written files that the next `Send`'s
    /// stream (every file from offset 0) was refused on ("offset 0 but have N").
    async fn receive_impl(
        &self,
        caller: Result<Peer, IdentityError>,
        mut s: Streaming<ImageChunk>,
    ) -> Result<ReceiveSummary, Status> {
        let Some(first) = s.message().await? else {
            return Err(Status::invalid_argument("empty image stream"));
        };
        let found = self.get(&first.migration_uid).ok();
        let m = match found {
            Some(m) => Some(m.lock_owned().await),
            None => None,
        };
        // Before anything is written: only the peer named at Prepare streams here (an
        // unknown migration is refused the same way, telling the caller nothing).
        let state = authz::State {
            this_node: self.own_node(),
            migration: m.as_ref().map(|m| Prepared {
                role: m.role,
                peer: &m.peer,
            }),
        };
        if let Err(d) = authz::authorize(&caller, Rpc::ReceiveImages, state) {
            tracing::warn!(uid = %first.migration_uid, denied = %d, "image stream refused");
            return Err(d.into());
        }
        let m = m.expect("authorized streams name a known migration");
        admit(m.role, m.phase, Step::Receive)?;
        tokio::spawn(receive_locked(m, first, s))
            .await
            .map_err(|e| Status::internal(format!("receive task: {e}")))?
    }

    /// Restores the received tree on the target. The restore runs to its end in a task
    /// of its own, holding the migration, even if the caller goes away: a gRPC call
    /// whose client disconnects (the operator's call deadline, its leader killed) drops
    /// the handler's future, and a restore dropped after CRIU forked the tree left a
    /// running copy this agent did not know of: a retried `Restore` then restored a
    /// second one (which failed: its connection's address was the first copy's), and
    /// `Abort` had nothing to kill, so the source was thawed beside the first copy.
    async fn restore_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let m = self.get(uid)?.lock_owned().await;
        tokio::spawn(restore_locked(Arc::clone(&self.cfg), m))
            .await
            .map_err(|e| Status::internal(format!("restore task: {e}")))?
    }

    /// The restore fence (see [`Freeze`]): once the broker has it in its journal, the
    /// freeze is FENCED and the answer says `fenced`. Idempotent: a fenced (or, since,
    /// killed or committing) source answers its status again.
    async fn fence_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let m = self.get(uid)?;
        let mut m = m.lock().await;
        m.sync_freeze();
        if m.role == Role::Source && (m.fenced || m.phase == Phase::Killed) {
            return Ok(m.status());
        }
        if m.freeze.get() == THAWED {
            return Err(Status::failed_precondition(
                "the source was resumed (freeze watchdog or agent shutdown): the migration is aborted",
            ));
        }
        admit(m.role, m.phase, Step::Fence)?;
        if !m.freeze.claim_from(FROZEN, FENCING) {
            return Err(Status::failed_precondition(
                "the source is not frozen (an abort or the watchdog claimed it)",
            ));
        }
        if let Err(e) = m.broker(Request::Fence { uid: m.uid.clone() }).await {
            m.freeze.set(FROZEN);
            return Err(e);
        }
        m.fenced = true;
        m.freeze.set(FENCED);
        tracing::info!(%uid, "fenced: from now on this source is killed, never resumed, unless the operator aborts");
        Ok(m.status())
    }

    async fn commit_impl(&self, r: CommitRequest) -> Result<MigrationStatus, Status> {
        let m = self.get(&r.migration_uid)?;
        let mut m = m.lock().await;
        m.sync_freeze();
        if m.phase == Phase::Aborted && m.freeze.get() == THAWED {
            return Err(Status::failed_precondition(
                "the source was resumed (freeze watchdog or agent shutdown): the migration is aborted",
            ));
        }
        if m.role == Role::Source && m.phase == Phase::Killed {
            // The fenced source was killed by the watchdog: what a commit does.
            return Ok(m.status());
        }
        if m.freeze.get() == KILLING {
            return Err(Status::unavailable(
                "the freeze watchdog is killing the fenced source: ask again",
            ));
        }
        if admit(m.role, m.phase, Step::Commit)? == Admission::Done {
            return Ok(m.status());
        }
        // From here the freeze is the commit's: neither the watchdog nor a shutdown
        // resumes (or kills) a source that is being killed (a retried Commit finds it
        // claimed).
        if !m.freeze.claim(COMMITTING)
            && !m.freeze.claim_from(FENCED, COMMITTING)
            && m.freeze.get() != COMMITTING
        {
            return Err(Status::failed_precondition("the source is not frozen"));
        }
        if r.close_connections || m.tcp == TcpPreservation::None {
            // Out of repair mode and network back: killing the tree now sends FIN.
            m.broker(Request::ReleaseTcpRepair { uid: m.uid.clone() })
                .await?;
            m.broker(Request::UnlockNetwork { uid: m.uid.clone() })
                .await?;
        }
        kill_source(&m.broker, &m.uid, m.process).await?;
        let _ = images::zeroize(&m.dir);
        m.image_bytes = 0;
        m.phase = Phase::Committed;
        Ok(m.status())
    }

    async fn abort_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let Ok(m) = self.get(uid) else {
            // Unknown here (never prepared, or lost in an agent restart). This agent
            // cannot tell whether a source is still frozen (the node's broker resumes
            // what a lost agent left, but that is not this agent's knowledge): the
            // answer is "unknown", never "aborted", so nobody reports it as resumed.
            MigrationUid::parse(uid).map_err(|e| Status::invalid_argument(e.to_string()))?;
            return Err(Status::not_found(format!(
                "no migration {uid:?} on this agent (never prepared, or forgotten in a restart): its source's state is unknown here"
            )));
        };
        let mut m = m.lock().await;
        m.sync_freeze();
        match (m.role, m.phase) {
            (_, Phase::Aborted) => return Ok(m.status()),
            (Role::Source, Phase::Committed) => {
                return Err(Status::failed_precondition(
                    "already committed: the source is gone",
                ));
            }
            (Role::Source, Phase::Killed) => {
                return Err(Status::failed_precondition(
                    "the fenced source was killed by its agent's freeze watchdog (restore fence: never resumed but by an abort in time): it cannot be resumed",
                ));
            }
            (Role::Source, _) => {
                if m.freeze.get() == COMMITTING {
                    return Err(Status::failed_precondition(
                        "a commit is killing the source: it cannot be resumed",
                    ));
                }
                match m.freeze.get() {
                    // The freeze the final dump left, if nothing claimed it since.
                    FROZEN => {
                        thaw_frozen(&m.freeze, &m.broker, &m.uid).await?;
                    }
                    // The operator's abort is the one thing that lifts the fence (it
                    // is sent once the target's copy is confirmed killed): the broker
                    // first, then the thaw.
                    FENCED => {
                        if !m.freeze.claim_from(FENCED, THAWING) {
                            return Err(Status::unavailable(
                                "the freeze watchdog is killing the fenced source: ask again",
                            ));
                        }
                        if let Err(e) = m.broker(Request::Unfence { uid: m.uid.clone() }).await {
                            m.freeze.set(FENCED);
                            return Err(e);
                        }
                        m.fenced = false;
                        if let Err(e) = thaw_source(&m.broker, &m.uid).await {
                            // Unfenced: the watchdog resumes it if no retry does.
                            m.freeze.set(FROZEN);
                            return Err(e);
                        }
                        m.freeze.set(THAWED);
                    }
                    THAWING | KILLING => {
                        return Err(Status::unavailable(
                            "the freeze watchdog is resuming or killing the source: ask again",
                        ));
                    }
                    THAWED => {}
                    // No final dump (Prepared, a pre-copy round, a failed dump): the
                    // calls are no-ops unless something was left locked.
                    _ => thaw_source(&m.broker, &m.uid).await?,
                }
                m.sync_freeze();
                m.timings.resumed_us = now_us();
            }
            (_, _) => {
                // The target: no restored process may outlive the answer "aborted"
                // (the operator thaws the source on it). Killed and confirmed dead,
                // or the Abort fails and the operator asks again.
                let root = m.restored;
                let holder = m.fs.is_some().then_some(m.process);
                if root.is_some() || holder.is_some() {
                    blocking(move || {
                        kill_restored(root, holder).map_err(|e| {
                            Status::unavailable(format!(
                                "the restored copy could not be confirmed killed: {e}"
                            ))
                        })
                    })
                    .await?;
                }
                m.restored = None;
            }
        }
        let _ = images::zeroize(&m.dir);
        m.image_bytes = 0;
        m.phase = Phase::Aborted;
        tracing::info!(uid, "aborted");
        Ok(m.status())
    }

    async fn cleanup_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let Ok(mm) = self.get(uid) else {
            // Unknown (never prepared, or already cleaned up, or lost in a restart):
            // make sure nothing is left on disk either way.
            if let Ok(u) = MigrationUid::parse(uid) {
                let _ = images::zeroize(&self.cfg.checkpoints_root.join(u.as_str()));
            }
            return Ok(MigrationStatus {
                migration_uid: uid.into(),
                phase: Phase::CleanedUp as i32,
                ..Default::default()
            });
        };
        let mut m = mm.lock().await;
        m.sync_freeze();
        if m.role == Role::Source && matches!(m.phase, Phase::Dumped | Phase::Sent) {
            return Err(Status::failed_precondition(
                "the source is frozen: commit or abort first",
            ));
        }
        images::zeroize(&m.dir).map_err(|e| Status::internal(e.to_string()))?;
        let _ = m.broker(Request::Forget { uid: m.uid.clone() }).await;
        m.phase = Phase::CleanedUp;
        m.image_bytes = 0;
        let st = m.status();
        drop(m);
        self.migrations.lock().expect("migrations").remove(uid);
        self.frozen
            .lock()
            .expect("frozen")
            .retain(|f| f.uid.as_str() != uid);
        Ok(st)
    }
}

/// What the final dump needs once the network is locked (see [`Agent::dump_impl`]).
struct DumpOutcome {
    dir: PathBuf,
    opts: Opts,
    external_mounts: Vec<String>,
    stdio_pipes: Vec<(i32, String)>,
    criu: Criu,
    frozen: Arc<StdMutex<Vec<FrozenSource>>>,
    margin: std::time::Duration,
}

/// The final dump from the network lock on, run by a task that owns the migration.
async fn dump_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    d: DumpOutcome,
) -> Result<MigrationStatus, Status> {
    m.timings.freeze_started_us = now_us();
    let t = Instant::now();
    // Network first: from here nothing reaches or leaves the pod, so no segment
    // is acknowledged after the socket state is captured.
    m.broker(Request::LockNetwork { uid: m.uid.clone() })
        .await?;
    let sockets = match inventory(&m).await {
        Ok(s) => s,
        Err(e) => {
            let _ = m
                .broker(Request::UnlockNetwork { uid: m.uid.clone() })
                .await;
            return Err(e);
        }
    };
    let criu = d.criu;
    let dir = d.dir;
    let log = dir.join("dump.log");
    let res = blocking(move || {
        criu.call(
            Req {
                r#type: criu::REQ_DUMP,
                opts: Some(d.opts),
            },
            Some(&log),
        )
        .map_err(criu_status)
    })
    .await;
    if let Err(e) = res {
        // CRIU resumed the tree and its sockets on failure; reopen the network.
        let _ = m
            .broker(Request::UnlockNetwork { uid: m.uid.clone() })
            .await;
        let _ = images::zeroize(&dir);
        m.timings.freeze_started_us = 0;
        return Err(e);
    }
    m.timings.dump_us = t.elapsed().as_micros() as u64;
    m.timings.dump_finished_us = now_us();
    // The tree is stopped: the freeze is recorded and watched from this instant, even
    // if what follows fails.
    m.freeze.set(FROZEN);
    start_freeze_watchdog(&d.frozen, d.margin, &m);
    let manifest = Manifest {
        final_dir: "final".into(),
        sockets: sockets
            .iter()
            .map(|s| ManifestSocket {
                local: s.local.clone(),
                remote: s.remote.clone(),
                listening: s.listening,
            })
            .collect(),
        tcp: m.tcp as i32,
        external_mounts: d.external_mounts,
        stdio_pipes: d.stdio_pipes,
        workload: m.fs.as_ref().and_then(|fs| fs.workload.clone()),
    };
    std::fs::write(
        m.dir.join("manifest.json"),
        serde_json::to_vec(&manifest).expect("manifest"),
    )
    .map_err(|e| Status::internal(e.to_string()))?;
    m.sockets = sockets;
    m.final_dump_bytes = images::size(&dir);
    m.image_bytes = images::size(&m.dir);
    m.phase = Phase::Dumped;
    tracing::info!(
        uid = %m.uid,
        dump_ms = m.timings.dump_us / 1000,
        bytes = m.final_dump_bytes,
        watchdog_ms = m.freeze_limit.as_millis() as u64,
        "dumped; source left stopped"
    );
    Ok(m.status())
}

/// Resumes the source `m` froze if it is still frozen `m.freeze_limit` from now
/// (tokio's clock is monotonic): neither Commit nor Abort claimed the freeze.
fn start_freeze_watchdog(
    frozen: &StdMutex<Vec<FrozenSource>>,
    margin: std::time::Duration,
    m: &Migration,
) {
    let (freeze, broker, uid, limit) = (
        Arc::clone(&m.freeze),
        Arc::clone(&m.broker),
        m.uid.clone(),
        m.freeze_limit,
    );
    let process = m.process;
    frozen.lock().expect("frozen").push(FrozenSource {
        freeze: Arc::clone(&freeze),
        broker: Arc::clone(&broker),
        uid: uid.clone(),
        process,
        since: std::time::Instant::now(),
        budget: limit.saturating_sub(margin),
    });
    tokio::spawn(async move {
        tokio::time::sleep(limit).await;
        // A failed resume or kill (the broker busy or restarting) is tried again, and
        // so is a freeze another call holds for a moment (a fence being taken, an
        // abort's thaw that may fail and give it back).
        for _ in 0..30 {
            match freeze.get() {
                FROZEN => {
                    tracing::warn!(%uid, limit_ms = limit.as_millis() as u64, "freeze watchdog: the source is still frozen past its budget and margin; resuming it");
                    match thaw_frozen(&freeze, &broker, &uid).await {
                        Ok(true) => {
                            crate::metrics::global().watchdog_resumed();
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::error!(%uid, error = %e, "freeze watchdog could not resume the source; retrying")
                        }
                    }
                }
                FENCED => {
                    tracing::warn!(%uid, limit_ms = limit.as_millis() as u64, "freeze watchdog: the fenced source is still frozen past its budget and margin; killing it (restore fence: its copy may run on the target, it is never resumed)");
                    match kill_fenced(&freeze, &broker, &uid, process).await {
                        Ok(true) => {
                            crate::metrics::global().watchdog_killed();
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            tracing::error!(%uid, error = %e, "freeze watchdog could not kill the fenced source; retrying")
                        }
                    }
                }
                FENCING | THAWING | KILLING => {}
                _ => return,
            }
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        }
    });
}

/// The workload's TCP sockets, duplicated to us by the broker.
async fn inventory(m: &Migration) -> Result<Vec<SocketReport>, Status> {
    let b = Arc::clone(&m.broker);
    let uid = m.uid.clone();
    blocking(move || {
        let fds = b
            .lock()
            .expect("broker client")
            .sockets(&uid)
            .map_err(broker_status)?;
        use nix::sys::socket::{
            SockaddrStorage, getpeername, getsockname, getsockopt, sockopt::AcceptConn,
        };
        use std::os::fd::AsRawFd;
        let mut out = Vec::new();
        for fd in fds {
            let listening = getsockopt(&fd, AcceptConn).unwrap_or(false);
            let local = getsockname::<SockaddrStorage>(fd.as_raw_fd())
                .map(|a| a.to_string())
                .unwrap_or_default();
            let remote = if listening {
                String::new()
            } else {
                getpeername::<SockaddrStorage>(fd.as_raw_fd())
                    .map(|a| a.to_string())
                    .unwrap_or_default()
            };
            out.push(SocketReport {
                local,
                remote,
                listening,
                outcome: SocketOutcome::Pending as i32,
            });
        }
        Ok(out)
    })
    .await
}

/// The body of `Restore`, run by a task that owns the migration (see
/// [`Agent::restore_impl`]).
async fn restore_locked(
    cfg: Arc<Config>,
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
) -> Result<MigrationStatus, Status> {
    if admit(m.role, m.phase, Step::Restore)? == Admission::Done {
        return Ok(m.status());
    }
    let manifest: Manifest = serde_json::from_slice(
        &std::fs::read(m.dir.join("manifest.json"))
            .map_err(|e| Status::data_loss(format!("manifest: {e}")))?,
    )
    .map_err(|e| Status::data_loss(format!("manifest: {e}")))?;
    let Reply::Addrs { addrs } = m.broker(Request::NetnsAddrs { uid: m.uid.clone() }).await? else {
        return Err(Status::internal("unexpected broker reply"));
    };
    let ip_of = |s: &str| {
        s.parse::<std::net::SocketAddr>()
            .map(|a| a.ip().to_string())
            .unwrap_or_default()
    };
    let established: Vec<&ManifestSocket> =
        manifest.sockets.iter().filter(|s| !s.listening).collect();
    let moved = established.iter().all(|s| addrs.contains(&ip_of(&s.local)));
    let tcp = TcpPreservation::try_from(manifest.tcp).unwrap_or(m.tcp);
    let preserve = tcp != TcpPreservation::None && moved;
    if tcp == TcpPreservation::Strict && !moved {
        return Err(Status::failed_precondition(
            "Strict TCP preservation: the pod address did not move to the target; refusing to restore",
        ));
    }
    let dir = final_dir(&m.dir, &manifest)?;
    let netns = m
        .netns_path
        .clone()
        .ok_or_else(|| Status::internal("target netns not bound"))?;
    // Not close-on-exec: criu swrk inherits it and finds it by number.
    let ns_fd = nix::fcntl::open(
        netns.as_str(),
        nix::fcntl::OFlag::O_RDONLY,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| Status::internal(format!("open {netns}: {e}")))?;
    let mut o = Opts::new(&dir, "restore.log");
    {
        use std::os::fd::AsRawFd;
        o.inherit_fd = vec![criu::InheritFd {
            key: NETNS_KEY.into(),
            fd: ns_fd.as_raw_fd(),
        }];
    }
    // A container: its mounts bound to the holder's, its root the holder's root
    // filesystem, its pipes to the runtime the holder's own, and CRIU run inside
    // the holder's PID namespace (crate::pidns).
    let container = container_restore(&cfg, &m, &manifest, &mut o)?;
    let holder_pid = container.is_some().then_some(m.process.pid);
    if preserve {
        o.tcp_established = Some(true);
    } else {
        o.tcp_close = Some(true);
    }
    m.timings.restore_started_us = now_us();
    let t = Instant::now();
    let criu = cfg.criu.clone();
    let log = dir.join("restore.log");
    let resp = blocking(move || {
        let r = criu
            .call_in(
                Req {
                    r#type: criu::REQ_RESTORE,
                    opts: Some(o),
                },
                Some(&log),
                holder_pid,
            )
            .map_err(criu_status);
        drop(ns_fd);
        drop(container);
        r
    })
    .await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            // CRIU kills what it forked when it fails (its own rollback). In a
            // holder's PID namespace anything it left (CRIU itself killed
            // mid-restore) is below the holder: end it all before answering.
            if holder_pid.is_some() {
                return Err(undo_restore(&mut m, true, e).await);
            }
            return Err(e);
        }
    };
    m.timings.resumed_us = now_us();
    m.timings.restore_us = t.elapsed().as_micros() as u64;
    let criu_pid = resp.restore.map(|r| r.pid).unwrap_or(0);
    // CRIU run inside the holder's PID namespace reports the restored root's PID
    // there; it is now the holder's child (CRIU has exited).
    let pid = match holder_pid {
        Some(h) => procfs::child_by_ns_pid(h, criu_pid),
        None => Some(criu_pid),
    };
    let Some(restored) = pid.and_then(|pid| {
        Some(ProcRef {
            pid,
            start_time: procfs::start_time(pid).ok()?,
        })
    }) else {
        let e = Status::internal(format!(
            "the restored root (pid {criu_pid} as CRIU reported it) is not to be found{}",
            holder_pid
                .map(|h| format!(" among the children of the holder {h}"))
                .unwrap_or_default()
        ));
        return Err(undo_restore(&mut m, holder_pid.is_some(), e).await);
    };
    // From here the copy runs: every failure below kills it before answering.
    m.restored = Some(restored);
    if let Err(e) = m
        .broker(Request::MoveCgroup {
            uid: m.uid.clone(),
            process: restored,
        })
        .await
    {
        return Err(undo_restore(&mut m, holder_pid.is_some(), e).await);
    }
    if let (Some(_), Some(w)) = (&m.fs, &manifest.workload) {
        // What the holder executes if the adopted container is started again.
        let path = format!("/proc/{}/root{HOLDER_RESTART}", m.process.pid);
        if let Err(e) = std::fs::write(&path, serde_json::to_vec(w).expect("workload")) {
            tracing::warn!(uid = %m.uid, path, error = %e, "restart file not written: a restart of the adopted container will not start the workload");
        }
    }
    m.sockets = manifest
        .sockets
        .iter()
        .map(|s| SocketReport {
            local: s.local.clone(),
            remote: s.remote.clone(),
            listening: s.listening,
            outcome: if s.listening {
                SocketOutcome::ListenerRestored
            } else if preserve {
                SocketOutcome::Preserved
            } else {
                SocketOutcome::ClosedCleanly
            } as i32,
        })
        .collect();
    // The images are no longer needed: do not keep the workload's memory around.
    let _ = images::zeroize(&m.dir);
    m.image_bytes = 0;
    m.phase = Phase::Restored;
    tracing::info!(
        uid = %m.uid,
        pid = restored.pid,
        restore_ms = m.timings.restore_us / 1000,
        "restored"
    );
    Ok(m.status())
}

/// After a failed restore, no process of it may run: kills what it restored (see
/// [`kill_restored`]) and returns `e`, saying whether the kill was confirmed. An
/// unconfirmed kill keeps the copy recorded, so an `Abort` tries again (and fails
/// while it cannot confirm it: the operator then never thaws the source).
async fn undo_restore(m: &mut Migration, holder: bool, e: Status) -> Status {
    let root = m.restored;
    let holder = holder.then_some(m.process);
    match blocking(move || kill_restored(root, holder).map_err(Status::internal)).await {
        Ok(()) => {
            m.restored = None;
            tracing::warn!(uid = %m.uid, error = %e.message(), "restore failed; no restored process left");
            Status::new(
                e.code(),
                format!("{}; no restored process left", e.message()),
            )
        }
        Err(k) => {
            tracing::error!(uid = %m.uid, error = %e.message(), kill = %k.message(), "restore failed and its copy could not be confirmed killed");
            Status::new(
                e.code(),
                format!(
                    "{}; a restored copy may still run: {}",
                    e.message(),
                    k.message()
                ),
            )
        }
    }
}

/// Kills a restored process tree and waits (bounded) until none of it runs: the tree
/// of `root` (the restored root as pinned after the restore; all of its PID namespace
/// with it if it is that namespace's init), and in a holder's PID namespace everything
/// below the holder (CRIU ran there, so whatever it forked and left ends up there,
/// pinned or not). The holder itself stays. Every process is pinned (pid and start
/// time) before it is signalled, so a reused pid is never killed.
fn kill_restored(root: Option<ProcRef>, holder: Option<ProcRef>) -> Result<(), String> {
    let live = || {
        let mut pids = Vec::new();
        if let Some(r) = root
            && procfs::check_live(r).is_ok()
        {
            pids.extend(procfs::tree(r.pid));
        }
        // The holder as pinned at `Prepare`: a holder that exited (its container
        // restarted) has nothing of this restore below it, and its pid may be reused.
        if let Some(h) = holder
            && procfs::check_live(h).is_ok()
        {
            pids.extend(procfs::tree(h.pid).into_iter().filter(|p| *p != h.pid));
        }
        pids.sort_unstable();
        pids.dedup();
        pids.into_iter()
            .filter_map(|pid| {
                let p = ProcRef {
                    pid,
                    start_time: procfs::start_time(pid).ok()?,
                };
                procfs::check_live(p).is_ok().then_some(p)
            })
            .collect::<Vec<_>>()
    };
    for _ in 0..500 {
        let procs = live();
        if procs.is_empty() {
            return Ok(());
        }
        for p in procs {
            if procfs::check_live(p).is_ok() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p.pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let left: Vec<i32> = live().iter().map(|p| p.pid).collect();
    Err(format!(
        "restored processes {left:?} still run 5 s after SIGKILL"
    ))
}

/// Restore options for a container's dump (`None`: a process of the node's mount
/// namespace, restored as it was). Returns the descriptors CRIU inherits; they must
/// stay open until the restore has run.
fn container_restore(
    cfg: &Config,
    m: &Migration,
    manifest: &Manifest,
    o: &mut Opts,
) -> Result<Option<Vec<std::os::fd::OwnedFd>>, Status> {
    if manifest.external_mounts.is_empty() && m.fs.is_none() {
        return Ok(None);
    }
    let Some(fs) = &m.fs else {
        return Err(Status::failed_precondition(
            "the source is a container but the target holder was not resolved through the container runtime",
        ));
    };
    let holder_pid = m.process.pid;
    let mi = std::fs::read_to_string(format!("/proc/{holder_pid}/mountinfo"))
        .map_err(|e| Status::failed_precondition(format!("mounts of the holder: {e}")))?;
    let holder = mounts::Holder {
        spec: fs.spec.clone(),
        mountinfo: mounts::parse_mountinfo(&mi),
        rootfs: fs.rootfs.clone(),
    };
    let args =
        mounts::restore_external_args(&manifest.external_mounts, &holder, &cfg.containers.host())
            .map_err(Status::failed_precondition)?;
    o.external.extend(args);
    o.root = Some(holder.rootfs.to_string_lossy().into_owned());
    let mut fds = Vec::new();
    for (fd, key) in &manifest.stdio_pipes {
        let path = format!("/proc/{holder_pid}/fd/{fd}");
        let flags = if *fd == 0 {
            nix::fcntl::OFlag::O_RDONLY
        } else {
            nix::fcntl::OFlag::O_WRONLY
        };
        // Not close-on-exec: criu swrk inherits it and finds it by number.
        let f = nix::fcntl::open(path.as_str(), flags, nix::sys::stat::Mode::empty())
            .map_err(|e| Status::failed_precondition(format!("open {path}: {e}")))?;
        use std::os::fd::AsRawFd;
        o.inherit_fd.push(criu::InheritFd {
            key: key.clone(),
            fd: f.as_raw_fd(),
        });
        fds.push(f);
    }
    Ok(Some(fds))
}

/// Stores one image stream (its first chunk already read) into the migration's
/// checkpoint dir, holding the migration to the stream's end. A stream that does not
/// end complete and verified (cut, refused, a chunk that does not open) leaves what was
/// there before it: the files it created or replaced are zeroized and removed, and the
/// phase is the one it found, so the next `Send` (a new stream) starts from the same
/// state the source records; earlier pre-copy rounds, which the source counts as sent,
/// stay.
async fn receive_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    first: ImageChunk,
    mut s: Streaming<ImageChunk>,
) -> Result<ReceiveSummary, Status> {
    // The stream's header (its first chunk) carries the stream id.
    let sealer = Arc::new(
        Sealer::new(&m.key, m.uid.as_str(), &first.stream_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?,
    );
    let before = m.phase;
    m.phase = Phase::Receiving;
    let dir = m.dir.clone();
    // This task takes chunks off the connection; a blocking thread opens and
    // writes them, so the network side never waits for the decryption or tmpfs.
    let (wtx, mut wrx) = tokio::sync::mpsc::channel::<ImageChunk>(RECEIVE_QUEUE);
    let writer = {
        let dir = dir.clone();
        let sealer = sealer.clone();
        tokio::task::spawn_blocking(move || {
            let mut store = Store::new(&dir);
            let res = (|| -> Result<(u64, u64), Status> {
                while let Some(mut c) = wrx.blocking_recv() {
                    transfer::check_image_path(&c.path)
                        .map_err(|e| Status::invalid_argument(e.to_string()))?;
                    let mut plain = std::mem::take(&mut c.sealed);
                    sealer
                        .open_in_place(c.seq, &c.path, c.offset, false, &mut plain)
                        .map_err(|e| Status::permission_denied(e.to_string()))?;
                    store.put(&c, plain)?;
                }
                Ok((store.files, store.bytes))
            })();
            (store.written(), res)
        })
    };
    let mut next = Some(first);
    let mut seq = 0u64;
    let uid = m.uid.to_string();
    let read: Result<Vec<u8>, Status> = async {
        loop {
            let c = match next.take() {
                Some(c) => c,
                None => s
                    .message()
                    .await?
                    .ok_or_else(|| Status::data_loss("stream ended without its final chunk"))?,
            };
            if c.seq != seq || c.migration_uid != uid {
                return Err(Status::invalid_argument(
                    "chunk out of order or for another migration",
                ));
            }
            seq += 1;
            if c.end {
                return Ok(c.sealed);
            }
            if wtx.send(c).await.is_err() {
                // The writer stopped on an error; it says which below.
                return Ok(vec![]);
            }
        }
    }
    .await;
    drop(wtx);
    drop(s);
    let (written, stored) = match writer.await {
        Ok((w, r)) => (Some(w), r),
        Err(e) => (None, Err(Status::internal(format!("image writer: {e}")))),
    };
    // The stream ends well only if every chunk opened and was stored, and its final
    // chunk authenticates the count.
    let res: Result<(u64, u64), Status> = (|| {
        let (files, bytes) = stored?;
        let end = read?;
        let count = sealer
            .open(seq - 1, "", 0, true, &end)
            .map_err(|e| Status::permission_denied(e.to_string()))?;
        if count != (seq - 1).to_be_bytes() {
            return Err(Status::data_loss("chunk count mismatch"));
        }
        Ok((files, bytes))
    })();
    let (files, bytes) = match res {
        Ok(r) => r,
        Err(e) => {
            // Never keep half an image: what this stream wrote goes (zeroized); what
            // earlier streams stored stays, as the source counts it sent.
            let undone = match written {
                Some(w) => blocking(move || {
                    w.undo(&dir);
                    Ok(())
                })
                .await
                .ok(),
                None => None,
            };
            if undone.is_none() {
                // The writer panicked: what it wrote is unknown, so nothing stays.
                let _ = images::zeroize(&m.dir);
                if let Some(root) = m.dir.parent() {
                    let _ = images::create(root, m.uid.as_str());
                }
            }
            m.image_bytes = images::size(&m.dir);
            m.phase = if undone.is_some() {
                before
            } else {
                Phase::Prepared
            };
            tracing::warn!(uid = %m.uid, error = %e, "image stream not stored; its files removed");
            return Err(e);
        }
    };
    m.bytes_received += bytes;
    m.image_bytes = images::size(&dir);
    // Pre-copy rounds arrive first; the round carrying the manifest is the last.
    m.phase = if dir.join("manifest.json").exists() {
        Phase::Received
    } else {
        Phase::Receiving
    };
    Ok(ReceiveSummary { files, bytes })
}

/// The sealer of one outgoing image stream (every Send, every retry): a fresh random
/// stream id, so no two streams under the migration key share a nonce.
fn stream_sealer(key: &[u8], uid: &str) -> Result<Sealer, Status> {
    let id: [u8; transfer::STREAM_ID_LEN] = rand::random();
    Sealer::new(key, uid, &id).map_err(|e| Status::internal(e.to_string()))
}

/// Writes the opened chunks of one stream into a migration's checkpoint dir. Nothing
/// it writes leaves that dir: paths are `<dir>/<file>` or `<file>`, the only links are
/// CRIU's `parent` links one level down pointing at a sibling round (`../pre-<n>`),
/// and no write or copy follows a link.
struct Store<'a> {
    dir: &'a Path,
    /// Files created from a delta base in this stream; their chunks patch in place.
    patched: std::collections::BTreeSet<String>,
    /// What this stream created or replaced, undone if the stream does not end well.
    written: Written,
    files: u64,
    bytes: u64,
}

fn open_nofollow(p: &Path, o: &mut std::fs::OpenOptions) -> Result<std::fs::File, Status> {
    use std::os::unix::fs::OpenOptionsExt;
    o.custom_flags(nix::libc::O_NOFOLLOW)
        .open(p)
        .map_err(|e| Status::invalid_argument(format!("{}: {e}", p.display())))
}

/// `../pre-<n>`: a sibling round's directory, the only link target CRIU writes.
fn parent_link_ok(path: &str, target: &str) -> bool {
    let Some((_, name)) = path.split_once('/') else {
        // A top-level link would resolve `../x` next to this migration's dir: into
        // another migration's.
        return false;
    };
    name == "parent"
        && target
            .strip_prefix("../pre-")
            .is_some_and(|n| !n.is_empty() && n.len() <= 9 && n.bytes().all(|b| b.is_ascii_digit()))
}

impl<'a> Store<'a> {
    fn new(dir: &'a Path) -> Self {
        Store {
            dir,
            patched: Default::default(),
            written: Default::default(),
            files: 0,
            bytes: 0,
        }
    }

    /// Stores one chunk whose path was checked and whose payload opened.
    fn put(&mut self, c: &ImageChunk, plain: Vec<u8>) -> Result<(), Status> {
        transfer::check_image_path(&c.path).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let ierr = |e: std::io::Error| Status::internal(e.to_string());
        let path = self.dir.join(&c.path);
        if let Some((top, _)) = c.path.split_once('/') {
            let d = self.dir.join(top);
            match std::fs::symlink_metadata(&d) {
                Ok(md) if md.is_dir() => {}
                Ok(_) => {
                    return Err(Status::invalid_argument(format!(
                        "{top} is not a directory"
                    )));
                }
                Err(_) => {
                    std::fs::create_dir(&d).map_err(ierr)?;
                    self.written.dirs.push(top.to_owned());
                }
            }
        }
        // A path this stream did not write yet: a new stream (a retried `Send`) sends
        // every file it carries whole, from offset 0, so a copy of it that an earlier
        // stream left (its end not recorded by the source) is replaced, not appended to.
        let fresh = !self.written.files.contains(&c.path);
        if fresh && !c.symlink && c.base.is_empty() && c.offset != 0 {
            return Err(Status::invalid_argument(format!(
                "{}: starts at offset {}",
                c.path, c.offset
            )));
        }
        if c.symlink {
            let target =
                String::from_utf8(plain).map_err(|_| Status::invalid_argument("bad link"))?;
            if !parent_link_ok(&c.path, &target) {
                return Err(Status::invalid_argument(format!(
                    "link {:?} -> {target:?} is not a round's parent link",
                    c.path
                )));
            }
            if fresh {
                self.replace(&c.path, &path)?;
            }
            return std::os::unix::fs::symlink(&target, &path).map_err(ierr);
        }
        if !c.base.is_empty() {
            transfer::check_image_path(&c.base)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
            let len: [u8; 8] = plain
                .as_slice()
                .try_into()
                .map_err(|_| Status::invalid_argument("bad delta length"))?;
            let mut from = open_nofollow(
                &self.dir.join(&c.base),
                std::fs::OpenOptions::new().read(true),
            )
            .map_err(|e| Status::failed_precondition(format!("delta base: {}", e.message())))?;
            if fresh {
                self.replace(&c.path, &path)?;
            }
            let mut to = open_nofollow(
                &path,
                std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true),
            )?;
            std::io::copy(&mut from, &mut to).map_err(ierr)?;
            to.set_len(u64::from_be_bytes(len)).map_err(ierr)?;
            self.files += 1;
            self.patched.insert(c.path.clone());
            return Ok(());
        }
        if self.patched.contains(&c.path) {
            use std::os::unix::fs::FileExt;
            let f = open_nofollow(&path, std::fs::OpenOptions::new().write(true))?;
            let len = f.metadata().map_err(ierr)?.len();
            if c.offset + plain.len() as u64 > len {
                return Err(Status::invalid_argument(
                    "delta block past the end of the file",
                ));
            }
            f.write_all_at(&plain, c.offset).map_err(ierr)?;
            self.bytes += plain.len() as u64;
            return Ok(());
        }
        let mut f = if fresh {
            self.replace(&c.path, &path)?;
            open_nofollow(
                &path,
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true),
            )?
        } else {
            open_nofollow(&path, std::fs::OpenOptions::new().create(true).append(true))?
        };
        let md = f.metadata().map_err(ierr)?;
        if !md.is_file() || md.len() != c.offset {
            return Err(Status::invalid_argument(format!(
                "{}: offset {} but have {}",
                c.path,
                c.offset,
                md.len()
            )));
        }
        if c.offset == 0 {
            self.files += 1;
        }
        f.write_all(&plain).map_err(ierr)?;
        self.bytes += plain.len() as u64;
        Ok(())
    }
}

impl Store<'_> {
    /// Takes `rel` (at `path`) as this stream's: a copy an earlier stream left there
    /// (its end not recorded by the source, which sends it whole again) is zeroized and
    /// replaced. Called only once the chunk that writes it was checked.
    fn replace(&mut self, rel: &str, path: &Path) -> Result<(), Status> {
        let ierr = |e: std::io::Error| Status::internal(e.to_string());
        match std::fs::symlink_metadata(path) {
            Ok(md) if md.file_type().is_symlink() => std::fs::remove_file(path).map_err(ierr)?,
            Ok(md) if md.is_file() => images::zeroize_file(path).map_err(ierr)?,
            Ok(_) => {
                return Err(Status::invalid_argument(format!(
                    "{rel} is not a regular file"
                )));
            }
            Err(_) => {}
        }
        self.written.files.insert(rel.to_owned());
        Ok(())
    }

    /// What this stream wrote, for `Written::undo`.
    fn written(&mut self) -> Written {
        std::mem::take(&mut self.written)
    }
}

/// The files and round directories one image stream created or replaced.
#[derive(Default)]
struct Written {
    files: std::collections::BTreeSet<String>,
    dirs: Vec<String>,
}

impl Written {
    /// Zeroizes and removes what the stream wrote (a directory it created goes whole),
    /// leaving what earlier streams stored.
    fn undo(self, dir: &Path) {
        for rel in &self.files {
            let p = dir.join(rel);
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_file() {
                let _ = images::zeroize_file(&p);
            }
            if !md.is_dir() {
                let _ = std::fs::remove_file(&p);
            }
        }
        for top in &self.dirs {
            let _ = images::zeroize(&dir.join(top));
        }
    }
}

/// The final image dir a manifest names: one plain directory inside the checkpoint
/// dir (never a link, never a path out of it).
fn final_dir(dir: &Path, manifest: &Manifest) -> Result<PathBuf, Status> {
    let name = &manifest.final_dir;
    if transfer::check_image_path(name).is_err() || name.contains('/') {
        return Err(Status::data_loss(format!(
            "manifest names final dir {name:?}: not a directory of the checkpoint"
        )));
    }
    let p = dir.join(name);
    match std::fs::symlink_metadata(&p) {
        Ok(md) if md.is_dir() => Ok(p),
        _ => Err(Status::data_loss(format!(
            "manifest names final dir {name:?}: not a directory of the checkpoint"
        ))),
    }
}

/// The producer's error when the target stopped taking chunks (its answer says why).
const TARGET_CLOSED: &str = "target closed the stream";

/// Chunks queued between the connection and the receiver's writer thread.
const RECEIVE_QUEUE: usize = 4;

/// Delta block size when comparing a final image with its warm copy.
const BLOCK: usize = 64 * 1024;

/// Reads the checkpoint dir and sends what was not sent before as sealed chunks;
/// returns the plaintext bytes sent and the paths now on the target. With `delta`, an
/// image of a later round (a warm copy after the first, or the final dump) whose
/// namesake the target holds from the newest earlier warm copy is sent as the blocks
/// that differ: each round then moves only what the workload changed since the last.
fn produce(
    dir: &Path,
    uid: &str,
    sealer: &Sealer,
    tx: &tokio::sync::mpsc::Sender<ImageChunk>,
    already: &std::collections::BTreeSet<String>,
    delta: bool,
    pace: &Pace,
) -> Result<(u64, Vec<String>), Status> {
    let ierr = |e: std::io::Error| Status::internal(e.to_string());
    let mut entries = Vec::new();
    collect(dir, dir, &mut entries).map_err(ierr)?;
    entries.retain(|(rel, _)| !already.contains(rel));
    // Parents before children: pre-1, pre-2, …, final, then the manifest last (its
    // arrival tells the target the image set is complete).
    entries.sort_by_key(|(rel, _)| {
        (
            rel.starts_with("manifest"),
            rel.starts_with("final"),
            pre_round(rel),
            rel.clone(),
        )
    });
    // The newest warm copy the target holds, for deltas.
    let base_dir = already
        .iter()
        .filter_map(|p| p.split_once('/').map(|(d, _)| d))
        .filter(|d| d.starts_with("pre-"))
        .max_by_key(|d| pre_round(d))
        .map(str::to_owned);
    let mut seq = 0u64;
    let mut bytes = 0u64;
    let mut paths = Vec::new();
    // The stream id travels in the first chunk, the stream's header.
    let header = |seq: u64| {
        if seq == 0 {
            sealer.stream_id().to_vec()
        } else {
            vec![]
        }
    };
    // Seals `data` (the plaintext, with room for the tag) in place.
    let sealed_chunk =
        |seq: u64, path: &str, offset: u64, mut data: Vec<u8>, symlink: bool, base: &str| {
            sealer.seal_in_place(seq, path, offset, false, &mut data);
            ImageChunk {
                migration_uid: uid.into(),
                seq,
                path: path.into(),
                offset,
                sealed: data,
                end: false,
                symlink,
                base: base.into(),
                stream_id: header(seq),
            }
        };
    let chunk = |seq: u64, path: &str, offset: u64, data: &[u8], symlink: bool, base: &str| {
        let mut buf = Vec::with_capacity(data.len() + transfer::TAG_LEN);
        buf.extend_from_slice(data);
        sealed_chunk(seq, path, offset, buf, symlink, base)
    };
    let send = |c: ImageChunk| {
        pace.wait(c.sealed.len() as u64);
        tx.blocking_send(c)
            .map_err(|_| Status::aborted(TARGET_CLOSED))
    };
    for (rel, is_link) in entries {
        let full = dir.join(&rel);
        paths.push(rel.clone());
        if is_link {
            let target = std::fs::read_link(&full).map_err(ierr)?;
            send(chunk(
                seq,
                &rel,
                0,
                target.to_string_lossy().as_bytes(),
                true,
                "",
            ))?;
            seq += 1;
            continue;
        }
        let name = rel.rsplit('/').next().unwrap_or_default();
        let later_round = rel.starts_with("final/") || pre_round(&rel) > 0;
        let base = match (&base_dir, delta && later_round) {
            (Some(b), true) if already.contains(&format!("{b}/{name}")) => {
                Some(format!("{b}/{name}"))
            }
            _ => None,
        };
        if let Some(base) = base {
            let f = std::fs::File::open(&full).map_err(ierr)?;
            let len = f.metadata().map_err(ierr)?.len();
            let mut new = f.take(len);
            let mut old = std::fs::File::open(dir.join(&base)).map_err(ierr)?;
            send(chunk(seq, &rel, 0, &len.to_be_bytes(), false, &base))?;
            seq += 1;
            // Runs of differing blocks, each at most one CHUNK. Both files are compared
            // a window at a time, so memory stays flat whatever the image size.
            let mut flush = |run: &mut Vec<u8>, at: u64, seq: &mut u64| {
                if run.is_empty() {
                    return Ok(());
                }
                let data =
                    std::mem::replace(run, Vec::with_capacity(transfer::CHUNK + transfer::TAG_LEN));
                bytes += data.len() as u64;
                send(sealed_chunk(*seq, &rel, at, data, false, ""))?;
                *seq += 1;
                Ok::<(), Status>(())
            };
            let (mut nw, mut ow) = (Vec::new(), Vec::new());
            let mut run = Vec::with_capacity(transfer::CHUNK + transfer::TAG_LEN);
            let (mut run_at, mut pos) = (0u64, 0u64);
            loop {
                nw.clear();
                ow.clear();
                let n = (&mut new)
                    .take(transfer::CHUNK as u64)
                    .read_to_end(&mut nw)
                    .map_err(ierr)?;
                if n == 0 {
                    break;
                }
                (&mut old)
                    .take(n as u64)
                    .read_to_end(&mut ow)
                    .map_err(ierr)?;
                for b in (0..n).step_by(BLOCK) {
                    let e = (b + BLOCK).min(n);
                    if ow.get(b..e) == Some(&nw[b..e]) {
                        flush(&mut run, run_at, &mut seq)?;
                        continue;
                    }
                    if run.is_empty() {
                        run_at = pos + b as u64;
                    }
                    run.extend_from_slice(&nw[b..e]);
                    if run.len() >= transfer::CHUNK {
                        flush(&mut run, run_at, &mut seq)?;
                    }
                }
                pos += n as u64;
            }
            flush(&mut run, run_at, &mut seq)?;
            continue;
        }
        let mut f = std::fs::File::open(&full).map_err(ierr)?;
        let mut offset = 0u64;
        loop {
            // Read straight into the buffer that is sealed in place and sent: no copy.
            let mut buf = Vec::with_capacity(transfer::CHUNK + transfer::TAG_LEN);
            let n = (&mut f)
                .take(transfer::CHUNK as u64)
                .read_to_end(&mut buf)
                .map_err(ierr)?;
            if n == 0 && offset > 0 {
                break;
            }
            send(sealed_chunk(seq, &rel, offset, buf, false, ""))?;
            seq += 1;
            offset += n as u64;
            bytes += n as u64;
            if n == 0 {
                break;
            }
        }
    }
    let sealed = sealer.seal(seq, "", 0, true, &seq.to_be_bytes());
    send(ImageChunk {
        migration_uid: uid.into(),
        seq,
        path: String::new(),
        offset: 0,
        sealed,
        end: true,
        symlink: false,
        base: String::new(),
        stream_id: header(seq),
    })?;
    Ok((bytes, paths))
}

/// The PodMigration's bandwidth limit: the stream never runs ahead of `limit` bytes
/// per second since it started (0 = unlimited).
struct Pace {
    limit: u64,
    started: Instant,
    sent: std::sync::atomic::AtomicU64,
}

impl Pace {
    fn new(limit: u64) -> Pace {
        Pace {
            limit,
            started: Instant::now(),
            sent: Default::default(),
        }
    }

    /// Blocks until `bytes` more may go out.
    fn wait(&self, bytes: u64) {
        if self.limit == 0 {
            return;
        }
        let before = self
            .sent
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        let due = std::time::Duration::from_secs_f64(before as f64 / self.limit as f64);
        if let Some(ahead) = due.checked_sub(self.started.elapsed()) {
            std::thread::sleep(ahead);
        }
    }
}

fn pre_round(rel: &str) -> u32 {
    rel.strip_prefix("pre-")
        .and_then(|r| r.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, bool)>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        let rel = e
            .path()
            .strip_prefix(root)
            .expect("under root")
            .to_string_lossy()
            .into_owned();
        if rel.ends_with(".log") {
            continue;
        }
        if ft.is_dir() {
            collect(root, &e.path(), out)?;
        } else if ft.is_symlink() {
            out.push((rel, true));
        } else if ft.is_file() {
            out.push((rel, false));
        }
    }
    Ok(())
}

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl MigrationAgent for Agent {
    async fn prepare(&self, r: GrpcRequest<PrepareRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Prepare)?;
        self.prepare_impl(r.into_inner()).await.map(Response::new)
    }
    async fn pre_dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::PreDump)?;
        self.pre_dump_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Dump)?;
        self.dump_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn send(&self, r: GrpcRequest<SendRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Send)?;
        self.send_impl(r.into_inner()).await.map(Response::new)
    }
    async fn receive_images(&self, r: GrpcRequest<Streaming<ImageChunk>>) -> Res<ReceiveSummary> {
        let caller = self.caller(&r);
        self.receive_impl(caller, r.into_inner())
            .await
            .map(Response::new)
    }
    async fn fence(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Fence)?;
        self.fence_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn restore(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Restore)?;
        self.restore_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn commit(&self, r: GrpcRequest<CommitRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Commit)?;
        self.commit_impl(r.into_inner()).await.map(Response::new)
    }
    async fn abort(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Abort)?;
        self.abort_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn cleanup(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Cleanup)?;
        self.cleanup_impl(&r.into_inner().migration_uid)
            .await
            .map(Response::new)
    }
    async fn status(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Status)?;
        let uid = r.into_inner().migration_uid;
        let m = self.get(&uid)?;
        Ok(Response::new(m.lock().await.status()))
    }
}

#[allow(dead_code)]
fn _assert_stream<S: Stream>(_: S) {}

#[cfg(test)]
mod transfer_tests;
