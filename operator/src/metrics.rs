//! Prometheus metrics, served as text on `/metrics`.
//!
//! Every label value comes from a bounded set (controller names, error categories,
//! results): never a free-text label. Kind-specific metrics live here too so the whole
//! metric surface is visible (and documented in docs/metrics.md) in one place.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use podmotion_api::RunnerPoolStatus;
use podmotion_api::names::condition_types as ct;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

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
pub struct ClaimLabels {
    pub controller: &'static str,
    /// `Claimed`, `LeftAlone` (held by another release; once per object generation)
    /// or `Lost` (another release claimed it first).
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// Terminal phase or reason: a fixed CamelCase word.
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConditionLabels {
    /// `Ready`, `Degraded` or `Stalled`.
    pub condition: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeStateLabels {
    /// `desired`, `ready` or `updated`.
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    /// A preflight check name from [`PREFLIGHT_CHECKS`], or `other`.
    pub check: &'static str,
}

/// The preflight check names a failure can carry (the preflight executor's checks,
/// the pod fields a runtime refusal names, and `verdict` for an unreadable verdict).
/// Anything else is counted as `other`: a label never carries free text.
pub const PREFLIGHT_CHECKS: [&str; 9] = [
    "kvm",
    "userns",
    "apparmor",
    "quota",
    "capabilities",
    "hostUsers",
    "procMount",
    "seccompProfile",
    "verdict",
];

/// One kind of request the operator sends the API server (`crate::client`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiRequestLabels {
    /// Kubernetes' verb: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
    /// `deletecollection` (or `other`).
    pub verb: &'static str,
    /// The resource (plural), or `other` for one the operator does not use.
    pub resource: &'static str,
    /// `status`, `exec`, `eviction`, `log`, `scale`, `other`, or empty.
    pub subresource: &'static str,
    /// The answer's HTTP status; 0 when there was none (a connection error).
    pub code: u16,
}

/// The operator's API requests, by verb, resource and answer
/// (`podmotion_api_requests`): every attempt the API server sees, retries included.
pub type ApiRequests = Family<ApiRequestLabels, Counter>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EvictionLabels {
    /// `Evicted`, `Migrating` or `Blocked`.
    pub answer: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BlockLabels {
    /// A reason of `crate::eviction::BLOCK_CAUSES`, or `Other`.
    pub reason: &'static str,
}

/// What the metrics keep of one RunnerPool's last status (never its name as a label).
#[derive(Clone, Debug, Default)]
struct PoolFacts {
    desired: i64,
    ready: i64,
    updated: i64,
    conditions: Vec<&'static str>,
    failed_checks: Vec<&'static str>,
}

/// The controllers' names (their `controller` label).
pub const CONTROLLERS: [&str; 3] = ["migration", "attachment", "runner-pool"];

/// All metrics of the operator.
pub struct Metrics {
    registry: Registry,
    pub reconciles: Family<ResultLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub reconciles_in_flight: Family<ControllerLabels, Gauge>,
    /// Objects claimed for this release, left to another, or lost in a race.
    pub claims: Family<ClaimLabels, Counter>,
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
    /// RunnerPools whose condition is True, by condition (summed at scrape time).
    pub runner_pools: Family<ConditionLabels, Gauge>,
    /// Runner nodes over every pool, by state.
    pub runner_pool_nodes: Family<NodeStateLabels, Gauge>,
    /// Nodes whose preflight failed, by failing check, over every pool.
    pub runner_pool_preflight_failures: Family<CheckLabels, Gauge>,
    /// Reconciles that found a Runner DaemonSet drifted from its rendered shape.
    pub runner_pool_shape_drift: Counter,
    /// Evictions the `pods/eviction` webhook answered, by answer.
    pub evictions: Family<EvictionLabels, Counter>,
    /// PodMigrations an eviction created.
    pub eviction_migrations_started: Counter,
    /// Evictions refused (drains blocked), by reason.
    pub evictions_blocked: Family<BlockLabels, Counter>,
    /// The operator's API requests (every attempt), by verb, resource and answer: the
    /// writes of a steady state are the `create`/`update`/`patch`/`delete` series.
    pub api_requests: ApiRequests,
    pools: Mutex<BTreeMap<String, PoolFacts>>,
}

/// Registers `metric` under `name` with `help` and hands it back (a clone shares its
/// values with the registered one).
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// The registry, as a table: one line per metric (name, help, metric), then every
    /// known series at 0.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("podmotion");
        let reg = &mut r;
        #[rustfmt::skip]
        let metrics = Metrics {
            reconciles: registered(reg, "reconciles", "Reconciles by controller and result", Family::default()),
            reconcile_errors: registered(reg, "reconcile_errors", "Reconcile errors by controller and error category", Family::default()),
            reconcile_duration: registered(reg, "reconcile_duration_seconds", "Time spent in one reconcile", Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 15)))),
            reconciles_in_flight: registered(reg, "reconciles_in_flight", "Reconciles running now (the controller's work queue in service)", Family::default()),
            claims: registered(reg, "claims", "Objects this release claimed (Claimed), left to the release that holds them (LeftAlone, once per object generation) or lost to another release's claim (Lost), by controller", Family::default()),
            migrations: registered(reg, "migrations", "PodMigrations finished, by terminal phase", Family::default()),
            migration_downtime: registered(reg, "migration_downtime_seconds", "Measured freeze of committed migrations", Histogram::new(exponential_buckets(0.01, 2.0, 12))),
            migration_bytes: registered(reg, "migration_bytes", "Checkpoint bytes moved between nodes", Counter::default()),
            attachment_jobs: registered(reg, "attachment_jobs", "Attachment Jobs that exist now", Gauge::default()),
            attachment_job_changes: registered(reg, "attachment_job_changes", "Attachment Jobs created, replaced and reaped", Family::default()),
            runner_pools: registered(reg, "runner_pools", "RunnerPools whose condition is True, by condition (Ready, Degraded, Stalled)", Family::default()),
            runner_pool_nodes: registered(reg, "runner_pool_nodes", "Runner nodes of every RunnerPool, by state (desired, ready, updated)", Family::default()),
            runner_pool_preflight_failures: registered(reg, "runner_pool_preflight_failures", "Nodes whose Runner preflight failed, by failing check, over every RunnerPool", Family::default()),
            runner_pool_shape_drift: registered(reg, "runner_pool_shape_drift", "RunnerPool reconciles that found the Runner DaemonSet drifted from its rendered shape (and repaired it)", Counter::default()),
            evictions: registered(reg, "evictions", "Evictions answered by the pods/eviction webhook, by answer (Evicted, Migrating, Blocked)", Family::default()),
            eviction_migrations_started: registered(reg, "eviction_migrations_started", "PodMigrations created by an eviction", Counter::default()),
            evictions_blocked: registered(reg, "evictions_blocked", "Evictions refused because the pod cannot move, by reason", Family::default()),
            api_requests: registered(reg, "api_requests", "Requests the operator sent the API server (each retry too), by verb, resource, subresource and HTTP status (0: no answer)", Family::default()),
            pools: Mutex::new(BTreeMap::new()),
            registry: r,
        };
        metrics.start_known_series_at_zero();
        metrics
    }

    /// Every known series starts at 0: a rate() or increase() over it works from the
    /// first scrape, and a fresh operator's /metrics already shows every family the
    /// alerts and the dashboard use (e2e/tests/real_metrics.rs checks that).
    fn start_known_series_at_zero(&self) {
        for controller in CONTROLLERS {
            for result in [ReconcileResult::Success, ReconcileResult::Error] {
                let _ = self
                    .reconciles
                    .get_or_create(&ResultLabels { controller, result });
            }
            for category in ["ApiError", "Cancelled"] {
                let _ = self.reconcile_errors.get_or_create(&ErrorLabels {
                    controller,
                    category,
                });
            }
            let _ = self
                .reconcile_duration
                .get_or_create(&ControllerLabels { controller });
            let _ = self
                .reconciles_in_flight
                .get_or_create(&ControllerLabels { controller });
            for outcome in ["Claimed", "LeftAlone", "Lost"] {
                let _ = self.claims.get_or_create(&ClaimLabels {
                    controller,
                    outcome,
                });
            }
        }
        for outcome in ["Succeeded", "Failed", "Aborted"] {
            let _ = self.migrations.get_or_create(&OutcomeLabels { outcome });
        }
        for answer in ["Evicted", "Migrating", "Blocked"] {
            let _ = self.evictions.get_or_create(&EvictionLabels { answer });
        }
        for outcome in ["Created", "Replaced", "Reaped"] {
            let _ = self
                .attachment_job_changes
                .get_or_create(&OutcomeLabels { outcome });
        }
    }

    /// Records a RunnerPool's status as last computed (`None`: the pool is gone). `key`
    /// (namespace/name) only identifies the pool here; it is never a label.
    pub fn runner_pool(&self, key: &str, status: Option<&RunnerPoolStatus>) {
        let mut pools = self.pools.lock().expect("pools");
        let Some(s) = status else {
            pools.remove(key);
            return;
        };
        let conditions = [ct::READY, ct::DEGRADED, ct::STALLED]
            .into_iter()
            .filter(|t| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == *t && c.status == "True")
            })
            .collect();
        let failed_checks = s
            .preflight_failures
            .iter()
            .flat_map(|f| &f.checks)
            .map(|c| {
                PREFLIGHT_CHECKS
                    .into_iter()
                    .find(|k| k == c)
                    .unwrap_or("other")
            })
            .collect();
        pools.insert(
            key.to_owned(),
            PoolFacts {
                desired: s.desired_nodes.into(),
                ready: s.ready_nodes.into(),
                updated: s.updated_nodes.into(),
                conditions,
                failed_checks,
            },
        );
    }

    /// Brings the RunnerPool gauges up to date from the pools' last statuses. Every
    /// series exists (at 0 when nothing counts), so a pool that recovers brings its
    /// series down rather than leaving it at its last value.
    fn refresh_runner_pools(&self) {
        let pools = self.pools.lock().expect("pools");
        for condition in [ct::READY, ct::DEGRADED, ct::STALLED] {
            let n = pools
                .values()
                .filter(|p| p.conditions.contains(&condition))
                .count();
            self.runner_pools
                .get_or_create(&ConditionLabels { condition })
                .set(n as i64);
        }
        let sum = |f: fn(&PoolFacts) -> i64| pools.values().map(f).sum::<i64>();
        for (state, n) in [
            ("desired", sum(|p| p.desired)),
            ("ready", sum(|p| p.ready)),
            ("updated", sum(|p| p.updated)),
        ] {
            self.runner_pool_nodes
                .get_or_create(&NodeStateLabels { state })
                .set(n);
        }
        for check in PREFLIGHT_CHECKS.into_iter().chain(["other"]) {
            let n = pools
                .values()
                .flat_map(|p| &p.failed_checks)
                .filter(|c| **c == check)
                .count();
            self.runner_pool_preflight_failures
                .get_or_create(&CheckLabels { check })
                .set(n as i64);
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
        self.refresh_runner_pools();
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

    fn pool_status(desired: i32, ready: i32, degraded: bool, checks: &[&str]) -> RunnerPoolStatus {
        use podmotion_api::runner_pool::PreflightFailure;
        let cond = |t: &str, on: bool| k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
            type_: t.into(),
            status: if on { "True" } else { "False" }.into(),
            reason: "R".into(),
            message: String::new(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        };
        RunnerPoolStatus {
            desired_nodes: desired,
            ready_nodes: ready,
            conditions: vec![cond(ct::READY, !degraded), cond(ct::DEGRADED, degraded)],
            preflight_failures: vec![PreflightFailure {
                node: "n1".into(),
                checks: checks.iter().map(|c| c.to_string()).collect(),
                message: "free text that must never become a label".into(),
            }],
            ..Default::default()
        }
    }

    #[test]
    fn runner_pools_are_summed_by_condition_and_check_without_their_names() {
        let m = Metrics::new();
        m.runner_pool("ns/a", Some(&pool_status(2, 1, true, &["kvm", "made-up"])));
        m.runner_pool("ns/b", Some(&pool_status(3, 3, false, &["kvm"])));
        let text = m.encode();
        for line in [
            r#"podmotion_runner_pools{condition="Degraded"} 1"#,
            r#"podmotion_runner_pools{condition="Ready"} 1"#,
            r#"podmotion_runner_pool_nodes{state="desired"} 5"#,
            r#"podmotion_runner_pool_nodes{state="ready"} 4"#,
            r#"podmotion_runner_pool_preflight_failures{check="kvm"} 2"#,
            r#"podmotion_runner_pool_preflight_failures{check="other"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
        assert!(
            !text.contains("ns/a") && !text.contains("made-up"),
            "{text}"
        );
        // A pool that recovers, and one that is deleted, bring the series down.
        m.runner_pool("ns/a", Some(&pool_status(2, 2, false, &[])));
        m.runner_pool("ns/b", None);
        let text = m.encode();
        assert!(
            text.contains(r#"podmotion_runner_pools{condition="Degraded"} 0"#),
            "{text}"
        );
        assert!(
            text.contains(r#"podmotion_runner_pool_nodes{state="desired"} 2"#),
            "{text}"
        );
        assert!(
            text.contains(r#"podmotion_runner_pool_preflight_failures{check="kvm"} 0"#),
            "{text}"
        );
    }
}
