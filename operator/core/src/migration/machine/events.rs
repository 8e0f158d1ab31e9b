//! The Event of entering each phase, and the words of the ending ones.

use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::reasons;

use super::report::{
    ACTION, END_ACTION, FENCED, KILL_UNCONFIRMED, KILLED_UNDER_FENCE, SOURCE_STATE_UNKNOWN,
};
use super::state::Machine;
use crate::migration::stage::Reason;
use crate::note::{EventKind, Note};

impl<'a> Machine<'a> {
    /// The Event of entering `phase`: its words ([`Self::entry_words`]), under the action
    /// of a step or of an ending.
    pub(super) fn entry_note(&self, phase: MigrationPhase) -> Note {
        let (kind, reason, message) = self.entry_words(phase);
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

    /// Kind, reason and message of entering `phase` (a table: one line per phase).
    fn entry_words(&self, phase: MigrationPhase) -> (EventKind, &'static str, String) {
        match phase {
            MigrationPhase::Pending => (EventKind::Normal, reasons::PENDING, "pending".to_string()),
            MigrationPhase::Preparing => (
                EventKind::Normal,
                reasons::MIGRATABLE,
                // The pod of the spec (always set): the status' target pod is a
                // different pod, which once printed as "migrating pod ? from ...".
                format!(
                    "migrating pod {} from node {} to node {}",
                    self.o.pod_name,
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
}
