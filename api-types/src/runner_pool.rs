//! `RunnerPool`: a microVM Runner on every eligible node, as a DaemonSet with an
//! exact, unprivileged, sized and network-locked pod shape.
//!
//! The spec carries only the values the design record leaves to the cluster
//! operator (node label and taint, capacity numbers, device resource name, paths,
//! the Server's Service); the pod *shape* is fixed by the operator's renderer
//! (`operator/core/src/runner_pool/`). Every bound here is enforced by CEL so a bad value
//! is rejected at admission with a message, not discovered as a crash-looping pod.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// Shortest liveness failure window (`periodSeconds × failureThreshold`) accepted.
/// A liveness-driven restart kills every session on the node and nothing
/// rate-limits it, so a transient stall must never trigger one.
pub const LIVENESS_FLOOR_SECONDS: i32 = 300;

/// Runs the microVM Runner on every eligible node as a DaemonSet whose pod shape is
/// fixed by PodMotion: unprivileged, user-namespaced, sized for the node's session
/// capacity and locked down by a NetworkPolicy.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "podmotion.io",
    version = "v1alpha1",
    kind = "RunnerPool",
    namespaced,
    status = "RunnerPoolStatus",
    shortname = "rp",
    category = "podmotion",
    doc = "Runs the microVM Runner on every eligible node as an unprivileged, sized, network-locked DaemonSet.",
    printcolumn(name = "Image", type_ = "string", json_path = ".status.imageDigestShort"),
    printcolumn(name = "Desired", type_ = "integer", json_path = ".status.desiredNodes"),
    printcolumn(name = "Ready", type_ = "integer", json_path = ".status.readyNodes"),
    printcolumn(name = "Capacity", type_ = "integer", json_path = ".status.sessionCapacity"),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    validation = Rule::new("self.metadata.name.size() <= 50").message("metadata.name must be at most 50 characters: it names the DaemonSet, its pods and the '-credentials' Secret"),
)]
#[x_kube(
    validation = Rule::new("self.hostPaths.sessionVolume != self.hostPaths.runtimeDir && !self.hostPaths.sessionVolume.startsWith(self.hostPaths.runtimeDir + '/') && !self.hostPaths.runtimeDir.startsWith(self.hostPaths.sessionVolume + '/')").message("hostPaths.sessionVolume and hostPaths.runtimeDir must be two separate trees: neither may equal or contain the other"),
)]
#[serde(rename_all = "camelCase")]
pub struct RunnerPoolSpec {
    /// Runner image, pinned by digest (`registry/runner@sha256:<64 hex>`). A tag is
    /// not accepted: the digest names the whole KVM userland and guest assets, and a
    /// tag can be moved under a running fleet.
    #[x_kube(validation = Rule::new("self.matches('^[^@\\\\s]+@sha256:[0-9a-f]{64}$')").message("image must be pinned by digest, e.g. registry.example/runner@sha256:<64 hex digits>; tags are not accepted"))]
    #[schemars(length(max = 512))]
    pub image: String,

    /// Concurrent microVM sessions per node: the node's session capacity. The pod's
    /// memory and CPU are sized from it (see `session` and `overhead`).
    #[x_kube(validation = Rule::new("self >= 1 && self <= 256").message("sessionsPerNode must be between 1 and 256"))]
    pub sessions_per_node: i32,

    /// Size of one session's guest (microVM).
    #[serde(default)]
    pub session: SessionSize,

    /// Memory and CPU the pod needs beyond the guests themselves. Defaults follow
    /// the model in `docs/runner-pool.md`.
    #[serde(default)]
    pub overhead: Overhead,

    /// Which nodes run a Runner: a node label the DaemonSet selects on, and the taint
    /// that keeps other workloads off those nodes, which the Runner tolerates.
    #[serde(default)]
    pub nodes: NodeSelection,

    /// How fast a change of the pod template rolls through the nodes. Every replaced
    /// Runner pod ends all sessions on its node, so this is bounded.
    #[serde(default)]
    pub rollout: Rollout,

    /// User and group the Runner and its VMM children run as (non-root). Must match
    /// the image's user: the image and this value are single-sourced by the release.
    #[serde(default)]
    pub runner_user: RunnerUser,

    /// The two host directories the Runner mounts (and no others).
    #[serde(default)]
    pub host_paths: HostPaths,

    /// Localhost seccomp profile, relative to the kubelet's seccomp root
    /// (`/var/lib/kubelet/seccomp`). Node provisioning stages it; RuntimeDefault does
    /// not work (passt cannot create its user namespace under it).
    #[serde(default = "default_seccomp_profile")]
    #[x_kube(validation = Rule::new("self.size() > 0 && !self.startsWith('/') && !self.contains('..') && self.matches('^[A-Za-z0-9._/-]+$')").message("seccompProfile must be a relative path under the kubelet's seccomp root, without '..', e.g. podmotion/compass-runner.json"))]
    #[schemars(length(max = 253))]
    pub seccomp_profile: String,

    /// Extended resource a KVM device plugin advertises; the Runner requests one in
    /// its limits and the plugin injects `/dev/kvm` with its cgroup allowance.
    #[serde(default = "default_kvm_resource")]
    #[x_kube(validation = Rule::new("self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$') && !self.startsWith('kubernetes.io/')").message("kvmResourceName must be a domain-qualified extended resource name such as devices.kubevirt.io/kvm"))]
    #[schemars(length(max = 253))]
    pub kvm_resource_name: String,

    /// Priority of Runner pods, so ordinary workload does not preempt them.
    #[serde(default)]
    pub priority_class: PriorityClassRef,

    /// Where the Runner's token comes from. It is always mounted as a file, never
    /// passed as an environment value.
    #[serde(default)]
    pub credentials: Credentials,

    /// The Server the Runner dials out to. The NetworkPolicy allows egress to the
    /// pods behind this Service on its target port.
    pub server: ServerRef,

    /// Metrics endpoint: scraped through pod annotations, reachable only from one
    /// namespace.
    #[serde(default)]
    pub metrics: Metrics,

    /// Health probes. Readiness gates the pool's status; liveness is off by default.
    #[serde(default)]
    pub probes: Probes,

    /// Seconds the Runner needs to shut one session down in order and notify the
    /// Server. The pod's termination grace period is this × `sessionsPerNode` + 30.
    #[serde(default = "default_reap_budget")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 600").message("reapBudgetSeconds must be between 1 and 600"))]
    pub reap_budget_seconds: i32,

    /// The node preflight init container.
    #[serde(default)]
    pub preflight: Preflight,
}

fn default_seccomp_profile() -> String {
    "podmotion/compass-runner.json".into()
}
fn default_kvm_resource() -> String {
    "devices.kubevirt.io/kvm".into()
}
fn default_reap_budget() -> i32 {
    30
}

/// Size of one session's guest.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionSize {
    /// Guest RAM per session, in MiB. Guest RAM is charged to the Runner pod's memory
    /// cgroup, so it is part of the pod's request and limit.
    #[serde(rename = "memoryMiB", default = "default_guest_memory")]
    #[x_kube(validation = Rule::new("self >= 128 && self <= 1048576").message("session.memoryMiB must be between 128 and 1048576 (1 TiB)"))]
    pub memory_mib: i64,
    /// Guest vCPU allowance per session, in millicores.
    #[serde(rename = "milliCPU", default = "default_guest_cpu")]
    #[x_kube(validation = Rule::new("self >= 100 && self <= 256000").message("session.milliCPU must be between 100 and 256000"))]
    pub milli_cpu: i64,
}

impl Default for SessionSize {
    fn default() -> Self {
        Self {
            memory_mib: default_guest_memory(),
            milli_cpu: default_guest_cpu(),
        }
    }
}
fn default_guest_memory() -> i64 {
    2048
}
fn default_guest_cpu() -> i64 {
    1000
}

/// Memory and CPU beyond the guests (model and sources in `docs/runner-pool.md`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Overhead {
    /// Per session: cloud-hypervisor, virtiofsd and passt, measured as PSS (guest RAM
    /// is shared memory and must not be counted again), in MiB.
    #[serde(
        rename = "perSessionMemoryMiB",
        default = "default_session_overhead_mem"
    )]
    #[x_kube(validation = Rule::new("self >= 16 && self <= 65536").message("overhead.perSessionMemoryMiB must be between 16 and 65536"))]
    pub per_session_memory_mib: i64,
    /// Per session: CPU of the VMM, virtiofsd and passt beyond the guest, in millicores.
    #[serde(
        rename = "perSessionMilliCPU",
        default = "default_session_overhead_cpu"
    )]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 64000").message("overhead.perSessionMilliCPU must be between 0 and 64000"))]
    pub per_session_milli_cpu: i64,
    /// Host page tables per GiB of guest RAM, in MiB (they grow with guest RAM:
    /// about 550 MiB at 96 GiB). Rounded up per session.
    #[serde(rename = "pageTableMiBPerGuestGiB", default = "default_page_tables")]
    #[x_kube(validation = Rule::new("self >= 0 && self <= 64").message("overhead.pageTableMiBPerGuestGiB must be between 0 and 64"))]
    pub page_table_mib_per_guest_gib: i64,
    /// The Runner process itself, in MiB.
    #[serde(rename = "runnerMemoryMiB", default = "default_runner_mem")]
    #[x_kube(validation = Rule::new("self >= 32 && self <= 65536").message("overhead.runnerMemoryMiB must be between 32 and 65536"))]
    pub runner_memory_mib: i64,
    /// The Runner process itself, in millicores.
    #[serde(rename = "runnerMilliCPU", default = "default_runner_cpu")]
    #[x_kube(validation = Rule::new("self >= 10 && self <= 64000").message("overhead.runnerMilliCPU must be between 10 and 64000"))]
    pub runner_milli_cpu: i64,
}

impl Default for Overhead {
    fn default() -> Self {
        Self {
            per_session_memory_mib: default_session_overhead_mem(),
            per_session_milli_cpu: default_session_overhead_cpu(),
            page_table_mib_per_guest_gib: default_page_tables(),
            runner_memory_mib: default_runner_mem(),
            runner_milli_cpu: default_runner_cpu(),
        }
    }
}
fn default_session_overhead_mem() -> i64 {
    192
}
fn default_session_overhead_cpu() -> i64 {
    100
}
fn default_page_tables() -> i64 {
    6
}
fn default_runner_mem() -> i64 {
    128
}
fn default_runner_cpu() -> i64 {
    100
}

/// Node label selected on and node taint tolerated.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeSelection {
    /// Label key that marks Runner nodes.
    #[serde(default = "default_runner_key")]
    #[x_kube(validation = Rule::new("self.matches('^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$') && self.size() <= 316").message("nodes.labelKey must be a label key such as podmotion.io/runner-node"))]
    #[schemars(length(max = 316))]
    pub label_key: String,
    /// Value of that label on Runner nodes.
    #[serde(default = "default_true_string")]
    #[x_kube(validation = Rule::new("self.size() <= 63 && self.matches('^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$')").message("nodes.labelValue must be a label value (at most 63 characters)"))]
    #[schemars(length(max = 63))]
    pub label_value: String,
    /// Key of the taint on Runner nodes that the Runner tolerates. Default: `labelKey`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')").message("nodes.taintKey must be a taint key such as podmotion.io/runner-node"))]
    #[schemars(length(max = 316))]
    pub taint_key: Option<String>,
    /// Value of that taint. Default: `labelValue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() <= 63 && self.matches('^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$')").message("nodes.taintValue must be a label value (at most 63 characters)"))]
    #[schemars(length(max = 63))]
    pub taint_value: Option<String>,
    /// Effect of that taint: `NoSchedule` (default) or `NoExecute`.
    #[serde(default)]
    pub taint_effect: TaintEffect,
}

impl Default for NodeSelection {
    fn default() -> Self {
        Self {
            label_key: default_runner_key(),
            label_value: default_true_string(),
            taint_key: None,
            taint_value: None,
            taint_effect: TaintEffect::default(),
        }
    }
}
fn default_runner_key() -> String {
    crate::names::labels::RUNNER_NODE.into()
}
fn default_true_string() -> String {
    "true".into()
}

/// Effect of the taint on Runner nodes.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum TaintEffect {
    #[default]
    NoSchedule,
    NoExecute,
}

impl TaintEffect {
    pub fn as_str(self) -> &'static str {
        match self {
            TaintEffect::NoSchedule => "NoSchedule",
            TaintEffect::NoExecute => "NoExecute",
        }
    }
}

/// Rollout bound.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// Most Runner nodes replaced (and so without sessions) at once, during a rollout
    /// and, through the PodDisruptionBudget, during voluntary evictions: a count
    /// (at least 1) or a percentage from 1% to 50%. The operator also never lets it
    /// reach every eligible node: with N nodes it is at most N-1 (and at least 1).
    #[serde(default = "default_max_unavailable")]
    #[x_kube(validation = Rule::new("string(self).matches('^([1-9][0-9]{0,3}|([1-9]|[1-4][0-9]|50)%)$')").message("rollout.maxUnavailable must be a count from 1 to 9999 or a percentage from 1% to 50%: replacing a Runner ends its node's sessions, so a rollout may not take all nodes at once (100% is rejected)"))]
    pub max_unavailable: IntOrString,
}

impl Default for Rollout {
    fn default() -> Self {
        Self {
            max_unavailable: default_max_unavailable(),
        }
    }
}
fn default_max_unavailable() -> IntOrString {
    IntOrString::Int(1)
}

/// The Runner's user and group.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerUser {
    /// User ID (not 0).
    #[serde(default = "default_runner_id")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65534").message("runnerUser.uid must be between 1 and 65534: the Runner never runs as root"))]
    pub uid: i64,
    /// Group ID (not 0).
    #[serde(default = "default_runner_id")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65534").message("runnerUser.gid must be between 1 and 65534: the Runner never runs with group root"))]
    pub gid: i64,
}

impl Default for RunnerUser {
    fn default() -> Self {
        Self {
            uid: default_runner_id(),
            gid: default_runner_id(),
        }
    }
}
fn default_runner_id() -> i64 {
    10001
}

/// The Runner's two host directories.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPaths {
    /// Session-volume tree on a filesystem with project quotas, provisioned by the
    /// node's operator (must already exist). Mounted read-write at the same path.
    #[serde(default = "default_session_volume")]
    #[x_kube(validation = Rule::new(HOST_PATH_RULE).message("hostPaths.sessionVolume must be an absolute path without '..', and not /, /dev, /proc, /sys, /etc, /boot, /root, /var/run, /var/lib/kubelet or a container runtime's directory"))]
    #[schemars(length(max = 4096))]
    pub session_volume: String,
    /// Runner runtime dir (`--runtime-dir`) holding the microVM runroot; it outlives
    /// the pod so stale pidfiles are found and reaped. Created if missing.
    #[serde(default = "default_runtime_dir")]
    #[x_kube(validation = Rule::new(HOST_PATH_RULE).message("hostPaths.runtimeDir must be an absolute path without '..', and not /, /dev, /proc, /sys, /etc, /boot, /root, /var/run, /var/lib/kubelet or a container runtime's directory"))]
    #[schemars(length(max = 4096))]
    pub runtime_dir: String,
}

// A path must be absolute, normalised, and outside every tree that would hand the
// Runner the host: devices, kernel interfaces, host config, kubelet and runtime state
// (their sockets live there).
const HOST_PATH_RULE: &str = "self.matches('^(/[A-Za-z0-9._-]+)+$') && !self.contains('..') && !['/dev', '/proc', '/sys', '/etc', '/boot', '/root', '/run/containerd', '/run/crio', '/run/docker', '/var/run', '/var/lib/kubelet', '/var/lib/containerd', '/var/lib/docker', '/run/docker.sock', '/usr', '/bin', '/sbin', '/lib'].exists(p, self == p || self.startsWith(p + '/'))";

impl Default for HostPaths {
    fn default() -> Self {
        Self {
            session_volume: default_session_volume(),
            runtime_dir: default_runtime_dir(),
        }
    }
}
fn default_session_volume() -> String {
    "/var/lib/compass/sessions".into()
}
fn default_runtime_dir() -> String {
    "/run/compass".into()
}

/// PriorityClass of Runner pods: an existing one, or one the operator creates.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!self.name.startsWith('system-')").message("priorityClass.name must not start with 'system-': those classes belong to the cluster's own components, which a Runner must never preempt"))]
pub struct PriorityClassRef {
    /// Name of the PriorityClass.
    #[serde(default = "default_priority_class")]
    #[x_kube(validation = Rule::new("self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("priorityClass.name must be a DNS subdomain name"))]
    #[schemars(length(max = 253))]
    pub name: String,
    /// Create (and on deletion of this RunnerPool, remove) the PriorityClass. False:
    /// reference an existing one.
    #[serde(default = "default_true")]
    pub create: bool,
    /// Value of the created PriorityClass: higher than ordinary workload, below the
    /// system classes (1000000000 and above are reserved). A created or referenced
    /// class above the ceiling the operator's installer set (chart value
    /// `runnerPool.maxPriority`, default 1000000) stalls the pool with reason
    /// `PriorityClassRefused`.
    #[serde(default = "default_priority_value")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 999999999").message("priorityClass.value must be between 1 and 999999999 (higher values are reserved for system classes)"))]
    pub value: i32,
}

impl Default for PriorityClassRef {
    fn default() -> Self {
        Self {
            name: default_priority_class(),
            create: true,
            value: default_priority_value(),
        }
    }
}
fn default_priority_class() -> String {
    "podmotion-runner".into()
}
fn default_true() -> bool {
    true
}
fn default_priority_value() -> i32 {
    1_000_000
}

/// Where the Runner's token comes from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Credentials {
    /// A Secret in this namespace holding the token. Unset: the operator generates a
    /// Secret `<name>-credentials` with a random token once and keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() <= 253 && self.matches('^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$')").message("credentials.secretName must be a DNS subdomain name"))]
    #[schemars(length(max = 253))]
    pub secret_name: Option<String>,
    /// Key of the token in that Secret. Default `token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 253 && self.matches('^[-._a-zA-Z0-9]+$')").message("credentials.key must be a Secret key (letters, digits, '-', '_' and '.')"))]
    #[schemars(length(max = 253))]
    pub key: Option<String>,
}

/// The Server's Service.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServerRef {
    /// Name of the Service.
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 63 && self.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message("server.serviceName must be a Service name (DNS label)"))]
    #[schemars(length(max = 63))]
    pub service_name: String,
    /// Namespace of the Service. Default: this RunnerPool's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.size() <= 63 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("server.namespace must be a namespace name"))]
    #[schemars(length(max = 63))]
    pub namespace: Option<String>,
    /// Service port the Runner dials (gRPC).
    #[x_kube(validation = Rule::new("self >= 1 && self <= 65535").message("server.port must be between 1 and 65535"))]
    pub port: i32,
}

/// The metrics endpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Metrics {
    /// Container port of the metrics (and health) endpoint.
    #[serde(default = "default_metrics_port")]
    #[x_kube(validation = Rule::new("self >= 1024 && self <= 65535").message("metrics.port must be between 1024 and 65535 (the Runner is not root)"))]
    pub port: i32,
    /// HTTP path of the metrics.
    #[serde(default = "default_metrics_path")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && self.size() <= 255").message("metrics.path must start with '/'"), validation = Rule::new("self.matches('^[!-~]*$')").message("metrics.path must be printable ASCII without spaces or control characters such as CR and LF: it is sent as the HTTP request line"))]
    #[schemars(length(max = 255))]
    pub path: String,
    /// The only namespace allowed to connect to the Runner pods (on this port).
    #[serde(default = "default_scrape_namespace")]
    #[x_kube(validation = Rule::new("self.size() > 0 && self.size() <= 63 && self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?$')").message("metrics.scrapeNamespace must be a namespace name"))]
    #[schemars(length(max = 63))]
    pub scrape_namespace: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            port: default_metrics_port(),
            path: default_metrics_path(),
            scrape_namespace: default_scrape_namespace(),
        }
    }
}
fn default_metrics_port() -> i32 {
    9090
}
fn default_metrics_path() -> String {
    "/metrics".into()
}
fn default_scrape_namespace() -> String {
    "monitoring".into()
}

/// Health probes, served on the metrics port.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Probes {
    /// Readiness probe (always present).
    #[serde(default)]
    pub readiness: ReadinessProbe,
    /// Liveness probe; unset (the default) means none. A liveness restart ends every
    /// session on the node, so its failure window (`periodSeconds ×
    /// failureThreshold`) must be at least 300 seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<LivenessProbe>,
}

/// Readiness probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessProbe {
    /// HTTP path.
    #[serde(default = "default_readyz")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && self.size() <= 255").message("probes.readiness.path must start with '/'"), validation = Rule::new("self.matches('^[!-~]*$')").message("probes.readiness.path must be printable ASCII without spaces or control characters such as CR and LF: it is sent as the HTTP request line"))]
    #[schemars(length(max = 255))]
    pub path: String,
    /// Seconds between probes.
    #[serde(default = "default_ten")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 300").message("probes.readiness.periodSeconds must be between 1 and 300"))]
    pub period_seconds: i32,
    /// Failures before the pod is marked not ready.
    #[serde(default = "default_three")]
    #[x_kube(validation = Rule::new("self >= 1 && self <= 100").message("probes.readiness.failureThreshold must be between 1 and 100"))]
    pub failure_threshold: i32,
}

impl Default for ReadinessProbe {
    fn default() -> Self {
        Self {
            path: default_readyz(),
            period_seconds: 10,
            failure_threshold: 3,
        }
    }
}
fn default_readyz() -> String {
    "/readyz".into()
}
fn default_ten() -> i32 {
    10
}
fn default_three() -> i32 {
    3
}

/// Liveness probe with a failure window of at least 300 seconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.periodSeconds * self.failureThreshold >= 300").message("probes.liveness: periodSeconds × failureThreshold must be at least 300 seconds; a liveness restart ends every session on the node, so a transient stall must never trigger one (omit liveness to disable it)"))]
pub struct LivenessProbe {
    /// HTTP path.
    #[serde(default = "default_livez")]
    #[x_kube(validation = Rule::new("self.startsWith('/') && self.size() <= 255").message("probes.liveness.path must start with '/'"), validation = Rule::new("self.matches('^[!-~]*$')").message("probes.liveness.path must be printable ASCII without spaces or control characters such as CR and LF: it is sent as the HTTP request line"))]
    #[schemars(length(max = 255))]
    pub path: String,
    /// Seconds between probes.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 3600").message("probes.liveness.periodSeconds must be between 1 and 3600"))]
    pub period_seconds: i32,
    /// Consecutive failures before the container is restarted.
    #[x_kube(validation = Rule::new("self >= 1 && self <= 1000").message("probes.liveness.failureThreshold must be between 1 and 1000"))]
    pub failure_threshold: i32,
}

fn default_livez() -> String {
    "/livez".into()
}

/// The node preflight init container.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
pub struct Preflight {
    /// Preflight image, pinned by digest. Default: the one the operator was installed
    /// with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.matches('^[^@\\\\s]+@sha256:[0-9a-f]{64}$')").message("preflight.image must be pinned by digest, e.g. registry.example/preflight@sha256:<64 hex digits>"))]
    #[schemars(length(max = 512))]
    pub image: Option<String>,
    /// Require project-quota support on the session-volume filesystem.
    #[serde(default = "default_true")]
    pub require_project_quota: bool,
}

impl Default for Preflight {
    fn default() -> Self {
        Self {
            image: None,
            require_project_quota: true,
        }
    }
}

/// Observed state of a RunnerPool.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunnerPoolStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// First 12 hex digits of the image digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_digest_short: Option<String>,
    /// Nodes that should run a Runner.
    #[serde(default)]
    pub desired_nodes: i32,
    /// Nodes whose Runner is ready.
    #[serde(default)]
    pub ready_nodes: i32,
    /// Nodes whose Runner runs the current pod template.
    #[serde(default)]
    pub updated_nodes: i32,
    /// Ready nodes × sessions per node.
    #[serde(default)]
    pub session_capacity: i32,
    /// Memory request (= limit) of one Runner pod, as a Kubernetes quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_memory: Option<String>,
    /// CPU request (= limit) of one Runner pod, as a Kubernetes quantity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_cpu: Option<String>,
    /// Name of the credential Secret the operator generated and owns (unset when the
    /// pool references its own Secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credential_secret: Option<String>,
    /// Nodes whose preflight passed (every check ok), sorted: with `preflightFailures`,
    /// the verdict of every node whose preflight has finished.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preflight_passed: Vec<String>,
    /// Nodes whose preflight check failed, with the failing checks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preflight_failures: Vec<PreflightFailure>,
    /// Other NetworkPolicies that also select the Runner pods. NetworkPolicy allows
    /// are additive, so any of them can reopen traffic this pool's policy denies.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub foreign_network_policies: Vec<String>,
    /// Standard and RunnerPool conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// A node that failed preflight.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PreflightFailure {
    /// The node.
    pub node: String,
    /// Names of the checks that failed (`kvm`, `userns`, `apparmor`, `quota`), or
    /// `verdict` when the preflight gave no readable verdict.
    pub checks: Vec<String>,
    /// What the checks reported.
    pub message: String,
}
