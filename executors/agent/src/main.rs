//! podmotion-agent: serves the MigrationAgent gRPC service over mutual TLS.
#![forbid(unsafe_code)]

use clap::Parser;
use podmotion_agent::{
    containers::Containers,
    criu::Criu,
    csr, images,
    service::{Agent, Config, FreezeWatchdog, leader_term::TermRecord},
};
use podmotion_wire::client::{TlsFiles, tls_incoming};
use podmotion_wire::proto::migration_agent_server::MigrationAgentServer;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address to serve gRPC on.
    #[arg(long, env = "PODMOTION_AGENT_LISTEN", default_value = "0.0.0.0:7443")]
    listen: std::net::SocketAddr,
    /// Address to serve Prometheus text on (`GET /metrics`, plain HTTP, counts only).
    #[arg(
        long,
        env = "PODMOTION_AGENT_METRICS_LISTEN",
        default_value = "0.0.0.0:9090"
    )]
    metrics_listen: std::net::SocketAddr,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, env = podmotion_log::ENV, default_value = "json")]
    log_format: podmotion_log::LogFormat,
    /// CA bundle file (PEM), with `--tls-cert` and `--tls-key`: the identity comes from
    /// files, re-read every `--tls-reload-seconds` (tests, or certificates managed
    /// elsewhere). Without them, `--identity-from-csr` is required.
    #[arg(long, env = "PODMOTION_TLS_CA", requires_all = ["tls_cert", "tls_key"], conflicts_with = "identity_from_csr")]
    tls_ca: Option<PathBuf>,
    #[arg(long, env = "PODMOTION_TLS_CERT", requires = "tls_ca")]
    tls_cert: Option<PathBuf>,
    #[arg(long, env = "PODMOTION_TLS_KEY", requires = "tls_ca")]
    tls_key: Option<PathBuf>,
    /// Seconds between re-reads of the TLS files.
    #[arg(long, env = "PODMOTION_TLS_RELOAD_SECONDS", default_value_t = 30)]
    tls_reload_seconds: u64,
    /// Get this node's certificate from the operator with a CertificateSigningRequest
    /// (signer podmotion.io/agent-serving) and trust the CA bundle of
    /// `--ca-bundle-configmap`; both are renewed while the agent runs.
    #[arg(
        long,
        env = "PODMOTION_IDENTITY_FROM_CSR",
        required_unless_present = "tls_ca"
    )]
    identity_from_csr: bool,
    /// This node's name (downward API): the identity asked for.
    #[arg(long, env = "NODE_NAME", required_if_eq("identity_from_csr", "true"))]
    node_name: Option<String>,
    /// The agent's namespace (downward API), where the CA bundle ConfigMap is.
    #[arg(
        long,
        env = "POD_NAMESPACE",
        required_if_eq("identity_from_csr", "true")
    )]
    namespace: Option<String>,
    /// ConfigMap (key `ca.crt`) holding the CA bundle the operator publishes.
    #[arg(
        long,
        env = "PODMOTION_CA_BUNDLE_CONFIGMAP",
        default_value = "podmotion-agent-ca"
    )]
    ca_bundle_configmap: String,
    /// criu binary (or the wrapper installed by hack/install-criu.sh).
    #[arg(long, env = "PODMOTION_CRIU", default_value = "criu")]
    criu: PathBuf,
    #[arg(
        long,
        env = "PODMOTION_BROKER_SOCKET",
        default_value = "/run/podmotion/broker.sock"
    )]
    broker_socket: PathBuf,
    /// The node's /run (or the CRI socket's directory) as mounted into the agent: the
    /// runtime socket is found there at a well-known path (containerd, CRI-O,
    /// cri-dockerd) and resolves the operator's container IDs to host PIDs.
    #[arg(long, env = "PODMOTION_CRI_RUN_DIR", default_value = "/run")]
    cri_run_dir: PathBuf,
    /// Where the node's root filesystem is mounted into the agent (read-only, with
    /// host-to-container propagation): paths in the runtime's container specs are node
    /// paths, found under it.
    #[arg(long, env = "PODMOTION_HOST_ROOT", default_value = "/")]
    host_root: PathBuf,
    /// Local runs only (nodes simulated by kwok): resolve container IDs through a file
    /// of `<container-id> <pid>` lines instead of the container runtime.
    #[arg(long, env = "PODMOTION_CONTAINER_TABLE")]
    container_table: Option<PathBuf>,
    /// Also accept the chart's legacy certificates without a URI SAN (one agent
    /// certificate shared by every node, CN `podmotion-agent`; the operator's, CN
    /// `podmotion-operator`). Off by default: with it, any agent may stream images to
    /// a migration this agent receives (see the agent's authz module).
    #[arg(long, env = "PODMOTION_AGENT_LEGACY_SHARED_IDENTITY")]
    legacy_shared_identity: bool,
    /// tmpfs directory for checkpoint images.
    #[arg(
        long,
        env = "PODMOTION_CHECKPOINTS",
        default_value = "/run/podmotion/checkpoints"
    )]
    checkpoints_root: PathBuf,
    /// Directory for what the agent must remember across its restarts: the highest
    /// operator leader term it admitted (`leader-term`), so a stale leader cannot
    /// command a restarted agent. It must outlive the agent's container (the chart: a
    /// hostPath in the release's run directory on the node). Default: `agent` beside
    /// the checkpoint root (`/run/podmotion/agent` with the default root).
    #[arg(long, env = "PODMOTION_AGENT_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The freeze watchdog's margin: a source still frozen its migration's freeze
    /// budget plus this long after the final dump is resumed by the agent itself.
    #[arg(
        long,
        env = "PODMOTION_FREEZE_WATCHDOG_MARGIN_MS",
        default_value_t = 60_000
    )]
    freeze_watchdog_margin_ms: u64,
    /// The freeze budget assumed when the operator's Prepare names none.
    #[arg(
        long,
        env = "PODMOTION_FREEZE_WATCHDOG_DEFAULT_BUDGET_MS",
        default_value_t = 60_000
    )]
    freeze_watchdog_default_budget_ms: u64,
    /// How long one call to the node's broker may take; a call past it fails and ends
    /// that migration's broker lease (the broker rolls the source back, or kills it if
    /// fenced).
    #[arg(
        long,
        env = "PODMOTION_BROKER_CALL_TIMEOUT_SECONDS",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=3600)
    )]
    broker_call_timeout_seconds: u64,
}

fn main() -> anyhow::Result<()> {
    // CRIU's launch stages (crate::pidns) are this binary too; they run before any
    // thread exists, as entering namespaces requires.
    let argv: Vec<String> = std::env::args().collect();
    if let Some(code) = podmotion_agent::pidns::run_stage(&argv) {
        std::process::exit(code);
    }
    if let Some(code) = podmotion_agent::creds::run_stage(&argv) {
        std::process::exit(code);
    }
    // The target pod's holder (crate::holder) is this binary too.
    if let Some(code) = podmotion_agent::holder::run_mode(&argv) {
        std::process::exit(code);
    }
    tokio::runtime::Runtime::new()?.block_on(serve())
}

async fn serve() -> anyhow::Result<()> {
    let a = Args::parse();
    podmotion_log::init(a.log_format, "info");
    zeroize_leftover_images(&a.checkpoints_root)?;
    // Before anything else can fail late: an unreadable record stops the agent here.
    let term_record = leader_term_record(&a)?;
    let track_mem = criu_tracks_dirty_memory(&a.criu);
    let criu = Criu {
        binary: a.criu.clone(),
    };
    let (maj, min) = criu.version()?;
    tracing::info!(criu = %format!("{maj}.{min}"), track_mem, "criu reachable over RPC");
    let tls = identity(&a).await?;
    let containers = container_resolver(&a);
    tracing::info!(?containers, "container IDs resolve through");
    let agent = Agent::new(Config {
        criu,
        containers,
        track_mem,
        broker_socket: a.broker_socket,
        checkpoints_root: a.checkpoints_root,
        tls: tls.clone(),
        legacy_shared_identity: a.legacy_shared_identity,
        freeze_watchdog: FreezeWatchdog {
            margin: std::time::Duration::from_millis(a.freeze_watchdog_margin_ms),
            default_budget: std::time::Duration::from_millis(a.freeze_watchdog_default_budget_ms),
        },
        broker_call_timeout: std::time::Duration::from_secs(a.broker_call_timeout_seconds),
    })?
    .with_leader_term_record(term_record)?;
    let agent = std::sync::Arc::new(agent);
    let scraped = std::sync::Arc::clone(&agent);
    podmotion_metrics::start(a.metrics_listen, move || {
        podmotion_agent::metrics::global().encode(&scraped.frozen_sources())
    })
    .await?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        listen = %a.listen,
        metrics = %a.metrics_listen,
        "agent serving"
    );
    let signal = serve_until_terminated(a.listen, tls, &agent).await?;
    // Every source this agent froze is resumed before it exits (no freeze outlives its
    // agent), every fenced one killed (never two copies).
    let (thawed, killed) = agent.thaw_frozen_sources(signal).await;
    tracing::info!(signal, thawed, killed, "agent exiting");
    Ok(())
}

/// Checks the checkpoint directory and zeroizes the images a previous run left there.
fn zeroize_leftover_images(checkpoints_root: &std::path::Path) -> anyhow::Result<()> {
    images::check_root(checkpoints_root)?;
    let swept = images::sweep(checkpoints_root)?;
    if swept > 0 {
        tracing::warn!(swept, "zeroized checkpoint images left by a previous run");
    }
    Ok(())
}

/// The node's record of the highest leader term this agent admitted, in `--state-dir`
/// (default: `agent` beside the checkpoint root, so each testbed node gets its own).
fn leader_term_record(a: &Args) -> anyhow::Result<TermRecord> {
    let dir = match (&a.state_dir, a.checkpoints_root.parent()) {
        (Some(d), _) => d.clone(),
        (None, Some(p)) if !p.as_os_str().is_empty() => p.join("agent"),
        (None, _) => anyhow::bail!(
            "--state-dir is needed: the checkpoint root {} has no parent directory",
            a.checkpoints_root.display()
        ),
    };
    Ok(TermRecord::open(&dir)?)
}

/// Whether CRIU can track soft-dirty memory here, which decides how pre-copy works
/// (see service::Config::track_mem).
fn criu_tracks_dirty_memory(criu: &std::path::Path) -> bool {
    std::process::Command::new(criu)
        .args(["check", "--feature", "mem_dirty_track"])
        .output()
        .map(|o| o.status.success() && !String::from_utf8_lossy(&o.stderr).contains("OFF"))
        .unwrap_or(false)
}

/// The agent's TLS identity: from files re-read periodically, or a certificate the
/// operator issues through a CertificateSigningRequest.
async fn identity(a: &Args) -> anyhow::Result<TlsFiles> {
    if let (Some(ca), Some(cert), Some(key)) = (&a.tls_ca, &a.tls_cert, &a.tls_key) {
        let tls = TlsFiles::load(
            &ca.to_string_lossy(),
            &cert.to_string_lossy(),
            &key.to_string_lossy(),
        )?;
        tls.watch_files(std::time::Duration::from_secs(a.tls_reload_seconds.max(1)));
        return Ok(tls);
    }
    let client = kube::Client::try_default().await?;
    let settings = csr::CsrSettings {
        node: a.node_name.clone().unwrap_or_default(),
        namespace: a.namespace.clone().unwrap_or_default(),
        bundle_configmap: a.ca_bundle_configmap.clone(),
        timeout: std::time::Duration::from_secs(120),
    };
    Ok(csr::start(client, settings).await?)
}

/// How container IDs resolve to host PIDs: the container runtime, or (kwok) a table.
fn container_resolver(a: &Args) -> Containers {
    match &a.container_table {
        Some(path) => Containers::Table { path: path.clone() },
        None => Containers::Cri {
            run_dir: a.cri_run_dir.clone(),
            host: podmotion_agent::mounts::HostView {
                host_root: a.host_root.clone(),
            },
        },
    }
}

/// Serves the MigrationAgent service on `listen` until SIGTERM or SIGINT (or until the
/// server stops), returning what stopped it.
async fn serve_until_terminated(
    listen: std::net::SocketAddr,
    tls: TlsFiles,
    agent: &std::sync::Arc<Agent>,
) -> anyhow::Result<&'static str> {
    // TLS is ours, not tonic's: every handshake uses the certificate and CA bundle
    // current at that moment (renewals are served without a restart); tonic still
    // sees the peer's certificates (`Request::peer_certs`).
    let listener = tokio::net::TcpListener::bind(listen).await?;
    // Large HTTP/2 windows and no Nagle: with the 64 KiB defaults each window
    // round trip of the image stream waits on a delayed ACK (~1.5 MB/s measured).
    let served = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(8 << 20))
        .initial_connection_window_size(Some(16 << 20))
        // The image stream's 1 MiB chunks in 1 MiB DATA frames, not 64 of 16 KiB.
        .max_frame_size(Some(1 << 20))
        .add_service(
            MigrationAgentServer::new(podmotion_agent::metrics::Observed {
                agent: std::sync::Arc::clone(agent),
            })
            .max_decoding_message_size(4 << 20),
        )
        .serve_with_incoming(tls_incoming(listener, tls));
    // SIGTERM (pod deletion, rollout, node drain) stops taking calls at once; the
    // calls in flight are not waited for (a Send to a dead target could hold the
    // exit past the grace period).
    Ok(tokio::select! {
        r = served => { r?; "server stopped" }
        s = terminated() => s,
    })
}

/// Resolves on SIGTERM or SIGINT, with the signal's name.
async fn terminated() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Args::command().debug_assert();
    }
}
