//! The testbed's certificates: a CA and the leaves of the identities the agents and
//! the operator present.

use podmotion_wire::client::TlsFiles;
use std::path::Path;

/// The agents' DNS names (each agent's certificate carries its own).
pub const AGENT_NAMES: [&str; 2] = ["agent-a", "agent-b"];

pub struct Tls {
    pub ca_pem: Vec<u8>,
    pub agents: [TlsFiles; 2],
    pub operator: TlsFiles,
    /// The node each agent's certificate identifies (`spiffe://podmotion.io/agent/<node>`).
    pub nodes: [String; 2],
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl Tls {
    /// A leaf certificate of the testbed's CA with these DNS SANs, identity URI SAN
    /// and CN, also written to `<dir>/<file>.crt|.key`.
    pub fn issue(&self, dir: &Path, file: &str, dns: &[String], uri: &str, cn: &str) -> TlsFiles {
        use rcgen::{CertificateParams, DnType, KeyPair, SanType};
        let k = KeyPair::generate().expect("key");
        let mut p = CertificateParams::new(dns.to_vec()).expect("params");
        p.distinguished_name.push(DnType::CommonName, cn);
        if !uri.is_empty() {
            p.subject_alt_names
                .push(SanType::URI(uri.try_into().expect("uri")));
        }
        let c = p.signed_by(&k, &self.ca).expect("sign");
        let (cert_pem, key_pem) = (c.pem().into_bytes(), k.serialize_pem().into_bytes());
        std::fs::write(dir.join(format!("{file}.crt")), &cert_pem).expect("write");
        std::fs::write(dir.join(format!("{file}.key")), &key_pem).expect("write");
        TlsFiles::from_pem(self.ca_pem.clone(), cert_pem, key_pem)
    }
}

/// A CA and leaf certificates in the identity format of `podmotion_wire::identity`:
/// agent `i` is `agent/<nodes[i]>` with DNS SANs `AGENT_NAMES[i]` plus `extra_sans[i]`;
/// the operator is `operator`.
pub(super) fn make_tls(dir: &Path, nodes: [String; 2], extra_sans: &[Vec<String>; 2]) -> Tls {
    use podmotion_wire::identity::{OPERATOR_CN, OPERATOR_URI, agent_cn, agent_uri};
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = CertifiedIssuer::self_signed(p, KeyPair::generate().expect("key")).expect("ca");
    let ca_pem = ca.pem().into_bytes();
    std::fs::write(dir.join("ca.crt"), &ca_pem).expect("write");
    let mut tls = Tls {
        agents: [
            TlsFiles::from_pem(vec![], vec![], vec![]),
            TlsFiles::from_pem(vec![], vec![], vec![]),
        ],
        operator: TlsFiles::from_pem(vec![], vec![], vec![]),
        nodes,
        ca,
        ca_pem,
    };
    for i in 0..2 {
        let dns: Vec<String> = std::iter::once(AGENT_NAMES[i].to_owned())
            .chain(extra_sans[i].iter().cloned())
            .collect();
        let node = tls.nodes[i].clone();
        tls.agents[i] = tls.issue(
            dir,
            AGENT_NAMES[i],
            &dns,
            &agent_uri(&node),
            &agent_cn(&node),
        );
    }
    tls.operator = tls.issue(
        dir,
        "operator",
        &["operator".into()],
        OPERATOR_URI,
        OPERATOR_CN,
    );
    tls
}
