//! The `MigrationAgent` service. Each migration is a small state machine keyed by its
//! UID; a step that already happened returns the current status instead of running
//! again, a step out of order is `FailedPrecondition`. Every call is first authorized
//! from the caller's certificate ([`crate::authz`]): control calls are the operator's,
//! the image stream is the peer agent's the operator named at `Prepare`.

use crate::admission::{Admission, Step, admit};
use crate::authz::{self, Prepared, Rpc};
use crate::containers::{ContainerFs, Containers, Resolved};
use crate::creds;
use crate::criu::{self, Criu, Opts, Req};
use crate::images;
use crate::mounts;
use crate::pod::PodPlan;
use futures::Stream;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::broker::{BrokerError, BrokerRole, Reply, Request};
use podmotion_wire::client::TlsFiles;
use podmotion_wire::identity::{self, IdentityError, Peer};
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use podmotion_wire::proto::migration_agent_server::MigrationAgent;
use podmotion_wire::transfer;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Mutex;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};

mod dump;
pub mod leader_term;
mod parts;
mod post_copy;
mod receive;
mod restore;
mod send;

use dump::{DumpOutcome, PreDumpRound, dump_locked, pre_dump_locked};
use receive::receive_locked;
use restore::{kill_restored, restore_locked};

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
    /// How long one call to the node's broker may take (taking the request and
    /// answering it). A call past it fails and closes that migration's broker
    /// connection, its lease: the broker rolls the source back, or kills it if fenced.
    pub broker_call_timeout: std::time::Duration,
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
///
/// `given_up`: the watchdog found that no retry of its resume or kill can succeed (the
/// broker ended the lease and undoes the freeze itself, or the source is gone). The
/// state stays as it was (what the operator is told does not change), but the freeze
/// is no longer this agent's to hold, so the frozen-time metric stops counting it.
#[derive(Debug)]
struct Freeze {
    state: std::sync::atomic::AtomicU8,
    given_up: std::sync::atomic::AtomicBool,
    /// PostCopy: the lazy dump that holds this frozen source while it serves pages.
    /// Every thaw ends its session first ([`end_lazy_session`]), and the freeze
    /// watchdog kills nothing it still serves from.
    lazy: StdMutex<Option<Arc<post_copy::Source>>>,
    /// The pod's other containers ([`parts`]): every thaw, fence and kill of the
    /// source acts on them too.
    others: StdMutex<Vec<parts::Lease>>,
}

impl Default for Freeze {
    fn default() -> Self {
        Freeze {
            state: std::sync::atomic::AtomicU8::new(NOT_FROZEN),
            given_up: std::sync::atomic::AtomicBool::new(false),
            lazy: StdMutex::new(None),
            others: StdMutex::new(Vec::new()),
        }
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
        self.state.load(std::sync::atomic::Ordering::SeqCst)
    }
    fn set(&self, v: u8) {
        self.state.store(v, std::sync::atomic::Ordering::SeqCst)
    }
    /// The watchdog gave up on this freeze (see [`Freeze`]).
    fn give_up(&self) {
        self.given_up
            .store(true, std::sync::atomic::Ordering::SeqCst)
    }
    /// Held by this agent: frozen (or being fenced, or fenced) and not given up.
    fn held(&self) -> bool {
        matches!(self.get(), FROZEN | FENCING | FENCED)
            && !self.given_up.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// The leases of the pod's other containers.
    fn others(&self) -> Vec<parts::Lease> {
        self.others.lock().expect("others").clone()
    }
    /// PostCopy: the lazy dump holding this source still serves pages.
    fn serving_pages(&self) -> bool {
        self.lazy
            .lock()
            .expect("lazy")
            .as_ref()
            .is_some_and(|s| s.serving())
    }
    /// Moves FROZEN to `to`; false if the freeze was already claimed (or never made).
    fn claim(&self, to: u8) -> bool {
        self.claim_from(FROZEN, to)
    }
    /// Moves `from` to `to`; false if the freeze is not in `from`.
    fn claim_from(&self, from: u8, to: u8) -> bool {
        self.state
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
    /// The container the operator named, `process` its PID (the broker checks it).
    container: ContainerId,
    /// Source: the container's PID 1 when it is PodMotion's holder (a pod moved
    /// before); `process` is then the restored workload it holds.
    held_by: Option<ProcRef>,
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
    /// Target: the source pod's addresses the broker took over for this restore (the
    /// installer's address hand-over), given back if the restore is undone.
    adopted: Vec<std::net::IpAddr>,
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
    /// PostCopy (`post_copy` at `Prepare`).
    post_copy: bool,
    /// PostCopy, source: the lazy dump serving the tree's pages.
    lazy_source: Option<Arc<post_copy::Source>>,
    /// PostCopy, target: the session with the source and its daemon's socket.
    lazy_target: Option<Arc<post_copy::Target>>,
    /// The pod's containers after the first ([`parts`]); empty for a one-container
    /// pod.
    parts: Vec<parts::Part>,
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
            post_copy: self.post_copy,
            lazy_done: self.lazy_state().is_some_and(|s| s.done()),
            lazy_error: self.lazy_state().map(|s| s.error()).unwrap_or_default(),
            lazy_bytes: self.lazy_state().map(|s| s.bytes()).unwrap_or(0),
        }
    }

    /// PostCopy: this side's view of the lazy phase, once it began.
    fn lazy_state(&self) -> Option<&post_copy::LazyState> {
        match (&self.lazy_source, &self.lazy_target) {
            (Some(s), _) => Some(&s.state),
            (_, Some(t)) => Some(&t.state),
            _ => None,
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

/// Where a prepared migration's process and images are.
struct Placement {
    process: ProcRef,
    /// The container `process` was resolved from (its bare ID).
    container: ContainerId,
    /// The holder whose workload `process` is (see [`Migration::held_by`]).
    held_by: Option<ProcRef>,
    /// A real container's mounts.
    fs: Option<ContainerFs>,
    /// Its checkpoint dir, just created.
    dir: PathBuf,
}

impl Migration {
    /// A migration as `Prepare` records it, before the broker knows it.
    fn prepared(
        uid: MigrationUid,
        role: Role,
        r: PrepareRequest,
        placed: Placement,
        broker: BrokerClient,
        freeze_limit: std::time::Duration,
    ) -> Migration {
        Migration {
            uid,
            role,
            peer: r.peer_node,
            phase: Phase::Prepared,
            process: placed.process,
            container: placed.container,
            held_by: placed.held_by,
            key: r.transfer_key,
            tcp: TcpPreservation::try_from(r.tcp).unwrap_or(TcpPreservation::BestEffort),
            dir: placed.dir,
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
            adopted: Vec::new(),
            sent: Default::default(),
            broker: Arc::new(StdMutex::new(broker)),
            netns_path: None,
            fs: placed.fs,
            freeze: Arc::default(),
            freeze_limit,
            fenced: false,
            post_copy: r.post_copy,
            lazy_source: None,
            lazy_target: None,
            parts: Vec::new(),
        }
    }

    /// Registers the migration with the node's broker, naming the container the process
    /// was resolved from (the broker refuses a process outside that container's
    /// cgroup); a target also has the broker bind the pod's network namespace. On
    /// failure `Prepare` undoes it all (see [`Agent::prepare_impl`]).
    async fn register(&mut self) -> Result<(), Status> {
        let broker_role = if self.role == Role::Source {
            BrokerRole::Source
        } else {
            BrokerRole::Target
        };
        self.broker(Request::Register {
            uid: self.uid.clone(),
            role: broker_role,
            process: self.process,
            container: self.container.clone(),
        })
        .await?;
        if self.role == Role::Target {
            match self
                .broker(Request::BindNetns {
                    uid: self.uid.clone(),
                })
                .await?
            {
                Reply::NetnsPath { path } => self.netns_path = Some(path),
                other => return Err(Status::internal(format!("broker replied {other:?}"))),
            }
        }
        Ok(())
    }

    /// `Abort` on the source: resumes it, whatever left it stopped (the final dump's
    /// freeze, the fence, or a step that left something locked), unless a commit or
    /// the freeze watchdog has it.
    async fn resume_source(&mut self) -> Result<(), Status> {
        if self.freeze.get() == COMMITTING {
            return Err(Status::failed_precondition(
                "a commit is killing the source: it cannot be resumed",
            ));
        }
        match self.freeze.get() {
            // The freeze the final dump left, if nothing claimed it since.
            FROZEN => {
                thaw_frozen(&self.freeze, &self.broker, &self.uid).await?;
            }
            FENCED => self.unfence_and_thaw().await?,
            THAWING | KILLING => {
                return Err(Status::unavailable(
                    "the freeze watchdog is resuming or killing the source: ask again",
                ));
            }
            THAWED => {}
            // No final dump (Prepared, a pre-copy round, a failed dump): the
            // calls are no-ops unless something was left locked.
            _ => thaw_source(&self.freeze, &self.broker, &self.uid).await?,
        }
        Ok(())
    }

    /// The operator's abort is the one thing that lifts the fence (it is sent once
    /// the target's copy is confirmed killed): the broker first, then the thaw.
    async fn unfence_and_thaw(&mut self) -> Result<(), Status> {
        if !self.freeze.claim_from(FENCED, THAWING) {
            return Err(Status::unavailable(
                "the freeze watchdog is killing the fenced source: ask again",
            ));
        }
        if let Err(e) = self
            .broker(Request::Unfence {
                uid: self.uid.clone(),
            })
            .await
        {
            self.freeze.set(FENCED);
            return Err(e);
        }
        if let Err(e) = parts::unfence_all(&self.freeze.others()).await {
            // The first container is unfenced, another is not: fenced again, so the
            // watchdog and a retry see one state.
            let _ = self
                .broker(Request::Fence {
                    uid: self.uid.clone(),
                })
                .await;
            self.freeze.set(FENCED);
            return Err(e);
        }
        self.fenced = false;
        if let Err(e) = end_lazy_session(&self.freeze).await {
            self.freeze.set(FROZEN);
            return Err(e);
        }
        if let Err(e) = thaw_source(&self.freeze, &self.broker, &self.uid).await {
            // Unfenced: the watchdog resumes it if no retry does.
            self.freeze.set(FROZEN);
            return Err(e);
        }
        self.freeze.set(THAWED);
        Ok(())
    }

    /// `Abort` on the target: no restored process may outlive the answer "aborted"
    /// (the operator thaws the source on it). Killed and confirmed dead, or the Abort
    /// fails and the operator asks again.
    /// Target: gives back the addresses taken over for the restore (before its holder
    /// is killed: the broker edits the holder's namespace through it), so the source,
    /// resumed, announces its address again with nobody else answering for it. A
    /// failure is logged: the target pod's deletion takes the address with it.
    async fn release_adopted(&mut self) {
        for address in std::mem::take(&mut self.adopted) {
            let req = Request::ReleaseAddress {
                uid: self.uid.clone(),
                address,
            };
            if let Err(e) = self.broker(req).await {
                tracing::warn!(uid = %self.uid, %address, error = %e.message(), "the adopted address could not be released (the target pod's deletion removes it)");
            }
        }
    }

    async fn kill_restored_copy(&mut self) -> Result<(), Status> {
        // PostCopy: a daemon started for a restore that never came goes too.
        if let Some(t) = &self.lazy_target {
            t.stop_daemon();
        }
        self.release_adopted().await;
        self.kill_restored_parts().await?;
        let root = self.restored;
        let holder = self.fs.is_some().then_some(self.process);
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
        self.restored = None;
        Ok(())
    }
}

impl Migration {
    /// Target: kills what was restored into the pod's other containers (below their
    /// holders), confirmed dead, or fails.
    async fn kill_restored_parts(&mut self) -> Result<(), Status> {
        for p in &mut self.parts {
            let root = p.restored;
            let holder = p.fs.is_some().then_some(p.lease.process);
            if root.is_none() && holder.is_none() {
                continue;
            }
            let name = p.name.clone();
            blocking(move || {
                kill_restored(root, holder).map_err(|e| {
                    Status::unavailable(format!(
                        "container {name}: the restored copy could not be confirmed killed: {e}"
                    ))
                })
            })
            .await?;
            p.restored = None;
        }
        Ok(())
    }
}

/// The checks of a new `Prepare` (a migration already prepared answers its status
/// before them); its role.
fn check_prepare(r: &PrepareRequest, own_node: Option<&str>) -> Result<Role, Status> {
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
    if own_node == Some(r.peer_node.as_str()) {
        return Err(Status::invalid_argument(format!(
            "peer_node {:?} is this agent's own node",
            r.peer_node
        )));
    }
    Ok(role)
}

async fn broker_call(b: &Arc<StdMutex<BrokerClient>>, req: Request) -> Result<Reply, Status> {
    let b = Arc::clone(b);
    blocking(move || broker_call_blocking(&b, req)).await
}

/// [`broker_call`] on a thread that may block (the blocking pool's).
fn broker_call_blocking(b: &StdMutex<BrokerClient>, req: Request) -> Result<Reply, Status> {
    let r = b.lock().expect("broker client").call(&req);
    crate::metrics::global().broker_op(req.name(), r.as_ref().map(|_| ()).map_err(|e| e.kind));
    r.map_err(broker_status)
}

/// Undoes a failed `Prepare`: the broker forgets the migration on its lease (unbinding
/// a target's netns; nothing registered is a no-op, and a registration another
/// connection holds is not this one's), the lease ends when `lease` is dropped, and the
/// checkpoint dir is zeroized.
async fn undo_prepare(uid: &MigrationUid, dir: &Path, lease: Option<Arc<StdMutex<BrokerClient>>>) {
    if let Some(b) = lease
        && let Err(e) = broker_call(&b, Request::Forget { uid: uid.clone() }).await
    {
        tracing::warn!(%uid, error = %e, "failed prepare: the broker did not forget it (the lease's end does)");
    }
    if let Err(e) = images::zeroize(dir) {
        tracing::warn!(%uid, error = %e, "failed prepare: its checkpoint dir could not be removed");
    }
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
    if let Err(e) = end_lazy_session(freeze).await {
        freeze.set(FROZEN);
        return Err(e);
    }
    match thaw_source(freeze, b, uid).await {
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

/// PostCopy: before a thaw, the lazy dump holding the source ends its session cleanly
/// and returns, leaving the tree stopped (a thaw of a tree CRIU still holds would be
/// lost). Nothing to do without one.
async fn end_lazy_session(freeze: &Freeze) -> Result<(), Status> {
    let Some(src) = freeze.lazy.lock().expect("lazy").clone() else {
        return Ok(());
    };
    src.end().await.map_err(|e| {
        Status::unavailable(format!(
            "the lazy dump holding the source did not let it go: {e}"
        ))
    })
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
    match kill_source(freeze, b, uid, process).await {
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
/// gone. A root already gone counts as killed (a commit whose call was cut off after
/// its kill is asked again, and the broker refuses a process that is gone).
async fn kill_source(
    freeze: &Freeze,
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
    process: ProcRef,
) -> Result<(), Status> {
    // The pod's other containers first: the first container's registration is the
    // one whose end (a lost lease) the operator's view follows.
    for o in freeze.others() {
        kill_one(&o.broker, &o.uid, o.process).await?;
    }
    kill_one(b, uid, process).await
}

/// [`kill_source`] of one registered tree.
async fn kill_one(
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
    process: ProcRef,
) -> Result<(), Status> {
    if let Err(e) = broker_call(b, Request::Kill { uid: uid.clone() }).await {
        if procfs::check_live(process).is_err() {
            return Ok(());
        }
        return Err(e);
    }
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
/// resumed workload's sockets work from its first instruction; every container of the
/// pod (`freeze`'s other containers) at each step.
async fn thaw_source(
    freeze: &Freeze,
    b: &Arc<StdMutex<BrokerClient>>,
    uid: &MigrationUid,
) -> Result<(), Status> {
    let others = freeze.others();
    for o in &others {
        o.call(Request::ReleaseTcpRepair { uid: o.uid.clone() })
            .await?;
    }
    broker_call(b, Request::ReleaseTcpRepair { uid: uid.clone() }).await?;
    broker_call(b, Request::UnlockNetwork { uid: uid.clone() }).await?;
    for o in &others {
        o.call(Request::UnlockNetwork { uid: o.uid.clone() })
            .await?;
        o.call(Request::Resume { uid: o.uid.clone() }).await?;
    }
    broker_call(b, Request::Resume { uid: uid.clone() }).await?;
    Ok(())
}

/// `Fence` once it holds the migration (see [`Agent::fence_impl`]).
async fn fence_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
) -> Result<MigrationStatus, Status> {
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
    if let Err(e) = parts::fence_all(&m.freeze.others()).await {
        let _ = m.broker(Request::Unfence { uid: m.uid.clone() }).await;
        m.freeze.set(FROZEN);
        return Err(e);
    }
    m.fenced = true;
    m.freeze.set(FENCED);
    tracing::info!(uid = %m.uid, "fenced: from now on this source is killed, never resumed, unless the operator aborts");
    Ok(m.status())
}

/// `Abort` once it holds the migration (see [`Agent::abort_impl`]): on the source the
/// thaw, on the target the kill of the restored copy, then the images go.
async fn abort_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
) -> Result<MigrationStatus, Status> {
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
            m.resume_source().await?;
            m.sync_freeze();
            m.timings.resumed_us = now_us();
        }
        (_, _) => m.kill_restored_copy().await?,
    }
    let _ = images::zeroize(&m.dir);
    m.image_bytes = 0;
    m.phase = Phase::Aborted;
    tracing::info!(uid = %m.uid, "aborted");
    Ok(m.status())
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

fn io_internal(e: std::io::Error) -> Status {
    Status::internal(e.to_string())
}

/// A failed system call `call` on `path` as a status whose code says what happened:
/// the kernel's refusal (EACCES, EPERM) is `PermissionDenied`, a path that is not
/// there `NotFound`, anything else `Internal`. The message names the call and the
/// path, and what grants the permission when refused.
pub(crate) fn io_status(call: &str, path: &str, e: &std::io::Error) -> Status {
    use std::io::ErrorKind;
    let msg = format!("{call} {path}: {e}");
    match e.kind() {
        ErrorKind::PermissionDenied => Status::permission_denied(format!(
            "{msg} (the agent runs as uid 0 without CAP_SYS_PTRACE: a process of another \
             user is reached as that user, see docs/security.md)"
        )),
        ErrorKind::NotFound => Status::not_found(msg),
        _ => Status::internal(msg),
    }
}

/// Runs one CRIU request (`kind`, its log at `log`) on a blocking thread, as `owner`
/// (the tree's: see [`crate::creds`]).
async fn run_criu(
    criu: Criu,
    kind: i32,
    opts: Opts,
    log: PathBuf,
    owner: creds::Owner,
) -> Result<criu::Resp, Status> {
    blocking(move || {
        criu.call_as(
            Req {
                r#type: kind,
                opts: Some(opts),
            },
            Some(&log),
            owner,
        )
        .map_err(criu_status)
    })
    .await
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
}

/// The inode of `pid`'s network namespace, read as `owner` (the process's).
/// Who the source's CRIU runs as: its tree's owner (the same at `Prepare`, which
/// refused a tree of several users).
fn source_owner(m: &Migration) -> Result<creds::Owner, Status> {
    creds::tree_owner(m.process.pid).map_err(Status::failed_precondition)
}

fn netns_ino(pid: i32, owner: creds::Owner) -> Result<String, Status> {
    let path = format!("/proc/{pid}/ns/net");
    let l = creds::as_owner(owner, || std::fs::read_link(&path))
        .and_then(|r| r)
        .map_err(|e| io_status("readlink", &path, &e))?;
    Ok(l.to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect())
}

/// The tree a source container's dump starts from, from its PID 1 (`pid`): that
/// process, or, if it is PodMotion's holder, the restored workload it holds (see
/// [`crate::holder::held_workload`]) with the holder pinned beside it. CRIU, run in the
/// node's PID namespace as for any container, dumps that workload: the init of the
/// namespace nested below the holder's (what it refuses is a tree that spans two
/// nested namespaces, the holder's own). A holder that holds nothing to migrate is a
/// failed precondition.
fn held_source(pid: i32) -> Result<(i32, Option<ProcRef>), Status> {
    let Some(workload) = crate::holder::held_workload(pid).map_err(Status::failed_precondition)?
    else {
        return Ok((pid, None));
    };
    let start_time = procfs::start_time(pid).map_err(|e| Status::not_found(e.to_string()))?;
    Ok((workload, Some(ProcRef { pid, start_time })))
}

/// Name under which the pod's network namespace is external to the images: CRIU
/// neither dumps nor recreates it; the target passes its own namespace for this key.
const NETNS_KEY: &str = "podnet";

pub struct Agent {
    cfg: Arc<Config>,
    /// This agent's own identity, from its certificate.
    own: Peer,
    migrations: StdMutex<HashMap<String, Arc<Mutex<Migration>>>>,
    /// Migrations whose `Prepare` is under way: a second `Prepare` of one of them is
    /// refused until the first has ended (its failure would undo the first's work).
    preparing: StdMutex<HashSet<String>>,
    /// Every source this agent left frozen after a final dump (claimed or not).
    frozen: Arc<StdMutex<Vec<FrozenSource>>>,
    /// Per migration, raised by its `Abort` before it waits for the migration: a
    /// `Send` or an image stream under way holds the migration for its whole length
    /// (minutes when paced), and is cut short by it, so that the Abort, and the
    /// rollback waiting on it, do not wait for the transfer to end.
    aborts: StdMutex<HashMap<String, tokio::sync::watch::Sender<bool>>>,
    /// The status of each migration a transfer holds (see [`Transferring`]), answered
    /// by `Status` instead of waiting for the transfer's end.
    transferring: Transfers,
    /// The highest operator leader term seen, and recorded on the node when the agent
    /// has a [`leader_term::TermRecord`] (the fence against a replica that still
    /// believes it leads; [`authz::admit_term`]).
    term_fence: leader_term::TermFence,
}

impl Agent {
    /// The Abort signal of migration `uid` (see [`Agent::aborts`]), raised already if
    /// its Abort came.
    fn abort_signal(&self, uid: &str) -> tokio::sync::watch::Receiver<bool> {
        self.with_abort(uid, |tx| tx.subscribe())
    }

    /// Raises the Abort signal of `uid`: its transfers under way end.
    fn raise_abort(&self, uid: &str) {
        self.with_abort(uid, |tx| tx.send_replace(true));
    }

    /// `f` on the Abort signal of `uid`, made (lowered) if it has none yet.
    fn with_abort<T>(
        &self,
        uid: &str,
        f: impl FnOnce(&tokio::sync::watch::Sender<bool>) -> T,
    ) -> T {
        let mut all = self.aborts.lock().expect("aborts");
        f(all
            .entry(uid.to_string())
            .or_insert_with(|| tokio::sync::watch::channel(false).0))
    }
}

/// Runs `transfer` unless and until `aborted` is raised: then it is dropped (its
/// stream closed) and the answer is `aborted`.
pub(crate) async fn cut_by_abort<T>(
    mut aborted: tokio::sync::watch::Receiver<bool>,
    transfer: impl std::future::Future<Output = Result<T, Status>>,
    what: &str,
) -> Result<T, Status> {
    tokio::select! {
        r = transfer => r,
        _ = aborted.wait_for(|a| *a) => {
            tracing::warn!(what, "cut short by the migration's Abort");
            Err(Status::aborted(format!("{what} was cut short by the migration's Abort")))
        }
    }
}

/// Statuses of the migrations whose transfer is under way, by UID.
pub(crate) type Transfers = Arc<StdMutex<HashMap<String, MigrationStatus>>>;

/// A transfer under way (a `Send`, an image stream): it holds its migration for its
/// whole length, so its status at the start is kept in [`Agent::transferring`] for
/// `Status` to answer, until dropped.
pub(crate) struct Transferring {
    all: Transfers,
    uid: String,
}

impl Transferring {
    pub(crate) fn mark(all: &Transfers, uid: &str, st: MigrationStatus) -> Transferring {
        all.lock()
            .expect("transferring")
            .insert(uid.to_string(), st);
        Transferring {
            all: Arc::clone(all),
            uid: uid.to_string(),
        }
    }
}

impl Drop for Transferring {
    fn drop(&mut self) {
        self.all.lock().expect("transferring").remove(&self.uid);
    }
}

/// A `Prepare` under way, marked in [`Agent::preparing`] until dropped (on every way
/// out of the call, an abandoned one included).
struct Preparing<'a> {
    set: &'a StdMutex<HashSet<String>>,
    uid: String,
}

impl<'a> Preparing<'a> {
    /// `None` if a `Prepare` of `uid` is already under way.
    fn claim(set: &'a StdMutex<HashSet<String>>, uid: &MigrationUid) -> Option<Self> {
        let uid = uid.to_string();
        // The guard is made only once the set's lock is released: a guard dropped
        // under it (`then_some` builds its value eagerly) would deadlock on it.
        let claimed = set.lock().expect("preparing").insert(uid.clone());
        if claimed {
            Some(Preparing { set, uid })
        } else {
            None
        }
    }
}

impl Drop for Preparing<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("preparing").remove(&self.uid);
    }
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
            preparing: StdMutex::new(HashSet::new()),
            aborts: StdMutex::new(HashMap::new()),
            transferring: Arc::new(StdMutex::new(HashMap::new())),
            frozen: Arc::new(StdMutex::new(Vec::new())),
            term_fence: leader_term::TermFence::default(),
        })
    }

    /// The agent keeps its leader-term fence in `record` (on the node, so that it
    /// survives the agent) and starts from the term recorded there. Fails if the
    /// record cannot be read or is corrupt: the fence is never lowered silently
    /// ([`leader_term::TermRecord`]).
    pub fn with_leader_term_record(
        mut self,
        record: leader_term::TermRecord,
    ) -> Result<Self, leader_term::TermRecordError> {
        let path = record.path();
        self.term_fence = leader_term::TermFence::recorded(record)?;
        tracing::info!(
            highest = %self.term_fence.highest(),
            record = %path.display(),
            "leader-term fence starts from the recorded term"
        );
        Ok(self)
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

    /// Authorizes a control call (its decision does not depend on the migration): the
    /// caller's identity, then the operator's leader term against the highest seen.
    fn authorize_control<T>(&self, r: &GrpcRequest<T>, rpc: Rpc) -> Result<(), Status> {
        let caller = self.caller(r);
        let state = authz::State {
            this_node: self.own_node(),
            migration: None,
        };
        let refused = |d: authz::Denied| {
            tracing::warn!(%rpc, denied = %d, "call refused");
            Status::from(d)
        };
        authz::authorize(&caller, rpc, state).map_err(refused)?;
        let presented = podmotion_wire::agent::leader_term(r.metadata())
            .map_err(|e| Status::invalid_argument(format!("{rpc}: {e}")))?;
        // A term this call raises is recorded on the node before the call is admitted:
        // an agent that crashes after acting on it must not come back below it.
        let highest = self.term_fence.observe(rpc, presented).map_err(|e| {
            tracing::error!(%rpc, error = %e, "could not record the leader term: call refused");
            Status::unavailable(format!("{rpc}: the leader term was not recorded: {e}"))
        })?;
        authz::admit_term(rpc, presented, highest).map_err(refused)
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
            .filter(|f| f.freeze.held())
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
        // Two calls at once (an operator retry racing its first call) would both
        // register: the loser's undo would remove the winner's checkpoint directory.
        let Some(_preparing) = Preparing::claim(&self.preparing, &uid) else {
            return Err(Status::unavailable(
                "a Prepare of this migration is already under way: ask again",
            ));
        };
        if let Ok(m) = self.get(uid.as_str()) {
            return Ok(m.lock().await.status());
        }
        let role = check_prepare(&r, self.own_node())?;
        if r.post_copy {
            // Refused here, before anything is frozen: the source serves the pages,
            // the target restores them through a userfaultfd.
            match role {
                Role::Source => crate::lazy::pipe_room(),
                _ => crate::lazy::uffd_room(),
            }
            .map_err(Status::failed_precondition)?;
        }
        // The pod's containers, by name (the single-container wire is the
        // one-element case): the first as a one-container pod's, the others as its
        // parts (see `parts`).
        let plan = PodPlan::from_request(&r)?;
        if plan.is_multi() && r.post_copy {
            // Refused before anything is resolved or frozen.
            return Err(Status::failed_precondition(format!(
                "PostCopy moves one container's memory lazily, and the pod has the \
                 containers {}: use PreCopy or Cold",
                plan.names()
            )));
        }
        // No PID on the wire: the containers the operator names are resolved here,
        // through the node's container runtime (a malformed ID is InvalidArgument).
        let Resolved { container, pid, fs } = self
            .cfg
            .containers
            .resolve(std::slice::from_ref(&plan.first().id))
            .await?;
        // A pod PodMotion moved before: the source container's PID 1 is the holder,
        // and the tree to dump is the workload it holds.
        let (pid, held_by) = match role {
            Role::Source => held_source(pid)?,
            _ => (pid, None),
        };
        let start_time = procfs::start_time(pid).map_err(|e| Status::not_found(e.to_string()))?;
        let process = ProcRef { pid, start_time };
        if role == Role::Source {
            // Refused here, before anything is frozen: a tree CRIU cannot dump as one
            // user on this node (see crate::creds).
            let owner = creds::tree_owner(pid).map_err(Status::failed_precondition)?;
            if r.post_copy && !owner.is_root() {
                return Err(Status::failed_precondition(format!(
                    "PostCopy of a container running as {owner} is not supported: its lazy \
                     dump runs CRIU as root, which cannot read that user's resource limits \
                     without CAP_SYS_RESOURCE; use PreCopy or Cold"
                )));
            }
        }
        let dir = images::create(&self.cfg.checkpoints_root, uid.as_str())
            .map_err(|e| Status::internal(e.to_string()))?;
        // From here every failure undoes what this Prepare did so far, in one place:
        // the checkpoint dir, and the broker registration (a target's netns bind
        // with it) on the lease that made it.
        let mut lease = None;
        let placed = Placement {
            process,
            container,
            held_by,
            fs,
            dir: dir.clone(),
        };
        let mut m = match self
            .connect_and_register(&uid, role, r, placed, &mut lease)
            .await
        {
            Ok(m) => m,
            Err(e) => {
                undo_prepare(&uid, &dir, lease).await;
                return Err(e);
            }
        };
        if plan.is_multi() {
            let mut prepared = Vec::new();
            let res = parts::prepare(
                &self.cfg.containers,
                self.cfg.broker_socket.clone(),
                self.cfg.broker_call_timeout,
                &plan,
                &uid,
                role,
                &mut prepared,
            )
            .await;
            if let Err(e) = res {
                parts::forget_all(&prepared).await;
                undo_prepare(&uid, &dir, lease).await;
                return Err(e);
            }
            if role == Role::Source {
                *m.freeze.others.lock().expect("others") =
                    prepared.iter().map(|p| p.lease.clone()).collect();
            }
            m.parts = prepared;
            tracing::info!(%uid, ?role, containers = %plan.names(), "prepared the pod's other containers");
        }
        let st = m.status();
        match m.held_by {
            Some(h) => {
                tracing::info!(%uid, ?role, pid = process.pid, holder = h.pid, peer = %m.peer, "prepared: the container's PID 1 is PodMotion's holder, its restored workload is the tree to migrate")
            }
            None => tracing::info!(%uid, ?role, pid = process.pid, peer = %m.peer, "prepared"),
        }
        self.migrations
            .lock()
            .expect("migrations")
            .insert(uid.to_string(), Arc::new(Mutex::new(m)));
        Ok(st)
    }

    /// The broker steps of a `Prepare`: a connection (this migration's lease, also
    /// left in `lease` for [`undo_prepare`]) and the registration on it.
    async fn connect_and_register(
        &self,
        uid: &MigrationUid,
        role: Role,
        r: PrepareRequest,
        placed: Placement,
        lease: &mut Option<Arc<StdMutex<BrokerClient>>>,
    ) -> Result<Migration, Status> {
        let sock = self.cfg.broker_socket.clone();
        let deadline = self.cfg.broker_call_timeout;
        let client = blocking(move || {
            BrokerClient::connect_with_deadline(&sock, deadline)
                .map_err(|e| Status::unavailable(format!("broker: {e}")))
        })
        .await?;
        let freeze_limit = self.cfg.freeze_watchdog.limit(r.freeze_budget_ms);
        let mut m = Migration::prepared(uid.clone(), role, r, placed, client, freeze_limit);
        *lease = Some(Arc::clone(&m.broker));
        m.register().await?;
        Ok(m)
    }

    fn dump_opts(
        &self,
        m: &Migration,
        dir: &Path,
        log: &str,
        external_mounts: &[String],
        owner: creds::Owner,
    ) -> Result<Opts, Status> {
        let mut o = Opts::new(dir, log);
        o.pid = Some(m.process.pid);
        o.external = vec![format!(
            "net[{}]:{NETNS_KEY}",
            netns_ino(m.process.pid, owner)?
        )];
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
        parts::external_mounts(m.fs.as_ref(), m.process.pid)
    }

    async fn pre_dump_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let m = self.get(uid)?.lock_owned().await;
        admit(m.role, m.phase, Step::PreDump)?;
        if m.post_copy {
            return Err(Status::failed_precondition(
                "PostCopy has no pre-copy rounds: the memory follows the restore",
            ));
        }
        procfs::check_live(m.process).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let owner = source_owner(&m)?;
        let dir = m.dir.join(format!("pre-{}", m.iteration + 1));
        std::fs::create_dir_all(&dir).map_err(|e| Status::internal(e.to_string()))?;
        let mut opts =
            self.dump_opts(&m, &dir, "pre-dump.log", &self.external_mounts(&m)?, owner)?;
        let kind = if self.cfg.track_mem {
            criu::REQ_PRE_DUMP
        } else {
            // Warm copy: a full dump that leaves the workload running and does not
            // touch its connections (they are captured by the final dump only).
            opts.leave_running = Some(true);
            opts.tcp_close = Some(true);
            // A connection the kernel accepted and the workload has not yet: nothing
            // to copy now (the final dump, under the network lock, decides), never a
            // reason to fail the round. A client connecting every 10 ms made it fail
            // 2 PreCopy rounds of 7 on the real nodes (issue 39).
            opts.tcp_skip_in_flight = Some(true);
            criu::REQ_DUMP
        };
        // The round runs to its end in a task of its own that holds the migration,
        // even if the caller goes away (a dropped gRPC call drops its handler's
        // future, not CRIU): otherwise the next round or the final dump would take
        // the migration while this CRIU still has the tree seized.
        let others = m
            .parts
            .iter()
            .map(|p| {
                let dir = m.dir.join(p.layout.pre_dir(m.iteration + 1));
                let parent = self.cfg.track_mem.then_some(m.iteration);
                parts::dump_of(p, dir, "pre-dump.log", self.cfg.track_mem, parent, false)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let round = PreDumpRound {
            kind,
            opts,
            dir,
            criu: self.cfg.criu.clone(),
            owner,
            parts: others,
        };
        tokio::spawn(pre_dump_locked(m, round))
            .await
            .map_err(|e| Status::internal(format!("pre-dump task: {e}")))?
    }

    async fn dump_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        let mut m = self.get(uid)?.lock_owned().await;
        m.sync_freeze();
        if admit(m.role, m.phase, Step::Dump)? == Admission::Done {
            return Ok(m.status());
        }
        procfs::check_live(m.process).map_err(|e| Status::failed_precondition(e.to_string()))?;
        let owner = source_owner(&m)?;
        let dir = m.dir.join("final");
        std::fs::create_dir_all(&dir).map_err(|e| Status::internal(e.to_string()))?;
        let external_mounts = self.external_mounts(&m)?;
        let stdio_pipes: Vec<(i32, String)> = if m.fs.is_some() {
            // The links of another user's fds are read as that user.
            let pid = m.process.pid;
            creds::as_owner(owner, || mounts::stdio_pipes(pid))
                .map_err(|e| io_status("read fd links of", &format!("/proc/{pid}/fd"), &e))?
                .into_iter()
                .map(|p| (p.fd, p.key))
                .collect()
        } else {
            vec![]
        };
        let opts = {
            let mut o = self.dump_opts(&m, &dir, "dump.log", &external_mounts, owner)?;
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
        let others = m
            .parts
            .iter()
            .map(|p| {
                let dir = m.dir.join(p.layout.final_dir());
                let parent = self.cfg.track_mem.then_some(m.iteration);
                parts::dump_of(p, dir, "dump.log", self.cfg.track_mem, parent, true)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let dumped = DumpOutcome {
            dir,
            opts,
            external_mounts,
            stdio_pipes,
            parts: others,
            criu: self.cfg.criu.clone(),
            frozen: Arc::clone(&self.frozen),
            margin: self.cfg.freeze_watchdog.margin,
            lazy: m.post_copy,
            owner,
        };
        tokio::spawn(dump_locked(m, dumped))
            .await
            .map_err(|e| Status::internal(format!("dump task: {e}")))?
    }

    async fn send_impl(&self, r: SendRequest) -> Result<MigrationStatus, Status> {
        let mm = self.get(&r.migration_uid)?;
        // Watched from before the wait for the migration: an Abort that comes while
        // this waits, or while it streams, ends it.
        let aborted = self.abort_signal(&r.migration_uid);
        let mut m = mm.lock().await;
        m.sync_freeze();
        if admit(m.role, m.phase, Step::Send)? == Admission::Done {
            return Ok(m.status());
        }
        let t = Instant::now();
        let _transferring = Transferring::mark(&self.transferring, &r.migration_uid, m.status());
        let channel = send::connect_target(&self.cfg, &m.peer, &r).await?;
        let delta = !self.cfg.track_mem;
        let (sent, paths) = cut_by_abort(
            aborted,
            send::stream_images(channel.clone(), &m, delta, r.bandwidth_limit),
            "the send",
        )
        .await?;
        m.record_sent(sent, paths, t);
        // PostCopy: with the images there, the source's pages follow on demand.
        if m.phase == Phase::Sent
            && let Some(src) = m.lazy_source.clone()
        {
            let (uid, key) = (m.uid.to_string(), m.key.clone());
            tokio::spawn(post_copy::serve_pages(
                channel,
                src,
                uid,
                key,
                r.bandwidth_limit,
            ));
        }
        Ok(m.status())
    }

    /// A stream from the peer agent (images, lazy pages), before anything of it is
    /// used: only the peer named at `Prepare` may open one, and an unknown migration is
    /// refused the same way, telling the caller nothing. The migration and its lock.
    async fn admit_peer_stream(
        &self,
        caller: &Result<Peer, IdentityError>,
        rpc: Rpc,
        uid: &str,
        what: &str,
    ) -> Result<
        (
            Arc<Mutex<Migration>>,
            tokio::sync::OwnedMutexGuard<Migration>,
        ),
        Status,
    > {
        let found = self.get(uid).ok();
        let guard = match &found {
            Some(m) => Some(Arc::clone(m).lock_owned().await),
            None => None,
        };
        let state = authz::State {
            this_node: self.own_node(),
            migration: guard.as_ref().map(|m| Prepared {
                role: m.role,
                peer: &m.peer,
            }),
        };
        if let Err(d) = authz::authorize(caller, rpc, state) {
            tracing::warn!(%uid, denied = %d, "{what} refused");
            return Err(d.into());
        }
        Ok((
            found.expect("authorized streams name a known migration"),
            guard.expect("authorized streams name a known migration"),
        ))
    }

    /// PostCopy, target: the source agent's lazy-pages session (see
    /// [`post_copy::accept_session`]), admitted like an image stream (only the peer
    /// named at Prepare), once the final images are here and before the restore.
    async fn lazy_pages_impl(
        &self,
        caller: Result<Peer, IdentityError>,
        mut s: Streaming<LazyFrame>,
    ) -> Result<post_copy::FrameStream, Status> {
        let Some(first) = s.message().await? else {
            return Err(Status::invalid_argument("empty lazy-pages stream"));
        };
        let (mm, mut m) = self
            .admit_peer_stream(
                &caller,
                Rpc::LazyPages,
                &first.migration_uid,
                "lazy-pages session",
            )
            .await?;
        if !m.post_copy {
            return Err(Status::failed_precondition(
                "this migration is not PostCopy",
            ));
        }
        if m.phase != Phase::Received || m.lazy_target.is_some() {
            return Err(Status::failed_precondition(format!(
                "a lazy-pages session opens once, between the final images and the restore (phase {:?})",
                m.phase
            )));
        }
        post_copy::accept_session(&self.cfg.criu, &mut m, mm, first, s)
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
        let (_, m) = self
            .admit_peer_stream(
                &caller,
                Rpc::ReceiveImages,
                &first.migration_uid,
                "image stream",
            )
            .await?;
        admit(m.role, m.phase, Step::Receive)?;
        let aborted = self.abort_signal(&first.migration_uid);
        let transfers = Arc::clone(&self.transferring);
        tokio::spawn(receive_locked(m, first, s, aborted, transfers))
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
        let mm = self.get(uid)?;
        let m = Arc::clone(&mm).lock_owned().await;
        tokio::spawn(restore_locked(Arc::clone(&self.cfg), m, mm))
            .await
            .map_err(|e| Status::internal(format!("restore task: {e}")))?
    }

    /// The restore fence (see [`Freeze`]): once the broker has it in its journal, the
    /// freeze is FENCED and the answer says `fenced`. Idempotent: a fenced (or, since,
    /// killed or committing) source answers its status again.
    async fn fence_impl(&self, uid: &str) -> Result<MigrationStatus, Status> {
        // Like `Abort`, the fence runs to its end in a task that holds the migration,
        // even if its caller goes away: one cut off inside the broker's call would leave
        // the freeze claimed (FENCING), neither fenced nor abortable.
        let m = self.get(uid)?.lock_owned().await;
        tokio::spawn(fence_locked(m))
            .await
            .map_err(|e| Status::internal(format!("fence task: {e}")))?
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
        if m.lazy_source.as_ref().is_some_and(|s| !s.state.done()) {
            return Err(Status::failed_precondition(
                "PostCopy: the target's copy has not all its pages yet; commit once the target reports lazy_done",
            ));
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
            for o in m.freeze.others() {
                o.call(Request::ReleaseTcpRepair { uid: o.uid.clone() })
                    .await?;
                o.call(Request::UnlockNetwork { uid: o.uid.clone() })
                    .await?;
            }
        }
        kill_source(&m.freeze, &m.broker, &m.uid, m.process).await?;
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
        // The abort runs to its end in a task of its own that holds the migration, even
        // if the caller goes away (a dropped gRPC call drops its handler's future: the
        // operator's leader killed, its call deadline): an abort cut off inside the
        // source's thaw left the freeze claimed (THAWING) with nothing to finish or give
        // it back, so every later Abort answered "ask again", the freeze watchdog waited
        // on it for ever and Cleanup refused the source as frozen: it stayed stopped.
        self.raise_abort(uid);
        let m = m.lock_owned().await;
        tokio::spawn(abort_locked(m))
            .await
            .map_err(|e| Status::internal(format!("abort task: {e}")))?
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
        if let Some(t) = &m.lazy_target {
            t.stop_daemon();
        }
        images::zeroize(&m.dir).map_err(|e| Status::internal(e.to_string()))?;
        parts::forget_all(&m.parts).await;
        let _ = m.broker(Request::Forget { uid: m.uid.clone() }).await;
        m.phase = Phase::CleanedUp;
        m.image_bytes = 0;
        let st = m.status();
        drop(m);
        self.migrations.lock().expect("migrations").remove(uid);
        self.aborts.lock().expect("aborts").remove(uid);
        self.frozen
            .lock()
            .expect("frozen")
            .retain(|f| f.uid.as_str() != uid);
        Ok(st)
    }
}

type Res<T> = Result<Response<T>, Status>;

/// A control call's result, its failure logged once (one line at warn: the call, the
/// migration's UID, the gRPC code and the message, which names the system call and
/// the path where one failed): what the operator reports is also in the node's log.
fn logged<T>(rpc: Rpc, uid: &str, r: Result<T, Status>) -> Result<T, Status> {
    if let Err(e) = &r {
        tracing::warn!(%rpc, uid, code = ?e.code(), error = e.message(), "call failed");
    }
    r
}

#[tonic::async_trait]
impl MigrationAgent for Agent {
    async fn prepare(&self, r: GrpcRequest<PrepareRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Prepare)?;
        let r = r.into_inner();
        let uid = r.migration_uid.clone();
        logged(Rpc::Prepare, &uid, self.prepare_impl(r).await).map(Response::new)
    }
    async fn pre_dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::PreDump)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::PreDump, &uid, self.pre_dump_impl(&uid).await).map(Response::new)
    }
    async fn dump(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Dump)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::Dump, &uid, self.dump_impl(&uid).await).map(Response::new)
    }
    async fn send(&self, r: GrpcRequest<SendRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Send)?;
        let r = r.into_inner();
        let uid = r.migration_uid.clone();
        logged(Rpc::Send, &uid, self.send_impl(r).await).map(Response::new)
    }
    async fn receive_images(&self, r: GrpcRequest<Streaming<ImageChunk>>) -> Res<ReceiveSummary> {
        let caller = self.caller(&r);
        self.receive_impl(caller, r.into_inner())
            .await
            .map(Response::new)
    }
    type LazyPagesStream = post_copy::FrameStream;
    async fn lazy_pages(&self, r: GrpcRequest<Streaming<LazyFrame>>) -> Res<Self::LazyPagesStream> {
        let caller = self.caller(&r);
        self.lazy_pages_impl(caller, r.into_inner())
            .await
            .map(Response::new)
    }
    async fn fence(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Fence)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::Fence, &uid, self.fence_impl(&uid).await).map(Response::new)
    }
    async fn restore(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Restore)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::Restore, &uid, self.restore_impl(&uid).await).map(Response::new)
    }
    async fn commit(&self, r: GrpcRequest<CommitRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Commit)?;
        let r = r.into_inner();
        let uid = r.migration_uid.clone();
        logged(Rpc::Commit, &uid, self.commit_impl(r).await).map(Response::new)
    }
    async fn abort(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Abort)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::Abort, &uid, self.abort_impl(&uid).await).map(Response::new)
    }
    async fn cleanup(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Cleanup)?;
        let uid = r.into_inner().migration_uid;
        logged(Rpc::Cleanup, &uid, self.cleanup_impl(&uid).await).map(Response::new)
    }
    async fn status(&self, r: GrpcRequest<MigrationRef>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Status)?;
        let uid = r.into_inner().migration_uid;
        let m = self.get(&uid)?;
        // A transfer under way holds the migration for minutes when paced: its status
        // is the one it started with, answered at once (a report that waited held the
        // operator's reconcile, a deletion's rollback included, until the end).
        if let Ok(g) = m.try_lock() {
            return Ok(Response::new(g.status()));
        }
        let kept = self
            .transferring
            .lock()
            .expect("transferring")
            .get(&uid)
            .cloned();
        match kept {
            Some(st) => Ok(Response::new(st)),
            None => Ok(Response::new(m.lock().await.status())),
        }
    }
}

#[allow(dead_code)]
fn _assert_stream<S: Stream>(_: S) {}

#[cfg(test)]
mod abort_tests;
#[cfg(test)]
mod prepare_tests;
#[cfg(test)]
mod restore_tests;
#[cfg(test)]
mod testkit;
#[cfg(test)]
mod transfer_tests;
#[cfg(test)]
mod watchdog_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_failure_carries_the_code_of_what_happened_and_names_the_call_and_path() {
        let status = |errno: i32| {
            io_status(
                "readlink",
                "/proc/7/ns/net",
                &std::io::Error::from_raw_os_error(errno),
            )
        };
        // The error of issue 39: EACCES was NotFound, with no call and no path.
        let denied = status(nix::libc::EACCES);
        assert_eq!(denied.code(), tonic::Code::PermissionDenied);
        assert!(
            denied
                .message()
                .starts_with("readlink /proc/7/ns/net: Permission denied (os error 13) (")
                && denied.message().contains("CAP_SYS_PTRACE"),
            "{}",
            denied.message()
        );
        assert_eq!(
            status(nix::libc::EPERM).code(),
            tonic::Code::PermissionDenied
        );
        let gone = status(nix::libc::ENOENT);
        assert_eq!(gone.code(), tonic::Code::NotFound);
        assert_eq!(
            gone.message(),
            "readlink /proc/7/ns/net: No such file or directory (os error 2)"
        );
        let other = status(nix::libc::EIO);
        assert_eq!(other.code(), tonic::Code::Internal);
        assert!(other.message().starts_with("readlink /proc/7/ns/net: "));
    }

    #[test]
    fn the_agents_own_read_of_a_namespace_reports_the_path() {
        let e = netns_ino(i32::MAX, creds::Owner { uid: 0, gid: 0 }).unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(
            e.message()
                .starts_with("readlink /proc/2147483647/ns/net: "),
            "{}",
            e.message()
        );
    }

    #[test]
    fn a_new_prepare_needs_a_role_a_key_and_another_node_as_peer() {
        let ok = PrepareRequest {
            migration_uid: "u".into(),
            role: Role::Target as i32,
            transfer_key: vec![1; transfer::KEY_LEN],
            peer_node: "node-b".into(),
            ..Default::default()
        };
        assert_eq!(check_prepare(&ok, Some("node-a")).unwrap(), Role::Target);
        assert_eq!(check_prepare(&ok, None).unwrap(), Role::Target);
        let refused = |r: PrepareRequest, own: Option<&str>| {
            let e = check_prepare(&r, own).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            e.message().to_string()
        };
        let no_role = PrepareRequest {
            role: Role::Unspecified as i32,
            ..ok.clone()
        };
        assert_eq!(refused(no_role, None), "role must be Source or Target");
        let short_key = PrepareRequest {
            transfer_key: vec![1; 16],
            ..ok.clone()
        };
        assert_eq!(refused(short_key, None), "transfer key must be 32 bytes");
        let bad_peer = PrepareRequest {
            peer_node: "Node_B".into(),
            ..ok.clone()
        };
        assert!(refused(bad_peer, None).contains("is not a node name"));
        assert!(refused(ok, Some("node-b")).contains("this agent's own node"));
    }
}
