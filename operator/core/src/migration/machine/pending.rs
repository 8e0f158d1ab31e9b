//! `Pending`: the pre-flight verdict, a dry run's end, and the wait for a slot.

use podmotion_api::conditions::{Health, set_condition};
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{condition_types as ct, reasons};

use super::state::{IDLE_RECHECK, Machine};
use crate::migration::observed::{Action, Plan, Preflight};
use crate::migration::stage::Reason;

impl<'a> Machine<'a> {
    pub(super) fn pending(&mut self) {
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

    pub(super) fn migratable(&mut self, plan: &Plan) {
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
}
