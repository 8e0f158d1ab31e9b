//! The `pods/eviction` admission webhook: the I/O around [`crate::eviction`].
//!
//! Every replica serves it (leader or not), over TLS with a serving certificate it
//! issues itself from the run-time CA ([`crate::pki`]), renewed at two thirds of its
//! life and whenever the signing CA changes. The leader writes the CA bundle into the
//! ValidatingWebhookConfiguration (the chart renders it without one) whenever it
//! differs, and again if someone removes it (a watch on that one object).
//!
//! One eviction: read the pod, its namespace's labels (only when a namespace default
//! is configured), the PodMigrations in its namespace and its claims; decide
//! ([`crate::eviction::decide`]); create the PodMigration when the decision says so;
//! answer. A replica that does not lead creates the PodMigration too, under its own
//! identity: a create with a name derived from the pod's UID is atomic (the second is
//! `AlreadyExists`), acts on nothing (the leader's migration controller does the
//! work, fenced as always), and so needs no fence — while leaving it to the leader
//! would make each retry a coin toss between replicas behind the Service. Anything
//! that cannot be read in time is answered 429 (retry), never allowed (which would
//! kill a pod that asked to be kept) nor refused (which would end the drain).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use clap::Args;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::names::{managers, reasons};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use serde::Deserialize;
use serde_json::json;
use tokio::net::TcpListener;

use crate::context::Context;
use crate::eviction::{
    self, Answer, EvictWhy, EvictedPod, KnownMigration, NamespaceDefault, Settings, Verdict,
};
use crate::graceful;
use crate::migration::preflight::{ClaimFacts, PodFacts, claim_names};
use crate::pki::plan::leaf_renewal_due;
use crate::pki::{Pki, issue};
use crate::writer::WriteError;

/// Readiness part of the webhook: ready once a serving certificate is in place.
pub const READINESS: &str = "eviction-webhook";

/// The longest a stopping replica waits for the reviews under way: the API server
/// gives up on a webhook after its `timeoutSeconds`, at most 10.
pub const IN_FLIGHT_BOUND: Duration = Duration::from_secs(10);

/// The eviction webhook's settings (`eviction.*` in the chart's values).
#[derive(Args, Clone, Debug)]
pub struct WebhookConfig {
    /// Serve the `pods/eviction` webhook (needs the run-time PKI: `--pki-ca-secret`).
    #[arg(
        id = "eviction_webhook",
        long = "eviction-webhook",
        env = "PODMOTION_EVICTION_WEBHOOK"
    )]
    pub enabled: bool,
    /// Address the webhook listens on (TLS).
    #[arg(
        long = "eviction-webhook-addr",
        env = "PODMOTION_EVICTION_WEBHOOK_ADDR",
        default_value = "0.0.0.0:9443"
    )]
    pub addr: SocketAddr,
    /// The ValidatingWebhookConfiguration whose `caBundle` the leader writes.
    #[arg(
        long = "eviction-webhook-configuration",
        env = "PODMOTION_EVICTION_WEBHOOK_CONFIGURATION",
        default_value = "podmotion-eviction"
    )]
    pub configuration: String,
    /// Names in the serving certificate (comma-separated): the Service's DNS names;
    /// IP addresses become IP SANs.
    #[arg(
        long = "eviction-webhook-names",
        env = "PODMOTION_EVICTION_WEBHOOK_NAMES",
        value_delimiter = ','
    )]
    pub names: Vec<String>,
    /// Namespaces whose pods are never held up (comma-separated), besides
    /// `kube-system` and the operator's own: the agents' namespace.
    #[arg(
        long = "eviction-protected-namespaces",
        env = "PODMOTION_EVICTION_PROTECTED_NAMESPACES",
        value_delimiter = ','
    )]
    pub protected_namespaces: Vec<String>,
    /// Namespaces carrying this label (`key` or `key=value`) give their pods
    /// `--eviction-default-strategy` unless the pod's annotation says otherwise.
    #[arg(
        long = "eviction-default-namespace-label",
        env = "PODMOTION_EVICTION_DEFAULT_NAMESPACE_LABEL"
    )]
    pub default_namespace_label: Option<String>,
    /// The default strategy of those namespaces' pods.
    #[arg(
        long = "eviction-default-strategy",
        env = "PODMOTION_EVICTION_DEFAULT_STRATEGY",
        default_value = "LiveMigrateIfPossible"
    )]
    pub default_strategy: String,
    /// Seconds a stopping replica keeps accepting and answering (keep-alive off)
    /// while its endpoint's removal reaches kube-proxy and the API server; then it
    /// stops accepting and answers what is under way (at most 10 s more: the API
    /// server's own timeout is at most 10 s). The pod's termination grace period must
    /// cover both.
    #[arg(
        long = "eviction-webhook-shutdown-propagation-seconds",
        env = "PODMOTION_EVICTION_WEBHOOK_SHUTDOWN_PROPAGATION_SECONDS",
        default_value_t = 10
    )]
    pub shutdown_propagation_seconds: u64,
    /// `freezeBudgetMillis` of the PodMigrations evictions start (10-600000): the
    /// node is going away, so a longer freeze beats an aborted move.
    #[arg(
        long = "eviction-freeze-budget-millis",
        env = "PODMOTION_EVICTION_FREEZE_BUDGET_MILLIS",
        default_value_t = 5000
    )]
    pub freeze_budget_millis: i64,
}

impl WebhookConfig {
    /// How long a stopping replica keeps serving ([`crate::graceful`]).
    pub fn grace(&self) -> graceful::Grace {
        graceful::Grace {
            propagation: Duration::from_secs(self.shutdown_propagation_seconds),
            in_flight: IN_FLIGHT_BOUND,
        }
    }

    /// The decision's settings; `Err` on a default that does not parse.
    pub fn settings(&self, operator_namespace: &str) -> Result<Settings, String> {
        let mut protected = vec![operator_namespace.to_string()];
        protected.extend(
            self.protected_namespaces
                .iter()
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty()),
        );
        let namespace_default = match self.default_namespace_label.as_deref() {
            Some(l) if !l.trim().is_empty() => {
                Some(NamespaceDefault::parse(l, &self.default_strategy)?)
            }
            _ => None,
        };
        if !(10..=600_000).contains(&self.freeze_budget_millis) {
            return Err(format!(
                "--eviction-freeze-budget-millis {}: must be between 10 and 600000",
                self.freeze_budget_millis
            ));
        }
        Ok(Settings {
            protected_namespaces: protected,
            namespace_default,
            freeze_budget_millis: Some(self.freeze_budget_millis),
        })
    }
}

// ------------------------------------------------------------------ the wire format

/// What the webhook reads of an `admission.k8s.io/v1` AdmissionReview.
#[derive(Debug, Deserialize)]
struct Review {
    request: Option<ReviewRequest>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReviewRequest {
    uid: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    operation: String,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    dry_run: bool,
    /// The Eviction: its `deleteOptions.dryRun` makes a dry run too (the API server
    /// sets the request's `dryRun` only from the query's options).
    #[serde(default)]
    object: Option<EvictionObject>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EvictionObject {
    #[serde(default)]
    delete_options: Option<EvictionDeleteOptions>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct EvictionDeleteOptions {
    #[serde(default)]
    dry_run: Vec<String>,
}

impl ReviewRequest {
    /// A dry run by the request's options or by the Eviction's own delete options.
    fn is_dry_run(&self) -> bool {
        self.dry_run
            || self
                .object
                .as_ref()
                .and_then(|o| o.delete_options.as_ref())
                .is_some_and(|d| !d.dry_run.is_empty())
    }
}

/// The answer as an AdmissionReview: allowed, or refused with `code` and `reason`.
fn review_response(uid: &str, refusal: Option<(u16, &str, &str)>) -> serde_json::Value {
    let response = match refusal {
        None => json!({ "uid": uid, "allowed": true }),
        Some((code, reason, message)) => json!({
            "uid": uid,
            "allowed": false,
            "status": { "status": "Failure", "code": code, "reason": reason, "message": message },
        }),
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": response,
    })
}

/// 429: `kubectl drain`, the autoscalers and the Eviction API's other clients retry.
fn too_many_requests(message: &str) -> Option<(u16, &'static str, String)> {
    Some((429, "TooManyRequests", message.to_string()))
}

// ------------------------------------------------------------------ the webhook

/// The running webhook: shared by every connection.
pub struct Webhook {
    ctx: Arc<Context>,
    cfg: WebhookConfig,
    settings: Settings,
    exec_probes: bool,
    /// The migration agents' namespace, whose pods never move.
    agents_namespace: String,
    tls: RwLock<Option<Arc<rustls::ServerConfig>>>,
}

impl Webhook {
    /// `exec_probes`: the migration controller's `--migration-exec-probes` (a pod
    /// whose readiness probe is an exec probe cannot move without it).
    pub fn new(
        ctx: Arc<Context>,
        cfg: WebhookConfig,
        exec_probes: bool,
        agents_namespace: String,
    ) -> anyhow::Result<Self> {
        let settings = cfg
            .settings(&ctx.config.namespace)
            .map_err(anyhow::Error::msg)?;
        if cfg.names.is_empty() {
            anyhow::bail!("--eviction-webhook-names: the serving certificate needs a name");
        }
        ctx.readiness.register(READINESS);
        Ok(Webhook {
            ctx,
            cfg,
            settings,
            exec_probes,
            agents_namespace,
            tls: RwLock::new(None),
        })
    }

    /// Serves until an error: the certificate keeper, the CA bundle writer and the
    /// listener.
    /// Once the operator is stopping, the listener's graceful stop decides when this
    /// ends: a keeper that fails then does not cut the answers under way.
    pub async fn run(self: Arc<Self>, pki: Pki) -> anyhow::Result<()> {
        let serve = self.clone().serve();
        tokio::pin!(serve);
        let keepers = async {
            tokio::select! {
                r = self.clone().keep_serving_cert(pki.clone()) => r,
                r = self.clone().keep_ca_bundle(pki) => r,
            }
        };
        tokio::select! {
            r = &mut serve => r,
            r = keepers => match r {
                Err(e) if self.ctx.stopping() => {
                    tracing::warn!(error = %e, "eviction webhook: a keeper ended while stopping");
                    serve.await
                }
                r => r,
            },
        }
    }

    /// Issues this replica's serving certificate from the signing CA, again at two
    /// thirds of its life and whenever the signing CA changes.
    async fn keep_serving_cert(self: Arc<Self>, pki: Pki) -> anyhow::Result<()> {
        let mut rx = pki.ca();
        let mut issued: Option<(String, i64)> = None;
        loop {
            let ca = rx.borrow_and_update().clone();
            let mut wait = Duration::from_secs(3600);
            if let Some(ca) = ca {
                let t = unix_now();
                let stale = issued
                    .as_ref()
                    .is_none_or(|(by, due)| *by != ca.signing.cert || t >= *due);
                if stale {
                    let (cert, key) = issue::webhook_serving_cert(
                        &ca.signing,
                        ca.signing_not_after(),
                        &self.cfg.names,
                        t,
                        &pki.life(),
                    )?;
                    let (nb, na) = podmotion_wire::client::cert_validity(cert.as_bytes())
                        .unwrap_or((t, t + 60));
                    *self.tls.write().expect("webhook tls") =
                        Some(Arc::new(server_config(&cert, &key)?));
                    issued = Some((ca.signing.cert.clone(), leaf_renewal_due(nb, na)));
                    self.ctx.readiness.set_ready(READINESS);
                    tracing::info!(names = ?self.cfg.names, "eviction webhook serving certificate in use");
                }
                if let Some((_, due)) = &issued {
                    wait = Duration::from_secs((due - t).clamp(1, 3600) as u64);
                }
            }
            tokio::select! {
                r = rx.changed() => r?,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The leader keeps the webhook configuration's `caBundle` equal to the CA bundle:
    /// on a CA change, on becoming the leader, and when the object changes.
    async fn keep_ca_bundle(self: Arc<Self>, pki: Pki) -> anyhow::Result<()> {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(self.ctx.client.clone());
        let mut objects = watcher::watcher(
            api.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", self.cfg.configuration)),
        )
        .boxed();
        let mut acquired = Box::pin(self.ctx.leader.on_acquire().fuse());
        let mut ca = pki.ca();
        let mut seen: Option<ValidatingWebhookConfiguration> = None;
        loop {
            tokio::select! {
                ev = objects.next() => match ev {
                    Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => seen = Some(o),
                    Some(Ok(watcher::Event::Delete(_) | watcher::Event::Init)) => seen = None,
                    Some(Ok(watcher::Event::InitDone)) => {}
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "webhook configuration watch");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    None => anyhow::bail!("webhook configuration watch ended"),
                },
                Some(()) = acquired.next() => {}
                r = ca.changed() => r?,
                // A write that failed is tried again.
                _ = tokio::time::sleep(Duration::from_secs(30)) => {}
            }
            let Some(bundle) = ca.borrow().as_ref().map(|c| c.bundle()) else {
                continue;
            };
            let Some(vwc) = &seen else { continue };
            if !self.ctx.writer.leads() || !needs_bundle(vwc, &bundle) {
                continue;
            }
            match self.write_bundle(&api, vwc, &bundle).await {
                Ok(()) => {
                    tracing::info!(configuration = %self.cfg.configuration, "eviction webhook CA bundle written")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "eviction webhook CA bundle not written; retrying")
                }
            }
        }
    }

    async fn write_bundle(
        &self,
        api: &Api<ValidatingWebhookConfiguration>,
        vwc: &ValidatingWebhookConfiguration,
        bundle: &str,
    ) -> anyhow::Result<()> {
        let encoded = k8s_openapi::ByteString(bundle.as_bytes().to_vec());
        let webhooks: Vec<serde_json::Value> = vwc
            .webhooks
            .iter()
            .flatten()
            .map(|w| json!({"name": w.name, "clientConfig": {"caBundle": encoded}}))
            .collect();
        // A strategic merge keyed by webhook name: only caBundle changes.
        let patch = Patch::Strategic(json!({ "webhooks": webhooks }));
        self.ctx
            .writer
            .patch(api, &vwc.name_any(), &PatchParams::default(), &patch)
            .await?;
        Ok(())
    }

    /// Accepts until the operator is asked to stop, then shuts down gracefully
    /// ([`crate::graceful`]): a replica evicted by a drain must not fail the API
    /// server's calls under the drain's other evictions.
    async fn serve(self: Arc<Self>) -> anyhow::Result<()> {
        let listener = TcpListener::bind(self.cfg.addr).await?;
        tracing::info!(addr = %self.cfg.addr, "serving the pods/eviction webhook");
        let grace = self.cfg.grace();
        let this = self.clone();
        graceful::serve(listener, self.ctx.shutdown(), grace, move |tcp, closing| {
            let this = this.clone();
            async move { this.connection(tcp, closing).await }
        })
        .await?;
        Ok(())
    }

    /// One connection: the TLS handshake, then HTTP/1.1 until the caller or the
    /// shutdown closes it.
    async fn connection(self: Arc<Self>, tcp: tokio::net::TcpStream, closing: graceful::Closing) {
        let Ok(peer) = tcp.peer_addr() else {
            return tracing::debug!("connection gone before its TLS handshake");
        };
        let Some(cfg) = self.tls.read().expect("webhook tls").clone() else {
            return tracing::debug!(%peer, "no serving certificate yet; connection dropped");
        };
        // The agents' acceptor: a TCP probe (closed before any byte) is debug, a
        // refused handshake info, with the peer.
        let Some(stream) = podmotion_wire::client::accept_tls(cfg, tcp, peer, "webhook").await
        else {
            return;
        };
        let this = self.clone();
        let handle = move |req: Request<Incoming>| {
            let this = this.clone();
            async move { this.route(req).await }
        };
        if let Err(e) = graceful::http1_connection(stream, handle, closing).await {
            tracing::debug!(error = %e, "webhook connection ended");
        }
    }

    async fn route(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::POST {
            return plain(StatusCode::METHOD_NOT_ALLOWED, "POST an AdmissionReview\n");
        }
        // An AdmissionReview of an Eviction is small; 1 MiB bounds what a caller can
        // make us buffer.
        let body = match Limited::new(req.into_body(), 1 << 20).collect().await {
            Ok(b) => b.to_bytes(),
            Err(e) => return plain(StatusCode::BAD_REQUEST, &format!("body: {e}\n")),
        };
        let review: Review = match serde_json::from_slice(&body) {
            Ok(r) => r,
            Err(e) => {
                return plain(
                    StatusCode::BAD_REQUEST,
                    &format!("not an AdmissionReview: {e}\n"),
                );
            }
        };
        let Some(r) = review.request else {
            return plain(StatusCode::BAD_REQUEST, "AdmissionReview without request\n");
        };
        let refusal = if r.operation == "CREATE" && r.sub_resource.as_deref() == Some("eviction") {
            // Inside the API server's timeout (a few seconds): a late answer is no answer.
            match tokio::time::timeout(Duration::from_secs(4), self.answer(&r)).await {
                Ok(x) => x,
                Err(_) => too_many_requests(&format!(
                    "PodMotion could not decide in time whether pod {} should live-migrate; retry",
                    r.name
                )),
            }
        } else {
            None
        };
        let out = review_response(
            &r.uid,
            refusal.as_ref().map(|(c, re, m)| (*c, *re, m.as_str())),
        );
        let mut resp = Response::new(Full::new(Bytes::from(out.to_string())));
        resp.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        resp
    }

    /// `None`: allowed; else the refusal `(code, reason, message)`.
    async fn answer(&self, r: &ReviewRequest) -> Option<(u16, &'static str, String)> {
        let ns = r.namespace.clone().unwrap_or_default();
        let facts = match self.read(&ns, &r.name).await {
            Ok(Some(f)) => f,
            // Nothing to evict: the API server answers 404 itself.
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(pod = %r.name, namespace = %ns, error = %e, "eviction: cannot read");
                return too_many_requests(&format!(
                    "PodMotion could not read what it needs to decide whether pod {} should \
                     live-migrate ({e}); retry",
                    r.name
                ));
            }
        };
        let answer = eviction::decide(
            &facts.pod,
            &facts.ns_labels,
            &self.settings,
            Some(&facts.verdict),
            &facts.migrations,
        );
        self.carry_out(&facts.object, answer, r.is_dry_run()).await
    }

    /// Creates what the answer asks for, counts it, records it on the pod.
    async fn carry_out(
        &self,
        pod: &Pod,
        answer: Answer,
        dry_run: bool,
    ) -> Option<(u16, &'static str, String)> {
        match answer {
            Answer::Evict(why) => {
                self.count_answer("Evicted");
                if let EvictWhy::CannotMove { reason } = &why {
                    let note = format!(
                        "evicted without live migration (LiveMigrateIfPossible): the pod cannot move ({reason})"
                    );
                    self.record(
                        pod,
                        EventType::Normal,
                        reasons::EVICTED_WITHOUT_MIGRATION,
                        note,
                    )
                    .await;
                }
                None
            }
            Answer::Migrating {
                migration,
                create,
                message,
            } => {
                if let (Some(new), false) = (create, dry_run)
                    && let Err(e) = self.create(pod, &new).await
                {
                    return too_many_requests(&format!(
                        "PodMotion could not start PodMigration {migration} ({e}); retry"
                    ));
                }
                self.count_answer("Migrating");
                too_many_requests(&message)
            }
            Answer::Blocked { cause, message } => Some(self.block(pod, &cause, message).await),
        }
    }

    /// Counts one answer of the webhook (Evicted, Migrating, Blocked).
    fn count_answer(&self, answer: &'static str) {
        self.ctx
            .metrics
            .evictions
            .get_or_create(&crate::metrics::EvictionLabels { answer })
            .inc();
    }

    /// A blocked eviction: counted (with its bounded cause), recorded on the pod as a
    /// Warning, refused with 403.
    async fn block(&self, pod: &Pod, cause: &str, message: String) -> (u16, &'static str, String) {
        self.count_answer("Blocked");
        self.ctx
            .metrics
            .evictions_blocked
            .get_or_create(&crate::metrics::BlockLabels {
                reason: eviction::bounded_cause(cause),
            })
            .inc();
        self.record(
            pod,
            EventType::Warning,
            reasons::EVICTION_BLOCKED,
            message.clone(),
        )
        .await;
        (403, "Forbidden", message)
    }

    async fn create(&self, pod: &Pod, new: &PodMigration) -> Result<(), WriteError> {
        let ns = pod.namespace().unwrap_or_default();
        let api: Api<PodMigration> = Api::namespaced(self.ctx.client.clone(), &ns);
        let pp = PostParams {
            field_manager: Some(managers::EVICTION.into()),
            ..Default::default()
        };
        // Created claimed by this release (`podmotion_core::claim`): the eviction this
        // release's webhook answered is its to carry out, and no other release's
        // operator races it for the claim.
        let mut new = new.clone();
        new.annotations_mut().insert(
            podmotion_api::names::annotations::CONTROLLER.into(),
            self.ctx.claims.me().into(),
        );
        // Unfenced: every replica creates it (see the module documentation).
        match self.ctx.writer.unfenced().create(&api, &pp, &new).await {
            Ok(_) => {
                self.ctx.metrics.eviction_migrations_started.inc();
                let note = format!(
                    "eviction answered by a live migration: PodMigration {} started",
                    new.name_any()
                );
                self.record(pod, EventType::Normal, reasons::EVICTION_MIGRATING, note)
                    .await;
                Ok(())
            }
            // Another retry or replica created it first.
            Err(e) if e.is_status(409) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// An Event on the pod, recorded by the replica that answered (its own act, not a
    /// controller's write: followers record too).
    async fn record(&self, pod: &Pod, type_: EventType, reason: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note.chars().take(1000).collect()),
            action: "Evict".into(),
            secondary: None,
        };
        // Unfenced: the replica that answered records its own act.
        let writer = self.ctx.writer.unfenced();
        writer.publish(&event, &pod.object_ref(&())).await;
    }

    /// What the decision needs; `None` when the pod does not exist.
    async fn read(&self, ns: &str, name: &str) -> Result<Option<Facts>, kube::Error> {
        let client = self.ctx.client.clone();
        let Some(pod) = Api::<Pod>::namespaced(client.clone(), ns)
            .get_opt(name)
            .await?
        else {
            return Ok(None);
        };
        let ns_labels = match &self.settings.namespace_default {
            Some(_) => Api::<Namespace>::all(client.clone())
                .get_metadata(ns)
                .await?
                .metadata
                .labels
                .unwrap_or_default(),
            None => BTreeMap::new(),
        };
        let evicted = EvictedPod::from_pod(&pod);
        // Only an opted-in pod costs more reads.
        let opted_in = !matches!(
            eviction::strategy(&evicted, &ns_labels, &self.settings),
            Ok(eviction::Strategy::Evict)
        );
        let (migrations, verdict) = if opted_in {
            let list = Api::<PodMigration>::namespaced(client.clone(), ns)
                .list(&ListParams::default())
                .await?;
            let migrations = list
                .items
                .iter()
                .map(KnownMigration::from_migration)
                .collect();
            let claims = read_claims(&client, ns, &pod).await?;
            let facts = PodFacts::from_pod(&pod).with_claims(&claims);
            let verdict = eviction::pod_verdict(
                &facts,
                &self.ctx.config.namespace,
                &self.agents_namespace,
                self.exec_probes,
            );
            (migrations, verdict)
        } else {
            (vec![], Verdict::Movable)
        };
        Ok(Some(Facts {
            pod: evicted,
            object: pod,
            ns_labels,
            migrations,
            verdict,
        }))
    }
}

struct Facts {
    pod: EvictedPod,
    object: Pod,
    ns_labels: BTreeMap<String, String>,
    migrations: Vec<KnownMigration>,
    verdict: Verdict,
}

/// Whether some webhook of `vwc` lacks `bundle` as its caBundle.
fn needs_bundle(vwc: &ValidatingWebhookConfiguration, bundle: &str) -> bool {
    vwc.webhooks.iter().flatten().any(|w| {
        w.client_config.ca_bundle.as_ref().map(|b| b.0.as_slice()) != Some(bundle.as_bytes())
    })
}

/// The claims `pod` mounts with their volumes (missing ones left out: the pre-flight
/// refuses a claim it has no facts for), as the migration controller reads them.
async fn read_claims(
    client: &kube::Client,
    ns: &str,
    pod: &Pod,
) -> Result<BTreeMap<String, ClaimFacts>, kube::Error> {
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let mut out = BTreeMap::new();
    for (_, name) in claim_names(pod) {
        if out.contains_key(&name) {
            continue;
        }
        let Some(pvc) = pvcs.get_opt(&name).await? else {
            continue;
        };
        let pv = match pvc.spec.as_ref().and_then(|s| s.volume_name.clone()) {
            Some(v) if !v.is_empty() => pvs.get_opt(&v).await?,
            _ => None,
        };
        out.insert(name, ClaimFacts::from_objects(&pvc, pv.as_ref()));
    }
    Ok(out)
}

/// TLS without client certificates (the API server presents none by default), HTTP/1.1.
fn server_config(cert_pem: &str, key_pem: &str) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(cert_pem.as_bytes()).collect::<Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

fn plain(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
    *r.status_mut() = status;
    r
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_carries_its_code_and_reason_to_the_api_server() {
        let v = review_response("u1", Some((429, "TooManyRequests", "migrating")));
        assert_eq!(v["response"]["uid"], "u1");
        assert_eq!(v["response"]["allowed"], false);
        assert_eq!(v["response"]["status"]["code"], 429);
        assert_eq!(v["response"]["status"]["reason"], "TooManyRequests");
        assert_eq!(v["response"]["status"]["message"], "migrating");
        let ok = review_response("u2", None);
        assert_eq!(ok["response"]["allowed"], true);
        assert_eq!(ok["kind"], "AdmissionReview");
    }

    #[test]
    fn an_eviction_review_is_read() {
        let r: Review = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "x", "name": "web", "namespace": "shop", "operation": "CREATE",
                "subResource": "eviction", "dryRun": true,
                "kind": {"group": "policy", "version": "v1", "kind": "Eviction"},
                "object": {"apiVersion": "policy/v1", "kind": "Eviction"}},
        }))
        .unwrap();
        let r = r.request.unwrap();
        assert_eq!(
            (r.name.as_str(), r.sub_resource.as_deref(), r.dry_run),
            ("web", Some("eviction"), true)
        );
    }

    #[test]
    fn an_eviction_whose_delete_options_are_a_dry_run_is_a_dry_run() {
        let r: Review = serde_json::from_value(json!({
            "request": {"uid": "x", "name": "web", "namespace": "shop", "dryRun": false,
                "object": {"apiVersion": "policy/v1", "kind": "Eviction",
                    "deleteOptions": {"dryRun": ["All"]}}},
        }))
        .unwrap();
        assert!(r.request.unwrap().is_dry_run());
        let r: Review = serde_json::from_value(json!({
            "request": {"uid": "x", "name": "web", "namespace": "shop",
                "object": {"apiVersion": "policy/v1", "kind": "Eviction"}},
        }))
        .unwrap();
        assert!(!r.request.unwrap().is_dry_run());
    }

    #[test]
    fn the_bundle_is_written_only_where_it_differs() {
        let vwc: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": "podmotion-eviction"},
            "webhooks": [{"name": "eviction.podmotion.io", "sideEffects": "NoneOnDryRun",
                "admissionReviewVersions": ["v1"],
                "clientConfig": {"caBundle": k8s_openapi::ByteString(b"A".to_vec())}}],
        }))
        .unwrap();
        assert!(!needs_bundle(&vwc, "A"));
        assert!(needs_bundle(&vwc, "B"));
    }

    #[test]
    fn settings_always_protect_the_operators_namespace() {
        let cfg = WebhookConfig {
            enabled: true,
            addr: "127.0.0.1:0".parse().unwrap(),
            configuration: "c".into(),
            names: vec!["svc".into()],
            protected_namespaces: vec!["agents".into(), " ".into()],
            default_namespace_label: Some("team=a".into()),
            default_strategy: "LiveMigrate".into(),
            shutdown_propagation_seconds: 10,
            freeze_budget_millis: 5000,
        };
        let s = cfg.settings("podmotion-system").unwrap();
        assert_eq!(s.protected_namespaces, vec!["podmotion-system", "agents"]);
        assert!(s.namespace_default.is_some());
        let bad = WebhookConfig {
            default_strategy: "Always".into(),
            ..cfg.clone()
        };
        assert!(bad.settings("ns").is_err());
        let bad = WebhookConfig {
            freeze_budget_millis: 5,
            ..cfg.clone()
        };
        assert!(bad.settings("ns").is_err());
        assert_eq!(cfg.settings("ns").unwrap().freeze_budget_millis, Some(5000));
    }
}
