//! `reap-all`, the Helm pre-delete hook: leaves no PodMotion object that only a running
//! operator could release. Helm runs it while the operator still runs, so the order is
//! what makes it work: (1) delete the in-flight PodMigrations and give the operator a
//! bounded time to roll them back (the source keeps running; never two copies), (2)
//! scale the operator Deployment to zero and wait until its pods are gone (a live
//! operator puts back every finalizer it sees removed), (3) remove the PodMotion
//! finalizer of every PodMigration, RunnerPool and NodeAgentAttachment in the
//! namespaces the controllers watch, and (4) reap the attachment Jobs as before. The
//! objects themselves and the CRDs are kept. Steps (1) and (3) touch only the objects
//! this release holds (or nobody does): another PodMotion release watching the same
//! namespaces keeps its migrations running and its finalizers (`podmotion_core::claim`). The decisions are the pure functions at
//! the top (`in_flight`; `released` with `release_all`, shared with `reap-all`, is in
//! `podmotion_operator::release`); the rest is I/O.

use std::time::Duration;

use anyhow::Context as _;
use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::names::finalizers;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_operator::claim::may_act;
use podmotion_operator::config::ControllerKind;
use podmotion_operator::controllers::attachment;
use podmotion_operator::release::release_all;
use podmotion_operator::writer::Writer;
use serde_json::json;

/// How long the operator gets to roll back the in-flight PodMigrations the hook deleted.
/// A migration still there afterwards is released anyway: its source is resumed by its
/// agent's watchdog, or on the agent's SIGTERM when the release removes the agents.
const MIGRATION_ROLLBACK_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the operator's pods get to exit after the scale to zero (their grace
/// period is 30 s).
const OPERATOR_STOP_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `reap-all` waits for the foreground deletion of every attachment Job.
/// The three bounds together stay under the hook's `activeDeadlineSeconds` (300).
const JOBS_TIMEOUT: Duration = Duration::from_secs(120);

/// What the hook works on, from the operator's own settings (the hook gets the same
/// environment as the operator).
#[derive(Clone, Debug)]
pub struct Uninstall {
    /// The operator's namespace (the release's).
    pub namespace: String,
    /// The operator Deployment to scale to zero; `None` when the operator does not run
    /// from one (then nothing is scaled).
    pub operator_deployment: Option<String>,
    /// The enabled controllers: the kinds of the others are left alone (the hook has no
    /// permission on them).
    pub controllers: Vec<ControllerKind>,
    /// Each controller's watch namespace (`None`: all namespaces).
    pub migration_scope: Option<String>,
    pub attachment_scope: Option<String>,
    pub runner_pool_scope: Option<String>,
    /// Where the attachment Jobs are.
    pub jobs_namespace: String,
    /// This release's identity (`claim::release_identity`): the objects it may touch.
    pub release: String,
}

/// Whether a PodMigration is still moving a pod (or waiting to): not terminal. Those are
/// deleted first so that the operator rolls them back before it stops.
pub fn in_flight(pm: &PodMigration) -> bool {
    !pm.status.as_ref().is_some_and(|s| s.phase.is_terminal())
}

/// Whether the hook of the release `me` rolls back `pm`: in flight, and not held by
/// another release (whose operator keeps driving it).
pub fn to_roll_back(pm: &PodMigration, me: &str) -> bool {
    in_flight(pm) && may_act(pm.annotations(), me)
}

fn api_in<K>(client: &Client, scope: Option<&str>) -> Api<K>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>,
{
    match scope {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

impl Uninstall {
    fn runs(&self, c: ControllerKind) -> bool {
        self.controllers.contains(&c)
    }

    /// The whole hook, in order. Fails (and Helm's uninstall with it) only when the
    /// operator cannot be stopped or an API call fails; the hook Job retries.
    pub async fn run(&self, client: &Client) -> anyhow::Result<()> {
        if self.runs(ControllerKind::Migration) {
            self.roll_back_in_flight_migrations(client).await?;
        }
        if let Some(deployment) = &self.operator_deployment {
            self.stop_operator(client, deployment).await?;
        }
        if self.runs(ControllerKind::Migration) {
            let n = release_all::<PodMigration>(
                client,
                self.migration_scope.as_deref(),
                finalizers::MIGRATION_CLEANUP,
                &self.release,
            )
            .await?;
            tracing::info!(released = n, "PodMigration finalizers removed");
        }
        if self.runs(ControllerKind::RunnerPool) {
            let n = release_all::<RunnerPool>(
                client,
                self.runner_pool_scope.as_deref(),
                finalizers::RUNNER_POOL_CLEANUP,
                &self.release,
            )
            .await?;
            tracing::info!(released = n, "RunnerPool finalizers removed");
        }
        if self.runs(ControllerKind::Attachment) {
            let n = release_all::<NodeAgentAttachment>(
                client,
                self.attachment_scope.as_deref(),
                finalizers::ATTACHMENT_CLEANUP,
                &self.release,
            )
            .await?;
            tracing::info!(released = n, "NodeAgentAttachment finalizers removed");
            let jobs = attachment::reap_all(
                client.clone(),
                &self.jobs_namespace,
                &self.release,
                JOBS_TIMEOUT,
            )
            .await?;
            tracing::info!(jobs, namespace = %self.jobs_namespace, "reaped every attachment Job");
        }
        Ok(())
    }

    /// Deletes every in-flight PodMigration and waits (bounded) until the operator has
    /// rolled each back and released it. A migration past its probe rolls forward to
    /// its commit instead (deletion waits for it), which is just as final.
    async fn roll_back_in_flight_migrations(&self, client: &Client) -> anyhow::Result<()> {
        let deleted = self.delete_in_flight_migrations(client).await?;
        if deleted.is_empty() {
            return Ok(());
        }
        tracing::info!(
            migrations = deleted.len(),
            "deleted in-flight PodMigrations; waiting for their rollback"
        );
        wait_for_rollback(client, &deleted).await
    }

    /// Deletes every PodMigration of this release still to roll back; the deleted ones
    /// as (namespace, name, uid).
    async fn delete_in_flight_migrations(
        &self,
        client: &Client,
    ) -> anyhow::Result<Vec<(String, String, String)>> {
        let api: Api<PodMigration> = api_in(client, self.migration_scope.as_deref());
        let list = api
            .list(&ListParams::default())
            .await
            .context("list PodMigrations")?;
        let mut deleted = vec![];
        // The hook runs with the controllers stopped and holds no lease: unfenced.
        let writer = Writer::hook(client.clone());
        for pm in list
            .items
            .iter()
            .filter(|pm| to_roll_back(pm, &self.release))
        {
            let (ns, name) = (pm.namespace().unwrap_or_default(), pm.name_any());
            let ns_api: Api<PodMigration> = Api::namespaced(client.clone(), &ns);
            let dp = DeleteParams::default();
            if writer.delete(&ns_api, &name, &dp).await? {
                deleted.push((ns, name, pm.uid().unwrap_or_default()));
            }
        }
        Ok(deleted)
    }

    /// Scales the operator Deployment to zero and waits until none of its pods is left.
    async fn stop_operator(&self, client: &Client, deployment: &str) -> anyhow::Result<()> {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), &self.namespace);
        let patch = Patch::Merge(json!({"spec": {"replicas": 0}}));
        let writer = Writer::hook(client.clone());
        let scale = match writer
            .patch_scale(&deployments, deployment, &PatchParams::default(), &patch)
            .await
        {
            Ok(s) => s,
            // Already gone: nothing runs it.
            Err(e) if e.is_status(404) => return Ok(()),
            Err(e) => {
                return Err(e).with_context(|| {
                    format!("scale Deployment {}/{deployment} to 0", self.namespace)
                });
            }
        };
        let selector = scale
            .status
            .map(|s| s.selector.unwrap_or_default())
            .filter(|s| !s.is_empty())
            .with_context(|| format!("Deployment {deployment} reports no pod selector"))?;
        tracing::info!(%deployment, %selector, "operator scaled to 0; waiting for its pods to exit");
        let pods: Api<Pod> = Api::namespaced(client.clone(), &self.namespace);
        let wait = async {
            loop {
                let list = pods
                    .list_metadata(&ListParams::default().labels(&selector))
                    .await
                    .context("list operator pods")?;
                if list.items.is_empty() {
                    return anyhow::Ok(());
                }
                stream::iter(list.items.iter())
                    .map(|p| {
                        let uid = p.uid().unwrap_or_default();
                        let name = p.name_any();
                        let pods = pods.clone();
                        async move { await_condition(pods, &name, conditions::is_deleted(&uid)).await }
                    })
                    .buffer_unordered(8)
                    .try_collect::<Vec<_>>()
                    .await
                    .context("watch operator pods")?;
            }
        };
        tokio::time::timeout(OPERATOR_STOP_TIMEOUT, wait)
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "operator pods ({selector}) still running {OPERATOR_STOP_TIMEOUT:?} after the scale to 0"
                )
            })??;
        tracing::info!(%deployment, "operator stopped");
        Ok(())
    }
}

/// Waits (up to [`MIGRATION_ROLLBACK_TIMEOUT`]) until every deleted PodMigration
/// (namespace, name, uid) is gone; past the timeout, logs those left and goes on.
async fn wait_for_rollback(
    client: &Client,
    deleted: &[(String, String, String)],
) -> anyhow::Result<()> {
    let gone = stream::iter(deleted.iter())
        .map(|(ns, name, uid)| {
            let api: Api<PodMigration> = Api::namespaced(client.clone(), ns);
            await_condition(api, name, conditions::is_deleted(uid))
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>();
    match tokio::time::timeout(MIGRATION_ROLLBACK_TIMEOUT, gone).await {
        Ok(r) => {
            r.context("watch PodMigrations")?;
        }
        Err(_) => {
            let left = stream::iter(deleted.iter())
                .filter_map(|(ns, name, _)| {
                    let api: Api<PodMigration> = Api::namespaced(client.clone(), ns);
                    async move {
                        api.get_opt(name)
                            .await
                            .ok()
                            .flatten()
                            .map(|_| format!("{ns}/{name}"))
                    }
                })
                .collect::<Vec<_>>()
                .await;
            tracing::warn!(
                ?left,
                "PodMigrations not rolled back in {MIGRATION_ROLLBACK_TIMEOUT:?}: released anyway (their sources are resumed by the agents' watchdog or on the agents' SIGTERM)"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_api::migration::MigrationPhase;

    fn pm(phase: Option<MigrationPhase>) -> PodMigration {
        let mut v = json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "m", "namespace": "ns"},
            "spec": {"podName": "p"}
        });
        if let Some(phase) = phase {
            v["status"] = json!({"phase": phase});
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_hook_rolls_back_only_its_own_release_s_migrations_or_nobody_s() {
        let me = "podmotion-a/podmotion-operator";
        let claimed = |by: &str| {
            let mut m = pm(Some(MigrationPhase::Transferring));
            m.annotations_mut().insert(
                podmotion_api::names::annotations::CONTROLLER.into(),
                by.into(),
            );
            m
        };
        assert!(to_roll_back(&pm(None), me), "unclaimed");
        assert!(to_roll_back(&claimed(me), me));
        assert!(!to_roll_back(
            &claimed("podmotion-b/podmotion-operator"),
            me
        ));
        let mut done = claimed(me);
        done.status.as_mut().unwrap().phase = MigrationPhase::Succeeded;
        assert!(!to_roll_back(&done, me), "finished");
    }

    #[test]
    fn only_unfinished_migrations_are_in_flight() {
        use MigrationPhase::*;
        assert!(in_flight(&pm(None)), "not yet reconciled");
        for p in [
            Pending,
            Preparing,
            Checkpointing,
            Transferring,
            Restoring,
            Committing,
        ] {
            assert!(in_flight(&pm(Some(p))), "{p:?}");
        }
        for p in [Succeeded, Failed, Aborted] {
            assert!(!in_flight(&pm(Some(p))), "{p:?}");
        }
    }
}
