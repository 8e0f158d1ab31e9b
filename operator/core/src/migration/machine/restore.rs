//! `Restoring`: the restore on the target behind the fence, the application probe,
//! and (PostCopy) the wait for the last page, then the commit.

use podmotion_api::conditions::Health;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::reasons;

use super::report::FENCED;
use super::state::Machine;
use crate::migration::agent::{AgentReport, Side, Step};
use crate::migration::observed::Action;

impl<'a> Machine<'a> {
    pub(super) fn restore_step(&mut self) {
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
                self.forward_new_connections();
                self.bump_progress_time();
            }
            Some(Step::Probe) => {
                self.record_restore(tgt);
                self.forward_new_connections();
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
}
