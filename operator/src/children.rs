//! Writes of the objects the operator owns: one helper applies them (server-side apply
//! with a per-controller field manager), one deletes the children a reconcile no longer
//! produced (by label). Their metadata is built by the pure [`crate::meta`].

use std::collections::BTreeSet;
use std::fmt::Debug;

use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PropagationPolicy};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

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
