//! The Helm chart (`charts/podmotion`): lint, rendering rules (restricted operator pod,
//! only the broker privileged, RBAC without wildcards or cluster-wide Secret reads, CRDs
//! identical to `crds/` and kept on uninstall, a value for every operator flag, the
//! values schema), then against the local control plane: the rendered chart is admitted
//! by server-side dry-run and for real with the operator's namespace enforcing
//! `restricted` and the agents' namespace `privileged`; RBAC is proven with
//! `kubectl auth can-i --as=system:serviceaccount:…`; `kubectl wait --for=condition=Ready`
//! and the printer columns are checked on the real API server.
//!
//! Needs `helm` (hack/build-helm.sh, called by hack/install-deps.sh): the tests fail
//! without it. The cluster tests need `hack/cluster.sh up` (or `PODMOTION_E2E=0`).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use podmotion_e2e::real::{Uninstall, helm as helm_cmd};
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, kubeconfig_path, kubectl_path, pod_phase, random_suffix,
    repo_root, wait_for, wait_list,
};
use serde_json::{Value, json};

fn chart_dir() -> PathBuf {
    repo_root().join("charts/podmotion")
}

/// Our helm (built from its Go module); the tests fail when it is missing.
fn helm() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join("hack/build-helm.sh"))
        .arg("--print")
        .output()
        .expect("running hack/build-helm.sh --print");
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        path.is_file(),
        "helm not found at {}; run hack/build-helm.sh (hack/install-deps.sh does)",
        path.display()
    );
    path
}

fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm template <release> charts/podmotion -n <namespace> <args…>`.
fn try_render(release: &str, namespace: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm())
        .args(["template", release])
        .arg(chart_dir())
        .args(["--namespace", namespace])
        .args(args)
        .output()
        .expect("running helm");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(output_text(&out))
    }
}

/// `extra` after the Prometheus Operator's kinds, each as `helm install` (and Argo
/// CD) tell a chart the cluster serves it: `monitoring.coreos.com/v1/<Kind>`.
fn prometheus_api<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--api-versions", "monitoring.coreos.com/v1"];
    for kind in [
        "monitoring.coreos.com/v1/ServiceMonitor",
        "monitoring.coreos.com/v1/PodMonitor",
        "monitoring.coreos.com/v1/PrometheusRule",
    ] {
        args.extend(["--api-versions", kind]);
    }
    args.extend_from_slice(extra);
    args
}

fn render(args: &[&str]) -> Vec<Value> {
    let text = try_render("pm", "podmotion-system", args)
        .unwrap_or_else(|e| panic!("helm template {args:?}: {e}"));
    parse_docs(&text)
}

fn parse_docs(text: &str) -> Vec<Value> {
    let docs: Vec<Value> = serde_saphyr::from_multiple(text)
        .unwrap_or_else(|e| panic!("rendered chart is not YAML: {e}\n{text}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

fn name(d: &Value) -> &str {
    d["metadata"]["name"].as_str().unwrap_or("")
}

fn is_hook(d: &Value) -> bool {
    d.pointer("/metadata/annotations/helm.sh~1hook").is_some()
}

/// Pod templates of the workloads: (workload kind/name, namespace, pod spec).
fn pod_specs(docs: &[Value]) -> Vec<(String, String, Value)> {
    docs.iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Deployment" | "DaemonSet" | "Job")))
        .map(|d| {
            (
                format!("{}/{}", d["kind"].as_str().unwrap(), name(d)),
                d["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_string(),
                d["spec"]["template"]["spec"].clone(),
            )
        })
        .collect()
}

fn containers(spec: &Value) -> Vec<&Value> {
    ["initContainers", "containers", "ephemeralContainers"]
        .iter()
        .filter_map(|k| spec[*k].as_array())
        .flatten()
        .collect()
}

// ---------------------------------------------------------------- without a cluster

/// Every optional object of the chart rendered: the Prometheus Operator objects forced
/// on, the dashboard, the Argo CD customizations, a PodDisruptionBudget (two replicas),
/// topology spread, the agents' affinity and annotations.
fn every_toggle_on() -> Vec<&'static str> {
    vec![
        "--set",
        "metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true,\
         metrics.podMonitor.enabled=true,\
         metrics.dashboard.enabled=true,argocd.resourceCustomizations.enabled=true,\
         operator.replicas=2,eviction.enabled=true,\
         operator.topologySpreadConstraints[0].maxSkew=1,\
         operator.topologySpreadConstraints[0].topologyKey=topology.kubernetes.io/zone,\
         operator.topologySpreadConstraints[0].whenUnsatisfiable=ScheduleAnyway,\
         migrationAgent.podAnnotations.example\\.com/scanned=yes,\
         migrationAgent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=podmotion.io/migrations,\
         migrationAgent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
    ]
}

#[test]
fn helm_lint_is_clean_for_the_defaults_and_the_variants() {
    for variant in [
        vec![],
        vec!["--set", "crds.install=false"],
        vec!["--set", "operator.controllers={runner-pool}"],
        vec![
            "--set",
            "migrationAgent.enabled=false,reapOnUninstall.enabled=false",
        ],
        vec![
            "--set",
            "operator.leaderElection.enabled=false,operator.networkPolicy.enabled=false",
        ],
        vec!["--set", "migration.masterKey.existingSecret=my-key"],
        every_toggle_on(),
    ] {
        let out = Command::new(helm())
            .args(["lint", "--strict"])
            .arg(chart_dir())
            .args(&variant)
            .output()
            .unwrap();
        let text = output_text(&out);
        assert!(out.status.success(), "helm lint {variant:?}:\n{text}");
        assert!(
            !text.contains("[WARNING]") && !text.contains("[ERROR]"),
            "helm lint {variant:?}:\n{text}"
        );
    }
}

#[test]
fn chart_crd_copies_match_the_generated_crds() {
    let generated = repo_root().join("crds");
    let copies = chart_dir().join("files/crds");
    let list = |dir: &Path| -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".yaml"))
            .collect()
    };
    let fix = "cp crds/*.yaml charts/podmotion/files/crds/";
    assert_eq!(list(&generated), list(&copies), "CRD files differ; {fix}");
    for file in list(&generated) {
        let a = std::fs::read(generated.join(&file)).unwrap();
        let b = std::fs::read(copies.join(&file)).unwrap();
        assert!(
            a == b,
            "charts/podmotion/files/crds/{file} drifted from crds/{file}; {fix}"
        );
    }
}

#[test]
fn rendered_crds_are_the_generated_ones_and_kept_on_uninstall() {
    let generated: Vec<Value> = std::fs::read_dir(repo_root().join("crds"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .flat_map(|p| parse_docs(&std::fs::read_to_string(p).unwrap()))
        .collect();
    assert_eq!(generated.len(), 3);
    let docs = render(&[]);
    let crds = of_kind(&docs, "CustomResourceDefinition");
    assert_eq!(crds.len(), 3, "rendered CRDs");
    for want in &generated {
        let got = crds
            .iter()
            .find(|c| name(c) == name(want))
            .unwrap_or_else(|| panic!("{} not rendered", name(want)));
        assert_eq!(got["spec"], want["spec"], "{}: spec differs", name(want));
        assert_eq!(
            got.pointer("/metadata/annotations/helm.sh~1resource-policy"),
            Some(&json!("keep")),
            "{}",
            name(want)
        );
        // To Argo CD `keep` is only Delete=false: without this a sync with pruning
        // deletes the CRDs (and every object) once they leave the desired state.
        assert_eq!(
            got.pointer("/metadata/annotations/argocd.argoproj.io~1sync-options"),
            Some(&json!("Prune=false")),
            "{}",
            name(want)
        );
        assert!(
            !is_hook(got),
            "CRDs must not be hooks (hooks are not upgraded)"
        );
    }
    let not_kept = render(&["--set", "crds.keep=false"]);
    for c in of_kind(&not_kept, "CustomResourceDefinition") {
        assert!(
            c.pointer("/metadata/annotations/helm.sh~1resource-policy")
                .is_none()
        );
        assert!(
            c.pointer("/metadata/annotations/argocd.argoproj.io~1sync-options")
                .is_none()
        );
    }
    let none = render(&["--set", "crds.install=false"]);
    assert!(of_kind(&none, "CustomResourceDefinition").is_empty());
}

#[test]
fn operator_and_hook_pods_meet_the_restricted_level() {
    let docs = render(&[]);
    let specs = pod_specs(&docs);
    let operator_pods: Vec<_> = specs
        .iter()
        .filter(|(w, _, _)| w.starts_with("Deployment/") || w.starts_with("Job/"))
        .collect();
    assert_eq!(
        operator_pods.len(),
        2,
        "operator Deployment and reap-all hook Job"
    );
    for (workload, ns, spec) in operator_pods {
        assert_eq!(ns, "podmotion-system", "{workload}");
        assert_eq!(spec["securityContext"]["runAsNonRoot"], true, "{workload}");
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
            "{workload}"
        );
        for key in ["hostPID", "hostNetwork", "hostIPC"] {
            assert!(spec[key] != true, "{workload}: {key}");
        }
        assert!(
            spec["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .all(|v| v.get("hostPath").is_none()),
            "{workload}: hostPath"
        );
        for c in containers(spec) {
            let sc = &c["securityContext"];
            let what = format!("{workload} container {}", c["name"]);
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{what}");
            assert_eq!(sc["readOnlyRootFilesystem"], true, "{what}");
            assert_eq!(sc["privileged"], false, "{what}");
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{what}");
            assert!(sc["capabilities"].get("add").is_none(), "{what}");
            assert!(
                c["resources"]["requests"].is_object() && c["resources"]["limits"].is_object(),
                "{what}: resources"
            );
        }
    }
    let deploy = of_kind(&docs, "Deployment")[0];
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["startupProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    let hook = of_kind(&docs, "Job")[0];
    assert_eq!(
        hook.pointer("/metadata/annotations/helm.sh~1hook"),
        Some(&json!("pre-delete"))
    );
    let args = hook["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap();
    // `reap-all <operator Deployment>`: the Deployment it scales to zero is the chart's.
    assert_eq!(
        args[args.len() - 2..],
        [json!("reap-all"), json!(name(deploy))],
        "{args:?}"
    );
}

/// PostCopy is the installer's choice: only `migrationAgent.postCopy.enabled` adds
/// CAP_SYS_PTRACE (the userfaultfd of CRIU's lazy restore), and only to the agent.
#[test]
fn post_copy_adds_sys_ptrace_to_the_agent_only_when_the_installer_enables_it() {
    let added = |args: &[&str]| -> Vec<String> {
        let docs = render(args);
        let ds = of_kind(&docs, "DaemonSet")[0];
        let agent = containers(&ds["spec"]["template"]["spec"])
            .into_iter()
            .find(|c| c["name"] == "agent")
            .expect("agent container");
        agent["securityContext"]["capabilities"]["add"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    };
    let default = added(&[]);
    assert!(!default.contains(&"SYS_PTRACE".to_string()), "{default:?}");
    let post_copy = added(&["--set", "migrationAgent.postCopy.enabled=true"]);
    let mut expected = default.clone();
    expected.push("SYS_PTRACE".into());
    assert_eq!(post_copy, expected);
    // Once, also where the installer listed it already.
    let listed = added(&[
        "--set",
        "migrationAgent.postCopy.enabled=true",
        "--set",
        "migrationAgent.agent.capabilities={SYS_ADMIN,SYS_PTRACE}",
    ]);
    assert_eq!(listed, ["SYS_ADMIN", "SYS_PTRACE"]);
}

#[test]
fn the_netns_broker_is_the_only_privileged_container() {
    let docs = render(&[]);
    let mut privileged = Vec::new();
    let mut host_pid = Vec::new();
    for (workload, _, spec) in pod_specs(&docs) {
        if spec["hostPID"] == true {
            host_pid.push(workload.clone());
        }
        assert!(spec["hostNetwork"] != true, "{workload}: hostNetwork");
        assert!(spec["hostIPC"] != true, "{workload}: hostIPC");
        for c in containers(&spec) {
            if c["securityContext"]["privileged"] == true {
                privileged.push(format!("{workload}/{}", c["name"].as_str().unwrap()));
            }
        }
    }
    assert_eq!(
        privileged,
        vec!["DaemonSet/pm-podmotion-migration-agent/netns-broker"]
    );
    assert_eq!(host_pid, vec!["DaemonSet/pm-podmotion-migration-agent"]);

    let ds = of_kind(&docs, "DaemonSet")[0];
    let spec = &ds["spec"]["template"]["spec"];
    assert_eq!(spec["automountServiceAccountToken"], false);
    let agent = containers(spec)
        .into_iter()
        .find(|c| c["name"] == "agent")
        .expect("agent container");
    let sc = &agent["securityContext"];
    assert_eq!(sc["privileged"], false);
    // no_new_privs would be inherited by every restored workload and cannot be cleared.
    assert_eq!(sc["allowPrivilegeEscalation"], true);
    assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
    let added: BTreeSet<&str> = sc["capabilities"]["add"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    // Exactly the set measured for a container's dump and restore (docs/security.md).
    assert_eq!(
        added,
        BTreeSet::from([
            "AUDIT_WRITE",
            "CHOWN",
            "DAC_OVERRIDE",
            "FOWNER",
            "FSETID",
            "KILL",
            "MKNOD",
            "NET_ADMIN",
            "NET_BIND_SERVICE",
            "NET_RAW",
            "SETFCAP",
            "SETGID",
            "SETPCAP",
            "SETUID",
            "SYS_ADMIN",
            "SYS_CHROOT",
            "SYS_TIME",
        ])
    );
    for unneeded in [
        "SYS_PTRACE",
        "CHECKPOINT_RESTORE",
        "SYS_RESOURCE",
        "SYS_MODULE",
    ] {
        assert!(!added.contains(unneeded), "measured unneeded: {unneeded}");
    }
    // Checkpoint images (whole process memory) only on the pod's own tmpfs.
    let checkpoints = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "checkpoints")
        .unwrap();
    assert_eq!(checkpoints["emptyDir"]["medium"], "Memory");
    // The agent mounts no host path read-write but its own state directory (the
    // leader-term record, which must outlive its pod).
    let host_volumes: BTreeSet<&str> = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v.get("hostPath").is_some())
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    for m in agent["volumeMounts"].as_array().unwrap() {
        let name = m["name"].as_str().unwrap();
        if host_volumes.contains(name) && name != "agent-state" {
            assert_eq!(m["readOnly"], true, "agent mount {m}");
        }
    }
    // The host paths it has: its state directory, the broker's netns directory and the
    // node's root.
    let agent_host_mounts: Vec<&str> = agent["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["name"].as_str())
        .filter(|n| host_volumes.contains(n))
        .collect();
    assert_eq!(agent_host_mounts, vec!["agent-state", "netns", "host"]);
    let state = mount(agent, "agent-state").unwrap();
    assert_eq!(state["mountPath"], "/run/podmotion/agent");
    assert!(state.get("mountPropagation").is_none(), "{state}");
    assert!(strs(&agent["args"]).contains(&"--state-dir=/run/podmotion/agent"));
    let broker = containers(spec)
        .into_iter()
        .find(|c| c["name"] == "netns-broker")
        .unwrap();
    assert!(mount(broker, "agent-state").is_none());
}

/// The volume named `name` of a pod spec.
fn volume<'a>(spec: &'a Value, name: &str) -> &'a Value {
    spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

/// The mount of volume `name` in `container`, if any.
fn mount<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["name"] == name)
}

#[test]
fn the_agent_sees_the_node_read_only_and_finds_the_runtime_socket_under_it() {
    for (set, cri) in [
        (vec![], "/host/run"),
        (
            vec![
                "--set",
                "migrationAgent.agent.criRunDir=/run/k3s/containerd",
            ],
            "/host/run/k3s/containerd",
        ),
    ] {
        let docs = render(&set);
        let spec = &of_kind(&docs, "DaemonSet")[0]["spec"]["template"]["spec"];
        let host = volume(spec, "host");
        assert_eq!(host["hostPath"]["path"], "/", "{set:?}");
        let agent = containers(spec)
            .into_iter()
            .find(|c| c["name"] == "agent")
            .unwrap();
        let m = mount(agent, "host").expect("agent mounts the node's root");
        assert_eq!(m["mountPath"], "/host");
        assert_eq!(m["readOnly"], true);
        // Mounts made after the agent started (pods' volumes, container root
        // filesystems) must appear in it.
        assert_eq!(m["mountPropagation"], "HostToContainer");
        let args = strs(&agent["args"]);
        assert!(
            args.contains(&format!("--cri-run-dir={cri}").as_str()),
            "{args:?}"
        );
        assert!(args.contains(&"--host-root=/host"));
        // The broker's netns bind mounts reach the agent, read-only.
        let n = mount(agent, "netns").expect("agent sees the broker's netns directory");
        assert_eq!(n["mountPath"], "/run/podmotion/netns");
        assert_eq!(n["mountPropagation"], "HostToContainer");
        assert_eq!(n["readOnly"], true);
        // Only the agent sees the node's root; the broker never sees the socket.
        let broker = containers(spec)
            .into_iter()
            .find(|c| c["name"] == "netns-broker")
            .unwrap();
        assert!(mount(broker, "host").is_none());
    }
}

/// Each release's broker owns its host directory (it rolls back and unbinds what it
/// finds there at start): two releases get two, and a named one is used as given. So
/// does each release's agent (its leader-term record: another release's operator has
/// its own Lease and terms), always in the release's run directory.
#[test]
fn each_release_gets_its_own_broker_directory_on_the_node() {
    let dirs = |release: &str, namespace: &str, args: &[&str]| {
        let docs = parse_docs(&try_render(release, namespace, args).unwrap());
        let spec = &of_kind(&docs, "DaemonSet")[0]["spec"]["template"]["spec"];
        let path = |name: &str| {
            let v = volume(spec, name);
            assert_eq!(v["hostPath"]["type"], "DirectoryOrCreate");
            v["hostPath"]["path"].as_str().unwrap().to_owned()
        };
        (path("netns"), path("agent-state"))
    };
    let dir = |release: &str, namespace: &str, args: &[&str]| dirs(release, namespace, args).0;
    let agent = |release: &str, namespace: &str, args: &[&str]| dirs(release, namespace, args).1;
    assert_eq!(
        agent("pm", "podmotion", &[]),
        "/run/podmotion/podmotion.pm/agent"
    );
    assert_eq!(
        agent("pm2", "podmotion", &[]),
        "/run/podmotion/podmotion.pm2/agent"
    );
    assert_eq!(agent("pm", "other", &[]), "/run/podmotion/other.pm/agent");
    assert_eq!(
        agent(
            "pm",
            "podmotion",
            &["--set", "migrationAgent.netnsDir=/var/run/pm"]
        ),
        "/run/podmotion/podmotion.pm/agent"
    );
    assert_eq!(
        dir("pm", "podmotion", &[]),
        "/run/podmotion/podmotion.pm/netns"
    );
    assert_eq!(
        dir("pm2", "podmotion", &[]),
        "/run/podmotion/podmotion.pm2/netns"
    );
    assert_eq!(dir("pm", "other", &[]), "/run/podmotion/other.pm/netns");
    assert_eq!(
        dir(
            "pm",
            "podmotion",
            &["--set", "migrationAgent.netnsDir=/var/run/pm"]
        ),
        "/var/run/pm"
    );
    let e = try_render(
        "pm",
        "podmotion",
        &["--set", "migrationAgent.netnsDir=relative/dir"],
    )
    .expect_err("a relative netnsDir is refused");
    assert!(e.contains("netnsDir"), "{e}");
}

#[test]
fn key_material_is_made_by_the_operator_at_run_time_never_by_the_chart() {
    let docs = render(&[]);
    // No Secret at all in the rendering: no CA, no certificate, no master key.
    assert!(
        of_kind(&docs, "Secret").is_empty(),
        "the chart renders key material"
    );
    let deploy = of_kind(&docs, "Deployment")[0];
    let spec = &deploy["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    let args = strs(&c["args"]);
    for flag in [
        "--migration-key-secret=pm-podmotion-migration-key",
        "--key-material-dir=/run/podmotion/keys",
        "--pki-ca-secret=pm-podmotion-agent-ca",
        "--pki-bundle-configmap=pm-podmotion-agent-ca",
        "--pki-agent-service-account=pm-podmotion-migration-agent",
        "--pki-ca-seconds=31536000",
        "--pki-leaf-seconds=604800",
        "--pki-propagation-seconds=300",
    ] {
        assert!(args.contains(&flag), "{flag} missing: {args:?}");
    }
    // The master key the operator reads through the API lands in memory only.
    let m = mount(c, "keys").expect("key material directory mounted");
    assert_eq!(m["mountPath"], "/run/podmotion/keys");
    assert_eq!(volume(spec, "keys")["emptyDir"]["medium"], "Memory");
    assert!(mount(c, "migration-key").is_none());
    assert!(mount(c, "agent-tls").is_none());
    // A file, never an environment variable; no TLS files either.
    for e in c["env"].as_array().unwrap() {
        let n = e["name"].as_str().unwrap();
        assert!(
            n != "PODMOTION_MIGRATION_KEY_FILE" && !n.starts_with("PODMOTION_AGENT_TLS_"),
            "{n}"
        );
    }
    // The agent asks for its own certificate; it gets a token in its container only.
    let ds = of_kind(&docs, "DaemonSet")[0];
    let aspec = &ds["spec"]["template"]["spec"];
    let agent = containers(aspec)
        .into_iter()
        .find(|c| c["name"] == "agent")
        .unwrap();
    let aargs = strs(&agent["args"]);
    assert!(aargs.contains(&"--identity-from-csr"), "{aargs:?}");
    assert!(aargs.contains(&"--ca-bundle-configmap=pm-podmotion-agent-ca"));
    assert!(!aargs.iter().any(|a| a.starts_with("--tls-")), "{aargs:?}");
    assert_eq!(aspec["automountServiceAccountToken"], false);
    let token = volume(aspec, "kube-api-access");
    let sources = token["projected"]["sources"].as_array().unwrap();
    assert_eq!(sources[0]["serviceAccountToken"]["expirationSeconds"], 3600);
    assert!(mount(agent, "kube-api-access").is_some());
    let broker = containers(aspec)
        .into_iter()
        .find(|c| c["name"] == "netns-broker")
        .unwrap();
    assert!(
        mount(broker, "kube-api-access").is_none(),
        "the broker gets no token"
    );

    // A Secret of the user's: mounted as a file, nothing managed.
    let docs = render(&["--set", "migration.masterKey.existingSecret=my-key"]);
    let spec = &of_kind(&docs, "Deployment")[0]["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    let flag = "--migration-key-file=/etc/podmotion/migration-key/key";
    assert!(strs(&c["args"]).contains(&flag), "{}", c["args"]);
    assert!(
        !strs(&c["args"])
            .iter()
            .any(|a| a.starts_with("--migration-key-secret"))
    );
    let m = mount(c, "migration-key").expect("master key mounted");
    assert_eq!(m["mountPath"], "/etc/podmotion/migration-key");
    assert_eq!(m["readOnly"], true);
    let v = volume(spec, "migration-key");
    assert_eq!(v["secret"]["secretName"], "my-key");
    // 0440 (rendered `0440`, octal to Kubernetes; read as 440 here), group = the pod's
    // fsGroup: readable by the operator's non-root uid/gid only.
    assert_eq!(v["secret"]["defaultMode"].as_f64(), Some(440.0));
    assert!(spec["securityContext"]["fsGroup"].is_number());
    assert!(of_kind(&docs, "Secret").is_empty());

    // Without the migration controller: no key, no flag, no PKI.
    let docs = render(&["--set", "operator.controllers={attachment,runner-pool}"]);
    let spec = &of_kind(&docs, "Deployment")[0]["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    assert!(
        !strs(&c["args"])
            .iter()
            .any(|a| a.starts_with("--migration-key") || a.starts_with("--pki-"))
    );
    assert!(mount(c, "migration-key").is_none());

    // Lifetimes without room for an overlapping rotation are refused at render time.
    let err = try_render(
        "pm",
        "podmotion-system",
        &[
            "--set",
            "migrationAgent.pki.caValidityDays=2,migrationAgent.pki.leafValidityHours=24",
        ],
    )
    .unwrap_err();
    assert!(err.contains("at least three times"), "{err}");
}

/// Argo CD and every GitOps tool render with `helm template`: the output must be a
/// function of the values alone (no `genCA`, `randAlphaNum`, `lookup`, clock).
#[test]
fn helm_template_twice_is_byte_identical() {
    for variant in [
        vec![],
        vec!["--set", "migration.masterKey.existingSecret=my-key"],
        vec![
            "--set",
            "operator.controllers={migration},migrationAgent.pki.leafValidityHours=24",
        ],
        every_toggle_on(),
        // "auto" with the Prometheus Operator's API present (as Argo CD passes it).
        prometheus_api(&[]),
    ] {
        let a = try_render("pm", "podmotion-system", &variant).unwrap();
        let b = try_render("pm", "podmotion-system", &variant).unwrap();
        assert!(a == b, "two renderings differ ({variant:?})");
        assert!(a.len() > 10_000, "rendered almost nothing");
    }
    // And the templates cannot start differing again: no function whose result is not
    // a function of the values.
    for entry in std::fs::read_dir(chart_dir().join("templates")).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for f in [
            "genCA",
            "genSignedCert",
            "genSelfSignedCert",
            "genPrivateKey",
            "randAlphaNum",
            "randAlpha",
            "randNumeric",
            "randAscii",
            "randBytes",
            "uuidv4",
            "lookup",
            "now",
        ] {
            let used = text
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .any(|w| w == f);
            assert!(!used, "{} uses {f}", path.display());
        }
    }
}

/// Every rule of every Role and ClusterRole of a rendering: (kind/name, namespace, rule).
/// The rules of the Roles and ClusterRoles PodMotion's own components hold (not the
/// plugin-user ClusterRole, which is for tenants to bind: `plugin_user_role_*`).
fn rules(docs: &[Value]) -> Vec<(String, String, Value)> {
    docs.iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("Role" | "ClusterRole")))
        // The operator's own rules: the roles for people (the plugin user's, and the
        // ones aggregated into view/edit/admin) have tests of their own.
        .filter(|d| {
            !matches!(
                d["metadata"]["labels"]["app.kubernetes.io/component"].as_str(),
                Some("plugin-user" | "user-roles")
            )
        })
        .flat_map(|d| {
            let who = format!("{}/{}", d["kind"].as_str().unwrap(), name(d));
            let ns = d["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_string();
            d["rules"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |r| (who.clone(), ns.clone(), r))
        })
        .collect()
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

#[test]
fn rbac_has_no_wildcards_and_reads_no_secrets_outside_the_agents_namespace() {
    let docs = render(&[]);
    let all = rules(&docs);
    assert!(all.len() > 10, "{} rules", all.len());
    for (who, ns, rule) in &all {
        for key in ["apiGroups", "resources", "verbs", "resourceNames"] {
            assert!(
                !strs(&rule[key]).iter().any(|s| s.contains('*')),
                "{who}: wildcard in {key}: {rule}"
            );
        }
        assert!(rule.get("nonResourceURLs").is_none(), "{who}: {rule}");
        let resources = strs(&rule["resources"]);
        let verbs = strs(&rule["verbs"]);
        for forbidden in ["escalate", "bind", "impersonate", "deletecollection"] {
            assert!(!verbs.contains(&forbidden), "{who}: {forbidden}: {rule}");
        }
        for sub in [
            "pods/exec",
            "pods/attach",
            "pods/portforward",
            "serviceaccounts/token",
        ] {
            assert!(!resources.contains(&sub), "{who}: {sub}");
        }
        if resources.contains(&"secrets") {
            let reads = verbs.iter().any(|v| matches!(*v, "get" | "list" | "watch"));
            // The only Secrets read are the operator's own key material, by name, in
            // its own namespace.
            let own_key_material = who == "Role/pm-podmotion-key-material"
                && ns == "podmotion-system"
                && strs(&rule["resourceNames"])
                    == vec!["pm-podmotion-agent-ca", "pm-podmotion-migration-key"];
            assert!(
                !reads || own_key_material,
                "{who} ({ns}) reads Secrets: {rule}"
            );
        }
        if resources.contains(&"jobs") {
            assert_eq!(
                (who.starts_with("Role/"), ns.as_str()),
                (true, "podmotion-system-agents"),
                "Jobs only in the agents' namespace: {rule}"
            );
        }
        for workload in ["deployments", "statefulsets", "replicasets"] {
            if resources.contains(&workload) {
                assert_eq!(
                    verbs,
                    vec!["get", "list", "watch"],
                    "{who}: workloads are never mutated"
                );
            }
        }
    }
    // The pieces the runtime needs are there: events create + patch, the leader Lease.
    let grants = |resource: &str, verb: &str| {
        all.iter().any(|(_, _, r)| {
            strs(&r["resources"]).contains(&resource) && strs(&r["verbs"]).contains(&verb)
        })
    };
    assert!(grants("events", "create") && grants("events", "patch"));
    assert!(grants("leases", "update"));
}

#[test]
fn plugin_user_role_grants_only_the_tenants_own_namespace_what_the_plugin_uses() {
    let docs = render(&[]);
    let role = docs
        .iter()
        .find(|d| d["kind"] == "ClusterRole" && name(d) == "pm-podmotion-plugin-user")
        .expect("the plugin-user ClusterRole");
    let got: Vec<(Vec<&str>, Vec<&str>, Vec<&str>)> = role["rules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                strs(&r["apiGroups"]),
                strs(&r["resources"]),
                strs(&r["verbs"]),
            )
        })
        .collect();
    // docs/plugin.md "Rights" lists exactly these.
    assert_eq!(
        got,
        vec![
            (
                vec!["podmotion.io"],
                vec!["podmigrations", "nodeagentattachments"],
                vec!["get", "list", "watch", "create", "delete"]
            ),
            (vec!["podmotion.io"], vec!["runnerpools"], vec!["list"]),
            (vec![""], vec!["pods"], vec!["get"]),
            (vec![""], vec!["pods/portforward"], vec!["get", "create"]),
            (vec![""], vec!["secrets"], vec!["get"]),
            (vec!["coordination.k8s.io"], vec!["leases"], vec!["patch"]),
        ]
    );
    // Bound by tenants, never by the chart: no binding names it.
    assert!(!docs.iter().any(|d| {
        matches!(
            d["kind"].as_str(),
            Some("RoleBinding" | "ClusterRoleBinding")
        ) && d["roleRef"]["name"] == "pm-podmotion-plugin-user"
    }));
}

#[test]
fn user_roles_extend_view_edit_and_admin_by_aggregation_only_when_asked() {
    // (role, the built-in role it aggregates to, its rules as (resources, verbs)).
    type Rules = Vec<(Vec<String>, Vec<String>)>;
    let aggregated = |docs: &[Value]| -> Vec<(String, String, Rules)> {
        docs.iter()
            .filter(|d| d["kind"] == "ClusterRole")
            .filter_map(|d| {
                let labels = d["metadata"]["labels"].as_object()?;
                let to = labels
                    .keys()
                    .find_map(|k| k.strip_prefix("rbac.authorization.k8s.io/aggregate-to-"))?;
                let rules = d["rules"]
                    .as_array()?
                    .iter()
                    .map(|r| {
                        let own = |v: &Value| strs(v).into_iter().map(String::from).collect();
                        (own(&r["resources"]), own(&r["verbs"]))
                    })
                    .collect();
                Some((name(d).to_owned(), to.to_owned(), rules))
            })
            .collect()
    };
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        aggregated(&render(&[])),
        vec![
            (
                "pm-podmotion-view".to_owned(),
                "view".to_owned(),
                vec![(
                    s(&[
                        "podmigrations",
                        "nodeagentattachments",
                        "runnerpools",
                        "podmigrations/status",
                        "nodeagentattachments/status",
                        "runnerpools/status"
                    ]),
                    s(&["get", "list", "watch"])
                )]
            ),
            (
                "pm-podmotion-edit".to_owned(),
                "edit".to_owned(),
                vec![(
                    s(&["podmigrations", "nodeagentattachments"]),
                    s(&["create", "update", "patch", "delete"])
                )]
            ),
            (
                "pm-podmotion-admin".to_owned(),
                "admin".to_owned(),
                vec![(
                    s(&["runnerpools"]),
                    s(&["create", "update", "patch", "delete"])
                )]
            ),
        ]
    );
    assert_eq!(
        aggregated(&render(&["--set", "userRoles.aggregate=false"])),
        vec![]
    );
}

#[test]
fn disabled_controllers_lose_their_permissions() {
    let docs = render(&["--set", "operator.controllers={runner-pool}"]);
    let all = rules(&docs);
    let grants = |resource: &str, verb: &str| {
        all.iter().any(|(_, _, r)| {
            strs(&r["resources"]).contains(&resource) && strs(&r["verbs"]).contains(&verb)
        })
    };
    assert!(grants("daemonsets", "create"), "RunnerPool owns DaemonSets");
    assert!(
        !grants("pods", "create"),
        "pod writes are the migration controller's"
    );
    assert!(
        !grants("jobs", "create"),
        "Jobs are the attachment controller's"
    );
    assert!(!grants("podmigrations", "get"));
    assert!(!grants("deployments", "get"));
    assert!(
        !grants("persistentvolumeclaims", "get"),
        "claims are read by the migration pre-flight only"
    );
    // RunnerPool creates its credential once; it applies (patches) it only where it
    // may read Secrets anyway: a no-op PATCH answers with the whole Secret (issue 41).
    assert!(
        !grants("secrets", "patch"),
        "patch on Secrets without runnerPool.watchNamespace"
    );
    let docs = render(&[
        "--set",
        "operator.controllers={runner-pool},runnerPool.watchNamespace=runners",
    ]);
    let scoped: Vec<(String, String)> = rules(&docs)
        .into_iter()
        .filter(|(_, _, r)| {
            strs(&r["resources"]).contains(&"secrets") && strs(&r["verbs"]).contains(&"patch")
        })
        .map(|(who, ns, _)| (who, ns))
        .collect();
    assert_eq!(
        scoped,
        vec![(
            "Role/pm-podmotion-runner-pool-secrets".to_string(),
            "runners".to_string()
        )]
    );

    // The migration controller writes Secrets with create and delete only (the
    // transfer key is derived from the master key, never read back or patched); the
    // key material (CA, master key) is read and replaced by name in the operator's
    // namespace only.
    let docs = render(&["--set", "operator.controllers={migration}"]);
    let all = rules(&docs);
    let secret_rules: Vec<(String, String, Vec<&str>, Vec<&str>)> = all
        .iter()
        .filter(|(_, _, r)| strs(&r["resources"]).contains(&"secrets"))
        .map(|(who, ns, r)| {
            (
                who.clone(),
                ns.clone(),
                strs(&r["verbs"]),
                strs(&r["resourceNames"]),
            )
        })
        .collect();
    let key_material = "Role/pm-podmotion-key-material".to_string();
    let own = "podmotion-system".to_string();
    assert_eq!(
        secret_rules,
        vec![
            (
                "ClusterRole/pm-podmotion-operator".to_string(),
                String::new(),
                vec!["create", "delete"],
                vec![]
            ),
            (key_material.clone(), own.clone(), vec!["create"], vec![]),
            (
                key_material,
                own,
                vec!["get", "list", "watch", "update"],
                vec!["pm-podmotion-agent-ca", "pm-podmotion-migration-key"]
            ),
        ]
    );
    // Without the migration controller there is no key material at all.
    let docs = render(&["--set", "operator.controllers={runner-pool}"]);
    assert!(
        docs.iter()
            .all(|d| !name(d).contains("key-material") && !name(d).contains("agent-signer")),
        "key material RBAC without the migration controller"
    );
    // The uninstall hook still runs (RunnerPools have finalizers too), for the enabled
    // controllers only, and gets no PodMigration or Job permission.
    let hooks: Vec<&Value> = docs.iter().filter(|d| is_hook(d)).collect();
    let job = hooks
        .iter()
        .find(|d| d["kind"] == "Job")
        .expect("the reap-all hook");
    assert!(
        strs(&job["spec"]["template"]["spec"]["containers"][0]["args"])
            .contains(&"--controllers=runner-pool")
    );
    let hook_rules = rules(&hooks.into_iter().cloned().collect::<Vec<_>>());
    assert!(
        hook_rules.iter().all(|(_, _, r)| {
            let res = strs(&r["resources"]);
            !res.contains(&"podmigrations") && !res.contains(&"jobs")
        }),
        "{hook_rules:?}"
    );
}

/// The uninstall hook's own permissions exist only while it runs (hook objects) and
/// are the two the operator never needs: scale that one Deployment, delete
/// PodMigrations (in the watched namespace only, when there is one).
#[test]
fn the_uninstall_hook_may_scale_only_the_operator_and_delete_only_migrations() {
    for (set, scope) in [
        ("reapOnUninstall.enabled=true", None),
        ("migration.watchNamespace=team-a", Some("team-a")),
    ] {
        let docs = render(&["--set", set]);
        let hooks: Vec<Value> = docs.iter().filter(|d| is_hook(d)).cloned().collect();
        let mut got = rules(&hooks);
        got.sort_by_key(|(who, _, _)| who.clone());
        let deploy = name(of_kind(&docs, "Deployment")[0]).to_string();
        let migrations = match scope {
            Some(_) => "Role/pm-podmotion-reap-all-migrations",
            None => "ClusterRole/pm-podmotion-reap-all-migrations",
        };
        let mut want = vec![
            (
                migrations.to_string(),
                scope.unwrap_or("").to_string(),
                json!({"apiGroups": ["podmotion.io"], "resources": ["podmigrations"], "verbs": ["delete"]}),
            ),
            (
                "Role/pm-podmotion-reap-all".to_string(),
                "podmotion-system".to_string(),
                json!({"apiGroups": ["apps"], "resources": ["deployments/scale"],
                    "resourceNames": [deploy], "verbs": ["patch"]}),
            ),
        ];
        want.sort_by_key(|(who, _, _)| who.clone());
        assert_eq!(got, want, "{set}");
        // Bound to the operator's ServiceAccount (the hook Job's), and created before it.
        for d in &hooks {
            let weight = d
                .pointer("/metadata/annotations/helm.sh~1hook-weight")
                .and_then(Value::as_str)
                .unwrap();
            if d["kind"] == "Job" {
                assert_eq!(weight, "0");
                continue;
            }
            assert_eq!(weight, "-10", "{}", name(d));
            assert_eq!(
                d.pointer("/metadata/annotations/helm.sh~1hook-delete-policy"),
                Some(&json!("before-hook-creation,hook-succeeded")),
                "{}",
                name(d)
            );
            if d["kind"].as_str().unwrap().ends_with("Binding") {
                assert_eq!(
                    d["subjects"],
                    json!([{"kind": "ServiceAccount", "name": "pm-podmotion", "namespace": "podmotion-system"}])
                );
            }
        }
    }
    let off = render(&["--set", "reapOnUninstall.enabled=false"]);
    assert!(!off.iter().any(is_hook), "no hook, no hook RBAC");
}

/// The uninstall hook Job's settings come from `reapOnUninstall`; placement it does not
/// set is the operator's (the hook runs the operator's image as its ServiceAccount), and
/// extra labels and annotations never replace the chart's own.
#[test]
fn the_uninstall_hook_job_takes_its_values_and_falls_back_to_the_operators_placement() {
    fn hook_job(docs: &[Value]) -> Value {
        of_kind(docs, "Job")
            .into_iter()
            .find(|d| is_hook(d))
            .expect("the reap-all hook Job")
            .clone()
    }
    let operator_placement = [
        "--set",
        "operator.nodeSelector.pool=system",
        "--set",
        "operator.tolerations[0].key=dedicated",
        "--set",
        "operator.tolerations[0].operator=Exists",
        "--set",
        "operator.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=1",
        "--set",
        "operator.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].key=zone",
        "--set",
        "operator.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].preference.matchExpressions[0].operator=Exists",
        "--set",
        "operator.priorityClassName=system-cluster-critical",
    ];
    // Defaults: the Job as before, placed like the operator.
    let job = hook_job(&render(&operator_placement));
    let spec = &job["spec"];
    assert_eq!(spec["backoffLimit"], json!(2));
    assert_eq!(spec["activeDeadlineSeconds"], json!(300));
    assert_eq!(spec["ttlSecondsAfterFinished"], json!(600));
    let pod = &spec["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"pool": "system", "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"})
    );
    assert_eq!(
        pod["tolerations"],
        json!([{"key": "dedicated", "operator": "Exists"}])
    );
    assert_eq!(
        pod.pointer(
            "/affinity/nodeAffinity/preferredDuringSchedulingIgnoredDuringExecution/0/weight"
        ),
        Some(&json!(1))
    );
    assert_eq!(pod["priorityClassName"], json!("system-cluster-critical"));
    assert_eq!(
        pod["containers"][0]["resources"],
        json!({"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}})
    );
    assert!(spec["template"]["metadata"].get("annotations").is_none());

    // Its own values win.
    let mut args: Vec<&str> = operator_placement.to_vec();
    args.extend([
        "--set",
        "reapOnUninstall.activeDeadlineSeconds=900",
        "--set",
        "reapOnUninstall.backoffLimit=0",
        "--set",
        "reapOnUninstall.ttlSecondsAfterFinished=3600",
        "--set",
        "reapOnUninstall.nodeSelector.pool=cleanup",
        "--set",
        "reapOnUninstall.tolerations[0].operator=Exists",
        "--set",
        "reapOnUninstall.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight=7",
        "--set",
        "reapOnUninstall.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].podAffinityTerm.topologyKey=kubernetes.io/hostname",
        "--set",
        "reapOnUninstall.priorityClassName=cleanup",
        "--set",
        "reapOnUninstall.resources.limits.memory=256Mi",
        "--set",
        "reapOnUninstall.jobAnnotations.team=platform",
        "--set",
        "reapOnUninstall.jobAnnotations.helm\\.sh/hook=post-delete",
        "--set-string",
        "reapOnUninstall.podAnnotations.sidecar\\.istio\\.io/inject=false",
        "--set",
        "reapOnUninstall.podLabels.team=platform",
        "--set",
        "reapOnUninstall.podLabels.app\\.kubernetes\\.io/component=mine",
    ]);
    let job = hook_job(&render(&args));
    let spec = &job["spec"];
    assert_eq!(spec["backoffLimit"], json!(0));
    assert_eq!(spec["activeDeadlineSeconds"], json!(900));
    assert_eq!(spec["ttlSecondsAfterFinished"], json!(3600));
    let pod = &spec["template"]["spec"];
    assert_eq!(
        pod["nodeSelector"],
        json!({"pool": "cleanup", "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"})
    );
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    assert!(
        pod["affinity"].get("nodeAffinity").is_none(),
        "{}",
        pod["affinity"]
    );
    assert_eq!(
        pod.pointer(
            "/affinity/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution/0/weight"
        ),
        Some(&json!(7))
    );
    assert_eq!(pod["priorityClassName"], json!("cleanup"));
    assert_eq!(
        pod["containers"][0]["resources"]["limits"]["memory"],
        json!("256Mi")
    );
    let annotations = &job["metadata"]["annotations"];
    assert_eq!(annotations["team"], json!("platform"));
    assert_eq!(
        annotations["helm.sh/hook"],
        json!("pre-delete"),
        "{annotations}"
    );
    let meta = &spec["template"]["metadata"];
    assert_eq!(
        meta["annotations"],
        json!({"sidecar.istio.io/inject": "false"})
    );
    assert_eq!(meta["labels"]["team"], json!("platform"));
    assert_eq!(
        meta["labels"]["app.kubernetes.io/component"],
        json!("reap-all"),
        "{}",
        meta["labels"]
    );
}

/// `(long flag, env var)` of every clap argument declared under `src` (a directory of
/// the repository), plus, `with_env_reads`, `PODMOTION_*` variables read with
/// `std::env::var`.
fn clap_flags(src: &str, with_env_reads: bool) -> Vec<(String, Option<String>)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&repo_root().join(src), &mut files);
    let quoted = |attr: &str, key: &str| -> Option<String> {
        let re = format!("{key} = \"");
        let start = attr.find(&re)? + re.len();
        Some(attr[start..].split('"').next()?.to_string())
    };
    let mut flags = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut rest = text.as_str();
        while let Some(i) = rest.find("#[arg(") {
            rest = &rest[i..];
            let end = rest.find(")]").expect("#[arg(…)] closes");
            let attr = &rest[..end];
            let after = &rest[end + 2..];
            // The field the attribute belongs to: the next `name: Type` line.
            let field = after
                .lines()
                .map(str::trim)
                .find(|l| !l.is_empty() && !l.starts_with("#[") && !l.starts_with("//"))
                .and_then(|l| l.trim_start_matches("pub ").split(':').next())
                .unwrap_or("")
                .trim()
                .to_string();
            let has_long = attr
                .split(|c: char| !c.is_alphanumeric() && c != '_')
                .any(|w| w == "long");
            if has_long {
                let long = quoted(attr, "long").unwrap_or_else(|| field.replace('_', "-"));
                flags.push((long, quoted(attr, "env")));
            }
            rest = after;
        }
    }
    // Settings read from the environment directly (`std::env::var("PODMOTION_…")`);
    // the executors' are test-bed switches, not settings.
    for file in rust_files(src).iter().filter(|_| with_env_reads) {
        let text = std::fs::read_to_string(file).unwrap();
        for part in text.split("env::var(\"").skip(1) {
            let var = part.split('"').next().unwrap_or("");
            if var.starts_with("PODMOTION_") {
                flags.push((String::new(), Some(var.to_string())));
            }
        }
    }
    flags
}

fn rust_files(src: &str) -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(&repo_root().join(src), &mut files);
    files
}

#[test]
fn every_operator_flag_has_a_value_in_the_chart() {
    let flags = clap_flags("operator/src", true);
    let names: Vec<&str> = flags.iter().map(|(f, _)| f.as_str()).collect();
    for known in [
        "namespace",
        "controllers",
        "no-leader-election",
        "log-format",
    ] {
        assert!(names.contains(&known), "parser missed --{known}: {names:?}");
    }
    let mut args = BTreeSet::new();
    let mut env = BTreeSet::new();
    for variant in [
        vec![],
        vec![
            "--set",
            "operator.leaderElection.enabled=false,attachment.watchNamespace=team-a,migration.watchNamespace=team-a",
            "--set",
            "runnerPool.watchNamespace=team-a,runnerPool.preflightImage=registry.example/preflight:1",
            "--set",
            "migration.agentEndpoints={pm-node-0=http://127.0.0.1:7443}",
            "--set",
            "imagePullSecrets[0].name=regcred,imagePullSecrets[1].name=mirror",
        ],
        // The user's own master key: mounted as a file (--migration-key-file).
        vec!["--set", "migration.masterKey.existingSecret=my-key"],
    ] {
        let docs = render(&variant);
        let deploy = of_kind(&docs, "Deployment")[0];
        if variant.iter().any(|a| a.contains("imagePullSecrets")) {
            // The attachment Jobs get the same pull Secrets as the chart's own pods.
            let c = &deploy["spec"]["template"]["spec"]["containers"][0];
            let v = c["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == "PODMOTION_ATTACHMENT_IMAGE_PULL_SECRETS")
                .map(|e| e["value"].clone());
            assert_eq!(v, Some(json!("regcred,mirror")));
        }
        let c = &deploy["spec"]["template"]["spec"]["containers"][0];
        for a in strs(&c["args"]) {
            args.insert(
                a.split('=')
                    .next()
                    .unwrap()
                    .trim_start_matches("--")
                    .to_string(),
            );
        }
        for e in c["env"].as_array().unwrap() {
            env.insert(e["name"].as_str().unwrap().to_string());
        }
    }
    // The operator's agent identity from files (runs without the run-time PKI): the
    // chart always uses the run-time PKI (--pki-*) instead.
    let files_only = [
        "migration-agent-tls-ca",
        "migration-agent-tls-cert",
        "migration-agent-tls-key",
    ];
    let missing: Vec<String> = flags
        .iter()
        .filter(|(long, _)| !files_only.contains(&long.as_str()))
        .filter(|(long, var)| {
            let by_flag = !long.is_empty() && args.contains(long);
            let by_env = var.as_ref().is_some_and(|v| env.contains(v));
            !by_flag && !by_env
        })
        .map(|(long, var)| format!("--{long} ({})", var.as_deref().unwrap_or("no env")))
        .collect();
    assert!(
        missing.is_empty(),
        "operator flags without a chart value (add one to values.yaml and the \
         Deployment's args or env): {missing:?}"
    );
}

/// `logLevel` sets every component's `RUST_LOG`; each component's own `logLevel`
/// overrides it, and `operator.logFilter` replaces the operator's whole filter.
#[test]
fn log_level_is_one_value_with_an_override_per_component() {
    // (workload/container, RUST_LOG) of every container the chart runs.
    let levels = |args: &[&str]| -> BTreeMap<String, String> {
        let mut all = vec!["--set", "reapOnUninstall.enabled=true"];
        all.extend_from_slice(args);
        let mut out = BTreeMap::new();
        for d in render(&all) {
            let spec = &d["spec"]["template"]["spec"];
            for c in spec["containers"].as_array().into_iter().flatten() {
                let rust_log = c["env"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|e| e["name"] == "RUST_LOG")
                    .map(|e| e["value"].as_str().unwrap().to_string())
                    .collect::<Vec<_>>();
                assert_eq!(rust_log.len(), 1, "{}: {rust_log:?}", name(&d));
                let component = match c["name"].as_str().unwrap() {
                    "netns-broker" => "broker",
                    "agent" | "operator" => c["name"].as_str().unwrap(),
                    _ if is_hook(&d) => "hook",
                    other => panic!("a container the test does not know: {other}"),
                };
                out.insert(component.to_string(), rust_log[0].clone());
            }
        }
        out
    };
    let expect = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(c, l)| (c.to_string(), l.to_string()))
            .collect()
    };
    // The defaults: what the binaries default to without RUST_LOG.
    assert_eq!(
        levels(&[]),
        expect(&[
            ("agent", "info"),
            ("broker", "info"),
            ("operator", "info,kube=warn"),
            ("hook", "info,kube=warn"),
        ])
    );
    assert_eq!(
        levels(&["--set", "logLevel=debug"]),
        expect(&[
            ("agent", "debug"),
            ("broker", "debug"),
            ("operator", "debug,kube=warn"),
            ("hook", "debug,kube=warn"),
        ])
    );
    assert_eq!(
        levels(&[
            "--set",
            "logLevel=warn",
            "--set",
            "migrationAgent.agent.logLevel=trace",
            "--set",
            "operator.logLevel=error",
        ]),
        expect(&[
            ("agent", "trace"),
            ("broker", "warn"),
            ("operator", "error"),
            ("hook", "error"),
        ])
    );
    assert_eq!(
        levels(&[
            "--set",
            "migrationAgent.broker.logLevel=debug",
            "--set",
            "operator.logFilter=info\\,podmotion_operator=debug",
        ]),
        expect(&[
            ("agent", "info"),
            ("broker", "debug"),
            ("operator", "info,podmotion_operator=debug"),
            ("hook", "info,podmotion_operator=debug"),
        ])
    );
}

#[test]
fn values_schema_rejects_bad_values() {
    assert!(try_render("pm", "ns", &[]).is_ok());
    for bad in [
        "operator.logFormat=xml",
        "logLevel=verbose",
        "operator.logLevel=INFO",
        "migrationAgent.agent.logLevel=loud",
        "migrationAgent.broker.logLevel=off",
        "operator.controllers={migration,ingest}",
        "operator.httpPort=0",
        "operator.leaderElection.leaseSeconds=1",
        "image.digest=latest",
        "agents.podSecurityEnforce=lenient",
        "migrationAgent.grpcPort=70000",
        "attachment.jobPrefix=Not_A_Name",
        // The attach agent's control API port.
        "attachment.metricsPort=8400",
        "operator.unknownKey=1",
        "metrics.serviceMonitor.enabled=yes",
        "metrics.prometheusRule.enabled=always",
        "metrics.dashboard.enabled=auto",
        "operator.podDisruptionBudget.maxUnavailable=0",
        "argocd.resourceCustomizations.enabled=auto",
    ] {
        let res = try_render("pm", "ns", &["--set", bad]);
        assert!(res.is_err(), "{bad} was accepted");
        assert!(
            res.unwrap_err().contains("schema"),
            "{bad}: rejected, but not by values.schema.json"
        );
    }
}

/// The sample names the operator and the migration agent export, from the `# TYPE`
/// lines of their own registries (operator/src/metrics.rs,
/// executors/agent/src/metrics.rs) with the suffixes a scrape shows: `_total` for a
/// counter, `_bucket`/`_sum`/`_count` for a histogram. A labelled family shows its
/// `# TYPE` only once it has a child, so each one gets one here (a new family needs a
/// line too).
fn exported_metric_names() -> BTreeSet<String> {
    let mut names = operator_metric_names();
    names.extend(agent_metric_names());
    names.extend(attach_metric_names());
    names
}

/// The attach agent's registry (executors/attach/src/metrics.rs): every family is
/// seeded at 0, so a fresh registry names them all.
fn attach_metric_names() -> BTreeSet<String> {
    let m = podmotion_attach::metrics::AttachMetrics::new();
    m.api_request("healthz", 200);
    sample_names(&m.encode(None))
}

fn agent_metric_names() -> BTreeSet<String> {
    use podmotion_agent::metrics::AgentMetrics;
    use podmotion_wire::agent::{MigrationStatus, Phase, Role, Timings};
    let m = AgentMetrics::new();
    let committed = MigrationStatus {
        migration_uid: "u".into(),
        role: Role::Source as i32,
        phase: Phase::Committed as i32,
        timings: Some(Timings {
            freeze_started_us: 1,
            ..Default::default()
        }),
        ..Default::default()
    };
    m.call(
        "Commit",
        std::time::Duration::from_millis(1),
        Ok(Some(&committed)),
    );
    m.broker_op("resume", Ok(()));
    sample_names(&m.encode(&[]))
}

fn operator_metric_names() -> BTreeSet<String> {
    use podmotion_operator::metrics::{ApiRequestLabels, Metrics, OutcomeLabels};
    let m = Metrics::new();
    m.reconcile("migration").done(Err("ApiError"));
    m.api_requests
        .get_or_create(&ApiRequestLabels {
            verb: "list",
            resource: "pods",
            subresource: "",
            code: 200,
        })
        .inc();
    m.migrations
        .get_or_create(&OutcomeLabels { outcome: "Failed" })
        .inc();
    m.attachment_job_changes
        .get_or_create(&OutcomeLabels {
            outcome: "Replaced",
        })
        .inc();
    sample_names(&m.encode())
}

/// The sample names of a text exposition, from its `# TYPE` lines.
fn sample_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE <name> <kind>");
        match kind {
            "counter" => {
                names.insert(format!("{}_total", name.trim_end_matches("_total")));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

/// Every `podmotion_…` metric name in a PromQL expression.
fn podmotion_metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut i = 0;
    while let Some(at) = expr[i..].find("podmotion_") {
        let start = i + at;
        let mut end = start;
        while end < bytes.len() && word(bytes[end]) {
            end += 1;
        }
        if start == 0 || !word(bytes[start - 1]) {
            out.insert(expr[start..end].to_string());
        }
        i = end.max(start + 1);
    }
    out
}

/// Every PromQL string of a Grafana dashboard: panel targets (`expr`) and template
/// variable queries (`query`, `definition`), however deeply nested (rows).
fn dashboard_queries(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "query" | "definition", Value::String(q)) => out.push(q.clone()),
                    _ => dashboard_queries(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| dashboard_queries(v, out)),
        _ => {}
    }
}

fn alert_rules(docs: &[Value]) -> Vec<Value> {
    of_kind(docs, "PrometheusRule")
        .iter()
        .flat_map(|r| r["spec"]["groups"].as_array().cloned().unwrap_or_default())
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn dashboard(docs: &[Value]) -> Value {
    let cm = of_kind(docs, "ConfigMap")
        .into_iter()
        .find(|c| name(c).ends_with("-dashboard"))
        .expect("dashboard ConfigMap rendered");
    serde_json::from_str(
        cm["data"]["podmotion.json"]
            .as_str()
            .expect("podmotion.json"),
    )
    .expect("the dashboard is JSON")
}

#[test]
fn podmotion_metric_names_are_found_in_promql_and_nothing_else_is() {
    assert_eq!(
        podmotion_metric_names(
            r#"sum by (le) (rate(podmotion_a_bucket{x="podmotion_not_a_label_value"}[5m])) / podmotion_b:rate5m + xpodmotion_c"#
        ),
        [
            "podmotion_a_bucket",
            "podmotion_b:rate5m",
            "podmotion_not_a_label_value"
        ]
        .into_iter()
        .map(String::from)
        .collect()
    );
    // The operator's and the agent's registries are read, with the suffixes a scrape
    // shows.
    let exported = exported_metric_names();
    for name in [
        "podmotion_reconciles_total",
        "podmotion_reconcile_duration_seconds_bucket",
        "podmotion_reconciles_in_flight",
        "podmotion_runner_pools",
        "podmotion_agent_calls_total",
        "podmotion_agent_source_freeze_seconds_bucket",
        "podmotion_agent_frozen_sources_over_budget",
        "podmotion_agent_broker_ops_total",
    ] {
        assert!(exported.contains(name), "{name} not in {exported:?}");
    }
    assert!(!exported.contains("podmotion_reconciles"));
}

/// The alerts and the dashboard use only metrics the operator or the migration agent
/// exports: renaming or removing a metric in operator/src/metrics.rs or
/// executors/agent/src/metrics.rs fails here, not silently in Prometheus.
#[test]
fn every_metric_an_alert_or_the_dashboard_uses_is_exported_by_the_operator_or_an_agent() {
    let exported = exported_metric_names();
    let docs = render(&every_toggle_on());
    let rules = alert_rules(&docs);
    let alerts: BTreeSet<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    for want in [
        "PodMotionOperatorDown",
        "PodMotionAgentDown",
        "PodMotionReconcileErrors",
        "PodMotionReconcileQueueSaturated",
        "PodMotionMigrationsFailing",
        "PodMotionAttachmentJobsReplaced",
        "PodMotionRunnerPoolDegraded",
        "PodMotionSourceFrozenOverBudget",
        "PodMotionMigrationStuck",
        "PodMotionFreezeWatchdogResumed",
        "PodMotionAttachForwardFailing",
        "PodMotionAttachInterceptUnanswered",
    ] {
        assert!(alerts.contains(want), "alert {want} missing: {alerts:?}");
    }
    let mut missing = Vec::new();
    let mut used = BTreeSet::new();
    for r in &rules {
        let expr = r["expr"].as_str().expect("every rule has an expr");
        for m in podmotion_metric_names(expr) {
            if !exported.contains(&m) {
                missing.push(format!("alert {}: {m}", r["alert"]));
            }
            used.insert(m);
        }
    }
    let mut queries = Vec::new();
    dashboard_queries(&dashboard(&docs), &mut queries);
    assert!(
        queries.len() >= 10,
        "dashboard has {} queries",
        queries.len()
    );
    for q in &queries {
        for m in podmotion_metric_names(q) {
            if !exported.contains(&m) {
                missing.push(format!("dashboard: {m} (in {q})"));
            }
            used.insert(m);
        }
    }
    assert!(
        missing.is_empty(),
        "metrics neither the operator (operator/src/metrics.rs), the migration agent \
         (executors/agent/src/metrics.rs) nor the attach agent \
         (executors/attach/src/metrics.rs) exports: {missing:#?}"
    );
    assert!(used.len() >= 8, "only {used:?} used");
    // The agents' metrics are used too, not only the operator's.
    assert!(
        used.iter()
            .filter(|m| agent_metric_names().contains(*m))
            .count()
            >= 8,
        "{used:?}"
    );
    let attach = attach_metric_names();
    assert!(
        used.iter().filter(|m| attach.contains(*m)).count() >= 8,
        "{used:?}"
    );
}

/// The migration agents' PodMonitor follows the same false/true/"auto" rule as the
/// ServiceMonitor, selects the agent pods' `metrics` port in their namespace, and the
/// agents' NetworkPolicy lets the operator's scrapers reach that port.
#[test]
fn the_agents_pod_monitor_selects_their_metrics_port_and_the_policy_admits_the_scrape() {
    let api = prometheus_api(&[]);
    assert!(of_kind(&render(&[]), "PodMonitor").is_empty());
    // The migration agents' and the attach agents'.
    assert_eq!(of_kind(&render(&api), "PodMonitor").len(), 2);
    let off = prometheus_api(&["--set", "metrics.podMonitor.enabled=false"]);
    assert!(of_kind(&render(&off), "PodMonitor").is_empty());
    let no_agents = [
        "--set",
        "metrics.podMonitor.enabled=true,migrationAgent.enabled=false",
        "--set",
        "operator.controllers={runner-pool}",
    ];
    assert!(of_kind(&render(&no_agents), "PodMonitor").is_empty());

    let docs = render(&[
        "--set",
        "metrics.podMonitor.enabled=true,migrationAgent.metricsPort=9191",
    ]);
    let pm = of_kind(&docs, "PodMonitor")
        .into_iter()
        .find(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "migration-agent")
        .expect("the migration agents' PodMonitor");
    let ds = of_kind(&docs, "DaemonSet")
        .into_iter()
        .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "migration-agent")
        .expect("agent DaemonSet");
    assert_eq!(pm["metadata"]["namespace"], ds["metadata"]["namespace"]);
    assert_eq!(
        pm["spec"]["namespaceSelector"]["matchNames"],
        json!([ds["metadata"]["namespace"]])
    );
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "agent pod label {k}");
    }
    let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    let agent = &ds["spec"]["template"]["spec"]["containers"][0];
    let port = agent["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == endpoint["port"])
        .unwrap_or_else(|| {
            panic!(
                "PodMonitor port {} is not a port of the agent",
                endpoint["port"]
            )
        });
    assert_eq!(port["containerPort"], 9191);
    assert!(
        strs(&agent["args"]).contains(&"--metrics-listen=0.0.0.0:9191"),
        "{}",
        agent["args"]
    );
    // The agents' policy admits the scrapers (operator.networkPolicy.metricsFrom) on
    // the metrics port, and only there.
    let np = of_kind(&docs, "NetworkPolicy")
        .into_iter()
        .find(|n| {
            n["metadata"]["namespace"] == ds["metadata"]["namespace"]
                && n["metadata"]["labels"]["app.kubernetes.io/component"] == "migration-agent"
        })
        .expect("agents' NetworkPolicy");
    let scrape = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["ports"][0]["port"] == 9191)
        .expect("an ingress rule for the metrics port");
    assert_eq!(
        scrape["from"],
        json!([{"namespaceSelector": {"matchLabels": {"podmotion.io/metrics-scraper": "true"}}}])
    );
}

/// PodMotionAgentDown watches the job the agents' PodMonitor makes
/// (`<namespace>/<PodMonitor name>`, prometheus-operator's naming), one series per agent
/// pod, and is left out when nothing scrapes the agents.
#[test]
fn the_agent_down_alert_watches_the_job_of_the_agents_pod_monitor() {
    // "auto" with the API: the PodMonitor and the rules render.
    let docs = render(&prometheus_api(&[]));
    let pm = of_kind(&docs, "PodMonitor")
        .into_iter()
        .find(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "migration-agent")
        .expect("the migration agents' PodMonitor");
    let ns = pm["metadata"]["namespace"].as_str().unwrap();
    let down = alert_rules(&docs)
        .into_iter()
        .find(|r| r["alert"] == "PodMotionAgentDown")
        .expect("PodMotionAgentDown");
    assert_eq!(
        down["expr"],
        format!("up{{job=\"{ns}/{}\", namespace=\"{ns}\"}} == 0", name(pm)),
        "{down}"
    );
    assert_eq!(down["for"], "10m");
    assert_eq!(down["labels"]["severity"], "warning");
    let summary = down["annotations"]["summary"].as_str().unwrap();
    assert!(summary.contains("{{ $labels.pod }}"), "{summary}");
    assert!(
        down["annotations"]["runbook_url"]
            .as_str()
            .unwrap()
            .ends_with("docs/metrics.md#podmotionagentdown"),
        "{down}"
    );
    // Its runbook section exists.
    let metrics_md = std::fs::read_to_string(repo_root().join("docs/metrics.md")).unwrap();
    assert!(metrics_md.contains("### PodMotionAgentDown"));

    // No PodMonitor (turned off, or no agents): no alert on a job nothing fills.
    for off in [
        "metrics.prometheusRule.enabled=true,metrics.podMonitor.enabled=false",
        "metrics.prometheusRule.enabled=true,migrationAgent.enabled=false,operator.controllers={runner-pool}",
    ] {
        let docs = render(&["--set", off]);
        let alerts: Vec<Value> = alert_rules(&docs)
            .into_iter()
            .map(|r| r["alert"].clone())
            .collect();
        assert!(!alerts.is_empty(), "{off}: no rules at all");
        assert!(
            !alerts.contains(&json!("PodMotionAgentDown")),
            "{off}: {alerts:?}"
        );
    }
}

/// An attachment Job as the operator renders it with `settings`, as JSON.
fn attach_job(settings: podmotion_operator::attachment::render::Settings) -> Value {
    use podmotion_api::attachment::{AgentSettings, WorkloadKind, WorkloadRef};
    use podmotion_operator::attachment::PodView;
    use podmotion_operator::attachment::render::{AgentProfile, AgentTarget, job};
    let w = WorkloadRef {
        kind: WorkloadKind::Deployment,
        name: "web".into(),
    };
    let agent = AgentSettings::default();
    let p = PodView::from_pod(
        &serde_json::from_value(json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u-1"},
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "app"}]},
        }))
        .unwrap(),
    );
    let ids = std::collections::BTreeMap::from([("app".to_string(), "containerd://a".to_string())]);
    let names = ["app".to_string()];
    let (job, _) = job(
        &settings,
        &AgentProfile {
            namespace: "shop",
            workload: &w,
            agent: &agent,
        },
        &AgentTarget {
            pod: &p,
            containers: &names,
            container_ids: &ids,
            ports: &[8080],
        },
        "pm-agent-1",
    );
    serde_json::to_value(&job).unwrap()
}

/// The attach agents' PodMonitor selects the pods the operator renders (their labels
/// and their `metrics` port, on the chart's `attachment.metricsPort` as the operator
/// is told it), only when the attachment controller runs, and the chart's policy
/// admits the operator's scrapers on that port alone.
#[test]
fn the_attach_agents_pod_monitor_selects_the_operators_jobs_and_the_policy_admits_the_scrape() {
    use podmotion_operator::attachment::render as attach;
    let only_migration = prometheus_api(&["--set", "operator.controllers={migration}"]);
    let docs = render(&only_migration);
    assert!(
        of_kind(&docs, "PodMonitor")
            .iter()
            .all(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] != "node-agent"),
        "an attach PodMonitor without the attachment controller"
    );
    assert!(
        !of_kind(&docs, "NetworkPolicy")
            .iter()
            .any(|n| name(n).ends_with("-attach-agent-metrics"))
    );

    let docs = render(&[
        "--set",
        "metrics.podMonitor.enabled=true,attachment.metricsPort=9393",
    ]);
    let pm = of_kind(&docs, "PodMonitor")
        .into_iter()
        .find(|p| p["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent")
        .expect("the attach agents' PodMonitor");
    // The port the operator is told, as the operator reads it.
    let operator = of_kind(&docs, "Deployment")[0];
    let env = &operator["spec"]["template"]["spec"]["containers"][0]["env"];
    let env_of = |k: &str| {
        env.as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == k)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("{k} not in the operator's env"))
            .to_string()
    };
    let port: i32 = env_of("PODMOTION_ATTACHMENT_METRICS_PORT").parse().unwrap();
    assert_eq!(port, 9393);
    let agents_ns = env_of("PODMOTION_ATTACHMENT_NAMESPACE");
    assert_eq!(pm["metadata"]["namespace"], agents_ns.as_str());
    assert_eq!(
        pm["spec"]["namespaceSelector"]["matchNames"],
        json!([agents_ns])
    );
    // A Job as the operator renders it with those settings.
    let job = attach_job(attach::Settings {
        namespace: agents_ns.clone(),
        metrics_port: port,
        ..attach::Settings::default()
    });
    assert_eq!(job["metadata"]["namespace"], agents_ns.as_str());
    let pod_labels = &job["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&pod_labels[k], v, "attach agent pod label {k}");
    }
    let endpoint = &pm["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    let named = container["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == endpoint["port"])
        .expect("the PodMonitor's port is a port of the attach agent");
    assert_eq!(named["containerPort"], 9393);
    // The operator's own policy denies all ingress to these pods; the chart's admits
    // the scrapers on the metrics port, and nothing else.
    let np = of_kind(&docs, "NetworkPolicy")
        .into_iter()
        .find(|n| name(n).ends_with("-attach-agent-metrics"))
        .expect("the attach agents' metrics policy");
    assert_eq!(np["metadata"]["namespace"], agents_ns.as_str());
    for (k, v) in np["spec"]["podSelector"]["matchLabels"]
        .as_object()
        .unwrap()
    {
        assert_eq!(
            &pod_labels[k], v,
            "policy selects the attach agent pods: {k}"
        );
    }
    assert_eq!(np["spec"]["policyTypes"], json!(["Ingress"]));
    assert_eq!(
        np["spec"]["ingress"],
        json!([{
            "ports": [{"port": 9393, "protocol": "TCP"}],
            "from": [{"namespaceSelector": {"matchLabels": {"podmotion.io/metrics-scraper": "true"}}}],
        }])
    );
    assert!(np["spec"]["egress"].is_null());
}

/// One value sets the log format of every component the chart runs; the deprecated
/// `operator.logFormat` still overrides the operator's.
#[test]
fn log_format_is_one_value_for_every_component() {
    let formats = |docs: &[Value]| -> Vec<(String, String)> {
        let mut out = Vec::new();
        for d in docs {
            let spec = &d["spec"]["template"]["spec"];
            for c in spec["containers"].as_array().into_iter().flatten() {
                let f = strs(&c["args"])
                    .into_iter()
                    .find_map(|a| a.strip_prefix("--log-format="))
                    .unwrap_or("<none>")
                    .to_string();
                out.push((format!("{}/{}", name(d), c["name"].as_str().unwrap()), f));
            }
        }
        out
    };
    let all = formats(&render(&["--set", "reapOnUninstall.enabled=true"]));
    // operator, reap hook, agent and broker.
    assert!(all.len() >= 4, "{all:?}");
    for (c, f) in &all {
        assert_eq!(f, "json", "{c}");
    }
    let text = formats(&render(&["--set", "logFormat=text"]));
    for (c, f) in &text {
        assert_eq!(f, "text", "{c}");
    }
    let mixed = formats(&render(&["--set", "operator.logFormat=text"]));
    for (c, f) in &mixed {
        let operator_image = c.contains("reap") || !c.contains("agent");
        assert_eq!(f, if operator_image { "text" } else { "json" }, "{c}");
    }
    // The operator passes its own format on to the pods it renders (attachment Jobs
    // here; the RunnerPool preflight in operator/core/src/runner_pool/tests.rs).
    let (_, operator_format) = text
        .iter()
        .find(|(c, _)| c.ends_with("/operator"))
        .expect("the operator's container");
    let job = attach_job(podmotion_operator::attachment::render::Settings {
        log_format: operator_format.parse().unwrap(),
        ..Default::default()
    });
    let env = &job["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .unwrap()
            .contains(&json!({"name": "PODMOTION_LOG_FORMAT", "value": "text"})),
        "{env}"
    );
}

#[test]
fn prometheus_operator_objects_render_when_asked_for_or_when_auto_finds_the_api() {
    let kinds = |docs: &[Value]| -> (usize, usize) {
        (
            of_kind(docs, "ServiceMonitor").len(),
            of_kind(docs, "PrometheusRule").len(),
        )
    };
    let api = prometheus_api(&[]);
    // Default "auto": nothing without the API, both with it.
    assert_eq!(kinds(&render(&[])), (0, 0));
    assert_eq!(kinds(&render(&api)), (1, 1));
    // The group alone is not the kind: a cluster may serve monitoring.coreos.com/v1
    // without PrometheusRule (a ServiceMonitor-only install of the CRDs), and "auto"
    // renders only the kinds it serves.
    assert_eq!(
        kinds(&render(&["--api-versions", "monitoring.coreos.com/v1"])),
        (0, 0)
    );
    let only_sm = [
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
    ];
    let docs = render(&only_sm);
    assert_eq!(kinds(&docs), (1, 0));
    assert!(of_kind(&docs, "PodMonitor").is_empty());
    let off = prometheus_api(&[
        "--set",
        "metrics.serviceMonitor.enabled=false,metrics.prometheusRule.enabled=false",
    ]);
    assert_eq!(kinds(&render(&off)), (0, 0));
    let on = [
        "--set",
        "metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true",
    ];
    let docs = render(&on);
    assert_eq!(kinds(&docs), (1, 1));

    // The ServiceMonitor selects the metrics Service and its port, in its namespace.
    let sm = of_kind(&docs, "ServiceMonitor")[0];
    let svc = of_kind(&docs, "Service")
        .into_iter()
        .find(|s| name(s).ends_with("-metrics"))
        .expect("metrics Service");
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_object().unwrap() {
        assert_eq!(&svc["metadata"]["labels"][k], v, "Service label {k}");
    }
    assert_eq!(
        sm["spec"]["namespaceSelector"]["matchNames"],
        json!([svc["metadata"]["namespace"]])
    );
    let port = &sm["spec"]["endpoints"][0]["port"];
    assert!(
        svc["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| &p["name"] == port),
        "ServiceMonitor port {port} is not a port of the Service"
    );
    // The OperatorDown alert watches the job the ServiceMonitor creates.
    let down = alert_rules(&docs)
        .into_iter()
        .find(|r| r["alert"] == "PodMotionOperatorDown")
        .expect("PodMotionOperatorDown");
    assert!(
        down["expr"]
            .as_str()
            .unwrap()
            .contains(&format!("job=\"{}\"", name(svc))),
        "{down}"
    );

    // No Service: "true" refuses to render, "auto" leaves the ServiceMonitor (and the
    // alert on its job) out.
    let err = try_render(
        "pm",
        "podmotion-system",
        &[
            "--set",
            "metrics.serviceMonitor.enabled=true,operator.metricsService.enabled=false",
        ],
    )
    .unwrap_err();
    assert!(err.contains("operator.metricsService.enabled"), "{err}");
    let docs = render(&prometheus_api(&[
        "--set",
        "operator.metricsService.enabled=false",
    ]));
    assert_eq!(kinds(&docs), (0, 1));
    assert!(
        alert_rules(&docs)
            .iter()
            .all(|r| r["alert"] != "PodMotionOperatorDown")
    );
    // Alerts of a controller that does not run are left out.
    let docs = render(&[
        "--set",
        "metrics.prometheusRule.enabled=true,operator.controllers={runner-pool}",
    ]);
    let alerts: Vec<Value> = alert_rules(&docs)
        .into_iter()
        .map(|r| r["alert"].clone())
        .collect();
    assert!(
        !alerts.contains(&json!("PodMotionMigrationsFailing")),
        "{alerts:?}"
    );
    assert!(
        !alerts.contains(&json!("PodMotionAttachmentJobsReplaced")),
        "{alerts:?}"
    );
}

#[test]
fn the_dashboard_configmap_carries_the_sidecar_label_and_the_file_unchanged() {
    assert!(
        of_kind(&render(&[]), "ConfigMap")
            .iter()
            .all(|c| !name(c).ends_with("-dashboard")),
        "dashboard rendered by default"
    );
    let docs = render(&[
        "--set",
        "metrics.dashboard.enabled=true,metrics.dashboard.namespace=monitoring",
    ]);
    let cm = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| name(c).ends_with("-dashboard"))
        .unwrap();
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    let file =
        std::fs::read_to_string(chart_dir().join("files/dashboards/podmotion.json")).unwrap();
    assert_eq!(
        cm["data"]["podmotion.json"].as_str().unwrap(),
        file.trim_end_matches('\n')
    );
    let d = dashboard(&docs);
    assert_eq!(d["uid"], "podmotion-operator");
}

/// The Argo CD switch emits the repository's health scripts (the files
/// e2e/tests/argocd_health.rs runs), byte for byte, under argocd-cm's keys.
#[test]
fn argocd_customizations_are_the_tested_health_scripts_under_argocd_cm_keys() {
    assert!(
        of_kind(&render(&[]), "ConfigMap")
            .iter()
            .all(|c| !name(c).ends_with("-argocd-cm"))
    );
    let docs = render(&[
        "--set",
        "argocd.resourceCustomizations.enabled=true,argocd.resourceCustomizations.namespace=argocd",
    ]);
    let cm = of_kind(&docs, "ConfigMap")
        .into_iter()
        .find(|c| name(c).ends_with("-argocd-cm"))
        .expect("argocd-cm snippet rendered");
    assert_eq!(cm["metadata"]["namespace"], "argocd");
    let data = cm["data"].as_object().unwrap();
    let mut want = BTreeSet::new();
    for kind in ["PodMigration", "NodeAgentAttachment", "RunnerPool"] {
        let key = format!("resource.customizations.health.podmotion.io_{kind}");
        let script = std::fs::read_to_string(
            repo_root()
                .join("argocd/resource_customizations/podmotion.io")
                .join(kind)
                .join("health.lua"),
        )
        .unwrap();
        assert_eq!(
            data.get(&key).and_then(Value::as_str),
            Some(script.as_str()),
            "{key} is not argocd/resource_customizations/podmotion.io/{kind}/health.lua"
        );
        want.insert(key);
    }
    assert_eq!(data.keys().cloned().collect::<BTreeSet<_>>(), want);
}

#[test]
fn the_eviction_webhook_renders_only_when_enabled_without_a_ca_bundle_and_never_for_system_namespaces()
 {
    let off = render(&[]);
    assert!(of_kind(&off, "ValidatingWebhookConfiguration").is_empty());
    let on = render(&[
        "--set",
        "eviction.enabled=true,eviction.excludeNamespaces={batch},eviction.failurePolicy=Ignore",
    ]);
    let vwc = of_kind(&on, "ValidatingWebhookConfiguration");
    assert_eq!(vwc.len(), 1);
    let hooks = vwc[0]["webhooks"].as_array().unwrap();
    assert_eq!(hooks.len(), 1);
    let w = &hooks[0];
    assert!(
        w["clientConfig"].get("caBundle").is_none(),
        "the operator writes the caBundle at run time: {w}"
    );
    assert_eq!(w["failurePolicy"], "Ignore");
    assert_eq!(w["sideEffects"], "NoneOnDryRun");
    let t = w["timeoutSeconds"].as_i64().unwrap();
    assert!((1..=10).contains(&t), "{t}");
    assert_eq!(w["rules"][0]["resources"], json!(["pods/eviction"]));
    assert_eq!(w["rules"][0]["operations"], json!(["CREATE"]));
    let expr = &w["namespaceSelector"]["matchExpressions"][0];
    assert_eq!(expr["key"], "kubernetes.io/metadata.name");
    assert_eq!(expr["operator"], "NotIn");
    let excluded = strs(&expr["values"]);
    for ns in [
        "kube-system",
        "podmotion-system",
        "podmotion-system-agents",
        "batch",
    ] {
        assert!(excluded.contains(&ns), "{ns} not excluded: {excluded:?}");
    }
    // The Service reaches every replica (not only the leader) on the webhook port.
    let svc_name = w["clientConfig"]["service"]["name"].as_str().unwrap();
    let svc = of_kind(&on, "Service")
        .into_iter()
        .find(|s| name(s) == svc_name)
        .expect("the webhook's Service");
    assert_eq!(svc["spec"]["ports"][0]["targetPort"], 9443);
    let deploy = of_kind(&on, "Deployment")[0];
    let env = deploy["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap();
    let get = |n: &str| {
        env.iter()
            .find(|e| e["name"] == n)
            .map(|e| e["value"].clone())
    };
    assert_eq!(get("PODMOTION_EVICTION_WEBHOOK"), Some(json!("true")));
    // An eviction's PodMigration gets the installer's freeze budget (5 s by default).
    assert_eq!(
        get("PODMOTION_EVICTION_FREEZE_BUDGET_MILLIS"),
        Some(json!("5000"))
    );
    assert_eq!(
        get("PODMOTION_EVICTION_WEBHOOK_CONFIGURATION"),
        Some(json!(name(vwc[0])))
    );
    let names = get("PODMOTION_EVICTION_WEBHOOK_NAMES").unwrap();
    assert!(
        names
            .as_str()
            .unwrap()
            .split(',')
            .any(|n| n == format!("{svc_name}.podmotion-system.svc")),
        "{names}"
    );
    // The API server reaches the webhook through the operator's NetworkPolicy.
    let np = of_kind(&on, "NetworkPolicy")
        .into_iter()
        .find(|p| name(p).ends_with("-operator"))
        .unwrap();
    let ports: Vec<i64> = np["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r["ports"].as_array().unwrap().iter())
        .filter_map(|p| p["port"].as_i64())
        .collect();
    assert!(ports.contains(&9443), "{ports:?}");
}

/// The eviction-strategy policy renders with the webhook only, checks pods and every
/// kind of pod template, and selects exactly the webhook's namespaces.
#[test]
fn the_eviction_strategy_policy_follows_the_webhook() {
    let policy = |out: &[Value]| {
        of_kind(out, "ValidatingAdmissionPolicy")
            .into_iter()
            .find(|p| name(p).ends_with("-eviction-strategy"))
            .cloned()
    };
    assert!(policy(&render(&[])).is_none());
    for set in [
        "eviction.enabled=true",
        "eviction.enabled=true,migration.watchNamespace=shop,eviction.excludeNamespaces={batch}",
    ] {
        let out = render(&["--set", set]);
        let p = policy(&out).expect(set);
        let vwc = of_kind(&out, "ValidatingWebhookConfiguration")[0];
        assert_eq!(
            p["spec"]["matchConstraints"]["namespaceSelector"],
            vwc["webhooks"][0]["namespaceSelector"],
            "{set}"
        );
        let resources: BTreeSet<String> = p["spec"]["matchConstraints"]["resourceRules"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| strs(&r["resources"]))
            .map(str::to_string)
            .collect();
        for r in [
            "pods",
            "deployments",
            "statefulsets",
            "replicasets",
            "daemonsets",
            "jobs",
            "cronjobs",
        ] {
            assert!(resources.contains(r), "{set}: {r} not checked");
        }
        let expr = p["spec"]["validations"][0]["expression"].as_str().unwrap();
        for v in ["'LiveMigrate'", "'LiveMigrateIfPossible'", "'Evict'"] {
            assert!(expr.contains(v), "{expr}");
        }
        let binding = of_kind(&out, "ValidatingAdmissionPolicyBinding")
            .into_iter()
            .find(|b| b["spec"]["policyName"] == p["metadata"]["name"])
            .expect("bound");
        assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    }
}

#[test]
fn a_scoped_release_s_eviction_webhook_selects_only_its_watched_namespace() {
    // A PodMigration made in a namespace the release's controller does not watch would
    // never run, and the eviction it answered would wait forever (429 on every retry).
    let on = render(&[
        "--set",
        "eviction.enabled=true,migration.watchNamespace=shop",
    ]);
    let vwc = of_kind(&on, "ValidatingWebhookConfiguration");
    let exprs = vwc[0]["webhooks"][0]["namespaceSelector"]["matchExpressions"]
        .as_array()
        .unwrap();
    assert_eq!(exprs.len(), 2, "{exprs:?}");
    assert_eq!(exprs[0]["key"], "kubernetes.io/metadata.name");
    assert_eq!(exprs[0]["operator"], "In");
    assert_eq!(exprs[0]["values"], json!(["shop"]));
    // The system namespaces stay excluded (the expressions are ANDed).
    assert_eq!(exprs[1]["operator"], "NotIn");
    assert!(strs(&exprs[1]["values"]).contains(&"kube-system"));
}

#[test]
fn the_eviction_webhook_may_create_migrations_and_patch_only_its_own_configuration() {
    let find = |docs: &[Value], group: &str, resource: &str| -> Vec<Value> {
        rules(docs)
            .into_iter()
            .filter(|(_, _, r)| {
                strs(&r["apiGroups"]).contains(&group) && strs(&r["resources"]).contains(&resource)
            })
            .map(|(_, _, r)| r)
            .collect()
    };
    let off = render(&[]);
    assert!(
        find(
            &off,
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations"
        )
        .is_empty()
    );
    let creates = |docs: &[Value]| {
        find(docs, "podmotion.io", "podmigrations")
            .iter()
            .any(|r| strs(&r["verbs"]).contains(&"create"))
    };
    assert!(
        !creates(&off),
        "no create of PodMigrations without the webhook"
    );
    let on = render(&["--set", "eviction.enabled=true"]);
    assert!(creates(&on));
    let vwc = find(
        &on,
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
    );
    assert_eq!(vwc.len(), 1);
    assert_eq!(
        strs(&vwc[0]["resourceNames"]),
        vec!["pm-podmotion-eviction"]
    );
    assert_eq!(
        strs(&vwc[0]["verbs"]),
        vec!["get", "list", "watch", "patch"]
    );
    // Without the migration controller and the agents' CA there is nothing to serve with.
    let e = try_render(
        "pm",
        "podmotion-system",
        &[
            "--set",
            "eviction.enabled=true,migrationAgent.enabled=false",
        ],
    )
    .unwrap_err();
    assert!(e.contains("eviction.enabled=true needs"), "{e}");
    let e = try_render(
        "pm",
        "podmotion-system",
        &[
            "--set",
            "eviction.enabled=true,eviction.namespaceDefault.strategy=Always",
        ],
    )
    .unwrap_err();
    assert!(e.contains("strategy"), "{e}");
}

/// A replica evicted by a drain keeps answering through its propagation period, then
/// up to 10 s for the reviews under way (operator/src/graceful.rs): the pod's grace
/// period covers both, so the kubelet's SIGKILL never cuts an answer.
#[test]
fn the_operator_s_grace_period_covers_the_webhook_s_graceful_stop() {
    let grace_and_env = |set: &str| {
        let out = render(&["--set", set]);
        let deploy = of_kind(&out, "Deployment")
            .into_iter()
            .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "operator")
            .expect("the operator Deployment")
            .clone();
        let spec = &deploy["spec"]["template"]["spec"];
        let env = spec["containers"][0]["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "PODMOTION_EVICTION_WEBHOOK_SHUTDOWN_PROPAGATION_SECONDS")
            .map(|e| e["value"].clone());
        (spec["terminationGracePeriodSeconds"].as_i64().unwrap(), env)
    };
    assert_eq!(
        grace_and_env("eviction.enabled=false"),
        (30, Some(json!("10")))
    );
    assert_eq!(
        grace_and_env("eviction.enabled=true"),
        (30, Some(json!("10")))
    );
    assert_eq!(
        grace_and_env("eviction.enabled=true,eviction.shutdownPropagationSeconds=25"),
        (45, Some(json!("25")))
    );
    assert_eq!(
        grace_and_env("eviction.enabled=true,eviction.shutdownPropagationSeconds=0"),
        (30, Some(json!("0")))
    );
}

#[test]
fn bad_eviction_values_are_refused_with_the_value_named() {
    for (set, names) in [
        ("eviction.failurePolicy=Never", "failurePolicy"),
        ("eviction.timeoutSeconds=30", "timeoutSeconds"),
        ("eviction.timeoutSeconds=0", "timeoutSeconds"),
        ("eviction.port=443", "port"),
        ("eviction.namespaceDefault.label=a\\,b", "label"),
        ("eviction.excludeNamespaces[0]=", "excludeNamespaces"),
        ("eviction.colour=blue", "colour"),
        (
            "eviction.shutdownPropagationSeconds=90",
            "shutdownPropagationSeconds",
        ),
        ("eviction.freezeBudgetMillis=5", "freezeBudgetMillis"),
        ("eviction.freezeBudgetMillis=700000", "freezeBudgetMillis"),
    ] {
        let e = try_render(
            "pm",
            "podmotion-system",
            &["--set", &format!("eviction.enabled=true,{set}")],
        )
        .expect_err(set);
        assert!(e.contains(names), "{set}: {e}");
    }
}

#[test]
fn more_than_one_replica_needs_leader_election_and_gets_a_disruption_budget() {
    let err = try_render(
        "pm",
        "podmotion-system",
        &[
            "--set",
            "operator.replicas=2,operator.leaderElection.enabled=false",
        ],
    )
    .unwrap_err();
    assert!(
        err.contains("operator.replicas=2 needs operator.leaderElection.enabled=true"),
        "{err}"
    );
    // One replica without leader election is fine; it gets no budget (it would block
    // every drain).
    let one = render(&["--set", "operator.leaderElection.enabled=false"]);
    assert!(of_kind(&one, "PodDisruptionBudget").is_empty());
    assert!(of_kind(&render(&[]), "PodDisruptionBudget").is_empty());

    let docs = render(&["--set", "operator.replicas=3"]);
    let pdbs = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(pdbs.len(), 1);
    let deploy = of_kind(&docs, "Deployment")[0];
    assert_eq!(pdbs[0]["spec"]["selector"], deploy["spec"]["selector"]);
    assert_eq!(pdbs[0]["spec"]["maxUnavailable"], 1);
    assert_eq!(
        pdbs[0]["metadata"]["namespace"],
        deploy["metadata"]["namespace"]
    );
    let off = render(&[
        "--set",
        "operator.replicas=3,operator.podDisruptionBudget.enabled=false",
    ]);
    assert!(of_kind(&off, "PodDisruptionBudget").is_empty());
}

#[test]
fn operator_spread_and_agent_placement_values_reach_the_pod_templates() {
    let docs = render(&every_toggle_on());
    let deploy = of_kind(&docs, "Deployment")[0];
    let spread = &deploy["spec"]["template"]["spec"]["topologySpreadConstraints"];
    assert_eq!(spread[0]["topologyKey"], "topology.kubernetes.io/zone");
    // No labelSelector given: the operator pods' own.
    assert_eq!(
        spread[0]["labelSelector"]["matchLabels"],
        deploy["spec"]["selector"]["matchLabels"]
    );
    let given = render(&[
        "--set",
        "operator.topologySpreadConstraints[0].maxSkew=1,\
         operator.topologySpreadConstraints[0].topologyKey=kubernetes.io/hostname,\
         operator.topologySpreadConstraints[0].whenUnsatisfiable=DoNotSchedule,\
         operator.topologySpreadConstraints[0].labelSelector.matchLabels.mine=yes",
    ]);
    assert_eq!(
        of_kind(&given, "Deployment")[0]["spec"]["template"]["spec"]["topologySpreadConstraints"]
            [0]["labelSelector"],
        json!({"matchLabels": {"mine": "yes"}})
    );
    let ds = of_kind(&docs, "DaemonSet")[0];
    let tpl = &ds["spec"]["template"];
    assert_eq!(tpl["metadata"]["annotations"]["example.com/scanned"], "yes");
    assert_eq!(
        tpl["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "podmotion.io/migrations"
    );
    // Defaults: none of them.
    let defaults = render(&[]);
    assert!(
        of_kind(&defaults, "Deployment")[0]
            .pointer("/spec/template/spec/topologySpreadConstraints")
            .is_none()
    );
    let ds = of_kind(&defaults, "DaemonSet")[0];
    assert!(ds.pointer("/spec/template/spec/affinity").is_none());
    // Only the chart's own scrape annotations (the metrics port), none of the user's.
    assert_eq!(
        ds["spec"]["template"]["metadata"]["annotations"],
        json!({
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "9090",
            "prometheus.io/path": "/metrics"
        })
    );
}

/// NOTES.txt names only objects the chart renders (it used to point at files that are
/// not in the chart).
#[test]
fn notes_name_only_objects_the_chart_renders() {
    for variant in [vec![], every_toggle_on()] {
        let out = Command::new(helm())
            .args(["install", "pm"])
            .arg(chart_dir())
            .args(["--namespace", "podmotion-system", "--dry-run=client"])
            .args(&variant)
            .output()
            .unwrap();
        let text = output_text(&out);
        assert!(out.status.success(), "{text}");
        let (manifest, notes) = text.split_once("\nNOTES:\n").expect("NOTES in the output");
        let docs = parse_docs(
            manifest
                .split_once("\nMANIFEST:\n")
                .map_or(manifest, |m| m.1),
        );
        let rendered = |kind: &str, ns: &str, n: &str| {
            docs.iter().any(|d| {
                d["kind"]
                    .as_str()
                    .is_some_and(|k| k.eq_ignore_ascii_case(kind))
                    && name(d) == n
                    && d["metadata"]["namespace"].as_str().unwrap_or(ns) == ns
            })
        };
        let mut refs = 0;
        for line in notes.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            for (i, w) in words.iter().enumerate() {
                if *w != "kubectl" {
                    continue;
                }
                let ns = match words.get(i + 1..i + 3) {
                    Some(["-n", ns]) => *ns,
                    _ => continue,
                };
                match words.get(i + 3..) {
                    Some(["get", kind, n, ..]) if !n.starts_with('-') && !n.starts_with('<') => {
                        refs += 1;
                        assert!(
                            rendered(kind, ns, n),
                            "NOTES: {line:?} names no rendered object"
                        );
                    }
                    Some(["rollout", "status", target, ..]) => {
                        let (kind, n) = target.split_once('/').unwrap();
                        refs += 1;
                        assert!(
                            rendered(kind, ns, n),
                            "NOTES: {line:?} names no rendered object"
                        );
                    }
                    _ => {}
                }
            }
        }
        assert!(refs >= 1, "no object references checked in:\n{notes}");
        assert!(
            !notes.contains("examples/"),
            "NOTES point at repository files:\n{notes}"
        );
    }
}

/// The values table of the chart README, generated from values.yaml the way helm-docs
/// does: a `# --` comment (and the `#` lines after it) describes the key below it; a
/// map without one is walked into; the default is the key's value as JSON.
fn values_table() -> String {
    let text = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let values: Value = serde_saphyr::from_str(&text).unwrap();
    let cell = |s: &str| s.replace('|', "\\|");
    let mut rows = vec![
        "| Key | Default | Description |".to_string(),
        "|---|---|---|".to_string(),
    ];
    let mut stack: Vec<(usize, String)> = Vec::new();
    let mut description: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if let Some(rest) = trimmed.strip_prefix("# --") {
            description = Some(rest.trim().to_string());
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix('#') {
            if let Some(d) = description.as_mut() {
                d.push(' ');
                d.push_str(rest.trim());
            }
            continue;
        }
        if trimmed.is_empty() || trimmed.starts_with('-') {
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        let key = key.trim_matches('"').to_string();
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        // Keys inside a value documented as a whole are not rows of their own.
        if stack.iter().any(|(_, k)| k.is_empty()) {
            continue;
        }
        let path: Vec<String> = stack
            .iter()
            .map(|(_, k)| k.clone())
            .chain([key.clone()])
            .collect();
        let value = path.iter().fold(&values, |v, k| &v[k.as_str()]);
        let walk_into = value.as_object().is_some_and(|m| !m.is_empty()) && description.is_none();
        if !walk_into {
            rows.push(format!(
                "| `{}` | `{}` | {} |",
                path.join("."),
                cell(&value.to_string()),
                cell(description.as_deref().unwrap_or(""))
            ));
        }
        // A row's value is documented as a whole: keys under it (a documented map, the
        // items of a list) are not rows of their own (marked by an empty name).
        stack.push((indent, if walk_into { key } else { String::new() }));
        description = None;
    }
    rows.join("\n") + "\n"
}

/// The chart README's values table is the one values.yaml gives (regenerate it with
/// `PODMOTION_WRITE_README=1 cargo test -p podmotion-e2e --test chart chart_readme`).
#[test]
fn chart_readme_lists_every_value_with_its_comment() {
    let path = chart_dir().join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (begin, end) = ("<!-- values:begin -->\n", "<!-- values:end -->");
    let start = readme.find(begin).expect("values:begin marker") + begin.len();
    let stop = readme.find(end).expect("values:end marker");
    let table = values_table();
    if readme[start..stop] != table {
        if std::env::var_os("PODMOTION_WRITE_README").is_some() {
            std::fs::write(
                &path,
                format!("{}{table}{}", &readme[..start], &readme[stop..]),
            )
            .unwrap();
        } else {
            panic!(
                "{} is not what values.yaml gives; run with PODMOTION_WRITE_README=1",
                path.display()
            );
        }
    }
    // Spot checks of the generator itself.
    assert!(
        table.contains("| `operator.replicas` | `1` | Replicas;"),
        "{table}"
    );
    assert!(
        table.contains("| `metrics.dashboard.labels` | `{\"grafana_dashboard\":\"1\"}` |"),
        "{table}"
    );
    assert!(
        table.contains("| `operator.leaderElection.enabled` | `true` |"),
        "{table}"
    );
    assert!(
        !table.contains("grafana_dashboard` |"),
        "a documented map is one row"
    );
    assert!(!table.contains("metricsFrom."), "list items are not rows");
}

// ---------------------------------------------------------------- on the local control plane

fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(kubectl_path().expect("kubectl from the binary cache"));
    cmd.arg("--kubeconfig").arg(kubeconfig_path()).args(args);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("running kubectl");
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn to_yaml_stream(docs: &[&Value]) -> String {
    // JSON documents are YAML documents.
    docs.iter()
        .map(|d| format!("---\n{}\n", serde_json::to_string(d).unwrap()))
        .collect()
}

/// Deletes the cluster-scoped objects of a test release (namespaces clean themselves).
struct ReleaseCleanup(String);

impl Drop for ReleaseCleanup {
    fn drop(&mut self) {
        if std::env::var("PODMOTION_KEEP").as_deref() == Ok("1") {
            return;
        }
        let selector = format!("app.kubernetes.io/instance={}", self.0);
        let _ = kubectl(
            &[
                "delete",
                // Every cluster-scoped kind the chart renders but the CRDs (kept): a
                // policy left behind would go on judging writes in later tests.
                "clusterrole,clusterrolebinding,validatingadmissionpolicy,\
                 validatingadmissionpolicybinding,validatingwebhookconfiguration",
                "-l",
                &selector,
                "--wait=false",
            ],
            None,
        );
    }
}

struct Installed {
    release: String,
    operator_ns: TestNamespace,
    agents_ns: TestNamespace,
    baseline_ns: TestNamespace,
    docs: Vec<Value>,
    _cleanup: ReleaseCleanup,
}

/// Creates the operator's namespace (restricted) and the agents' (privileged), renders
/// the chart for them and applies it for real (hooks excluded).
/// `scoped`: every controller handles only the operator's own (empty) namespace, so an
/// operator started by a test never acts on other tests' objects.
async fn install(prefix: &str, scoped: bool) -> Option<Installed> {
    let operator_ns = TestNamespace::new(prefix, PodSecurity::Restricted).await?;
    let agents_ns = TestNamespace::new(&format!("{prefix}-ag"), PodSecurity::Privileged).await?;
    let baseline_ns = TestNamespace::new(&format!("{prefix}-bl"), PodSecurity::Baseline).await?;
    let release = format!("pm{}", random_suffix());
    let cleanup = ReleaseCleanup(release.clone());
    let mut set = format!(
        "agents.createNamespace=false,agents.namespace={}",
        agents_ns.name
    );
    if scoped {
        let ns = &operator_ns.name;
        set.push_str(&format!(
            ",attachment.watchNamespace={ns},migration.watchNamespace={ns},runnerPool.watchNamespace={ns}"
        ));
    }
    let text = try_render(&release, &operator_ns.name, &["--set", &set])
        .unwrap_or_else(|e| panic!("helm template: {e}"));
    let docs = parse_docs(&text);

    // 1. Server-side dry-run of everything, hooks included.
    let all: Vec<&Value> = docs.iter().collect();
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=helm",
            "--dry-run=server",
            "-f",
            "-",
        ],
        Some(&to_yaml_stream(&all)),
    );
    assert!(
        out.status.success(),
        "server-side dry-run:\n{}",
        output_text(&out)
    );
    let applied = String::from_utf8_lossy(&out.stdout).lines().count();
    assert_eq!(applied, docs.len(), "{}", output_text(&out));

    // 2. For real, without the hook (it runs only on uninstall).
    let release_docs: Vec<&Value> = docs.iter().filter(|d| !is_hook(d)).collect();
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=helm",
            "-f",
            "-",
        ],
        Some(&to_yaml_stream(&release_docs)),
    );
    assert!(out.status.success(), "apply:\n{}", output_text(&out));
    Some(Installed {
        release,
        operator_ns,
        agents_ns,
        baseline_ns,
        docs,
        _cleanup: cleanup,
    })
}

/// A bare Pod with a workload's pod template, for a dry-run create (Pod Security is
/// enforced on pods, not on their workloads).
fn pod_manifest(name: &str, namespace: &str, spec: &Value) -> String {
    serde_json::to_string(&json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }))
    .unwrap()
}

fn dry_run_pod(name: &str, namespace: &str, spec: &Value) -> Output {
    kubectl(
        &["create", "--dry-run=server", "-f", "-"],
        Some(&pod_manifest(name, namespace, spec)),
    )
}

#[tokio::test]
async fn chart_is_admitted_with_a_restricted_operator_namespace_and_privileged_agents() {
    let Some(inst) = install("chart", false).await else {
        return;
    };
    let (op, ag) = (&inst.operator_ns, &inst.agents_ns);

    // Pod Security on the pods themselves: operator and hook pods pass `restricted`,
    // the agent pod passes `privileged`, and is refused by `restricted` and `baseline`
    // (the level it needs is really `privileged`).
    for (workload, ns, spec) in pod_specs(&inst.docs) {
        let out = dry_run_pod("psa-check", &ns, &spec);
        assert!(
            out.status.success(),
            "{workload} pod refused in {ns}:\n{}",
            output_text(&out)
        );
        if workload.starts_with("DaemonSet/") {
            // Its ServiceAccount exists only in the agents' namespace.
            let mut spec = spec.clone();
            spec["serviceAccountName"] = json!("default");
            for (level, other) in [
                ("restricted", &op.name),
                ("baseline", &inst.baseline_ns.name),
            ] {
                let out = dry_run_pod("psa-check", other, &spec);
                let text = output_text(&out);
                assert!(
                    !out.status.success() && text.contains("violates PodSecurity"),
                    "agent pod admitted by {level}:\n{text}"
                );
            }
        }
    }

    // The real objects: the operator pod and one agent pod per schedulable node exist
    // (their ReplicaSet and DaemonSet controllers were admitted to create them).
    let pods: Api<Pod> = op.api();
    wait_list(
        &pods,
        "app.kubernetes.io/component=operator",
        TIMEOUT,
        "operator pod running",
        |ps| ps.len() == 1 && pod_phase(&ps[0]) == "Running",
    )
    .await
    .unwrap();
    let dss: Api<DaemonSet> = ag.api();
    let ds_name = format!("{}-podmotion-migration-agent", inst.release);
    wait_for(&dss, &ds_name, TIMEOUT, "agents on every node", |d| {
        d.and_then(|d| d.status.as_ref()).is_some_and(|s| {
            s.desired_number_scheduled > 0
                && s.current_number_scheduled == s.desired_number_scheduled
                && s.number_ready == s.desired_number_scheduled
        })
    })
    .await
    .unwrap();

    // The pre-delete hook Job's pod is admitted in the restricted namespace too.
    let hook: Vec<&Value> = inst
        .docs
        .iter()
        .filter(|d| is_hook(d) && d["kind"] == "Job")
        .collect();
    assert_eq!(hook.len(), 1);
    let out = kubectl(
        &["apply", "--server-side", "--field-manager=helm", "-f", "-"],
        Some(&to_yaml_stream(&hook)),
    );
    assert!(out.status.success(), "{}", output_text(&out));
    wait_list(
        &pods,
        "app.kubernetes.io/component=reap-all",
        TIMEOUT,
        "reap-all hook pod created",
        |ps| !ps.is_empty(),
    )
    .await
    .unwrap();
    let _ = Api::<k8s_openapi::api::batch::v1::Job>::namespaced(op.client.clone(), &op.name)
        .delete(
            &format!("{}-podmotion-reap-all", inst.release),
            &DeleteParams::foreground(),
        )
        .await;
}

/// `kubectl auth can-i` as `sa`: true for "yes".
fn can_i(sa: &str, args: &[&str]) -> bool {
    let mut full = vec!["auth", "can-i"];
    full.extend_from_slice(args);
    full.extend_from_slice(&["--as", sa]);
    let out = kubectl(&full, None);
    let text = String::from_utf8_lossy(&out.stdout);
    match text.lines().next().map(str::trim) {
        Some("yes") => true,
        Some("no") => false,
        _ => panic!("kubectl auth can-i {args:?}: {}", output_text(&out)),
    }
}

#[tokio::test]
async fn rbac_allows_what_the_controllers_use_and_denies_the_rest() {
    let Some(inst) = install("rbac", false).await else {
        return;
    };
    let op = inst.operator_ns.name.as_str();
    let ag = inst.agents_ns.name.as_str();
    let sa = format!("system:serviceaccount:{op}:{}-podmotion", inst.release);
    let agent_sa = format!(
        "system:serviceaccount:{ag}:{}-podmotion-migration-agent",
        inst.release
    );
    let lease = "leases.coordination.k8s.io/podmotion-operator";

    let mut allowed: Vec<Vec<&str>> = Vec::new();
    for kind in [
        "podmigrations.podmotion.io",
        "nodeagentattachments.podmotion.io",
        "runnerpools.podmotion.io",
    ] {
        for verb in ["get", "list", "watch", "patch", "update"] {
            allowed.push(vec![verb, kind, "-A"]);
        }
        allowed.push(vec!["patch", kind, "--subresource=status", "-n", "default"]);
        allowed.push(vec![
            "update",
            kind,
            "--subresource=finalizers",
            "-n",
            "default",
        ]);
    }
    allowed.extend([
        vec![
            "get",
            "customresourcedefinitions.apiextensions.k8s.io/podmigrations.podmotion.io",
        ],
        vec![
            "watch",
            "customresourcedefinitions.apiextensions.k8s.io/runnerpools.podmotion.io",
        ],
        vec!["create", "events.events.k8s.io", "-n", "default"],
        vec!["patch", "events.events.k8s.io", "-n", "default"],
        vec!["get", "pods", "-A"],
        vec!["list", "pods", "-A"],
        vec!["watch", "pods", "-A"],
        vec!["create", "pods", "-n", "default"],
        vec!["patch", "pods", "-n", "default"],
        vec!["delete", "pods", "-n", "default"],
        vec!["list", "nodes"],
        vec!["watch", "nodes"],
        // Migration pre-flight: can the source's claims follow it.
        vec!["get", "persistentvolumeclaims", "-n", "default"],
        vec!["get", "persistentvolumes"],
        vec!["list", "deployments.apps", "-A"],
        vec!["list", "statefulsets.apps", "-A"],
        vec!["list", "replicasets.apps", "-A"],
        vec!["list", "daemonsets.apps", "-A"],
        vec!["create", "daemonsets.apps", "-n", "default"],
        vec!["patch", "daemonsets.apps", "-n", "default"],
        vec!["update", "daemonsets.apps", "-n", "default"],
        vec!["delete", "daemonsets.apps", "-n", "default"],
        vec!["create", "secrets", "-n", "default"],
        vec!["delete", "secrets", "-n", "default"],
        vec!["watch", "leases.coordination.k8s.io", "-A"],
        vec!["create", "leases.coordination.k8s.io", "-n", "default"],
        vec!["get", "namespaces"],
        vec!["get", "services", "-n", "default"],
        // The forward of a committing source's new connections: which Services list it.
        vec!["list", "endpointslices.discovery.k8s.io", "-A"],
        vec!["create", "serviceaccounts", "-n", "default"],
        vec![
            "create",
            "networkpolicies.networking.k8s.io",
            "-n",
            "default",
        ],
        vec!["create", "poddisruptionbudgets.policy", "-n", "default"],
        vec!["create", "priorityclasses.scheduling.k8s.io"],
        vec!["delete", "priorityclasses.scheduling.k8s.io"],
        // Leader election, in the operator's namespace.
        vec!["create", "leases.coordination.k8s.io", "-n", op],
        vec!["get", lease, "-n", op],
        vec!["update", lease, "-n", op],
        // Attachment Jobs, their Secrets and NetworkPolicy, in the agents' namespace.
        vec!["create", "jobs.batch", "-n", ag],
        vec!["get", "jobs.batch", "-n", ag],
        vec!["watch", "jobs.batch", "-n", ag],
        vec!["patch", "jobs.batch", "-n", ag],
        vec!["delete", "jobs.batch", "-n", ag],
        vec!["update", "jobs.batch", "--subresource=finalizers", "-n", ag],
        vec!["create", "secrets", "-n", ag],
        vec!["delete", "secrets", "-n", ag],
        vec!["create", "networkpolicies.networking.k8s.io", "-n", ag],
    ]);
    let denied: Vec<Vec<&str>> = vec![
        // Secrets are never read outside what the operator creates.
        vec!["get", "secrets", "-A"],
        vec!["list", "secrets", "-A"],
        vec!["watch", "secrets", "-A"],
        vec!["get", "secrets", "-n", "kube-system"],
        // An application namespace (where PodMigrations create transfer-key Secrets).
        vec!["get", "secrets", "-n", "default"],
        vec!["patch", "secrets", "-n", "default"],
        vec!["list", "secrets", "-n", "default"],
        vec!["watch", "secrets", "-n", "default"],
        vec!["list", "secrets", "-n", op],
        vec!["get", "secrets", "-n", ag],
        // No way into a pod.
        vec!["create", "pods", "--subresource=exec", "-n", "default"],
        vec!["create", "pods", "--subresource=attach", "-n", "default"],
        vec![
            "create",
            "pods",
            "--subresource=portforward",
            "-n",
            "default",
        ],
        vec!["get", "pods", "--subresource=log", "-n", "default"],
        vec!["create", "pods", "--subresource=eviction", "-n", "default"],
        // Jobs only in the agents' namespace.
        vec!["create", "jobs.batch", "-n", "default"],
        vec!["delete", "jobs.batch", "-n", "kube-system"],
        vec!["list", "jobs.batch", "-A"],
        vec!["create", "jobs.batch", "-n", op],
        vec!["create", "cronjobs.batch", "-n", ag],
        // Workloads are never mutated.
        vec!["patch", "deployments.apps", "-n", "default"],
        vec!["update", "statefulsets.apps", "-n", "default"],
        vec!["delete", "replicasets.apps", "-n", "default"],
        vec![
            "update",
            "deployments.apps",
            "--subresource=scale",
            "-n",
            "default",
        ],
        // EndpointSlices and Services are read, never written or watched.
        vec!["create", "endpointslices.discovery.k8s.io", "-n", "default"],
        vec!["patch", "endpointslices.discovery.k8s.io", "-n", "default"],
        vec!["watch", "endpointslices.discovery.k8s.io", "-A"],
        // Storage is read one claim at a time, never listed or written.
        vec!["list", "persistentvolumeclaims", "-A"],
        vec!["patch", "persistentvolumeclaims", "-n", "default"],
        vec!["delete", "persistentvolumes"],
        // Nodes, namespaces, CRDs.
        vec!["patch", "nodes"],
        vec!["delete", "nodes"],
        vec!["create", "namespaces"],
        vec!["delete", "namespaces"],
        vec!["create", "customresourcedefinitions.apiextensions.k8s.io"],
        vec![
            "delete",
            "customresourcedefinitions.apiextensions.k8s.io/podmigrations.podmotion.io",
        ],
        vec![
            "get",
            "customresourcedefinitions.apiextensions.k8s.io/widgets.example.com",
        ],
        // Other Leases; deleting ours.
        vec![
            "update",
            "leases.coordination.k8s.io/kube-scheduler",
            "-n",
            "kube-system",
        ],
        vec![
            "update",
            "leases.coordination.k8s.io/someone-else",
            "-n",
            op,
        ],
        vec!["delete", lease, "-n", op],
        // No privilege escalation paths.
        vec!["create", "clusterrolebindings.rbac.authorization.k8s.io"],
        vec![
            "create",
            "rolebindings.rbac.authorization.k8s.io",
            "-n",
            "default",
        ],
        vec!["escalate", "clusterroles.rbac.authorization.k8s.io"],
        vec!["bind", "clusterroles.rbac.authorization.k8s.io"],
        vec!["impersonate", "users"],
        vec!["impersonate", "serviceaccounts", "-n", "default"],
        vec![
            "create",
            "serviceaccounts",
            "--subresource=token",
            "-n",
            "default",
        ],
        vec!["create", "certificatesigningrequests.certificates.k8s.io"],
        vec![
            "create",
            "mutatingwebhookconfigurations.admissionregistration.k8s.io",
        ],
        vec!["get", "configmaps", "-n", "kube-system"],
        vec!["list", "services", "-A"],
        vec!["patch", "services", "-n", "default"],
        vec!["delete", "events.events.k8s.io", "-n", "default"],
        vec!["*", "*"],
    ];
    let mut failures = Vec::new();
    for args in &allowed {
        if !can_i(&sa, args) {
            failures.push(format!("operator cannot {}", args.join(" ")));
        }
    }
    for args in &denied {
        if can_i(&sa, args) {
            failures.push(format!("operator CAN {}", args.join(" ")));
        }
    }
    // The migration agent has no API access at all.
    for args in [
        vec!["get", "pods", "-n", ag],
        vec!["list", "nodes"],
        vec!["get", "secrets", "-n", ag],
        vec!["get", "podmigrations.podmotion.io", "-A"],
        vec!["create", "events.events.k8s.io", "-n", ag],
    ] {
        if can_i(&agent_sa, &args) {
            failures.push(format!("migration agent CAN {}", args.join(" ")));
        }
    }
    // The checks themselves can say yes: the cluster admin may read Secrets.
    let admin = kubectl(&["auth", "can-i", "get", "secrets", "-A"], None);
    assert_eq!(String::from_utf8_lossy(&admin.stdout).trim(), "yes");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------- kubectl experience

/// Reads an example manifest as JSON.
fn example(file: &str) -> Value {
    let path = repo_root().join("examples/valid").join(file);
    parse_docs(&std::fs::read_to_string(&path).unwrap())
        .pop()
        .unwrap()
}

/// The columns `kubectl get` prints for one object: header words and the row's cells.
fn get_columns(resource: &str, ns: &str) -> (Vec<String>, Vec<String>) {
    let out = kubectl(&["get", resource, "-n", ns], None);
    assert!(out.status.success(), "{}", output_text(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut lines = text.lines();
    let header = lines.next().unwrap_or("");
    let row = lines.next().unwrap_or("");
    // Cells are separated by runs of 3+ spaces (kubectl pads to the widest cell + 3).
    let split = |l: &str| -> Vec<String> {
        l.split("   ")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()
    };
    (split(header), split(row))
}

fn condition(type_: &str, status: bool, reason: &str, message: &str, generation: i64) -> Value {
    json!({
        "type": type_,
        "status": if status { "True" } else { "False" },
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": "2026-11-29T10:00:00Z",
    })
}

fn ready_conditions(generation: i64, reason: &str, message: &str) -> Value {
    json!([
        condition("Ready", true, reason, message, generation),
        condition("Reconciling", false, reason, message, generation),
        condition("Stalled", false, reason, message, generation),
    ])
}

#[tokio::test]
async fn kubectl_wait_for_ready_and_printer_columns_on_the_real_api_server() {
    let Some(ns) = TestNamespace::new("kubectl", PodSecurity::Restricted).await else {
        return;
    };
    // The chart's CRDs (what a Helm user gets).
    let docs = render(&[]);
    let crds = of_kind(&docs, "CustomResourceDefinition");
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=helm",
            "-f",
            "-",
        ],
        Some(&to_yaml_stream(&crds)),
    );
    assert!(out.status.success(), "{}", output_text(&out));
    for c in &crds {
        let out = kubectl(
            &[
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                &format!("crd/{}", name(c)),
            ],
            None,
        );
        assert!(out.status.success(), "{}", output_text(&out));
    }

    let docs_md =
        std::fs::read_to_string(repo_root().join("docs/kubectl.md")).expect("docs/kubectl.md");
    struct Case {
        file: &'static str,
        resource: &'static str,
        status: Value,
        header: &'static [&'static str],
        row_tail: &'static [&'static str],
    }
    let cases = [
        Case {
            file: "podmigration-precopy.yaml",
            resource: "podmigrations",
            status: json!({
                "observedGeneration": 1, "phase": "Succeeded", "sourceNode": "pm-node-0",
                "targetNode": "pm-node-1", "targetPod": "web-7d9f8-abcde-pm1",
                "downtimeMillis": 183, "downtime": "183ms",
                "conditions": ready_conditions(1, "Succeeded", "migrated (downtime 183ms)"),
            }),
            header: &[
                "NAME", "POD", "SOURCE", "TARGET", "PHASE", "DOWNTIME", "READY", "AGE",
            ],
            row_tail: &[
                "web-7d9f8-abcde",
                "pm-node-0",
                "pm-node-1",
                "Succeeded",
                "183ms",
                "True",
            ],
        },
        Case {
            file: "nodeagentattachment-intercept.yaml",
            resource: "nodeagentattachments",
            status: json!({
                "observedGeneration": 1, "workload": "Deployment/web",
                "readyTargets": 5, "totalTargets": 5, "readySummary": "5/5",
                "conditions": ready_conditions(1, "AllTargetsAttached", "5/5 agents running"),
            }),
            header: &["NAME", "WORKLOAD", "MODE", "READY", "STATUS", "AGE"],
            row_tail: &["Deployment/web", "Intercept", "5/5", "AllTargetsAttached"],
        },
        Case {
            file: "runnerpool-basic.yaml",
            resource: "runnerpools",
            status: json!({
                "observedGeneration": 1, "imageDigestShort": "4f1c3a2b5d6e",
                "desiredNodes": 2, "readyNodes": 2, "updatedNodes": 2, "sessionCapacity": 8,
                "conditions": ready_conditions(1, "Reconciled", "2/2 nodes ready"),
            }),
            header: &[
                "NAME",
                "IMAGE",
                "DESIRED",
                "READY",
                "CAPACITY",
                "AVAILABLE",
                "AGE",
            ],
            row_tail: &["4f1c3a2b5d6e", "2", "2", "8", "True"],
        },
    ];
    for case in &cases {
        let mut obj = example(case.file);
        obj["metadata"]["namespace"] = json!(ns.name);
        let obj_name = name(&obj).to_string();
        let target = format!("{}/{obj_name}", case.resource);
        let out = kubectl(
            &["apply", "--server-side", "-f", "-"],
            Some(&to_yaml_stream(&[&obj])),
        );
        assert!(out.status.success(), "{}", output_text(&out));

        // No status yet: kubectl wait times out.
        let wait = |timeout: &str| {
            kubectl(
                &[
                    "wait",
                    "--for=condition=Ready",
                    &format!("--timeout={timeout}"),
                    &target,
                    "-n",
                    &ns.name,
                ],
                None,
            )
        };
        assert!(
            !wait("1s").status.success(),
            "{target}: Ready without a status"
        );

        // Ready=True, but for an older generation: kubectl keeps waiting.
        let mut stale = case.status.clone();
        stale["observedGeneration"] = json!(0);
        for c in stale["conditions"].as_array_mut().unwrap() {
            c["observedGeneration"] = json!(0);
        }
        let patch = |status: &Value| {
            let out = kubectl(
                &[
                    "patch",
                    &target,
                    "-n",
                    &ns.name,
                    "--subresource=status",
                    "--type=merge",
                    "-p",
                    &json!({ "status": status }).to_string(),
                ],
                None,
            );
            assert!(out.status.success(), "{target}: {}", output_text(&out));
        };
        patch(&stale);
        assert!(
            !wait("2s").status.success(),
            "{target}: kubectl wait accepted a Ready condition of an older generation"
        );

        // The status the operator writes when done: wait returns.
        patch(&case.status);
        let out = wait("30s");
        assert!(out.status.success(), "{target}: {}", output_text(&out));
        assert!(String::from_utf8_lossy(&out.stdout).contains("condition met"));

        // Printer columns as the real API server serves them.
        let (header, row) = get_columns(case.resource, &ns.name);
        assert_eq!(header, case.header, "{} columns", case.resource);
        assert_eq!(row.first().map(String::as_str), Some(obj_name.as_str()));
        let tail: Vec<&str> = row
            .iter()
            .skip(1)
            .take(case.row_tail.len())
            .map(String::as_str)
            .collect();
        assert_eq!(tail, case.row_tail, "{} row {row:?}", case.resource);
        // docs/kubectl.md shows the same header.
        let documented = case.header.join(" ");
        let normalized: Vec<String> = docs_md
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        assert!(
            normalized.iter().any(|l| l == &documented),
            "docs/kubectl.md lacks the {} header line `{documented}`",
            case.resource
        );
    }
    // The `podmotion` category lists all three kinds.
    let out = kubectl(&["get", "podmotion", "-n", &ns.name, "-o", "name"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    for kind in ["podmigration", "nodeagentattachment", "runnerpool"] {
        assert!(
            text.contains(&format!("{kind}.podmotion.io/")),
            "{kind} missing:\n{text}"
        );
    }
}

/// The flags and environment of one container of a rendered pod spec.
fn container_settings(spec: &Value, container: &str) -> (BTreeSet<String>, BTreeSet<String>) {
    let c = containers(spec)
        .into_iter()
        .find(|c| c["name"] == container)
        .unwrap_or_else(|| panic!("no container {container}"));
    let args = strs(&c["args"])
        .into_iter()
        .filter(|a| a.starts_with("--"))
        .map(|a| {
            a.split('=')
                .next()
                .unwrap()
                .trim_start_matches("--")
                .to_string()
        })
        .collect();
    let env = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["name"].as_str().map(String::from))
        .collect();
    (args, env)
}

#[test]
fn migration_agent_and_broker_get_exactly_the_flags_their_binaries_declare() {
    let docs = render(&[]);
    let ds = of_kind(&docs, "DaemonSet")[0];
    let spec = &ds["spec"]["template"]["spec"];
    let mut failures = Vec::new();
    for (container, src) in [
        ("agent", "executors/agent/src"),
        ("netns-broker", "executors/broker/src"),
    ] {
        // Local runs only (kwok nodes), and the identity from files (tests, or
        // certificates managed elsewhere; the chart uses --identity-from-csr): the
        // chart leaves them at their (unset) default.
        let local_only = [
            "container-table",
            "tls-ca",
            "tls-cert",
            "tls-key",
            "tls-reload-seconds",
            // Accepts the pre-PKI chart's shared certificates, which this chart no
            // longer issues (docs/migration-controller.md).
            "legacy-shared-identity",
        ];
        let declared: Vec<_> = clap_flags(src, false)
            .into_iter()
            .filter(|(long, _)| !local_only.contains(&long.as_str()))
            .collect();
        let (args, env) = container_settings(spec, container);
        // Every flag of the binary has a value (its default only where that is right
        // for a pod: then the flag is listed here with its default, not left out).
        for (long, var) in &declared {
            let by_flag = !long.is_empty() && args.contains(long);
            let by_env = var.as_ref().is_some_and(|v| env.contains(v));
            if !by_flag && !by_env {
                failures.push(format!(
                    "{container}: --{long} ({var:?}) has no chart value"
                ));
            }
        }
        // Every flag the chart passes exists (an unknown flag stops the binary). A binary
        // that declares no flags yet is not checked (its CLI has not landed).
        let known: BTreeSet<&str> = declared.iter().map(|(l, _)| l.as_str()).collect();
        if !known.is_empty() {
            for a in &args {
                if !known.contains(a.as_str()) {
                    failures.push(format!(
                        "{container}: chart passes --{a}, which the binary does not declare"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

// ---------------------------------------------------------------- the operator as the chart's ServiceAccount

/// Builds the operator binary (nested cargo; the outer test run no longer holds the
/// build lock) and returns its path. `--workspace --tests` resolves features as `cargo
/// test --workspace` does, so after hack/test.sh's build this compiles nothing; `-p
/// podmotion-operator` would resolve them for the operator alone and rebuild about a
/// hundred crates (kube, k8s-openapi, tokio, ...) in the middle of the test run.
fn operator_binary() -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = podmotion_e2e::without_crate_env(&mut Command::new(cargo))
        .current_dir(repo_root())
        .args([
            "build",
            "-q",
            "--workspace",
            "--tests",
            "--bin",
            "podmotion-operator",
        ])
        .output()
        .expect("running cargo build");
    assert!(out.status.success(), "cargo build: {}", output_text(&out));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    let bin = target.join("debug/podmotion-operator");
    assert!(bin.is_file(), "{} not built", bin.display());
    bin
}

/// A kubeconfig that authenticates as `sa` in `ns` with a short-lived token.
/// A kubeconfig authenticating as `sa` with a token from `kubectl create token` (plus
/// `token_args`, e.g. a bound object).
fn service_account_kubeconfig(ns: &str, sa: &str, path: &Path, token_args: &[&str]) {
    let mut args = vec!["-n", ns, "create", "token", sa, "--duration=15m"];
    args.extend_from_slice(token_args);
    let token = kubectl(&args, None);
    assert!(token.status.success(), "{}", output_text(&token));
    let view = |jsonpath: &str| {
        let out = kubectl(
            &[
                "config",
                "view",
                "--minify",
                "--raw",
                "-o",
                &format!("jsonpath={jsonpath}"),
            ],
            None,
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {
            "server": view("{.clusters[0].cluster.server}"),
            "certificate-authority-data": view("{.clusters[0].cluster.certificate-authority-data}"),
        }}],
        "users": [{"name": "sa", "user": {"token": String::from_utf8_lossy(&token.stdout).trim()}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "sa", "namespace": ns}}],
        "current-context": "c",
    });
    std::fs::write(path, serde_json::to_string(&config).unwrap()).unwrap();
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// GET `path` on 127.0.0.1:`port`; the status code, if the server answered.
fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
        .ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split_whitespace().nth(1)?.parse().ok()
}

/// `GET path` over HTTP/1.0 (no chunked body): the whole response, head and body.
fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    Some(buf)
}

/// The chart's operator Deployment run as a local process: its args and environment as
/// the kubelet would expand them, its Secret volumes and its key-material directory
/// as local directories, as the chart's ServiceAccount (a token kubeconfig).
struct LocalOperator {
    child: KillOnDrop,
    log: PathBuf,
    port: u16,
    identity: String,
    sa: String,
    kubeconfig: PathBuf,
    dirs: Vec<PathBuf>,
}

impl LocalOperator {
    /// `overrides`: `(flag prefix, replacement)` for args of the Deployment.
    fn start(inst: &Installed, overrides: &[(&str, String)]) -> LocalOperator {
        let op = inst.operator_ns.name.clone();
        let sa = format!("{}-podmotion", inst.release);
        let kubeconfig =
            std::env::temp_dir().join(format!("podmotion-{}-sa.kubeconfig", inst.release));
        service_account_kubeconfig(&op, &sa, &kubeconfig, &[]);
        let deploy = of_kind(&inst.docs, "Deployment")[0];
        let c = &deploy["spec"]["template"]["spec"]["containers"][0];
        let [port] = podmotion_e2e::kwok_agents::free_ports::<1>();
        let identity = format!("{sa}-e2e");
        // Secret volumes (a user's migration master key) as the kubelet would mount
        // them; the memory-backed key-material directory as a private directory.
        let mounts = materialize_secret_mounts(deploy, &op, &inst.release);
        let keys = std::env::temp_dir().join(format!("podmotion-{}-keys", inst.release));
        std::fs::create_dir_all(&keys).unwrap();
        let local = |v: &str| {
            mounts.iter().fold(v.to_string(), |v, (mount, dir)| {
                v.replace(mount.as_str(), &dir.to_string_lossy())
            })
        };
        let args: Vec<String> = strs(&c["args"])
            .into_iter()
            .map(|a| {
                if let Some((_, r)) = overrides.iter().find(|(p, _)| a.starts_with(p)) {
                    r.clone()
                } else if a.starts_with("--http-addr=") {
                    format!("--http-addr=127.0.0.1:{port}")
                } else if a.starts_with("--key-material-dir=") {
                    format!("--key-material-dir={}", keys.display())
                } else if a.starts_with("--log-format=") {
                    // Text: the client's HTTP spans (with status codes) are on each line.
                    "--log-format=text".to_string()
                } else {
                    local(a)
                        .replace("$(POD_NAMESPACE)", &op)
                        .replace("$(POD_NAME)", &identity)
                }
            })
            .collect();
        let log = std::env::temp_dir().join(format!("podmotion-{}-operator.log", inst.release));
        let mut cmd = Command::new(operator_binary());
        cmd.args(&args)
            .env_clear()
            .env("KUBECONFIG", &kubeconfig)
            .env("POD_NAMESPACE", &op)
            .env("POD_NAME", &identity)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::fs::File::options().append(true).open(&log).unwrap());
        // Never let a test's operator loose on the whole cluster (other tests' objects).
        for var in [
            "PODMOTION_ATTACHMENT_WATCH_NAMESPACE",
            "PODMOTION_MIGRATION_NAMESPACE",
            "PODMOTION_RUNNER_POOL_NAMESPACE",
        ] {
            let value = c["env"]
                .as_array()
                .unwrap()
                .iter()
                .find(|e| e["name"] == var)
                .and_then(|e| e["value"].as_str());
            assert_eq!(
                value,
                Some(op.as_str()),
                "{var} must scope the test's operator"
            );
        }
        for e in c["env"].as_array().unwrap() {
            if let Some(v) = e["value"].as_str() {
                cmd.env(e["name"].as_str().unwrap(), local(v));
            }
        }
        // Every API response with its status code, to find any refusal.
        cmd.env("RUST_LOG", "info,kube_client=debug");
        let child = KillOnDrop(cmd.spawn().expect("starting podmotion-operator"));
        let mut dirs: Vec<PathBuf> = mounts.into_iter().map(|(_, d)| d).collect();
        dirs.push(keys);
        LocalOperator {
            child,
            log,
            port,
            identity,
            sa,
            kubeconfig,
            dirs,
        }
    }

    fn text(&self) -> String {
        strip_ansi(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }

    /// Lines of requests the API server refused for lack of permission.
    fn refused(&self) -> Vec<String> {
        self.text()
            .lines()
            .filter(|l| l.contains("status_code=403"))
            .map(str::to_string)
            .collect()
    }

    /// Waits until /readyz answers 200; panics with the log otherwise.
    async fn wait_ready(&mut self) {
        let deadline = std::time::Instant::now() + TIMEOUT;
        while http_status(self.port, "/readyz") != Some(200) && std::time::Instant::now() < deadline
        {
            if let Ok(Some(status)) = self.child.0.try_wait() {
                panic!(
                    "podmotion-operator exited ({status}) as {}:\n{}",
                    self.sa,
                    self.text()
                );
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
        assert_eq!(
            http_status(self.port, "/readyz"),
            Some(200),
            "not ready as {}:\n{}",
            self.sa,
            self.text()
        );
    }
}

impl Drop for LocalOperator {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

#[tokio::test]
async fn the_operator_runs_with_only_the_charts_permissions() {
    let Some(inst) = install("run", true).await else {
        return;
    };
    let op = inst.operator_ns.name.clone();
    let deploy = of_kind(&inst.docs, "Deployment")[0];
    let c = &deploy["spec"]["template"]["spec"]["containers"][0];
    assert!(
        strs(&c["args"])
            .iter()
            .any(|a| a.starts_with("--migration-key-secret=")),
        "the operator is given its master key"
    );
    let mut child = LocalOperator::start(&inst, &[]);
    let sa = child.sa.clone();

    // Every controller starts: it lists and watches its kind (and what it owns) with
    // the chart's permissions and is never refused (the client's debug log records
    // each response's status code).
    let started = |text: &str| {
        ["podmigrations?", "nodeagentattachments?", "runnerpools?"]
            .iter()
            .all(|kind| text.contains(&format!("namespaces/{op}/{kind}")))
    };
    let deadline = std::time::Instant::now() + TIMEOUT;
    let mut text = String::new();
    while std::time::Instant::now() < deadline {
        if let Ok(Some(status)) = child.child.0.try_wait() {
            panic!(
                "podmotion-operator exited ({status}) as {sa}:\n{}",
                child.text()
            );
        }
        text = child.text();
        if started(&text) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    assert!(started(&text), "controllers did not start as {sa}:\n{text}");
    // Let the watches, the sweep and the first reconciles run.
    tokio::time::sleep(std::time::Duration::from_secs(10)).await;
    assert!(
        matches!(child.child.0.try_wait(), Ok(None)),
        "podmotion-operator exited as {sa}"
    );
    let text = child.text();
    // The pattern below matches this log format: accepted requests are recorded.
    assert!(
        text.contains("status_code=200"),
        "no response codes in the operator's log:\n{text}"
    );
    // The master key came from its Secret, not the random fallback.
    assert!(
        !text.contains("no --migration-key-file"),
        "the operator did not get its master key:\n{text}"
    );
    let refused = child.refused();
    assert!(
        refused.is_empty(),
        "requests refused by RBAC as {sa}:\n{}",
        refused.join("\n")
    );
    // And it becomes ready: every controller's caches synced with these permissions.
    child.wait_ready().await;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(inst.operator_ns.client.clone(), &op);
    wait_for(
        &leases,
        "podmotion-operator",
        TIMEOUT,
        "the leader Lease",
        |l| {
            l.and_then(|l| l.spec.as_ref())
                .and_then(|s| s.holder_identity.as_deref())
                == Some(child.identity.as_str())
        },
    )
    .await
    .unwrap();
    assert_eq!(http_status(child.port, "/healthz"), Some(200));
    // /metrics (what the chart's ServiceMonitor scrapes) serves the operator's registry:
    // the metrics without labels from the start (a labelled family appears with its
    // first sample), and only names the alerts' and dashboard's check knows.
    let scrape = http_get(child.port, "/metrics").expect("GET /metrics");
    assert!(
        scrape.starts_with("HTTP/1.0 200") || scrape.starts_with("HTTP/1.1 200"),
        "{scrape}"
    );
    for want in [
        "# TYPE podmotion_attachment_jobs gauge",
        "\npodmotion_migration_bytes_total ",
        "\npodmotion_migration_downtime_seconds_count ",
    ] {
        assert!(
            scrape.contains(want),
            "/metrics without {want:?}:\n{scrape}"
        );
    }
    let exported = exported_metric_names();
    for line in scrape.lines().filter(|l| l.starts_with("podmotion_")) {
        let name = line.split(['{', ' ']).next().unwrap();
        assert!(
            exported.contains(name),
            "/metrics serves {name}, unknown to the registry check"
        );
    }
    // The key material was made at run time, with these permissions: the master key
    // and the CA in the operator's namespace, the CA bundle in the agents'.
    let key = secret_data(&op, &format!("{}-podmotion-migration-key", inst.release));
    assert_eq!(
        key["data"]["key"].as_str().map(str::len),
        Some(88),
        "64 bytes, base64"
    );
    let ca = secret_data(&op, &format!("{}-podmotion-agent-ca", inst.release));
    for k in ["ca.crt", "ca.key", "ca-bundle.crt", "rotation.json"] {
        assert!(
            ca["data"][k].is_string(),
            "CA Secret without {k}: {}",
            ca["data"]
        );
    }
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(inst.agents_ns.client.clone(), &inst.agents_ns.name);
    wait_for(
        &cms,
        &format!("{}-podmotion-agent-ca", inst.release),
        TIMEOUT,
        "the CA bundle",
        |c| {
            c.and_then(|c| c.data.as_ref())
                .and_then(|d| d.get("ca.crt"))
                .is_some_and(|b| b.contains("BEGIN CERTIFICATE"))
        },
    )
    .await
    .unwrap();
    let refused = child.refused();
    assert!(
        refused.is_empty(),
        "requests refused by RBAC as {sa}:\n{}",
        refused.join("\n")
    );
}

/// A client for the API as `sa` of `ns` with a token bound to `pod` (what the kubelet
/// gives the agent container).
async fn pod_bound_client(ns: &str, sa: &str, pod: &Pod, tag: &str) -> kube::Client {
    let path = std::env::temp_dir().join(format!("podmotion-{tag}.kubeconfig"));
    let name = pod.metadata.name.clone().unwrap();
    let uid = pod.metadata.uid.clone().unwrap();
    service_account_kubeconfig(
        ns,
        sa,
        &path,
        &[
            "--bound-object-kind=Pod",
            &format!("--bound-object-name={name}"),
            &format!("--bound-object-uid={uid}"),
        ],
    );
    client_from_kubeconfig(&path).await
}

async fn client_from_kubeconfig(path: &Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(path).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let _ = std::fs::remove_file(path);
    kube::Client::try_from(cfg).unwrap()
}

/// Dials a server using `tls` as the client identity (trusting its bundle) and returns
/// the server's certificate (DER).
async fn served_certificate(
    addr: std::net::SocketAddr,
    client: &podmotion_wire::client::TlsMaterial,
    expect: &str,
) -> Vec<u8> {
    use std::sync::Arc;
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{
        CertificateDer, PrivateKeyDer, ServerName, pem::PemObject,
    };
    let verifier = podmotion_wire::identity::PeerVerifier::new(
        &client.ca_pem,
        podmotion_wire::identity::Peer::Agent(expect.into()),
        false,
    )
    .unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&client.cert_pem)
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(&client.key_pem).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(verifier))
    .with_client_auth_cert(chain, key)
    .unwrap();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(
            ServerName::try_from(format!("podmotion-agent.{expect}")).unwrap(),
            tcp,
        )
        .await
        .expect("TLS handshake with the agent");
    s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

fn der_of(pem: &[u8]) -> Vec<u8> {
    use tokio_rustls::rustls::pki_types::{CertificateDer, pem::PemObject};
    CertificateDer::from_pem_slice(pem).unwrap().to_vec()
}

/// Issue 16, findings 2 and 3: each node agent gets its own identity from the
/// operator at run time (CertificateSigningRequest, signer podmotion.io/agent-serving),
/// an agent cannot obtain another node's, and a running agent serves the certificate
/// the operator re-issues after a CA rotation without restarting. The operator is the
/// chart's Deployment run as the chart's ServiceAccount (every 403 fails the test);
/// the agents are the chart's DaemonSet pods (on kwok nodes) and their requests carry
/// real tokens bound to those pods.
#[tokio::test]
async fn agents_get_their_own_node_certificate_and_never_another_s() {
    use podmotion_agent::csr::{self, CsrError};
    use podmotion_wire::identity::{self, Peer};
    let Some(inst) = install("pki", true).await else {
        return;
    };
    let agents_ns = inst.agents_ns.name.clone();
    let agent_sa = format!("{}-podmotion-migration-agent", inst.release);
    let bundle_cm = format!("{}-podmotion-agent-ca", inst.release);
    // Short lifetimes so that the CA rotates during the test: CA 120 s (rotated with
    // 40 s left), leaves 30 s (renewed at 20 s), 3 s for a new CA to propagate.
    let mut op = LocalOperator::start(
        &inst,
        &[
            ("--pki-ca-seconds=", "--pki-ca-seconds=120".to_string()),
            ("--pki-leaf-seconds=", "--pki-leaf-seconds=30".to_string()),
            (
                "--pki-propagation-seconds=",
                "--pki-propagation-seconds=3".to_string(),
            ),
        ],
    );
    op.wait_ready().await;

    // Two agent pods of the DaemonSet, on two nodes.
    let pods: Api<Pod> = Api::namespaced(inst.agents_ns.client.clone(), &agents_ns);
    let selector = format!(
        "app.kubernetes.io/component=migration-agent,app.kubernetes.io/instance={}",
        inst.release
    );
    let listed = wait_list(&pods, &selector, TIMEOUT, "two agent pods on nodes", |ps| {
        let nodes: BTreeSet<_> = ps
            .iter()
            .filter_map(|p| p.spec.as_ref().and_then(|s| s.node_name.clone()))
            .collect();
        nodes.len() >= 2
    })
    .await
    .unwrap();
    let mut by_node: Vec<(String, Pod)> = Vec::new();
    for p in listed {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        if !node.is_empty() && !by_node.iter().any(|(n, _)| *n == node) {
            by_node.push((node, p));
        }
    }
    let (node_a, pod_a) = by_node[0].clone();
    let (node_b, pod_b) = by_node[1].clone();
    let tag = &inst.release;
    let client_a = pod_bound_client(&agents_ns, &agent_sa, &pod_a, &format!("{tag}-a")).await;
    let client_b = pod_bound_client(&agents_ns, &agent_sa, &pod_b, &format!("{tag}-b")).await;
    let timeout = std::time::Duration::from_secs(60);

    // Agent A asks for node B's identity: denied, whatever it puts in the request.
    let key = rcgen::KeyPair::generate().unwrap();
    match csr::request_certificate(&client_a, &node_b, &key, timeout).await {
        Err(CsrError::Denied {
            reason, message, ..
        }) => {
            assert_eq!(reason, "IdentityMismatch", "{message}")
        }
        other => panic!("agent on {node_a} asking for {node_b}: {other:?}"),
    }
    // The agents' ServiceAccount without a pod-bound token: denied.
    let unbound_path = std::env::temp_dir().join(format!("podmotion-{tag}-unbound.kubeconfig"));
    service_account_kubeconfig(&agents_ns, &agent_sa, &unbound_path, &[]);
    let unbound = client_from_kubeconfig(&unbound_path).await;
    match csr::request_certificate(&unbound, &node_a, &key, timeout).await {
        Err(CsrError::Denied { reason, .. }) => assert_eq!(reason, "NotBoundToAPod"),
        other => panic!("unbound token: {other:?}"),
    }

    // Each asks for its own: issued, distinct, exactly that node's identity, signed by
    // the CA the bundle names first.
    let cert_a = csr::request_certificate(&client_a, &node_a, &key, timeout)
        .await
        .expect("agent A's own certificate");
    let key_b = rcgen::KeyPair::generate().unwrap();
    let cert_b = csr::request_certificate(&client_b, &node_b, &key_b, timeout)
        .await
        .expect("agent B's own certificate");
    assert_ne!(cert_a, cert_b);
    assert_eq!(
        identity::from_pem(cert_a.as_bytes(), false),
        Ok(Peer::Agent(node_a.clone()))
    );
    assert_eq!(
        identity::from_pem(cert_b.as_bytes(), false),
        Ok(Peer::Agent(node_b.clone()))
    );
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(inst.agents_ns.client.clone(), &agents_ns);
    let bundle = |c: &k8s_openapi::api::core::v1::ConfigMap| {
        c.data
            .as_ref()
            .and_then(|d| d.get("ca.crt"))
            .cloned()
            .unwrap_or_default()
    };
    let first_bundle = bundle(&cms.get(&bundle_cm).await.unwrap());
    let signing = |b: &str| podmotion_wire::client::cert_names(b.as_bytes()).unwrap().0;
    let issuer = |c: &str| podmotion_wire::client::cert_names(c.as_bytes()).unwrap().1;
    assert_eq!(issuer(&cert_a), signing(&first_bundle));

    // A running agent (the agent binary's own identity code and TLS acceptor) and a
    // peer dialling it with its own certificate.
    let tls = csr::start(
        client_a.clone(),
        csr::CsrSettings {
            node: node_a.clone(),
            namespace: agents_ns.clone(),
            bundle_configmap: bundle_cm.clone(),
            timeout,
        },
    )
    .await
    .expect("the agent's identity");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut incoming = Box::pin(podmotion_wire::client::tls_incoming(listener, tls.clone()));
    let server = tokio::spawn(async move {
        use futures::StreamExt;
        let mut held = vec![];
        while let Some(Ok(s)) = incoming.next().await {
            held.push(s);
        }
    });
    let peer = podmotion_wire::client::TlsMaterial {
        ca_pem: first_bundle.clone().into_bytes(),
        cert_pem: cert_b.clone().into_bytes(),
        key_pem: key_b.serialize_pem().into_bytes(),
    };
    let served_first = served_certificate(addr, &peer, &node_a).await;
    assert_eq!(served_first, der_of(&tls.material().cert_pem));

    // The CA rotates (a third of its life left): a new signing CA first in the bundle,
    // the old one still trusted; the running agent re-issues at once and serves it.
    let rotated = wait_for(
        &cms,
        &bundle_cm,
        std::time::Duration::from_secs(180),
        "a new signing CA",
        |c| {
            c.is_some_and(|c| {
                let b = bundle(c);
                b.matches("BEGIN CERTIFICATE").count() >= 2 && signing(&b) != signing(&first_bundle)
            })
        },
    )
    .await
    .unwrap();
    let new_bundle = bundle(rotated.as_ref().expect("the bundle"));
    assert!(
        new_bundle.contains(first_bundle.trim()),
        "the old CA left the bundle too early"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let m = tls.material();
        if issuer(std::str::from_utf8(&m.cert_pem).unwrap()) == signing(&new_bundle) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not re-issue from the new CA"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    // Same process, same listener: the new certificate is what a new connection gets,
    // and the peer's certificate of the old CA is still accepted (overlap).
    let m = tls.material();
    let peer_new_trust = podmotion_wire::client::TlsMaterial {
        ca_pem: new_bundle.clone().into_bytes(),
        ..peer.clone()
    };
    let served_after = served_certificate(addr, &peer_new_trust, &node_a).await;
    assert_eq!(served_after, der_of(&m.cert_pem));
    assert_ne!(served_after, served_first);
    assert_eq!(
        identity::from_der(&served_after, false),
        Ok(Peer::Agent(node_a.clone()))
    );
    server.abort();
    let refused = op.refused();
    assert!(
        refused.is_empty(),
        "requests refused by RBAC as the operator:\n{}",
        refused.join("\n")
    );
    let text = op.text();
    assert!(text.contains("agent certificate request denied"), "{text}");
}

/// Writes the Secrets mounted into the first container of `workload` to local
/// directories; returns (mount path, local directory) pairs.
fn materialize_secret_mounts(workload: &Value, ns: &str, tag: &str) -> Vec<(String, PathBuf)> {
    let spec = &workload["spec"]["template"]["spec"];
    let c = &spec["containers"][0];
    let mut out = Vec::new();
    for m in c["volumeMounts"].as_array().into_iter().flatten() {
        let Some(volume) = spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == m["name"])
        else {
            continue;
        };
        let Some(secret) = volume["secret"]["secretName"].as_str() else {
            continue;
        };
        let dir =
            std::env::temp_dir().join(format!("podmotion-{tag}-{}", m["name"].as_str().unwrap()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = secret_data(ns, secret);
        for (key, b64) in data["data"].as_object().into_iter().flatten() {
            let mut child = Command::new("base64")
                .arg("-d")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("base64");
            child
                .stdin
                .take()
                .unwrap()
                .write_all(b64.as_str().unwrap().as_bytes())
                .unwrap();
            let decoded = child.wait_with_output().unwrap();
            assert!(decoded.status.success());
            std::fs::write(dir.join(key), decoded.stdout).unwrap();
        }
        out.push((m["mountPath"].as_str().unwrap().to_string(), dir));
    }
    out
}

// ---------------------------------------------------------------- helm install, upgrade, uninstall

fn secret_data(ns: &str, name: &str) -> Value {
    let out = kubectl(&["-n", ns, "get", "secret", name, "-o", "json"], None);
    assert!(out.status.success(), "{}", output_text(&out));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn helm_install_upgrade_and_uninstall_keep_the_crds_and_run_the_reap_hook() {
    let Some(op) = TestNamespace::new("helm", PodSecurity::Restricted).await else {
        return;
    };
    let release = format!("pm{}", random_suffix());
    let agents = format!("{}-agents", op.name);
    let _cleanup = ReleaseCleanup(release.clone());
    let uninstall = Uninstall {
        release: release.clone(),
        namespace: op.name.clone(),
    };
    let chart = chart_dir();
    let chart = chart.to_str().unwrap();
    // Installed first with the last chart that generated key material at render time
    // (genCA, randAlphaNum, lookup), then upgraded to this one: what a user upgrading
    // from it goes through.
    let old_dir = std::env::temp_dir().join(format!("podmotion-{release}-old-chart"));
    std::fs::create_dir_all(&old_dir).unwrap();
    let archive = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "git -C {} archive {OLD_KEY_MATERIAL_CHART} charts/podmotion | tar -x -C {}",
            repo_root().display(),
            old_dir.display()
        ))
        .output()
        .unwrap();
    assert!(
        archive.status.success(),
        "the old chart from git ({OLD_KEY_MATERIAL_CHART}; needs the history): {}",
        output_text(&archive)
    );
    let old_chart = old_dir.join("charts/podmotion");
    // The CRDs already exist on this shared control plane (other tests apply them):
    // the release takes them over, as an upgrade from a manual install would.
    let install = helm_cmd(&[
        "install",
        &release,
        old_chart.to_str().unwrap(),
        "-n",
        &op.name,
        "--take-ownership",
        "--force-conflicts",
        "--wait",
        "--timeout",
        "3m",
    ]);
    assert!(
        install.status.success(),
        "helm install (old chart):\n{}",
        output_text(&install)
    );
    // The old chart rendered key material into the release.
    let agent_tls = format!("{release}-podmotion-migration-agent-tls");
    let master_key = format!("{release}-podmotion-migration-key");
    let _ = secret_data(&agents, &agent_tls);
    let _ = secret_data(&op.name, &master_key);

    // Upgrade to this chart: it succeeds; Helm deletes the Secrets it had rendered (they
    // left the chart), and the operator makes the key material at run time instead
    // (docs/security.md: migrations in flight during this one upgrade roll back).
    let upgrade = helm_cmd(&[
        "upgrade",
        &release,
        chart,
        "-n",
        &op.name,
        "--force-conflicts",
        "--wait",
        "--timeout",
        "3m",
    ]);
    assert!(
        upgrade.status.success(),
        "helm upgrade from the old chart:\n{}",
        output_text(&upgrade)
    );
    assert!(
        String::from_utf8_lossy(&upgrade.stdout).contains("rollout status deployment/"),
        "NOTES tell what to do next:\n{}",
        output_text(&upgrade)
    );
    let _ = std::fs::remove_dir_all(&old_dir);
    for (ns, name) in [(&agents, &agent_tls), (&op.name, &master_key)] {
        let out = kubectl(
            &[
                "-n",
                ns,
                "get",
                "secret",
                name,
                "--ignore-not-found",
                "-o",
                "name",
            ],
            None,
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).trim().is_empty(),
            "{ns}/{name} left behind by the upgrade"
        );
    }

    // The chart created the agents' namespace at the level they need.
    let out = kubectl(&["get", "namespace", &agents, "-o", "json"], None);
    assert!(out.status.success(), "{}", output_text(&out));
    let ns: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        ns.pointer("/metadata/labels/pod-security.kubernetes.io~1enforce"),
        Some(&json!("privileged"))
    );

    // An upgrade with the same chart changes nothing but what the values change: the
    // release's manifest holds no Secret, nothing that could churn on a sync.
    let manifest = |rev: &str| {
        let out = helm_cmd(&[
            "get",
            "manifest",
            &release,
            "-n",
            &op.name,
            "--revision",
            rev,
        ]);
        assert!(out.status.success(), "{}", output_text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let upgrade = helm_cmd(&[
        "upgrade",
        &release,
        chart,
        "-n",
        &op.name,
        "--force-conflicts",
        "--wait",
        "--timeout",
        "3m",
    ]);
    assert!(
        upgrade.status.success(),
        "helm upgrade:\n{}",
        output_text(&upgrade)
    );
    assert_eq!(
        manifest("2"),
        manifest("3"),
        "the same upgrade rendered something new"
    );
    assert!(
        !manifest("3").contains("kind: Secret"),
        "the release renders a Secret"
    );

    // Uninstall runs the pre-delete reap-all hook (it must complete, or uninstall
    // fails), removes the release's objects and keeps the CRDs.
    let out = helm_cmd(&[
        "uninstall",
        &release,
        "-n",
        &op.name,
        "--wait",
        "--timeout",
        "3m",
    ]);
    assert!(
        out.status.success(),
        "helm uninstall:\n{}",
        output_text(&out)
    );
    std::mem::forget(uninstall);
    for crd in [
        "podmigrations.podmotion.io",
        "nodeagentattachments.podmotion.io",
        "runnerpools.podmotion.io",
    ] {
        let out = kubectl(&["get", "crd", crd, "-o", "name"], None);
        assert!(out.status.success(), "{crd} deleted by uninstall");
    }
    let out = kubectl(
        &[
            "get",
            "clusterrole",
            &format!("{release}-podmotion-operator"),
            "--ignore-not-found",
            "-o",
            "name",
        ],
        None,
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "ClusterRole left behind"
    );
    let out = kubectl(
        &["-n", &op.name, "get", "deployments,jobs", "-o", "name"],
        None,
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).trim().is_empty(),
        "left behind: {}",
        output_text(&out)
    );
}

/// The last commit whose chart rendered key material (genCA, randAlphaNum, lookup).
const OLD_KEY_MATERIAL_CHART: &str = "4b97ae3";

/// `s` without ANSI colour sequences (tracing colours its output even into a file).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // ESC [ … final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

#[test]
fn pods_exec_is_granted_only_when_the_installer_enables_exec_probes() {
    let exec_rules = |docs: &[Value]| -> Vec<(String, String)> {
        rules(docs)
            .into_iter()
            .filter(|(_, _, r)| strs(&r["resources"]).contains(&"pods/exec"))
            .map(|(who, ns, r)| {
                assert_eq!(strs(&r["verbs"]), ["get", "create"], "{who}");
                (who, ns)
            })
            .collect()
    };
    let env = |docs: &[Value]| -> Value {
        let c = &of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0];
        c["env"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == "PODMOTION_MIGRATION_EXEC_PROBES")
            .map(|e| e["value"].clone())
            .unwrap_or(Value::Null)
    };
    // Off by default (and with every other toggle on): no pods/exec anywhere.
    for args in [vec![], every_toggle_on()] {
        let docs = render(&args);
        assert_eq!(exec_rules(&docs), vec![], "{args:?}");
        assert_eq!(env(&docs), json!("false"), "{args:?}");
    }
    // On: in the operator's ClusterRole, or a Role in the one watched namespace.
    let docs = render(&["--set", "migration.execProbes.enabled=true"]);
    assert_eq!(
        exec_rules(&docs),
        vec![(
            "ClusterRole/pm-podmotion-operator".to_string(),
            String::new()
        )]
    );
    assert_eq!(env(&docs), json!("true"));
    let docs = render(&[
        "--set",
        "migration.execProbes.enabled=true,migration.watchNamespace=team-a",
    ]);
    assert_eq!(
        exec_rules(&docs),
        vec![(
            "Role/pm-podmotion-migration-exec-probes".to_string(),
            "team-a".to_string()
        )]
    );
    let binding = of_kind(&docs, "RoleBinding")
        .into_iter()
        .find(|b| name(b) == "pm-podmotion-migration-exec-probes")
        .expect("the Role is bound");
    assert_eq!(binding["subjects"][0]["kind"], "ServiceAccount");
    // Without the migration controller there is nothing to probe.
    let docs = render(&[
        "--set",
        "migration.execProbes.enabled=true,operator.controllers={attachment}",
    ]);
    assert_eq!(exec_rules(&docs), vec![]);
}

/// hack/release.sh's chart (`chart_pin` of hack/lib/chart.sh): its defaults name each
/// released digest, so with `global.imageRegistry` alone every image the chart runs or
/// hands the operator is `<registry>/podmotion/podmotion-<name>@<that name's digest>`
/// (the holder is the agent's image). Comments of values.yaml are kept, and a copy the
/// pinning cannot find its keys in is refused and left as it was.
#[test]
fn a_release_s_pinned_defaults_install_with_the_registry_as_the_only_value() {
    let names = ["operator", "agent", "broker", "attach", "preflight"];
    let digest: BTreeMap<&str, String> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            (
                *n,
                format!(
                    "sha256:{}",
                    char::from(b'a' + i as u8).to_string().repeat(64)
                ),
            )
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("podmotion-pinned-{}", random_suffix()));
    // -L: the chart's files/ link into the repository, as for hack/release.sh's copy.
    let copy = Command::new("cp")
        .args(["-RL"])
        .arg(chart_dir())
        .arg(&dir)
        .status()
        .unwrap();
    assert!(copy.success());
    let pin = |chart: &Path| {
        Command::new("bash")
            .arg("-c")
            .arg(r#"source "$1"; chart_pin "${@:2}""#)
            .arg("pin")
            .arg(repo_root().join("hack/lib/chart.sh"))
            .arg(chart)
            .args(names.map(|n| digest[n].as_str()))
            .output()
            .unwrap()
    };
    let out = pin(&dir);
    assert!(out.status.success(), "chart_pin: {}", output_text(&out));
    let source = std::fs::read_to_string(chart_dir().join("values.yaml")).unwrap();
    let pinned = std::fs::read_to_string(dir.join("values.yaml")).unwrap();
    let comments = |t: &str| {
        t.lines()
            .filter(|l| l.trim_start().starts_with('#'))
            .count()
    };
    assert_eq!(comments(&pinned), comments(&source), "comments lost");
    assert_eq!(pinned.lines().count(), source.lines().count());

    let mut args = every_toggle_on();
    args.extend(["--set", "global.imageRegistry=registry.example:5000/team"]);
    let out = Command::new(helm())
        .args(["template", "pm"])
        .arg(&dir)
        .args(["--namespace", "podmotion-system"])
        .args(&args)
        .output()
        .unwrap();
    assert!(out.status.success(), "helm template: {}", output_text(&out));
    let images = every_image(&parse_docs(&String::from_utf8_lossy(&out.stdout)));
    assert!(images.len() >= 10, "{images:#?}");
    let mut seen = BTreeSet::new();
    for (w, i) in &images {
        let rest = i
            .strip_prefix("registry.example:5000/team/podmotion/podmotion-")
            .unwrap_or_else(|| panic!("{w}: {i} is not from the release's registry"));
        let (name, d) = rest
            .split_once('@')
            .unwrap_or_else(|| panic!("{w}: {i} is not pinned by digest"));
        assert_eq!(Some(&d.to_owned()), digest.get(name), "{w}: {i}");
        seen.insert(name.to_owned());
    }
    assert_eq!(
        seen,
        names.iter().map(|n| n.to_string()).collect(),
        "{images:#?}"
    );

    // A values.yaml without one of the keys: refused, naming it, file untouched.
    let broken = std::env::temp_dir().join(format!("podmotion-pinned-{}", random_suffix()));
    std::fs::create_dir_all(&broken).unwrap();
    let without = source.replace("  preflightImage: \"\"", "  preflightImageX: \"\"");
    assert_ne!(without, source);
    std::fs::write(broken.join("values.yaml"), &without).unwrap();
    let out = pin(&broken);
    assert!(!out.status.success());
    assert!(
        output_text(&out).contains("runnerPool.preflightImage: found 0 times"),
        "{}",
        output_text(&out)
    );
    assert_eq!(
        std::fs::read_to_string(broken.join("values.yaml")).unwrap(),
        without
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&broken);
}

/// Every image the chart runs, and every one it has the operator run (its `*_IMAGE`
/// settings): (where, reference).
fn every_image(docs: &[Value]) -> Vec<(String, String)> {
    let mut out = vec![];
    for (workload, _, spec) in pod_specs(docs) {
        for c in containers(&spec) {
            let image = c["image"].as_str().unwrap_or_default().to_string();
            let name = c["name"].as_str().unwrap_or_default();
            out.push((format!("{workload} {name}"), image));
            for e in c["env"].as_array().into_iter().flatten() {
                let var = e["name"].as_str().unwrap_or_default();
                if var.ends_with("_IMAGE") {
                    let v = e["value"].as_str().unwrap_or_default().to_string();
                    out.push((format!("{workload} {var}"), v));
                }
            }
        }
    }
    out
}

#[test]
fn one_value_moves_every_image_to_a_mirror_in_one_naming_scheme() {
    let as_named = every_image(&render(&every_toggle_on()));
    let vars: BTreeSet<&str> = as_named
        .iter()
        .filter_map(|(w, _)| w.rsplit(' ').next().filter(|v| v.ends_with("_IMAGE")))
        .collect();
    // The operator, the hook, the agent and broker, and the holder, attachment and
    // preflight images the operator (and the hook) are given.
    assert_eq!(
        vars,
        BTreeSet::from([
            "PODMOTION_ATTACHMENT_AGENT_IMAGE",
            "PODMOTION_HOLDER_IMAGE",
            "PODMOTION_PREFLIGHT_IMAGE"
        ]),
        "{as_named:#?}"
    );
    assert!(as_named.len() >= 10, "{as_named:#?}");
    for (w, i) in &as_named {
        assert!(
            i.starts_with("ghcr.io/podmotion/podmotion-"),
            "{w}: {i} is not ghcr.io/podmotion/podmotion-<name>"
        );
    }
    let mut args = every_toggle_on();
    args.extend(["--set", "global.imageRegistry=mirror.example:5000/"]);
    let mirrored = every_image(&render(&args));
    assert_eq!(mirrored.len(), as_named.len());
    for ((w, named), (_, m)) in as_named.iter().zip(&mirrored) {
        let path = named.strip_prefix("ghcr.io/").unwrap();
        assert_eq!(m, &format!("mirror.example:5000/{path}"), "{w}");
    }
    // A reference set in full (a digest pinned by hack/images.sh, a local registry) is
    // moved too, keeping its path and digest; one without a registry gets it prepended.
    let digest = format!("sha256:{}", "a".repeat(64));
    let pinned = format!(
        "image.repository=127.0.0.1:15000/podmotion/operator,image.digest={digest},\
         attachment.agentImage=localhost/podmotion/podmotion-attach:1,\
         runnerPool.preflightImage=podmotion/podmotion-preflight:2,\
         global.imageRegistry=mirror.example"
    );
    let imgs = every_image(&render(&["--set", &pinned]));
    let find = |suffix: &str| {
        imgs.iter()
            .find(|(w, _)| w.ends_with(suffix))
            .map(|(_, i)| i.as_str())
            .unwrap_or_else(|| panic!("no {suffix}: {imgs:#?}"))
    };
    assert_eq!(
        find("operator"),
        format!("mirror.example/podmotion/operator@{digest}")
    );
    assert_eq!(
        find("PODMOTION_ATTACHMENT_AGENT_IMAGE"),
        "mirror.example/podmotion/podmotion-attach:1"
    );
    assert_eq!(
        find("PODMOTION_PREFLIGHT_IMAGE"),
        "mirror.example/podmotion/podmotion-preflight:2"
    );
    // Not a registry: refused at install with the value's name.
    let e = try_render(
        "pm",
        "podmotion-system",
        &["--set", "global.imageRegistry=https://x"],
    )
    .unwrap_err();
    assert!(e.contains("imageRegistry"), "{e}");
}

#[test]
fn every_pod_selects_linux_nodes_of_the_images_architecture_beside_its_own_selector() {
    let selectors = |args: &[&str]| -> Vec<(String, Value)> {
        pod_specs(&render(args))
            .into_iter()
            .map(|(w, _, spec)| (w, spec["nodeSelector"].clone()))
            .collect()
    };
    let defaults = selectors(&every_toggle_on());
    assert!(defaults.len() >= 3, "{defaults:#?}");
    for (w, sel) in &defaults {
        assert_eq!(sel["kubernetes.io/os"], "linux", "{w}: {sel}");
        assert_eq!(sel["kubernetes.io/arch"], "amd64", "{w}: {sel}");
    }
    // The values' own selectors are kept beside the platform's.
    let own = selectors(&[
        "--set",
        "operator.nodeSelector.role=control,migrationAgent.nodeSelector.role=workers",
    ]);
    for (w, sel) in &own {
        assert!(sel["role"].is_string(), "{w}: {sel}");
        assert_eq!(sel["kubernetes.io/os"], "linux", "{w}: {sel}");
    }
    // Multi-architecture images: no architecture, still Linux only.
    for (w, sel) in selectors(&["--set", "global.nodeArch="]) {
        assert!(sel.get("kubernetes.io/arch").is_none(), "{w}: {sel}");
        assert_eq!(sel["kubernetes.io/os"], "linux", "{w}: {sel}");
    }
}

/// The operator gets `global.nodeArch` (`--node-arch`) for the pods it renders that
/// run PodMotion's images, and, as the attachment controller reads the nodes' platform
/// labels, the right to read nodes whichever controllers run.
#[test]
fn the_operator_gives_the_pods_it_renders_the_same_platform_as_the_charts() {
    let node_arch = |args: &[&str]| -> String {
        let docs = render(args);
        let deploy = of_kind(&docs, "Deployment")[0];
        let c = &deploy["spec"]["template"]["spec"]["containers"][0];
        let found: Vec<&str> = strs(&c["args"])
            .into_iter()
            .filter_map(|a| a.strip_prefix("--node-arch="))
            .collect();
        assert_eq!(found.len(), 1, "{args:?}: {}", c["args"]);
        found[0].to_string()
    };
    assert_eq!(node_arch(&[]), "amd64");
    assert_eq!(node_arch(&["--set", "global.nodeArch=arm64"]), "arm64");
    assert_eq!(node_arch(&["--set", "global.nodeArch="]), "");
    // What the operator renders from it is the chart's own selector: an attachment
    // Job, rendered by the operator's core with the setting the chart passes, selects
    // exactly what the chart's own pods select.
    for (set, chart_pods) in [
        (vec![], "amd64"),
        (vec!["--set", "global.nodeArch=arm64"], "arm64"),
        (vec!["--set", "global.nodeArch="], ""),
    ] {
        let arch = node_arch(&set);
        let job = attach_job(podmotion_operator::attachment::render::Settings {
            platform: podmotion_operator::platform::Platform::linux(&arch),
            ..Default::default()
        });
        let sel = &job["spec"]["template"]["spec"]["nodeSelector"];
        let own = pod_specs(&render(&set))
            .into_iter()
            .map(|(_, _, spec)| spec["nodeSelector"].clone())
            .find(|s| s.get("kubernetes.io/os").is_some())
            .expect("a chart pod with the platform selector");
        assert_eq!(sel["kubernetes.io/os"], "linux", "{set:?}: {sel}");
        assert_eq!(sel.get("kubernetes.io/arch"), own.get("kubernetes.io/arch"));
        match chart_pods {
            "" => assert!(sel.get("kubernetes.io/arch").is_none(), "{sel}"),
            a => assert_eq!(sel["kubernetes.io/arch"], a, "{sel}"),
        }
    }
    // The attachment controller alone reads nodes (their platform labels).
    let docs = render(&["--set", "operator.controllers={attachment}"]);
    let reads_nodes = rules(&docs).iter().any(|(who, _, r)| {
        who == "ClusterRole/pm-podmotion-operator"
            && strs(&r["resources"]).contains(&"nodes")
            && ["get", "list", "watch"]
                .iter()
                .all(|v| strs(&r["verbs"]).contains(v))
    });
    assert!(reads_nodes, "{:#?}", rules(&docs));
}
