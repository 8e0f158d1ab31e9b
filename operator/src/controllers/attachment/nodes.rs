//! The attachment controller's node cache: each node's platform labels
//! (`kubernetes.io/os`, `kubernetes.io/arch`) and nothing else, from a watch of the
//! nodes' metadata, so that the plan skips pods on nodes the agent image cannot run on instead of
//! creating Jobs the kubelet would reject.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use kube::core::PartialObjectMeta;

use super::state::{PlatformLabels, Shared};
use crate::platform::{ARCH_LABEL, OS_LABEL};

/// The projection: the node's platform labels (a node without either is kept, with
/// what it has, so that "not known" means "not listed").
pub(super) fn platform_labels(n: &PartialObjectMeta<Node>) -> Option<PlatformLabels> {
    Some(
        n.labels()
            .iter()
            .filter(|(k, _)| *k == OS_LABEL || *k == ARCH_LABEL)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    )
}

/// The platform labels of the nodes `nodes` names (those the cache knows).
pub(super) fn labels_of<'a>(
    s: &Shared,
    nodes: impl IntoIterator<Item = &'a str>,
) -> BTreeMap<String, PlatformLabels> {
    nodes
        .into_iter()
        .filter_map(|n| {
            let labels = s.nodes.get(&(String::new(), n.to_string()))?;
            Some((n.to_string(), labels.as_ref().clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    #[test]
    fn only_the_platform_labels_are_kept() {
        let n = PartialObjectMeta::<Node> {
            types: None,
            metadata: ObjectMeta {
                name: Some("n1".into()),
                labels: Some(BTreeMap::from([
                    ("kubernetes.io/os".to_string(), "linux".to_string()),
                    ("kubernetes.io/arch".to_string(), "arm64".to_string()),
                    ("kubernetes.io/hostname".to_string(), "n1".to_string()),
                    ("type".to_string(), "kwok".to_string()),
                ])),
                ..Default::default()
            },
            _phantom: Default::default(),
        };
        assert_eq!(
            platform_labels(&n),
            Some(BTreeMap::from([
                ("kubernetes.io/arch".to_string(), "arm64".to_string()),
                ("kubernetes.io/os".to_string(), "linux".to_string()),
            ]))
        );
    }
}
