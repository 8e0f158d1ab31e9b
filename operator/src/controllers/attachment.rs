//! The NodeAgentAttachment controller: the thin I/O shell around `crate::attachment`.
//!
//! One reconcile handles one attachment's *workload*: it observes the workload, its
//! pods (through the workload's selector), the agent Jobs labelled for it and the
//! ingest Leases of its attachments, asks [`plan`] what to do, creates and deletes Jobs
//! (always foreground), and writes the attachment's status only when it changed. The
//! same function serves the finalizer (the attachment, deleting, claims nothing; the
//! finalizer goes once no unwanted Job is left), lease expiry (a requeue at the earliest
//! expiry) and the periodic orphan sweep (every workload that has agent Jobs, deletes
//! only), so all removal paths go through the one reaping predicate.
//!
//! Reads come from caches, not from lists: the attachments (the controller's store),
//! and projection caches ([`crate::cache`]) of all pods (a `PodView` each) and the
//! agent Jobs (a `JobView` each). Only the workload itself (for its selector) and
//! ingest Leases are read per reconcile. A change of a cached projection wakes the
//! attachments it concerns (a pod: those of its namespace; a Job: those of its
//! workload); updates the core cannot see wake nothing.
//!
//! A Job is created suspended; its credential Secret (owned by the Job) is created
//! next, then the Job is resumed. Secrets are never read: a Job still suspended is one
//! whose Secret is not confirmed, and is resumed the same way.
//!
//! Nothing is decided before every cache has its first complete list, and the
//! controller records its own writes in the caches at once. Nothing polls the API
//! server except the orphan sweep, by design.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::{Args, Parser};
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::core::{Selector, SelectorExt};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::wait::{await_condition, conditions};
use kube::runtime::watcher::{self, watcher};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{AttachMode, WorkloadKind, WorkloadRef};
use podmotion_api::names::{annotations, finalizers, labels, managers, reasons};
use rand::RngCore;
use serde_json::json;

use super::{CategorizedError, controller_config, reconcile_guard, timed};
use crate::attachment::observed::workload_key;
use crate::attachment::plan::{Deletion, Plan, Resume};
use crate::attachment::render::{self, Settings};
use crate::attachment::{AttachmentView, JobFate, JobView, ObservedGroup, PodView, plan};
use crate::cache::{self, Key, Projection};
use crate::context::Context;
use crate::events::publish;
use crate::leader::NotLeader;

const NAME: &str = "attachment";

/// Settings of the attachment controller (flags with environment fallbacks).
#[derive(Args, Clone, Debug)]
pub struct AttachmentConfig {
    /// Prefix of every agent Job's name (`<prefix>-<hash of namespace/pod>`).
    #[arg(
        long = "attachment-job-prefix",
        env = "PODMOTION_ATTACHMENT_JOB_PREFIX",
        default_value = "podmotion-agent"
    )]
    pub job_prefix: String,
    /// Agent image for attachments that do not name one.
    #[arg(
        long = "attachment-agent-image",
        env = "PODMOTION_ATTACHMENT_AGENT_IMAGE",
        default_value = "ghcr.io/podmotion/attach:0.1.0"
    )]
    pub agent_image: String,
    /// Host path mounted read-only as the container-runtime socket (directory) when an
    /// attachment does not name one.
    #[arg(
        long = "attachment-cri-socket-path",
        env = "PODMOTION_ATTACHMENT_CRI_SOCKET_PATH",
        default_value = "/run"
    )]
    pub cri_socket_path: String,
    /// Seconds between orphan sweeps (one also runs at start).
    #[arg(
        long = "attachment-sweep-seconds",
        env = "PODMOTION_ATTACHMENT_SWEEP_SECONDS",
        default_value_t = 60
    )]
    pub sweep_seconds: u64,
    /// Most Job creations or deletions in flight for one reconcile.
    #[arg(
        long = "attachment-write-parallelism",
        env = "PODMOTION_ATTACHMENT_WRITE_PARALLELISM",
        default_value_t = 16
    )]
    pub write_parallelism: usize,
    /// Retries of a failing agent pod before its Job fails (and is replaced).
    #[arg(
        long = "attachment-backoff-limit",
        env = "PODMOTION_ATTACHMENT_BACKOFF_LIMIT",
        default_value_t = 3
    )]
    pub backoff_limit: i32,
    /// Namespace of the agent Jobs (and their Secrets and NetworkPolicy). Their pods
    /// use hostPID and capabilities, so it must enforce the `privileged` PodSecurity
    /// level. Unset: the operator's own namespace.
    #[arg(long = "attachment-namespace", env = "PODMOTION_ATTACHMENT_NAMESPACE")]
    pub jobs_namespace: Option<String>,
    /// Only handle attachments (and watch pods) in this namespace. Unset: every namespace.
    #[arg(
        long = "attachment-watch-namespace",
        env = "PODMOTION_ATTACHMENT_WATCH_NAMESPACE"
    )]
    pub watch_namespace: Option<String>,
}

impl AttachmentConfig {
    /// The settings from the environment alone (until the binary flattens the flags).
    pub fn from_env() -> anyhow::Result<AttachmentConfig> {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            a: AttachmentConfig,
        }
        Ok(Only::try_parse_from(["podmotion-operator"])?.a)
    }

    /// Namespace of the agent Jobs, given the operator's own.
    pub fn jobs_namespace_or(&self, operator_namespace: &str) -> String {
        self.jobs_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| operator_namespace.into())
    }

    pub fn settings(&self, operator_namespace: &str) -> Settings {
        Settings {
            namespace: self.jobs_namespace_or(operator_namespace),
            job_prefix: self.job_prefix.clone(),
            default_image: self.agent_image.clone(),
            default_cri_socket_path: self.cri_socket_path.clone(),
            backoff_limit: self.backoff_limit,
        }
    }
}

/// Errors of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("{verb} {what}: {source}")]
    Api {
        verb: &'static str,
        what: String,
        source: kube::Error,
    },
}

impl CategorizedError for AttachmentError {
    fn category(&self) -> &'static str {
        match self {
            AttachmentError::NotLeader(_) => "NotLeader",
            AttachmentError::Api { .. } => "ApiError",
        }
    }
}

fn api_err(
    verb: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(kube::Error) -> AttachmentError {
    let what = what.into();
    move |source| AttachmentError::Api { verb, what, source }
}

fn is_status(e: &kube::Error, code: u16) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == code)
}

struct Shared {
    ctx: Arc<Context>,
    cfg: AttachmentConfig,
    settings: Settings,
    store: Store<NodeAgentAttachment>,
    pods: Arc<Projection<PodView>>,
    jobs: Arc<Projection<JobView>>,
    policy_applied: AtomicBool,
}

impl Shared {
    /// Whether every cache has its first complete list (the attachments' store is
    /// waited for by the controller runtime itself).
    fn caches_ready(&self) -> bool {
        self.pods.is_ready() && self.jobs.is_ready()
    }

    fn job_key(&self, name: &str) -> Key {
        (self.settings.namespace.clone(), name.into())
    }
}

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let cfg = AttachmentConfig::from_env()?;
    run_with(ctx, cfg).await
}

/// Runs the controller (and its orphan sweep) with explicit settings.
pub async fn run_with(ctx: Arc<Context>, cfg: AttachmentConfig) -> anyhow::Result<()> {
    let client = ctx.client.clone();
    let settings = cfg.settings(&ctx.config.namespace);
    let (attachments, pods): (Api<NodeAgentAttachment>, Api<Pod>) = match &cfg.watch_namespace {
        Some(ns) => (
            Api::namespaced(client.clone(), ns),
            Api::namespaced(client.clone(), ns),
        ),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let controller = Controller::new(attachments, watcher::Config::default().any_semantic());
    let shared = Arc::new(Shared {
        ctx: ctx.clone(),
        store: controller.store(),
        pods: Arc::new(Projection::new()),
        jobs: Arc::new(Projection::new()),
        policy_applied: AtomicBool::new(false),
        cfg,
        settings,
    });
    let s = shared.clone();
    let pod_triggers = cache::feed(
        &ctx,
        "attachment-pods",
        watcher(pods, paged()),
        shared.pods.clone(),
        |p: &Pod| Some(PodView::from_pod(p)),
        move |c| attachments_in_namespace(&s.store, &c.key.0),
    );
    let s = shared.clone();
    let job_triggers = cache::feed(
        &ctx,
        "attachment-jobs",
        watcher(
            Api::<Job>::namespaced(client.clone(), &shared.settings.namespace),
            paged().labels(&render::agent_selector()),
        ),
        shared.jobs.clone(),
        JobView::from_job,
        move |c| {
            c.latest()
                .map(|j| attachments_of_job(&s.store, j))
                .unwrap_or_default()
        },
    );
    let controller = controller
        .reconcile_on(stream::select(pod_triggers, job_triggers))
        .reconcile_all_on(ctx.leader.on_acquire())
        // No debounce: a new attachment gets its Jobs at once. A reconcile reads caches
        // (one GET), triggers that arrive while it runs are coalesced into one rerun by
        // the runtime, and changes the plan cannot see wake nothing.
        .with_config(controller_config(&ctx).debounce(Duration::ZERO))
        .graceful_shutdown_on(ctx.shutdown());

    super::mark_ready_when_synced(&ctx, NAME, shared.store.clone());
    let sweeper = shared.clone();
    tokio::spawn(async move {
        let stop = sweeper.ctx.shutdown();
        tokio::pin!(stop);
        // The first sweep runs as soon as every cache is synced: it reaps what was
        // orphaned while the operator was down.
        while !(sweeper.caches_ready() && sweeper.ctx.readiness.is_ready(NAME)) {
            tokio::select! {
                _ = &mut stop => return,
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
        let mut tick = tokio::time::interval(Duration::from_secs(sweeper.cfg.sweep_seconds.max(1)));
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tick.tick() => {}
            }
            if sweeper.ctx.leader.is_leader() {
                match sweep(&sweeper).await {
                    Ok(n) if n > 0 => tracing::info!(reaped = n, "orphan sweep reaped agent Jobs"),
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(category = e.category(), error = %e, "orphan sweep failed")
                    }
                }
            }
        }
    });

    controller
        .run(reconcile, error_policy, shared)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "attachment reconcile");
            }
        })
        .await;
    Ok(())
}

fn error_policy(_a: Arc<NodeAgentAttachment>, err: &AttachmentError, _s: Arc<Shared>) -> Action {
    tracing::warn!(category = err.category(), error = %err, "attachment reconcile failed");
    Action::requeue(Duration::from_secs(2))
}

/// The list-then-watch of a cache: small pages, not `any_semantic` (the API server's
/// watch cache serves such a list whole, ignoring the page size). Each page is decoded
/// as full objects before it is projected, and the allocator keeps the largest such
/// moment: 500-pod pages left the operator at 91 MiB with 10,000 pods, 100-pod pages
/// at 48 MiB (`bench_operator_rss`).
fn paged() -> watcher::Config {
    watcher::Config::default().page_size(100)
}

/// A Job wakes every attachment of the workload it was made for.
fn attachments_of_job(
    store: &Store<NodeAgentAttachment>,
    job: &JobView,
) -> Vec<ObjectRef<NodeAgentAttachment>> {
    store
        .state()
        .iter()
        .filter(|a| {
            a.namespace().as_deref() == Some(job.target_namespace.as_str())
                && workload_key(&a.spec.workload_ref) == job.workload
        })
        .map(|a| ObjectRef::from_obj(a.as_ref()))
        .collect()
}

/// A pod wakes the attachments of its namespace (there are few; each selects its
/// workload's pods from the cache).
fn attachments_in_namespace(
    store: &Store<NodeAgentAttachment>,
    ns: &str,
) -> Vec<ObjectRef<NodeAgentAttachment>> {
    store
        .state()
        .iter()
        .filter(|a| a.namespace().as_deref() == Some(ns))
        .map(|a| ObjectRef::from_obj(a.as_ref()))
        .collect()
}

async fn reconcile(a: Arc<NodeAgentAttachment>, s: Arc<Shared>) -> Result<Action, AttachmentError> {
    if let Some(action) = reconcile_guard(&s.ctx) {
        return Ok(action);
    }
    timed(&s.ctx, NAME, reconcile_inner(a, &s)).await
}

async fn reconcile_inner(
    a: Arc<NodeAgentAttachment>,
    s: &Shared,
) -> Result<Action, AttachmentError> {
    if !s.caches_ready() {
        // Deciding on a cache that has not listed yet could reap wanted Jobs.
        return Ok(Action::requeue(Duration::from_millis(250)));
    }
    let ns = a.namespace().unwrap_or_default();
    let name = a.name_any();
    let api: Api<NodeAgentAttachment> = Api::namespaced(s.ctx.client.clone(), &ns);
    let has_finalizer = a
        .finalizers()
        .iter()
        .any(|f| f == finalizers::ATTACHMENT_CLEANUP);
    let deleting = a.metadata.deletion_timestamp.is_some();
    if deleting && !has_finalizer {
        return Ok(Action::await_change());
    }
    let add_finalizer = async {
        if !deleting && !has_finalizer {
            s.ctx.ensure_leader()?;
            // A merge patch replaces the list: keep the other finalizers; the
            // resourceVersion makes a concurrent change fail (and retry) instead of
            // being overwritten.
            let mut all: Vec<String> = a.finalizers().to_vec();
            all.push(finalizers::ATTACHMENT_CLEANUP.into());
            let patch =
                json!({"metadata": {"finalizers": all, "resourceVersion": a.resource_version()}});
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(api_err("add finalizer to", &name))?;
        }
        Ok(())
    };
    // The finalizer goes on while the workload is read; nothing is created before
    // both are done.
    let ((), group) = tokio::try_join!(
        add_finalizer,
        observe_workload(s, &ns, &a.spec.workload_ref, Some(&a), Mode::Full)
    )?;
    let (p, _group) = carry_out(s, group, Some(&a), Mode::Full).await?;

    if deleting {
        if p.unwanted_jobs > 0 {
            // Foreground deletion in progress; the Job watch wakes us when they are gone.
            return Ok(Action::requeue(Duration::from_secs(30)));
        }
        s.ctx.ensure_leader()?;
        let keep: Vec<String> = a
            .finalizers()
            .iter()
            .filter(|f| *f != finalizers::ATTACHMENT_CLEANUP)
            .cloned()
            .collect();
        let patch =
            json!({"metadata": {"finalizers": keep, "resourceVersion": a.resource_version()}});
        match api
            .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(api_err("remove finalizer from", &name)(e)),
        }
        return Ok(Action::await_change());
    }

    if let Some(new) = p.statuses.get(&name) {
        let old = serde_json::to_value(&a.status).unwrap_or_default();
        let new_v = serde_json::to_value(new).unwrap_or_default();
        if old != new_v {
            s.ctx.ensure_leader()?;
            api.patch_status(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"status": new_v})),
            )
            .await
            .map_err(api_err("update status of", &name))?;
        }
    }
    for n in p.notices.iter().filter(|n| n.attachment == name) {
        let t = if n.warning {
            EventType::Warning
        } else {
            EventType::Normal
        };
        publish(&s.ctx, a.as_ref(), t, n.reason, "Attach", n.note.clone()).await;
    }
    Ok(match p.wake_at {
        Some(at) => {
            let secs = at.duration_since(Timestamp::now()).as_secs_f64().max(0.0) + 1.0;
            Action::requeue(Duration::from_secs_f64(secs))
        }
        None => Action::await_change(),
    })
}

/// Whether a workload reconcile may create Jobs and Leases, or only delete (the sweep).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Full,
    DeletesOnly,
}

/// Fetches one workload's state, plans it and carries out the plan's Job creations and
/// deletions. `about` is the attachment Events are recorded on.
async fn reconcile_workload(
    s: &Shared,
    ns: &str,
    workload: &WorkloadRef,
    about: Option<&NodeAgentAttachment>,
    mode: Mode,
) -> Result<(Plan, ObservedGroup), AttachmentError> {
    let group = observe_workload(s, ns, workload, about, mode).await?;
    carry_out(s, group, about, mode).await
}

/// One workload's state: the workload (read, for its selector), its pods, its agent
/// Jobs, and the attachments claiming it (from the caches), with
/// the ingest Leases of those attachments (read).
async fn observe_workload(
    s: &Shared,
    ns: &str,
    workload: &WorkloadRef,
    about: Option<&NodeAgentAttachment>,
    mode: Mode,
) -> Result<ObservedGroup, AttachmentError> {
    let (workload_exists, selector) = workload_selector(&s.ctx.client, ns, workload).await?;
    let pods: Vec<PodView> = match &selector {
        Some(sel) => s
            .pods
            .select(|(pod_ns, _), p| pod_ns == ns && sel.matches(&p.labels))
            .iter()
            .map(|p| p.as_ref().clone())
            .collect(),
        None => vec![],
    };
    let key = workload_key(workload);
    let jobs: Vec<JobView> = s
        .jobs
        .select(|_, j| j.target_namespace == ns && j.workload == key)
        .iter()
        .map(|j| j.as_ref().clone())
        .collect();
    let members: Vec<Arc<NodeAgentAttachment>> = s
        .store
        .state()
        .into_iter()
        .filter(|a| a.namespace().as_deref() == Some(ns) && a.spec.workload_ref == *workload)
        .collect();
    let mut attachments = vec![];
    for m in &members {
        // The reconciled attachment as the watch delivered it (fresher than the store).
        let m = match about {
            Some(a) if a.uid() == m.uid() => a,
            _ => m.as_ref(),
        };
        let lease = if m.spec.mode == AttachMode::Ingest {
            ingest_lease(s, m, mode).await?
        } else {
            None
        };
        attachments.push(AttachmentView::from_object(m, lease.as_ref()));
    }
    Ok(ObservedGroup {
        namespace: ns.into(),
        workload: workload.clone(),
        workload_exists,
        attachments,
        pods,
        jobs,
        now: Timestamp::now(),
    })
}

/// Plans an observed workload and carries out the plan's Job deletions and (in
/// `Mode::Full`) creations.
async fn carry_out(
    s: &Shared,
    group: ObservedGroup,
    about: Option<&NodeAgentAttachment>,
    mode: Mode,
) -> Result<(Plan, ObservedGroup), AttachmentError> {
    let p = plan(&group, &s.settings);

    let par = s.cfg.write_parallelism.max(1);
    let deleted: Vec<bool> = stream::iter(p.delete.clone())
        .map(|d| async move { delete_job(s, &d).await })
        .buffer_unordered(par)
        .try_collect()
        .await?;
    if let Some(a) = about {
        // One Event per kind of change and reconcile, not one per Job: a 100-replica
        // workload must not cost 100 extra writes.
        for (fate_is, reason, verb) in [
            (true, reasons::JOB_REPLACED, "replacing"),
            (false, reasons::JOB_REAPED, "reaping"),
        ] {
            let lines: Vec<String> = p
                .delete
                .iter()
                .zip(&deleted)
                .filter(|(d, done)| **done && matches!(d.fate, JobFate::Replace(_)) == fate_is)
                .map(|(d, _)| {
                    let why = match d.fate {
                        JobFate::Replace(r) => r.describe(),
                        JobFate::Reap(r) => r.describe(),
                        JobFate::Keep => "",
                    };
                    format!("{} (pod {}: {why})", d.job, d.pod)
                })
                .collect();
            if !lines.is_empty() {
                let note = format!(
                    "{verb} {} agent Job(s): {}",
                    lines.len(),
                    some_names(&lines)
                );
                publish(&s.ctx, a, EventType::Normal, reason, "DeleteJob", note).await;
            }
        }
    }
    if mode == Mode::Full && !p.create.is_empty() {
        ensure_network_policy(s).await?;
        // Jobs first, all of them; then each one's Secret, and it is resumed.
        let created: Vec<Option<Job>> = stream::iter(p.create.clone())
            .map(|c| create_job(s, c.job))
            .buffer_unordered(par)
            .try_collect()
            .await?;
        let created: Vec<Job> = created.into_iter().flatten().collect();
        resume_all(s, &created, &p.resume).await?;
        s.ctx
            .metrics
            .attachment_job_changes
            .get_or_create(&crate::metrics::OutcomeLabels { outcome: "Created" })
            .inc_by(created.len() as u64);
        if let Some(a) = about
            && !created.is_empty()
        {
            let lines: Vec<String> = created
                .iter()
                .map(|j| {
                    let pod = j
                        .annotations()
                        .get(annotations::TARGET_POD)
                        .cloned()
                        .unwrap_or_default();
                    let node = j
                        .spec
                        .as_ref()
                        .and_then(|j| j.template.spec.as_ref())
                        .and_then(|p| p.node_name.clone())
                        .unwrap_or_default();
                    format!("{} (pod {pod} on {node})", j.name_any())
                })
                .collect();
            let note = format!(
                "created {} agent Job(s): {}",
                lines.len(),
                some_names(&lines)
            );
            publish(
                &s.ctx,
                a,
                EventType::Normal,
                reasons::JOB_CREATED,
                "CreateJob",
                note,
            )
            .await;
        }
    }
    if mode == Mode::Full && p.create.is_empty() {
        resume_all(s, &[], &p.resume).await?;
    }
    Ok((p, group))
}

/// Whether the workload exists, and its pod selector.
async fn workload_selector(
    client: &Client,
    ns: &str,
    w: &WorkloadRef,
) -> Result<(bool, Option<Selector>), AttachmentError> {
    async fn get<K>(client: &Client, ns: &str, name: &str) -> Result<Option<K>, kube::Error>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        Api::<K>::namespaced(client.clone(), ns).get_opt(name).await
    }
    let what = workload_key(w);
    let sel: Option<Option<LabelSelector>> = match w.kind {
        WorkloadKind::Deployment => get::<Deployment>(client, ns, &w.name)
            .await
            .map_err(api_err("get", &what))?
            .map(|o| Some(o.spec.selector)),
        WorkloadKind::StatefulSet => get::<StatefulSet>(client, ns, &w.name)
            .await
            .map_err(api_err("get", &what))?
            .map(|o| Some(o.spec.selector)),
        WorkloadKind::ReplicaSet => get::<ReplicaSet>(client, ns, &w.name)
            .await
            .map_err(api_err("get", &what))?
            .map(|o| Some(o.spec.selector)),
        WorkloadKind::DaemonSet => get::<DaemonSet>(client, ns, &w.name)
            .await
            .map_err(api_err("get", &what))?
            .map(|o| Some(o.spec.selector)),
    };
    Ok(match sel {
        None => (false, None),
        // An empty or unparsable selector selects nothing rather than every pod.
        Some(ls) => {
            let sel = ls
                .and_then(|ls| Selector::try_from(ls).ok())
                .filter(|s| !s.selects_all());
            (true, sel)
        }
    })
}

/// The ingest session Lease of `a`; created (owned by the attachment) when missing.
async fn ingest_lease(
    s: &Shared,
    a: &NodeAgentAttachment,
    mode: Mode,
) -> Result<Option<Lease>, AttachmentError> {
    let ns = a.namespace().unwrap_or_default();
    let api: Api<Lease> = Api::namespaced(s.ctx.client.clone(), &ns);
    let view = AttachmentView::from_object(a, None);
    let name = view.lease_name();
    if let Some(l) = api
        .get_opt(&name)
        .await
        .map_err(api_err("get Lease", &name))?
    {
        return Ok(Some(l));
    }
    if mode != Mode::Full || a.metadata.deletion_timestamp.is_some() {
        return Ok(None);
    }
    s.ctx.ensure_leader()?;
    let secs = a
        .spec
        .ingest
        .as_ref()
        .map(|i| i.lease_duration_seconds)
        .unwrap_or(60);
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(ns.clone()),
            labels: Some(BTreeMap::from([
                (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
                (labels::OWNER_KIND.into(), "NodeAgentAttachment".into()),
            ])),
            owner_references: a.controller_owner_ref(&()).map(|r| vec![r]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            lease_duration_seconds: Some(secs),
            acquire_time: Some(MicroTime(Timestamp::now())),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..Default::default()
        }),
    };
    match api.create(&PostParams::default(), &lease).await {
        Ok(l) => Ok(Some(l)),
        Err(e) if is_status(&e, 409) => api
            .get_opt(&name)
            .await
            .map_err(api_err("get Lease", &name)),
        Err(e) => Err(api_err("create Lease", &name)(e)),
    }
}

async fn ensure_network_policy(s: &Shared) -> Result<(), AttachmentError> {
    if s.policy_applied.load(Ordering::Relaxed) {
        return Ok(());
    }
    s.ctx.ensure_leader()?;
    let np = render::network_policy(&s.settings);
    let api: Api<NetworkPolicy> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    api.patch(
        render::NETWORK_POLICY,
        &PatchParams::apply(managers::ATTACHMENT).force(),
        &Patch::Apply(&np),
    )
    .await
    .map_err(api_err("apply NetworkPolicy", render::NETWORK_POLICY))?;
    s.policy_applied.store(true, Ordering::Relaxed);
    Ok(())
}

/// Creates one agent Job; `None` when another reconcile created it first.
async fn create_job(s: &Shared, job: Job) -> Result<Option<Job>, AttachmentError> {
    s.ctx.ensure_leader()?;
    let name = job.name_any();
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let pp = PostParams {
        field_manager: Some(managers::ATTACHMENT.into()),
        ..Default::default()
    };
    match api.create(&pp, &job).await {
        Ok(j) => {
            if let Some(v) = JobView::from_job(&j) {
                s.jobs.insert_if_absent(s.job_key(&name), v);
            }
            Ok(Some(j))
        }
        Err(e) if is_status(&e, 409) => Ok(None),
        Err(e) => Err(api_err("create Job", &name)(e)),
    }
}

/// Resumes the Jobs just `created` and the kept ones left suspended,
/// `write_parallelism` at a time: each gets its credential Secret (owned by it, random
/// token; one that exists already is kept), then is unsuspended, so its pod starts with
/// the Secret in place.
async fn resume_all(s: &Shared, created: &[Job], left: &[Resume]) -> Result<(), AttachmentError> {
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|r| r.job.clone()).collect();
        tracing::info!(jobs = %some_names(&names), "resuming agent Jobs left suspended");
    }
    let jobs = created
        .iter()
        .map(|j| Resume {
            job: j.name_any(),
            job_uid: j.uid().unwrap_or_default(),
        })
        .chain(left.iter().cloned())
        .collect::<Vec<_>>();
    stream::iter(jobs)
        .map(|r| async move {
            create_secret(s, &r).await?;
            unsuspend(s, &r.job).await
        })
        .buffer_unordered(s.cfg.write_parallelism.max(1))
        .try_collect::<Vec<()>>()
        .await
        .map(|_| ())
}

async fn create_secret(s: &Shared, r: &Resume) -> Result<(), AttachmentError> {
    s.ctx.ensure_leader()?;
    let mut token = [0u8; 32];
    rand::rng().fill_bytes(&mut token);
    let secret = render::credentials(&s.settings.namespace, &r.job, &r.job_uid, &token);
    let secrets: Api<Secret> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let pp = PostParams {
        field_manager: Some(managers::ATTACHMENT.into()),
        ..Default::default()
    };
    match secrets.create(&pp, &secret).await {
        Ok(_) => Ok(()),
        Err(e) if is_status(&e, 409) => Ok(()),
        Err(e) => Err(api_err("create Secret", &r.job)(e)),
    }
}

async fn unsuspend(s: &Shared, job: &str) -> Result<(), AttachmentError> {
    s.ctx.ensure_leader()?;
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let patch = json!({"spec": {"suspend": false}});
    let pp = PatchParams {
        field_manager: Some(managers::ATTACHMENT.into()),
        ..Default::default()
    };
    match api.patch(job, &pp, &Patch::Merge(&patch)).await {
        Ok(_) => {}
        // Deleted meanwhile: nothing to resume.
        Err(e) if is_status(&e, 404) => {}
        Err(e) => return Err(api_err("resume Job", job)(e)),
    }
    s.jobs.update_if_present(&s.job_key(job), |j| JobView {
        suspended: false,
        ..j.clone()
    });
    Ok(())
}

/// A short list of names for an Event note.
fn some_names(names: &[String]) -> String {
    let mut out = names
        .iter()
        .take(10)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 10 {
        out.push_str(&format!(" and {} more", names.len() - 10));
    }
    out
}

/// Deletes one agent Job with foreground propagation; `false` if it was already gone.
async fn delete_job(s: &Shared, d: &Deletion) -> Result<bool, AttachmentError> {
    s.ctx.ensure_leader()?;
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    match api.delete(&d.job, &dp).await {
        Ok(_) => {}
        Err(e) if is_status(&e, 404) => return Ok(false),
        Err(e) => return Err(api_err("delete Job", &d.job)(e)),
    }
    s.jobs.update_if_present(&s.job_key(&d.job), |j| JobView {
        terminating: true,
        ..j.clone()
    });
    let (outcome, why) = match d.fate {
        JobFate::Replace(r) => ("Replaced", r.describe()),
        JobFate::Reap(r) => ("Reaped", r.describe()),
        JobFate::Keep => return Ok(false),
    };
    s.ctx
        .metrics
        .attachment_job_changes
        .get_or_create(&crate::metrics::OutcomeLabels { outcome })
        .inc();
    tracing::info!(job = %d.job, pod = %d.pod, %why, "deleting agent Job");
    Ok(true)
}

/// The periodic orphan sweep: every workload that has agent Jobs is planned (with the
/// one reaping predicate) and its unwanted Jobs deleted. Covers operator restarts,
/// attachments deleted while the operator was down, and vanished ingest clients.
/// Returns the number of Jobs deleted.
async fn sweep(s: &Shared) -> Result<usize, AttachmentError> {
    let jobs = s.jobs.select(|_, _| true);
    s.ctx.metrics.attachment_jobs.set(jobs.len() as i64);
    let groups: BTreeSet<(String, String)> = jobs
        .iter()
        .map(|j| (j.target_namespace.clone(), j.workload.clone()))
        .collect();
    let mut reaped = 0;
    for (ns, key) in groups {
        let Some(w) = parse_workload(&key) else {
            continue;
        };
        if s.cfg
            .watch_namespace
            .as_ref()
            .is_some_and(|only| *only != ns)
        {
            continue;
        }
        let (p, _) = reconcile_workload(s, &ns, &w, None, Mode::DeletesOnly).await?;
        reaped += p.delete.len();
    }
    Ok(reaped)
}

fn parse_workload(key: &str) -> Option<WorkloadRef> {
    let (kind, name) = key.split_once('/')?;
    let kind = match kind {
        "Deployment" => WorkloadKind::Deployment,
        "StatefulSet" => WorkloadKind::StatefulSet,
        "ReplicaSet" => WorkloadKind::ReplicaSet,
        "DaemonSet" => WorkloadKind::DaemonSet,
        _ => return None,
    };
    Some(WorkloadRef {
        kind,
        name: name.into(),
    })
}

/// `reap-all`: deletes every agent Job in `namespace` (foreground), waits until they are
/// gone (bounded by `timeout`), and removes the attachment finalizer from every
/// NodeAgentAttachment so that uninstalling the operator cannot leave them stuck.
/// Returns the number of Jobs deleted. Run it with the controllers stopped (the Helm
/// pre-delete hook), or live attachments get their Jobs back.
pub async fn reap_all(client: Client, namespace: &str, timeout: Duration) -> anyhow::Result<usize> {
    let api: Api<Job> = Api::namespaced(client.clone(), namespace);
    let lp = ListParams::default().labels(&render::agent_selector());
    let jobs = api.list_metadata(&lp).await?;
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    let mut deleted = vec![];
    for j in &jobs.items {
        match api.delete(&j.name_any(), &dp).await {
            Ok(_) => deleted.push((j.name_any(), j.uid().unwrap_or_default())),
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(e.into()),
        }
    }
    // Foreground deletion: each Job disappears once its pods (and Secret) are gone.
    let gone = stream::iter(deleted.iter())
        .map(|(name, uid)| await_condition(api.clone(), name, conditions::is_deleted(uid)))
        .buffer_unordered(16)
        .try_collect::<Vec<_>>();
    tokio::time::timeout(timeout, gone)
        .await
        .map_err(|_| anyhow::anyhow!("agent Jobs still present after {timeout:?}"))??;
    let n = deleted.len();
    let attachments: Api<NodeAgentAttachment> = Api::all(client.clone());
    for a in attachments
        .list_metadata(&ListParams::default())
        .await?
        .items
    {
        if !a
            .finalizers()
            .iter()
            .any(|f| f == finalizers::ATTACHMENT_CLEANUP)
        {
            continue;
        }
        let keep: Vec<String> = a
            .finalizers()
            .iter()
            .filter(|f| *f != finalizers::ATTACHMENT_CLEANUP)
            .cloned()
            .collect();
        let ns_api: Api<NodeAgentAttachment> =
            Api::namespaced(client.clone(), &a.namespace().unwrap_or_default());
        let patch = json!({"metadata": {"finalizers": keep}});
        match ns_api
            .patch(
                &a.name_any(),
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if is_status(&e, 404) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(n)
}
