//! The operator's small HTTP server: `/metrics` (Prometheus text), `/healthz` (the
//! process is serving) and `/readyz` (every controller has synced its caches).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use crate::context::Context;

/// Answers one request.
pub fn route(ctx: &Context, method: &Method, path: &str) -> (StatusCode, &'static str, String) {
    const TEXT: &str = "text/plain; charset=utf-8";
    if method != Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, TEXT, "GET only\n".into());
    }
    match path {
        "/metrics" => (
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            ctx.metrics.encode(),
        ),
        "/healthz" | "/livez" => (StatusCode::OK, TEXT, "ok\n".into()),
        "/readyz" => {
            let pending = ctx.readiness.pending();
            if pending.is_empty() {
                (StatusCode::OK, TEXT, "ok\n".into())
            } else {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    TEXT,
                    format!("not ready: {}\n", pending.join(", ")),
                )
            }
        }
        _ => (StatusCode::NOT_FOUND, TEXT, "not found\n".into()),
    }
}

/// Serves until the process ends.
pub async fn serve(ctx: Arc<Context>, addr: SocketAddr) -> anyhow::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    loop {
        let (stream, _) = listener.accept().await?;
        let ctx = ctx.clone();
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let (status, content_type, body) = route(&ctx, req.method(), req.uri().path());
                async move {
                    Ok::<_, Infallible>(
                        Response::builder()
                            .status(status)
                            .header("content-type", content_type)
                            .body(Full::new(Bytes::from(body)))
                            .expect("static response parts are valid"),
                    )
                }
            });
            if let Err(e) = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "metrics connection ended");
            }
        });
    }
}
