//! The Argo CD health checks in `argocd/resource_customizations/podmotion.io/<Kind>/`
//! (argo-cd's layout: `health.lua`, `health_test.yaml`, `testdata/*.yaml`), run with a
//! Lua 5.1 interpreter — Argo CD runs them in gopher-lua, a Lua 5.1 — against every
//! fixture, and against statuses written by `podmotion_api::conditions::set_health`,
//! the one place the operator writes `Ready`/`Reconciling`/`Stalled`. The same statuses
//! are mapped to kstatus (Current / InProgress / Failed) by the rules kstatus applies to
//! custom resources.
//!
//! Needs `lua5.1` (installed by `hack/install-tools.sh`; override with `PODMOTION_LUA`).
//! Without it these tests fail: CI installs it.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use k8s_openapi::jiff::Timestamp;
use podmotion_api::conditions::{Health, set_health};
use podmotion_api::names::reasons;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_e2e::repo_root;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const KINDS: [&str; 3] = ["PodMigration", "NodeAgentAttachment", "RunnerPool"];

fn kind_dir(kind: &str) -> PathBuf {
    repo_root()
        .join("argocd/resource_customizations/podmotion.io")
        .join(kind)
}

fn lua() -> PathBuf {
    let candidate = std::env::var_os("PODMOTION_LUA")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("lua5.1"));
    match Command::new(&candidate).arg("-v").output() {
        Ok(out) if out.status.success() || !out.stderr.is_empty() => candidate,
        _ => panic!(
            "no Lua 5.1 interpreter ({}); run hack/install-tools.sh (CI installs it through \
             hack/install-deps.sh) or set PODMOTION_LUA",
            candidate.display()
        ),
    }
}

/// A Lua string literal for `s` (decimal escapes for anything but printable ASCII).
fn lua_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for b in s.bytes() {
        match b {
            b'"' => out.push_str("\\\""),
            b'\\' => out.push_str("\\\\"),
            0x20..=0x7e => out.push(b as char),
            _ => out.push_str(&format!("\\{b:03}")),
        }
    }
    out.push('"');
    out
}

/// A Lua table constructor for a JSON value, the way Argo CD hands `obj` to the script
/// (objects become tables with string keys, arrays sequences, null is absent).
fn lua_value(v: &Value) -> String {
    match v {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => lua_string(s),
        Value::Array(items) => {
            let parts: Vec<String> = items
                .iter()
                .filter(|v| !v.is_null())
                .map(lua_value)
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
        Value::Object(map) => {
            let parts: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("[{}] = {}", lua_string(k), lua_value(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
    }
}

/// Runs `script` with the global `obj` set to `object`; returns (status, message).
fn run_health(script: &Path, object: &Value) -> Result<(String, String), String> {
    let harness = format!(
        "obj = {}\n\
         local chunk, err = loadfile({})\n\
         if chunk == nil then io.write('ERROR\\t' .. tostring(err)) os.exit(2) end\n\
         local ok, hs = pcall(chunk)\n\
         if not ok then io.write('ERROR\\t' .. tostring(hs)) os.exit(2) end\n\
         if type(hs) ~= 'table' then io.write('ERROR\\thealth.lua returned ' .. type(hs)) os.exit(2) end\n\
         io.write(tostring(hs.status), '\\t', tostring(hs.message))\n",
        lua_value(object),
        lua_string(&script.to_string_lossy()),
    );
    let mut child = Command::new(lua())
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("starting lua: {e}"))?;
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(harness.as_bytes())
        .map_err(|e| format!("writing to lua: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("lua: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() || stdout.starts_with("ERROR\t") {
        return Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)));
    }
    let (status, message) = stdout
        .split_once('\t')
        .ok_or_else(|| format!("unexpected harness output {stdout:?}"))?;
    Ok((status.to_string(), message.to_string()))
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

#[test]
fn health_checks_report_the_expected_status_for_every_fixture() {
    let mut failures = Vec::new();
    let mut count = 0;
    for kind in KINDS {
        let dir = kind_dir(kind);
        let listed: BTreeSet<String> = health_tests(kind)
            .tests
            .iter()
            .map(|t| t.input_path.clone())
            .collect();
        // Every fixture on disk is listed (a forgotten one would never be checked).
        for entry in std::fs::read_dir(dir.join("testdata")).unwrap() {
            let name = entry.unwrap().file_name().to_string_lossy().into_owned();
            let rel = format!("testdata/{name}");
            if !listed.contains(&rel) {
                failures.push(format!("{kind}/{rel}: not listed in health_test.yaml"));
            }
        }
        for t in health_tests(kind).tests {
            count += 1;
            let object = read_yaml(&dir.join(&t.input_path));
            match run_health(&dir.join("health.lua"), &object) {
                Err(e) => failures.push(format!("{kind}/{}: {e}", t.input_path)),
                Ok((status, message)) => {
                    if status != t.health_status.status {
                        failures.push(format!(
                            "{kind}/{}: status {status:?}, want {:?} (message {message:?})",
                            t.input_path, t.health_status.status
                        ));
                    }
                    if let Some(want) = &t.health_status.message
                        && &message != want
                    {
                        failures.push(format!(
                            "{kind}/{}: message {message:?}, want {want:?}",
                            t.input_path
                        ));
                    }
                }
            }
        }
    }
    assert!(count >= 15, "only {count} fixtures");
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
    let mut failures = Vec::new();
    for (kind, health, phase, want_kstatus, want_argo, want_wait) in &cases {
        // Current generation: the status describes the spec.
        let obj = with_health(kind, health, *phase, 1);
        let label = format!("{kind} {health:?}");
        if kstatus(&obj) != *want_kstatus {
            failures.push(format!(
                "{label}: kstatus {}, want {want_kstatus}",
                kstatus(&obj)
            ));
        }
        match run_health(&kind_dir(kind).join("health.lua"), &obj) {
            Ok((status, _)) if status == *want_argo => {}
            Ok((status, message)) => failures.push(format!(
                "{label}: Argo CD {status} ({message}), want {want_argo}"
            )),
            Err(e) => failures.push(format!("{label}: {e}")),
        }
        if kubectl_wait_ready(&obj) != *want_wait {
            failures.push(format!("{label}: kubectl wait Ready = {}", !want_wait));
        }
        // A spec change the operator has not seen yet: never Current, never Healthy,
        // and `kubectl wait` keeps waiting (observedGeneration on the condition).
        let stale = with_health(kind, health, *phase, 2);
        if kstatus(&stale) != "InProgress" {
            failures.push(format!("{label} (stale): kstatus {}", kstatus(&stale)));
        }
        match run_health(&kind_dir(kind).join("health.lua"), &stale) {
            Ok((status, _)) if status == "Progressing" => {}
            other => failures.push(format!("{label} (stale): Argo CD {other:?}")),
        }
        if kubectl_wait_ready(&stale) {
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
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn lua_harness_sees_nested_objects_and_escaped_strings() {
    // The harness itself must be able to fail: a script that echoes what it got.
    let dir = std::env::temp_dir().join(format!("podmotion-lua-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("echo.lua");
    std::fs::write(
        &script,
        "local hs = {}\nhs.status = obj.status.conditions[2].type\nhs.message = obj.metadata.name .. '|' .. tostring(obj.metadata.generation)\nreturn hs\n",
    )
    .unwrap();
    let obj = json!({
        "metadata": {"name": "a \"quoted\" \\ name ü", "generation": 7},
        "status": {"conditions": [{"type": "Ready"}, {"type": "Stalled"}]}
    });
    let got = run_health(&script, &obj).unwrap();
    assert_eq!(
        got,
        (
            "Stalled".to_string(),
            "a \"quoted\" \\ name ü|7".to_string()
        )
    );
    std::fs::write(&script, "error('boom')\n").unwrap();
    assert!(run_health(&script, &obj).unwrap_err().contains("boom"));
    let _ = std::fs::remove_dir_all(&dir);
}
