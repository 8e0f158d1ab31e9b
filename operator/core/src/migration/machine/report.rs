//! What the machine says: the Events' actions, the markers its status messages carry
//! (what the Events and later rounds read back), and the health a status implies.

use podmotion_api::conditions::Health;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_api::names::reasons;

use crate::migration::stage::Reason;

/// The Events' action: every note of the machine is about migrating.
pub(super) const ACTION: &str = "Migrate";
/// The action of the Event that ends a failed or aborted migration.
pub(super) const END_ACTION: &str = "EndMigration";

/// In a failure message: the rollback ended without an agent confirming the source's
/// thaw, so nothing may report the source as resumed.
pub(super) const SOURCE_STATE_UNKNOWN: &str = "source state unknown";

/// In a failure message: the fenced source was killed on its node, never resumed.
pub(super) const KILLED_UNDER_FENCE: &str = "the fenced source was killed on its node";

/// What the restore fence means, in the Restoring Event and condition.
pub(super) const FENCED: &str =
    "from now its node kills it rather than resume it, unless this migration rolls back";

/// In the status message of a commit whose kill of the source its agent did not confirm.
pub(super) const KILL_UNCONFIRMED: &str = "the source agent did not confirm the kill of the source";

/// In the status message of a commit that found the source pod gone before it asked
/// the source agent for the kill.
pub(super) const SOURCE_GONE_FIRST: &str =
    "the source pod was gone before its agent was asked to kill the source";

/// The health (Ready/Reconciling/Stalled) a status implies when a phase handler did not
/// choose one.
pub(super) fn default_health(status: &PodMigrationStatus) -> Health {
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
