//! An agent's wire status read as the phase machine's report (which step completed,
//! and the progress figures the freeze budget and the status use), and what the agent
//! adapter remembers of a finished call. Pure: message types in, plain values out. The
//! translation lives in the adapter, so the core never sees a wire message.

use k8s_openapi::jiff::Timestamp;
use podmotion_api::migration::NetworkOutcome;
use podmotion_wire::agent::{
    FreezeClock, FreezeRecord, MigrationStatus, Phase, Role, SocketOutcome,
};

use crate::migration::agent::{AgentFreeze, AgentProgress, AgentReport, Step, StepState};

/// The agent's status as the phase machine's report. Pure.
pub fn report_from_status(st: &MigrationStatus) -> AgentReport {
    let role = Role::try_from(st.role).unwrap_or(Role::Unspecified);
    let phase = Phase::try_from(st.phase).unwrap_or(Phase::Unknown);
    let t = st.timings();
    let at = |us: u64| {
        (us > 0)
            .then(|| Timestamp::from_microsecond(us as i64).ok())
            .flatten()
    };
    AgentReport {
        last: last_step(st, phase, role).map(|s| (s, StepState::Done)),
        progress: AgentProgress {
            iteration: st.iteration,
            bytes_sent: st.bytes_sent,
            dirty_bytes: dirty_bytes(st),
            rate_bytes_per_second: link_rate(st),
            dump_millis: (st.iteration > 0 && t.last_round_us > 0)
                .then(|| t.last_round_us.div_ceil(1000)),
            frozen_at: at(t.freeze_started_us),
            resumed_at: if role == Role::Target {
                at(t.resumed_us)
            } else {
                None
            },
            network: network_outcome(st),
            fenced: st.fenced,
            killed_under_fence: phase == Phase::Killed,
            lazy_done: st.lazy_done,
            lazy_error: (!st.lazy_error.is_empty()).then(|| st.lazy_error.clone()),
            lazy_bytes: st.lazy_bytes,
            freezes: st.freezes.iter().map(freeze).collect(),
            forward: None,
        },
    }
}

/// One freeze of the source's trees: CRIU's freezing and frozen times together (its
/// tasks stop within the freezing), or the agent's clock around the dump.
fn freeze(f: &FreezeRecord) -> AgentFreeze {
    let by_criu = f.clock() == FreezeClock::Criu;
    AgentFreeze {
        round: f.round,
        final_dump: f.final_dump,
        micros: f.frozen_us.saturating_add(f.freezing_us),
        pages_written: (by_criu || f.pages_written > 0).then_some(f.pages_written),
        bytes_written: (f.bytes_written > 0).then_some(f.bytes_written),
        by_criu,
    }
}

/// The last step the agent's phase says completed (for its role).
fn last_step(st: &MigrationStatus, phase: Phase, role: Role) -> Option<Step> {
    match (phase, role) {
        (Phase::Unknown, _) => None,
        (Phase::Prepared, Role::Target) | (Phase::Receiving | Phase::Received, _) => {
            Some(Step::Receive)
        }
        (Phase::Prepared, _) => Some(Step::Prepare),
        (Phase::PreDumping, _) => Some(Step::PreDump(st.iteration.max(1))),
        (Phase::Dumped, _) => Some(Step::Dump),
        (Phase::Sent, _) if st.fenced => Some(Step::Fence),
        (Phase::Sent, _) => Some(Step::Transfer),
        // Fenced, then killed by its agent's watchdog: the fence stands (never resumed).
        (Phase::Killed, _) => Some(Step::Fence),
        (Phase::Restored, _) => Some(Step::Restore),
        (Phase::Committed, _) => Some(Step::Commit),
        (Phase::Aborted, _) => Some(Step::Abort),
        (Phase::CleanedUp, _) => Some(Step::Cleanup),
    }
}

/// The link's speed: the final transfer's once it ran, before that the pre-copy
/// rounds' (streamed while the workload runs, so known before the freeze).
fn link_rate(st: &MigrationStatus) -> Option<u64> {
    let t = st.timings();
    let final_bytes = st.bytes_sent.saturating_sub(st.pre_copy_sent_bytes);
    if t.send_us > 0 && final_bytes > 0 {
        Some(final_bytes.saturating_mul(1_000_000) / t.send_us)
    } else if t.pre_copy_send_us > 0 && st.pre_copy_sent_bytes > 0 {
        Some(st.pre_copy_sent_bytes.saturating_mul(1_000_000) / t.pre_copy_send_us)
    } else {
        None
    }
}

/// What the final transfer will move: what the last streamed round had to send (the
/// dirty set), else the last round's whole image; nothing before a round.
fn dirty_bytes(st: &MigrationStatus) -> Option<u64> {
    (st.iteration > 0).then_some(if st.timings().pre_copy_send_us > 0 {
        st.last_round_sent_bytes
    } else {
        st.last_round_bytes
    })
}

/// Per socket, what the restore did with it (none reported: unknown, not zero).
fn network_outcome(st: &MigrationStatus) -> Option<NetworkOutcome> {
    (!st.sockets.is_empty()).then(|| NetworkOutcome {
        listeners_restored: st.count(SocketOutcome::ListenerRestored) as i32,
        connections_preserved: st.count(SocketOutcome::Preserved) as i32,
        connections_closed: st.count(SocketOutcome::ClosedCleanly) as i32,
        connections_reset: 0,
    })
}

/// What the agent adapter keeps of a finished call. A success is forgotten (the agent's own
/// status shows it) except for the probe, which the agent does not know about: without
/// the memory the machine would see `Restore` done and probe again forever. Failures
/// are kept until the next step replaces them.
pub fn remembered_outcome(
    step: Step,
    res: Result<(), (String, String)>,
) -> Option<(Step, StepState)> {
    match res {
        Ok(()) if step == Step::Probe => Some((step, StepState::Done)),
        Ok(()) => None,
        Err((category, message)) => Some((step, StepState::Failed { category, message })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_wire::agent::Timings;

    fn status(role: Role, phase: Phase) -> MigrationStatus {
        MigrationStatus {
            migration_uid: "u".into(),
            role: role as i32,
            phase: phase as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_passed_probe_is_remembered_because_the_agent_cannot_report_it() {
        assert_eq!(
            remembered_outcome(Step::Probe, Ok(())),
            Some((Step::Probe, StepState::Done))
        );
        assert_eq!(remembered_outcome(Step::Restore, Ok(())), None);
        let failed = remembered_outcome(Step::Dump, Err(("WrongPhase".into(), "x".into())));
        assert!(matches!(
            failed,
            Some((Step::Dump, StepState::Failed { .. }))
        ));
    }

    #[test]
    fn agent_phases_map_to_the_steps_the_machine_expects() {
        let cases = [
            (Role::Source, Phase::Unknown, None),
            (Role::Source, Phase::Prepared, Some(Step::Prepare)),
            (Role::Target, Phase::Prepared, Some(Step::Receive)),
            (Role::Target, Phase::Received, Some(Step::Receive)),
            (Role::Source, Phase::Dumped, Some(Step::Dump)),
            (Role::Source, Phase::Sent, Some(Step::Transfer)),
            (Role::Source, Phase::Killed, Some(Step::Fence)),
            (Role::Target, Phase::Restored, Some(Step::Restore)),
            (Role::Source, Phase::Committed, Some(Step::Commit)),
            (Role::Source, Phase::Aborted, Some(Step::Abort)),
            (Role::Target, Phase::CleanedUp, Some(Step::Cleanup)),
        ];
        for (role, phase, want) in cases {
            assert_eq!(
                report_from_status(&status(role, phase)).last_step(),
                want,
                "{role:?} {phase:?}"
            );
        }
        let mut fenced = status(Role::Source, Phase::Sent);
        fenced.fenced = true;
        let r = report_from_status(&fenced);
        assert_eq!(r.last_step(), Some(Step::Fence));
        assert!(r.progress.fenced && !r.progress.killed_under_fence);
        let r = report_from_status(&MigrationStatus {
            phase: Phase::Killed as i32,
            ..fenced
        });
        assert!(r.done(Step::Fence) && r.progress.killed_under_fence);
        let mut st = status(Role::Source, Phase::PreDumping);
        st.iteration = 3;
        st.last_round_bytes = 4096;
        let r = report_from_status(&st);
        assert_eq!(r.last_step(), Some(Step::PreDump(3)));
        assert_eq!(r.progress.dirty_bytes, Some(4096));
    }

    #[test]
    fn pre_copy_rounds_report_the_dirty_set_the_link_speed_and_the_dump_cost() {
        // Round 2 streamed 3 MB of 64 MB; 60 MB went in 0.6 s over both rounds.
        let mut st = status(Role::Source, Phase::PreDumping);
        st.iteration = 2;
        st.last_round_bytes = 64_000_000;
        st.last_round_sent_bytes = 3_000_000;
        st.pre_copy_sent_bytes = 60_000_000;
        st.bytes_sent = 60_000_000;
        st.timings = Some(Timings {
            pre_copy_send_us: 600_000,
            last_round_us: 120_400,
            ..Default::default()
        });
        let r = report_from_status(&st);
        assert_eq!(r.last_step(), Some(Step::PreDump(2)));
        assert_eq!(r.progress.dirty_bytes, Some(3_000_000));
        assert_eq!(r.progress.rate_bytes_per_second, Some(100_000_000));
        assert_eq!(r.progress.dump_millis, Some(121));
        // After the final transfer its own speed is reported, not the pre-copy one.
        st.phase = Phase::Sent as i32;
        st.bytes_sent = 62_000_000;
        st.timings = Some(Timings {
            send_us: 10_000,
            ..st.timings()
        });
        assert_eq!(
            report_from_status(&st).progress.rate_bytes_per_second,
            Some(200_000_000)
        );
    }

    #[test]
    fn each_freeze_counts_criu_s_seizing_and_frozen_time_and_says_how_it_was_measured() {
        let mut st = status(Role::Source, Phase::Dumped);
        st.freezes = vec![
            FreezeRecord {
                round: 1,
                frozen_us: 450_000,
                freezing_us: 1_200,
                pages_written: 131_000,
                bytes_written: 536_576_000,
                clock: FreezeClock::Criu as i32,
                ..Default::default()
            },
            FreezeRecord {
                round: 2,
                final_dump: true,
                frozen_us: 380_000,
                clock: FreezeClock::Agent as i32,
                ..Default::default()
            },
        ];
        let f = report_from_status(&st).progress.freezes;
        assert_eq!(
            f,
            vec![
                AgentFreeze {
                    round: 1,
                    final_dump: false,
                    micros: 451_200,
                    pages_written: Some(131_000),
                    bytes_written: Some(536_576_000),
                    by_criu: true,
                },
                AgentFreeze {
                    round: 2,
                    final_dump: true,
                    micros: 380_000,
                    pages_written: None,
                    bytes_written: None,
                    by_criu: false,
                },
            ]
        );
    }

    #[test]
    fn timings_become_freeze_and_resume_instants_and_a_rate() {
        let mut st = status(Role::Target, Phase::Restored);
        st.bytes_sent = 10_000_000;
        st.timings = Some(Timings {
            freeze_started_us: 1_000_000,
            resumed_us: 1_183_000,
            send_us: 100_000,
            ..Default::default()
        });
        let r = report_from_status(&st);
        let (f, res) = (
            r.progress.frozen_at.unwrap(),
            r.progress.resumed_at.unwrap(),
        );
        assert_eq!(res.duration_since(f).as_millis(), 183);
        assert_eq!(r.progress.rate_bytes_per_second, Some(100_000_000));
        let src = report_from_status(&MigrationStatus {
            role: Role::Source as i32,
            ..st
        });
        assert_eq!(
            src.progress.resumed_at, None,
            "a resumed source is not a restored target"
        );
    }
}
