//! The signer of node agents' CertificateSigningRequests (`podmotion.io/agent-serving`),
//! a controller like the three others: it runs through the shell
//! ([`crate::controllers::shell`]), so it gets the leader guard, the deserialize guard,
//! the reconcile metrics (`controller="csr-signer"`), the one error policy and Events
//! (on the request: issued, or refused and why). Observe reads the request, the CA and
//! the requesting agent pod; apply asks the pure review ([`super::plan::review`]) and
//! makes its writes through the writer: approval (or denial), then the certificate.
//! Requests are cluster-scoped and carry no finalizer: nothing to clean up.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::core::DeserializeGuard;
use kube::runtime::controller::Controller;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use podmotion_api::names::reasons;
use serde_json::json;

use super::issue;
use super::plan::{self, CsrFacts, PodFacts, Verdict};
use super::shell::{LoadedCa, MANAGER, Pki, PkiSettings, now};
use crate::context::Context;
use crate::controllers::controller_config;
use crate::controllers::shell::{self, Outcome, ReconcileError, Reconciler, api_err};
use crate::note::Note;
use crate::writer::{WriteError, Writer};

/// Metric and log name of the signer.
pub const NAME: &str = "csr-signer";

/// Runs the signer (leader only, through the shell) until its watch ends.
pub async fn run(ctx: Arc<Context>, pki: Pki) -> anyhow::Result<()> {
    let csrs: Api<DeserializeGuard<CertificateSigningRequest>> = Api::all(ctx.client.clone());
    let cfg = watcher::Config::default().fields(&format!("spec.signerName={}", plan::AGENT_SIGNER));
    let controller = Controller::new(csrs, cfg)
        .reconcile_all_on(ctx.leader.on_acquire())
        .with_config(controller_config(&ctx));
    shell::run(controller, Arc::new(Signer { ctx, pki })).await;
    anyhow::bail!("the agent certificate signer stopped")
}

/// The signer's state: the context and the PKI (the CA it signs with).
pub struct Signer {
    ctx: Arc<Context>,
    pki: Pki,
}

/// What one round of the signer decides from.
pub enum Observed {
    /// Issued, denied or failed already: nothing to do.
    Done,
    Review(Box<Review>),
}

/// A request to review: the CA to sign with, what the review reads of the request and
/// of the requesting pod, and whether someone approved it already.
pub struct Review {
    ca: Arc<LoadedCa>,
    facts: CsrFacts,
    pod: Option<PodFacts>,
    approved: bool,
}

/// Whether the request has the condition `type_` set to True.
fn has(csr: &CertificateSigningRequest, type_: &str) -> bool {
    let conds = csr.status.as_ref().and_then(|s| s.conditions.as_ref());
    conds.is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == "True"))
}

impl Reconciler for Signer {
    type Object = CertificateSigningRequest;
    type Status = ();
    type Observed = Observed;
    type Then = ();
    const NAME: &'static str = NAME;
    const FINALIZER: Option<&'static str> = None;
    const MANAGER: &'static str = MANAGER;

    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    /// The signer writes the request's status through its `/approval` and `/status`
    /// in the apply step: the shell has none to write.
    fn status(_obj: &CertificateSigningRequest) -> Option<&()> {
        None
    }

    async fn observe(
        &self,
        csr: &CertificateSigningRequest,
        _cleanup: bool,
    ) -> Result<Observed, ReconcileError> {
        let issued = csr.status.as_ref().is_some_and(|s| s.certificate.is_some());
        if issued || has(csr, "Denied") || has(csr, "Failed") {
            return Ok(Observed::Done);
        }
        let Some(ca) = self.pki.ca().borrow().clone() else {
            return Err(ReconcileError::wait(
                "no CA to sign with yet",
                Duration::from_secs(2),
            ));
        };
        let facts = csr_facts(csr);
        let pod = requesting_pod(&self.ctx.client, self.pki.settings(), &facts)
            .await
            .map_err(api_err("get", "the requesting agent pod"))?;
        Ok(Observed::Review(Box::new(Review {
            ca,
            facts,
            pod,
            approved: has(csr, "Approved"),
        })))
    }

    async fn apply(
        &self,
        csr: &CertificateSigningRequest,
        observed: Observed,
        _cleanup: bool,
    ) -> Result<Outcome<()>, ReconcileError> {
        let mut out = Outcome::new(None);
        let Observed::Review(review) = observed else {
            return Ok(out);
        };
        let Review {
            ca,
            facts,
            pod,
            approved,
        } = *review;
        let name = csr.name_any();
        let request_pem = String::from_utf8_lossy(&facts.request).into_owned();
        let requested = issue::requested(&request_pem);
        let settings = self.pki.settings();
        let verdict = plan::review(
            &facts,
            &settings.agents,
            requested.as_ref().map_err(String::as_str),
            pod.as_ref(),
        );
        let api: Api<CertificateSigningRequest> = Api::all(self.ctx.client.clone());
        let writer = &self.ctx.writer;
        match verdict {
            Verdict::NotOurs { requester } => {
                tracing::debug!(csr = %name, %requester, "not a request of this installation's agents");
            }
            Verdict::Deny { reason, message } => {
                tracing::warn!(csr = %name, reason, %message, "agent certificate request denied");
                refuse(writer, &api, &name, approved, reason, &message).await?;
                out.notes.push(Note::warning(
                    reasons::AGENT_CERTIFICATE_REFUSED,
                    "Sign",
                    format!("{reason}: {message}"),
                ));
            }
            Verdict::Approve { node } => {
                let note = self
                    .issue(&api, &name, approved, &node, &ca, &request_pem)
                    .await?;
                out.notes.push(note);
            }
        }
        Ok(out)
    }
}

impl Signer {
    /// Approves the request (unless someone did already), signs it for `node` with the
    /// CA and writes the certificate to its status; returns the Event that says so.
    async fn issue(
        &self,
        api: &Api<CertificateSigningRequest>,
        name: &str,
        approved: bool,
        node: &str,
        ca: &LoadedCa,
        request_pem: &str,
    ) -> Result<Note, ReconcileError> {
        let writer = &self.ctx.writer;
        if !approved {
            approve(writer, api, name, node).await?;
        }
        let cert = issue::sign_agent(
            &ca.signing,
            ca.signing_not_after(),
            node,
            request_pem,
            now(),
            &self.pki.settings().life,
        )
        .map_err(|e| ReconcileError::Inconsistent(e.to_string()))?;
        let patch = json!({"status": {"certificate": ByteString(cert.into_bytes())}});
        let pp = PatchParams::default();
        writer
            .patch_status(api, name, &pp, &Patch::Merge(&patch))
            .await?;
        tracing::info!(csr = %name, %node, "agent certificate issued");
        Ok(Note::normal(
            reasons::AGENT_CERTIFICATE_ISSUED,
            "Sign",
            format!("certificate issued to the agent pod on node {node}"),
        ))
    }
}

/// The agent pod a request names, read only when the requester is the agents'
/// ServiceAccount (the only requester whose pod the review looks at).
async fn requesting_pod(
    client: &Client,
    settings: &PkiSettings,
    facts: &CsrFacts,
) -> Result<Option<PodFacts>, kube::Error> {
    let agents = &settings.agents;
    let agents_sa = format!(
        "system:serviceaccount:{}:{}",
        agents.namespace, agents.service_account
    );
    let Some(p) = facts
        .extra
        .get(plan::EXTRA_POD_NAME)
        .and_then(|v| v.first())
        .filter(|_| facts.username == agents_sa)
    else {
        return Ok(None);
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), &agents.namespace);
    Ok(pods.get_opt(p).await?.map(|p| PodFacts {
        namespace: p.namespace().unwrap_or_default(),
        name: p.name_any(),
        uid: p.uid().unwrap_or_default(),
        node_name: p.spec.as_ref().and_then(|s| s.node_name.clone()),
        service_account: p.spec.as_ref().and_then(|s| s.service_account_name.clone()),
        labels: p.labels().clone(),
        terminating: p.metadata.deletion_timestamp.is_some(),
    }))
}

/// What the review reads of a request.
fn csr_facts(csr: &CertificateSigningRequest) -> CsrFacts {
    CsrFacts {
        signer_name: csr.spec.signer_name.clone(),
        username: csr.spec.username.clone().unwrap_or_default(),
        extra: csr.spec.extra.clone().unwrap_or_default(),
        usages: csr.spec.usages.clone().unwrap_or_default(),
        request: csr.spec.request.0.clone(),
    }
}

/// Refuses a request: Denied, or Failed when someone else approved it already (not
/// acceptable to the signer all the same).
async fn refuse(
    writer: &Writer,
    api: &Api<CertificateSigningRequest>,
    name: &str,
    approved: bool,
    reason: &str,
    message: &str,
) -> Result<(), WriteError> {
    let type_ = if approved { "Failed" } else { "Denied" };
    let patch = json!({"status": {"conditions": [condition(type_, reason, message)]}});
    let pp = PatchParams::default();
    if approved {
        writer
            .patch_status(api, name, &pp, &Patch::Merge(&patch))
            .await?;
    } else {
        writer
            .patch_approval(api, name, &pp, &Patch::Merge(&patch))
            .await?;
    }
    Ok(())
}

/// Approves the request of the agent pod on `node`.
async fn approve(
    writer: &Writer,
    api: &Api<CertificateSigningRequest>,
    name: &str,
    node: &str,
) -> Result<(), WriteError> {
    let patch = json!({"status": {"conditions": [condition(
        "Approved",
        "AgentOfNode",
        &format!("the agent pod on node {node}, requesting its own identity"),
    )]}});
    let pp = PatchParams::default();
    writer
        .patch_approval(api, name, &pp, &Patch::Merge(&patch))
        .await
}

fn condition(type_: &str, reason: &str, message: &str) -> serde_json::Value {
    json!({
        "type": type_,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastUpdateTime": k8s_openapi::jiff::Timestamp::now().to_string(),
    })
}
