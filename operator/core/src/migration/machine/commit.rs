//! `Committing`: the source given up after the target passed its probe, in the order
//! that an operator restart can resume anywhere; past the probe a migration only
//! rolls forward.

use std::time::Duration;

use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::reasons;

use super::report::{ACTION, KILL_UNCONFIRMED, SOURCE_GONE_FIRST, SOURCE_STATE_UNKNOWN};
use super::state::Machine;
use crate::migration::agent::{AgentView, Side, Step, StepState};
use crate::migration::observed::{Action, Observed, SourcePodFacts};
use crate::migration::stage::Reason;
use crate::note::Note;

/// Where the kill of the frozen source stands at commit.
enum SourceKill {
    /// Its agent killed it (or its node did, under the fence).
    Confirmed,
    /// Its agent is killing it.
    Running,
    /// Its agent can kill it and has not been asked (it is, once the pod terminates).
    NotAsked,
    /// Its agent cannot confirm a kill (why): the pod's deletion kills it.
    ByPodDeletion(String),
}

impl<'a> Machine<'a> {
    /// Past the probe, a migration only rolls forward: deletion waits for it.
    ///
    /// The source is given up in this order, each step decided from what is observed,
    /// so an operator restart anywhere resumes it:
    /// 1. its `pod-deletion-cost` is lowered, the target pod is handed over to the
    ///    workload's controller and its adoption awaited (bounded: at the progress
    ///    timeout the migration ends `Failed`, see `owner_never_adopted`);
    /// 2. the source pod is deleted with the commit's grace period
    ///    (`Machine::commit_grace_seconds`). Its ReplicaSet, which has two active pods
    ///    once it adopted the target, may have deleted it already (chosen by the lowered
    ///    deletion cost): a terminating source pod counts as deleted;
    /// 3. only once the source pod is seen terminating (read back from the API server, at
    ///    the earliest in the pass after the deletion: the deletion has gone out to its
    ///    watchers, the source's kubelet among them) is its agent asked to kill the
    ///    frozen tree (`Commit`,
    ///    which releases TCP repair and unlocks the network first, so the peers of
    ///    closed connections get a FIN). The kubelet never restarts a container of a
    ///    terminating pod, so the kill leaves no fresh workload beside the restored
    ///    copy; its SIGTERM stays pending on the stopped tree (nothing continues it
    ///    after the restore fence) and its SIGKILL waits for the grace period, which the
    ///    agent's kill wins. A source pod already gone by then (the kubelet's SIGKILL
    ///    at the end of the grace period, a forced deletion) does not hold the kill
    ///    back: the agent is asked all the same (a tree already dead counts as killed
    ///    for it), and the status notes that its peers may have got no FIN;
    /// 4. `Succeeded` once the kill is confirmed and the source pod is terminating or
    ///    gone.
    ///
    /// A kill the source agent does not confirm (missing, unreachable, restarted, the
    /// kill failed, no answer within the progress timeout from the source pod's
    /// deletion)
    /// is never counted as done: the source pod is deleted with grace period 0 (again,
    /// if it was terminating with a grace period), the deletion is the kill, and the
    /// outcome says that the agent did not confirm it.
    pub(super) fn committing(&mut self) {
        self.poll();
        // `Committing` is only ever entered (and persisted) once the target's probe
        // passed, so the phase itself is the proof: an agent that cannot remember the
        // probe after an operator restart must not hold the commit back.
        if self.forwarding_first() {
            return;
        }
        let source = self.source_of_record();
        if let Some(s) = source
            && !s.terminating
            && !s.deletion_cost_lowered
        {
            self.act(Action::LowerSourceDeletionCost);
        }
        if self.target_adopted() && self.source_given_up(source) {
            self.enter(MigrationPhase::Succeeded);
            self.resume();
        }
    }

    /// Step 0 (`Knobs::forward_new_connections`): the source's node forwards the frozen
    /// source's new connections to the target before the target pod is handed over:
    /// from then on a connection the Services still send to the source (kube-proxy
    /// programs the hand-over's two endpoint changes up to its `minSyncPeriod` apart)
    /// reaches the target instead of a dropped SYN. Asked as soon as the target
    /// restored ([`Machine::forward_new_connections`]); asked here again if it was not
    /// (an operator restart forgot it). Whether the commit waits for it: while it is
    /// asked and not answered. Its failure (a node that does not forward, an agent
    /// without `Forward`) never holds the commit back.
    fn forwarding_first(&mut self) -> bool {
        self.forward_new_connections() == Some(StepState::Running)
    }

    /// Asks the source agent to `Forward` (a no-op while it runs; never once the
    /// source's kill was asked, nor where the installer turned it off), in the pass
    /// that sees the target's restore: past the restore fence the restored copy is the
    /// workload (its restored connections already run on it, and the source is never
    /// thawed behind it), so the SYNs the source's lock holds go to it at once rather
    /// than after the probe's and the commit's passes (≈ 1 s under load, which
    /// outlasted a client's 3 s connect timeout: issue 39). A copy that then fails its
    /// probe is killed before the rollback thaws the source, which ends the forward
    /// first: a client forwarded in between sees a reset, as its restored connections
    /// do. How the forward stands, or `None` where it is not asked.
    pub(super) fn forward_new_connections(&mut self) -> Option<StepState> {
        let r = self.o.source_agent.report()?;
        let killing = r.done(Step::Commit)
            || r.running(Step::Commit)
            || r.progress.killed_under_fence
            || !r.progress.fenced;
        if !self.o.knobs.forward_new_connections || killing {
            return None;
        }
        match &r.progress.forward {
            None => {
                self.act(Action::Agent(Side::Source, Step::Forward));
                Some(StepState::Running)
            }
            Some(s) => Some(s.clone()),
        }
    }

    /// Step 1: the target pod handed over and adopted. Whether it is (the commit goes
    /// on); if not, what waits for it was asked for, or the migration ended.
    fn target_adopted(&mut self) -> bool {
        let o = self.o;
        match &o.target_pod {
            None => {
                self.restored_pod_lost("the target pod disappeared during commit");
                false
            }
            Some(tp) if tp.terminating => {
                self.restored_pod_lost("the target pod was deleted during commit");
                false
            }
            // The adoption's wait counts from the hand-over (asked again each pass
            // until it is seen), not from entering `Committing`: the passes before it
            // may have waited out an API server away or a leader's failover.
            Some(tp) if !tp.handed_over => {
                self.act(Action::HandOverTargetPod);
                self.bump_progress_time();
                false
            }
            Some(tp) if tp.awaiting_adoption => {
                if self.progress_stalled() {
                    self.owner_never_adopted();
                }
                false
            }
            Some(_) => true,
        }
    }

    /// Steps 2 and 3: the source pod deleted, then the source killed. Whether both are
    /// done (the migration succeeded); if not, the next of them was asked for.
    fn source_given_up(&mut self, source: Option<&'a SourcePodFacts>) -> bool {
        match (source, self.source_kill()) {
            (_, SourceKill::ByPodDeletion(why)) => {
                self.note_kill_unconfirmed(&why);
                if source.is_some_and(|s| s.deletion_grace_seconds != Some(0)) {
                    self.act(Action::DeleteSourcePod { grace_seconds: 0 });
                    return false;
                }
                true
            }
            // The agent's kill is to come: the pod goes first.
            (Some(s), SourceKill::NotAsked | SourceKill::Running) if !s.terminating => {
                let grace_seconds = self.commit_grace_seconds();
                self.act(Action::DeleteSourcePod { grace_seconds });
                false
            }
            (_, SourceKill::NotAsked) => {
                if let Some(wait) = source.and_then(|s| self.kill_settling(s)) {
                    self.requeue_within(wait);
                    return false;
                }
                if source.is_none() {
                    self.note_source_gone_before_the_kill();
                }
                self.act(Action::Agent(Side::Source, Step::Commit));
                false
            }
            (_, SourceKill::Running) => false,
            // Killed before its pod was deleted (its node's freeze watchdog, or a commit
            // in the order before this one): its container may be restarting from its
            // image, and the deletion ends that at once.
            (Some(s), SourceKill::Confirmed) if !s.terminating => {
                self.act(Action::DeleteSourcePod { grace_seconds: 0 });
                false
            }
            (_, SourceKill::Confirmed) => true,
        }
    }

    /// The source pod the migration pinned, if it exists (a namesake is not it).
    fn source_of_record(&self) -> Option<&'a SourcePodFacts> {
        let o: &'a Observed = self.o;
        o.source_pod.as_ref().filter(|s| {
            o.status
                .source_pod_uid
                .as_ref()
                .is_none_or(|uid| *uid == s.uid)
        })
    }

    /// How much longer the source's kill waits for its kubelet to have seen the pod's
    /// deletion and the Services to have let it go (`Knobs::kill_settle`), if at all.
    fn kill_settling(&self, s: &SourcePodFacts) -> Option<Duration> {
        let accepted = s.deletion_accepted?;
        self.o
            .knobs
            .kill_settle()
            .checked_sub(self.elapsed_since(accepted))
            .filter(|w| !w.is_zero())
    }

    /// The grace period of the source pod's deletion when its agent's kill follows it:
    /// the progress timeout, which bounds the wait for that kill from the same
    /// deletion (`kill_stalled`). The kubelet's own SIGKILL at its end (the source's
    /// network still locked: no FIN) thus comes no earlier than the machine stops
    /// waiting for the agent's kill and makes the deletion the kill itself (grace
    /// period 0). Normally the
    /// agent's kill follows within a poll and one call, and the pod goes with it.
    fn commit_grace_seconds(&self) -> i64 {
        i64::try_from(self.o.knobs.progress_timeout.as_secs()).unwrap_or(i64::MAX)
    }

    /// Where the kill of the frozen source stands, from its agent's report.
    fn source_kill(&self) -> SourceKill {
        let bound = self.o.knobs.progress_timeout.as_secs();
        let r = match &self.o.source_agent {
            AgentView::Reported(r) => r,
            AgentView::Missing => return SourceKill::ByPodDeletion("no source agent".into()),
            AgentView::Unreachable(e) => {
                return SourceKill::ByPodDeletion(format!("the source agent is unreachable: {e}"));
            }
        };
        // A fenced source its node killed (its agent's watchdog) is confirmed dead too.
        if r.done(Step::Commit)
            || r.last_step() == Some(Step::Cleanup)
            || r.progress.killed_under_fence
        {
            return SourceKill::Confirmed;
        }
        if r.last.is_none() {
            return SourceKill::ByPodDeletion(
                "the source agent no longer knows the migration (restarted?)".into(),
            );
        }
        if let Some((step, category, m)) = r.failure() {
            return SourceKill::ByPodDeletion(format!(
                "the source agent's {step} failed ({category}): {m}"
            ));
        }
        // Decided once: the pod's deletion with grace period 0 that followed moved
        // `deletion_accepted`, which must not restart the wait.
        if self.noted(KILL_UNCONFIRMED) {
            return SourceKill::ByPodDeletion("decided earlier".into());
        }
        if !r.running(Step::Commit) {
            return SourceKill::NotAsked;
        }
        if self.kill_stalled() {
            return SourceKill::ByPodDeletion(format!(
                "the source agent did not confirm the kill within {bound}s"
            ));
        }
        SourceKill::Running
    }

    /// Whether the kill asked of the source agent has had its time: the progress
    /// timeout from the source pod's deletion (the kill follows it), or from the last
    /// progress if that came later or the pod has no deletion. Time spent before the
    /// deletion (the hand-over waiting for the pod's owner to adopt the target) is
    /// never counted against the kill: a slow adoption once made the machine give up
    /// on a kill it had not yet asked for.
    fn kill_stalled(&self) -> bool {
        let deleted = self.source_of_record().and_then(|s| s.deletion_accepted);
        let from = self.last_progress().max(deleted.unwrap_or(self.o.created));
        self.elapsed_since(from) > self.o.knobs.progress_timeout
    }

    /// The kill goes through the source pod's deletion; say so once (status and
    /// Event), never counting it as the agent's kill.
    fn note_kill_unconfirmed(&mut self, why: &str) {
        if self.noted(KILL_UNCONFIRMED) {
            return;
        }
        let message = format!(
            "{KILL_UNCONFIRMED} ({why}): the source pod is deleted with grace period 0 once the target is adopted, and that deletion is the kill; if its node is unreachable, {SOURCE_STATE_UNKNOWN} until the node's kubelet removes it"
        );
        self.notes
            .push(Note::warning(reasons::COMMITTING, ACTION, message.clone()));
        self.push_message(&message);
    }

    /// The source pod was gone before its agent was asked for the kill: say so once in
    /// the status (the agent is asked all the same; a tree already dead counts as
    /// killed for it, so its answer cannot tell whether the FIN went out).
    fn note_source_gone_before_the_kill(&mut self) {
        if self.noted(SOURCE_GONE_FIRST) {
            return;
        }
        self.push_message(&format!(
            "{SOURCE_GONE_FIRST} (its kubelet killed it at the end of the grace period, or the pod was deleted by force): the peers of its closed connections may have got no FIN"
        ));
    }

    /// The restored pod disappeared or is being deleted during the commit (before the
    /// source was given up): the migrated state goes with it, and the stale source is
    /// never thawed behind it (the restore fence). Its agent kills it as at any commit,
    /// but its pod is kept: its container restarts from its image, the workload's
    /// replica again, without the state. A kill the agent does not confirm is the
    /// source pod's deletion with grace period 0. Then the migration ends `Failed`.
    fn restored_pod_lost(&mut self, what: &str) {
        let source = self.source_of_record();
        let outcome = match self.source_kill() {
            SourceKill::NotAsked => {
                self.act(Action::Agent(Side::Source, Step::Commit));
                return;
            }
            SourceKill::Running => return,
            SourceKill::Confirmed => match source {
                Some(s) if !s.terminating => "the source was killed by its agent; its pod is kept (its container restarts from its image, without the state)".to_string(),
                _ => "the source was killed by its agent".to_string(),
            },
            SourceKill::ByPodDeletion(why) => {
                if source.is_some_and(|s| s.deletion_grace_seconds != Some(0)) {
                    self.act(Action::DeleteSourcePod { grace_seconds: 0 });
                    return;
                }
                format!(
                    "{KILL_UNCONFIRMED} ({why}): the source pod was deleted with grace period 0, which kills it"
                )
            }
        };
        self.status.failure_reason = Some(Reason::TargetPodUnschedulable.as_str().into());
        self.status.failure_message = Some(format!(
            "{what}: the migrated state is lost with it; {outcome}"
        ));
        self.enter(MigrationPhase::Failed);
        self.resume();
    }

    /// The target pod was handed over, but no controller adopted it within the bound
    /// (the ReplicaSet was deleted or no longer selects it): end with the reason. The
    /// source was already given up, so the source pod goes too, with grace period 0
    /// (the deletion is the kill: the agent's kill waits for a terminating pod, and the
    /// migration ends here); the handed-over target pod keeps running the workload,
    /// unowned.
    fn owner_never_adopted(&mut self) {
        if self
            .source_of_record()
            .is_some_and(|s| s.deletion_grace_seconds != Some(0))
        {
            self.act(Action::DeleteSourcePod { grace_seconds: 0 });
        }
        let noted = self
            .status
            .failure_message
            .clone()
            .map(|m| format!("; {m}"))
            .unwrap_or_default();
        self.status.failure_reason = Some(Reason::ProgressTimeout.as_str().into());
        self.status.failure_message = Some(format!(
            "the target pod {} was handed over but the pod's owner did not adopt it within {}s (was it deleted?): it runs the workload unowned; the source pod was deleted with grace period 0, which kills the frozen source (its peers get no FIN){noted}",
            self.o.status_pod_name(),
            self.o.knobs.progress_timeout.as_secs()
        ));
        self.enter(MigrationPhase::Failed);
        self.resume();
    }
}
