//! Whether a migration on the forward path must roll back, and why: the restore fence
//! decides which failures still count.

use std::time::Duration;

use podmotion_api::migration::{MigrationMode, MigrationPhase};

use super::state::{Machine, rank};
use crate::migration::agent::{AgentView, Side, Step};
use crate::migration::stage::Reason;

impl<'a> Machine<'a> {
    /// Failures that stop a migration before commit, in order of precedence: the
    /// first is returned (`start_rollback` records it).
    ///
    /// Past the restore fence (the target reports its restore) only the restored
    /// copy's own failures count: the migration rolls forward to the probe and the
    /// commit, and the source is never thawed behind a live copy.
    pub(super) fn detect_failure(&self) -> Option<(Reason, String)> {
        if self.target_restored() {
            self.restored_copy_failure()
        } else if self.source_killed_under_fence() {
            self.killed_source_failure()
        } else {
            self.stop_requested()
                .or_else(|| self.pod_failure())
                .or_else(|| self.lazy_failure())
                .or_else(|| self.agent_failure())
                .or_else(|| self.time_failure())
        }
    }

    /// The restore fence: the target agent reports that it restored the copy (its
    /// restore is done, its resume instant is known, or the probe, which only runs on
    /// a restored copy, was asked for). From here the restored copy is the workload
    /// (it runs, and its connections went on from the checkpoint): a stop, a
    /// deadline, a progress timeout, the source pod or the source agent going away,
    /// or a lost operator lease in between, roll forward to the commit (the kill of
    /// the source), never back to a thaw. Only the restored copy failing itself
    /// rolls back, and then only after it is confirmed dead (see `rollback`).
    fn target_restored(&self) -> bool {
        rank(self.status.phase) >= rank(MigrationPhase::Restoring)
            && self.o.target_agent.report().is_some_and(|r| {
                r.progress.resumed_at.is_some()
                    || r.done(Step::Restore)
                    || r.last_step() == Some(Step::Probe)
            })
    }

    /// The source's node killed the fenced source before the target restored, or is
    /// killing it: its agent's watchdog did (this operator was away longer than the
    /// freeze budget plus the agent's margin), or its agent lost the migration after
    /// acknowledging the fence (phase `Restoring`: the agent restarted, and its broker
    /// kills a fenced source when the agent's lease ends or at its own restart).
    /// Nothing can be thawed any more, and the target holds every image: roll forward
    /// to the restore, the probe and the commit; only the target failing (or no
    /// progress within the timeout) ends it, with the state lost.
    fn source_killed_under_fence(&self) -> bool {
        let phase = rank(self.status.phase);
        self.o.source_agent.report().is_some_and(|r| {
            (phase >= rank(MigrationPhase::Transferring) && r.progress.killed_under_fence)
                || (phase >= rank(MigrationPhase::Restoring) && r.last.is_none())
        })
    }

    /// Before the target restored, after the fenced source was killed on its node.
    fn killed_source_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        self.restored_copy_failure()
            .or_else(|| match &o.target_agent {
                AgentView::Reported(r) if r.last.is_none() => Some((
                    Reason::AgentError,
                    "target agent lost the migration (restarted?)".to_string(),
                )),
                _ => None,
            })
            .or_else(|| {
                self.progress_stalled().then(|| {
                    (
                        Reason::ProgressTimeout,
                        format!(
                            "no progress for {}s in {:?} after the fenced source was killed",
                            o.knobs.progress_timeout.as_secs(),
                            self.phase()
                        ),
                    )
                })
            })
    }

    /// Past the restore fence: the target pod cannot run, the target agent failed or
    /// forgot, or no probe verdict came within the progress timeout.
    fn restored_copy_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        if let Some(why) = o.target_pod.as_ref().and_then(|tp| tp.unusable.as_ref()) {
            return Some((
                Reason::TargetPodUnschedulable,
                format!("target pod cannot run: {why}"),
            ));
        }
        if o.target_pod.is_none() {
            return Some((
                Reason::TargetPodUnschedulable,
                "the target pod disappeared".to_string(),
            ));
        }
        if let Some(f) = self.lazy_failure() {
            return Some(f);
        }
        let r = o.target_agent.report()?;
        if let Some((step, category, message)) = r.failure() {
            let reason = if step == Step::Probe {
                Reason::ProbeFailed
            } else {
                Reason::AgentError
            };
            let message = format!("target agent: {step} failed ({category}): {message}");
            return Some((reason, message));
        }
        // The waits past the fence are the probe's verdict (asking for the probe
        // counts as progress, so a replica that takes over after a long absence
        // probes before it judges) and, in PostCopy, the last page (every page
        // fetched counts as progress).
        if r.running(Step::Probe) && self.progress_stalled() {
            return Some((
                Reason::ProgressTimeout,
                format!(
                    "the restored copy was not proven healthy within {}s",
                    o.knobs.progress_timeout.as_secs()
                ),
            ));
        }
        (self.awaiting_pages() && self.progress_stalled()).then(|| {
            (
                Reason::ProgressTimeout,
                format!(
                    "PostCopy: the restored copy fetched no page from the source for {}s ({} bytes in so far)",
                    o.knobs.progress_timeout.as_secs(),
                    r.progress.lazy_bytes
                ),
            )
        })
    }

    /// PostCopy: the lazy phase failed on either agent (the session between them
    /// broke, the target's daemon failed, the restored copy died). The target agent
    /// killed its copy before anything read a missing page; the rollback confirms
    /// that kill, then thaws the source, whose memory is whole, unless the source
    /// itself was lost, and with it the pod's state.
    fn lazy_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        if o.knobs.mode != MigrationMode::PostCopy {
            return None;
        }
        [(Side::Target, &o.target_agent), (Side::Source, &o.source_agent)]
            .into_iter()
            .find_map(|(side, view)| {
                let why = view.report()?.progress.lazy_error.as_ref()?;
                Some((
                    Reason::PostCopyFailed,
                    format!(
                        "PostCopy: the lazy phase failed before every page was in ({side} agent: {why}); the restored copy is not kept"
                    ),
                ))
            })
    }

    /// PostCopy: the restored copy passed its probe and still fetches pages from the
    /// frozen source, which must live (and not be committed) until the last page.
    pub(super) fn awaiting_pages(&self) -> bool {
        self.o.knobs.mode == MigrationMode::PostCopy
            && self
                .o
                .target_agent
                .report()
                .is_some_and(|r| r.done(Step::Probe) && !r.progress.lazy_done)
    }

    /// The user's stop: deletion, or the deadline.
    fn stop_requested(&self) -> Option<(Reason, String)> {
        let o = self.o;
        if o.deletion_requested {
            return Some((Reason::Aborted, "the PodMigration was deleted".into()));
        }
        self.deadline_passed().then(|| {
            (
                Reason::DeadlineExceeded,
                format!("not committed within {}s", o.knobs.deadline.as_secs()),
            )
        })
    }

    /// The source pod went away, or the target pod cannot run.
    fn pod_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        let gone = |m: &str| Some((Reason::SourcePodGone, m.to_string()));
        match &o.source_pod {
            None => return gone("the source pod no longer exists"),
            Some(s) if s.terminating || Some(&s.uid) != self.status.source_pod_uid.as_ref() => {
                return gone("the source pod is being deleted or was replaced");
            }
            Some(s) if !s.running => return gone("the source pod stopped running"),
            Some(_) => {}
        }
        if let Some(why) = o.target_pod.as_ref().and_then(|tp| tp.unusable.as_ref()) {
            return Some((
                Reason::TargetPodUnschedulable,
                format!("target pod cannot run: {why}"),
            ));
        }
        (self.phase() != MigrationPhase::Preparing && o.target_pod.is_none()).then(|| {
            (
                Reason::TargetPodUnschedulable,
                "the target pod disappeared".to_string(),
            )
        })
    }

    /// A failed step, or an agent that forgot the migration.
    fn agent_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        for (side, view) in [
            (Side::Source, &o.source_agent),
            (Side::Target, &o.target_agent),
        ] {
            // Agents that are unreachable or whose pod is not Ready (restarting) are
            // given until the progress timeout.
            let AgentView::Reported(r) = view else {
                continue;
            };
            if let Some((step, category, message)) = r.failure() {
                // A fence the source agent did not acknowledge is asked again until the
                // progress timeout (nothing was restored: the rollback thaws the source);
                // a migration the agent forgot is not retried.
                if step == Step::Fence && category != "MigrationUnknown" {
                    continue;
                }
                let reason = if step == Step::Probe {
                    Reason::ProbeFailed
                } else {
                    Reason::AgentError
                };
                let message = format!("{side} agent: {step} failed ({category}): {message}");
                return Some((reason, message));
            }
            // Past Preparing both agents must know the migration; an agent that forgot
            // it restarted and swept its checkpoint.
            if self.phase() != MigrationPhase::Preparing && r.last.is_none() {
                let message = format!("{side} agent lost the migration (restarted?)");
                return Some((Reason::AgentError, message));
            }
        }
        None
    }

    /// The freeze budget overrun, or no progress for too long.
    fn time_failure(&self) -> Option<(Reason, String)> {
        let o = self.o;
        if self.freeze_overrun() {
            return Some((
                Reason::FreezeBudgetExceeded,
                format!(
                    "the source has been frozen longer than freezeBudgetMillis={} without a restore",
                    o.knobs.freeze_budget_millis
                ),
            ));
        }
        if !self.progress_stalled() {
            return None;
        }
        let detail = match (&o.source_agent, &o.target_agent) {
            (AgentView::Unreachable(e), _) => format!("; source agent unreachable: {e}"),
            (_, AgentView::Unreachable(e)) => format!("; target agent unreachable: {e}"),
            _ => String::new(),
        };
        Some((
            Reason::ProgressTimeout,
            format!(
                "no progress for {}s in {:?}{detail}",
                o.knobs.progress_timeout.as_secs(),
                self.phase()
            ),
        ))
    }

    /// The source is frozen (final dump started) and the target has not resumed, for
    /// longer than the freeze budget: the budget would be exceeded silently otherwise.
    fn freeze_overrun(&self) -> bool {
        let Some(frozen) = self
            .o
            .source_agent
            .report()
            .and_then(|r| r.progress.frozen_at)
        else {
            return false;
        };
        let restored = self
            .o
            .target_agent
            .report()
            .is_some_and(|r| r.progress.resumed_at.is_some() || r.done(Step::Restore));
        !restored
            && self.elapsed_since(frozen) > Duration::from_millis(self.o.knobs.freeze_budget_millis)
    }
}
