//! The committed CRDs are exactly what the types generate, and the generated schemas
//! keep the rules every CRD of ours must follow.

use podmotion_api::crds;
use serde_json::Value;

#[test]
fn committed_crds_match_the_types() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds");
    for (stem, crd) in crds::all() {
        let path = dir.join(format!("{stem}.yaml"));
        let have = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            have == crds::to_yaml(&crd),
            "{} differs from the types: run `cargo run -p podmotion-api --bin crdgen`",
            path.display()
        );
    }
}

fn schema_of(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
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

/// Visits every subschema with its JSON path.
fn walk(path: &str, v: &Value, f: &mut dyn FnMut(&str, &serde_json::Map<String, Value>)) {
    let Some(obj) = v.as_object() else { return };
    f(path, obj);
    if let Some(props) = obj.get("properties").and_then(Value::as_object) {
        for (k, sub) in props {
            walk(&format!("{path}.{k}"), sub, f);
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(sub) = obj.get(key) {
            walk(&format!("{path}[]"), sub, f);
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = obj.get(key).and_then(Value::as_array) {
            for sub in list {
                walk(path, sub, f);
            }
        }
    }
}

#[test]
fn schemas_have_no_unsigned_formats_and_no_null_defaults() {
    for (stem, crd) in crds::all() {
        walk(stem, &schema_of(&crd), &mut |path, s| {
            if let Some(fmt) = s.get("format").and_then(Value::as_str) {
                assert!(!fmt.starts_with("uint"), "{path}: unsigned format {fmt}");
            }
            assert!(
                s.get("default") != Some(&Value::Null),
                "{path}: null default"
            );
        });
    }
}

#[test]
fn every_spec_and_status_field_has_a_description() {
    for (stem, crd) in crds::all() {
        let schema = schema_of(&crd);
        for part in ["spec", "status"] {
            let sub = &schema["properties"][part];
            assert!(sub.is_object(), "{stem}: no {part}");
            walk(&format!("{stem}.{part}"), sub, &mut |path, s| {
                // Items of lists and maps are described by their field.
                if path.ends_with("[]") {
                    return;
                }
                assert!(
                    s.get("description")
                        .and_then(Value::as_str)
                        .is_some_and(|d| !d.is_empty()),
                    "{path} has no description"
                );
            });
        }
    }
}

#[test]
fn every_kind_has_status_ready_column_category_and_cel_rules() {
    for (stem, crd) in crds::all() {
        let v = &crd.spec.versions[0];
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{stem}: no status subresource"
        );
        let cols = v
            .additional_printer_columns
            .as_ref()
            .expect("printer columns");
        assert!(
            cols.iter()
                .any(|c| c.json_path.contains(r#"@.type=="Ready""#)),
            "{stem}: no column shows the Ready condition"
        );
        assert!(
            cols.iter().any(|c| c.name == "Age"),
            "{stem}: no Age column"
        );
        assert_eq!(
            crd.spec.names.categories.as_deref(),
            Some(&["podmotion".to_string()][..])
        );
        assert_eq!(
            crd.spec.names.short_names.as_ref().map(Vec::len),
            Some(1),
            "{stem}: short name"
        );
        let json = serde_json::to_string(&schema_of(&crd)).unwrap();
        assert!(
            json.contains("x-kubernetes-validations"),
            "{stem}: no CEL rules"
        );
        let mut conditions_is_map = false;
        walk(stem, &schema_of(&crd), &mut |path, s| {
            if path.ends_with("status.conditions") {
                conditions_is_map = s.get("x-kubernetes-list-type") == Some(&Value::from("map"))
                    && s.get("x-kubernetes-list-map-keys") == Some(&serde_json::json!(["type"]));
            }
        });
        assert!(
            conditions_is_map,
            "{stem}: status.conditions is not a list-map keyed by type"
        );
    }
}

#[test]
fn every_cel_rule_has_a_message() {
    for (stem, crd) in crds::all() {
        walk(stem, &schema_of(&crd), &mut |path, s| {
            for rule in s
                .get("x-kubernetes-validations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                assert!(
                    rule.get("message")
                        .and_then(Value::as_str)
                        .is_some_and(|m| !m.is_empty()),
                    "{path}: rule {rule} has no message"
                );
            }
        });
    }
}
