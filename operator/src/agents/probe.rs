//! Application probes of a restored pod, run by the operator over the pod network
//! (the wire protocol has no probe call yet): TCP, HTTP, HTTPS (no certificate
//! verification, as the kubelet's) and gRPC health. Exec probes run through the API
//! server's `pods/exec` subresource in the target pod's container (which enters the
//! holder container's namespaces: the restored tree's files and network), only when
//! the installer enabled them (`--migration-exec-probes`).

use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::Api;
use kube::api::AttachParams;
use podmotion_api::migration::{ApplicationProbe, ExecProbe, HttpScheme};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub enum ProbeError {
    Unsupported(String),
    Failed(String),
}

/// One gRPC health check (`grpc.health.v1` Check, plaintext, as the kubelet's gRPC
/// probes).
async fn grpc_health(addr: &str, service: &str) -> Result<(), String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect {addr}: {e}"))?;
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_err(|s| format!("{addr} health check: {}", s.message()))?;
    match resp.into_inner().status {
        s if s == ServingStatus::Serving as i32 => Ok(()),
        other => Err(format!("{addr} health status {other}, not SERVING")),
    }
}

/// Most bytes of an exec probe's stderr kept for its failure message (the tail).
pub const STDERR_TAIL: usize = 512;

/// One attempt of an exec probe: `command` in `container` of `pod`, through the API
/// server (`pods/exec`). Passes on exit status 0 within `timeout`.
pub async fn exec_once(
    pods: &Api<Pod>,
    pod: &str,
    container: &str,
    e: &ExecProbe,
    timeout: Duration,
) -> Result<(), ProbeError> {
    let ap = AttachParams::default()
        .container(container)
        .stdin(false)
        .stdout(false)
        .stderr(true);
    let attempt = async {
        let mut proc = pods
            .exec(pod, e.command.clone(), &ap)
            .await
            .map_err(|x| format!("exec in {pod}/{container}: {x}"))?;
        let status = proc.take_status();
        let stderr = proc.stderr();
        let tail = async {
            let Some(mut r) = stderr else {
                return Vec::new();
            };
            let mut tail = Vec::new();
            let mut buf = [0u8; 4096];
            while let Ok(n) = r.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                tail.extend_from_slice(&buf[..n]);
                let over = tail.len().saturating_sub(STDERR_TAIL);
                tail.drain(..over);
            }
            tail
        };
        let status = async {
            match status {
                Some(s) => s.await,
                None => None,
            }
        };
        let (tail, status) = tokio::join!(tail, status);
        exec_verdict(status.as_ref(), &tail)
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| {
            ProbeError::Failed(format!(
                "exec {:?} in {pod}/{container}: no exit status within {timeout:?}",
                e.command
            ))
        })?
        .map_err(ProbeError::Failed)
}

/// What the exec subresource's status channel says of the command: `Success` is exit
/// status 0; a `NonZeroExitCode` names the code (cause `ExitCode`); anything else (no
/// status: the stream ended early; a command that could not start) fails with the
/// API server's message. The stderr tail (at most `STDERR_TAIL` bytes) is appended.
pub fn exec_verdict(status: Option<&Status>, stderr_tail: &[u8]) -> Result<(), String> {
    let Some(st) = status else {
        return Err(with_stderr(
            "the exec stream ended without an exit status".into(),
            stderr_tail,
        ));
    };
    if st.status.as_deref() == Some("Success") {
        return Ok(());
    }
    let code = st
        .details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .and_then(|cs| {
            cs.iter()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
                .and_then(|c| c.message.clone())
        });
    let what = match (code, st.message.as_deref()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(m)) if !m.is_empty() => m.to_string(),
        (None, _) => format!(
            "failed ({})",
            st.reason.as_deref().unwrap_or("no reason given")
        ),
    };
    Err(with_stderr(what, stderr_tail))
}

fn with_stderr(what: String, tail: &[u8]) -> String {
    let tail = &tail[tail.len().saturating_sub(STDERR_TAIL)..];
    let text = String::from_utf8_lossy(tail);
    let text = text.trim();
    if text.is_empty() {
        what
    } else {
        format!("{what}; stderr: {text}")
    }
}

/// One attempt of a TCP, plain-HTTP or gRPC probe against `ip`.
pub async fn probe_once(
    ip: &str,
    p: &ApplicationProbe,
    timeout: Duration,
) -> Result<(), ProbeError> {
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
                "an exec probe runs through the API server, not against the pod's IP".into(),
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
            code if (200..400).contains(&code) => Ok(()),
            other => Err(failed(format!("GET {addr}{path}: status {other}"))),
        }
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| failed(format!("{addr}: no answer within {timeout:?}")))?
}

/// Sends `GET path` (escaped: a probe path never shapes the request line) and
/// returns the response's status code.
async fn http_status<S>(stream: S, host: &str, path: &str) -> Result<u16, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    let req = hyper::Request::get(escape_path(path))
        .header(hyper::header::HOST, host)
        .header(hyper::header::USER_AGENT, "podmotion-probe")
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let mut response = std::pin::pin!(sender.send_request(req));
    let response = tokio::select! {
        biased;
        r = &mut response => r,
        // The connection ended: the response is in, or it never comes.
        _ = conn => response.await,
    };
    response
        .map(|r| r.status().as_u16())
        .map_err(|e| e.to_string())
}

/// `path` as a request target: bytes outside RFC 3986's path and query characters
/// (spaces, CR and LF among them) are percent-encoded, and it starts with `/`.
fn escape_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len() + 1);
    if !path.starts_with('/') {
        out.push('/');
    }
    for b in path.bytes() {
        let keep = b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@/?%".contains(&b);
        if keep {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_api::migration::{HttpProbe, TcpProbe};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
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

    #[test]
    fn a_probe_path_cannot_break_out_of_the_request_line() {
        let p = escape_path("/ok\r\nX-Injected: 1 HTTP/1.1");
        assert!(!p.contains(['\r', '\n', ' ']), "{p}");
        assert_eq!(p, "/ok%0D%0AX-Injected:%201%20HTTP/1.1");
        assert_eq!(escape_path("healthz?full=1"), "/healthz?full=1");
        assert_eq!(escape_path("/caf\u{e9}"), "/caf%C3%A9");
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

    fn status(json: serde_json::Value) -> Status {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn exec_passes_only_on_exit_status_zero_and_says_why_it_failed() {
        // What the API server sends on the exec status channel (v4/v5 protocols).
        let ok = status(serde_json::json!({"metadata": {}, "status": "Success"}));
        assert_eq!(exec_verdict(Some(&ok), b""), Ok(()));
        let exit1 = status(serde_json::json!({"metadata": {}, "status": "Failure",
            "message": "command terminated with non-zero exit code: error executing command [false], exit code 1",
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": "1"}]}}));
        assert_eq!(
            exec_verdict(Some(&exit1), b"not ready: cache cold\n"),
            Err("exit status 1; stderr: not ready: cache cold".into())
        );
        assert_eq!(exec_verdict(Some(&exit1), b""), Err("exit status 1".into()));
        let missing = status(serde_json::json!({"metadata": {}, "status": "Failure",
            "message": "exec: \"nope\": executable file not found in $PATH",
            "reason": "InternalError"}));
        let m = exec_verdict(Some(&missing), b"").unwrap_err();
        assert!(m.contains("executable file not found"), "{m}");
        let m = exec_verdict(None, b"").unwrap_err();
        assert!(m.contains("without an exit status"), "{m}");
        // The stderr shown is bounded: only its tail.
        let mut noisy = vec![b'x'; 10_000];
        noisy.extend_from_slice(b" the end");
        let m = exec_verdict(Some(&exit1), &noisy).unwrap_err();
        assert!(m.ends_with("x the end"), "{m}");
        assert!(
            m.len() <= "exit status 1; stderr: ".len() + STDERR_TAIL,
            "{}",
            m.len()
        );
    }
}
