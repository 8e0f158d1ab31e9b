//! Making and signing certificates (rcgen): CAs, the operator's client certificate and
//! node agent certificates from their requests. Deterministic given its inputs except
//! for fresh keys and serial numbers.

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use time::OffsetDateTime;

use super::plan::{Lifetimes, Requested, leaf_validity};
use podmotion_api::names::identity;

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("time out of range")]
    Time,
    #[error("CA material: {0}")]
    Ca(String),
}

fn at(unix: i64) -> Result<OffsetDateTime, IssueError> {
    OffsetDateTime::from_unix_timestamp(unix).map_err(|_| IssueError::Time)
}

fn serial() -> SerialNumber {
    let mut b = [0u8; 16];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut b);
    b[0] &= 0x7f;
    SerialNumber::from_slice(&b)
}

/// A CA certificate and its key, PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct CaPem {
    pub cert: String,
    pub key: String,
}

impl std::fmt::Debug for CaPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaPem").finish_non_exhaustive()
    }
}

/// A new self-signed CA valid from `now` (backdated an hour for skew) for `life.ca`.
/// Its CN carries the creation time, so each CA has a distinct subject and a leaf's
/// issuer names the CA that signed it.
pub fn new_ca(now: i64, life: &Lifetimes) -> Result<CaPem, IssueError> {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, format!("podmotion-agents-ca-{now}"));
    p.distinguished_name
        .push(DnType::OrganizationName, "podmotion.io");
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = at(now - 3600)?;
    p.not_after = at(now + life.ca)?;
    p.serial_number = Some(serial());
    let key = KeyPair::generate()?;
    let cert = p.self_signed(&key)?;
    Ok(CaPem {
        cert: cert.pem(),
        key: key.serialize_pem(),
    })
}

/// The CA as an issuer.
fn issuer(ca: &CaPem) -> Result<Issuer<'static, KeyPair>, IssueError> {
    let key = KeyPair::from_pem(&ca.key)?;
    Issuer::from_ca_cert_pem(&ca.cert, key).map_err(|e| IssueError::Ca(e.to_string()))
}

/// Our own parameters for `want`: nothing of a request is copied but its public key.
fn leaf_params(
    want: &Requested,
    ekus: Vec<ExtendedKeyUsagePurpose>,
    ca_not_after: i64,
    now: i64,
    life: &Lifetimes,
) -> Result<CertificateParams, IssueError> {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    if let Some(cn) = &want.common_name {
        p.distinguished_name.push(DnType::CommonName, cn.clone());
    }
    for u in &want.uris {
        p.subject_alt_names
            .push(SanType::URI(u.as_str().try_into()?));
    }
    for d in &want.dns {
        p.subject_alt_names
            .push(SanType::DnsName(d.as_str().try_into()?));
    }
    p.is_ca = IsCa::ExplicitNoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = ekus;
    let (nb, na) = leaf_validity(now, life, ca_not_after);
    p.not_before = at(nb)?;
    p.not_after = at(na)?;
    p.serial_number = Some(serial());
    p.use_authority_key_identifier_extension = true;
    Ok(p)
}

/// The certificate of the agent on `node`, for the public key of `request_pem` (a
/// request [`super::plan::review`] approved).
pub fn sign_agent(
    ca: &CaPem,
    ca_not_after: i64,
    node: &str,
    request_pem: &str,
    now: i64,
    life: &Lifetimes,
) -> Result<String, IssueError> {
    let csr = CertificateSigningRequestParams::from_pem(request_pem)?;
    let params = leaf_params(
        &super::plan::agent_request(node),
        vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ],
        ca_not_after,
        now,
        life,
    )?;
    let signed = CertificateSigningRequestParams {
        params,
        public_key: csr.public_key,
    }
    .signed_by(&issuer(ca)?)?;
    Ok(signed.pem())
}

/// A fresh key and client certificate for the operator: `(cert PEM, key PEM)`.
pub fn operator_cert(
    ca: &CaPem,
    ca_not_after: i64,
    now: i64,
    life: &Lifetimes,
) -> Result<(String, String), IssueError> {
    let want = Requested {
        common_name: Some(identity::OPERATOR_CN.into()),
        uris: vec![identity::OPERATOR_URI.into()],
        ..Default::default()
    };
    let params = leaf_params(
        &want,
        vec![ExtendedKeyUsagePurpose::ClientAuth],
        ca_not_after,
        now,
        life,
    )?;
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer(ca)?)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// A fresh key and serving certificate for the operator's admission webhook (the API
/// server trusts the CA bundle written into the webhook configuration): `(cert PEM,
/// key PEM)`. `names` are the Service's DNS names; those that parse as IP addresses
/// become IP SANs (a webhook reached by URL in tests).
pub fn webhook_serving_cert(
    ca: &CaPem,
    ca_not_after: i64,
    names: &[String],
    now: i64,
    life: &Lifetimes,
) -> Result<(String, String), IssueError> {
    let (ips, dns): (Vec<&String>, Vec<&String>) = names
        .iter()
        .partition(|n| n.parse::<std::net::IpAddr>().is_ok());
    let want = Requested {
        common_name: names.first().cloned(),
        dns: dns.into_iter().cloned().collect(),
        ..Default::default()
    };
    let mut params = leaf_params(
        &want,
        vec![ExtendedKeyUsagePurpose::ServerAuth],
        ca_not_after,
        now,
        life,
    )?;
    for ip in ips {
        let addr = ip.parse().expect("partitioned as an IP address");
        params.subject_alt_names.push(SanType::IpAddress(addr));
    }
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &issuer(ca)?)?;
    Ok((cert.pem(), key.serialize_pem()))
}

/// The identity a request asks for, after checking its signature.
pub fn requested(request_pem: &str) -> Result<Requested, String> {
    let csr = CertificateSigningRequestParams::from_pem(request_pem).map_err(|e| e.to_string())?;
    let mut r = Requested {
        is_ca: !matches!(csr.params.is_ca, IsCa::NoCa | IsCa::ExplicitNoCa),
        ..Default::default()
    };
    // The subject may hold one CN and nothing else.
    for (ty, v) in csr.params.distinguished_name.iter() {
        let text = match v {
            rcgen::DnValue::Utf8String(s) => Some(s.clone()),
            rcgen::DnValue::PrintableString(p) => Some(p.as_str().to_string()),
            _ => None,
        };
        match (ty, text) {
            (DnType::CommonName, Some(cn)) if r.common_name.is_none() => r.common_name = Some(cn),
            _ => r.other_names += 1,
        }
    }
    for san in &csr.params.subject_alt_names {
        match san {
            SanType::URI(u) => r.uris.push(u.as_str().to_string()),
            SanType::DnsName(d) => r.dns.push(d.as_str().to_string()),
            _ => r.other_names += 1,
        }
    }
    Ok(r)
}

#[cfg(test)]
#[path = "issue_tests.rs"]
mod tests;
