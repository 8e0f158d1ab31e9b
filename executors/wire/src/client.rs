//! The operator's handle on one migration agent.
//!
//! ```no_run
//! # async fn f(tls: podmotion_wire::client::TlsFiles) -> Result<(), podmotion_wire::client::ClientError> {
//! use podmotion_wire::{agent::*, client::AgentClient};
//! let mut src = AgentClient::connect("https://10.0.0.1:7443", "agent-node-a", &tls).await?;
//! src.prepare(PrepareRequest { migration_uid: "uid".into(), role: Role::Source as i32,
//!     container_ids: vec!["containerd://0123abcd".into()], peer_node: "node-b".into(),
//!     transfer_key: vec![0; 32], ..Default::default() }).await?;
//! let st = src.pre_dump("uid").await?;      // repeat while st.last_round_bytes shrinks
//! let st = src.dump("uid").await?;          // freeze + final dump, source left stopped
//! src.send("uid", "https://10.0.0.2:7443", "agent-node-b").await?;
//! // target.restore("uid"), then probe, then src.commit("uid") — or src.abort("uid")
//! # Ok(()) }
//! ```
//!
//! Every call is idempotent per migration UID; on any error before `commit` the
//! operator calls `abort` on the source (which resumes it) and `cleanup` on both.
//!
//! Contract details the controller relies on:
//! * `pre_dump` may be repeated; `send` may be called after each round (it streams only
//!   what the target does not have yet) and once more after `dump` (the final round;
//!   `Phase::Sent`). `last_round_bytes`/`bytes_sent` never run backwards.
//! * Downtime = target `timings.resumed_us` − source `timings.freeze_started_us`.
//! * After `restore`, count `SocketOutcome::ClosedCleanly` in the target's status; if
//!   non-zero, commit with `commit_closing(uid, true)` so peers get FIN.
//! * `cleanup` on a frozen source is refused (`FailedPrecondition`): commit or abort first.
//! * `NotFound` (category `MigrationUnknown`) for a migration that was prepared means
//!   the agent restarted: its broker already resumed a frozen source and the agent
//!   zeroized the images at start. Treat the migration as failed; abort the target.

use crate::agent::*;
use crate::proto::migration_agent_client::MigrationAgentClient;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig,
};

/// PEM material for mutual TLS: the CA bundle this party trusts (one or more CA
/// certificates: during a CA rotation the old and the new one) and its own identity.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsMaterial {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("TlsMaterial")
            .field("ca_pem_len", &self.ca_pem.len())
            .field("cert_pem_len", &self.cert_pem.len())
            .finish_non_exhaustive()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading TLS material: {0}")]
    Io(#[from] std::io::Error),
    #[error("no certificate in the PEM")]
    NoCertificate,
    #[error("no CA certificate in the bundle")]
    NoCa,
    #[error("private key: {0}")]
    Key(String),
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The TLS state of one party, shared by everything that connects or accepts: a handle
/// whose material can be replaced while the process runs (a renewed certificate, a CA
/// bundle with a new CA). Clones share the state. Every new connection uses the
/// material current when it starts; established connections keep theirs.
///
/// Sources: PEM bytes ([`TlsFiles::from_pem`], then [`TlsFiles::set`] on renewal) or
/// three files ([`TlsFiles::load`], re-read by [`TlsFiles::reload`] or periodically by
/// [`TlsFiles::watch_files`]).
#[derive(Clone)]
pub struct TlsFiles {
    state: Arc<RwLock<Arc<Loaded>>>,
    files: Option<Arc<[PathBuf; 3]>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

struct Loaded {
    pem: TlsMaterial,
    /// Built from `pem` when it was set (None when it is not a usable server identity).
    server: Option<Arc<rustls::ServerConfig>>,
}

fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    Ok(certs)
}

/// A rustls server configuration that requires a client certificate chaining to a CA
/// of the bundle, and serves `cert_pem` (ALPN h2, as tonic's own TLS does).
fn build_server_config(m: &TlsMaterial) -> Result<rustls::ServerConfig, TlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in parse_certs(&m.ca_pem).map_err(|_| TlsError::NoCa)? {
        roots
            .add(ca)
            .map_err(|e| TlsError::Config(format!("CA: {e}")))?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| TlsError::Config(e.to_string()))?;
    let chain = parse_certs(&m.cert_pem)?;
    let key =
        PrivateKeyDer::from_pem_slice(&m.key_pem).map_err(|e| TlsError::Key(e.to_string()))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

impl TlsFiles {
    /// A handle on this material. Whether it serves is checked when a server uses it
    /// ([`TlsFiles::acceptor_config`]); [`TlsFiles::set`] validates.
    pub fn from_pem(ca_pem: Vec<u8>, cert_pem: Vec<u8>, key_pem: Vec<u8>) -> Self {
        let pem = TlsMaterial {
            ca_pem,
            cert_pem,
            key_pem,
        };
        let server = build_server_config(&pem).ok().map(Arc::new);
        let (tx, _) = tokio::sync::watch::channel(0);
        TlsFiles {
            state: Arc::new(RwLock::new(Arc::new(Loaded { pem, server }))),
            files: None,
            changed: Arc::new(tx),
        }
    }

    /// Reads the three PEM files; [`TlsFiles::reload`] reads them again.
    pub fn load(ca: &str, cert: &str, key: &str) -> std::io::Result<Self> {
        let mut t = Self::from_pem(
            std::fs::read(ca)?,
            std::fs::read(cert)?,
            std::fs::read(key)?,
        );
        t.files = Some(Arc::new([ca.into(), cert.into(), key.into()]));
        Ok(t)
    }

    /// The material new connections use now.
    pub fn material(&self) -> TlsMaterial {
        self.state.read().expect("tls state").pem.clone()
    }

    /// How many times the material was replaced; changes wake the receiver.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Replaces the material after checking that it is a usable identity with a CA
    /// bundle (on error the previous material stays). Returns whether it changed.
    pub fn set(&self, m: TlsMaterial) -> Result<bool, TlsError> {
        if self.state.read().expect("tls state").pem == m {
            return Ok(false);
        }
        let server = Arc::new(build_server_config(&m)?);
        *self.state.write().expect("tls state") = Arc::new(Loaded {
            pem: m,
            server: Some(server),
        });
        self.changed.send_modify(|g| *g += 1);
        Ok(true)
    }

    /// Re-reads the files this handle was loaded from (no-op for PEM handles).
    pub fn reload(&self) -> Result<bool, TlsError> {
        let Some(f) = &self.files else {
            return Ok(false);
        };
        self.set(TlsMaterial {
            ca_pem: std::fs::read(&f[0])?,
            cert_pem: std::fs::read(&f[1])?,
            key_pem: std::fs::read(&f[2])?,
        })
    }

    /// Re-reads the files every `every` (a Secret or ConfigMap mounted by the kubelet
    /// is replaced atomically; a half-written set fails validation and is retried).
    pub fn watch_files(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match this.reload() {
                    Ok(true) => tracing::info!("TLS material reloaded"),
                    Ok(false) => {}
                    Err(e) => tracing::warn!(error = %e, "TLS material not reloaded"),
                }
            }
        })
    }

    pub fn client_config(&self, server_name: &str) -> ClientTlsConfig {
        let m = self.material();
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&m.ca_pem))
            .identity(Identity::from_pem(&m.cert_pem, &m.key_pem))
            .domain_name(server_name)
    }

    /// Server side, fixed at the time of the call: require a client certificate signed
    /// by a CA of the bundle. Servers that must pick up renewals use
    /// [`tls_incoming`] instead.
    pub fn server_config(&self) -> ServerTlsConfig {
        let m = self.material();
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&m.cert_pem, &m.key_pem))
            .client_ca_root(Certificate::from_pem(&m.ca_pem))
    }

    /// The rustls server configuration of the current material.
    pub fn acceptor_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let loaded = self.state.read().expect("tls state").clone();
        match &loaded.server {
            Some(s) => Ok(s.clone()),
            None => build_server_config(&loaded.pem).map(Arc::new),
        }
    }
}

/// Accepted mutual-TLS connections for `tonic::transport::Server::serve_with_incoming`:
/// each handshake uses the material current when the connection arrives, so a renewed
/// certificate or CA bundle is served without a restart. The streams are
/// `tokio_rustls::server::TlsStream<TcpStream>`, whose peer certificates tonic exposes
/// as `Request::peer_certs()` exactly as with its own TLS. Failed handshakes are logged
/// and dropped; they never end the stream.
pub fn tls_incoming(
    listener: tokio::net::TcpListener,
    tls: TlsFiles,
) -> impl futures::Stream<
    Item = Result<tokio_rustls::server::TlsStream<tokio::net::TcpStream>, std::io::Error>,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let cfg = match tls.acceptor_config() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, %peer, "no usable TLS identity; connection dropped");
                    continue;
                }
            };
            if tx.is_closed() {
                return;
            }
            let tx = tx.clone();
            tokio::spawn(async move {
                if let Some(s) = accept_tls(cfg, tcp, peer, "agent").await {
                    let _ = tx.send(Ok(s)).await;
                }
            });
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

/// How long a TLS handshake may take before its connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The server side of one connection's TLS handshake, within [`HANDSHAKE_TIMEOUT`];
/// `None` once it failed, which is logged here (`server` names the listener in the
/// line: "agent", "webhook"). A peer that closes or resets before sending a single
/// byte is a TCP probe (the kubelet's probe of the TLS port, every period): debug, so
/// an idle server logs nothing at info. A handshake that started and failed (an
/// unknown certificate, a client speaking plain HTTP, a stalled peer) is news: info,
/// with the peer and the error.
pub async fn accept_tls(
    cfg: Arc<rustls::ServerConfig>,
    tcp: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    server: &'static str,
) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
    enum Failed {
        /// Closed (or reset) before its first byte.
        Probe(Option<std::io::Error>),
        Refused(std::io::Error),
    }
    let handshake = async {
        // Waits for the first byte without taking it (the ClientHello stays whole).
        match tcp.peek(&mut [0u8; 1]).await {
            Ok(0) => return Err(Failed::Probe(None)),
            Err(e) if closed_early(&e) => return Err(Failed::Probe(Some(e))),
            _ => {}
        }
        tokio_rustls::TlsAcceptor::from(cfg)
            .accept(tcp)
            .await
            .map_err(Failed::Refused)
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(s)) => Some(s),
        Ok(Err(Failed::Probe(e))) => {
            let error = e.map(|e| e.to_string()).unwrap_or_else(|| "closed".into());
            tracing::debug!(%error, %peer, server, "connection closed before any TLS byte");
            None
        }
        Ok(Err(Failed::Refused(e))) => {
            tracing::info!(error = %e, %peer, server, "TLS handshake refused");
            None
        }
        Err(_) => {
            tracing::info!(%peer, server, "TLS handshake timed out");
            None
        }
    }
}

/// Whether reading a connection failed because the peer went away (a probe that
/// resets rather than closes), not because of what it sent.
fn closed_early(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
    )
}

/// `(subject, issuer)` of the first certificate of a PEM bundle, as RFC 4514 strings.
pub fn cert_names(pem: &[u8]) -> Option<(String, String)> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem).ok()?;
    let c = p.parse_x509().ok()?;
    Some((c.subject().to_string(), c.issuer().to_string()))
}

/// `(not_before, not_after)` in Unix seconds of the first certificate of a PEM bundle.
pub fn cert_validity(pem: &[u8]) -> Option<(i64, i64)> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem).ok()?;
    let c = p.parse_x509().ok()?;
    Some((
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    ))
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach agent: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("agent refused: {0}")]
    Status(#[from] tonic::Status),
}

impl ClientError {
    /// Bounded category, usable as an Event reason or metric label.
    pub fn category(&self) -> &'static str {
        match self {
            ClientError::Transport(_) => "AgentUnreachable",
            ClientError::Status(s) => match s.code() {
                tonic::Code::NotFound => "MigrationUnknown",
                tonic::Code::InvalidArgument => "InvalidRequest",
                tonic::Code::FailedPrecondition => "WrongPhase",
                tonic::Code::ResourceExhausted => "NoRoom",
                tonic::Code::Unavailable => "AgentUnavailable",
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => "NotAuthorized",
                _ => "AgentFailed",
            },
        }
    }
}

/// A connection to one agent.
#[derive(Clone)]
pub struct AgentClient {
    inner: MigrationAgentClient<Channel>,
    /// The operator's leader term, sent with every call (`None`: leader election off).
    term: Option<LeaderTerm>,
}

impl AgentClient {
    /// Connects with mutual TLS; `server_name` must be in the agent certificate's SANs.
    pub async fn connect(
        endpoint: &str,
        server_name: &str,
        tls: &TlsFiles,
    ) -> Result<Self, ClientError> {
        let channel = Endpoint::from_shared(endpoint.to_owned())?
            .tls_config(tls.client_config(server_name))?
            .connect_timeout(std::time::Duration::from_secs(5))
            .connect()
            .await?;
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: MigrationAgentClient::new(channel)
                .max_decoding_message_size(8 << 20)
                .max_encoding_message_size(8 << 20),
            term: None,
        }
    }

    /// Every call carries `term`, the term of the lease the operator holds
    /// ([`crate::agent::LeaderTerm`]; `None` with leader election off).
    pub fn with_leader_term(mut self, term: Option<LeaderTerm>) -> Self {
        self.term = term;
        self
    }

    /// `msg` as a request with this client's leader term.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(t) = self.term {
            let meta = r.metadata_mut();
            meta.insert(
                crate::agent::LEADER_TERM_METADATA,
                tonic::metadata::MetadataValue::from(t.term),
            );
            meta.insert(
                crate::agent::LEADER_EPOCH_METADATA,
                tonic::metadata::MetadataValue::from(t.epoch),
            );
        }
        r
    }

    pub fn raw(&mut self) -> &mut MigrationAgentClient<Channel> {
        &mut self.inner
    }

    pub async fn prepare(&mut self, req: PrepareRequest) -> Result<MigrationStatus, ClientError> {
        Ok(self.inner.prepare(self.request(req)).await?.into_inner())
    }
    /// One pre-copy round (memory tracking; pages since the previous round).
    pub async fn pre_dump(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .pre_dump(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    /// Freeze, final dump, source left stopped with its network locked.
    pub async fn dump(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .dump(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    /// Stream the images to the target agent.
    pub async fn send(
        &mut self,
        uid: &str,
        target_endpoint: &str,
        target_server_name: &str,
    ) -> Result<MigrationStatus, ClientError> {
        let req = SendRequest {
            migration_uid: uid.into(),
            target_endpoint: target_endpoint.into(),
            target_server_name: target_server_name.into(),
            bandwidth_limit: 0,
        };
        Ok(self.inner.send(self.request(req)).await?.into_inner())
    }
    pub async fn restore(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .restore(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    /// Source: the restore fence, asked (and acknowledged) before the target's
    /// `Restore`: from here the source agent and its broker kill the frozen source
    /// instead of resuming it, unless the operator aborts.
    pub async fn fence(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .fence(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    /// Source: kill the frozen tree. Only after the target passed its probe.
    /// `close_connections`: the target reported `ClosedCleanly` sockets, so the source
    /// sends FIN on them before it dies.
    pub async fn commit(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        self.commit_closing(uid, false).await
    }
    /// Commit when the target restored some connections closed (`ClosedCleanly` in
    /// its status): the source takes them out of repair and lets them send FIN first.
    pub async fn commit_closing(
        &mut self,
        uid: &str,
        close_connections: bool,
    ) -> Result<MigrationStatus, ClientError> {
        let req = CommitRequest {
            migration_uid: uid.into(),
            close_connections,
        };
        Ok(self.inner.commit(self.request(req)).await?.into_inner())
    }
    /// Source, fenced, once the target passed its probe: its node sends new
    /// connections to the frozen source to the target until the source is killed,
    /// resumed or forgotten.
    pub async fn forward(&mut self, req: ForwardRequest) -> Result<MigrationStatus, ClientError> {
        Ok(self.inner.forward(self.request(req)).await?.into_inner())
    }
    /// Source: resume the tree; target: kill whatever was restored.
    pub async fn abort(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .abort(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    /// Zeroize images and forget the migration.
    pub async fn cleanup(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .cleanup(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
    pub async fn status(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .status(self.request(MigrationRef::new(uid)))
            .await?
            .into_inner())
    }
}
