//! The checks' tests: each refusal for its cause, with a message that says what to do.

use std::collections::BTreeMap;

use podmotion_api::names::annotations;
use serde_json::{Value, json};

use super::*;
use crate::migration::fixtures::{claim_volume, claims, k8s, me, merge, node, pod, spec, ts};
use crate::migration::preflight::ClaimFacts;
use crate::migration::render::HOLDER_INSTALLER;

fn verdict_reason(p: &Preflight) -> &'static str {
    match p {
        Preflight::Migratable(_) => reasons::MIGRATABLE,
        Preflight::NotMigratable { reason, .. } => reason,
    }
}

fn three_nodes() -> Vec<NodeFacts> {
    vec![node("n0").build(), node("n1").build(), node("n2").build()]
}

#[test]
fn a_running_pod_with_agents_everywhere_is_migratable_to_another_node() {
    let p = pod("web-0").on("n0").build();
    let v = preflight(&spec("web-0").build(), &me(), Some(&p), &three_nodes(), &[]);
    let Preflight::Migratable(plan) = v else {
        panic!("{v:?}")
    };
    assert_eq!(plan.source_node, "n0");
    assert_ne!(plan.target_node, "n0");
    assert_eq!(plan.source_pod_uid, p.uid);
    assert!(plan.target_pod.starts_with("web-0-"), "{}", plan.target_pod);
}

#[test]
fn every_failed_check_names_its_reason() {
    let nodes = three_nodes();
    let s = spec("web-0").build();
    type Case = (
        &'static str,
        Option<PodFacts>,
        PodMigrationSpec,
        Vec<NodeFacts>,
        Vec<OtherMigration>,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "missing pod",
            None,
            s.clone(),
            nodes.clone(),
            vec![],
            reasons::SOURCE_POD_NOT_FOUND,
        ),
        (
            "uid pin mismatch",
            Some(pod("web-0").on("n0").build()),
            spec("web-0")
                .uid("ffffffff-0000-4000-8000-000000000000")
                .build(),
            nodes.clone(),
            vec![],
            reasons::POD_UID_MISMATCH,
        ),
        (
            "pending pod",
            Some(pod("web-0").on("n0").pending().build()),
            s.clone(),
            nodes.clone(),
            vec![],
            reasons::SOURCE_POD_NOT_RUNNING,
        ),
        (
            "terminating pod",
            Some(pod("web-0").on("n0").terminating().build()),
            s.clone(),
            nodes.clone(),
            vec![],
            reasons::SOURCE_POD_NOT_RUNNING,
        ),
        (
            "statefulset pod",
            Some(pod("db-0").on("n0").owned_by("StatefulSet", "db").build()),
            spec("db-0").build(),
            nodes.clone(),
            vec![],
            reasons::UNSUPPORTED_OWNER,
        ),
        (
            "older migration of the same pod",
            Some(pod("web-0").on("n0").build()),
            s.clone(),
            nodes.clone(),
            vec![OtherMigration {
                name: "earlier".into(),
                pod_name: "web-0".into(),
                created: ts(50),
                terminal: false,
            }],
            reasons::ALREADY_MIGRATING,
        ),
        (
            "no agent on source",
            Some(pod("web-0").on("n0").build()),
            s.clone(),
            vec![node("n0").without_agent().build(), node("n1").build()],
            vec![],
            reasons::NO_AGENT_ON_NODE,
        ),
        (
            "target is the source",
            Some(pod("web-0").on("n0").build()),
            spec("web-0").target("n0").build(),
            nodes.clone(),
            vec![],
            reasons::TARGET_IS_SOURCE,
        ),
        (
            "explicit target without agent",
            Some(pod("web-0").on("n0").build()),
            spec("web-0").target("n1").build(),
            vec![node("n0").build(), node("n1").without_agent().build()],
            vec![],
            reasons::NO_AGENT_ON_NODE,
        ),
        (
            "explicit target unknown",
            Some(pod("web-0").on("n0").build()),
            spec("web-0").target("n9").build(),
            nodes.clone(),
            vec![],
            reasons::NO_TARGET_NODE,
        ),
        (
            "explicit target full",
            Some(pod("web-0").on("n0").requests(2000, 1 << 30).build()),
            spec("web-0").target("n1").build(),
            vec![
                node("n0").build(),
                node("n1").allocatable(1000, 8 << 30).build(),
            ],
            vec![],
            reasons::TARGET_DOES_NOT_FIT,
        ),
        (
            "selector matches nothing",
            Some(pod("web-0").on("n0").build()),
            spec("web-0").selector("zone", "b").build(),
            nodes.clone(),
            vec![],
            reasons::NO_TARGET_NODE,
        ),
    ];
    // What cannot move: pods read from their manifests, each refused for its cause.
    let opt_in = spec("web-0").leave_local_data_behind().build();
    let rwo = claims(&[("data", &["ReadWriteOnce"])]);
    let cannot_move: Vec<(&str, PodFacts, PodMigrationSpec, &str)> = vec![
        (
            "kube-system pod",
            k8s(json!({"metadata": {"namespace": "kube-system"}})),
            s.clone(),
            reasons::PROTECTED_NAMESPACE,
        ),
        (
            "pod in the operator's namespace",
            k8s(json!({"metadata": {"namespace": "podmotion-system"}})),
            s.clone(),
            reasons::PROTECTED_NAMESPACE,
        ),
        (
            "pod in the agents' namespace",
            k8s(json!({"metadata": {"namespace": "podmotion-system-agents"}})),
            s.clone(),
            reasons::PROTECTED_NAMESPACE,
        ),
        (
            "mirror pod",
            k8s(json!({"metadata": {"annotations": {(annotations::CONFIG_MIRROR): "abc"}}})),
            s.clone(),
            reasons::STATIC_POD,
        ),
        (
            "static pod owned by its node",
            k8s(json!({"metadata": {"ownerReferences": [{"apiVersion": "v1",
                "kind": "Node", "name": "n0", "uid": "node-uid", "controller": true}]}})),
            s.clone(),
            reasons::STATIC_POD,
        ),
        (
            "hostNetwork",
            k8s(json!({"spec": {"hostNetwork": true}})),
            s.clone(),
            reasons::HOST_NAMESPACES,
        ),
        (
            "hostPID",
            k8s(json!({"spec": {"hostPID": true}})),
            s.clone(),
            reasons::HOST_NAMESPACES,
        ),
        (
            "hostIPC",
            k8s(json!({"spec": {"hostIPC": true}})),
            s.clone(),
            reasons::HOST_NAMESPACES,
        ),
        (
            "two containers in PostCopy",
            two_running(json!({"spec": {"containers": [
                {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]}})),
            spec("web-0").post_copy().build(),
            reasons::MULTIPLE_CONTAINERS,
        ),
        (
            "native sidecar in PostCopy",
            two_running(json!({"spec": {"initContainers": [
                {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]}})),
            spec("web-0").post_copy().build(),
            reasons::MULTIPLE_CONTAINERS,
        ),
        (
            "a second container not running",
            k8s(json!({"spec": {"containers": [
                {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]},
                "status": {"containerStatuses": [running("app"), json!({"name": "proxy",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}}})]}})),
            s.clone(),
            reasons::MULTIPLE_CONTAINERS,
        ),
        (
            "gpu limit",
            k8s(
                json!({"spec": {"containers": [{"name": "app", "image": "app:1",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}),
            ),
            s.clone(),
            reasons::EXTENDED_RESOURCES,
        ),
        (
            "emptyDir",
            k8s(json!({"spec": {"volumes": [{"name": "scratch", "emptyDir": {}}]}})),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "memory emptyDir",
            k8s(json!({"spec": {"volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}]}})),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "hostPath",
            k8s(json!({"spec": {"volumes": [{"name": "logs", "hostPath": {"path": "/var/log"}}]}})),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "generic ephemeral volume",
            k8s(json!({"spec": {"volumes": [{"name": "cache", "ephemeral": {
                "volumeClaimTemplate": {"spec": {"accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}}}}}}]}})),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "writable inline csi volume",
            k8s(
                json!({"spec": {"volumes": [{"name": "scratch", "csi": {"driver": "x.example"}}]}}),
            ),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "ReadWriteOnce claim",
            with_claim(k8s(claim_volume("data")), &rwo),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "ReadWriteOncePod claim",
            with_claim(
                k8s(claim_volume("data")),
                &claims(&[("data", &["ReadWriteOncePod"])]),
            ),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "ReadWriteOnce claim, even with the opt-in",
            with_claim(k8s(claim_volume("data")), &rwo),
            opt_in.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "claim that does not exist",
            k8s(claim_volume("data")),
            s.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "ReadWriteMany claim on a local volume",
            with_claim(k8s(claim_volume("data")), &{
                let mut c = claims(&[("data", &["ReadWriteMany"])]);
                c.get_mut("data").unwrap().node_local_kind = Some("local");
                c
            }),
            opt_in.clone(),
            reasons::LOCAL_DATA,
        ),
        (
            "in-tree disk",
            k8s(json!({"spec": {"volumes": [{"name": "disk",
                "gcePersistentDisk": {"pdName": "d1"}}]}})),
            opt_in.clone(),
            reasons::LOCAL_DATA,
        ),
    ];
    let base = preflight(&s, &me(), Some(&k8s(json!({}))), &nodes, &[]);
    assert_eq!(verdict_reason(&base), reasons::MIGRATABLE, "{base:?}");
    let cases = cases.into_iter().chain(
        cannot_move
            .into_iter()
            .map(|(what, p, s, want)| (what, Some(p), s, nodes.clone(), vec![], want)),
    );
    for (what, p, s, n, others, want) in cases {
        let v = preflight(&s, &me(), p.as_ref(), &n, &others);
        assert_eq!(verdict_reason(&v), want, "{what}: {v:?}");
    }
}

/// A container's status as the kubelet reports a running one.
fn running(name: &str) -> Value {
    json!({"name": name, "containerID": format!("containerd://{name}"),
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}})
}

/// `k8s(patch)` with every container of `app` and `proxy` (regular or native
/// sidecar) reported running.
fn two_running(mut patch: Value) -> PodFacts {
    let sidecar = patch["spec"]["initContainers"].is_array();
    let status = if sidecar {
        json!({"containerStatuses": [running("app")],
            "initContainerStatuses": [running("proxy")]})
    } else {
        let names: Vec<Value> = patch["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| running(c["name"].as_str().unwrap()))
            .collect();
        json!({"containerStatuses": names})
    };
    merge(&mut patch, json!({"status": status}));
    k8s(patch)
}

fn with_claim(p: PodFacts, c: &BTreeMap<String, ClaimFacts>) -> PodFacts {
    p.with_claims(c)
}

fn refusal(p: &PodFacts, s: &PodMigrationSpec) -> (&'static str, String) {
    match preflight(s, &me(), Some(p), &three_nodes(), &[]) {
        Preflight::NotMigratable { reason, message } => (reason, message),
        v => panic!("migratable: {v:?}"),
    }
}

fn assert_migratable(what: &str, p: &PodFacts, s: &PodMigrationSpec) {
    let v = preflight(s, &me(), Some(p), &three_nodes(), &[]);
    assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{what}: {v:?}");
}

#[test]
fn refusals_name_the_cause_and_what_to_do() {
    let s = spec("web-0").build();
    let (_, m) = refusal(&k8s(json!({"spec": {"hostPID": true}})), &s);
    assert!(m.contains("hostPID") && !m.contains("hostNetwork"), "{m}");
    let (_, m) = refusal(
        &k8s(json!({"spec": {"hostNetwork": true, "hostIPC": true}})),
        &s,
    );
    assert!(m.contains("hostNetwork, hostIPC"), "{m}");
    let (_, m) = refusal(
        &k8s(
            json!({"spec": {"containers": [{"name": "train", "image": "t:1",
            "resources": {"requests": {"cpu": "1", "example.com/fpga": "2"}}}]}}),
        ),
        &s,
    );
    assert!(m.contains("example.com/fpga (container train)"), "{m}");
    assert!(!m.contains("cpu ("), "{m}");
    let (_, m) = refusal(
        &k8s(
            json!({"spec": {"volumes": [{"name": "scratch", "emptyDir": {}},
            {"name": "logs", "hostPath": {"path": "/var/log"}}]}}),
        ),
        &s,
    );
    assert!(
        m.contains("scratch (emptyDir), logs (hostPath)")
            && m.contains("spec.leaveLocalDataBehind: true"),
        "{m}"
    );
    let (_, m) = refusal(
        &with_claim(
            k8s(claim_volume("data")),
            &claims(&[("data", &["ReadWriteOnce"])]),
        ),
        &s,
    );
    assert!(
        m.contains("claim data is ReadWriteOnce") && m.contains("does not change this"),
        "{m}"
    );
    let (_, m) = refusal(
        &two_running(json!({"spec": {"containers": [{"name": "app"}, {"name": "envoy"}]}})),
        &spec("web-0").post_copy().build(),
    );
    assert!(
        m.contains("2 containers (app, envoy") && m.contains("PreCopy or Cold"),
        "{m}"
    );
    let (_, m) = refusal(&k8s(json!({"metadata": {"namespace": "kube-system"}})), &s);
    assert!(m.contains("kube-system"), "{m}");
}

#[test]
fn a_non_root_container_is_refused_in_pending_only_where_its_dump_cannot_run() {
    let post_copy = spec("web-0").post_copy().build();
    let pre_copy = spec("web-0").build();
    // The image's own user, as the kubelet reports it: no securityContext says it.
    let reported = k8s(json!({"status": {"containerStatuses": [{"name": "app",
        "image": "app:1", "imageID": "", "ready": true, "restartCount": 0,
        "user": {"linux": {"uid": 65532, "gid": 65532}}}]}}));
    assert_eq!(
        reported.non_root_containers,
        vec![("app".to_string(), 65532)]
    );
    let (reason, m) = refusal(&reported, &post_copy);
    assert_eq!(reason, reasons::NON_ROOT_WORKLOAD);
    assert!(
        m.contains("container app runs as uid 65532")
            && m.contains("CAP_SYS_RESOURCE")
            && m.contains("migrationAgent.agent.capabilities")
            && m.contains("PreCopy or Cold"),
        "{m}"
    );
    // PreCopy and Cold dump it as its own user.
    assert_migratable("a non-root container in PreCopy", &reported, &pre_copy);
    // Declared in the spec (container over pod), when the kubelet does not report it.
    let declared = k8s(json!({"spec": {"securityContext": {"runAsUser": 1000},
        "containers": [{"name": "app", "image": "app:1"}]}}));
    assert_eq!(
        declared.non_root_containers,
        vec![("app".to_string(), 1000)]
    );
    assert_eq!(refusal(&declared, &post_copy).0, reasons::NON_ROOT_WORKLOAD);
    let root = k8s(json!({"spec": {"securityContext": {"runAsUser": 1000},
        "containers": [{"name": "app", "image": "app:1",
            "securityContext": {"runAsUser": 0}}]}}));
    assert!(root.non_root_containers.is_empty());
    assert_migratable("a root container in PostCopy", &root, &post_copy);
    // Neither tells: the agent checks the process at Prepare.
    assert!(k8s(json!({})).non_root_containers.is_empty());
}

#[test]
fn an_exec_probe_is_refused_before_the_freeze_unless_the_installer_enabled_it() {
    use podmotion_api::migration::{ApplicationProbe, ExecProbe, TcpProbe};
    let probe = |exec: bool| ApplicationProbe {
        http_get: None,
        tcp_socket: (!exec).then_some(TcpProbe { port: 8080 }),
        grpc: None,
        exec: exec.then(|| ExecProbe {
            command: vec!["/bin/check".into()],
            container: None,
        }),
        timeout_seconds: 2,
        failure_threshold: 3,
    };
    let mut s = spec("web-0").build();
    s.probe = Some(probe(true));
    let p = k8s(json!({}));
    let (reason, m) = refusal(&p, &s);
    assert_eq!(reason, EXEC_PROBE_DISABLED);
    assert!(
        m.starts_with("spec.probe is an exec probe") && m.contains("migration.execProbes.enabled"),
        "{m}"
    );
    // Enabled by the installer: migratable.
    let on = Me {
        exec_probes: true,
        ..me()
    };
    let v = preflight(&s, &on, Some(&p), &three_nodes(), &[]);
    assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
    // Other probe kinds never need it.
    s.probe = Some(probe(false));
    assert_migratable("tcp probe", &p, &s);
    // Without spec.probe the pod's readiness probe is the check: an exec one is
    // refused the same way, a spec.probe of another kind overrides it.
    let exec_ready = k8s(
        json!({"spec": {"containers": [{"name": "app", "image": "app:1",
        "readinessProbe": {"exec": {"command": ["/bin/ready"]}}}]}}),
    );
    let (reason, m) = refusal(&exec_ready, &spec("web-0").build());
    assert_eq!(reason, EXEC_PROBE_DISABLED);
    assert!(m.starts_with("the pod's readiness probe"), "{m}");
    assert_migratable("tcp probe over exec readiness", &exec_ready, &s);
}

#[test]
fn exec_probes_never_run_in_the_operators_or_the_agents_namespace_even_when_enabled() {
    use podmotion_api::migration::{ApplicationProbe, ExecProbe};
    let on = Me {
        exec_probes: true,
        ..me()
    };
    let mut s = spec("web-0").build();
    s.probe = Some(ApplicationProbe {
        http_get: None,
        tcp_socket: None,
        grpc: None,
        exec: Some(ExecProbe {
            command: vec!["/bin/cat".into(), "/var/run/secrets/master-key".into()],
            container: None,
        }),
        timeout_seconds: 2,
        failure_threshold: 3,
    });
    for ns in ["podmotion-system", "podmotion-system-agents"] {
        let p = k8s(json!({"metadata": {"namespace": ns}}));
        let v = preflight(&s, &on, Some(&p), &three_nodes(), &[]);
        assert_eq!(
            verdict_reason(&v),
            reasons::PROTECTED_NAMESPACE,
            "{ns}: {v:?}"
        );
    }
    let tenant = k8s(json!({}));
    let v = preflight(&s, &on, Some(&tenant), &three_nodes(), &[]);
    assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
}

#[test]
fn leave_local_data_behind_lets_pod_scoped_volumes_through() {
    let p = k8s(json!({"spec": {"volumes": [
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        {"name": "logs", "hostPath": {"path": "/var/log/app"}},
        {"name": "cache", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]}}));
    assert_eq!(refusal(&p, &spec("web-0").build()).0, reasons::LOCAL_DATA);
    assert_migratable(
        "opted in",
        &p,
        &spec("web-0").leave_local_data_behind().build(),
    );
}

/// A pod PodMotion restored (its holder's init container and volume, its
/// container's command the holder) moves again: the agent dumps the workload the
/// holder holds.
#[test]
fn a_pod_podmotion_restored_is_migratable_again() {
    let p = k8s(json!({"spec": {
        "initContainers": [{"name": HOLDER_INSTALLER, "image": "agent:1"}],
        "containers": [{"name": "app", "command": ["/.podmotion/hold", "hold"]}],
        "volumes": [{"name": HOLDER_INSTALLER, "emptyDir": {"sizeLimit": "64Mi"}}]}}));
    assert_eq!(
        p.containers,
        ["app"],
        "the finished installer is no container"
    );
    assert_migratable("pod PodMotion restored", &p, &spec("web-0").build());
}

#[test]
fn the_holder_volume_alone_is_not_local_data() {
    // The volume PodMotion adds to a target pod, without its init container.
    let p = k8s(json!({"spec": {"volumes": [{"name": HOLDER_INSTALLER,
        "emptyDir": {"sizeLimit": "64Mi"}}]}}));
    assert!(p.local_volumes.is_empty(), "{:?}", p.local_volumes);
    assert_migratable("holder volume", &p, &spec("web-0").build());
}

#[test]
fn volumes_that_follow_the_pod_keep_it_migratable() {
    let p = k8s(json!({"spec": {"volumes": [
        {"name": "config", "configMap": {"name": "web"}},
        {"name": "creds", "secret": {"secretName": "web"}},
        {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}},
        {"name": "info", "downwardAPI": {"items": []}},
        {"name": "certs", "csi": {"driver": "secrets-store.csi.k8s.io", "readOnly": true}},
        {"name": "shared", "nfs": {"server": "nfs.example", "path": "/export"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "shared-data"}}]}}))
    .with_claims(&claims(&[("shared-data", &["ReadWriteMany"])]));
    assert_migratable("volumes that follow", &p, &spec("web-0").build());
}

#[test]
fn a_pod_of_several_containers_moves_unless_one_cannot_and_the_refusal_names_it() {
    let pre_copy = spec("web-0").build();
    let cold = spec("web-0").cold().build();
    let two = two_running(json!({"spec": {"containers": [
        {"name": "app", "image": "app:1"}, {"name": "proxy", "image": "proxy:1"}]}}));
    assert_eq!(two.containers, vec!["app", "proxy"]);
    assert_migratable("two containers, PreCopy", &two, &pre_copy);
    assert_migratable("two containers, Cold", &two, &cold);
    // A native sidecar, and a finished ordinary init container beside it.
    let sidecar = two_running(json!({"spec": {"initContainers": [
        {"name": "setup", "image": "app:1"},
        {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]}}));
    assert_eq!(sidecar.containers, vec!["app", "proxy"]);
    assert!(
        sidecar.not_running_containers.is_empty(),
        "{:?}",
        sidecar.not_running_containers
    );
    assert_migratable("native sidecar, PreCopy", &sidecar, &pre_copy);
    // PostCopy: every container is named, and what to use instead.
    let (r, m) = refusal(&sidecar, &spec("web-0").post_copy().build());
    assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
    assert!(m.contains("(app, proxy") && m.contains("PostCopy"), "{m}");
    // A container that does not run is named with what its status says.
    let waiting = k8s(json!({"spec": {"initContainers": [
        {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}]},
        "status": {"containerStatuses": [running("app")],
            "initContainerStatuses": [{"name": "proxy",
                "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}));
    let (r, m) = refusal(&waiting, &pre_copy);
    assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
    assert!(
        m.contains("container proxy is not running (waiting: CrashLoopBackOff)"),
        "{m}"
    );
    let unreported = k8s(json!({"spec": {"containers": [
        {"name": "app", "image": "app:1"}, {"name": "log", "image": "log:1"}]},
        "status": {"containerStatuses": [running("app")]}}));
    let (_, m) = refusal(&unreported, &cold);
    assert!(
        m.contains("container log is not running (no status reported yet)"),
        "{m}"
    );
    // More containers than the agents move at once.
    let many: Vec<Value> = (0..=MAX_CONTAINERS)
        .map(|i| json!({"name": format!("c{i}"), "image": "app:1"}))
        .collect();
    let statuses: Vec<Value> = (0..=MAX_CONTAINERS)
        .map(|i| running(&format!("c{i}")))
        .collect();
    let (r, m) = refusal(
        &k8s(json!({"spec": {"containers": many},
            "status": {"containerStatuses": statuses}})),
        &pre_copy,
    );
    assert_eq!(r, reasons::MULTIPLE_CONTAINERS);
    assert!(
        m.contains("17 containers") && m.contains("at most 16"),
        "{m}"
    );
    // One container: its status is the agent's to check, as before.
    assert_migratable("one container, no status", &k8s(json!({})), &pre_copy);
}

#[test]
fn hugepages_ephemeral_storage_and_native_init_containers_are_not_refused() {
    let p = k8s(json!({"spec": {
        "containers": [{"name": "app", "image": "app:1", "resources": {
            "requests": {"cpu": "100m", "memory": "64Mi", "hugepages-2Mi": "128Mi",
                "ephemeral-storage": "1Gi"},
            "limits": {"hugepages-1Gi": "1Gi", "memory": "128Mi"}}}],
        // An ordinary init container has finished: it is not a second container.
        "initContainers": [{"name": "migrate-db", "image": "app:1"}]}}));
    assert!(
        p.extended_resources.is_empty(),
        "{:?}",
        p.extended_resources
    );
    assert_eq!(p.containers, vec!["app"]);
    assert_migratable("hugepages", &p, &spec("web-0").build());
}

#[test]
fn a_newer_migration_of_the_same_pod_does_not_block_the_older_one() {
    let p = pod("web-0").on("n0").build();
    let newer = OtherMigration {
        name: "later".into(),
        pod_name: "web-0".into(),
        created: ts(200),
        terminal: false,
    };
    let finished = OtherMigration {
        name: "old".into(),
        pod_name: "web-0".into(),
        created: ts(1),
        terminal: true,
    };
    let v = preflight(
        &spec("web-0").build(),
        &me(),
        Some(&p),
        &three_nodes(),
        &[newer, finished],
    );
    assert_eq!(verdict_reason(&v), reasons::MIGRATABLE, "{v:?}");
}
