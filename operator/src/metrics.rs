//! Prometheus metrics, served as text on `/metrics`.
//!
//! Every label value comes from a bounded set (controller names, error categories,
//! results): never a free-text label. Kind-specific metrics live here too so the whole
//! metric surface is visible (and documented in docs/metrics.md) in one place.

use std::time::Instant;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Outcome of one reconcile.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum ReconcileResult {
    Success,
    Error,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub controller: &'static str,
    pub result: ReconcileResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: &'static str,
    /// An error enum's `category()`: a fixed CamelCase word.
    pub category: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Terminal phase or reason: a fixed CamelCase word.
    pub outcome: &'static str,
}

/// All metrics of the operator.
pub struct Metrics {
    registry: Registry,
    pub reconciles: Family<ResultLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub reconciles_in_flight: Family<ControllerLabels, Gauge>,
    /// PodMigrations that reached a terminal phase, by phase.
    pub migrations: Family<OutcomeLabels, Counter>,
    /// Measured freeze of committed migrations.
    pub migration_downtime: Histogram,
    /// Checkpoint bytes moved between nodes.
    pub migration_bytes: Counter,
    /// Attachment Jobs that exist now, as last counted by the attachment controller.
    pub attachment_jobs: Gauge,
    /// Attachment Jobs created, replaced and reaped.
    pub attachment_job_changes: Family<OutcomeLabels, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("podmotion");
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "reconciles",
            "Reconciles by controller and result",
            reconciles.clone(),
        );
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "reconcile_errors",
            "Reconcile errors by controller and error category",
            reconcile_errors.clone(),
        );
        let reconcile_duration =
            Family::<ControllerLabels, Histogram>::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.001, 2.0, 15))
            });
        registry.register(
            "reconcile_duration_seconds",
            "Time spent in one reconcile",
            reconcile_duration.clone(),
        );
        let reconciles_in_flight = Family::<ControllerLabels, Gauge>::default();
        registry.register(
            "reconciles_in_flight",
            "Reconciles running now (the controller's work queue in service)",
            reconciles_in_flight.clone(),
        );
        let migrations = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "migrations",
            "PodMigrations finished, by terminal phase",
            migrations.clone(),
        );
        let migration_downtime = Histogram::new(exponential_buckets(0.01, 2.0, 12));
        registry.register(
            "migration_downtime_seconds",
            "Measured freeze of committed migrations",
            migration_downtime.clone(),
        );
        let migration_bytes = Counter::default();
        registry.register(
            "migration_bytes",
            "Checkpoint bytes moved between nodes",
            migration_bytes.clone(),
        );
        let attachment_jobs = Gauge::default();
        registry.register(
            "attachment_jobs",
            "Attachment Jobs that exist now",
            attachment_jobs.clone(),
        );
        let attachment_job_changes = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "attachment_job_changes",
            "Attachment Jobs created, replaced and reaped",
            attachment_job_changes.clone(),
        );
        Metrics {
            registry,
            reconciles,
            reconcile_errors,
            reconcile_duration,
            reconciles_in_flight,
            migrations,
            migration_downtime,
            migration_bytes,
            attachment_jobs,
            attachment_job_changes,
        }
    }

    /// Starts timing one reconcile of `controller`; finish it with [`ReconcileTimer::done`].
    pub fn reconcile(&self, controller: &'static str) -> ReconcileTimer<'_> {
        self.reconciles_in_flight
            .get_or_create(&ControllerLabels { controller })
            .inc();
        ReconcileTimer {
            metrics: self,
            controller,
            start: Instant::now(),
            finished: false,
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Records duration, result and (on error) the error category of one reconcile.
pub struct ReconcileTimer<'a> {
    metrics: &'a Metrics,
    controller: &'static str,
    start: Instant,
    finished: bool,
}

impl ReconcileTimer<'_> {
    /// `Err(category)` for a failed reconcile.
    pub fn done(mut self, result: Result<(), &'static str>) {
        self.finish(result);
    }

    fn finish(&mut self, result: Result<(), &'static str>) {
        if std::mem::replace(&mut self.finished, true) {
            return;
        }
        let controller = self.controller;
        let m = self.metrics;
        m.reconciles_in_flight
            .get_or_create(&ControllerLabels { controller })
            .dec();
        m.reconcile_duration
            .get_or_create(&ControllerLabels { controller })
            .observe(self.start.elapsed().as_secs_f64());
        let result_label = match result {
            Ok(()) => ReconcileResult::Success,
            Err(category) => {
                m.reconcile_errors
                    .get_or_create(&ErrorLabels {
                        controller,
                        category,
                    })
                    .inc();
                ReconcileResult::Error
            }
        };
        m.reconciles
            .get_or_create(&ResultLabels {
                controller,
                result: result_label,
            })
            .inc();
    }
}

impl Drop for ReconcileTimer<'_> {
    fn drop(&mut self) {
        // A reconcile future dropped mid-way (shutdown) still leaves the gauge right.
        self.finish(Err("Cancelled"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_reconcile_counts_its_category_and_leaves_no_work_in_flight() {
        let m = Metrics::new();
        m.reconcile("runner-pool").done(Err("ApiError"));
        m.reconcile("runner-pool").done(Ok(()));
        let text = m.encode();
        assert!(text.contains(r#"podmotion_reconcile_errors_total{controller="runner-pool",category="ApiError"} 1"#), "{text}");
        assert!(
            text.contains(
                r#"podmotion_reconciles_total{controller="runner-pool",result="Success"} 1"#
            ),
            "{text}"
        );
        assert!(
            text.contains(r#"podmotion_reconciles_in_flight{controller="runner-pool"} 0"#),
            "{text}"
        );
    }
}
