//! The NodeAgentAttachment controller: the wiring around `crate::attachment`.
//!
//! One reconcile handles one attachment's *workload*: it observes the workload, its
//! pods (through the workload's selector), the agent Jobs labelled for it and the
//! ingest Leases of its attachments ([`observe`]), asks [`plan`] what to do, creates
//! and deletes Jobs (always foreground, [`writes`]), and hands the attachment's status
//! and the core's notes to the controller shell. The same steps serve the finalizer
//! (the attachment, deleting, claims nothing; the finalizer goes once no unwanted Job
//! is left), lease expiry (a requeue at the earliest expiry) and the periodic orphan
//! sweep ([`sweep`]: every workload that has agent Jobs, deletes only), so all removal
//! paths go through the one reaping predicate.
//!
//! Reads come from caches, not from lists: the attachments (the controller's store),
//! and projection caches ([`crate::cache`]) of all pods (a `PodView` each), the agent
//! Jobs (a `JobView` each), the nodes' platform labels ([`nodes`]: a pod on a node
//! the agent image cannot run on is skipped) and the Leases of the watched namespaces
//! (a `LeaseView` each: only to wake an ingest). Only the workload itself (for its
//! selector) and ingest Leases are read per reconcile. A change of a cached projection
//! wakes the attachments it concerns (a pod: those of its namespace; a Job: those of
//! its workload; a node: those of the namespaces with pods on it; a Lease: the ingests
//! whose session it is, so a renewal after the expiry brings one back); updates the
//! core cannot see wake nothing.
//!
//! A Job is created suspended; its credential Secret (owned by the Job) is created
//! next, then the Job is resumed. Secrets are never read: a Job still suspended is one
//! whose Secret is not confirmed, and is resumed the same way.
//!
//! Nothing is decided before every cache has its first complete list, and the
//! controller records its own writes in the caches at once. Nothing polls the API
//! server except the orphan sweep, by design.

mod nodes;
mod observe;
mod settings;
mod state;
mod sweep;
mod writes;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use futures::stream;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::Api;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::{self, watcher};
use podmotion_api::attachment::AttachMode;
use podmotion_api::names::{finalizers, managers};
use podmotion_api::{NodeAgentAttachment, NodeAgentAttachmentStatus};

use super::controller_config;
use super::shell::{self, Outcome, ReconcileError, Reconciler};
use crate::attachment::observed::{AttachmentView, LeaseView, workload_key};
use crate::attachment::render;
use crate::attachment::{JobView, ObservedGroup, PodView};
use crate::cache::{self, Change, Projection};
use crate::client::scoped;
use crate::context::Context;

pub use settings::AttachmentConfig;
pub use sweep::reap_all;

use state::{Mode, NAME, PlatformLabels, Shared};

/// Runs the controller with the settings from the environment.
pub async fn run(ctx: Arc<Context>) -> anyhow::Result<()> {
    let cfg = AttachmentConfig::from_env()?;
    run_with(ctx, cfg).await
}

/// Runs the controller (and its orphan sweep) with explicit settings.
pub async fn run_with(ctx: Arc<Context>, cfg: AttachmentConfig) -> anyhow::Result<()> {
    let client = ctx.client.clone();
    let settings = cfg.settings(
        &ctx.config.namespace,
        ctx.config.log_format,
        ctx.config.platform(),
    );
    let attachments: Api<DeserializeGuard<NodeAgentAttachment>> =
        scoped(&client, cfg.watch_namespace.as_deref());
    let controller = Controller::new(attachments, watcher::Config::default().any_semantic());
    let shared = Arc::new(Shared {
        ctx: ctx.clone(),
        store: controller.store(),
        pods: Arc::new(Projection::new()),
        jobs: Arc::new(Projection::new()),
        nodes: Arc::new(Projection::new()),
        leases: Arc::new(Projection::new()),
        policy_applied: AtomicBool::new(false),
        cfg,
        settings,
    });
    let controller = controller
        .reconcile_on(triggers(&ctx, &shared))
        .reconcile_all_on(ctx.leader.on_acquire())
        // No debounce: a new attachment gets its Jobs at once. A reconcile reads caches
        // (one GET), triggers that arrive while it runs are coalesced into one rerun by
        // the runtime, and changes the plan cannot see wake nothing.
        .with_config(controller_config(&ctx).debounce(Duration::ZERO))
        .graceful_shutdown_on(ctx.shutdown());

    super::mark_ready_when_synced(&ctx, NAME, shared.store.clone());
    tokio::spawn(sweep::every_period(shared.clone()));
    shell::run(controller, shared).await;
    Ok(())
}

type AttachmentRef = ObjectRef<DeserializeGuard<NodeAgentAttachment>>;

/// The reconcile triggers: the changes of the caches of the watched pods, the agent
/// Jobs and the nodes' platform labels, each mapped to the attachments it concerns.
fn triggers(
    ctx: &Arc<Context>,
    shared: &Arc<Shared>,
) -> impl futures::Stream<Item = AttachmentRef> + Send + 'static {
    let client = ctx.client.clone();
    let pods: Api<Pod> = scoped(&client, shared.cfg.watch_namespace.as_deref());
    let s = shared.clone();
    let pod_triggers = cache::feed(
        ctx,
        "attachment-pods",
        watcher(pods, cache::paged()),
        shared.pods.clone(),
        |p: &Pod| Some(PodView::from_pod(p)),
        move |c| attachments_in_namespace(&s.store, &c.key.0),
    );
    let s = shared.clone();
    let job_triggers = cache::feed(
        ctx,
        "attachment-jobs",
        watcher(
            Api::<Job>::namespaced(client.clone(), &shared.settings.namespace),
            cache::paged().labels(&render::agent_selector()),
        ),
        shared.jobs.clone(),
        JobView::from_job,
        move |c| {
            c.latest()
                .map(|j| attachments_of_job(&s.store, j))
                .unwrap_or_default()
        },
    );
    let s = shared.clone();
    let node_triggers = cache::feed(
        ctx,
        "attachment-nodes",
        // Only the labels are kept (kube 5 still lists the nodes in full, see
        // `runner_pool`), and only a change of the platform labels wakes anything.
        watcher(
            Api::<PartialObjectMeta<Node>>::all(client.clone()),
            cache::paged(),
        ),
        shared.nodes.clone(),
        nodes::platform_labels,
        move |c| attachments_of_node(&s, c),
    );
    stream::select(
        stream::select(pod_triggers, job_triggers),
        stream::select(node_triggers, lease_triggers(ctx, shared)),
    )
}

/// The Leases of the watched namespaces, each waking the ingests whose session it is:
/// a client's renewal after the expiry brings its ingest back (nothing else would wake
/// the attachment). The nodes' heartbeats (a renewal per node every 10 s) concern no
/// attachment and are not watched.
fn lease_triggers(
    ctx: &Arc<Context>,
    shared: &Arc<Shared>,
) -> impl futures::Stream<Item = AttachmentRef> + Send + 'static {
    let s = shared.clone();
    cache::feed(
        ctx,
        "attachment-leases",
        watcher(
            scoped::<Lease>(&ctx.client, shared.cfg.watch_namespace.as_deref()),
            cache::paged().fields("metadata.namespace!=kube-node-lease"),
        ),
        shared.leases.clone(),
        |l: &Lease| Some(LeaseView::from_lease(l)),
        move |c| ingests_of_lease(&s.store, &c.key),
    )
}

/// A Lease changed: the ingests of its namespace whose session it is.
fn ingests_of_lease(
    store: &Store<DeserializeGuard<NodeAgentAttachment>>,
    (ns, name): &crate::cache::Key,
) -> Vec<AttachmentRef> {
    attachments_where(store, |a| {
        a.spec.mode == AttachMode::Ingest
            && a.namespace().as_deref() == Some(ns.as_str())
            && AttachmentView::from_object(a, None).lease_name() == *name
    })
}

/// A node's platform labels changed (or it appeared): the attachments of the
/// namespaces that have pods on it.
fn attachments_of_node(s: &Shared, c: &Change<PlatformLabels>) -> Vec<AttachmentRef> {
    let node = c.key.1.as_str();
    s.store
        .state()
        .iter()
        .filter(|g| {
            let ns = g.namespace().unwrap_or_default();
            !s.pods
                .select(|(pod_ns, _), p| *pod_ns == ns && p.node.as_deref() == Some(node))
                .is_empty()
        })
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

/// A Job wakes every attachment of the workload it was made for.
fn attachments_of_job(
    store: &Store<DeserializeGuard<NodeAgentAttachment>>,
    job: &JobView,
) -> Vec<AttachmentRef> {
    attachments_where(store, |a| {
        a.namespace().as_deref() == Some(job.target_namespace.as_str())
            && workload_key(&a.spec.workload_ref) == job.workload
    })
}

/// The attachments (those that parse) for which `keep` holds.
fn attachments_where(
    store: &Store<DeserializeGuard<NodeAgentAttachment>>,
    keep: impl Fn(&NodeAgentAttachment) -> bool,
) -> Vec<AttachmentRef> {
    store
        .state()
        .iter()
        .filter(|g| g.0.as_ref().is_ok_and(&keep))
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

/// A pod wakes the attachments of its namespace (there are few; each selects its
/// workload's pods from the cache).
fn attachments_in_namespace(
    store: &Store<DeserializeGuard<NodeAgentAttachment>>,
    ns: &str,
) -> Vec<AttachmentRef> {
    store
        .state()
        .iter()
        .filter(|g| g.namespace().as_deref() == Some(ns))
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

impl Reconciler for Shared {
    type Object = NodeAgentAttachment;
    type Status = NodeAgentAttachmentStatus;
    type Observed = ObservedGroup;
    type Then = ();
    const NAME: &'static str = NAME;
    const FINALIZER: Option<&'static str> = Some(finalizers::ATTACHMENT_CLEANUP);
    const MANAGER: &'static str = managers::ATTACHMENT;
    const CLAIMS: bool = true;

    fn context(&self) -> &Arc<Context> {
        &self.ctx
    }

    fn status(a: &NodeAgentAttachment) -> Option<&NodeAgentAttachmentStatus> {
        a.status.as_ref()
    }

    async fn observe(
        &self,
        a: &NodeAgentAttachment,
        _cleanup: bool,
    ) -> Result<ObservedGroup, ReconcileError> {
        if !self.caches_ready() {
            // Deciding on a cache that has not listed yet could reap wanted Jobs.
            return Err(ReconcileError::wait(
                "caches not synced",
                Duration::from_millis(250),
            ));
        }
        let ns = a.namespace().unwrap_or_default();
        observe::workload(self, &ns, &a.spec.workload_ref, Some(a), Mode::Full).await
    }

    async fn apply(
        &self,
        a: &NodeAgentAttachment,
        group: ObservedGroup,
        cleanup: bool,
    ) -> Result<Outcome<NodeAgentAttachmentStatus>, ReconcileError> {
        let (p, mut notes) = writes::carry_out(self, group, Mode::Full).await?;
        let name = a.name_any();
        if cleanup {
            // Foreground deletion in progress; the Job watch wakes us when they are gone.
            let mut out = Outcome::new(None);
            out.notes = notes;
            out.cleaned_up = p.unwanted_jobs == 0;
            out.requeue = Some(Duration::from_secs(30));
            return Ok(out);
        }
        notes.extend(
            p.notices
                .iter()
                .filter(|n| n.attachment == name)
                .map(|n| n.to_note()),
        );
        let mut out = Outcome::new(p.statuses.get(&name).cloned());
        out.notes = notes;
        out.requeue = p.wake_at.map(|at| {
            let secs = at.duration_since(Timestamp::now()).as_secs_f64().max(0.0) + 1.0;
            Duration::from_secs_f64(secs)
        });
        Ok(out)
    }
}
