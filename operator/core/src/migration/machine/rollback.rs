//! Rolling back: the one handler that undoes a failure before commit, in the order
//! that keeps exactly one running copy (the restored copy killed and confirmed dead
//! before the source is thawed).

use podmotion_api::conditions::Health;
use podmotion_api::migration::MigrationPhase;

use super::report::{ACTION, KILLED_UNDER_FENCE, SOURCE_STATE_UNKNOWN};
use super::state::{Machine, rank};
use crate::migration::agent::{AgentView, Side, Step};
use crate::migration::observed::Action;
use crate::migration::stage::Reason;
use crate::note::Note;

impl<'a> Machine<'a> {
    /// A failure before commit: records it (once) and rolls back in this round. Every
    /// rollback starts here (a failure `detect_failure` found, the pre-copy's budget);
    /// a persisted one resumes in `rollback`.
    pub(super) fn start_rollback(&mut self, reason: Reason, message: String) {
        self.fail(reason, message);
        self.rollback(reason);
    }

    /// Records a failure (once): from now the status says the migration rolls back
    /// (`Stage::RollingBack`).
    fn fail(&mut self, reason: Reason, message: String) {
        if self.status.failure_reason.is_some() {
            return;
        }
        self.status.failure_reason = Some(reason.as_str().to_string());
        self.status.failure_message = Some(message.clone());
        self.notes.push(Note::warning(
            reason.as_str(),
            ACTION,
            format!("{message}; rolling back"),
        ));
        self.bump_progress_time();
    }

    /// Undo everything before commit, in the order that keeps one running copy.
    ///
    /// Bounded: a rollback that cannot confirm a step within `progressTimeoutSeconds`
    /// of the failure ends anyway, saying what it could not confirm (see
    /// `unconfirmed_target_copy` and `source_resumed`), so a deletion never waits on
    /// an agent forever.
    pub(super) fn rollback(&mut self, reason: Reason) {
        let o = self.o;
        self.poll();
        let message = self.status.failure_message.clone().unwrap_or_default();
        self.health = Some(Health::reconciling(
            reason.as_str(),
            format!("rolling back: {message}"),
        ));
        // 1. No restored copy may run on the target when the source is thawed.
        if !self.target_copy_gone() {
            if !matches!(o.target_agent, AgentView::Reported(_)) {
                self.act(Action::DeleteTargetPod);
            }
            if self.progress_stalled() {
                self.unconfirmed_target_copy(reason);
            }
            return;
        }
        // 2. Thaw the source (a no-op for an agent that never froze it).
        let source_resumed = self.source_resumed();
        if o.target_pod.is_some() {
            self.act(Action::DeleteTargetPod);
        }
        if !source_resumed {
            return;
        }
        if !matches!(o.source_agent, AgentView::Reported(_)) {
            self.note_source_state_unknown("source agent unreachable during rollback");
        }
        self.enter(reason.end_phase());
        self.resume();
    }

    /// The rollback's bound passed and a restored copy may still run on the target (its
    /// agent did not confirm the kill and its pod is still there): the source is never
    /// thawed behind it. Its agent is asked to kill it instead (the container then
    /// restarts from its image under the kubelet, not from the stale checkpoint), and
    /// the migration ends saying the source's state is unknown.
    fn unconfirmed_target_copy(&mut self, reason: Reason) {
        let o = self.o;
        let detail = match &o.target_agent {
            AgentView::Missing => "no target agent".to_string(),
            AgentView::Unreachable(e) => format!("target agent unreachable: {e}"),
            AgentView::Reported(r) => match r.failure() {
                Some((step, category, m)) => {
                    format!("target agent: {step} failed ({category}): {m}")
                }
                None => "the target agent did not confirm the kill".to_string(),
            },
        };
        if matches!(o.source_agent, AgentView::Reported(_)) {
            self.act(Action::Agent(Side::Source, Step::Commit));
        }
        self.act(Action::DeleteTargetPod);
        let m = self.status.failure_message.get_or_insert_with(String::new);
        m.push_str(&format!(
            "; the restored copy on the target could not be confirmed stopped within {}s ({detail}), so the source was not thawed (restore fence): its agent was asked to kill it",
            o.knobs.progress_timeout.as_secs()
        ));
        self.note_source_state_unknown("");
        self.enter(reason.end_phase());
        self.resume();
    }

    /// Records once, in the failure message, that the fenced source was killed on its
    /// node and what that leaves.
    fn note_killed_under_fence(&mut self) {
        let pod = self.o.status_source_pod();
        let m = self.status.failure_message.get_or_insert_with(String::new);
        if m.contains(KILLED_UNDER_FENCE) {
            return;
        }
        m.push_str(&format!(
            "; {KILLED_UNDER_FENCE} (its agent's freeze watchdog: nobody committed or aborted it within its budget and margin): its state is lost; the source pod {pod} is left with its network isolated: delete it (its controller recreates it)"
        ));
    }

    /// Records once, in the failure message, that nothing confirmed the source's state,
    /// and what may be left: the Event then never says "resumed".
    fn note_source_state_unknown(&mut self, why: &str) {
        let pod = self.o.status_source_pod();
        let node = self
            .status
            .source_node
            .clone()
            .unwrap_or_else(|| "?".into());
        let m = self.status.failure_message.get_or_insert_with(String::new);
        if m.contains(SOURCE_STATE_UNKNOWN) {
            return;
        }
        if !why.is_empty() {
            m.push_str("; ");
            m.push_str(why);
        }
        m.push_str(&format!(
            ", {SOURCE_STATE_UNKNOWN}: the source pod {pod} on {node} may still be frozen; delete it if it does not serve (its controller recreates it)"
        ));
    }

    /// Whether no restored copy can run on the target (asking for its kill if one may).
    fn target_copy_gone(&mut self) -> bool {
        let o = self.o;
        let restored = rank(self.status.phase) >= rank(MigrationPhase::Restoring);
        let r = match &o.target_agent {
            AgentView::Reported(r) => r,
            // Unknown target agent: only the target pod's removal (the kubelet kills
            // its containers and so the restored tree) proves no copy runs there.
            AgentView::Missing | AgentView::Unreachable(_) => {
                return !restored || o.target_pod.is_none();
            }
        };
        match r.last_step() {
            Some(Step::Restore | Step::Probe) => {
                self.act(Action::Agent(Side::Target, Step::Abort));
                false
            }
            Some(Step::Abort) if r.failure().is_some() => {
                // The kill failed: retry it, and remove the pod (the kubelet kills its
                // containers, the restored tree with them).
                self.act(Action::Agent(Side::Target, Step::Abort));
                self.act(Action::DeleteTargetPod);
                !restored || o.target_pod.is_none()
            }
            Some(Step::Abort) => r.done(Step::Abort),
            None if restored => {
                // The agent forgot the migration (it restarted) after a restore may have
                // run: its silence proves nothing. Only the target pod's removal (the
                // kubelet kills its containers) does.
                self.act(Action::DeleteTargetPod);
                o.target_pod.is_none()
            }
            // Receive (or nothing): no process was restored yet. Stop the receiver.
            // Once `Restore` may have been issued (Restoring), a report of `Receive`
            // proves nothing either: the agent reports it until a restore in flight
            // (asked by this process before a restart, or by the replica that held the
            // lease before) completes. Only the agent's answer to the kill does.
            last => {
                if last.is_some() {
                    self.act(Action::Agent(Side::Target, Step::Abort));
                }
                !restored || last.is_none()
            }
        }
    }

    /// Whether the source runs again, or the rollback must end without knowing (asking
    /// for its thaw if not). Bounded by the progress timeout: an agent that stays
    /// unreachable, or whose thaw keeps failing or never finishes, ends the rollback
    /// with "source state unknown".
    fn source_resumed(&mut self) -> bool {
        // The fenced source was killed on its node (its agent's watchdog): nothing can
        // thaw it, and it is never reported as resumed.
        if self
            .o
            .source_agent
            .report()
            .is_some_and(|r| r.progress.killed_under_fence)
        {
            self.note_killed_under_fence();
            return true;
        }
        // The source agent does not know the migration (it restarted and lost it), so
        // it cannot confirm a thaw: the rollback ends, saying the state is unknown
        // (the node's broker and the agent's freeze watchdog resume a lost freeze).
        let may_be_frozen = rank(self.status.phase) >= rank(MigrationPhase::Checkpointing);
        let unknown = match &self.o.source_agent {
            AgentView::Reported(r) => {
                (r.last.is_none() && may_be_frozen)
                    || r.failure().is_some_and(|(s, category, _)| {
                        s == Step::Abort && category == "MigrationUnknown"
                    })
            }
            _ => false,
        };
        if unknown {
            self.note_source_state_unknown("the source agent no longer knows the migration");
            return true;
        }
        let bound = self.o.knobs.progress_timeout.as_secs();
        match &self.o.source_agent {
            AgentView::Reported(r) => match r.last_step() {
                None => true,
                Some(Step::Abort) if r.done(Step::Abort) => true,
                _ if self.progress_stalled() => {
                    let why = match r.failure() {
                        Some((step, category, m)) => format!(
                            "the source agent's {step} kept failing for {bound}s ({category}: {m})"
                        ),
                        None => {
                            format!("the source agent did not confirm the thaw within {bound}s")
                        }
                    };
                    self.note_source_state_unknown(&why);
                    true
                }
                Some(Step::Abort) if r.running(Step::Abort) => false,
                Some(_) => {
                    self.act(Action::Agent(Side::Source, Step::Abort));
                    false
                }
            },
            // The agent is gone or unreachable: keep trying until the progress timeout,
            // then finish with a message that says the source's state is unknown.
            AgentView::Missing | AgentView::Unreachable(_) => self.progress_stalled(),
        }
    }
}
