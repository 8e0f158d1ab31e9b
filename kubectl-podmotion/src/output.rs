//! `-o json|yaml`: objects printed as `kubectl get -o json|yaml` prints them — the
//! object as the API server returned it, with `apiVersion` and `kind`, without
//! `metadata.managedFields` (kubectl hides them too), several objects as a `v1` `List`.

use serde::Serialize;
use serde_json::{Value, json};

use crate::cli::Output;

/// One object as JSON, ready to print: `managedFields` left out.
pub fn object<K: Serialize>(k: &K) -> anyhow::Result<Value> {
    let mut v = serde_json::to_value(k)?;
    if let Some(meta) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.remove("managedFields");
    }
    Ok(v)
}

/// Several objects, possibly of several kinds, as kubectl prints them: a `List`.
pub fn list(items: Vec<Value>) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "List",
        "metadata": { "resourceVersion": "" },
        "items": items,
    })
}

/// The text to print, ending with a newline.
pub fn render(v: &Value, format: Output) -> anyhow::Result<String> {
    Ok(match format {
        Output::Json => format!("{}\n", serde_json::to_string_pretty(v)?),
        Output::Yaml => {
            let mut s = serde_saphyr::to_string(v)?;
            if !s.ends_with('\n') {
                s.push('\n');
            }
            s
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use podmotion_api::PodMigration;

    fn pm() -> PodMigration {
        let mut pm: PodMigration = serde_json::from_value(json!({
            "apiVersion": "podmotion.io/v1alpha1",
            "kind": "PodMigration",
            "metadata": {
                "name": "web-0-ab12c",
                "namespace": "shop",
                "managedFields": [{"manager": "kubectl-podmotion", "operation": "Update"}],
            },
            "spec": { "podName": "web-0" },
        }))
        .unwrap();
        pm.metadata.uid = Some("u-1".into());
        pm
    }

    #[test]
    fn an_object_prints_with_its_kind_and_without_managed_fields() {
        let v = object(&pm()).unwrap();
        assert_eq!(v["kind"], "PodMigration");
        assert_eq!(v["apiVersion"], PodMigration::api_version(&()).as_ref());
        assert_eq!(v["metadata"]["name"], "web-0-ab12c");
        assert!(v["metadata"].get("managedFields").is_none(), "{v}");
        let text = render(&v, Output::Json).unwrap();
        let back: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(back, v);
        assert!(text.ends_with("}\n"));
    }

    #[test]
    fn yaml_reads_back_as_the_same_list() {
        let l = list(vec![object(&pm()).unwrap()]);
        assert_eq!(l["kind"], "List");
        let text = render(&l, Output::Yaml).unwrap();
        assert!(text.contains("kind: List"), "{text}");
        let back: Value = serde_saphyr::from_str(&text).unwrap();
        assert_eq!(back, l);
    }
}
