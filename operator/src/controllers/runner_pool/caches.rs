//! The RunnerPool controller's caches ([`crate::cache`]): what a round reads instead of
//! listing, and which pools a change of it wakes. Each keeps only what the round
//! decides on: the Runner pods' node, scheduling conditions and preflight container
//! status; every NetworkPolicy's name and spec (a policy of another owner that selects
//! the Runner pods is reported); every node's labels (the eligible count); the Runner
//! DaemonSets whole (drift is judged on the live object), without managed fields.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, Pod, PodSpec, PodStatus};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::ObjectMeta;
use kube::core::{DeserializeGuard, PartialObjectMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Resource, ResourceExt};
use podmotion_api::RunnerPool;
use podmotion_api::names::labels;

use crate::cache::Change;
use crate::platform::Platform;

pub(super) type PoolRef = ObjectRef<DeserializeGuard<RunnerPool>>;
pub(super) type Pools = Store<DeserializeGuard<RunnerPool>>;

/// A node's labels.
pub(super) type NodeLabels = BTreeMap<String, String>;

/// A Runner pod as the status reads it (its preflight verdict, whether it is
/// unschedulable): a kubelet heartbeat of another container changes none of it.
pub(super) fn runner_pod(p: &Pod) -> Option<Pod> {
    let spec = p.spec.as_ref();
    let status = p.status.as_ref();
    Some(Pod {
        metadata: ObjectMeta {
            name: p.metadata.name.clone(),
            namespace: p.metadata.namespace.clone(),
            labels: p.metadata.labels.clone(),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: spec.and_then(|s| s.node_name.clone()),
            ..Default::default()
        }),
        status: Some(PodStatus {
            conditions: status.and_then(|s| s.conditions.clone()),
            init_container_statuses: status.and_then(|s| s.init_container_statuses.clone()),
            ..Default::default()
        }),
    })
}

/// A NetworkPolicy's name and spec (what `foreign_policies` reads).
pub(super) fn policy(np: &NetworkPolicy) -> Option<NetworkPolicy> {
    Some(NetworkPolicy {
        metadata: ObjectMeta {
            name: np.metadata.name.clone(),
            namespace: np.metadata.namespace.clone(),
            ..Default::default()
        },
        spec: np.spec.clone(),
    })
}

/// The Runner DaemonSet without its managed fields.
pub(super) fn daemonset(ds: &DaemonSet) -> Option<DaemonSet> {
    let mut ds = ds.clone();
    ds.metadata.managed_fields = None;
    Some(ds)
}

/// A node's labels.
pub(super) fn node_labels(n: &PartialObjectMeta<Node>) -> Option<NodeLabels> {
    Some(n.labels().clone())
}

/// Whether a node with `labels` is eligible for `pool`: it carries the pool's label
/// and the platform's (the Runner pod's whole nodeSelector).
pub(super) fn eligible(pool: &RunnerPool, platform: &Platform, labels: &NodeLabels) -> bool {
    crate::runner_pool::render::eligible(pool, platform, labels)
}

fn refs(pools: &Pools, keep: impl Fn(&RunnerPool) -> bool) -> Vec<PoolRef> {
    pools
        .state()
        .iter()
        .filter(|g| g.0.as_ref().is_ok_and(&keep))
        .map(|g| ObjectRef::from_obj(g.as_ref()))
        .collect()
}

/// A node's labels changed: the pools whose eligible count it changes.
pub(super) fn pools_of_node(
    pools: &Pools,
    platform: &Platform,
    c: &Change<NodeLabels>,
) -> Vec<PoolRef> {
    refs(pools, |p| {
        c.old.as_deref().is_some_and(|l| eligible(p, platform, l))
            != c.new.as_deref().is_some_and(|l| eligible(p, platform, l))
    })
}

/// A NetworkPolicy changed: the pools of its namespace (few; each reads the policies
/// of its namespace from the cache).
pub(super) fn pools_in_namespace(pools: &Pools, c: &Change<NetworkPolicy>) -> Vec<PoolRef> {
    refs(pools, |p| {
        p.namespace().as_deref() == Some(c.key.0.as_str())
    })
}

/// A Runner pod changed: its pool, by the instance label every Runner pod carries.
pub(super) fn pool_of_pod(c: &Change<Pod>) -> Option<PoolRef> {
    let pool = c.latest()?.labels().get(labels::INSTANCE)?.clone();
    Some(ObjectRef::new(&pool).within(&c.key.0))
}

/// A DaemonSet changed: the RunnerPool that owns it.
pub(super) fn pool_of_daemonset(c: &Change<DaemonSet>) -> Option<PoolRef> {
    let owner = c
        .latest()?
        .owner_references()
        .iter()
        .find(|o| o.kind == RunnerPool::kind(&()))?
        .name
        .clone();
    Some(ObjectRef::new(&owner).within(&c.key.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::Key;
    use serde_json::json;
    use std::sync::Arc;

    fn pool(ns: &str, name: &str, key: &str, value: &str) -> RunnerPool {
        let mut p: RunnerPool = serde_json::from_value(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"image": "r@sha256:00", "sessionsPerNode": 1,
                "server": {"serviceName": "s", "port": 8443}}
        }))
        .unwrap();
        p.spec.nodes.label_key = key.into();
        p.spec.nodes.label_value = value.into();
        p
    }

    fn pools(ps: Vec<RunnerPool>) -> Pools {
        let (store, mut writer) = kube::runtime::reflector::store();
        for p in ps {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(DeserializeGuard(
                Ok(p),
            )));
        }
        store
    }

    fn labels(kv: &[(&str, &str)]) -> Option<Arc<NodeLabels>> {
        Some(Arc::new(
            kv.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ))
    }

    fn names(refs: Vec<PoolRef>) -> Vec<String> {
        let mut n: Vec<String> = refs.into_iter().map(|r| r.name).collect();
        n.sort();
        n
    }

    fn node_change(
        old: Option<Arc<NodeLabels>>,
        new: Option<Arc<NodeLabels>>,
    ) -> Change<NodeLabels> {
        let key: Key = (String::new(), "n1".into());
        Change { key, old, new }
    }

    #[test]
    fn a_node_wakes_only_the_pools_whose_eligible_count_it_changes() {
        let store = pools(vec![
            pool("a", "gpu", "role", "gpu"),
            pool("a", "web", "role", "web"),
        ]);
        let amd = Platform::default();
        let linux = |role: &str, arch: &str| {
            labels(&[
                ("role", role),
                ("kubernetes.io/os", "linux"),
                ("kubernetes.io/arch", arch),
            ])
        };
        let gpu = linux("gpu", "amd64");
        let web = linux("web", "amd64");
        let other = labels(&[
            ("role", "gpu"),
            ("zone", "z1"),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
        ]);
        let changed = |old, new| names(pools_of_node(&store, &amd, &node_change(old, new)));
        assert_eq!(changed(None, gpu.clone()), ["gpu"]);
        assert_eq!(changed(gpu.clone(), web), ["gpu", "web"]);
        assert!(changed(gpu.clone(), other).is_empty());
        // A node of another architecture runs no Runner of PodMotion's preflight.
        assert_eq!(changed(gpu.clone(), linux("gpu", "arm64")), ["gpu"]);
        assert!(changed(None, linux("gpu", "arm64")).is_empty());
        assert_eq!(changed(gpu, None), ["gpu"]);
    }

    #[test]
    fn a_policy_wakes_the_pools_of_its_namespace() {
        let store = pools(vec![pool("a", "one", "k", "v"), pool("b", "two", "k", "v")]);
        let c = Change {
            key: ("b".to_string(), "allow-all".to_string()),
            old: None,
            new: policy(&NetworkPolicy::default()).map(Arc::new),
        };
        assert_eq!(names(pools_in_namespace(&store, &c)), ["two"]);
    }

    #[test]
    fn a_daemonset_wakes_its_owning_pool_and_a_pod_its_instance() {
        let ds: DaemonSet = serde_json::from_value(json!({
            "metadata": {"name": "rp", "namespace": "a", "ownerReferences": [
                {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x", "uid": "1"},
                {"apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool", "name": "gpu", "uid": "2"}
            ]}
        }))
        .unwrap();
        let key = ("a".to_string(), "rp".to_string());
        let c = Change {
            key: key.clone(),
            old: daemonset(&ds).map(Arc::new),
            new: None,
        };
        let r = pool_of_daemonset(&c).unwrap();
        assert_eq!(
            (r.name.as_str(), r.namespace.as_deref()),
            ("gpu", Some("a"))
        );
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "rp-x", "namespace": "a",
                "labels": {labels::INSTANCE: "gpu"}}
        }))
        .unwrap();
        let c = Change {
            key: ("a".to_string(), "rp-x".to_string()),
            old: None,
            new: runner_pod(&pod).map(Arc::new),
        };
        assert_eq!(pool_of_pod(&c).unwrap().name, "gpu");
    }

    #[test]
    fn a_runner_pod_keeps_what_the_status_reads() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": "rp-x", "namespace": "a", "resourceVersion": "7",
                "labels": {"l": "v"}, "annotations": {"big": "x"}},
            "spec": {"nodeName": "n1", "containers": [{"name": "runner", "image": "i"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "initContainerStatuses": [{"name": "preflight", "image": "i", "imageID": "",
                    "ready": true, "restartCount": 0}]}
        }))
        .unwrap();
        let kept = runner_pod(&pod).unwrap();
        assert_eq!(kept.name_any(), "rp-x");
        assert_eq!(kept.labels().get("l").map(String::as_str), Some("v"));
        assert!(kept.annotations().is_empty() && kept.resource_version().is_none());
        let spec = kept.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        assert!(spec.containers.is_empty());
        let st = kept.status.as_ref().unwrap();
        assert_eq!(st.conditions, pod.status.as_ref().unwrap().conditions);
        assert_eq!(
            st.init_container_statuses,
            pod.status.as_ref().unwrap().init_container_statuses
        );
        assert!(st.phase.is_none() && st.pod_ip.is_none());
    }
}
