//! The single reaping predicate, and what becomes of an existing Job.
//!
//! [`wanted`] is the only place that decides whether an agent Job is still wanted: a
//! live, accepted intercept or wiretap attachment claims its target pod, or an ingest
//! whose session lease has not expired does. [`fate`] adds the replacement rules for a
//! wanted Job that no longer fits its target. Every removal path (the finalizer, lease
//! expiry, the periodic orphan sweep, `reap-all` aside) reaches them through
//! [`super::plan::plan`], so they cannot disagree.

use std::collections::BTreeMap;

use super::observed::{JobRun, JobView};

/// A pod some attachment wants an agent Job for, and the Job it wants.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedTarget {
    pub pod_uid: String,
    pub job_name: String,
    pub container_ids: BTreeMap<String, String>,
    pub spec_hash: String,
    /// Port numbers the agent must redirect.
    pub ports: Vec<i32>,
    /// Names of the attachments that claim it (for status and Events).
    pub claimed_by: Vec<String>,
}

/// Who wants which pod of one workload, computed once per plan from the live, accepted
/// attachments and unexpired ingest leases.
#[derive(Clone, Debug, Default)]
pub struct Claims {
    /// Target pod name → the Job wanted for it.
    pub targets: BTreeMap<String, WantedTarget>,
    /// Pods of the workload that are not targets, and why (by pod name).
    pub not_targets: BTreeMap<String, ReapReason>,
    /// Why nothing at all is claimed, when no attachment claims the workload.
    pub unclaimed: Option<ReapReason>,
}

/// Why a Job is no longer wanted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReapReason {
    /// No live attachment claims the workload (all deleted, or the operator missed it).
    NoLiveAttachment,
    /// The only claims were ingests whose session leases expired.
    LeaseExpired,
    /// The target pod no longer exists.
    TargetGone,
    /// The target pod can no longer host an agent (host network, sidecar, user namespace).
    TargetNotAdmissible,
    /// An ingest moved to another pod, or no longer needs this one.
    NotSelected,
    /// The workload itself is gone.
    WorkloadGone,
}

impl ReapReason {
    pub fn describe(self) -> &'static str {
        match self {
            ReapReason::NoLiveAttachment => "no live attachment claims the workload",
            ReapReason::LeaseExpired => "the ingest session lease expired",
            ReapReason::TargetGone => "the target pod is gone",
            ReapReason::TargetNotAdmissible => "the target pod can no longer host a node agent",
            ReapReason::NotSelected => "no attachment selects this pod any more",
            ReapReason::WorkloadGone => "the workload is gone",
        }
    }
}

/// Why a wanted target's Job is replaced instead of reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReplaceReason {
    /// A target container restarted: its container ID changed.
    ContainerRestarted,
    /// A pod of the same name but another UID (a StatefulSet's recreated replica).
    TargetPodReplaced,
    /// The target pod failed.
    TargetPodFailed,
    /// The agent Job failed.
    AgentFailed,
    /// The Job is terminating; its successor waits until it is gone.
    Terminating,
    /// The agent settings changed since the Job was made.
    AgentSettingsChanged,
    /// The Job has another name than the target's Job should (prefix changed).
    Renamed,
    /// A port must be redirected that the Job's agent does not redirect.
    PortsAdded,
}

impl ReplaceReason {
    pub fn describe(self) -> &'static str {
        match self {
            ReplaceReason::ContainerRestarted => {
                "a target container restarted (its container ID changed)"
            }
            ReplaceReason::TargetPodReplaced => {
                "the target pod was replaced by another of the same name"
            }
            ReplaceReason::TargetPodFailed => "the target pod failed",
            ReplaceReason::AgentFailed => "the agent Job failed",
            ReplaceReason::Terminating => "the Job is terminating",
            ReplaceReason::AgentSettingsChanged => "the agent settings changed",
            ReplaceReason::Renamed => "the Job name prefix changed",
            ReplaceReason::PortsAdded => "a port is wanted that the agent does not redirect",
        }
    }
}

/// What becomes of an existing Job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobFate {
    /// Still wanted and still fits its target.
    Keep,
    /// Its target still wants an agent, but not this Job: delete it (foreground), and
    /// create the successor only once it is gone.
    Replace(ReplaceReason),
    /// Not wanted: delete it (foreground).
    Reap(ReapReason),
}

/// THE reaping predicate: the target this Job is still wanted for, or why it is not.
pub fn wanted<'c>(job: &JobView, claims: &'c Claims) -> Result<&'c WantedTarget, ReapReason> {
    if let Some(t) = claims.targets.get(&job.target_pod) {
        return Ok(t);
    }
    if let Some(reason) = claims.unclaimed {
        return Err(reason);
    }
    Err(claims
        .not_targets
        .get(&job.target_pod)
        .copied()
        .unwrap_or(ReapReason::TargetGone))
}

/// What becomes of `job`: kept, replaced (wanted, but no longer fits), or reaped.
/// `target_failed`: the pod this Job was made for still exists and has failed.
pub fn fate(job: &JobView, claims: &Claims, target_failed: bool) -> JobFate {
    let t = match wanted(job, claims) {
        Ok(t) => t,
        Err(_) if target_failed && claims.unclaimed.is_none() => {
            return JobFate::Replace(ReplaceReason::TargetPodFailed);
        }
        Err(reason) => return JobFate::Reap(reason),
    };
    if job.terminating {
        JobFate::Replace(ReplaceReason::Terminating)
    } else if job.target_pod_uid != t.pod_uid {
        JobFate::Replace(ReplaceReason::TargetPodReplaced)
    } else if job.container_ids != t.container_ids {
        JobFate::Replace(ReplaceReason::ContainerRestarted)
    } else if job.run == JobRun::Failed {
        JobFate::Replace(ReplaceReason::AgentFailed)
    } else if job.name != t.job_name {
        JobFate::Replace(ReplaceReason::Renamed)
    } else if job.spec_hash != t.spec_hash {
        JobFate::Replace(ReplaceReason::AgentSettingsChanged)
    } else if !t.ports.iter().all(|p| job.ports.contains(p)) {
        // Fewer ports than the Job redirects is fine: the agent passes unclaimed ports
        // through, and replacing it would cut the sessions still using it.
        JobFate::Replace(ReplaceReason::PortsAdded)
    } else {
        JobFate::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(pod: &str) -> JobView {
        JobView {
            name: format!("j-{pod}"),
            uid: "ju".into(),
            target_namespace: "ns".into(),
            target_pod: pod.into(),
            target_pod_uid: format!("uid-{pod}"),
            workload: "Deployment/web".into(),
            container_ids: BTreeMap::from([("app".into(), format!("cri://{pod}-1"))]),
            spec_hash: "h1".into(),
            ports: vec![8080],
            terminating: false,
            suspended: false,
            run: JobRun::Active { ready: true },
        }
    }
    fn claims_for(pods: &[&str]) -> Claims {
        let targets = pods
            .iter()
            .map(|p| {
                let j = job(p);
                (
                    p.to_string(),
                    WantedTarget {
                        pod_uid: j.target_pod_uid,
                        job_name: j.name,
                        container_ids: j.container_ids,
                        spec_hash: j.spec_hash,
                        ports: j.ports,
                        claimed_by: vec!["a".into()],
                    },
                )
            })
            .collect();
        Claims {
            targets,
            ..Default::default()
        }
    }

    #[test]
    fn fate_table() {
        use JobFate::*;
        let unclaimed = Claims {
            unclaimed: Some(ReapReason::NoLiveAttachment),
            ..Default::default()
        };
        let expired = Claims {
            unclaimed: Some(ReapReason::LeaseExpired),
            ..Default::default()
        };
        let mut skipped = claims_for(&[]);
        skipped
            .not_targets
            .insert("p".into(), ReapReason::TargetNotAdmissible);
        let cases: Vec<(&str, JobView, Claims, bool, JobFate)> = vec![
            (
                "claimed job that fits is kept",
                job("p"),
                claims_for(&["p"]),
                false,
                Keep,
            ),
            (
                "unready agent job is kept",
                JobView {
                    run: JobRun::Active { ready: false },
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Keep,
            ),
            (
                "job of a pod nobody claims is reaped",
                job("p"),
                claims_for(&["q"]),
                false,
                Reap(ReapReason::TargetGone),
            ),
            (
                "job without a live attachment is reaped",
                job("p"),
                unclaimed,
                false,
                Reap(ReapReason::NoLiveAttachment),
            ),
            (
                "job whose ingest lease expired is reaped",
                job("p"),
                expired,
                false,
                Reap(ReapReason::LeaseExpired),
            ),
            (
                "job of a pod that became inadmissible is reaped",
                job("p"),
                skipped,
                false,
                Reap(ReapReason::TargetNotAdmissible),
            ),
            (
                "restarted target container replaces the job",
                JobView {
                    container_ids: BTreeMap::from([("app".into(), "cri://old".into())]),
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Replace(ReplaceReason::ContainerRestarted),
            ),
            (
                "recreated pod of the same name replaces the job",
                JobView {
                    target_pod_uid: "old-uid".into(),
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Replace(ReplaceReason::TargetPodReplaced),
            ),
            (
                "failed target pod replaces the job",
                job("p"),
                claims_for(&[]),
                true,
                Replace(ReplaceReason::TargetPodFailed),
            ),
            (
                "failed target pod without any claim is reaped",
                job("p"),
                Claims {
                    unclaimed: Some(ReapReason::NoLiveAttachment),
                    ..Default::default()
                },
                true,
                Reap(ReapReason::NoLiveAttachment),
            ),
            (
                "failed agent job is replaced",
                JobView {
                    run: JobRun::Failed,
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Replace(ReplaceReason::AgentFailed),
            ),
            (
                "terminating job is replaced not reused",
                JobView {
                    terminating: true,
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Replace(ReplaceReason::Terminating),
            ),
            (
                "changed agent settings replace the job",
                JobView {
                    spec_hash: "h0".into(),
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Replace(ReplaceReason::AgentSettingsChanged),
            ),
            (
                "completed agent job is kept and reported",
                JobView {
                    run: JobRun::Complete,
                    ..job("p")
                },
                claims_for(&["p"]),
                false,
                Keep,
            ),
        ];
        for (case, j, claims, failed, want) in cases {
            assert_eq!(fate(&j, &claims, failed), want, "{case}");
        }
    }

    #[test]
    fn wanted_names_the_claiming_target() {
        let claims = claims_for(&["p"]);
        assert_eq!(
            wanted(&job("p"), &claims).unwrap().claimed_by,
            vec!["a".to_string()]
        );
        assert_eq!(
            wanted(&job("q"), &claims).unwrap_err(),
            ReapReason::TargetGone
        );
    }
}
