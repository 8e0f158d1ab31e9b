//! The Argo CD health checks in `argocd/resource_customizations/podmotion.io/<Kind>/`
//! (argo-cd's layout: `health.lua`, `health_test.yaml`, `testdata/*.yaml`), evaluated by
//! Argo CD's own code: `podmotion-argocd-health` (hack/argocd-health, built from the
//! argo-cd module pinned in hack/versions.env by hack/build-argocd-health.sh) parses the
//! `argocd-cm` keys the chart renders (`argocd.resourceCustomizations.enabled`) with Argo
//! CD's settings manager and calls gitops-engine's `GetResourceHealth` — the application
//! controller's call — which runs the scripts in Argo CD's gopher-lua VM.
//!
//! Evaluated: every fixture as a file, every fixture created as a live object in the
//! local cluster (spec, then status through the status subresource; the object the API
//! server returns is what Argo CD is given), and statuses written by
//! `podmotion_api::conditions::set_health`, the one place the operator writes
//! `Ready`/`Reconciling`/`Stalled`. The same statuses are mapped to kstatus (Current /
//! InProgress / Failed) by the rules kstatus applies to custom resources.
//!
//! Needs Go and the module proxy on a cold cache (the first build takes minutes; the
//! tests build it through hack/build-argocd-health.sh, which hack/install-tools.sh also
//! runs) and `helm` (hack/build-helm.sh). The live test needs the cluster
//! (`PODMOTION_E2E=0` skips it).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use podmotion_api::conditions::{Health, set_health};
use podmotion_api::names::reasons;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_e2e::operator::install_crds;
use podmotion_e2e::{PodSecurity, TestNamespace, repo_root};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const KINDS: [&str; 3] = ["PodMigration", "NodeAgentAttachment", "RunnerPool"];

fn kind_dir(kind: &str) -> PathBuf {
    repo_root()
        .join("argocd/resource_customizations/podmotion.io")
        .join(kind)
}

/// Runs a `hack/` script that prints a path on its last stdout line.
fn script_path(script: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(repo_root().join("hack").join(script))
        .stderr(Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("running hack/{script}: {e}"));
    assert!(out.status.success(), "hack/{script} failed");
    let stdout = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(stdout.lines().last().unwrap_or_default().trim())
}

/// The evaluator, built on first use (a no-op when the pinned build is in the cache).
fn argocd_health_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| script_path("build-argocd-health.sh"))
}

/// The chart's `argocd-cm` customizations (`helm template` with the switch on), in a file.
fn argocd_cm() -> &'static Path {
    static CM: OnceLock<PathBuf> = OnceLock::new();
    CM.get_or_init(|| argocd_cm_from(&repo_root().join("charts/podmotion"), "chart"))
}

fn argocd_cm_from(chart: &Path, label: &str) -> PathBuf {
    let helm = script_path("build-helm.sh");
    let out = Command::new(helm)
        .args(["template", "pm"])
        .arg(chart)
        .args([
            "--set",
            "argocd.resourceCustomizations.enabled=true",
            "--show-only",
            "templates/argocd-resource-customizations.yaml",
        ])
        .output()
        .expect("helm template");
    assert!(
        out.status.success(),
        "helm template: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = std::env::temp_dir().join(format!(
        "podmotion-argocd-cm-{label}-{}.yaml",
        std::process::id()
    ));
    std::fs::write(&path, &out.stdout).unwrap();
    path
}

/// Argo CD's health of each object, in order: Ok((status, message)) or Err(error).
fn argocd_health_with(cm: &Path, objects: &[Value]) -> Vec<Result<(String, String), String>> {
    let mut child = Command::new(argocd_health_bin())
        .arg("--argocd-cm")
        .arg(cm)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting podmotion-argocd-health");
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(&serde_json::to_vec(objects).unwrap())
        .expect("writing to podmotion-argocd-health");
    let out = child.wait_with_output().expect("podmotion-argocd-health");
    assert!(
        out.status.success(),
        "podmotion-argocd-health: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let results: Vec<Value> = serde_json::from_slice(&out.stdout).expect("its JSON output");
    assert_eq!(results.len(), objects.len(), "one result per object");
    results
        .into_iter()
        .map(|r| match r["error"].as_str() {
            Some(e) => Err(e.to_string()),
            None => Ok((
                r["status"].as_str().unwrap_or_default().to_string(),
                r["message"].as_str().unwrap_or_default().to_string(),
            )),
        })
        .collect()
}

fn argocd_health(objects: &[Value]) -> Vec<Result<(String, String), String>> {
    argocd_health_with(argocd_cm(), objects)
}

#[derive(Deserialize)]
struct HealthTests {
    tests: Vec<HealthTest>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HealthTest {
    health_status: Expected,
    input_path: String,
}

#[derive(Deserialize)]
struct Expected {
    status: String,
    message: Option<String>,
}

fn health_tests(kind: &str) -> HealthTests {
    let path = kind_dir(kind).join("health_test.yaml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn read_yaml(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn every_kind_has_a_health_check_with_fixtures_for_each_status_it_can_report() {
    for kind in KINDS {
        assert!(
            kind_dir(kind).join("health.lua").is_file(),
            "{kind}: no health.lua"
        );
        let statuses: BTreeSet<String> = health_tests(kind)
            .tests
            .into_iter()
            .map(|t| t.health_status.status)
            .collect();
        for want in ["Healthy", "Progressing", "Degraded"] {
            assert!(
                statuses.contains(want),
                "{kind}: no {want} fixture in health_test.yaml"
            );
        }
        // Only an ingest attachment can wait for an outside event (its client renewing
        // the session lease): the one kind with a Suspended state.
        assert_eq!(
            statuses.contains("Suspended"),
            kind == "NodeAgentAttachment",
            "{kind}: Suspended fixtures"
        );
    }
}

/// A fixture with what health_test.yaml expects of it.
struct Fixture {
    kind: &'static str,
    path: String,
    object: Value,
    want: Expected,
}

fn fixtures() -> Vec<Fixture> {
    let mut out = Vec::new();
    for kind in KINDS {
        let dir = kind_dir(kind);
        for t in health_tests(kind).tests {
            out.push(Fixture {
                kind,
                object: read_yaml(&dir.join(&t.input_path)),
                path: t.input_path,
                want: t.health_status,
            });
        }
    }
    out
}

/// Compares Argo CD's verdicts with health_test.yaml; the message too when `messages`.
fn check(
    label: &str,
    fixtures: &[Fixture],
    got: Vec<Result<(String, String), String>>,
    messages: impl Fn(&Fixture) -> bool,
) -> Vec<String> {
    let mut failures = Vec::new();
    for (f, got) in fixtures.iter().zip(got) {
        let at = format!("{label} {}/{}", f.kind, f.path);
        match got {
            Err(e) => failures.push(format!("{at}: {e}")),
            Ok((status, message)) => {
                if status != f.want.status {
                    failures.push(format!(
                        "{at}: status {status:?}, want {:?} (message {message:?})",
                        f.want.status
                    ));
                }
                if let Some(want) = f.want.message.as_ref().filter(|_| messages(f))
                    && &message != want
                {
                    failures.push(format!("{at}: message {message:?}, want {want:?}"));
                }
            }
        }
    }
    failures
}

#[test]
fn every_fixture_is_listed_in_health_test_yaml() {
    let mut failures = Vec::new();
    for kind in KINDS {
        let dir = kind_dir(kind);
        let listed: BTreeSet<String> = health_tests(kind)
            .tests
            .iter()
            .map(|t| t.input_path.clone())
            .collect();
        // A forgotten fixture would never be checked.
        for entry in std::fs::read_dir(dir.join("testdata")).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            let rel = format!("testdata/{name}");
            if !listed.contains(&rel) {
                failures.push(format!("{kind}/{rel}: not listed in health_test.yaml"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn argo_cd_reports_the_expected_status_for_every_fixture() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 15, "only {} fixtures", fixtures.len());
    let objects: Vec<Value> = fixtures.iter().map(|f| f.object.clone()).collect();
    let failures = check("file", &fixtures, argocd_health(&objects), |_| true);
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_broken_health_script_fails_the_fixtures() {
    // The evaluation must be able to fail: the chart rendered with a copy of the scripts
    // where one of them errors out. (The chart reads the scripts through its files/argocd
    // link, so the copy is a chart whose link points at the broken tree.)
    let tmp = std::env::temp_dir().join(format!("podmotion-broken-chart-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let chart = tmp.join("podmotion");
    copy_dir(&repo_root().join("charts/podmotion"), &chart);
    let scripts = tmp.join("argocd");
    copy_dir(
        &repo_root().join("argocd/resource_customizations"),
        &scripts,
    );
    let broken = scripts.join("podmotion.io/RunnerPool/health.lua");
    let text = std::fs::read_to_string(&broken).unwrap();
    std::fs::write(
        &broken,
        format!("local hs = nil\nhs.status = 'Healthy'\n{text}"),
    )
    .unwrap();
    let link = chart.join("files/argocd");
    let _ = std::fs::remove_file(&link);
    let _ = std::fs::remove_dir_all(&link);
    std::os::unix::fs::symlink(&scripts, &link).unwrap();
    let cm = argocd_cm_from(&chart, "broken");

    let fixtures = fixtures();
    let objects: Vec<Value> = fixtures.iter().map(|f| f.object.clone()).collect();
    let got = argocd_health_with(&cm, &objects);
    for (f, got) in fixtures.iter().zip(&got) {
        match (f.kind, got) {
            ("RunnerPool", Err(e)) => assert!(e.contains("nil"), "{}: {e}", f.path),
            ("RunnerPool", Ok(ok)) => panic!("{}: the broken script reported {ok:?}", f.path),
            (kind, got) => assert!(got.is_ok(), "{kind}/{}: {got:?}", f.path),
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_file(&cm);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        let kind = entry.file_type().unwrap();
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path()).unwrap(), &target).unwrap();
        } else if kind.is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// The API resource of a fixture's kind.
fn api_resource(kind: &str) -> ApiResource {
    match kind {
        "PodMigration" => ApiResource::erase::<PodMigration>(&()),
        "NodeAgentAttachment" => ApiResource::erase::<NodeAgentAttachment>(&()),
        _ => ApiResource::erase::<RunnerPool>(&()),
    }
}

/// Creates `fixture` as a live object named `name` in `api`'s namespace: the spec first,
/// then its status through the status subresource, with the fixture's
/// `metadata.generation - observedGeneration` gap kept against the live generation (the
/// API server assigns generation 1). Returns the object the API server stored.
async fn create_live(api: &Api<DynamicObject>, name: &str, fixture: &Value) -> Value {
    let mut spec_only = json!({
        "apiVersion": fixture["apiVersion"],
        "kind": fixture["kind"],
        "metadata": {"name": name},
        "spec": fixture["spec"],
    });
    if let Some(labels) = fixture.pointer("/metadata/labels") {
        spec_only["metadata"]["labels"] = labels.clone();
    }
    let obj: DynamicObject = serde_json::from_value(spec_only).unwrap();
    let created = api
        .create(&PostParams::default(), &obj)
        .await
        .unwrap_or_else(|e| panic!("creating {name}: {e}"));
    let live_generation = created.metadata.generation.unwrap_or(1);
    let Some(status) = fixture.get("status") else {
        return serde_json::to_value(created).unwrap();
    };
    let fixture_generation = fixture
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(1);
    let shift = |observed: &Value| -> Value {
        observed
            .as_i64()
            .map(|o| json!(live_generation - (fixture_generation - o)))
            .unwrap_or(Value::Null)
    };
    let mut status = status.clone();
    if let Some(o) = status.get("observedGeneration").map(shift) {
        status["observedGeneration"] = o;
    }
    if let Some(conditions) = status.get_mut("conditions").and_then(Value::as_array_mut) {
        for c in conditions {
            if let Some(o) = c.get("observedGeneration").map(shift) {
                c["observedGeneration"] = o;
            }
        }
    }
    let patched = api
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .unwrap_or_else(|e| panic!("writing the status of {name}: {e}"));
    serde_json::to_value(patched).unwrap()
}

#[tokio::test]
async fn argo_cd_reports_the_expected_status_for_live_objects_of_every_fixture() {
    let Some(ns) = TestNamespace::new("argocd-health", PodSecurity::Baseline).await else {
        return;
    };
    install_crds(&ns.client).await;
    let fixtures = fixtures();
    let mut live = Vec::new();
    for f in &fixtures {
        let api = Api::<DynamicObject>::namespaced_with(
            ns.client.clone(),
            &ns.name,
            &api_resource(f.kind),
        );
        // One object per fixture: the file's stem names it.
        let name = Path::new(&f.path)
            .file_stem()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        live.push(create_live(&api, &name, &f.object).await);
    }
    // The messages of the old-generation fixtures name the fixture's generation, not the
    // live one: their status is what is compared.
    let failures = check("live", &fixtures, argocd_health(&live), |f| {
        !f.path.contains("old-generation")
    });
    // The live objects are what the API server holds (managedFields, uid, ...), not the
    // files: at least one field the files do not have.
    assert!(
        live.iter()
            .all(|o| o.pointer("/metadata/managedFields").is_some()),
        "the objects given to Argo CD are not the live ones"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `value` with every null removed (what the typed round trip also drops).
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(without_nulls).collect()),
        v => v.clone(),
    }
}

/// Fields of `fixture` that the typed round trip lost or changed (a renamed or
/// removed status field would make a fixture describe an object that cannot exist).
fn lost_fields(path: &str, fixture: &Value, typed: &Value, out: &mut Vec<String>) {
    match (fixture, typed) {
        (Value::Object(f), Value::Object(t)) => {
            for (k, v) in f {
                match t.get(k) {
                    Some(tv) => lost_fields(&format!("{path}.{k}"), v, tv, out),
                    None => out.push(format!("{path}.{k}")),
                }
            }
        }
        (Value::Array(f), Value::Array(t)) if f.len() == t.len() => {
            for (i, (fv, tv)) in f.iter().zip(t).enumerate() {
                lost_fields(&format!("{path}[{i}]"), fv, tv, out);
            }
        }
        (Value::Number(f), Value::Number(t)) if f.as_f64() == t.as_f64() => {}
        (f, t) if f == t => {}
        _ => out.push(format!("{path}: {fixture} became {typed}")),
    }
}

fn round_trip<K: DeserializeOwned + serde::Serialize>(v: &Value) -> Result<Value, String> {
    let typed: K = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(typed).map_err(|e| e.to_string())
}

#[test]
fn fixtures_are_objects_the_api_types_can_hold() {
    let mut failures = Vec::new();
    for kind in KINDS {
        let dir = kind_dir(kind);
        for t in health_tests(kind).tests {
            let fixture = without_nulls(&read_yaml(&dir.join(&t.input_path)));
            let typed = match kind {
                "PodMigration" => round_trip::<PodMigration>(&fixture),
                "NodeAgentAttachment" => round_trip::<NodeAgentAttachment>(&fixture),
                _ => round_trip::<RunnerPool>(&fixture),
            };
            match typed {
                Err(e) => failures.push(format!("{kind}/{}: {e}", t.input_path)),
                Ok(typed) => {
                    let mut lost = Vec::new();
                    lost_fields("", &fixture, &typed, &mut lost);
                    if !lost.is_empty() {
                        failures.push(format!("{kind}/{}: {}", t.input_path, lost.join(", ")));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The kstatus result for a custom resource (sigs.k8s.io/cli-utils `kstatus`, generic
/// rules): Terminating when deleted, InProgress while `observedGeneration` differs from
/// `metadata.generation` or `Reconciling` is True, Failed when `Stalled` is True,
/// Current otherwise.
fn kstatus(obj: &Value) -> &'static str {
    if obj.pointer("/metadata/deletionTimestamp").is_some() {
        return "Terminating";
    }
    let generation = obj.pointer("/metadata/generation").and_then(Value::as_i64);
    let observed = obj
        .pointer("/status/observedGeneration")
        .and_then(Value::as_i64);
    // A missing observedGeneration is not a mismatch to kstatus (it cannot tell).
    if let (Some(g), Some(o)) = (generation, observed)
        && g != o
    {
        return "InProgress";
    }
    let conditions = obj
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let is_true = |t: &str| {
        conditions
            .iter()
            .any(|c| c["type"] == t && c["status"] == "True")
    };
    if is_true("Reconciling") {
        return "InProgress";
    }
    if is_true("Stalled") {
        return "Failed";
    }
    "Current"
}

/// `kubectl wait --for=condition=Ready` on an object: Ready is True and, where the
/// condition carries an `observedGeneration`, it is the object's generation.
fn kubectl_wait_ready(obj: &Value) -> bool {
    let generation = obj.pointer("/metadata/generation").and_then(Value::as_i64);
    obj.pointer("/status/conditions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .any(|c| {
            c["type"] == "Ready"
                && c["status"] == "True"
                && match (c["observedGeneration"].as_i64(), generation) {
                    (Some(o), Some(g)) => o == g,
                    _ => true,
                }
        })
}

/// A fixture of `kind` whose conditions are rewritten by the operator's own writer.
fn with_health(kind: &str, health: &Health, phase: Option<&str>, generation: i64) -> Value {
    let mut obj = read_yaml(&kind_dir(kind).join("testdata/healthy.yaml"));
    obj["metadata"]["generation"] = json!(generation);
    let mut conditions = Vec::new();
    set_health(
        &mut conditions,
        health,
        Some(1),
        Timestamp::from_second(1_790_000_000).unwrap(),
    );
    obj["status"]["observedGeneration"] = json!(1);
    obj["status"]["conditions"] = serde_json::to_value(&conditions).unwrap();
    if let Some(phase) = phase {
        obj["status"]["phase"] = json!(phase);
        if matches!(phase, "Failed" | "Aborted") {
            obj["status"]["failureReason"] = json!(health.reason());
        }
    }
    obj
}

/// (kind, health, PodMigration phase, kstatus, Argo CD status, kubectl wait succeeds)
type MappingCase = (
    &'static str,
    Health,
    Option<&'static str>,
    &'static str,
    &'static str,
    bool,
);

#[test]
fn the_conditions_the_operator_writes_map_to_kstatus_argo_cd_and_kubectl_wait() {
    let cases: Vec<MappingCase> = vec![
        (
            "PodMigration",
            Health::ready(reasons::SUCCEEDED, "migrated (downtime 90ms)"),
            Some("Succeeded"),
            "Current",
            "Healthy",
            true,
        ),
        (
            "PodMigration",
            Health::ready(reasons::DRY_RUN_PASSED, "dry run passed"),
            Some("Succeeded"),
            "Current",
            "Healthy",
            true,
        ),
        (
            "PodMigration",
            Health::reconciling(reasons::CHECKPOINTING, "Checkpointing"),
            Some("Checkpointing"),
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "PodMigration",
            Health::reconciling(reasons::QUEUED, "waiting for a slot"),
            Some("Pending"),
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "PodMigration",
            Health::stalled(reasons::NO_TARGET_NODE, "no node fits"),
            Some("Pending"),
            "Failed",
            "Degraded",
            false,
        ),
        (
            "PodMigration",
            Health::stalled(reasons::PROBE_FAILED, "probe failed; rolled back"),
            Some("Failed"),
            "Failed",
            "Degraded",
            false,
        ),
        (
            "PodMigration",
            Health::stalled(reasons::ABORTED, "deleted; rolled back"),
            Some("Aborted"),
            "Failed",
            "Degraded",
            false,
        ),
        (
            "NodeAgentAttachment",
            Health::ready(reasons::ALL_TARGETS_ATTACHED, "5/5 agents running"),
            None,
            "Current",
            "Healthy",
            true,
        ),
        (
            "NodeAgentAttachment",
            Health::reconciling(reasons::JOBS_PENDING, "2/5 agents running"),
            None,
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "NodeAgentAttachment",
            Health::reconciling(reasons::WAITING_FOR_READY_PODS, "no pod ready"),
            None,
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "NodeAgentAttachment",
            Health::stalled(reasons::NO_ADMISSIBLE_TARGET, "host network"),
            None,
            "Failed",
            "Degraded",
            false,
        ),
        (
            "NodeAgentAttachment",
            Health::stalled(reasons::SIDECAR_CONFLICT, "sidecar"),
            None,
            "Failed",
            "Degraded",
            false,
        ),
        (
            "NodeAgentAttachment",
            Health::stalled(reasons::LEASE_EXPIRED, "renew the Lease"),
            None,
            "Failed",
            "Suspended",
            false,
        ),
        (
            "RunnerPool",
            Health::ready(reasons::RECONCILED, "2/2 nodes ready"),
            None,
            "Current",
            "Healthy",
            true,
        ),
        (
            "RunnerPool",
            Health::reconciling(reasons::ROLLING_OUT, "1/2 nodes ready"),
            None,
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "RunnerPool",
            Health::reconciling(reasons::SHAPE_DRIFT, "re-applied"),
            None,
            "InProgress",
            "Progressing",
            false,
        ),
        (
            "RunnerPool",
            Health::stalled(reasons::POD_SECURITY_REJECTS, "baseline"),
            None,
            "Failed",
            "Degraded",
            false,
        ),
        (
            "RunnerPool",
            Health::stalled(reasons::PREFLIGHT_FAILED, "kvm"),
            None,
            "Failed",
            "Degraded",
            false,
        ),
    ];
    // Every case at the current generation (the status describes the spec) and at a
    // spec change the operator has not seen yet (never Current, never Healthy, and
    // `kubectl wait` keeps waiting: observedGeneration on the condition).
    let objects: Vec<Value> = cases
        .iter()
        .flat_map(|(kind, health, phase, ..)| {
            [
                with_health(kind, health, *phase, 1),
                with_health(kind, health, *phase, 2),
            ]
        })
        .collect();
    let mut argo = argocd_health(&objects).into_iter();
    let mut failures = Vec::new();
    for (i, (kind, health, _, want_kstatus, want_argo, want_wait)) in cases.iter().enumerate() {
        let (obj, stale) = (&objects[2 * i], &objects[2 * i + 1]);
        let label = format!("{kind} {health:?}");
        if kstatus(obj) != *want_kstatus {
            failures.push(format!(
                "{label}: kstatus {}, want {want_kstatus}",
                kstatus(obj)
            ));
        }
        match argo.next().unwrap() {
            Ok((status, _)) if status == *want_argo => {}
            Ok((status, message)) => failures.push(format!(
                "{label}: Argo CD {status} ({message}), want {want_argo}"
            )),
            Err(e) => failures.push(format!("{label}: {e}")),
        }
        if kubectl_wait_ready(obj) != *want_wait {
            failures.push(format!("{label}: kubectl wait Ready = {}", !want_wait));
        }
        if kstatus(stale) != "InProgress" {
            failures.push(format!("{label} (stale): kstatus {}", kstatus(stale)));
        }
        match argo.next().unwrap() {
            Ok((status, _)) if status == "Progressing" => {}
            other => failures.push(format!("{label} (stale): Argo CD {other:?}")),
        }
        if kubectl_wait_ready(stale) {
            failures.push(format!("{label} (stale): kubectl wait would succeed"));
        }
    }
    // Being deleted wins over everything.
    let mut deleting = with_health(
        "RunnerPool",
        &Health::ready(reasons::RECONCILED, "ok"),
        None,
        1,
    );
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-29T10:00:00Z");
    if kstatus(&deleting) != "Terminating" {
        failures.push("deleting RunnerPool is not Terminating".into());
    }
    // Argo CD says Progressing (gitops-engine's "Pending deletion") before any script runs.
    match &argocd_health(&[deleting])[0] {
        Ok((status, _)) if status == "Progressing" => {}
        other => failures.push(format!("deleting RunnerPool: Argo CD {other:?}")),
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
