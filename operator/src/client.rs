//! The operator's API client: kube's, with a bounded retry of transient answers.
//!
//! kube's client retries 429, 503 and 504 by itself, up to 15 times with delays that
//! double from 5 ms up to a 1000 s cap. After an API server outage of some seconds
//! behind a proxy or load balancer (which answers 503 meanwhile), a request — a watch's
//! too — can go on sleeping inside the client for about as long again once the server
//! is back: its reconcile holds the object, and the controller's cache stays as it
//! was. Here a request is retried at most [`RETRIES`] times, after 100 ms up to
//! [`MAX_DELAY`] (jittered), and a `Retry-After` is not followed past that; then the
//! error reaches the controller, whose error policy tries again with a fresh read, or
//! the watcher, which lists again.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::{Method, Request, Response};
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ClientBuilder};
use kube::{Client, Config};
use tower::buffer::BufferLayer;
use tower::retry::RetryLayer;
use tower::{Layer, Service};

use crate::metrics::ApiRequestLabels;
pub use crate::metrics::ApiRequests;

/// Retries of one request answered 429, 503 or 504.
pub const RETRIES: u32 = 4;
/// The longest wait before one retry (before jitter).
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// Requests waiting to be handed to the client stack.
const BUFFER: usize = 1024;

/// The client of the local kubeconfig or the in-cluster service account, counting its
/// requests in `requests`.
pub async fn infer(requests: ApiRequests) -> anyhow::Result<Client> {
    let config = Config::infer().await?;
    Ok(from_config(config, requests)?)
}

/// The client for `config`, with the bounded retry in place of kube's, counting every
/// request it sends (each retry too) in `requests`.
pub fn from_config(mut config: Config, requests: ApiRequests) -> Result<Client, kube::Error> {
    config.default_retry = false;
    let policy = RetryPolicy::new(Duration::from_millis(100), MAX_DELAY, RETRIES, false)
        .expect("the retry delays are valid");
    // The retry clones the service it wraps: kube's stack is not `Clone`, a buffer in
    // front of it is (requests still run concurrently; the buffer only hands them on).
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&CountLayer(requests))
        .with_layer(&BufferLayer::new(BUFFER))
        .with_layer(&RetryLayer::new(policy))
        .build())
}

/// Counts each request under its verb and resource, by the status of its answer (0:
/// no answer).
#[derive(Clone)]
struct CountLayer(ApiRequests);

impl<S> Layer<S> for CountLayer {
    type Service = Count<S>;
    fn layer(&self, inner: S) -> Count<S> {
        Count {
            inner,
            requests: self.0.clone(),
        }
    }
}

struct Count<S> {
    inner: S,
    requests: ApiRequests,
}

impl<S, B> Service<Request<Body>> for Count<S>
where
    S: Service<Request<Body>, Response = Response<B>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    B: 'static,
{
    type Response = Response<B>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<B>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (verb, resource, subresource) =
            classify(req.method(), req.uri().path(), req.uri().query());
        let requests = self.requests.clone();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let res = answer.await;
            let code = res.as_ref().map_or(0, |r| r.status().as_u16());
            requests
                .get_or_create(&ApiRequestLabels {
                    verb,
                    resource,
                    subresource,
                    code,
                })
                .inc();
            res
        })
    }
}

/// The resources the operator reads or writes; any other is counted as `other` (a
/// label never carries free text).
const RESOURCES: [&str; 28] = [
    "pods",
    "jobs",
    "secrets",
    "leases",
    "events",
    "networkpolicies",
    "daemonsets",
    "deployments",
    "replicasets",
    "statefulsets",
    "podmigrations",
    "nodeagentattachments",
    "runnerpools",
    "nodes",
    "namespaces",
    "serviceaccounts",
    "configmaps",
    "services",
    "endpointslices",
    "customresourcedefinitions",
    "validatingwebhookconfigurations",
    "mutatingwebhookconfigurations",
    "certificatesigningrequests",
    "tokenreviews",
    "subjectaccessreviews",
    "selfsubjectaccessreviews",
    "poddisruptionbudgets",
    "controllerrevisions",
];

/// The subresources counted by name; any other is `other`.
const SUBRESOURCES: [&str; 5] = ["status", "exec", "eviction", "log", "scale"];

/// A request's verb (Kubernetes' words: `get`, `list`, `watch`, `create`, `update`,
/// `patch`, `delete`, `deletecollection`), resource and subresource (`""`: none), from
/// its method and URL (`/api/v1/…` or `/apis/<group>/<version>/…`).
fn classify(
    method: &Method,
    path: &str,
    query: Option<&str>,
) -> (&'static str, &'static str, &'static str) {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segs.first() {
        Some(&"api") => segs.get(2..),
        Some(&"apis") => segs.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    // [namespaces, ns, resource, name, sub] or [resource, name, sub]; a namespace
    // itself is [namespaces, name, sub].
    let rest = match rest {
        ["namespaces", _, more @ ..] if !more.is_empty() => more,
        _ => rest,
    };
    let known = |s: Option<&&str>, list: &[&'static str]| match s {
        None => "",
        Some(s) => list.iter().find(|k| *k == s).copied().unwrap_or("other"),
    };
    let resource = match rest.first() {
        None => "other",
        r => known(r, &RESOURCES),
    };
    let named = rest.len() > 1;
    let subresource = known(rest.get(2), &SUBRESOURCES);
    let watch = query.is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match *method {
        Method::GET if watch => "watch",
        Method::GET if named => "get",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if named => "delete",
        Method::DELETE => "deletecollection",
        _ => "other",
    };
    (verb, resource, subresource)
}

/// `Api<K>` in namespace `ns`, or across all namespaces when `ns` is `None` (a
/// controller's watch namespace).
pub fn scoped<K>(client: &Client, ns: Option<&str>) -> kube::Api<K>
where
    K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::Api;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A server that answers every request with `status`, counting the requests.
    async fn always(status: &'static str) -> (String, Arc<AtomicU32>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let count = Arc::new(AtomicU32::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    seen.fetch_add(1, Ordering::SeqCst);
                    let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"unavailable","reason":"ServiceUnavailable","code":503}"#;
                    let reply = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nRetry-After: 3600\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(reply.as_bytes()).await;
                });
            }
        });
        (url, count)
    }

    #[tokio::test]
    async fn a_request_answered_503_is_retried_a_bounded_number_of_times() {
        let (url, count) = always("503 Service Unavailable").await;
        let requests = ApiRequests::default();
        let client = from_config(Config::new(url.parse().unwrap()), requests.clone()).unwrap();
        let err = Api::<ConfigMap>::namespaced(client, "default")
            .get("x")
            .await
            .expect_err("every answer is 503");
        assert!(
            matches!(&err, kube::Error::Api(s) if s.code == 503),
            "the last answer reaches the caller: {err:?}"
        );
        // The first attempt and RETRIES more (kube's own policy makes 16), and the
        // Retry-After of an hour was not followed.
        assert_eq!(count.load(Ordering::SeqCst), 1 + RETRIES);
        // Each attempt is counted, under its verb, resource and answer.
        let counted = requests
            .get_or_create(&ApiRequestLabels {
                verb: "get",
                resource: "configmaps",
                subresource: "",
                code: 503,
            })
            .get();
        assert_eq!(counted, u64::from(1 + RETRIES));
    }

    #[tokio::test]
    async fn a_request_answered_409_is_not_retried() {
        let (url, count) = always("409 Conflict").await;
        let client =
            from_config(Config::new(url.parse().unwrap()), ApiRequests::default()).unwrap();
        let _ = Api::<ConfigMap>::namespaced(client, "default")
            .get("x")
            .await;
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn requests_are_counted_by_kubernetes_verb_resource_and_subresource() {
        let c = |m: Method, path: &str, q: Option<&str>| classify(&m, path, q);
        let ns = "/api/v1/namespaces/team-a";
        assert_eq!(
            c(Method::GET, &format!("{ns}/pods/p1"), None),
            ("get", "pods", "")
        );
        assert_eq!(
            c(Method::GET, &format!("{ns}/pods"), Some("limit=100")),
            ("list", "pods", "")
        );
        assert_eq!(
            c(
                Method::GET,
                "/api/v1/pods",
                Some("watch=true&resourceVersion=5")
            ),
            ("watch", "pods", "")
        );
        assert_eq!(
            c(
                Method::PATCH,
                "/apis/podmotion.io/v1alpha1/namespaces/a/podmigrations/m/status",
                None
            ),
            ("patch", "podmigrations", "status")
        );
        assert_eq!(
            c(Method::POST, "/apis/batch/v1/namespaces/a/jobs", None),
            ("create", "jobs", "")
        );
        assert_eq!(
            c(
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/a/leases/l",
                None
            ),
            ("update", "leases", "")
        );
        assert_eq!(
            c(Method::DELETE, "/api/v1/namespaces/a/secrets/s", None),
            ("delete", "secrets", "")
        );
        assert_eq!(
            c(Method::DELETE, "/api/v1/namespaces/a/secrets", None),
            ("deletecollection", "secrets", "")
        );
        assert_eq!(
            c(Method::POST, &format!("{ns}/pods/p1/exec"), None),
            ("create", "pods", "exec")
        );
        // A namespace itself, cluster-scoped kinds, and what is not known.
        assert_eq!(
            c(Method::GET, "/api/v1/namespaces/team-a", None),
            ("get", "namespaces", "")
        );
        assert_eq!(
            c(Method::GET, "/api/v1/namespaces", None),
            ("list", "namespaces", "")
        );
        assert_eq!(
            c(Method::GET, "/api/v1/nodes/n1", None),
            ("get", "nodes", "")
        );
        assert_eq!(
            c(
                Method::GET,
                "/apis/example.com/v1/namespaces/a/widgets/w/shine",
                None
            ),
            ("get", "other", "other")
        );
        assert_eq!(c(Method::GET, "/version", None), ("list", "other", ""));
    }
}
