//! The one `/metrics` server of the node executors (the agent and the attach
//! executor): plain HTTP/1.1, one request per connection, on a port of its own (no
//! TLS, no token — the port carries counts only), `GET /metrics` answered with the
//! text a render closure returns at each scrape, anything else 404. The operator serves its metrics beside its health
//! endpoints (operator/src/server.rs); the executors have nothing else to serve there.
//!
//! Also the two steps of every executor's registry that were copies: registering a
//! metric ([`registered`]) and encoding the registry as text ([`encode`]).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::{Metric, Registry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a scrape answers with: the OpenMetrics text prometheus-client encodes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// How long a client may take over each read of its request head; a stalled one is
/// dropped.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest request head read: a scrape sends a few lines and no body.
const MAX_HEAD: usize = 4096;

/// Registers `metric` under `name` with `help` and hands it back (a clone shares its
/// values with the registered one).
pub fn registered<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// The text exposition format of `registry`.
pub fn encode(registry: &Registry) -> String {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing to a String cannot fail");
    out
}

/// Binds `addr`, logs it, and serves `/metrics` there from a task of its own until the
/// process ends; `render` is called at each scrape for the body. The bound address
/// comes back (the port, when `addr` asked for any).
pub async fn start<F>(addr: SocketAddr, render: F) -> io::Result<SocketAddr>
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "serving /metrics");
    tokio::spawn(serve(listener, Arc::new(render), HEAD_TIMEOUT));
    Ok(bound)
}

/// Serves `GET /metrics` (anything else: 404) on `listener` until the process ends;
/// `render` is called at each scrape for the body. One request per connection; one
/// connection's failure (a garbage head, a client that stalls past `head_timeout`)
/// ends that connection only.
async fn serve<F>(listener: TcpListener, render: Arc<F>, head_timeout: Duration)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            continue;
        };
        let render = Arc::clone(&render);
        tokio::spawn(answer(conn, render, head_timeout));
    }
}

/// Reads one request head from `conn` and answers it: the rendered text on
/// `GET /metrics`, else 404. Always HTTP/1.1 and `connection: close`.
async fn answer<F>(mut conn: TcpStream, render: Arc<F>, head_timeout: Duration)
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let Some(head) = read_head(&mut conn, head_timeout).await else {
        return;
    };
    let target = head.split_whitespace().nth(1).unwrap_or("");
    let path = target.split('?').next().unwrap_or("");
    let (status, ctype, body) = if head.starts_with("GET ") && path == "/metrics" {
        ("200 OK", CONTENT_TYPE, render())
    } else {
        ("404 Not Found", "text/plain", "not found\n".to_owned())
    };
    let reply = format!(
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.write_all(reply.as_bytes()).await;
    let _ = conn.shutdown().await;
}

/// The request head (at most [`MAX_HEAD`] bytes; a scrape sends no body), or `None`
/// when the client closed, failed or took longer than `head_timeout` over a read.
async fn read_head(conn: &mut TcpStream, head_timeout: Duration) -> Option<String> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut n = 0;
    while n < buf.len() {
        match tokio::time::timeout(head_timeout, conn.read(&mut buf[n..])).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return None,
            Ok(Ok(k)) => n += k,
        }
        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            break;
        }
    }
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// A server on a loopback port that renders `text`, with `head_timeout`.
    async fn server(text: &'static str, head_timeout: Duration) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let render = Arc::new(move || text.to_owned());
        tokio::spawn(serve(listener, render, head_timeout));
        addr
    }

    /// Sends `request` on a new connection and reads the answer until the server
    /// closes it (or resets it: a refused head may leave bytes unread).
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(request).await.unwrap();
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        let read_all = async {
            while let Ok(n @ 1..) = c.read(&mut buf).await {
                out.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(Duration::from_secs(5), read_all)
            .await
            .expect("the server answers and closes");
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn get_metrics_is_the_rendered_text_and_other_paths_are_404() {
        let any_port = SocketAddr::from(([127, 0, 0, 1], 0));
        let addr = start(any_port, || "podmotion_x_total 1\n".to_owned())
            .await
            .unwrap();
        let ok = exchange(addr, b"GET /metrics?x=1 HTTP/1.1\r\nhost: a\r\n\r\n").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains(&format!("content-type: {CONTENT_TYPE}\r\n")),
            "{ok}"
        );
        assert!(ok.contains("content-length: 20\r\n"), "{ok}");
        assert!(ok.ends_with("\r\n\r\npodmotion_x_total 1\n"), "{ok}");
        for request in [
            &b"GET / HTTP/1.1\r\nhost: a\r\n\r\n"[..],
            b"GET /metricsx HTTP/1.1\r\nhost: a\r\n\r\n",
            b"POST /metrics HTTP/1.1\r\nhost: a\r\ncontent-length: 0\r\n\r\n",
        ] {
            let nf = exchange(addr, request).await;
            assert!(nf.starts_with("HTTP/1.1 404 Not Found\r\n"), "{nf}");
            assert!(nf.ends_with("\r\n\r\nnot found\n"), "{nf}");
        }
    }

    #[tokio::test]
    async fn a_stalled_or_garbage_client_does_not_stop_the_server() {
        let addr = server("up 1\n", Duration::from_millis(300)).await;
        // A client that sends half a head and then nothing: dropped at the timeout,
        // while others are answered meanwhile.
        let mut stalled = TcpStream::connect(addr).await.unwrap();
        stalled.write_all(b"GET /metr").await.unwrap();
        let garbage = exchange(addr, b"\x00\x01 not http at all\r\n\r\n").await;
        assert!(!garbage.contains("up 1"), "{garbage}");
        let ok = exchange(addr, b"GET /metrics HTTP/1.1\r\n\r\n").await;
        assert!(ok.ends_with("\r\n\r\nup 1\n"), "{ok}");
        let mut rest = Vec::new();
        let n = tokio::time::timeout(Duration::from_secs(5), stalled.read_to_end(&mut rest))
            .await
            .expect("the stalled connection is closed at the head timeout");
        assert!(n.is_ok(), "{n:?}");
        // A client that closes before its head ends gets nothing, and ends nothing.
        drop(TcpStream::connect(addr).await.unwrap());
        let ok = exchange(addr, b"GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(ok.ends_with("\r\n\r\nup 1\n"), "{ok}");
    }
}
