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
//!    keep-alive off (each response says `Connection: close`, and idle connections
//!    are closed at once), while the endpoint's removal reaches kube-proxy and the API
//!    server (readiness already reports not-ready; the EndpointSlice marks a
//!    terminating pod not ready at once). A request that still lands here is answered,
//!    and its connection closed after the answer, so the API server's next request
//!    opens a new connection, which goes to another replica.
//! 2. **In flight** (`Grace::in_flight`): it stops accepting and waits for the
//!    requests under way to be answered (hyper's graceful shutdown), then returns.
//!    Whatever is still running after that bound is dropped.

use std::future::Future;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::server::conn::http1;
use hyper::service::HttpService;
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

/// What a connection is told: whether the listener is stopping. A connection accepted
/// while stopping serves with keep-alive off from its first request.
pub type Closing = watch::Receiver<bool>;

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
    let (closing_tx, closing) = watch::channel(false);
    let mut conns = JoinSet::new();
    tokio::pin!(stop);
    let propagation_over = tokio::time::sleep(Duration::MAX / 4);
    tokio::pin!(propagation_over);
    let mut stopping = false;
    loop {
        tokio::select! {
            () = &mut stop, if !stopping => {
                stopping = true;
                let _ = closing_tx.send(true);
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

/// Serves HTTP/1.1 on `io` with `svc`, keep-alive off once `closing` says so: a
/// request under way is answered (with `Connection: close`), an idle connection
/// closed.
pub async fn http1_connection<I, S>(io: I, svc: S, mut closing: Closing) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = Full<Bytes>>,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let keep_alive = !*closing.borrow_and_update();
    let conn = http1::Builder::new()
        .keep_alive(keep_alive)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    if !keep_alive {
        return conn.await;
    }
    let closed = async move {
        let _ = closing.wait_for(|c| *c).await;
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
    use std::convert::Infallible;
    use std::net::SocketAddr;
    use std::sync::Arc;

    use hyper::service::service_fn;
    use hyper::{Request, Response};
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
                let svc = service_fn(move |req: Request<Incoming>| async move {
                    if req.uri().path() == "/slow" {
                        tokio::time::sleep(slow).await;
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("answered"))))
                });
                let _ = http1_connection(tcp, svc, closing).await;
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

    /// Whether the peer closed the connection (EOF, or a reset).
    async fn closed(s: &mut TcpStream) -> bool {
        let mut buf = [0u8; 16];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await,
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
            closed(&mut c).await,
            "the connection is closed after the answer"
        );
        task.await.unwrap().unwrap();
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "no longer accepting"
        );
    }

    #[tokio::test]
    async fn a_new_connection_during_the_propagation_is_served_once() {
        let grace = Grace {
            propagation: Duration::from_secs(2),
            in_flight: Duration::from_secs(5),
        };
        let (addr, stop, task) = server(grace, Duration::ZERO).await;
        // An idle kept-alive connection is closed at the stop.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(request("/").as_bytes()).await.unwrap();
        response(&mut idle).await.expect("an answer");
        stop.notify_one();
        assert!(closed(&mut idle).await, "the idle connection is closed");
        // A new one is still accepted and answered, then closed.
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(request("/").as_bytes()).await.unwrap();
        let answer = response(&mut c)
            .await
            .expect("served during the propagation");
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        assert!(answer.contains("connection: close"), "{answer}");
        assert!(
            closed(&mut c).await,
            "one request per connection while stopping"
        );
        assert!(!task.is_finished(), "still within the propagation period");
        task.await.unwrap().unwrap();
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
