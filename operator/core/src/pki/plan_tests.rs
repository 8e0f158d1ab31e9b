use super::*;

const DAY: i64 = 86400;

fn life() -> Lifetimes {
    Lifetimes {
        ca: 365 * DAY,
        leaf: 7 * DAY,
        propagation: 300,
    }
}

fn ca(name: &str, not_before: i64, not_after: i64) -> CaCert {
    CaCert {
        cert_pem: format!("-----BEGIN CERTIFICATE-----\n{name}\n-----END CERTIFICATE-----\n"),
        not_before,
        not_after,
    }
}

fn state(current: CaCert) -> CaState {
    CaState {
        current: Some(current),
        ..Default::default()
    }
}

#[test]
fn no_ca_is_created_first() {
    assert_eq!(ca_step(&CaState::default(), &life(), 0), CaStep::Create);
}

#[test]
fn a_young_ca_is_left_alone_until_a_third_of_its_life_is_left() {
    // Backdated an hour (clock skew): the hour does not count.
    let s = state(ca("a", -3600, 365 * DAY));
    assert_eq!(ca_step(&s, &life(), 10 * DAY), CaStep::Nothing);
    let due = 365 * DAY - 365 * DAY / 3;
    assert_eq!(ca_next_event(&s, &life()), Some(due));
    assert_eq!(ca_step(&s, &life(), due - 1), CaStep::Nothing);
    assert_eq!(ca_step(&s, &life(), due), CaStep::Introduce);
    // A short CA (tests) backdated far more than its life is not rotated at once.
    let short = Lifetimes {
        ca: 120,
        leaf: 30,
        propagation: 5,
    };
    let s = state(ca("a", 1000 - 3600, 1120));
    assert_eq!(ca_step(&s, &short, 1001), CaStep::Nothing);
    assert_eq!(ca_next_event(&s, &short), Some(1080));
}

#[test]
fn a_short_ca_rotates_early_enough_for_the_last_leaf_it_signs() {
    // 7-day leaves: a 30-day CA rotates at two thirds (day 20); a 9-day CA must rotate
    // by day 9 - 7 - 2 propagations, before its two thirds (day 6).
    let l = |ca_days: i64| Lifetimes {
        ca: ca_days * DAY,
        ..life()
    };
    assert_eq!(ca_rotation_due(&ca("a", 0, 30 * DAY), &l(30)), 20 * DAY);
    assert_eq!(ca_rotation_due(&ca("a", 0, 9 * DAY), &l(9)), 2 * DAY - 600);
}

#[test]
fn rotation_overlaps_old_and_new_until_every_old_leaf_is_gone() {
    let l = life();
    let old = ca("old", 0, 365 * DAY);
    let new = ca("new", 200 * DAY, 565 * DAY);
    // Introduced: both trusted, the old one still signs (first in the bundle).
    let introduced = CaState {
        current: Some(old.clone()),
        next: Some((new.clone(), 200 * DAY)),
        retired: vec![],
    };
    assert_eq!(bundle(&introduced).matches("BEGIN").count(), 2);
    assert!(bundle(&introduced).starts_with(&old.cert_pem));
    assert_eq!(ca_step(&introduced, &l, 200 * DAY + 299), CaStep::Nothing);
    assert_eq!(ca_next_event(&introduced, &l), Some(200 * DAY + 300));
    // Promoted after propagation: the new one signs, the old is trusted one leaf
    // lifetime (+ propagation) longer.
    let t = 200 * DAY + 300;
    assert_eq!(ca_step(&introduced, &l, t), CaStep::Promote);
    let promoted = promote(&introduced, &l, t);
    assert_eq!(promoted.current.as_ref(), Some(&new));
    assert!(promoted.next.is_none());
    assert_eq!(
        promoted.retired,
        vec![Retired {
            cert_pem: old.cert_pem.clone(),
            trusted_until: t + 7 * DAY + 300
        }]
    );
    let b = bundle(&promoted);
    assert!(
        b.starts_with(&new.cert_pem),
        "the signing CA comes first: {b}"
    );
    assert!(b.contains("old"));
    // A leaf the old CA signed just before the switch expires before its CA leaves
    // the bundle.
    let (_, last_old_leaf_expiry) = leaf_validity(t - 1, &l, old.not_after);
    assert!(last_old_leaf_expiry < t + 7 * DAY + 300);
    assert_eq!(ca_step(&promoted, &l, t + 7 * DAY + 299), CaStep::Nothing);
    assert_eq!(
        ca_step(&promoted, &l, t + 7 * DAY + 300),
        CaStep::DropRetired
    );
    let dropped = drop_retired(&promoted, t + 7 * DAY + 300);
    assert_eq!(bundle(&dropped), new.cert_pem);
}

#[test]
fn lifetimes_without_room_for_overlap_are_rejected() {
    assert!(life().validate().is_ok());
    let bad = Lifetimes {
        ca: 10 * DAY,
        leaf: 7 * DAY,
        propagation: 0,
    };
    assert!(bad.validate().unwrap_err().contains("three times"));
    assert!(Lifetimes { leaf: 0, ..life() }.validate().is_err());
}

#[test]
fn leaves_renew_at_two_thirds_and_never_outlive_their_ca() {
    assert_eq!(leaf_renewal_due(0, 90), 60);
    let l = life();
    assert_eq!(leaf_validity(1000, &l, 10 * DAY), (940, 1000 + 7 * DAY));
    assert_eq!(leaf_validity(1000, &l, 2000), (940, 2000));
    // A short leaf is backdated a tenth of its life: renewal comes after the issue.
    let short = Lifetimes { leaf: 30, ..l };
    let (nb, na) = leaf_validity(1000, &short, 10 * DAY);
    assert_eq!((nb, na), (997, 1030));
    assert!(leaf_renewal_due(nb, na) > 1000);
}

// --- certificate signing requests ---------------------------------------------------

fn policy() -> AgentPolicy {
    AgentPolicy {
        namespace: "pm-agents".into(),
        service_account: "pm-migration-agent".into(),
        pod_labels: BTreeMap::from([(
            "app.kubernetes.io/component".into(),
            "migration-agent".into(),
        )]),
    }
}

/// A request from the agent pod `pod` (uid `pod`-uid) on `node`.
fn from_agent(pod: &str, node: &str) -> CsrFacts {
    CsrFacts {
        signer_name: AGENT_SIGNER.into(),
        username: "system:serviceaccount:pm-agents:pm-migration-agent".into(),
        extra: BTreeMap::from([
            (EXTRA_POD_NAME.into(), vec![pod.into()]),
            (EXTRA_POD_UID.into(), vec![format!("{pod}-uid")]),
            (EXTRA_NODE_NAME.into(), vec![node.into()]),
            (
                "authentication.kubernetes.io/credential-id".into(),
                vec!["JTI=x".into()],
            ),
        ]),
        usages: AGENT_USAGES.iter().map(|s| s.to_string()).collect(),
        request: vec![],
    }
}

fn agent_pod(pod: &str, node: &str) -> PodFacts {
    PodFacts {
        namespace: "pm-agents".into(),
        name: pod.into(),
        uid: format!("{pod}-uid"),
        node_name: Some(node.into()),
        service_account: Some("pm-migration-agent".into()),
        labels: BTreeMap::from([(
            "app.kubernetes.io/component".into(),
            "migration-agent".into(),
        )]),
        terminating: false,
    }
}

fn reason(v: Verdict) -> &'static str {
    match v {
        Verdict::Deny { reason, .. } => reason,
        Verdict::NotOurs { .. } => "NotOurs",
        Verdict::Approve { node } => panic!("approved for {node}"),
    }
}

#[test]
fn the_agent_pod_of_a_node_gets_exactly_that_node_s_identity() {
    let want = agent_request("n1");
    assert_eq!(want.uris, vec!["spiffe://podmotion.io/agent/n1"]);
    assert_eq!(want.common_name.as_deref(), Some("podmotion-agent:n1"));
    assert_eq!(want.dns, vec!["podmotion-agent.n1"]);
    let v = review(
        &from_agent("a-1", "n1"),
        &policy(),
        Ok(&want),
        Some(&agent_pod("a-1", "n1")),
    );
    assert_eq!(v, Verdict::Approve { node: "n1".into() });
}

#[test]
fn an_agent_asking_for_another_node_s_identity_is_denied() {
    let pod = agent_pod("a-1", "n1");
    let csr = from_agent("a-1", "n1");
    let other = agent_request("n2");
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&other), Some(&pod))),
        "IdentityMismatch"
    );
    // Its own identity plus another name, or the operator's: denied too.
    let mut more = agent_request("n1");
    more.dns.push("podmotion-agent.n2".into());
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&more), Some(&pod))),
        "IdentityMismatch"
    );
    let mut op = agent_request("n1");
    op.uris = vec!["spiffe://podmotion.io/operator".into()];
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&op), Some(&pod))),
        "IdentityMismatch"
    );
    let mut ca = agent_request("n1");
    ca.is_ca = true;
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&ca), Some(&pod))),
        "IdentityMismatch"
    );
    let mut ip = agent_request("n1");
    ip.other_names = 1;
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&ip), Some(&pod))),
        "IdentityMismatch"
    );
}

#[test]
fn the_node_comes_from_the_token_and_the_live_pod_never_from_the_request() {
    let want = agent_request("n2");
    // The token says n1 (the pod's node when it was issued); the pod now runs on n2:
    // a stale or forged binding is denied.
    let csr = from_agent("a-1", "n1");
    assert_eq!(
        reason(review(
            &csr,
            &policy(),
            Ok(&want),
            Some(&agent_pod("a-1", "n2"))
        )),
        "NodeMismatch"
    );
    // A pod that was replaced (same name, new uid) or is gone.
    let mut replaced = agent_pod("a-1", "n1");
    replaced.uid = "other".into();
    assert_eq!(
        reason(review(
            &csr,
            &policy(),
            Ok(&agent_request("n1")),
            Some(&replaced)
        )),
        "PodMismatch"
    );
    assert_eq!(
        reason(review(&csr, &policy(), Ok(&agent_request("n1")), None)),
        "PodGone"
    );
    let mut leaving = agent_pod("a-1", "n1");
    leaving.terminating = true;
    assert_eq!(
        reason(review(
            &csr,
            &policy(),
            Ok(&agent_request("n1")),
            Some(&leaving)
        )),
        "PodTerminating"
    );
}

#[test]
fn only_the_agents_service_account_with_a_pod_bound_token_may_ask() {
    let want = agent_request("n1");
    let pod = agent_pod("a-1", "n1");
    let mut other_sa = from_agent("a-1", "n1");
    other_sa.username = "system:serviceaccount:pm-agents:default".into();
    // Never signed, never denied either: another installation's agents (or nobody's).
    assert_eq!(
        review(&other_sa, &policy(), Ok(&want), Some(&pod)),
        Verdict::NotOurs {
            requester: "system:serviceaccount:pm-agents:default".into()
        }
    );
    let mut admin = from_agent("a-1", "n1");
    admin.username = "kubernetes-admin".into();
    assert_eq!(
        reason(review(&admin, &policy(), Ok(&want), Some(&pod))),
        "NotOurs"
    );
    // A token not bound to a pod (e.g. `kubectl create token` without a bound object).
    let mut unbound = from_agent("a-1", "n1");
    unbound.extra.remove(EXTRA_POD_NAME);
    assert_eq!(
        reason(review(&unbound, &policy(), Ok(&want), Some(&pod))),
        "NotBoundToAPod"
    );
    let mut no_node = from_agent("a-1", "n1");
    no_node.extra.remove(EXTRA_NODE_NAME);
    assert_eq!(
        reason(review(&no_node, &policy(), Ok(&want), Some(&pod))),
        "NotBoundToAPod"
    );
    let mut two = from_agent("a-1", "n1");
    two.extra
        .insert(EXTRA_NODE_NAME.into(), vec!["n1".into(), "n2".into()]);
    assert_eq!(
        reason(review(&two, &policy(), Ok(&want), Some(&pod))),
        "NotBoundToAPod"
    );
    // A pod of the same ServiceAccount that is not an agent pod.
    let mut stranger = agent_pod("a-1", "n1");
    stranger.labels.clear();
    assert_eq!(
        reason(review(
            &from_agent("a-1", "n1"),
            &policy(),
            Ok(&want),
            Some(&stranger)
        )),
        "NotAnAgentPod"
    );
}

#[test]
fn requests_with_other_usages_signers_or_bad_pem_are_denied() {
    let want = agent_request("n1");
    let pod = agent_pod("a-1", "n1");
    let mut usages = from_agent("a-1", "n1");
    usages.usages = vec!["client auth".into()];
    assert_eq!(
        reason(review(&usages, &policy(), Ok(&want), Some(&pod))),
        "WrongUsages"
    );
    let mut signing = from_agent("a-1", "n1");
    signing.usages.push("cert sign".into());
    assert_eq!(
        reason(review(&signing, &policy(), Ok(&want), Some(&pod))),
        "WrongUsages"
    );
    let mut rsa = from_agent("a-1", "n1");
    rsa.usages.push("key encipherment".into());
    assert_eq!(
        review(&rsa, &policy(), Ok(&want), Some(&pod)),
        Verdict::Approve { node: "n1".into() }
    );
    let mut signer = from_agent("a-1", "n1");
    signer.signer_name = "kubernetes.io/kube-apiserver-client".into();
    assert_eq!(
        reason(review(&signer, &policy(), Ok(&want), Some(&pod))),
        "WrongSigner"
    );
    assert_eq!(
        reason(review(
            &from_agent("a-1", "n1"),
            &policy(),
            Err("bad signature"),
            Some(&pod)
        )),
        "BadRequest"
    );
}

#[test]
fn key_material_older_than_its_protection_or_unprotected_is_not_adopted() {
    let b = "pm-podmotion-key-material";
    assert_eq!(provenance(b, 1_000, Some(1_000)), Ok(()));
    assert_eq!(provenance(b, 5_000, Some(1_000)), Ok(()));
    let planted = provenance(b, 999, Some(1_000)).unwrap_err();
    assert_eq!(
        planted,
        Untrusted::OlderThanProtection {
            binding: b.into(),
            created: 999,
            since: 1_000
        }
    );
    assert!(
        planted.to_string().contains("did not necessarily make it"),
        "{planted}"
    );
    let open = provenance(b, 5_000, None).unwrap_err();
    assert_eq!(open, Untrusted::Unprotected(b.into()));
    assert!(open.to_string().contains(b), "{open}");
}
