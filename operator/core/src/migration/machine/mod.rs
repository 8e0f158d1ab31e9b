//! The PodMigration phase machine: `next(&Observed) -> Transition`.
//!
//! Everything the controller learned this round (the persisted status, the pods, both
//! agents' reports, the clock, whether deletion was requested) goes in; the next status
//! and the idempotent actions to take come out. There is no I/O and no memory between
//! calls, so an operator restart is just another call with the same facts: the
//! machine resumes where the persisted status and the agents' reports say it is.
//!
//! The machine dispatches on the migration's [`Stage`] (`Forward`, `RollingBack`,
//! `Terminal`), read from the persisted status: rolling back is not a phase of the API
//! (a pre-commit phase with a `failureReason` is a migration rolling back), but it is
//! a stage here, with its own handler. A handler that moves the migration to another
//! stage hands over to that stage's handler in the same round (`Machine::resume`).
//! The rollback order is what keeps the invariants: the restored copy on the target is killed (and confirmed killed)
//! before the source is thawed, so there are never two running copies; the source is
//! thawed on every failure before commit (past the restore fence, only after the
//! restored copy's own failure), so there is never zero; and `Commit` (kill
//! the frozen source) is only issued after the target passed the application probe.
//! Once the target reports its restore (the restore fence) only the restored copy's
//! own failure rolls back; everything else rolls forward to the commit. The target is
//! asked to restore only after the source agent acknowledged the fence (`Fence`): from
//! then on the source's node kills the frozen source rather than resume it (its agent's
//! watchdog and shutdown, its broker), so an operator that disappears can never leave
//! it thawed beside a restored copy; only the rollback's `Abort` lifts the fence. Every
//! wait is bounded by the progress timeout and ends in a terminal phase that says what
//! it could not confirm.
//!
//! The module is split along the stages: `Machine`'s state and the helpers every
//! stage uses (`state`), then one module per stage handler: `pending` (pre-flight and
//! the slot), `forward` (preparing and transferring), `checkpoint` (the pre-copy
//! rounds and the final dump), `restore` (restore and probe), `commit`, `rollback`
//! (the one handler that undoes a failure before commit), and `terminal` (cleanup).
//! `failure` decides whether a forward migration must roll back, `progress` merges
//! the agents' counters, `freezes` every freeze of the pod and their total, `events`
//! and `report` word what happens. The facts it
//! decides from and the actions it returns are in [`super::observed`], below this
//! module and `render`, both of which use them.

mod checkpoint;
mod commit;
mod events;
mod failure;
mod forward;
mod freezes;
mod pending;
mod progress;
mod report;
mod restore;
mod rollback;
mod state;
mod terminal;

use podmotion_api::migration::PodMigrationStatus;

pub use super::observed::{
    API_TIME_UNIT, Action, DEFAULT_SERVICE_SYNC, KUBELET_SETTLE, Knobs, Observed, Plan, Preflight,
    SERVICE_SYNC_MARGIN, SourcePodFacts, TargetPodFacts, Transition,
};
pub use super::stage::{Active, Forward, Reason, Stage};
pub use crate::note::{EventKind, Note};
pub use checkpoint::{PreCopyDecision, freeze_estimate_millis, pre_copy_decision};
pub use freezes::{merge_freezes, total_frozen_millis};
pub use state::{FROZEN_POLL, IDLE_RECHECK, POLL, rank};

use state::Machine;

/// Whether a failure reason ends in `Aborted` (the user's decision or limit) rather
/// than `Failed` (something broke).
pub fn is_abort_reason(reason: &str) -> bool {
    Reason::parse(reason).is_some_and(Reason::is_abort)
}

/// The next step of a migration. Pure; see the module documentation.
pub fn next(o: &Observed) -> Transition {
    let mut t = Machine::new(o);
    t.run();
    t.finish()
}

impl Machine<'_> {
    fn run(&mut self) {
        self.merge_agent_progress();
        self.merge_freezes();
        self.resume();
        self.count_frozen();
    }

    /// Runs the handler of the stage the status is in now.
    fn resume(&mut self) {
        match Stage::of(&self.status) {
            Stage::Forward(Forward::Pending) => self.pending(),
            Stage::Forward(Forward::Active(active)) => match self.detect_failure() {
                Some((reason, message)) => self.start_rollback(reason, message),
                None => self.forward(active),
            },
            Stage::Forward(Forward::Committing) => self.committing(),
            Stage::RollingBack(reason) => self.rollback(reason),
            Stage::Terminal => self.terminal(),
        }
    }
}

/// The name of the target pod this migration may observe, hand over or delete, once
/// its status says it made one: the name only it makes (`render::target_pod_name` of
/// its source pod and its UID), never `status.targetPod` itself — whoever may write
/// `podmigrations/status` could name any pod of the namespace there, and the next
/// rollback would delete it.
pub fn target_pod_of_record(
    source_pod: &str,
    migration_uid: &str,
    status: &PodMigrationStatus,
) -> Option<String> {
    status
        .target_pod
        .as_ref()
        .map(|_| super::render::target_pod_name(source_pod, migration_uid))
}

/// Whether `pod` is the target pod of the migration `name`/`uid`: it records the
/// migration (`podmotion.io/migration`), and a PodMigration that controls it (until
/// the hand-over) is this one. A pod that merely took the name is not acted on.
pub fn is_target_pod_of(pod: &k8s_openapi::api::core::v1::Pod, name: &str, uid: &str) -> bool {
    let meta = &pod.metadata;
    let records_us = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(podmotion_api::names::annotations::MIGRATION))
        .is_some_and(|m| m == name);
    let other_owner = meta
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.kind == "PodMigration" && o.uid != uid);
    records_us && !other_owner
}

#[cfg(test)]
mod target_of_record_tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

    fn pod(name: &str, migration: Option<&str>, owner_uid: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                annotations: migration.map(|m| {
                    [(
                        podmotion_api::names::annotations::MIGRATION.to_string(),
                        m.to_string(),
                    )]
                    .into()
                }),
                owner_references: owner_uid.map(|uid| {
                    vec![OwnerReference {
                        api_version: "podmotion.io/v1alpha1".into(),
                        kind: "PodMigration".into(),
                        name: "m".into(),
                        uid: uid.into(),
                        controller: Some(true),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn a_forged_status_target_pod_names_no_pod_a_rollback_deletes() {
        let forged = PodMigrationStatus {
            target_pod: Some("payments-db-0".into()),
            ..Default::default()
        };
        let name = target_pod_of_record("web-abc", "uid-1", &forged).unwrap();
        assert_ne!(
            name, "payments-db-0",
            "status names the pod, and is not trusted"
        );
        assert_eq!(
            name,
            super::super::render::target_pod_name("web-abc", "uid-1")
        );
        assert_eq!(
            target_pod_of_record("web-abc", "uid-1", &PodMigrationStatus::default()),
            None,
            "no target pod made yet"
        );
    }

    #[test]
    fn only_a_pod_that_records_this_migration_is_its_target() {
        assert!(is_target_pod_of(
            &pod("t", Some("m"), Some("uid-1")),
            "m",
            "uid-1"
        ));
        // Handed over: no PodMigration owner, the annotation stays.
        assert!(is_target_pod_of(&pod("t", Some("m"), None), "m", "uid-1"));
        // Squatting the deterministic name, or another migration's.
        assert!(!is_target_pod_of(&pod("t", None, None), "m", "uid-1"));
        assert!(!is_target_pod_of(
            &pod("t", Some("other"), None),
            "m",
            "uid-1"
        ));
        assert!(!is_target_pod_of(
            &pod("t", Some("m"), Some("uid-2")),
            "m",
            "uid-1"
        ));
    }
}
