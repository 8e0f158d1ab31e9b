//! The agents' progress merged into the status: counters never run backwards, and
//! growth counts as progress.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use podmotion_api::migration::MigrationProgress;

use super::state::Machine;

impl<'a> Machine<'a> {
    /// Progress never runs backwards: counters take the maximum of what was recorded
    /// and what the source agent reports now. Growth counts as progress.
    pub(super) fn merge_agent_progress(&mut self) {
        let Some(r) = self.o.source_agent.report() else {
            return;
        };
        let before = self.status.progress.clone().unwrap_or_default();
        let mut p: MigrationProgress = before.clone();
        p.iteration = p
            .iteration
            .max(i32::try_from(r.progress.iteration).unwrap_or(i32::MAX));
        p.bytes_sent = p
            .bytes_sent
            .max(i64::try_from(r.progress.bytes_sent).unwrap_or(i64::MAX));
        if let Some(d) = r.progress.dirty_bytes {
            p.bytes_remaining_estimate = Some(i64::try_from(d).unwrap_or(i64::MAX));
        }
        if let Some(rate) = r.progress.rate_bytes_per_second {
            p.transfer_rate_bytes_per_second = Some(i64::try_from(rate).unwrap_or(i64::MAX));
        }
        // PostCopy: the pages the restored copy fetched after its resume, recorded at
        // most once a second (each record is a status write; the progress timeout
        // counts in seconds), and the total once every page is in.
        let recorded_within_a_second = before
            .last_progress_time
            .as_ref()
            .is_some_and(|t| self.elapsed_since(t.0) < Duration::from_secs(1));
        if let Some(t) = self.o.target_agent.report()
            && t.progress.lazy_bytes > 0
            && (!recorded_within_a_second || t.progress.lazy_done)
        {
            let lazy = i64::try_from(t.progress.lazy_bytes).unwrap_or(i64::MAX);
            p.lazy_bytes = Some(p.lazy_bytes.unwrap_or(0).max(lazy));
        }
        let grew = p.iteration > before.iteration
            || p.bytes_sent > before.bytes_sent
            || p.lazy_bytes > before.lazy_bytes;
        if grew {
            p.last_progress_time = Some(Time(self.o.now));
        }
        if p != before || self.status.progress.is_some() || grew {
            self.status.progress = Some(p);
        }
    }
}
