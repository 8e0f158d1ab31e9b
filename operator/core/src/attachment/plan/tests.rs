//! The plan of one workload, table by table: selection, churn, replacement, reaping,
//! coexistence and status.

use podmotion_api::attachment::{AttachMode, SkipReason, TargetState};
use podmotion_api::conditions::{find, is_true};
use podmotion_api::names::{condition_types, reasons};

use super::*;
use crate::attachment::fixtures::{attachment, created_jobs, group, pod, settings, t};
use crate::attachment::observed::JobView;
use crate::attachment::reap::ReplaceReason;
use k8s_openapi::jiff::SignedDuration;

fn five_ready() -> Vec<PodView> {
    (0..5)
        .map(|i| {
            pod(&format!("web-{i}"))
                .on_node(&format!("n{}", i % 3))
                .ready()
                .build()
        })
        .collect()
}

/// Plans, then pretends every created Job exists with a ready agent.
fn converged(attachments: Vec<AttachmentView>, pods: Vec<PodView>) -> Vec<JobView> {
    created_jobs(&plan(&group(attachments, pods, vec![]), &settings()))
}

fn reason_of(p: &Plan, a: &str) -> String {
    let st = &p.statuses[a];
    let ready = find(&st.conditions, condition_types::READY).expect("Ready condition");
    ready.reason.clone()
}

fn deleted(p: &Plan) -> Vec<(String, JobFate)> {
    p.delete.iter().map(|d| (d.pod.clone(), d.fate)).collect()
}

#[test]
fn every_ready_replica_gets_one_job_pinned_to_its_node() {
    let p = plan(
        &group(vec![attachment("a").build()], five_ready(), vec![]),
        &settings(),
    );
    assert_eq!(p.create.len(), 5);
    for c in &p.create {
        let ps = c.job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let want = five_ready().into_iter().find(|x| x.name == c.pod).unwrap();
        assert_eq!(ps.node_name, want.node, "{}", c.pod);
        assert_eq!(
            c.job.metadata.name.as_deref(),
            Some(job_name("podmotion-agent", "shop", &c.pod).as_str())
        );
    }
    let st = &p.statuses["a"];
    assert_eq!(st.total_targets, 5);
    assert_eq!(st.ready_summary.as_deref(), Some("0/5"));
    assert!(st.targets.iter().all(|t| t.state == TargetState::Pending));
    assert_eq!(reason_of(&p, "a"), reasons::JOBS_PENDING);
}

#[test]
fn converged_workload_needs_no_writes_and_is_ready() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let p = plan(
        &group(vec![attachment("a").build()], five_ready(), jobs),
        &settings(),
    );
    assert!(
        p.create.is_empty() && p.delete.is_empty(),
        "{:?} {:?}",
        p.create.len(),
        p.delete
    );
    let st = &p.statuses["a"];
    assert_eq!(st.ready_summary.as_deref(), Some("5/5"));
    assert!(is_true(&st.conditions, condition_types::READY));
    assert_eq!(st.targets[0].pod_ip, five_ready()[0].ip);
}

#[test]
fn skipped_pods_are_listed_with_their_reasons_and_do_not_fail_the_attachment() {
    let pods = vec![
        pod("web-0").on_node("n0").ready().build(),
        pod("web-1").on_node("n1").ready().host_network().build(),
        pod("web-2").on_node("n2").ready().with_sidecar().build(),
        pod("web-3").on_node("n0").ready().host_users(false).build(),
        pod("web-4").on_node("n1").pending().build(),
    ];
    let p = plan(
        &group(vec![attachment("a").build()], pods, vec![]),
        &settings(),
    );
    assert_eq!(
        p.create.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(),
        vec!["web-0"]
    );
    let skipped: Vec<(&str, SkipReason)> = p.statuses["a"]
        .skipped
        .iter()
        .map(|s| (s.pod.as_str(), s.reason))
        .collect();
    assert_eq!(
        skipped,
        vec![
            ("web-1", SkipReason::HostNetwork),
            ("web-2", SkipReason::InjectedSidecar),
            ("web-3", SkipReason::UserNamespace),
            ("web-4", SkipReason::NotReady),
        ]
    );
    assert_eq!(reason_of(&p, "a"), reasons::JOBS_PENDING);
    // The sidecar pod is a rejected combination: an Event says so.
    assert!(
        p.notices
            .iter()
            .any(|n| n.reason == reasons::SIDECAR_CONFLICT && n.note.contains("web-2"))
    );
}

#[test]
fn attachment_fails_only_when_no_pod_is_admissible() {
    let cases: Vec<(&str, Vec<PodView>, bool, &str)> = vec![
        (
            "no pods at all",
            vec![],
            true,
            reasons::NO_ADMISSIBLE_TARGET,
        ),
        (
            "only host network pods",
            vec![pod("a").on_node("n").ready().host_network().build()],
            true,
            reasons::NO_ADMISSIBLE_TARGET,
        ),
        (
            "host network and sidecar pods",
            vec![
                pod("a").on_node("n").ready().host_network().build(),
                pod("b").on_node("n").ready().with_sidecar().build(),
            ],
            true,
            reasons::NO_ADMISSIBLE_TARGET,
        ),
        (
            "only sidecar pods",
            vec![pod("a").on_node("n").ready().with_sidecar().build()],
            true,
            reasons::SIDECAR_CONFLICT,
        ),
        (
            "pods still starting",
            vec![pod("a").on_node("n").pending().build()],
            false,
            reasons::WAITING_FOR_READY_PODS,
        ),
        (
            "one admissible pod among skipped ones",
            vec![
                pod("a").on_node("n").ready().build(),
                pod("b").on_node("n").ready().host_network().build(),
            ],
            false,
            reasons::JOBS_PENDING,
        ),
    ];
    for (case, pods, stalled, reason) in cases {
        let p = plan(
            &group(vec![attachment("a").build()], pods, vec![]),
            &settings(),
        );
        let st = &p.statuses["a"];
        assert_eq!(
            is_true(&st.conditions, condition_types::STALLED),
            stalled,
            "{case}"
        );
        assert_eq!(reason_of(&p, "a"), reason, "{case}");
    }
}

#[test]
fn unready_replica_keeps_its_job() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let mut pods = five_ready();
    pods[2] = pod("web-2").on_node("n2").unready().build();
    let p = plan(
        &group(vec![attachment("a").build()], pods, jobs),
        &settings(),
    );
    assert!(p.create.is_empty() && p.delete.is_empty(), "{:?}", p.delete);
    assert_eq!(p.statuses["a"].total_targets, 5);
}

#[test]
fn scale_up_gets_jobs_for_ready_replicas_only_and_scale_down_reaps_once_pods_are_gone() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let mut pods = five_ready();
    pods.push(pod("web-5").on_node("n0").ready().build());
    pods.push(pod("web-6").on_node("n1").pending().build());
    let p = plan(
        &group(vec![attachment("a").build()], pods, jobs.clone()),
        &settings(),
    );
    assert_eq!(
        p.create.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(),
        vec!["web-5"]
    );
    assert!(p.delete.is_empty());

    // Scale down: web-3 is terminating (keeps its Job), web-4 is gone (reaped).
    let mut pods = five_ready();
    pods[3] = pod("web-3").on_node("n0").ready().terminating().build();
    pods.truncate(4);
    let p = plan(
        &group(vec![attachment("a").build()], pods, jobs),
        &settings(),
    );
    assert_eq!(
        deleted(&p),
        vec![("web-4".to_string(), JobFate::Reap(ReapReason::TargetGone))]
    );
    assert!(p.create.is_empty());
}

#[test]
fn rolling_restart_converges_with_no_special_case() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    // Old pods web-0..4 are gone; new pods new-0..4 are ready.
    let new: Vec<PodView> = (0..5)
        .map(|i| pod(&format!("new-{i}")).on_node("n1").ready().build())
        .collect();
    let p = plan(
        &group(vec![attachment("a").build()], new.clone(), jobs),
        &settings(),
    );
    assert_eq!(p.create.len(), 5);
    assert_eq!(p.delete.len(), 5);
    assert!(
        p.delete
            .iter()
            .all(|d| d.fate == JobFate::Reap(ReapReason::TargetGone))
    );
    let jobs = created_jobs(&p);
    let p = plan(
        &group(vec![attachment("a").build()], new, jobs),
        &settings(),
    );
    assert!(p.create.is_empty() && p.delete.is_empty());
}

#[test]
fn restarted_target_container_replaces_the_job_and_the_successor_waits_for_it() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let mut pods = five_ready();
    pods[1] = pod("web-1").on_node("n1").ready().restarted().build();
    let p = plan(
        &group(vec![attachment("a").build()], pods.clone(), jobs.clone()),
        &settings(),
    );
    assert_eq!(
        deleted(&p),
        vec![(
            "web-1".to_string(),
            JobFate::Replace(ReplaceReason::ContainerRestarted)
        )]
    );
    assert!(
        p.create.is_empty(),
        "no successor while the predecessor exists"
    );
    let web1 = p.statuses["a"]
        .targets
        .iter()
        .find(|t| t.pod == "web-1")
        .unwrap();
    assert_eq!(web1.state, TargetState::Replacing);

    // Predecessor terminating (foreground deletion in progress): still no successor.
    let mut terminating = jobs.clone();
    terminating
        .iter_mut()
        .find(|j| j.target_pod == "web-1")
        .unwrap()
        .terminating = true;
    let p = plan(
        &group(vec![attachment("a").build()], pods.clone(), terminating),
        &settings(),
    );
    assert!(p.create.is_empty() && p.delete.is_empty());

    // Predecessor gone: the successor carries the new container ID.
    let gone: Vec<JobView> = jobs
        .into_iter()
        .filter(|j| j.target_pod != "web-1")
        .collect();
    let p = plan(
        &group(vec![attachment("a").build()], pods, gone),
        &settings(),
    );
    assert_eq!(p.create.len(), 1);
    let v = JobView::from_job(&p.create[0].job).unwrap();
    assert_eq!(v.container_ids["app"], "containerd://web-1-app-2");
}

#[test]
fn failed_target_pod_and_recreated_pod_replace_the_job() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let mut pods = five_ready();
    pods[0] = pod("web-0").on_node("n0").failed().build();
    pods[1] = pod("web-1")
        .on_node("n1")
        .ready()
        .uid("uid-web-1-second")
        .build();
    let p = plan(
        &group(vec![attachment("a").build()], pods, jobs),
        &settings(),
    );
    assert_eq!(
        deleted(&p),
        vec![
            (
                "web-0".to_string(),
                JobFate::Replace(ReplaceReason::TargetPodFailed)
            ),
            (
                "web-1".to_string(),
                JobFate::Replace(ReplaceReason::TargetPodReplaced)
            ),
        ]
    );
    assert!(p.create.is_empty());
}

#[test]
fn deleting_the_only_attachment_reaps_every_job() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let p = plan(
        &group(vec![attachment("a").deleting().build()], five_ready(), jobs),
        &settings(),
    );
    assert_eq!(p.delete.len(), 5);
    assert!(
        p.delete
            .iter()
            .all(|d| d.fate == JobFate::Reap(ReapReason::NoLiveAttachment))
    );
    assert_eq!(p.unwanted_jobs, 5);
    assert!(
        p.statuses.is_empty(),
        "a deleting attachment gets no status"
    );
}

#[test]
fn orphans_without_any_attachment_are_reaped() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let p = plan(&group(vec![], five_ready(), jobs.clone()), &settings());
    assert_eq!(p.delete.len(), 5);
    let mut gone = group(vec![attachment("a").build()], vec![], jobs);
    gone.workload_exists = false;
    let p = plan(&gone, &settings());
    assert!(
        p.delete
            .iter()
            .all(|d| d.fate == JobFate::Reap(ReapReason::WorkloadGone))
    );
    assert_eq!(reason_of(&p, "a"), reasons::WORKLOAD_NOT_FOUND);
}

#[test]
fn second_intercept_shares_the_jobs_and_deleting_one_keeps_them() {
    let a = || attachment("a").ports(&[8080]).build();
    let b = || attachment("b").ports(&[9090]).created(10).build();
    let jobs = converged(vec![a(), b()], five_ready());
    assert_eq!(jobs.len(), 5, "one Job per pod, not per attachment");
    let p = plan(
        &group(vec![a(), b()], five_ready(), jobs.clone()),
        &settings(),
    );
    assert!(p.create.is_empty() && p.delete.is_empty());
    assert_eq!(p.statuses["b"].ready_summary.as_deref(), Some("5/5"));
    let p = plan(
        &group(
            vec![attachment("a").ports(&[8080]).deleting().build(), b()],
            five_ready(),
            jobs,
        ),
        &settings(),
    );
    assert!(p.delete.is_empty(), "b still claims every Job");
}

#[test]
fn intercepts_of_the_same_port_conflict_and_the_younger_is_rejected() {
    // (case, ports of the older intercept, ports of the younger, its mode, conflict)
    type Case = (&'static str, Vec<i32>, Vec<i32>, AttachMode, bool);
    let cases: Vec<Case> = vec![
        (
            "same port",
            vec![8080],
            vec![8080],
            AttachMode::Intercept,
            true,
        ),
        (
            "overlapping ports",
            vec![8080, 9090],
            vec![9090],
            AttachMode::Intercept,
            true,
        ),
        (
            "all ports vs one",
            vec![],
            vec![8080],
            AttachMode::Intercept,
            true,
        ),
        (
            "different ports",
            vec![8080],
            vec![9090],
            AttachMode::Intercept,
            false,
        ),
        (
            "wiretap of an intercepted port",
            vec![8080],
            vec![8080],
            AttachMode::Wiretap,
            false,
        ),
    ];
    for (case, pa, pb, mode_b, conflict) in cases {
        let a = attachment("a").ports(&pa).build();
        let b = attachment("b").ports(&pb).mode(mode_b).created(10).build();
        let p = plan(&group(vec![b, a], five_ready(), vec![]), &settings());
        assert_eq!(
            reason_of(&p, "b") == reasons::PORT_CONFLICT,
            conflict,
            "{case}"
        );
        assert_ne!(
            reason_of(&p, "a"),
            reasons::PORT_CONFLICT,
            "{case}: the older one is never rejected"
        );
    }
}

#[test]
fn attachment_with_other_agent_settings_is_rejected_and_claims_nothing() {
    let a = attachment("a").ports(&[8080]).build();
    let b = attachment("b")
        .ports(&[9090])
        .agent_gid(4242)
        .created(10)
        .build();
    let jobs = converged(vec![a.clone()], five_ready());
    let p = plan(
        &group(vec![a.clone(), b.clone()], five_ready(), jobs.clone()),
        &settings(),
    );
    assert_eq!(reason_of(&p, "b"), reasons::AGENT_CONFLICT);
    assert!(p.create.is_empty() && p.delete.is_empty());
    // Once a is gone, b's settings win and the Jobs are replaced.
    let p = plan(&group(vec![b], five_ready(), jobs), &settings());
    assert!(
        p.delete
            .iter()
            .all(|d| d.fate == JobFate::Replace(ReplaceReason::AgentSettingsChanged))
    );
    assert_eq!(p.delete.len(), 5);
}

#[test]
fn ingest_alone_creates_one_job_for_one_target() {
    let ingest = attachment("i")
        .mode(AttachMode::Ingest)
        .lease_renewed(90, 60)
        .build();
    let p = plan(&group(vec![ingest], five_ready(), vec![]), &settings());
    assert_eq!(
        p.create.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(),
        vec!["web-0"]
    );
    assert_eq!(p.statuses["i"].total_targets, 1);
    assert_eq!(p.wake_at, Some(crate::attachment::fixtures::t(150)));
}

#[test]
fn ingest_reuses_an_existing_job_of_an_admissible_pod() {
    let intercept = attachment("a").build();
    let jobs: Vec<JobView> = converged(vec![intercept], five_ready())
        .into_iter()
        .filter(|j| j.target_pod == "web-3")
        .collect();
    let ingest = attachment("i")
        .mode(AttachMode::Ingest)
        .lease_renewed(90, 60)
        .build();
    let p = plan(&group(vec![ingest], five_ready(), jobs), &settings());
    assert!(p.create.is_empty() && p.delete.is_empty(), "{:?}", p.delete);
    assert_eq!(p.statuses["i"].targets[0].pod, "web-3");
}

#[test]
fn ingest_shares_an_intercepts_job_and_keeps_it_by_its_lease() {
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let ingest = || {
        attachment("i")
            .mode(AttachMode::Ingest)
            .lease_renewed(90, 60)
            .created(5)
            .build()
    };
    let p = plan(
        &group(
            vec![attachment("a").build(), ingest()],
            five_ready(),
            jobs.clone(),
        ),
        &settings(),
    );
    assert!(p.create.is_empty() && p.delete.is_empty());
    // The intercept ends: the ingest's lease keeps exactly its one Job.
    let p = plan(
        &group(
            vec![attachment("a").deleting().build(), ingest()],
            five_ready(),
            jobs,
        ),
        &settings(),
    );
    assert_eq!(p.delete.len(), 4);
    assert!(p.delete.iter().all(|d| d.pod != "web-0"), "{:?}", p.delete);
}

#[test]
fn expired_ingest_lease_reaps_the_job_it_alone_held() {
    let ingest = || {
        attachment("i")
            .mode(AttachMode::Ingest)
            .lease_renewed(10, 60)
            .build()
    };
    let jobs = converged(
        vec![
            attachment("i")
                .mode(AttachMode::Ingest)
                .lease_renewed(90, 60)
                .build(),
        ],
        five_ready(),
    );
    assert_eq!(jobs.len(), 1);
    let p = plan(
        &group(vec![ingest()], five_ready(), jobs.clone()),
        &settings(),
    );
    assert_eq!(
        deleted(&p),
        vec![("web-0".to_string(), JobFate::Reap(ReapReason::LeaseExpired))]
    );
    assert_eq!(reason_of(&p, "i"), reasons::LEASE_EXPIRED);
    // With a live intercept next to it, the expired ingest releases nothing.
    let p = plan(
        &group(
            vec![attachment("a").created(20).build(), ingest()],
            five_ready(),
            jobs,
        ),
        &settings(),
    );
    // Nothing is reaped; the ingest's Job is replaced only because the intercept needs
    // port 8080, which an ingest-only agent does not redirect.
    assert_eq!(
        deleted(&p),
        vec![(
            "web-0".to_string(),
            JobFate::Replace(ReplaceReason::PortsAdded)
        )]
    );
}

#[test]
fn sidecar_conflict_event_is_not_repeated_while_nothing_changes() {
    let pods = vec![
        pod("web-0").on_node("n0").ready().build(),
        pod("web-1").on_node("n0").ready().with_sidecar().build(),
    ];
    let p = plan(
        &group(vec![attachment("a").build()], pods.clone(), vec![]),
        &settings(),
    );
    assert_eq!(p.notices.len(), 1);
    let mut a = attachment("a").build();
    a.status = Some(p.statuses["a"].clone());
    let p = plan(&group(vec![a], pods, vec![]), &settings());
    assert!(p.notices.is_empty());
}

#[test]
fn exited_and_starting_agents_are_reported_not_ready() {
    let mut jobs = converged(vec![attachment("a").build()], five_ready());
    jobs[0].run = JobRun::Complete;
    jobs[1].run = JobRun::Active { ready: false };
    let p = plan(
        &group(vec![attachment("a").build()], five_ready(), jobs),
        &settings(),
    );
    let st = &p.statuses["a"];
    assert_eq!(st.ready_summary.as_deref(), Some("3/5"));
    let states: Vec<TargetState> = st.targets.iter().map(|t| t.state).collect();
    assert!(states.contains(&TargetState::Exited) && states.contains(&TargetState::Starting));
    assert!(!is_true(&st.conditions, condition_types::READY));
}

#[test]
fn kept_jobs_still_suspended_are_resumed_and_others_are_not() {
    // Created Jobs are suspended until the operator has made their Secret.
    let p = plan(
        &group(vec![attachment("a").build()], five_ready(), vec![]),
        &settings(),
    );
    assert!(
        p.create
            .iter()
            .all(|c| c.job.spec.as_ref().unwrap().suspend == Some(true))
    );
    assert!(p.resume.is_empty(), "new Jobs are resumed once they exist");
    let jobs = converged(vec![attachment("a").build()], five_ready());
    let mut g = group(vec![attachment("a").build()], five_ready(), jobs.clone());
    assert!(
        plan(&g, &settings()).resume.is_empty(),
        "all resumed already"
    );
    // The operator stopped between web-2's Job and its Secret.
    let web2 = g.jobs.iter_mut().find(|j| j.target_pod == "web-2").unwrap();
    web2.suspended = true;
    let web2 = web2.clone();
    let p = plan(&g, &settings());
    assert_eq!(
        p.resume,
        vec![Resume {
            job: web2.name.clone(),
            job_uid: web2.uid.clone(),
            target_namespace: web2.target_namespace.clone(),
            target_pod: "web-2".into(),
            target_pod_uid: web2.target_pod_uid.clone(),
        }]
    );
    assert!(p.create.is_empty() && p.delete.is_empty());
    // A terminating Job, or one about to be reaped, is not resumed.
    let mut terminating = g.clone();
    terminating
        .jobs
        .iter_mut()
        .find(|j| j.target_pod == "web-2")
        .unwrap()
        .terminating = true;
    assert!(plan(&terminating, &settings()).resume.is_empty());
    let mut unclaimed = g.clone();
    unclaimed.attachments.clear();
    let p = plan(&unclaimed, &settings());
    assert_eq!(p.delete.len(), 5);
    assert!(p.resume.is_empty());
}

#[test]
fn a_lease_cannot_stretch_the_session_beyond_the_attachments_bound() {
    // The client writes the Lease: a year-long duration counts as the attachment's
    // 60 s, so a session renewed at 10 s has expired at 100 s.
    let ingest = attachment("i")
        .mode(AttachMode::Ingest)
        .lease_renewed(10, 365 * 86_400)
        .build();
    assert_eq!(ingest.lease_expiry(t(100)), t(70));
    let jobs = converged(
        vec![
            attachment("i")
                .mode(AttachMode::Ingest)
                .lease_renewed(90, 60)
                .build(),
        ],
        five_ready(),
    );
    let p = plan(&group(vec![ingest], five_ready(), jobs), &settings());
    assert_eq!(
        deleted(&p),
        vec![("web-0".to_string(), JobFate::Reap(ReapReason::LeaseExpired))]
    );
}

#[test]
fn a_renewal_stamped_far_in_the_future_is_no_renewal() {
    // Created at 0 (the fixture's default): without a believable renewal the session
    // counts from the attachment's creation, whatever the clock says later.
    let ingest = attachment("i")
        .mode(AttachMode::Ingest)
        .lease_renewed(10_000_000, 60)
        .build();
    assert_eq!(
        ingest.lease_expiry(t(100)),
        ingest.created + SignedDuration::from_secs(60)
    );
    assert_eq!(
        ingest.lease_expiry(t(5_000)),
        ingest.created + SignedDuration::from_secs(60)
    );
    // A client clock a little ahead still renews.
    let ahead = attachment("i")
        .mode(AttachMode::Ingest)
        .lease_renewed(120, 60)
        .build();
    assert_eq!(ahead.lease_expiry(t(100)), t(180));
}

#[test]
fn workloads_of_the_operators_the_agents_and_the_system_namespace_are_never_attached_to() {
    let s = Settings {
        namespace: "podmotion-agents".into(),
        operator_namespace: "podmotion".into(),
        ..settings()
    };
    // Converged Jobs of the same workload, as if they had been made before the rule.
    let jobs = converged(vec![attachment("a").build()], five_ready());
    for ns in ["podmotion", "podmotion-agents", "kube-system"] {
        let mut g = group(vec![attachment("a").build()], five_ready(), jobs.clone());
        g.namespace = ns.into();
        let p = plan(&g, &s);
        assert!(p.create.is_empty(), "{ns}: no agent Job");
        assert_eq!(reason_of(&p, "a"), reasons::PROTECTED_NAMESPACE, "{ns}");
        let st = &p.statuses["a"];
        assert!(is_true(&st.conditions, condition_types::STALLED), "{ns}");
        let stalled = find(&st.conditions, condition_types::STALLED).unwrap();
        assert!(
            stalled.message.contains(ns) && stalled.message.contains("never attaches"),
            "{ns}: {}",
            stalled.message
        );
        assert_eq!(
            p.delete.len(),
            jobs.len(),
            "{ns}: Jobs made before are reaped"
        );
    }
    // Any other namespace is attached to as before.
    let p = plan(
        &group(vec![attachment("a").build()], five_ready(), vec![]),
        &s,
    );
    assert_eq!(p.create.len(), 5);
}

/// `kubernetes.io/os` and `kubernetes.io/arch` labels of a node.
fn platform_labels(os: &str, arch: &str) -> std::collections::BTreeMap<String, String> {
    [
        (crate::platform::OS_LABEL.to_string(), os.to_string()),
        (crate::platform::ARCH_LABEL.to_string(), arch.to_string()),
    ]
    .into()
}

#[test]
fn pods_on_nodes_the_agent_image_cannot_run_on_get_no_job_and_say_why() {
    // n0 amd64 Linux, n1 arm64, n2 Windows; n3 not known to the node cache (yet).
    let pods: Vec<PodView> = (0..4)
        .map(|i| {
            pod(&format!("web-{i}"))
                .on_node(&format!("n{i}"))
                .ready()
                .build()
        })
        .collect();
    let mut g = group(vec![attachment("a").build()], pods, vec![]);
    g.node_labels = [
        ("n0".to_string(), platform_labels("linux", "amd64")),
        ("n1".to_string(), platform_labels("linux", "arm64")),
        ("n2".to_string(), platform_labels("windows", "amd64")),
    ]
    .into();
    let p = plan(&g, &settings());
    assert_eq!(
        p.create.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(),
        vec!["web-0", "web-3"],
        "an unknown node is not held against its pod"
    );
    // Every Job selects the agent image's platform, beside its node pin.
    for c in &p.create {
        let ps = c.job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(
            ps.node_selector,
            Some(platform_labels("linux", "amd64")),
            "{}",
            c.pod
        );
    }
    let st = &p.statuses["a"];
    let skipped: Vec<(&str, SkipReason)> = st
        .skipped
        .iter()
        .map(|s| (s.pod.as_str(), s.reason))
        .collect();
    assert_eq!(
        skipped,
        vec![
            ("web-1", SkipReason::UnsupportedPlatform),
            ("web-2", SkipReason::UnsupportedPlatform),
        ]
    );
    assert!(
        st.skipped[0].message.contains("kubernetes.io/arch=arm64")
            && st.skipped[0].message.contains("linux/amd64"),
        "{:?}",
        st.skipped[0]
    );
    assert!(
        st.skipped[1].message.contains("kubernetes.io/os=windows"),
        "{:?}",
        st.skipped[1]
    );
    assert_eq!(reason_of(&p, "a"), reasons::JOBS_PENDING);

    // The installer's multi-architecture images: only the OS counts.
    let mut any = settings();
    any.platform = crate::platform::Platform::linux("");
    let p = plan(&g, &any);
    assert_eq!(
        p.create.iter().map(|c| c.pod.as_str()).collect::<Vec<_>>(),
        vec!["web-0", "web-1", "web-3"]
    );
    let ps = p.create[0]
        .job
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref();
    let sel = ps.unwrap().node_selector.clone().unwrap();
    assert_eq!(sel.get(crate::platform::ARCH_LABEL), None);
    assert_eq!(sel[crate::platform::OS_LABEL], "linux");
}

#[test]
fn a_job_on_a_node_found_to_be_of_another_platform_is_reaped() {
    let pods = vec![pod("web-0").on_node("n1").ready().build()];
    let jobs = converged(vec![attachment("a").build()], pods.clone());
    let mut g = group(vec![attachment("a").build()], pods, jobs.clone());
    let p = plan(&g, &settings());
    assert!(p.create.is_empty() && p.delete.is_empty(), "{:?}", p.delete);
    // Once the node is known to be arm64, the Job (which cannot run there) goes.
    g.node_labels = [("n1".to_string(), platform_labels("linux", "arm64"))].into();
    let p = plan(&g, &settings());
    assert_eq!(
        deleted(&p),
        vec![(
            "web-0".to_string(),
            JobFate::Reap(ReapReason::TargetNotAdmissible)
        )]
    );
    assert!(p.create.is_empty());
    // Nothing left to attach to: stalled, and the message counts the platform skips.
    let health = find(&p.statuses["a"].conditions, condition_types::STALLED).unwrap();
    assert_eq!(health.reason, reasons::NO_ADMISSIBLE_TARGET);
    assert!(
        health
            .message
            .contains("1 on a node the agent image is not built for"),
        "{}",
        health.message
    );
}
