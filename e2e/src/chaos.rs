//! The chaos run (`src/bin/chaos.rs`, which drives [`scenario`]'s steps in order): a
//! fault-injecting proxy in front of the API server and a small seeded random source
//! (here), the run's options, objects, replicas, churn, live migrations, invariants,
//! convergence, teardown and summary (the modules below).
//!
//! The proxy listens on loopback (plain HTTP) and forwards every request through a
//! [`kube::Client`] built from the admin kubeconfig, so TLS and the client certificate
//! are the client's and responses — watches included — stream back unbuffered. A
//! configurable share of writes (POST, PUT, PATCH, DELETE) is answered by the proxy itself
//! with `409 Conflict` or `429 Too Many Requests` (`Retry-After: 1`) and never reaches the
//! API server. Writes to `coordination.k8s.io` Leases are never faulted: a 409 on its own
//! Lease makes a leader exit by design, which the run covers by killing leaders instead.

// As the binary it serves (`src/bin/chaos.rs`).
#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use http_body_util::{BodyExt, Full, combinators::UnsyncBoxBody};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

mod churn;
mod converge;
mod invariants;
mod live;
pub mod opts;
mod replicas;
pub mod scenario;
mod setup;
mod state;
pub mod summary;
mod teardown;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// What the proxy does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    Forward,
    Conflict,
    Throttle,
}

/// Whether a request may be faulted: a write, and not to a Lease.
pub fn faultable(method: &Method, path: &str) -> bool {
    let write = matches!(
        *method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    write && !path.starts_with("/apis/coordination.k8s.io/")
}

/// The decision for a request given a uniform `roll` in `0..1000` and the share of
/// faulted writes in per mille: the first half of the share answers 409, the second 429.
pub fn decide(method: &Method, path: &str, roll: u32, share_per_mille: u32) -> Decision {
    if !faultable(method, path) || roll >= share_per_mille {
        Decision::Forward
    } else if roll < share_per_mille / 2 {
        Decision::Conflict
    } else {
        Decision::Throttle
    }
}

/// A xorshift64* generator: reproducible from its seed, no dependency.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Counters and the live fault share of a running proxy.
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Writes answered 409 by the proxy.
    pub conflicts: AtomicU64,
    /// Writes answered 429 by the proxy.
    pub throttles: AtomicU64,
    /// Writes forwarded to the API server.
    pub writes_forwarded: AtomicU64,
    /// Reads and watches forwarded.
    pub reads_forwarded: AtomicU64,
    /// Requests the API server could not be reached for (answered 503).
    pub upstream_errors: AtomicU64,
    /// Share of faulted writes, per mille; set to 0 to stop injecting.
    pub share_per_mille: AtomicU32,
    rng: std::sync::Mutex<Option<Rng>>,
}

impl ProxyStats {
    fn roll(&self) -> u32 {
        let mut g = self.rng.lock().expect("rng lock");
        let rng = g.get_or_insert_with(|| Rng::new(0x5eed));
        (rng.next_u64() % 1000) as u32
    }
}

/// Starts the proxy on `127.0.0.1:0`, forwarding through `upstream`. Returns its address
/// and its counters (the share of faulted writes starts at `share_per_mille`).
pub async fn start_proxy(
    upstream: kube::Client,
    share_per_mille: u32,
    seed: u64,
) -> anyhow::Result<(SocketAddr, Arc<ProxyStats>)> {
    anyhow::ensure!(
        share_per_mille <= 1000,
        "the share of faulted writes is per mille: 0..=1000, not {share_per_mille}"
    );
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stats = Arc::new(ProxyStats {
        share_per_mille: AtomicU32::new(share_per_mille),
        rng: std::sync::Mutex::new(Some(Rng::new(seed))),
        ..Default::default()
    });
    let st = stats.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let client = upstream.clone();
            let st = st.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let client = client.clone();
                    let st = st.clone();
                    async move { Ok::<_, Infallible>(handle(client, &st, req).await) }
                });
                // Errors here are clients going away mid-watch: nothing to do.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok((addr, stats))
}

fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed_unsync()
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    r
}

async fn handle(
    client: kube::Client,
    st: &ProxyStats,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let path = req.uri().path().to_string();
    let share = st.share_per_mille.load(Ordering::Relaxed);
    if let Some(injected) = inject(st, decide(req.method(), &path, st.roll(), share)) {
        return injected;
    }
    forward(client, st, req).await
}

/// The proxy's own answer to a faulted write (counted), or `None` to forward it.
fn inject(st: &ProxyStats, decision: Decision) -> Option<Response<ProxyBody>> {
    match decision {
        Decision::Conflict => {
            st.conflicts.fetch_add(1, Ordering::Relaxed);
            Some(status(
                StatusCode::CONFLICT,
                "Conflict",
                "chaos: injected conflict, the object has been modified; please apply your changes to the latest version and try again",
            ))
        }
        Decision::Throttle => {
            st.throttles.fetch_add(1, Ordering::Relaxed);
            let mut r = status(
                StatusCode::TOO_MANY_REQUESTS,
                "TooManyRequests",
                "chaos: injected throttling, please try again later",
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            Some(r)
        }
        Decision::Forward => None,
    }
}

/// Forwards `req` to the API server through `client` (counted as a read or a write)
/// and streams its answer back; 503 if the API server cannot be reached.
async fn forward(
    client: kube::Client,
    st: &ProxyStats,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    if *req.method() != Method::GET {
        st.writes_forwarded.fetch_add(1, Ordering::Relaxed);
    } else {
        st.reads_forwarded.fetch_add(1, Ordering::Relaxed);
    }
    let (mut parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &format!("{e}")),
    };
    for h in [
        header::HOST,
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::CONTENT_LENGTH,
        header::AUTHORIZATION,
    ] {
        parts.headers.remove(h);
    }
    parts.uri = parts
        .uri
        .path_and_query()
        .map(|pq| pq.as_str())
        .unwrap_or("/")
        .parse()
        .expect("a path and query is a URI");
    let up = Request::from_parts(parts, kube::client::Body::from(body.to_vec()));
    match client.send(up).await {
        Ok(resp) => resp.map(|b| b.map_err(|e| Box::new(e) as BoxError).boxed_unsync()),
        Err(e) => {
            st.upstream_errors.fetch_add(1, Ordering::Relaxed);
            status(
                StatusCode::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                &format!("chaos proxy: API server unreachable: {e}"),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_writes_other_than_leases_are_faulted() {
        let pod = "/api/v1/namespaces/a/pods/p";
        let lease = "/apis/coordination.k8s.io/v1/namespaces/a/leases/l";
        assert_eq!(decide(&Method::GET, pod, 0, 1000), Decision::Forward);
        assert_eq!(decide(&Method::PATCH, lease, 0, 1000), Decision::Forward);
        assert_eq!(decide(&Method::PATCH, pod, 0, 1000), Decision::Conflict);
        assert_eq!(decide(&Method::DELETE, pod, 999, 1000), Decision::Throttle);
        assert_eq!(decide(&Method::POST, pod, 200, 200), Decision::Forward);
        assert_eq!(decide(&Method::PUT, pod, 99, 200), Decision::Conflict);
        assert_eq!(decide(&Method::PUT, pod, 100, 200), Decision::Throttle);
        assert_eq!(decide(&Method::POST, pod, 0, 0), Decision::Forward);
    }

    #[test]
    fn rng_range_is_inclusive_and_reproducible() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let xs: Vec<u64> = (0..1000).map(|_| a.range(3, 5)).collect();
        assert!(xs.iter().all(|x| (3..=5).contains(x)));
        assert!(xs.contains(&3) && xs.contains(&5));
        assert_eq!(xs, (0..1000).map(|_| b.range(3, 5)).collect::<Vec<_>>());
    }
}
