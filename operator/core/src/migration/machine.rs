//! The PodMigration phase machine: `next(&Observed) -> Transition`.
//!
//! Everything the controller learned this round (the persisted status, the pods, both
//! agents' reports, the clock, whether deletion was requested) goes in; the next status
//! and the idempotent actions to take come out. There is no I/O and no memory between
//! calls, so an operator restart is just another call with the same facts: the
//! machine resumes where the persisted status and the agents' reports say it is.
//!
//! The machine dispatches on the migration's [`Stage`] (`Forward`, `RollingBack`,
//! `Terminal`), read from the persisted status: rolling back is not a phase of the API
//! (a pre-commit phase with a `failureReason` is a migration rolling back), but it is
//! a stage here, with its own handler. A handler that moves the migration to another
//! stage hands over to that stage's handler in the same round (`Machine::resume`).
//! The rollback order is what keeps the invariants: the restored copy on the target is killed (and confirmed killed)
//! before the source is thawed, so there are never two running copies; the source is
//! thawed on every failure before commit (past the restore fence, only after the
//! restored copy's own failure), so there is never zero; and `Commit` (kill
//! the frozen source) is only issued after the target passed the application probe.
//! Once the target reports its restore (the restore fence) only the restored copy's
//! own failure rolls back; everything else rolls forward to the commit. The target is
//! asked to restore only after the source agent acknowledged the fence (`Fence`): from
//! then on the source's node kills the frozen source rather than resume it (its agent's
//! watchdog and shutdown, its broker), so an operator that disappears can never leave
//! it thawed beside a restored copy; only the rollback's `Abort` lifts the fence. Every
//! wait is bounded by the progress timeout and ends in a terminal phase that says what
//! it could not confirm.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::conditions::{Health, set_condition, set_health};
use podmotion_api::migration::{
    MigrationMode, MigrationPhase, MigrationProgress, PhaseTransition, PodMigrationStatus,
};
use podmotion_api::names::{condition_types as ct, reasons};

use super::agent::{AgentReport, AgentView, Side, Step};
pub use super::observed::{
    API_TIME_UNIT, Action, DEFAULT_SERVICE_SYNC, KUBELET_SETTLE, Knobs, Observed, Plan, Preflight,
    SERVICE_SYNC_MARGIN, SourcePodFacts, TargetPodFacts, Transition,
};
pub use super::stage::{Active, Forward, Reason, Stage};
pub use crate::note::{EventKind, Note};

/// The Events' action: every note of the machine is about migrating.
const ACTION: &str = "Migrate";
/// The action of the Event that ends a failed or aborted migration.
const END_ACTION: &str = "EndMigration";

/// Poll interval while agents are working.
pub const POLL: Duration = Duration::from_millis(500);
/// Re-check interval while the source is frozen (from the final dump until the
/// hand-over): every step of that window waits for the next poll, and that wait is
/// downtime. Few migrations are ever frozen at once (the concurrency limits), so the
/// extra reconciles are bounded.
pub const FROZEN_POLL: Duration = Duration::from_millis(50);
/// Re-check interval while waiting for a slot or for the cluster to become migratable.
pub const IDLE_RECHECK: Duration = Duration::from_secs(10);

/// The pre-copy decision after a completed round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreCopyDecision {
    /// The remaining dirty memory fits the freeze budget: freeze and dump.
    FinalDump,
    /// Another round may shrink the dirty set.
    AnotherRound(u32),
    /// It will not fit: the round limit is reached, or the dirty set is already below
    /// the threshold and the link is simply too slow.
    BudgetExceeded { estimate_millis: Option<u64> },
}

/// Estimated freeze for `dirty` bytes at `rate` bytes/s, rounded up, plus the final
/// dump's own cost `dump_millis` where known; `None` if unknown.
pub fn freeze_estimate_millis(
    dirty: Option<u64>,
    rate: Option<u64>,
    dump_millis: Option<u64>,
) -> Option<u64> {
    let transfer = match (dirty, rate) {
        (Some(0), _) => Some(0),
        (Some(d), Some(r)) if r > 0 => Some((d.saturating_mul(1000)).div_ceil(r)),
        _ => None,
    }?;
    Some(transfer.saturating_add(dump_millis.unwrap_or(0)))
}

/// The freeze-budget rule. Keep pre-copying until the remaining dirty bytes fit
/// `freezeBudgetMillis` at the measured rate; at the round limit (or once the dirty
/// set is below `dirtyThresholdBytes`, where more rounds cannot help) proceed only if
/// within budget, else abort.
pub fn pre_copy_decision(round: u32, report: &AgentReport, knobs: &Knobs) -> PreCopyDecision {
    let dirty = report.progress.dirty_bytes;
    let estimate = freeze_estimate_millis(
        dirty,
        report.progress.rate_bytes_per_second,
        report.progress.dump_millis,
    );
    let fits = estimate.is_some_and(|e| e <= knobs.freeze_budget_millis);
    let small = dirty.is_some_and(|d| d <= knobs.dirty_threshold_bytes);
    if fits {
        PreCopyDecision::FinalDump
    } else if round >= knobs.max_rounds || small {
        PreCopyDecision::BudgetExceeded {
            estimate_millis: estimate,
        }
    } else {
        PreCopyDecision::AnotherRound(round + 1)
    }
}

/// Whether a failure reason ends in `Aborted` (the user's decision or limit) rather
/// than `Failed` (something broke).
pub fn is_abort_reason(reason: &str) -> bool {
    Reason::parse(reason).is_some_and(Reason::is_abort)
}

/// The next step of a migration. Pure; see the module documentation.
pub fn next(o: &Observed) -> Transition {
    let mut t = Machine::new(o);
    t.run();
    t.finish()
}

struct Machine<'a> {
    o: &'a Observed,
    status: PodMigrationStatus,
    actions: Vec<Action>,
    notes: Vec<Note>,
    requeue_after: Option<Duration>,
    health: Option<Health>,
}

impl<'a> Machine<'a> {
    fn new(o: &'a Observed) -> Self {
        Machine {
            o,
            status: o.status.clone(),
            actions: vec![],
            notes: vec![],
            requeue_after: None,
            health: None,
        }
    }

    fn phase(&self) -> MigrationPhase {
        self.status.phase
    }

    fn finish(mut self) -> Transition {
        let now = self.o.now;
        if self.requeue_after == Some(POLL) && self.source_frozen() {
            self.requeue_after = Some(FROZEN_POLL);
        }
        self.status.observed_generation = self.o.generation;
        let health = self
            .health
            .take()
            .unwrap_or_else(|| default_health(&self.status));
        set_health(&mut self.status.conditions, &health, self.o.generation, now);
        Transition {
            status: self.status,
            actions: self.actions,
            notes: self.notes,
            requeue_after: self.requeue_after,
        }
    }

    /// Whether the source is (being) frozen: the final dump was asked for and the
    /// migration has not ended.
    fn source_frozen(&self) -> bool {
        let dumping = self
            .o
            .source_agent
            .report()
            .and_then(AgentReport::last_step)
            .is_some_and(|s| s != Step::Prepare && !matches!(s, Step::PreDump(_)));
        match self.status.phase {
            MigrationPhase::Transferring
            | MigrationPhase::Restoring
            | MigrationPhase::Committing => true,
            MigrationPhase::Checkpointing => {
                dumping
                    || self
                        .actions
                        .contains(&Action::Agent(Side::Source, Step::Dump))
            }
            _ => false,
        }
    }

    fn act(&mut self, a: Action) {
        if !self.actions.contains(&a) {
            self.actions.push(a);
        }
    }

    fn poll(&mut self) {
        self.requeue_after = Some(POLL);
    }

    /// Reconcile again no later than `wait` from now.
    fn requeue_within(&mut self, wait: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(wait, |r| r.min(wait)));
    }

    fn enter(&mut self, phase: MigrationPhase) {
        if self.status.phase == phase {
            return;
        }
        self.status.phase = phase;
        if phase.is_terminal() {
            // A terminal phase's health follows from it (see `default_health`).
            self.health = None;
        }
        self.status
            .phase_transition_timestamps
            .push(PhaseTransition {
                phase,
                time: Time(self.o.now),
            });
        let note = self.entry_note(phase);
        self.notes.push(note);
        self.bump_progress_time();
    }

    /// The Event of entering `phase` (a table: one line per phase).
    fn entry_note(&self, phase: MigrationPhase) -> Note {
        let (kind, reason, message) = match phase {
            MigrationPhase::Pending => (EventKind::Normal, reasons::PENDING, "pending".to_string()),
            MigrationPhase::Preparing => (
                EventKind::Normal,
                reasons::MIGRATABLE,
                // The Event is on the PodMigration, whose spec names the pod; the target
                // pod has no name yet when this phase is entered.
                format!(
                    "migrating the pod from node {} to node {}",
                    self.status.source_node.as_deref().unwrap_or("(unknown)"),
                    self.status.target_node.as_deref().unwrap_or("(unknown)")
                ),
            ),
            MigrationPhase::Checkpointing => (
                EventKind::Normal,
                reasons::CHECKPOINTING,
                "target ready; checkpointing the source".to_string(),
            ),
            MigrationPhase::Transferring => (
                EventKind::Normal,
                reasons::TRANSFERRING,
                "final dump taken; transferring the checkpoint".to_string(),
            ),
            MigrationPhase::Restoring => (
                EventKind::Normal,
                reasons::RESTORING,
                format!(
                    "checkpoint transferred and the source fenced ({FENCED}); restoring on the target"
                ),
            ),
            MigrationPhase::Committing => (
                EventKind::Normal,
                reasons::COMMITTING,
                "target passed the application probe; giving up the source".to_string(),
            ),
            MigrationPhase::Succeeded => self.succeeded_entry(),
            MigrationPhase::Failed | MigrationPhase::Aborted => (
                EventKind::Warning,
                self.status
                    .failure_reason
                    .as_deref()
                    .map_or(Reason::RolledBack, Reason::from_status)
                    .as_str(),
                self.stopped_message(),
            ),
        };
        // The end of a rollback is its own Event: with the failure's action it would
        // carry the same reason, type and action as the failure's Event ("rolling
        // back"), and the recorder folds such a repeat into that Event's series,
        // dropping this message (what was resumed, or what may be left).
        let action = match phase {
            MigrationPhase::Failed | MigrationPhase::Aborted => END_ACTION,
            _ => ACTION,
        };
        Note {
            kind,
            reason: reason.into(),
            action,
            message,
        }
    }

    /// Kind, reason and message of entering `Succeeded`: a dry run's pass, or where the
    /// pod runs now, with what the commit noted — a Warning when the source's kill was
    /// not confirmed.
    fn succeeded_entry(&self) -> (EventKind, &'static str, String) {
        if self.o.knobs.dry_run {
            return (
                EventKind::Normal,
                reasons::DRY_RUN_PASSED,
                "dry run: every check passed; nothing was frozen".to_string(),
            );
        }
        let noted = self
            .status
            .failure_message
            .as_deref()
            .filter(|m| !m.is_empty());
        (
            if noted.is_some_and(|m| m.contains(KILL_UNCONFIRMED)) {
                EventKind::Warning
            } else {
                EventKind::Normal
            },
            reasons::SUCCEEDED,
            format!(
                "pod runs on {} (downtime {}){}",
                self.status.target_node.as_deref().unwrap_or("?"),
                self.status.downtime.as_deref().unwrap_or("unknown"),
                noted.map(|m| format!("; {m}")).unwrap_or_default()
            ),
        )
    }

    /// The message of entering `Failed` or `Aborted`: the failure and what became of
    /// the source.
    fn stopped_message(&self) -> String {
        let m = self.status.failure_message.as_deref().unwrap_or("stopped");
        // Never "resumed" unless an agent that knew the migration said so.
        if m.contains(KILLED_UNDER_FENCE) {
            format!("{m}; the source was not resumed")
        } else if m.contains(SOURCE_STATE_UNKNOWN) {
            format!("{m}; whether the source pod runs again could not be confirmed")
        } else if self.committed() {
            format!("{m}; the source was given up at commit, not resumed")
        } else {
            format!("{m}; the source pod was resumed")
        }
    }

    /// Whether the migration reached `Committing` (the source was given up).
    fn committed(&self) -> bool {
        self.status
            .phase_transition_timestamps
            .iter()
            .any(|t| t.phase == MigrationPhase::Committing)
    }

    fn bump_progress_time(&mut self) {
        let p = self.status.progress.get_or_insert_with(Default::default);
        p.last_progress_time = Some(Time(self.o.now));
    }

    /// Records a failure (once) and switches to rollback.
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

    fn last_progress(&self) -> Timestamp {
        let from_progress = self
            .status
            .progress
            .as_ref()
            .and_then(|p| p.last_progress_time.as_ref())
            .map(|t| t.0);
        let from_phase = self
            .status
            .phase_transition_timestamps
            .last()
            .map(|p| p.time.0);
        [from_progress, from_phase, Some(self.o.created)]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(self.o.created)
    }

    fn elapsed_since(&self, t: Timestamp) -> Duration {
        let d = self.o.now.duration_since(t);
        Duration::try_from(d).unwrap_or(Duration::ZERO)
    }

    fn deadline_passed(&self) -> bool {
        self.elapsed_since(self.o.created) > self.o.knobs.deadline
    }

    fn progress_stalled(&self) -> bool {
        self.elapsed_since(self.last_progress()) > self.o.knobs.progress_timeout
    }

    fn run(&mut self) {
        self.merge_agent_progress();
        self.resume();
    }

    /// Runs the handler of the stage the status is in now.
    fn resume(&mut self) {
        match Stage::of(&self.status) {
            Stage::Forward(Forward::Pending) => self.pending(),
            Stage::Forward(Forward::Active(active)) => match self.detect_failure() {
                Some(reason) => self.rollback(reason),
                None => self.forward(active),
            },
            Stage::Forward(Forward::Committing) => self.committing(),
            Stage::RollingBack(reason) => self.rollback(reason),
            Stage::Terminal => self.terminal(),
        }
    }

    // ----------------------------------------------------------------- progress

    /// Progress never runs backwards: counters take the maximum of what was recorded
    /// and what the source agent reports now. Growth counts as progress.
    fn merge_agent_progress(&mut self) {
        let Some(r) = self.o.source_agent.report() else {
            return;
        };
        let before = self.status.progress.clone().unwrap_or_default();
        let mut p: MigrationProgress = before.clone();
        p.iteration = p
            .iteration
            .max(i32::try_from(r.progress.iteration).unwrap_or(i32::MAX));
        p.bytes_sent = p
            .bytes_sent
            .max(i64::try_from(r.progress.bytes_sent).unwrap_or(i64::MAX));
        if let Some(d) = r.progress.dirty_bytes {
            p.bytes_remaining_estimate = Some(i64::try_from(d).unwrap_or(i64::MAX));
        }
        if let Some(rate) = r.progress.rate_bytes_per_second {
            p.transfer_rate_bytes_per_second = Some(i64::try_from(rate).unwrap_or(i64::MAX));
        }
        // PostCopy: the pages the restored copy fetched after its resume, recorded at
        // most once a second (each record is a status write; the progress timeout
        // counts in seconds), and the total once every page is in.
        let recorded_within_a_second = before
            .last_progress_time
            .as_ref()
            .is_some_and(|t| self.elapsed_since(t.0) < Duration::from_secs(1));
        if let Some(t) = self.o.target_agent.report()
            && t.progress.lazy_bytes > 0
            && (!recorded_within_a_second || t.progress.lazy_done)
        {
            let lazy = i64::try_from(t.progress.lazy_bytes).unwrap_or(i64::MAX);
            p.lazy_bytes = Some(p.lazy_bytes.unwrap_or(0).max(lazy));
        }
        let grew = p.iteration > before.iteration
            || p.bytes_sent > before.bytes_sent
            || p.lazy_bytes > before.lazy_bytes;
        if grew {
            p.last_progress_time = Some(Time(self.o.now));
        }
        if p != before || self.status.progress.is_some() || grew {
            self.status.progress = Some(p);
        }
    }

    fn record_restore(&mut self, target: &AgentReport) {
        if self.status.downtime_millis.is_none() {
            let frozen = self
                .o
                .source_agent
                .report()
                .and_then(|r| r.progress.frozen_at);
            if let (Some(f), Some(r)) = (frozen, target.progress.resumed_at) {
                let ms = r.duration_since(f).as_millis().max(0) as i64;
                self.status.downtime_millis = Some(ms);
                self.status.downtime = Some(format!("{ms}ms"));
            }
        }
        if target.progress.network.is_some() {
            self.status.network = target.progress.network.clone();
        }
    }

    // ------------------------------------------------------------------ phases

    fn pending(&mut self) {
        let o = self.o;
        let stop = if o.deletion_requested {
            Some((Reason::Aborted, "deleted before it started"))
        } else if self.deadline_passed() {
            Some((
                Reason::DeadlineExceeded,
                "deadline passed before the migration could start",
            ))
        } else {
            None
        };
        if let Some((reason, message)) = stop {
            self.status.failure_reason = Some(reason.as_str().into());
            self.status.failure_message = Some(message.into());
            self.enter(MigrationPhase::Aborted);
            self.resume();
            return;
        }
        match &o.preflight {
            // The controller always evaluates pre-flight in Pending; without it there
            // is nothing safe to do but look again.
            None => self.requeue_after = Some(IDLE_RECHECK),
            Some(Preflight::NotMigratable { reason, message }) => {
                self.not_migratable(reason, message)
            }
            Some(Preflight::Migratable(plan)) => self.migratable(plan),
        }
    }

    fn not_migratable(&mut self, reason: &'static str, message: &str) {
        let o = self.o;
        set_condition(
            &mut self.status.conditions,
            ct::MIGRATABLE,
            false,
            reason,
            message,
            o.generation,
            o.now,
        );
        if o.knobs.dry_run {
            self.status.failure_reason = Some(reason.to_string());
            self.status.failure_message = Some(format!("dry run: {message}"));
            self.enter(MigrationPhase::Failed);
        } else {
            self.health = Some(Health::stalled(reason, message.to_string()));
            self.requeue_after = Some(IDLE_RECHECK);
        }
    }

    fn migratable(&mut self, plan: &Plan) {
        let o = self.o;
        set_condition(
            &mut self.status.conditions,
            ct::MIGRATABLE,
            true,
            reasons::MIGRATABLE,
            &format!("can move from {} to {}", plan.source_node, plan.target_node),
            o.generation,
            o.now,
        );
        self.status.source_node = Some(plan.source_node.clone());
        self.status.target_node = Some(plan.target_node.clone());
        if o.knobs.dry_run {
            self.enter(MigrationPhase::Succeeded);
            return;
        }
        if !o.slot_available {
            self.health = Some(Health::reconciling(
                reasons::QUEUED,
                "waiting for a free migration slot (per cluster or per source node)",
            ));
            self.requeue_after = Some(IDLE_RECHECK);
            return;
        }
        self.status.source_pod_uid = Some(plan.source_pod_uid.clone());
        self.status.target_pod = Some(plan.target_pod.clone());
        self.status.mode = Some(o.knobs.mode);
        self.enter(MigrationPhase::Preparing);
        self.act(Action::EnsureTransferKey);
        self.act(Action::EnsureTargetPod);
        self.poll();
    }

    /// Failures that stop a migration before commit, in order of precedence: the
    /// first is recorded and its reason returned.
    ///
    /// Past the restore fence (the target reports its restore) only the restored
    /// copy's own failures count: the migration rolls forward to the probe and the
    /// commit, and the source is never thawed behind a live copy.
    fn detect_failure(&mut self) -> Option<Reason> {
        let (reason, message) = if self.target_restored() {
            self.restored_copy_failure()?
        } else if self.source_killed_under_fence() {
            self.killed_source_failure()?
        } else {
            self.stop_requested()
                .or_else(|| self.pod_failure())
                .or_else(|| self.lazy_failure())
                .or_else(|| self.agent_failure())
                .or_else(|| self.time_failure())?
        };
        self.fail(reason, message);
        Some(reason)
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
    fn awaiting_pages(&self) -> bool {
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

    fn forward(&mut self, active: Active) {
        let o = self.o;
        self.poll();
        match active {
            Active::Preparing => self.prepare_step(),
            Active::Checkpointing => {
                if let Some(src) = o.source_agent.report() {
                    self.checkpoint_step(src);
                }
            }
            Active::Transferring => {
                let Some(src) = o.source_agent.report() else {
                    return;
                };
                // The restore fence: the target is asked to restore only once the source
                // agent acknowledged it (entering Restoring records that it did).
                match src.last_step() {
                    Some(Step::Fence) if src.done(Step::Fence) => {
                        self.enter(MigrationPhase::Restoring);
                        self.restore_step();
                    }
                    Some(Step::Fence) if src.running(Step::Fence) => {}
                    // Done, or a fence not acknowledged: (again) until the timeout.
                    Some(Step::Transfer | Step::Fence)
                        if src.done(Step::Transfer) || src.failure().is_some() =>
                    {
                        self.act(Action::Agent(Side::Source, Step::Fence));
                    }
                    _ if !src.running(Step::Transfer) => {
                        self.act(Action::Agent(Side::Source, Step::Transfer));
                    }
                    _ => {}
                }
            }
            Active::Restoring => self.restore_step(),
        }
    }

    /// The transfer key and the target pod, then both agents' first steps.
    fn prepare_step(&mut self) {
        let o = self.o;
        if !o.transfer_key_present {
            self.act(Action::EnsureTransferKey);
        }
        let Some(tp) = &o.target_pod else {
            self.act(Action::EnsureTargetPod);
            return;
        };
        if !tp.running || !o.transfer_key_present {
            return;
        }
        let (Some(src), Some(tgt)) = (o.source_agent.report(), o.target_agent.report()) else {
            return;
        };
        if src.last.is_none() {
            self.act(Action::Agent(Side::Source, Step::Prepare));
        }
        if tgt.last.is_none() {
            self.act(Action::Agent(Side::Target, Step::Receive));
        }
        if src.done(Step::Prepare) && tgt.done(Step::Receive) {
            self.enter(MigrationPhase::Checkpointing);
            self.checkpoint_step(src);
        }
    }

    fn checkpoint_step(&mut self, src: &AgentReport) {
        let knobs = &self.o.knobs;
        match src.last_step() {
            Some(Step::Prepare) if src.done(Step::Prepare) => {
                let first = match knobs.mode {
                    MigrationMode::PreCopy => Step::PreDump(1),
                    MigrationMode::Cold | MigrationMode::PostCopy => Step::Dump,
                };
                self.act(Action::Agent(Side::Source, first));
            }
            Some(Step::PreDump(n)) if src.done(Step::PreDump(n)) => {
                match pre_copy_decision(n, src, knobs) {
                    PreCopyDecision::FinalDump => self.act(Action::Agent(Side::Source, Step::Dump)),
                    PreCopyDecision::AnotherRound(m) => {
                        self.act(Action::Agent(Side::Source, Step::PreDump(m)))
                    }
                    PreCopyDecision::BudgetExceeded { estimate_millis } => {
                        let est = estimate_millis
                            .map_or("unknown (no transfer rate measured)".to_string(), |e| {
                                format!("{e}ms")
                            });
                        self.fail(
                            Reason::FreezeBudgetExceeded,
                            format!(
                                "after {n} pre-copy rounds the final freeze would take {est}, over freezeBudgetMillis={}",
                                knobs.freeze_budget_millis
                            ),
                        );
                        self.resume();
                    }
                }
            }
            Some(Step::Dump) if src.done(Step::Dump) => {
                self.enter(MigrationPhase::Transferring);
                self.act(Action::Agent(Side::Source, Step::Transfer));
            }
            // A step is running: wait for it.
            _ => {}
        }
    }

    fn restore_step(&mut self) {
        self.health = Some(Health::reconciling(
            reasons::RESTORING,
            format!("restoring on the target; the source is fenced ({FENCED})"),
        ));
        let Some(tgt) = self.o.target_agent.report() else {
            return;
        };
        match tgt.last_step() {
            Some(Step::Receive) if tgt.done(Step::Receive) => {
                self.act(Action::Agent(Side::Target, Step::Restore));
            }
            Some(Step::Restore) if tgt.done(Step::Restore) => {
                self.record_restore(tgt);
                self.act(Action::Agent(Side::Target, Step::Probe));
                self.bump_progress_time();
            }
            Some(Step::Probe) => {
                self.record_restore(tgt);
                if self.awaiting_pages() {
                    // The source is the restored copy's page store until the last
                    // page: nothing of it is given up before (deleting its pod would
                    // end it with the grace period's SIGKILL).
                    self.health = Some(Health::reconciling(
                        reasons::RESTORING,
                        format!(
                            "PostCopy: the restored copy runs and passed its probe; fetching its memory from the frozen source ({} bytes in)",
                            tgt.progress.lazy_bytes
                        ),
                    ));
                } else if tgt.done(Step::Probe) {
                    self.enter(MigrationPhase::Committing);
                    self.resume();
                }
            }
            _ => {}
        }
    }

    /// Past the probe, a migration only rolls forward: deletion waits for it.
    ///
    /// The source is given up in this order, each step decided from what is observed,
    /// so an operator restart anywhere resumes it:
    /// 1. its `pod-deletion-cost` is lowered, the target pod is handed over to the
    ///    workload's controller and its adoption awaited (bounded: at the progress
    ///    timeout the migration ends `Failed`, see `owner_never_adopted`);
    /// 2. the source pod is deleted with the commit's grace period
    ///    ([`Machine::commit_grace_seconds`]). Its ReplicaSet, which has two active pods
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
    /// kill failed, no answer within the progress timeout from entering `Committing`)
    /// is never counted as done: the source pod is deleted with grace period 0 (again,
    /// if it was terminating with a grace period), the deletion is the kill, and the
    /// outcome says that the agent did not confirm it.
    fn committing(&mut self) {
        let o = self.o;
        self.poll();
        // `Committing` is only ever entered (and persisted) once the target's probe
        // passed, so the phase itself is the proof: an agent that cannot remember the
        // probe after an operator restart must not hold the commit back.
        let source = self.source_of_record();
        if let Some(s) = source
            && !s.terminating
            && !s.deletion_cost_lowered
        {
            self.act(Action::LowerSourceDeletionCost);
        }
        match &o.target_pod {
            None => return self.restored_pod_lost("the target pod disappeared during commit"),
            Some(tp) if tp.terminating => {
                return self.restored_pod_lost("the target pod was deleted during commit");
            }
            Some(tp) if !tp.handed_over => {
                self.act(Action::HandOverTargetPod);
                return;
            }
            Some(tp) if tp.awaiting_adoption => {
                if self.progress_stalled() {
                    self.owner_never_adopted();
                }
                return;
            }
            Some(_) => {}
        }
        match (source, self.source_kill()) {
            (_, SourceKill::ByPodDeletion(why)) => {
                self.note_kill_unconfirmed(&why);
                if source.is_some_and(|s| s.deletion_grace_seconds != Some(0)) {
                    self.act(Action::DeleteSourcePod { grace_seconds: 0 });
                    return;
                }
            }
            // The agent's kill is to come: the pod goes first.
            (Some(s), SourceKill::NotAsked | SourceKill::Running) if !s.terminating => {
                let grace_seconds = self.commit_grace_seconds();
                self.act(Action::DeleteSourcePod { grace_seconds });
                return;
            }
            (_, SourceKill::NotAsked) => {
                if let Some(wait) = source.and_then(|s| self.kill_settling(s)) {
                    self.requeue_within(wait);
                    return;
                }
                if source.is_none() {
                    self.note_source_gone_before_the_kill();
                }
                self.act(Action::Agent(Side::Source, Step::Commit));
                return;
            }
            (_, SourceKill::Running) => return,
            // Killed before its pod was deleted (its node's freeze watchdog, or a commit
            // in the order before this one): its container may be restarting from its
            // image, and the deletion ends that at once.
            (Some(s), SourceKill::Confirmed) if !s.terminating => {
                self.act(Action::DeleteSourcePod { grace_seconds: 0 });
                return;
            }
            (_, SourceKill::Confirmed) => {}
        }
        self.enter(MigrationPhase::Succeeded);
        self.resume();
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
    /// deletion and the Services to have let it go ([`Knobs::kill_settle`]), if at all.
    fn kill_settling(&self, s: &SourcePodFacts) -> Option<Duration> {
        let accepted = s.deletion_accepted?;
        self.o
            .knobs
            .kill_settle()
            .checked_sub(self.elapsed_since(accepted))
            .filter(|w| !w.is_zero())
    }

    /// The grace period of the source pod's deletion when its agent's kill follows it:
    /// the progress timeout, which bounds the wait for that kill from entering
    /// `Committing`. The kubelet's own SIGKILL at its end (the source's network still
    /// locked: no FIN) thus never comes before the machine has stopped waiting for the
    /// agent's kill and made the deletion the kill itself (grace period 0). Normally the
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
        if self.progress_stalled() {
            return SourceKill::ByPodDeletion(format!(
                "the source agent did not confirm the kill within {bound}s"
            ));
        }
        if r.running(Step::Commit) {
            SourceKill::Running
        } else {
            SourceKill::NotAsked
        }
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

    /// Whether the status message already says `marker` (each note is made once).
    fn noted(&self, marker: &str) -> bool {
        self.status
            .failure_message
            .as_deref()
            .is_some_and(|m| m.contains(marker))
    }

    /// Appends `m` to the status message (`; `-separated).
    fn push_message(&mut self, m: &str) {
        match &mut self.status.failure_message {
            Some(existing) if !existing.is_empty() => {
                existing.push_str("; ");
                existing.push_str(m);
            }
            slot => *slot = Some(m.to_string()),
        }
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

    /// Undo everything before commit, in the order that keeps one running copy.
    ///
    /// Bounded: a rollback that cannot confirm a step within `progressTimeoutSeconds`
    /// of the failure ends anyway, saying what it could not confirm (see
    /// `unconfirmed_target_copy` and `source_resumed`), so a deletion never waits on
    /// an agent forever.
    fn rollback(&mut self, reason: Reason) {
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

    /// Terminal: clean up what is left, then let a deletion go through.
    fn terminal(&mut self) {
        let o = self.o;
        self.requeue_after = None;
        let failed = self.phase() != MigrationPhase::Succeeded;
        let mut pending_cleanup = false;
        let mut unanswered = false;
        let nodes = (
            self.status.source_node.is_some(),
            self.status.target_node.is_some(),
        );
        for (side, view, node_known) in [
            (Side::Source, &o.source_agent, nodes.0),
            (Side::Target, &o.target_agent, nodes.1),
        ] {
            match view {
                AgentView::Reported(r) if r.last.is_some() && !r.done(Step::Cleanup) => {
                    // Never clean up a running Abort or Commit (nor one asked for this
                    // round): its thaw or kill must finish first.
                    let asked = self.actions.contains(&Action::Agent(side, Step::Abort))
                        || self.actions.contains(&Action::Agent(side, Step::Commit));
                    if !asked && !r.running(Step::Abort) && !r.running(Step::Commit) {
                        self.act(Action::Agent(side, Step::Cleanup));
                    }
                    pending_cleanup = true;
                }
                // An agent of this migration's nodes that did not answer (a replica that
                // has just taken over, an agent restarting, a timeout) may still hold
                // its images: ask again, for as long as progress would be awaited
                // after the terminal phase (a restarted agent sweeps its images anyway).
                AgentView::Unreachable(_) | AgentView::Missing if node_known => {
                    unanswered = true;
                }
                _ => {}
            }
        }
        if failed
            && o.target_pod
                .as_ref()
                .is_some_and(|t| !t.terminating && !t.handed_over)
        {
            self.act(Action::DeleteTargetPod);
        }
        if o.transfer_key_present {
            self.act(Action::DeleteTransferKey);
        }
        if pending_cleanup || (unanswered && !self.progress_stalled()) {
            self.poll();
        }
        if o.deletion_requested && o.has_finalizer {
            // Agents sweep a forgotten migration's images on their own; an unreachable
            // agent must not hold the deletion forever.
            self.act(Action::RemoveFinalizer);
        }
    }
}

/// The health (Ready/Reconciling/Stalled) a status implies when a phase handler did not
/// choose one.
fn default_health(status: &PodMigrationStatus) -> Health {
    let reason = status
        .failure_reason
        .as_deref()
        .map(|r| Reason::from_status(r).as_str());
    let message = status.failure_message.clone().unwrap_or_default();
    match status.phase {
        MigrationPhase::Succeeded => {
            if status.downtime.is_some() {
                Health::ready(
                    reasons::SUCCEEDED,
                    format!(
                        "migrated (downtime {}){}",
                        status.downtime.as_deref().unwrap_or(""),
                        status
                            .failure_message
                            .as_deref()
                            .map(|m| format!("; {m}"))
                            .unwrap_or_default()
                    ),
                )
            } else {
                Health::ready(
                    reasons::DRY_RUN_PASSED,
                    "dry run passed; nothing was frozen",
                )
            }
        }
        MigrationPhase::Failed | MigrationPhase::Aborted => {
            Health::stalled(reason.unwrap_or(reasons::ROLLED_BACK), message)
        }
        MigrationPhase::Pending => Health::reconciling(reasons::PENDING, "waiting to start"),
        p => Health::reconciling(phase_reason(p), format!("{p:?}")),
    }
}

/// In a failure message: the rollback ended without an agent confirming the source's
/// thaw, so nothing may report the source as resumed.
const SOURCE_STATE_UNKNOWN: &str = "source state unknown";

/// In a failure message: the fenced source was killed on its node, never resumed.
const KILLED_UNDER_FENCE: &str = "the fenced source was killed on its node";

/// What the restore fence means, in the Restoring Event and condition.
const FENCED: &str =
    "from now its node kills it rather than resume it, unless this migration rolls back";

/// In the status message of a commit whose kill of the source its agent did not confirm.
const KILL_UNCONFIRMED: &str = "the source agent did not confirm the kill of the source";

/// In the status message of a commit that found the source pod gone before it asked
/// the source agent for the kill.
const SOURCE_GONE_FIRST: &str =
    "the source pod was gone before its agent was asked to kill the source";

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

/// Order of the phases along the happy path (terminal phases last).
pub fn rank(p: MigrationPhase) -> u8 {
    match p {
        MigrationPhase::Pending => 0,
        MigrationPhase::Preparing => 1,
        MigrationPhase::Checkpointing => 2,
        MigrationPhase::Transferring => 3,
        MigrationPhase::Restoring => 4,
        MigrationPhase::Committing => 5,
        MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Aborted => 6,
    }
}

fn phase_reason(p: MigrationPhase) -> &'static str {
    match p {
        MigrationPhase::Pending => reasons::PENDING,
        MigrationPhase::Preparing => reasons::PROGRESSING,
        MigrationPhase::Checkpointing => reasons::CHECKPOINTING,
        MigrationPhase::Transferring => reasons::TRANSFERRING,
        MigrationPhase::Restoring => reasons::RESTORING,
        MigrationPhase::Committing => reasons::COMMITTING,
        MigrationPhase::Succeeded => reasons::SUCCEEDED,
        MigrationPhase::Failed | MigrationPhase::Aborted => reasons::ROLLED_BACK,
    }
}

/// The name of the target pod this migration may observe, hand over or delete, once
/// its status says it made one: the name only it makes (`render::target_pod_name` of
/// its source pod and its UID), never `status.targetPod` itself — whoever may write
/// `podmigrations/status` could name any pod of the namespace there, and the next
/// rollback would delete it.
pub fn target_pod_of_record(
    source_pod: &str,
    migration_uid: &str,
    status: &PodMigrationStatus,
) -> Option<String> {
    status
        .target_pod
        .as_ref()
        .map(|_| super::render::target_pod_name(source_pod, migration_uid))
}

/// Whether `pod` is the target pod of the migration `name`/`uid`: it records the
/// migration (`podmotion.io/migration`), and a PodMigration that controls it (until
/// the hand-over) is this one. A pod that merely took the name is not acted on.
pub fn is_target_pod_of(pod: &k8s_openapi::api::core::v1::Pod, name: &str, uid: &str) -> bool {
    let meta = &pod.metadata;
    let records_us = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(podmotion_api::names::annotations::MIGRATION))
        .is_some_and(|m| m == name);
    let other_owner = meta
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "PodMigration" && o.uid != uid);
    records_us && !other_owner
}

#[cfg(test)]
mod target_of_record_tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn pod(name: &str, migration: Option<&str>, owner_uid: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: migration.map(|m| {
                    [(
                        podmotion_api::names::annotations::MIGRATION.to_string(),
                        m.to_string(),
                    )]
                    .into()
                }),
                owner_references: owner_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: "podmotion.io/v1alpha1".into(),
                        kind: "PodMigration".into(),
                        name: "m".into(),
                        uid: uid.into(),
                        controller: Some(true),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_forged_status_target_pod_names_no_pod_a_rollback_deletes() {
        let forged = PodMigrationStatus {
            target_pod: Some("payments-db-0".into()),
            ..Default::default()
        };
        let name = target_pod_of_record("web-abc", "uid-1", &forged).unwrap();
        assert_ne!(
            name, "payments-db-0",
            "status names the pod, and is not trusted"
        );
        assert_eq!(
            name,
            super::super::render::target_pod_name("web-abc", "uid-1")
        );
        assert_eq!(
            target_pod_of_record("web-abc", "uid-1", &PodMigrationStatus::default()),
            None,
            "no target pod made yet"
        );
    }

    #[test]
    fn only_a_pod_that_records_this_migration_is_its_target() {
        assert!(is_target_pod_of(
            &pod("t", Some("m"), Some("uid-1")),
            "m",
            "uid-1"
        ));
        // Handed over: no PodMigration owner, the annotation stays.
        assert!(is_target_pod_of(&pod("t", Some("m"), None), "m", "uid-1"));
        // Squatting the deterministic name, or another migration's.
        assert!(!is_target_pod_of(&pod("t", None, None), "m", "uid-1"));
        assert!(!is_target_pod_of(
            &pod("t", Some("other"), None),
            "m",
            "uid-1"
        ));
        assert!(!is_target_pod_of(
            &pod("t", Some("m"), Some("uid-2")),
            "m",
            "uid-1"
        ));
    }
}
