//! The machine's working state for one call (the status being decided, the actions,
//! Events and requeue chosen so far) and what every stage handler does with it:
//! record an action, enter a phase, record a failure, measure time and progress.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::conditions::{Health, set_health};
use podmotion_api::migration::{MigrationPhase, PhaseTransition, PodMigrationStatus};

use super::report::default_health;
use crate::migration::agent::{AgentReport, Side, Step};
use crate::migration::observed::{Action, Observed, Transition};
use crate::note::Note;

/// One call of the machine: the facts, and what it decided so far.
pub(super) struct Machine<'a> {
    pub(super) o: &'a Observed,
    pub(super) status: PodMigrationStatus,
    pub(super) actions: Vec<Action>,
    pub(super) notes: Vec<Note>,
    pub(super) requeue_after: Option<Duration>,
    pub(super) health: Option<Health>,
}

/// Poll interval while agents are working.
pub const POLL: Duration = Duration::from_millis(500);
/// Re-check interval while the source is frozen (from the final dump until the
/// hand-over): every step of that window waits for the next poll, and that wait is
/// downtime. Few migrations are ever frozen at once (the concurrency limits), so the
/// extra reconciles are bounded.
pub const FROZEN_POLL: Duration = Duration::from_millis(50);

/// Re-check interval while waiting for a slot or for the cluster to become migratable.
pub const IDLE_RECHECK: Duration = Duration::from_secs(10);

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

impl<'a> Machine<'a> {
    pub(super) fn new(o: &'a Observed) -> Self {
        Machine {
            o,
            status: o.status.clone(),
            actions: vec![],
            notes: vec![],
            requeue_after: None,
            health: None,
        }
    }

    pub(super) fn phase(&self) -> MigrationPhase {
        self.status.phase
    }

    pub(super) fn finish(mut self) -> Transition {
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

    pub(super) fn act(&mut self, a: Action) {
        if !self.actions.contains(&a) {
            self.actions.push(a);
        }
    }

    pub(super) fn poll(&mut self) {
        self.requeue_after = Some(POLL);
    }

    /// Reconcile again no later than `wait` from now.
    pub(super) fn requeue_within(&mut self, wait: Duration) {
        self.requeue_after = Some(self.requeue_after.map_or(wait, |r| r.min(wait)));
    }

    pub(super) fn enter(&mut self, phase: MigrationPhase) {
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

    /// Whether the migration reached `Committing` (the source was given up).
    pub(super) fn committed(&self) -> bool {
        self.status
            .phase_transition_timestamps
            .iter()
            .any(|t| t.phase == MigrationPhase::Committing)
    }

    pub(super) fn bump_progress_time(&mut self) {
        let p = self.status.progress.get_or_insert_with(Default::default);
        p.last_progress_time = Some(Time(self.o.now));
    }

    pub(super) fn last_progress(&self) -> Timestamp {
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

    pub(super) fn elapsed_since(&self, t: Timestamp) -> Duration {
        let d = self.o.now.duration_since(t);
        Duration::try_from(d).unwrap_or(Duration::ZERO)
    }

    pub(super) fn deadline_passed(&self) -> bool {
        self.elapsed_since(self.o.created) > self.o.knobs.deadline
    }

    pub(super) fn progress_stalled(&self) -> bool {
        self.elapsed_since(self.last_progress()) > self.o.knobs.progress_timeout
    }

    /// Whether the status message already says `marker` (each note is made once).
    pub(super) fn noted(&self, marker: &str) -> bool {
        self.status
            .failure_message
            .as_deref()
            .is_some_and(|m| m.contains(marker))
    }

    /// Appends `m` to the status message (`; `-separated).
    pub(super) fn push_message(&mut self, m: &str) {
        match &mut self.status.failure_message {
            Some(existing) if !existing.is_empty() => {
                existing.push_str("; ");
                existing.push_str(m);
            }
            slot => *slot = Some(m.to_string()),
        }
    }
}
