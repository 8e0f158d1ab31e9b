//! The design record's R3 and R4 test cycles, item by item, the contract
//! items, and the absence of everything on the "explicitly absent" list. Each test
//! asserts on the rendered typed objects, so dropping any item from the renderer
//! fails a test by name.

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, PodSpec, SecurityContext};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use podmotion_api::names::{annotations, labels};

use super::drift::forbidden_items;
use super::fixtures::{IMAGE, PREFLIGHT_IMAGE, inputs, pool};
use super::render::*;
use super::sizing::pod_size;
use super::{Desired, Inputs, render};

fn desired() -> Desired {
    render(&pool("rp").build(), &inputs())
}
fn pod_of(ds: &DaemonSet) -> PodSpec {
    ds.spec.template.spec.clone().unwrap()
}
fn pod() -> PodSpec {
    pod_of(&desired().daemonset)
}
fn runner(p: &PodSpec) -> &Container {
    p.containers
        .iter()
        .find(|c| c.name == RUNNER_CONTAINER)
        .expect("runner container")
}
fn every_container(p: &PodSpec) -> Vec<&Container> {
    p.init_containers
        .iter()
        .flatten()
        .chain(p.containers.iter())
        .collect()
}
fn sc(c: &Container) -> &SecurityContext {
    c.security_context.as_ref().expect("securityContext")
}

// ---- R3: the full privilege shape ----

#[test]
fn r3_no_container_is_privileged() {
    let p = pod();
    for c in every_container(&p) {
        assert_ne!(sc(c).privileged, Some(true), "{}", c.name);
    }
}

#[test]
fn r3_every_container_drops_all_capabilities_and_adds_none() {
    let p = pod();
    for c in every_container(&p) {
        let caps = sc(c).capabilities.as_ref().expect("capabilities");
        assert_eq!(
            caps.drop.as_deref(),
            Some(&["ALL".to_string()][..]),
            "{}",
            c.name
        );
        assert!(caps.add.as_ref().is_none_or(Vec::is_empty), "{}", c.name);
    }
}

#[test]
fn r3_runs_as_non_root_with_the_fixed_uid_and_gid() {
    let rp = pool("rp").build();
    let p = pod_of(&render(&rp, &inputs()).daemonset);
    for c in every_container(&p) {
        let s = sc(c);
        assert_eq!(s.run_as_non_root, Some(true), "{}", c.name);
        assert_eq!(s.run_as_user, Some(rp.spec.runner_user.uid), "{}", c.name);
        assert_eq!(s.run_as_group, Some(rp.spec.runner_user.gid), "{}", c.name);
        assert_eq!(s.allow_privilege_escalation, Some(false), "{}", c.name);
        assert_ne!(s.run_as_user, Some(0));
    }
    let ps = p.security_context.as_ref().unwrap();
    assert_eq!(
        (ps.run_as_non_root, ps.run_as_user),
        (Some(true), Some(rp.spec.runner_user.uid))
    );
}

#[test]
fn r3_pod_is_user_namespaced() {
    assert_eq!(pod().host_users, Some(false));
}

#[test]
fn r3_proc_mount_is_unmasked() {
    assert_eq!(sc(runner(&pod())).proc_mount.as_deref(), Some("Unmasked"));
}

#[test]
fn r3_apparmor_profile_is_unconfined() {
    let p = pod();
    let aa = sc(runner(&p))
        .app_armor_profile
        .as_ref()
        .expect("appArmorProfile");
    assert_eq!(aa.type_, "Unconfined");
}

#[test]
fn r3_kvm_device_resource_is_requested_in_limits() {
    let p = pod();
    let limits = runner(&p)
        .resources
        .as_ref()
        .unwrap()
        .limits
        .clone()
        .unwrap();
    assert_eq!(
        limits.get("devices.kubevirt.io/kvm").map(|q| q.0.as_str()),
        Some("1")
    );
}

#[test]
fn r3_seccomp_references_the_localhost_profile() {
    let rp = pool("rp").build();
    let p = pod_of(&render(&rp, &inputs()).daemonset);
    for c in every_container(&p) {
        let s = sc(c).seccomp_profile.as_ref().expect("seccompProfile");
        assert_eq!(s.type_, "Localhost", "{}", c.name);
        assert_eq!(
            s.localhost_profile.as_deref(),
            Some(rp.spec.seccomp_profile.as_str())
        );
    }
}

#[test]
fn r3_exactly_two_host_path_mounts_session_volume_and_runtime_dir() {
    let rp = pool("rp").build();
    let p = pod_of(&render(&rp, &inputs()).daemonset);
    let hp: Vec<_> = p
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.host_path.as_ref().map(|h| (v.name.clone(), h.clone())))
        .collect();
    assert_eq!(hp.len(), 2, "{hp:?}");
    assert_eq!(hp[0].0, SESSIONS_VOLUME);
    assert_eq!(hp[0].1.path, rp.spec.host_paths.session_volume);
    assert_eq!(hp[0].1.type_.as_deref(), Some("Directory"));
    assert_eq!(hp[1].0, RUNTIME_VOLUME);
    assert_eq!(hp[1].1.path, rp.spec.host_paths.runtime_dir);
    let mounts: Vec<_> = runner(&p)
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| (m.name.as_str(), m.read_only))
        .collect();
    assert!(
        mounts.contains(&(SESSIONS_VOLUME, None)),
        "session volume is read-write: {mounts:?}"
    );
    assert!(
        mounts.contains(&(RUNTIME_VOLUME, None)),
        "runtime dir is read-write: {mounts:?}"
    );
}

#[test]
fn r3_requests_equal_limits_and_are_sized_to_the_session_capacity() {
    for sessions in [1, 4, 16] {
        let rp = pool("rp").sessions(sessions).guest(8192, 2000).build();
        let p = pod_of(&render(&rp, &inputs()).daemonset);
        let r = runner(&p).resources.clone().unwrap();
        let size = pod_size(&rp.spec);
        let (req, lim) = (r.requests.unwrap(), r.limits.unwrap());
        assert_eq!(req, lim, "Guaranteed QoS needs requests = limits");
        assert_eq!(req["memory"].0, format!("{}Mi", size.memory_mib));
        assert_eq!(req["cpu"].0, format!("{}m", size.milli_cpu));
        assert!(
            size.memory_mib >= i64::from(sessions) * 8192,
            "memory covers the aggregate guest RAM"
        );
        for c in every_container(&p) {
            let r = c.resources.clone().unwrap();
            assert_eq!(
                r.requests, r.limits,
                "{}: every container Guaranteed",
                c.name
            );
        }
    }
}

#[test]
fn r3_max_unavailable_is_bounded_and_never_all_nodes() {
    let ds = desired().daemonset;
    let ru = ds.spec.update_strategy.unwrap();
    assert_eq!(ru.type_.as_deref(), Some("RollingUpdate"));
    let ru = ru.rolling_update.unwrap();
    assert_eq!(ru.max_unavailable, Some(IntOrString::Int(1)));
    assert_eq!(ru.max_surge, Some(IntOrString::Int(0)));
    // A count as large as the fleet is capped at N-1 (3 eligible nodes -> 2).
    let big = pool("rp").max_unavailable(IntOrString::Int(50)).build();
    assert_eq!(effective_max_unavailable(&big, 3), IntOrString::Int(2));
    assert_eq!(effective_max_unavailable(&big, 1), IntOrString::Int(1));
    assert_eq!(effective_max_unavailable(&big, 0), IntOrString::Int(1));
    let pct = pool("rp")
        .max_unavailable(IntOrString::String("25%".into()))
        .build();
    assert_eq!(
        effective_max_unavailable(&pct, 8),
        IntOrString::String("25%".into())
    );
}

// ---- R4: device-plugin delivery ----

#[test]
fn r4_pod_requests_the_configured_device_resource_with_user_namespaces_and_unmasked_proc() {
    let mut rp = pool("rp").build();
    rp.spec.kvm_resource_name = "devices.example.com/kvm".into();
    let p = pod_of(&render(&rp, &inputs()).daemonset);
    let r = runner(&p).resources.clone().unwrap();
    assert_eq!(
        r.limits
            .unwrap()
            .get("devices.example.com/kvm")
            .map(|q| q.0.clone()),
        Some("1".into())
    );
    assert!(
        !r.requests.unwrap().contains_key("devices.kubevirt.io/kvm"),
        "the default name must not leak"
    );
    assert_eq!(p.host_users, Some(false));
    assert_eq!(sc(runner(&p)).proc_mount.as_deref(), Some("Unmasked"));
}

#[test]
fn r4_device_arrives_through_the_plugin_never_a_dev_mount_or_a_kvm_group() {
    let p = pod();
    assert!(p.volumes.iter().flatten().all(|v| {
        v.host_path
            .as_ref()
            .is_none_or(|h| !h.path.starts_with("/dev"))
    }));
    for c in every_container(&p) {
        assert!(
            c.volume_mounts
                .iter()
                .flatten()
                .all(|m| !m.mount_path.starts_with("/dev")),
            "{}",
            c.name
        );
    }
    // The host kvm gid is outside the pod's id mapping: the grant is dropped.
    assert!(p.security_context.unwrap().supplemental_groups.is_none());
}

// ---- Explicitly absent ----

#[test]
fn nothing_from_the_explicitly_absent_list_is_rendered() {
    let p = pod();
    assert_eq!(forbidden_items(&p), Vec::<String>::new());
    assert_ne!(p.host_network, Some(true));
    assert_ne!(p.host_pid, Some(true));
    assert_ne!(p.host_ipc, Some(true));
    assert_ne!(p.share_process_namespace, Some(true));
    let json = serde_json::to_string(&p).unwrap();
    for needle in [
        "containerd",
        "crio",
        "docker.sock",
        ".sock",
        "\"privileged\":true",
        "hostPort",
        "SYS_ADMIN",
    ] {
        assert!(!json.contains(needle), "rendered pod contains {needle:?}");
    }
}

#[test]
fn the_forbidden_audit_can_fail() {
    let mut p = pod();
    p.host_pid = Some(true);
    p.containers[0]
        .security_context
        .as_mut()
        .unwrap()
        .privileged = Some(true);
    let found = forbidden_items(&p);
    assert!(found.iter().any(|f| f.contains("hostPID")));
    assert!(found.iter().any(|f| f.contains("privileged")));
}

// ---- The rest of the object contract ----

#[test]
fn node_selector_and_matching_toleration() {
    let p = pod();
    assert_eq!(
        p.node_selector
            .unwrap()
            .get(labels::RUNNER_NODE)
            .map(String::as_str),
        Some("true")
    );
    let t = &p.tolerations.unwrap()[0];
    assert_eq!(
        (
            t.key.as_deref(),
            t.operator.as_deref(),
            t.value.as_deref(),
            t.effect.as_deref()
        ),
        (
            Some(labels::RUNNER_NODE),
            Some("Equal"),
            Some("true"),
            Some("NoSchedule")
        )
    );
    let custom = pool("rp").node_label("example.com/pool", "compass").build();
    let p = pod_of(&render(&custom, &inputs()).daemonset);
    assert_eq!(
        p.node_selector
            .unwrap()
            .get("example.com/pool")
            .map(String::as_str),
        Some("compass")
    );
    assert_eq!(
        p.tolerations.unwrap()[0].key.as_deref(),
        Some("example.com/pool"),
        "taint key follows the label"
    );
}

#[test]
fn node_name_comes_from_the_downward_api() {
    let p = pod();
    let env = runner(&p).env.clone().unwrap();
    let n = env
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    assert_eq!(
        n.value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "spec.nodeName"
    );
}

#[test]
fn pods_carry_the_scrape_annotations() {
    let ds = desired().daemonset;
    let a = ds.spec.template.metadata.unwrap().annotations.unwrap();
    assert_eq!(a[annotations::PROMETHEUS_SCRAPE], "true");
    assert_eq!(a[annotations::PROMETHEUS_PORT], "9090");
    assert_eq!(a[annotations::PROMETHEUS_PATH], "/metrics");
}

#[test]
fn readiness_probe_is_present_and_liveness_absent_by_default() {
    let p = pod();
    let r = runner(&p);
    let rp = r.readiness_probe.as_ref().expect("readiness");
    assert_eq!(
        rp.http_get.as_ref().unwrap().path.as_deref(),
        Some("/readyz")
    );
    assert!(r.liveness_probe.is_none());
}

#[test]
fn a_configured_liveness_probe_keeps_its_generous_window() {
    let p = pod_of(&render(&pool("rp").liveness(60, 10).build(), &inputs()).daemonset);
    let l = runner(&p).liveness_probe.clone().expect("liveness");
    assert_eq!(
        (l.period_seconds, l.failure_threshold),
        (Some(60), Some(10))
    );
    assert!(
        l.period_seconds.unwrap() * l.failure_threshold.unwrap()
            >= podmotion_api::runner_pool::LIVENESS_FLOOR_SECONDS
    );
}

#[test]
fn grace_period_is_reap_budget_times_capacity_plus_margin() {
    let p = pod_of(&render(&pool("rp").sessions(5).reap_budget(20).build(), &inputs()).daemonset);
    assert_eq!(p.termination_grace_period_seconds, Some(5 * 20 + 30));
}

#[test]
fn pods_use_the_priority_class_and_it_is_created_when_asked() {
    let d = desired();
    assert_eq!(
        pod_of(&d.daemonset).priority_class_name.as_deref(),
        Some("podmotion-runner")
    );
    let pc = d.priority_class.expect("created");
    assert_eq!(pc.value, Some(1_000_000));
    assert_eq!(pc.global_default, Some(false));
    assert!(
        pc.metadata.owner_references.is_none(),
        "cluster-scoped: cleaned by finalizer"
    );
    assert_eq!(pc.metadata.labels.unwrap()[labels::OWNER], "runners.rp");
    let referenced = render(
        &pool("rp").reference_priority_class("existing").build(),
        &inputs(),
    );
    assert!(referenced.priority_class.is_none());
    assert_eq!(
        pod_of(&referenced.daemonset).priority_class_name.as_deref(),
        Some("existing")
    );
}

#[test]
fn service_account_does_not_automount_a_token() {
    let d = desired();
    assert_eq!(
        d.service_account.automount_service_account_token,
        Some(false)
    );
    let p = pod_of(&d.daemonset);
    assert_eq!(p.automount_service_account_token, Some(false));
    assert_eq!(p.service_account_name.as_deref(), Some("rp"));
}

#[test]
fn the_token_is_a_mounted_file_never_an_env_value() {
    let d = desired();
    let secret = d.secret.expect("generated secret");
    assert_eq!(secret.metadata.name.as_deref(), Some("rp-credentials"));
    assert_eq!(secret.data.unwrap()["token"].0, b"s3cr3t-token");
    let p = pod_of(&d.daemonset);
    let vol = p
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == CREDENTIALS_VOLUME)
        .unwrap();
    assert_eq!(
        vol.secret.as_ref().unwrap().secret_name.as_deref(),
        Some("rp-credentials")
    );
    let r = runner(&p);
    let env = r.env.clone().unwrap();
    assert!(env.iter().all(|e| {
        e.value_from
            .as_ref()
            .is_none_or(|v| v.secret_key_ref.is_none())
    }));
    assert!(!serde_json::to_string(&env).unwrap().contains("s3cr3t"));
    assert!(env.iter().any(|e| e.name == "COMPASS_TOKEN_FILE"
        && e.value.as_deref() == Some("/var/run/secrets/compass/token")));
    assert!(
        r.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == CREDENTIALS_VOLUME && m.read_only == Some(true))
    );
}

#[test]
fn a_referenced_secret_is_mounted_and_none_is_generated() {
    let d = render(
        &pool("rp").secret("my-token").build(),
        &Inputs {
            credential_token: None,
            ..inputs()
        },
    );
    assert!(d.secret.is_none());
    let p = pod_of(&d.daemonset);
    let vol = p
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == CREDENTIALS_VOLUME)
        .unwrap();
    assert_eq!(
        vol.secret.as_ref().unwrap().secret_name.as_deref(),
        Some("my-token")
    );
}

#[test]
fn every_child_has_owner_labels_and_a_controller_reference() {
    let d = desired();
    let metas = [
        d.daemonset.metadata.clone(),
        d.service_account.metadata.clone(),
        d.secret.clone().unwrap().metadata,
        d.network_policy.metadata.clone(),
        d.pdb.metadata.clone(),
    ];
    for m in metas {
        let refs = m.owner_references.clone().unwrap_or_default();
        assert_eq!(refs.len(), 1, "{:?}", m.name);
        assert_eq!(refs[0].kind, "RunnerPool");
        assert_eq!(refs[0].controller, Some(true));
        assert_eq!(m.labels.unwrap()[labels::MANAGED_BY], "podmotion");
    }
}

#[test]
fn image_is_the_pinned_digest_and_preflight_defaults_to_the_operators_image() {
    let p = pod();
    assert_eq!(runner(&p).image.as_deref(), Some(IMAGE));
    let pf = &p.init_containers.as_ref().unwrap()[0];
    assert_eq!(pf.name, PREFLIGHT_CONTAINER);
    assert_eq!(pf.image.as_deref(), Some(PREFLIGHT_IMAGE));
    assert_eq!(
        pf.termination_message_policy.as_deref(),
        Some("FallbackToLogsOnError")
    );
    assert_eq!(
        sc(pf),
        sc(runner(&p)),
        "preflight tests the node under the Runner's exact confinement"
    );
}

#[test]
fn preflight_logs_in_the_operators_format_and_the_runner_is_left_alone() {
    let format_of = |p: &PodSpec, name: &str| -> Option<String> {
        every_container(p)
            .into_iter()
            .find(|c| c.name == name)?
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "PODMOTION_LOG_FORMAT")?
            .value
            .clone()
    };
    let p = pod();
    assert_eq!(format_of(&p, PREFLIGHT_CONTAINER).as_deref(), Some("json"));
    let text = pod_of(
        &render(
            &pool("rp").build(),
            &Inputs {
                log_format: podmotion_log::LogFormat::Text,
                ..inputs()
            },
        )
        .daemonset,
    );
    assert_eq!(
        format_of(&text, PREFLIGHT_CONTAINER).as_deref(),
        Some("text")
    );
    // The Runner is the user's image: PodMotion's log setting is not its business.
    assert_eq!(format_of(&text, runner(&text).name.as_str()), None);
}

#[test]
fn pdb_bounds_evictions_like_the_rollout() {
    // 3 eligible nodes, maxUnavailable 1: at least 2 Runners must stay.
    let pdb = desired().pdb.spec.unwrap();
    assert_eq!(pdb.min_available, Some(IntOrString::Int(2)));
    assert!(
        pdb.max_unavailable.is_none(),
        "DaemonSet pods support only an integer minAvailable"
    );
    assert_eq!(
        pdb.unhealthy_pod_eviction_policy.as_deref(),
        Some("AlwaysAllow")
    );
    let pct = pool("rp")
        .max_unavailable(IntOrString::String("25%".into()))
        .build();
    assert_eq!(pdb_min_available(&pct, 8), 6);
    assert_eq!(pdb_min_available(&pct, 0), 0);
    assert_eq!(
        pdb.selector.unwrap().match_labels.unwrap()[labels::INSTANCE],
        "rp"
    );
}

// ---- NetworkPolicy ----

#[test]
fn network_policy_allows_only_metrics_ingress_from_the_scrape_namespace() {
    let np = desired().network_policy.spec.unwrap();
    assert_eq!(np.policy_types.unwrap(), vec!["Ingress", "Egress"]);
    let ingress = np.ingress.unwrap();
    assert_eq!(ingress.len(), 1);
    let from = ingress[0].from.clone().unwrap();
    assert_eq!(from.len(), 1);
    let ns = from[0]
        .namespace_selector
        .clone()
        .unwrap()
        .match_labels
        .unwrap();
    assert_eq!(ns["kubernetes.io/metadata.name"], "monitoring");
    assert!(from[0].ip_block.is_none());
    let ports = ingress[0].ports.clone().unwrap();
    assert_eq!(ports.len(), 1);
    assert_eq!(ports[0].port, Some(IntOrString::Int(9090)));
}

#[test]
fn network_policy_egress_is_dns_the_server_and_the_public_internet_only() {
    let egress = desired().network_policy.spec.unwrap().egress.unwrap();
    assert_eq!(egress.len(), 3);
    let dns = &egress[0];
    assert_eq!(
        dns.ports
            .as_ref()
            .unwrap()
            .iter()
            .map(|p| p.port.clone().unwrap())
            .collect::<Vec<_>>(),
        vec![IntOrString::Int(53); 2]
    );
    let server = &egress[1];
    let to = &server.to.as_ref().unwrap()[0];
    assert_eq!(
        to.namespace_selector.clone().unwrap().match_labels.unwrap()["kubernetes.io/metadata.name"],
        "compass"
    );
    assert_eq!(
        to.pod_selector.clone().unwrap().match_labels.unwrap()["app"],
        "compass-server"
    );
    assert_eq!(
        server.ports.as_ref().unwrap()[0].port,
        Some(IntOrString::Int(9443)),
        "the Service's targetPort"
    );
    let internet = egress[2].to.clone().unwrap();
    let v4 = internet[0].ip_block.clone().unwrap();
    assert_eq!(v4.cidr, "0.0.0.0/0");
    let except = v4.except.unwrap();
    for r in [
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "100.64.0.0/10",
        "169.254.0.0/16",
        "127.0.0.0/8",
    ] {
        assert!(except.iter().any(|e| e == r), "{r} not excluded");
    }
    let v6 = internet[1].ip_block.clone().unwrap();
    assert_eq!(v6.cidr, "::/0");
    for r in ["fc00::/7", "fe80::/10"] {
        assert!(
            v6.except.as_ref().unwrap().iter().any(|e| e == r),
            "{r} not excluded"
        );
    }
}

#[test]
fn an_unresolved_server_gets_no_in_cluster_egress() {
    let np = render(
        &pool("rp").build(),
        &Inputs {
            server: None,
            ..inputs()
        },
    )
    .network_policy;
    let egress = np.spec.unwrap().egress.unwrap();
    assert_eq!(egress.len(), 2);
    assert!(
        egress.iter().all(|e| e
            .to
            .as_ref()
            .unwrap()
            .iter()
            .all(|p| p.pod_selector.is_none()
                || p.namespace_selector
                    .as_ref()
                    .unwrap()
                    .match_labels
                    .as_ref()
                    .unwrap()["kubernetes.io/metadata.name"]
                    == "kube-system"))
    );
}

#[test]
fn the_runner_is_told_the_servers_address() {
    let p = pod_of(&render(&pool("rp").server_in_own_namespace().build(), &inputs()).daemonset);
    let env = runner(&p).env.clone().unwrap();
    let addr = env
        .iter()
        .find(|e| e.name == "COMPASS_SERVER_ADDR")
        .unwrap();
    assert_eq!(
        addr.value.as_deref(),
        Some("compass-server.runners.svc:8443")
    );
}

#[test]
fn changing_capacity_changes_only_the_sizing_fields_of_the_template() {
    let a = render(&pool("rp").sessions(2).build(), &inputs()).daemonset;
    let b = render(&pool("rp").sessions(3).build(), &inputs()).daemonset;
    let drift = super::drift::shape_drift(&a, &b);
    assert!(!drift.is_empty());
    assert!(
        drift.iter().all(|d| d.contains(".resources.")
            || d.contains("COMPASS_SESSIONS")
            || d.contains("terminationGracePeriodSeconds")),
        "{drift:#?}"
    );
}
