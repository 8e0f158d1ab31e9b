//! A listener that shuts down without dropping a request: the eviction webhook's.
//!
//! The API server reaches the webhook through its Service over kept-alive
//! connections, and a connection stays with the replica it first reached. A replica
//! that exits with such a connection open, or under a request, makes the API server
//! fail the call (`failed calling webhook ... EOF`), which `failurePolicy: Fail` turns
//! into a refused eviction: `kubectl drain` stops. A drain evicts the replicas on the
//! drained node too, so this happens in every drain unless the replica leaves
//! politely. From the moment it is asked to stop ([`serve`]'s `stop`):
//!
//! 1. **Propagation** (`Grace::propagation`): it keeps accepting and answering, with
//!    keep-alive off: every answer says `Connection: close` and its connection is closed
//!    after it, so the API server's next call opens a new connection, which kube-proxy
//!    sends to another replica once the endpoint's removal has propagated (readiness
//!    already reports not-ready; the EndpointSlice marks a terminating pod not ready at
//!    once). A connection accepted now serves one request. An idle kept-alive
//!    connection is *not* closed at the stop: the drain's own evictions are calling at
//!    that very moment, and closing a connection the API server is just writing a
//!    request on fails that call with `EOF` (HTTP/1.1 has no way to refuse it cleanly);
//!    its next request is answered, with `Connection: close`.
//! 2. **In flight** (`Grace::in_flight`): it stops accepting, closes the connections
//!    still idle, and waits for the requests under way to be answered (hyper's graceful
//!    shutdown), then returns. Whatever is still running after that bound is dropped.

use std::future::Future;
use std::time::Duration;

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONNECTION, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long a stopping listener keeps serving.
#[derive(Clone, Copy, Debug)]
pub struct Grace {
    /// Keep accepting (keep-alive off) this long after the stop.
    pub propagation: Duration,
    /// Then wait at most this long for the requests under way.
    pub in_flight: Duration,
}

/// Where a stopping listener is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Serving,
    /// Answering with `Connection: close`.
    Propagating,
    /// No longer accepting: idle connections close, answers under way finish.
    Closed,
}

/// What a connection is told: the listener's [`Phase`]. A connection accepted while
/// propagating serves one request.
pub type Closing = watch::Receiver<Phase>;

/// Accepts on `listener` and hands every connection to `conn` on its own task, until
/// `stop` resolves and `grace` has run out (module documentation). Returns `Ok` after
/// a graceful stop; `Err` when accepting fails.
pub async fn serve<C, Fut>(
    listener: TcpListener,
    stop: impl Future<Output = ()>,
    grace: Grace,
    conn: C,
) -> std::io::Result<()>
where
    C: Fn(TcpStream, Closing) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (closing_tx, closing) = watch::channel(Phase::Serving);
    let mut conns = JoinSet::new();
    tokio::pin!(stop);
    let propagation_over = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(propagation_over);
    let mut stopping = false;
    loop {
        tokio::select! {
            () = &mut stop, if !stopping => {
                stopping = true;
                let _ = closing_tx.send(Phase::Propagating);
                propagation_over.as_mut().reset(tokio::time::Instant::now() + grace.propagation);
                tracing::info!(
                    propagation_ms = grace.propagation.as_millis() as u64,
                    connections = conns.len(),
                    "stopping: answering with keep-alive off until the endpoint's removal has propagated"
                );
            }
            () = &mut propagation_over, if stopping => break,
            accepted = listener.accept() => {
                let (tcp, _) = accepted?;
                conns.spawn(conn(tcp, closing.clone()));
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let _ = closing_tx.send(Phase::Closed);
    let open = conns.len();
    let finished = tokio::time::timeout(grace.in_flight, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    match finished {
        Ok(()) => tracing::info!(open, "stopped accepting; every request answered"),
        Err(_) => tracing::warn!(
            open,
            left = conns.len(),
            "stopped accepting; requests still under way after the bound are dropped"
        ),
    }
    conns.abort_all();
    Ok(())
}

/// Serves HTTP/1.1 on `io`, each request answered by `handle`: with `Connection:
/// close` (and the connection closed after it) once the listener propagates its stop;
/// once it is closed, an idle connection is closed and one under way closes after
/// its answer.
pub async fn http1_connection<I, H, Fut>(
    io: I,
    handle: H,
    mut closing: Closing,
) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let keep_alive = *closing.borrow_and_update() == Phase::Serving;
    let phase = closing.clone();
    let handle = Arc::new(handle);
    let svc = service_fn(move |req: Request<Incoming>| {
        let answer = handle(req);
        let phase = phase.clone();
        async move {
            let mut resp = answer.await;
            if *phase.borrow() != Phase::Serving {
                resp.headers_mut()
                    .insert(CONNECTION, HeaderValue::from_static("close"));
            }
            Ok::<_, Infallible>(resp)
        }
    });
    let conn = http1::Builder::new()
        .keep_alive(keep_alive)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let closed = async move {
        let _ = closing.wait_for(|p| *p == Phase::Closed).await;
    };
    tokio::select! {
        r = conn.as_mut() => r,
        () = closed => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::sync::Notify;

    /// A server on loopback whose answer to `/slow` takes `slow`; stopped by `stop`.
    async fn server(
        grace: Grace,
        slow: Duration,
    ) -> (
        SocketAddr,
        Arc<Notify>,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(Notify::new());
        let s = stop.clone();
        let task = tokio::spawn(serve(
            listener,
            async move { s.notified().await },
            grace,
            move |tcp, closing| async move {
                let handle = move |req: Request<Incoming>| async move {
                    if req.uri().path() == "/slow" {
                        tokio::time::sleep(slow).await;
                    }
                    Response::new(Full::new(Bytes::from("answered")))
                };
                let _ = http1_connection(tcp, handle, closing).await;
            },
        ));
        (addr, stop, task)
    }

    fn request(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nhost: test\r\n\r\n")
    }

    /// Reads one response (its body is `answered`); `None` on EOF before one.
    async fn response(s: &mut TcpStream) -> Option<String> {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.ends_with(b"answered") {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        Some(String::from_utf8(got).unwrap().to_ascii_lowercase())
    }

    /// Whether the peer closed the connection (EOF, or a reset) within `within`.
    async fn closed(s: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 16];
        matches!(
            tokio::time::timeout(within, s.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn a_request_in_flight_when_the_stop_comes_is_answered_and_its_connection_closed() {
        let grace = Grace {
            propagation: Duration::from_millis(200),
            in_flight: Duration::from_secs(5),
        };
        let (addr, stop, task) = server(grace, Duration::from_millis(800)).await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        // Kept alive before the stop.
        c.write_all(request("/").as_bytes()).await.unwrap();
        let first = response(&mut c).await.expect("an answer");
        assert!(!first.contains("connection: close"), "{first}");
        // Under way when the stop comes, and still when the propagation ends.
        c.write_all(request("/slow").as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.notify_one();
        let answer = response(&mut c)
            .await
            .expect("the request under way is answered");
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(
            closed(&mut c, Duration::from_secs(5)).await,
            "the connection is closed after the answer"
        );
        task.await.unwrap().unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "no longer accepting"
        );
    }

    #[tokio::test]
    async fn during_the_propagation_kept_alive_and_new_connections_are_answered_once() {
        let grace = Grace {
            propagation: Duration::from_secs(3),
            in_flight: Duration::from_secs(5),
        };
        let (addr, stop, task) = server(grace, Duration::ZERO).await;
        // Two kept-alive connections, idle when the stop comes.
        let mut used = TcpStream::connect(addr).await.unwrap();
        let mut untouched = TcpStream::connect(addr).await.unwrap();
        for c in [&mut used, &mut untouched] {
            c.write_all(request("/").as_bytes()).await.unwrap();
            response(c).await.expect("an answer");
        }
        stop.notify_one();
        // Not closed at the stop: a request the caller is writing now is not lost.
        assert!(
            !closed(&mut used, Duration::from_millis(300)).await,
            "an idle connection closed at the stop"
        );
        used.write_all(request("/").as_bytes()).await.unwrap();
        let answer = response(&mut used)
            .await
            .expect("answered while propagating");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(
            closed(&mut used, Duration::from_secs(1)).await,
            "closed after its answer, before the propagation ends"
        );
        // A new connection is still accepted and answered, once.
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(request("/").as_bytes()).await.unwrap();
        let answer = response(&mut c)
            .await
            .expect("served during the propagation");
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(
            closed(&mut c, Duration::from_secs(1)).await,
            "one request per connection while stopping"
        );
        assert!(!task.is_finished(), "still within the propagation period");
        task.await.unwrap().unwrap();
        // The connection never used again is closed when the listener closes.
        assert!(
            closed(&mut untouched, Duration::from_secs(1)).await,
            "an idle connection left open after the stop"
        );
    }

    #[tokio::test]
    async fn a_request_longer_than_the_bound_is_dropped_and_the_stop_still_ends() {
        let grace = Grace {
            propagation: Duration::from_millis(100),
            in_flight: Duration::from_millis(300),
        };
        let (addr, stop, task) = server(grace, Duration::from_secs(60)).await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(request("/slow").as_bytes()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.notify_one();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("the stop ends within its bounds")
            .unwrap()
            .unwrap();
        assert!(
            response(&mut c).await.is_none(),
            "dropped without an answer"
        );
    }
}
