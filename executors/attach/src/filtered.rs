//! The filtered HTTP intercept at the forwarder: a redirected connection is read as
//! HTTP/1.1, one request at a time (keep-alive and pipelined requests included). A
//! request carrying the intercept's headers goes to a client stream (the first one on
//! the connection is offered to a waiting client stream as a connection of its own, and
//! later matching requests of the same connection follow on it); every other request
//! goes to the application, dialed from inside the target's network namespace like a
//! pass-through, on one upstream connection kept for the downstream connection's life.
//! Each response is relayed back whole before the next request is routed, so responses
//! reach the caller in request order whichever side answered. The connection ends
//! after a response when the request or the response said `Connection: close` (or was
//! HTTP/1.0 without keep-alive), as it would without the agent in between.
//!
//! A connection whose first bytes are not HTTP/1.x is passed through to the
//! application unchanged; a framing error later on closes it (the two sides could no
//! longer agree where a message ends). `Connection: upgrade`/`CONNECT` requests are
//! relayed as bytes once the chosen side accepts the upgrade. Wiretaps do not see
//! connections of a filtered port.

use crate::http::{self, BodyCursor, Filter};
use crate::metrics::{ErrorCategory, Outcome as Ended, Route};
use crate::port::{Conn, Delivered, Delivery, Port};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

/// Opens connections to the application: from inside the target's network namespace
/// in the agent ([`crate::netns::NetnsExecutor`], see [`crate::forward`]), plain TCP
/// in tests.
pub trait AppDial: Send + Sync {
    fn dial(
        &self,
        addr: SocketAddr,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<TcpStream>> + Send + '_>>;
}

/// Bytes of an in-memory pipe to a client stream.
const PIPE: usize = 64 * 1024;
const READ: usize = 16 * 1024;

/// One side a request can go to: the application or a client stream.
struct Upstream {
    r: ReadHalf<Box<dyn Conn>>,
    w: WriteHalf<Box<dyn Conn>>,
    /// Bytes read from it and not yet relayed.
    buf: Vec<u8>,
}

impl Upstream {
    fn new(s: Box<dyn Conn>) -> Upstream {
        let (r, w) = tokio::io::split(s);
        Upstream { r, w, buf: vec![] }
    }
}

/// How an exchange ended.
enum Outcome {
    /// The response is complete; the upstream may take another request.
    Next { upstream_closes: bool },
    /// The response runs until the upstream closes, and it has: end the connection.
    Closed,
    /// The upstream switched protocols: relay bytes from here on.
    Upgraded,
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Appends what `r` has to `buf`; 0 at the end of the stream.
async fn read_more(r: &mut (impl AsyncRead + Unpin), buf: &mut Vec<u8>) -> std::io::Result<usize> {
    let start = buf.len();
    buf.resize(start + READ, 0);
    let n = r.read(&mut buf[start..]).await;
    buf.truncate(start + *n.as_ref().unwrap_or(&0));
    n
}

/// How a redirected connection failed: the error, the outcome it counts as and its
/// error category (counted once, by the forwarder).
#[derive(Debug)]
pub struct ProxyError {
    pub outcome: Ended,
    pub category: ErrorCategory,
    pub error: std::io::Error,
}

impl std::fmt::Display for ProxyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.error, self.outcome.name())
    }
}

impl From<std::io::Error> for ProxyError {
    fn from(error: std::io::Error) -> Self {
        ProxyError {
            outcome: Ended::Error,
            category: ErrorCategory::Io,
            error,
        }
    }
}

/// The application could not be dialed.
pub(crate) fn dial_failed(error: std::io::Error) -> ProxyError {
    ProxyError {
        outcome: Ended::DialFailed,
        category: ErrorCategory::Dial,
        error,
    }
}

/// Serves one redirected connection of a port under a filtered intercept; the outcome
/// is `Delivered` when a request of it went to a client stream, else `Forwarded` (or
/// `TimedOut` when no client stream came). Every routing decision is counted
/// (`podmotion_attach_filtered_requests_total`).
pub async fn proxy<S>(
    port: &Port,
    down: S,
    peer: SocketAddr,
    original_dst: SocketAddr,
    netns: &dyn AppDial,
    wait: Duration,
    filter: Arc<Filter>,
) -> Result<Ended, ProxyError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let metrics = crate::metrics::global();
    let (mut dr, mut dw) = tokio::io::split(down);
    let mut dbuf: Vec<u8> = vec![];
    let mut app: Option<Upstream> = None;
    let mut client: Option<Upstream> = None;
    let mut first = true;
    let done = |client: &Option<Upstream>| {
        if client.is_some() {
            Ended::Delivered
        } else {
            Ended::Forwarded
        }
    };
    loop {
        let (head, mut to_client) =
            match next_request(port, &filter, &mut dr, &mut dbuf, first).await? {
                NextRequest::Head(head, to_client) => (head, to_client),
                NextRequest::CallerDone => return Ok(done(&client)),
                NextRequest::NotHttp => {
                    let down = dr.unsplit(dw);
                    raw_to_app(down, dbuf, original_dst, netns).await?;
                    return Ok(Ended::Forwarded);
                }
            };
        first = false;
        if to_client && client.is_none() {
            match offer_to_client(port, peer, original_dst, wait).await {
                Offer::Taken(stream) => client = Some(stream),
                Offer::Stopped => to_client = false,
                Offer::TimedOut => {
                    answer_no_client(&mut dw).await;
                    return Ok(Ended::TimedOut);
                }
            }
        }
        metrics.filtered(if to_client {
            Route::Matched
        } else {
            Route::Passed
        });
        let up = upstream(to_client, &mut client, &mut app, netns, original_dst).await?;
        let (outcome, sent) = exchange(up, &head, &mut dr, &mut dbuf, &mut dw).await?;
        if !after_response(outcome, sent, head.close, up, &mut dr, &dbuf, &mut dw).await? {
            return Ok(done(&client));
        }
    }
}

/// What the caller sent next on a filtered connection.
enum NextRequest {
    /// A whole request head, and whether it goes to a client stream.
    Head(http::RequestHead, bool),
    /// The caller closed its side.
    CallerDone,
    /// The connection's first bytes are not HTTP/1.x: it is passed through as it is.
    NotHttp,
}

/// Reads until the next request head is whole. The filter of the moment decides (a
/// stopped intercept sends the rest of the connection to the application).
async fn next_request(
    port: &Port,
    filter: &Filter,
    dr: &mut (impl AsyncRead + Unpin),
    dbuf: &mut Vec<u8>,
    first: bool,
) -> Result<NextRequest, ProxyError> {
    loop {
        let current = port.filter();
        match http::parse_request(dbuf, current.as_deref().unwrap_or(filter)) {
            Ok(Some(h)) => {
                let m = h.matches && current.is_some();
                return Ok(NextRequest::Head(h, m));
            }
            Ok(None) => {
                if read_more(dr, dbuf).await? == 0 {
                    return Ok(NextRequest::CallerDone);
                }
            }
            Err(e) if first => {
                tracing::debug!(error = %e, "not HTTP: passing the connection through");
                crate::metrics::global().filtered(Route::NotHttp);
                return Ok(NextRequest::NotHttp);
            }
            Err(e) => {
                return Err(ProxyError {
                    outcome: Ended::Error,
                    category: ErrorCategory::HttpFraming,
                    error: io_err(e),
                });
            }
        }
    }
}

/// What became of the connection offered to the intercept's client streams.
enum Offer {
    /// A client stream took it: matching requests go down this pipe.
    Taken(Upstream),
    /// The intercept stopped meanwhile: the request goes to the application.
    Stopped,
    /// No client stream came in time.
    TimedOut,
}

/// Offers the connection (as a pipe of its own) to a waiting client stream, for up to
/// `wait`.
async fn offer_to_client(
    port: &Port,
    peer: SocketAddr,
    original_dst: SocketAddr,
    wait: Duration,
) -> Offer {
    let (ours, theirs) = tokio::io::duplex(PIPE);
    let offered = Delivered {
        stream: Box::new(theirs),
        peer,
        original_dst,
    };
    match port.deliver(offered, wait).await {
        Delivery::Taken => Offer::Taken(Upstream::new(Box::new(ours))),
        Delivery::Stopped(_) => Offer::Stopped,
        Delivery::TimedOut => Offer::TimedOut,
    }
}

/// Counts a matched request no client stream took, and answers the caller 502 and
/// closes.
async fn answer_no_client(dw: &mut (impl AsyncWrite + Unpin)) {
    let metrics = crate::metrics::global();
    metrics.error(ErrorCategory::NoClient);
    metrics.filtered(Route::Matched);
    let body = "no intercept client took the request in time\n";
    let _ = dw
        .write_all(
            format!(
                "HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await;
    let _ = dw.shutdown().await;
}

/// The side a request goes to: the client stream, or the application (dialed on its
/// first request and kept for the connection's life).
async fn upstream<'a>(
    to_client: bool,
    client: &'a mut Option<Upstream>,
    app: &'a mut Option<Upstream>,
    netns: &dyn AppDial,
    original_dst: SocketAddr,
) -> Result<&'a mut Upstream, ProxyError> {
    if to_client {
        return Ok(client.as_mut().expect("opened above"));
    }
    if app.is_none() {
        let up = netns.dial(original_dst).await.map_err(dial_failed)?;
        *app = Some(Upstream::new(Box::new(up)));
    }
    Ok(app.as_mut().expect("dialed above"))
}

/// Sends one request to `up` (its head, then its body) while relaying the response
/// back; the exchange's outcome, and whether the request's body went out whole.
async fn exchange(
    up: &mut Upstream,
    head: &http::RequestHead,
    dr: &mut (impl AsyncRead + Unpin),
    dbuf: &mut Vec<u8>,
    dw: &mut (impl AsyncWrite + Unpin),
) -> Result<(Outcome, bool), ProxyError> {
    up.w.write_all(&dbuf[..head.len]).await?;
    dbuf.drain(..head.len);
    let mut body = BodyCursor::new(head.body);
    let send = send_body(dr, dbuf, &mut body, &mut up.w);
    let relay = relay_response(&mut up.r, &mut up.buf, dw, &head.method, head.upgrade);
    tokio::pin!(send, relay);
    let mut sent = false;
    loop {
        tokio::select! {
            r = &mut send, if !sent => { r?; sent = true; }
            o = &mut relay => return Ok((o?, sent)),
        }
    }
}

/// After a relayed response: `true` when the connection takes another request; else
/// it has ended (an upgraded one after its bytes were relayed to the end).
async fn after_response(
    outcome: Outcome,
    sent: bool,
    request_closes: bool,
    up: &mut Upstream,
    dr: &mut (impl AsyncRead + Unpin),
    dbuf: &[u8],
    dw: &mut (impl AsyncWrite + Unpin),
) -> Result<bool, ProxyError> {
    match (outcome, sent) {
        (Outcome::Upgraded, _) => {
            // The request's remaining bytes (if any) and everything after are the
            // new protocol's.
            up.w.write_all(dbuf).await?;
            dw.write_all(&up.buf).await?;
            let (a, b) = tokio::join!(
                tokio::io::copy(dr, &mut up.w),
                tokio::io::copy(&mut up.r, dw)
            );
            a?;
            b?;
            Ok(false)
        }
        (Outcome::Closed, _) => {
            let _ = dw.shutdown().await;
            Ok(false)
        }
        // A response that came before its request's body was read whole: where
        // the next request starts is unknown.
        (Outcome::Next { .. }, false) => {
            let _ = dw.shutdown().await;
            Ok(false)
        }
        // Either side said the connection ends after this response: end it, as
        // the caller, who saw that `Connection` header, expects (HTTP/1.0 callers
        // read to the end of the connection).
        (Outcome::Next { upstream_closes }, true) if upstream_closes || request_closes => {
            let _ = dw.shutdown().await;
            Ok(false)
        }
        (Outcome::Next { .. }, true) => Ok(true),
    }
}

/// Copies the request body (what `dbuf` holds first, then the caller's bytes) to `w`.
async fn send_body(
    dr: &mut (impl AsyncRead + Unpin),
    dbuf: &mut Vec<u8>,
    body: &mut BodyCursor,
    w: &mut (impl AsyncWrite + Unpin),
) -> std::io::Result<()> {
    while !body.done() {
        if dbuf.is_empty() && read_more(dr, dbuf).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the caller closed inside a request body",
            ));
        }
        let n = body.advance(dbuf).map_err(io_err)?;
        w.write_all(&dbuf[..n]).await?;
        dbuf.drain(..n);
    }
    w.flush().await
}

/// Relays one response (interim 1xx responses included) from `r` to `dw`, to a
/// request with `method` that asked to upgrade (`upgrade`) or not.
async fn relay_response(
    r: &mut (impl AsyncRead + Unpin),
    buf: &mut Vec<u8>,
    dw: &mut (impl AsyncWrite + Unpin),
    method: &str,
    upgrade: bool,
) -> std::io::Result<Outcome> {
    loop {
        let head = loop {
            if let Some(h) = http::parse_response(buf, method, upgrade).map_err(io_err)? {
                break h;
            }
            if read_more(r, buf).await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the upstream closed before answering",
                ));
            }
        };
        dw.write_all(&buf[..head.len]).await?;
        buf.drain(..head.len);
        if head.status == 101
            || (method.eq_ignore_ascii_case("CONNECT") && (200..300).contains(&head.status))
        {
            dw.flush().await?;
            return Ok(Outcome::Upgraded);
        }
        let interim = (100..200).contains(&head.status);
        let mut body = BodyCursor::new(head.body);
        while !body.done() {
            if buf.is_empty() && read_more(r, buf).await? == 0 {
                if body == BodyCursor::UntilClose {
                    dw.flush().await?;
                    return Ok(Outcome::Closed);
                }
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the upstream closed inside a response body",
                ));
            }
            let n = body.advance(buf).map_err(io_err)?;
            dw.write_all(&buf[..n]).await?;
            buf.drain(..n);
        }
        dw.flush().await?;
        if !interim {
            return Ok(Outcome::Next {
                upstream_closes: head.close,
            });
        }
    }
}

/// A connection that is not HTTP: to the application as it is.
async fn raw_to_app<S: AsyncRead + AsyncWrite + Unpin>(
    mut down: S,
    already: Vec<u8>,
    original_dst: SocketAddr,
    netns: &dyn AppDial,
) -> Result<(), ProxyError> {
    let mut up = netns.dial(original_dst).await.map_err(dial_failed)?;
    up.write_all(&already).await?;
    tokio::io::copy_bidirectional(&mut down, &mut up).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::HeaderMatch;

    /// `relay_response` over a canned upstream: what reaches the caller and the outcome.
    async fn relay(upstream: &[u8], method: &str) -> (Vec<u8>, Vec<u8>, &'static str) {
        relay_to(upstream, method, false).await
    }

    /// `relay` to a request that asked to upgrade (`upgrade`) or not.
    async fn relay_to(
        upstream: &[u8],
        method: &str,
        upgrade: bool,
    ) -> (Vec<u8>, Vec<u8>, &'static str) {
        let mut r = upstream;
        let mut buf = vec![];
        let mut out = vec![];
        let o = relay_response(&mut r, &mut buf, &mut out, method, upgrade).await;
        let o = match o {
            Ok(Outcome::Next {
                upstream_closes: false,
            }) => "next",
            Ok(Outcome::Next {
                upstream_closes: true,
            }) => "next, upstream closes",
            Ok(Outcome::Closed) => "closed",
            Ok(Outcome::Upgraded) => "upgraded",
            Err(_) => "error",
        };
        (out, buf, o)
    }

    #[tokio::test]
    async fn one_response_is_relayed_and_the_next_stays_for_the_next_request() {
        let two = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhiHTTP/1.1 204 No Content\r\n\r\n";
        let (out, rest, o) = relay(two, "GET").await;
        assert_eq!(out, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi");
        assert_eq!(o, "next");
        assert!(
            rest.is_empty() || rest.starts_with(b"HTTP/1.1 204"),
            "what was read past the response is kept: {rest:?}"
        );
        let chunked = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
        let (out, _, o) = relay(chunked, "POST").await;
        assert_eq!(out, chunked, "interim and final response, chunks and all");
        assert_eq!(o, "next");
        let (out, _, o) = relay(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", "GET").await;
        assert_eq!(out, b"HTTP/1.0 200 OK\r\n\r\nuntil the end");
        assert_eq!(o, "closed");
        let (_, _, o) = relay(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "GET").await;
        assert_eq!(o, "error", "a response cut short is an error");
        let switching = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n";
        let (_, _, o) = relay_to(switching, "GET", true).await;
        assert_eq!(o, "upgraded");
        let (out, _, o) = relay(switching, "GET").await;
        assert_eq!(
            (o, out.as_slice()),
            ("error", &b""[..]),
            "a 101 to a request that did not ask to upgrade is refused, not relayed"
        );
        let (_, _, o) = relay(
            b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
            "GET",
        )
        .await;
        assert_eq!(o, "next, upstream closes");
    }

    #[tokio::test]
    async fn a_request_body_is_sent_whole_and_the_next_request_stays() {
        let mut dbuf = b"hel".to_vec();
        let mut rest: &[u8] = b"loGET /next HTTP/1.1\r\n\r\n";
        let mut body = BodyCursor::new(http::Body::Length(5));
        let mut up = vec![];
        send_body(&mut rest, &mut dbuf, &mut body, &mut up)
            .await
            .unwrap();
        assert_eq!(up, b"hello");
        assert_eq!(dbuf, b"GET /next HTTP/1.1\r\n\r\n");
        let mut dbuf = b"2\r\nab".to_vec();
        let mut none: &[u8] = b"";
        let mut body = BodyCursor::new(http::Body::Chunked);
        assert!(
            send_body(&mut none, &mut dbuf, &mut body, &mut vec![])
                .await
                .is_err(),
            "the caller closed inside a body"
        );
    }

    struct PlainDial;
    impl AppDial for PlainDial {
        fn dial(
            &self,
            addr: SocketAddr,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = std::io::Result<TcpStream>> + Send + '_>,
        > {
            Box::pin(TcpStream::connect(addr))
        }
    }

    /// A keep-alive HTTP server on `s`: answers each request with `<who>:<request
    /// line>` (and the body's length), until the stream ends; `close_after` answers
    /// with `Connection: close` and ends after that many requests.
    async fn serve_http(mut s: impl Conn, who: &'static str, close_after: Option<usize>) {
        let mut buf = vec![];
        let mut served = 0;
        let none = Filter::default();
        loop {
            let head = loop {
                match http::parse_request(&buf, &none).unwrap() {
                    Some(h) => break h,
                    None => {
                        if read_more(&mut s, &mut buf).await.unwrap_or(0) == 0 {
                            return;
                        }
                    }
                }
            };
            let line =
                String::from_utf8_lossy(&buf[..buf.iter().position(|b| *b == b'\r').unwrap()])
                    .into_owned();
            buf.drain(..head.len);
            let mut body = BodyCursor::new(head.body);
            let mut got = 0;
            while !body.done() {
                if buf.is_empty() && read_more(&mut s, &mut buf).await.unwrap() == 0 {
                    return;
                }
                let n = body.advance(&buf).unwrap();
                got += n;
                buf.drain(..n);
            }
            served += 1;
            let last = close_after == Some(served);
            let text = format!("{who}:{line}:{got}");
            let conn = if last { "Connection: close\r\n" } else { "" };
            s.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\n{conn}Content-Length: {}\r\n\r\n{text}",
                    text.len()
                )
                .as_bytes(),
            )
            .await
            .unwrap();
            if last {
                return;
            }
        }
    }

    /// Reads `n` responses (Content-Length framed) from `s`: their bodies.
    async fn responses(s: &mut TcpStream, n: usize) -> Vec<String> {
        let mut buf = vec![];
        let mut out = vec![];
        while out.len() < n {
            let head = loop {
                if let Some(h) = http::parse_response(&buf, "GET", false).unwrap() {
                    break h;
                }
                assert!(
                    read_more(s, &mut buf).await.unwrap() > 0,
                    "closed after {out:?}"
                );
            };
            buf.drain(..head.len);
            let http::Body::Length(len) = head.body else {
                panic!("{head:?}")
            };
            while buf.len() < len as usize {
                assert!(read_more(s, &mut buf).await.unwrap() > 0);
            }
            out.push(String::from_utf8(buf.drain(..len as usize).collect()).unwrap());
        }
        out
    }

    /// The router end to end on loopback: an application, a client that takes the
    /// matching requests, and one keep-alive connection with pipelined requests.
    #[tokio::test]
    async fn matching_requests_of_one_keep_alive_connection_reach_the_client_and_the_rest_the_app()
    {
        let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app_addr = app.local_addr().unwrap();
        let app_conns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = app_conns.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = app.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(serve_http(s, "app", None));
            }
        });
        let port = Arc::new(Port::new(8080, 0));
        let filter = Filter {
            headers: vec![HeaderMatch {
                name: "X-Dev".into(),
                value: "me".into(),
            }],
        };
        port.start_intercept(Some(filter.clone())).unwrap();
        // The client: takes offered connections as the accept endpoint does.
        let p = port.clone();
        let client_conns = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = client_conns.clone();
        tokio::spawn(async move {
            loop {
                let Ok(rx) = p.add_waiter() else { return };
                let Ok(d) = rx.await else { return };
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(serve_http(d.stream, "client", None));
            }
        });
        let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front_addr = front.local_addr().unwrap();
        let mut caller = TcpStream::connect(front_addr).await.unwrap();
        let (down, peer) = front.accept().await.unwrap();
        let f = Arc::new(filter);
        let p = port.clone();
        let proxied = tokio::spawn(async move {
            proxy(
                &p,
                down,
                peer,
                app_addr,
                &PlainDial,
                Duration::from_secs(5),
                f,
            )
            .await
        });

        let matched = r#"podmotion_attach_filtered_requests_total{route="matched"}"#;
        let passed = r#"podmotion_attach_filtered_requests_total{route="passed"}"#;
        let before = (
            crate::metrics::value(matched),
            crate::metrics::value(passed),
        );
        // Pipelined: all written at once, in pieces that split heads and bodies.
        let reqs = b"GET /1 HTTP/1.1\r\nHost: x\r\nX-Dev: me\r\n\r\n\
POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello\
POST /3 HTTP/1.1\r\nHost: x\r\nx-dev: me\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n\
GET /4 HTTP/1.1\r\nHost: x\r\n\r\n\
GET /5 HTTP/1.1\r\nHost: x\r\nX-Dev: other\r\n\r\n";
        for piece in reqs.chunks(7) {
            caller.write_all(piece).await.unwrap();
        }
        let got = responses(&mut caller, 5).await;
        assert_eq!(
            got,
            [
                "client:GET /1 HTTP/1.1:0",
                "app:POST /2 HTTP/1.1:5",
                "client:POST /3 HTTP/1.1:13",
                "app:GET /4 HTTP/1.1:0",
                "app:GET /5 HTTP/1.1:0",
            ]
        );
        assert_eq!(
            client_conns.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one client stream per connection"
        );
        // Every routing decision is counted (other tests only ever add to these).
        assert!(crate::metrics::value(matched) - before.0 >= 2.0);
        assert!(crate::metrics::value(passed) - before.1 >= 3.0);
        assert_eq!(
            app_conns.load(std::sync::atomic::Ordering::SeqCst),
            1,
            "one application connection, kept alive across the requests"
        );

        // The intercept stops: the next request of the same connection goes to the app.
        port.stop_intercept().unwrap();
        caller
            .write_all(b"GET /6 HTTP/1.1\r\nX-Dev: me\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(responses(&mut caller, 1).await, ["app:GET /6 HTTP/1.1:0"]);
        // `Connection: close`: the response, then the end of the connection.
        caller
            .write_all(b"GET /7 HTTP/1.1\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(responses(&mut caller, 1).await, ["app:GET /7 HTTP/1.1:0"]);
        let mut rest = vec![];
        caller.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        let outcome = proxied.await.unwrap().unwrap();
        assert_eq!(outcome, Ended::Delivered, "a request went to the client");
    }

    /// A first request that is not HTTP passes the whole connection to the app.
    #[tokio::test]
    async fn a_connection_that_is_not_http_goes_to_the_app_unchanged() {
        let app = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app_addr = app.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = app.accept().await.unwrap();
            let mut b = [0u8; 64];
            let n = s.read(&mut b).await.unwrap();
            s.write_all(&b[..n]).await.unwrap();
        });
        let port = Arc::new(Port::new(8080, 0));
        let filter = Filter {
            headers: vec![HeaderMatch {
                name: "X-Dev".into(),
                value: "me".into(),
            }],
        };
        port.start_intercept(Some(filter.clone())).unwrap();
        let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut caller = TcpStream::connect(front.local_addr().unwrap())
            .await
            .unwrap();
        let (down, peer) = front.accept().await.unwrap();
        let p = port.clone();
        tokio::spawn(async move {
            proxy(
                &p,
                down,
                peer,
                app_addr,
                &PlainDial,
                Duration::from_secs(5),
                Arc::new(filter),
            )
            .await
        });
        caller.write_all(b"SSH-2.0-x\r\n").await.unwrap();
        let mut b = [0u8; 11];
        caller.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"SSH-2.0-x\r\n");
    }
}
