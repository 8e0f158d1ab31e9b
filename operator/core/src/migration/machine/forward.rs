//! The forward path's active phases: `Preparing` (the transfer key, the target pod,
//! both agents' first steps) and `Transferring` (the transfer, then the restore fence).
//! `Checkpointing` and `Restoring` have their own modules.

use podmotion_api::migration::MigrationPhase;

use super::state::Machine;
use crate::migration::agent::{AgentReport, Side, Step};
use crate::migration::observed::Action;
use crate::migration::stage::Active;

impl<'a> Machine<'a> {
    pub(super) fn forward(&mut self, active: Active) {
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
                if let Some(src) = o.source_agent.report() {
                    self.transfer_step(src);
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

    /// The transfer, then the restore fence: the target is asked to restore only once
    /// the source agent acknowledged it (entering Restoring records that it did).
    fn transfer_step(&mut self, src: &AgentReport) {
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
}
