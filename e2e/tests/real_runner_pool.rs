//! RunnerPool on a real runner node (issue 17, the seed's R7 real-node rerun), through
//! the chart installed from our images: the operator renders the DaemonSet, the real
//! runner node (pm-real-2: kubelet, containerd, runc, labelled and tainted
//! podmotion.io/runner-node=real) runs it with our KVM device plugin and the Runner's
//! Localhost seccomp profile, the preflight init container checks the node under the
//! Runner's confinement, and the Runner container is our stand-in
//! (images/runner-standin), which probes the shape from inside the pod.
//!
//! Needs the cluster with a runner node (`hack/cluster.sh up`, REAL_RUNNER_NODES
//! defaults to 1; on a cluster started without it: `hack/cluster.sh add-runner-nodes`)
//! and the images pushed (`hack/images.sh`, whose list of printed images is
//! `$PODMOTION_IMAGES_LIST`, default `$PODMOTION_RUN/images.txt`).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use podmotion_api::RunnerPool;
use podmotion_api::conditions::{find, is_true};
use podmotion_api::names::{condition_types as ct, labels, reasons};
use podmotion_e2e::real::runner::{
    KVM, PROFILE, RUNNER_KEY, RUNNER_VALUE, RUNTIME, SESSIONS, pool_manifest, runner_nodes,
    standin_image,
};
use podmotion_e2e::real::{Images, helm_install, kubectl, output_text};
use podmotion_e2e::{
    PodSecurity, TestNamespace, delete_and_wait, from_json, kubectl_wait, pod_running_ready,
    random_suffix, wait_for, wait_list,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(300);
/// Label (and taint) of the real runner nodes (hack/lib/real-nodes.sh).
/// The stand-in's report: the first JSON line of its log (or of `report`'s output).
fn report_of(log: &str) -> Value {
    log.lines()
        .find_map(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .filter(|v| v["runner"] == "standin-v1")
        })
        .unwrap_or_else(|| panic!("no stand-in report in {log:?}"))
}

fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["checks"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no check {name} in {report}"))
}

fn logs(ns: &str, pod: &str, container: &str) -> String {
    let out = kubectl(&["-n", ns, "logs", pod, "-c", container]);
    assert!(out.status.success(), "kubectl logs: {}", output_text(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The live Runner pod's shape, field by field, against the seed's §Privilege shape.
fn assert_seed_shape(pod: &Pod, pool: &RunnerPool) {
    let spec = pod.spec.as_ref().expect("spec");
    let name = pod.name_any();
    assert_eq!(spec.host_users, Some(false), "{name}: hostUsers");
    for (what, on) in [
        ("hostNetwork", spec.host_network),
        ("hostPID", spec.host_pid),
        ("hostIPC", spec.host_ipc),
    ] {
        assert_ne!(on, Some(true), "{name}: {what}");
    }
    let psc = spec.security_context.as_ref().expect("pod securityContext");
    assert_eq!(psc.run_as_non_root, Some(true), "{name}: pod runAsNonRoot");
    // Exactly the two hostPaths, the session volume and the runtime dir.
    let mut host_paths: Vec<(String, String)> = spec
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| {
            v.host_path
                .as_ref()
                .map(|h| (h.path.clone(), h.type_.clone().unwrap_or_default()))
        })
        .collect();
    host_paths.sort();
    assert_eq!(
        host_paths,
        vec![
            (RUNTIME.to_string(), "DirectoryOrCreate".to_string()),
            (SESSIONS.to_string(), "Directory".to_string()),
        ],
        "{name}: hostPath volumes"
    );
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter());
    let mut seen = vec![];
    for c in containers {
        seen.push(c.name.clone());
        let sc = c
            .security_context
            .as_ref()
            .expect("container securityContext");
        let who = format!("{name}/{}", c.name);
        assert_ne!(sc.privileged, Some(true), "{who}: privileged");
        assert_eq!(sc.run_as_non_root, Some(true), "{who}: runAsNonRoot");
        assert_eq!(
            (sc.run_as_user, sc.run_as_group),
            (
                Some(pool.spec.runner_user.uid),
                Some(pool.spec.runner_user.gid)
            ),
            "{who}: uid/gid"
        );
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{who}");
        let caps = sc.capabilities.as_ref().expect("capabilities");
        assert_eq!(
            caps.drop.as_deref(),
            Some(&["ALL".to_string()][..]),
            "{who}"
        );
        assert!(
            caps.add.as_ref().is_none_or(|a| a.is_empty()),
            "{who}: add {caps:?}"
        );
        assert_eq!(
            sc.proc_mount.as_deref(),
            Some("Unmasked"),
            "{who}: procMount"
        );
        let seccomp = sc.seccomp_profile.as_ref().expect("seccompProfile");
        assert_eq!(
            (seccomp.type_.as_str(), seccomp.localhost_profile.as_deref()),
            ("Localhost", Some(PROFILE)),
            "{who}: seccomp"
        );
        let aa = sc.app_armor_profile.as_ref().expect("appArmorProfile");
        assert_eq!(aa.type_, "Unconfined", "{who}: AppArmor");
        let limits = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(
            limits.get(KVM).map(|q| q.0.as_str()),
            Some("1"),
            "{who}: {KVM}"
        );
        // No /dev mount and no runtime socket reaches the container.
        for m in c.volume_mounts.iter().flatten() {
            assert!(
                !m.mount_path.starts_with("/dev") && !m.mount_path.contains(".sock"),
                "{who}: mount {}",
                m.mount_path
            );
        }
    }
    assert_eq!(seen, vec!["preflight", "runner"], "{name}: containers");
}

/// A process of a pod on this machine (the e2e tests run on the nodes' machine).
#[derive(Debug, Clone, PartialEq, Eq)]
struct HostProcess {
    pid: u32,
    /// Field 22 of /proc/<pid>/stat: tells a reused PID from the same process.
    start_time: u64,
    cmdline: String,
}

fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command's closing parenthesis: state is field 3, starttime field 22.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Every live process whose cgroup is the pod's (`pod<uid>` in its path).
fn pod_processes(pod_uid: &str) -> Vec<HostProcess> {
    let needle = format!("pod{pod_uid}");
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if !cgroup.contains(&needle) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| {
                String::from_utf8_lossy(&b)
                    .replace('\0', " ")
                    .trim()
                    .to_string()
            })
            .unwrap_or_default();
        if let Some(start_time) = start_time(pid) {
            out.push(HostProcess {
                pid,
                start_time,
                cmdline,
            });
        }
    }
    out
}

fn alive(p: &HostProcess) -> bool {
    start_time(p.pid) == Some(p.start_time)
}

fn runner_restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "runner"))
        .map(|c| c.restart_count)
        .unwrap_or(0)
}

/// The pool, created Stalled by a preflight the real node fails (project quotas
/// required: the node's session tree is on ext4 without prjquota), reports that node and
/// check in its status; relaxed, it rolls out and becomes Ready with a Runner pod of the
/// seed's exact shape on the real runner node, whose preflight verdict passed every
/// check and whose Runner (the stand-in) opened /dev/kvm (KVM API 12), created a user
/// namespace and mounted a fresh /proc under the Localhost profile.
#[tokio::test]
async fn a_runner_pool_runs_the_seed_shape_on_the_real_runner_node() {
    let Some(op) = TestNamespace::new("rp-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = runner_nodes(&op.client).await else {
        return;
    };
    // hostPath needs the privileged level (docs/runner-pool.md).
    let Some(app) = TestNamespace::new("rp-app", PodSecurity::Privileged).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let standin = standin_image();
    let release = format!("pm{}", random_suffix());
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-runner-pool",
        &[],
    );

    // The Server's Service the pool's NetworkPolicy egress resolves (no Server runs:
    // the stand-in dials nothing).
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443}]}
    }));
    app.api::<Service>()
        .create(&PostParams::default(), &svc)
        .await
        .unwrap();

    let pools: Api<RunnerPool> = app.api();
    let name = "runners";
    pools
        .create(
            &PostParams::default(),
            &pool_manifest(
                name,
                &app.name,
                &standin,
                json!({"preflight": {"requireProjectQuota": true}}),
            ),
        )
        .await
        .unwrap();

    // 1. The node's preflight verdict lands in the status, per node.
    let stalled = wait_for(
        &pools,
        name,
        TIMEOUT,
        "the pool Stalled by preflight",
        |p| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| !s.preflight_failures.is_empty())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .expect("pool");
    let status = stalled.status.clone().unwrap();
    let failure = &status.preflight_failures[0];
    assert!(nodes.contains(&failure.node), "{failure:?} on {nodes:?}");
    assert_eq!(failure.checks, vec!["quota"], "{failure:?}");
    assert!(failure.message.contains("prjquota"), "{}", failure.message);
    let c = find(&status.conditions, ct::STALLED).expect("Stalled");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", reasons::PREFLIGHT_FAILED),
        "{c:?}"
    );
    assert!(c.message.contains(&failure.node), "{}", c.message);

    // 2. Relaxed (the local node has no project-quota filesystem), the pool rolls out.
    pools
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"preflight": {"requireProjectQuota": false}}})),
        )
        .await
        .unwrap();
    kubectl_wait(&app.name, &format!("runnerpool/{name}"), "Ready", TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let pool = pools.get(name).await.unwrap();
    let status = pool.status.clone().unwrap();
    assert!(status.preflight_failures.is_empty(), "{status:?}");
    // Every runner node's passing verdict is in the status, by node.
    assert_eq!(status.preflight_passed, nodes, "{status:?}");
    assert_eq!(
        (status.desired_nodes, status.ready_nodes),
        (nodes.len() as i32, nodes.len() as i32),
        "{status:?}"
    );
    assert!(
        is_true(&status.conditions, ct::SHAPE_CONFORMANT),
        "{status:?}"
    );
    assert!(!is_true(&status.conditions, ct::DEGRADED), "{status:?}");

    // 3. The live pods: one per runner node, Running and Ready, the seed's shape.
    let selector = format!("{}=runner,{}={name}", labels::NAME, labels::INSTANCE);
    let pods = wait_list(
        &app.api::<Pod>(),
        &selector,
        TIMEOUT,
        "Runner pods Ready",
        |ps| ps.len() == nodes.len() && ps.iter().all(pod_running_ready),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let mut on: Vec<String> = pods
        .iter()
        .map(|p| p.spec.as_ref().unwrap().node_name.clone().unwrap())
        .collect();
    on.sort();
    assert_eq!(on, nodes, "one Runner pod per runner node");
    for pod in &pods {
        assert_seed_shape(pod, &pool);
        let pname = pod.name_any();
        // The preflight's verdict, as the operator read it: every check passed,
        // including the ones proving the node honoured each field.
        let verdict = pod
            .status
            .as_ref()
            .and_then(|s| s.init_container_statuses.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.name == "preflight"))
            .and_then(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone())
            .unwrap_or_else(|| panic!("{pname}: no preflight termination message"));
        let verdict: Value = serde_json::from_str(verdict.trim()).expect("verdict JSON");
        assert_eq!(verdict["ok"], true, "{verdict}");
        for field in [
            "kvm",
            "userns",
            "hostUsers",
            "procMount",
            "seccompProfile",
            "capabilities",
        ] {
            assert_eq!(check(&verdict, field)["ok"], true, "{field}: {verdict}");
        }
        // The Runner stand-in's own probes, from its log.
        let report = report_of(&logs(&app.name, &pname, "runner"));
        assert_eq!(report["ok"], true, "{report}");
        let kvm = check(&report, "kvm");
        assert!(
            kvm["ok"] == true
                && kvm["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("KVM_GET_API_VERSION 12")),
            "{kvm}"
        );
        assert_eq!(report["facts"]["kvm_api_version"], 12, "{report}");
        for probe in [
            "userns",
            "procMount",
            "hostUsers",
            "seccompProfile",
            "capabilities",
        ] {
            assert_eq!(check(&report, probe)["ok"], true, "{probe}: {report}");
        }
        // Under hostUsers: false the host's root owner of /dev/kvm is outside the
        // pod's mapping: it shows as the overflow ids; access comes from mode 0666.
        assert_eq!(report["facts"]["kvm_owner"], "65534:65534", "{report}");
        assert_eq!(report["facts"]["kvm_mode"], "0666", "{report}");
        assert_eq!(report["facts"]["ids"], "10001:10001", "{report}");
        let uid_map = report["facts"]["uid_map"].as_str().unwrap_or_default();
        assert!(
            !uid_map.is_empty() && !uid_map.starts_with("0 0 "),
            "uid_map {uid_map:?}"
        );
        assert!(
            report["facts"]["token_file"]
                .as_str()
                .is_some_and(|t| t.contains("readable")),
            "{report}"
        );
        // The same probes, run again by `kubectl exec` in the live container.
        let out = kubectl(&[
            "-n",
            &app.name,
            "exec",
            &pname,
            "-c",
            "runner",
            "--",
            "/usr/local/bin/podmotion-runner-standin",
            "report",
        ]);
        assert!(out.status.success(), "exec report: {}", output_text(&out));
        let again = report_of(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(again["ok"], true, "{again}");
    }

    // 4. R7 question 6: a container restart leaves no stranded session process. The
    //    stand-in runs one child per session in a user namespace of its own (passt's
    //    pattern); its PID 1 is killed on the node and the kubelet restarts it.
    let pod = &pods[0];
    let uid = pod.metadata.uid.clone().unwrap();
    let before = pod_processes(&uid);
    let sessions: Vec<HostProcess> = before
        .iter()
        .filter(|p| p.cmdline.ends_with("--internal-session"))
        .cloned()
        .collect();
    assert_eq!(
        sessions.len(),
        1,
        "one session child per session: {before:?}"
    );
    let pid1: Vec<&HostProcess> = before
        .iter()
        .filter(|p| p.cmdline == "/usr/local/bin/podmotion-runner-standin")
        .collect();
    assert_eq!(pid1.len(), 1, "the Runner's PID 1: {before:?}");
    let restarts = runner_restarts(pod);
    let out = std::process::Command::new("kill")
        .args(["-KILL", &pid1[0].pid.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "kill: {}", output_text(&out));
    let pname = pod.name_any();
    wait_for(
        &app.api::<Pod>(),
        &pname,
        TIMEOUT,
        "the Runner restarted and Ready",
        |p| p.is_some_and(|p| runner_restarts(p) > restarts && pod_running_ready(p)),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let stranded: Vec<&HostProcess> = sessions.iter().filter(|p| alive(p)).collect();
    assert!(
        stranded.is_empty(),
        "stranded after the restart: {stranded:?}"
    );
    let after: Vec<HostProcess> = pod_processes(&uid)
        .into_iter()
        .filter(|p| p.cmdline.ends_with("--internal-session"))
        .collect();
    assert_eq!(
        after.len(),
        1,
        "the restarted Runner's session child: {after:?}"
    );
    eprintln!(
        "R7 Q6: killed the Runner's PID 1 (host pid {}); session child {:?} gone, new one {:?}",
        pid1[0].pid, sessions, after
    );

    delete_and_wait(&pools, name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
}

/// One pod running the stand-in's `report` on the runner node, with the seed's shape
/// changed by `alter`; its report.
async fn probe_pod(
    ns: &TestNamespace,
    name: &str,
    node: &str,
    image: &str,
    alter: impl Fn(&mut Value),
) -> Value {
    let mut pod = json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "tolerations": [{"key": RUNNER_KEY, "operator": "Equal", "value": RUNNER_VALUE, "effect": "NoSchedule"}],
            "hostUsers": false, "restartPolicy": "Never",
            "automountServiceAccountToken": false, "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 10001, "runAsGroup": 10001},
            "containers": [{
                "name": "runner", "image": image, "args": ["report"],
                "resources": {"limits": {"cpu": "100m", "memory": "32Mi", KVM: "1"}},
                "securityContext": {
                    "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]},
                    "procMount": "Unmasked",
                    "seccompProfile": {"type": "Localhost", "localhostProfile": PROFILE},
                    "appArmorProfile": {"type": "Unconfined"},
                },
            }],
        }
    });
    alter(&mut pod["spec"]);
    let pods: Api<Pod> = ns.api();
    pods.create(&PostParams::default(), &from_json(pod))
        .await
        .unwrap();
    wait_for(&pods, name, TIMEOUT, "the probe pod to finish", |p| {
        p.and_then(|p| p.status.as_ref())
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|ph| ph == "Succeeded" || ph == "Failed")
    })
    .await
    .unwrap_or_else(|e| panic!("{name}: {e:#}"));
    report_of(&logs(&ns.name, name, "runner"))
}

/// The seed's R7 controls on the real runner node, each one field away from the shape:
/// a raw hostPath /dev/kvm without the device plugin fails open() (EPERM from the device
/// cgroup, although the node's device is mode 0666); RuntimeDefault seccomp fails the
/// user namespace (EPERM, passt's "Couldn't create user namespace"); procMount Default
/// fails the fresh /proc. The shape itself passes all three.
#[tokio::test]
async fn one_field_away_from_the_shape_the_runner_loses_what_the_seed_says() {
    let Some(ns) = TestNamespace::new("rp-r7", PodSecurity::Privileged).await else {
        return;
    };
    let Some(nodes) = runner_nodes(&ns.client).await else {
        return;
    };
    let node = &nodes[0];
    let image = standin_image();

    let shape = probe_pod(&ns, "shape", node, &image, |_| {}).await;
    for probe in [
        "kvm",
        "userns",
        "procMount",
        "hostUsers",
        "seccompProfile",
        "capabilities",
    ] {
        assert_eq!(check(&shape, probe)["ok"], true, "{probe}: {shape}");
    }

    let raw = probe_pod(&ns, "hostpath-kvm", node, &image, |spec| {
        let c = &mut spec["containers"][0];
        c["resources"]["limits"]
            .as_object_mut()
            .unwrap()
            .remove(KVM);
        c["volumeMounts"] = json!([{"name": "kvm", "mountPath": "/dev/kvm"}]);
        spec["volumes"] =
            json!([{"name": "kvm", "hostPath": {"path": "/dev/kvm", "type": "CharDevice"}}]);
    })
    .await;
    let kvm = check(&raw, "kvm");
    assert_eq!(kvm["ok"], false, "{raw}");
    assert!(
        kvm["detail"]
            .as_str()
            .is_some_and(|d| d.contains("Operation not permitted")),
        "{kvm}"
    );
    assert_eq!(raw["facts"]["kvm_mode"], "0666", "{raw}");

    let rd = probe_pod(&ns, "runtime-default", node, &image, |spec| {
        spec["containers"][0]["securityContext"]["seccompProfile"] =
            json!({"type": "RuntimeDefault"});
    })
    .await;
    let userns = check(&rd, "userns");
    assert_eq!(userns["ok"], false, "{rd}");
    assert!(
        userns["detail"]
            .as_str()
            .is_some_and(|d| d.contains("EPERM")),
        "{userns}"
    );
    assert_eq!(check(&rd, "kvm")["ok"], true, "{rd}");

    let masked = probe_pod(&ns, "proc-default", node, &image, |spec| {
        spec["containers"][0]["securityContext"]["procMount"] = json!("Default");
    })
    .await;
    assert_eq!(check(&masked, "procMount")["ok"], false, "{masked}");
    assert_eq!(check(&masked, "userns")["ok"], true, "{masked}");
}
