//! The phase machine's table: every phase × every event, the freeze-budget rule, dry
//! run, restart, and whole runs through a small simulated world that checks the
//! invariants after every step.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use podmotion_api::conditions::is_true;
use podmotion_api::migration::{MigrationPhase as P, MigrationProgress, PodMigrationStatus};
use podmotion_api::names::{condition_types as ct, reasons};

use super::agent::{AgentView, Side, Step};
use super::fixtures::*;
use super::machine::*;

const ACTIVE: [P; 4] = [
    P::Preparing,
    P::Checkpointing,
    P::Transferring,
    P::Restoring,
];
const ALL: [P; 9] = [
    P::Pending,
    P::Preparing,
    P::Checkpointing,
    P::Transferring,
    P::Restoring,
    P::Committing,
    P::Succeeded,
    P::Failed,
    P::Aborted,
];

fn has(t: &Transition, a: &Action) -> bool {
    t.actions.contains(a)
}

fn gives_up_source(t: &Transition) -> bool {
    has(t, &Action::Agent(Side::Source, Step::Commit)) || source_deletion(t).is_some()
}

/// The grace period of the source pod's deletion this transition asks for, if any.
fn source_deletion(t: &Transition) -> Option<i64> {
    t.actions.iter().find_map(|a| match a {
        Action::DeleteSourcePod { grace_seconds } => Some(*grace_seconds),
        _ => None,
    })
}

/// The commit's grace period with the fixtures' knobs (the default progress timeout).
const COMMIT_GRACE: i64 = 150;

const COMMIT: Action = Action::Agent(Side::Source, Step::Commit);

// ------------------------------------------------------------------ the table

/// Events that stop a migration before commit, each as an edit of a healthy Observed.
type Event = (&'static str, fn(Observed) -> Observed, &'static str);

fn events() -> Vec<Event> {
    vec![
        (
            "agent error",
            |o| o.source(failed(Step::Dump, "CriuDumpFailed")),
            reasons::AGENT_ERROR,
        ),
        (
            "progress timeout",
            |o| o.at_second(NOW + 151),
            reasons::PROGRESS_TIMEOUT,
        ),
        (
            "deadline",
            |o| o.at_second(CREATED + 901),
            reasons::DEADLINE_EXCEEDED,
        ),
        ("abort requested", |o| o.deleting(), reasons::ABORTED),
        (
            "source pod gone",
            |mut o| {
                o.source_pod = None;
                o
            },
            reasons::SOURCE_POD_GONE,
        ),
        (
            "target pod unschedulable",
            |mut o| {
                if let Some(t) = o.target_pod.as_mut() {
                    t.unusable = Some("OutOfmemory".into());
                    t.running = false;
                }
                o
            },
            reasons::TARGET_POD_UNSCHEDULABLE,
        ),
        (
            "probe failure",
            |o| o.target(failed(Step::Probe, "ProbeFailed")),
            reasons::PROBE_FAILED,
        ),
    ]
}

#[test]
fn every_event_before_commit_records_its_reason_and_rolls_back() {
    for phase in ACTIVE {
        for (what, edit, reason) in events() {
            let o = edit(at(phase));
            let t = next(&o);
            assert_eq!(
                t.status.failure_reason.as_deref(),
                Some(reason),
                "{phase:?} × {what}: {t:?}"
            );
            assert!(
                !gives_up_source(&t),
                "{phase:?} × {what} gave up the source: {:?}",
                t.actions
            );
            assert!(
                matches!(t.status.phase, P::Failed | P::Aborted) || t.status.phase == phase,
                "{phase:?} × {what} moved forward to {:?}",
                t.status.phase
            );
            assert!(is_true(&t.status.conditions, ct::RECONCILING) || t.status.phase.is_terminal());
            assert!(
                t.notes
                    .iter()
                    .any(|n| n.reason == reason && n.kind == EventKind::Warning),
                "{phase:?} × {what}"
            );
        }
    }
}

#[test]
fn abort_reasons_end_aborted_and_failures_end_failed() {
    for (what, edit, reason) in events() {
        // Preparing with nothing started on the agents: rollback finishes at once.
        let mut o = edit(at(P::Preparing));
        o.target_pod = None;
        o.source_agent = AgentView::reported(blank());
        o.target_agent = AgentView::reported(blank());
        if reason == reasons::AGENT_ERROR || reason == reasons::PROBE_FAILED {
            continue; // these need an agent that ran a step
        }
        let t = next(&o);
        let want = if is_abort_reason(reason) {
            P::Aborted
        } else {
            P::Failed
        };
        if reason == reasons::TARGET_POD_UNSCHEDULABLE {
            continue; // the target pod is absent here, so nothing is unschedulable
        }
        assert_eq!(t.status.phase, want, "{what}");
        assert!(is_true(&t.status.conditions, ct::STALLED), "{what}");
    }
}

#[test]
fn after_the_probe_passed_every_event_rolls_forward() {
    for (what, edit, _) in events() {
        let o = edit(at(P::Committing));
        let t = next(&o);
        assert_eq!(t.status.failure_reason, None, "Committing × {what}");
        assert!(
            !t.actions
                .iter()
                .any(|a| matches!(a, Action::Agent(_, Step::Abort))),
            "Committing × {what} aborted after the point of no return: {:?}",
            t.actions
        );
        assert!(
            !has(&t, &Action::RemoveFinalizer),
            "Committing × {what} released the finalizer early"
        );
    }
}

#[test]
fn deletion_in_every_phase_ends_with_the_finalizer_released() {
    for phase in ALL {
        // Run the world forward with deletion requested until it settles.
        let mut w = World::new(at(phase).deleting());
        w.step_until_settled(40);
        assert!(
            w.finalizer_released,
            "deleting in {phase:?} never released the finalizer; ended in {:?}",
            w.o.status.phase
        );
        assert!(!w.two_copies_seen, "{phase:?}");
        if phase != P::Committing && !phase.is_terminal() {
            assert_eq!(w.o.status.phase, P::Aborted, "{phase:?}");
            assert!(
                w.source_resumed(),
                "deleting in {phase:?} left the source frozen"
            );
        }
    }
}

#[test]
fn pending_deleted_before_start_is_aborted_without_touching_anything() {
    let t = next(&at(P::Pending).deleting());
    assert_eq!(t.status.phase, P::Aborted);
    assert_eq!(t.actions, vec![Action::RemoveFinalizer]);
}

#[test]
fn deadline_in_pending_aborts_without_starting() {
    let t = next(&at(P::Pending).at_second(CREATED + 901));
    assert_eq!(t.status.phase, P::Aborted);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::DEADLINE_EXCEEDED)
    );
    assert!(!has(&t, &Action::EnsureTargetPod));
}

#[test]
fn terminal_phases_clean_up_and_never_act_on_pods_or_agents_steps() {
    for phase in [P::Succeeded, P::Failed, P::Aborted] {
        let mut o = at(phase)
            .source(done(Step::Abort))
            .target(done(Step::Abort));
        o.transfer_key_present = true;
        let t = next(&o);
        assert_eq!(t.status.phase, phase);
        assert!(has(&t, &Action::Agent(Side::Source, Step::Cleanup)));
        assert!(has(&t, &Action::Agent(Side::Target, Step::Cleanup)));
        assert!(has(&t, &Action::DeleteTransferKey));
        assert!(!gives_up_source(&t));
    }
}

#[test]
fn a_terminal_migration_asks_an_unanswering_agent_again_until_the_progress_timeout() {
    // A replica that has just taken over (or an agent restarting) gets no answer: the
    // images that agent holds are only cleaned up if the migration is looked at again.
    for phase in [P::Succeeded, P::Failed, P::Aborted] {
        let o = at(phase)
            .source(done(Step::Cleanup))
            .target_view(AgentView::Unreachable("connection refused".into()));
        let t = next(&o);
        assert_eq!(t.requeue_after, Some(POLL), "{phase:?}");
        let o = at(phase)
            .source_view(AgentView::Missing)
            .target(done(Step::Cleanup));
        assert_eq!(next(&o).requeue_after, Some(POLL), "{phase:?}");
        // Bounded: past the progress timeout after the terminal phase it stops asking.
        let later = at(phase)
            .source(done(Step::Cleanup))
            .target_view(AgentView::Unreachable("connection refused".into()))
            .at_second(NOW + 3_600);
        assert_eq!(next(&later).requeue_after, None, "{phase:?}");
        // Both cleaned up: nothing to ask.
        let clean = at(phase)
            .source(done(Step::Cleanup))
            .target(done(Step::Cleanup));
        assert_eq!(next(&clean).requeue_after, None, "{phase:?}");
    }
}

// ---------------------------------------------------------- rollback ordering

#[test]
fn a_restored_target_is_killed_before_the_source_is_thawed() {
    let o = at(P::Restoring)
        .target(done(Step::Restore).resumed_at(ts(NOW)))
        .failing(reasons::PROBE_FAILED);
    let t = next(&o);
    assert!(has(&t, &Action::Agent(Side::Target, Step::Abort)));
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "{:?}",
        t.actions
    );

    let t = next(&o.clone().target(running(Step::Abort)));
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "thawed while the target abort ran"
    );

    let t = next(&o.target(done(Step::Abort)));
    assert!(has(&t, &Action::Agent(Side::Source, Step::Abort)));
    assert!(has(&t, &Action::DeleteTargetPod));
    assert_eq!(
        t.status.phase,
        P::Restoring,
        "rolled back only once the source is confirmed thawed"
    );
}

#[test]
fn a_failed_kill_of_the_restored_copy_removes_the_target_pod_before_the_source_thaws() {
    let o = at(P::Restoring)
        .target(failed(Step::Abort, "KillFailed"))
        .failing(reasons::PROBE_FAILED);
    let t = next(&o);
    assert!(
        has(&t, &Action::DeleteTargetPod) && has(&t, &Action::Agent(Side::Target, Step::Abort))
    );
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "{:?}",
        t.actions
    );
    let mut gone = o;
    gone.target_pod = None;
    assert!(has(&next(&gone), &Action::Agent(Side::Source, Step::Abort)));
}

#[test]
fn a_source_agent_that_cannot_kill_at_commit_leaves_it_to_the_pod_deletion() {
    for source in [blank(), failed(Step::Commit, "NotFound")] {
        let t = next(&at(P::Committing).source(source.clone()));
        assert!(
            has(&t, &Action::HandOverTargetPod),
            "{source:?}: {:?}",
            t.actions
        );
        assert!(!gives_up_source(&t), "{source:?}: {:?}", t.actions);
        let t = next(&at(P::Committing).source(source.clone()).adopted());
        assert_eq!(source_deletion(&t), Some(0), "{source:?}: {:?}", t.actions);
        assert!(!has(&t, &COMMIT), "{source:?}");
    }
    let t = next(
        &at(P::Committing)
            .source(running(Step::Commit))
            .adopted()
            .source_terminating(COMMIT_GRACE),
    );
    assert!(t.actions.is_empty(), "waits for the kill: {:?}", t.actions);
    assert_eq!(t.status.phase, P::Committing);
}

#[test]
fn an_unreachable_target_agent_must_lose_its_pod_before_the_source_thaws() {
    let o = at(P::Restoring)
        .target_view(AgentView::Unreachable("connection refused".into()))
        .failing(reasons::AGENT_ERROR);
    let t = next(&o);
    assert!(has(&t, &Action::DeleteTargetPod));
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    let mut gone = o.clone();
    gone.target_pod = None;
    let t = next(&gone);
    assert!(has(&t, &Action::Agent(Side::Source, Step::Abort)));
}

#[test]
fn rollback_completes_when_the_source_confirms_it_resumed() {
    let mut o = at(P::Transferring)
        .source(done(Step::Abort))
        .target(done(Step::Abort))
        .failing(reasons::AGENT_ERROR);
    o.target_pod = None;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Failed);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR)
    );
    assert!(is_true(&t.status.conditions, ct::STALLED));
    assert!(t.notes.iter().any(|n| n.message.contains("resumed")));
}

#[test]
fn a_source_agent_that_never_answers_again_ends_the_rollback_at_the_progress_timeout() {
    let o = at(P::Checkpointing)
        .source_view(AgentView::Unreachable("killed".into()))
        .target(done(Step::Receive));
    let t = next(&o);
    assert_eq!(
        t.status.failure_reason, None,
        "an unreachable agent gets until the progress timeout"
    );
    let late = o.at_second(NOW + 151);
    let t = next(&late);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("unreachable")
    );
    // Rollback itself is bounded by another progress timeout.
    let mut o2 = late.clone();
    o2.status = t.status.clone();
    assert_eq!(
        next(&o2).status.phase,
        P::Checkpointing,
        "keeps trying to thaw first"
    );
    let o3 = o2.at_second(NOW + 151 + 151);
    let t = next(&o3);
    assert_eq!(t.status.phase, P::Failed);
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("source state unknown")
    );
}

#[test]
fn a_source_agent_that_lost_the_migration_is_never_reported_as_resumed() {
    // The source agent restarted during the freeze: its report is blank, or its Abort
    // answers "unknown". Either way the rollback ends without saying "resumed".
    for source in [blank(), failed(Step::Abort, "MigrationUnknown")] {
        let mut o = at(P::Transferring)
            .source(source.clone())
            .target(done(Step::Abort))
            .failing(reasons::AGENT_ERROR);
        o.target_pod = None;
        let t = next(&o);
        assert_eq!(t.status.phase, P::Failed, "{source:?}");
        assert!(
            !has(&t, &Action::Agent(Side::Source, Step::Abort)),
            "an agent that does not know the migration cannot thaw it: {source:?}"
        );
        let msg = t.status.failure_message.as_deref().unwrap();
        assert!(msg.contains("source state unknown"), "{msg}");
        assert!(
            t.notes.iter().all(|n| !n.message.contains("resumed")),
            "{:?}",
            t.notes
        );
    }
}

#[test]
fn an_agent_that_forgot_the_migration_fails_it() {
    let t = next(&at(P::Transferring).source(blank()));
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR)
    );
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("lost")
    );
}

// -------------------------------------------------------------- freeze budget

fn knobs(budget: i64, rounds: i32, threshold: i64) -> Knobs {
    Knobs::from_spec(
        &spec("web-0")
            .budget_millis(budget)
            .rounds(rounds, threshold)
            .build(),
    )
}

#[test]
fn pre_copy_continues_until_the_dirty_set_fits_the_budget() {
    let k = knobs(500, 5, 1024);
    // 100 MiB dirty at 100 MiB/s = 1000 ms > 500 ms: another round.
    let r = done(Step::PreDump(1)).dirty(100 << 20, 100 << 20);
    assert_eq!(
        pre_copy_decision(1, &r, &k),
        PreCopyDecision::AnotherRound(2)
    );
    // 40 MiB at 100 MiB/s = 400 ms: freeze now.
    let r = done(Step::PreDump(2)).dirty(40 << 20, 100 << 20);
    assert_eq!(pre_copy_decision(2, &r, &k), PreCopyDecision::FinalDump);
}

#[test]
fn the_final_dump_itself_counts_against_the_freeze_budget() {
    let k = knobs(500, 5, 1024);
    // 40 MiB at 100 MiB/s is 400 ms of transfer: alone it fits 500 ms, but the final
    // dump the last round says costs 150 ms does not fit with it.
    let mut r = done(Step::PreDump(2)).dirty(40 << 20, 100 << 20);
    r.progress.dump_millis = Some(150);
    assert_eq!(
        freeze_estimate_millis(Some(40 << 20), Some(100 << 20), Some(150)),
        Some(550)
    );
    assert_eq!(
        pre_copy_decision(2, &r, &k),
        PreCopyDecision::AnotherRound(3)
    );
    r.progress.dump_millis = Some(90);
    assert_eq!(pre_copy_decision(2, &r, &k), PreCopyDecision::FinalDump);
    // No rate measured: unknown, whatever the dump costs.
    assert_eq!(freeze_estimate_millis(Some(1), None, Some(10)), None);
}

#[test]
fn the_last_round_over_budget_aborts_with_freeze_budget_exceeded() {
    let k = knobs(500, 3, 1024);
    let r = done(Step::PreDump(3)).dirty(100 << 20, 100 << 20);
    assert_eq!(
        pre_copy_decision(3, &r, &k),
        PreCopyDecision::BudgetExceeded {
            estimate_millis: Some(1000)
        }
    );
    let o = at(P::Checkpointing)
        .knobs(spec("web-0").budget_millis(500).rounds(3, 1024).build())
        .source(r);
    let t = next(&o);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::FREEZE_BUDGET_EXCEEDED)
    );
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Dump)),
        "never freezes over budget"
    );
    assert!(has(&t, &Action::Agent(Side::Source, Step::Abort)));
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("1000ms")
    );
}

#[test]
fn a_small_dirty_set_on_a_slow_link_stops_pre_copying_and_aborts() {
    // 1 MiB left (below the 4 MiB threshold) but at 1 MiB/s that is 1000 ms.
    let k = knobs(500, 5, 4 << 20);
    let r = done(Step::PreDump(1)).dirty(1 << 20, 1 << 20);
    assert!(matches!(
        pre_copy_decision(1, &r, &k),
        PreCopyDecision::BudgetExceeded { .. }
    ));
}

#[test]
fn an_unmeasured_rate_never_counts_as_fitting() {
    let k = knobs(500, 2, 0);
    let mut r = done(Step::PreDump(1));
    r.progress.dirty_bytes = Some(4096);
    assert_eq!(
        pre_copy_decision(1, &r, &k),
        PreCopyDecision::AnotherRound(2)
    );
    assert_eq!(
        pre_copy_decision(2, &r, &k),
        PreCopyDecision::BudgetExceeded {
            estimate_millis: None
        }
    );
    r.progress.dirty_bytes = Some(0);
    assert_eq!(pre_copy_decision(2, &r, &k), PreCopyDecision::FinalDump);
}

#[test]
fn a_freeze_longer_than_the_budget_without_a_restore_is_rolled_back() {
    let frozen = at(P::Transferring)
        .knobs(spec("web-0").budget_millis(500).build())
        .source(running(Step::Transfer).frozen_at(ts(NOW - 1)));
    let t = next(&frozen);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::FREEZE_BUDGET_EXCEEDED)
    );
    // Once the target resumed the budget is settled: the probe decides.
    let restored = at(P::Restoring)
        .knobs(spec("web-0").budget_millis(500).build())
        .source(done(Step::Transfer).frozen_at(ts(NOW - 1)))
        .target(running(Step::Probe).resumed_at(ts(NOW)));
    assert_eq!(next(&restored).status.failure_reason, None);
}

#[test]
fn cold_mode_dumps_without_pre_copy_rounds() {
    let o = at(P::Checkpointing)
        .knobs(spec("web-0").cold().build())
        .source(done(Step::Prepare));
    let t = next(&o);
    assert!(has(&t, &Action::Agent(Side::Source, Step::Dump)));
    assert!(
        !t.actions
            .iter()
            .any(|a| matches!(a, Action::Agent(_, Step::PreDump(_))))
    );
}

// ------------------------------------------------------------- pending, dry run

#[test]
fn dry_run_runs_the_checks_and_freezes_nothing() {
    let o = at(P::Pending).knobs(spec("web-0").dry_run().build());
    let t = next(&o);
    assert_eq!(t.status.phase, P::Succeeded);
    assert!(is_true(&t.status.conditions, ct::MIGRATABLE));
    assert!(is_true(&t.status.conditions, ct::READY));
    assert_eq!(
        t.status
            .conditions
            .iter()
            .find(|c| c.type_ == ct::READY)
            .unwrap()
            .reason,
        reasons::DRY_RUN_PASSED
    );
    assert!(
        t.actions
            .iter()
            .all(|a| matches!(a, Action::DeleteTransferKey)),
        "{:?}",
        t.actions
    );
}

#[test]
fn dry_run_of_an_unmigratable_pod_fails_with_the_reason() {
    let mut o = at(P::Pending).knobs(spec("web-0").dry_run().build());
    o.preflight = Some(Preflight::NotMigratable {
        reason: reasons::NO_AGENT_ON_NODE,
        message: "no agent".into(),
    });
    let t = next(&o);
    assert_eq!(t.status.phase, P::Failed);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::NO_AGENT_ON_NODE)
    );
    assert!(!is_true(&t.status.conditions, ct::MIGRATABLE));
}

#[test]
fn an_unmigratable_pod_stays_pending_and_stalled_with_the_reason() {
    let mut o = at(P::Pending);
    o.preflight = Some(Preflight::NotMigratable {
        reason: reasons::TARGET_DOES_NOT_FIT,
        message: "full".into(),
    });
    let t = next(&o);
    assert_eq!(t.status.phase, P::Pending);
    assert!(is_true(&t.status.conditions, ct::STALLED));
    assert!(!is_true(&t.status.conditions, ct::MIGRATABLE));
    assert!(t.actions.is_empty(), "{:?}", t.actions);
    assert!(t.requeue_after.is_some());
}

#[test]
fn without_a_free_slot_the_migration_waits_queued() {
    let mut o = at(P::Pending);
    o.slot_available = false;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Pending);
    assert_eq!(
        t.status
            .conditions
            .iter()
            .find(|c| c.type_ == ct::RECONCILING)
            .unwrap()
            .reason,
        reasons::QUEUED
    );
    assert!(!has(&t, &Action::EnsureTargetPod));
}

#[test]
fn a_migratable_pod_starts_preparing_its_key_and_target_pod() {
    let t = next(&at(P::Pending));
    assert_eq!(t.status.phase, P::Preparing);
    assert_eq!(
        t.actions,
        vec![Action::EnsureTransferKey, Action::EnsureTargetPod]
    );
    assert_eq!(t.status.source_pod_uid.as_deref(), Some(SOURCE_UID));
    assert_eq!(t.status.target_node.as_deref(), Some("n1"));
    assert_eq!(
        t.status.phase_transition_timestamps.last().unwrap().phase,
        P::Preparing
    );
}

// ---------------------------------------------------------------- restart

#[test]
fn an_operator_restart_resumes_from_persisted_status_and_agent_reports() {
    // After a restart the operator knows only what the API server and the agents say:
    // the status round-trips through JSON. The decision must be exactly the same.
    for phase in ALL {
        let o = at(phase);
        let before = next(&o);
        let mut restarted = o.clone();
        let json = serde_json::to_string(&o.status).unwrap();
        restarted.status = serde_json::from_str::<PodMigrationStatus>(&json).unwrap();
        assert_eq!(next(&restarted), before, "{phase:?}");
    }
}

#[test]
fn a_restart_after_the_restore_reissues_the_probe_not_the_restore() {
    let t = next(&at(P::Restoring).target(done(Step::Restore).resumed_at(ts(NOW))));
    assert!(has(&t, &Action::Agent(Side::Target, Step::Probe)));
    assert!(!has(&t, &Action::Agent(Side::Target, Step::Restore)));
}

#[test]
fn a_restart_in_preparing_reuses_the_target_pod_it_already_created() {
    let t = next(&at(P::Preparing));
    assert!(!has(&t, &Action::EnsureTargetPod), "{:?}", t.actions);
    assert!(has(&t, &Action::Agent(Side::Source, Step::Prepare)));
    assert!(has(&t, &Action::Agent(Side::Target, Step::Receive)));
}

// ------------------------------------------------------------ commit and status

#[test]
fn the_source_is_given_up_only_after_the_probe_passed() {
    let t = next(&at(P::Restoring).target(running(Step::Probe)));
    assert_eq!(t.status.phase, P::Restoring);
    assert!(!gives_up_source(&t));
    let t = next(&at(P::Restoring).target(done(Step::Probe)));
    assert_eq!(t.status.phase, P::Committing);
    assert!(has(&t, &Action::LowerSourceDeletionCost));
    assert!(has(&t, &Action::HandOverTargetPod));
    // Neither killed nor deleted before the workload's controller adopted the target.
    assert!(!gives_up_source(&t), "{:?}", t.actions);
}

#[test]
fn committing_resumes_after_a_restart_even_when_the_probe_is_no_longer_reported() {
    // The wire adapter keeps a passed probe in memory only; after a restart the target
    // reports its restore as the last step. The persisted phase is the proof.
    let o = at(P::Committing).target(done(Step::Restore));
    let t = next(&o);
    assert!(has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    let t = next(
        &o.adopted()
            .source_terminating(COMMIT_GRACE)
            .kubelet_settled(),
    );
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
}

/// The commit's whole order: hand-over, adoption, the source pod's deletion with a
/// grace period, and only then the agent's kill, which the grace period lets win.
#[test]
fn commit_hands_over_waits_for_adoption_deletes_the_source_pod_then_kills_the_source() {
    let o = at(P::Committing);
    let t = next(&o);
    assert!(has(&t, &Action::HandOverTargetPod));
    assert!(!gives_up_source(&t), "{:?}", t.actions);
    let mut waiting = o.clone();
    waiting.target_pod.as_mut().unwrap().handed_over = true;
    waiting.target_pod.as_mut().unwrap().awaiting_adoption = true;
    let t = next(&waiting);
    assert!(
        !gives_up_source(&t),
        "source given up before the ReplicaSet adopted the target: {:?}",
        t.actions
    );
    let adopted = o.adopted();
    let t = next(&adopted);
    assert_eq!(source_deletion(&t), Some(COMMIT_GRACE), "{:?}", t.actions);
    assert!(!has(&t, &COMMIT), "{:?}", t.actions);
    let terminating = adopted.source_terminating(COMMIT_GRACE);
    let t = next(&terminating);
    assert!(
        !has(&t, &COMMIT),
        "killed before the kubelet saw the deletion: {:?}",
        t.actions
    );
    let terminating = terminating.kubelet_settled();
    let t = next(&terminating);
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    let t = next(&terminating.clone().source(running(Step::Commit)));
    assert!(t.actions.is_empty(), "{:?}", t.actions);
    let t = next(&terminating.clone().source(done(Step::Commit)));
    assert_eq!(t.status.phase, P::Succeeded);
    assert!(is_true(&t.status.conditions, ct::READY));
    assert_eq!(t.status.failure_message, None);
    let note = t
        .notes
        .iter()
        .find(|n| n.reason == reasons::SUCCEEDED)
        .expect("success event");
    assert_eq!(note.kind, EventKind::Normal);
    // The kill confirmed and the pod gone (its kubelet finished): the same.
    let mut gone = terminating.source(done(Step::Commit));
    gone.source_pod = None;
    assert_eq!(next(&gone).status.phase, P::Succeeded);
}

/// (a) The frozen source's container is never killed while its pod is not terminating:
/// the kubelet would restart it from its image beside the restored copy.
#[test]
fn no_commit_is_asked_before_the_source_pod_is_terminating() {
    let not_terminating = [
        at(P::Committing),
        at(P::Committing).at_second(NOW + 100),
        {
            let mut o = at(P::Committing);
            let tp = o.target_pod.as_mut().unwrap();
            tp.handed_over = true;
            tp.awaiting_adoption = true;
            o
        },
        at(P::Committing).adopted(),
        at(P::Committing).adopted().deleting(),
    ];
    for o in not_terminating {
        let t = next(&o);
        assert!(
            !has(&t, &COMMIT),
            "killed with its pod not terminating: {:?} from {:?}",
            t.actions,
            o.target_pod
        );
    }
    // Deleted by its ReplicaSet (two active pods once the target is adopted), with the
    // pod's own grace period: terminating counts as deleted; the kill follows once the
    // kubelet has had the time to see the deletion.
    let t = next(
        &at(P::Committing)
            .adopted()
            .source_terminating(30)
            .kubelet_settled(),
    );
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
}

/// (a') The kill waits [`Knobs::kill_settle`] from the accepted deletion: the kubelet
/// sees it through its watch (a container that dies before that is restarted), and
/// the Services program the source out (a connection still sent to it after the kill
/// is refused). It asks to be reconciled again when that wait ends, not a poll later.
/// With the default sync period the Services decide (2.5 s); with none, the kubelet
/// (1.5 s).
#[test]
fn the_kill_waits_for_the_kubelet_and_the_services_to_let_the_source_go() {
    for (sync_ms, settle_ms) in [(1_000, 2_500), (0, 1_500), (3_000, 4_500)] {
        let mut deleted = at(P::Committing).adopted().source_terminating(150);
        deleted.knobs = deleted
            .knobs
            .clone()
            .with_service_sync(Duration::from_millis(sync_ms));
        assert_eq!(
            deleted.knobs.kill_settle(),
            Duration::from_millis(settle_ms)
        );
        let accepted = deleted
            .source_pod
            .as_ref()
            .unwrap()
            .deletion_accepted
            .unwrap();
        for after_ms in [0, 100, 1_000, settle_ms - 1] {
            let mut o = deleted.clone();
            o.now = accepted + Duration::from_millis(after_ms);
            let t = next(&o);
            assert!(
                !has(&t, &COMMIT),
                "sync {sync_ms} ms: killed {after_ms} ms after: {:?}",
                t.actions
            );
            assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
            let wait = t.requeue_after.expect("a requeue");
            assert!(
                wait <= Duration::from_millis(settle_ms - after_ms),
                "sync {sync_ms} ms, {after_ms} ms after: requeue in {wait:?}"
            );
            assert_eq!(t.status.phase, P::Committing);
        }
        for after_ms in [settle_ms, settle_ms + 1, 60_000] {
            let mut o = deleted.clone();
            o.now = accepted + Duration::from_millis(after_ms);
            let t = next(&o);
            assert!(
                has(&t, &COMMIT),
                "sync {sync_ms} ms: not killed {after_ms} ms after: {:?}",
                t.actions
            );
        }
    }
    let deleted = at(P::Committing).adopted().source_terminating(150);
    // A pod already gone (its kubelet ended it, or a deletion with grace 0): nothing to
    // wait for.
    let mut gone = deleted.clone();
    gone.source_pod = None;
    assert!(has(&next(&gone), &COMMIT));
}

/// (b) While the agent's kill is to come, the source pod is deleted with the commit's
/// grace period (the progress timeout), not 0: the kubelet's SIGKILL must not come
/// first (the network still locked: no FIN).
#[test]
fn the_source_pod_is_deleted_with_a_grace_period_when_its_agent_kills_it() {
    let t = next(&at(P::Committing).adopted());
    assert_eq!(source_deletion(&t), Some(COMMIT_GRACE), "{:?}", t.actions);
    let mut o = at(P::Committing).adopted();
    o.knobs.progress_timeout = Duration::from_secs(40);
    let t = next(&o);
    assert_eq!(source_deletion(&t), Some(40), "{:?}", t.actions);
    // A kill already under way (a commit of the order before this one) too.
    let t = next(&at(P::Committing).adopted().source(running(Step::Commit)));
    assert_eq!(source_deletion(&t), Some(COMMIT_GRACE), "{:?}", t.actions);
}

/// (c) A kill the agent does not confirm: the deletion is the kill, with grace period 0,
/// also when the pod was already terminating with a grace period (it is shortened).
#[test]
fn the_source_pod_is_deleted_with_grace_period_zero_when_the_kill_is_unconfirmed() {
    let unconfirmed = [
        AgentView::Unreachable("connection refused".into()),
        AgentView::Missing,
        AgentView::reported(blank()),
        AgentView::reported(failed(Step::Commit, "KillFailed")),
    ];
    for view in unconfirmed {
        let o = at(P::Committing).adopted().source_view(view.clone());
        let t = next(&o);
        assert_eq!(source_deletion(&t), Some(0), "{view:?}: {:?}", t.actions);
        assert!(!has(&t, &COMMIT), "{view:?}");
        let t = next(&o.clone().source_terminating(COMMIT_GRACE));
        assert_eq!(source_deletion(&t), Some(0), "{view:?}: {:?}", t.actions);
        assert_eq!(t.status.phase, P::Committing, "{view:?}");
        // Accepted (grace 0 recorded; a pod its finalizers hold stays so): done.
        let t = next(&o.source_terminating(0));
        assert_eq!(source_deletion(&t), None, "{view:?}: {:?}", t.actions);
        assert_eq!(t.status.phase, P::Succeeded, "{view:?}");
    }
    // No answer within the bound: the same.
    let t = next(
        &at(P::Committing)
            .adopted()
            .source(running(Step::Commit))
            .source_terminating(COMMIT_GRACE)
            .at_second(NOW + 151),
    );
    assert_eq!(source_deletion(&t), Some(0), "{:?}", t.actions);
}

/// (c') The kill's bound counts from the source pod's deletion, not from entering
/// `Committing`: an adoption slower than the progress timeout (the controller manager
/// away with its API server, in a chaos run) once made the machine give the kill up
/// before it asked for it, and the frozen source was left to the pod's deletion.
#[test]
fn a_slow_adoption_does_not_count_against_the_kill() {
    // The adoption's own bound counts from the hand-over, however late it came.
    let late_hand_over = next(&at(P::Committing).at_second(NOW + COMMIT_GRACE + 20));
    assert!(has(&late_hand_over, &Action::HandOverTargetPod));
    let mut awaiting = at(P::Committing).at_second(NOW + COMMIT_GRACE + 21);
    awaiting.status = late_hand_over.status.clone();
    let tp = awaiting.target_pod.as_mut().unwrap();
    tp.handed_over = true;
    tp.awaiting_adoption = true;
    let t = next(&awaiting);
    assert_eq!(t.status.phase, P::Committing, "{:?}", t.status);
    assert!(!has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    let t = next(&awaiting.at_second(NOW + 2 * COMMIT_GRACE + 22));
    assert_eq!(t.status.phase, P::Failed, "{:?}", t.status);
    let late = NOW + COMMIT_GRACE + 20;
    let adopted_late = at(P::Committing).adopted().at_second(late);
    let t = next(&adopted_late);
    assert_eq!(source_deletion(&t), Some(COMMIT_GRACE), "{:?}", t.actions);
    assert!(t.status.failure_message.is_none(), "{:?}", t.status);
    // Deleted: the kill is asked once the kubelet had the time to see it.
    let deleted = adopted_late
        .clone()
        .source_terminating(COMMIT_GRACE)
        .kubelet_settled();
    let t = next(&deleted);
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    // Asked and running: waited for, up to the bound from the deletion.
    let asked = deleted.source(running(Step::Commit));
    let t = next(&asked.clone().at_second(late + COMMIT_GRACE));
    assert!(t.actions.is_empty(), "{:?}", t.actions);
    assert_eq!(t.status.phase, P::Committing);
    let t = next(&asked.clone().at_second(late + COMMIT_GRACE + 2));
    assert_eq!(source_deletion(&t), Some(0), "{:?}", t.actions);
    let msg = t.status.failure_message.clone().unwrap_or_default();
    assert!(msg.contains("did not confirm the kill"), "{msg}");
    // That grace-0 deletion is a later deletion: the decision stands.
    let mut zero = asked
        .at_second(late + COMMIT_GRACE + 3)
        .source_terminating(0);
    zero.status = t.status.clone();
    let t = next(&zero);
    assert_eq!(t.status.phase, P::Succeeded, "{:?}", t.status);
}

/// (d) An operator restart anywhere in the commit resumes it from what it observes:
/// before the deletion it deletes, after it (the pod terminating, the kill not asked
/// or not answered) it asks the kill, never another deletion.
#[test]
fn a_restart_mid_commit_asks_the_kill_of_a_terminating_source_not_another_deletion() {
    // The pod was deleted, the operator restarted before it asked the kill.
    let o = at(P::Committing)
        .adopted()
        .source_terminating(COMMIT_GRACE)
        .kubelet_settled();
    let t = next(&o);
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    // Restarted after asking the kill: it waits for the agent.
    let t = next(&o.clone().source(running(Step::Commit)));
    assert!(t.actions.is_empty(), "{:?}", t.actions);
    // Restarted before the deletion: the deletion, not the kill.
    let t = next(&at(P::Committing).adopted());
    assert_eq!(source_deletion(&t), Some(COMMIT_GRACE), "{:?}", t.actions);
    assert!(!has(&t, &COMMIT), "{:?}", t.actions);
    // Restarted after the kill: done, whatever the agent's last step says now.
    for source in [done(Step::Commit), done(Step::Cleanup)] {
        let t = next(&o.clone().source(source));
        assert_eq!(t.status.phase, P::Succeeded);
        assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    }
}

/// The source pod gone before the kill was asked (its kubelet's SIGKILL at the end of
/// the grace period, or a forced deletion): the agent is asked all the same (a tree
/// that still runs, a forced deletion's, gets the FIN; a dead one counts as killed),
/// and the status notes that its peers may have got no FIN.
#[test]
fn a_source_pod_gone_before_the_kill_still_asks_the_agent_and_says_so() {
    let mut o = at(P::Committing).adopted();
    o.source_pod = None;
    let t = next(&o);
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None);
    let msg = t.status.failure_message.clone().unwrap_or_default();
    assert!(msg.contains("was gone before its agent"), "{msg}");
    assert!(msg.contains("no FIN"), "{msg}");
    // The agent confirms: Succeeded, the note kept, no Warning (the kill is confirmed).
    let mut done_o = o.clone().source(done(Step::Commit));
    done_o.status = t.status.clone();
    let t = next(&done_o);
    assert_eq!(t.status.phase, P::Succeeded);
    let note = t
        .notes
        .iter()
        .find(|n| n.reason == reasons::SUCCEEDED)
        .expect("success event");
    assert_eq!(note.kind, EventKind::Normal);
    assert!(note.message.contains("no FIN"), "{}", note.message);
    // An agent that cannot answer: the pod's deletion was the kill.
    let t = next(&o.source_view(AgentView::Missing));
    assert_eq!(t.status.phase, P::Succeeded);
    assert!(
        t.notes
            .iter()
            .any(|n| n.reason == reasons::SUCCEEDED && n.kind == EventKind::Warning),
        "{:?}",
        t.notes
    );
}

/// The restored pod deleted during the commit (its ReplicaSet chose it over the source,
/// someone deleted it): the state goes with it. Never `Succeeded`, and the stale source
/// is never thawed: its agent kills it (its pod kept: its container restarts from its
/// image as the workload's replica), then the migration fails.
#[test]
fn a_target_pod_deleted_during_the_commit_fails_it_killing_never_thawing_the_source() {
    let mut o = at(P::Committing).adopted();
    o.target_pod.as_mut().unwrap().terminating = true;
    let t = next(&o);
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
    assert_eq!(source_deletion(&t), None, "{:?}", t.actions);
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    assert_eq!(t.status.phase, P::Committing);
    let t = next(&o.clone().source(done(Step::Commit)));
    assert_eq!(t.status.phase, P::Failed, "{:?}", t.status);
    let msg = t.status.failure_message.as_deref().unwrap();
    assert!(msg.contains("deleted during commit"), "{msg}");
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    // The target pod gone entirely: the same, and an agent that cannot kill leaves it
    // to the source pod's deletion (grace 0).
    o.target_pod = None;
    let t = next(&o.clone().source_view(AgentView::Missing));
    assert_eq!(source_deletion(&t), Some(0), "{:?}", t.actions);
    let mut gone = o.source_view(AgentView::Missing);
    gone.source_pod = None;
    let t = next(&gone);
    assert_eq!(t.status.phase, P::Failed);
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("disappeared during commit")
    );
}

#[test]
fn progress_never_runs_backwards() {
    let mut o = at(P::Checkpointing).source(running(Step::PreDump(2)).sent(1, 500));
    o.status.progress = Some(MigrationProgress {
        iteration: 3,
        bytes_sent: 1000,
        ..Default::default()
    });
    let t = next(&o);
    let p = t.status.progress.unwrap();
    assert_eq!((p.iteration, p.bytes_sent), (3, 1000));
    let t = next(&o.source(running(Step::PreDump(4)).sent(4, 2000)));
    let p = t.status.progress.unwrap();
    assert_eq!((p.iteration, p.bytes_sent), (4, 2000));
    assert_eq!(
        p.last_progress_time.unwrap().0,
        ts(NOW),
        "growth counts as progress"
    );
}

#[test]
fn growing_bytes_hold_off_the_progress_timeout() {
    let mut o = at(P::Transferring).source(running(Step::Transfer).sent(0, 10));
    o.knobs.freeze_budget_millis = 10_000_000;
    let o = o.at_second(NOW + 140);
    let t = next(&o);
    assert_eq!(t.status.failure_reason, None);
    let mut later = o.clone().at_second(NOW + 140 + 151);
    later.status = t.status.clone();
    assert_eq!(
        next(&later).status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    let mut moving = later.clone().source(running(Step::Transfer).sent(0, 20));
    moving.status = t.status;
    assert_eq!(next(&moving).status.failure_reason, None);
}

#[test]
fn downtime_is_measured_from_freeze_to_resume() {
    let o = at(P::Restoring)
        .source(done(Step::Transfer).frozen_at(ts(NOW)))
        .target(done(Step::Restore).resumed_at(ts(NOW) + Duration::from_millis(183)));
    let t = next(&o);
    assert_eq!(t.status.downtime_millis, Some(183));
    assert_eq!(t.status.downtime.as_deref(), Some("183ms"));
}

// ------------------------------------------------------------- whole runs

/// A small world that carries out the machine's actions: agents complete each step
/// on the next tick, the ReplicaSet adopts a handed-over pod one tick later.
struct World {
    o: Observed,
    source_frozen: bool,
    source_killed: bool,
    target_running: bool,
    finalizer_released: bool,
    two_copies_seen: bool,
    commit_before_probe: bool,
    /// The source agent acknowledged the restore fence (and no Abort lifted it).
    source_fenced: bool,
    /// The target was asked to restore while the source was not fenced.
    restore_before_fence: bool,
    fail_step: Option<(Side, Step)>,
    adopt_next_tick: bool,
    /// The ReplicaSet deletes the source pod itself (its own grace period) as it adopts
    /// the target (two active pods).
    replicaset_deletes_source: bool,
    /// The source was killed while its pod was not terminating, or before its kubelet
    /// could have seen the deletion ([`KUBELET_SETTLE`]): its kubelet would restart the
    /// container from its image beside the restored copy.
    killed_before_its_pod_terminated: bool,
    /// The true instant of the source pod's (latest) deletion: the API's
    /// `deletionTimestamp` is to the second, this is not.
    source_deleted_at: Option<Timestamp>,
    /// The source was killed before the Services could have programmed it out
    /// ([`Knobs::service_sync`] + [`SERVICE_SYNC_MARGIN`] after its deletion): a
    /// connection they still send to it is refused.
    killed_while_the_services_may_send: bool,
}

impl World {
    fn new(o: Observed) -> World {
        let source_frozen = matches!(
            o.status.phase,
            P::Transferring | P::Restoring | P::Committing
        );
        let target_running = o.status.phase == P::Committing;
        let source_fenced = matches!(o.status.phase, P::Restoring | P::Committing);
        let source_deleted_at = o.source_pod.as_ref().and_then(|s| s.deletion_accepted);
        World {
            o,
            source_frozen,
            source_killed: false,
            target_running,
            finalizer_released: false,
            two_copies_seen: false,
            commit_before_probe: false,
            source_fenced,
            restore_before_fence: false,
            fail_step: None,
            adopt_next_tick: false,
            replicaset_deletes_source: false,
            killed_before_its_pod_terminated: false,
            source_deleted_at,
            killed_while_the_services_may_send: false,
        }
    }

    fn source_resumed(&self) -> bool {
        !self.source_frozen && !self.source_killed
    }

    fn tick(&mut self) -> Transition {
        let t = next(&self.o);
        self.o.status = t.status.clone();
        self.o.preflight = None;
        if self.adopt_next_tick {
            if let Some(tp) = self.o.target_pod.as_mut() {
                tp.awaiting_adoption = false;
            }
            if self.replicaset_deletes_source
                && let Some(s) = self.o.source_pod.as_mut()
            {
                s.terminating = true;
                s.deletion_grace_seconds = Some(30);
                s.deletion_accepted = Some(whole_second(self.o.now));
                self.source_deleted_at = Some(self.o.now);
            }
            self.adopt_next_tick = false;
        }
        for a in &t.actions {
            self.apply(a);
        }
        if self.source_resumed() && self.source_running_pod() && self.target_running {
            self.two_copies_seen = true;
        }
        self.o.now += Duration::from_millis(100);
        t
    }

    fn source_running_pod(&self) -> bool {
        self.o.source_pod.is_some()
    }

    fn report_mut(&mut self, side: Side) -> &mut super::agent::AgentReport {
        let view = match side {
            Side::Source => &mut self.o.source_agent,
            Side::Target => &mut self.o.target_agent,
        };
        if !matches!(view, AgentView::Reported(_)) {
            *view = AgentView::reported(blank());
        }
        match view {
            AgentView::Reported(r) => r,
            _ => unreachable!(),
        }
    }

    fn apply(&mut self, a: &Action) {
        let now = self.o.now;
        match a {
            Action::RemoveFinalizer => self.finalizer_released = true,
            Action::EnsureTransferKey => self.o.transfer_key_present = true,
            Action::DeleteTransferKey => self.o.transfer_key_present = false,
            Action::EnsureTargetPod => {
                self.o.target_pod.get_or_insert(TargetPodFacts {
                    running: true,
                    unusable: None,
                    terminating: false,
                    handed_over: false,
                    awaiting_adoption: false,
                });
            }
            Action::DeleteTargetPod => {
                self.o.target_pod = None;
                self.target_running = false;
            }
            Action::LowerSourceDeletionCost => {
                if let Some(s) = self.o.source_pod.as_mut() {
                    s.deletion_cost_lowered = true;
                }
            }
            Action::HandOverTargetPod => {
                let tp = self
                    .o
                    .target_pod
                    .as_mut()
                    .expect("hand over of a missing pod");
                tp.handed_over = true;
                tp.awaiting_adoption = true;
                self.adopt_next_tick = true;
            }
            // Grace 0: the object goes at once and the kubelet kills the tree. Otherwise
            // the pod terminates, and the frozen tree ignores the SIGTERM.
            Action::DeleteSourcePod { grace_seconds: 0 } => {
                self.o.source_pod = None;
                if self.source_frozen {
                    self.source_killed = true;
                    self.source_frozen = false;
                }
            }
            Action::DeleteSourcePod { grace_seconds } => {
                if let Some(s) = self.o.source_pod.as_mut() {
                    s.terminating = true;
                    // The API server only ever shortens a deletion's grace period, and
                    // a shortened one moves the deletion's time to now.
                    let g = s.deletion_grace_seconds.unwrap_or(i64::MAX);
                    if *grace_seconds < g {
                        s.deletion_grace_seconds = Some(*grace_seconds);
                        s.deletion_accepted = Some(whole_second(now));
                        self.source_deleted_at = Some(now);
                    }
                }
            }
            Action::Agent(side, step) => {
                if self.fail_step == Some((*side, *step)) {
                    *self.report_mut(*side) = failed(*step, "Injected");
                    return;
                }
                match (side, step) {
                    (Side::Source, Step::Dump) => self.source_frozen = true,
                    (Side::Source, Step::Fence) => self.source_fenced = true,
                    (Side::Source, Step::Abort) => {
                        self.source_frozen = false;
                        self.source_fenced = false;
                    }
                    (Side::Source, Step::Commit) => {
                        if !self
                            .o
                            .target_agent
                            .report()
                            .is_some_and(|r| r.done(Step::Probe))
                        {
                            self.commit_before_probe = true;
                        }
                        self.source_killed = true;
                        self.source_frozen = false;
                        let unseen = |s: &SourcePodFacts| {
                            !s.terminating
                                || s.deletion_accepted.is_none_or(|d| {
                                    now.duration_since(d) < KUBELET_SETTLE.try_into().unwrap()
                                })
                        };
                        let settle = self.o.knobs.service_sync + SERVICE_SYNC_MARGIN;
                        if self.o.source_pod.is_some()
                            && self
                                .source_deleted_at
                                .is_none_or(|d| now.duration_since(d) < settle.try_into().unwrap())
                        {
                            self.killed_while_the_services_may_send = true;
                        }
                        match &self.o.source_pod {
                            Some(s) if unseen(s) => self.killed_before_its_pod_terminated = true,
                            // The container exited: the kubelet ends the terminating pod.
                            Some(_) => self.o.source_pod = None,
                            None => {}
                        }
                    }
                    (Side::Target, Step::Restore) => {
                        if !self.source_fenced {
                            self.restore_before_fence = true;
                        }
                        self.target_running = true;
                    }
                    (Side::Target, Step::Abort) => self.target_running = false,
                    _ => {}
                }
                let r = self.report_mut(*side);
                let mut progress = r.progress.clone();
                match step {
                    Step::PreDump(n) => {
                        progress.iteration = *n;
                        progress.bytes_sent += 64 << 20;
                        progress.dirty_bytes = Some((256u64 << 20) >> (2 * n));
                        progress.rate_bytes_per_second = Some(100 << 20);
                    }
                    Step::Dump => progress.frozen_at = Some(now),
                    Step::Transfer => progress.bytes_sent += 4 << 20,
                    Step::Fence => progress.fenced = true,
                    Step::Abort => progress.fenced = false,
                    Step::Restore => progress.resumed_at = Some(now + Duration::from_millis(150)),
                    _ => {}
                }
                *r = done(*step);
                r.progress = progress;
            }
        }
    }

    fn step_until_settled(&mut self, max: usize) -> Vec<P> {
        let mut phases = vec![self.o.status.phase];
        for _ in 0..max {
            let t = self.tick();
            if phases.last() != Some(&t.status.phase) {
                phases.push(t.status.phase);
            }
            let settled = t.status.phase.is_terminal()
                && t.actions
                    .iter()
                    .all(|a| !matches!(a, Action::Agent(_, Step::Abort)))
                && (!self.o.deletion_requested || self.finalizer_released);
            if settled {
                // One more tick to run cleanup.
                self.tick();
                break;
            }
        }
        phases
    }
}

fn fresh() -> Observed {
    // The shell's finalizer is on before the machine first runs.
    let mut o = at(P::Pending);
    o.target_pod = None;
    o.transfer_key_present = false;
    o.status = PodMigrationStatus::default();
    o.knobs = Knobs::from_spec(&spec("web-0").budget_millis(500).build());
    o
}

#[test]
fn a_pre_copy_migration_walks_every_phase_to_succeeded() {
    for replicaset_deletes_source in [false, true] {
        let mut w = World::new(fresh());
        w.replicaset_deletes_source = replicaset_deletes_source;
        walks_every_phase_to_succeeded(w);
    }
}

fn walks_every_phase_to_succeeded(mut w: World) {
    let phases = w.step_until_settled(60);
    assert_eq!(
        phases,
        vec![
            P::Pending,
            P::Preparing,
            P::Checkpointing,
            P::Transferring,
            P::Restoring,
            P::Committing,
            P::Succeeded
        ]
    );
    assert!(!w.two_copies_seen && !w.commit_before_probe);
    assert!(
        w.source_fenced && !w.restore_before_fence,
        "the target restored before the source was fenced"
    );
    assert!(w.source_killed && w.target_running && w.o.source_pod.is_none());
    assert!(
        !w.killed_before_its_pod_terminated,
        "the source was killed before its pod terminated: its container restarts afresh"
    );
    assert!(
        !w.killed_while_the_services_may_send,
        "the source was killed before the Services programmed it out"
    );
    assert_eq!(w.o.status.failure_message, None, "{:?}", w.o.status);
    let s = &w.o.status;
    let frozen =
        w.o.source_agent
            .report()
            .unwrap()
            .progress
            .frozen_at
            .unwrap();
    let resumed =
        w.o.target_agent
            .report()
            .and_then(|r| r.progress.resumed_at);
    let measured = resumed.map(|r| r.duration_since(frozen).as_millis() as i64);
    assert!(
        s.downtime_millis.is_some() && s.downtime_millis >= Some(150),
        "{:?}",
        s.downtime_millis
    );
    let _ = measured; // the target forgets after Cleanup; the status keeps it
    assert!(
        s.progress.as_ref().unwrap().iteration >= 2,
        "{:?}",
        s.progress
    );
    assert!(!w.o.transfer_key_present, "transfer key left behind");
    assert_eq!(s.phase_transition_timestamps.len(), 6);
}

#[test]
fn a_failure_at_any_step_resumes_the_source_and_never_runs_two_copies() {
    let steps = [
        (Side::Source, Step::Prepare),
        (Side::Target, Step::Receive),
        (Side::Source, Step::PreDump(1)),
        (Side::Source, Step::PreDump(2)),
        (Side::Source, Step::Dump),
        (Side::Source, Step::Transfer),
        (Side::Target, Step::Restore),
        (Side::Target, Step::Probe),
    ];
    for (side, step) in steps {
        let mut w = World::new(fresh());
        w.fail_step = Some((side, step));
        w.step_until_settled(80);
        let want = if step == Step::Probe {
            reasons::PROBE_FAILED
        } else {
            reasons::AGENT_ERROR
        };
        assert_eq!(w.o.status.phase, P::Failed, "{side} {step}");
        assert_eq!(
            w.o.status.failure_reason.as_deref(),
            Some(want),
            "{side} {step}"
        );
        assert!(
            w.source_resumed(),
            "{side} {step}: source left frozen or killed"
        );
        assert!(
            !w.target_running,
            "{side} {step}: restored copy left running"
        );
        assert!(
            w.o.target_pod.is_none(),
            "{side} {step}: target pod left behind"
        );
        assert!(
            !w.two_copies_seen && !w.commit_before_probe && !w.restore_before_fence,
            "{side} {step}"
        );
    }
}

#[test]
fn a_cold_migration_goes_straight_to_the_final_dump() {
    let mut o = fresh();
    o.knobs = Knobs::from_spec(&spec("web-0").cold().build());
    let mut w = World::new(o);
    w.step_until_settled(60);
    assert_eq!(w.o.status.phase, P::Succeeded);
    assert_eq!(w.o.status.progress.as_ref().map(|p| p.iteration), Some(0));
}

#[test]
fn the_controller_polls_fast_only_while_the_source_is_frozen() {
    // Every poll the frozen pod waits for is downtime; outside the freeze the slower
    // poll keeps the API and agent load low.
    let cases = [
        (P::Preparing, POLL),
        (P::Checkpointing, POLL), // pre-copy round running: the pod still runs
        (P::Transferring, FROZEN_POLL),
        (P::Restoring, FROZEN_POLL),
    ];
    for (phase, want) in cases {
        let t = next(&at(phase));
        assert_eq!(t.requeue_after, Some(want), "{phase:?}");
    }
    // The final dump runs: frozen from its start.
    let t = next(&at(P::Checkpointing).source(running(Step::Dump)));
    assert_eq!(t.requeue_after, Some(FROZEN_POLL));
    // A last pre-copy round that fits the budget asks for the final dump: the next
    // poll already finds the pod frozen.
    let mut done_round = done(Step::PreDump(1));
    done_round.progress.dirty_bytes = Some(0);
    let t = next(&at(P::Checkpointing).source(done_round));
    assert!(
        has(&t, &Action::Agent(Side::Source, Step::Dump)),
        "{:?}",
        t.actions
    );
    assert_eq!(t.requeue_after, Some(FROZEN_POLL));
}

#[test]
fn a_target_agent_that_forgot_after_a_restore_holds_the_thaw_until_the_target_pod_is_gone() {
    // Failed while restoring; the target agent restarted and reports nothing.
    let o = at(P::Restoring)
        .failing(reasons::AGENT_ERROR)
        .target(blank());
    let t = next(&o);
    assert!(has(&t, &Action::DeleteTargetPod), "{:?}", t.actions);
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "the source must not be thawed while a restored copy may run: {:?}",
        t.actions
    );
    // Once the pod is gone, no copy can run there: thaw the source.
    let mut gone = o.clone();
    gone.target_pod = None;
    let t = next(&gone);
    assert!(
        has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "{:?}",
        t.actions
    );
    // Before any restore, an empty target report needs no such wait.
    let early = at(P::Transferring)
        .failing(reasons::AGENT_ERROR)
        .target(blank());
    assert!(has(
        &next(&early),
        &Action::Agent(Side::Source, Step::Abort)
    ));
}

// ------------------------------------------------------------ restore fence

/// Stops that are not the restored copy's own failure, each as an edit.
/// An edit of a healthy Observed, named.
type Edit = (&'static str, fn(Observed) -> Observed);

fn stops_that_are_not_the_target_s() -> Vec<Edit> {
    vec![
        ("abort requested", |o| o.deleting()),
        ("deadline", |o| o.at_second(CREATED + 901)),
        ("source pod gone", |mut o| {
            o.source_pod = None;
            o
        }),
        ("source agent error", |o| {
            o.source(failed(Step::Transfer, "Injected").frozen_at(ts(NOW)))
        }),
        ("source agent unreachable", |o| {
            o.source_view(AgentView::Unreachable("lease lost".into()))
        }),
        // A replica that takes over long after the restore (the old one lost its
        // lease): no progress was seen for longer than the timeout.
        ("long absence", |o| o.at_second(NOW + 151)),
        ("freeze budget overrun", |mut o| {
            o.knobs.freeze_budget_millis = 100;
            o.at_second(NOW + 5)
        }),
    ]
}

#[test]
fn past_the_restore_fence_nothing_but_the_restored_copy_s_own_failure_thaws_the_source() {
    for (what, edit) in stops_that_are_not_the_target_s() {
        // Restored, probe not yet asked (as a replica that just took over sees it).
        let o = edit(at(P::Restoring).target(done(Step::Restore).resumed_at(ts(NOW))));
        let t = next(&o);
        assert_eq!(t.status.failure_reason, None, "{what}: {:?}", t.status);
        assert!(
            !has(&t, &Action::Agent(Side::Source, Step::Abort))
                && !has(&t, &Action::Agent(Side::Target, Step::Abort)),
            "{what}: rolled back behind a restored copy: {:?}",
            t.actions
        );
        assert!(
            has(&t, &Action::Agent(Side::Target, Step::Probe)),
            "{what}: {:?}",
            t.actions
        );
        // Probe passed: on to the commit, which kills the source.
        let o = edit(at(P::Restoring).target(done(Step::Probe).resumed_at(ts(NOW))));
        let t = next(&o);
        assert_eq!(t.status.phase, P::Committing, "{what}");
        assert!(
            !has(&t, &Action::Agent(Side::Source, Step::Abort)),
            "{what}"
        );
    }
    // The restored copy's own failure still rolls back, killing it first.
    let t = next(&at(P::Restoring).target(failed(Step::Probe, "ProbeFailed").resumed_at(ts(NOW))));
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROBE_FAILED)
    );
    assert!(has(&t, &Action::Agent(Side::Target, Step::Abort)));
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    // A probe without a verdict is bounded by the progress timeout.
    let t = next(
        &at(P::Restoring)
            .target(running(Step::Probe).resumed_at(ts(NOW)))
            .at_second(NOW + 151),
    );
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
}

#[test]
fn a_restore_in_flight_is_not_taken_for_no_copy_before_the_source_thaws() {
    // Rolling back in Restoring: the target still reports `Receive` while a restore
    // asked before an operator restart (or by the replica that lost the lease) runs.
    let o = at(P::Restoring)
        .target(done(Step::Receive))
        .failing(reasons::ABORTED);
    let t = next(&o);
    assert!(has(&t, &Action::Agent(Side::Target, Step::Abort)));
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "thawed while a restore may complete: {:?}",
        t.actions
    );
    // The kill's answer is the proof.
    let t = next(&o.target(done(Step::Abort)));
    assert!(has(&t, &Action::Agent(Side::Source, Step::Abort)));
}

#[test]
fn deleting_a_migration_whose_target_restored_commits_it_with_one_copy() {
    let mut w = World::new(
        at(P::Restoring)
            .target(done(Step::Restore).resumed_at(ts(NOW)))
            .deleting(),
    );
    w.target_running = true;
    w.step_until_settled(40);
    assert_eq!(w.o.status.phase, P::Succeeded, "{:?}", w.o.status);
    assert!(w.finalizer_released);
    assert!(w.source_killed && w.target_running && !w.two_copies_seen);
    assert!(!w.killed_before_its_pod_terminated);
}

#[test]
fn a_source_kill_its_agent_does_not_confirm_is_never_reported_as_done() {
    let unconfirmed = [
        AgentView::Unreachable("connection refused".into()),
        AgentView::Missing,
        AgentView::reported(blank()),
        AgentView::reported(failed(Step::Commit, "MigrationUnknown")),
    ];
    for view in unconfirmed {
        let o = at(P::Committing).source_view(view.clone());
        let t = next(&o);
        // The kill goes through the pod deletion, after the hand-over and adoption.
        assert!(has(&t, &Action::HandOverTargetPod), "{view:?}");
        assert!(
            source_deletion(&t).is_none(),
            "{view:?}: before the hand-over"
        );
        let t = next(&o.clone().adopted());
        assert_eq!(source_deletion(&t), Some(0), "{view:?}");
        let msg = t.status.failure_message.clone().unwrap_or_default();
        assert!(msg.contains("did not confirm the kill"), "{view:?}: {msg}");
        assert!(
            t.notes.iter().any(|n| n.kind == EventKind::Warning),
            "{view:?}: {:?}",
            t.notes
        );
        // The pod deleted: Succeeded saying so.
        let mut adopted = o.clone().adopted();
        adopted.status = t.status.clone();
        adopted.source_pod = None;
        let t = next(&adopted);
        assert_eq!(t.status.phase, P::Succeeded);
        let note = t
            .notes
            .iter()
            .find(|n| n.reason == reasons::SUCCEEDED)
            .expect("success event");
        assert_eq!(note.kind, EventKind::Warning, "{view:?}");
        assert!(note.message.contains("did not confirm"), "{}", note.message);
    }
    // The agent's kill is confirmed: no warning.
    let t = next(&at(P::Committing).source(done(Step::Commit)));
    assert!(has(&t, &Action::HandOverTargetPod));
    assert_eq!(t.status.failure_message, None);
    let t = next(
        &at(P::Committing)
            .source(done(Step::Commit))
            .adopted()
            .source_terminating(COMMIT_GRACE),
    );
    assert_eq!(t.status.phase, P::Succeeded);
    assert_eq!(t.status.failure_message, None);
}

// ------------------------------------------------------------------ bounds

#[test]
fn a_source_thaw_that_never_succeeds_ends_the_rollback_at_its_bound_and_releases_the_deletion() {
    for source in [
        failed(Step::Abort, "KillFailed"),
        running(Step::Abort),
        done(Step::Transfer),
    ] {
        let mut o = at(P::Transferring)
            .source(source.clone())
            .target(done(Step::Abort))
            .failing(reasons::ABORTED)
            .deleting();
        o.target_pod = None;
        let t = next(&o);
        assert_eq!(t.status.phase, P::Transferring, "{source:?}: keeps trying");
        assert!(!has(&t, &Action::RemoveFinalizer));
        let t = next(&o.at_second(NOW + 151));
        assert_eq!(t.status.phase, P::Aborted, "{source:?}");
        assert!(has(&t, &Action::RemoveFinalizer), "{source:?}");
        let msg = t.status.failure_message.as_deref().unwrap();
        assert!(msg.contains("source state unknown"), "{msg}");
        assert!(msg.contains("may still be frozen"), "{msg}");
        assert!(
            t.notes.iter().all(|n| !n.message.contains("was resumed")),
            "{:?}",
            t.notes
        );
    }
}

#[test]
fn a_restored_copy_never_confirmed_dead_ends_the_rollback_killing_not_thawing_the_source() {
    let mut o = at(P::Restoring)
        .source(done(Step::Transfer).frozen_at(ts(NOW)))
        .target_view(AgentView::Unreachable("node partitioned".into()))
        .failing(reasons::PROBE_FAILED);
    o.target_pod.as_mut().unwrap().terminating = true;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Restoring);
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    let t = next(&o.at_second(NOW + 151));
    assert_eq!(t.status.phase, P::Failed, "{:?}", t.status);
    assert!(
        !t.actions
            .iter()
            .any(|a| matches!(a, Action::Agent(Side::Source, Step::Abort | Step::Cleanup))),
        "{:?}",
        t.actions
    );
    assert!(has(&t, &Action::Agent(Side::Source, Step::Commit)));
    let msg = t.status.failure_message.as_deref().unwrap();
    assert!(
        msg.contains("restore fence") && msg.contains("source state unknown"),
        "{msg}"
    );
}

#[test]
fn committing_is_bounded_a_kill_without_answer_and_an_owner_that_never_adopts_end_it() {
    // The kill never finishes: at the bound the pod deletion takes over.
    let t = next(
        &at(P::Committing)
            .source(running(Step::Commit))
            .at_second(NOW + 151),
    );
    assert!(has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    // Handed over, never adopted (the ReplicaSet was deleted).
    let mut o = at(P::Committing).source(done(Step::Commit)).deleting();
    let tp = o.target_pod.as_mut().unwrap();
    tp.handed_over = true;
    tp.awaiting_adoption = true;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Committing, "waits for the adoption");
    let t = next(&o.at_second(NOW + 151));
    assert_eq!(t.status.phase, P::Failed);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    assert_eq!(source_deletion(&t), Some(0), "{:?}", t.actions);
    assert!(has(&t, &Action::RemoveFinalizer));
    assert!(
        !has(&t, &Action::DeleteTargetPod),
        "the handed-over pod runs the workload"
    );
    let note = t
        .notes
        .iter()
        .find(|n| n.reason == reasons::PROGRESS_TIMEOUT)
        .expect("terminal event");
    assert!(note.message.contains("did not adopt"), "{}", note.message);
    assert!(!note.message.contains("was resumed"), "{}", note.message);
}

#[test]
fn the_end_of_a_rollback_is_an_event_of_its_own() {
    // The recorder folds an Event with the same type, reason and action into the
    // earlier one's series and drops its message: the end of a rollback (what was
    // resumed, or what may be left) must differ from its start in one of them.
    let mut o = at(P::Transferring).deleting();
    let start = next(&o);
    let began = start
        .notes
        .iter()
        .find(|n| n.reason == reasons::ABORTED)
        .expect("rollback event")
        .clone();
    o.status = start.status;
    o.source_agent = AgentView::reported(done(Step::Abort));
    o.target_agent = AgentView::reported(done(Step::Abort));
    o.target_pod = None;
    let end = next(&o);
    assert_eq!(end.status.phase, P::Aborted);
    let ended = end
        .notes
        .iter()
        .find(|n| n.reason == reasons::ABORTED)
        .expect("end event");
    assert_ne!(
        (began.kind, began.action),
        (ended.kind, ended.action),
        "the end's message would be folded into the start's Event"
    );
    assert!(ended.message.contains("resumed"), "{}", ended.message);
}

// ------------------------------------------------- the restore fence (finding 6)

/// The target is asked to restore only once the source agent acknowledged the fence:
/// from then on the source's node kills the source rather than resume it. A fence the
/// agent does not acknowledge is asked again until the progress timeout, then the
/// migration rolls back (nothing was restored: the source is thawed).
#[test]
fn no_restore_is_asked_before_the_source_agent_acknowledges_the_fence() {
    let restore = Action::Agent(Side::Target, Step::Restore);
    let fence = Action::Agent(Side::Source, Step::Fence);
    // The final images are sent: fence first, no restore yet.
    let sent = at(P::Transferring).source(done(Step::Transfer).frozen_at(ts(NOW)));
    let t = next(&sent);
    assert!(has(&t, &fence), "{:?}", t.actions);
    assert!(
        !has(&t, &restore),
        "restore asked before the fence: {:?}",
        t.actions
    );
    assert_eq!(t.status.phase, P::Transferring);
    // The fence in flight, not acknowledged, the agent unreachable, or gone: no restore.
    let cases = [
        (
            "fence running",
            sent.clone().source(running(Step::Fence).frozen_at(ts(NOW))),
        ),
        (
            "fence failed",
            sent.clone()
                .source(failed(Step::Fence, "AgentUnavailable").frozen_at(ts(NOW))),
        ),
        (
            "source agent unreachable",
            sent.clone()
                .source_view(AgentView::Unreachable("connection refused".into())),
        ),
        (
            "source agent lost the migration",
            sent.clone().source(blank()),
        ),
    ];
    for (what, o) in cases {
        let t = next(&o);
        assert!(!has(&t, &restore), "{what}: {:?}", t.actions);
        assert_ne!(t.status.phase, P::Restoring, "{what}");
    }
    // A fence the agent refused is asked again, within the progress timeout.
    let refused = sent
        .clone()
        .source(failed(Step::Fence, "AgentUnavailable").frozen_at(ts(NOW)));
    let t = next(&refused);
    assert_eq!(t.status.failure_reason, None);
    assert!(has(&t, &fence));
    // Past it: rolled back, and the source thawed (nothing was restored).
    let t = next(&refused.at_second(NOW + 151));
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    assert!(!has(&t, &restore));
    assert!(has(&t, &Action::Agent(Side::Source, Step::Abort)));
    // Acknowledged: Restoring (the Event says the source is fenced), and the restore.
    let t = next(&sent.source(done(Step::Fence).fenced().frozen_at(ts(NOW))));
    assert_eq!(t.status.phase, P::Restoring);
    assert!(has(&t, &restore));
    assert!(
        t.notes
            .iter()
            .any(|n| n.reason == reasons::RESTORING && n.message.contains("source fenced")),
        "{:?}",
        t.notes
    );
}

/// A rollback before the restore still thaws the fenced source, through the operator's
/// Abort (the only thing that lifts the fence), and only once the target answered.
#[test]
fn a_rollback_before_the_restore_thaws_a_fenced_source_through_abort_after_the_target() {
    let src_abort = Action::Agent(Side::Source, Step::Abort);
    let tgt_abort = Action::Agent(Side::Target, Step::Abort);
    // Restoring, the restore perhaps asked: the target's answer comes first.
    let o = at(P::Restoring).target(done(Step::Receive)).deleting();
    let t = next(&o);
    assert_eq!(t.status.failure_reason.as_deref(), Some(reasons::ABORTED));
    assert!(has(&t, &tgt_abort));
    assert!(!has(&t, &src_abort), "thawed before the target answered");
    let mut o = o.target(done(Step::Abort));
    o.status = t.status;
    let t = next(&o);
    assert!(has(&t, &src_abort), "{:?}", t.actions);
    let mut o = o.source(done(Step::Abort).frozen_at(ts(NOW)));
    o.status = t.status;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Aborted);
    assert!(
        t.notes
            .iter()
            .any(|n| n.message.contains("the source pod was resumed")),
        "{:?}",
        t.notes
    );
    // In Transferring, fenced, no restore ever asked: the receiver is stopped and the
    // source thawed in the same round.
    let t = next(
        &at(P::Transferring)
            .source(done(Step::Fence).fenced().frozen_at(ts(NOW)))
            .deleting(),
    );
    assert!(has(&t, &src_abort) && !has(&t, &Action::Agent(Side::Target, Step::Restore)));
}

/// The source's node killed the fenced source (its agent's watchdog fired while the
/// operator was away): never reported as resumed; the migration rolls forward to the
/// restore (the target holds the images), and a commit counts the kill as done.
#[test]
fn a_fenced_source_killed_on_its_node_is_never_reported_as_resumed() {
    let killed = || done(Step::Fence).killed_under_fence().frozen_at(ts(NOW));
    // Long past the freeze budget, even deleted: the restore is asked, no rollback
    // (there is nothing to thaw).
    let o = at(P::Restoring)
        .source(killed())
        .target(done(Step::Receive))
        .knobs(spec("web-0").budget_millis(500).build())
        .deleting()
        .at_second(NOW + 60);
    let t = next(&o);
    assert_eq!(t.status.failure_reason, None, "{:?}", t.status);
    assert!(has(&t, &Action::Agent(Side::Target, Step::Restore)));
    // The target fails its restore: rolled back, the source not asked to thaw, and
    // the end says it was killed, never resumed.
    let o = at(P::Restoring)
        .source(killed())
        .target(failed(Step::Restore, "AgentFailed"));
    let t = next(&o);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR)
    );
    let mut o = o.target(done(Step::Abort));
    o.status = t.status;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Failed);
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    let end = t
        .notes
        .iter()
        .find(|n| n.reason == reasons::AGENT_ERROR && n.message.contains("killed"))
        .unwrap_or_else(|| panic!("{:?}", t.notes));
    assert!(
        !end.message.contains("resumed the") && !end.message.contains("was resumed"),
        "{end:?}"
    );
    assert!(
        end.message
            .contains("the fenced source was killed on its node"),
        "{end:?}"
    );
    // Committing: the node's kill is the confirmed kill.
    let t = next(&at(P::Committing).source(killed()));
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Commit)));
    assert!(has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    // Its container may be restarting from its image: the pod goes at once.
    let t = next(&at(P::Committing).source(killed()).adopted());
    assert!(!has(&t, &COMMIT));
    assert_eq!(source_deletion(&t), Some(0), "{:?}", t.actions);
    assert!(
        !t.status
            .failure_message
            .as_deref()
            .is_some_and(|m| m.contains("did not confirm")),
        "{:?}",
        t.status.failure_message
    );
}

/// The source agent lost the migration after it acknowledged the fence (`Restoring`,
/// the target not yet restored): the agent restarted, and its broker kills a fenced
/// source when the agent's lease ends or at its own restart — there is no source to
/// go back to. The migration rolls forward to the restore (the target holds every
/// image) instead of aborting the target and leaving no copy at all.
#[test]
fn a_source_agent_that_forgot_a_fenced_migration_rolls_forward_to_the_restore() {
    let restore = Action::Agent(Side::Target, Step::Restore);
    let target_abort = Action::Agent(Side::Target, Step::Abort);
    // The restore running: nothing stops it, nothing is rolled back.
    let t = next(
        &at(P::Restoring)
            .source(blank())
            .target(running(Step::Restore)),
    );
    assert_eq!(t.status.failure_reason, None, "{:?}", t.status);
    assert!(!has(&t, &target_abort), "{:?}", t.actions);
    assert_eq!(t.status.phase, P::Restoring);
    // Not yet asked: it is asked.
    let t = next(&at(P::Restoring).source(blank()).target(done(Step::Receive)));
    assert_eq!(t.status.failure_reason, None, "{:?}", t.status);
    assert!(has(&t, &restore), "{:?}", t.actions);
    // Before the fence (Transferring) the same report still rolls back: the source
    // was not fenced, its broker resumes it.
    let t = next(&at(P::Transferring).source(blank()));
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR)
    );
    // The target failing its restore still ends it, and never says resumed.
    let o = at(P::Restoring)
        .source(blank())
        .target(failed(Step::Restore, "AgentFailed"));
    let t = next(&o);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR)
    );
    assert!(
        t.notes.iter().all(|n| !n.message.contains("was resumed")),
        "{:?}",
        t.notes
    );
}

// ------------------------------------------------------------------- PostCopy

/// A PostCopy migration in `phase` (the knobs' mode; the status records it).
fn post_copy_at(phase: P) -> Observed {
    at(phase).knobs(spec("web-0").post_copy().build())
}

#[test]
fn the_mode_that_runs_is_recorded_when_the_migration_starts() {
    let t = next(&post_copy_at(P::Pending));
    assert_eq!(t.status.phase, P::Preparing);
    assert_eq!(
        t.status.mode,
        Some(podmotion_api::migration::MigrationMode::PostCopy)
    );
    let t = next(&at(P::Pending).knobs(spec("web-0").cold().build()));
    assert_eq!(
        t.status.mode,
        Some(podmotion_api::migration::MigrationMode::Cold)
    );
}

#[test]
fn post_copy_dumps_once_without_pre_copy_rounds() {
    let o = post_copy_at(P::Checkpointing).source(done(Step::Prepare));
    let t = next(&o);
    assert!(
        has(&t, &Action::Agent(Side::Source, Step::Dump)),
        "{:?}",
        t.actions
    );
}

/// The restored copy passed its probe but still fetches pages: the source is its page
/// store, so nothing of it is given up (no commit, no hand-over, no deletion) until
/// the target reports every page in.
#[test]
fn post_copy_commits_only_once_the_restored_copy_has_every_page() {
    let waiting = post_copy_at(P::Restoring)
        .target(done(Step::Probe).resumed_at(ts(NOW)).lazy(8 << 20, false));
    let t = next(&waiting);
    assert_eq!(t.status.phase, P::Restoring);
    assert!(!gives_up_source(&t), "{:?}", t.actions);
    assert!(!has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    assert_eq!(
        t.status.progress.as_ref().and_then(|p| p.lazy_bytes),
        Some(8 << 20)
    );
    let ready = is_true(&t.status.conditions, ct::READY);
    assert!(!ready);
    // A deletion in this window rolls forward too (the copy is the workload now).
    let t = next(&waiting.clone().deleting());
    assert_eq!(t.status.phase, P::Restoring);
    assert!(
        t.status.failure_reason.is_none(),
        "{:?}",
        t.status.failure_message
    );
    let t = next(&post_copy_at(P::Restoring).target(done(Step::Probe).lazy(64 << 20, true)));
    assert_eq!(t.status.phase, P::Committing);
    assert!(has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    // Cold and PreCopy never wait for pages.
    let t = next(&at(P::Restoring).target(done(Step::Probe)));
    assert_eq!(t.status.phase, P::Committing);
}

/// Pages fetched count as progress; none for the progress timeout rolls back: the
/// restored copy is killed (confirmed) before the source, whose memory is whole, is
/// thawed.
#[test]
fn post_copy_pages_that_stop_coming_roll_back_to_the_whole_source() {
    let mut o = post_copy_at(P::Restoring).target(done(Step::Probe).lazy(1 << 20, false));
    o.status.progress = Some(MigrationProgress {
        lazy_bytes: Some(1 << 20),
        last_progress_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts(
            NOW,
        ))),
        ..Default::default()
    });
    let later = NOW + 151;
    let t = next(
        &o.clone()
            .at_second(later)
            .target(done(Step::Probe).lazy(2 << 20, false)),
    );
    assert!(
        t.status.failure_reason.is_none(),
        "growth is progress: {:?}",
        t.status.failure_message
    );
    let t = next(&o.clone().at_second(later));
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::PROGRESS_TIMEOUT)
    );
    assert!(
        t.status
            .failure_message
            .as_deref()
            .unwrap()
            .contains("PostCopy")
    );
    assert!(
        has(&t, &Action::Agent(Side::Target, Step::Abort)),
        "{:?}",
        t.actions
    );
    assert!(
        !has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "{:?}",
        t.actions
    );
    assert!(!gives_up_source(&t));
}

/// A broken lazy phase (the session between the agents, the target's daemon, the
/// copy) is reported by either agent: the migration fails with `PostCopyFailed`, the
/// target's kill is confirmed first, then the source is thawed; a source that is gone
/// too ends it saying the state is lost.
#[test]
fn a_broken_lazy_phase_fails_clearly_and_never_waits_or_commits() {
    let broken = post_copy_at(P::Restoring).target(
        done(Step::Probe)
            .lazy(4096, false)
            .lazy_failed("the page stream from the source broke"),
    );
    let t = next(&broken);
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::POST_COPY_FAILED)
    );
    let m = t.status.failure_message.clone().unwrap();
    assert!(m.contains("page stream from the source broke"), "{m}");
    assert!(
        has(&t, &Action::Agent(Side::Target, Step::Abort)),
        "{:?}",
        t.actions
    );
    assert!(!gives_up_source(&t));
    assert!(!has(&t, &Action::Agent(Side::Source, Step::Abort)));
    // The kill confirmed: the source is thawed and the migration ends Failed.
    let mut o = broken.clone().target(done(Step::Abort));
    o.status = t.status.clone();
    let t = next(&o);
    assert!(
        has(&t, &Action::Agent(Side::Source, Step::Abort)),
        "{:?}",
        t.actions
    );
    let mut o = o.source(done(Step::Abort));
    o.status = t.status.clone();
    let t = next(&o);
    assert_eq!(t.status.phase, P::Failed);
    // The source agent restarted in the lazy phase (its broker kills a fenced source):
    // the rollback ends saying the state may be lost, never waits.
    let mut o = broken.clone().target(done(Step::Abort)).source(blank());
    o.status = next(&broken).status;
    let t = next(&o);
    assert_eq!(t.status.phase, P::Failed, "{:?}", t.status.failure_message);
    // Reported by the source before the restore: a Cold-like rollback.
    let t = next(
        &post_copy_at(P::Transferring).source(
            done(Step::Transfer)
                .frozen_at(ts(NOW))
                .lazy_failed("target closed the session"),
        ),
    );
    assert_eq!(
        t.status.failure_reason.as_deref(),
        Some(reasons::POST_COPY_FAILED)
    );
    // Another mode ignores lazy fields it never asked for.
    let t = next(&at(P::Restoring).target(done(Step::Probe).lazy_failed("x")));
    assert_eq!(t.status.phase, P::Committing);
}

#[test]
fn the_preparing_event_names_the_pod_of_the_spec_and_both_nodes() {
    // Once read "migrating pod ? from pm-real-1 to pm-real-0": it printed a name the
    // status did not have. The spec's pod is always known.
    for pod in ["web-0", "shop.api-7f9c"] {
        let mut o = at(P::Pending);
        o.pod_name = pod.into();
        let t = next(&o);
        assert_eq!(t.status.phase, P::Preparing);
        let n = t
            .notes
            .iter()
            .find(|n| n.reason == reasons::MIGRATABLE)
            .expect("an Event of entering Preparing");
        assert_eq!(
            n.message,
            format!("migrating pod {pod} from node n0 to node n1"),
            "{n:?}"
        );
        assert!(!n.message.contains('?'), "{n:?}");
    }
}
