//! `Fence`, `Commit` and `Abort` once they hold the migration: the restore fence on
//! the source, the source's end when the move is committed, and the rollback of either
//! side (the source resumed, the target's copy killed).

use super::freeze::{COMMITTING, FENCED, FENCING, FROZEN, KILLING, THAWED, kill_source};
use super::helpers::{broker_call, now_us};
use super::parts;
use super::state::Migration;
use crate::admission::{Admission, Step, admit};
use crate::images;
use podmotion_wire::agent::{CommitRequest, MigrationStatus, Phase, Role, TcpPreservation};
use podmotion_wire::broker::Request;
use tonic::Status;

/// `Fence` once it holds the migration (see [`Agent::fence_impl`]).
pub(super) async fn fence_locked(
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
pub(super) async fn abort_locked(
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

/// `Commit` once it holds the migration: the source, frozen (or fenced), is killed
/// and its images go; a source the watchdog resumed or killed meanwhile answers so.
pub(super) async fn commit_locked(
    m: &mut Migration,
    r: &CommitRequest,
) -> Result<MigrationStatus, Status> {
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
        reopen_before_kill(m).await?;
    }
    kill_source(&m.freeze, &m.broker, &m.uid, m.process).await?;
    let _ = images::zeroize(&m.dir);
    m.image_bytes = 0;
    m.phase = Phase::Committed;
    Ok(m.status())
}

/// Takes the source's trees out of TCP repair and unlocks their network, so that
/// killing them sends FIN. A tree already dead (its kubelet's SIGKILL at the end of a
/// grace period shorter than the commit's wait) has nothing to release or unlock: the
/// broker refuses it, and the kill counts it as killed.
async fn reopen_before_kill(m: &Migration) -> Result<(), Status> {
    release_and_unlock(&m.broker, &m.uid, m.process).await?;
    for o in m.freeze.others() {
        release_and_unlock(&o.broker, &o.uid, o.process).await?;
    }
    if podmotion_broker::procfs::check_live(m.process).is_err() {
        tracing::warn!(uid = %m.uid, "the source was dead before its commit's kill (its kubelet killed it at the end of its grace period): its peers got no FIN");
    }
    Ok(())
}

/// Takes one registered tree out of TCP repair and unlocks its network; a refusal
/// for a tree that is gone is no failure.
async fn release_and_unlock(
    b: &std::sync::Arc<std::sync::Mutex<podmotion_broker::client::BrokerClient>>,
    uid: &podmotion_wire::ids::MigrationUid,
    process: podmotion_wire::ids::ProcRef,
) -> Result<(), Status> {
    let r = async {
        broker_call(b, Request::ReleaseTcpRepair { uid: uid.clone() }).await?;
        broker_call(b, Request::UnlockNetwork { uid: uid.clone() }).await?;
        Ok(())
    }
    .await;
    match r {
        Err(_) if podmotion_broker::procfs::check_live(process).is_err() => Ok(()),
        r => r,
    }
}
