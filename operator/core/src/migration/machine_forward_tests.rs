//! The forward of the frozen source's new connections to the target (issue 39): asked
//! of the source agent in the pass that sees the target's restore (the restore fence)
//! and before the target pod is handed over, awaited while it runs, never holding the commit back when it fails,
//! never asked once the source's kill was, nor where the installer turned it off.

use podmotion_api::migration::MigrationPhase as P;

use super::agent::{AgentReport, Side, Step, StepState};
use super::fixtures::*;
use super::machine::*;
use super::observed::Observed;

const FORWARD: Action = Action::Agent(Side::Source, Step::Forward);
const COMMIT: Action = Action::Agent(Side::Source, Step::Commit);

fn has(t: &Transition, a: &Action) -> bool {
    t.actions.contains(a)
}

/// `o` where the installer left the forward on (the chart's default).
fn forwarding(mut o: Observed) -> Observed {
    o.knobs = o.knobs.with_forward_new_connections(true);
    o
}

/// The fenced source's report with the forward standing as `state`.
fn source_with(state: Option<StepState>) -> AgentReport {
    let mut r = done(Step::Fence).fenced().frozen_at(ts(NOW));
    r.progress.forward = state;
    r
}

#[test]
fn the_forward_is_asked_at_the_restore_fence_and_before_the_hand_over() {
    // The pass that sees the restore asks for the probe and the forward together.
    let t = next(&forwarding(at(P::Restoring).target(done(Step::Restore))));
    assert!(has(&t, &FORWARD), "{:?}", t.actions);
    assert!(
        has(&t, &Action::Agent(Side::Target, Step::Probe)),
        "{:?}",
        t.actions
    );
    // While the probe runs, and in the pass in which it passes (Committing entered,
    // the target pod not handed over yet while the forward is unanswered).
    let t = next(&forwarding(at(P::Restoring).target(running(Step::Probe))));
    assert!(has(&t, &FORWARD), "{:?}", t.actions);
    let t = next(&forwarding(at(P::Restoring).target(done(Step::Probe))));
    assert_eq!(t.status.phase, P::Committing);
    assert!(has(&t, &FORWARD), "{:?}", t.actions);
    assert!(!has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    // Not before the restore fence: the target still receiving or restoring.
    for target in [done(Step::Receive), running(Step::Restore)] {
        let t = next(&forwarding(at(P::Restoring).target(target.clone())));
        assert!(!has(&t, &FORWARD), "{target:?}: {:?}", t.actions);
    }
    // Asked once: while it runs it is not asked again.
    let t = next(
        &forwarding(at(P::Restoring).target(running(Step::Probe)))
            .source(source_with(Some(StepState::Running))),
    );
    assert!(!has(&t, &FORWARD), "{:?}", t.actions);
    // In Committing (an operator restart forgot it): asked again, hand-over waits.
    let t = next(&forwarding(at(P::Committing)));
    assert!(has(&t, &FORWARD), "{:?}", t.actions);
    assert!(!has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
}

#[test]
fn the_hand_over_waits_for_the_forward_and_goes_on_whatever_its_outcome() {
    let o = forwarding(at(P::Committing));
    let t = next(&o.clone().source(source_with(Some(StepState::Running))));
    assert!(
        !has(&t, &FORWARD) && !has(&t, &Action::HandOverTargetPod),
        "{:?}",
        t.actions
    );
    let failed = StepState::Failed {
        category: "FailedPrecondition".into(),
        message: "broker: ForwardOff".into(),
    };
    for outcome in [StepState::Done, failed] {
        let t = next(&o.clone().source(source_with(Some(outcome.clone()))));
        assert!(
            has(&t, &Action::HandOverTargetPod),
            "{outcome:?}: {:?}",
            t.actions
        );
        assert!(!has(&t, &FORWARD), "{outcome:?}: {:?}", t.actions);
        assert_eq!(t.status.phase, P::Committing);
        assert_eq!(t.status.failure_message, None, "{outcome:?}");
    }
    // A failed forward does not make the kill unconfirmed: the agent is asked.
    let failed = StepState::Failed {
        category: "Unimplemented".into(),
        message: "an agent without Forward".into(),
    };
    let t = next(
        &o.source(source_with(Some(failed)))
            .adopted()
            .source_terminating(150)
            .kubelet_settled(),
    );
    assert!(has(&t, &COMMIT), "{:?}", t.actions);
}

#[test]
fn no_forward_once_the_kill_was_asked_or_where_it_is_off() {
    let o = forwarding(at(P::Committing))
        .adopted()
        .source_terminating(150);
    for source in [
        running(Step::Commit).fenced(),
        done(Step::Commit),
        done(Step::Fence).killed_under_fence(),
    ] {
        let t = next(&o.clone().source(source.clone()));
        assert!(!has(&t, &FORWARD), "{source:?}: {:?}", t.actions);
    }
    // The installer turned it off: the commit goes as before.
    let t = next(&at(P::Committing));
    assert!(!has(&t, &FORWARD), "{:?}", t.actions);
    assert!(has(&t, &Action::HandOverTargetPod), "{:?}", t.actions);
    // No report from the source agent: nothing to ask it; the commit's own rules apply.
    let t = next(&forwarding(at(P::Committing)).source_view(super::agent::AgentView::Missing));
    assert!(!has(&t, &FORWARD), "{:?}", t.actions);
}
