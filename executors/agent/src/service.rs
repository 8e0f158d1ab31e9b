//! The `MigrationAgent` service. Each migration is a small state machine keyed by its
//! UID; a step that already happened returns the current status instead of running
//! again, a step out of order is `FailedPrecondition`. Every call is first authorized
//! from the caller's certificate ([`crate::authz`]): control calls are the operator's,
//! the image stream is the peer agent's the operator named at `Prepare`.
//!
//! The layers below it, each naming only what is below itself (no module cycle,
//! `hack/check-modules.sh`): `helpers` (statuses, blocking calls, the broker's calls),
//! `pace` and `manifest`, `parts` and `post_copy` (the pod's other containers, the lazy
//! session), `freeze` (a frozen source's owner, its thaw and kill), `state` (the
//! configuration and one migration), then the steps that act on a migration
//! (`prepare`, `dump` with `room`, `send`, `receive`, `restore`, `fence`,
//! `post_copy::target`). This file holds the gRPC service that calls them.

use crate::admission::{Admission, Step, admit};
use crate::authz::{self, Prepared, Rpc};
use crate::creds;
use crate::criu::{self, Opts};
use crate::images;
use crate::mounts;
use podmotion_broker::procfs;
use podmotion_wire::agent::*;
use podmotion_wire::broker::Request;
use podmotion_wire::identity::{self, IdentityError, Peer};
use podmotion_wire::ids::MigrationUid;
use podmotion_wire::proto::migration_agent_server::MigrationAgent;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Instant;
use tokio::sync::Mutex;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};

mod dump;
mod fence;
mod forward;
mod freeze;
mod helpers;
pub mod leader_term;
mod manifest;
mod pace;
mod parts;
mod post_copy;
mod prepare;
mod receive;
mod restore;
mod room;
mod send;
mod state;
mod warm;

pub use state::{Config, FreezeWatchdog};

use dump::{DumpOutcome, dump_locked};
use fence::{abort_locked, commit_locked, fence_locked};
use freeze::{FrozenSource, kill_fenced, thaw_frozen};
use helpers::{NETNS_KEY, Transferring, Transfers, cut_by_abort, io_status, netns_ino};
use prepare::Preparing;
use receive::receive_locked;
use restore::restore_locked;
use state::{Migration, source_owner};
use warm::{PreDumpRound, pre_dump_locked};

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
        let m = prepare::prepare(&self.cfg, self.own_node(), uid, r).await?;
        let st = m.status();
        self.migrations
            .lock()
            .expect("migrations")
            .insert(m.uid.to_string(), Arc::new(Mutex::new(m)));
        Ok(st)
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
        post_copy::target::accept_session(&self.cfg.criu, &mut m, mm, first, s)
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
        commit_locked(&mut m, &r).await
    }

    async fn forward_impl(&self, r: ForwardRequest) -> Result<MigrationStatus, Status> {
        let m = self.get(&r.migration_uid)?;
        let mut m = m.lock().await;
        forward::forward_locked(&mut m, &r).await
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
    async fn forward(&self, r: GrpcRequest<ForwardRequest>) -> Res<MigrationStatus> {
        self.authorize_control(&r, Rpc::Forward)?;
        let r = r.into_inner();
        let uid = r.migration_uid.clone();
        logged(Rpc::Forward, &uid, self.forward_impl(r).await).map(Response::new)
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

#[cfg(test)]
mod abort_tests;
#[cfg(test)]
mod forward_tests;
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
