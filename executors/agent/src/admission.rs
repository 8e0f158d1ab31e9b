//! Which step an agent admits, by its role in the migration and the phase it is in:
//! one table, [`admit`], instead of a guard in every step. A step already done is
//! answered with the current status (the operator repeats calls after a restart); a
//! step out of order is refused with a [`StepError`], which becomes a gRPC status in
//! one place (`From<StepError> for tonic::Status`).

use std::fmt;

use podmotion_wire::agent::{Phase, Role};

/// A step the operator asks of an agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    PreDump,
    Dump,
    Send,
    Receive,
    Restore,
    /// The restore fence (source).
    Fence,
    Commit,
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Step::PreDump => "pre-dump",
            Step::Dump => "dump",
            Step::Send => "send",
            Step::Receive => "receive",
            Step::Restore => "restore",
            Step::Fence => "fence",
            Step::Commit => "commit",
        })
    }
}

/// What the agent does with an admitted step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Run it.
    Run,
    /// It already ran: answer with the current status.
    Done,
}

/// Why a step is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StepError {
    #[error("{step} in phase {phase:?}")]
    WrongPhase { step: Step, phase: Phase },
    /// The final images came already: a second stream would overwrite them.
    #[error("the final images were already received")]
    AlreadyReceived,
}

impl From<StepError> for tonic::Status {
    fn from(e: StepError) -> Self {
        match e {
            StepError::WrongPhase { .. } => tonic::Status::failed_precondition(e.to_string()),
            StepError::AlreadyReceived => tonic::Status::already_exists(e.to_string()),
        }
    }
}

/// The admission table: whether `role` in `phase` runs `step`.
pub fn admit(role: Role, phase: Phase, step: Step) -> Result<Admission, StepError> {
    use Admission::{Done, Run};
    use Phase as P;
    use Role::{Source, Target};
    match (step, role, phase) {
        (Step::PreDump, Source, P::Prepared | P::PreDumping) => Ok(Run),
        (Step::Dump, Source, P::Dumped | P::Sent) => Ok(Done),
        (Step::Dump, Source, P::Prepared | P::PreDumping) => Ok(Run),
        (Step::Send, _, P::Sent) => Ok(Done),
        (Step::Send, Source, P::Dumped | P::PreDumping) => Ok(Run),
        (Step::Receive, _, P::Received) => Err(StepError::AlreadyReceived),
        (Step::Receive, Target, P::Prepared | P::Receiving) => Ok(Run),
        (Step::Restore, _, P::Restored) => Ok(Done),
        (Step::Restore, Target, P::Received) => Ok(Run),
        // Only once the final images were sent (the target holds all of the state);
        // a fence already taken is answered from the freeze, before this table.
        (Step::Fence, _, P::Killed) => Ok(Done),
        (Step::Fence, Source, P::Sent) => Ok(Run),
        (Step::Commit, _, P::Committed) => Ok(Done),
        (Step::Commit, Source, P::Dumped | P::Sent) => Ok(Run),
        (step, _, phase) => Err(StepError::WrongPhase { step, phase }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEPS: [Step; 7] = [
        Step::PreDump,
        Step::Dump,
        Step::Send,
        Step::Receive,
        Step::Restore,
        Step::Fence,
        Step::Commit,
    ];

    const PHASES: [Phase; 12] = [
        Phase::Unknown,
        Phase::Prepared,
        Phase::PreDumping,
        Phase::Dumped,
        Phase::Receiving,
        Phase::Received,
        Phase::Sent,
        Phase::Restored,
        Phase::Committed,
        Phase::Aborted,
        Phase::CleanedUp,
        Phase::Killed,
    ];

    /// Every (step, role, phase) the table runs; everything else is done or refused.
    fn runs(step: Step, role: Role, phase: Phase) -> bool {
        admit(role, phase, step) == Ok(Admission::Run)
    }

    #[test]
    fn the_source_checkpoints_and_sends_and_the_target_receives_and_restores() {
        assert!(runs(Step::PreDump, Role::Source, Phase::Prepared));
        assert!(runs(Step::PreDump, Role::Source, Phase::PreDumping));
        assert!(runs(Step::Dump, Role::Source, Phase::PreDumping));
        assert!(runs(Step::Send, Role::Source, Phase::PreDumping));
        assert!(runs(Step::Send, Role::Source, Phase::Dumped));
        assert!(runs(Step::Commit, Role::Source, Phase::Sent));
        assert!(runs(Step::Fence, Role::Source, Phase::Sent));
        // Not before the final images are on their way: the target would hold no state.
        for phase in [Phase::Prepared, Phase::PreDumping, Phase::Dumped] {
            assert!(!runs(Step::Fence, Role::Source, phase), "{phase:?}");
        }
        assert!(runs(Step::Receive, Role::Target, Phase::Prepared));
        assert!(runs(Step::Restore, Role::Target, Phase::Received));
    }

    #[test]
    fn no_step_runs_on_the_wrong_side() {
        for step in STEPS {
            for phase in PHASES {
                let source_side = matches!(
                    step,
                    Step::PreDump | Step::Dump | Step::Send | Step::Fence | Step::Commit
                );
                let wrong = if source_side {
                    Role::Target
                } else {
                    Role::Source
                };
                assert!(
                    !runs(step, wrong, phase),
                    "{step} ran on {wrong:?} in {phase:?}"
                );
                assert!(!runs(step, Role::Unspecified, phase));
            }
        }
    }

    #[test]
    fn nothing_runs_after_an_abort_or_cleanup() {
        for step in STEPS {
            for role in [Role::Source, Role::Target] {
                for phase in [Phase::Aborted, Phase::CleanedUp, Phase::Unknown] {
                    assert_eq!(
                        admit(role, phase, step),
                        Err(StepError::WrongPhase { step, phase })
                    );
                }
            }
        }
    }

    #[test]
    fn a_repeated_step_is_answered_not_run_again() {
        assert_eq!(
            admit(Role::Source, Phase::Sent, Step::Dump),
            Ok(Admission::Done)
        );
        assert_eq!(
            admit(Role::Source, Phase::Sent, Step::Send),
            Ok(Admission::Done)
        );
        assert_eq!(
            admit(Role::Target, Phase::Restored, Step::Restore),
            Ok(Admission::Done)
        );
        assert_eq!(
            admit(Role::Source, Phase::Committed, Step::Commit),
            Ok(Admission::Done)
        );
        // A second final stream would overwrite the images: refused, not answered.
        assert_eq!(
            admit(Role::Target, Phase::Received, Step::Receive),
            Err(StepError::AlreadyReceived)
        );
    }

    #[test]
    fn a_commit_before_the_dump_is_refused_with_the_phase_in_its_message() {
        let e = admit(Role::Source, Phase::PreDumping, Step::Commit).unwrap_err();
        assert_eq!(e.to_string(), "commit in phase PreDumping");
        let s = tonic::Status::from(e);
        assert_eq!(s.code(), tonic::Code::FailedPrecondition);
        let s = tonic::Status::from(StepError::AlreadyReceived);
        assert_eq!(s.code(), tonic::Code::AlreadyExists);
    }
}
