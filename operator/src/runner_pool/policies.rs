//! Other NetworkPolicies that select the Runner pods. Allows are additive, so any
//! other policy with an allow rule that selects our pods can reopen what ours denies;
//! the status names them. A policy without rules only denies and is harmless.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::ResourceExt;

/// Whether `selector` matches `labels` (matchLabels and matchExpressions; an empty
/// selector matches everything, as in a NetworkPolicy's podSelector).
pub fn selects(selector: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let by_label = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let by_expr = selector.match_expressions.iter().flatten().all(|e| {
        let have = labels.get(&e.key);
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" => have.is_some_and(|h| values.contains(h)),
            "NotIn" => have.is_none_or(|h| !values.contains(h)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    });
    by_label && by_expr
}

/// Names of the policies other than `own` that select pods with `pod_labels` and
/// allow some traffic.
pub fn foreign_policies(
    own: &str,
    pod_labels: &BTreeMap<String, String>,
    policies: &[NetworkPolicy],
) -> Vec<String> {
    policies
        .iter()
        .filter(|p| p.name_any() != own)
        .filter(|p| {
            let Some(spec) = &p.spec else { return false };
            let selected = spec
                .pod_selector
                .as_ref()
                .is_none_or(|s| selects(s, pod_labels));
            let allows = spec.ingress.as_ref().is_some_and(|r| !r.is_empty())
                || spec.egress.as_ref().is_some_and(|r| !r.is_empty());
            selected && allows
        })
        .map(|p| p.name_any())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn np(name: &str, spec: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
    }
    fn runner_labels() -> BTreeMap<String, String> {
        BTreeMap::from([
            ("app.kubernetes.io/name".to_string(), "runner".to_string()),
            ("app.kubernetes.io/instance".to_string(), "rp".to_string()),
        ])
    }

    #[test]
    fn an_allow_all_policy_over_every_pod_is_foreign_and_ours_is_not() {
        let policies = vec![
            np("rp", json!({"podSelector": {}, "egress": [{}]})),
            np(
                "allow-all",
                json!({"podSelector": {}, "egress": [{}], "policyTypes": ["Egress"]}),
            ),
        ];
        assert_eq!(
            foreign_policies("rp", &runner_labels(), &policies),
            vec!["allow-all"]
        );
    }

    #[test]
    fn deny_only_and_non_selecting_policies_are_not_foreign() {
        let policies = vec![
            np(
                "default-deny",
                json!({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}),
            ),
            np(
                "web",
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{}]}),
            ),
            np(
                "not-runners",
                json!({"podSelector": {"matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "NotIn", "values": ["runner"]}]}, "ingress": [{}]}),
            ),
        ];
        assert!(foreign_policies("rp", &runner_labels(), &policies).is_empty());
    }

    #[test]
    fn match_expressions_are_evaluated() {
        let s: LabelSelector = serde_json::from_value(json!({"matchExpressions": [
            {"key": "app.kubernetes.io/name", "operator": "In", "values": ["runner", "x"]},
            {"key": "gone", "operator": "DoesNotExist"}
        ]}))
        .unwrap();
        assert!(selects(&s, &runner_labels()));
        let mut l = runner_labels();
        l.insert("gone".into(), "1".into());
        assert!(!selects(&s, &l));
    }
}
