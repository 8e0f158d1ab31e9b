//! The RunnerPool controller's writes: each child is applied when missing or when its
//! rendered form changed (a hash annotation on the small children, the drift check for
//! the DaemonSet), so a settled pool costs no writes; children no longer rendered are
//! deleted. Secrets are never read where the chart grants no read.

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, PostParams, PropagationPolicy};
use kube::{Resource, ResourceExt};
use podmotion_api::RunnerPool;
use podmotion_api::names::{annotations, labels, managers};
use rand::RngCore;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::context::Context;
use crate::controllers::shell::{ReconcileError, api_err};
use crate::meta::{owner_selector, short_hash};
use crate::runner_pool::{Applied, Desired, Inputs, drift, render};

/// Renders the pool and applies every child that changed; returns what was
/// rendered and what the applies left behind. `live` is the DaemonSet as the cache has
/// it.
pub(super) async fn apply_all(
    ctx: &Context,
    reads_secrets: bool,
    pool: &RunnerPool,
    inputs: &Inputs,
    live: Option<DaemonSet>,
) -> Result<(Desired, Applied), ReconcileError> {
    let ns = pool.namespace().unwrap_or_default();
    let desired = render::render(pool, inputs);
    let client = &ctx.client;
    let sa = desired.service_account.clone();
    apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), sa).await?;
    let credential_secret = ensure_credential_secret(ctx, reads_secrets, pool, &desired).await?;
    let np = desired.network_policy.clone();
    apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), np).await?;
    let pdb = desired.pdb.clone();
    apply_if_changed(ctx, &Api::namespaced(client.clone(), &ns), pdb).await?;
    let mut conflicts = vec![];
    if let Some(pc) = desired.priority_class.clone()
        && let Some(conflict) = apply_priority_class(ctx, pool, pc).await?
    {
        conflicts.push(conflict);
    }
    let keep_pc: BTreeSet<String> = desired
        .priority_class
        .iter()
        .map(|p| p.name_any())
        .collect();
    delete_priority_classes(ctx, pool, &keep_pc).await?;
    // The DaemonSet: drift is judged on the live object before the apply.
    let (daemonset, drift) = apply_daemonset(ctx, pool, &desired, live).await?;
    let applied = Applied {
        daemonset,
        drift,
        conflicts,
        credential_secret,
    };
    Ok((desired, applied))
}

/// Keeps the generated credential Secret: returns the name of the one the operator owns.
///
/// Where Secrets may be read, it is applied like the other children and stale ones are
/// deleted by label. Elsewhere the operator never reads a Secret: it creates the Secret
/// once (an existing one is kept: 409), records its name in the status, and deletes a
/// previously recorded one by name when the pool switches to its own Secret.
pub(super) async fn ensure_credential_secret(
    ctx: &Context,
    reads_secrets: bool,
    pool: &RunnerPool,
    desired: &Desired,
) -> Result<Option<String>, ReconcileError> {
    let api: Api<Secret> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let want = desired.secret.as_ref().map(|x| x.name_any());
    if reads_secrets {
        if let Some(secret) = desired.secret.clone() {
            apply_if_changed(ctx, &api, secret).await?;
        }
        let keep: BTreeSet<String> = want.iter().cloned().collect();
        ctx.writer
            .delete_orphans(
                &api,
                &owner_selector(pool),
                &keep,
                PropagationPolicy::Background,
            )
            .await?;
        return Ok(want);
    }
    let recorded = pool
        .status
        .as_ref()
        .and_then(|st| st.credential_secret.clone());
    if let Some(old) = recorded.as_ref().filter(|old| want.as_ref() != Some(*old)) {
        ctx.writer
            .delete_with(&api, old, PropagationPolicy::Background)
            .await?;
    }
    if let Some(secret) = desired.secret.as_ref().filter(|_| recorded != want) {
        let (secret, _) = stamp(secret.clone());
        // A 409 Conflict (contention, a proxy) is not "it exists": only AlreadyExists is.
        match ctx
            .writer
            .create(&api, &PostParams::default(), &secret)
            .await
        {
            Ok(_) => {}
            Err(e) if e.is_already_exists() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(want)
}

/// 32 random bytes as hex.
pub(super) fn fresh_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    crate::meta::hex(&bytes)
}

/// The hash of a rendered object, recorded as an annotation on it.
fn stamp<K: Resource + Serialize>(mut obj: K) -> (K, String) {
    let hash = short_hash(&serde_json::to_string(&obj).unwrap_or_default(), 16);
    obj.annotations_mut()
        .insert(annotations::SPEC_HASH.into(), hash.clone());
    (obj, hash)
}

/// Applies `obj` unless the live one carries the same rendered hash (reads, no write).
pub(super) async fn apply_if_changed<K>(
    ctx: &Context,
    api: &Api<K>,
    obj: K,
) -> Result<(), ReconcileError>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + std::fmt::Debug,
{
    let (obj, hash) = stamp(obj);
    let name = obj.name_any();
    let live = api
        .get_metadata_opt(&name)
        .await
        .map_err(api_err("get", format!("{} {name}", K::kind(&()))))?;
    if live
        .as_ref()
        .and_then(|l| l.annotations().get(annotations::SPEC_HASH))
        == Some(&hash)
    {
        return Ok(());
    }
    ctx.writer.apply(api, &obj, managers::RUNNER_POOL).await?;
    Ok(())
}

/// Applies the pool's PriorityClass. One of another owner is never taken over (that
/// is reported); the value of a PriorityClass is immutable, so ours is replaced when
/// the value changes. Returns a conflict message, if any.
pub(super) async fn apply_priority_class(
    ctx: &Context,
    pool: &RunnerPool,
    pc: PriorityClass,
) -> Result<Option<String>, ReconcileError> {
    let api: Api<PriorityClass> = Api::all(ctx.client.clone());
    let name = pc.name_any();
    if let Some(live) = api
        .get_opt(&name)
        .await
        .map_err(api_err("get", format!("PriorityClass {name}")))?
    {
        let ours = live.labels().get(labels::OWNER_UID) == pool.uid().as_ref();
        if !ours {
            return Ok(Some(format!(
                "PriorityClass {name} exists and is not this pool's: set priorityClass.create=false to use it, or pick another name"
            )));
        }
        if live.value != pc.value {
            ctx.writer
                .delete_with(&api, &name, PropagationPolicy::Background)
                .await?;
        }
    }
    apply_if_changed(ctx, &api, pc).await?;
    Ok(None)
}

/// Deletes the pool's PriorityClasses not in `keep` (found by owner label).
pub(super) async fn delete_priority_classes(
    ctx: &Context,
    pool: &RunnerPool,
    keep: &BTreeSet<String>,
) -> Result<(), ReconcileError> {
    let api: Api<PriorityClass> = Api::all(ctx.client.clone());
    ctx.writer
        .delete_orphans(
            &api,
            &owner_selector(pool),
            keep,
            PropagationPolicy::Background,
        )
        .await?;
    Ok(())
}

/// Applies the DaemonSet when it is missing or has drifted; returns the live object
/// and the drift found before the apply. `live` comes from the DaemonSet cache (the
/// watch the controller is woken by): when it shows the rendered hash and no drift, a
/// settled pool costs no read and no write. Otherwise the DaemonSet is read again
/// before anything is judged, so a cached copy that lags behind our last apply can
/// never be reported as drift (a drifted change of the live object arrives through
/// the same watch and wakes the pool again).
pub(super) async fn apply_daemonset(
    ctx: &Context,
    pool: &RunnerPool,
    desired: &Desired,
    live: Option<DaemonSet>,
) -> Result<(DaemonSet, Vec<String>), ReconcileError> {
    let api: Api<DaemonSet> =
        Api::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default());
    let (ds, hash) = stamp(desired.daemonset.clone());
    let name = ds.name_any();
    let settled = |l: &DaemonSet| {
        l.annotations().get(annotations::SPEC_HASH) == Some(&hash)
            && drift::shape_drift(&ds, l).is_empty()
    };
    if let Some(live) = live.filter(|l| settled(l)) {
        return Ok((live, vec![]));
    }
    let live = api
        .get_opt(&name)
        .await
        .map_err(api_err("get", format!("DaemonSet {name}")))?;
    let drift = live
        .as_ref()
        .map(|l| drift::shape_drift(&ds, l))
        .unwrap_or_default();
    let hash_matches = live
        .as_ref()
        .and_then(|l| l.annotations().get(annotations::SPEC_HASH))
        == Some(&hash);
    if let Some(live) = live.filter(|_| drift.is_empty() && hash_matches) {
        return Ok((live, drift));
    }
    let applied = ctx.writer.apply(&api, &ds, managers::RUNNER_POOL).await?;
    // A forced apply restores every field we own, but cannot remove what another
    // manager added (an extra volume, a capability). Then replace the whole spec.
    if drift::shape_drift(&ds, &applied).is_empty() {
        return Ok((applied, drift));
    }
    Ok((replace_daemonset(ctx, &api, &ds, applied).await?, drift))
}

/// Replaces the whole DaemonSet with `ds`, from the `current` one. The DaemonSet
/// controller writes its status all the time, so the resourceVersion may move between
/// our read and the replace: a conflict is retried on a fresh read (5 times).
async fn replace_daemonset(
    ctx: &Context,
    api: &Api<DaemonSet>,
    ds: &DaemonSet,
    mut current: DaemonSet,
) -> Result<DaemonSet, ReconcileError> {
    let name = ds.name_any();
    let pp = PostParams {
        field_manager: Some(managers::RUNNER_POOL.into()),
        ..Default::default()
    };
    let mut attempts = 0;
    loop {
        let mut replacement = ds.clone();
        replacement.metadata.resource_version = current.resource_version();
        match ctx.writer.replace(api, &name, &pp, &replacement).await {
            Ok(r) => return Ok(r),
            Err(e) if e.is_status(409) && attempts < 5 => {
                attempts += 1;
                current = api
                    .get(&name)
                    .await
                    .map_err(api_err("get", format!("DaemonSet {name}")))?;
            }
            Err(e) => return Err(e.into()),
        }
    }
}
