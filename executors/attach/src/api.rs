//! Control API. With the controller's layout it is served on the target pod's loopback
//! (`127.0.0.1:<AGENT_CONTROL_PORT>` inside the target's network namespace), so a client
//! reaches it by port-forwarding to its *own* pod (`pods/portforward` in the workload's
//! namespace), never into the agents' namespace; the Job pod's own port answers
//! `/healthz` only (the readiness probe). Without a target port (manual runs) the whole
//! API is on the Job pod's port. HTTP/1.1 with JSON bodies; client streams are HTTP
//! upgrades (`Upgrade: podmotion-stream`) so one port serves everything. With a token
//! verifier configured, every route but `/healthz` requires
//! `Authorization: Bearer <token>` whose SHA-256 is the verifier
//! (`podmotion_attach_job::token_verifier`): the agent never holds the token itself.
//!
//! | method + path | |
//! |---|---|
//! | `GET /healthz` | liveness + what is attached (no token needed) |
//! | `GET /v1/env[?container=<id>]` | ordered environment (duplicates kept) |
//! | `GET /v1/exports` | exports dir, symlinks, target mounts |
//! | `GET /v1/files?path=<abs, %-encoded>[&container=<id>]` (upgrade) | one file or directory of the target's filesystem, resolved strictly inside its root (`files.rs`): a JSON line `{"kind":"file","size","mode"}` then exactly `size` bytes, or `{"kind":"dir","mode"}` then a tar stream; refusals (404 missing, 400 loop/magic link/special file, 403) come before the upgrade |
//! | `POST /v1/intercepts/<port>` · `DELETE …` | start / stop an intercept; a JSON body `{"headers":[{"name","value"}]}` makes it a filtered HTTP intercept |
//! | `GET /v1/intercepts/<port>/accept` (upgrade) | take one intercepted connection: a JSON line `{"peer","original_dst"}` then the raw bytes both ways; the client must not write before that line |
//! | `POST /v1/wiretaps/<port>` → `{"id"}` · `DELETE /v1/wiretaps/<port>/<id>` | start / stop a wiretap |
//! | `GET /v1/wiretaps/<port>/<id>/stream` (upgrade) | the tap's frames, `[kind u8][conn u32 BE][len u32 BE][payload]`, kinds open(0, JSON meta) / to-app(1) / from-app(2) / close(3) |

use crate::attached::Attached;
use crate::http::Filter;
use crate::port::{ModeError, Port};
use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

pub const UPGRADE_PROTO: &str = "podmotion-stream";

/// Serves the whole control API on `listener`.
pub async fn serve(listener: TcpListener, state: Arc<Attached>) {
    serve_with(listener, state, Scope::Full).await
}

/// Serves `/healthz` only on `listener` (the Job pod's port, for its readiness probe,
/// when the API itself is on the target pod's loopback).
pub async fn serve_health(listener: TcpListener, state: Arc<Attached>) {
    serve_with(listener, state, Scope::HealthOnly).await
}

/// What one listener answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Scope {
    Full,
    HealthOnly,
}

async fn serve_with(listener: TcpListener, state: Arc<Attached>, scope: Scope) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move {
                    Ok::<_, std::convert::Infallible>(match scope {
                        Scope::Full => route(state, req).await,
                        Scope::HealthOnly => health_only(&state, &req),
                    })
                }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades()
                .await
            {
                tracing::debug!(error = %e, "control connection ended");
            }
        });
    }
}

fn json(status: StatusCode, v: serde_json::Value) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())))
        .expect("static response")
}

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response<Full<Bytes>> {
    json(status, serde_json::json!({ "error": msg.to_string() }))
}

fn mode_error(e: ModeError) -> Response<Full<Bytes>> {
    let status = match e {
        ModeError::UnknownPort(_) | ModeError::NoTap(..) => StatusCode::NOT_FOUND,
        ModeError::AlreadyIntercepted(_) | ModeError::NotIntercepted(_) => StatusCode::CONFLICT,
        ModeError::TooManyWiretaps(_) => StatusCode::TOO_MANY_REQUESTS,
    };
    error(status, e)
}

fn switching() -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, UPGRADE_PROTO)
        .body(Full::new(Bytes::new()))
        .expect("static response")
}

fn wants_upgrade(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(UPGRADE_PROTO))
}

/// `/healthz`, and for every other path a 404 that says where the API is.
fn health_only(state: &Attached, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() == "/healthz" {
        // Counted as on the full API: the readiness probe's answers are the series the
        // alerts and the dashboard read when no client calls the API.
        crate::metrics::global().api_request("healthz", 200);
        return json(StatusCode::OK, state.health());
    }
    crate::metrics::global().api_request("unknown", 404);
    error(
        StatusCode::NOT_FOUND,
        "this port serves /healthz only: the control API is on the target pod's loopback \
         (port-forward to the target pod, with the token from the attachment's namespace)",
    )
}

/// Whether the presented bearer token is the one whose verifier we hold
/// (`Attached::token` is that verifier, the SHA-256 of the token, never the token).
fn authorized(state: &Attached, req: &Request<Incoming>) -> bool {
    let Some(verifier) = &state.token else {
        return true;
    };
    let Some(got) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    podmotion_attach_job::token_matches(verifier, got)
}

/// The `route` label of a request path (one of [`crate::metrics::API_ROUTES`]).
fn route_name(method: &Method, segs: &[&str]) -> &'static str {
    match segs {
        ["healthz"] => "healthz",
        ["v1", "env"] => "env",
        ["v1", "exports"] => "exports",
        ["v1", "files"] => "files",
        ["v1", "intercepts", _] => "intercepts",
        ["v1", "intercepts", _, "accept"] => "intercept_accept",
        ["v1", "wiretaps", _] if method == Method::POST => "wiretaps",
        ["v1", "wiretaps", _, _] if method == Method::DELETE => "wiretaps",
        ["v1", "wiretaps", _, _, "stream"] => "wiretap_stream",
        _ => "unknown",
    }
}

/// Answers one request and counts it by route and status code.
async fn route(state: Arc<Attached>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let name = {
        let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
        route_name(req.method(), &segs)
    };
    if path != "/healthz" && !authorized(&state, &req) {
        crate::metrics::global().api_request("unauthorized", 401);
        return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    let r = answer(state, req, &path).await;
    crate::metrics::global().api_request(name, r.status().as_u16());
    r
}

async fn answer(state: Arc<Attached>, req: Request<Incoming>, path: &str) -> Response<Full<Bytes>> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let method = req.method().clone();
    match (&method, segs.as_slice()) {
        (&Method::GET, ["healthz"]) => json(StatusCode::OK, state.health()),
        (&Method::GET, ["v1", "env"]) => env(&state, &req),
        (&Method::GET, ["v1", "exports"]) => json(StatusCode::OK, state.exports()),
        (&Method::GET, ["v1", "files"]) => files(&state, req),
        (m, ["v1", "intercepts", port]) if m == Method::POST || m == Method::DELETE => {
            let port = port.to_string();
            start_or_stop_intercept(&state, &method, &port, req).await
        }
        (&Method::GET, ["v1", "intercepts", port, "accept"]) => accept(&state, port, req),
        (&Method::POST, ["v1", "wiretaps", port]) => {
            match state.port(port).and_then(|p| Ok((p.start_wiretap()?, p))) {
                Ok((id, p)) => json(
                    StatusCode::CREATED,
                    serde_json::json!({ "id": id, "port": p.app_port }),
                ),
                Err(e) => mode_error(e),
            }
        }
        (&Method::DELETE, ["v1", "wiretaps", port, id]) => {
            let (port, id) = match wiretap_of(&state, port, id) {
                Ok(w) => w,
                Err(r) => return *r,
            };
            match port.stop_wiretap(id) {
                Ok(()) => json(StatusCode::OK, serde_json::json!({ "stopped": id })),
                Err(e) => mode_error(e),
            }
        }
        (&Method::GET, ["v1", "wiretaps", port, id, "stream"]) => {
            stream_wiretap(&state, port, id, req)
        }
        _ => error(
            StatusCode::NOT_FOUND,
            format!("no route for {method} {path}"),
        ),
    }
}

/// `GET /v1/env[?container=NAME]`: the target container's environment.
fn env(state: &Attached, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let container = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("container=")))
        .map(str::to_owned);
    match state.env(container.as_deref()) {
        Some(env) => json(
            StatusCode::OK,
            serde_json::to_value(env).unwrap_or_default(),
        ),
        None => error(StatusCode::NOT_FOUND, "no such container"),
    }
}

/// Carries the blocking file reader's bytes to the async stream; a send fails once
/// the client is gone, which stops the reader.
struct ChannelWriter(tokio::sync::mpsc::Sender<Bytes>);

impl std::io::Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .blocking_send(Bytes::copy_from_slice(buf))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `GET /v1/files?path=P[&container=ID]` (upgrade): the file or directory at `P` in the
/// target container's filesystem (see [`crate::files`]). The path is resolved and
/// opened before the answer, so a refusal is a plain error response.
fn files(state: &Attached, req: Request<Incoming>) -> Response<Full<Bytes>> {
    use crate::metrics::FileResult;
    let r = open_file(state, req);
    match r.status().as_u16() {
        // Counted by `open_file` once the kind is known.
        101 => {}
        426 => crate::metrics::global().file_request(FileResult::Error),
        code => crate::metrics::global().file_request(FileResult::of_status(code)),
    }
    r
}

fn open_file(state: &Attached, mut req: Request<Incoming>) -> Response<Full<Bytes>> {
    use crate::files::Opened;
    use crate::metrics::FileResult;
    if let Some(r) = upgrade_required(&req) {
        return r;
    }
    let (path, opened) = match requested_file(state, &req) {
        Ok(found) => found,
        Err(answer) => return *answer,
    };
    let (meta, result) = match &opened {
        Opened::File { size, mode, .. } => (
            serde_json::json!({ "kind": "file", "size": size, "mode": mode }),
            FileResult::File,
        ),
        Opened::Dir { mode, .. } => (
            serde_json::json!({ "kind": "dir", "mode": mode }),
            FileResult::Directory,
        ),
    };
    crate::metrics::global().file_request(result);
    upgrade_then(&mut req, move |mut client| async move {
        if client
            .write_all(format!("{meta}\n").as_bytes())
            .await
            .is_err()
        {
            return;
        }
        send_opened(&mut client, opened, path).await;
        let _ = client.shutdown().await;
    })
}

/// The `?path=` of a file request and what it names, opened inside the `?container=`'s
/// root; or the answer to a request without a path, of an unknown container, or of a
/// path that cannot be opened.
fn requested_file(
    state: &Attached,
    req: &Request<Incoming>,
) -> Result<(String, crate::files::Opened), Box<Reply>> {
    use crate::files::query_param;
    let query = req.uri().query();
    let Some(path) = query_param(query, "path") else {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "?path=<absolute path, percent-encoded> is required",
        )));
    };
    let container = query_param(query, "container");
    match state.open_file(container.as_deref(), &path) {
        Ok(opened) => Ok((path, opened)),
        Err(e) => {
            let status =
                StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(Box::new(error(status, e)))
        }
    }
}

/// Streams `opened` to `client`: a file's bytes, a directory as a tar. A blocking task
/// reads it while this one writes; a copy that ends early is counted and logged.
async fn send_opened(
    client: &mut (impl tokio::io::AsyncWrite + Unpin),
    opened: crate::files::Opened,
    path: String,
) {
    use crate::files::{Opened, write_tar};
    use crate::metrics::ErrorCategory;
    // The tar's top entry: the directory's own name (`/` is `root`).
    let name = std::path::Path::new(&path)
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| *n != "..")
        .unwrap_or("root")
        .to_owned();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(8);
    let producer = tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut w = std::io::BufWriter::with_capacity(64 * 1024, ChannelWriter(tx));
        match opened {
            Opened::File { file, size, .. } => {
                std::io::copy(&mut file.take(size), &mut w)?;
                w.flush()
            }
            Opened::Dir { dir, mode } => write_tar(dir, &name, mode, w).map(|s| {
                tracing::info!(?s, "directory sent as tar");
            }),
        }
    });
    while let Some(chunk) = rx.recv().await {
        if client.write_all(&chunk).await.is_err() {
            break;
        }
    }
    drop(rx);
    match producer.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            crate::metrics::global().error(ErrorCategory::FileCopy);
            tracing::warn!(path, error = %e, "file copy ended early")
        }
        Err(e) => {
            crate::metrics::global().error(ErrorCategory::FileCopy);
            tracing::warn!(path, error = %e, "file copy task failed")
        }
    }
}

/// Longest body of a control request.
const MAX_BODY: usize = 64 * 1024;

/// The optional filter of `POST /v1/intercepts/PORT`: none for an empty body.
async fn read_filter(req: Request<Incoming>) -> Result<Option<Filter>, Box<Reply>> {
    use http_body_util::BodyExt;
    let body = http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| {
            Box::new(error(
                StatusCode::BAD_REQUEST,
                format!("reading the body: {e}"),
            ))
        })?
        .to_bytes();
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let filter: Filter = serde_json::from_slice(&body).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            format!("the body is not {{\"headers\":[{{\"name\",\"value\"}}]}}: {e}"),
        ))
    })?;
    filter
        .validate()
        .map_err(|e| Box::new(error(StatusCode::BAD_REQUEST, e)))?;
    Ok(Some(filter))
}

/// `POST|DELETE /v1/intercepts/PORT`: starts or stops intercepting the port; a POST
/// with a header filter starts a filtered HTTP intercept (the answer echoes it).
async fn start_or_stop_intercept(
    state: &Attached,
    m: &Method,
    port: &str,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let port = match state.port(port) {
        Ok(p) => p,
        Err(e) => return mode_error(e),
    };
    if m == Method::POST {
        let filter = match read_filter(req).await {
            Ok(f) => f,
            Err(r) => return *r,
        };
        let headers = filter.as_ref().map(|f| f.headers.clone());
        match port.start_intercept(filter) {
            Ok(id) => {
                let mut v = serde_json::json!({ "id": id, "port": port.app_port });
                if let Some(h) = headers {
                    v["headers"] = serde_json::to_value(h).unwrap_or_default();
                }
                json(StatusCode::CREATED, v)
            }
            Err(e) => mode_error(e),
        }
    } else {
        match port.stop_intercept() {
            Ok(()) => json(
                StatusCode::OK,
                serde_json::json!({ "stopped": port.app_port }),
            ),
            Err(e) => mode_error(e),
        }
    }
}

/// The answer to a request that must upgrade to our protocol and does not.
fn upgrade_required(req: &Request<Incoming>) -> Option<Response<Full<Bytes>>> {
    (!wants_upgrade(req)).then(|| {
        error(
            StatusCode::UPGRADE_REQUIRED,
            format!("Upgrade: {UPGRADE_PROTO} required"),
        )
    })
}

/// `GET /v1/intercepts/PORT/accept` (upgrade): waits for one intercepted connection
/// and splices it to the client's stream, after a JSON line naming its peer.
fn accept(state: &Attached, port: &str, mut req: Request<Incoming>) -> Response<Full<Bytes>> {
    if let Some(r) = upgrade_required(&req) {
        return r;
    }
    let port = match state.port(port) {
        Ok(p) => p,
        Err(e) => return mode_error(e),
    };
    let rx = match port.add_waiter() {
        Ok(rx) => rx,
        Err(e) => return mode_error(e),
    };
    upgrade_then(&mut req, move |mut client| async move {
        let mut probe = [0u8; 1];
        let conn = tokio::select! {
            c = rx => c,
            // The client closed its stream before a connection came: drop
            // the waiter so no connection is handed to a dead stream.
            _ = client.read(&mut probe) => return,
        };
        let Ok(conn) = conn else { return }; // intercept stopped
        let head = format!(
            "{}\n",
            serde_json::json!({ "peer": conn.peer.to_string(), "original_dst": conn.original_dst.to_string() })
        );
        if client.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        let mut s = conn.stream;
        let _ = tokio::io::copy_bidirectional(&mut client, &mut s).await;
    })
}

/// Answers `101 Switching Protocols` and runs `then` on the upgraded stream once the
/// client has it (nothing runs when the upgrade fails).
fn upgrade_then<F, Fut>(req: &mut Request<Incoming>, then: F) -> Response<Full<Bytes>>
where
    F: FnOnce(TokioIo<Upgraded>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let on_upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            then(TokioIo::new(upgraded)).await;
        }
    });
    switching()
}

/// An answer of the control API.
type Reply = Response<Full<Bytes>>;

/// The port and wiretap id of a wiretap path, or the answer to a bad one.
fn wiretap_of(state: &Attached, port: &str, id: &str) -> Result<(Arc<Port>, u64), Box<Reply>> {
    match (state.port(port), id.parse::<u64>()) {
        (Ok(p), Ok(id)) => Ok((p, id)),
        (Err(e), _) => Err(Box::new(mode_error(e))),
        (_, Err(_)) => Err(Box::new(error(StatusCode::BAD_REQUEST, "bad wiretap id"))),
    }
}

/// `GET /v1/wiretaps/PORT/ID/stream` (upgrade): the wiretap's frames, until either
/// side ends; the wiretap is stopped when the stream ends.
fn stream_wiretap(
    state: &Attached,
    port: &str,
    id: &str,
    mut req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    if let Some(r) = upgrade_required(&req) {
        return r;
    }
    let (port, id) = match wiretap_of(state, port, id) {
        Ok(w) => w,
        Err(r) => return *r,
    };
    let mut rx = match port.take_wiretap_stream(id) {
        Ok(rx) => rx,
        Err(e) => return mode_error(e),
    };
    upgrade_then(&mut req, move |mut client| async move {
        while let Some(frame) = rx.recv().await {
            if client.write_all(&frame).await.is_err() {
                break;
            }
        }
        let _ = client.shutdown().await;
        let _ = port.stop_wiretap(id);
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::environ::EnvEntry;
    use crate::nft::{Redirect, Ruleset};
    use crate::port::Port;

    fn attached() -> Arc<Attached> {
        with_token(None)
    }

    fn with_token(token: Option<&str>) -> Arc<Attached> {
        Arc::new(Attached {
            containers: vec![
                crate::attached::Container {
                    id: "containerd://aaa".into(),
                    pid: 10,
                    env: vec![
                        EnvEntry {
                            name: "B".into(),
                            value: "1".into(),
                        },
                        EnvEntry {
                            name: "A".into(),
                            value: "2".into(),
                        },
                        EnvEntry {
                            name: "B".into(),
                            value: "3".into(),
                        },
                    ],
                    pin: own_pin(),
                },
                crate::attached::Container {
                    id: "containerd://bbb".into(),
                    pid: 11,
                    env: vec![],
                    pin: own_pin(),
                },
            ],
            exports_dir: "/x".into(),
            exports: vec![],
            mounts: vec![],
            ports: vec![Arc::new(Port::new(8080, 15001))],
            ruleset: Ruleset {
                table: "t".into(),
                agent_gid: 1,
                redirects: vec![Redirect {
                    port: 8080,
                    to: 15001,
                }],
            },
            cri_socket: None,
            // The agent holds the verifier, never the token.
            token: token.map(podmotion_attach_job::token_verifier),
        })
    }

    /// A live process to stand for the fixture's containers: this test process.
    fn own_pin() -> Arc<crate::pinned::Pinned> {
        Arc::new(crate::pinned::Pinned::open("/proc".as_ref(), std::process::id()).unwrap())
    }

    async fn call(addr: std::net::SocketAddr, method: &str, path: &str, upgrade: bool) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let extra = if upgrade {
            "Connection: upgrade\r\nUpgrade: podmotion-stream\r\n"
        } else {
            "Connection: close\r\n"
        };
        s.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: 0\r\n\r\n")
                .as_bytes(),
        )
        .await
        .unwrap();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[tokio::test]
    async fn control_api_serves_env_and_drives_intercept_state() {
        let env_ok = r#"podmotion_attach_api_requests_total{route="env",code="200"}"#;
        let conflict = r#"podmotion_attach_api_requests_total{route="intercepts",code="409"}"#;
        let before = (
            crate::metrics::value(env_ok),
            crate::metrics::value(conflict),
        );
        let state = attached();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, state.clone()));

        let env = call(addr, "GET", "/v1/env", false).await;
        assert!(
            env.contains(
                r#"[{"name":"B","value":"1"},{"name":"A","value":"2"},{"name":"B","value":"3"}]"#
            ),
            "{env}"
        );
        assert!(
            call(addr, "GET", "/v1/env?container=bbb", false)
                .await
                .ends_with("[]")
        );
        assert!(
            call(addr, "GET", "/v1/env?container=zzz", false)
                .await
                .starts_with("HTTP/1.1 404")
        );

        assert!(
            call(addr, "GET", "/v1/intercepts/8080/accept", true)
                .await
                .starts_with("HTTP/1.1 409"),
            "accept needs an intercept"
        );
        assert!(
            call(addr, "POST", "/v1/intercepts/9999", false)
                .await
                .starts_with("HTTP/1.1 404")
        );
        assert!(
            call(addr, "POST", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 201")
        );
        assert!(state.ports[0].intercepted());
        assert!(
            call(addr, "POST", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 409")
        );
        assert!(
            call(addr, "GET", "/v1/intercepts/8080/accept", false)
                .await
                .starts_with("HTTP/1.1 426")
        );
        assert!(
            call(addr, "GET", "/v1/intercepts/8080/accept", true)
                .await
                .starts_with("HTTP/1.1 101")
        );
        assert!(
            call(addr, "DELETE", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(!state.ports[0].intercepted());
        assert!(
            call(addr, "DELETE", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 409")
        );

        let tap = call(addr, "POST", "/v1/wiretaps/8080", false).await;
        assert!(tap.starts_with("HTTP/1.1 201"), "{tap}");
        let health = call(addr, "GET", "/healthz", false).await;
        assert!(
            health.contains(r#""wiretaps":["#) && !health.contains(r#""wiretaps":[]"#),
            "{health}"
        );
        assert!(
            call(addr, "GET", "/nope", false)
                .await
                .starts_with("HTTP/1.1 404")
        );
        // Counted by route and status (other tests only ever add to these).
        assert!(crate::metrics::value(env_ok) - before.0 >= 2.0);
        assert!(crate::metrics::value(conflict) - before.1 >= 2.0);
    }

    async fn raw(addr: std::net::SocketAddr, head: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(head.as_bytes()).await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            s.read_to_string(&mut out),
        )
        .await
        .unwrap()
        .unwrap();
        out
    }

    #[tokio::test]
    async fn a_filtered_intercept_starts_with_its_headers_and_a_bad_filter_is_refused() {
        let state = attached();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, state.clone()));
        let post = |body: &str| {
            format!(
                "POST /v1/intercepts/8080 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        for bad in [
            r#"{"headers":[]}"#,
            r#"{"headers":[{"name":"a b","value":"x"}]}"#,
            "nope",
        ] {
            let r = raw(addr, &post(bad)).await;
            assert!(r.starts_with("HTTP/1.1 400"), "{bad}: {r}");
            assert!(!state.ports[0].intercepted(), "{bad} started an intercept");
        }
        let r = raw(
            addr,
            &post(r#"{"headers":[{"name":"X-Dev","value":"me"}]}"#),
        )
        .await;
        assert!(r.starts_with("HTTP/1.1 201"), "{r}");
        assert!(
            r.contains(r#""headers":[{"name":"X-Dev","value":"me"}]"#),
            "{r}"
        );
        let f = state.ports[0].filter().expect("a filtered intercept");
        assert_eq!(
            (f.headers[0].name.as_str(), f.headers[0].value.as_str()),
            ("X-Dev", "me")
        );
        assert!(
            call(addr, "DELETE", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(state.ports[0].filter().is_none());
        // Without a body: a whole-port intercept, no filter.
        assert!(
            call(addr, "POST", "/v1/intercepts/8080", false)
                .await
                .starts_with("HTTP/1.1 201")
        );
        assert!(state.ports[0].intercepted() && state.ports[0].filter().is_none());
    }

    /// Sends a raw request and reads the answer's head (through the empty line) and
    /// its body: after a 101, whatever follows until the server closes; otherwise
    /// `Content-Length` bytes (an error answer keeps the connection alive).
    async fn raw_bytes(addr: std::net::SocketAddr, head: &str) -> (String, Vec<u8>) {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut s = tokio::io::BufReader::new(s);
        s.write_all(head.as_bytes()).await.unwrap();
        let read = async {
            use tokio::io::AsyncBufReadExt;
            let mut head = String::new();
            while !head.ends_with("\r\n\r\n") {
                assert!(s.read_line(&mut head).await.unwrap() > 0, "{head}");
            }
            let mut body = vec![];
            if head.starts_with("HTTP/1.1 101") {
                s.read_to_end(&mut body).await.unwrap();
            } else {
                let len = head
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse::<usize>().unwrap())
                    })
                    .unwrap_or(0);
                body.resize(len, 0);
                s.read_exact(&mut body).await.unwrap();
            }
            (head, body)
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn files_stream_a_file_or_a_tar_from_the_targets_root_and_refuse_escapes() {
        let base = std::env::temp_dir().join(format!("pm-api-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let root = base.join("10/root");
        std::fs::create_dir_all(root.join("srv")).unwrap();
        std::fs::write(base.join("outside"), b"OUTSIDE").unwrap();
        std::fs::write(root.join("srv/index.html"), b"<h1>hi</h1>").unwrap();
        std::os::unix::fs::symlink("../../../outside", root.join("srv/up")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root", root.join("srv/proc")).unwrap();
        // A directory laid out like `/proc/10` of a running process stands for the target.
        std::fs::write(base.join("10/stat"), "10 (app) S 1").unwrap();
        let mut state = Arc::into_inner(with_token(Some("t"))).unwrap();
        state.containers[0].pin =
            Arc::new(crate::pinned::Pinned::open_dir("/proc".as_ref(), &base.join("10")).unwrap());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, Arc::new(state)));
        let get = |q: &str, token: &str| {
            format!(
                "GET /v1/files?{q} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nConnection: upgrade\r\nUpgrade: podmotion-stream\r\n\r\n"
            )
        };
        let file = r#"podmotion_attach_file_requests_total{result="file"}"#;
        let not_found = r#"podmotion_attach_file_requests_total{result="not_found"}"#;
        let refused = r#"podmotion_attach_file_requests_total{result="refused"}"#;
        let before = [file, not_found, refused].map(crate::metrics::value);
        let (head, body) = raw_bytes(addr, &get("path=%2Fsrv%2Findex.html", "t")).await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert_eq!(
            String::from_utf8_lossy(&body),
            "{\"kind\":\"file\",\"mode\":420,\"size\":11}\n<h1>hi</h1>"
        );
        let (head, _) = raw_bytes(addr, &get("path=/srv/index.html", "nope")).await;
        assert!(head.starts_with("HTTP/1.1 401"), "{head}");
        // `srv/up` climbs out of the root on the host: inside the root it names /outside.
        let (head, body) = raw_bytes(addr, &get("path=/srv/up", "t")).await;
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        assert!(!String::from_utf8_lossy(&body).contains("OUTSIDE"));
        let (head, _) = raw_bytes(addr, &get("path=/srv/index.html&container=zzz", "t")).await;
        assert!(head.starts_with("HTTP/1.1 404"), "{head}");
        let (head, _) = raw_bytes(addr, &get("container=containerd://aaa", "t")).await;
        assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        let (head, body) = raw_bytes(addr, &get("path=/srv&container=aaa", "t")).await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        let nl = body.iter().position(|b| *b == b'\n').unwrap();
        assert!(body[..nl].starts_with(br#"{"kind":"dir""#));
        let mut names = vec![];
        for e in tar::Archive::new(&body[nl + 1..]).entries().unwrap() {
            names.push(e.unwrap().path().unwrap().display().to_string());
        }
        assert_eq!(names, ["srv/", "srv/index.html", "srv/proc", "srv/up"]);
        let after = [file, not_found, refused].map(crate::metrics::value);
        assert_eq!(
            [
                after[0] - before[0],
                after[1] - before[1],
                after[2] - before[2]
            ],
            [1.0, 2.0, 1.0],
            "one file, two not found (an escape, a container), one without a path"
        );
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[tokio::test]
    async fn with_a_token_every_route_but_health_needs_the_bearer() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, with_token(Some("s3cret"))));
        let req = |path: &str, auth: &str| {
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n")
        };
        assert!(
            raw(addr, &req("/healthz", ""))
                .await
                .starts_with("HTTP/1.1 200")
        );
        assert!(
            raw(addr, &req("/v1/env", ""))
                .await
                .starts_with("HTTP/1.1 401")
        );
        assert!(
            raw(addr, &req("/v1/env", "Authorization: Bearer s3creX\r\n"))
                .await
                .starts_with("HTTP/1.1 401")
        );
        assert!(
            raw(addr, &req("/v1/env", "Authorization: Bearer s3cre\r\n"))
                .await
                .starts_with("HTTP/1.1 401")
        );
        assert!(
            raw(addr, &req("/v1/env", "Authorization: Bearer s3cret\r\n"))
                .await
                .starts_with("HTTP/1.1 200")
        );
    }

    #[tokio::test]
    async fn the_verifier_the_agent_holds_is_not_a_token() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, with_token(Some("s3cret"))));
        let verifier = podmotion_attach_job::token_verifier("s3cret");
        let req = format!(
            "GET /v1/env HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {verifier}\r\n\r\n"
        );
        let answer = raw(addr, &req).await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }

    #[tokio::test]
    async fn the_job_pods_port_answers_health_and_nothing_else_even_with_the_token() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve_health(l, with_token(Some("s3cret"))));
        let req = |path: &str| {
            format!(
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer s3cret\r\n\r\n"
            )
        };
        assert!(
            raw(addr, &req("/healthz"))
                .await
                .starts_with("HTTP/1.1 200")
        );
        for path in [
            "/v1/env",
            "/v1/exports",
            "/v1/files?path=%2F",
            "/v1/intercepts/8080",
        ] {
            let answer = raw(addr, &req(path)).await;
            assert!(answer.starts_with("HTTP/1.1 404"), "{path}: {answer}");
            assert!(answer.contains("loopback"), "{path}: {answer}");
        }
    }
}
