//! Node-agent executor: enters a target pod's namespaces from outside.
#![forbid(unsafe_code)]

use clap::Parser;
use podmotion_attach::agent::{self, Attached, Config};
use podmotion_attach::environ::EnvFilter;
use podmotion_attach::jobenv::{self, config_keys, env};
use podmotion_attach::nft::{DEFAULT_TABLE, Redirect};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};

#[derive(Debug, Parser)]
#[command(
    name = "podmotion-attach",
    about = "Attach a node-hosted agent to a running pod from outside"
)]
struct Cli {
    /// Accepted for the controller's `args: ["node-agent"]`; the only mode there is.
    #[arg(value_parser = ["node-agent"])]
    mode: Option<String>,
    #[command(flatten)]
    controller: ControllerArgs,
    #[command(flatten)]
    target: TargetArgs,
    #[command(flatten)]
    net: NetArgs,
    #[command(flatten)]
    files: FileArgs,
    /// Where the control API listens, in the Job pod's own network namespace.
    #[arg(long, env = "PODMOTION_ATTACH_LISTEN", default_value = "0.0.0.0:8400")]
    listen: SocketAddr,
    /// Where `GET /metrics` (Prometheus text, plain HTTP, counts only) listens, in the
    /// Job pod's own network namespace.
    #[arg(long, env = env::METRICS_LISTEN, default_value = "0.0.0.0:9090")]
    metrics_listen: SocketAddr,
    /// Most concurrent wiretaps of this agent, all ports together; each queues up to
    /// about 16 MiB for a slow reader, so this bounds their memory (4: 64 MiB). A
    /// wiretap past it is refused (429).
    #[arg(long, env = "PODMOTION_MAX_WIRETAPS", default_value_t = podmotion_attach::port::DEFAULT_MAX_WIRETAPS)]
    max_wiretaps: usize,
    /// Where to write the termination message on a fatal error.
    #[arg(
        long,
        env = "PODMOTION_TERMINATION_LOG",
        default_value = "/dev/termination-log"
    )]
    termination_log: PathBuf,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, env = env::LOG_FORMAT, default_value = "json")]
    log_format: podmotion_log::LogFormat,
}

#[derive(Debug, clap::Args)]
struct TargetArgs {
    /// CRI container IDs of the target pod (kubelet form accepted); the first is the primary.
    #[arg(
        long = "container-id",
        env = "PODMOTION_CONTAINER_IDS",
        value_delimiter = ','
    )]
    container_ids: Vec<String>,
    /// Target host PIDs, bypassing CRI resolution (repeatable or comma-separated; the
    /// first is the primary, like the first container id).
    #[arg(long, env = "PODMOTION_TARGET_PID", value_delimiter = ',')]
    pid: Vec<u32>,
    /// The container-runtime socket; when absent, well-known sockets under --host-run are probed.
    #[arg(long, env = env::CRI_SOCKET)]
    cri_socket: Option<PathBuf>,
    /// The node's /run (or the runtime socket's directory) as mounted into the Job
    /// pod. Default: AGENT_CRI_SOCKET_DIR, else /run.
    #[arg(long, env = "PODMOTION_HOST_RUN")]
    host_run: Option<PathBuf>,
    /// The host's /proc (the Job runs with hostPID).
    #[arg(long, env = "PODMOTION_PROC", default_value = "/proc")]
    proc_root: PathBuf,
}

#[derive(Debug, clap::Args)]
struct NetArgs {
    /// The agent GID (the Job's runAsGroup): the redirect exempts sockets owned by it.
    /// Default: AGENT_CONFIG's agentGID.
    #[arg(long, env = "PODMOTION_AGENT_GID")]
    agent_gid: Option<u32>,
    /// Intercepted port and its forwarder port, APP:AGENT (repeatable).
    #[arg(long = "port", env = "PODMOTION_PORTS", value_delimiter = ',', value_parser = parse_redirect)]
    ports: Vec<Redirect>,
    /// Name of the agent's nftables table (inet family) in the target namespace.
    #[arg(long, env = "PODMOTION_TABLE", default_value = DEFAULT_TABLE)]
    table: String,
    /// How long to wait for a predecessor agent to release the table and ports.
    #[arg(long, env = "PODMOTION_CLAIM_TIMEOUT_SECS", default_value_t = 30)]
    claim_timeout_secs: u64,
    /// How long an intercepted connection waits for a client stream.
    #[arg(long, env = "PODMOTION_INTERCEPT_WAIT_SECS", default_value_t = 10)]
    intercept_wait_secs: u64,
}

/// What the attachment controller puts in the Job (see `jobenv`).
#[derive(Debug, clap::Args)]
struct ControllerArgs {
    /// The sidecar-compatible agent configuration (JSON).
    #[arg(long, env = env::AGENT_CONFIG, hide_env_values = true)]
    agent_config: Option<String>,
    /// Container name → CRI ID (JSON object).
    #[arg(long, env = env::AGENT_CONTAINER_IDS)]
    container_ids_json: Option<String>,
    /// Where the runtime socket (or its directory) is mounted.
    #[arg(long, env = env::AGENT_CRI_SOCKET_DIR)]
    cri_socket_dir: Option<PathBuf>,
    /// Directory holding `token`: when set, the control API requires
    /// `Authorization: Bearer <token>` (all but /healthz). Manual runs; the controller
    /// gives --token-sha256.
    #[arg(long, env = env::AGENT_CREDENTIALS_DIR)]
    credentials_dir: Option<PathBuf>,
    /// SHA-256 (hex) of the control API's bearer token: the agent holds only this.
    /// Given but empty is an error.
    #[arg(long, env = env::AGENT_TOKEN_SHA256, hide_env_values = true)]
    token_sha256: Option<String>,
    /// Serve the control API on 127.0.0.1:<port> inside the target pod's network
    /// namespace (reached by port-forwarding to the target pod); --listen then answers
    /// /healthz only.
    #[arg(long, env = env::AGENT_CONTROL_PORT, value_parser = clap::value_parser!(u16).range(1..))]
    control_port: Option<u16>,
}

#[derive(Debug, clap::Args)]
struct FileArgs {
    /// Directory the export symlinks are created in.
    #[arg(
        long,
        env = env::EXPORTS_DIR,
        default_value = "/var/run/podmotion/exports"
    )]
    exports_dir: PathBuf,
    /// Container paths to export (repeatable); `/` exports the whole root.
    #[arg(
        long = "export",
        env = "PODMOTION_EXPORTS",
        value_delimiter = ',',
        default_value = "/"
    )]
    exports: Vec<String>,
    /// Prefix added to every environment name. Default: AGENT_CONFIG's config.envPrefix.
    #[arg(long, env = "PODMOTION_ENV_PREFIX")]
    env_prefix: Option<String>,
    /// Environment names to drop (`NAME` or `PREFIX*`), repeatable.
    #[arg(
        long = "env-exclude",
        env = "PODMOTION_ENV_EXCLUDE",
        value_delimiter = ','
    )]
    env_exclude: Vec<String>,
}

fn parse_redirect(s: &str) -> Result<Redirect, String> {
    let (a, b) = s.split_once(':').ok_or("expected APP:AGENT")?;
    let port = a.parse().map_err(|e| format!("app port: {e}"))?;
    let to = b.parse().map_err(|e| format!("agent port: {e}"))?;
    if port == 0 || to == 0 || port == to {
        return Err("ports must be non-zero and distinct".into());
    }
    Ok(Redirect { port, to })
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    podmotion_log::init(cli.log_format, "info");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    match rt.block_on(run(&cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err((reason, msg)) => {
            tracing::error!(reason, "{msg}");
            let _ = std::fs::write(&cli.termination_log, format!("{reason}: {msg}\n"));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Flags and `PODMOTION_*` first, the controller's `AGENT_*` environment for the rest.
fn config(cli: &Cli) -> Result<Config, String> {
    let c = &cli.controller;
    let agent_config = match &c.agent_config {
        Some(json) => jobenv::AgentConfig::parse(json)?,
        None => jobenv::AgentConfig::default(),
    };
    let container_ids = container_ids(cli, &agent_config)?;
    let agent_gid = cli
        .net
        .agent_gid
        .or(agent_config.agent_gid)
        .ok_or("no agent GID: give --agent-gid (or agentGID in AGENT_CONFIG)")?;
    let redirects = if cli.net.ports.is_empty() {
        jobenv::redirects(&agent_config)?
    } else {
        cli.net.ports.clone()
    };
    let env_filter = env_filter(cli, &agent_config);
    let token_verifier = token_verifier(c)?;
    Ok(Config {
        container_ids,
        pids: cli.target.pid.clone(),
        cri_socket: cli.target.cri_socket.clone(),
        host_run: cli
            .target
            .host_run
            .clone()
            .or_else(|| c.cri_socket_dir.clone())
            .unwrap_or_else(|| PathBuf::from("/run")),
        proc_root: cli.target.proc_root.clone(),
        agent_gid,
        redirects,
        table: cli.net.table.clone(),
        exports_dir: cli.files.exports_dir.clone(),
        export_paths: cli.files.exports.clone(),
        env_filter,
        listen: cli.listen,
        target_control_port: c.control_port,
        claim_timeout: Duration::from_secs(cli.net.claim_timeout_secs),
        intercept_wait: Duration::from_secs(cli.net.intercept_wait_secs),
        token_verifier,
        max_wiretaps: cli.max_wiretaps,
    })
}

/// The target containers: the flags', else the controller's `AGENT_CONTAINER_IDS`;
/// none at all is an error unless a PID is given.
fn container_ids(cli: &Cli, agent_config: &jobenv::AgentConfig) -> Result<Vec<String>, String> {
    let mut container_ids = cli.target.container_ids.clone();
    if container_ids.is_empty()
        && let Some(json) = &cli.controller.container_ids_json
    {
        container_ids = jobenv::container_ids(json, &agent_config.containers)?;
    }
    if container_ids.is_empty() && cli.target.pid.is_empty() {
        return Err("no target: give --container-id (or AGENT_CONTAINER_IDS) or --pid".into());
    }
    Ok(container_ids)
}

/// Which environment variables of the target are served: the flags', else the
/// controller's config.
fn env_filter(cli: &Cli, agent_config: &jobenv::AgentConfig) -> EnvFilter {
    let prefix = cli
        .files
        .env_prefix
        .clone()
        .or_else(|| agent_config.config.get(config_keys::ENV_PREFIX).cloned())
        .unwrap_or_default();
    let mut exclude = cli.files.env_exclude.clone();
    if exclude.is_empty()
        && let Some(list) = agent_config.config.get(config_keys::ENV_EXCLUDE)
    {
        exclude = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
    }
    EnvFilter { prefix, exclude }
}

/// The control API's token verifier: the controller's `AGENT_TOKEN_SHA256`, else the
/// SHA-256 of the token in `--credentials-dir`; none means no token is required.
fn token_verifier(c: &ControllerArgs) -> Result<Option<String>, String> {
    if let Some(v) = &c.token_sha256 {
        let v = v.trim();
        if v.len() != 64 || !v.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "{} must be the 64 hex digits of a SHA-256 (the Job's pod annotation is missing?): \
                 refusing to serve the control API without a credential",
                env::AGENT_TOKEN_SHA256
            ));
        }
        return Ok(Some(v.to_ascii_lowercase()));
    }
    match &c.credentials_dir {
        Some(dir) => Ok(Some(jobenv::token_verifier(&read_token(dir)?))),
        None => Ok(None),
    }
}

/// The control API's bearer token from the credential Secret mounted at `dir`.
fn read_token(dir: &std::path::Path) -> Result<String, String> {
    let path = dir.join("token");
    let t =
        std::fs::read_to_string(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let t = t.trim().to_owned();
    if t.is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    Ok(t)
}

async fn run(cli: &Cli) -> Result<(), (&'static str, String)> {
    let cfg = config(cli).map_err(|e| ("BadConfig", e))?;
    // Signals are hooked before attaching so a SIGTERM during attach still cleans up.
    let mut term = signal(SignalKind::terminate()).map_err(|e| ("Signal", e.to_string()))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| ("Signal", e.to_string()))?;
    // Metrics first: a scrape while the agent waits for a predecessor's table shows
    // the ruleset not installed yet.
    let attached: Arc<OnceLock<Arc<Attached>>> = Arc::new(OnceLock::new());
    let scraped = attached.clone();
    podmotion_metrics::start(cli.metrics_listen, move || {
        podmotion_attach::metrics::global().encode(scraped.get().map(|a| a.port_gauges()))
    })
    .await
    .map_err(|e| {
        (
            "MetricsListenFailed",
            format!("{}: {e}", cli.metrics_listen),
        )
    })?;
    let running = tokio::select! {
        r = agent::attach(&cfg) => r.map_err(|e| (e.category(), e.to_string()))?,
        _ = term.recv() => return Ok(()),
        _ = int.recv() => return Ok(()),
    };
    let _ = attached.set(running.attached.clone());
    tracing::info!(control = %running.control_addr, pid = running.attached.containers[0].pid, "attached");
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut reported: Vec<String> = Vec::new();
    let target_gone = loop {
        tokio::select! {
            _ = term.recv() => break false,
            _ = int.recv() => break false,
            _ = tick.tick() => {
                if !running.target_alive() { break true }
                for id in running.gone() {
                    if !reported.contains(&id) {
                        tracing::warn!(container = %id, "target container exited: its attachment has ended, requests about it are refused");
                        reported.push(id);
                    }
                }
            }
        }
    };
    let r = tokio::task::spawn_blocking(move || running.shutdown())
        .await
        .expect("shutdown task");
    r.map_err(|e| (e.category(), e.to_string()))?;
    tracing::info!("ruleset removed; exiting");
    if target_gone {
        return Err((
            "TargetGone",
            "the target process exited; this Job is for a container that no longer runs".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    fn cli(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("podmotion-attach").chain(args.iter().copied()))
            .unwrap()
    }

    #[test]
    fn controller_job_environment_configures_the_agent() {
        let dir = std::env::temp_dir().join(format!("pm-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("token"), "s3cret\n").unwrap();
        let c = cli(&[
            "node-agent",
            "--agent-config",
            r#"{"containers":["web"],"agentGID":4242,"ports":[8080],"config":{"envPrefix":"T_","envExclude":"HOME, KUBERNETES_*"}}"#,
            "--container-ids-json",
            r#"{"side":"containerd://s","web":"containerd://w"}"#,
            "--cri-socket-dir",
            "/host/cri",
            "--credentials-dir",
            dir.to_str().unwrap(),
        ]);
        let cfg = config(&c).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(cfg.container_ids, vec!["containerd://w", "containerd://s"]);
        assert_eq!(cfg.agent_gid, 4242);
        assert_eq!(
            cfg.redirects,
            vec![Redirect {
                port: 8080,
                to: jobenv::AGENT_PORT_BASE
            }]
        );
        assert_eq!(cfg.host_run, PathBuf::from("/host/cri"));
        assert_eq!(cfg.env_filter.prefix, "T_");
        assert_eq!(cfg.env_filter.exclude, vec!["HOME", "KUBERNETES_*"]);
        assert_eq!(
            cfg.token_verifier,
            Some(jobenv::token_verifier("s3cret")),
            "the agent keeps the verifier, not the token"
        );
    }

    #[test]
    fn explicit_flags_win_over_the_controller_environment() {
        let c = cli(&[
            "--agent-config",
            r#"{"agentGID":4242,"ports":[8080]}"#,
            "--agent-gid",
            "7777",
            "--port",
            "9090:16000",
            "--pid",
            "1",
        ]);
        let cfg = config(&c).unwrap();
        assert_eq!(cfg.agent_gid, 7777);
        assert_eq!(
            cfg.redirects,
            vec![Redirect {
                port: 9090,
                to: 16000
            }]
        );
        assert_eq!(cfg.host_run, PathBuf::from("/run"));
        assert!(cfg.token_verifier.is_none());
        assert_eq!(cfg.target_control_port, None);
    }

    #[test]
    fn the_controllers_verifier_and_loopback_port_configure_the_control_api() {
        let verifier = jobenv::token_verifier("t0k3n");
        let c = cli(&[
            "node-agent",
            "--pid",
            "1",
            "--agent-gid",
            "7",
            "--token-sha256",
            &verifier.to_ascii_uppercase(),
            "--control-port",
            "15000",
        ]);
        let cfg = config(&c).unwrap();
        assert_eq!(cfg.token_verifier, Some(verifier));
        assert_eq!(cfg.target_control_port, Some(15000));
        // The Job's annotation missing gives an empty variable: never serve open.
        for bad in ["", "abc", &"z".repeat(64)] {
            let c = cli(&["--pid", "1", "--agent-gid", "7", "--token-sha256", bad]);
            let e = config(&c).unwrap_err();
            assert!(e.contains("AGENT_TOKEN_SHA256"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn missing_target_or_gid_is_a_config_error() {
        assert!(config(&cli(&["--agent-gid", "1"])).is_err());
        assert!(config(&cli(&["--pid", "1"])).is_err());
    }

    #[test]
    fn redirect_parsing_rejects_equal_or_zero_ports() {
        assert_eq!(
            parse_redirect("8080:15001").unwrap(),
            Redirect {
                port: 8080,
                to: 15001
            }
        );
        assert!(parse_redirect("8080:8080").is_err());
        assert!(parse_redirect("0:1").is_err());
        assert!(parse_redirect("8080").is_err());
    }
}
