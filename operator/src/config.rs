//! Operator settings, parsed from flags with environment fallbacks. Every flag has a
//! Helm value (charts/podmotion/values.yaml).

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// Controllers the binary can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, ValueEnum)]
pub enum ControllerKind {
    /// PodMigration.
    Migration,
    /// NodeAgentAttachment.
    Attachment,
    /// RunnerPool.
    RunnerPool,
}

impl ControllerKind {
    /// Stable name, used in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            ControllerKind::Migration => "migration",
            ControllerKind::Attachment => "attachment",
            ControllerKind::RunnerPool => "runner-pool",
        }
    }
}

/// Settings shared by every controller.
#[derive(Args, Clone, Debug)]
pub struct OperatorConfig {
    /// Namespace the operator runs in; the leader Lease lives here (and the attachment
    /// Jobs, unless `--attachment-namespace` names another).
    #[arg(long, env = "POD_NAMESPACE", default_value = "podmotion-system")]
    pub namespace: String,

    /// Name of this replica (the pod name), recorded as the Lease holder and on Events.
    #[arg(long, env = "POD_NAME", default_value_t = default_identity())]
    pub identity: String,

    /// Controllers to run (comma-separated).
    #[arg(
        long,
        env = "PODMOTION_CONTROLLERS",
        value_delimiter = ',',
        default_value = "migration,attachment,runner-pool"
    )]
    pub controllers: Vec<ControllerKind>,

    /// Address of the `/metrics`, `/healthz` and `/readyz` server.
    #[arg(long, env = "PODMOTION_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,

    #[command(flatten)]
    pub leader: LeaderConfig,

    /// Most objects of one kind reconciled at once (per controller).
    #[arg(long, env = "PODMOTION_CONCURRENCY", default_value_t = 8)]
    pub concurrency: u16,

    /// Log format: `json` (one object per line) or `text`. The pods the operator
    /// renders (attachment Jobs, RunnerPool preflight init containers) log in it too.
    #[arg(long, env = podmotion_log::ENV, default_value = "json", global = true)]
    pub log_format: podmotion_log::LogFormat,

    /// CPU architecture PodMotion's images are built for (`kubernetes.io/arch`; empty:
    /// any, for multi-architecture images). The pods the operator renders that run
    /// them (attachment Jobs, RunnerPool preflights) select Linux nodes of it, and an
    /// attachment skips pods on nodes of another platform. The chart passes
    /// `global.nodeArch`.
    #[arg(
        long,
        env = "PODMOTION_NODE_ARCH",
        default_value = crate::platform::DEFAULT_ARCH,
        value_parser = parse_arch
    )]
    pub node_arch: String,
}

impl OperatorConfig {
    /// The platform of PodMotion's images: Linux on `--node-arch`.
    pub fn platform(&self) -> crate::platform::Platform {
        crate::platform::Platform::linux(&self.node_arch)
    }
}

/// `--node-arch`: a `kubernetes.io/arch` value (`amd64`, `arm64`, …) or empty.
fn parse_arch(s: &str) -> Result<String, String> {
    if s.bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        Ok(s.to_string())
    } else {
        Err(format!(
            "expected a kubernetes.io/arch value such as amd64 or arm64 (lowercase letters and \
             digits), or empty for any architecture, not {s:?}"
        ))
    }
}

/// Leader election with a coordination.k8s.io Lease.
#[derive(Args, Clone, Debug)]
pub struct LeaderConfig {
    /// Turn leader election off (single replica, local runs).
    #[arg(long = "no-leader-election", env = "PODMOTION_NO_LEADER_ELECTION", action = clap::ArgAction::SetFalse)]
    pub enabled: bool,

    /// Name of the Lease in the operator's namespace.
    #[arg(
        long = "leader-lease-name",
        env = "PODMOTION_LEADER_LEASE",
        default_value = "podmotion-operator"
    )]
    pub lease_name: String,

    /// Seconds a Lease is valid without renewal.
    #[arg(
        long = "leader-lease-seconds",
        env = "PODMOTION_LEADER_LEASE_SECONDS",
        default_value_t = 15
    )]
    pub lease_seconds: u32,
}

impl LeaderConfig {
    /// How long a lease stays valid.
    pub fn lease_duration(&self) -> Duration {
        Duration::from_secs(u64::from(self.lease_seconds.max(2)))
    }
    /// How often the holder renews: a third of the lease.
    pub fn renew_every(&self) -> Duration {
        self.lease_duration() / 3
    }
}

fn default_identity() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "podmotion".into());
    format!("{host}-{}", std::process::id())
}

/// Run-time key material (`crate::pki`): on when `--pki-ca-secret` is set.
#[derive(Args, Clone, Debug)]
pub struct PkiConfig {
    /// Secret in the operator's namespace holding the agents' CA (created and rotated
    /// by the leader). Unset: no run-time PKI (the agent TLS files of the migration
    /// controller are used as given).
    #[arg(long = "pki-ca-secret", env = "PODMOTION_PKI_CA_SECRET")]
    pub ca_secret: Option<String>,
    /// ConfigMap in the agents' namespace the CA bundle is published in (`ca.crt`).
    #[arg(
        long = "pki-bundle-configmap",
        env = "PODMOTION_PKI_BUNDLE_CONFIGMAP",
        default_value = "podmotion-agent-ca"
    )]
    pub bundle_configmap: String,
    /// ServiceAccount of the node agents: the only requester whose certificate
    /// requests are signed.
    #[arg(
        long = "pki-agent-service-account",
        env = "PODMOTION_PKI_AGENT_SERVICE_ACCOUNT",
        default_value = "podmotion-migration-agent"
    )]
    pub agent_service_account: String,
    /// Seconds a CA certificate is valid.
    #[arg(long = "pki-ca-seconds", env = "PODMOTION_PKI_CA_SECONDS", default_value_t = 365 * 86400)]
    pub ca_seconds: i64,
    /// Seconds an agent or operator certificate is valid (renewed at two thirds).
    #[arg(long = "pki-leaf-seconds", env = "PODMOTION_PKI_LEAF_SECONDS", default_value_t = 7 * 86400)]
    pub leaf_seconds: i64,
    /// Seconds a new CA is trusted before it signs (bundle propagation).
    #[arg(
        long = "pki-propagation-seconds",
        env = "PODMOTION_PKI_PROPAGATION_SECONDS",
        default_value_t = 300
    )]
    pub propagation_seconds: i64,
    /// Secret in the operator's namespace holding the migration master key (`key`),
    /// created by the leader when absent, and handed to the migration controller as a
    /// file under `--key-material-dir`. Ignored when `--migration-key-file` is given.
    #[arg(long = "migration-key-secret", env = "PODMOTION_MIGRATION_KEY_SECRET")]
    pub migration_key_secret: Option<String>,
    /// ValidatingAdmissionPolicyBinding (the chart's `<release>-podmotion-key-material`)
    /// that lets only the operator's ServiceAccount write the CA and master key
    /// Secrets: key material created before it existed, or while it is missing, is
    /// not used, and the leader replaces it. Unset: no such check.
    #[arg(
        long = "pki-key-material-policy",
        env = "PODMOTION_PKI_KEY_MATERIAL_POLICY"
    )]
    pub key_material_policy: Option<String>,
    /// Private directory (a memory-backed volume) where key material read through the
    /// API is written for the controllers that read files.
    #[arg(
        long = "key-material-dir",
        env = "PODMOTION_KEY_MATERIAL_DIR",
        default_value = "/run/podmotion/keys"
    )]
    pub key_material_dir: std::path::PathBuf,
}
