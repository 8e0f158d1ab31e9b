//! The operator's handle on one migration agent.
//!
//! ```no_run
//! # async fn f(tls: podmotion_wire::client::TlsFiles) -> Result<(), podmotion_wire::client::ClientError> {
//! use podmotion_wire::{agent::*, client::AgentClient};
//! let mut src = AgentClient::connect("https://10.0.0.1:7443", "agent-node-a", &tls).await?;
//! src.prepare(PrepareRequest { migration_uid: "uid".into(), role: Role::Source as i32,
//!     pid: 1234, transfer_key: vec![0; 32], ..Default::default() }).await?;
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
use tonic::transport::{
    Certificate, Channel, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig,
};

/// PEM material for mutual TLS: the cluster's agent CA and this party's identity.
#[derive(Clone)]
pub struct TlsFiles {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl TlsFiles {
    pub fn load(ca: &str, cert: &str, key: &str) -> std::io::Result<Self> {
        Ok(Self {
            ca_pem: std::fs::read(ca)?,
            cert_pem: std::fs::read(cert)?,
            key_pem: std::fs::read(key)?,
        })
    }

    pub fn client_config(&self, server_name: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(server_name)
    }

    /// Server side: require a client certificate signed by the same CA.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
    }
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
        }
    }

    pub fn raw(&mut self) -> &mut MigrationAgentClient<Channel> {
        &mut self.inner
    }

    pub async fn prepare(&mut self, req: PrepareRequest) -> Result<MigrationStatus, ClientError> {
        Ok(self.inner.prepare(req).await?.into_inner())
    }
    /// One pre-copy round (memory tracking; pages since the previous round).
    pub async fn pre_dump(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .pre_dump(MigrationRef::new(uid))
            .await?
            .into_inner())
    }
    /// Freeze, final dump, source left stopped with its network locked.
    pub async fn dump(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self.inner.dump(MigrationRef::new(uid)).await?.into_inner())
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
        Ok(self.inner.send(req).await?.into_inner())
    }
    pub async fn restore(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .restore(MigrationRef::new(uid))
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
        Ok(self.inner.commit(req).await?.into_inner())
    }
    /// Source: resume the tree; target: kill whatever was restored.
    pub async fn abort(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self.inner.abort(MigrationRef::new(uid)).await?.into_inner())
    }
    /// Zeroize images and forget the migration.
    pub async fn cleanup(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .cleanup(MigrationRef::new(uid))
            .await?
            .into_inner())
    }
    pub async fn status(&mut self, uid: &str) -> Result<MigrationStatus, ClientError> {
        Ok(self
            .inner
            .status(MigrationRef::new(uid))
            .await?
            .into_inner())
    }
}
