//! The attachment controller's writes: it carries out a plan (Job deletions, always
//! foreground, with their credential Secrets; Job creations, suspended, then each Job's
//! credential Secret in the target's namespace and its resumption with the token's
//! verifier), creates ingest Leases and the agents' NetworkPolicy. Every write goes
//! through the context's writer (which holds the leader's fence) and is recorded in the
//! Job cache at once (read your writes).

use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, PropagationPolicy};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::managers;
use rand::RngCore;

use super::state::{Mode, Shared};
use crate::attachment::plan::{Deletion, Plan, Resume};
use crate::attachment::{AttachmentView, JobFate, JobView, ObservedGroup, notes, plan, render};
use crate::controllers::shell::{ReconcileError, api_err};
use crate::note::{Note, some_names};

/// Plans an observed workload and carries out the plan's Job deletions and (in
/// `Mode::Full`) creations. Returns the plan and the notes on what was done.
pub(super) async fn carry_out(
    s: &Shared,
    group: ObservedGroup,
    mode: Mode,
) -> Result<(Plan, Vec<Note>), ReconcileError> {
    let p = plan(&group, &s.settings);
    let par = s.cfg.write_parallelism.max(1);
    let deleted: Vec<bool> = stream::iter(p.delete.clone())
        .map(|d| async move { delete_job(s, &d).await })
        .buffer_unordered(par)
        .try_collect()
        .await?;
    let mut out = notes::jobs_deleted(&p.delete, &deleted);
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
        out.extend(notes::jobs_created(&created));
    }
    if mode == Mode::Full && p.create.is_empty() {
        resume_all(s, &[], &p.resume).await?;
    }
    Ok((p, out))
}

/// The ingest session Lease of `a`; created (owned by the attachment) when missing.
pub(super) async fn ingest_lease(
    s: &Shared,
    a: &NodeAgentAttachment,
    mode: Mode,
) -> Result<Option<Lease>, ReconcileError> {
    let ns = a.namespace().unwrap_or_default();
    let api: Api<Lease> = Api::namespaced(s.ctx.client.clone(), &ns);
    let name = AttachmentView::from_object(a, None).lease_name();
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
    let lease = render::ingest_lease(a, &name, Timestamp::now());
    match s
        .ctx
        .writer
        .create(&api, &PostParams::default(), &lease)
        .await
    {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.is_already_exists() => api
            .get_opt(&name)
            .await
            .map_err(api_err("get Lease", &name)),
        Err(e) => Err(e.into()),
    }
}

async fn ensure_network_policy(s: &Shared) -> Result<(), ReconcileError> {
    if s.policy_applied.load(Ordering::Relaxed) {
        return Ok(());
    }
    let np = render::network_policy(&s.settings);
    let api: Api<NetworkPolicy> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    s.ctx.writer.apply(&api, &np, managers::ATTACHMENT).await?;
    s.policy_applied.store(true, Ordering::Relaxed);
    Ok(())
}

/// Creates one agent Job; `None` when another reconcile created it first.
async fn create_job(s: &Shared, job: Job) -> Result<Option<Job>, ReconcileError> {
    let name = job.name_any();
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let created = s
        .ctx
        .writer
        .create_if_absent(&api, &job, managers::ATTACHMENT)
        .await?;
    if let Some(v) = created.as_ref().and_then(JobView::from_job) {
        s.jobs.insert_if_absent(s.job_key(&name), v);
    }
    Ok(created)
}

/// Resumes the Jobs just `created` and the kept ones left suspended,
/// `write_parallelism` at a time: each gets a fresh token, its Secret in the target's
/// namespace, then is unsuspended with the token's verifier, so its pod starts with
/// the credential in place and the agents' namespace never holds the token.
async fn resume_all(s: &Shared, created: &[Job], left: &[Resume]) -> Result<(), ReconcileError> {
    if !left.is_empty() {
        let names: Vec<String> = left.iter().map(|r| r.job.clone()).collect();
        tracing::info!(jobs = %some_names(&names), "resuming agent Jobs left suspended");
    }
    let jobs = created
        .iter()
        .filter_map(JobView::from_job)
        .map(|j| Resume::of(&j))
        .chain(left.iter().cloned())
        .collect::<Vec<_>>();
    stream::iter(jobs)
        .map(|r| async move {
            let mut token = [0u8; 32];
            rand::rng().fill_bytes(&mut token);
            create_secret(s, &r, &token).await?;
            resume(s, &r.job, &token).await
        })
        .buffer_unordered(s.cfg.write_parallelism.max(1))
        .try_collect::<Vec<()>>()
        .await
        .map(|_| ())
}

/// The Job's credential Secret in the target's namespace, for `token`. One left by an
/// earlier attempt (the operator stopped before resuming) holds a token whose verifier
/// no Job has: it is replaced. Secrets are never read, only created and deleted.
async fn create_secret(s: &Shared, r: &Resume, token: &[u8]) -> Result<(), ReconcileError> {
    let secret = render::credentials(
        &s.settings,
        render::CredentialOf {
            job: &r.job,
            target_namespace: &r.target_namespace,
            target_pod: &r.target_pod,
            target_pod_uid: &r.target_pod_uid,
        },
        token,
    );
    let secrets: Api<Secret> = Api::namespaced(s.ctx.client.clone(), &r.target_namespace);
    let pp = PostParams {
        field_manager: Some(managers::ATTACHMENT.into()),
        ..Default::default()
    };
    for _ in 0..3 {
        match s.ctx.writer.create(&secrets, &pp, &secret).await {
            Ok(_) => return Ok(()),
            // Only an existing Secret counts (the chaos run's proxy answers creates 409
            // Conflict too): it is an earlier attempt's, with another token.
            Err(e) if e.is_already_exists() => {
                delete_secret(s, &r.target_namespace, &r.job).await?
            }
            Err(e) => return Err(e.into()),
        }
    }
    Err(ReconcileError::wait(
        "the agent's credential Secret keeps coming back",
        std::time::Duration::from_secs(1),
    ))
}

/// Deletes the credential Secret `job` of the target's namespace `ns` (gone is fine).
async fn delete_secret(s: &Shared, ns: &str, job: &str) -> Result<(), ReconcileError> {
    let secrets: Api<Secret> = Api::namespaced(s.ctx.client.clone(), ns);
    s.ctx
        .writer
        .delete(&secrets, job, &DeleteParams::default())
        .await?;
    Ok(())
}

/// Unsuspends the Job with the verifier of `token` on its pod template (one write).
async fn resume(s: &Shared, job: &str, token: &[u8]) -> Result<(), ReconcileError> {
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let pp = PatchParams {
        field_manager: Some(managers::ATTACHMENT.into()),
        ..Default::default()
    };
    let patch = Patch::Merge(render::resume_patch(token));
    match s.ctx.writer.patch(&api, job, &pp, &patch).await {
        Ok(_) => {}
        // Deleted meanwhile: nothing to resume.
        Err(e) if e.is_status(404) => {}
        // A Job that ran once and was suspended again (by hand) has an immutable pod
        // template: it cannot take the new verifier, so it is replaced (foreground; the
        // next reconcile creates its successor once it is gone).
        Err(e) if e.is_status(422) => {
            tracing::warn!(
                job,
                "a suspended Job that ran before cannot take a new token: replacing it"
            );
            let dp = DeleteParams {
                propagation_policy: Some(PropagationPolicy::Foreground),
                ..Default::default()
            };
            s.ctx.writer.delete(&api, job, &dp).await?;
            s.jobs.update_if_present(&s.job_key(job), |j| JobView {
                terminating: true,
                ..j.clone()
            });
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    }
    s.jobs.update_if_present(&s.job_key(job), |j| JobView {
        suspended: false,
        ..j.clone()
    });
    Ok(())
}

/// Deletes one agent Job with foreground propagation; `false` if it was already gone.
async fn delete_job(s: &Shared, d: &Deletion) -> Result<bool, ReconcileError> {
    let api: Api<Job> = Api::namespaced(s.ctx.client.clone(), &s.settings.namespace);
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    if !s.ctx.writer.delete(&api, &d.job, &dp).await? {
        return Ok(false);
    }
    s.jobs.update_if_present(&s.job_key(&d.job), |j| JobView {
        terminating: true,
        ..j.clone()
    });
    // Its credential goes with it (the target pod owns it too, for a pod that goes first).
    if let Some(ns) = s
        .jobs
        .get(&s.job_key(&d.job))
        .map(|j| j.target_namespace.clone())
    {
        delete_secret(s, &ns, &d.job).await?;
    }
    let outcome = match d.fate {
        JobFate::Replace(_) => "Replaced",
        JobFate::Reap(_) => "Reaped",
        JobFate::Keep => return Ok(false),
    };
    s.ctx
        .metrics
        .attachment_job_changes
        .get_or_create(&crate::metrics::OutcomeLabels { outcome })
        .inc();
    tracing::info!(job = %d.job, pod = %d.pod, why = %notes::why(d.fate), "deleting agent Job");
    Ok(true)
}
