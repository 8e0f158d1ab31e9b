//! A client of one attach agent's control API (`docs/attach-executor.md`), reached as a
//! user reaches it: a port-forward through the API server (kube's websocket
//! Portforwarder, the user's kubeconfig and RBAC) to the *target pod* — the agent
//! serves its API on that pod's loopback — and the bearer token from the agent's
//! credential Secret beside it, in the attachment's namespace. A user needs no right
//! in the agents' namespace and can reach only the agents of namespaces whose pods they
//! may port-forward to and whose Secrets they may read. Every call opens its own
//! port-forward: a plain call is one HTTP/1.1
//! request with `Connection: close`; an accept stream is an HTTP upgrade that, once a
//! connection is intercepted, carries a JSON line and then that connection's bytes.

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::Api;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, DuplexStream};

/// The agent's control port on the target pod's loopback when its credential names
/// none (the operator's `--attachment-control-port` default, `render.rs`).
pub const DEFAULT_CONTROL_PORT: u16 = 15000;
/// The upgrade protocol of the agent's client streams.
pub const UPGRADE_PROTO: &str = "podmotion-stream";
/// Longest response head or JSON line the plugin reads from an agent.
const MAX_HEAD: usize = 64 * 1024;

/// One agent: the target pod whose loopback it serves on, and its credential.
#[derive(Clone)]
pub struct Agent {
    pub pods: Api<Pod>,
    /// The attachment's (the target pod's) namespace.
    pub namespace: String,
    /// The pod port-forwarded to: the target pod.
    pub pod: String,
    pub control_port: u16,
    pub token: String,
    /// The target pod (the workload's replica) and its node, for messages.
    pub target: String,
    pub node: String,
}

/// The bearer token and the control port of an agent's credential Secret (`token`:
/// hex text; `port`: decimal, the default when absent).
pub fn credential(secret: &Secret) -> anyhow::Result<(String, u16)> {
    let data = secret.data.as_ref();
    let text = |k: &str| {
        data.and_then(|d| d.get(k))
            .map(|b| String::from_utf8_lossy(&b.0).trim().to_string())
    };
    let token = text("token")
        .filter(|t| !t.is_empty())
        .context("it has no token")?;
    let port = match text("port") {
        None => DEFAULT_CONTROL_PORT,
        Some(p) => p
            .parse::<u16>()
            .ok()
            .filter(|p| *p != 0)
            .with_context(|| format!("its port {p:?} is not a port number"))?,
    };
    Ok((token, port))
}

/// The status code and `Content-Length` of an HTTP/1.1 response head (the bytes up to
/// and including the empty line), or why it is not one.
pub fn parse_response_head(head: &[u8]) -> Result<(u16, Option<usize>), String> {
    let text = std::str::from_utf8(head).map_err(|_| "a response head that is not UTF-8")?;
    let mut lines = text.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let code = status
        .strip_prefix("HTTP/1.1 ")
        .or_else(|| status.strip_prefix("HTTP/1.0 "))
        .and_then(|rest| rest.get(..3))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("not an HTTP response: {status:?}"))?;
    let mut length = None;
    for l in lines {
        if let Some((k, v)) = l.split_once(':')
            && k.trim().eq_ignore_ascii_case("content-length")
        {
            length = Some(
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("bad Content-Length {v:?}"))?,
            );
        }
    }
    Ok((code, length))
}

/// The request line and headers of a call to the agent.
pub fn request(method: &str, path: &str, token: &str, body: &str, upgrade: bool) -> String {
    let conn = if upgrade {
        format!("Connection: upgrade\r\nUpgrade: {UPGRADE_PROTO}\r\n")
    } else {
        "Connection: close\r\n".to_string()
    };
    let ctype = if body.is_empty() {
        ""
    } else {
        "Content-Type: application/json\r\n"
    };
    format!(
        "{method} {path} HTTP/1.1\r\nHost: podmotion-agent\r\nAuthorization: Bearer {token}\r\n{conn}{ctype}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Reads through the empty line that ends an HTTP head.
async fn read_head<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> anyhow::Result<Vec<u8>> {
    let mut head = Vec::new();
    loop {
        let n = r.read_until(b'\n', &mut head).await?;
        if n == 0 {
            bail!("the agent closed the connection before answering");
        }
        if head.ends_with(b"\r\n\r\n") || head == b"\r\n" {
            return Ok(head);
        }
        if head.len() > MAX_HEAD {
            bail!("the agent's answer has an oversized head");
        }
    }
}

/// The JSON line an accept stream starts with, once a connection is intercepted.
#[derive(Debug, serde::Deserialize)]
pub struct Intercepted {
    pub peer: String,
    pub original_dst: String,
}

impl Agent {
    /// A fresh port-forwarded stream to the agent's control port.
    async fn connect(&self) -> anyhow::Result<DuplexStream> {
        let mut pf = self
            .pods
            .portforward(&self.pod, &[self.control_port])
            .await
            .map_err(|e| {
                anyhow::anyhow!(crate::explain::kube_error(
                    crate::explain::Attempt {
                        verb: "create",
                        resource: "pods/portforward",
                        namespace: Some(&self.namespace),
                        name: Some(&self.pod),
                    },
                    &e
                ))
            })?;
        let stream = pf
            .take_stream(self.control_port)
            .context("the port-forward has no stream for the control port")?;
        // The forwarder's task ends when the stream is closed.
        tokio::spawn(async move {
            let _ = pf.join().await;
        });
        Ok(stream)
    }

    /// One request; the status code and the body.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: &str,
    ) -> anyhow::Result<(u16, String)> {
        let mut s = BufReader::new(self.connect().await?);
        s.write_all(request(method, path, &self.token, body, false).as_bytes())
            .await?;
        s.flush().await?;
        let head = read_head(&mut s).await?;
        let (code, length) = parse_response_head(&head).map_err(anyhow::Error::msg)?;
        let mut body = Vec::new();
        match length {
            Some(n) => {
                body.resize(n.min(MAX_HEAD * 16), 0);
                s.read_exact(&mut body).await?;
            }
            None => {
                s.take((MAX_HEAD * 16) as u64)
                    .read_to_end(&mut body)
                    .await?;
            }
        }
        Ok((code, String::from_utf8_lossy(&body).into_owned()))
    }

    /// Opens an upgraded stream on `path` (the agent answers 101, then the stream is
    /// the endpoint's).
    pub async fn upgrade(&self, path: &str) -> anyhow::Result<BufReader<DuplexStream>> {
        let mut s = BufReader::new(self.connect().await?);
        s.write_all(request("GET", path, &self.token, "", true).as_bytes())
            .await?;
        s.flush().await?;
        let head = read_head(&mut s).await?;
        let (code, length) = parse_response_head(&head).map_err(anyhow::Error::msg)?;
        if code != 101 {
            let mut body = vec![0; length.unwrap_or(0).min(MAX_HEAD)];
            let _ = s.read_exact(&mut body).await;
            bail!(
                "the agent refused the stream {path} ({code}): {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(s)
    }

    /// Opens an accept stream for `port` and waits until a connection is intercepted:
    /// its peer and original destination, and the stream carrying its bytes. `Ok(None)`
    /// when the agent closes the stream without a connection (intercept stopped).
    pub async fn accept(
        &self,
        port: u16,
    ) -> anyhow::Result<Option<(Intercepted, BufReader<DuplexStream>)>> {
        let mut s = self
            .upgrade(&format!("/v1/intercepts/{port}/accept"))
            .await?;
        let mut line = Vec::new();
        let n = (&mut s)
            .take(MAX_HEAD as u64)
            .read_until(b'\n', &mut line)
            .await?;
        if n == 0 {
            return Ok(None);
        }
        let meta: Intercepted = serde_json::from_slice(&line).with_context(|| {
            format!(
                "the agent's connection line {:?}",
                String::from_utf8_lossy(&line)
            )
        })?;
        Ok(Some((meta, s)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_heads_give_the_code_and_the_length() {
        assert_eq!(
            parse_response_head(b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 17\r\n\r\n"),
            Ok((201, Some(17)))
        );
        assert_eq!(
            parse_response_head(
                b"HTTP/1.1 101 Switching Protocols\r\nupgrade: podmotion-stream\r\n\r\n"
            ),
            Ok((101, None))
        );
        assert!(parse_response_head(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n").is_err());
    }

    #[test]
    fn requests_carry_the_token_and_their_framing() {
        let r = request("POST", "/v1/intercepts/8080", "t0k", "{}", false);
        assert!(
            r.starts_with("POST /v1/intercepts/8080 HTTP/1.1\r\n"),
            "{r}"
        );
        assert!(r.contains("\r\nAuthorization: Bearer t0k\r\n"), "{r}");
        assert!(r.contains("\r\nConnection: close\r\n"), "{r}");
        assert!(r.ends_with("Content-Length: 2\r\n\r\n{}"), "{r}");
        let u = request("GET", "/v1/intercepts/8080/accept", "t0k", "", true);
        assert!(u.contains("\r\nUpgrade: podmotion-stream\r\n"), "{u}");
        assert!(u.ends_with("Content-Length: 0\r\n\r\n"), "{u}");
    }

    #[test]
    fn a_credential_gives_the_token_and_the_loopback_port() {
        let secret = |pairs: &[(&str, &str)]| Secret {
            data: Some(
                pairs
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            k8s_openapi::ByteString(v.as_bytes().to_vec()),
                        )
                    })
                    .collect(),
            ),
            ..Default::default()
        };
        assert_eq!(
            credential(&secret(&[("token", "ab12\n"), ("port", "15123")])).unwrap(),
            ("ab12".to_string(), 15123)
        );
        assert_eq!(
            credential(&secret(&[("token", "ab12")])).unwrap(),
            ("ab12".to_string(), DEFAULT_CONTROL_PORT)
        );
        assert!(credential(&secret(&[("port", "15000")])).is_err());
        assert!(credential(&secret(&[("token", "ab12"), ("port", "0")])).is_err());
        assert!(credential(&secret(&[("token", "ab12"), ("port", "70000")])).is_err());
    }
}
