//! Releasing a PodMotion finalizer without a running controller: `reap-all` (the
//! attachment Jobs' hook step) and the uninstall hook remove the finalizers a stopped
//! operator can no longer remove. One function serves both, and it never overwrites a
//! concurrent change of the finalizer list: each patch carries the resourceVersion it
//! was computed from, and a conflict is answered by reading the object again. It
//! releases only the objects of its own release (or nobody's): an object another
//! PodMotion release holds (`podmotion_core::claim`) keeps its finalizer, which that
//! release's operator still needs.

use std::fmt::Debug;

use anyhow::Context as _;
use k8s_openapi::NamespaceResourceScope;
use kube::api::{Api, ListParams, PartialObjectMeta, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::json;

use crate::claim::may_act;
use crate::writer::Writer;

/// Conflicts retried per object before giving up (each one a fresh read).
const CONFLICT_RETRIES: usize = 5;

/// The finalizer list without `ours`, or `None` when `ours` is not on it (nothing to do).
pub fn released(finalizers: &[String], ours: &str) -> Option<Vec<String>> {
    finalizers
        .iter()
        .any(|f| f == ours)
        .then(|| finalizers.iter().filter(|f| *f != ours).cloned().collect())
}

/// Removes `ours` from every object of kind `K` in `scope` (`None`: all namespaces)
/// that carries it and that no release but `me` holds; returns how many were released.
pub async fn release_all<K>(
    client: &Client,
    scope: Option<&str>,
    ours: &str,
    me: &str,
) -> anyhow::Result<usize>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let kind = K::kind(&());
    // Run without a controller (hooks): no lease to fence with.
    let writer = Writer::hook(client.clone());
    let api: Api<K> = crate::client::scoped(client, scope);
    let list = api
        .list_metadata(&ListParams::default())
        .await
        .with_context(|| format!("list {kind}"))?;
    let mut n = 0;
    for obj in list.items {
        if release_one(&writer, client, obj, ours, me, &kind).await? {
            n += 1;
        }
    }
    Ok(n)
}

/// Removes `ours` from one object (listed as `obj`) unless another release holds it,
/// reading it again on a conflict (up to [`CONFLICT_RETRIES`] times); whether it was
/// released (`false`: not ours to release, nothing to remove, or gone).
async fn release_one<K>(
    writer: &Writer,
    client: &Client,
    obj: PartialObjectMeta<K>,
    ours: &str,
    me: &str,
    kind: &str,
) -> anyhow::Result<bool>
where
    K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug,
{
    let (ns, name) = (obj.namespace().unwrap_or_default(), obj.name_any());
    let ns_api: Api<K> = Api::namespaced(client.clone(), &ns);
    let mut current = obj;
    for attempt in 0.. {
        if !may_act(current.annotations(), me) {
            break;
        }
        let Some(keep) = released(current.finalizers(), ours) else {
            break;
        };
        let patch = json!({"metadata": {
            "finalizers": keep,
            "resourceVersion": current.resource_version(),
        }});
        let patch = Patch::Merge(&patch);
        match writer
            .patch_metadata(&ns_api, &name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => return Ok(true),
            Err(e) if e.is_status(404) => break,
            Err(e) if e.is_status(409) && attempt < CONFLICT_RETRIES => {
                match ns_api.get_metadata_opt(&name).await? {
                    Some(fresh) => current = fresh,
                    None => break,
                }
            }
            Err(e) => {
                return Err(e).with_context(|| format!("remove {ours} from {kind} {ns}/{name}"));
            }
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use podmotion_api::names::finalizers;

    #[test]
    fn releasing_removes_only_our_finalizer() {
        let ours = finalizers::MIGRATION_CLEANUP;
        let list = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(released(&list(&[ours]), ours), Some(vec![]));
        assert_eq!(
            released(&list(&["example.com/keep", ours]), ours),
            Some(list(&["example.com/keep"]))
        );
        assert_eq!(released(&list(&["example.com/keep"]), ours), None);
        assert_eq!(released(&[], ours), None);
    }
}
