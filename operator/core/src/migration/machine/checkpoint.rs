//! `Checkpointing`: the pre-copy rounds under the freeze-budget rule, then the final
//! dump.

use podmotion_api::migration::{MigrationMode, MigrationPhase};

use super::state::Machine;
use crate::migration::agent::{AgentReport, Side, Step};
use crate::migration::observed::{Action, Knobs};
use crate::migration::stage::Reason;

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

impl<'a> Machine<'a> {
    pub(super) fn checkpoint_step(&mut self, src: &AgentReport) {
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
                        self.start_rollback(
                            Reason::FreezeBudgetExceeded,
                            format!(
                                "after {n} pre-copy rounds the final freeze would take {est}, over freezeBudgetMillis={}",
                                knobs.freeze_budget_millis
                            ),
                        );
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
}
