//! The migration controller's settings: flags with environment fallbacks.

use clap::{Args, Parser};

use crate::migration::render::Holder;

/// Settings of the migration controller (flags with environment fallbacks).
#[derive(Args, Clone, Debug)]
pub struct MigrationConfig {
    /// Reach the agent of NODE at URL instead of through its agent pod (local runs
    /// where nodes are simulated): NODE=URL, repeatable or comma-separated.
    #[arg(long = "migration-agent-endpoint", env = "PODMOTION_AGENT_ENDPOINTS", value_delimiter = ',', value_parser = parse_endpoint)]
    pub agent_endpoints: Vec<(String, String)>,

    /// Namespace of the node-agent DaemonSet's pods.
    #[arg(
        long = "migration-agent-namespace",
        env = "PODMOTION_AGENT_NAMESPACE",
        default_value = "podmotion-system"
    )]
    pub agent_namespace: String,

    /// Label selector of the node-agent DaemonSet's pods.
    #[arg(
        long = "migration-agent-selector",
        env = "PODMOTION_AGENT_SELECTOR",
        default_value = "app.kubernetes.io/name=podmotion-agent"
    )]
    pub agent_selector: String,

    /// gRPC port of the node agents.
    #[arg(
        long = "migration-agent-port",
        env = "PODMOTION_AGENT_PORT",
        default_value_t = 7443
    )]
    pub agent_port: u16,

    /// Most migrations past `Pending` at once in the cluster.
    #[arg(
        long = "migration-max-parallel",
        env = "PODMOTION_MIGRATION_MAX_PARALLEL",
        default_value_t = 5
    )]
    pub max_parallel: usize,

    /// Most migrations past `Pending` at once out of one source node.
    #[arg(
        long = "migration-max-per-node",
        env = "PODMOTION_MIGRATION_MAX_PER_NODE",
        default_value_t = 2
    )]
    pub max_per_node: usize,

    /// CA (PEM) that signs the node agents' certificates (mutual TLS).
    #[arg(long = "migration-agent-tls-ca", env = "PODMOTION_AGENT_TLS_CA")]
    pub agent_tls_ca: Option<String>,
    /// The operator's client certificate (PEM) for the node agents.
    #[arg(long = "migration-agent-tls-cert", env = "PODMOTION_AGENT_TLS_CERT")]
    pub agent_tls_cert: Option<String>,
    /// The operator's client key (PEM) for the node agents.
    #[arg(long = "migration-agent-tls-key", env = "PODMOTION_AGENT_TLS_KEY")]
    pub agent_tls_key: Option<String>,

    /// Reconcile PodMigrations of this namespace only (default: all namespaces).
    #[arg(
        id = "migration_namespace",
        long = "migration-namespace",
        env = "PODMOTION_MIGRATION_NAMESPACE"
    )]
    pub watch_namespace: Option<String>,

    /// File holding the master key per-migration transfer keys are derived from (at
    /// least 32 bytes). Without it a random key is used, and a migration in flight
    /// when the operator restarts fails its transfer and rolls back.
    #[arg(long = "migration-key-file", env = "PODMOTION_MIGRATION_KEY_FILE")]
    pub key_file: Option<std::path::PathBuf>,

    /// Deadline, in seconds, of every call the controller makes to a node agent (its
    /// report, and the start of a step; a step's own work is bounded by the
    /// PodMigration's `progressTimeoutSeconds`). An agent that does not answer in time
    /// counts as unreachable for that round.
    #[arg(
        long = "migration-agent-call-timeout-seconds",
        env = "PODMOTION_MIGRATION_AGENT_CALL_TIMEOUT_SECONDS",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=300)
    )]
    pub agent_call_timeout_seconds: u64,

    /// How late, in milliseconds, the cluster's Service data plane may program an
    /// endpoint change (kube-proxy's `minSyncPeriod`, 1 s by default; 0 for one that
    /// programs changes as they come). A moved pod's source is killed only once the
    /// Services can have stopped sending it new connections (this, plus a margin,
    /// after its deletion); a connection sent to it after its kill is refused.
    #[arg(
        long = "migration-service-sync-millis",
        env = "PODMOTION_MIGRATION_SERVICE_SYNC_MILLIS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(0..=60_000)
    )]
    pub service_sync_millis: u64,

    /// Once a moved pod's target passed its probe, have the source's node send the new
    /// TCP connections that would reach the frozen source to the target until the
    /// source is killed (its broker's `--forward-new-connections` must be on too;
    /// Helm: `migration.forwardNewConnections`). Needs list on EndpointSlices and get
    /// on Services in the watched namespaces. Off: those connections wait for a SYN
    /// retransmission until the Services let the source go.
    #[arg(
        long = "migration-forward-new-connections",
        env = "PODMOTION_MIGRATION_FORWARD_NEW_CONNECTIONS",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub forward_new_connections: bool,

    /// Run exec application probes (`spec.probe.exec`) through the API server's
    /// pods/exec subresource; the operator's ServiceAccount must hold pods/exec create
    /// (Helm: `migration.execProbes.enabled`). Off: a PodMigration with an exec probe
    /// is refused before anything freezes (`ExecProbeDisabled`).
    #[arg(
        long = "migration-exec-probes",
        env = "PODMOTION_MIGRATION_EXEC_PROBES",
        default_value_t = false
    )]
    pub exec_probes: bool,

    /// Image whose entrypoint is `podmotion-agent` (the migration agent's image): a
    /// target pod's init container copies the holder program out of it. Default: the
    /// agent image of this version.
    #[arg(long = "migration-holder-image", env = "PODMOTION_HOLDER_IMAGE")]
    pub holder_image: Option<String>,
}

fn parse_endpoint(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((node, url)) if !node.is_empty() && !url.is_empty() => Ok((node.into(), url.into())),
        _ => Err(format!("expected NODE=URL, got {s:?}")),
    }
}

impl MigrationConfig {
    /// The settings from the environment alone (until the binary flattens the flags).
    pub fn from_env() -> anyhow::Result<MigrationConfig> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            m: MigrationConfig,
        }
        Ok(Only::try_parse_from(["podmotion-operator"])?.m)
    }
    /// The deadline of one call to a node agent.
    pub fn agent_call_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.agent_call_timeout_seconds)
    }

    /// How late the Services may program an endpoint change.
    pub fn service_sync(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.service_sync_millis)
    }

    pub(super) fn holder(&self) -> Holder {
        match &self.holder_image {
            Some(i) if !i.is_empty() => Holder {
                installer_image: i.clone(),
            },
            _ => Holder::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_overrides_parse_as_node_equals_url() {
        assert_eq!(
            parse_endpoint("pm-node-0=http://127.0.0.1:7001").unwrap().0,
            "pm-node-0"
        );
        assert!(parse_endpoint("pm-node-0").is_err());
        assert!(parse_endpoint("=http://x").is_err());
    }

    #[test]
    fn settings_default_to_five_per_cluster_and_two_per_node() {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            m: MigrationConfig,
        }
        let c = Only::try_parse_from(["x"]).unwrap().m;
        assert_eq!((c.max_parallel, c.max_per_node), (5, 2));
        assert_eq!(c.agent_call_timeout(), std::time::Duration::from_secs(10));
        assert_eq!(c.service_sync(), std::time::Duration::from_secs(1));
        assert!(c.forward_new_connections, "the forward is on by default");
        let off = Only::try_parse_from(["x", "--migration-forward-new-connections=false"]);
        assert!(!off.unwrap().m.forward_new_connections);
        assert!(
            Only::try_parse_from(["x", "--migration-agent-call-timeout-seconds", "0"]).is_err(),
            "a call without a deadline is refused"
        );
        let c = Only::try_parse_from(["x", "--migration-agent-endpoint", "a=http://1,b=http://2"])
            .unwrap()
            .m;
        assert_eq!(c.agent_endpoints.len(), 2);
        assert!(!c.exec_probes, "exec probes are off unless enabled");
        assert!(
            Only::try_parse_from(["x", "--migration-exec-probes"])
                .unwrap()
                .m
                .exec_probes
        );
    }
}
