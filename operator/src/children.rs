//! Objects the operator owns: one helper builds their metadata (recommended labels and,
//! where the owner shares the namespace, a controller owner reference), one applies them
//! (server-side apply with a per-controller field manager), one deletes the children a
//! reconcile no longer produced (by label).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PropagationPolicy};
use kube::{Resource, ResourceExt};
use podmotion_api::names::labels;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::context::Context;
use crate::leader::NotLeader;

/// Errors of the I/O helpers, with a bounded category for metrics and Events.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    #[error(transparent)]
    NotLeader(#[from] NotLeader),
    #[error("{verb} {kind} {name}: {source}")]
    Api {
        verb: &'static str,
        kind: String,
        name: String,
        source: kube::Error,
    },
}

impl ChildError {
    pub fn category(&self) -> &'static str {
        match self {
            ChildError::NotLeader(_) => "NotLeader",
            ChildError::Api { .. } => "ApiError",
        }
    }
}

/// A label value (at most 63 characters): `s` itself when it fits, else a prefix and a
/// hash of the whole, so distinct inputs keep distinct values.
pub fn label_value(s: &str) -> String {
    if s.len() <= 63 {
        return s.to_string();
    }
    let hash = short_hash(s, 10);
    let mut prefix: String = s.chars().take(52).collect();
    while prefix.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        prefix.pop();
    }
    format!("{prefix}-{hash}")
}

/// First `len` hex digits of the SHA-256 of `s`: deterministic across restarts.
pub fn short_hash(s: &str, len: usize) -> String {
    let digest = Sha256::digest(s.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    hex[..len.min(hex.len())].to_string()
}

/// The labels every child of `owner` carries (and that select them for orphan deletion).
pub fn owner_labels<K: Resource<DynamicType = ()>>(owner: &K) -> BTreeMap<String, String> {
    let ns = owner.namespace().unwrap_or_default();
    BTreeMap::from([
        (
            labels::MANAGED_BY.to_string(),
            labels::MANAGED_BY_VALUE.to_string(),
        ),
        (labels::OWNER_KIND.to_string(), K::kind(&()).to_string()),
        (
            labels::OWNER.to_string(),
            label_value(&format!("{ns}.{}", owner.name_any())),
        ),
        (
            labels::OWNER_UID.to_string(),
            owner.uid().unwrap_or_default(),
        ),
    ])
}

/// Label selector matching every child of `owner` (by UID: a recreated owner of the
/// same name does not adopt its predecessor's children).
pub fn owner_selector<K: Resource<DynamicType = ()>>(owner: &K) -> String {
    format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::OWNER_UID,
        owner.uid().unwrap_or_default()
    )
}

/// Metadata of a child called `name` in `namespace` (`None` for cluster-scoped
/// children): the owner's labels, `app.kubernetes.io/{name,instance,component}`, and a
/// controller owner reference when the owner can own it (same namespace).
pub fn child_meta<K: Resource<DynamicType = ()>>(
    owner: &K,
    name: &str,
    namespace: Option<&str>,
    component: &str,
) -> ObjectMeta {
    let mut l = owner_labels(owner);
    l.insert(labels::NAME.into(), component.into());
    l.insert(labels::INSTANCE.into(), label_value(&owner.name_any()));
    l.insert(labels::COMPONENT.into(), component.into());
    let same_namespace = namespace.is_some() && namespace == owner.meta().namespace.as_deref();
    ObjectMeta {
        name: Some(name.into()),
        namespace: namespace.map(Into::into),
        labels: Some(l),
        owner_references: if same_namespace {
            controller_ref(owner).map(|r| vec![r])
        } else {
            None
        },
        ..Default::default()
    }
}

fn controller_ref<K: Resource<DynamicType = ()>>(owner: &K) -> Option<OwnerReference> {
    owner.controller_owner_ref(&())
}

/// Server-side applies `obj` as `manager`, forcing conflicts: callers only apply objects
/// PodMotion exclusively owns.
pub async fn apply<K>(ctx: &Context, api: &Api<K>, obj: &K, manager: &str) -> Result<K, ChildError>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
{
    ctx.ensure_leader()?;
    let name = obj.name_any();
    let params = PatchParams::apply(manager).force();
    api.patch(&name, &params, &Patch::Apply(obj))
        .await
        .map_err(|source| ChildError::Api {
            verb: "apply",
            kind: K::kind(&()).to_string(),
            name,
            source,
        })
}

/// Deletes every object matching `selector` whose name is not in `keep`, with the
/// given propagation. Returns the names deleted.
pub async fn delete_orphans<K>(
    ctx: &Context,
    api: &Api<K>,
    selector: &str,
    keep: &BTreeSet<String>,
    propagation: PropagationPolicy,
) -> Result<Vec<String>, ChildError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    let list = api
        .list_metadata(&ListParams::default().labels(selector))
        .await
        .map_err(|source| ChildError::Api {
            verb: "list",
            kind: K::kind(&()).to_string(),
            name: selector.into(),
            source,
        })?;
    let mut deleted = vec![];
    for obj in list.items {
        let name = obj.name_any();
        if keep.contains(&name) || obj.metadata.deletion_timestamp.is_some() {
            continue;
        }
        delete(ctx, api, &name, propagation.clone()).await?;
        deleted.push(name);
    }
    Ok(deleted)
}

/// Deletes one object; a missing object counts as deleted.
pub async fn delete<K>(
    ctx: &Context,
    api: &Api<K>,
    name: &str,
    propagation: PropagationPolicy,
) -> Result<(), ChildError>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
{
    ctx.ensure_leader()?;
    let params = DeleteParams {
        propagation_policy: Some(propagation),
        ..Default::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        Err(source) => Err(ChildError::Api {
            verb: "delete",
            kind: K::kind(&()).to_string(),
            name: name.into(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn owner() -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("apps".into()),
                uid: Some("1234".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[test]
    fn child_in_the_owners_namespace_gets_a_controller_reference() {
        let m = child_meta(&owner(), "c", Some("apps"), "runner");
        let refs = m.owner_references.expect("owner reference");
        assert_eq!(refs.len(), 1);
        assert_eq!(refs[0].controller, Some(true));
        assert_eq!(refs[0].uid, "1234");
        let l = m.labels.unwrap();
        assert_eq!(l[labels::MANAGED_BY], "podmotion");
        assert_eq!(l[labels::OWNER], "apps.web");
        assert_eq!(l[labels::OWNER_UID], "1234");
        assert_eq!(l[labels::OWNER_KIND], "ConfigMap");
    }

    #[test]
    fn child_in_another_namespace_is_tracked_by_label_only() {
        let m = child_meta(&owner(), "c", Some("podmotion-system"), "node-agent");
        assert!(m.owner_references.is_none());
        assert!(owner_selector(&owner()).contains("podmotion.io/owner-uid=1234"));
        let cluster_scoped = child_meta(&owner(), "pc", None, "runner");
        assert!(cluster_scoped.owner_references.is_none());
    }

    #[test]
    fn long_label_values_are_shortened_without_collisions() {
        let a = label_value(&format!("{}a", "x".repeat(80)));
        let b = label_value(&format!("{}b", "x".repeat(80)));
        assert!(a.len() <= 63 && b.len() <= 63);
        assert_ne!(a, b);
        assert_eq!(label_value("short"), "short");
    }
}
