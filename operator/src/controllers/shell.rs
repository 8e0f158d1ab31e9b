//! The controller shell: what every controller does, done one way.
//!
//! A controller is a [`Reconciler`]: an `observe` step (reads), an `apply` step (calls
//! its pure core and makes the writes the core asks for) and, where some writes must
//! follow the status, an `after_status` step. The shell runs them for each watch event:
//!
//! 1. leader guard (followers keep their caches warm but never reconcile);
//! 2. deserialize guard (an object that does not deserialize gets a Warning Event and
//!    waits for a change, so it cannot wedge the controller);
//! 3. claim gate, for the kinds one release owns ([`Reconciler::CLAIMS`], [`claim_gate`]):
//!    an object another PodMotion release holds is left alone from here on, an
//!    unclaimed one is claimed for this release first;
//! 4. finalizer, through kube-runtime's helper behind the writer's fence: added before
//!    anything else happens; a deleted object runs the same steps with `cleanup = true`,
//!    and the finalizer goes once the step reports everything cleaned up (a controller
//!    without one, the CSR signer, leaves deleted objects alone);
//! 5. observe → apply → status → Events → after_status. The status is written by
//!    server-side apply on `/status` under the controller's field manager, only when it
//!    changed; a field the core no longer sets is left out of the applied object and so
//!    removed (a merge patch would keep it). The write carries the resourceVersion the
//!    round read, so a round decided on a stale read (a cache behind the API server)
//!    gets a conflict, writes nothing and reads again. The Events are the core's notes;
//! 6. one error type ([`ReconcileError`] in `super::error`, with a bounded `category()`
//!    for metrics and logs) and one error policy.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::{ClusterResourceScope, NamespaceResourceScope};
use kube::api::Api;
use kube::core::DeserializeGuard;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{self, Event as Finalizer};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::names::{annotations, reasons};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

pub use super::error::{ReconcileError, api_err, is_already_exists, is_status};
use super::reconcile_guard;
use crate::claim::{Seen, Step, step};
use crate::context::Context;
use crate::events::publish;
use crate::metrics::ClaimLabels;
use crate::note::{EventKind, Note};

/// What one round of a controller produced, for the shell to finish.
pub struct Outcome<S, T = ()> {
    /// The status the core computed; written when it differs from the object's.
    pub status: Option<S>,
    /// Events to publish, in order.
    pub notes: Vec<Note>,
    /// Look again after this long (`None`: on the next watch event).
    pub requeue: Option<Duration>,
    /// Cleanup rounds only: everything the finalizer guards is gone.
    pub cleaned_up: bool,
    /// Writes for `after_status`.
    pub then: T,
}

impl<S, T: Default> Outcome<S, T> {
    pub fn new(status: Option<S>) -> Self {
        Outcome {
            status,
            notes: vec![],
            requeue: None,
            cleaned_up: true,
            then: T::default(),
        }
    }
}

/// A controller: its object kind, names, and its observe and apply steps.
pub trait Reconciler: Send + Sync + Sized + 'static {
    type Object: Resource<DynamicType = (), Scope: ObjectScope>
        + Clone
        + DeserializeOwned
        + Serialize
        + Debug
        + Send
        + Sync
        + 'static;
    type Status: Serialize + Send + Sync;
    type Observed: Send;
    type Then: Send;

    /// Metric and log name.
    const NAME: &'static str;
    /// The finalizer that guards the cleanup (`None`: nothing to clean up; a deleted
    /// object is left alone).
    const FINALIZER: Option<&'static str>;
    /// Field manager of the status (and the children).
    const MANAGER: &'static str;
    /// Whether one PodMotion release owns each object of the kind (the claim gate,
    /// [`claim_gate`]): the namespaced kinds two releases' watches may share. Off for
    /// kinds a release serves by other means (the CSR signer signs only its own
    /// agents' requests).
    const CLAIMS: bool = false;

    fn context(&self) -> &Arc<Context>;
    /// The object's current status, to skip writes that change nothing.
    fn status(obj: &Self::Object) -> Option<&Self::Status>;

    /// Reads everything the core decides from.
    fn observe(
        &self,
        obj: &Self::Object,
        cleanup: bool,
    ) -> impl Future<Output = Result<Self::Observed, ReconcileError>> + Send;

    /// Calls the core and makes the writes it asks for, except the status and Events.
    fn apply(
        &self,
        obj: &Self::Object,
        observed: Self::Observed,
        cleanup: bool,
    ) -> impl Future<Output = Result<Outcome<Self::Status, Self::Then>, ReconcileError>> + Send;

    /// Writes that must wait until the status is persisted (none by default).
    fn after_status(
        &self,
        _obj: &Self::Object,
        _then: Self::Then,
    ) -> impl Future<Output = Result<(), ReconcileError>> + Send {
        async { Ok(()) }
    }
}

/// Runs `controller` with the shell around `r` until shutdown.
pub async fn run<R: Reconciler>(controller: Controller<DeserializeGuard<R::Object>>, r: Arc<R>) {
    controller
        .run(reconcile::<R>, error_policy::<R>, r)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(controller = R::NAME, error = %e, "reconcile");
            }
        })
        .await;
}

/// The one error policy: a wait is not a failure and comes back when it said; a
/// failure is logged with its category and retried after a short, bounded delay.
pub fn error_policy<R: Reconciler>(
    _obj: Arc<DeserializeGuard<R::Object>>,
    err: &ReconcileError,
    _r: Arc<R>,
) -> Action {
    match err {
        ReconcileError::Wait { why, retry } => {
            tracing::debug!(controller = R::NAME, %why, "waiting");
            Action::requeue(*retry)
        }
        e => {
            tracing::warn!(controller = R::NAME, category = e.category(), error = %e, "reconcile failed");
            Action::requeue(Duration::from_secs(2))
        }
    }
}

/// One reconcile of one object (see the module documentation for the order).
pub async fn reconcile<R: Reconciler>(
    guard: Arc<DeserializeGuard<R::Object>>,
    r: Arc<R>,
) -> Result<Action, ReconcileError> {
    let ctx = r.context().clone();
    if let Some(wait) = reconcile_guard(&ctx) {
        return Ok(wait);
    }
    let obj = match &guard.0 {
        Ok(obj) => Arc::new(obj.clone()),
        Err(invalid) => {
            tracing::warn!(controller = R::NAME, name = ?invalid.metadata.name, error = %invalid.error, "object does not deserialize");
            let note = Note::warning(reasons::INVALID_SPEC, "Reconcile", invalid.error.clone());
            announce(&ctx, guard.as_ref(), &[note]).await;
            return Ok(Action::await_change());
        }
    };
    let obj = if R::CLAIMS {
        match claim_gate::<R>(&ctx, obj).await? {
            Gate::Proceed(obj) => obj,
            Gate::Stop(action) => return Ok(action),
        }
    } else {
        obj
    };
    let timer = ctx.metrics.reconcile(R::NAME);
    let name = obj.name_any();
    let started = std::time::Instant::now();
    tracing::debug!(controller = R::NAME, %name, "reconcile started");
    let res = finalized(r.as_ref(), obj).await;
    tracing::debug!(
        controller = R::NAME,
        %name,
        elapsed_ms = started.elapsed().as_millis() as u64,
        outcome = res.as_ref().map_or_else(|e| e.category(), |_| "Ok"),
        "reconcile finished"
    );
    timer.done(match &res {
        Ok(_) | Err(ReconcileError::Wait { .. }) => Ok(()),
        Err(e) => Err(e.category()),
    });
    res
}

/// Why a round ended without a claim: another release claimed the object first.
pub const CLAIM_LOST: &str = "another release claimed the object first; reading again";

/// What the shell does after the gate.
enum Gate<K> {
    /// Reconcile this object (the claimed one when the gate just claimed it: its
    /// resourceVersion is the one the status write must carry).
    Proceed(Arc<K>),
    /// Leave it: end the round with this action.
    Stop(Action),
}

/// The claim gate for `obj` in controller `R`: one PodMotion release owns each object
/// (`podmotion_core::claim` decides; this writes, logs and counts). An object another
/// release holds gets nothing from this one but one info line, one `ClaimedElsewhere`
/// Event and one count of `podmotion_claims_total{outcome="LeftAlone"}` per object
/// generation and holder (not per round: the holder's status writes wake this
/// controller too). An unclaimed one is claimed by a write that carries the
/// resourceVersion read (`Writer::claim`): of two releases racing, the loser gets a
/// conflict and waits for its cache to show the winner's claim. Nothing takes over
/// another release's claim by itself (a release whose Lease looks expired may be
/// restarting, scaled to zero or partitioned, and would come back to an object
/// someone else drives): a user hands an object over by overwriting or removing the
/// annotation (docs/security.md, "Two releases over the same namespaces").
async fn claim_gate<R: Reconciler>(
    ctx: &Context,
    obj: Arc<R::Object>,
) -> Result<Gate<R::Object>, ReconcileError> {
    let me = ctx.claims.me();
    let seen = Seen {
        annotations: obj.annotations(),
        finalizers: obj.finalizers(),
        deleting: obj.meta().deletion_timestamp.is_some(),
    };
    match step(seen, R::FINALIZER, me) {
        Step::Reconcile => Ok(Gate::Proceed(obj)),
        Step::Nothing => Ok(Gate::Stop(Action::await_change())),
        Step::LeaveAlone { holder } => {
            leave_alone::<R>(ctx, &obj, &holder).await;
            Ok(Gate::Stop(Action::await_change()))
        }
        Step::Claim => claim::<R>(ctx, &obj).await,
    }
}

/// Counts one outcome of controller `R`'s claim gate in `podmotion_claims_total`.
fn count_claim<R: Reconciler>(ctx: &Context, outcome: &'static str) {
    ctx.metrics
        .claims
        .get_or_create(&ClaimLabels {
            controller: R::NAME,
            outcome,
        })
        .inc();
}

/// An object `holder` (another release) holds: the info line, the `ClaimedElsewhere`
/// Event and the `LeftAlone` count, once per object generation and holder.
async fn leave_alone<R: Reconciler>(ctx: &Context, obj: &R::Object, holder: &str) {
    let me = ctx.claims.me();
    let uid = obj.uid().unwrap_or_default();
    let generation = obj.meta().generation.unwrap_or_default();
    if !ctx.claims.first_time(&uid, generation, holder) {
        return;
    }
    count_claim::<R>(ctx, "LeftAlone");
    tracing::info!(
        controller = R::NAME,
        name = %obj.name_any(),
        namespace = obj.namespace().as_deref().unwrap_or_default(),
        %uid,
        generation,
        holder = %holder,
        release = %me,
        "claimed by another PodMotion release: left alone (overwrite or remove the {} annotation to hand it over)",
        annotations::CONTROLLER,
    );
    let note = format!(
        "Reconciled by PodMotion release {holder}, not by {me}: this release leaves it alone. To hand it over: kubectl annotate --overwrite {kind} {name} {key}=<release namespace>/<lease name> (or remove the annotation: the first release that sees it claims it).",
        kind = R::Object::kind(&()).to_lowercase(),
        name = obj.name_any(),
        key = annotations::CONTROLLER,
    );
    publish(
        ctx,
        obj,
        EventType::Normal,
        reasons::CLAIMED_ELSEWHERE,
        "Reconcile",
        note,
    )
    .await;
}

/// Claims an unclaimed object for this release, by a write that carries the
/// resourceVersion read: the claimed object to reconcile, or, when another release
/// (or anything else) changed it since the read, a short wait to read again.
async fn claim<R: Reconciler>(
    ctx: &Context,
    obj: &R::Object,
) -> Result<Gate<R::Object>, ReconcileError> {
    let me = ctx.claims.me();
    let api = api_of(&ctx.client, obj);
    match ctx
        .writer
        .claim(&api, obj, annotations::CONTROLLER, me, R::MANAGER)
        .await
    {
        Ok(claimed) => {
            count_claim::<R>(ctx, "Claimed");
            tracing::info!(
                controller = R::NAME,
                name = %obj.name_any(),
                namespace = obj.namespace().as_deref().unwrap_or_default(),
                uid = obj.uid().as_deref().unwrap_or_default(),
                release = %me,
                "claimed for this PodMotion release"
            );
            Ok(Gate::Proceed(Arc::new(claimed)))
        }
        // Another release claimed it (or anything else changed it) since the
        // read: nothing was written; decide again on a fresher read.
        Err(e) if e.is_conflict() => {
            count_claim::<R>(ctx, "Lost");
            Err(ReconcileError::wait(CLAIM_LOST, Duration::from_millis(500)))
        }
        Err(e) if e.is_status(404) => Ok(Gate::Stop(Action::await_change())),
        Err(e) => Err(e.into()),
    }
}

async fn finalized<R: Reconciler>(r: &R, obj: Arc<R::Object>) -> Result<Action, ReconcileError> {
    let ctx = r.context();
    let name = obj.name_any();
    let Some(finalizer_name) = R::FINALIZER else {
        if obj.meta().deletion_timestamp.is_some() {
            return Ok(Action::await_change());
        }
        return round(r, &obj, false).await;
    };
    let api = api_of(&ctx.client, obj.as_ref());
    // The helper's finalizer patches are writes too: through the writer's fence.
    let res = ctx
        .writer
        .finalizer(&api, finalizer_name, obj, |event| async move {
            match event {
                Finalizer::Apply(obj) => round(r, &obj, false).await,
                Finalizer::Cleanup(obj) => round(r, &obj, true).await,
            }
        })
        .await?;
    match res {
        Ok(action) => Ok(action),
        Err(finalizer::Error::ApplyFailed(e) | finalizer::Error::CleanupFailed(e)) => Err(e),
        // Gone meanwhile: nothing left to release.
        Err(finalizer::Error::RemoveFinalizer(e)) if is_status(&e, 404) => {
            Ok(Action::await_change())
        }
        Err(finalizer::Error::AddFinalizer(e)) => Err(api_err("add finalizer to", name)(e)),
        Err(finalizer::Error::RemoveFinalizer(e)) => Err(api_err("remove finalizer from", name)(e)),
        Err(e) => Err(ReconcileError::Inconsistent(e.to_string())),
    }
}

async fn round<R: Reconciler>(
    r: &R,
    obj: &R::Object,
    cleanup: bool,
) -> Result<Action, ReconcileError> {
    let ctx = r.context();
    let observed = r.observe(obj, cleanup).await?;
    let out = r.apply(obj, observed, cleanup).await?;
    if let Some(status) = &out.status {
        write_status(ctx, obj, R::MANAGER, R::status(obj), status).await?;
    }
    announce(ctx, obj, &out.notes).await;
    r.after_status(obj, out.then).await?;
    if cleanup && !out.cleaned_up {
        // An error keeps the finalizer (the helper removes it on success).
        return Err(ReconcileError::wait(
            "cleanup in progress",
            out.requeue.unwrap_or(Duration::from_secs(30)),
        ));
    }
    Ok(match out.requeue {
        Some(d) => Action::requeue(d),
        None => Action::await_change(),
    })
}

/// The one status writer: server-side apply of `new` on `/status` as `manager`, when
/// it differs from `old`, with `obj`'s resourceVersion as a precondition (the
/// writer's `apply_status`). Fields `new` leaves out are removed (they were ours).
pub async fn write_status<K, S>(
    ctx: &Context,
    obj: &K,
    manager: &str,
    old: Option<&S>,
    new: &S,
) -> Result<(), ReconcileError>
where
    K: Resource<DynamicType = (), Scope: ObjectScope> + Clone + DeserializeOwned + Debug,
    S: Serialize,
{
    let new = serde_json::to_value(new).unwrap_or_default();
    if old.map(|o| serde_json::to_value(o).unwrap_or_default()) == Some(new.clone()) {
        return Ok(());
    }
    let api = api_of(&ctx.client, obj);
    let body = status_apply_body(obj, new);
    match ctx.writer.apply_status(&api, obj, manager, body).await {
        Ok(_) => Ok(()),
        // Gone meanwhile: act on nothing more (the store drops it, so no retry comes).
        Err(e) if e.is_status(404) => {
            Err(ReconcileError::wait("object gone", Duration::from_secs(5)))
        }
        // The status was decided from a read the object has moved past (a cache that
        // lags behind): nothing was written, and nothing that waits for the status
        // (`after_status`) runs; the object is read and decided again.
        Err(e) if e.is_conflict() => {
            Err(ReconcileError::wait(STALE_READ, Duration::from_millis(500)))
        }
        Err(e) => Err(e.into()),
    }
}

/// Why a round ended without writing its status: it was decided on a stale read.
pub const STALE_READ: &str = "the status was decided on a stale read; reading again";

/// How the shell reaches an object of a namespaced or a cluster-scoped kind (the CSR
/// signer's CertificateSigningRequests are cluster-scoped).
pub trait ObjectScope {
    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: &Client, obj: &K) -> Api<K>;
}

impl ObjectScope for NamespaceResourceScope {
    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: &Client, obj: &K) -> Api<K> {
        Api::namespaced(client.clone(), &obj.namespace().unwrap_or_default())
    }
}

impl ObjectScope for ClusterResourceScope {
    fn api<K: Resource<Scope = Self, DynamicType = ()>>(client: &Client, _obj: &K) -> Api<K> {
        Api::all(client.clone())
    }
}

/// The API of `obj`'s kind where `obj` lives.
fn api_of<K: Resource<DynamicType = (), Scope: ObjectScope>>(client: &Client, obj: &K) -> Api<K> {
    <K::Scope as ObjectScope>::api(client, obj)
}

/// The applied object of a status write: type, name and the status alone, without
/// nulls (an unset field is left out, and so released).
pub fn status_apply_body<K: Resource<DynamicType = ()>>(obj: &K, status: Value) -> Value {
    json!({
        "apiVersion": K::api_version(&()),
        "kind": K::kind(&()),
        "metadata": { "name": obj.name_any(), "namespace": obj.namespace() },
        "status": without_nulls(status),
    })
}

fn without_nulls(v: Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.into_iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k, without_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.into_iter().map(without_nulls).collect()),
        v => v,
    }
}

/// Publishes the core's notes as Events about `obj`.
pub async fn announce<K: Resource<DynamicType = ()>>(ctx: &Context, obj: &K, notes: &[Note]) {
    for n in notes {
        let kind = match n.kind {
            EventKind::Normal => EventType::Normal,
            EventKind::Warning => EventType::Warning,
        };
        publish(ctx, obj, kind, &n.reason, n.action, n.message.clone()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;
    use podmotion_api::RunnerPoolStatus;

    #[test]
    fn a_status_field_that_went_away_is_left_out_of_the_applied_status() {
        // The old status had `credentialSecret`; the new one has not.
        let obj = ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some("rp".into()),
                namespace: Some("ns".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let new = RunnerPoolStatus {
            ready_nodes: 3,
            ..Default::default()
        };
        let body = status_apply_body(&obj, serde_json::to_value(&new).unwrap());
        let status = body["status"].as_object().unwrap();
        assert!(!status.contains_key("credentialSecret"));
        assert_eq!(status["readyNodes"], 3);
        assert_eq!(body["kind"], "ConfigMap");
        assert_eq!(body["metadata"]["name"], "rp");
    }

    #[test]
    fn nulls_are_left_out_at_every_depth() {
        let v = without_nulls(json!({"a": null, "b": {"c": null, "d": 1}, "e": [{"f": null}]}));
        assert_eq!(v, json!({"b": {"d": 1}, "e": [{}]}));
    }
}
