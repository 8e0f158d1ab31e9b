//! The I/O around [`super::plan`]: the CA Secret (read by every replica, written by the
//! leader only), the CA bundle ConfigMap the agents read, the migration master key
//! Secret and the operator's own client certificate (in memory, per replica). The signer
//! of node agents' CertificateSigningRequests is [`super::signer`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::events::Reporter;
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use podmotion_wire::client::{TlsFiles, TlsMaterial, cert_validity};
use serde_json::json;
use tokio::sync::watch;

use super::issue::{self, CaPem};
use super::plan::{self, AgentPolicy, CaCert, CaState, CaStep, Lifetimes};
use crate::leader::Leadership;
use crate::writer::Writer;

/// Field manager of everything this module writes.
pub const MANAGER: &str = "podmotion.io/pki";

/// Where the key material lives and who may ask for it.
#[derive(Clone, Debug)]
pub struct PkiSettings {
    /// The operator's namespace: the CA Secret (and the master key Secret) live here.
    pub namespace: String,
    pub ca_secret: String,
    /// The agents' namespace and the ConfigMap there holding the CA bundle (`ca.crt`).
    pub bundle_namespace: String,
    pub bundle_configmap: String,
    pub agents: AgentPolicy,
    pub life: Lifetimes,
}

/// The CA as loaded from its Secret.
#[derive(Clone, Debug)]
pub struct LoadedCa {
    pub state: CaState,
    pub signing: CaPem,
    pub next: Option<CaPem>,
}

impl LoadedCa {
    pub fn bundle(&self) -> String {
        plan::bundle(&self.state)
    }
    pub fn signing_not_after(&self) -> i64 {
        self.state.current.as_ref().map_or(0, |c| c.not_after)
    }
}

pub(super) fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[derive(Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Rotation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_introduced_at: Option<i64>,
    #[serde(default)]
    retired: Vec<plan::Retired>,
}

fn data_str(s: &Secret, key: &str) -> Option<String> {
    s.data
        .as_ref()?
        .get(key)
        .and_then(|b| String::from_utf8(b.0.clone()).ok())
}

fn ca_cert(pem: &str) -> Option<CaCert> {
    let (not_before, not_after) = cert_validity(pem.as_bytes())?;
    Some(CaCert {
        cert_pem: pem.to_string(),
        not_before,
        not_after,
    })
}

/// The CA the Secret `name` holds (`None`: there is none); `Err` when it cannot be
/// used, which is logged.
fn usable_ca(seen: Option<&Secret>, name: &str) -> Result<Option<LoadedCa>, ()> {
    match seen.map(parse_ca_secret) {
        Some(Ok(l)) => Ok(Some(l)),
        Some(Err(e)) => {
            tracing::error!(secret = %name, error = %e, "the CA Secret cannot be used; fix or delete it");
            Err(())
        }
        None => Ok(None),
    }
}

/// Reads the CA Secret; `Err` when it exists but cannot be used (never overwritten:
/// an operator must look at it).
pub fn parse_ca_secret(s: &Secret) -> Result<LoadedCa, String> {
    let cert = data_str(s, "ca.crt").ok_or("no ca.crt")?;
    let key = data_str(s, "ca.key").ok_or("no ca.key")?;
    let current = ca_cert(&cert).ok_or("ca.crt does not parse")?;
    let rot: Rotation = match data_str(s, "rotation.json") {
        Some(j) => serde_json::from_str(&j).map_err(|e| format!("rotation.json: {e}"))?,
        None => Rotation::default(),
    };
    let next = match (data_str(s, "next.crt"), data_str(s, "next.key")) {
        (Some(c), Some(k)) => Some(CaPem { cert: c, key: k }),
        _ => None,
    };
    let next_state = match (&next, rot.next_introduced_at) {
        (Some(n), Some(at)) => Some((ca_cert(&n.cert).ok_or("next.crt does not parse")?, at)),
        _ => None,
    };
    Ok(LoadedCa {
        state: CaState {
            current: Some(current),
            next: next_state,
            retired: rot.retired,
        },
        signing: CaPem { cert, key },
        next: next.filter(|_| rot.next_introduced_at.is_some()),
    })
}

/// The Secret data for a CA state.
fn ca_secret_data(ca: &LoadedCa) -> BTreeMap<String, ByteString> {
    let mut d = BTreeMap::new();
    let mut put = |k: &str, v: &str| {
        d.insert(k.to_string(), ByteString(v.as_bytes().to_vec()));
    };
    put("ca.crt", &ca.signing.cert);
    put("ca.key", &ca.signing.key);
    let rot = Rotation {
        next_introduced_at: ca.state.next.as_ref().map(|(_, at)| *at),
        retired: ca.state.retired.clone(),
    };
    if let Some(n) = &ca.next {
        put("next.crt", &n.cert);
        put("next.key", &n.key);
    }
    put(
        "rotation.json",
        &serde_json::to_string(&rot).expect("rotation serializes"),
    );
    put("ca-bundle.crt", &ca.bundle());
    d
}

/// The CA after `step` (None: nothing to do).
fn apply_step(
    cur: Option<&LoadedCa>,
    step: &CaStep,
    life: &Lifetimes,
    t: i64,
) -> anyhow::Result<Option<LoadedCa>> {
    Ok(match (step, cur) {
        (CaStep::Nothing, _) => None,
        (CaStep::Create, _) | (_, None) => {
            let pem = issue::new_ca(t, life)?;
            Some(LoadedCa {
                state: CaState {
                    current: Some(ca_cert(&pem.cert).expect("fresh CA parses")),
                    next: None,
                    retired: vec![],
                },
                signing: pem,
                next: None,
            })
        }
        (CaStep::Introduce, Some(c)) => {
            let pem = issue::new_ca(t, life)?;
            let mut n = c.clone();
            n.state.next = Some((ca_cert(&pem.cert).expect("fresh CA parses"), t));
            n.next = Some(pem);
            Some(n)
        }
        (CaStep::Promote, Some(c)) => {
            let mut n = c.clone();
            n.state = plan::promote(&c.state, life, t);
            if let Some(next) = n.next.take() {
                n.signing = next;
            }
            Some(n)
        }
        (CaStep::DropRetired, Some(c)) => {
            let mut n = c.clone();
            n.state = plan::drop_retired(&c.state, t);
            Some(n)
        }
    })
}

/// The operator's PKI: run [`Pki::run`]; read the CA through [`Pki::ca`] and use
/// [`Pki::operator_tls`] for every connection to an agent.
#[derive(Clone)]
pub struct Pki {
    client: Client,
    settings: Arc<PkiSettings>,
    leader: Leadership,
    /// Every write of this module, fenced by `leader`.
    writer: Writer,
    ca: watch::Sender<Option<Arc<LoadedCa>>>,
    tls: TlsFiles,
    /// The ValidatingAdmissionPolicyBinding letting only the operator write the key
    /// material (`--pki-key-material-policy`); `None`: no provenance check.
    protection: Option<String>,
}

impl Pki {
    pub fn new(client: Client, settings: PkiSettings, leader: Leadership) -> anyhow::Result<Self> {
        settings.life.validate().map_err(anyhow::Error::msg)?;
        let (ca, _) = watch::channel(None);
        let reporter = Reporter {
            controller: "podmotion-operator".into(),
            instance: None,
        };
        Ok(Pki {
            writer: Writer::fenced(client.clone(), leader.clone(), reporter),
            client,
            settings: Arc::new(settings),
            leader,
            ca,
            tls: TlsFiles::from_pem(vec![], vec![], vec![]),
            protection: None,
        })
    }

    /// Adopts only key material created while the policy binding `binding` let only
    /// the operator write it ([`plan::provenance`]).
    pub fn with_protection(mut self, binding: Option<String>) -> Self {
        self.protection = binding.filter(|b| !b.is_empty());
        self
    }

    /// The operator's client identity for the agents (renewed in place).
    pub fn operator_tls(&self) -> TlsFiles {
        self.tls.clone()
    }

    /// The lifetimes leaves are issued with.
    pub fn life(&self) -> Lifetimes {
        self.settings.life
    }

    /// The CA as last read.
    pub fn ca(&self) -> watch::Receiver<Option<Arc<LoadedCa>>> {
        self.ca.subscribe()
    }

    /// The settings: where the key material lives, who may ask for it.
    pub fn settings(&self) -> &PkiSettings {
        &self.settings
    }

    /// Runs the CA keeper and the operator certificate until one fails. The agents'
    /// signer is a controller of its own ([`super::signer::run`]).
    pub async fn run(self) -> anyhow::Result<()> {
        tokio::select! {
            r = self.clone().keep_ca() => r,
            r = self.clone().keep_operator_cert() => r,
        }
    }

    /// Watches the CA Secret; the leader creates it, rotates it and publishes the bundle.
    async fn keep_ca(self) -> anyhow::Result<()> {
        let s = &self.settings;
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &s.namespace);
        let mut events = watcher::watcher(
            secrets.clone(),
            watcher::Config::default().fields(&format!("metadata.name={}", s.ca_secret)),
        )
        .boxed();
        let mut acquired = Box::pin(self.leader.on_acquire().fuse());
        let mut seen: Option<Secret> = None;
        let mut synced = false;
        let mut published: Option<String> = None;
        let mut wait = Duration::from_secs(0);
        loop {
            tokio::select! {
                ev = events.next() => match ev {
                    Some(Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o))) => seen = Some(o),
                    Some(Ok(watcher::Event::Delete(_))) => seen = None,
                    Some(Ok(watcher::Event::Init)) => seen = None,
                    Some(Ok(watcher::Event::InitDone)) => synced = true,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "CA Secret watch");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        continue;
                    }
                    None => anyhow::bail!("CA Secret watch ended"),
                },
                Some(()) = acquired.next() => { published = None; }
                _ = tokio::time::sleep(wait) => {}
            }
            if !synced {
                continue;
            }
            wait = self
                .ca_round(&secrets, seen.as_ref(), &mut published)
                .await?;
        }
    }

    /// One look at the CA Secret seen, once the watch has synced: unless it is not to be
    /// trusted or cannot be used, the leader creates or rotates it, or this replica puts
    /// it in use. Returns how long to wait before looking again (the watch may wake us
    /// sooner).
    async fn ca_round(
        &self,
        secrets: &Api<Secret>,
        seen: Option<&Secret>,
        published: &mut Option<String>,
    ) -> anyhow::Result<Duration> {
        let s = &self.settings;
        if let Some(planted) = seen
            && let Some(wait) = self.distrusted(secrets, planted).await
        {
            return Ok(wait);
        }
        let Ok(loaded) = usable_ca(seen, &s.ca_secret) else {
            return Ok(Duration::from_secs(60));
        };
        let t = now();
        let step = match &loaded {
            Some(l) => plan::ca_step(&l.state, &s.life, t),
            None => CaStep::Create,
        };
        if step != CaStep::Nothing && self.writer.leads() {
            self.take_ca_step(secrets, seen, loaded.as_ref(), &step, t)
                .await?;
            // The watch brings the new version (or the winner's).
            return Ok(Duration::from_secs(2));
        }
        Ok(match loaded {
            Some(l) => self.serve_ca(l, t, published).await,
            // No CA and not the leader: the leader makes it; its write wakes us.
            None => Duration::from_secs(3600),
        })
    }

    /// Whether the CA Secret seen is not to be trusted ([`untrusted`]): `None` when it
    /// may be used, else how long to wait before looking again (the leader deletes an
    /// untrusted one, to create its own).
    async fn distrusted(&self, secrets: &Api<Secret>, planted: &Secret) -> Option<Duration> {
        match untrusted(&self.client, self.protection.as_deref(), planted).await {
            Ok(None) => None,
            Ok(Some(why)) => {
                tracing::error!(secret = %self.settings.ca_secret, error = %why, "the CA Secret is not used");
                if self.writer.leads() {
                    replace_untrusted(&self.writer, secrets, planted).await;
                }
                Some(Duration::from_secs(10))
            }
            Err(e) => {
                tracing::warn!(error = %e, "reading the key material's admission policy binding");
                Some(Duration::from_secs(5))
            }
        }
    }

    /// Creates or rotates the CA (the leader); a failed write is only logged, and tried
    /// again on the watch's next event.
    async fn take_ca_step(
        &self,
        secrets: &Api<Secret>,
        seen: Option<&Secret>,
        loaded: Option<&LoadedCa>,
        step: &CaStep,
        t: i64,
    ) -> anyhow::Result<()> {
        let next = apply_step(loaded, step, &self.settings.life, t)?
            .expect("a step other than Nothing changes the CA");
        match self.write_ca(secrets, seen, &next).await {
            Ok(()) => tracing::info!(?step, "CA updated"),
            Err(e) => tracing::warn!(?step, error = %e, "CA not updated; retrying"),
        }
        Ok(())
    }

    /// Puts the current CA in use: the leader publishes its bundle (once per leadership
    /// and change), and this replica signs with it. Returns how long to wait before
    /// looking again (the CA's next event, sooner while the bundle is unpublished).
    async fn serve_ca(&self, l: LoadedCa, t: i64, published: &mut Option<String>) -> Duration {
        let bundle = l.bundle();
        if self.writer.leads() && published.as_deref() != Some(bundle.as_str()) {
            match self.publish_bundle(&bundle).await {
                Ok(()) => *published = Some(bundle),
                Err(e) => tracing::warn!(error = %e, "CA bundle not published; retrying"),
            }
        }
        let due = plan::ca_next_event(&l.state, &self.settings.life).unwrap_or(t + 3600);
        let mut wait = Duration::from_secs((due - t).clamp(1, 3600) as u64);
        if published.is_none() && self.writer.leads() {
            wait = wait.min(Duration::from_secs(5));
        }
        let changed = self
            .ca
            .borrow()
            .as_ref()
            .is_none_or(|c| c.signing != l.signing || c.state != l.state);
        if changed {
            self.ca.send_replace(Some(Arc::new(l)));
        }
        wait
    }

    async fn write_ca(
        &self,
        api: &Api<Secret>,
        old: Option<&Secret>,
        ca: &LoadedCa,
    ) -> anyhow::Result<()> {
        let s = &self.settings;
        let meta = ObjectMeta {
            name: Some(s.ca_secret.clone()),
            namespace: Some(s.namespace.clone()),
            resource_version: old.and_then(|o| o.metadata.resource_version.clone()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/managed-by".to_string(),
                    "podmotion".to_string(),
                ),
                ("app.kubernetes.io/component".to_string(), "pki".to_string()),
            ])),
            ..Default::default()
        };
        let secret = Secret {
            metadata: meta,
            type_: Some("Opaque".into()),
            data: Some(ca_secret_data(ca)),
            ..Default::default()
        };
        // Optimistic concurrency: a replace carries the resourceVersion we read, so two
        // replicas that both believe they lead cannot both rotate.
        let pp = PostParams::default();
        match old {
            None => self.writer.create(api, &pp, &secret).await.map(|_| ())?,
            Some(_) => {
                let name = &s.ca_secret;
                self.writer
                    .replace(api, name, &pp, &secret)
                    .await
                    .map(|_| ())?
            }
        }
        Ok(())
    }

    async fn publish_bundle(&self, bundle: &str) -> anyhow::Result<()> {
        let s = &self.settings;
        let api: Api<ConfigMap> = Api::namespaced(self.client.clone(), &s.bundle_namespace);
        let cm = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": s.bundle_configmap,
                "labels": {
                    "app.kubernetes.io/managed-by": "podmotion",
                    "app.kubernetes.io/component": "pki",
                },
            },
            "data": { "ca.crt": bundle },
        });
        let pp = PatchParams::apply(MANAGER).force();
        self.writer
            .patch(&api, &s.bundle_configmap, &pp, &Patch::Apply(&cm))
            .await?;
        tracing::info!(configmap = %s.bundle_configmap, "CA bundle published");
        Ok(())
    }

    /// Issues this replica's client certificate from the signing CA, again at two
    /// thirds of its life and whenever the signing CA changes; the bundle follows the
    /// CA's.
    async fn keep_operator_cert(self) -> anyhow::Result<()> {
        let mut rx = self.ca.subscribe();
        let mut issued: Option<(String, i64)> = None; // (signing CA cert, renew at)
        loop {
            let ca = rx.borrow_and_update().clone();
            let mut wait = Duration::from_secs(3600);
            if let Some(ca) = ca {
                let t = now();
                let stale = issued
                    .as_ref()
                    .is_none_or(|(by, due)| *by != ca.signing.cert || t >= *due);
                let mut m = self.tls.material();
                m.ca_pem = ca.bundle().into_bytes();
                if stale {
                    let (cert, key) = issue::operator_cert(
                        &ca.signing,
                        ca.signing_not_after(),
                        t,
                        &self.settings.life,
                    )?;
                    let (nb, na) = cert_validity(cert.as_bytes()).unwrap_or((t, t + 60));
                    issued = Some((ca.signing.cert.clone(), plan::leaf_renewal_due(nb, na)));
                    m.cert_pem = cert.into_bytes();
                    m.key_pem = key.into_bytes();
                }
                match self.tls.set(m) {
                    Ok(true) => tracing::info!(
                        renewed = stale,
                        "operator client certificate and CA bundle in use"
                    ),
                    Ok(false) => {}
                    Err(e) => tracing::error!(error = %e, "operator TLS material rejected"),
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
}

/// Why `obj` must not be adopted as key material (`Ok(None)`: it may), given the
/// policy binding `protection` (`None`: no check).
async fn untrusted<K: ResourceExt>(
    client: &Client,
    protection: Option<&str>,
    obj: &K,
) -> Result<Option<plan::Untrusted>, kube::Error> {
    use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding;
    let Some(binding) = protection else {
        return Ok(None);
    };
    let since = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .get_opt(binding)
        .await?
        .and_then(|b| b.metadata.creation_timestamp)
        .map(|t| t.0.as_second());
    let created = obj
        .meta()
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_second());
    Ok(plan::provenance(binding, created, since).err())
}

/// Deletes key material that is not trusted (that very object: uid and version as
/// read), through the fenced writer, so that the leader makes its own in its place.
async fn replace_untrusted(writer: &Writer, api: &Api<Secret>, s: &Secret) {
    let dp = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: s.metadata.uid.clone(),
            resource_version: s.metadata.resource_version.clone(),
        }),
        ..Default::default()
    };
    match writer.delete(api, &s.name_any(), &dp).await {
        Ok(_) => {
            tracing::warn!(secret = %s.name_any(), "untrusted key material deleted; the leader makes its own")
        }
        Err(e) => {
            tracing::warn!(secret = %s.name_any(), error = %e, "untrusted key material not deleted")
        }
    }
}

/// The migration master key from `name` in `namespace`, created (64 random characters)
/// by the leader when absent (through `writer`, fenced). Followers wait for the
/// leader's.
pub async fn master_key(
    client: &Client,
    namespace: &str,
    name: &str,
    writer: &Writer,
    protection: Option<&str>,
) -> anyhow::Result<Vec<u8>> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    loop {
        if let Some(s) = api.get_opt(name).await? {
            if let Some(why) = untrusted(client, protection, &s).await? {
                tracing::error!(secret = %name, error = %why, "the master key Secret is not used");
                if writer.leads() {
                    replace_untrusted(writer, &api, &s).await;
                }
                tokio::time::sleep(Duration::from_secs(2)).await;
                continue;
            }
            let key = s
                .data
                .as_ref()
                .and_then(|d| d.get("key"))
                .map(|b| b.0.clone())
                .ok_or_else(|| anyhow::anyhow!("Secret {namespace}/{name} has no `key` entry"))?;
            return Ok(key);
        }
        if writer.leads() {
            let secret = Secret {
                metadata: ObjectMeta {
                    name: Some(name.into()),
                    namespace: Some(namespace.into()),
                    labels: Some(BTreeMap::from([
                        (
                            "app.kubernetes.io/managed-by".to_string(),
                            "podmotion".to_string(),
                        ),
                        ("app.kubernetes.io/component".to_string(), "pki".to_string()),
                    ])),
                    ..Default::default()
                },
                type_: Some("Opaque".into()),
                data: Some(BTreeMap::from([(
                    "key".to_string(),
                    ByteString(random_key()),
                )])),
                ..Default::default()
            };
            match writer.create(&api, &PostParams::default(), &secret).await {
                Ok(_) => tracing::info!(secret = %name, "migration master key created"),
                Err(e) if e.is_status(409) => {}
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

/// 64 characters from [A-Za-z0-9] (what the chart used to generate), from the OS RNG.
fn random_key() -> Vec<u8> {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..64)
        .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())])
        .collect()
}

/// Builds the operator's TLS material from a CA for tests and tools: a fresh client
/// certificate and the bundle.
pub fn operator_material(ca: &LoadedCa, life: &Lifetimes) -> anyhow::Result<TlsMaterial> {
    let (cert, key) = issue::operator_cert(&ca.signing, ca.signing_not_after(), now(), life)?;
    Ok(TlsMaterial {
        ca_pem: ca.bundle().into_bytes(),
        cert_pem: cert.into_bytes(),
        key_pem: key.into_bytes(),
    })
}
