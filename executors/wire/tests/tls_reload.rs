//! The agents' TLS acceptor serves renewed material without a restart: each new
//! connection gets the certificate and CA bundle current when it arrives, and a client
//! certificate of a retired CA is accepted exactly while that CA is in the bundle.

use std::sync::Arc;

use futures::StreamExt;
use podmotion_wire::client::{TlsFiles, TlsMaterial, tls_incoming};
use podmotion_wire::identity::{self, Peer, PeerVerifier};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, SanType};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject};

fn ca(cn: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut p = CertificateParams::default();
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
}

/// (cert PEM, key PEM) of `uri`, signed by `ca`.
fn leaf(ca: &CertifiedIssuer<'static, KeyPair>, uri: &str, dns: &str) -> (Vec<u8>, Vec<u8>) {
    let mut p = CertificateParams::new(vec![dns.to_string()]).unwrap();
    p.subject_alt_names
        .push(SanType::URI(uri.try_into().unwrap()));
    let k = KeyPair::generate().unwrap();
    let c = p.signed_by(&k, ca).unwrap();
    (c.pem().into_bytes(), k.serialize_pem().into_bytes())
}

/// Connects as the operator (client certificate `client`, trusting `trust`) and
/// returns the server's certificate, or the handshake error.
async fn dial(
    addr: std::net::SocketAddr,
    trust: &[u8],
    client: &(Vec<u8>, Vec<u8>),
) -> Result<Vec<u8>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let verifier = PeerVerifier::new(trust, Peer::Agent("n1".into()), false).unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&client.0)
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(&client.1).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(verifier))
    .with_client_auth_cert(chain, key)
    .unwrap();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("podmotion-agent.n1").unwrap(), tcp)
        .await
        .map_err(|e| e.to_string())?;
    // TLS 1.3: the server checks the client certificate after the client finished; a
    // refusal arrives as an alert on the first read. An accepted connection stays open
    // and silent (nothing serves HTTP/2 on it here), so the read times out.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 1];
    match tokio::time::timeout(std::time::Duration::from_millis(500), s.read(&mut buf)).await {
        Ok(Err(e)) => return Err(e.to_string()),
        Ok(Ok(0)) => return Err("closed by the server".into()),
        _ => {}
    }
    let (_, conn) = s.get_ref();
    Ok(conn.peer_certificates().unwrap()[0].to_vec())
}

fn der(pem: &[u8]) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem).unwrap().to_vec()
}

fn material(ca: &[u8], leaf: &(Vec<u8>, Vec<u8>)) -> TlsMaterial {
    TlsMaterial {
        ca_pem: ca.to_vec(),
        cert_pem: leaf.0.clone(),
        key_pem: leaf.1.clone(),
    }
}

#[tokio::test]
async fn a_running_server_serves_renewed_certificates_and_bundles() {
    let old = ca("ca-old");
    let new = ca("ca-new");
    let agent_v1 = leaf(&old, &identity::agent_uri("n1"), "podmotion-agent.n1");
    let agent_v2 = leaf(&old, &identity::agent_uri("n1"), "podmotion-agent.n1");
    let operator_old = leaf(&old, identity::OPERATOR_URI, "unused");
    let old_pem = old.pem().into_bytes();
    let both = [new.pem().into_bytes(), old.pem().into_bytes()].concat();
    let tls = TlsFiles::from_pem(old_pem.clone(), agent_v1.0.clone(), agent_v1.1.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut incoming = Box::pin(tls_incoming(listener, tls.clone()));
    // Accepted connections are held open until the test ends.
    let accepted = tokio::spawn(async move {
        let mut held = vec![];
        while let Some(Ok(s)) = incoming.next().await {
            held.push(s);
        }
    });

    assert_eq!(
        dial(addr, &old_pem, &operator_old).await.unwrap(),
        der(&agent_v1.0)
    );

    // Renewed certificate: the next connection gets it, same process, same listener.
    let changed = tls.subscribe();
    assert!(tls.set(material(&old_pem, &agent_v2)).unwrap());
    assert!(changed.has_changed().unwrap());
    assert!(
        !tls.set(material(&old_pem, &agent_v2)).unwrap(),
        "same material"
    );
    assert_eq!(
        dial(addr, &old_pem, &operator_old).await.unwrap(),
        der(&agent_v2.0)
    );

    // CA rotation, overlap: the agent is re-issued by the new CA and trusts both; the
    // operator's certificate of the old CA still gets in.
    let agent_v3 = leaf(&new, &identity::agent_uri("n1"), "podmotion-agent.n1");
    tls.set(material(&both, &agent_v3)).unwrap();
    assert_eq!(
        dial(addr, &both, &operator_old).await.unwrap(),
        der(&agent_v3.0)
    );
    // A client that trusts only the old CA refuses the new certificate.
    assert!(dial(addr, &old_pem, &operator_old).await.is_err());

    // The old CA retired from the bundle: its client certificates are refused; the
    // operator's new one is accepted.
    tls.set(material(&new.pem().into_bytes(), &agent_v3))
        .unwrap();
    let refused = dial(addr, &both, &operator_old).await;
    assert!(
        refused.is_err(),
        "a retired CA's client certificate was accepted"
    );
    let operator_new = leaf(&new, identity::OPERATOR_URI, "unused");
    assert_eq!(
        dial(addr, &both, &operator_new).await.unwrap(),
        der(&agent_v3.0)
    );

    // Material that is not a usable identity is refused; the current one stays.
    assert!(tls.set(material(b"junk", &agent_v3)).is_err());
    assert_eq!(
        dial(addr, &both, &operator_new).await.unwrap(),
        der(&agent_v3.0)
    );
    accepted.abort();
}
