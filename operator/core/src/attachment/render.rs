//! The objects an attachment needs, rendered from plain inputs: the node-pinned agent
//! Job for one target pod, its credential Secret (in the *attachment's* namespace, owned
//! by the target pod; the Job gets only the token's verifier) and the one NetworkPolicy
//! that denies all ingress to agent pods.
//!
//! Tenancy: the agent serves its control API on the target pod's loopback
//! ([`Settings::control_port`]), so a client reaches it by port-forwarding to the target
//! pod in its own namespace with the token from its own namespace. Nothing of a tenant's
//! agent is usable with rights in the agents' namespace, and a tenant needs none there.
//!
//! The agent pod is privileged in the seed's sense, and no more: `hostPID`, the node's
//! container-runtime socket directory mounted read-only, capabilities SYS_ADMIN,
//! SYS_PTRACE, NET_ADMIN and DAC_READ_SEARCH (everything else dropped), `runAsGroup` set to the
//! agent GID so the redirect rules exempt the agent's own sockets. It is not
//! `privileged`, has no service-account token and no host network.

use std::collections::BTreeMap;

use crate::meta::{label_value, sha256_hex};
use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::{Job, JobSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction,
    HostPathVolumeSource, LocalObjectReference, ObjectFieldSelector, PodSecurityContext, PodSpec,
    PodTemplateSpec, Probe, SeccompProfile, Secret, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicySpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube_core::{Resource, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{AgentSettings, WorkloadRef};
use podmotion_api::names::{annotations, labels};
use podmotion_attach_job::{self as agent_job, AgentConfig, PortEntry, env as agent_env};

use super::observed::{PodView, lease_duration_seconds, workload_key};
use crate::platform::Platform;

/// `app.kubernetes.io/component` (and `name`) of agent Jobs and their pods.
pub const COMPONENT: &str = "node-agent";
/// Name of the NetworkPolicy that denies all ingress to agent pods.
pub const NETWORK_POLICY: &str = "podmotion-node-agent-deny-ingress";
/// Pod-template annotation of an agent Job holding the verifier (SHA-256, hex) of its
/// control API token; the agent reads it through the downward API. Written when the Job
/// is resumed (a suspended Job's template annotations are mutable), together with the
/// token's Secret in the attachment's namespace.
pub const TOKEN_VERIFIER_ANNOTATION: &str = "podmotion.io/token-sha256";
/// Default port of the agent's control API on the target pod's loopback (installer's
/// choice, `--attachment-control-port`): below the forwarders' first port (15001).
pub const DEFAULT_CONTROL_PORT: i32 = 15000;
/// Default of [`Settings::max_wiretaps`]: the attach agent's own default.
pub const DEFAULT_MAX_WIRETAPS: u32 = 4;
/// Keys of the credential Secret in the attachment's namespace.
pub mod credential_keys {
    /// The bearer token (hex text).
    pub const TOKEN: &str = "token";
    /// The control API's port on the target pod's loopback (decimal).
    pub const PORT: &str = "port";
}
/// Namespaces whose pods are never attached to: the cluster's system namespace (in
/// addition to the operator's and the agents', see [`Settings::protected_namespaces`]).
pub const SYSTEM_NAMESPACE: &str = "kube-system";
/// Where the node's container-runtime socket (or its directory) is mounted.
pub const CRI_MOUNT: &str = "/host/cri";
/// The executor's export symlinks (an emptyDir: the root filesystem is read-only).
pub const EXPORTS_DIR: &str = "/var/run/podmotion/exports";
/// The agent's `/healthz` port in its Job pod (the readiness probe). The control API
/// itself is on the target pod's loopback ([`Settings::control_port`]).
pub const CONTROL_PORT: i32 = 8400;
/// Default port of the executor's `GET /metrics` (container port `metrics`), the
/// migration agent's default too (the Job pod has its own network namespace).
pub const DEFAULT_METRICS_PORT: i32 = 9090;
/// The agent's capabilities, exactly these.
// DAC_READ_SEARCH: /proc/<pid>/environ is 0400 and owned by the application's uid, so
// root without a read-only DAC bypass cannot open it (proven by the attach executor's
// root tests). The seed's NET_RAW is not granted: the executor never uses it.
pub const CAPABILITIES: [&str; 4] = ["SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "DAC_READ_SEARCH"];

/// Operator-wide settings of attachment Jobs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The operator's namespace: every agent Job lives there.
    pub namespace: String,
    /// Prefix of every Job name.
    pub job_prefix: String,
    /// The agent image (installer's choice: an attachment never names one).
    pub image: String,
    /// Host path mounted read-only as the container-runtime socket, or the directory
    /// holding it (`/run`: the agent picks the socket that knows the target's
    /// containers). Installer's choice.
    pub cri_socket_path: String,
    /// Annotations on every agent pod (policy-engine exemptions, AppArmor), installer's
    /// choice.
    pub pod_annotations: BTreeMap<String, String>,
    /// Retries of a failing agent pod before the Job fails (and is replaced).
    pub backoff_limit: i32,
    /// Image pull Secrets of every agent pod (in `namespace`), chosen by the installer.
    pub image_pull_secrets: Vec<String>,
    /// Port of the agent's Prometheus metrics (plain HTTP, counts only), in the Job
    /// pod's own network namespace.
    pub metrics_port: i32,
    /// The agent's log format: the operator's own (`--log-format`).
    pub log_format: podmotion_log::LogFormat,
    /// Port of the agent's control API on the target pod's loopback (installer's
    /// choice; a workload listening on it cannot be attached to).
    pub control_port: i32,
    /// Most concurrent wiretaps of each agent (installer's choice; each queues up to
    /// about 16 MiB in the agent).
    pub max_wiretaps: u32,
    /// The operator's own namespace. With [`Settings::namespace`] and
    /// [`SYSTEM_NAMESPACE`], a namespace whose workloads are never attached to: an
    /// agent there would read the operator's token, the master key or the migration
    /// agents' checkpoints.
    pub operator_namespace: String,
    /// The platform the agent image is built for (the operator's `--node-arch`): the
    /// agent pod's nodeSelector, and the nodes whose pods are skipped
    /// (`UnsupportedPlatform`).
    pub platform: Platform,
}

impl Settings {
    /// Namespaces whose workloads are never attached to.
    pub fn protected_namespaces(&self) -> [&str; 3] {
        [
            SYSTEM_NAMESPACE,
            self.operator_namespace.as_str(),
            self.namespace.as_str(),
        ]
    }
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            namespace: "podmotion-system".into(),
            job_prefix: "podmotion-agent".into(),
            image: format!(
                "ghcr.io/podmotion/podmotion-attach:{}",
                env!("CARGO_PKG_VERSION")
            ),
            cri_socket_path: "/run".into(),
            pod_annotations: BTreeMap::new(),
            backoff_limit: 3,
            image_pull_secrets: Vec::new(),
            metrics_port: DEFAULT_METRICS_PORT,
            log_format: podmotion_log::LogFormat::Json,
            control_port: DEFAULT_CONTROL_PORT,
            max_wiretaps: DEFAULT_MAX_WIRETAPS,
            operator_namespace: "podmotion-system".into(),
            platform: Platform::default(),
        }
    }
}

/// What the agent is told, besides its target: the same information a sidecar gets in
/// its `AGENT_CONFIG`.
#[derive(Clone, Debug)]
pub struct AgentProfile<'a> {
    pub namespace: &'a str,
    pub workload: &'a WorkloadRef,
    pub agent: &'a AgentSettings,
}

/// One target as the agent sees it: the pod, its containers (primary first) with their
/// container IDs, and the ports to redirect.
#[derive(Clone, Debug)]
pub struct AgentTarget<'a> {
    pub pod: &'a PodView,
    pub containers: &'a [String],
    pub container_ids: &'a BTreeMap<String, String>,
    pub ports: &'a [i32],
}

/// Labels selecting every agent Job and pod of PodMotion.
pub fn agent_selector_labels() -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
        (labels::COMPONENT.into(), COMPONENT.into()),
    ])
}

/// Label selector (string form) of every agent Job.
pub fn agent_selector() -> String {
    format!(
        "{}={},{}={}",
        labels::MANAGED_BY,
        labels::MANAGED_BY_VALUE,
        labels::COMPONENT,
        COMPONENT
    )
}

/// Label value for the workload label: `<kind>.<name>`, shortened with a hash if long.
pub fn workload_label(w: &WorkloadRef) -> String {
    label_value(&format!(
        "{}.{}",
        w.kind.as_str().to_ascii_lowercase(),
        w.name
    ))
}

/// The agent Job for `pod`, named `name`, carrying `container_ids`, created suspended
/// (see below). The spec hash is recorded in an annotation (and returned) so a change
/// of agent settings is noticed.
pub fn job(
    settings: &Settings,
    profile: &AgentProfile<'_>,
    target: &AgentTarget<'_>,
    name: &str,
) -> (Job, String) {
    let pod = target.pod;
    let ids_json = agent_job::container_ids_json(target.container_ids);
    // The ports are left out of the hashed spec: a Job that already redirects every
    // wanted port is kept when fewer are wanted (see `reap::fate`).
    let mut agent_config = agent_config(settings, profile, target);
    let container = agent_container(settings, profile, target, &agent_config, &ids_json);
    let mut spec = JobSpec {
        backoff_limit: Some(settings.backoff_limit),
        template: PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(agent_pod_labels(profile, pod)),
                annotations: Some(pod_annotations(settings)),
                ..Default::default()
            }),
            spec: Some(agent_pod_spec(settings, pod, container)),
        },
        ..Default::default()
    };
    let hash = spec_hash(&spec);
    // Only where the agent image runs. Not part of the hash either: a Job made before
    // this setting stays (its pod runs, so its node is of the right platform), and the
    // plan, not a replacement, handles a node of another platform (the pod is skipped
    // and its Job reaped).
    if let Some(ps) = spec.template.spec.as_mut() {
        ps.node_selector = Some(settings.platform.node_selector());
    }
    // Created suspended: the operator resumes it once its credential Secret exists, so
    // its pod never waits on a missing Secret, and a Job still suspended is one whose
    // Secret is not confirmed (an operator stopped between the two resumes it). Like
    // the ports, not part of the hash: it is the handshake's state, not a setting.
    spec.suspend = Some(true);
    agent_config.ports = target
        .ports
        .iter()
        .filter_map(|p| u16::try_from(*p).ok().map(PortEntry::Number))
        .collect();
    set_agent_config(&mut spec, &agent_config);
    let job = Job {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(settings.namespace.clone()),
            labels: Some(job_labels(profile, pod)),
            annotations: Some(job_annotations(profile, target, ids_json, &hash)),
            ..Default::default()
        },
        spec: Some(spec),
        status: None,
    };
    (job, hash)
}

/// The agent's `AGENT_CONFIG`, without the ports to redirect.
fn agent_config(
    settings: &Settings,
    profile: &AgentProfile<'_>,
    target: &AgentTarget<'_>,
) -> AgentConfig {
    AgentConfig {
        namespace: profile.namespace.into(),
        workload: Some(agent_job::Workload {
            kind: profile.workload.kind.as_str().into(),
            name: profile.workload.name.clone(),
        }),
        containers: target.containers.to_vec(),
        // Admission bounds the GID to 1..=2^31-1.
        agent_gid: u32::try_from(profile.agent.gid).ok(),
        manager_namespace: settings.namespace.clone(),
        config: profile.agent.config.clone(),
        ports: vec![],
    }
}

/// Replaces the agent container's `AGENT_CONFIG` with `config`.
fn set_agent_config(spec: &mut JobSpec, config: &AgentConfig) {
    if let Some(env) = spec
        .template
        .spec
        .as_mut()
        .and_then(|ps| ps.containers[0].env.as_mut())
        .and_then(|env| env.iter_mut().find(|e| e.name == agent_env::AGENT_CONFIG))
    {
        env.value = Some(config.to_json());
    }
}

/// A path naming the socket itself is handed over as the socket; anything else is a
/// directory the agent probes for the well-known runtime sockets.
fn cri_is_socket(settings: &Settings) -> bool {
    settings.cri_socket_path.ends_with(".sock")
}

/// The agent pod's labels: the agent selector, and its target.
fn agent_pod_labels(profile: &AgentProfile<'_>, pod: &PodView) -> BTreeMap<String, String> {
    let mut pod_labels = agent_selector_labels();
    pod_labels.insert(labels::TARGET_NAMESPACE.into(), profile.namespace.into());
    pod_labels.insert(labels::TARGET_POD_UID.into(), pod.uid.clone());
    pod_labels
}

/// The Job's labels: the agent selector, its owner kind, its target and workload.
fn job_labels(profile: &AgentProfile<'_>, pod: &PodView) -> BTreeMap<String, String> {
    let mut job_labels = agent_selector_labels();
    job_labels.insert(labels::NAME.into(), COMPONENT.into());
    job_labels.insert(labels::OWNER_KIND.into(), "NodeAgentAttachment".into());
    job_labels.insert(labels::TARGET_NAMESPACE.into(), profile.namespace.into());
    job_labels.insert(labels::WORKLOAD.into(), workload_label(profile.workload));
    job_labels.insert(labels::TARGET_POD_UID.into(), pod.uid.clone());
    job_labels
}

/// The Job's annotations: its target, container IDs, ports and spec hash (read back by
/// the observation).
fn job_annotations(
    profile: &AgentProfile<'_>,
    target: &AgentTarget<'_>,
    ids_json: String,
    hash: &str,
) -> BTreeMap<String, String> {
    BTreeMap::from([
        (annotations::TARGET_POD.into(), target.pod.name.clone()),
        (annotations::WORKLOAD.into(), workload_key(profile.workload)),
        (annotations::CONTAINER_IDS.into(), ids_json),
        (annotations::SPEC_HASH.into(), hash.to_string()),
        (
            annotations::AGENT_PORTS.into(),
            serde_json::to_string(target.ports).expect("numbers serialize"),
        ),
    ])
}

/// The agent container: root with the agent's GID and exactly [`CAPABILITIES`], a
/// read-only root filesystem, ready when its control port answers `/healthz`.
fn agent_container(
    settings: &Settings,
    profile: &AgentProfile<'_>,
    target: &AgentTarget<'_>,
    agent_config: &AgentConfig,
    ids_json: &str,
) -> Container {
    Container {
        name: "agent".into(),
        // The image, the host path and the pod's annotations are the installer's (the
        // attachment's deprecated fields of the same names are rejected at admission
        // and never read): an attachment must not choose what runs as root on the node.
        image: Some(settings.image.clone()),
        args: Some(vec!["node-agent".into()]),
        env: Some(agent_env_vars(
            settings,
            profile,
            target,
            agent_config,
            ids_json,
        )),
        ports: Some(vec![
            ContainerPort {
                name: Some("control".into()),
                container_port: CONTROL_PORT,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
            ContainerPort {
                name: Some("metrics".into()),
                container_port: settings.metrics_port,
                protocol: Some("TCP".into()),
                ..Default::default()
            },
        ]),
        readiness_probe: Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/healthz".into()),
                port: IntOrString::String("control".into()),
                ..Default::default()
            }),
            period_seconds: Some(5),
            ..Default::default()
        }),
        security_context: Some(agent_security_context(profile.agent.gid)),
        volume_mounts: Some(agent_volume_mounts()),
        ..Default::default()
    }
}

/// The agent's environment: its config and target, where its mounts are, its node,
/// metrics address and log format.
fn agent_env_vars(
    settings: &Settings,
    profile: &AgentProfile<'_>,
    target: &AgentTarget<'_>,
    agent_config: &AgentConfig,
    ids_json: &str,
) -> Vec<EnvVar> {
    let env = |name: &str, value: String| EnvVar {
        name: name.into(),
        value: Some(value),
        ..Default::default()
    };
    let pod = target.pod;
    vec![
        env(agent_env::AGENT_CONFIG, agent_config.to_json()),
        env(agent_env::AGENT_TARGET_NAMESPACE, profile.namespace.into()),
        env(agent_env::AGENT_TARGET_POD, pod.name.clone()),
        env(agent_env::AGENT_TARGET_POD_UID, pod.uid.clone()),
        env(
            agent_env::AGENT_TARGET_POD_IP,
            pod.ip.clone().unwrap_or_default(),
        ),
        env(agent_env::AGENT_CONTAINER_IDS, ids_json.into()),
        if cri_is_socket(settings) {
            env(agent_env::CRI_SOCKET, CRI_MOUNT.into())
        } else {
            env(agent_env::AGENT_CRI_SOCKET_DIR, CRI_MOUNT.into())
        },
        // The verifier arrives with the resumption (`resume_patch`), as an annotation of
        // the pod; the token itself never enters the agents' namespace.
        EnvVar {
            name: agent_env::AGENT_TOKEN_SHA256.into(),
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    field_path: format!("metadata.annotations['{TOKEN_VERIFIER_ANNOTATION}']"),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        },
        env(
            agent_env::AGENT_CONTROL_PORT,
            settings.control_port.to_string(),
        ),
        env(agent_env::MAX_WIRETAPS, settings.max_wiretaps.to_string()),
        env(agent_env::EXPORTS_DIR, EXPORTS_DIR.into()),
        env(agent_env::NODE_NAME, pod.node.clone().unwrap_or_default()),
        env(
            agent_env::METRICS_LISTEN,
            format!("0.0.0.0:{}", settings.metrics_port),
        ),
        env(agent_env::LOG_FORMAT, settings.log_format.to_string()),
    ]
}

/// Root with the agent's group (so the redirect rules exempt its sockets), not
/// privileged, exactly [`CAPABILITIES`], a read-only root filesystem.
fn agent_security_context(gid: i64) -> SecurityContext {
    SecurityContext {
        run_as_user: Some(0),
        run_as_group: Some(gid),
        privileged: Some(false),
        read_only_root_filesystem: Some(true),
        capabilities: Some(Capabilities {
            add: Some(CAPABILITIES.iter().map(|c| c.to_string()).collect()),
            drop: Some(vec!["ALL".into()]),
        }),
        ..Default::default()
    }
}

/// The runtime socket read-only; the exports writable.
fn agent_volume_mounts() -> Vec<VolumeMount> {
    vec![
        VolumeMount {
            name: "cri".into(),
            mount_path: CRI_MOUNT.into(),
            read_only: Some(true),
            ..Default::default()
        },
        VolumeMount {
            name: "exports".into(),
            mount_path: EXPORTS_DIR.into(),
            ..Default::default()
        },
    ]
}

/// The agent pod: on the target's node, in its PID namespace, never restarted in
/// place, without a service-account token.
fn agent_pod_spec(settings: &Settings, pod: &PodView, container: Container) -> PodSpec {
    PodSpec {
        node_name: Some(pod.node.clone().unwrap_or_default()),
        // Left out when empty, so Jobs made before this setting keep their hash.
        image_pull_secrets: (!settings.image_pull_secrets.is_empty()).then(|| {
            settings
                .image_pull_secrets
                .iter()
                .map(|name| LocalObjectReference { name: name.clone() })
                .collect()
        }),
        host_pid: Some(true),
        restart_policy: Some("Never".into()),
        automount_service_account_token: Some(false),
        enable_service_links: Some(false),
        termination_grace_period_seconds: Some(30),
        // Pinned to the target's node with exactly the target's tolerations: the
        // agent may go where its target may run, and nowhere else (a blanket
        // toleration would let it onto tainted control-plane nodes).
        tolerations: (!pod.tolerations.is_empty()).then(|| pod.tolerations.clone()),
        // The runtime's default syscall filter: the agent needs setns, ptrace
        // (of the target only, CAP_SYS_PTRACE) and netlink, all allowed by it.
        security_context: Some(PodSecurityContext {
            seccomp_profile: Some(SeccompProfile {
                type_: "RuntimeDefault".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        containers: vec![container],
        volumes: Some(agent_volumes(settings)),
        ..Default::default()
    }
}

/// The node's runtime socket (or its directory) and the exports' emptyDir.
fn agent_volumes(settings: &Settings) -> Vec<Volume> {
    vec![
        Volume {
            name: "cri".into(),
            host_path: Some(HostPathVolumeSource {
                type_: Some(
                    if cri_is_socket(settings) {
                        "Socket"
                    } else {
                        "Directory"
                    }
                    .into(),
                ),
                path: settings.cri_socket_path.clone(),
            }),
            ..Default::default()
        },
        Volume {
            name: "exports".into(),
            empty_dir: Some(Default::default()),
            ..Default::default()
        },
    ]
}

/// The agent pod's annotations: the Prometheus scrape annotations (as on the
/// migration agents), then the installer's, which win on a clash.
fn pod_annotations(settings: &Settings) -> BTreeMap<String, String> {
    let mut a = BTreeMap::from([
        ("prometheus.io/scrape".to_string(), "true".to_string()),
        (
            "prometheus.io/port".to_string(),
            settings.metrics_port.to_string(),
        ),
        ("prometheus.io/path".to_string(), "/metrics".to_string()),
    ]);
    a.extend(settings.pod_annotations.clone());
    a
}

/// Hash of a Job spec (its JSON is deterministic: maps are ordered).
pub fn spec_hash(spec: &JobSpec) -> String {
    let json = serde_json::to_vec(spec).expect("a JobSpec serializes");
    sha256_hex(&json, 16)
}

/// The target of one agent Job's credential: the Job, and the pod it attaches to.
#[derive(Clone, Copy, Debug)]
pub struct CredentialOf<'a> {
    pub job: &'a str,
    pub target_namespace: &'a str,
    pub target_pod: &'a str,
    pub target_pod_uid: &'a str,
}

/// The credential of an agent Job, in the *attachment's* namespace (the target pod's),
/// named like the Job: the bearer token (hex text, as a client sends it) and the control
/// API's port on the target pod's loopback. Owned by the target pod, so it never
/// outlives it; the operator deletes it with the Job. Whoever may read Secrets of that
/// namespace may use its agents, and nobody else: the agents' namespace holds only the
/// verifier (`resume_patch`).
pub fn credentials(settings: &Settings, of: CredentialOf<'_>, token: &[u8]) -> Secret {
    let mut l = agent_selector_labels();
    l.insert(labels::TARGET_POD_UID.into(), of.target_pod_uid.into());
    Secret {
        metadata: ObjectMeta {
            name: Some(of.job.into()),
            namespace: Some(of.target_namespace.into()),
            labels: Some(l),
            owner_references: Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: of.target_pod.into(),
                uid: of.target_pod_uid.into(),
                // Not the pod's controller, and it must not hold up the pod's deletion.
                controller: None,
                block_owner_deletion: None,
            }]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([
            (
                credential_keys::TOKEN.to_string(),
                ByteString(token_text(token).into_bytes()),
            ),
            (
                credential_keys::PORT.to_string(),
                ByteString(settings.control_port.to_string().into_bytes()),
            ),
        ])),
        immutable: Some(true),
        ..Default::default()
    }
}

/// The token as a client sends it: hex text.
pub fn token_text(token: &[u8]) -> String {
    crate::meta::hex(token)
}

/// The merge patch that resumes a suspended agent Job whose credential (for `token`)
/// is in place: the token's verifier on the pod template (what the agent reads) and
/// `suspend: false`, in one write, so the agent never starts without its verifier.
pub fn resume_patch(token: &[u8]) -> serde_json::Value {
    serde_json::json!({
        "spec": {
            "suspend": false,
            "template": {"metadata": {"annotations": {
                TOKEN_VERIFIER_ANNOTATION: agent_job::token_verifier(&token_text(token)),
            }}},
        }
    })
}

/// The ingest session Lease of attachment `a` (named `name`, owned by the
/// attachment), acquired and renewed `now`, for the spec's lease duration (60 s when
/// unset). The ingest client renews it; when it lapses the Jobs are reaped.
pub fn ingest_lease(a: &NodeAgentAttachment, name: &str, now: Timestamp) -> Lease {
    let secs = lease_duration_seconds(&a.spec);
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: a.namespace(),
            labels: Some(BTreeMap::from([
                (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
                (labels::OWNER_KIND.into(), "NodeAgentAttachment".into()),
            ])),
            owner_references: a.controller_owner_ref(&()).map(|r| vec![r]),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            lease_duration_seconds: Some(secs),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            ..Default::default()
        }),
    }
}

/// Denies all ingress to agent pods. Port-forwarding (which the client uses to reach
/// the agent) enters the pod's network namespace through the kubelet and is unaffected.
pub fn network_policy(settings: &Settings) -> NetworkPolicy {
    NetworkPolicy {
        metadata: ObjectMeta {
            name: Some(NETWORK_POLICY.into()),
            namespace: Some(settings.namespace.clone()),
            labels: Some(BTreeMap::from([
                (labels::MANAGED_BY.into(), labels::MANAGED_BY_VALUE.into()),
                (labels::NAME.into(), COMPONENT.into()),
            ])),
            ..Default::default()
        },
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(agent_selector_labels()),
                ..Default::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: None,
            egress: None,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attachment::fixtures::pod;
    use k8s_openapi::api::core::v1::Toleration;
    use podmotion_api::attachment::WorkloadKind;

    fn render(agent: &AgentSettings) -> Job {
        let p = pod("web-0").on_node("n1").ready().build();
        render_with(&Settings::default(), agent, &p)
    }

    fn credential_of<'a>(job: &'a str) -> CredentialOf<'a> {
        CredentialOf {
            job,
            target_namespace: "shop",
            target_pod: "web-0",
            target_pod_uid: "pod-uid",
        }
    }

    #[test]
    fn the_credential_token_is_text_a_client_can_send() {
        let s = credentials(
            &Settings::default(),
            credential_of("job"),
            &[0xff, 0x00, 0x9a],
        );
        let data = s.data.unwrap();
        let token = std::str::from_utf8(&data["token"].0).expect("UTF-8, as a client sends it");
        assert_eq!(token, "ff009a");
        assert_eq!(&data["port"].0, b"15000");
    }

    #[test]
    fn the_installers_wiretap_limit_reaches_every_agent() {
        let p = pod("web-0").on_node("n1").ready().build();
        for (limit, want) in [(None, "4"), (Some(9), "9")] {
            let mut settings = Settings::default();
            if let Some(l) = limit {
                settings.max_wiretaps = l;
            }
            let j = render_with(&settings, &AgentSettings::default(), &p);
            let env = pod_spec(&j).containers[0].env.clone().unwrap();
            let got = env.iter().find(|e| e.name == "PODMOTION_MAX_WIRETAPS");
            assert_eq!(
                got.and_then(|e| e.value.as_deref()),
                Some(want),
                "{limit:?}"
            );
        }
    }

    #[test]
    fn the_token_lives_in_the_attachments_namespace_and_the_agents_namespace_holds_only_its_verifier()
     {
        let settings = Settings {
            control_port: 15123,
            ..Settings::default()
        };
        let p = pod("web-0").on_node("n1").ready().build();
        let j = render_with(&settings, &AgentSettings::default(), &p);
        let token = [7u8; 32];
        let s = credentials(&settings, credential_of("podmotion-agent-1234"), &token);
        // The Secret is the tenant's: its namespace, owned by its pod.
        assert_eq!(s.metadata.namespace.as_deref(), Some("shop"));
        assert_ne!(s.metadata.namespace, j.metadata.namespace);
        let owner = &s.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Pod", "web-0", "pod-uid")
        );
        assert_eq!(&s.data.as_ref().unwrap()["port"].0, b"15123");
        // The Job mounts no Secret and names no token: it reads the verifier from its
        // own pod's annotation, which the resumption writes.
        let ps = pod_spec(&j);
        assert!(
            ps.volumes.iter().flatten().all(|v| v.secret.is_none()),
            "no Secret volume in the agents' namespace"
        );
        let env = ps.containers[0].env.as_ref().unwrap();
        let verifier = env
            .iter()
            .find(|e| e.name == "AGENT_TOKEN_SHA256")
            .expect("the verifier variable");
        assert_eq!(
            verifier
                .value_from
                .as_ref()
                .and_then(|v| v.field_ref.as_ref())
                .map(|f| f.field_path.as_str()),
            Some("metadata.annotations['podmotion.io/token-sha256']")
        );
        assert!(!env.iter().any(|e| e.name == "AGENT_CREDENTIALS_DIR"));
        let port = env.iter().find(|e| e.name == "AGENT_CONTROL_PORT").unwrap();
        assert_eq!(port.value.as_deref(), Some("15123"));
        let patch = resume_patch(&token);
        let text = token_text(&token);
        assert_eq!(patch["spec"]["suspend"], false);
        assert_eq!(
            patch["spec"]["template"]["metadata"]["annotations"][TOKEN_VERIFIER_ANNOTATION],
            agent_job::token_verifier(&text)
        );
        assert!(
            !patch.to_string().contains(&text),
            "the token never reaches the Job"
        );
    }

    #[test]
    fn agent_pods_carry_the_installers_image_pull_secrets_and_none_by_default() {
        let j = render(&AgentSettings::default());
        assert_eq!(pod_spec(&j).image_pull_secrets, None);
        let settings = Settings {
            image_pull_secrets: vec!["regcred".into(), "mirror".into()],
            ..Settings::default()
        };
        let p = pod("web-0").on_node("n1").ready().build();
        let j2 = render_with(&settings, &AgentSettings::default(), &p);
        let got: Vec<&str> = pod_spec(&j2)
            .image_pull_secrets
            .as_ref()
            .unwrap()
            .iter()
            .map(|r| r.name.as_str())
            .collect();
        assert_eq!(got, ["regcred", "mirror"]);
        let hash =
            |j: &Job| j.metadata.annotations.as_ref().unwrap()[annotations::SPEC_HASH].clone();
        assert_ne!(
            hash(&j),
            hash(&j2),
            "a changed pull secret replaces the Jobs"
        );
    }

    #[test]
    fn job_is_pinned_privileged_as_the_seed_says_and_no_more() {
        let j = render(&AgentSettings::default());
        assert_eq!(j.metadata.namespace.as_deref(), Some("podmotion-system"));
        let ps = j.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        assert_eq!(ps.node_name.as_deref(), Some("n1"));
        assert_eq!(ps.host_pid, Some(true));
        assert_eq!(ps.host_network, None);
        assert_eq!(ps.automount_service_account_token, Some(false));
        let c = &ps.containers[0];
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.run_as_group, Some(7777));
        assert_eq!(sc.privileged, Some(false));
        let caps = sc.capabilities.as_ref().unwrap();
        assert_eq!(
            caps.add.as_ref().unwrap(),
            &["SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "DAC_READ_SEARCH"]
        );
        assert_eq!(caps.drop.as_ref().unwrap(), &["ALL"]);
        let cri = ps
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "cri")
            .unwrap();
        assert_eq!(cri.host_path.as_ref().unwrap().path, "/run");
        let mount = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| m.name == "cri")
            .unwrap();
        assert_eq!(mount.read_only, Some(true));
        let env: BTreeMap<_, _> = c
            .env
            .as_ref()
            .unwrap()
            .iter()
            .map(|e| (e.name.as_str(), e.value.clone().unwrap_or_default()))
            .collect();
        assert_eq!(env["AGENT_CONTAINER_IDS"], r#"{"app":"containerd://abc"}"#);
        assert_eq!(
            env["AGENT_TARGET_POD_IP"],
            pod("web-0").on_node("n1").ready().build().ip.unwrap()
        );
        let config: serde_json::Value = serde_json::from_str(&env["AGENT_CONFIG"]).unwrap();
        assert_eq!(config["agentGID"], 7777);
        assert_eq!(config["ports"], serde_json::json!([8080]));
        assert_eq!(config["containers"], serde_json::json!(["app"]));
        assert_eq!(env["AGENT_CRI_SOCKET_DIR"], CRI_MOUNT);
    }

    fn render_with(settings: &Settings, agent: &AgentSettings, p: &PodView) -> Job {
        let w = WorkloadRef {
            kind: WorkloadKind::Deployment,
            name: "web".into(),
        };
        let ids = BTreeMap::from([("app".to_string(), "containerd://abc".to_string())]);
        let profile = AgentProfile {
            namespace: "shop",
            workload: &w,
            agent,
        };
        let names = ["app".to_string()];
        let target = AgentTarget {
            pod: p,
            containers: &names,
            container_ids: &ids,
            ports: &[8080],
        };
        job(settings, &profile, &target, "podmotion-agent-1234").0
    }

    fn pod_spec(j: &Job) -> &PodSpec {
        j.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    #[test]
    fn the_installers_settings_reach_the_job_and_change_its_hash() {
        let p = pod("web-0").on_node("n1").ready().build();
        let base = render_with(&Settings::default(), &AgentSettings::default(), &p);
        let installer = Settings {
            image: "registry.example/agent:2".into(),
            cri_socket_path: "/run/containerd".into(),
            pod_annotations: BTreeMap::from([(
                "policy.example/exempt".to_string(),
                "agent".to_string(),
            )]),
            ..Settings::default()
        };
        let j = render_with(&installer, &AgentSettings::default(), &p);
        let ps = pod_spec(&j);
        assert_eq!(
            ps.containers[0].image.as_deref(),
            Some("registry.example/agent:2")
        );
        let cri = ps.volumes.as_ref().unwrap()[0].host_path.as_ref().unwrap();
        assert_eq!(cri.path, "/run/containerd");
        let pod_meta = j.spec.as_ref().unwrap().template.metadata.as_ref().unwrap();
        assert_eq!(
            pod_meta.annotations.as_ref().unwrap()["policy.example/exempt"],
            "agent"
        );
        let socket = render_with(
            &Settings {
                cri_socket_path: "/run/k3s/containerd/containerd.sock".into(),
                ..Settings::default()
            },
            &AgentSettings::default(),
            &p,
        );
        let ps = pod_spec(&socket);
        let cri = ps.volumes.as_ref().unwrap()[0].host_path.as_ref().unwrap();
        assert_eq!(cri.type_.as_deref(), Some("Socket"));
        let env = ps.containers[0].env.as_ref().unwrap();
        assert!(env.iter().any(|e| e.name == "PODMOTION_CRI_SOCKET"));
        assert!(!env.iter().any(|e| e.name == "AGENT_CRI_SOCKET_DIR"));
        let gid = render(&AgentSettings {
            gid: 4242,
            ..Default::default()
        });
        let sc = pod_spec(&gid).containers[0]
            .security_context
            .clone()
            .unwrap();
        assert_eq!(sc.run_as_group, Some(4242));
        let hash =
            |j: &Job| j.metadata.annotations.as_ref().unwrap()[annotations::SPEC_HASH].clone();
        assert_ne!(hash(&base), hash(&j));
        assert_ne!(hash(&base), hash(&gid));
        assert_eq!(hash(&base), hash(&render(&AgentSettings::default())));
    }

    #[test]
    fn the_agent_pod_selects_the_images_platform_without_changing_the_jobs_hash() {
        let p = pod("web-0").on_node("n1").ready().build();
        let selector = |settings: &Settings| {
            let j = render_with(settings, &AgentSettings::default(), &p);
            let hash = j.metadata.annotations.as_ref().unwrap()[annotations::SPEC_HASH].clone();
            (pod_spec(&j).node_selector.clone().unwrap(), hash)
        };
        let (amd, amd_hash) = selector(&Settings::default());
        assert_eq!(
            amd,
            BTreeMap::from([
                ("kubernetes.io/arch".to_string(), "amd64".to_string()),
                ("kubernetes.io/os".to_string(), "linux".to_string()),
            ])
        );
        let arm = Settings {
            platform: Platform::linux("arm64"),
            ..Settings::default()
        };
        let (sel, arm_hash) = selector(&arm);
        assert_eq!(sel["kubernetes.io/arch"], "arm64");
        let any = Settings {
            platform: Platform::linux(""),
            ..Settings::default()
        };
        let (sel, any_hash) = selector(&any);
        assert_eq!(
            sel,
            BTreeMap::from([("kubernetes.io/os".to_string(), "linux".to_string())])
        );
        // The hash is the one a Job made before the setting carries: an upgrade, or a
        // change of the setting, replaces no running agent (the plan reaps a Job whose
        // node is of another platform instead).
        assert_eq!(amd_hash, arm_hash);
        assert_eq!(amd_hash, any_hash);
    }

    #[test]
    fn the_agent_serves_metrics_on_its_port_and_logs_in_the_operators_format() {
        let p = pod("web-0").on_node("n1").ready().build();
        let base = render_with(&Settings::default(), &AgentSettings::default(), &p);
        let env_of = |j: &Job| -> BTreeMap<String, String> {
            pod_spec(j).containers[0]
                .env
                .iter()
                .flatten()
                .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
                .collect()
        };
        let port_of = |j: &Job| {
            pod_spec(j).containers[0]
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some("metrics"))
                .map(|p| p.container_port)
        };
        assert_eq!(agent_env::LOG_FORMAT, podmotion_log::ENV);
        assert_eq!(env_of(&base)["PODMOTION_METRICS_LISTEN"], "0.0.0.0:9090");
        assert_eq!(env_of(&base)["PODMOTION_LOG_FORMAT"], "json");
        assert_eq!(port_of(&base), Some(9090));
        let meta = |j: &Job| {
            j.spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations
                .clone()
                .unwrap()
        };
        assert_eq!(meta(&base)["prometheus.io/port"], "9090");
        assert_eq!(meta(&base)["prometheus.io/scrape"], "true");

        let text = render_with(
            &Settings {
                log_format: podmotion_log::LogFormat::Text,
                metrics_port: 9191,
                pod_annotations: BTreeMap::from([(
                    "prometheus.io/scrape".to_string(),
                    "false".to_string(),
                )]),
                ..Settings::default()
            },
            &AgentSettings::default(),
            &p,
        );
        assert_eq!(env_of(&text)["PODMOTION_LOG_FORMAT"], "text");
        assert_eq!(env_of(&text)["PODMOTION_METRICS_LISTEN"], "0.0.0.0:9191");
        assert_eq!(port_of(&text), Some(9191));
        assert_eq!(
            meta(&text)["prometheus.io/scrape"],
            "false",
            "the installer's annotations win"
        );
        let hash =
            |j: &Job| j.metadata.annotations.as_ref().unwrap()[annotations::SPEC_HASH].clone();
        assert_ne!(
            hash(&base),
            hash(&text),
            "a changed format replaces the Jobs"
        );
    }

    #[test]
    fn an_attachment_cannot_choose_the_image_host_path_or_annotations_of_its_agent() {
        // What a tenant would write (admission rejects it; the core ignores it too).
        let exploit = AgentSettings {
            image: Some("evil.example/rootkit:1".into()),
            cri_socket_path: Some("/".into()),
            pod_annotations: BTreeMap::from([(
                "container.apparmor.security.beta.kubernetes.io/agent".to_string(),
                "unconfined".to_string(),
            )]),
            ..Default::default()
        };
        let j = render(&exploit);
        assert_eq!(j, render(&AgentSettings::default()));
        let ps = pod_spec(&j);
        assert_eq!(
            ps.containers[0].image.as_deref(),
            Some(concat!(
                "ghcr.io/podmotion/podmotion-attach:",
                env!("CARGO_PKG_VERSION")
            ))
        );
        let host_paths: Vec<&str> = ps
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.host_path.as_ref().map(|h| h.path.as_str()))
            .collect();
        assert_eq!(host_paths, ["/run"]);
        assert_eq!(
            j.spec
                .as_ref()
                .unwrap()
                .template
                .metadata
                .as_ref()
                .unwrap()
                .annotations,
            Some(pod_annotations(&Settings::default())),
            "only the chart's scrape annotations, none of the attachment's"
        );
    }

    #[test]
    fn the_agent_tolerates_exactly_what_its_target_tolerates_under_runtime_default_seccomp() {
        let plain = render(&AgentSettings::default());
        let ps = pod_spec(&plain);
        assert_eq!(ps.tolerations, None, "no blanket toleration");
        let seccomp = ps
            .security_context
            .as_ref()
            .and_then(|sc| sc.seccomp_profile.as_ref())
            .expect("a seccomp profile");
        assert_eq!(seccomp.type_, "RuntimeDefault");
        let mut p = pod("web-0").on_node("n1").ready().build();
        p.tolerations = vec![Toleration {
            key: Some("podmotion.io/real-node".into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Default::default()
        }];
        let j = render_with(&Settings::default(), &AgentSettings::default(), &p);
        assert_eq!(pod_spec(&j).tolerations.as_ref(), Some(&p.tolerations));
    }

    #[test]
    fn the_largest_admissible_config_fits_in_one_environment_value() {
        // The CRD's bounds: 64 entries, keys of 63 characters, values of 448 characters
        // (of up to 4 UTF-8 bytes, or 2 once JSON-escaped); also 32 containers of 63
        // characters and 256 ports (16 from the spec, or what the containers declare).
        let config: BTreeMap<String, String> = (0..64)
            .map(|i| (format!("{i:0>63}"), "\u{10FFFF}".repeat(448)))
            .collect();
        let agent = AgentSettings {
            config,
            ..Default::default()
        };
        let w = WorkloadRef {
            kind: WorkloadKind::StatefulSet,
            name: "w".repeat(253),
        };
        let p = pod("web-0").on_node("n1").ready().build();
        let containers: Vec<String> = (0..32).map(|i| format!("{i:c>63}")).collect();
        let ids: BTreeMap<String, String> = containers
            .iter()
            .map(|c| (c.clone(), format!("containerd://{}", "f".repeat(64))))
            .collect();
        let ports: Vec<i32> = (60_000..60_256).collect();
        let profile = AgentProfile {
            namespace: &"n".repeat(63),
            workload: &w,
            agent: &agent,
        };
        let target = AgentTarget {
            pod: &p,
            containers: &containers,
            container_ids: &ids,
            ports: &ports,
        };
        let (j, _) = job(&Settings::default(), &profile, &target, "podmotion-agent-1");
        let env = pod_spec(&j).containers[0].env.clone().unwrap();
        // Linux: MAX_ARG_STRLEN (32 pages) per `NAME=value` string, NUL included.
        const MAX_ARG_STRLEN: usize = 32 * 4096;
        for e in env {
            let len = e.name.len() + 1 + e.value.unwrap_or_default().len() + 1;
            assert!(len <= MAX_ARG_STRLEN, "{} is {len} bytes", e.name);
        }
    }

    #[test]
    fn rendered_job_reads_back_as_the_same_target() {
        let j = render(&AgentSettings::default());
        let v = crate::attachment::JobView::from_job(&j).expect("labels and annotations present");
        assert_eq!(v.target_namespace, "shop");
        assert_eq!(v.target_pod, "web-0");
        assert_eq!(v.workload, "Deployment/web");
        assert_eq!(v.container_ids["app"], "containerd://abc");
    }

    #[test]
    fn policy_denies_all_ingress_to_the_agent_pods() {
        let j = render(&AgentSettings::default());
        let np = network_policy(&Settings::default());
        let spec = np.spec.unwrap();
        assert_eq!(spec.policy_types.unwrap(), vec!["Ingress".to_string()]);
        assert!(
            spec.ingress.is_none(),
            "no ingress rule: everything is denied"
        );
        let sel = spec.pod_selector.unwrap().match_labels.unwrap();
        let pod_labels = j.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        assert!(
            sel.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
            "the policy selects the agent pods"
        );
    }

    #[test]
    fn long_workload_names_give_valid_distinct_labels() {
        let a = WorkloadRef {
            kind: WorkloadKind::Deployment,
            name: format!("{}a", "x".repeat(100)),
        };
        let b = WorkloadRef {
            kind: WorkloadKind::Deployment,
            name: format!("{}b", "x".repeat(100)),
        };
        assert!(workload_label(&a).len() <= 63);
        assert_ne!(workload_label(&a), workload_label(&b));
    }
}
