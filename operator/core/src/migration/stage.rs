//! Where a migration stands, read from its persisted status alone: the [`Stage`] the
//! machine dispatches on, and the [`Reason`] a failure is recorded with.
//!
//! Rolling back is a stage of its own here, though not a phase of the API: a
//! pre-commit phase with a `failureReason` is a migration rolling back (the phase
//! still says how far it got, which the rollback needs: a target that may have
//! restored must be killed before the source is thawed).

use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_api::names::reasons;

/// A pre-commit phase in which the agents work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Active {
    Preparing,
    Checkpointing,
    Transferring,
    Restoring,
}

/// The forward path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// Pre-flight checks, queueing for a slot.
    Pending,
    Active(Active),
    /// Past the probe: a migration only rolls forward (deletion waits for it).
    Committing,
}

/// What the machine does with a migration this round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Forward(Forward),
    /// A failure before commit: undo, keeping exactly one running copy.
    RollingBack(Reason),
    /// Succeeded, Failed or Aborted: clean up, let a deletion through.
    Terminal,
}

impl Stage {
    pub fn of(status: &PodMigrationStatus) -> Stage {
        let active = match status.phase {
            MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Aborted => {
                return Stage::Terminal;
            }
            MigrationPhase::Pending => return Stage::Forward(Forward::Pending),
            MigrationPhase::Committing => return Stage::Forward(Forward::Committing),
            MigrationPhase::Preparing => Active::Preparing,
            MigrationPhase::Checkpointing => Active::Checkpointing,
            MigrationPhase::Transferring => Active::Transferring,
            MigrationPhase::Restoring => Active::Restoring,
        };
        match status.failure_reason.as_deref() {
            Some(r) => Stage::RollingBack(Reason::from_status(r)),
            None => Stage::Forward(Forward::Active(active)),
        }
    }
}

/// One list makes the enum, its condition-reason strings and [`Reason::ALL`], so no
/// copy of the list can fall behind.
macro_rules! failure_reasons {
    ($($variant:ident = $constant:ident),* $(,)?) => {
        /// Why a migration stopped, as `status.failureReason` and the Event's reason.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Reason {
            $($variant),*
        }

        impl Reason {
            pub const ALL: &[Reason] = &[$(Reason::$variant),*];

            /// The condition reason constant.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => reasons::$constant),*
                }
            }
        }
    };
}

failure_reasons! {
    Aborted = ABORTED,
    DeadlineExceeded = DEADLINE_EXCEEDED,
    FreezeBudgetExceeded = FREEZE_BUDGET_EXCEEDED,
    ProbeFailed = PROBE_FAILED,
    AgentError = AGENT_ERROR,
    ProgressTimeout = PROGRESS_TIMEOUT,
    SourcePodGone = SOURCE_POD_GONE,
    TargetPodUnschedulable = TARGET_POD_UNSCHEDULABLE,
    NoAgentOnNode = NO_AGENT_ON_NODE,
    SourcePodNotFound = SOURCE_POD_NOT_FOUND,
    SourcePodNotRunning = SOURCE_POD_NOT_RUNNING,
    PodUidMismatch = POD_UID_MISMATCH,
    AlreadyMigrating = ALREADY_MIGRATING,
    NoTargetNode = NO_TARGET_NODE,
    TargetIsSource = TARGET_IS_SOURCE,
    TargetDoesNotFit = TARGET_DOES_NOT_FIT,
    UnsupportedOwner = UNSUPPORTED_OWNER,
    RolledBack = ROLLED_BACK,
    PostCopyFailed = POST_COPY_FAILED,
}

impl Reason {
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.iter().copied().find(|r| r.as_str() == s)
    }

    /// A persisted reason; one this version does not know (written by another)
    /// reads as `RolledBack`.
    pub fn from_status(s: &str) -> Reason {
        Reason::parse(s).unwrap_or(Reason::RolledBack)
    }

    /// Whether it ends in `Aborted` (the user's decision or limit) rather than
    /// `Failed` (something broke).
    pub fn is_abort(self) -> bool {
        matches!(
            self,
            Reason::Aborted | Reason::DeadlineExceeded | Reason::FreezeBudgetExceeded
        )
    }

    /// The terminal phase a rollback for this reason ends in.
    pub fn end_phase(self) -> MigrationPhase {
        if self.is_abort() {
            MigrationPhase::Aborted
        } else {
            MigrationPhase::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_reads_back_as_itself_and_an_unknown_one_as_rolled_back() {
        for r in Reason::ALL {
            assert_eq!(Reason::parse(r.as_str()), Some(*r));
        }
        assert_eq!(Reason::from_status("SomethingNew"), Reason::RolledBack);
    }

    #[test]
    fn a_pre_commit_phase_with_a_failure_is_rolling_back() {
        let mut st = PodMigrationStatus {
            phase: MigrationPhase::Transferring,
            ..Default::default()
        };
        assert_eq!(
            Stage::of(&st),
            Stage::Forward(Forward::Active(Active::Transferring))
        );
        st.failure_reason = Some(reasons::PROBE_FAILED.into());
        assert_eq!(Stage::of(&st), Stage::RollingBack(Reason::ProbeFailed));
        st.phase = MigrationPhase::Failed;
        assert_eq!(Stage::of(&st), Stage::Terminal);
        st.phase = MigrationPhase::Committing;
        assert_eq!(Stage::of(&st), Stage::Forward(Forward::Committing));
    }

    #[test]
    fn user_decisions_and_limits_abort_and_breakage_fails() {
        assert_eq!(
            Reason::DeadlineExceeded.end_phase(),
            MigrationPhase::Aborted
        );
        assert_eq!(Reason::AgentError.end_phase(), MigrationPhase::Failed);
    }
}
