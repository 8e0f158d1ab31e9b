//! What the agents' TLS acceptor logs: a TCP probe (the kubelet's, every period on the
//! TLS port) connects and closes before any TLS byte, and must not log at info, or an
//! idle agent repeats one line every 10 s; a real handshake failure (a client
//! certificate of an unknown CA, a client speaking plain HTTP) is logged at info with
//! the peer. Real listener, real sockets; the acceptor's output is captured as JSON.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use podmotion_wire::client::{TlsFiles, tls_incoming};
use podmotion_wire::identity::{self, Peer, PeerVerifier};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};

fn ca(cn: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, uri: &str, dns: &str) -> (Vec<u8>, Vec<u8>) {
    let mut p = CertificateParams::new(vec![dns.to_string()]).unwrap();
    p.subject_alt_names
        .push(SanType::URI(uri.try_into().unwrap()));
    let k = KeyPair::generate().unwrap();
    let c = p.signed_by(&k, ca).unwrap();
    (c.pem().into_bytes(), k.serialize_pem().into_bytes())
}

/// The captured log: one JSON object per line.
#[derive(Clone, Default)]
struct Buf(Arc<Mutex<Vec<u8>>>);
impl std::io::Write for Buf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
impl Buf {
    /// The lines whose `peer` is `peer`.
    fn lines_of(&self, peer: SocketAddr) -> Vec<serde_json::Value> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect(l))
            .filter(|v| v["peer"] == peer.to_string())
            .collect()
    }
    /// Waits until the acceptor logged something about `peer` (it runs on its own
    /// task), then returns those lines.
    async fn wait_for(&self, peer: SocketAddr) -> Vec<serde_json::Value> {
        for _ in 0..500 {
            let lines = self.lines_of(peer);
            if !lines.is_empty() {
                // Anything else it logs about this peer comes in the same poll.
                tokio::time::sleep(Duration::from_millis(50)).await;
                return self.lines_of(peer);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the acceptor logged nothing about {peer}");
    }
}

fn levels(lines: &[serde_json::Value]) -> Vec<String> {
    lines
        .iter()
        .map(|v| format!("{} {}", v["level"], v["message"]))
        .collect()
}

/// A TLS client with `client`'s certificate, trusting `trust`: the handshake's
/// outcome as the client sees it, and its local address (the server's `peer`).
async fn dial(
    addr: SocketAddr,
    trust: &[u8],
    client: &(Vec<u8>, Vec<u8>),
) -> (SocketAddr, Result<(), String>) {
    let verifier = PeerVerifier::new(trust, Peer::Agent("n1".into()), false).unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&client.0)
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(&client.1).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(verifier))
    .with_client_auth_cert(chain, key)
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let me = tcp.local_addr().unwrap();
    let r = async {
        let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
            .connect(ServerName::try_from("podmotion-agent.n1").unwrap(), tcp)
            .await
            .map_err(|e| e.to_string())?;
        // TLS 1.3: a refused client certificate arrives as an alert on the first read.
        s.write_all(b"x").await.map_err(|e| e.to_string())?;
        let mut buf = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(0)) => Err("closed by the server".into()),
            _ => Ok(()),
        }
    }
    .await;
    (me, r)
}

// The default (current-thread) runtime: the acceptor's tasks run on this thread, under
// the subscriber set for it.
#[tokio::test]
async fn a_tcp_probe_logs_nothing_at_info_and_a_refused_handshake_does() {
    let buf = Buf::default();
    let out = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || buf.clone())
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let ours = ca("ours");
    let rogue = ca("rogue");
    let agent = leaf(&ours, &identity::agent_uri("n1"), "podmotion-agent.n1");
    let operator = leaf(&ours, identity::OPERATOR_URI, "unused");
    let impostor = leaf(&rogue, identity::OPERATOR_URI, "unused");
    let ours_pem = ours.pem().into_bytes();
    let tls = TlsFiles::from_pem(ours_pem.clone(), agent.0.clone(), agent.1.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut incoming = Box::pin(tls_incoming(listener, tls));
    let accepted = tokio::spawn(async move {
        let mut held = vec![];
        while let Some(Ok(s)) = incoming.next().await {
            held.push(s);
        }
    });

    // The kubelet's TCP probe: connect, then close (FIN) before any byte.
    let probe = tokio::net::TcpStream::connect(addr).await.unwrap();
    let peer = probe.local_addr().unwrap();
    drop(probe);
    let lines = out.wait_for(peer).await;
    println!("FIN probe: {:?}", levels(&lines));
    assert!(
        lines.iter().all(|v| v["level"] == "DEBUG"),
        "a TCP probe is not news: {lines:?}"
    );
    assert_eq!(lines[0]["message"], "connection closed before any TLS byte");

    // The same probe closing with a reset (SO_LINGER 0), as Go dialers may.
    let probe = tokio::net::TcpStream::connect(addr).await.unwrap();
    let peer = probe.local_addr().unwrap();
    probe.set_zero_linger().unwrap();
    drop(probe);
    let lines = out.wait_for(peer).await;
    println!("RST probe: {:?}", levels(&lines));
    assert!(
        lines.iter().all(|v| v["level"] == "DEBUG"),
        "a TCP probe is not news: {lines:?}"
    );

    // A client certificate of an unknown CA: refused, at info, with the peer.
    let (peer, r) = dial(addr, &ours_pem, &impostor).await;
    assert!(r.is_err(), "a certificate of an unknown CA got in");
    let lines = out.wait_for(peer).await;
    println!("unknown CA: {:?} {lines:?}", levels(&lines));
    assert!(
        lines
            .iter()
            .any(|v| v["level"] == "INFO" && v["message"] == "TLS handshake refused"),
        "a refused certificate must be logged at info: {lines:?}"
    );

    // Plain HTTP on the TLS port: the wrong protocol, at info.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    let peer = plain.local_addr().unwrap();
    plain
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let lines = out.wait_for(peer).await;
    println!("plain HTTP: {:?}", levels(&lines));
    assert!(
        lines
            .iter()
            .any(|v| v["level"] == "INFO" && v["message"] == "TLS handshake refused"),
        "plain HTTP on the TLS port must be logged at info: {lines:?}"
    );
    drop(plain);

    // And the acceptor still serves a good client afterwards, logging nothing on it.
    let (peer, r) = dial(addr, &ours_pem, &operator).await;
    r.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(out.lines_of(peer).is_empty(), "{:?}", out.lines_of(peer));
    accepted.abort();
}
