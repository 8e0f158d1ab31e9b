//! The attach sequence and the agent's lifetime: resolve the target, refuse what we
//! cannot attach to safely, read env and exports, bind the forwarders and program
//! the ruleset inside the target namespace, serve the control API, and tear the
//! ruleset down on every way out.

pub use crate::attached::{Attached, Container};
use crate::cri::{self, CriClient};
use crate::environ::{self, EnvFilter};
use crate::exports;
use crate::forward;
use crate::netns::{self, NetnsExecutor};
use crate::nft::{NftError, NftSession, Redirect, Ruleset};
use crate::pinned::Pinned;
use crate::port::{Port, TapBudget};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Config {
    /// CRI container IDs (kubelet form `containerd://…` accepted); the first one is
    /// the primary container whose namespaces are entered.
    pub container_ids: Vec<String>,
    /// Target PIDs given directly instead of resolving container IDs (the first is
    /// the primary).
    pub pids: Vec<u32>,
    pub cri_socket: Option<PathBuf>,
    pub host_run: PathBuf,
    pub proc_root: PathBuf,
    pub agent_gid: u32,
    pub redirects: Vec<Redirect>,
    pub table: String,
    pub exports_dir: PathBuf,
    pub export_paths: Vec<String>,
    pub env_filter: EnvFilter,
    /// The Job pod's own control address: `/healthz` only when
    /// [`Config::target_control_port`] is set, else the whole control API.
    pub listen: SocketAddr,
    /// Serve the control API on `127.0.0.1:<port>` inside the target's network
    /// namespace: a client reaches it by port-forwarding to the target pod, in its own
    /// namespace, and the agents' namespace needs no client at all.
    pub target_control_port: Option<u16>,
    pub claim_timeout: Duration,
    pub intercept_wait: Duration,
    /// SHA-256 (hex) of the bearer token the control API requires (all routes but
    /// /healthz); the agent never holds the token.
    pub token_verifier: Option<String>,
    /// Most concurrent wiretaps, all ports together (the installer's choice).
    pub max_wiretaps: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(transparent)]
    Cri(#[from] cri::CriError),
    #[error(
        "target pid {pid} runs in its own user namespace (hostUsers: false): the agent's GID owner match (meta skgid) cannot identify its sockets there, and the packet-mark discriminator is not implemented; node-agent attachment to user-namespaced pods is not supported"
    )]
    UserNamespaced { pid: u32 },
    #[error(
        "the agent runs with effective GID {actual}, not the configured agent GID {expected}: its own sockets would be redirected back into itself (set the Job's runAsGroup)"
    )]
    WrongGid { expected: u32, actual: u32 },
    #[error("containers {0} and {1} are not in the same network namespace")]
    SplitPod(String, String),
    #[error("reading target {what}: {source}")]
    Proc {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Export(#[from] exports::ExportError),
    #[error(transparent)]
    Netns(#[from] netns::NetnsError),
    #[error("binding forwarder port {port} in the target namespace: {source}")]
    Bind { port: u16, source: std::io::Error },
    #[error(transparent)]
    Nft(#[from] NftError),
    #[error("binding the control API on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "binding the control API on 127.0.0.1:{port} in the target pod: {source} (the port is the installer's, chart value attachment.controlPort; choose one the workload does not use)"
    )]
    TargetListen { port: u16, source: std::io::Error },
    #[error(
        "the control port {0} is also a forwarder port of AGENT_CONFIG: choose another agentPort (or the installer another attachment.controlPort)"
    )]
    ControlPortTaken(u16),
    #[error("no container IDs and no pid given")]
    NoTarget,
}

impl AttachError {
    /// Bounded reason, used as termination-message reason and log field.
    pub fn category(&self) -> &'static str {
        match self {
            AttachError::Cri(e) => e.category(),
            AttachError::UserNamespaced { .. } => "UserNamespacedTarget",
            AttachError::WrongGid { .. } => "WrongAgentGid",
            AttachError::SplitPod(..) => "SplitPod",
            AttachError::Proc { .. } => "TargetProcUnreadable",
            AttachError::Export(_) => "ExportFailed",
            AttachError::Netns(_) => "NetnsFailed",
            AttachError::Bind { .. } => "ForwarderBindFailed",
            AttachError::Nft(e) => e.category(),
            AttachError::Listen { .. } | AttachError::TargetListen { .. } => "ControlListenFailed",
            AttachError::ControlPortTaken(_) => "ControlPortTaken",
            AttachError::NoTarget => "NoTarget",
        }
    }
}

/// Resolves container IDs to PIDs over one CRI connection.
async fn resolve(cfg: &Config) -> Result<(Vec<(String, u32)>, Option<PathBuf>), AttachError> {
    if !cfg.pids.is_empty() {
        let targets = cfg
            .pids
            .iter()
            .map(|p| (format!("pid://{p}"), *p))
            .collect();
        return Ok((targets, None));
    }
    let first = cfg.container_ids.first().ok_or(AttachError::NoTarget)?;
    let client = match &cfg.cri_socket {
        Some(path) => CriClient::connect(path).await?,
        None => cri::discover(&cfg.host_run, first).await?,
    };
    let mut out = Vec::new();
    for id in &cfg.container_ids {
        out.push((id.clone(), client.container_pid(id).await?));
    }
    Ok((out, Some(client.socket().to_owned())))
}

fn proc_err(what: String) -> impl FnOnce(std::io::Error) -> AttachError {
    move |source| AttachError::Proc { what, source }
}

/// Retries `f` until it succeeds, fails with a non-retryable error, or the claim
/// timeout passes. Used while a predecessor agent still holds the table or ports.
async fn claim<T, E: std::fmt::Display, F, Fut>(
    timeout: Duration,
    what: &str,
    retryable: impl Fn(&E) -> bool,
    mut f: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let mut logged = false;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if retryable(&e) && tokio::time::Instant::now() < deadline => {
                if !logged {
                    tracing::warn!(error = %e, "{what}: waiting for the previous agent to let go");
                    logged = true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// A running attachment. Dropping it closes the netlink socket, which removes the
/// table; [`Running::shutdown`] deletes it explicitly first.
pub struct Running {
    pub attached: Arc<Attached>,
    pub control_addr: SocketAddr,
    nft: Arc<NftSession>,
    netns: Arc<NetnsExecutor>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

pub async fn attach(cfg: &Config) -> Result<Running, AttachError> {
    let egid = nix::unistd::getegid().as_raw();
    if egid != cfg.agent_gid {
        return Err(AttachError::WrongGid {
            expected: cfg.agent_gid,
            actual: egid,
        });
    }
    if let Some(port) = cfg.target_control_port
        && cfg.redirects.iter().any(|r| r.to == port || r.port == port)
    {
        return Err(AttachError::ControlPortTaken(port));
    }
    let (targets, cri_socket) = resolve(cfg).await?;
    let pid = targets[0].1;
    // Pinned first: from here on nothing is read through a PID.
    let containers = read_containers(cfg, &targets)?;
    let primary = containers[0].pin.clone();
    let exports = exports::populate(
        &cfg.exports_dir,
        &primary.path().join("root"),
        &cfg.export_paths,
    )?;
    let mounts =
        exports::read_mounts(&primary).map_err(proc_err(format!("pid {pid} mountinfo")))?;

    let netns = Arc::new(NetnsExecutor::open(&primary.path().join("ns/net"))?);

    // Forwarders first, then the ruleset: a redirect never points at a port nobody
    // listens on. A predecessor may still hold the ports for a moment.
    let (ports, listeners) = bind_forwarders(cfg, &netns).await?;
    let (nft, ruleset) = program_ruleset(cfg, &netns).await?;
    tracing::info!(pid, table = %ruleset.table, "ruleset applied in the target network namespace");
    crate::metrics::global().ruleset(Some(ruleset.redirects.len()));

    let attached = Arc::new(Attached {
        containers,
        exports_dir: cfg.exports_dir.clone(),
        exports,
        mounts,
        ports,
        ruleset,
        cri_socket,
        // The verifier (`api::authorized` compares the token's SHA-256 with it).
        token: cfg.token_verifier.clone(),
    });
    let (tasks, control_addr) = serve(cfg, &attached, listeners, &netns).await?;
    Ok(Running {
        attached,
        control_addr,
        nft,
        netns,
        tasks,
    })
}

/// The target containers with their (filtered) environments, after checking that each
/// shares our user namespace and the first container's network namespace.
fn read_containers(cfg: &Config, targets: &[(String, u32)]) -> Result<Vec<Container>, AttachError> {
    let proc = cfg.proc_root.as_path();
    let own_user = netns::ns_inode(&proc.join("self/ns/user"))
        .map_err(proc_err("own user namespace".into()))?;
    let mut containers: Vec<Container> = Vec::new();
    for (id, cpid) in targets {
        let pin = Arc::new(Pinned::open(proc, *cpid).map_err(proc_err(format!("pid {cpid}")))?);
        let user = pin
            .ns_inode("user")
            .map_err(proc_err(format!("pid {cpid} user namespace")))?;
        if user != own_user {
            return Err(AttachError::UserNamespaced { pid: *cpid });
        }
        let net = pin
            .ns_inode("net")
            .map_err(proc_err(format!("pid {cpid} net namespace")))?;
        if let Some(primary) = containers.first() {
            let primary_net = primary
                .pin
                .ns_inode("net")
                .map_err(proc_err(format!("pid {} net namespace", primary.pid)))?;
            if net != primary_net {
                return Err(AttachError::SplitPod(targets[0].0.clone(), id.clone()));
            }
        }
        let env = environ::read_environ(&pin).map_err(proc_err(format!("pid {cpid} environ")))?;
        containers.push(Container {
            id: id.clone(),
            pid: *cpid,
            env: cfg.env_filter.apply(env),
            pin,
        });
    }
    Ok(containers)
}

type Listeners = Vec<(Arc<Port>, tokio::net::TcpListener)>;

/// Binds the forwarder of every redirect in the target network namespace, waiting out
/// a predecessor that still holds a port.
async fn bind_forwarders(
    cfg: &Config,
    netns: &NetnsExecutor,
) -> Result<(Vec<Arc<Port>>, Listeners), AttachError> {
    let mut ports = Vec::new();
    let mut listeners = Vec::new();
    let taps = TapBudget::new(cfg.max_wiretaps);
    for r in &cfg.redirects {
        let ls = claim(
            cfg.claim_timeout,
            "binding forwarder",
            |e: &std::io::Error| e.kind() == std::io::ErrorKind::AddrInUse,
            || forward::bind(netns, r.to),
        )
        .await
        .map_err(|source| AttachError::Bind { port: r.to, source })?;
        let port = Arc::new(Port::with_tap_budget(r.port, r.to, taps.clone()));
        for l in ls {
            listeners.push((port.clone(), l));
        }
        ports.push(port);
    }
    Ok((ports, listeners))
}

/// Applies the redirect ruleset in the target network namespace, waiting out a
/// predecessor that still holds the table.
async fn program_ruleset(
    cfg: &Config,
    netns: &NetnsExecutor,
) -> Result<(Arc<NftSession>, Ruleset), AttachError> {
    let nft = Arc::new(
        netns
            .run(|| NftSession::open_here().map_err(|e| std::io::Error::other(e.to_string())))
            .await?,
    );
    let ruleset = Ruleset {
        table: cfg.table.clone(),
        agent_gid: cfg.agent_gid,
        redirects: cfg.redirects.clone(),
    };
    {
        let nft = nft.clone();
        let rs = ruleset.clone();
        claim(
            cfg.claim_timeout,
            "programming the ruleset",
            |e: &NftError| matches!(e, NftError::HeldByOther { .. }),
            move || {
                let nft = nft.clone();
                let rs = rs.clone();
                async move {
                    tokio::task::spawn_blocking(move || nft.apply(&rs))
                        .await
                        .expect("apply task")
                }
            },
        )
        .await?;
    }
    Ok((nft, ruleset))
}

/// Starts the forwarders and the control API; returns their tasks and the control
/// API's address.
async fn serve(
    cfg: &Config,
    attached: &Arc<Attached>,
    listeners: Listeners,
    netns: &Arc<NetnsExecutor>,
) -> Result<(Vec<tokio::task::JoinHandle<()>>, SocketAddr), AttachError> {
    let mut tasks = Vec::new();
    for (port, l) in listeners {
        tasks.push(tokio::spawn(forward::serve(
            port,
            l,
            netns.clone(),
            cfg.intercept_wait,
        )));
    }
    let control = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|source| AttachError::Listen {
            addr: cfg.listen,
            source,
        })?;
    let control_addr = control.local_addr().map_err(|source| AttachError::Listen {
        addr: cfg.listen,
        source,
    })?;
    match cfg.target_control_port {
        Some(port) => {
            let api = claim(
                cfg.claim_timeout,
                "binding the control API in the target pod",
                |e: &std::io::Error| e.kind() == std::io::ErrorKind::AddrInUse,
                || bind_loopback(netns, port),
            )
            .await
            .map_err(|source| AttachError::TargetListen { port, source })?;
            tasks.push(tokio::spawn(crate::api::serve(api, attached.clone())));
            tasks.push(tokio::spawn(crate::api::serve_health(
                control,
                attached.clone(),
            )));
        }
        None => tasks.push(tokio::spawn(crate::api::serve(control, attached.clone()))),
    }
    Ok((tasks, control_addr))
}

/// A listener on `127.0.0.1:<port>` inside the target's network namespace. The kubelet's
/// port-forward (containerd: a dial of `localhost:<port>` from inside the pod's network
/// namespace) reaches it; nothing outside the pod does (loopback is not routed, and no
/// NetworkPolicy is involved). A predecessor agent may still hold it for a moment.
async fn bind_loopback(
    netns: &NetnsExecutor,
    port: u16,
) -> std::io::Result<tokio::net::TcpListener> {
    let l = netns
        .run(move || std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, port)))
        .await
        .map_err(|e| match e {
            netns::NetnsError::Op(e) => e,
            e => std::io::Error::other(e.to_string()),
        })?;
    l.set_nonblocking(true)?;
    tokio::net::TcpListener::from_std(l)
}

impl Running {
    /// True while the primary target process (the one whose namespaces were entered)
    /// runs: asked of its pin, so never true of another process that got its PID.
    pub fn target_alive(&self) -> bool {
        self.attached.containers[0].pin.alive()
    }

    /// The ids of target containers that have exited. Their attachment has ended:
    /// requests about them are refused ([`crate::files::FileError::Gone`]).
    pub fn gone(&self) -> Vec<String> {
        self.attached
            .containers
            .iter()
            .filter(|c| !c.pin.alive())
            .map(|c| c.id.clone())
            .collect()
    }

    /// Re-applies the ruleset (idempotent).
    pub fn reapply(&self) -> Result<(), NftError> {
        let r = self.nft.apply(&self.attached.ruleset);
        if r.is_err() {
            crate::metrics::global().error(crate::metrics::ErrorCategory::Ruleset);
        }
        r
    }

    /// Orderly exit: stop serving, delete the table atomically.
    pub fn shutdown(self) -> Result<(), NftError> {
        for t in &self.tasks {
            t.abort();
        }
        let r = self.nft.delete(&self.attached.ruleset.table);
        match &r {
            Ok(()) => crate::metrics::global().ruleset(None),
            Err(_) => crate::metrics::global().error(crate::metrics::ErrorCategory::Ruleset),
        }
        drop(self.netns);
        r
    }
}
