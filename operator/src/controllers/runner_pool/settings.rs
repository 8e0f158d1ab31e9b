//! The RunnerPool controller's settings, from the environment.

use crate::runner_pool::priority;

/// Preflight image used when a RunnerPool names none (`PODMOTION_PREFLIGHT_IMAGE`).
pub const DEFAULT_PREFLIGHT_IMAGE: &str = concat!(
    "ghcr.io/podmotion/podmotion-preflight:",
    env!("CARGO_PKG_VERSION")
);

/// Settings of the RunnerPool controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunnerPoolConfig {
    /// Preflight image when a RunnerPool names none (`PODMOTION_PREFLIGHT_IMAGE`).
    pub preflight_image: String,
    /// Reconcile RunnerPools of this namespace only (`PODMOTION_RUNNER_POOL_NAMESPACE`;
    /// default: all namespaces).
    pub watch_namespace: Option<String>,
    /// The highest PriorityClass value a pool may create or reference
    /// (`PODMOTION_RUNNER_POOL_MAX_PRIORITY`, chart value `runnerPool.maxPriority`).
    pub max_priority: i32,
    /// Whether the operator may read Secrets (in `watch_namespace`). The chart grants
    /// get/list/watch on Secrets only through a Role in the watch namespace, so this
    /// is true exactly when a watch namespace is set.
    pub read_secrets: bool,
}

impl RunnerPoolConfig {
    /// The settings from the environment.
    pub fn from_env() -> anyhow::Result<RunnerPoolConfig> {
        let max_priority = match std::env::var("PODMOTION_RUNNER_POOL_MAX_PRIORITY") {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e| {
                anyhow::anyhow!("PODMOTION_RUNNER_POOL_MAX_PRIORITY={v:?} is not a number: {e}")
            })?,
            _ => priority::DEFAULT_CEILING,
        };
        Ok(RunnerPoolConfig {
            max_priority,
            preflight_image: std::env::var("PODMOTION_PREFLIGHT_IMAGE")
                .unwrap_or_else(|_| DEFAULT_PREFLIGHT_IMAGE.to_string()),
            watch_namespace: std::env::var("PODMOTION_RUNNER_POOL_NAMESPACE")
                .ok()
                .filter(|s| !s.is_empty()),
            read_secrets: false,
        }
        .with_secret_reads_where_granted())
    }

    /// Whether the operator may read Secrets: only in its watch namespace (the chart
    /// grants get/list/watch there through a Role, and nowhere else).
    pub fn reads_secrets(&self) -> bool {
        self.read_secrets && self.watch_namespace.is_some()
    }

    /// `read_secrets` as the chart grants it: only with a watch namespace.
    pub fn with_secret_reads_where_granted(mut self) -> RunnerPoolConfig {
        self.read_secrets = self.watch_namespace.is_some();
        self
    }
}
