//! Metadata of the objects the operator owns, pure: the recommended labels, the
//! selector that finds an owner's children, a controller owner reference where the
//! owner shares the namespace, and the one SHA-256-to-hex helper behind generated names
//! and label values. The cores build their objects with it; the writes are in
//! the runtime's `children`.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube_core::ObjectMeta;
use kube_core::{Resource, ResourceExt};
use podmotion_api::names::labels;
use sha2::{Digest, Sha256};

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
    sha256_hex(s.as_bytes(), len)
}

/// First `len` hex digits (at most 64) of the SHA-256 of `data`: the one hash helper
/// behind every generated name, label value and spec hash.
pub fn sha256_hex(data: &[u8], len: usize) -> String {
    let mut out = hex(&Sha256::digest(data));
    out.truncate(len);
    out
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
    fn sha256_hex_is_the_digest_prefix() {
        assert_eq!(sha256_hex(b"abc", 16), "ba7816bf8f01cfea");
        assert_eq!(sha256_hex(b"abc", 100).len(), 64);
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
