//! The agent's configuration and one migration's state, below the step modules
//! (`dump`, `send`, `receive`, `restore`, ...) that act on it: what `Prepare` records,
//! what every status reports, and the undoing both sides share (the source's resume,
//! the target's kill of its restored copy).

use super::freeze::{COMMITTING, FENCED, FROZEN, Freeze, KILLED, KILLING, THAWED, THAWING};
use super::freeze::{end_lazy_session, thaw_frozen, thaw_source};
use super::helpers::{blocking, broker_call};
use super::{parts, post_copy};
use crate::containers::{ContainerFs, Containers};
use crate::creds;
use crate::criu::Criu;
use crate::images;
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::broker::{BrokerRole, Reply, Request};
use podmotion_wire::client::TlsFiles;
use podmotion_wire::ids::{ContainerId, MigrationUid, ProcRef};
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use tonic::Status;

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
    pub(super) fn limit(&self, budget_ms: u64) -> std::time::Duration {
        let budget = if budget_ms == 0 {
            self.default_budget
        } else {
            std::time::Duration::from_millis(budget_ms)
        };
        budget + self.margin
    }
}

pub(super) struct Migration {
    pub(super) uid: MigrationUid,
    pub(super) role: Role,
    /// The other agent's node, as the operator named it at `Prepare`.
    pub(super) peer: String,
    pub(super) phase: Phase,
    pub(super) process: ProcRef,
    /// The container the operator named, `process` its PID (the broker checks it).
    pub(super) container: ContainerId,
    /// Source: the container's PID 1 when it is PodMotion's holder (a pod moved
    /// before); `process` is then the restored workload it holds.
    pub(super) held_by: Option<ProcRef>,
    pub(super) key: Vec<u8>,
    pub(super) tcp: TcpPreservation,
    pub(super) dir: PathBuf,
    pub(super) iteration: u32,
    pub(super) last_round_bytes: u64,
    pub(super) image_bytes: u64,
    pub(super) final_dump_bytes: u64,
    pub(super) last_round_sent_bytes: u64,
    pub(super) pre_copy_sent_bytes: u64,
    pub(super) bytes_sent: u64,
    pub(super) bytes_received: u64,
    pub(super) timings: Timings,
    pub(super) sockets: Vec<SocketReport>,
    pub(super) restored: Option<ProcRef>,
    /// Target: the source pod's addresses the broker took over for this restore (the
    /// installer's address hand-over), given back if the restore is undone.
    pub(super) adopted: Vec<std::net::IpAddr>,
    /// Relative paths already streamed to the target (Send is incremental).
    pub(super) sent: std::collections::BTreeSet<String>,
    pub(super) broker: Arc<StdMutex<BrokerClient>>,
    pub(super) netns_path: Option<String>,
    /// A real container (source: the dumped one; target: the holder): its mounts.
    pub(super) fs: Option<ContainerFs>,
    pub(super) freeze: Arc<Freeze>,
    /// The watchdog's bound on this source's freeze.
    pub(super) freeze_limit: std::time::Duration,
    /// The restore fence was taken (`Fence`), and no `Abort` lifted it since.
    pub(super) fenced: bool,
    /// PostCopy (`post_copy` at `Prepare`).
    pub(super) post_copy: bool,
    /// Source: the Service ports its lock holds new connections to (`Prepare`'s
    /// `hold_services`), beside the pod's own addresses.
    pub(super) hold_services: Vec<podmotion_wire::agent::ForwardedPort>,
    /// PostCopy, source: the lazy dump serving the tree's pages.
    pub(super) lazy_source: Option<Arc<post_copy::Source>>,
    /// PostCopy, target: the session with the source and its daemon's socket.
    pub(super) lazy_target: Option<Arc<post_copy::Target>>,
    /// The pod's containers after the first ([`parts`]); empty for a one-container
    /// pod.
    pub(super) parts: Vec<parts::Part>,
    /// Source: every freeze of the tree so far (pre-copy rounds, then the final
    /// dump), see [`super::warm`].
    pub(super) freezes: Vec<FreezeRecord>,
}

impl Migration {
    pub(super) fn status(&self) -> MigrationStatus {
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
            freezes: self.freezes.clone(),
        }
    }

    /// PostCopy: this side's view of the lazy phase, once it began.
    pub(super) fn lazy_state(&self) -> Option<&post_copy::LazyState> {
        match (&self.lazy_source, &self.lazy_target) {
            (Some(s), _) => Some(&s.state),
            (_, Some(t)) => Some(&t.state),
            _ => None,
        }
    }

    pub(super) async fn broker(&self, req: Request) -> Result<Reply, Status> {
        broker_call(&self.broker, req).await
    }

    /// Takes over a phase change that a watchdog or shutdown thaw made while a call
    /// held the migration.
    pub(super) fn sync_freeze(&mut self) {
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
pub(super) struct Placement {
    pub(super) process: ProcRef,
    /// The container `process` was resolved from (its bare ID).
    pub(super) container: ContainerId,
    /// The holder whose workload `process` is (see [`Migration::held_by`]).
    pub(super) held_by: Option<ProcRef>,
    /// A real container's mounts.
    pub(super) fs: Option<ContainerFs>,
    /// Its checkpoint dir, just created.
    pub(super) dir: PathBuf,
}

impl Migration {
    /// A migration as `Prepare` records it, before the broker knows it.
    pub(super) fn prepared(
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
            // Checked by `check_prepare`.
            hold_services: r.hold_services,
            lazy_source: None,
            lazy_target: None,
            parts: Vec::new(),
            freezes: Vec::new(),
        }
    }

    /// Registers the migration with the node's broker, naming the container the process
    /// was resolved from (the broker refuses a process outside that container's
    /// cgroup); a target also has the broker bind the pod's network namespace. On
    /// failure `Prepare` undoes it all (see [`Agent::prepare_impl`]).
    pub(super) async fn register(&mut self) -> Result<(), Status> {
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
    pub(super) async fn resume_source(&mut self) -> Result<(), Status> {
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
    pub(super) async fn unfence_and_thaw(&mut self) -> Result<(), Status> {
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
    pub(super) async fn release_adopted(&mut self) {
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

    pub(super) async fn kill_restored_copy(&mut self) -> Result<(), Status> {
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
    pub(super) async fn kill_restored_parts(&mut self) -> Result<(), Status> {
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

/// Who the source's CRIU runs as: its tree's owner (the same at `Prepare`, which
/// refused a tree of several users).
pub(super) fn source_owner(m: &Migration) -> Result<creds::Owner, Status> {
    creds::tree_owner(m.process.pid).map_err(Status::failed_precondition)
}

/// Kills a restored process tree and waits (bounded) until none of it runs: the tree
/// of `root` (the restored root as pinned after the restore; all of its PID namespace
/// with it if it is that namespace's init), and in a holder's PID namespace everything
/// below the holder (CRIU ran there, so whatever it forked and left ends up there,
/// pinned or not). The holder itself stays. Every process is pinned (pid and start
/// time) before it is signalled, so a reused pid is never killed.
pub(super) fn kill_restored(root: Option<ProcRef>, holder: Option<ProcRef>) -> Result<(), String> {
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
