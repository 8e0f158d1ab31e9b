//! The one door for the operator's API writes: every create, apply, replace, patch and
//! delete, the orphan sweep, the status writes and the Events go through a [`Writer`].
//!
//! The leader's fence lives here and nowhere else: each write asks [`Writer::fence`]
//! (is the lease held *and* current, `Leadership::ensure`) just before its request, so
//! no call site can forget it and a replica that lost its lease writes nothing. The
//! few acts that need no fence are explicit: [`Writer::unfenced`] gives a writer
//! without it, for what every replica may do (the eviction webhook's create of a
//! PodMigration whose name is derived from the pod's UID, atomic by that name) and
//! for the uninstall hook, which runs with the controllers stopped. The lease's own
//! writes (`leader.rs`) are the fence itself and stay there.
//!
//! The verbs are the shapes the controllers use (stackable's `ClusterResources` is the
//! model): server-side apply of an object we own, create-if-absent, create, replace
//! (carrying the resourceVersion read), patch, delete-ignoring-absent, the orphan sweep
//! by label, the status write by server-side apply with the resourceVersion of the
//! read it was decided from as a precondition (a decision made on a stale read gets a
//! conflict, never a write), and the claim of an object for this release (an
//! annotation, with the same precondition). `hack/check-layers.sh` fails on an API write call outside
//! this module.

use std::collections::BTreeSet;
use std::fmt::Debug;

use k8s_openapi::api::autoscaling::v1::Scale;
use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::events::{Event, Recorder, Reporter};
use kube::runtime::finalizer::{self, Event as FinalizerEvent};
use kube::{Client, Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::leader::{Leadership, NotLeader};

/// Errors of a write, with a bounded category for metrics and Events.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
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

impl WriteError {
    pub fn category(&self) -> &'static str {
        match self {
            WriteError::NotLeader(_) => "NotLeader",
            WriteError::Api { .. } => "ApiError",
        }
    }

    /// Whether the API server answered with HTTP status `code`.
    pub fn is_status(&self, code: u16) -> bool {
        matches!(self, WriteError::Api { source: kube::Error::Api(s), .. } if s.code == code)
    }

    /// Whether a create failed because the object exists (409 `AlreadyExists`). Any
    /// other 409 (a `Conflict`) says nothing about the object.
    pub fn is_already_exists(&self) -> bool {
        matches!(self, WriteError::Api { source: kube::Error::Api(s), .. }
            if s.code == 409 && s.reason == "AlreadyExists")
    }

    /// Whether the write's precondition failed: the object changed since the read the
    /// write was decided from (409 `Conflict`).
    pub fn is_conflict(&self) -> bool {
        matches!(self, WriteError::Api { source: kube::Error::Api(s), .. }
            if s.code == 409 && s.reason != "AlreadyExists")
    }
}

/// The writer: the client, the leader's fence and the Event reporter.
#[derive(Clone)]
pub struct Writer {
    client: Client,
    /// `None`: an unfenced writer (see the module documentation).
    fence: Option<Leadership>,
    recorder: Recorder,
}

fn kind_of<K: Resource<DynamicType = ()>>() -> String {
    K::kind(&()).to_string()
}

impl Writer {
    /// A writer fenced by `leader`: it writes only while this replica leads.
    pub fn fenced(client: Client, leader: Leadership, reporter: Reporter) -> Writer {
        Writer {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            fence: Some(leader),
        }
    }

    /// The same writer without the fence, for acts every replica may do and for the
    /// uninstall hook (see the module documentation). Say why at the call site.
    pub fn unfenced(&self) -> Writer {
        Writer {
            fence: None,
            ..self.clone()
        }
    }

    /// An unfenced writer on `client` (the uninstall hook: no lease, no controllers).
    pub fn hook(client: Client) -> Writer {
        let reporter = Reporter {
            controller: "podmotion-operator".into(),
            instance: None,
        };
        Writer {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            fence: None,
        }
    }

    /// The leader check, the only one: `Ok` while this replica holds a current lease
    /// (always for an unfenced writer).
    pub fn fence(&self) -> Result<(), NotLeader> {
        match &self.fence {
            Some(leader) => leader.ensure(),
            None => Ok(()),
        }
    }

    /// Whether a write now would pass the fence: loops that only write (the orphan
    /// sweep, the CA keeper) skip their round on a follower.
    pub fn leads(&self) -> bool {
        self.fence().is_ok()
    }

    /// The client writes go through (reads use the context's).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Server-side applies `obj` as `manager`, forcing conflicts: only for objects
    /// PodMotion exclusively owns.
    pub async fn apply<K>(&self, api: &Api<K>, obj: &K, manager: &str) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
    {
        let name = obj.name_any();
        self.patch(
            api,
            &name,
            &PatchParams::apply(manager).force(),
            &Patch::Apply(obj),
        )
        .await
        .map_err(|e| e.verb("apply"))
    }

    /// Creates `obj`.
    pub async fn create<K>(&self, api: &Api<K>, pp: &PostParams, obj: &K) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
    {
        self.fence()?;
        api.create(pp, obj).await.map_err(|source| WriteError::Api {
            verb: "create",
            kind: kind_of::<K>(),
            name: obj.name_any(),
            source,
        })
    }

    /// Creates `obj` as `manager`; `None` when it exists already (409 `AlreadyExists`
    /// only: any other conflict is an error, so the caller tries again).
    pub async fn create_if_absent<K>(
        &self,
        api: &Api<K>,
        obj: &K,
        manager: &str,
    ) -> Result<Option<K>, WriteError>
    where
        K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
    {
        let pp = PostParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        match self.create(api, &pp, obj).await {
            Ok(o) => Ok(Some(o)),
            Err(e) if e.is_already_exists() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Replaces the object `name` with `obj`; `obj` carries the resourceVersion it was
    /// computed from, so a concurrent change makes it a conflict (409).
    pub async fn replace<K>(
        &self,
        api: &Api<K>,
        name: &str,
        pp: &PostParams,
        obj: &K,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + Serialize + DeserializeOwned + Clone + Debug,
    {
        self.fence()?;
        api.replace(name, pp, obj)
            .await
            .map_err(api_error::<K>("replace", name))
    }

    /// Patches the object `name`.
    pub async fn patch<K, P>(
        &self,
        api: &Api<K>,
        name: &str,
        pp: &PatchParams,
        patch: &Patch<P>,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
        P: Serialize + Debug,
    {
        self.fence()?;
        api.patch(name, pp, patch)
            .await
            .map_err(api_error::<K>("patch", name))
    }

    /// Patches the metadata of the object `name` (finalizers, by the uninstall hook).
    pub async fn patch_metadata<K, P>(
        &self,
        api: &Api<K>,
        name: &str,
        pp: &PatchParams,
        patch: &Patch<P>,
    ) -> Result<(), WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
        P: Serialize + Debug,
    {
        self.fence()?;
        api.patch_metadata(name, pp, patch)
            .await
            .map(|_| ())
            .map_err(api_error::<K>("patch metadata of", name))
    }

    /// Patches the `/status` of the object `name`.
    pub async fn patch_status<K, P>(
        &self,
        api: &Api<K>,
        name: &str,
        pp: &PatchParams,
        patch: &Patch<P>,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
        P: Serialize + Debug,
    {
        self.fence()?;
        api.patch_status(name, pp, patch)
            .await
            .map_err(api_error::<K>("patch status of", name))
    }

    /// Patches the `/scale` of the object `name`.
    pub async fn patch_scale<K, P>(
        &self,
        api: &Api<K>,
        name: &str,
        pp: &PatchParams,
        patch: &Patch<P>,
    ) -> Result<Scale, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
        P: Serialize + Debug,
    {
        self.fence()?;
        api.patch_scale(name, pp, patch)
            .await
            .map_err(api_error::<K>("scale", name))
    }

    /// Patches the `/approval` of a CertificateSigningRequest (Approved, Denied).
    pub async fn patch_approval<P: Serialize + Debug>(
        &self,
        api: &Api<CertificateSigningRequest>,
        name: &str,
        pp: &PatchParams,
        patch: &Patch<P>,
    ) -> Result<(), WriteError> {
        self.fence()?;
        api.patch_approval(name, pp, patch)
            .await
            .map(|_| ())
            .map_err(|source| WriteError::Api {
                verb: "patch approval of",
                kind: "CertificateSigningRequest".into(),
                name: name.into(),
                source,
            })
    }

    /// Deletes the object `name`; `Ok(false)` when it was already gone (404). Any other
    /// answer (a failed precondition: 409) is the caller's to judge.
    pub async fn delete<K>(
        &self,
        api: &Api<K>,
        name: &str,
        dp: &DeleteParams,
    ) -> Result<bool, WriteError>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    {
        self.fence()?;
        match api.delete(name, dp).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
            Err(source) => Err(WriteError::Api {
                verb: "delete",
                kind: kind_of::<K>(),
                name: name.into(),
                source,
            }),
        }
    }

    /// Deletes the object `name` with `propagation`; a missing object counts as deleted.
    pub async fn delete_with<K>(
        &self,
        api: &Api<K>,
        name: &str,
        propagation: PropagationPolicy,
    ) -> Result<(), WriteError>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    {
        let dp = DeleteParams {
            propagation_policy: Some(propagation),
            ..Default::default()
        };
        self.delete(api, name, &dp).await.map(|_| ())
    }

    /// The orphan sweep: deletes every object matching `selector` whose name is not in
    /// `keep` (and that is not already going), with `propagation`. Returns the names
    /// deleted.
    pub async fn delete_orphans<K>(
        &self,
        api: &Api<K>,
        selector: &str,
        keep: &BTreeSet<String>,
        propagation: PropagationPolicy,
    ) -> Result<Vec<String>, WriteError>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
    {
        let list = api
            .list_metadata(&ListParams::default().labels(selector))
            .await
            .map_err(|source| WriteError::Api {
                verb: "list",
                kind: kind_of::<K>(),
                name: selector.into(),
                source,
            })?;
        let mut deleted = vec![];
        for obj in list.items {
            let name = obj.name_any();
            if keep.contains(&name) || obj.metadata.deletion_timestamp.is_some() {
                continue;
            }
            self.delete_with(api, &name, propagation.clone()).await?;
            deleted.push(name);
        }
        Ok(deleted)
    }

    /// Server-side applies `body` (type, name, the status; see
    /// `controllers::shell::status_apply_body`) on the `/status` of `obj` as `manager`,
    /// with `obj`'s resourceVersion as a precondition: the status is a decision made
    /// from `obj` as read, so when the object has changed since (the read came from a
    /// cache that lagged behind) the API server answers 409 `Conflict` and nothing is
    /// written; [`WriteError::is_conflict`] tells the caller to read again.
    pub async fn apply_status<K>(
        &self,
        api: &Api<K>,
        obj: &K,
        manager: &str,
        mut body: serde_json::Value,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
    {
        if let (Some(rv), Some(meta)) = (obj.resource_version(), body.get_mut("metadata"))
            && let Some(meta) = meta.as_object_mut()
        {
            meta.insert("resourceVersion".into(), rv.into());
        }
        self.patch_status(
            api,
            &obj.name_any(),
            &PatchParams::apply(manager).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(|e| e.verb("apply status of"))
    }

    /// Claims `obj` for a release: sets its annotation `key` to `value` by a merge
    /// patch that carries the resourceVersion `obj` was read at, so of two writers that
    /// read the same version only the first wins and the other gets 409 `Conflict`
    /// ([`WriteError::is_conflict`]): it reads again and sees the winner's claim.
    /// Returns the object as written (its new resourceVersion is what the round's
    /// status write must carry).
    pub async fn claim<K>(
        &self,
        api: &Api<K>,
        obj: &K,
        key: &str,
        value: &str,
        manager: &str,
    ) -> Result<K, WriteError>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug,
    {
        let patch = serde_json::json!({"metadata": {
            "resourceVersion": obj.resource_version(),
            "annotations": { key: value },
        }});
        let pp = PatchParams {
            field_manager: Some(manager.into()),
            ..Default::default()
        };
        self.patch(api, &obj.name_any(), &pp, &Patch::Merge(&patch))
            .await
            .map_err(|e| e.verb("claim"))
    }

    /// Runs kube-runtime's finalizer helper (which adds and removes `name` on `obj`
    /// by patches) behind the fence.
    pub async fn finalizer<K, F, Fut, E>(
        &self,
        api: &Api<K>,
        name: &str,
        obj: std::sync::Arc<K>,
        reconcile: F,
    ) -> Result<Result<kube::runtime::controller::Action, finalizer::Error<E>>, NotLeader>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Serialize + Debug,
        F: FnOnce(FinalizerEvent<K>) -> Fut,
        Fut: Future<Output = Result<kube::runtime::controller::Action, E>>,
        E: std::error::Error + 'static,
    {
        self.fence()?;
        Ok(finalizer::finalizer(api, name, obj, reconcile).await)
    }

    /// Records `event` about `obj` (best effort: a failure is logged, never returned;
    /// a fenced writer that does not lead records nothing).
    pub async fn publish(&self, event: &Event, obj: &ObjectReference) {
        if self.fence().is_err() {
            return;
        }
        if let Err(e) = self.recorder.publish(event, obj).await {
            tracing::warn!(error = %e, reason = %event.reason, "could not record event");
        }
    }
}

impl WriteError {
    /// The same error under another verb (the verb of the caller's intent).
    fn verb(self, verb: &'static str) -> WriteError {
        match self {
            WriteError::Api {
                kind, name, source, ..
            } => WriteError::Api {
                verb,
                kind,
                name,
                source,
            },
            e => e,
        }
    }
}

/// The error of a write `verb` on the object `name` of kind `K`, for `map_err`.
fn api_error<K: Resource<DynamicType = ()>>(
    verb: &'static str,
    name: &str,
) -> impl FnOnce(kube::Error) -> WriteError {
    let name = name.to_string();
    move |source| WriteError::Api {
        verb,
        kind: kind_of::<K>(),
        name,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    fn writer(leader: Leadership) -> Writer {
        // A client that is never reached: the fence answers first.
        let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
        let client = crate::client::from_config(config, Default::default()).unwrap();
        Writer::fenced(
            client,
            leader,
            Reporter {
                controller: "test".into(),
                instance: None,
            },
        )
    }

    fn cm() -> ConfigMap {
        ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some("x".into()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_follower_s_writer_refuses_every_verb_before_any_request() {
        let w = writer(Leadership::elected());
        let api: Api<ConfigMap> = Api::namespaced(w.client().clone(), "ns");
        assert!(!w.leads());
        let not_leader = |e: WriteError| matches!(e, WriteError::NotLeader(_));
        assert!(not_leader(w.apply(&api, &cm(), "m").await.unwrap_err()));
        assert!(not_leader(
            w.create_if_absent(&api, &cm(), "m").await.unwrap_err()
        ));
        assert!(not_leader(
            w.replace(&api, "x", &PostParams::default(), &cm())
                .await
                .unwrap_err()
        ));
        assert!(not_leader(
            w.delete(&api, "x", &DeleteParams::default())
                .await
                .unwrap_err()
        ));
        assert!(not_leader(
            w.delete_with(&api, "x", PropagationPolicy::Foreground)
                .await
                .unwrap_err()
        ));
        assert!(not_leader(
            w.claim(&api, &cm(), "podmotion.io/controller", "ns/lease", "m")
                .await
                .unwrap_err()
        ));
        let body = serde_json::json!({"metadata": {"name": "x"}, "status": {}});
        assert!(not_leader(
            w.apply_status(&api, &cm(), "m", body).await.unwrap_err()
        ));
        // Unfenced, the same writer reaches the (unreachable) server instead.
        let free = w.unfenced();
        assert!(free.leads());
        assert!(matches!(
            free.delete(&api, "x", &DeleteParams::default())
                .await
                .unwrap_err(),
            WriteError::Api { .. }
        ));
    }

    #[test]
    fn only_already_exists_counts_as_an_existing_object_and_only_conflict_as_stale() {
        let err = |code: u16, reason: &str| {
            let mut st = kube::core::Status::failure("x", reason);
            st.code = code;
            WriteError::Api {
                verb: "create",
                kind: "ConfigMap".into(),
                name: "x".into(),
                source: kube::Error::Api(Box::new(st)),
            }
        };
        assert!(err(409, "AlreadyExists").is_already_exists());
        assert!(!err(409, "AlreadyExists").is_conflict());
        assert!(err(409, "Conflict").is_conflict());
        assert!(!err(409, "Conflict").is_already_exists());
        assert!(err(404, "NotFound").is_status(404));
        assert!(!err(429, "TooManyRequests").is_conflict());
    }
}
