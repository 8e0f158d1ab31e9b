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

use std::time::Duration;

use kube::client::ClientBuilder;
use kube::client::retry::RetryPolicy;
use kube::{Client, Config};
use tower::buffer::BufferLayer;
use tower::retry::RetryLayer;

/// Retries of one request answered 429, 503 or 504.
pub const RETRIES: u32 = 4;
/// The longest wait before one retry (before jitter).
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// Requests waiting to be handed to the client stack.
const BUFFER: usize = 1024;

/// The client of the local kubeconfig or the in-cluster service account.
pub async fn infer() -> anyhow::Result<Client> {
    let config = Config::infer().await?;
    Ok(from_config(config)?)
}

/// The client for `config`, with the bounded retry in place of kube's.
pub fn from_config(mut config: Config) -> Result<Client, kube::Error> {
    config.default_retry = false;
    let policy = RetryPolicy::new(Duration::from_millis(100), MAX_DELAY, RETRIES, false)
        .expect("the retry delays are valid");
    // The retry clones the service it wraps: kube's stack is not `Clone`, a buffer in
    // front of it is (requests still run concurrently; the buffer only hands them on).
    Ok(ClientBuilder::try_from(config)?
        .with_layer(&BufferLayer::new(BUFFER))
        .with_layer(&RetryLayer::new(policy))
        .build())
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
        let client = from_config(Config::new(url.parse().unwrap())).unwrap();
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
    }

    #[tokio::test]
    async fn a_request_answered_409_is_not_retried() {
        let (url, count) = always("409 Conflict").await;
        let client = from_config(Config::new(url.parse().unwrap())).unwrap();
        let _ = Api::<ConfigMap>::namespaced(client, "default")
            .get("x")
            .await;
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }
}
