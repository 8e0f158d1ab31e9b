//! One workload's plan: which attachments are accepted (coexistence rules), who claims
//! which pod, which Jobs to create and delete, and every attachment's status.
//!
//! Coexistence, as in the seed's table: attachments of one workload share its Jobs, so
//! they must agree on the agent (`agent`, `containers`, `sidecar`; the oldest wins,
//! younger ones that differ are rejected with `AgentConflict`); two intercepts of the
//! same port conflict (the younger is rejected with `PortConflict`); wiretaps and
//! ingests share freely. A pod with an injected sidecar is never attached (skipped, and
//! the attachment says so with a `SidecarConflict` Event). An ingest needs one pod: it
//! reuses a Job that already targets an admissible pod, else takes the first admissible
//! pod by name; it holds it only while its session lease is unexpired.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::jiff::Timestamp;
use podmotion_api::NodeAgentAttachmentStatus;
use podmotion_api::attachment::{
    AgentPort, AttachMode, SidecarRecognition, SkipReason, SkippedPod, TargetState, TargetStatus,
};
use podmotion_api::conditions::{Health, set_health};
use podmotion_api::names::reasons;

use super::naming::job_name;
use super::observed::{
    AttachmentView, JobRun, JobView, ObservedGroup, PodPhase, PodView, workload_key,
};
use super::reap::{Claims, JobFate, ReapReason, WantedTarget, fate};
use super::render::{AgentProfile, AgentTarget, Settings, job};
use super::selection::{PodClass, classify, container_ids, container_names, resolve_ports};
use crate::note::{EventKind, Note};

/// A Job to create for a target pod.
#[derive(Clone, Debug)]
pub struct Creation {
    pub pod: String,
    pub job: Job,
}

/// A Job to delete (always with foreground propagation), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deletion {
    pub job: String,
    pub pod: String,
    pub fate: JobFate,
}

/// A Job to resume: a fresh token's Secret is created in the target's namespace
/// (replacing one a previous attempt left), then the Job is unsuspended with the
/// token's verifier and its pod starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resume {
    pub job: String,
    pub job_uid: String,
    pub target_namespace: String,
    pub target_pod: String,
    pub target_pod_uid: String,
}

impl Resume {
    /// The resumption of the Job `j`.
    pub fn of(j: &JobView) -> Resume {
        Resume {
            job: j.name.clone(),
            job_uid: j.uid.clone(),
            target_namespace: j.target_namespace.clone(),
            target_pod: j.target_pod.clone(),
            target_pod_uid: j.target_pod_uid.clone(),
        }
    }
}

/// An Event about one attachment, beyond the Job created/replaced/reaped ones the
/// controller records as it acts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub attachment: String,
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

impl Notice {
    /// The Event it becomes on its attachment.
    pub fn to_note(&self) -> Note {
        let kind = if self.warning {
            EventKind::Warning
        } else {
            EventKind::Normal
        };
        Note {
            kind,
            reason: self.reason.into(),
            action: "Attach",
            message: self.note.clone(),
        }
    }
}

/// Why an attachment is not accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rejection {
    AgentConflict {
        with: String,
    },
    PortConflict {
        with: String,
    },
    /// The workload is in a namespace PodMotion never attaches to
    /// ([`Settings::protected_namespaces`]).
    ProtectedNamespace,
}

/// Everything one reconcile of a workload must do.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub create: Vec<Creation>,
    pub delete: Vec<Deletion>,
    /// Kept Jobs still suspended (the operator stopped between creating one and
    /// resuming it). The Jobs in `create` are resumed once they exist.
    pub resume: Vec<Resume>,
    /// Status of every attachment that is not being deleted, by name.
    pub statuses: BTreeMap<String, NodeAgentAttachmentStatus>,
    pub notices: Vec<Notice>,
    /// Earliest instant an ingest lease expires (reconcile again then).
    pub wake_at: Option<Timestamp>,
    /// Jobs of this workload that exist but are not wanted as they are (to be deleted
    /// now, or terminating already). A finalizer waits until this is zero.
    pub unwanted_jobs: usize,
    /// Jobs that are kept.
    pub kept_jobs: usize,
}

fn ports_overlap(a: &AttachmentView, b: &AttachmentView) -> bool {
    let (pa, pb) = (&a.spec.ports, &b.spec.ports);
    pa.is_empty() || pb.is_empty() || pa.iter().any(|p| pb.contains(p))
}

/// Whether two attachments ask the same of a shared agent. Only what an attachment
/// may choose counts (`config`, `gid`): the deprecated installer-owned fields are
/// rejected at admission and never read.
fn same_agent(a: &AttachmentView, b: &AttachmentView) -> bool {
    let (x, y) = (&a.spec.agent, &b.spec.agent);
    x.config == y.config
        && x.gid == y.gid
        && a.spec.containers == b.spec.containers
        && a.spec.sidecar == b.spec.sidecar
}

/// Plans one workload. Pure: same input, same output.
pub fn plan(obs: &ObservedGroup, settings: &Settings) -> Plan {
    let mut out = Plan::default();
    let co = Coexistence::of(obs, settings);
    out.wake_at = co.wake_at;
    let sel = Selection::of(obs, settings, co.accepted.first().copied());
    let claimed = Claimed::of(obs, settings, &co, &sel);
    let fates = judge_jobs(obs, &claimed, &sel.pods, &mut out);
    for a in &co.live {
        let (st, notice) = attachment_status(a, obs, settings, &co, &sel, &claimed, &fates);
        out.notices.extend(notice);
        out.statuses.insert(a.name.clone(), st);
    }
    out
}

/// 1. Coexistence: live attachments, oldest first; the younger of a conflict is
///    rejected; ingests whose lease expired claim nothing.
struct Coexistence<'a> {
    live: Vec<&'a AttachmentView>,
    accepted: Vec<&'a AttachmentView>,
    rejected: BTreeMap<&'a str, Rejection>,
    expired: BTreeSet<&'a str>,
    /// Accepted and not expired.
    claimants: Vec<&'a AttachmentView>,
    wake_at: Option<Timestamp>,
}

impl<'a> Coexistence<'a> {
    fn of(obs: &'a ObservedGroup, settings: &Settings) -> Self {
        let mut live: Vec<&AttachmentView> =
            obs.attachments.iter().filter(|a| !a.deleting).collect();
        live.sort_by(|a, b| (a.created, &a.name).cmp(&(b.created, &b.name)));
        let mut accepted: Vec<&AttachmentView> = vec![];
        let mut rejected: BTreeMap<&str, Rejection> = BTreeMap::new();
        // The operator's and the agents' namespaces hold the operator's token, the
        // master key and every tenant's checkpoints: no agent ever enters their pods.
        let protected = settings
            .protected_namespaces()
            .contains(&obs.namespace.as_str());
        for a in &live {
            let r = if protected {
                Some(Rejection::ProtectedNamespace)
            } else {
                rejection(&accepted, a)
            };
            match r {
                Some(r) => {
                    rejected.insert(&a.name, r);
                }
                None => accepted.push(a),
            }
        }
        let ingest = |a: &&&AttachmentView| a.spec.mode == AttachMode::Ingest;
        let expired: BTreeSet<&str> = accepted
            .iter()
            .filter(ingest)
            .filter(|a| a.lease_expiry(obs.now) <= obs.now)
            .map(|a| a.name.as_str())
            .collect();
        let wake_at = accepted
            .iter()
            .filter(ingest)
            .filter(|a| !expired.contains(a.name.as_str()))
            .map(|a| a.lease_expiry(obs.now))
            .min();
        let claimants = accepted
            .iter()
            .copied()
            .filter(|a| !expired.contains(a.name.as_str()))
            .collect();
        Coexistence {
            live,
            accepted,
            rejected,
            expired,
            claimants,
            wake_at,
        }
    }
}

/// Why `a` cannot join the `accepted` ones, if it cannot.
fn rejection(accepted: &[&AttachmentView], a: &AttachmentView) -> Option<Rejection> {
    if let Some(first) = accepted.first().filter(|f| !same_agent(f, a)) {
        return Some(Rejection::AgentConflict {
            with: first.name.clone(),
        });
    }
    accepted
        .iter()
        .find(|b| {
            a.spec.mode == AttachMode::Intercept
                && b.spec.mode == AttachMode::Intercept
                && ports_overlap(a, b)
        })
        .map(|b| Rejection::PortConflict {
            with: b.name.clone(),
        })
}

/// 2. Selection, under the oldest accepted attachment's agent profile.
struct Selection<'a> {
    primary: Option<&'a AttachmentView>,
    sidecar: SidecarRecognition,
    containers: &'a [String],
    /// Every pod, by name.
    pods: Vec<&'a PodView>,
    classes: Vec<(&'a PodView, PodClass)>,
    admissible: Vec<&'a PodView>,
    held_or_admissible: Vec<&'a PodView>,
}

impl<'a> Selection<'a> {
    fn of(
        obs: &'a ObservedGroup,
        settings: &Settings,
        primary: Option<&'a AttachmentView>,
    ) -> Self {
        let sidecar = primary.map(|p| p.spec.sidecar.clone()).unwrap_or_default();
        let containers: &[String] = primary.map(|p| &p.spec.containers[..]).unwrap_or(&[]);
        let mut pods: Vec<&PodView> = obs.pods.iter().collect();
        pods.sort_by(|a, b| a.name.cmp(&b.name));
        let has_job = |p: &PodView| {
            obs.jobs
                .iter()
                .any(|j| j.target_pod == p.name && j.target_pod_uid == p.uid)
        };
        // Why a pod's node cannot run the agent image, when its labels are known.
        let unfit = |p: &PodView| {
            let labels = obs.node_labels.get(p.node.as_deref()?)?;
            settings.platform.mismatch(labels)
        };
        let classes: Vec<(&PodView, PodClass)> = pods
            .iter()
            .map(|p| (*p, classify(p, &sidecar, has_job(p), unfit(p).as_deref())))
            .collect();
        let of_class = |keep: fn(&PodClass) -> bool| -> Vec<&'a PodView> {
            classes
                .iter()
                .filter(|(_, c)| keep(c))
                .map(|(p, _)| *p)
                .collect()
        };
        let admissible = of_class(|c| *c == PodClass::Admissible);
        let held_or_admissible = of_class(|c| matches!(c, PodClass::Admissible | PodClass::Held));
        Selection {
            primary,
            sidecar,
            containers,
            pods,
            classes,
            admissible,
            held_or_admissible,
        }
    }

    /// Why a pod nobody claims is not a target.
    fn not_target_reason(&self, pod: &str) -> ReapReason {
        match self
            .classes
            .iter()
            .find(|(q, _)| q.name == pod)
            .map(|(_, c)| c)
        {
            Some(PodClass::Skipped(r, _)) if *r != SkipReason::NotReady => {
                ReapReason::TargetNotAdmissible
            }
            Some(PodClass::Skipped(..)) => ReapReason::TargetGone,
            _ => ReapReason::NotSelected,
        }
    }
}

/// 3. Claims: every target of an intercept or wiretap, one pod per live ingest; the
///    Jobs wanted for them.
struct Claimed<'a> {
    claims: Claims,
    per_attachment: BTreeMap<&'a str, Vec<&'a PodView>>,
    desired: BTreeMap<&'a str, Job>,
}

impl<'a> Claimed<'a> {
    fn of(
        obs: &'a ObservedGroup,
        settings: &Settings,
        co: &Coexistence<'a>,
        sel: &Selection<'a>,
    ) -> Self {
        let mut claimed: BTreeMap<&str, Vec<String>> = BTreeMap::new();
        let mut per_attachment: BTreeMap<&str, Vec<&PodView>> = BTreeMap::new();
        let (ingests, every_replica): (Vec<&AttachmentView>, Vec<&AttachmentView>) = co
            .claimants
            .iter()
            .copied()
            .partition(|a| a.spec.mode == AttachMode::Ingest);
        for a in &every_replica {
            for p in &sel.held_or_admissible {
                claimed.entry(&p.name).or_default().push(a.name.clone());
            }
            per_attachment.insert(&a.name, sel.held_or_admissible.clone());
        }
        for a in &ingests {
            let pick = ingest_pick(obs, sel);
            if let Some(p) = pick {
                claimed.entry(&p.name).or_default().push(a.name.clone());
            }
            per_attachment.insert(&a.name, pick.into_iter().collect());
        }
        let mut claims = Claims {
            unclaimed: unclaimed_reason(obs, co),
            ..Claims::default()
        };
        let mut desired: BTreeMap<&str, Job> = BTreeMap::new();
        if claims.unclaimed.is_none() {
            let primary = sel.primary.expect("claimants imply an accepted attachment");
            let profile = AgentProfile {
                namespace: &obs.namespace,
                workload: &obs.workload,
                agent: &primary.spec.agent,
            };
            let port_claims: Vec<&[AgentPort]> =
                every_replica.iter().map(|a| &a.spec.ports[..]).collect();
            for p in &sel.pods {
                let Some(by) = claimed.get(p.name.as_str()) else {
                    claims
                        .not_targets
                        .insert(p.name.clone(), sel.not_target_reason(&p.name));
                    continue;
                };
                let (wanted, j) = wanted_job(settings, &profile, sel, p, &port_claims, by);
                claims.targets.insert(p.name.clone(), wanted);
                desired.insert(&p.name, j);
            }
        }
        Claimed {
            claims,
            per_attachment,
            desired,
        }
    }
}

/// Why no attachment claims the group's Jobs (the workload is gone, or no attachment
/// of it is live), if none does.
fn unclaimed_reason(obs: &ObservedGroup, co: &Coexistence<'_>) -> Option<ReapReason> {
    if !obs.workload_exists {
        Some(ReapReason::WorkloadGone)
    } else if co.claimants.is_empty() {
        Some(if co.accepted.is_empty() {
            ReapReason::NoLiveAttachment
        } else {
            ReapReason::LeaseExpired
        })
    } else {
        None
    }
}

/// The pod a live ingest holds: one that already has a live Job, else the first
/// admissible one by name.
fn ingest_pick<'a>(obs: &ObservedGroup, sel: &Selection<'a>) -> Option<&'a PodView> {
    let with_job = |p: &&&PodView| {
        obs.jobs
            .iter()
            .any(|j| j.target_pod == p.name && !j.terminating)
    };
    sel.admissible
        .iter()
        .find(with_job)
        .or_else(|| sel.admissible.first())
        .copied()
}

/// The Job wanted for target `p` claimed `by` these attachments, and what the reaping
/// predicate compares existing Jobs with.
fn wanted_job(
    settings: &Settings,
    profile: &AgentProfile,
    sel: &Selection,
    p: &PodView,
    port_claims: &[&[AgentPort]],
    by: &[String],
) -> (WantedTarget, Job) {
    let name = job_name(&settings.job_prefix, profile.namespace, &p.name);
    let ids = container_ids(p, sel.containers, &sel.sidecar);
    let names = container_names(p, sel.containers, &sel.sidecar);
    let ports = resolve_ports(p, sel.containers, &sel.sidecar, port_claims);
    let target = AgentTarget {
        pod: p,
        containers: &names,
        container_ids: &ids,
        ports: &ports,
    };
    let (j, hash) = job(settings, profile, &target, &name);
    let wanted = WantedTarget {
        pod_uid: p.uid.clone(),
        job_name: name,
        container_ids: ids,
        spec_hash: hash,
        ports,
        claimed_by: by.to_vec(),
    };
    (wanted, j)
}

type Fates<'a> = BTreeMap<&'a str, (JobFate, &'a JobView)>;

/// 4. Existing Jobs: the reaping predicate and the replacement rules decide; wanted
///    Jobs that do not exist (and whose pod no unwanted Job blocks) are created.
fn judge_jobs<'a>(
    obs: &'a ObservedGroup,
    claimed: &Claimed,
    pods: &[&PodView],
    out: &mut Plan,
) -> Fates<'a> {
    let failed: BTreeSet<(&str, &str)> = pods
        .iter()
        .filter(|p| p.phase == PodPhase::Failed)
        .map(|p| (p.name.as_str(), p.uid.as_str()))
        .collect();
    let mut fates: Fates = BTreeMap::new();
    let mut blocked: BTreeSet<&str> = BTreeSet::new();
    for j in &obs.jobs {
        let target_failed = failed.contains(&(j.target_pod.as_str(), j.target_pod_uid.as_str()));
        let f = fate(j, &claimed.claims, target_failed);
        if f == JobFate::Keep {
            out.kept_jobs += 1;
            if j.suspended && !j.terminating {
                out.resume.push(Resume::of(j));
            }
        } else {
            // Any Job of a pod that is not kept blocks that pod's successor until it is gone.
            blocked.insert(&j.target_pod);
            if !j.terminating {
                out.delete.push(Deletion {
                    job: j.name.clone(),
                    pod: j.target_pod.clone(),
                    fate: f,
                });
            }
            out.unwanted_jobs += 1;
        }
        fates.insert(&j.target_pod, (f, j));
    }
    for (pod, j) in &claimed.desired {
        let exists = obs.jobs.iter().any(|e| e.target_pod == *pod);
        if !exists && !blocked.contains(pod) {
            out.create.push(Creation {
                pod: pod.to_string(),
                job: j.clone(),
            });
        }
    }
    fates
}

/// 5. The status of live attachment `a`, and the Event when its sidecar-skipped pods
///    changed.
fn attachment_status(
    a: &AttachmentView,
    obs: &ObservedGroup,
    settings: &Settings,
    co: &Coexistence,
    sel: &Selection,
    claimed: &Claimed,
    fates: &Fates,
) -> (NodeAgentAttachmentStatus, Option<Notice>) {
    let prev = a.status.clone().unwrap_or_default();
    let mut st = NodeAgentAttachmentStatus {
        observed_generation: a.generation,
        workload: Some(workload_key(&obs.workload)),
        conditions: prev.conditions.clone(),
        ..Default::default()
    };
    st.skipped = sel
        .classes
        .iter()
        .filter_map(|(p, c)| match c {
            PodClass::Skipped(r, m) => Some(SkippedPod {
                pod: p.name.clone(),
                reason: *r,
                message: m.clone(),
            }),
            _ => None,
        })
        .collect();
    let notice = sidecar_notice(a, &prev, &st);
    let targets = claimed
        .per_attachment
        .get(a.name.as_str())
        .cloned()
        .unwrap_or_default();
    st.targets = targets
        .iter()
        .map(|p| TargetStatus {
            pod: p.name.clone(),
            node: p.node.clone().unwrap_or_default(),
            pod_ip: p.ip.clone(),
            job: job_name(&settings.job_prefix, &obs.namespace, &p.name),
            state: target_state(fates.get(p.name.as_str())),
        })
        .collect();
    let total = st.targets.len();
    let ready = st
        .targets
        .iter()
        .filter(|t| t.state == TargetState::Running)
        .count();
    st.ready_targets = ready as i32;
    st.total_targets = total as i32;
    st.ready_summary = Some(format!("{ready}/{total}"));
    let expired = co.expired.contains(a.name.as_str());
    let health = health(a, obs, &co.rejected, expired, &st, ready, total);
    set_health(&mut st.conditions, &health, a.generation, obs.now);
    (st, notice)
}

/// A target's state from its Job's fate (no Job yet: pending).
fn target_state(fate: Option<&(JobFate, &JobView)>) -> TargetState {
    match fate {
        None => TargetState::Pending,
        Some((JobFate::Keep, j)) => match j.run {
            JobRun::Active { ready: true } => TargetState::Running,
            JobRun::Active { ready: false } => TargetState::Starting,
            JobRun::Complete => TargetState::Exited,
            JobRun::Failed => TargetState::Replacing,
        },
        Some(_) => TargetState::Replacing,
    }
}

/// The `SidecarConflict` Event, when the pods skipped for an injected sidecar changed.
fn sidecar_notice(
    a: &AttachmentView,
    prev: &NodeAgentAttachmentStatus,
    st: &NodeAgentAttachmentStatus,
) -> Option<Notice> {
    let sidecars = |s: &NodeAgentAttachmentStatus| -> Vec<String> {
        s.skipped
            .iter()
            .filter(|s| s.reason == SkipReason::InjectedSidecar)
            .map(|s| s.pod.clone())
            .collect()
    };
    let now = sidecars(st);
    (!now.is_empty() && now != sidecars(prev)).then(|| Notice {
        attachment: a.name.clone(),
        warning: true,
        reason: reasons::SIDECAR_CONFLICT,
        note: format!(
            "not attaching to pods with an injected traffic-agent sidecar: {}",
            now.join(", ")
        ),
    })
}

/// The attachment's health: stalled when something blocks it, otherwise how its
/// targets stand.
fn health(
    a: &AttachmentView,
    obs: &ObservedGroup,
    rejected: &BTreeMap<&str, Rejection>,
    expired: bool,
    st: &NodeAgentAttachmentStatus,
    ready: usize,
    total: usize,
) -> Health {
    let workload = workload_key(&obs.workload);
    if let Some(h) = blocked(a, obs, &workload, rejected, expired) {
        return h;
    }
    if total == 0 {
        return without_targets(&workload, st);
    }
    let skipped = if st.skipped.is_empty() {
        String::new()
    } else {
        format!("; {} pod(s) skipped", st.skipped.len())
    };
    if ready == total {
        Health::ready(
            reasons::ALL_TARGETS_ATTACHED,
            format!("{ready}/{total} agents running{skipped}"),
        )
    } else {
        Health::reconciling(
            reasons::JOBS_PENDING,
            format!("{ready}/{total} agents running{skipped}"),
        )
    }
}

/// What stalls the attachment whatever its pods: a missing workload, a conflict with
/// another attachment of the workload, an expired ingest lease.
fn blocked(
    a: &AttachmentView,
    obs: &ObservedGroup,
    workload: &str,
    rejected: &BTreeMap<&str, Rejection>,
    expired: bool,
) -> Option<Health> {
    if !obs.workload_exists {
        return Some(Health::stalled(
            reasons::WORKLOAD_NOT_FOUND,
            format!("{workload} does not exist in {}", obs.namespace),
        ));
    }
    match rejected.get(a.name.as_str()) {
        Some(Rejection::AgentConflict { with }) => {
            return Some(Health::stalled(
                reasons::AGENT_CONFLICT,
                format!(
                    "{with} already attaches agents to {workload} with other agent settings (agent, containers or \
                     sidecar); attachments of one workload share its Jobs and must agree"
                ),
            ));
        }
        Some(Rejection::PortConflict { with }) => {
            return Some(Health::stalled(
                reasons::PORT_CONFLICT,
                format!(
                    "{with} already intercepts the same port(s) of {workload}; concurrent intercepts of one port conflict"
                ),
            ));
        }
        Some(Rejection::ProtectedNamespace) => {
            return Some(Health::stalled(
                reasons::PROTECTED_NAMESPACE,
                format!(
                    "{workload} is in {}, a namespace PodMotion never attaches agents to (the cluster's \
                     system namespace, or the operator's or its agents' own: their pods hold the \
                     operator's credentials, the master key and other tenants' checkpoints)",
                    obs.namespace
                ),
            ));
        }
        None => {}
    }
    expired.then(|| {
        Health::stalled(
            reasons::LEASE_EXPIRED,
            format!(
                "the ingest session lease {} expired at {}; its Job was released. Renew the Lease to ingest again",
                a.lease_name(),
                a.lease_expiry(obs.now)
            ),
        )
    })
}

/// Health with no target at all: waiting for Ready pods, or stalled and why no pod
/// can host an agent.
fn without_targets(workload: &str, st: &NodeAgentAttachmentStatus) -> Health {
    let count = |r: SkipReason| st.skipped.iter().filter(|s| s.reason == r).count();
    if count(SkipReason::NotReady) > 0 {
        return Health::reconciling(
            reasons::WAITING_FOR_READY_PODS,
            format!("no pod of {workload} is Running and Ready yet"),
        );
    }
    if st.skipped.is_empty() {
        return Health::stalled(
            reasons::NO_ADMISSIBLE_TARGET,
            format!("{workload} has no pods"),
        );
    }
    if count(SkipReason::InjectedSidecar) == st.skipped.len() {
        return Health::stalled(
            reasons::SIDECAR_CONFLICT,
            format!(
                "every pod of {workload} carries an injected traffic-agent sidecar; use the sidecar instead"
            ),
        );
    }
    Health::stalled(
        reasons::NO_ADMISSIBLE_TARGET,
        format!(
            "no pod of {workload} can host a node agent ({} on the host network, {} with an injected sidecar, \
             {} in a user namespace, {} on a node the agent image is not built for); see status.skipped",
            count(SkipReason::HostNetwork),
            count(SkipReason::InjectedSidecar),
            count(SkipReason::UserNamespace),
            count(SkipReason::UnsupportedPlatform)
        ),
    )
}

#[cfg(test)]
mod tests;
