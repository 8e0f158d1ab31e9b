//! Observed state, as plain structs: the few facts of pods, Jobs, attachments and
//! Leases the core decides on, and the (pure) conversions from the API objects.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Toleration};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube_core::ResourceExt;
use podmotion_api::attachment::{NodeAgentAttachmentSpec, WorkloadKind, WorkloadRef};
use podmotion_api::names::{annotations, labels};
use podmotion_api::{NodeAgentAttachment, NodeAgentAttachmentStatus};

/// Everything the core needs about one workload in one namespace.
#[derive(Clone, Debug)]
pub struct ObservedGroup {
    /// Namespace of the workload, its pods and its attachments.
    pub namespace: String,
    /// The workload.
    pub workload: WorkloadRef,
    /// Whether the workload exists (its pods are listed through its selector).
    pub workload_exists: bool,
    /// Attachments in `namespace` whose `workloadRef` is `workload`, deleting ones included.
    pub attachments: Vec<AttachmentView>,
    /// Pods of the workload.
    pub pods: Vec<PodView>,
    /// Agent Jobs made for pods of this workload (in the operator's namespace).
    pub jobs: Vec<JobView>,
    /// Platform labels (`kubernetes.io/os`, `kubernetes.io/arch`) of the nodes the pods
    /// are on, by node name. A node missing here is not known yet and is not held
    /// against its pods (the Job's own nodeSelector still guards it).
    pub node_labels: BTreeMap<String, BTreeMap<String, String>>,
    /// The clock, for lease expiry.
    pub now: Timestamp,
}

/// One NodeAgentAttachment.
#[derive(Clone, Debug)]
pub struct AttachmentView {
    pub name: String,
    pub uid: String,
    pub generation: Option<i64>,
    pub created: Timestamp,
    /// `deletionTimestamp` is set: it no longer claims anything.
    pub deleting: bool,
    pub spec: NodeAgentAttachmentSpec,
    /// The ingest session Lease, if one was read (mode Ingest).
    pub lease: Option<LeaseView>,
    /// The status as last written (conditions keep their transition times).
    pub status: Option<NodeAgentAttachmentStatus>,
}

impl AttachmentView {
    pub fn from_object(a: &NodeAgentAttachment, lease: Option<&Lease>) -> Self {
        AttachmentView {
            name: a.name_any(),
            uid: a.uid().unwrap_or_default(),
            generation: a.metadata.generation,
            created: a
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0)
                .unwrap_or(Timestamp::UNIX_EPOCH),
            deleting: a.metadata.deletion_timestamp.is_some(),
            spec: a.spec.clone(),
            lease: lease.map(LeaseView::from_lease),
            status: a.status.clone(),
        }
    }

    /// Name of the ingest session Lease (mode Ingest).
    pub fn lease_name(&self) -> String {
        self.spec
            .ingest
            .as_ref()
            .and_then(|i| i.lease_name.clone())
            .unwrap_or_else(|| self.name.clone())
    }

    /// When the ingest session ends unless renewed: the Lease's last renewal (or, before
    /// the first one, its creation; or, without a Lease, the attachment's creation) plus
    /// its duration. The Lease is written by the client, so it cannot stretch the
    /// session beyond what the attachment allows: its `leaseDurationSeconds` counts only
    /// up to the attachment's `ingest.leaseDurationSeconds`, and a renewal stamped more
    /// than [`LEASE_CLOCK_SKEW`] after `now` is no renewal at all (the session then
    /// counts from the attachment's creation).
    pub fn lease_expiry(&self, now: Timestamp) -> Timestamp {
        let bound = lease_duration_seconds(&self.spec);
        let latest_believable = now.checked_add(LEASE_CLOCK_SKEW).unwrap_or(Timestamp::MAX);
        let (from, secs) = match &self.lease {
            Some(l) => (
                l.renewed
                    .filter(|r| *r <= latest_believable)
                    .unwrap_or(self.created),
                l.duration_seconds.unwrap_or(bound).min(bound),
            ),
            None => (self.created, bound),
        };
        from.checked_add(SignedDuration::from_secs(i64::from(secs.max(0))))
            .unwrap_or(Timestamp::MAX)
    }
}

/// How far ahead of the operator's clock a client's Lease renewal may be stamped and
/// still count (the client's clock may run ahead).
pub const LEASE_CLOCK_SKEW: SignedDuration = SignedDuration::from_secs(30);

/// The facts of a `coordination.k8s.io` Lease that decide an ingest session's life.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseView {
    /// `spec.renewTime`, else `spec.acquireTime`, else the Lease's creation.
    pub renewed: Option<Timestamp>,
    pub duration_seconds: Option<i32>,
}

impl LeaseView {
    pub fn from_lease(l: &Lease) -> Self {
        let spec = l.spec.as_ref();
        LeaseView {
            renewed: spec
                .and_then(|s| s.renew_time.as_ref().or(s.acquire_time.as_ref()))
                .map(|t| t.0)
                .or(l.metadata.creation_timestamp.as_ref().map(|t| t.0)),
            duration_seconds: spec.and_then(|s| s.lease_duration_seconds),
        }
    }
}

/// Pod phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodPhase {
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

/// One container of a pod: its name and, once started, its CRI container ID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    pub id: Option<String>,
    /// `(port, name, protocol)` the container declares.
    pub ports: Vec<(i32, Option<String>, String)>,
}

/// One pod of the workload. Also what the controller caches per pod, so it keeps
/// only what the core reads.
#[derive(Clone, Debug, PartialEq)]
pub struct PodView {
    pub name: String,
    pub uid: String,
    /// Labels (the workload's selector is matched against them).
    pub labels: BTreeMap<String, String>,
    pub node: Option<String>,
    pub ip: Option<String>,
    pub phase: PodPhase,
    pub ready: bool,
    pub terminating: bool,
    pub host_network: bool,
    pub host_users: Option<bool>,
    /// The annotations whose value is `true` (any case): the only ones the core reads
    /// (sidecar recognition). Others are dropped, however large.
    pub annotations: BTreeMap<String, String>,
    pub containers: Vec<ContainerView>,
    /// The pod's tolerations: its agent Job tolerates exactly these (the agent goes
    /// only where its target may run, never onto a node because of a blanket
    /// toleration).
    pub tolerations: Vec<Toleration>,
}

impl PodView {
    pub fn from_pod(p: &Pod) -> Self {
        let spec = p.spec.as_ref();
        let status = p.status.as_ref();
        let phase = match status.and_then(|s| s.phase.as_deref()) {
            Some("Pending") => PodPhase::Pending,
            Some("Running") => PodPhase::Running,
            Some("Succeeded") => PodPhase::Succeeded,
            Some("Failed") => PodPhase::Failed,
            _ => PodPhase::Unknown,
        };
        PodView {
            name: p.name_any(),
            uid: p.uid().unwrap_or_default(),
            labels: p.labels().clone(),
            node: spec
                .and_then(|s| s.node_name.clone())
                .filter(|n| !n.is_empty()),
            ip: status
                .and_then(|s| s.pod_ip.clone())
                .filter(|ip| !ip.is_empty()),
            phase,
            ready: status
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True"),
            terminating: p.metadata.deletion_timestamp.is_some(),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            host_users: spec.and_then(|s| s.host_users),
            tolerations: spec.and_then(|s| s.tolerations.clone()).unwrap_or_default(),
            annotations: p
                .annotations()
                .iter()
                .filter(|(_, v)| v.eq_ignore_ascii_case("true"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            containers: container_views(p),
        }
    }
}

/// The pod's (non-init) containers with their IDs (once the runtime gave them) and
/// declared ports.
fn container_views(p: &Pod) -> Vec<ContainerView> {
    let ids: BTreeMap<&str, &str> = p
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            c.container_id
                .as_deref()
                .filter(|id| !id.is_empty())
                .map(|id| (c.name.as_str(), id))
        })
        .collect();
    p.spec
        .as_ref()
        .map(|s| &s.containers[..])
        .unwrap_or_default()
        .iter()
        .map(|c| ContainerView {
            name: c.name.clone(),
            id: ids.get(c.name.as_str()).map(|s| s.to_string()),
            ports: c
                .ports
                .iter()
                .flatten()
                .map(|p| {
                    (
                        p.container_port,
                        p.name.clone(),
                        p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    )
                })
                .collect(),
        })
        .collect()
}

/// How far an agent Job has run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobRun {
    /// Not finished; `ready` when a pod of it is ready.
    Active { ready: bool },
    /// Finished successfully (the agent exited on its own).
    Complete,
    /// Failed (the agent kept failing).
    Failed,
}

/// One agent Job, as far as the core cares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobView {
    pub name: String,
    pub uid: String,
    /// Namespace and name of the target pod (from the Job's label and annotation).
    pub target_namespace: String,
    pub target_pod: String,
    pub target_pod_uid: String,
    /// `Kind/name` of the target's workload.
    pub workload: String,
    /// Container IDs the Job was made for.
    pub container_ids: BTreeMap<String, String>,
    /// Hash of the rendered Job spec, to notice outdated agent settings.
    pub spec_hash: String,
    /// Port numbers the agent redirects.
    pub ports: Vec<i32>,
    pub terminating: bool,
    /// Still suspended: created, but its credential Secret not confirmed yet.
    pub suspended: bool,
    pub run: JobRun,
}

impl JobView {
    /// `None` for a Job that does not carry the attachment labels and annotations.
    pub fn from_job(j: &Job) -> Option<Self> {
        let l = j.labels();
        let a = j.annotations();
        let status = j.status.as_ref();
        let finished = |t: &str| {
            status
                .and_then(|s| s.conditions.as_ref())
                .into_iter()
                .flatten()
                .any(|c| c.type_ == t && c.status == "True")
        };
        let run = if finished("Failed") {
            JobRun::Failed
        } else if finished("Complete") {
            JobRun::Complete
        } else {
            JobRun::Active {
                ready: status.and_then(|s| s.ready).unwrap_or(0) > 0,
            }
        };
        Some(JobView {
            name: j.name_any(),
            uid: j.uid().unwrap_or_default(),
            target_namespace: l.get(labels::TARGET_NAMESPACE)?.clone(),
            target_pod: a.get(annotations::TARGET_POD)?.clone(),
            target_pod_uid: l.get(labels::TARGET_POD_UID).cloned().unwrap_or_default(),
            workload: a.get(annotations::WORKLOAD).cloned().unwrap_or_default(),
            container_ids: a
                .get(annotations::CONTAINER_IDS)
                .and_then(|s| serde_json::from_str(s).ok())
                .unwrap_or_default(),
            spec_hash: a.get(annotations::SPEC_HASH).cloned().unwrap_or_default(),
            ports: a
                .get(annotations::AGENT_PORTS)
                .and_then(|s| serde_json::from_str(s).ok())
                .unwrap_or_default(),
            terminating: j.metadata.deletion_timestamp.is_some(),
            suspended: j.spec.as_ref().and_then(|s| s.suspend) == Some(true),
            run,
        })
    }
}

/// The ingest session's lease duration the spec asks for (60 s when unset).
pub fn lease_duration_seconds(spec: &NodeAgentAttachmentSpec) -> i32 {
    spec.ingest
        .as_ref()
        .map(|i| i.lease_duration_seconds)
        .unwrap_or(60)
}

/// `Kind/name` of a workload, as in `status.workload` and the Jobs' annotation.
pub fn workload_key(w: &WorkloadRef) -> String {
    format!("{}/{}", w.kind.as_str(), w.name)
}

/// The inverse of [`workload_key`]; `None` for a key no workload kind makes.
pub fn parse_workload_key(key: &str) -> Option<WorkloadRef> {
    let (kind, name) = key.split_once('/')?;
    let kind = [
        WorkloadKind::Deployment,
        WorkloadKind::StatefulSet,
        WorkloadKind::ReplicaSet,
        WorkloadKind::DaemonSet,
    ]
    .into_iter()
    .find(|k| k.as_str() == kind)?;
    Some(WorkloadRef {
        kind,
        name: name.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_key_parses_back_into_its_workload() {
        for kind in [
            WorkloadKind::Deployment,
            WorkloadKind::StatefulSet,
            WorkloadKind::ReplicaSet,
            WorkloadKind::DaemonSet,
        ] {
            let w = WorkloadRef {
                kind,
                name: "web".into(),
            };
            assert_eq!(parse_workload_key(&workload_key(&w)), Some(w));
        }
        assert_eq!(parse_workload_key("CronJob/web"), None);
        assert_eq!(parse_workload_key("Deployment"), None);
    }

    #[test]
    fn pod_view_keeps_labels_and_only_the_annotations_the_core_reads() {
        let p: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-0", "namespace": "shop", "uid": "u1",
              "labels": {"app": "web", "pod-template-hash": "abc"},
              "annotations": {
                "telepresence.io/injected": "TRUE",
                "kubectl.kubernetes.io/last-applied-configuration": "{\"a\": \"very long\"}",
                "other": "false"
              }},
            "spec": {"nodeName": "n1", "containers": [{"name": "app", "ports": [{"containerPort": 8080}]}]},
            "status": {"phase": "Running", "podIP": "10.0.0.1",
              "conditions": [{"type": "Ready", "status": "True"}],
              "containerStatuses": [{"name": "app", "containerID": "containerd://c1", "image": "i",
                "imageID": "", "ready": true, "restartCount": 0}]}
        }))
        .unwrap();
        let v = PodView::from_pod(&p);
        assert_eq!(v.labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(v.labels.len(), 2);
        assert_eq!(
            v.annotations.keys().collect::<Vec<_>>(),
            vec!["telepresence.io/injected"]
        );
        assert_eq!(v.node.as_deref(), Some("n1"));
        assert_eq!(v.ip.as_deref(), Some("10.0.0.1"));
        assert!(v.ready && v.phase == PodPhase::Running);
        assert_eq!(v.containers[0].id.as_deref(), Some("containerd://c1"));
        assert_eq!(v.containers[0].ports, vec![(8080, None, "TCP".into())]);
    }
}
