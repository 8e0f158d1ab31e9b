//! A source's freeze, once the final dump left it stopped: who owns it (an atomic,
//! claimed by the first of Commit, Abort, the freeze watchdog and shutdown), and the
//! thaw and the kill that end it, on every container of the pod.

use super::helpers::{blocking, broker_call};
use super::{parts, post_copy};
use podmotion_broker::client::BrokerClient;
use podmotion_broker::procfs;
use podmotion_wire::broker::Request;
use podmotion_wire::ids::{MigrationUid, ProcRef};
use std::sync::{Arc, Mutex as StdMutex};
use tonic::Status;

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
pub(super) struct Freeze {
    pub(super) state: std::sync::atomic::AtomicU8,
    pub(super) given_up: std::sync::atomic::AtomicBool,
    /// PostCopy: the lazy dump that holds this frozen source while it serves pages.
    /// Every thaw ends its session first ([`end_lazy_session`]), and the freeze
    /// watchdog kills nothing it still serves from.
    pub(super) lazy: StdMutex<Option<Arc<post_copy::Source>>>,
    /// The pod's other containers ([`parts`]): every thaw, fence and kill of the
    /// source acts on them too.
    pub(super) others: StdMutex<Vec<parts::Lease>>,
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

pub(super) const NOT_FROZEN: u8 = 0;
pub(super) const FROZEN: u8 = 1;
pub(super) const COMMITTING: u8 = 2;
pub(super) const THAWING: u8 = 3;
pub(super) const THAWED: u8 = 4;
/// `Fence` is telling the broker (the watchdog waits for the outcome).
pub(super) const FENCING: u8 = 5;
pub(super) const FENCED: u8 = 6;
pub(super) const KILLING: u8 = 7;
/// A fenced source killed by the watchdog or at shutdown (never by a commit).
pub(super) const KILLED: u8 = 8;

impl Freeze {
    pub(super) fn get(&self) -> u8 {
        self.state.load(std::sync::atomic::Ordering::SeqCst)
    }
    pub(super) fn set(&self, v: u8) {
        self.state.store(v, std::sync::atomic::Ordering::SeqCst)
    }
    /// The watchdog gave up on this freeze (see [`Freeze`]).
    pub(super) fn give_up(&self) {
        self.given_up
            .store(true, std::sync::atomic::Ordering::SeqCst)
    }
    /// Held by this agent: frozen (or being fenced, or fenced) and not given up.
    pub(super) fn held(&self) -> bool {
        matches!(self.get(), FROZEN | FENCING | FENCED)
            && !self.given_up.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// The leases of the pod's other containers.
    pub(super) fn others(&self) -> Vec<parts::Lease> {
        self.others.lock().expect("others").clone()
    }
    /// PostCopy: the lazy dump holding this source still serves pages.
    pub(super) fn serving_pages(&self) -> bool {
        self.lazy
            .lock()
            .expect("lazy")
            .as_ref()
            .is_some_and(|s| s.serving())
    }
    /// Moves FROZEN to `to`; false if the freeze was already claimed (or never made).
    pub(super) fn claim(&self, to: u8) -> bool {
        self.claim_from(FROZEN, to)
    }
    /// Moves `from` to `to`; false if the freeze is not in `from`.
    pub(super) fn claim_from(&self, from: u8, to: u8) -> bool {
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

/// Resumes a source the final dump left frozen, if nothing else claimed it: `Ok(true)`
/// when this call resumed it. On failure the freeze is left to the next claimant.
pub(super) async fn thaw_frozen(
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
pub(super) async fn end_lazy_session(freeze: &Freeze) -> Result<(), Status> {
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
pub(super) async fn kill_fenced(
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
pub(super) async fn kill_source(
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
pub(super) async fn kill_one(
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
pub(super) async fn thaw_source(
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

#[derive(Clone)]
pub(super) struct FrozenSource {
    pub(super) freeze: Arc<Freeze>,
    pub(super) broker: Arc<StdMutex<BrokerClient>>,
    pub(super) uid: MigrationUid,
    /// The frozen tree's root (a fenced source is killed, not resumed).
    pub(super) process: ProcRef,
    /// For the metrics: when the final dump froze it, and its freeze budget.
    pub(super) since: std::time::Instant,
    pub(super) budget: std::time::Duration,
}
