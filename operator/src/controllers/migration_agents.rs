//! The operator's `AgentClient` over the executors' gRPC wire client
//! (`podmotion_wire::client`).
//!
//! The wire calls block until a step is done and return the agent's
//! `MigrationStatus`; the phase machine instead wants "start a step" and "how do the
//! steps stand". This adapter starts each call on a task and remembers the call in
//! flight (and its failure) per node and migration; reports merge that memory with the
//! agent's own `Status`. The memory is only a convenience: after an operator restart
//! the agent's status alone says which step completed, and every call is idempotent.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use podmotion_api::migration::{ApplicationProbe, HttpScheme};
use podmotion_api::migration::{NetworkOutcome, TcpPreservation};
use podmotion_wire::agent::{
    MigrationStatus, Phase, PrepareRequest, Role, SendRequest, SocketOutcome,
};
use podmotion_wire::client::{AgentClient as WireClient, ClientError, TlsFiles};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::migration::agent::{
    AgentCallError, AgentClient, AgentEndpoint, AgentProgress, AgentReport, Step, StepRequest,
    StepState,
};

/// TLS server name of the agent on `node` (the SAN its certificate carries).
pub fn agent_server_name(node: &str) -> String {
    format!("podmotion-agent.{node}")
}

/// The agent's status as the phase machine's report. Pure.
pub fn report_from_status(st: &MigrationStatus) -> AgentReport {
    let role = Role::try_from(st.role).unwrap_or(Role::Unspecified);
    let phase = Phase::try_from(st.phase).unwrap_or(Phase::Unknown);
    let step = match (phase, role) {
        (Phase::Unknown, _) => None,
        (Phase::Prepared, Role::Target) | (Phase::Receiving | Phase::Received, _) => {
            Some(Step::Receive)
        }
        (Phase::Prepared, _) => Some(Step::Prepare),
        (Phase::PreDumping, _) => Some(Step::PreDump(st.iteration.max(1))),
        (Phase::Dumped, _) => Some(Step::Dump),
        (Phase::Sent, _) => Some(Step::Transfer),
        (Phase::Restored, _) => Some(Step::Restore),
        (Phase::Committed, _) => Some(Step::Commit),
        (Phase::Aborted, _) => Some(Step::Abort),
        (Phase::CleanedUp, _) => Some(Step::Cleanup),
    };
    let t = st.timings();
    let at = |us: u64| {
        (us > 0)
            .then(|| Timestamp::from_microsecond(us as i64).ok())
            .flatten()
    };
    // The link's speed: the final transfer's once it ran, before that the pre-copy
    // rounds' (streamed while the workload runs, so known before the freeze).
    let final_bytes = st.bytes_sent.saturating_sub(st.pre_copy_sent_bytes);
    let rate = if t.send_us > 0 && final_bytes > 0 {
        Some(final_bytes.saturating_mul(1_000_000) / t.send_us)
    } else if t.pre_copy_send_us > 0 && st.pre_copy_sent_bytes > 0 {
        Some(st.pre_copy_sent_bytes.saturating_mul(1_000_000) / t.pre_copy_send_us)
    } else {
        None
    };
    // What the final transfer will move: what the last streamed round had to send
    // (the dirty set), else the last round's whole image.
    let dirty = (st.iteration > 0).then_some(if t.pre_copy_send_us > 0 {
        st.last_round_sent_bytes
    } else {
        st.last_round_bytes
    });
    let network = (!st.sockets.is_empty()).then(|| NetworkOutcome {
        listeners_restored: st.count(SocketOutcome::ListenerRestored) as i32,
        connections_preserved: st.count(SocketOutcome::Preserved) as i32,
        connections_closed: st.count(SocketOutcome::ClosedCleanly) as i32,
        connections_reset: 0,
    });
    AgentReport {
        last: step.map(|s| (s, StepState::Done)),
        progress: AgentProgress {
            iteration: st.iteration,
            bytes_sent: st.bytes_sent,
            dirty_bytes: dirty,
            rate_bytes_per_second: rate,
            dump_millis: (st.iteration > 0 && t.last_round_us > 0)
                .then(|| t.last_round_us.div_ceil(1000)),
            frozen_at: at(t.freeze_started_us),
            resumed_at: if role == Role::Target {
                at(t.resumed_us)
            } else {
                None
            },
            network,
        },
    }
}

type Key = (String, String);

/// What the adapter keeps of a finished call. A success is forgotten (the agent's own
/// status shows it) except for the probe, which the agent does not know about: without
/// the memory the machine would see `Restore` done and probe again forever. Failures
/// are kept until the next step replaces them.
fn remembered_outcome(step: Step, res: Result<(), (String, String)>) -> Option<(Step, StepState)> {
    match res {
        Ok(()) if step == Step::Probe => Some((step, StepState::Done)),
        Ok(()) => None,
        Err((category, message)) => Some((step, StepState::Failed { category, message })),
    }
}

/// `AgentClient` over mutual TLS (or plain HTTP/2 for `http://` endpoints in local runs).
#[derive(Clone)]
pub struct WireAgents {
    client: kube::Client,
    tls: Option<TlsFiles>,
    inflight: Arc<Mutex<BTreeMap<Key, (Step, StepState)>>>,
}

impl WireAgents {
    pub fn new(client: kube::Client, tls: Option<TlsFiles>) -> Self {
        WireAgents {
            client,
            tls,
            inflight: Default::default(),
        }
    }

    async fn connect(&self, e: &AgentEndpoint) -> Result<WireClient, AgentCallError> {
        let err = |m: String| AgentCallError {
            node: e.node.clone(),
            message: m,
        };
        match (&self.tls, e.url.starts_with("http://")) {
            (_, true) => {
                let ch = tonic::transport::Endpoint::from_shared(e.url.clone())
                    .map_err(|x| err(x.to_string()))?
                    .connect_timeout(std::time::Duration::from_secs(5))
                    .connect()
                    .await
                    .map_err(|x| err(format!("cannot reach agent: {x}")))?;
                Ok(WireClient::from_channel(ch))
            }
            (Some(tls), false) => WireClient::connect(&e.url, &agent_server_name(&e.node), tls)
                .await
                .map_err(|x| err(x.to_string())),
            (None, false) => Err(err("no agent TLS material configured".into())),
        }
    }

    async fn call(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), (String, String)> {
        let fail = |c: &ClientError| (c.category().to_string(), c.to_string());
        let mut c = self
            .connect(e)
            .await
            .map_err(|x| ("AgentUnreachable".to_string(), x.message))?;
        let uid = r.migration_uid.as_str();
        let tcp = match r.tcp_preservation {
            TcpPreservation::Strict => podmotion_wire::agent::TcpPreservation::Strict,
            TcpPreservation::BestEffort => podmotion_wire::agent::TcpPreservation::BestEffort,
            TcpPreservation::None => podmotion_wire::agent::TcpPreservation::None,
        };
        let res = match r.step {
            Step::Prepare | Step::Receive => {
                let role = if r.step == Step::Prepare {
                    Role::Source
                } else {
                    Role::Target
                };
                // pid 0: the agent resolves the container IDs to the pod's process
                // tree (source) or its holder (target); the operator never sees host
                // pids.
                c.prepare(PrepareRequest {
                    migration_uid: uid.into(),
                    role: role as i32,
                    pid: 0,
                    pid_start_time: 0,
                    transfer_key: r.transfer_key.0.to_vec(),
                    tcp: tcp as i32,
                    container_ids: r.container_ids.clone(),
                })
                .await
            }
            // A pre-copy round is the dump while the workload runs and the stream of
            // what changed to the target: pages move before the freeze, and the
            // stream measures the dirty set and the link for the freeze budget.
            Step::PreDump(_) => match (c.pre_dump(uid).await, &r.target_agent_url) {
                (Ok(_), Some(url)) => send(&mut c, r, url).await,
                (res, _) => res,
            },
            Step::Dump => c.dump(uid).await,
            Step::Transfer => {
                let Some(url) = &r.target_agent_url else {
                    return Err(("NoTargetAgent".into(), "no target agent endpoint".into()));
                };
                send(&mut c, r, url).await
            }
            Step::Restore => c.restore(uid).await,
            // The wire service has no probe call yet: the operator probes the restored
            // pod over the pod network itself (TCP, HTTP, HTTPS, gRPC); exec probes fail
            // closed, so nothing is committed without proof.
            Step::Probe => return self.probe(r).await,
            Step::Commit => c.commit_closing(uid, r.close_connections).await,
            Step::Abort => c.abort(uid).await,
            Step::Cleanup => c.cleanup(uid).await,
        };
        res.map(|_| ()).map_err(|e| fail(&e))
    }
}

/// Streams the images the source holds and the target lacks (incremental).
async fn send(
    c: &mut WireClient,
    r: &StepRequest,
    target_url: &str,
) -> Result<MigrationStatus, ClientError> {
    let req = SendRequest {
        migration_uid: r.migration_uid.clone(),
        target_endpoint: target_url.into(),
        target_server_name: agent_server_name(&r.target_node),
        bandwidth_limit: r.bandwidth_limit_bytes_per_second.unwrap_or(0).max(0) as u64,
    };
    c.raw()
        .send(req)
        .await
        .map(|resp| resp.into_inner())
        .map_err(ClientError::from)
}

impl WireAgents {
    async fn probe(&self, r: &StepRequest) -> Result<(), (String, String)> {
        let Some(p) = &r.probe else {
            // No probe anywhere: the restore resuming the process is the proof.
            return Ok(());
        };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &r.namespace);
        let ip = pods
            .get(&r.target_pod)
            .await
            .ok()
            .and_then(|pod| pod.status.and_then(|s| s.pod_ip))
            .ok_or_else(|| {
                (
                    "ProbeFailed".to_string(),
                    "the target pod has no IP".to_string(),
                )
            })?;
        let timeout = Duration::from_secs(p.timeout_seconds.max(1) as u64);
        let mut last = String::new();
        for attempt in 1..=p.failure_threshold.max(1) {
            match probe_once(&ip, p, timeout).await {
                Ok(()) => return Ok(()),
                Err(ProbeError::Unsupported(m)) => return Err(("ProbeUnsupported".into(), m)),
                Err(ProbeError::Failed(m)) => last = format!("attempt {attempt}: {m}"),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        Err(("ProbeFailed".into(), last))
    }
}

enum ProbeError {
    Unsupported(String),
    Failed(String),
}

/// `grpc.health.v1` messages (the kubelet's gRPC probe protocol).
mod health {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HealthCheckRequest {
        #[prost(string, tag = "1")]
        pub service: String,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct HealthCheckResponse {
        /// 1 = SERVING.
        #[prost(int32, tag = "1")]
        pub status: i32,
    }
    pub const SERVING: i32 = 1;
    pub const CHECK: &str = "/grpc.health.v1.Health/Check";
}

/// One gRPC health check (plaintext, as the kubelet's gRPC probes).
async fn grpc_health(addr: &str, service: &str) -> Result<(), String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let resp = grpc
        .unary::<_, health::HealthCheckResponse, _>(
            tonic::Request::new(health::HealthCheckRequest {
                service: service.into(),
            }),
            tonic::codegen::http::uri::PathAndQuery::from_static(health::CHECK),
            tonic_prost::ProstCodec::default(),
        )
        .await
        .map_err(|s| format!("{addr} health check: {}", s.message()))?;
    match resp.into_inner().status {
        health::SERVING => Ok(()),
        other => Err(format!("{addr} health status {other}, not SERVING")),
    }
}

/// One attempt of a TCP, plain-HTTP or gRPC probe against `ip`.
async fn probe_once(ip: &str, p: &ApplicationProbe, timeout: Duration) -> Result<(), ProbeError> {
    let failed = |m: String| ProbeError::Failed(m);
    if let Some(g) = &p.grpc {
        let addr = format!("{ip}:{}", g.port);
        let service = g.service.clone().unwrap_or_default();
        return tokio::time::timeout(timeout, grpc_health(&addr, &service))
            .await
            .map_err(|_| failed(format!("{addr}: no answer within {timeout:?}")))?
            .map_err(failed);
    }
    let (port, http) = match (&p.tcp_socket, &p.http_get) {
        (Some(t), _) => (t.port, None),
        (None, Some(h)) => (h.port, Some((h.path.clone(), h.scheme))),
        _ => {
            return Err(ProbeError::Unsupported(
                "exec probes need the agent, whose wire protocol has no probe call yet".into(),
            ));
        }
    };
    let addr = format!("{ip}:{port}");
    let attempt = async {
        let stream = TcpStream::connect(&addr)
            .await
            .map_err(|e| failed(format!("connect {addr}: {e}")))?;
        let Some((path, scheme)) = http else {
            return Ok(());
        };
        let code = match scheme {
            HttpScheme::Http => http_status(stream, ip, &path).await,
            HttpScheme::Https => {
                let name = rustls::pki_types::ServerName::try_from(ip.to_string())
                    .map_err(|e| failed(format!("{ip}: {e}")))?;
                let tls = tokio_rustls::TlsConnector::from(probe_tls())
                    .connect(name, stream)
                    .await
                    .map_err(|e| failed(format!("TLS to {addr}: {e}")))?;
                http_status(tls, ip, &path).await
            }
        }
        .map_err(|e| failed(format!("GET {addr}{path}: {e}")))?;
        match code {
            Some(code) if (200..400).contains(&code) => Ok(()),
            other => Err(failed(format!("GET {addr}{path}: status {other:?}"))),
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| failed(format!("{addr}: no answer within {timeout:?}")))?
}

/// Sends `GET path` and returns the response's status code.
async fn http_status<S>(mut stream: S, host: &str, path: &str) -> std::io::Result<Option<u16>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let req = format!("GET {path} HTTP/1.0\r\nHost: {host}\r\nUser-Agent: podmotion-probe\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    stream.flush().await?;
    let mut buf = vec![0u8; 64];
    let n = stream.read(&mut buf).await?;
    Ok(String::from_utf8_lossy(&buf[..n])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok()))
}

/// TLS for HTTPS probes: like the kubelet's, they check that the application answers
/// over TLS, not who it is, so the server's certificate is not verified.
fn probe_tls() -> Arc<rustls::ClientConfig> {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{DigitallySignedStruct, SignatureScheme};

    #[derive(Debug)]
    struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);
    impl ServerCertVerifier for AnyCertificate {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    Arc::new(config)
}

impl AgentClient for WireAgents {
    async fn report(&self, e: &AgentEndpoint, uid: &str) -> Result<AgentReport, AgentCallError> {
        let key = (e.node.clone(), uid.to_string());
        let remembered = self
            .inflight
            .lock()
            .expect("inflight lock")
            .get(&key)
            .cloned();
        if let Some((step, state)) = remembered {
            // A call in flight or failed says more than the agent's last completed phase.
            let mut r = AgentReport {
                last: Some((step, state)),
                ..Default::default()
            };
            if let Ok(mut c) = self.connect(e).await
                && let Ok(st) = c.status(uid).await
            {
                r.progress = report_from_status(&st).progress;
            }
            return Ok(r);
        }
        let mut c = self.connect(e).await?;
        match c.status(uid).await {
            Ok(st) => Ok(report_from_status(&st)),
            Err(ClientError::Status(s)) if s.code() == tonic::Code::NotFound => {
                Ok(AgentReport::default())
            }
            Err(x) => Err(AgentCallError {
                node: e.node.clone(),
                message: x.to_string(),
            }),
        }
    }

    async fn start(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), AgentCallError> {
        let key = (e.node.clone(), r.migration_uid.clone());
        {
            let mut inflight = self.inflight.lock().expect("inflight lock");
            if matches!(inflight.get(&key), Some((s, StepState::Running)) if *s == r.step) {
                return Ok(());
            }
            inflight.insert(key.clone(), (r.step, StepState::Running));
        }
        let this = self.clone();
        let (e, r) = (e.clone(), r.clone());
        tokio::spawn(async move {
            let res = this.call(&e, &r).await;
            let mut inflight = this.inflight.lock().expect("inflight lock");
            match remembered_outcome(r.step, res) {
                Some(outcome) => inflight.insert(key, outcome),
                None => inflight.remove(&key),
            };
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_api::migration::{HttpProbe, TcpProbe};
    use podmotion_wire::agent::Timings;
    use tokio::net::TcpListener;

    fn probe(tcp: Option<i32>, http: Option<(i32, &str)>) -> ApplicationProbe {
        ApplicationProbe {
            http_get: http.map(|(port, path)| HttpProbe {
                path: path.into(),
                port,
                scheme: HttpScheme::Http,
            }),
            tcp_socket: tcp.map(|port| TcpProbe { port }),
            grpc: None,
            exec: None,
            timeout_seconds: 1,
            failure_threshold: 1,
        }
    }

    #[tokio::test]
    async fn tcp_and_http_probes_pass_only_against_a_live_healthy_server() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = i32::from(l.local_addr().unwrap().port());
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let ok = String::from_utf8_lossy(&buf[..n]).starts_with("GET /ok ");
                let line = if ok {
                    "HTTP/1.0 200 OK\r\n\r\n"
                } else {
                    "HTTP/1.0 503 Unavailable\r\n\r\n"
                };
                let _ = s.write_all(line.as_bytes()).await;
            }
        });
        let t = Duration::from_secs(1);
        assert!(
            probe_once("127.0.0.1", &probe(Some(port), None), t)
                .await
                .is_ok()
        );
        assert!(
            probe_once("127.0.0.1", &probe(None, Some((port, "/ok"))), t)
                .await
                .is_ok()
        );
        assert!(matches!(
            probe_once("127.0.0.1", &probe(None, Some((port, "/bad"))), t).await,
            Err(ProbeError::Failed(_))
        ));
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        assert!(matches!(
            probe_once("127.0.0.1", &probe(Some(i32::from(closed)), None), t).await,
            Err(ProbeError::Failed(_))
        ));
        let exec = ApplicationProbe {
            exec: Some(podmotion_api::migration::ExecProbe {
                command: vec!["true".into()],
                container: None,
            }),
            ..probe(None, None)
        };
        assert!(matches!(
            probe_once("127.0.0.1", &exec, t).await,
            Err(ProbeError::Unsupported(_))
        ));
    }

    #[tokio::test]
    async fn an_https_probe_passes_against_a_self_signed_server_and_fails_on_its_errors() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["app.invalid".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let server = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::try_from(key.serialize_der()).unwrap(),
        )
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = i32::from(l.local_addr().unwrap().port());
        tokio::spawn(async move {
            loop {
                let (s, _) = l.accept().await.unwrap();
                let Ok(mut s) = acceptor.accept(s).await else {
                    continue;
                };
                let mut buf = [0u8; 256];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let ok = String::from_utf8_lossy(&buf[..n]).starts_with("GET /healthz ");
                let line = if ok {
                    "HTTP/1.0 204 No Content\r\n\r\n"
                } else {
                    "HTTP/1.0 500 Oops\r\n\r\n"
                };
                let _ = s.write_all(line.as_bytes()).await;
                let _ = s.shutdown().await;
            }
        });
        let get = |path: &str, scheme: HttpScheme| ApplicationProbe {
            http_get: Some(HttpProbe {
                path: path.into(),
                port,
                scheme,
            }),
            ..probe(None, None)
        };
        let t = Duration::from_secs(2);
        probe_once("127.0.0.1", &get("/healthz", HttpScheme::Https), t)
            .await
            .unwrap_or_else(|_| panic!("a healthy HTTPS server must pass"));
        assert!(matches!(
            probe_once("127.0.0.1", &get("/broken", HttpScheme::Https), t).await,
            Err(ProbeError::Failed(_))
        ));
        // Plain HTTP against the TLS port gets no status line: a failure, not a pass.
        assert!(
            probe_once("127.0.0.1", &get("/healthz", HttpScheme::Http), t)
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn a_grpc_probe_passes_only_while_the_service_reports_serving() {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("web", tonic_health::ServingStatus::Serving)
            .await;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = i32::from(l.local_addr().unwrap().port());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream_of(l)),
        );
        let grpc = |service: &str| ApplicationProbe {
            grpc: Some(podmotion_api::migration::GrpcProbe {
                port,
                service: Some(service.into()),
            }),
            ..probe(None, None)
        };
        let t = Duration::from_secs(2);
        probe_once("127.0.0.1", &grpc("web"), t)
            .await
            .unwrap_or_else(|_| panic!("serving service must pass"));
        assert!(matches!(
            probe_once("127.0.0.1", &grpc("other"), t).await,
            Err(ProbeError::Failed(_))
        ));
        reporter
            .set_service_status("web", tonic_health::ServingStatus::NotServing)
            .await;
        assert!(matches!(
            probe_once("127.0.0.1", &grpc("web"), t).await,
            Err(ProbeError::Failed(_))
        ));
    }

    /// The listener as the incoming-connection stream tonic's server takes.
    fn tokio_stream_of(
        l: TcpListener,
    ) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
        futures::stream::unfold(l, |l| async move {
            let r = l.accept().await.map(|(s, _)| s);
            Some((r, l))
        })
    }

    fn status(role: Role, phase: Phase) -> MigrationStatus {
        MigrationStatus {
            migration_uid: "u".into(),
            role: role as i32,
            phase: phase as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_passed_probe_is_remembered_because_the_agent_cannot_report_it() {
        assert_eq!(
            remembered_outcome(Step::Probe, Ok(())),
            Some((Step::Probe, StepState::Done))
        );
        assert_eq!(remembered_outcome(Step::Restore, Ok(())), None);
        let failed = remembered_outcome(Step::Dump, Err(("WrongPhase".into(), "x".into())));
        assert!(matches!(
            failed,
            Some((Step::Dump, StepState::Failed { .. }))
        ));
    }

    #[test]
    fn agent_phases_map_to_the_steps_the_machine_expects() {
        let cases = [
            (Role::Source, Phase::Unknown, None),
            (Role::Source, Phase::Prepared, Some(Step::Prepare)),
            (Role::Target, Phase::Prepared, Some(Step::Receive)),
            (Role::Target, Phase::Received, Some(Step::Receive)),
            (Role::Source, Phase::Dumped, Some(Step::Dump)),
            (Role::Source, Phase::Sent, Some(Step::Transfer)),
            (Role::Target, Phase::Restored, Some(Step::Restore)),
            (Role::Source, Phase::Committed, Some(Step::Commit)),
            (Role::Source, Phase::Aborted, Some(Step::Abort)),
            (Role::Target, Phase::CleanedUp, Some(Step::Cleanup)),
        ];
        for (role, phase, want) in cases {
            assert_eq!(
                report_from_status(&status(role, phase)).last_step(),
                want,
                "{role:?} {phase:?}"
            );
        }
        let mut st = status(Role::Source, Phase::PreDumping);
        st.iteration = 3;
        st.last_round_bytes = 4096;
        let r = report_from_status(&st);
        assert_eq!(r.last_step(), Some(Step::PreDump(3)));
        assert_eq!(r.progress.dirty_bytes, Some(4096));
    }

    #[test]
    fn pre_copy_rounds_report_the_dirty_set_the_link_speed_and_the_dump_cost() {
        // Round 2 streamed 3 MB of 64 MB; 60 MB went in 0.6 s over both rounds.
        let mut st = status(Role::Source, Phase::PreDumping);
        st.iteration = 2;
        st.last_round_bytes = 64_000_000;
        st.last_round_sent_bytes = 3_000_000;
        st.pre_copy_sent_bytes = 60_000_000;
        st.bytes_sent = 60_000_000;
        st.timings = Some(Timings {
            pre_copy_send_us: 600_000,
            last_round_us: 120_400,
            ..Default::default()
        });
        let r = report_from_status(&st);
        assert_eq!(r.last_step(), Some(Step::PreDump(2)));
        assert_eq!(r.progress.dirty_bytes, Some(3_000_000));
        assert_eq!(r.progress.rate_bytes_per_second, Some(100_000_000));
        assert_eq!(r.progress.dump_millis, Some(121));
        // After the final transfer its own speed is reported, not the pre-copy one.
        st.phase = Phase::Sent as i32;
        st.bytes_sent = 62_000_000;
        st.timings = Some(Timings {
            send_us: 10_000,
            ..st.timings()
        });
        assert_eq!(
            report_from_status(&st).progress.rate_bytes_per_second,
            Some(200_000_000)
        );
    }

    #[test]
    fn timings_become_freeze_and_resume_instants_and_a_rate() {
        let mut st = status(Role::Target, Phase::Restored);
        st.bytes_sent = 10_000_000;
        st.timings = Some(Timings {
            freeze_started_us: 1_000_000,
            resumed_us: 1_183_000,
            send_us: 100_000,
            ..Default::default()
        });
        let r = report_from_status(&st);
        let (f, res) = (
            r.progress.frozen_at.unwrap(),
            r.progress.resumed_at.unwrap(),
        );
        assert_eq!(res.duration_since(f).as_millis(), 183);
        assert_eq!(r.progress.rate_bytes_per_second, Some(100_000_000));
        let src = report_from_status(&MigrationStatus {
            role: Role::Source as i32,
            ..st
        });
        assert_eq!(
            src.progress.resumed_at, None,
            "a resumed source is not a restored target"
        );
    }
}
