//! The attachment controller's settings: flags with environment fallbacks.

use std::collections::BTreeMap;

use clap::{Args, Parser};

use crate::attachment::render::Settings;
use crate::platform::Platform;

/// Settings of the attachment controller (flags with environment fallbacks).
#[derive(Args, Clone, Debug)]
pub struct AttachmentConfig {
    /// Prefix of every agent Job's name (`<prefix>-<hash of namespace/pod>`).
    #[arg(
        long = "attachment-job-prefix",
        env = "PODMOTION_ATTACHMENT_JOB_PREFIX",
        default_value = "podmotion-agent"
    )]
    pub job_prefix: String,
    /// The agent image of every attachment Job (an attachment never chooses it).
    #[arg(
        long = "attachment-agent-image",
        env = "PODMOTION_ATTACHMENT_AGENT_IMAGE",
        default_value = concat!("ghcr.io/podmotion/podmotion-attach:", env!("CARGO_PKG_VERSION"))
    )]
    pub agent_image: String,
    /// Host path mounted read-only into every agent as the container-runtime socket, or
    /// the directory holding it.
    #[arg(
        long = "attachment-cri-socket-path",
        env = "PODMOTION_ATTACHMENT_CRI_SOCKET_PATH",
        default_value = "/run"
    )]
    pub cri_socket_path: String,
    /// Annotations on every agent pod, as a JSON object of strings (policy-engine
    /// exemptions, an AppArmor profile). The chart passes `attachment.podAnnotations`.
    #[arg(
        long = "attachment-pod-annotations",
        env = "PODMOTION_ATTACHMENT_POD_ANNOTATIONS",
        default_value = "{}",
        value_parser = parse_annotations
    )]
    pub pod_annotations: BTreeMap<String, String>,
    /// Seconds between orphan sweeps (one also runs at start).
    #[arg(
        long = "attachment-sweep-seconds",
        env = "PODMOTION_ATTACHMENT_SWEEP_SECONDS",
        default_value_t = 60
    )]
    pub sweep_seconds: u64,
    /// Most Job creations or deletions in flight for one reconcile.
    #[arg(
        long = "attachment-write-parallelism",
        env = "PODMOTION_ATTACHMENT_WRITE_PARALLELISM",
        default_value_t = 16
    )]
    pub write_parallelism: usize,
    /// Retries of a failing agent pod before its Job fails (and is replaced).
    #[arg(
        long = "attachment-backoff-limit",
        env = "PODMOTION_ATTACHMENT_BACKOFF_LIMIT",
        default_value_t = 3
    )]
    pub backoff_limit: i32,
    /// Image pull Secrets (names, comma-separated) of every agent Job's pod; they must
    /// exist in the Jobs' namespace. The chart passes its `imagePullSecrets`.
    #[arg(
        long = "attachment-image-pull-secrets",
        env = "PODMOTION_ATTACHMENT_IMAGE_PULL_SECRETS",
        value_delimiter = ','
    )]
    pub image_pull_secrets: Vec<String>,
    /// Port of every agent's `GET /metrics` (container port `metrics`, Prometheus
    /// text, no token). The chart passes `attachment.metricsPort`.
    #[arg(
        long = "attachment-metrics-port",
        env = "PODMOTION_ATTACHMENT_METRICS_PORT",
        default_value_t = crate::attachment::render::DEFAULT_METRICS_PORT,
        value_parser = clap::value_parser!(i32).range(1..=65535)
    )]
    pub metrics_port: i32,
    /// Port of every agent's control API on its target pod's loopback (127.0.0.1
    /// inside the target's network namespace), reached by port-forwarding to the target
    /// pod. A workload that listens on it itself cannot be attached to. The chart
    /// passes `attachment.controlPort`.
    #[arg(
        long = "attachment-control-port",
        env = "PODMOTION_ATTACHMENT_CONTROL_PORT",
        default_value_t = crate::attachment::render::DEFAULT_CONTROL_PORT,
        value_parser = clap::value_parser!(i32).range(1..=65535)
    )]
    pub control_port: i32,
    /// Most concurrent wiretaps of each agent, all its ports together (each queues up to
    /// about 16 MiB in the agent pod). The chart passes `attachment.maxWiretaps`.
    #[arg(
        long = "attachment-max-wiretaps",
        env = "PODMOTION_ATTACHMENT_MAX_WIRETAPS",
        default_value_t = crate::attachment::render::DEFAULT_MAX_WIRETAPS,
        value_parser = clap::value_parser!(u32).range(1..=64)
    )]
    pub max_wiretaps: u32,
    /// Namespace of the agent Jobs (and their NetworkPolicy). Their pods
    /// use hostPID and capabilities, so it must enforce the `privileged` PodSecurity
    /// level. Unset: the operator's own namespace.
    #[arg(long = "attachment-namespace", env = "PODMOTION_ATTACHMENT_NAMESPACE")]
    pub jobs_namespace: Option<String>,
    /// Only handle attachments (and watch pods) in this namespace. Unset: every namespace.
    #[arg(
        long = "attachment-watch-namespace",
        env = "PODMOTION_ATTACHMENT_WATCH_NAMESPACE"
    )]
    pub watch_namespace: Option<String>,
}

/// `--attachment-pod-annotations`: a JSON object of strings.
fn parse_annotations(s: &str) -> Result<BTreeMap<String, String>, String> {
    serde_json::from_str(s).map_err(|e| {
        format!("expected a JSON object of strings, such as {{\"example.com/key\":\"value\"}}: {e}")
    })
}

impl AttachmentConfig {
    /// The settings from the environment alone (until the binary flattens the flags).
    pub fn from_env() -> anyhow::Result<AttachmentConfig> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            a: AttachmentConfig,
        }
        Ok(Only::try_parse_from(["podmotion-operator"])?.a)
    }

    /// Namespace of the agent Jobs, given the operator's own.
    pub fn jobs_namespace_or(&self, operator_namespace: &str) -> String {
        self.jobs_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| operator_namespace.into())
    }

    /// The render settings; the agents log in `log_format` and run on `platform` (the
    /// operator's own).
    pub fn settings(
        &self,
        operator_namespace: &str,
        log_format: podmotion_log::LogFormat,
        platform: Platform,
    ) -> Settings {
        Settings {
            platform,
            metrics_port: self.metrics_port,
            control_port: self.control_port,
            max_wiretaps: self.max_wiretaps,
            operator_namespace: operator_namespace.into(),
            log_format,
            namespace: self.jobs_namespace_or(operator_namespace),
            job_prefix: self.job_prefix.clone(),
            image: self.agent_image.clone(),
            cri_socket_path: self.cri_socket_path.clone(),
            pod_annotations: self.pod_annotations.clone(),
            backoff_limit: self.backoff_limit,
            image_pull_secrets: self
                .image_pull_secrets
                .iter()
                .filter(|n| !n.is_empty())
                .cloned()
                .collect(),
        }
    }
}
