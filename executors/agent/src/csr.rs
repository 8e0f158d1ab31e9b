//! The agent's own identity, from the operator, through the Kubernetes API: the agent
//! makes a key (it never leaves this process), asks for the certificate of its node
//! with a CertificateSigningRequest (signer `podmotion.io/agent-serving`) using its
//! pod-bound ServiceAccount token, and waits until the operator signs or denies it.
//! The API server records who asked (the agents' ServiceAccount, the pod and node the
//! token is bound to); the operator signs only the identity of that pod's node, so an
//! agent cannot obtain another node's certificate. The CA bundle it trusts is the
//! operator's ConfigMap in the agent's namespace, watched.
//!
//! [`run`] keeps both current in a [`TlsFiles`]: a renewed certificate (at two thirds
//! of its life, or at once when the bundle shows a new signing CA) or a new bundle is
//! used by the next connection, without a restart.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestSpec, CertificateSigningRequestStatus,
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use podmotion_wire::client::{TlsFiles, TlsMaterial, cert_names, cert_validity};
use podmotion_wire::identity;
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

/// The signer of node agent certificates (the operator).
pub const SIGNER: &str = "podmotion.io/agent-serving";
/// What an agent certificate is for (spec.usages, exactly what the operator accepts).
pub const USAGES: [&str; 3] = ["digital signature", "server auth", "client auth"];

/// Where the agent's identity comes from.
#[derive(Clone, Debug)]
pub struct CsrSettings {
    /// This node (downward API): the only identity the agent asks for.
    pub node: String,
    /// The agent's namespace, holding the CA bundle ConfigMap.
    pub namespace: String,
    pub bundle_configmap: String,
    /// How long one request may wait for the operator.
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum CsrError {
    #[error("API: {0}")]
    Kube(#[from] kube::Error),
    #[error("key or request: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("certificate request {name} denied: {reason}: {message}")]
    Denied {
        name: String,
        reason: String,
        message: String,
    },
    #[error("certificate request {0} not signed in time")]
    Timeout(String),
    #[error("CA bundle ConfigMap {0}: {1}")]
    Bundle(String, String),
    #[error("TLS material: {0}")]
    Tls(#[from] podmotion_wire::client::TlsError),
}

/// The PEM request for `node`'s identity: CN, URI SAN and DNS SAN, nothing else.
pub fn request_pem(node: &str, key: &KeyPair) -> Result<String, rcgen::Error> {
    let mut p = CertificateParams::default();
    p.distinguished_name = DistinguishedName::new();
    p.distinguished_name
        .push(DnType::CommonName, identity::agent_cn(node));
    p.subject_alt_names
        .push(SanType::URI(identity::agent_uri(node).try_into()?));
    p.subject_alt_names
        .push(SanType::DnsName(agent_server_name(node).try_into()?));
    p.serialize_request(key)?.pem()
}

/// The TLS server name the operator and peer agents dial this node's agent by.
pub fn agent_server_name(node: &str) -> String {
    format!("podmotion-agent.{node}")
}

/// Asks for `node`'s certificate for `key` and waits for the operator's answer.
/// Returns the certificate PEM.
pub async fn request_certificate(
    client: &Client,
    node: &str,
    key: &KeyPair,
    timeout: Duration,
) -> Result<String, CsrError> {
    let api: Api<CertificateSigningRequest> = Api::all(client.clone());
    let csr = certificate_request(node, key)?;
    let created = api.create(&PostParams::default(), &csr).await?;
    let name = created.name_any();
    tracing::info!(csr = %name, %node, "certificate requested");
    tokio::time::timeout(timeout, wait_for_answer(&api, &name))
        .await
        .unwrap_or_else(|_| Err(CsrError::Timeout(name.clone())))
}

/// The CertificateSigningRequest for `node`'s identity, named by the API server.
fn certificate_request(
    node: &str,
    key: &KeyPair,
) -> Result<CertificateSigningRequest, rcgen::Error> {
    let mut prefix = format!("podmotion-agent-{node}-");
    prefix.truncate(200);
    Ok(CertificateSigningRequest {
        metadata: ObjectMeta {
            generate_name: Some(prefix),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/component".to_string(),
                "migration-agent".to_string(),
            )])),
            ..Default::default()
        },
        spec: CertificateSigningRequestSpec {
            request: ByteString(request_pem(node, key)?.into_bytes()),
            signer_name: SIGNER.into(),
            usages: Some(USAGES.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        },
        status: None,
    })
}

/// Watches the request `name` until the operator signs or denies it (a watch error is
/// retried after a second).
async fn wait_for_answer(
    api: &Api<CertificateSigningRequest>,
    name: &str,
) -> Result<String, CsrError> {
    let mut events = watcher::watcher(
        api.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .boxed();
    while let Some(ev) = events.next().await {
        let obj = match ev {
            Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => o,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %e, csr = %name, "watching the certificate request");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Some(answer) = answer(name, obj.status.unwrap_or_default()) {
            return answer;
        }
    }
    Err(CsrError::Timeout(name.to_owned()))
}

/// The operator's answer in a request's status, if it gave one: denied (or failed),
/// or the certificate PEM.
fn answer(name: &str, status: CertificateSigningRequestStatus) -> Option<Result<String, CsrError>> {
    for c in status.conditions.unwrap_or_default() {
        if (c.type_ == "Denied" || c.type_ == "Failed") && c.status == "True" {
            return Some(Err(CsrError::Denied {
                name: name.to_owned(),
                reason: c.reason.unwrap_or_default(),
                message: c.message.unwrap_or_default(),
            }));
        }
    }
    let cert = status.certificate.filter(|c| !c.0.is_empty())?;
    Some(Ok(String::from_utf8_lossy(&cert.0).into_owned()))
}

/// The CA bundle (`ca.crt` of the ConfigMap), once it exists.
async fn next_bundle(
    events: &mut (
             impl futures::Stream<Item = Result<watcher::Event<ConfigMap>, watcher::Error>> + Unpin
         ),
    cm: &str,
) -> Result<Option<String>, CsrError> {
    loop {
        match events.next().await {
            Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => {
                if let Some(b) = o
                    .data
                    .and_then(|mut d| d.remove("ca.crt"))
                    .filter(|b| !b.trim().is_empty())
                {
                    return Ok(Some(b));
                }
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                tracing::warn!(error = %e, configmap = %cm, "watching the CA bundle");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            None => return Err(CsrError::Bundle(cm.into(), "watch ended".into())),
        }
    }
}

/// Whether a certificate should be renewed now: at two thirds of its life, or when its
/// issuer is no longer the bundle's signing CA (its first certificate).
pub fn renewal_due(cert_pem: &str, bundle_pem: &str, now: i64) -> bool {
    let Some((nb, na)) = cert_validity(cert_pem.as_bytes()) else {
        return true;
    };
    if now >= nb + (na - nb) * 2 / 3 {
        return true;
    }
    match (
        cert_names(cert_pem.as_bytes()),
        cert_names(bundle_pem.as_bytes()),
    ) {
        (Some((_, issuer)), Some((signing, _))) => issuer != signing,
        _ => true,
    }
}

fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The watch of the CA bundle ConfigMap.
type BundleEvents =
    futures::stream::BoxStream<'static, Result<watcher::Event<ConfigMap>, watcher::Error>>;

/// Obtains the first certificate and bundle, then keeps them current in the returned
/// handle from a background task (renewal errors are retried; the old certificate
/// serves meanwhile).
pub async fn start(client: Client, s: CsrSettings) -> Result<TlsFiles, CsrError> {
    let mut events = watch_bundle(&client, &s);
    tracing::info!(configmap = %s.bundle_configmap, "waiting for the CA bundle");
    let bundle = next_bundle(&mut events, &s.bundle_configmap)
        .await?
        .ok_or_else(|| CsrError::Bundle(s.bundle_configmap.clone(), "absent".into()))?;
    let (cert, key) = first_certificate(&client, &s).await?;
    let tls = TlsFiles::from_pem(
        bundle.clone().into_bytes(),
        cert.clone().into_bytes(),
        key.serialize_pem().into_bytes(),
    );
    tls.set(tls.material())?;
    tracing::info!(node = %s.node, "serving with the certificate the operator issued");
    tokio::spawn(keep_current(client, s, tls.clone(), events, bundle, cert));
    Ok(tls)
}

fn watch_bundle(client: &Client, s: &CsrSettings) -> BundleEvents {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &s.namespace);
    watcher::watcher(
        cms,
        watcher::Config::default().fields(&format!("metadata.name={}", s.bundle_configmap)),
    )
    .boxed()
}

/// Asks for a certificate every 5 s until the operator issues one (the agent serves
/// nothing without it).
async fn first_certificate(
    client: &Client,
    s: &CsrSettings,
) -> Result<(String, KeyPair), CsrError> {
    loop {
        let key = KeyPair::generate()?;
        match request_certificate(client, &s.node, &key, s.timeout).await {
            Ok(c) => return Ok((c, key)),
            Err(e) => {
                tracing::warn!(error = %e, "no certificate yet; asking again");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

/// Keeps `handle` current until the bundle watch ends: takes every new CA bundle, and
/// renews the certificate when [`renewal_due`] (failed renewals back off from 5 s to
/// 5 min; the old certificate serves meanwhile).
async fn keep_current(
    client: Client,
    s: CsrSettings,
    handle: TlsFiles,
    mut events: BundleEvents,
    mut bundle: String,
    mut cert: String,
) {
    let mut retry = Duration::from_secs(5);
    loop {
        let wait = until_renewal(&cert, &bundle, now());
        tokio::select! {
            b = next_bundle(&mut events, &s.bundle_configmap) => match b {
                Ok(Some(b)) if b != bundle => {
                    bundle = b;
                    take_bundle(&handle, &bundle);
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::error!(error = %e, "CA bundle watch ended");
                    return;
                }
            },
            _ = tokio::time::sleep(wait) => {
                if !renewal_due(&cert, &bundle, now()) {
                    continue;
                }
                match renew(&client, &s, &handle, &bundle).await {
                    Ok(c) => {
                        cert = c;
                        retry = Duration::from_secs(5);
                        tracing::info!("certificate renewed");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, ?retry, "certificate not renewed; retrying");
                        tokio::time::sleep(retry).await;
                        retry = (retry * 2).min(Duration::from_secs(300));
                    }
                }
            }
        }
    }
}

/// How long until `cert` is due for renewal at `now` (0 if it is; at least 1 s and at
/// most an hour otherwise, so a bundle change is never missed for long).
fn until_renewal(cert: &str, bundle: &str, now: i64) -> Duration {
    if renewal_due(cert, bundle, now) {
        return Duration::ZERO;
    }
    let (nb, na) = cert_validity(cert.as_bytes()).unwrap_or((now, now));
    Duration::from_secs((nb + (na - nb) * 2 / 3 - now).clamp(1, 3600) as u64)
}

/// Serves a new CA bundle with the current certificate.
fn take_bundle(handle: &TlsFiles, bundle: &str) {
    let mut m = handle.material();
    m.ca_pem = bundle.as_bytes().to_vec();
    match handle.set(m) {
        Ok(_) => tracing::info!("CA bundle updated"),
        Err(e) => tracing::warn!(error = %e, "CA bundle rejected"),
    }
}

/// A fresh key and certificate, served at once; returns the certificate.
async fn renew(
    client: &Client,
    s: &CsrSettings,
    handle: &TlsFiles,
    bundle: &str,
) -> Result<String, CsrError> {
    let key = KeyPair::generate()?;
    let c = request_certificate(client, &s.node, &key, s.timeout).await?;
    handle.set(TlsMaterial {
        ca_pem: bundle.as_bytes().to_vec(),
        cert_pem: c.clone().into_bytes(),
        key_pem: key.serialize_pem().into_bytes(),
    })?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_asks_for_exactly_the_node_identity() {
        use x509_parser::prelude::{FromDer, GeneralName, ParsedExtension};
        let key = KeyPair::generate().unwrap();
        let pem = request_pem("pm-real-0", &key).unwrap();
        let (_, p) = x509_parser::pem::parse_x509_pem(pem.as_bytes()).unwrap();
        let (_, csr) =
            x509_parser::certification_request::X509CertificationRequest::from_der(&p.contents)
                .unwrap();
        csr.verify_signature().unwrap();
        let info = &csr.certification_request_info;
        let cns: Vec<_> = info
            .subject
            .iter_common_name()
            .map(|c| c.as_str().unwrap().to_string())
            .collect();
        assert_eq!(cns, vec!["podmotion-agent:pm-real-0"]);
        let mut names = vec![];
        for ext in csr.requested_extensions().unwrap() {
            if let ParsedExtension::SubjectAlternativeName(san) = ext {
                for n in &san.general_names {
                    names.push(match n {
                        GeneralName::URI(u) => format!("uri:{u}"),
                        GeneralName::DNSName(d) => format!("dns:{d}"),
                        other => format!("other:{other:?}"),
                    });
                }
            }
        }
        assert_eq!(
            names,
            vec![
                "uri:spiffe://podmotion.io/agent/pm-real-0",
                "dns:podmotion-agent.pm-real-0"
            ]
        );
    }

    #[test]
    fn renewal_is_due_at_two_thirds_or_when_the_signing_ca_changed() {
        use rcgen::{BasicConstraints, CertifiedIssuer, IsCa};
        let ca = |cn: &str| {
            let mut p = CertificateParams::default();
            p.distinguished_name.push(DnType::CommonName, cn);
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap()
        };
        let (old, new) = (ca("ca-old"), ca("ca-new"));
        let mut p = CertificateParams::new(vec!["x".to_string()]).unwrap();
        p.not_before = time_at(1000);
        p.not_after = time_at(1900);
        let leaf = p
            .signed_by(&KeyPair::generate().unwrap(), &old)
            .unwrap()
            .pem();
        let both_old_first = format!("{}{}", old.pem(), new.pem());
        let both_new_first = format!("{}{}", new.pem(), old.pem());
        assert!(!renewal_due(&leaf, &both_old_first, 1599));
        assert!(renewal_due(&leaf, &both_old_first, 1600));
        assert!(renewal_due(&leaf, &both_new_first, 1100));
        assert!(renewal_due("junk", &both_old_first, 1100));
    }

    #[test]
    fn the_request_is_for_the_agent_signer_and_named_after_its_node() {
        let key = KeyPair::generate().unwrap();
        let csr = certificate_request("pm-real-0", &key).unwrap();
        assert_eq!(
            csr.metadata.generate_name.as_deref(),
            Some("podmotion-agent-pm-real-0-")
        );
        assert_eq!(csr.spec.signer_name, SIGNER);
        assert_eq!(csr.spec.usages.unwrap(), USAGES);
        let pem = String::from_utf8(csr.spec.request.0).unwrap();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
        let long = "n".repeat(250);
        let name = certificate_request(&long, &key)
            .unwrap()
            .metadata
            .generate_name;
        assert_eq!(name.unwrap().len(), 200);
    }

    #[test]
    fn a_denial_or_failure_is_an_answer_and_so_is_a_certificate() {
        use k8s_openapi::api::certificates::v1::CertificateSigningRequestCondition;
        let cond = |type_: &str, status: &str| CertificateSigningRequestCondition {
            type_: type_.into(),
            status: status.into(),
            reason: Some("Nope".into()),
            message: Some("not yours".into()),
            ..Default::default()
        };
        let status = |conds: Vec<CertificateSigningRequestCondition>, cert: &str| {
            CertificateSigningRequestStatus {
                conditions: Some(conds),
                certificate: Some(ByteString(cert.as_bytes().to_vec())),
            }
        };
        assert!(answer("r", status(vec![], "")).is_none());
        assert!(answer("r", status(vec![cond("Denied", "False")], "")).is_none());
        assert_eq!(answer("r", status(vec![], "PEM")).unwrap().unwrap(), "PEM");
        for t in ["Denied", "Failed"] {
            let e = answer("r", status(vec![cond(t, "True")], "PEM"))
                .unwrap()
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                "certificate request r denied: Nope: not yours"
            );
        }
    }

    fn time_at(unix: i64) -> time::OffsetDateTime {
        time::OffsetDateTime::from_unix_timestamp(unix).unwrap()
    }
}
