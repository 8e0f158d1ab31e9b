//! The orphan sweep and `reap-all`: the removal paths that do not start from a watch
//! event. The sweep plans every workload that has agent Jobs, with the one reaping
//! predicate, and deletes only; `reap-all` is the uninstall hook's.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, ListParams, PropagationPolicy};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::finalizers;

use super::state::{Mode, NAME, Shared};
use super::{observe, writes};
use crate::attachment::observed::parse_workload_key;
use crate::attachment::render;
use crate::controllers::shell::ReconcileError;
use crate::writer::Writer;

/// Sweeps once every cache is synced (reaping what was orphaned while the operator was
/// down), then every `sweep_seconds`, while this replica leads.
pub(super) async fn every_period(s: Arc<Shared>) {
    let stop = s.ctx.shutdown();
    tokio::pin!(stop);
    while !(s.caches_ready() && s.ctx.readiness.is_ready(NAME)) {
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    let mut tick = tokio::time::interval(Duration::from_secs(s.cfg.sweep_seconds.max(1)));
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {}
        }
        if !s.ctx.writer.leads() {
            continue;
        }
        match sweep(&s).await {
            Ok(n) if n > 0 => tracing::info!(reaped = n, "orphan sweep reaped agent Jobs"),
            Ok(_) => {}
            Err(e) => tracing::warn!(category = e.category(), error = %e, "orphan sweep failed"),
        }
    }
}

/// The periodic orphan sweep: every workload that has agent Jobs is planned (with the
/// one reaping predicate) and its unwanted Jobs deleted. Covers operator restarts,
/// attachments deleted while the operator was down, and vanished ingest clients.
/// Returns the number of Jobs deleted.
async fn sweep(s: &Shared) -> Result<usize, ReconcileError> {
    let jobs = s.jobs.select(|_, _| true);
    s.ctx.metrics.attachment_jobs.set(jobs.len() as i64);
    let groups: BTreeSet<(String, String)> = jobs
        .iter()
        .map(|j| (j.target_namespace.clone(), j.workload.clone()))
        .collect();
    let mut reaped = 0;
    for (ns, key) in groups {
        let Some(w) = parse_workload_key(&key) else {
            continue;
        };
        if s.cfg
            .watch_namespace
            .as_ref()
            .is_some_and(|only| *only != ns)
        {
            continue;
        }
        let group = observe::workload(s, &ns, &w, None, Mode::DeletesOnly).await?;
        let (p, _) = writes::carry_out(s, group, Mode::DeletesOnly).await?;
        reaped += p.delete.len();
    }
    Ok(reaped)
}

/// `reap-all`: deletes every agent Job in `namespace` (foreground) and its credential
/// Secret in the target's namespace, waits until the Jobs are
/// gone (bounded by `timeout`), and removes the attachment finalizer from every
/// NodeAgentAttachment of the release `me` (or of none) so that uninstalling the
/// operator cannot leave them stuck; another release's keep theirs.
/// Returns the number of Jobs deleted. Run it with the controllers stopped (the Helm
/// pre-delete hook), or live attachments get their Jobs back.
pub async fn reap_all(
    client: Client,
    namespace: &str,
    me: &str,
    timeout: Duration,
) -> anyhow::Result<usize> {
    let api: Api<Job> = Api::namespaced(client.clone(), namespace);
    // The hook runs with the controllers stopped and holds no lease: unfenced.
    let writer = Writer::hook(client.clone());
    let deleted = delete_agent_jobs(&writer, &api).await?;
    await_deleted(&api, &deleted, timeout).await?;
    crate::release::release_all::<NodeAgentAttachment>(
        &client,
        None,
        finalizers::ATTACHMENT_CLEANUP,
        me,
    )
    .await?;
    Ok(deleted.len())
}

/// Deletes every agent Job (foreground); returns the name and UID of each one deleted.
async fn delete_agent_jobs(
    writer: &Writer,
    api: &Api<Job>,
) -> anyhow::Result<Vec<(String, String)>> {
    let lp = ListParams::default().labels(&render::agent_selector());
    let jobs = api.list_metadata(&lp).await?;
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    let mut deleted = vec![];
    for j in &jobs.items {
        if writer.delete(api, &j.name_any(), &dp).await? {
            deleted.push((j.name_any(), j.uid().unwrap_or_default()));
        }
        // Its credential, in the target's namespace.
        if let Some(ns) = j
            .labels()
            .get(podmotion_api::names::labels::TARGET_NAMESPACE)
        {
            let secrets: Api<Secret> = Api::namespaced(api.clone().into_client(), ns);
            writer
                .delete(&secrets, &j.name_any(), &DeleteParams::default())
                .await?;
        }
    }
    Ok(deleted)
}

/// Waits until every deleted Job is gone, at most `timeout`. Foreground deletion: each
/// Job disappears once its pods (and Secret) are gone.
async fn await_deleted(
    api: &Api<Job>,
    deleted: &[(String, String)],
    timeout: Duration,
) -> anyhow::Result<()> {
    let gone = stream::iter(deleted.iter())
        .map(|(name, uid)| await_condition(api.clone(), name, conditions::is_deleted(uid)))
        .buffer_unordered(16)
        .try_collect::<Vec<_>>();
    tokio::time::timeout(timeout, gone)
        .await
        .map_err(|_| anyhow::anyhow!("agent Jobs still present after {timeout:?}"))??;
    Ok(())
}
