//! Every freeze of the pod, and their total. A PreCopy migration freezes the pod more
//! than once: without memory tracking in the node's kernel each pre-copy round is a
//! full dump that stops the pod while CRIU collects its memory. The source agent
//! reports each freeze (`AgentProgress::freezes`); they are recorded in
//! `status.freezes`, never forgotten (an agent that restarted reports none), and
//! summed with the final freeze into `status.totalFrozenMillis`.

use podmotion_api::migration::{FreezeMeasure, MigrationFreeze, PodMigrationStatus};

use super::state::Machine;
use crate::migration::agent::AgentFreeze;

impl Machine<'_> {
    /// Records the freezes the source agent reports that the status does not hold.
    pub(super) fn merge_freezes(&mut self) {
        if let Some(r) = self.o.source_agent.report() {
            merge_freezes(&mut self.status.freezes, &r.progress.freezes);
        }
    }

    /// Sums every freeze recorded so far (see [`total_frozen_millis`]). A migration
    /// that ended before freezes were counted (an older operator's) is left as it is:
    /// no status write for what it never recorded.
    pub(super) fn count_frozen(&mut self) {
        let never_counted = self.o.status.total_frozen_millis.is_none()
            && self.o.status.phase.is_terminal()
            && self.status.freezes.is_empty();
        if never_counted {
            return;
        }
        let total = total_frozen_millis(&self.status);
        if total != self.status.total_frozen_millis {
            self.status.total_frozen_millis = total;
            self.status.total_frozen = total.map(|ms| format!("{ms}ms"));
        }
    }
}

/// Adds to `recorded` each freeze of `reported` whose round (warm or final) it does
/// not hold yet, in round order; what is recorded stays as it is. Returns whether it
/// added any.
pub fn merge_freezes(recorded: &mut Vec<MigrationFreeze>, reported: &[AgentFreeze]) -> bool {
    let before = recorded.len();
    for f in reported {
        let round = i32::try_from(f.round).unwrap_or(i32::MAX);
        let known = recorded
            .iter()
            .any(|r| r.round == round && r.final_dump == f.final_dump);
        if !known {
            recorded.push(freeze_of(f, round));
        }
    }
    if recorded.len() == before {
        return false;
    }
    recorded.sort_by_key(|r| (r.round, r.final_dump));
    true
}

fn freeze_of(f: &AgentFreeze, round: i32) -> MigrationFreeze {
    let int = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    MigrationFreeze {
        round,
        final_dump: f.final_dump,
        frozen_millis: int(f.micros.div_ceil(1000)),
        pages_written: f.pages_written.map(int),
        bytes_written: f.bytes_written.map(int),
        measured_by: if f.by_criu {
            FreezeMeasure::Criu
        } else {
            FreezeMeasure::AgentClock
        },
    }
}

/// All the time the pod was frozen: the pre-copy rounds' freezes plus the final
/// freeze, which is `downtimeMillis` once measured (from the final dump to the resume
/// on the target), else the final dump's own freeze if one was recorded (a migration
/// rolled back after its final dump). `None` while nothing froze the pod.
pub fn total_frozen_millis(status: &PodMigrationStatus) -> Option<i64> {
    let warm = status.freezes.iter().filter(|f| !f.final_dump);
    let final_dump = status.freezes.iter().find(|f| f.final_dump);
    let last = status
        .downtime_millis
        .or(final_dump.map(|f| f.frozen_millis));
    if last.is_none() && status.freezes.is_empty() {
        return None;
    }
    Some(
        warm.map(|f| f.frozen_millis)
            .fold(last.unwrap_or(0), i64::saturating_add),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::agent::{AgentReport, Step};
    use crate::migration::fixtures::*;
    use crate::migration::machine::next;
    use podmotion_api::migration::MigrationPhase as P;
    use std::time::Duration;

    fn warm(round: u32, micros: u64) -> AgentFreeze {
        AgentFreeze {
            round,
            micros,
            pages_written: Some(131_000),
            bytes_written: Some(536_576_000),
            by_criu: true,
            ..Default::default()
        }
    }

    fn final_dump(round: u32, micros: u64) -> AgentFreeze {
        AgentFreeze {
            round,
            final_dump: true,
            micros,
            by_criu: false,
            ..Default::default()
        }
    }

    fn with_freezes(mut r: AgentReport, f: &[AgentFreeze]) -> AgentReport {
        r.progress.freezes = f.to_vec();
        r
    }

    #[test]
    fn each_pre_copy_round_s_freeze_is_recorded_and_counted_as_it_comes() {
        let o = at(P::Checkpointing).source(with_freezes(
            done(Step::PreDump(1)).sent(1, 1 << 20),
            &[warm(1, 451_200)],
        ));
        let t = next(&o);
        assert_eq!(
            t.status.freezes,
            vec![MigrationFreeze {
                round: 1,
                final_dump: false,
                frozen_millis: 452,
                pages_written: Some(131_000),
                bytes_written: Some(536_576_000),
                measured_by: FreezeMeasure::Criu,
            }]
        );
        assert_eq!(t.status.total_frozen_millis, Some(452));
        assert_eq!(t.status.total_frozen.as_deref(), Some("452ms"));
        let mut o2 = o.source(with_freezes(
            done(Step::PreDump(2)).sent(2, 2 << 20),
            &[warm(1, 451_200), warm(2, 440_000)],
        ));
        o2.status = t.status;
        let t2 = next(&o2);
        assert_eq!(t2.status.freezes.len(), 2);
        assert_eq!(t2.status.freezes[1].frozen_millis, 440);
        assert_eq!(t2.status.total_frozen_millis, Some(892));
    }

    #[test]
    fn the_total_adds_the_downtime_to_the_warm_rounds_not_the_final_dump_s_share_of_it() {
        let freezes = [warm(1, 450_000), warm(2, 430_000), final_dump(3, 380_000)];
        let o = at(P::Restoring)
            .source(with_freezes(
                done(Step::Transfer).frozen_at(ts(NOW)),
                &freezes,
            ))
            .target(done(Step::Restore).resumed_at(ts(NOW) + Duration::from_millis(612)));
        let t = next(&o);
        assert_eq!(t.status.downtime_millis, Some(612));
        assert_eq!(t.status.freezes.len(), 3);
        let fin = &t.status.freezes[2];
        assert!(fin.final_dump && fin.round == 3, "{fin:?}");
        assert_eq!(fin.measured_by, FreezeMeasure::AgentClock);
        assert_eq!(t.status.total_frozen_millis, Some(450 + 430 + 612));
        assert_eq!(t.status.total_frozen.as_deref(), Some("1492ms"));
    }

    #[test]
    fn a_cold_migration_s_total_is_its_downtime() {
        let o = at(P::Restoring)
            .source(with_freezes(
                done(Step::Transfer).frozen_at(ts(NOW)),
                &[final_dump(1, 90_000)],
            ))
            .target(done(Step::Restore).resumed_at(ts(NOW) + Duration::from_millis(183)));
        let t = next(&o);
        assert_eq!(t.status.total_frozen_millis, Some(183));
    }

    #[test]
    fn a_migration_that_ended_before_freezes_were_counted_is_not_rewritten() {
        let mut o = at(P::Succeeded);
        o.status.downtime_millis = Some(183);
        let t = next(&o);
        assert_eq!(t.status.total_frozen_millis, None);
        // One that ended since counts as it always did.
        o.status.total_frozen_millis = Some(183);
        o.status.total_frozen = Some("183ms".into());
        assert_eq!(next(&o).status.total_frozen_millis, Some(183));
        let mut running = at(P::Transferring);
        running.status.downtime_millis = Some(183);
        assert_eq!(next(&running).status.total_frozen_millis, Some(183));
    }

    #[test]
    fn before_the_downtime_is_measured_the_final_dump_s_own_freeze_counts() {
        let mut status = PodMigrationStatus::default();
        assert_eq!(total_frozen_millis(&status), None, "nothing froze yet");
        merge_freezes(&mut status.freezes, &[warm(1, 1), final_dump(2, 75_001)]);
        assert_eq!(total_frozen_millis(&status), Some(1 + 76));
        status.downtime_millis = Some(300);
        assert_eq!(total_frozen_millis(&status), Some(301));
    }

    #[test]
    fn recorded_freezes_outlive_an_agent_that_forgot_them_and_are_never_rewritten() {
        let mut recorded = Vec::new();
        assert!(merge_freezes(
            &mut recorded,
            &[warm(2, 2_000), warm(1, 1_000)]
        ));
        assert_eq!(
            recorded.iter().map(|f| f.round).collect::<Vec<_>>(),
            [1, 2],
            "in round order"
        );
        assert!(
            !merge_freezes(&mut recorded, &[]),
            "a restarted agent reports none"
        );
        assert!(!merge_freezes(&mut recorded, &[warm(1, 9_000_000)]));
        assert_eq!(recorded[0].frozen_millis, 1);
        assert!(merge_freezes(&mut recorded, &[final_dump(2, 5_000)]));
        assert_eq!(
            recorded.len(),
            3,
            "a final dump is not the warm round of its number"
        );
        let mut o = at(P::Checkpointing).source(blank());
        o.status.freezes = recorded.clone();
        let t = next(&o);
        assert_eq!(t.status.freezes, recorded);
        assert_eq!(t.status.total_frozen_millis, Some(1 + 2 + 5));
    }
}
