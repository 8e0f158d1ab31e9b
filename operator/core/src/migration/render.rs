//! The objects a migration owns and the patches it makes, rendered purely.
//!
//! * The target pod: the source's spec pinned to the target node, every container
//!   replaced by a holder that only keeps the pod's namespaces (and reserves its
//!   resources) until the agent restores the process tree into them. It carries none
//!   of the source's labels until commit, and the PodMigration is its controller, so
//!   neither a Service nor the ReplicaSet sees it early.
//! * The hand-over patch at commit: the source's labels on, the PodMigration's owner
//!   reference off, so the ReplicaSet adopts it as an orphan.
//! * The source's `pod-deletion-cost` patch, so the ReplicaSet removes the source and
//!   never the restored pod. The workload object itself is never touched.
//! * The per-migration transfer-key Secret, owned by the PodMigration.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, Pod, PodSpec, Probe, ResourceRequirements,
    SeccompProfile, Secret, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube_core::ObjectMeta;
use kube_core::ResourceExt;
use podmotion_api::PodMigration;
use podmotion_api::migration::{
    ApplicationProbe, ExecProbe, GrpcProbe, HttpProbe, HttpScheme, PodMigrationStatus, TcpProbe,
};
use podmotion_api::names::holder::{HOLDER_BIN, HOLDER_DIR};
use podmotion_api::names::{annotations, labels};
use serde_json::json;

use super::agent::{Side, Step, StepRequest};
use super::key::TransferKey;
use super::observed::{SourcePodFacts, TargetPodFacts};
use crate::meta::{child_meta, short_hash};

/// Component label of a migration's target pod.
pub const TARGET_COMPONENT: &str = "migration-target";
/// Component label of a migration's transfer-key Secret.
pub const KEY_COMPONENT: &str = "migration-transfer-key";
/// Key of the transfer key in its Secret.
pub const TRANSFER_KEY: &str = "transfer-key";
/// The deletion cost that makes the source the ReplicaSet's first choice to remove.
pub const LOWEST_DELETION_COST: &str = "-2147483648";

/// What stands in for each of the pod's containers until restore: the container keeps
/// the source's image (CRIU restores the tree on top of the holder container's root
/// filesystem, which must hold the same files) and runs the holder program, which an
/// init container of `installer_image` (the migration agent's image, whose entrypoint is
/// `podmotion-agent`) copies into a shared `emptyDir` at [`HOLDER_DIR`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub installer_image: String,
}

impl Default for Holder {
    fn default() -> Self {
        Holder {
            installer_image: format!(
                "ghcr.io/podmotion/podmotion-agent:{}",
                env!("CARGO_PKG_VERSION")
            ),
        }
    }
}

/// Name of the target pod's init container and volume that install the holder.
pub const HOLDER_INSTALLER: &str = "podmotion-io-holder";

/// `<source pod>-pm-<hash of migration UID>`, at most 63 characters (pod names become
/// hostnames), deterministic so a restarted operator finds the pod it created.
pub fn target_pod_name(source_pod: &str, migration_uid: &str) -> String {
    let suffix = format!("-pm-{}", short_hash(migration_uid, 8));
    let mut prefix: String = source_pod.chars().take(63 - suffix.len()).collect();
    while prefix.ends_with(|c: char| !c.is_ascii_alphanumeric()) {
        prefix.pop();
    }
    format!("{prefix}{suffix}")
}

/// Name of the transfer-key Secret.
pub fn transfer_key_name(migration: &PodMigration) -> String {
    format!("{}-transfer-key", migration.name_any())
}

/// The target pod for `source`, pinned to `target_node`.
pub fn target_pod(
    migration: &PodMigration,
    source: &Pod,
    target_node: &str,
    holder: &Holder,
) -> Pod {
    let ns = migration.namespace();
    let source_name = source.name_any();
    let name = target_pod_name(&source_name, &migration.uid().unwrap_or_default());
    let mut meta: ObjectMeta = child_meta(migration, &name, ns.as_deref(), TARGET_COMPONENT);
    meta.labels
        .get_or_insert_with(Default::default)
        .insert(labels::MIGRATION.into(), migration.name_any());
    meta.annotations = Some(target_annotations(migration, source));

    let src = source.spec.clone().unwrap_or_default();
    let volumes = target_volumes(&src);
    let spec = PodSpec {
        node_name: Some(target_node.to_string()),
        containers: src.containers.iter().map(holder_container).collect(),
        init_containers: Some(target_init_containers(&src, holder)),
        volumes: Some(volumes),
        ephemeral_containers: None,
        // The restored process keeps the source's hostname through its UTS namespace
        // image; the pod's own hostname is its new name.
        hostname: None,
        subdomain: None,
        ..src
    };
    Pod {
        metadata: meta,
        spec: Some(spec),
        status: None,
    }
}

/// The source's volumes, and a fresh holder installer's.
fn target_volumes(src: &PodSpec) -> Vec<Volume> {
    let mut volumes = src.volumes.clone().unwrap_or_default();
    // A source PodMotion restored already has it (moved again): a fresh one in its
    // place, the restart file it held goes with the images.
    volumes.retain(|v| v.name != HOLDER_INSTALLER);
    volumes.push(Volume {
        name: HOLDER_INSTALLER.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity("64Mi".into())),
            ..Default::default()
        }),
        ..Default::default()
    });
    volumes
}

/// The source's finished init containers never run again; the first init container
/// copies the holder, and each native sidecar gets a holder of its own, still a
/// sidecar (`restartPolicy: Always`), after it: its tree is restored there as the
/// regular containers' are into theirs.
fn target_init_containers(src: &PodSpec, holder: &Holder) -> Vec<Container> {
    std::iter::once(holder_installer(holder))
        .chain(
            src.init_containers
                .iter()
                .flatten()
                .filter(|c| c.restart_policy.as_deref() == Some("Always"))
                .map(|c| Container {
                    restart_policy: Some("Always".into()),
                    ..holder_container(c)
                }),
        )
        .collect()
}

/// The source's annotations a target pod does not take over: what PodMotion records of
/// one migration (a source moved before carries its own move's), and the deletion cost
/// a commit lowers on a source.
const NOT_CARRIED: [&str; 5] = [
    annotations::MIGRATION,
    annotations::SOURCE_LABELS,
    annotations::SOURCE_POD,
    annotations::EXPECTED_OWNER,
    annotations::POD_DELETION_COST,
];

/// The target pod's annotations: the source's own (what its template and its users put
/// there — its eviction strategy, scrape settings — so that the moved pod is asked
/// the same of, by the next drain too), and what it records of its migration and its
/// source: the source's labels (put on at hand-over), the source pod (name/uid), and
/// the source's controller that must adopt it (kind/name/uid).
fn target_annotations(migration: &PodMigration, source: &Pod) -> BTreeMap<String, String> {
    let mut ann: BTreeMap<String, String> = source
        .annotations()
        .iter()
        .filter(|(k, _)| !NOT_CARRIED.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    ann.extend([
        (annotations::MIGRATION.to_string(), migration.name_any()),
        (
            annotations::SOURCE_LABELS.to_string(),
            serde_json::to_string(source.labels()).unwrap_or_else(|_| "{}".into()),
        ),
        (
            annotations::SOURCE_POD.to_string(),
            format!("{}/{}", source.name_any(), source.uid().unwrap_or_default()),
        ),
    ]);
    if let Some(owner) = source
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
    {
        ann.insert(
            annotations::EXPECTED_OWNER.to_string(),
            format!("{}/{}/{}", owner.kind, owner.name, owner.uid),
        );
    }
    ann
}

fn holder_mount() -> VolumeMount {
    VolumeMount {
        name: HOLDER_INSTALLER.into(),
        mount_path: HOLDER_DIR.into(),
        ..Default::default()
    }
}

/// A holder in place of `c`: same name, image, environment, working directory, ports,
/// resources, mounts and security context (so it reserves the same, PodSecurity admits
/// it alike, and a restart of the adopted container starts the application with the
/// environment resolved for this pod), running the holder program; no probes or hooks.
fn holder_container(c: &Container) -> Container {
    let mut mounts = c.volume_mounts.clone().unwrap_or_default();
    mounts.retain(|m| m.name != HOLDER_INSTALLER);
    mounts.push(holder_mount());
    Container {
        name: c.name.clone(),
        image: c.image.clone(),
        image_pull_policy: c.image_pull_policy.clone(),
        command: Some(vec![HOLDER_BIN.into(), "hold".into()]),
        env: c.env.clone(),
        env_from: c.env_from.clone(),
        working_dir: c.working_dir.clone(),
        ports: c.ports.clone(),
        resources: c.resources.clone(),
        volume_mounts: Some(mounts),
        security_context: c.security_context.clone(),
        ..Default::default()
    }
}

/// The init container that copies the holder program into the shared directory:
/// unprivileged, restricted-profile, small.
fn holder_installer(holder: &Holder) -> Container {
    let q = |s: &str| Quantity(s.into());
    Container {
        name: HOLDER_INSTALLER.into(),
        image: Some(holder.installer_image.clone()),
        image_pull_policy: Some("IfNotPresent".into()),
        args: Some(vec!["install-holder".into(), HOLDER_BIN.into()]),
        volume_mounts: Some(vec![holder_mount()]),
        resources: Some(ResourceRequirements {
            requests: Some(BTreeMap::from([
                ("cpu".into(), q("10m")),
                ("memory".into(), q("16Mi")),
            ])),
            limits: Some(BTreeMap::from([
                ("cpu".into(), q("100m")),
                ("memory".into(), q("64Mi")),
            ])),
            ..Default::default()
        }),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(65532),
            run_as_group: Some(65532),
            allow_privilege_escalation: Some(false),
            read_only_root_filesystem: Some(true),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".into()]),
                ..Default::default()
            }),
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The transfer-key Secret: `key` (32 random bytes from the caller), immutable, owned by
/// the PodMigration so it goes with it.
pub fn transfer_key_secret(migration: &PodMigration, key: &[u8]) -> Secret {
    let ns = migration.namespace();
    Secret {
        metadata: child_meta(
            migration,
            &transfer_key_name(migration),
            ns.as_deref(),
            KEY_COMPONENT,
        ),
        type_: Some("Opaque".into()),
        immutable: Some(true),
        data: Some(BTreeMap::from([(
            TRANSFER_KEY.to_string(),
            ByteString(key.to_vec()),
        )])),
        ..Default::default()
    }
}

/// How the source pod is deleted at commit: only the pod the migration pinned (its
/// UID), never a namesake, with the grace period the machine chose: the commit's while
/// the source agent's kill is to follow (the frozen, fenced tree leaves the kubelet's
/// SIGTERM pending, and the kill comes before the SIGKILL), 0 when the deletion is the
/// kill (see `machine::Machine::committing`).
pub fn source_pod_deletion(
    source_pod_uid: Option<String>,
    grace_seconds: i64,
) -> kube_core::params::DeleteParams {
    kube_core::params::DeleteParams {
        grace_period_seconds: Some(u32::try_from(grace_seconds.max(0)).unwrap_or(u32::MAX)),
        preconditions: Some(kube_core::params::Preconditions {
            uid: source_pod_uid,
            resource_version: None,
        }),
        ..Default::default()
    }
}

/// Merge patch marking the source as the pod its ReplicaSet removes first.
pub fn deletion_cost_patch() -> serde_json::Value {
    json!({"metadata": {"annotations": {annotations::POD_DELETION_COST: LOWEST_DELETION_COST}}})
}

/// Whether the source already carries [`deletion_cost_patch`].
pub fn deletion_cost_lowered(source: &Pod) -> bool {
    source
        .annotations()
        .get(annotations::POD_DELETION_COST)
        .map(String::as_str)
        == Some(LOWEST_DELETION_COST)
}

/// Merge patch releasing the target pod to the workload's controller: the source's
/// labels replace PodMotion's, and the PodMigration's owner reference goes (so deleting
/// the PodMigration later never garbage-collects the migrated pod).
pub fn hand_over_patch(target: &Pod) -> serde_json::Value {
    let source_labels: BTreeMap<String, String> = target
        .annotations()
        .get(annotations::SOURCE_LABELS)
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    let mut l = serde_json::Map::new();
    for k in target.labels().keys() {
        l.insert(k.clone(), serde_json::Value::Null);
    }
    for (k, v) in source_labels {
        l.insert(k, json!(v));
    }
    json!({"metadata": {"labels": l, "ownerReferences": []}})
}

/// The check the restored pod must pass before the source is given up: the
/// PodMigration's probe, else the source's own readiness probe (first container that
/// has one; a named port is resolved through the container's ports), else none (the
/// restore having resumed the process is then the proof).
pub fn effective_probe(
    spec_probe: Option<&ApplicationProbe>,
    source: &Pod,
) -> Option<ApplicationProbe> {
    if let Some(p) = spec_probe {
        return Some(p.clone());
    }
    let spec = source.spec.as_ref()?;
    spec.containers
        .iter()
        .find_map(|c| probe_from_readiness(c, c.readiness_probe.as_ref()?))
}

/// Container `c`'s readiness probe `rp` as an application probe (its port resolved);
/// `None` when it names a port the container does not declare.
fn probe_from_readiness(c: &Container, rp: &Probe) -> Option<ApplicationProbe> {
    let base = ApplicationProbe {
        http_get: None,
        tcp_socket: None,
        grpc: None,
        exec: None,
        timeout_seconds: rp.timeout_seconds.unwrap_or(1).clamp(1, 60),
        failure_threshold: rp.failure_threshold.unwrap_or(3).clamp(1, 30),
    };
    if let Some(h) = &rp.http_get {
        let scheme = if h.scheme.as_deref() == Some("HTTPS") {
            HttpScheme::Https
        } else {
            HttpScheme::Http
        };
        let path = h.path.clone().unwrap_or_else(|| "/".into());
        let port = container_port(c, &h.port)?;
        return Some(ApplicationProbe {
            http_get: Some(HttpProbe { path, port, scheme }),
            ..base
        });
    }
    if let Some(t) = &rp.tcp_socket {
        let port = container_port(c, &t.port)?;
        return Some(ApplicationProbe {
            tcp_socket: Some(TcpProbe { port }),
            ..base
        });
    }
    if let Some(g) = &rp.grpc {
        return Some(ApplicationProbe {
            grpc: Some(GrpcProbe {
                port: g.port,
                service: g.service.clone(),
            }),
            ..base
        });
    }
    rp.exec.as_ref().map(|e| ApplicationProbe {
        exec: Some(ExecProbe {
            command: e.command.clone().unwrap_or_default(),
            container: Some(c.name.clone()),
        }),
        ..base
    })
}

/// A probe's port: a number, or a name resolved through the container's ports.
fn container_port(c: &Container, p: &IntOrString) -> Option<i32> {
    match p {
        IntOrString::Int(n) => Some(*n),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .map(|cp| cp.container_port),
    }
}

/// The source pod as the machine sees it.
pub fn source_facts(p: &Pod) -> SourcePodFacts {
    SourcePodFacts {
        uid: p.uid().unwrap_or_default(),
        running: p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"),
        terminating: p.metadata.deletion_timestamp.is_some(),
        deletion_grace_seconds: p
            .metadata
            .deletion_timestamp
            .as_ref()
            .and(p.metadata.deletion_grace_period_seconds),
        deletion_accepted: deletion_accepted(p),
        deletion_cost_lowered: deletion_cost_lowered(p),
    }
}

/// When the API server accepted `p`'s deletion (see
/// [`SourcePodFacts::deletion_accepted`]).
fn deletion_accepted(p: &Pod) -> Option<Timestamp> {
    let at = p.metadata.deletion_timestamp.as_ref()?.0;
    let grace = p.metadata.deletion_grace_period_seconds.unwrap_or(0);
    at.checked_sub(k8s_openapi::jiff::SignedDuration::from_secs(grace))
        .ok()
}

/// Container IDs (`containerd://…`) of `pod`'s containers that have one.
pub fn container_ids(pod: Option<&Pod>) -> Vec<String> {
    pod.and_then(|p| p.status.as_ref())
        .and_then(|st| st.container_statuses.as_ref())
        .map(|cs| cs.iter().filter_map(|c| c.container_id.clone()).collect())
        .unwrap_or_default()
}

/// `pod`'s containers that move, by name with their container IDs: its native
/// sidecars (init containers with `restartPolicy: Always`) in spec order, then its
/// containers in spec order, each with the ID its status reports (the status lists
/// are not in spec order). Finished init containers, and containers the kubelet has
/// not reported an ID for, are left out.
pub fn named_containers(pod: Option<&Pod>) -> Vec<(String, String)> {
    let (Some(spec), Some(st)) = (
        pod.and_then(|p| p.spec.as_ref()),
        pod.and_then(|p| p.status.as_ref()),
    ) else {
        return vec![];
    };
    let id_in = |statuses: Option<&Vec<k8s_openapi::api::core::v1::ContainerStatus>>,
                 name: &str| {
        statuses?
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.container_id.clone())
    };
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"))
        .filter_map(|c| {
            id_in(st.init_container_statuses.as_ref(), &c.name).map(|id| (c.name.clone(), id))
        });
    let regular = spec.containers.iter().filter_map(|c| {
        id_in(st.container_statuses.as_ref(), &c.name).map(|id| (c.name.clone(), id))
    });
    sidecars.chain(regular).collect()
}

/// What the agent on `side` needs to run `step` of `pm`, whose status is `status`.
/// `source`, `target`: the pods as observed; `target_agent_url`: where the target
/// agent is reached.
pub fn step_request(
    pm: &PodMigration,
    status: &PodMigrationStatus,
    (side, step): (Side, Step),
    (source, target): (Option<&Pod>, Option<&Pod>),
    transfer_key: TransferKey,
    target_agent_url: Option<String>,
) -> StepRequest {
    StepRequest {
        migration_uid: pm.uid().unwrap_or_default(),
        namespace: pm.namespace().unwrap_or_default(),
        source_pod: pm.spec.pod_name.clone(),
        source_pod_uid: status.source_pod_uid.clone().unwrap_or_default(),
        target_pod: status.target_pod.clone().unwrap_or_default(),
        source_node: status.source_node.clone().unwrap_or_default(),
        target_node: status.target_node.clone().unwrap_or_default(),
        transfer_key,
        mode: pm.spec.mode,
        tcp_preservation: pm.spec.tcp_preservation,
        bandwidth_limit_bytes_per_second: pm.spec.bandwidth_limit_bytes_per_second,
        probe: source.and_then(|src| effective_probe(pm.spec.probe.as_ref(), src)),
        target_agent_url,
        container_ids: container_ids(match side {
            Side::Source => source,
            Side::Target => target,
        }),
        containers: named_containers(match side {
            Side::Source => source,
            Side::Target => target,
        }),
        close_connections: status
            .network
            .as_ref()
            .is_some_and(|n| n.connections_closed > 0),
        freeze_budget_millis: pm.spec.freeze_budget_millis.max(0) as u64,
        step,
    }
}

/// The target pod's facts for the machine.
pub fn target_facts(pod: &Pod) -> TargetPodFacts {
    let status = pod.status.clone().unwrap_or_default();
    let phase = status.phase.as_deref().unwrap_or("Pending");
    let conditions = status.conditions.clone().unwrap_or_default();
    let containers_running = !pod.spec.as_ref().is_none_or(|s| s.containers.is_empty())
        && status.container_statuses.as_ref().is_some_and(|cs| {
            !cs.is_empty()
                && cs
                    .iter()
                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
        });
    let unusable = match phase {
        "Failed" | "Succeeded" => Some(format!(
            "pod is {phase}{}",
            status
                .reason
                .as_deref()
                .map(|r| format!(" ({r})"))
                .unwrap_or_default()
        )),
        _ => conditions
            .iter()
            .find(|c| {
                c.type_ == "PodScheduled"
                    && c.status == "False"
                    && c.reason.as_deref() == Some("Unschedulable")
            })
            .map(|c| format!("unschedulable: {}", c.message.as_deref().unwrap_or(""))),
    };
    let owned_by_migration = pod
        .owner_references()
        .iter()
        .any(|o| o.kind == "PodMigration");
    let handed_over = !owned_by_migration && !pod.labels().contains_key(labels::OWNER_UID);
    let expected_owner_uid = pod
        .annotations()
        .get(annotations::EXPECTED_OWNER)
        .and_then(|s| s.rsplit('/').next().map(str::to_string));
    let adopted = match &expected_owner_uid {
        None => true,
        Some(uid) => pod
            .owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && &o.uid == uid),
    };
    TargetPodFacts {
        running: phase == "Running" && containers_running,
        unusable,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        handed_over,
        awaiting_adoption: handed_over && !adopted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::fixtures::{k8s_pod, migration};
    use k8s_openapi::api::core::v1::{
        ContainerState, ContainerStateRunning, ContainerStatus, PodStatus,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    #[test]
    fn containers_go_by_name_sidecars_first_and_finished_init_containers_never() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-0"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "image": "setup:1"},
                    {"name": "proxy", "image": "proxy:1", "restartPolicy": "Always"}
                ],
                "containers": [
                    {"name": "app", "image": "app:1"},
                    {"name": "logs", "image": "logs:1"},
                    {"name": "late", "image": "late:1"}
                ]
            },
            "status": {
                "initContainerStatuses": [
                    {"name": "setup", "containerID": "containerd://s", "image": "", "imageID": "", "ready": false, "restartCount": 0},
                    {"name": "proxy", "containerID": "containerd://p", "image": "", "imageID": "", "ready": true, "restartCount": 0}
                ],
                // Not in spec order, and one container not started yet.
                "containerStatuses": [
                    {"name": "logs", "containerID": "containerd://l", "image": "", "imageID": "", "ready": true, "restartCount": 0},
                    {"name": "late", "image": "", "imageID": "", "ready": false, "restartCount": 0},
                    {"name": "app", "containerID": "containerd://a", "image": "", "imageID": "", "ready": true, "restartCount": 0}
                ]
            }
        }))
        .unwrap();
        let named = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(n, i)| ((*n).to_string(), (*i).to_string()))
                .collect()
        };
        assert_eq!(
            named_containers(Some(&pod)),
            named(&[
                ("proxy", "containerd://p"),
                ("app", "containerd://a"),
                ("logs", "containerd://l")
            ])
        );
        assert!(named_containers(None).is_empty());
    }

    #[test]
    fn the_source_pod_is_deleted_with_the_machine_s_grace_period_and_only_by_its_uid() {
        for grace in [0, 150] {
            let dp = source_pod_deletion(Some("uid-1".into()), grace);
            assert_eq!(dp.grace_period_seconds, Some(grace as u32));
            assert_eq!(
                dp.preconditions.and_then(|p| p.uid).as_deref(),
                Some("uid-1")
            );
        }
    }

    #[test]
    fn a_deletion_is_accepted_its_grace_period_before_its_deletion_timestamp() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let mut p = k8s_pod("web-abc-1", "n0", "ReplicaSet", "web-abc");
        assert_eq!(source_facts(&p).deletion_accepted, None, "not deleted");
        let at = Timestamp::from_second(1_000_150).unwrap();
        p.metadata.deletion_timestamp = Some(Time(at));
        p.metadata.deletion_grace_period_seconds = Some(150);
        let f = source_facts(&p);
        assert!(f.terminating);
        assert_eq!(f.deletion_grace_seconds, Some(150));
        assert_eq!(
            f.deletion_accepted,
            Some(Timestamp::from_second(1_000_000).unwrap())
        );
        // A grace period shortened to 0 moves the deletion timestamp to that instant.
        p.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(1_000_007).unwrap()));
        p.metadata.deletion_grace_period_seconds = Some(0);
        assert_eq!(
            source_facts(&p).deletion_accepted,
            Some(Timestamp::from_second(1_000_007).unwrap())
        );
    }

    fn rendered() -> (PodMigration, Pod, Pod) {
        let m = migration("move-web", "web-abc-1");
        let mut source = k8s_pod("web-abc-1", "n0", "ReplicaSet", "web-abc");
        source.metadata.labels = Some(BTreeMap::from([
            ("app".to_string(), "web".to_string()),
            ("pod-template-hash".to_string(), "abc".to_string()),
        ]));
        let target = target_pod(&m, &source, "n1", &Holder::default());
        (m, source, target)
    }

    #[test]
    fn a_native_sidecar_gets_a_holder_that_is_still_a_sidecar_and_finished_inits_none() {
        let m = migration("move-web", "web-abc-1");
        let mut source = k8s_pod("web-abc-1", "n0", "ReplicaSet", "web-abc");
        source.spec.as_mut().unwrap().init_containers = Some(vec![
            Container {
                name: "setup".into(),
                image: Some("setup:1".into()),
                ..Default::default()
            },
            Container {
                name: "proxy".into(),
                image: Some("proxy:1".into()),
                restart_policy: Some("Always".into()),
                ..Default::default()
            },
        ]);
        let target = target_pod(&m, &source, "n1", &Holder::default());
        let init = target.spec.unwrap().init_containers.unwrap_or_default();
        assert_eq!(
            init.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            [HOLDER_INSTALLER, "proxy"],
            "the installer first, then the sidecar's holder; the finished init container never again"
        );
        let proxy = &init[1];
        assert_eq!(proxy.restart_policy.as_deref(), Some("Always"));
        assert_eq!(proxy.image.as_deref(), Some("proxy:1"));
        assert_eq!(
            proxy.command.as_deref(),
            Some(&[HOLDER_BIN.to_string(), "hold".to_string()][..])
        );
    }

    #[test]
    fn target_pod_is_pinned_to_the_target_node_and_runs_only_holders() {
        let (_, source, target) = rendered();
        let spec = target.spec.as_ref().unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("n1"));
        let src = source.spec.as_ref().unwrap();
        assert_eq!(spec.containers.len(), src.containers.len());
        for (h, c) in spec.containers.iter().zip(&src.containers) {
            assert_eq!(h.name, c.name);
            assert_eq!(h.image, c.image, "CRIU restores onto the source's image");
            assert_eq!(
                h.command.as_deref(),
                Some(&[HOLDER_BIN.to_string(), "hold".to_string()][..])
            );
            assert!(h.args.is_none());
            assert_eq!(
                h.resources, c.resources,
                "holders reserve the same resources"
            );
            assert!(h.readiness_probe.is_none() && h.liveness_probe.is_none());
            assert!(h.lifecycle.is_none(), "no hooks of the application");
            assert_eq!(h.env, c.env, "a restart gets the application's environment");
            assert!(
                h.volume_mounts
                    .iter()
                    .flatten()
                    .any(|v| v.name == HOLDER_INSTALLER && v.mount_path == HOLDER_DIR)
            );
        }
        let init = spec.init_containers.as_deref().unwrap_or_default();
        assert_eq!(
            init.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
            [HOLDER_INSTALLER],
            "the source's init containers never run again on the target; only the holder's installer does"
        );
        assert_eq!(init[0].image, Some(Holder::default().installer_image));
        let sc = init[0].security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_non_root, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let vols = spec.volumes.as_deref().unwrap_or_default();
        let src_vols = src.volumes.as_deref().unwrap_or_default();
        assert_eq!(
            &vols[..src_vols.len()],
            src_vols,
            "the source's volumes, unchanged"
        );
        assert_eq!(vols.len(), src_vols.len() + 1);
        assert!(vols.last().unwrap().empty_dir.is_some());
    }

    /// A source PodMotion restored (moved again): its spec already has the holder's
    /// volume, mount and command; the target gets each once (the API server refuses a
    /// pod that names a volume or a mount path twice).
    #[test]
    fn a_restored_source_renders_a_target_with_one_holder_volume_and_mount() {
        let m = migration("move-web-again", "web-abc-1-pm-12345678");
        let (_, _, first) = rendered();
        let mut source = first.clone();
        source.metadata.name = Some("web-abc-1-pm-12345678".into());
        let target = target_pod(&m, &source, "n0", &Holder::default());
        let spec = target.spec.as_ref().unwrap();
        let vols: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(
            vols.iter().filter(|v| **v == HOLDER_INSTALLER).count(),
            1,
            "{vols:?}"
        );
        assert_eq!(
            vols.len(),
            first.spec.as_ref().unwrap().volumes.as_ref().unwrap().len()
        );
        for c in &spec.containers {
            let mounts: Vec<&str> = c
                .volume_mounts
                .iter()
                .flatten()
                .map(|v| v.mount_path.as_str())
                .collect();
            assert_eq!(
                mounts.iter().filter(|p| **p == HOLDER_DIR).count(),
                1,
                "{mounts:?}"
            );
            assert_eq!(
                c.command.as_deref(),
                Some(&[HOLDER_BIN.to_string(), "hold".to_string()][..])
            );
        }
        let init = spec.init_containers.as_deref().unwrap_or_default();
        assert_eq!(init.len(), 1, "one installer");
    }

    #[test]
    fn the_target_keeps_the_sources_own_annotations_and_records_only_this_move() {
        let m = migration("move-web", "web-abc-1");
        let mut source = k8s_pod("web-abc-1", "n0", "ReplicaSet", "web-abc");
        source.metadata.annotations = Some(BTreeMap::from([
            (
                annotations::EVICTION_STRATEGY.to_string(),
                "LiveMigrate".to_string(),
            ),
            ("prometheus.io/scrape".to_string(), "true".to_string()),
            // Moved before: its own move's records, and a commit's deletion cost.
            (
                annotations::MIGRATION.to_string(),
                "an-earlier-move".to_string(),
            ),
            (
                annotations::SOURCE_POD.to_string(),
                "web-abc-0/u0".to_string(),
            ),
            (
                annotations::POD_DELETION_COST.to_string(),
                "-1000".to_string(),
            ),
        ]));
        let target = target_pod(&m, &source, "n1", &Holder::default());
        let a = target.annotations();
        assert_eq!(
            a.get(annotations::EVICTION_STRATEGY).map(String::as_str),
            Some("LiveMigrate")
        );
        assert_eq!(
            a.get("prometheus.io/scrape").map(String::as_str),
            Some("true")
        );
        assert_eq!(a.get(annotations::MIGRATION), Some(&m.name_any()));
        assert_eq!(
            a.get(annotations::SOURCE_POD)
                .map(|s| s.starts_with("web-abc-1/")),
            Some(true)
        );
        assert!(!a.contains_key(annotations::POD_DELETION_COST), "{a:?}");
    }

    #[test]
    fn target_pod_is_invisible_to_services_and_the_replicaset_until_hand_over() {
        let (m, source, target) = rendered();
        for k in source.labels().keys() {
            assert!(
                !target.labels().contains_key(k),
                "source label {k} on the target before commit"
            );
        }
        let owner = &target.owner_references()[0];
        assert_eq!(owner.kind, "PodMigration");
        assert_eq!(owner.controller, Some(true));
        assert_eq!(target.labels().get(labels::MIGRATION), Some(&m.name_any()));
        assert_eq!(
            target
                .annotations()
                .get(annotations::EXPECTED_OWNER)
                .map(|s| s.starts_with("ReplicaSet/web-abc/")),
            Some(true)
        );
        let f = target_facts(&target);
        assert!(!f.handed_over && !f.running);
    }

    #[test]
    fn hand_over_puts_the_source_labels_on_and_releases_ownership() {
        let (_, _, target) = rendered();
        let patch = hand_over_patch(&target);
        let l = &patch["metadata"]["labels"];
        assert_eq!(l["app"], "web");
        assert_eq!(l["pod-template-hash"], "abc");
        assert!(l[labels::OWNER_UID].is_null() && l[labels::MIGRATION].is_null());
        assert_eq!(patch["metadata"]["ownerReferences"], json!([]));

        // Applied (as the API server would merge it), then adopted by the ReplicaSet.
        let mut after = target.clone();
        let mut new_labels: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in l.as_object().unwrap() {
            if let Some(v) = v.as_str() {
                new_labels.insert(k.clone(), v.into());
            }
        }
        after.metadata.labels = Some(new_labels);
        after.metadata.owner_references = None;
        let f = target_facts(&after);
        assert!(f.handed_over && f.awaiting_adoption);
        let uid = target.annotations()[annotations::EXPECTED_OWNER]
            .rsplit('/')
            .next()
            .unwrap()
            .to_string();
        after.metadata.owner_references = Some(vec![OwnerReference {
            api_version: "apps/v1".into(),
            kind: "ReplicaSet".into(),
            name: "web-abc".into(),
            uid,
            controller: Some(true),
            block_owner_deletion: Some(true),
        }]);
        assert!(!target_facts(&after).awaiting_adoption);
    }

    #[test]
    fn target_pod_names_are_deterministic_bounded_and_distinct_per_migration() {
        let a = target_pod_name("web-abc-1", "uid-1");
        assert_eq!(a, target_pod_name("web-abc-1", "uid-1"));
        assert_ne!(a, target_pod_name("web-abc-1", "uid-2"));
        let long = target_pod_name(&"x".repeat(250), "uid-1");
        assert!(long.len() <= 63, "{}", long.len());
        let dashed = target_pod_name(&format!("{}-y", "a".repeat(53)), "u");
        assert!(!dashed.contains("--"), "{dashed}");
    }

    #[test]
    fn transfer_key_secret_is_owned_immutable_and_holds_the_key() {
        let m = migration("move-web", "web-abc-1");
        let s = transfer_key_secret(&m, &[7u8; 32]);
        assert_eq!(s.immutable, Some(true));
        assert_eq!(s.owner_references()[0].kind, "PodMigration");
        assert_eq!(s.data.as_ref().unwrap()[TRANSFER_KEY].0, vec![7u8; 32]);
        assert_eq!(s.name_any(), "move-web-transfer-key");
    }

    #[test]
    fn the_default_probe_is_the_source_containers_readiness_probe() {
        use k8s_openapi::api::core::v1::{ContainerPort, HTTPGetAction, Probe};
        let (_, mut source, _) = rendered();
        let c = &mut source.spec.as_mut().unwrap().containers[0];
        c.ports = Some(vec![ContainerPort {
            name: Some("http".into()),
            container_port: 8080,
            ..Default::default()
        }]);
        c.readiness_probe = Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz".into()),
                port: IntOrString::String("http".into()),
                ..Default::default()
            }),
            failure_threshold: Some(5),
            ..Default::default()
        });
        let p = effective_probe(None, &source).unwrap();
        let h = p.http_get.clone().unwrap();
        assert_eq!(
            (h.port, h.path.as_str(), p.failure_threshold),
            (8080, "/healthz", 5)
        );
        let explicit = ApplicationProbe {
            tcp_socket: Some(TcpProbe { port: 9 }),
            ..p.clone_without_handlers()
        };
        assert_eq!(
            effective_probe(Some(&explicit), &source),
            Some(explicit.clone())
        );
        source.spec.as_mut().unwrap().containers[0].readiness_probe = None;
        assert_eq!(effective_probe(None, &source), None);
    }

    trait Bare {
        fn clone_without_handlers(&self) -> ApplicationProbe;
    }
    impl Bare for ApplicationProbe {
        fn clone_without_handlers(&self) -> ApplicationProbe {
            ApplicationProbe {
                http_get: None,
                tcp_socket: None,
                grpc: None,
                exec: None,
                ..self.clone()
            }
        }
    }

    #[test]
    fn deletion_cost_patch_is_recognised_once_applied() {
        let (_, mut source, _) = rendered();
        assert!(!deletion_cost_lowered(&source));
        let v = deletion_cost_patch();
        let cost = v["metadata"]["annotations"][annotations::POD_DELETION_COST]
            .as_str()
            .unwrap();
        source.metadata.annotations = Some(BTreeMap::from([(
            annotations::POD_DELETION_COST.to_string(),
            cost.to_string(),
        )]));
        assert!(deletion_cost_lowered(&source));
    }

    #[test]
    fn target_facts_distinguish_running_unschedulable_and_failed_pods() {
        let (_, _, mut target) = rendered();
        let running = ContainerStatus {
            name: "app".into(),
            state: Some(ContainerState {
                running: Some(ContainerStateRunning::default()),
                ..Default::default()
            }),
            ..Default::default()
        };
        target.status = Some(PodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![running]),
            ..Default::default()
        });
        assert!(target_facts(&target).running);
        target.status = Some(PodStatus {
            phase: Some("Failed".into()),
            reason: Some("OutOfcpu".into()),
            ..Default::default()
        });
        let f = target_facts(&target);
        assert!(!f.running);
        assert!(f.unusable.as_deref().unwrap().contains("OutOfcpu"));
    }
}
