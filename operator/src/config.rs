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
