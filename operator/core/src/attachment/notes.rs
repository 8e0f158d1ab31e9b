//! The Events an attachment's reconcile records about its Jobs, worded once: one Event
//! per kind of change and reconcile, not one per Job (a 100-replica workload must not
//! cost 100 extra writes), naming the first few Jobs with their pods.

use k8s_openapi::api::batch::v1::Job;
use kube_core::ResourceExt;
use podmotion_api::names::{annotations, reasons};

use super::plan::Deletion;
use super::reap::JobFate;
use crate::note::{Note, some_names};

/// The Event about the Jobs just created (`None` when none was).
pub fn jobs_created(created: &[Job]) -> Option<Note> {
    if created.is_empty() {
        return None;
    }
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
    Some(Note::normal(
        reasons::JOB_CREATED,
        "CreateJob",
        format!(
            "created {} agent Job(s): {}",
            lines.len(),
            some_names(&lines)
        ),
    ))
}

/// The Events about the Jobs deleted (`done[i]`: `deletions[i]` was carried out; a Job
/// already gone is not reported): one for replaced Jobs, one for reaped ones.
pub fn jobs_deleted(deletions: &[Deletion], done: &[bool]) -> Vec<Note> {
    let mut out = vec![];
    for (replaced, reason, verb) in [
        (true, reasons::JOB_REPLACED, "replacing"),
        (false, reasons::JOB_REAPED, "reaping"),
    ] {
        let lines: Vec<String> = deletions
            .iter()
            .zip(done)
            .filter(|(d, done)| **done && matches!(d.fate, JobFate::Replace(_)) == replaced)
            .map(|(d, _)| format!("{} (pod {}: {})", d.job, d.pod, why(d.fate)))
            .collect();
        if !lines.is_empty() {
            out.push(Note::normal(
                reason,
                "DeleteJob",
                format!(
                    "{verb} {} agent Job(s): {}",
                    lines.len(),
                    some_names(&lines)
                ),
            ));
        }
    }
    out
}

/// Why a Job goes, in words (empty for a kept one).
pub fn why(fate: JobFate) -> &'static str {
    match fate {
        JobFate::Replace(r) => r.describe(),
        JobFate::Reap(r) => r.describe(),
        JobFate::Keep => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attachment::{ReapReason, ReplaceReason};

    fn deletion(job: &str, fate: JobFate) -> Deletion {
        Deletion {
            job: job.into(),
            pod: format!("pod-of-{job}"),
            fate,
        }
    }

    #[test]
    fn replaced_and_reaped_jobs_get_one_event_each() {
        let ds = vec![
            deletion("a", JobFate::Replace(ReplaceReason::ContainerRestarted)),
            deletion("b", JobFate::Reap(ReapReason::TargetGone)),
            deletion("c", JobFate::Reap(ReapReason::TargetGone)),
        ];
        let notes = jobs_deleted(&ds, &[true, true, false]);
        assert_eq!(notes.len(), 2);
        assert_eq!(notes[0].reason, reasons::JOB_REPLACED);
        assert!(
            notes[0]
                .message
                .starts_with("replacing 1 agent Job(s): a (pod pod-of-a: ")
        );
        assert_eq!(notes[1].reason, reasons::JOB_REAPED);
        // `c` was already gone: not reported.
        assert!(notes[1].message.starts_with("reaping 1 agent Job(s): b "));
    }

    #[test]
    fn no_job_created_means_no_event() {
        assert!(jobs_created(&[]).is_none());
    }
}
