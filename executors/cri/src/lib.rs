//! Container ID → host PID resolution over the node's container-runtime socket.
//!
//! The kubelet reports CRI container IDs (`containerd://<id>`); the runtime knows
//! which host PID runs each of them and says so in `ContainerStatus` with
//! `verbose = true` (containerd, CRI-O and cri-dockerd all put a JSON document under
//! the `info` key of the response's info map, with a top-level `pid`). We speak the
//! minimum of gRPC needed for unary calls, over one HTTP/2 connection on the unix
//! socket, dialed once and reused for every container. The protobuf messages below
//! are hand-written and wire-compatible with `runtime.v1` for the fields we read or
//! set; everything else is skipped by prost as unknown fields.

#![forbid(unsafe_code)]

use bytes::{Buf, BufMut, Bytes, BytesMut};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::UnixStream;

/// Messages of `runtime.v1` that the attach executor (and its tests) use. Field
/// numbers follow the CRI API; only the listed fields exist here.
pub mod mountinfo;

pub mod v1 {
    use std::collections::HashMap;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct VersionRequest {
        #[prost(string, tag = "1")]
        pub version: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct VersionResponse {
        #[prost(string, tag = "1")]
        pub version: String,
        #[prost(string, tag = "2")]
        pub runtime_name: String,
        #[prost(string, tag = "3")]
        pub runtime_version: String,
        #[prost(string, tag = "4")]
        pub runtime_api_version: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerStatusRequest {
        #[prost(string, tag = "1")]
        pub container_id: String,
        #[prost(bool, tag = "2")]
        pub verbose: bool,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerStatusResponse {
        #[prost(message, optional, tag = "1")]
        pub status: Option<ContainerStatus>,
        #[prost(map = "string, string", tag = "2")]
        pub info: HashMap<String, String>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerStatus {
        #[prost(string, tag = "1")]
        pub id: String,
        #[prost(message, optional, tag = "2")]
        pub metadata: Option<ContainerMetadata>,
        /// CONTAINER_CREATED = 0, CONTAINER_RUNNING = 1, CONTAINER_EXITED = 2, CONTAINER_UNKNOWN = 3
        #[prost(int32, tag = "3")]
        pub state: i32,
    }
    pub const CONTAINER_RUNNING: i32 = 1;

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerMetadata {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(uint32, tag = "2")]
        pub attempt: u32,
    }

    // --- Pod/container lifecycle: used by the runtime-path tests to create a real
    // CRI pod; the executor itself never creates anything.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxMetadata {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(string, tag = "2")]
        pub uid: String,
        #[prost(string, tag = "3")]
        pub namespace: String,
        #[prost(uint32, tag = "4")]
        pub attempt: u32,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxConfig {
        #[prost(message, optional, tag = "1")]
        pub metadata: Option<PodSandboxMetadata>,
        #[prost(string, tag = "2")]
        pub hostname: String,
        #[prost(string, tag = "3")]
        pub log_directory: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RunPodSandboxRequest {
        #[prost(message, optional, tag = "1")]
        pub config: Option<PodSandboxConfig>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RunPodSandboxResponse {
        #[prost(string, tag = "1")]
        pub pod_sandbox_id: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PodSandboxIdRequest {
        #[prost(string, tag = "1")]
        pub pod_sandbox_id: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Empty {}
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ImageSpec {
        #[prost(string, tag = "1")]
        pub image: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerConfig {
        #[prost(message, optional, tag = "1")]
        pub metadata: Option<ContainerMetadata>,
        #[prost(message, optional, tag = "2")]
        pub image: Option<ImageSpec>,
        #[prost(string, repeated, tag = "3")]
        pub command: Vec<String>,
        #[prost(string, repeated, tag = "4")]
        pub args: Vec<String>,
        #[prost(string, tag = "5")]
        pub working_dir: String,
        #[prost(message, repeated, tag = "6")]
        pub envs: Vec<KeyValue>,
        #[prost(string, tag = "11")]
        pub log_path: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CreateContainerRequest {
        #[prost(string, tag = "1")]
        pub pod_sandbox_id: String,
        #[prost(message, optional, tag = "2")]
        pub config: Option<ContainerConfig>,
        #[prost(message, optional, tag = "3")]
        pub sandbox_config: Option<PodSandboxConfig>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CreateContainerResponse {
        #[prost(string, tag = "1")]
        pub container_id: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ContainerIdRequest {
        #[prost(string, tag = "1")]
        pub container_id: String,
    }
}

pub const RUNTIME_SERVICE: &str = "/runtime.v1.RuntimeService";

#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("connecting to CRI socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("HTTP/2 to CRI socket: {0}")]
    Transport(#[from] h2::Error),
    #[error("CRI call {method} failed: grpc-status {code}: {message}")]
    Status {
        method: String,
        code: u32,
        message: String,
    },
    #[error("CRI call {method}: malformed response: {detail}")]
    Malformed { method: String, detail: String },
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
            CriError::Malformed { .. } => "CriMalformed",
            CriError::Timeout { .. } => "CriTimeout",
            CriError::NotRunning { .. } => "ContainerNotRunning",
            CriError::NoPid { .. } => "NoPid",
            CriError::NoSocket { .. } => "NoCriSocket",
        }
    }
}

/// One HTTP/2 connection to a CRI endpoint; cheap to clone (clones share it).
#[derive(Clone)]
pub struct CriClient {
    path: PathBuf,
    send: h2::client::SendRequest<Bytes>,
    timeout: Duration,
}

impl CriClient {
    pub async fn connect(path: &Path) -> Result<Self, CriError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| CriError::Connect {
                path: path.to_owned(),
                source,
            })?;
        let (send, conn) = h2::client::handshake(stream).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "CRI connection ended");
            }
        });
        Ok(CriClient {
            path: path.to_owned(),
            send,
            timeout: Duration::from_secs(10),
        })
    }

    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// A unary gRPC call: length-prefixed protobuf request, one response message,
    /// status from the trailers (or from the headers for trailers-only errors).
    pub async fn unary<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        method: &str,
        req: &Req,
    ) -> Result<Resp, CriError> {
        let path = format!("{RUNTIME_SERVICE}/{method}");
        let fut = self.unary_inner(&path, req);
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r,
            Err(_) => Err(CriError::Timeout { method: path }),
        }
    }

    async fn unary_inner<Req: prost::Message, Resp: prost::Message + Default>(
        &self,
        path: &str,
        req: &Req,
    ) -> Result<Resp, CriError> {
        let malformed = |detail: String| CriError::Malformed {
            method: path.to_owned(),
            detail,
        };
        let request = http::Request::builder()
            .method("POST")
            .uri(format!("http://localhost{path}"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .map_err(|e| malformed(e.to_string()))?;
        let mut send = self.send.clone().ready().await?;
        let (response, mut body) = send.send_request(request, false)?;
        let msg = req.encode_to_vec();
        let mut frame = BytesMut::with_capacity(5 + msg.len());
        frame.put_u8(0);
        frame.put_u32(msg.len() as u32);
        frame.put_slice(&msg);
        body.send_data(frame.freeze(), true)?;

        let response = response.await?;
        let (parts, mut recv) = response.into_parts();
        if let Some(err) = grpc_status(path, &parts.headers) {
            return Err(err);
        }
        let mut data = BytesMut::new();
        while let Some(chunk) = recv.data().await {
            let chunk = chunk?;
            let _ = recv.flow_control().release_capacity(chunk.len());
            data.extend_from_slice(&chunk);
        }
        let trailers = recv.trailers().await?;
        if let Some(err) = trailers.as_ref().and_then(|t| grpc_status(path, t)) {
            return Err(err);
        }
        if trailers.is_none() && !parts.headers.contains_key("grpc-status") {
            return Err(malformed("no grpc-status".into()));
        }
        if data.len() < 5 {
            return Err(malformed(format!("{} body bytes", data.len())));
        }
        let mut buf = data.freeze();
        let compressed = buf.get_u8();
        let len = buf.get_u32() as usize;
        if compressed != 0 || buf.len() < len {
            return Err(malformed("compressed or truncated message".into()));
        }
        Resp::decode(buf.slice(..len)).map_err(|e| malformed(e.to_string()))
    }

    pub async fn version(&self) -> Result<v1::VersionResponse, CriError> {
        self.unary(
            "Version",
            &v1::VersionRequest {
                version: "v1".into(),
            },
        )
        .await
    }

    /// Host PID of a running container.
    pub async fn container_pid(&self, id: &str) -> Result<u32, CriError> {
        Ok(self.running_container(id).await?.pid)
    }

    /// Host PID and OCI runtime spec (`runtimeSpec` of the verbose info, when the
    /// runtime reports it: containerd and CRI-O do) of a running container.
    pub async fn running_container(&self, id: &str) -> Result<RunningContainer, CriError> {
        let id = strip_runtime_prefix(id);
        let resp: v1::ContainerStatusResponse = self
            .unary(
                "ContainerStatus",
                &v1::ContainerStatusRequest {
                    container_id: id.to_owned(),
                    verbose: true,
                },
            )
            .await?;
        let state = resp.status.as_ref().map(|s| s.state).unwrap_or(-1);
        if state != v1::CONTAINER_RUNNING {
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

fn grpc_status(method: &str, headers: &http::HeaderMap) -> Option<CriError> {
    let code: u32 = headers.get("grpc-status")?.to_str().ok()?.parse().ok()?;
    if code == 0 {
        return None;
    }
    let message = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .unwrap_or("")
        .to_owned();
    Some(CriError::Status {
        method: method.to_owned(),
        code,
        message,
    })
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
