//! Who is on the other end of an agent connection, read from its certificate.
//!
//! Every party of the migration wire has its own certificate, all signed by the
//! agents' CA, and its identity is one URI SAN in PodMotion's trust domain:
//!
//! | party                 | URI SAN                              | CN                     |
//! |-----------------------|--------------------------------------|------------------------|
//! | the operator (client) | `spiffe://podmotion.io/operator`     | `podmotion-operator`   |
//! | node agent of node N  | `spiffe://podmotion.io/agent/<N>`    | `podmotion-agent:<N>`  |
//!
//! An agent's certificate is its server certificate and, when it streams images to
//! another agent, its client certificate. mTLS only proves that a peer holds *a*
//! CA-signed key; what that peer may do is decided from this identity
//! (`podmotion_agent::authz`). The CN is informative: only the URI SAN is trusted.
//!
//! Before per-node certificates existed, the chart issued one server certificate
//! shared by every agent (CN `podmotion-agent`) and an operator certificate
//! (CN `podmotion-operator`), neither with a URI SAN. They are recognised only when the
//! caller asks for it (`legacy`), as [`Peer::SharedAgent`] and [`Peer::Operator`].
//!
//! [`PeerVerifier`] is the client side: a TLS server verifier that accepts the server
//! only if its certificate chains to the CA *and* carries the expected identity,
//! whatever DNS name was dialled.

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

// The names the operator's PKI issues and this module reads are shared with the API
// types, so the operator's pure core names them without depending on the wire.
pub use podmotion_api::names::identity::{
    LEGACY_AGENT_CN, OPERATOR_CN, OPERATOR_URI, TRUST_DOMAIN, agent_cn, agent_uri, valid_node_name,
};

/// A party of the migration wire.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Peer {
    /// The operator: the only party that commands agents.
    Operator,
    /// The agent of the node named here.
    Agent(String),
    /// The legacy certificate shared by all agents: which node it is cannot be told.
    SharedAgent,
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Operator => f.write_str(OPERATOR_URI),
            Peer::Agent(n) => f.write_str(&agent_uri(n)),
            Peer::SharedAgent => write!(f, "the shared agent certificate (CN {LEGACY_AGENT_CN})"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("no client certificate")]
    NoCertificate,
    #[error("certificate cannot be parsed: {0}")]
    Unparsable(String),
    #[error("certificate carries no PodMotion identity (URI SAN under {TRUST_DOMAIN})")]
    NoIdentity,
    #[error("certificate carries more than one PodMotion identity")]
    Ambiguous,
    #[error("{0:?} is not a PodMotion identity")]
    Unknown(String),
    #[error("{0:?} is not a valid node name")]
    BadNode(String),
}

/// The party an identity URI names.
pub fn from_uri(uri: &str) -> Result<Peer, IdentityError> {
    if uri == OPERATOR_URI {
        return Ok(Peer::Operator);
    }
    match uri
        .strip_prefix(TRUST_DOMAIN)
        .and_then(|r| r.strip_prefix("agent/"))
    {
        Some(node) if valid_node_name(node) => Ok(Peer::Agent(node.to_owned())),
        Some(node) => Err(IdentityError::BadNode(node.to_owned())),
        None => Err(IdentityError::Unknown(uri.to_owned())),
    }
}

/// The party a DER certificate identifies. URI SANs outside PodMotion's trust domain
/// are ignored; exactly one inside it must name a party. With `legacy`, a certificate
/// without any such URI SAN is recognised by its CN as the chart's shared agent
/// certificate or the operator's.
pub fn from_der(der: &[u8], legacy: bool) -> Result<Peer, IdentityError> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    let sans = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    let ours: Vec<&str> = sans
        .iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|n| match n {
            GeneralName::URI(u) if u.starts_with(TRUST_DOMAIN) => Some(*u),
            _ => None,
        })
        .collect();
    match ours.as_slice() {
        [one] => from_uri(one),
        [] if legacy => {
            let cn = cert
                .subject()
                .iter_common_name()
                .next()
                .and_then(|c| c.as_str().ok());
            match cn {
                Some(OPERATOR_CN) => Ok(Peer::Operator),
                Some(LEGACY_AGENT_CN) => Ok(Peer::SharedAgent),
                _ => Err(IdentityError::NoIdentity),
            }
        }
        [] => Err(IdentityError::NoIdentity),
        _ => Err(IdentityError::Ambiguous),
    }
}

/// The party the first certificate of a PEM bundle identifies (an agent's own
/// certificate file).
pub fn from_pem(pem: &[u8], legacy: bool) -> Result<Peer, IdentityError> {
    let (_, p) = x509_parser::pem::parse_x509_pem(pem)
        .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
    from_der(&p.contents, legacy)
}

/// The party of a TLS peer's certificate chain (its first certificate).
pub fn from_chain(
    chain: Option<&[CertificateDer<'_>]>,
    legacy: bool,
) -> Result<Peer, IdentityError> {
    let leaf = chain
        .and_then(|c| c.first())
        .ok_or(IdentityError::NoCertificate)?;
    from_der(leaf.as_ref(), legacy)
}

/// TLS server verification by identity: the server's certificate must chain to the
/// CA and identify `expected` (with `legacy`, the shared agent certificate also
/// passes for any agent). The DNS name dialled is not what is trusted.
#[derive(Debug)]
pub struct PeerVerifier {
    roots: Arc<RootCertStore>,
    expected: Peer,
    legacy: bool,
    provider: Arc<CryptoProvider>,
}

impl PeerVerifier {
    pub fn new(ca_pem: &[u8], expected: Peer, legacy: bool) -> Result<Self, IdentityError> {
        let mut roots = RootCertStore::empty();
        let mut rest = ca_pem;
        while let Ok((r, p)) = x509_parser::pem::parse_x509_pem(rest) {
            roots
                .add(CertificateDer::from(p.contents))
                .map_err(|e| IdentityError::Unparsable(e.to_string()))?;
            rest = r;
        }
        if roots.is_empty() {
            return Err(IdentityError::Unparsable("no CA certificate".into()));
        }
        Ok(Self {
            roots: Arc::new(roots),
            expected,
            legacy,
            provider: Arc::new(rustls::crypto::ring::default_provider()),
        })
    }

    fn accepts(&self, got: &Peer) -> bool {
        *got == self.expected
            || (self.legacy && *got == Peer::SharedAgent && matches!(self.expected, Peer::Agent(_)))
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        let got = from_der(end_entity.as_ref(), self.legacy)
            .map_err(|e| rustls::Error::General(format!("server identity: {e}")))?;
        if !self.accepts(&got) {
            return Err(rustls::Error::General(format!(
                "server is {got}, expected {}",
                self.expected
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_uris_name_the_operator_and_node_agents_only() {
        assert_eq!(from_uri(OPERATOR_URI), Ok(Peer::Operator));
        assert_eq!(
            from_uri(&agent_uri("pm-real-0")),
            Ok(Peer::Agent("pm-real-0".into()))
        );
        assert_eq!(
            from_uri("spiffe://podmotion.io/agent/node.example.com"),
            Ok(Peer::Agent("node.example.com".into()))
        );
        for bad in [
            "spiffe://podmotion.io/agent/",
            "spiffe://podmotion.io/agent/Node",
            "spiffe://podmotion.io/agent/a/b",
            "spiffe://podmotion.io/agent/-a",
            "spiffe://podmotion.io/agent/a..b",
        ] {
            assert!(
                matches!(from_uri(bad), Err(IdentityError::BadNode(_))),
                "{bad}"
            );
        }
        for bad in [
            "spiffe://podmotion.io/operator/x",
            "spiffe://podmotion.io/broker",
            "spiffe://other.io/operator",
            "",
        ] {
            assert!(
                matches!(from_uri(bad), Err(IdentityError::Unknown(_))),
                "{bad}"
            );
        }
    }

    /// A DER certificate with these URI SANs, this CN and a DNS SAN.
    fn cert(uris: &[&str], cn: &str) -> Vec<u8> {
        use rcgen::{CertificateParams, DnType, KeyPair, SanType};
        let mut p = CertificateParams::new(vec!["podmotion-agent.n1".to_string()]).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        for u in uris {
            p.subject_alt_names
                .push(SanType::URI((*u).try_into().unwrap()));
        }
        let k = KeyPair::generate().unwrap();
        p.self_signed(&k).unwrap().der().to_vec()
    }

    #[test]
    fn certificates_are_read_by_their_podmotion_uri_san() {
        let op = cert(&[OPERATOR_URI], OPERATOR_CN);
        assert_eq!(from_der(&op, false), Ok(Peer::Operator));
        let a = cert(
            &["https://example.com/x", &agent_uri("n1")],
            &agent_cn("n1"),
        );
        assert_eq!(from_der(&a, false), Ok(Peer::Agent("n1".into())));
        // The CN is not trusted: an agent cert with the operator's CN is still the agent.
        let a = cert(&[&agent_uri("n1")], OPERATOR_CN);
        assert_eq!(from_der(&a, true), Ok(Peer::Agent("n1".into())));
        let two = cert(&[OPERATOR_URI, &agent_uri("n1")], OPERATOR_CN);
        assert_eq!(from_der(&two, true), Err(IdentityError::Ambiguous));
        let foreign = cert(&["spiffe://podmotion.io/agent/Bad"], "x");
        assert!(matches!(
            from_der(&foreign, true),
            Err(IdentityError::BadNode(_))
        ));
        assert!(matches!(
            from_der(b"junk", true),
            Err(IdentityError::Unparsable(_))
        ));
    }

    #[test]
    fn the_chart_s_shared_certificates_are_recognised_only_in_legacy_mode() {
        let shared = cert(&[], LEGACY_AGENT_CN);
        let op = cert(&[], OPERATOR_CN);
        let other = cert(&["https://example.com/agent"], "someone");
        assert_eq!(from_der(&shared, false), Err(IdentityError::NoIdentity));
        assert_eq!(from_der(&op, false), Err(IdentityError::NoIdentity));
        assert_eq!(from_der(&shared, true), Ok(Peer::SharedAgent));
        assert_eq!(from_der(&op, true), Ok(Peer::Operator));
        assert_eq!(from_der(&other, true), Err(IdentityError::NoIdentity));
    }

    #[test]
    fn no_chain_is_no_identity() {
        assert_eq!(from_chain(None, true), Err(IdentityError::NoCertificate));
        assert_eq!(
            from_chain(Some(&[]), true),
            Err(IdentityError::NoCertificate)
        );
    }
}
