//! The pure part of the operator's PKI: when the CA rotates, what the agents trust
//! (the bundle), when a leaf certificate is renewed, and whether a node agent's
//! certificate signing request may be signed. No I/O, no clock: `now` is an argument
//! (Unix seconds) everywhere.

use std::collections::BTreeMap;

use podmotion_api::names::identity;

/// Lifetimes of the key material, in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    /// Validity of a CA certificate.
    pub ca: i64,
    /// Validity of a leaf (agent or operator) certificate.
    pub leaf: i64,
    /// How long a new CA is published in the bundle before anything is signed with it:
    /// every party must trust it before it meets a certificate it signed.
    pub propagation: i64,
}

impl Lifetimes {
    /// Rejects lifetimes under which a rotation cannot overlap.
    pub fn validate(&self) -> Result<(), String> {
        if self.leaf <= 0 || self.propagation < 0 {
            return Err("leaf validity must be positive and propagation not negative".into());
        }
        if self.ca < 3 * (self.leaf + self.propagation) {
            return Err(format!(
                "CA validity ({} s) must be at least three times leaf validity + propagation ({} s): the old CA must outlive every leaf it signed",
                self.ca,
                self.leaf + self.propagation
            ));
        }
        Ok(())
    }
}

/// One CA certificate as the plan sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CaCert {
    pub cert_pem: String,
    pub not_before: i64,
    pub not_after: i64,
}

/// A CA no longer signing, still trusted until every leaf it signed is gone.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Retired {
    pub cert_pem: String,
    /// Unix seconds.
    pub trusted_until: i64,
}

/// The CA's state as stored (the keys are not the plan's business).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaState {
    /// The CA that signs.
    pub current: Option<CaCert>,
    /// A new CA already in the bundle, not signing yet, and when it was introduced.
    pub next: Option<(CaCert, i64)>,
    pub retired: Vec<Retired>,
}

/// What to do to the CA now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaStep {
    /// There is no CA: make one (it signs at once; nothing trusts anything yet).
    Create,
    /// Make the next CA and publish it next to the current one.
    Introduce,
    /// The next CA has been published long enough: it signs from now on; the current
    /// one is retired, trusted until the leaves it signed have expired.
    Promote,
    /// Retired CAs past their trust: drop them from the bundle.
    DropRetired,
    Nothing,
}

/// When the current CA is replaced: when a third of its configured life is left
/// (counted back from its expiry: its start is backdated for clock skew), and early
/// enough that a leaf signed just before the switch still expires before the CA does.
pub fn ca_rotation_due(ca: &CaCert, life: &Lifetimes) -> i64 {
    (ca.not_after - life.ca / 3).min(ca.not_after - life.leaf - 2 * life.propagation)
}

/// The next step for the CA, and the time it is due when that is later than now.
pub fn ca_step(s: &CaState, life: &Lifetimes, now: i64) -> CaStep {
    let Some(current) = &s.current else {
        return CaStep::Create;
    };
    if s.retired.iter().any(|r| r.trusted_until <= now) {
        return CaStep::DropRetired;
    }
    match &s.next {
        Some((_, introduced)) if now >= introduced + life.propagation => CaStep::Promote,
        Some(_) => CaStep::Nothing,
        None if now >= ca_rotation_due(current, life) => CaStep::Introduce,
        None => CaStep::Nothing,
    }
}

/// When [`ca_step`] will next return something other than `Nothing` (Unix seconds).
pub fn ca_next_event(s: &CaState, life: &Lifetimes) -> Option<i64> {
    let current = s.current.as_ref()?;
    let mut t = match &s.next {
        Some((_, introduced)) => introduced + life.propagation,
        None => ca_rotation_due(current, life),
    };
    for r in &s.retired {
        t = t.min(r.trusted_until);
    }
    Some(t)
}

/// The state after `Promote`: `next` signs, `current` is retired for one leaf
/// lifetime (every leaf it signed expires by then; parties re-issue sooner).
pub fn promote(s: &CaState, life: &Lifetimes, now: i64) -> CaState {
    let mut out = s.clone();
    if let Some((next, _)) = out.next.take()
        && let Some(old) = out.current.replace(next)
    {
        out.retired.push(Retired {
            trusted_until: (now + life.leaf + life.propagation).min(old.not_after),
            cert_pem: old.cert_pem,
        });
    }
    out
}

/// The state without retired CAs past their trust.
pub fn drop_retired(s: &CaState, now: i64) -> CaState {
    let mut out = s.clone();
    out.retired.retain(|r| r.trusted_until > now);
    out
}

/// The CA bundle every party trusts: the signing CA first, then the next one, then the
/// retired ones still trusted. Parties compare their certificate's issuer with the
/// first entry to know that they should renew.
pub fn bundle(s: &CaState) -> String {
    let mut out = String::new();
    let mut push = |pem: &str| {
        out.push_str(pem.trim_end());
        out.push('\n');
    };
    if let Some(c) = &s.current {
        push(&c.cert_pem);
    }
    if let Some((n, _)) = &s.next {
        push(&n.cert_pem);
    }
    for r in &s.retired {
        push(&r.cert_pem);
    }
    out
}

/// When a leaf certificate valid from `not_before` to `not_after` is renewed: at two
/// thirds of its life.
pub fn leaf_renewal_due(not_before: i64, not_after: i64) -> i64 {
    not_before + (not_after - not_before) * 2 / 3
}

/// The validity of a leaf issued at `now` by a CA that expires at `ca_not_after`:
/// backdated a little for clock skew (a minute, or a tenth of a short lifetime, so
/// that renewal at two thirds stays after the issue), never past the CA.
pub fn leaf_validity(now: i64, life: &Lifetimes, ca_not_after: i64) -> (i64, i64) {
    (
        now - (life.leaf / 10).min(60),
        (now + life.leaf).min(ca_not_after),
    )
}

// ---------------------------------------------------------------------------------
// Node agents' certificate signing requests.

/// The signer name of node agent certificates (CertificateSigningRequest.spec.signerName).
pub const AGENT_SIGNER: &str = "podmotion.io/agent-serving";

/// Extra keys the API server records for a token bound to a pod.
pub const EXTRA_POD_NAME: &str = "authentication.kubernetes.io/pod-name";
pub const EXTRA_POD_UID: &str = "authentication.kubernetes.io/pod-uid";
pub const EXTRA_NODE_NAME: &str = "authentication.kubernetes.io/node-name";

/// Usages an agent certificate has (spec.usages of its request, exactly; key
/// encipherment is tolerated for RSA keys).
pub const AGENT_USAGES: [&str; 3] = ["digital signature", "server auth", "client auth"];

/// Who may ask for node agent certificates.
#[derive(Clone, Debug)]
pub struct AgentPolicy {
    /// The agents' namespace.
    pub namespace: String,
    /// The agents' ServiceAccount.
    pub service_account: String,
    /// Labels every agent pod carries (the DaemonSet's selector).
    pub pod_labels: BTreeMap<String, String>,
}

/// What the API server recorded about a request (all set by the API server, none by
/// the requester) and the request itself.
#[derive(Clone, Debug, Default)]
pub struct CsrFacts {
    pub signer_name: String,
    pub username: String,
    pub extra: BTreeMap<String, Vec<String>>,
    pub usages: Vec<String>,
    /// PEM `CERTIFICATE REQUEST`.
    pub request: Vec<u8>,
}

/// The pod a request's token is bound to, as it is now.
#[derive(Clone, Debug, Default)]
pub struct PodFacts {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub node_name: Option<String>,
    pub service_account: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub terminating: bool,
}

/// The identity a request asks for, read from its PEM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Requested {
    pub common_name: Option<String>,
    pub uris: Vec<String>,
    pub dns: Vec<String>,
    /// IP, e-mail or other names (never granted).
    pub other_names: usize,
    pub is_ca: bool,
}

/// The verdict on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Sign the identity of the agent on this node.
    Approve { node: String },
    /// Not from this installation's agents: another PodMotion installation in the same
    /// cluster (same signer name) answers it, or nobody does and it expires unsigned.
    /// Never denied, so two installations cannot deny each other's agents.
    NotOurs { requester: String },
    /// Refuse; `reason` is a CamelCase condition reason.
    Deny {
        reason: &'static str,
        message: String,
    },
}

fn deny(reason: &'static str, message: impl Into<String>) -> Verdict {
    Verdict::Deny {
        reason,
        message: message.into(),
    }
}

fn single<'a>(extra: &'a BTreeMap<String, Vec<String>>, key: &str) -> Option<&'a str> {
    match extra.get(key).map(Vec::as_slice) {
        Some([one]) if !one.is_empty() => Some(one.as_str()),
        _ => None,
    }
}

/// Whether a node agent's request is signed: the requester must be the agents'
/// ServiceAccount authenticated with a token bound to a live agent pod, and the
/// request must ask for exactly the identity of the node that pod runs on. The node
/// comes from what the API server recorded (the token's pod binding) and the pod as it
/// is now, never from the request. `requested` is `Err` when the PEM does not parse or
/// its signature is wrong.
pub fn review(
    csr: &CsrFacts,
    policy: &AgentPolicy,
    requested: Result<&Requested, &str>,
    pod: Option<&PodFacts>,
) -> Verdict {
    if csr.signer_name != AGENT_SIGNER {
        return deny("WrongSigner", format!("signer {:?}", csr.signer_name));
    }
    let expected_user = format!(
        "system:serviceaccount:{}:{}",
        policy.namespace, policy.service_account
    );
    if csr.username != expected_user {
        return Verdict::NotOurs {
            requester: csr.username.clone(),
        };
    }
    match agents_own_identity(csr, policy, requested, pod) {
        Ok(node) => Verdict::Approve {
            node: node.to_string(),
        },
        Err(denied) => denied,
    }
}

/// The checks of a request of this installation's agents, in order: the node it may
/// have, or the first refusal.
fn agents_own_identity<'a>(
    csr: &'a CsrFacts,
    policy: &AgentPolicy,
    requested: Result<&Requested, &str>,
    pod: Option<&PodFacts>,
) -> Result<&'a str, Verdict> {
    let (pod_name, pod_uid, node) = token_binding(csr)?;
    live_agent_pod_on(policy, pod, (pod_name, pod_uid), node)?;
    if !identity::valid_node_name(node) {
        return Err(deny("BadNodeName", format!("{node:?}")));
    }
    agent_usages(csr)?;
    identity_of(node, requested)?;
    Ok(node)
}

/// The pod name, pod UID and node the API server bound the requester's token to.
fn token_binding(csr: &CsrFacts) -> Result<(&str, &str, &str), Verdict> {
    match (
        single(&csr.extra, EXTRA_POD_NAME),
        single(&csr.extra, EXTRA_POD_UID),
        single(&csr.extra, EXTRA_NODE_NAME),
    ) {
        (Some(name), Some(uid), Some(node)) => Ok((name, uid, node)),
        _ => Err(deny(
            "NotBoundToAPod",
            "the requester's token is not bound to a pod on a node",
        )),
    }
}

/// The token's pod is the live, running agent pod on `node`.
fn live_agent_pod_on(
    policy: &AgentPolicy,
    pod: Option<&PodFacts>,
    (pod_name, pod_uid): (&str, &str),
    node: &str,
) -> Result<(), Verdict> {
    let Some(pod) = pod else {
        return Err(deny(
            "PodGone",
            format!("pod {}/{pod_name} does not exist", policy.namespace),
        ));
    };
    if pod.namespace != policy.namespace || pod.name != pod_name || pod.uid != pod_uid {
        return Err(deny(
            "PodMismatch",
            format!("the token's pod {pod_name} ({pod_uid}) is not the live pod"),
        ));
    }
    if pod.terminating {
        return Err(deny(
            "PodTerminating",
            format!("pod {pod_name} is terminating"),
        ));
    }
    if pod.node_name.as_deref() != Some(node) {
        return Err(deny(
            "NodeMismatch",
            format!(
                "the token says node {node}, the pod runs on {:?}",
                pod.node_name
            ),
        ));
    }
    if pod.service_account.as_deref() != Some(policy.service_account.as_str())
        || policy
            .pod_labels
            .iter()
            .any(|(k, v)| pod.labels.get(k) != Some(v))
    {
        return Err(deny(
            "NotAnAgentPod",
            format!("pod {pod_name} is not a node agent pod"),
        ));
    }
    Ok(())
}

/// The request's usages are the agent's (key encipherment aside).
fn agent_usages(csr: &CsrFacts) -> Result<(), Verdict> {
    let mut usages: Vec<&str> = csr
        .usages
        .iter()
        .map(String::as_str)
        .filter(|u| *u != "key encipherment")
        .collect();
    usages.sort_unstable();
    let mut want = AGENT_USAGES.to_vec();
    want.sort_unstable();
    if usages != want {
        return Err(deny(
            "WrongUsages",
            format!("usages {:?}, expected {:?}", csr.usages, AGENT_USAGES),
        ));
    }
    Ok(())
}

/// The request parses and asks for exactly the identity of the agent on `node`.
fn identity_of(node: &str, requested: Result<&Requested, &str>) -> Result<(), Verdict> {
    let r = match requested {
        Ok(r) => r,
        Err(e) => {
            return Err(deny(
                "BadRequest",
                format!("the request does not parse: {e}"),
            ));
        }
    };
    let want = agent_request(node);
    if *r != want {
        return Err(deny(
            "IdentityMismatch",
            format!(
                "the agent on {node} may ask for CN {:?}, URI {:?}, DNS {:?} only; asked for {r:?}",
                want.common_name, want.uris, want.dns
            ),
        ));
    }
    Ok(())
}

/// Exactly what the agent on `node` asks for (and gets).
pub fn agent_request(node: &str) -> Requested {
    Requested {
        common_name: Some(identity::agent_cn(node)),
        uris: vec![identity::agent_uri(node)],
        dns: vec![agent_server_name(node)],
        other_names: 0,
        is_ca: false,
    }
}

/// The TLS server name the operator and peer agents dial the agent on `node` by (its
/// DNS SAN, the SAN its certificate carries): the operator's one rule, which
/// `crate::agents` dials by and which also names the target of every Send.
pub fn agent_server_name(node: &str) -> String {
    format!("podmotion-agent.{node}")
}

/// Why key material found in the API is not adopted ([`provenance`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Untrusted {
    #[error(
        "the admission policy binding {0} that lets only the operator write the key material is missing: \
         key material anyone may have written is not used (reinstall the chart's policies)"
    )]
    Unprotected(String),
    #[error(
        "it was created at {created} (Unix seconds), before the admission policy binding {binding} that \
         lets only the operator write it existed ({since}): the operator did not necessarily make it"
    )]
    OlderThanProtection {
        binding: String,
        created: i64,
        since: i64,
    },
}

/// Whether a key-material object (the CA Secret, the master key Secret) created at
/// `created` may be adopted, given the creation time of the policy binding that lets
/// only the operator's ServiceAccount create it (`None`: the binding is missing). The
/// API server records no creator, but an object created while that binding was in
/// force can only be the operator's: anything older was made when anyone with Secret
/// rights in the namespace could plant it.
pub fn provenance(
    binding: &str,
    created: i64,
    protected_since: Option<i64>,
) -> Result<(), Untrusted> {
    match protected_since {
        None => Err(Untrusted::Unprotected(binding.to_string())),
        Some(since) if created < since => Err(Untrusted::OlderThanProtection {
            binding: binding.to_string(),
            created,
            since,
        }),
        Some(_) => Ok(()),
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
