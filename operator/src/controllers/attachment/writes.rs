//! The attachment controller's writes: it carries out a plan (Job deletions, always
//! foreground; Job creations, suspended, then each Job's credential Secret and its
//! resumption), creates ingest Leases and the agents' NetworkPolicy. Every write checks
//! the lease first and is recorded in the Job cache at once (read your writes).

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
use serde_json::json;

use super::state::{Mode, Shared};
use crate::attachment::plan::{Deletion, Plan, Resume};
use crate::attachment::{AttachmentView, JobFate, JobView, ObservedGroup, notes, plan, render};
use crate::controllers::shell::{ReconcileError, api_err, is_already_exists, is_status};
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
    s.ctx.ensure_leader()?;
    let lease = render::ingest_lease(a, &name, Timestamp::now());
    match api.create(&PostParams::default(), &lease).await {
        Ok(l) => Ok(Some(l)),
        Err(e) if is_already_exists(&e) => api
            .get_opt(&name)
            .await
            .map_err(api_err("get Lease", &name)),
        Err(e) => Err(api_err("create Lease", &name)(e)),
    }
}

async fn ensure_network_policy(s: &Shared) -> Result<(), ReconcileError> {
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
async fn create_job(s: &Shared, job: Job) -> Result<Option<Job>, ReconcileError> {
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
        Err(e) if is_already_exists(&e) => Ok(None),
        Err(e) => Err(api_err("create Job", &name)(e)),
    }
}

/// Resumes the Jobs just `created` and the kept ones left suspended,
/// `write_parallelism` at a time: each gets its credential Secret (owned by it, random
/// token; one that exists already is kept), then is unsuspended, so its pod starts with
/// the Secret in place.
async fn resume_all(s: &Shared, created: &[Job], left: &[Resume]) -> Result<(), ReconcileError> {
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

async fn create_secret(s: &Shared, r: &Resume) -> Result<(), ReconcileError> {
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
        // Only an existing Secret counts: on any other 409 the Job would be resumed
        // without its Secret, and nothing reads Secrets to notice (found by the chaos
        // run, whose proxy answers creates 409 Conflict).
        Err(e) if is_already_exists(&e) => Ok(()),
        Err(e) => Err(api_err("create Secret", &r.job)(e)),
    }
}

async fn unsuspend(s: &Shared, job: &str) -> Result<(), ReconcileError> {
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

/// Deletes one agent Job with foreground propagation; `false` if it was already gone.
async fn delete_job(s: &Shared, d: &Deletion) -> Result<bool, ReconcileError> {
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
