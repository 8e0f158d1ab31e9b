//! What a tenant with namespace rights cannot do, proven on the real API server (the
//! local control plane): the chart's ValidatingAdmissionPolicies and RBAC are rendered
//! with `helm template` and applied (no workload runs: the API server alone decides),
//! then each attempt is made as an impersonated user or the operator's ServiceAccount.
//!
//! - The run-time key material (the agents' CA and the master key Secrets, the CA
//!   bundle ConfigMap) is written by the operator's ServiceAccount only, whatever
//!   Secret or ConfigMap rights a user holds there (issue 41).
//! - A PodMigration with an exec probe is admitted only when its creator may
//!   `create pods/exec` on the pod.
//! - A RunnerPool's host paths lie under the installer's roots.
//! - A pod, or a workload's pod template, asks only an eviction strategy the eviction
//!   webhook knows (`podmotion.io/eviction-strategy`, with `eviction.enabled`).
//! - Kubernetes' own `view`, `edit` and `admin` roles carry the three kinds (the
//!   chart's aggregated ClusterRoles, `userRoles.aggregate`).
//! - The operator cannot read a Secret by a no-op PATCH: it holds no cluster-wide
//!   `patch secrets` (the answer to a PATCH is the whole Secret).

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use podmotion_api::samples::{Sample, examples_dir, load_dir};
use podmotion_e2e::real::output_text;
use podmotion_e2e::{
    PodSecurity, TestNamespace, grant_user, kubeconfig_path, kubectl_path, random_suffix, repo_root,
};
use serde_json::{Value, json};

/// `kubectl` against the local cluster, with `stdin`.
fn kubectl(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(kubectl_path().expect("kubectl"))
        .arg("--kubeconfig")
        .arg(kubeconfig_path())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running kubectl");
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

/// `kubectl create -f -` of `obj` as `who` (impersonated), optionally a server dry run.
fn create_as(who: &str, obj: &Value, dry_run: bool) -> Output {
    let mut args = vec!["create", "-f", "-", "--as", who];
    if dry_run {
        args.push("--dry-run=server");
    }
    kubectl(&args, Some(&obj.to_string()))
}

fn helm_template(release: &str, namespace: &str, set: &str) -> Vec<Value> {
    let helm = Command::new("bash")
        .arg(repo_root().join("hack/build-helm.sh"))
        .arg("--print")
        .output()
        .expect("hack/build-helm.sh --print");
    let helm = String::from_utf8_lossy(&helm.stdout).trim().to_owned();
    let out = Command::new(&helm)
        .args(["template", release])
        .arg(repo_root().join("charts/podmotion"))
        .args(["--namespace", namespace, "--set", set])
        .output()
        .expect("running helm");
    assert!(out.status.success(), "helm template: {}", output_text(&out));
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(&String::from_utf8_lossy(&out.stdout)).expect("YAML");
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// Deletes the release's cluster-scoped objects (policies, ClusterRoles) at the end.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        if std::env::var("PODMOTION_KEEP").as_deref() == Ok("1") {
            return;
        }
        let selector = format!("app.kubernetes.io/instance={}", self.0);
        let _ = kubectl(
            &[
                "delete",
                "validatingadmissionpolicies,validatingadmissionpolicybindings,clusterroles,clusterrolebindings",
                "-l",
                &selector,
                "--wait=false",
            ],
            None,
        );
    }
}

struct Release {
    name: String,
    operator_ns: TestNamespace,
    agents_ns: TestNamespace,
    app_ns: TestNamespace,
    _cleanup: Cleanup,
}

impl Release {
    fn operator_sa(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}-podmotion",
            self.operator_ns.name, self.name
        )
    }
}

/// The chart's CRDs, RBAC and admission policies, applied for real (nothing that runs).
async fn install(prefix: &str, extra_set: &str) -> Option<Release> {
    let operator_ns = TestNamespace::new(prefix, PodSecurity::Restricted).await?;
    let agents_ns = TestNamespace::new(&format!("{prefix}-ag"), PodSecurity::Privileged).await?;
    let app_ns = TestNamespace::new(&format!("{prefix}-app"), PodSecurity::Restricted).await?;
    let name = format!("pm{}", random_suffix());
    let cleanup = Cleanup(name.clone());
    let mut set = format!(
        "agents.createNamespace=false,agents.namespace={},migration.execProbes.enabled=true",
        agents_ns.name
    );
    if !extra_set.is_empty() {
        set.push(',');
        set.push_str(extra_set);
    }
    let docs = helm_template(&name, &operator_ns.name, &set);
    let kinds = [
        "CustomResourceDefinition",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ];
    let stream: String = docs
        .iter()
        .filter(|d| kinds.contains(&d["kind"].as_str().unwrap_or("")))
        .filter(|d| d.pointer("/metadata/annotations/helm.sh~1hook").is_none())
        .map(|d| format!("---\n{d}\n"))
        .collect();
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            "--field-manager=helm",
            "-f",
            "-",
        ],
        Some(&stream),
    );
    assert!(out.status.success(), "apply: {}", output_text(&out));
    Some(Release {
        name,
        operator_ns,
        agents_ns,
        app_ns,
        _cleanup: cleanup,
    })
}

/// Repeats `attempt` until it is refused with a message containing `needle` (a new
/// policy binding takes effect when the API server's informer has it: about a second),
/// for at most 60 s; returns the refusal's text. Fails if it is never refused.
async fn refused_with(what: &str, needle: &str, attempt: impl Fn() -> Output) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let out = attempt();
        let text = output_text(&out);
        if !out.status.success() && text.contains(needle) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what}: not refused with {needle:?} within 60 s; last answer:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn secret(name: &str, ns: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Secret",
           "metadata": {"name": name, "namespace": ns},
           "stringData": {"ca.crt": "planted", "ca.key": "planted", "key": "planted"}})
}

#[tokio::test]
async fn key_material_is_written_by_the_operators_service_account_only() {
    let Some(rel) = install("keymat", "").await else {
        return;
    };
    let (op, ag) = (&rel.operator_ns, &rel.agents_ns);
    let ca = format!("{}-podmotion-agent-ca", rel.name);
    let key = format!("{}-podmotion-migration-key", rel.name);
    // A namespace admin of both namespaces, as far as Secrets and ConfigMaps go.
    let admin = format!("keymat-admin-{}", random_suffix());
    let rules = json!([{"apiGroups": [""], "resources": ["secrets", "configmaps"],
                        "verbs": ["create", "get", "update", "patch", "delete", "deletecollection"]}]);
    grant_user(op, &admin, rules.clone()).await.unwrap();
    grant_user(ag, &admin, rules).await.unwrap();

    // The policy is in force (a server dry run of the planted CA is refused), then:
    // the CA and the master key cannot be planted, the bundle cannot be written.
    refused_with(
        "the key-material policy in force",
        "only the PodMotion operator",
        || create_as(&admin, &secret(&ca, &op.name), true),
    )
    .await;
    for (name, ns, obj) in [
        (&ca, &op.name, secret(&ca, &op.name)),
        (&key, &op.name, secret(&key, &op.name)),
        (
            &ca,
            &ag.name,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": ca, "namespace": ag.name},
                   "data": {"ca.crt": "planted"}}),
        ),
    ] {
        let out = create_as(&admin, &obj, false);
        let text = output_text(&out);
        assert!(
            !out.status.success() && text.contains("only the PodMotion operator"),
            "{admin} created {ns}/{name}:\n{text}"
        );
        eprintln!("refused as expected: {}", text.trim());
    }
    // Other names stay the user's: the refusal is the policy's, not RBAC's.
    let other = secret("an-ordinary-secret", &op.name);
    let out = create_as(&admin, &other, false);
    assert!(out.status.success(), "{}", output_text(&out));

    // The operator's ServiceAccount creates them (as it does at run time) ...
    let sa = rel.operator_sa();
    let out = create_as(&sa, &secret(&ca, &op.name), false);
    assert!(out.status.success(), "operator: {}", output_text(&out));
    // ... and nobody else may then change or delete them.
    let out = kubectl(
        &[
            "-n",
            &op.name,
            "patch",
            "secret",
            &ca,
            "--type=merge",
            "-p",
            r#"{"stringData":{"ca.crt":"swapped"}}"#,
            "--as",
            &admin,
        ],
        None,
    );
    let text = output_text(&out);
    assert!(
        !out.status.success() && text.contains("only the PodMotion operator"),
        "{admin} changed the CA Secret:\n{text}"
    );
    let out = kubectl(
        &["-n", &op.name, "delete", "secret", &ca, "--as", &admin],
        None,
    );
    let text = output_text(&out);
    assert!(
        !out.status.success() && text.contains("only the PodMotion operator"),
        "{admin} deleted the CA Secret:\n{text}"
    );
    // The operator still may (its key-material Role: update by name, a PUT).
    let out = kubectl(&["-n", &op.name, "get", "secret", &ca, "-o", "json"], None);
    assert!(out.status.success(), "{}", output_text(&out));
    let mut current: Value = serde_json::from_slice(&out.stdout).unwrap();
    current["metadata"]["labels"] = json!({"checked": "yes"});
    let out = kubectl(
        &["replace", "-f", "-", "--as", &sa],
        Some(&current.to_string()),
    );
    assert!(out.status.success(), "operator: {}", output_text(&out));

    // A copy Helm made (an earlier chart rendered the master key; the upgrade deletes
    // it, perhaps after this policy took effect) may be deleted by whoever Helm runs as.
    let key = format!("{}-podmotion-migration-key", rel.name);
    let mut helms = secret(&key, &op.name);
    helms["metadata"]["annotations"] = json!({"meta.helm.sh/release-name": rel.name});
    let out = create_as(&sa, &helms, false);
    assert!(out.status.success(), "operator: {}", output_text(&out));
    let out = kubectl(
        &["-n", &op.name, "delete", "secret", &key, "--as", &admin],
        None,
    );
    assert!(
        out.status.success(),
        "{admin} could not delete the Helm-made master key:\n{}",
        output_text(&out)
    );

    // With the policy in force and key material in both namespaces, deleting them (a
    // user's `kubectl delete namespace`, Argo CD's prune) ends: the namespace controller
    // empties them by collection, which names no object in the request.
    let bundle = json!({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": ca, "namespace": ag.name},
                        "data": {"ca.crt": "the operator's"}});
    let out = create_as(&sa, &bundle, false);
    assert!(out.status.success(), "operator: {}", output_text(&out));
    // ... while a collection deletion by anyone else still leaves the key material.
    let collection = format!("/api/v1/namespaces/{}/configmaps", ag.name);
    let out = kubectl(&["delete", "--raw", &collection, "--as", &admin], None);
    let text = output_text(&out);
    assert!(
        !out.status.success() && text.contains("only the PodMotion operator"),
        "{admin} deleted the CA bundle by collection:\n{text}"
    );
    let out = kubectl(
        &["-n", &ag.name, "get", "configmap", &ca, "-o", "name"],
        None,
    );
    assert!(
        out.status.success(),
        "the CA bundle is gone: {}",
        output_text(&out)
    );
    let out = kubectl(
        &["delete", "namespace", &op.name, &ag.name, "--wait=false"],
        None,
    );
    assert!(out.status.success(), "{}", output_text(&out));
    for ns in [&op.name, &ag.name] {
        let mut gone = false;
        for _ in 0..120 {
            let out = kubectl(&["get", "namespace", ns, "-o", "name"], None);
            if !out.status.success() && output_text(&out).contains("NotFound") {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        if !gone {
            let out = kubectl(&["get", "namespace", ns, "-o", "jsonpath={.status}"], None);
            panic!(
                "namespace {ns} is still there 60 s after its deletion: {}",
                output_text(&out)
            );
        }
    }
}

fn migration(ns: &str, probe: Value) -> Value {
    json!({"apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
           "metadata": {"name": format!("m-{}", random_suffix()), "namespace": ns},
           "spec": {"podName": "web-0", "probe": probe}})
}

/// A workload of `kind` (a bare Pod, a Deployment, a CronJob) in `ns` whose pod asks
/// `strategy`.
fn asking(kind: &str, ns: &str, strategy: &str) -> Value {
    let name = format!("w-{}", random_suffix());
    let meta = json!({"labels": {"app": name},
                      "annotations": {"podmotion.io/eviction-strategy": strategy}});
    // Restricted Pod Security (the app namespace's) admits it.
    let pod_spec = json!({"restartPolicy": if kind == "CronJob" { "Never" } else { "Always" },
        "securityContext": {"runAsNonRoot": true, "runAsUser": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{"name": "c", "image": "example.invalid/app:1",
            "securityContext": {"allowPrivilegeEscalation": false,
                                "capabilities": {"drop": ["ALL"]}}}]});
    let template = json!({"metadata": meta, "spec": pod_spec});
    let mut obj = match kind {
        "Pod" => json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}),
        "Deployment" => json!({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {
            "selector": {"matchLabels": {"app": name}}, "template": template}}),
        "CronJob" => json!({"apiVersion": "batch/v1", "kind": "CronJob", "spec": {
            "schedule": "0 0 * * *", "jobTemplate": {"spec": {"template": template}}}}),
        _ => unreachable!("{kind}"),
    };
    obj["metadata"]["name"] = json!(name);
    obj["metadata"]["namespace"] = json!(ns);
    obj
}

#[tokio::test]
async fn an_unknown_eviction_strategy_is_refused_when_the_workload_is_written() {
    let Some(rel) = install("evstrategy", "eviction.enabled=true").await else {
        return;
    };
    let app = &rel.app_ns.name;
    let create = |obj: &Value| {
        kubectl(
            &["create", "--dry-run=server", "-f", "-"],
            Some(&obj.to_string()),
        )
    };
    for (kind, field) in [
        ("Pod", "metadata.annotations"),
        ("Deployment", "spec.template.metadata.annotations"),
        (
            "CronJob",
            "spec.jobTemplate.spec.template.metadata.annotations",
        ),
    ] {
        let text = refused_with(kind, "is not an eviction strategy", || {
            create(&asking(kind, app, "LiveMigrateNow"))
        })
        .await;
        assert!(
            text.contains(&format!(
                "{field}[podmotion.io/eviction-strategy]: LiveMigrateNow is not"
            )),
            "{kind}: {text}"
        );
        for good in ["LiveMigrate", "LiveMigrateIfPossible", "Evict"] {
            let out = create(&asking(kind, app, good));
            assert!(out.status.success(), "{kind} {good}: {}", output_text(&out));
        }
    }
    // The release's own namespace is not the webhook's: not checked there either.
    let out = create(&asking(
        "Deployment",
        &rel.operator_ns.name,
        "LiveMigrateNow",
    ));
    assert!(out.status.success(), "{}", output_text(&out));

    // The manifest corpus's cases for this policy (`examples/*/with-eviction/`, beside
    // the CRD cases examples.rs sends without the chart), in the app namespace.
    let in_app = |s: &Sample| {
        let mut obj = s.object.clone();
        obj["metadata"]["namespace"] = json!(app);
        obj
    };
    let dir = examples_dir();
    let valid = load_dir(&dir.join("valid/with-eviction")).unwrap();
    let invalid = load_dir(&dir.join("invalid/with-eviction")).unwrap();
    assert!(
        !valid.is_empty() && !invalid.is_empty(),
        "no with-eviction samples"
    );
    for s in &valid {
        let out = create(&in_app(s));
        assert!(
            out.status.success(),
            "valid/with-eviction/{}: {}",
            s.name(),
            output_text(&out)
        );
    }
    for s in &invalid {
        let expect = s
            .expect
            .as_deref()
            .unwrap_or_else(|| panic!("{}: no `# expect:`", s.name()));
        refused_with(
            &format!("invalid/with-eviction/{}", s.name()),
            expect,
            || create(&in_app(s)),
        )
        .await;
    }
}

#[tokio::test]
async fn an_exec_probe_needs_its_creators_own_pods_exec() {
    let Some(rel) = install("execprobe", "").await else {
        return;
    };
    let app = &rel.app_ns;
    let user = format!("migrator-{}", random_suffix());
    grant_user(
        app,
        &user,
        json!([{"apiGroups": ["podmotion.io"], "resources": ["podmigrations"],
                "verbs": ["create", "get"]}]),
    )
    .await
    .unwrap();
    let exec = json!({"exec": {"command": ["cat", "/etc/secret/token"]}});
    let text = refused_with(
        &format!("{user} creating an exec-probe migration"),
        "may not create pods/exec",
        || create_as(&user, &migration(&app.name, exec.clone()), true),
    )
    .await;
    eprintln!("refused as expected: {}", text.trim());
    assert!(text.contains("web-0"), "the message names the pod: {text}");

    // Probes the operator makes over the network need nothing more.
    let http = json!({"httpGet": {"path": "/healthz", "port": 8080}});
    let out = create_as(&user, &migration(&app.name, http), true);
    assert!(out.status.success(), "{}", output_text(&out));

    // With pods/exec of their own, the same migration is admitted.
    for args in [
        vec![
            "create",
            "role",
            "pod-exec",
            "--verb=create",
            "--resource=pods/exec",
        ],
        vec![
            "create",
            "rolebinding",
            "pod-exec",
            "--role=pod-exec",
            "--user",
            &user,
        ],
    ] {
        let mut args = args.clone();
        args.extend(["-n", &app.name]);
        let out = kubectl(&args, None);
        assert!(out.status.success(), "{}", output_text(&out));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = create_as(&user, &migration(&app.name, exec.clone()), true);
        if out.status.success() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "with pods/exec still refused: {}",
            output_text(&out)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn runner_pool(ns: &str, runtime_dir: &str) -> Value {
    let text = std::fs::read_to_string(repo_root().join("examples/valid/runnerpool-basic.yaml"))
        .expect("the RunnerPool example");
    let mut pool: Value = serde_saphyr::from_str(&text).expect("YAML");
    pool["metadata"]["namespace"] = json!(ns);
    pool["metadata"]["name"] = json!(format!("rp-{}", random_suffix()));
    pool["spec"]["hostPaths"]["runtimeDir"] = json!(runtime_dir);
    pool
}

#[tokio::test]
async fn a_runner_pools_runtime_dir_must_lie_under_the_installers_roots() {
    let Some(rel) = install("rphostpath", "").await else {
        return;
    };
    let app = &rel.app_ns.name;
    // (/var itself holds the default session volume: the CRD's own rule refuses it.)
    for dir in [
        "/run",
        "/home",
        "/home/runner",
        "/var/tmp/compass",
        "/run/compass-other",
    ] {
        let text = refused_with(&format!("runtimeDir {dir}"), "hostPathRoots", || {
            kubectl(
                &["create", "--dry-run=server", "-f", "-"],
                Some(&runner_pool(app, dir).to_string()),
            )
        })
        .await;
        assert!(
            text.contains(&format!("spec.hostPaths.runtimeDir {dir} is not under")),
            "{text}"
        );
    }
    let mut pool = runner_pool(app, "/run/compass");
    pool["spec"]["hostPaths"]["sessionVolume"] = json!("/home/sessions");
    let out = kubectl(
        &["create", "--dry-run=server", "-f", "-"],
        Some(&pool.to_string()),
    );
    let text = output_text(&out);
    assert!(
        !out.status.success()
            && text.contains("spec.hostPaths.sessionVolume /home/sessions is not under"),
        "{text}"
    );
    for dir in ["/run/compass", "/run/compass/pool-a"] {
        let out = kubectl(
            &["create", "--dry-run=server", "-f", "-"],
            Some(&runner_pool(app, dir).to_string()),
        );
        assert!(out.status.success(), "{dir}: {}", output_text(&out));
    }
}

/// What `user` may do, per `kubectl auth can-i` in `ns` (impersonated).
fn can_i(user: &str, ns: &str, verb: &str, resource: &str) -> bool {
    let out = kubectl(
        &["auth", "can-i", verb, resource, "-n", ns, "--as", user],
        None,
    );
    match String::from_utf8_lossy(&out.stdout).trim() {
        "yes" => true,
        "no" => false,
        _ => panic!(
            "kubectl auth can-i {verb} {resource}: {}",
            output_text(&out)
        ),
    }
}

#[tokio::test]
async fn kubernetes_own_view_edit_and_admin_roles_carry_the_three_kinds() {
    let Some(rel) = install("uroles", "").await else {
        return;
    };
    let ns = &rel.app_ns.name;
    let suffix = random_suffix();
    // One user per built-in role, bound in the tenant's namespace only.
    for role in ["view", "edit", "admin"] {
        let user = format!("uroles-{role}-{suffix}");
        let out = kubectl(
            &[
                "-n",
                ns,
                "create",
                "rolebinding",
                &user,
                &format!("--clusterrole={role}"),
                &format!("--user={user}"),
            ],
            None,
        );
        assert!(out.status.success(), "{}", output_text(&out));
    }
    // (role, verb, resource, allowed): view reads the three kinds, edit also writes
    // migrations and attachments, admin also RunnerPools; nobody more than that.
    let expected = [
        ("view", "list", "podmigrations.podmotion.io", true),
        ("view", "watch", "nodeagentattachments.podmotion.io", true),
        ("view", "get", "runnerpools.podmotion.io", true),
        ("view", "create", "podmigrations.podmotion.io", false),
        ("view", "delete", "nodeagentattachments.podmotion.io", false),
        ("edit", "create", "podmigrations.podmotion.io", true),
        ("edit", "delete", "podmigrations.podmotion.io", true),
        ("edit", "create", "nodeagentattachments.podmotion.io", true),
        ("edit", "list", "runnerpools.podmotion.io", true),
        ("edit", "create", "runnerpools.podmotion.io", false),
        ("admin", "create", "runnerpools.podmotion.io", true),
        ("admin", "delete", "podmigrations.podmotion.io", true),
        (
            "admin",
            "deletecollection",
            "podmigrations.podmotion.io",
            false,
        ),
    ];
    // The aggregation controller and the authorizer's caches follow the new
    // ClusterRoles a moment later: wait (at most 60 s) until every answer is expected.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let wrong: Vec<_> = expected
            .iter()
            .filter(|(role, verb, res, allowed)| {
                can_i(&format!("uroles-{role}-{suffix}"), ns, verb, res) != *allowed
            })
            .collect();
        if wrong.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "after 60 s these answers are not the expected ones (role, verb, resource, expected): {wrong:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Only in the namespace they were bound in.
    assert!(!can_i(
        &format!("uroles-edit-{suffix}"),
        &rel.operator_ns.name,
        "list",
        "podmigrations.podmotion.io"
    ));
}

#[tokio::test]
async fn the_operator_cannot_read_a_secret_with_a_no_op_patch() {
    let Some(rel) = install("nopatch", "").await else {
        return;
    };
    let app = &rel.app_ns.name;
    let out = kubectl(
        &[
            "-n",
            app,
            "create",
            "secret",
            "generic",
            "tenant-db",
            "--from-literal=password=hunter2-tenant",
        ],
        None,
    );
    assert!(out.status.success(), "{}", output_text(&out));
    let sa = rel.operator_sa();
    // Wait until the operator's ClusterRoleBinding is in force (it may create Secrets).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let out = kubectl(
            &["auth", "can-i", "create", "secrets", "-n", app, "--as", &sa],
            None,
        );
        if String::from_utf8_lossy(&out.stdout).trim() == "yes" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "RBAC not in force");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A PATCH that changes nothing answers with the whole object when it is allowed.
    let out = kubectl(
        &[
            "-n",
            app,
            "patch",
            "secret",
            "tenant-db",
            "--type=merge",
            "-p",
            "{}",
            "-o",
            "json",
            "--as",
            &sa,
        ],
        None,
    );
    let text = output_text(&out);
    assert!(
        !text.contains("aHVudGVyMi10ZW5hbnQ="),
        "the operator read the tenant's Secret with a no-op PATCH:\n{text}"
    );
    assert!(
        !out.status.success() && text.contains("forbidden"),
        "a no-op PATCH by the operator was not refused:\n{text}"
    );
    // Server-side apply is a PATCH too.
    let apply = json!({"apiVersion": "v1", "kind": "Secret",
                       "metadata": {"name": "tenant-db", "namespace": app}});
    let out = kubectl(
        &[
            "apply",
            "--server-side",
            "--field-manager=probe",
            "-o",
            "json",
            "-f",
            "-",
            "--as",
            &sa,
        ],
        Some(&apply.to_string()),
    );
    let text = output_text(&out);
    assert!(
        !out.status.success() && !text.contains("aHVudGVyMi10ZW5hbnQ="),
        "server-side apply by the operator answered:\n{text}"
    );
    // Measured for docs/security.md: `delete secrets` (still granted cluster-wide) and
    // what the API server answers a DELETE with.
    let path = format!("/api/v1/namespaces/{app}/secrets/tenant-db");
    let out = kubectl(&["delete", "--raw", &path, "--as", &sa], None);
    let text = output_text(&out);
    assert!(
        out.status.success(),
        "the operator may delete Secrets: {text}"
    );
    eprintln!(
        "DELETE answer as the operator {} the Secret's data",
        if text.contains("aHVudGVyMi10ZW5hbnQ=") {
            "CONTAINS"
        } else {
            "does not contain"
        }
    );
}

/// The operator's egress to pods (its HTTP, TCP and gRPC application probes) reaches
/// only namespaces a migration may run in: never kube-system, the release's or the
/// agents' (issue 41: it admitted every pod on every port). Rendering only.
#[test]
fn the_operators_probe_egress_leaves_out_the_protected_namespaces() {
    let egress_to_pods = |set: &str| -> Vec<Value> {
        let docs = helm_template("pm", "podmotion-system", set);
        let np = docs
            .iter()
            .find(|d| {
                d["kind"] == "NetworkPolicy" && d["metadata"]["name"] == "pm-podmotion-operator"
            })
            .expect("the operator's NetworkPolicy");
        np["spec"]["egress"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r["to"].as_array().cloned().unwrap_or_default())
            .filter(|peer| peer.get("ipBlock").is_none())
            .collect()
    };
    let peers = egress_to_pods("agents.namespace=pm-agents");
    for peer in &peers {
        assert_ne!(
            peer["namespaceSelector"],
            json!({}),
            "an egress rule to every namespace: {peers:?}"
        );
    }
    let probe = peers
        .iter()
        .find(|p| p["podSelector"] == json!({}))
        .expect("the probe rule");
    assert_eq!(
        probe["namespaceSelector"]["matchExpressions"],
        json!([{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                "values": ["kube-system", "podmotion-system", "pm-agents"]}])
    );
    let peers = egress_to_pods("agents.namespace=pm-agents,migration.watchNamespace=shop");
    let probe = peers
        .iter()
        .find(|p| p["podSelector"] == json!({}))
        .expect("the probe rule");
    assert_eq!(
        probe["namespaceSelector"]["matchExpressions"],
        json!([{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["shop"]}])
    );
}
