//! Every example under `examples/valid` is accepted, and every one under
//! `examples/invalid` is rejected with the message it names, by the same checks the
//! API server runs: the structural schema (types, enums, required, bounds, unknown
//! fields) and the CEL rules, evaluated client-side (kube's `cel` feature). The e2e
//! suite sends the same files to the real API server.

use kube::core::cel::Validator;
use podmotion_api::samples::{Sample, examples_dir, load_dir};
use serde_json::Value;

fn schema_for(kind: &str) -> Value {
    let crd = podmotion_api::crds::all()
        .into_iter()
        .map(|(_, c)| c)
        .find(|c| c.spec.names.kind == kind)
        .unwrap_or_else(|| panic!("no CRD of kind {kind:?}"));
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

/// Structural validation in the API server's words (the parts our schemas use).
fn structural(schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    if v.is_null() {
        if schema.get("nullable") != Some(&Value::Bool(true)) {
            errs.push(format!("{path}: Invalid value: \"null\": must not be null"));
        }
        return;
    }
    let ty = schema.get("type").and_then(Value::as_str).unwrap_or("");
    let ok = match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        _ => true,
    };
    if !ok && schema.get("x-kubernetes-int-or-string").is_none() {
        errs.push(format!("{path}: Invalid value: {v}: must be of type {ty}"));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(v)
    {
        let list: Vec<String> = allowed.iter().map(|a| a.to_string()).collect();
        errs.push(format!(
            "{path}: Unsupported value: {v}: supported values: {}",
            list.join(", ")
        ));
    }
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    if let Some(x) = v.as_f64() {
        if num("minimum").is_some_and(|m| x < m) {
            errs.push(format!(
                "{path}: Invalid value: {v}: should be greater than or equal to {}",
                num("minimum").unwrap()
            ));
        }
        if num("maximum").is_some_and(|m| x > m) {
            errs.push(format!(
                "{path}: Invalid value: {v}: should be less than or equal to {}",
                num("maximum").unwrap()
            ));
        }
    }
    if let Some(s) = v.as_str() {
        if num("maxLength").is_some_and(|m| s.len() as f64 > m) {
            errs.push(format!(
                "{path}: Too long: may not be more than {} bytes",
                num("maxLength").unwrap()
            ));
        }
        if num("minLength").is_some_and(|m| (s.len() as f64) < m) {
            errs.push(format!(
                "{path}: Invalid value: {v}: should be at least {} chars long",
                num("minLength").unwrap()
            ));
        }
    }
    if let Some(items) = v.as_array() {
        if num("maxItems").is_some_and(|m| items.len() as f64 > m) {
            errs.push(format!(
                "{path}: Too many: {}: must have at most {} items",
                items.len(),
                num("maxItems").unwrap()
            ));
        }
        if let Some(sub) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                structural(sub, item, &format!("{path}[{i}]"), errs);
            }
        }
    }
    if let Some(obj) = v.as_object() {
        // ObjectMeta is validated by the API server's own code, not by our schema.
        if path == "metadata" {
            return;
        }
        for req in schema
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let req = req.as_str().unwrap_or_default();
            if !obj.contains_key(req) {
                errs.push(format!("{path}.{req}: Required value"));
            }
        }
        let props = schema.get("properties").and_then(Value::as_object);
        let extra = schema.get("additionalProperties");
        let open = schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
        for (k, sub) in obj {
            let child = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            if let Some(s) = props.and_then(|p| p.get(k)) {
                structural(s, sub, &child, errs);
            } else if let Some(s) = extra.filter(|e| e.is_object()) {
                structural(s, sub, &child, errs);
            } else if !(open
                || path.is_empty() && matches!(k.as_str(), "apiVersion" | "kind" | "metadata"))
            {
                errs.push(format!("unknown field \"{child}\""));
            }
        }
    }
}

/// Every message the API server would answer for this sample, or none.
fn rejections(sample: &Sample) -> Vec<String> {
    let schema = schema_for(sample.kind());
    let mut errs = vec![];
    if let Some(old) = &sample.old {
        let old_errs = rejections(&Sample {
            old: None,
            object: old.clone(),
            ..sample.clone()
        });
        assert!(
            old_errs.is_empty(),
            "{}: the first document must be valid: {old_errs:?}",
            sample.name()
        );
    }
    structural(&schema, &sample.object, "", &mut errs);
    if errs.is_empty()
        && let Err(cel) = Validator::new().validate(&schema, &sample.object, sample.old.as_ref())
    {
        errs.extend(cel.iter().map(|e| e.to_string()));
    }
    errs
}

#[test]
fn every_valid_example_is_accepted() {
    let samples = load_dir(&examples_dir().join("valid")).unwrap();
    for kind in ["PodMigration", "NodeAgentAttachment", "RunnerPool"] {
        assert!(
            samples.iter().any(|s| s.kind() == kind),
            "no valid example of {kind}"
        );
    }
    for s in &samples {
        let errs = rejections(s);
        assert!(errs.is_empty(), "{} was rejected: {errs:#?}", s.name());
    }
}

#[test]
fn every_invalid_example_is_rejected_with_its_message() {
    let samples = load_dir(&examples_dir().join("invalid")).unwrap();
    assert!(
        samples.len() >= 20,
        "only {} invalid examples",
        samples.len()
    );
    let mut failures = Vec::new();
    for s in &samples {
        let expect = s
            .expect
            .as_deref()
            .unwrap_or_else(|| panic!("{} has no `# expect:` line", s.name()));
        let errs = rejections(s);
        if !errs.iter().any(|e| e.contains(expect)) {
            failures.push(format!(
                "{}: want a rejection containing {expect:?}, got {errs:#?}",
                s.name()
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_checks_can_reject_an_unknown_field_and_a_bad_enum() {
    let s = Sample::parse(
        std::path::Path::new("inline.yaml"),
        "apiVersion: podmotion.io/v1alpha1\nkind: PodMigration\nmetadata: {name: m}\nspec: {podName: web-0, mode: Hot, colour: blue}\n",
    )
    .unwrap();
    let errs = rejections(&s);
    assert!(
        errs.iter()
            .any(|e| e.contains("Unsupported value: \"Hot\"")),
        "{errs:?}"
    );
    assert!(
        errs.iter()
            .any(|e| e.contains("unknown field \"spec.colour\"")),
        "{errs:?}"
    );
}
