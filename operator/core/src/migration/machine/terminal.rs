//! `Succeeded`, `Failed`, `Aborted`: clean up what is left on the agents and in the
//! cluster, then let a deletion go through.

use podmotion_api::migration::MigrationPhase;

use super::state::Machine;
use crate::migration::agent::{AgentView, Side, Step};
use crate::migration::observed::Action;

impl<'a> Machine<'a> {
    /// Terminal: clean up what is left, then let a deletion go through.
    pub(super) fn terminal(&mut self) {
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
