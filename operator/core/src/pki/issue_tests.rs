use super::*;
use crate::pki::plan::{self, Lifetimes};
// The wire's reading of a certificate (as the agents read it), not the shared names.
use podmotion_wire::identity;

fn life() -> Lifetimes {
    Lifetimes {
        ca: 3000,
        leaf: 600,
        propagation: 60,
    }
}

fn agent_csr(node: &str, extra_dns: &[&str]) -> (String, KeyPair) {
    let key = KeyPair::generate().unwrap();
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, identity::agent_cn(node));
    p.subject_alt_names
        .push(SanType::URI(identity::agent_uri(node).try_into().unwrap()));
    p.subject_alt_names.push(SanType::DnsName(
        plan::agent_server_name(node).try_into().unwrap(),
    ));
    for d in extra_dns {
        p.subject_alt_names
            .push(SanType::DnsName((*d).try_into().unwrap()));
    }
    (p.serialize_request(&key).unwrap().pem().unwrap(), key)
}

fn parse(pem: &str) -> x509_parser::pem::Pem {
    x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap().1
}

#[test]
fn a_request_reads_as_the_identity_it_asks_for() {
    let (pem, _) = agent_csr("n1", &[]);
    assert_eq!(requested(&pem).unwrap(), plan::agent_request("n1"));
    let (pem, _) = agent_csr("n1", &["evil.example"]);
    assert_ne!(requested(&pem).unwrap(), plan::agent_request("n1"));
    assert!(requested("not a request").is_err());
}

#[test]
fn agent_certificates_carry_exactly_the_node_identity_and_chain_to_the_ca() {
    let now = 1_800_000_000;
    let ca = new_ca(now, &life()).unwrap();
    let (_, ca_not_after) = podmotion_wire::client::cert_validity(ca.cert.as_bytes()).unwrap();
    let (req, key) = agent_csr("n1", &[]);
    let cert = sign_agent(&ca, ca_not_after, "n1", &req, now, &life()).unwrap();
    let der = parse(&cert).contents;
    assert_eq!(
        identity::from_der(&der, false),
        Ok(identity::Peer::Agent("n1".into()))
    );
    let (_, x) = x509_parser::parse_x509_certificate(&der).unwrap();
    // The request's public key, our validity, serverAuth + clientAuth.
    assert_eq!(
        x.public_key().subject_public_key.data.as_ref(),
        key.public_key_raw()
    );
    assert_eq!(x.validity().not_after.timestamp(), now + 600);
    let eku = x.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.server_auth && eku.client_auth && !eku.any);
    assert!(!x.is_ca());
    let ca_der = parse(&ca.cert).contents;
    let (_, ca_x) = x509_parser::parse_x509_certificate(&ca_der).unwrap();
    assert_eq!(x.issuer(), ca_x.subject());
    x.verify_signature(Some(ca_x.public_key())).unwrap();
    // Never past the CA.
    let late = sign_agent(&ca, ca_not_after, "n1", &req, ca_not_after - 10, &life()).unwrap();
    assert_eq!(
        podmotion_wire::client::cert_validity(late.as_bytes())
            .unwrap()
            .1,
        ca_not_after
    );
}

#[test]
fn the_operator_certificate_is_a_client_certificate_of_the_operator_identity() {
    let now = 1_800_000_000;
    let ca = new_ca(now, &life()).unwrap();
    let (cert, _key) = operator_cert(&ca, now + 3000, now, &life()).unwrap();
    let der = parse(&cert).contents;
    assert_eq!(
        identity::from_der(&der, false),
        Ok(identity::Peer::Operator)
    );
    let (_, x) = x509_parser::parse_x509_certificate(&der).unwrap();
    let eku = x.extended_key_usage().unwrap().unwrap().value;
    assert!(eku.client_auth && !eku.server_auth);
    assert_eq!(
        x.subject()
            .iter_common_name()
            .next()
            .unwrap()
            .as_str()
            .unwrap(),
        identity::OPERATOR_CN
    );
}

#[test]
fn every_ca_has_its_own_subject() {
    let a = new_ca(1_800_000_000, &life()).unwrap();
    let b = new_ca(1_800_000_001, &life()).unwrap();
    let subject = |pem: &str| {
        let der = parse(pem).contents;
        x509_parser::parse_x509_certificate(&der)
            .unwrap()
            .1
            .subject()
            .to_string()
    };
    assert_ne!(subject(&a.cert), subject(&b.cert));
}
