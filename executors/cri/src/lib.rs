//! Container ID → host PID resolution over the node's container-runtime socket.
//!
//! The kubelet reports CRI container IDs (`containerd://<id>`); the runtime knows
//! which host PID runs each of them and says so in `ContainerStatus` with
//! `verbose = true` (containerd, CRI-O and cri-dockerd all put a JSON document under
//! the `info` key of the response's info map, with a top-level `pid`). The client is
//! generated from the upstream CRI contract (`proto/runtime/v1/api.proto`, vendored
//! from k8s.io/cri-api; see `proto/README.md`) and runs over one HTTP/2 connection on
//! the unix socket, dialed once and reused for every container.

#![forbid(unsafe_code)]

use hyper_util::rt::TokioIo;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint};

pub mod mountinfo;

/// `runtime.v1` as generated from the upstream contract: every message and the
/// `RuntimeService` client ([`v1::runtime_service_client::RuntimeServiceClient`]).
/// The executors read container status; the runtime-path tests also create pods
/// through it ([`CriClient::runtime`]).
// The upstream comments become the docs as written; their lists are not Markdown's.
#[allow(
    clippy::doc_lazy_continuation,
    clippy::doc_overindented_list_items,
    rustdoc::bare_urls,
    rustdoc::invalid_html_tags
)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/runtime.v1.rs"));
}

/// The generated client of the runtime service, over the CRI socket's channel.
pub type RuntimeClient = v1::runtime_service_client::RuntimeServiceClient<Channel>;

pub const RUNTIME_SERVICE: &str = "/runtime.v1.RuntimeService";

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("connecting to CRI socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The connection failed under a call (or its HTTP/2 handshake did): the error is
    /// the transport's, not an answer of the runtime.
    #[error("HTTP/2 to CRI socket: {}", error_chain(.0.as_ref()))]
    Transport(Box<dyn std::error::Error + Send + Sync>),
    /// The runtime answered the call with a non-OK gRPC status (`code` is the gRPC
    /// code: 5 NotFound for an unknown container, ...).
    #[error("CRI call {method} failed: grpc-status {code}: {message}")]
    Status {
        method: String,
        code: u32,
        message: String,
    },
    #[error("CRI call {method} timed out")]
    Timeout { method: String },
    #[error("container {id} is not running (state {state})")]
    NotRunning { id: String, state: i32 },
    #[error("container {id}: runtime reported no pid in verbose info")]
    NoPid { id: String },
    #[error(
        "no CRI socket under {run_dir} knows container {id}; tried: {}",
        tried.iter().map(|(p, e)| format!("{} ({e})", p.display())).collect::<Vec<_>>().join(", ")
    )]
    NoSocket {
        run_dir: PathBuf,
        id: String,
        tried: Vec<(PathBuf, String)>,
    },
}

impl CriError {
    /// Bounded label for logs/metrics.
    pub fn category(&self) -> &'static str {
        match self {
            CriError::Connect { .. } => "CriConnect",
            CriError::Transport(_) => "CriTransport",
            CriError::Status { .. } => "CriStatus",
            CriError::Timeout { .. } => "CriTimeout",
            CriError::NotRunning { .. } => "ContainerNotRunning",
            CriError::NoPid { .. } => "NoPid",
            CriError::NoSocket { .. } => "NoCriSocket",
        }
    }

    /// The error of a failed call. tonic reports both the runtime's answers and the
    /// failures of the connection as a `Status`; the ones it made itself from a
    /// transport error carry that error as their source, the runtime's never do.
    fn of_call(method: &str, status: tonic::Status) -> CriError {
        if std::error::Error::source(&status).is_some() {
            return CriError::Transport(Box::new(status));
        }
        CriError::Status {
            method: method.to_owned(),
            code: status.code() as u32,
            message: status.message().to_owned(),
        }
    }
}

/// `error: source: source's source...` (the transport's errors say little at the top).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// One HTTP/2 connection to a CRI endpoint; cheap to clone (clones share it).
#[derive(Clone)]
pub struct CriClient {
    path: PathBuf,
    runtime: RuntimeClient,
    timeout: Duration,
}

impl CriClient {
    /// Dials the socket (a dead one is refused here, as [`CriError::Connect`]) and
    /// runs the channel over that connection; should it end, the channel dials the
    /// socket again.
    pub async fn connect(path: &Path) -> Result<Self, CriError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| CriError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let first = Arc::new(Mutex::new(Some(stream)));
        let socket = path.to_owned();
        let connector = tower::service_fn(move |_: tonic::transport::Uri| {
            let first = first.lock().ok().and_then(|mut s| s.take());
            let socket = socket.clone();
            async move {
                let stream = match first {
                    Some(stream) => stream,
                    None => {
                        tracing::debug!(socket = %socket.display(), "CRI connection re-dialed");
                        UnixStream::connect(&socket).await?
                    }
                };
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        });
        // The URI only names the HTTP/2 authority; the connector ignores it.
        let channel = Endpoint::from_static("http://localhost")
            .connect_with_connector(connector)
            .await
            .map_err(|e| CriError::Transport(Box::new(e)))?;
        Ok(CriClient {
            path: path.to_owned(),
            runtime: RuntimeClient::new(channel),
            timeout: Duration::from_secs(10),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// The generated `RuntimeService` client on this connection, for calls this
    /// crate has no method for (the runtime-path tests create pods with it).
    pub fn runtime(&self) -> RuntimeClient {
        self.runtime.clone()
    }

    /// A unary call of the runtime service, bounded by the client's timeout.
    async fn call<T>(
        &self,
        method: &str,
        call: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CriError> {
        let path = format!("{RUNTIME_SERVICE}/{method}");
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CriError::of_call(&path, status)),
            Err(_) => Err(CriError::Timeout { method: path }),
        }
    }

    pub async fn version(&self) -> Result<v1::VersionResponse, CriError> {
        let mut runtime = self.runtime();
        let request = v1::VersionRequest {
            version: "v1".into(),
        };
        self.call("Version", runtime.version(request)).await
    }

    /// Host PID of a running container.
    pub async fn container_pid(&self, id: &str) -> Result<u32, CriError> {
        Ok(self.running_container(id).await?.pid)
    }

    /// Host PID and OCI runtime spec (`runtimeSpec` of the verbose info, when the
    /// runtime reports it: containerd and CRI-O do) of a running container.
    pub async fn running_container(&self, id: &str) -> Result<RunningContainer, CriError> {
        let id = strip_runtime_prefix(id);
        let mut runtime = self.runtime();
        let request = v1::ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: true,
        };
        let resp = self
            .call("ContainerStatus", runtime.container_status(request))
            .await?;
        let state = resp.status.as_ref().map(|s| s.state).unwrap_or(-1);
        if state != v1::ContainerState::ContainerRunning as i32 {
            return Err(CriError::NotRunning {
                id: id.to_owned(),
                state,
            });
        }
        let pid = pid_from_info(&resp.info).ok_or_else(|| CriError::NoPid { id: id.to_owned() })?;
        Ok(RunningContainer {
            id: id.to_owned(),
            pid,
            runtime_spec: runtime_spec_from_info(&resp.info),
        })
    }
}

/// A running container as the runtime reports it.
#[derive(Clone, Debug)]
pub struct RunningContainer {
    /// The ID without the runtime prefix.
    pub id: String,
    pub pid: u32,
    /// The OCI runtime spec the container was created with (mounts, root, cgroups).
    pub runtime_spec: Option<serde_json::Value>,
}

/// The `runtimeSpec` object of the verbose info (containerd and CRI-O put it in the
/// JSON document under `info`).
pub fn runtime_spec_from_info(
    info: &std::collections::HashMap<String, String>,
) -> Option<serde_json::Value> {
    let doc: serde_json::Value = serde_json::from_str(info.get("info")?).ok()?;
    doc.get("runtimeSpec").filter(|s| s.is_object()).cloned()
}

/// `containerd://abc` → `abc` (the kubelet's containerID form).
pub fn strip_runtime_prefix(id: &str) -> &str {
    id.split_once("://").map(|(_, rest)| rest).unwrap_or(id)
}

/// The `pid` in the verbose info. containerd and CRI-O put a JSON object under
/// `info`; some runtimes use a top-level `pid` key instead.
pub fn pid_from_info(info: &std::collections::HashMap<String, String>) -> Option<u32> {
    if let Some(doc) = info.get("info")
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(doc)
        && let Some(pid) = v.get("pid").and_then(|p| p.as_u64())
        && pid > 0
    {
        return u32::try_from(pid).ok();
    }
    info.get("pid")
        .and_then(|p| p.trim().parse().ok())
        .filter(|p| *p > 0)
}

/// Well-known CRI sockets relative to the node's `/run`, in probe order, then the
/// same sockets' names directly in the mounted directory (when the mount is the
/// socket's own directory, e.g. `/run/containerd`).
pub const WELL_KNOWN_SOCKETS: &[&str] = &[
    "containerd/containerd.sock",
    "k3s/containerd/containerd.sock",
    "crio/crio.sock",
    "cri-dockerd.sock",
    "containerd.sock",
    "crio.sock",
];

/// Finds the runtime that knows `probe_id` among the well-known sockets under the
/// mounted `/run`: the first socket whose ContainerStatus answers for it wins.
/// Sockets that exist but don't know the container (another runtime on the same
/// node) are skipped, and reported if none matches.
pub async fn discover(run_dir: &Path, probe_id: &str) -> Result<CriClient, CriError> {
    // The mount may be the socket itself.
    if std::fs::metadata(run_dir)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()))
    {
        let client = CriClient::connect(run_dir).await?;
        client.container_pid(probe_id).await?;
        return Ok(client);
    }
    let mut tried = Vec::new();
    for rel in WELL_KNOWN_SOCKETS {
        let path = run_dir.join(rel);
        if !path.exists() {
            continue;
        }
        match CriClient::connect(&path).await {
            Ok(client) => match client.container_pid(probe_id).await {
                Ok(_) => return Ok(client),
                Err(e) => tried.push((path, e.to_string())),
            },
            Err(e) => tried.push((path, e.to_string())),
        }
    }
    Err(CriError::NoSocket {
        run_dir: run_dir.to_owned(),
        id: probe_id.to_owned(),
        tried,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn pid_is_read_from_containerd_style_info_json() {
        let mut info = HashMap::new();
        info.insert(
            "info".to_owned(),
            r#"{"sandboxID":"x","pid":4242,"removing":false}"#.to_owned(),
        );
        assert_eq!(pid_from_info(&info), Some(4242));
    }

    #[test]
    fn zero_or_missing_pid_is_no_pid() {
        let mut info = HashMap::new();
        info.insert("info".to_owned(), r#"{"pid":0}"#.to_owned());
        assert_eq!(pid_from_info(&info), None);
        assert_eq!(pid_from_info(&HashMap::new()), None);
    }

    #[test]
    fn kubelet_container_id_prefix_is_stripped() {
        assert_eq!(strip_runtime_prefix("containerd://abc"), "abc");
        assert_eq!(strip_runtime_prefix("cri-o://def"), "def");
        assert_eq!(strip_runtime_prefix("abc"), "abc");
    }

    #[test]
    fn the_runtimes_answer_is_a_status_with_its_grpc_code() {
        let err = CriError::of_call(
            "/runtime.v1.RuntimeService/ContainerStatus",
            tonic::Status::not_found("an error occurred when try to find container"),
        );
        assert!(
            matches!(&err, CriError::Status { code, .. } if *code == tonic::Code::NotFound as u32),
            "{err:?}"
        );
        assert_eq!(err.category(), "CriStatus");
        assert!(err.to_string().contains("grpc-status 5"), "{err}");
    }

    #[test]
    fn a_status_tonic_made_from_a_broken_connection_is_the_transports() {
        let broken = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let mut status = tonic::Status::unavailable("connection error");
        status.set_source(Arc::new(broken));
        let err = CriError::of_call("/runtime.v1.RuntimeService/Version", status);
        assert_eq!(err.category(), "CriTransport");
        assert!(err.to_string().contains("connection reset"), "{err}");
    }

    #[tokio::test]
    async fn a_dead_socket_is_refused_at_connect() {
        let dir = std::env::temp_dir().join(format!("podmotion-cri-dead-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("containerd.sock");
        let _ = std::fs::remove_file(&socket);
        drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
        let err = CriClient::connect(&socket).await.err().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(err.category(), "CriConnect", "{err}");
    }

    #[test]
    fn status_request_encodes_like_the_cri_message() {
        use prost::Message;
        let bytes = v1::ContainerStatusRequest {
            container_id: "ab".into(),
            verbose: true,
        }
        .encode_to_vec();
        // field 1 (len-delimited) "ab", field 2 (varint) 1
        assert_eq!(bytes, vec![0x0a, 2, b'a', b'b', 0x10, 1]);
    }
}
