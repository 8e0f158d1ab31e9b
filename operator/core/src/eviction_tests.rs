use super::*;

const UID: &str = "1f0e6c2a-3c1d-4a53-9a1f-7d2f0c9e8b11";

fn pod(name: &str) -> EvictedPod {
    EvictedPod {
        name: name.into(),
        namespace: "shop".into(),
        uid: UID.into(),
        running: true,
        ..Default::default()
    }
}

impl EvictedPod {
    fn asking(mut self, strategy: &str) -> Self {
        self.annotations
            .insert(annotations::EVICTION_STRATEGY.into(), strategy.into());
        self
    }
    fn in_namespace(mut self, ns: &str) -> Self {
        self.namespace = ns.into();
        self
    }
    fn terminating(mut self) -> Self {
        self.terminating = true;
        self
    }
}

fn migration(name: &str, pod: &str, phase: MigrationPhase) -> KnownMigration {
    KnownMigration {
        name: name.into(),
        pod_name: pod.into(),
        pod_uid: Some(UID.into()),
        dry_run: false,
        phase,
        migratable: None,
        failure: None,
    }
}

impl KnownMigration {
    fn refused_for(mut self, reason: &str) -> Self {
        self.migratable = Some((false, reason.into(), format!("because {reason}")));
        self
    }
    fn migratable(mut self) -> Self {
        self.migratable = Some((true, reasons::MIGRATABLE.into(), String::new()));
        self
    }
    fn failed(mut self, reason: &str) -> Self {
        self.failure = Some((reason.into(), "it broke".into()));
        self
    }
    fn dry_run(mut self) -> Self {
        self.dry_run = true;
        self
    }
}

fn no_labels() -> BTreeMap<String, String> {
    BTreeMap::new()
}

fn settings() -> Settings {
    Settings {
        protected_namespaces: vec!["podmotion-system".into(), "podmotion-agents".into()],
        namespace_default: None,
        freeze_budget_millis: None,
    }
}

fn cannot(reason: &str) -> Verdict {
    Verdict::CannotMove {
        reason: reason.into(),
        message: format!("{reason} explained"),
    }
}

fn decide_simple(pod: &EvictedPod, verdict: Option<&Verdict>, ms: &[KnownMigration]) -> Answer {
    decide(pod, &no_labels(), &settings(), verdict, ms)
}

fn migrating_name(a: &Answer) -> (&str, bool) {
    match a {
        Answer::Migrating {
            migration, create, ..
        } => (migration.as_str(), create.is_some()),
        other => panic!("expected a 429, got {other:?}"),
    }
}

fn blocked_cause(a: &Answer) -> &str {
    match a {
        Answer::Blocked { cause, .. } => cause,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_pod_that_did_not_ask_is_evicted() {
    let a = decide_simple(&pod("web"), None, &[]);
    assert_eq!(a, Answer::Evict(EvictWhy::NotOptedIn));
}

#[test]
fn an_opted_in_pod_is_answered_429_and_its_migration_is_created() {
    for s in ["LiveMigrate", "LiveMigrateIfPossible"] {
        let p = pod("web").asking(s);
        let a = decide_simple(&p, Some(&Verdict::Movable), &[]);
        let (name, create) = migrating_name(&a);
        assert_eq!(name, migration_name(&p));
        assert!(create, "{s}: the first eviction creates the migration");
        let Answer::Migrating {
            create: Some(m),
            message,
            ..
        } = &a
        else {
            unreachable!()
        };
        assert_eq!(m.spec.pod_name, "web");
        assert_eq!(m.spec.pod_uid.as_deref(), Some(UID));
        assert_eq!(m.spec.target_node, None, "placement chooses the target");
        assert_eq!(m.metadata.namespace.as_deref(), Some("shop"));
        assert!(message.contains(name), "{message}");
    }
}

#[test]
fn an_eviction_s_migration_has_the_installer_s_freeze_budget() {
    let p = pod("web").asking("LiveMigrate");
    let created = |settings: &Settings| match decide(
        &p,
        &no_labels(),
        settings,
        Some(&Verdict::Movable),
        &[],
    ) {
        Answer::Migrating {
            create: Some(m), ..
        } => m.spec.freeze_budget_millis,
        a => panic!("{a:?}"),
    };
    assert_eq!(created(&settings()), 500, "the PodMigration's default");
    let s = Settings {
        freeze_budget_millis: Some(5000),
        ..settings()
    };
    assert_eq!(created(&s), 5000);
}

#[test]
fn a_retry_names_the_same_migration_and_creates_nothing() {
    let p = pod("web").asking("LiveMigrate");
    let ours = migration_name(&p);
    for phase in [
        MigrationPhase::Pending,
        MigrationPhase::Checkpointing,
        MigrationPhase::Committing,
    ] {
        let ms = [migration(&ours, "web", phase).migratable()];
        let a = decide_simple(&p, Some(&Verdict::Movable), &ms);
        assert_eq!(migrating_name(&a), (ours.as_str(), false), "{phase:?}");
    }
}

#[test]
fn migration_names_depend_on_the_pod_uid_only_and_fit_a_label() {
    let a = pod("web");
    let mut b = pod("web");
    b.uid = "2f0e6c2a-3c1d-4a53-9a1f-7d2f0c9e8b11".into();
    assert_eq!(migration_name(&a), migration_name(&pod("web")));
    assert_ne!(migration_name(&a), migration_name(&b));
    let long = pod(&format!("{}-x", "a".repeat(60)));
    let n = migration_name(&long);
    assert!(n.len() <= 63, "{n}");
    assert!(!n.contains("--"), "{n}");
}

#[test]
fn a_live_migrate_pod_that_cannot_move_blocks_with_the_reason() {
    let p = pod("web").asking("LiveMigrate");
    let a = decide_simple(&p, Some(&cannot(reasons::HOST_NAMESPACES)), &[]);
    assert_eq!(blocked_cause(&a), reasons::HOST_NAMESPACES);
    let Answer::Blocked { message, .. } = a else {
        unreachable!()
    };
    assert!(message.contains("HostNamespaces explained"), "{message}");
    assert!(message.contains("LiveMigrateIfPossible"), "{message}");
}

#[test]
fn a_live_migrate_if_possible_pod_that_cannot_move_is_evicted() {
    let p = pod("web").asking("LiveMigrateIfPossible");
    let a = decide_simple(&p, Some(&cannot(reasons::LOCAL_DATA)), &[]);
    assert_eq!(
        a,
        Answer::Evict(EvictWhy::CannotMove {
            reason: reasons::LOCAL_DATA.into()
        })
    );
}

#[test]
fn a_migration_refused_by_the_preflight_is_the_verdict() {
    let ours = migration_name(&pod("web"));
    let ms =
        [migration(&ours, "web", MigrationPhase::Pending).refused_for(reasons::NO_TARGET_NODE)];
    let a = decide_simple(&pod("web").asking("LiveMigrate"), None, &ms);
    assert_eq!(blocked_cause(&a), reasons::NO_TARGET_NODE);
    let a = decide_simple(&pod("web").asking("LiveMigrateIfPossible"), None, &ms);
    assert_eq!(
        a,
        Answer::Evict(EvictWhy::CannotMove {
            reason: reasons::NO_TARGET_NODE.into()
        })
    );
}

#[test]
fn a_queued_migration_keeps_the_eviction_waiting() {
    // Migratable=True and Pending: waiting for a slot within the concurrency limits.
    let ours = migration_name(&pod("web"));
    let ms = [migration(&ours, "web", MigrationPhase::Pending).migratable()];
    let a = decide_simple(&pod("web").asking("LiveMigrate"), None, &ms);
    assert_eq!(migrating_name(&a), (ours.as_str(), false));
}

#[test]
fn a_users_migration_of_the_pod_in_flight_is_the_one_waited_for() {
    let ms = [migration("by-hand", "web", MigrationPhase::Transferring)];
    let a = decide_simple(&pod("web").asking("LiveMigrate"), None, &ms);
    assert_eq!(migrating_name(&a), ("by-hand", false));
}

#[test]
fn migrations_of_other_pods_dry_runs_and_other_uids_are_ignored() {
    let p = pod("web").asking("LiveMigrate");
    let mut other_uid = migration("old", "web", MigrationPhase::Transferring);
    other_uid.pod_uid = Some("9f0e6c2a-3c1d-4a53-9a1f-7d2f0c9e8b11".into());
    let ms = [
        migration("x", "db", MigrationPhase::Transferring),
        migration("y", "web", MigrationPhase::Pending).dry_run(),
        other_uid,
    ];
    let a = decide_simple(&p, Some(&Verdict::Movable), &ms);
    assert_eq!(migrating_name(&a), (migration_name(&p).as_str(), true));
}

#[test]
fn a_failed_migration_blocks_a_live_migrate_pod_and_lets_an_if_possible_one_go() {
    let ours = migration_name(&pod("web"));
    for phase in [MigrationPhase::Failed, MigrationPhase::Aborted] {
        let ms = [migration(&ours, "web", phase).failed(reasons::PROBE_FAILED)];
        let a = decide_simple(&pod("web").asking("LiveMigrate"), None, &ms);
        assert_eq!(blocked_cause(&a), reasons::EVICTION_MIGRATION_FAILED);
        let Answer::Blocked { message, .. } = &a else {
            unreachable!()
        };
        assert!(message.contains("ProbeFailed: it broke"), "{message}");
        assert!(message.contains(&ours), "{message}");
        let a = decide_simple(&pod("web").asking("LiveMigrateIfPossible"), None, &ms);
        assert_eq!(
            a,
            Answer::Evict(EvictWhy::MigrationEnded {
                migration: ours.clone()
            })
        );
    }
}

#[test]
fn after_a_successful_migration_what_is_left_is_evicted() {
    let ours = migration_name(&pod("web"));
    let ms = [migration(&ours, "web", MigrationPhase::Succeeded)];
    let a = decide_simple(&pod("web").asking("LiveMigrate"), None, &ms);
    assert_eq!(a, Answer::Evict(EvictWhy::Migrated { migration: ours }));
}

#[test]
fn a_terminating_pod_is_evicted() {
    let a = decide_simple(&pod("web").asking("LiveMigrate").terminating(), None, &[]);
    assert_eq!(a, Answer::Evict(EvictWhy::Terminating));
}

#[test]
fn a_pod_that_runs_nothing_is_evicted() {
    let mut p = pod("web").asking("LiveMigrate");
    p.running = false;
    let a = decide_simple(&p, Some(&cannot(reasons::HOST_NAMESPACES)), &[]);
    assert_eq!(a, Answer::Evict(EvictWhy::NotRunning));
}

fn facts(spec: serde_json::Value) -> PodFacts {
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "shop", "uid": UID,
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-1",
                "uid": "u", "controller": true}]},
        "spec": spec,
        "status": {"phase": "Running"},
    }))
    .unwrap();
    PodFacts::from_pod(&p).with_claims(&BTreeMap::new())
}

#[test]
fn the_pod_verdict_refuses_what_the_pod_alone_rules_out() {
    let plain =
        facts(serde_json::json!({"nodeName": "n0", "containers": [{"name": "c", "image": "i"}]}));
    assert_eq!(
        pod_verdict(&plain, "podmotion-system", "podmotion-system-agents", false),
        Verdict::Movable
    );
    let host = facts(serde_json::json!({"nodeName": "n0", "hostNetwork": true,
        "containers": [{"name": "c", "image": "i"}]}));
    match pod_verdict(&host, "podmotion-system", "podmotion-system-agents", false) {
        Verdict::CannotMove { reason, message } => {
            assert_eq!(reason, reasons::HOST_NAMESPACES);
            assert!(message.contains("hostNetwork"), "{message}");
        }
        v => panic!("{v:?}"),
    }
    let scratch = facts(serde_json::json!({"nodeName": "n0",
        "containers": [{"name": "c", "image": "i"}],
        "volumes": [{"name": "tmp", "emptyDir": {}}]}));
    assert!(matches!(
        pod_verdict(&scratch, "podmotion-system", "podmotion-system-agents", false),
        Verdict::CannotMove { reason, .. } if reason == reasons::LOCAL_DATA
    ));
}

#[test]
fn system_and_podmotion_namespaces_are_never_held_up() {
    for ns in ["kube-system", "podmotion-system", "podmotion-agents"] {
        let p = pod("web").asking("LiveMigrate").in_namespace(ns);
        let a = decide_simple(&p, Some(&cannot(reasons::HOST_NAMESPACES)), &[]);
        assert_eq!(a, Answer::Evict(EvictWhy::ProtectedNamespace), "{ns}");
    }
}

#[test]
fn an_unknown_strategy_is_refused_with_the_accepted_values() {
    let a = decide_simple(&pod("web").asking("livemigrate"), None, &[]);
    assert_eq!(blocked_cause(&a), reasons::INVALID_EVICTION_STRATEGY);
    let Answer::Blocked { message, .. } = a else {
        unreachable!()
    };
    assert!(
        message.contains("LiveMigrate, LiveMigrateIfPossible, Evict"),
        "{message}"
    );
}

#[test]
fn a_namespace_default_applies_to_pods_that_did_not_choose() {
    let mut s = settings();
    s.namespace_default =
        Some(NamespaceDefault::parse("podmotion.io/live-migrate=true", "LiveMigrate").unwrap());
    let labelled = BTreeMap::from([("podmotion.io/live-migrate".into(), "true".into())]);
    let other = BTreeMap::from([("podmotion.io/live-migrate".into(), "false".into())]);
    let p = pod("web");
    let a = decide(&p, &labelled, &s, Some(&Verdict::Movable), &[]);
    assert!(migrating_name(&a).1, "the default opts the pod in");
    assert_eq!(
        decide(&p, &other, &s, Some(&Verdict::Movable), &[]),
        Answer::Evict(EvictWhy::NotOptedIn)
    );
    // The pod's own choice wins, opting out included.
    let out = pod("web").asking("Evict");
    assert_eq!(
        decide(&out, &labelled, &s, Some(&Verdict::Movable), &[]),
        Answer::Evict(EvictWhy::NotOptedIn)
    );
    let soft = pod("web").asking("LiveMigrateIfPossible");
    assert_eq!(
        decide(
            &soft,
            &labelled,
            &s,
            Some(&cannot(reasons::LOCAL_DATA)),
            &[]
        ),
        Answer::Evict(EvictWhy::CannotMove {
            reason: reasons::LOCAL_DATA.into()
        })
    );
}

#[test]
fn a_namespace_default_selector_is_one_label() {
    let d = NamespaceDefault::parse("team", "LiveMigrateIfPossible").unwrap();
    assert_eq!(d.value, None);
    assert!(d.applies(&BTreeMap::from([("team".into(), "any".into())])));
    assert!(NamespaceDefault::parse("", "LiveMigrate").is_err());
    assert!(NamespaceDefault::parse("a=b,c=d", "LiveMigrate").is_err());
    let e = NamespaceDefault::parse("a=b", "Sometimes").unwrap_err();
    assert!(
        e.contains("LiveMigrate, LiveMigrateIfPossible, Evict"),
        "{e}"
    );
}

#[test]
fn block_causes_are_bounded_for_metrics() {
    assert_eq!(
        bounded_cause(reasons::HOST_NAMESPACES),
        reasons::HOST_NAMESPACES
    );
    assert_eq!(bounded_cause("SomethingNew"), "Other");
}

#[test]
fn the_evicted_pod_is_read_from_the_pod() {
    let p: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": "web", "namespace": "shop", "uid": UID,
            "annotations": {"podmotion.io/eviction-strategy": "LiveMigrate"},
            "deletionTimestamp": "2026-12-05T06:00:00Z",
        },
    }))
    .unwrap();
    let e = EvictedPod::from_pod(&p);
    assert_eq!(e.name, "web");
    assert_eq!(e.uid, UID);
    assert!(e.terminating);
    assert_eq!(
        strategy(&e, &no_labels(), &settings()),
        Ok(Strategy::LiveMigrate)
    );
}
