//! The attachment controller's reads: one workload's state, from its selector (read)
//! and the caches (its pods' nodes' platform labels too), with the ingest Leases of
//! the attachments that claim it.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment, ReplicaSet, StatefulSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::core::{Selector, SelectorExt};
use kube::{Client, Resource, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{AttachMode, WorkloadKind, WorkloadRef};

use super::nodes;
use super::state::{Mode, Shared};
use super::writes;
use crate::attachment::observed::workload_key;
use crate::attachment::{AttachmentView, JobView, ObservedGroup, PodView};
use crate::controllers::shell::{ReconcileError, api_err};

/// One workload's state: the workload (read, for its selector), its pods, its agent
/// Jobs, and the attachments claiming it (from the caches; those another PodMotion
/// release holds left out), with the ingest Leases of
/// those attachments (read; created when missing in `Mode::Full`). `about` is the
/// reconciled attachment as the watch delivered it (fresher than the store).
pub(super) async fn workload(
    s: &Shared,
    ns: &str,
    workload: &WorkloadRef,
    about: Option<&NodeAgentAttachment>,
    mode: Mode,
) -> Result<ObservedGroup, ReconcileError> {
    let (workload_exists, selector) = selector(&s.ctx.client, ns, workload).await?;
    let pods: Vec<PodView> = match &selector {
        Some(sel) => s
            .pods
            .select(|(pod_ns, _), p| pod_ns == ns && sel.matches(&p.labels))
            .iter()
            .map(|p| p.as_ref().clone())
            .collect(),
        None => vec![],
    };
    let key = workload_key(workload);
    let jobs: Vec<JobView> = s
        .jobs
        .select(|_, j| j.target_namespace == ns && j.workload == key)
        .iter()
        .map(|j| j.as_ref().clone())
        .collect();
    let node_labels = nodes::labels_of(s, pods.iter().filter_map(|p| p.node.as_deref()));
    let stored = s.store.state();
    let members: Vec<&NodeAgentAttachment> = stored
        .iter()
        .filter_map(|g| g.0.as_ref().ok())
        .filter(|a| a.namespace().as_deref() == Some(ns) && a.spec.workload_ref == *workload)
        // Another release's attachments are its own: their Jobs are planned there
        // (in that release's namespace), never here.
        .filter(|a| crate::claim::may_act(a.annotations(), s.ctx.claims.me()))
        .collect();
    let mut attachments = vec![];
    for m in members {
        let m = match about {
            Some(a) if a.uid() == m.uid() => a,
            _ => m,
        };
        let lease = if m.spec.mode == AttachMode::Ingest {
            writes::ingest_lease(s, m, mode).await?
        } else {
            None
        };
        attachments.push(AttachmentView::from_object(m, lease.as_ref()));
    }
    Ok(ObservedGroup {
        namespace: ns.into(),
        workload: workload.clone(),
        workload_exists,
        attachments,
        pods,
        jobs,
        node_labels,
        now: Timestamp::now(),
    })
}

/// Whether the workload exists, and its pod selector.
async fn selector(
    client: &Client,
    ns: &str,
    w: &WorkloadRef,
) -> Result<(bool, Option<Selector>), ReconcileError> {
    async fn get<K>(client: &Client, ns: &str, name: &str) -> Result<Option<K>, kube::Error>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        Api::<K>::namespaced(client.clone(), ns).get_opt(name).await
    }
    let what = workload_key(w);
    let sel: Option<LabelSelector> = match w.kind {
        WorkloadKind::Deployment => get::<Deployment>(client, ns, &w.name)
            .await
            .map(|o| o.map(|o| o.spec.selector)),
        WorkloadKind::StatefulSet => get::<StatefulSet>(client, ns, &w.name)
            .await
            .map(|o| o.map(|o| o.spec.selector)),
        WorkloadKind::ReplicaSet => get::<ReplicaSet>(client, ns, &w.name)
            .await
            .map(|o| o.map(|o| o.spec.selector)),
        WorkloadKind::DaemonSet => get::<DaemonSet>(client, ns, &w.name)
            .await
            .map(|o| o.map(|o| o.spec.selector)),
    }
    .map_err(api_err("get", &what))?;
    Ok(match sel {
        None => (false, None),
        // An empty or unparsable selector selects nothing rather than every pod.
        Some(ls) => {
            let sel = Selector::try_from(ls).ok().filter(|s| !s.selects_all());
            (true, sel)
        }
    })
}
