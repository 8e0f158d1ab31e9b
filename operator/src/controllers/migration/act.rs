//! The migration controller's writes: each action the machine returns, carried out
//! idempotently (a repeated reconcile repeats them harmlessly). The finalizer is the
//! shell's, so `RemoveFinalizer` (which tells the shell the cleanup is done) only
//! forgets the key memo here.

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use podmotion_api::names::managers;
use podmotion_api::{PodMigration, PodMigrationStatus};

use super::observe::endpoint_of;
use super::state::Shared;
use crate::controllers::shell::ReconcileError;
use crate::migration::agent::{AgentCallError, AgentClient, Side, Step};
use crate::migration::machine::Action;
use crate::migration::render;
use crate::writer::WriteError;

/// What the machine decided that must follow the status write.
#[derive(Default)]
pub(super) struct Deferred {
    pub(super) actions: Vec<Action>,
    pub(super) source: Option<Pod>,
    pub(super) target: Option<Pod>,
    pub(super) status: PodMigrationStatus,
}

pub(super) async fn execute<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
    action: &Action,
    d: &Deferred,
) -> Result<(), ReconcileError> {
    let ns = pm.namespace().unwrap_or_default();
    let secrets: Api<Secret> = Api::namespaced(s.ctx.client.clone(), &ns);
    match action {
        // The shell removes it once this round succeeds: forget the key memo.
        Action::RemoveFinalizer => {
            s.remember_key_secret(pm, None);
            Ok(())
        }
        Action::EnsureTransferKey => {
            let key = s.master_key.transfer_key(&pm.uid().unwrap_or_default());
            let secret = render::transfer_key_secret(pm, &key.0);
            create_if_absent(s, &secrets, &secret).await?;
            s.remember_key_secret(pm, Some(true));
            Ok(())
        }
        Action::Agent(side, step) => start_step(s, pm, d, (*side, *step)).await,
        Action::DeleteTransferKey => {
            let name = render::transfer_key_name(pm);
            s.ctx
                .writer
                .delete(&secrets, &name, &DeleteParams::default())
                .await?;
            s.remember_key_secret(pm, Some(false));
            Ok(())
        }
        Action::EnsureTargetPod
        | Action::LowerSourceDeletionCost
        | Action::HandOverTargetPod
        | Action::DeleteSourcePod { .. }
        | Action::DeleteTargetPod => pod_action(s, pm, action, d).await,
    }
}

/// The actions on the source and target pods.
async fn pod_action<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
    action: &Action,
    d: &Deferred,
) -> Result<(), ReconcileError> {
    let pods: Api<Pod> = Api::namespaced(s.ctx.client.clone(), &pm.namespace().unwrap_or_default());
    match (action, &d.source, &d.target) {
        (Action::EnsureTargetPod, source, _) => {
            ensure_target_pod(s, pm, &pods, source.as_ref(), &d.status).await
        }
        (Action::LowerSourceDeletionCost, Some(src), _) => {
            let name = src.name_any();
            merge_patch(s, &pods, &name, &render::deletion_cost_patch())
                .await
                .or_else(|e| ignore(e, &[404]))
        }
        (Action::HandOverTargetPod, _, Some(t)) => {
            let name = t.name_any();
            merge_patch(s, &pods, &name, &render::hand_over_patch(t))
                .await
                .map_err(ReconcileError::from)
        }
        (Action::DeleteSourcePod { grace_seconds }, _, _) => {
            delete_source_pod(s, &pods, pm, &d.status, *grace_seconds).await
        }
        (Action::DeleteTargetPod, _, target) => delete_target_pod(s, &pods, target.as_ref()).await,
        // Nothing to act on (the pod is gone), or not a pod action.
        _ => Ok(()),
    }
}

/// Creates the target pod from the source pod, pinned to the recorded target node.
async fn ensure_target_pod<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
    pods: &Api<Pod>,
    source: Option<&Pod>,
    status: &PodMigrationStatus,
) -> Result<(), ReconcileError> {
    let Some(src) = source else {
        return Err(ReconcileError::Inconsistent(
            "target pod wanted without source pod".into(),
        ));
    };
    let Some(node) = status.target_node.as_deref() else {
        return Err(ReconcileError::Inconsistent(
            "target pod wanted without a target node".into(),
        ));
    };
    let pod = render::target_pod(pm, src, node, &s.cfg.holder());
    create_if_absent(s, pods, &pod).await
}

/// A merge patch of the pod `name`.
async fn merge_patch<A: AgentClient>(
    s: &Shared<A>,
    pods: &Api<Pod>,
    name: &str,
    patch: &serde_json::Value,
) -> Result<(), WriteError> {
    s.ctx
        .writer
        .patch(pods, name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map(|_| ())
}

/// Deletes the source pod (see `render::source_pod_deletion`: its UID, the machine's
/// grace period). A pod already terminating takes a shorter grace period, never a
/// longer one (the API server's rule), which is what the machine relies on.
async fn delete_source_pod<A: AgentClient>(
    s: &Shared<A>,
    pods: &Api<Pod>,
    pm: &PodMigration,
    status: &PodMigrationStatus,
    grace_seconds: i64,
) -> Result<(), ReconcileError> {
    let dp = render::source_pod_deletion(status.source_pod_uid.clone(), grace_seconds);
    let name = &pm.spec.pod_name;
    s.ctx
        .writer
        .delete(pods, name, &dp)
        .await
        .map(|_| ())
        .or_else(|e| ignore(e, &[404, 409]))
}

/// Deletes the target pod as observed (`observe`: the name only this migration makes,
/// recording this migration), if any, by its UID: never a pod named by the status.
async fn delete_target_pod<A: AgentClient>(
    s: &Shared<A>,
    pods: &Api<Pod>,
    target: Option<&Pod>,
) -> Result<(), ReconcileError> {
    let Some(t) = target else {
        return Ok(());
    };
    let name = t.name_any();
    let dp = DeleteParams {
        preconditions: t.uid().map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..Default::default()
    };
    s.ctx
        .writer
        .delete(pods, &name, &dp)
        .await
        .map(|_| ())
        .or_else(|e| ignore(e, &[404, 409]))
}

/// Starts `step` on the agent of `side`'s node.
async fn start_step<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
    d: &Deferred,
    (side, step): (Side, Step),
) -> Result<(), ReconcileError> {
    let status = &d.status;
    let node = match side {
        Side::Source => status.source_node.as_deref(),
        Side::Target => status.target_node.as_deref(),
    }
    .ok_or_else(|| ReconcileError::Inconsistent(format!("no {side} node recorded")))?;
    let Some(endpoint) = endpoint_of(s, node).await? else {
        return Err(ReconcileError::Inconsistent(format!(
            "no agent endpoint for {node}"
        )));
    };
    let target_agent_url = match status.target_node.as_deref() {
        Some(t) => endpoint_of(s, t).await?.map(|e| e.url),
        None => None,
    };
    let request = render::step_request(
        pm,
        status,
        (side, step),
        (d.source.as_ref(), d.target.as_ref()),
        s.master_key.transfer_key(&pm.uid().unwrap_or_default()),
        target_agent_url,
    );
    // `start` only hands the step over (its work is bounded by the machine's progress
    // timeout); the hand-over itself gets the call deadline.
    let limit = s.cfg.agent_call_timeout();
    tokio::time::timeout(limit, s.agents.start(&endpoint, &request))
        .await
        .map_err(|_| AgentCallError {
            node: node.to_string(),
            message: format!(
                "{step} not accepted within {}s (--migration-agent-call-timeout-seconds)",
                limit.as_secs()
            ),
        })??;
    Ok(())
}

/// `Ok` for the API server's answers in `codes` (the write's effect is already there).
fn ignore(e: WriteError, codes: &[u16]) -> Result<(), ReconcileError> {
    match e {
        e if codes.iter().any(|c| e.is_status(*c)) => Ok(()),
        e => Err(e.into()),
    }
}

/// Creates `obj` as the migration controller; one that exists already is fine.
async fn create_if_absent<A: AgentClient, K>(
    s: &Shared<A>,
    api: &Api<K>,
    obj: &K,
) -> Result<(), ReconcileError>
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + serde::Serialize
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    s.ctx
        .writer
        .create_if_absent(api, obj, managers::MIGRATION)
        .await?;
    Ok(())
}
