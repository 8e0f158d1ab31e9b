//! The object contract of `runner-daemonset-design-record.txt`, rendered from a
//! RunnerPool: the DaemonSet (§Privilege shape, §Pod resources, §Kubernetes object
//! contract), its ServiceAccount, the Runner's credential Secret, the NetworkPolicy
//! of `agent-pods-in-own-namespace.txt`, a PodDisruptionBudget and, when asked, a
//! PriorityClass.
//!
//! The objects are written as manifests (`json!`) because that is how reviewers read
//! a pod shape; each is converted to its typed form once, and the tests assert on the
//! typed objects. Fields the contract says must be off (`privileged`, `hostNetwork`,
//! `hostPID`, `hostIPC`) are rendered explicitly `false` so that this controller owns
//! them under server-side apply: a hand edit that turns one on conflicts with our
//! field manager and the next (forced) apply takes it back.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube_core::ResourceExt;
use podmotion_api::names::{annotations, labels};
use podmotion_api::runner_pool::RunnerPool;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::server::ServerEndpoint;
use super::sizing::{pod_size, termination_grace_seconds};
use crate::meta::child_meta;
use crate::platform::{Clash, Platform};

/// Name of the Runner container.
pub const RUNNER_CONTAINER: &str = "runner";
pub use super::preflight::PREFLIGHT_CONTAINER;
/// `app.kubernetes.io/name` (and component) of every Runner child.
pub const COMPONENT: &str = "runner";
/// Where the credential Secret is mounted in the Runner container.
pub const CREDENTIALS_DIR: &str = "/var/run/secrets/compass";
/// Default key of the token in the credential Secret.
pub const DEFAULT_TOKEN_KEY: &str = "token";
/// Volume names of the two hostPath mounts and the credential Secret.
pub const SESSIONS_VOLUME: &str = "sessions";
pub const RUNTIME_VOLUME: &str = "runtime";
pub const CREDENTIALS_VOLUME: &str = "credentials";

/// Ranges the Runner may never reach, besides the Server and DNS: every range that is
/// not the internet (`policies` says which and why).
pub use super::policies::{DENIED_IPV4, denied_ipv6};

/// Resources of the preflight init container (requests = limits, so the pod stays in
/// the Guaranteed QoS class).
const PREFLIGHT_CPU: &str = "50m";
const PREFLIGHT_MEMORY: &str = "32Mi";

/// Name of a pool's DaemonSet, ServiceAccount, NetworkPolicy and PDB.
pub fn child_name(pool: &RunnerPool) -> String {
    pool.name_any()
}

/// Name of the Secret the operator generates when none is referenced.
pub fn generated_secret_name(pool: &RunnerPool) -> String {
    format!("{}-credentials", pool.name_any())
}

/// The Secret the Runner mounts: the referenced one, or the generated one.
pub fn credential_secret(pool: &RunnerPool) -> (String, String) {
    let c = &pool.spec.credentials;
    let name = c
        .secret_name
        .clone()
        .unwrap_or_else(|| generated_secret_name(pool));
    (
        name,
        c.key.clone().unwrap_or_else(|| DEFAULT_TOKEN_KEY.into()),
    )
}

/// Labels that select one pool's Runner pods.
pub fn pod_selector(pool: &RunnerPool) -> BTreeMap<String, String> {
    BTreeMap::from([
        (labels::NAME.to_string(), COMPONENT.to_string()),
        (
            labels::INSTANCE.to_string(),
            crate::meta::label_value(&pool.name_any()),
        ),
    ])
}

/// The pool's `maxUnavailable` as applied: a count is capped so a rollout or a drain
/// never takes every eligible node (at most N-1, at least 1); a percentage (at most
/// 50% by the CRD) is passed through.
pub fn effective_max_unavailable(pool: &RunnerPool, eligible_nodes: usize) -> IntOrString {
    match &pool.spec.rollout.max_unavailable {
        IntOrString::Int(n) => {
            let cap = i32::try_from(eligible_nodes.saturating_sub(1))
                .unwrap_or(i32::MAX)
                .max(1);
            IntOrString::Int((*n).clamp(1, cap))
        }
        IntOrString::String(s) => IntOrString::String(s.clone()),
    }
}

/// `minAvailable` of the PodDisruptionBudget: the eligible nodes less the rollout's
/// bound, so evictions are bounded like a rollout.
pub fn pdb_min_available(pool: &RunnerPool, eligible_nodes: usize) -> i32 {
    let nodes = i32::try_from(eligible_nodes).unwrap_or(i32::MAX);
    let down = super::sizing::max_unavailable_count(
        &effective_max_unavailable(pool, eligible_nodes),
        nodes,
    );
    (nodes - down).max(0)
}

/// The platform the Runner pod needs: Linux always (user namespaces, KVM), and the
/// operator's architecture while the pod runs PodMotion's own preflight image. A pool
/// that names its own preflight image runs nothing of PodMotion's, and chooses its
/// nodes' architecture with its own label.
pub fn pod_platform(pool: &RunnerPool, platform: &Platform) -> Platform {
    match pool.spec.preflight.image {
        Some(_) => Platform::linux(""),
        None => platform.clone(),
    }
}

/// The Runner pod's nodeSelector: the pool's node label and the keys of
/// [`pod_platform`]. The pool's label wins where it names one of those keys (as the
/// chart's own values do over `global.nodeArch`): the pool's choice of nodes is never
/// silently replaced. Each such key with another value is returned too, and reported
/// (`PlatformConflict`) instead of leaving the pool's pods failing unexplained.
pub fn node_selector(
    pool: &RunnerPool,
    platform: &Platform,
) -> (BTreeMap<String, String>, Vec<Clash>) {
    let nodes = &pool.spec.nodes;
    let own = BTreeMap::from([(nodes.label_key.clone(), nodes.label_value.clone())]);
    pod_platform(pool, platform).merge(&own)
}

/// Whether a node with `labels` runs a Runner of `pool`: it matches every key of the
/// pod's [`node_selector`], as the DaemonSet controller decides.
pub fn eligible(pool: &RunnerPool, platform: &Platform, labels: &BTreeMap<String, String>) -> bool {
    node_selector(pool, platform)
        .0
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// Observed facts the rendering needs besides the RunnerPool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inputs {
    /// Preflight image when the RunnerPool names none (operator setting).
    pub preflight_image: String,
    /// The preflight's log format: the operator's own (`--log-format`).
    pub log_format: podmotion_log::LogFormat,
    /// The platform PodMotion's images (the default preflight) are built for: the
    /// operator's `--node-arch` ([`node_selector`]).
    pub platform: Platform,
    /// Nodes carrying the pool's node label; caps `maxUnavailable` below all of them.
    pub eligible_nodes: usize,
    /// The Server's Service; `None` when it is missing or has no selector.
    pub server: Option<ServerEndpoint>,
    /// Token of the generated credential Secret: the existing one, or a fresh random
    /// one when the Secret does not exist yet. `None` when a Secret is referenced.
    pub credential_token: Option<String>,
}

/// Every object of the contract for one pool.
#[derive(Clone, Debug, PartialEq)]
pub struct Desired {
    pub daemonset: DaemonSet,
    pub service_account: ServiceAccount,
    /// The generated credential Secret (`None` when the pool references one).
    pub secret: Option<Secret>,
    pub network_policy: NetworkPolicy,
    pub pdb: PodDisruptionBudget,
    /// Cluster-scoped, cleaned up by the pool's finalizer (`None` when referenced).
    pub priority_class: Option<PriorityClass>,
}

fn typed<T: DeserializeOwned>(what: &str, v: Value) -> T {
    // The manifests below are fixed shapes; a failure here is a bug caught by every test.
    serde_json::from_value(v)
        .unwrap_or_else(|e| panic!("rendered {what} does not match its type: {e}"))
}

fn meta_json(pool: &RunnerPool, name: &str, namespace: Option<&str>) -> Value {
    serde_json::to_value(child_meta(pool, name, namespace, COMPONENT))
        .expect("ObjectMeta serializes")
}

/// Renders every object of the contract.
pub fn render(pool: &RunnerPool, inputs: &Inputs) -> Desired {
    let ns = pool.namespace().unwrap_or_default();
    let name = child_name(pool);
    Desired {
        daemonset: daemonset(pool, inputs),
        service_account: typed(
            "ServiceAccount",
            json!({
                "apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": meta_json(pool, &name, Some(&ns)),
                "automountServiceAccountToken": false,
            }),
        ),
        secret: generated_secret(pool, inputs),
        network_policy: network_policy(pool, inputs),
        pdb: typed(
            "PodDisruptionBudget",
            json!({
                "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                "metadata": meta_json(pool, &name, Some(&ns)),
                "spec": {
                    "selector": {"matchLabels": pod_selector(pool)},
                    // The disruption controller cannot compute maxUnavailable or
                    // percentages for DaemonSet pods (no scale subresource): an integer
                    // minAvailable is the form it supports.
                    "minAvailable": pdb_min_available(pool, inputs.eligible_nodes),
                    // A Runner that is not ready holds no sessions worth protecting; it
                    // must never block a node drain.
                    "unhealthyPodEvictionPolicy": "AlwaysAllow",
                }
            }),
        ),
        priority_class: pool
            .spec
            .priority_class
            .create
            .then(|| priority_class(pool)),
    }
}

fn generated_secret(pool: &RunnerPool, inputs: &Inputs) -> Option<Secret> {
    if pool.spec.credentials.secret_name.is_some() {
        return None;
    }
    let token = inputs.credential_token.as_ref()?;
    let (name, key) = credential_secret(pool);
    let mut secret: Secret = typed(
        "Secret",
        json!({
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": meta_json(pool, &name, pool.namespace().as_deref()),
        }),
    );
    secret.data = Some(BTreeMap::from([(
        key,
        ByteString(token.as_bytes().to_vec()),
    )]));
    Some(secret)
}

fn priority_class(pool: &RunnerPool) -> PriorityClass {
    let pc = &pool.spec.priority_class;
    typed(
        "PriorityClass",
        json!({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": meta_json(pool, &pc.name, None),
            "value": pc.value,
            "globalDefault": false,
            "preemptionPolicy": "PreemptLowerPriority",
            "description": format!(
                "Runner pods of RunnerPool {}/{}: every session on a node dies with its Runner, so ordinary workload must not preempt it.",
                pool.namespace().unwrap_or_default(), pool.name_any()
            ),
        }),
    )
}

/// The container securityContext shared by the Runner and its preflight (the
/// preflight must test the node under exactly the Runner's confinement).
fn container_security(pool: &RunnerPool) -> Value {
    let user = &pool.spec.runner_user;
    json!({
        "privileged": false,
        "runAsNonRoot": true,
        "runAsUser": user.uid,
        "runAsGroup": user.gid,
        "allowPrivilegeEscalation": false,
        "capabilities": {"drop": ["ALL"]},
        // virtiofsd --sandbox=namespace mounts a fresh /proc; needs hostUsers: false.
        "procMount": "Unmasked",
        // RuntimeDefault stops passt creating its user namespace.
        "seccompProfile": {"type": "Localhost", "localhostProfile": pool.spec.seccomp_profile},
        // The runtime default AppArmor profile denies passt's mount in its userns.
        "appArmorProfile": {"type": "Unconfined"},
    })
}

/// The Runner DaemonSet: one Runner pod per labelled node, rolled one node at a time
/// within the pool's disruption budget.
fn daemonset(pool: &RunnerPool, inputs: &Inputs) -> DaemonSet {
    let ns = pool.namespace().unwrap_or_default();
    let name = child_name(pool);
    let metrics = &pool.spec.metrics;
    typed(
        "DaemonSet",
        json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": meta_json(pool, &name, Some(&ns)),
            "spec": {
                "selector": {"matchLabels": pod_selector(pool)},
                "updateStrategy": {
                    "type": "RollingUpdate",
                    // maxSurge stays 0: two Runners on one node would share the runtime dir.
                    "rollingUpdate": {
                        "maxUnavailable": effective_max_unavailable(pool, inputs.eligible_nodes),
                        "maxSurge": 0,
                    },
                },
                "revisionHistoryLimit": 5,
                "template": {
                    "metadata": {
                        "labels": runner_pod_labels(pool, &name, &ns),
                        "annotations": {
                            annotations::PROMETHEUS_SCRAPE: "true",
                            annotations::PROMETHEUS_PORT: metrics.port.to_string(),
                            annotations::PROMETHEUS_PATH: metrics.path,
                        },
                    },
                    "spec": runner_pod_spec(pool, inputs, &name),
                },
            },
        }),
    )
}

/// The Runner pod's labels: those of every child of the pool, and its selector.
fn runner_pod_labels(pool: &RunnerPool, name: &str, ns: &str) -> serde_json::Map<String, Value> {
    let mut pod_labels = match meta_json(pool, name, Some(ns)).get("labels") {
        Some(Value::Object(m)) => m.clone(),
        _ => serde_json::Map::new(),
    };
    for (k, v) in &pod_selector(pool) {
        pod_labels.insert(k.clone(), Value::String(v.clone()));
    }
    pod_labels
}

/// The Runner pod: on the pool's nodes of its platform (tolerating their taint), in a
/// user namespace, none of the host's namespaces, the preflight before the Runner, the
/// two hostPath volumes and the credential Secret.
fn runner_pod_spec(pool: &RunnerPool, inputs: &Inputs, name: &str) -> Value {
    let spec = &pool.spec;
    let nodes = &spec.nodes;
    let taint_key = nodes
        .taint_key
        .clone()
        .unwrap_or_else(|| nodes.label_key.clone());
    let taint_value = nodes
        .taint_value
        .clone()
        .unwrap_or_else(|| nodes.label_value.clone());
    let (secret_name, _) = credential_secret(pool);
    json!({
        "serviceAccountName": name,
        "automountServiceAccountToken": false,
        "enableServiceLinks": false,
        "hostUsers": false,
        "hostNetwork": false,
        "hostPID": false,
        "hostIPC": false,
        "priorityClassName": spec.priority_class.name,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "nodeSelector": node_selector(pool, &inputs.platform).0,
        "tolerations": [{
            "key": taint_key, "operator": "Equal", "value": taint_value,
            "effect": nodes.taint_effect.as_str(),
        }],
        "securityContext": {
            "runAsNonRoot": true,
            "runAsUser": spec.runner_user.uid,
            "runAsGroup": spec.runner_user.gid,
            // Lets the Runner's group read the mounted token (mode 0440).
            "fsGroup": spec.runner_user.gid,
        },
        "initContainers": [preflight_container(pool, inputs)],
        "containers": [runner_container(pool)],
        "volumes": [
            {"name": SESSIONS_VOLUME, "hostPath": {"path": spec.host_paths.session_volume, "type": "Directory"}},
            {"name": RUNTIME_VOLUME, "hostPath": {"path": spec.host_paths.runtime_dir, "type": "DirectoryOrCreate"}},
            {"name": CREDENTIALS_VOLUME, "secret": {"secretName": secret_name, "defaultMode": 0o440}},
        ],
    })
}

/// The Runner container: the pod's size plus one KVM device (Guaranteed QoS), the
/// session and runtime directories and the token mounted, ready (and, when asked, live)
/// by its metrics port.
fn runner_container(pool: &RunnerPool) -> Value {
    let spec = &pool.spec;
    let size = pod_size(spec);
    let kvm = spec.kvm_resource_name.as_str();
    let metrics = &spec.metrics;
    let readiness = &spec.probes.readiness;
    let mut runner = json!({
        "name": RUNNER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "env": runner_env(pool),
        "ports": [{"name": "metrics", "containerPort": metrics.port, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": size.cpu_quantity(), "memory": size.memory_quantity(), kvm: "1"},
            "limits": {"cpu": size.cpu_quantity(), "memory": size.memory_quantity(), kvm: "1"},
        },
        "securityContext": container_security(pool),
        "volumeMounts": [
            {"name": SESSIONS_VOLUME, "mountPath": spec.host_paths.session_volume},
            {"name": RUNTIME_VOLUME, "mountPath": spec.host_paths.runtime_dir},
            {"name": CREDENTIALS_VOLUME, "mountPath": CREDENTIALS_DIR, "readOnly": true},
        ],
        "readinessProbe": {
            "httpGet": {"path": readiness.path, "port": "metrics"},
            "periodSeconds": readiness.period_seconds,
            "failureThreshold": readiness.failure_threshold,
        },
    });
    if let Some(l) = &spec.probes.liveness {
        runner["livenessProbe"] = json!({
            "httpGet": {"path": l.path, "port": "metrics"},
            "periodSeconds": l.period_seconds,
            "failureThreshold": l.failure_threshold,
        });
    }
    runner
}

/// The Runner's environment: its node, the Server and the token, the session shape,
/// its directories, reap budget and metrics address.
fn runner_env(pool: &RunnerPool) -> Value {
    let spec = &pool.spec;
    let ns = pool.namespace().unwrap_or_default();
    let (_, token_key) = credential_secret(pool);
    let server = &spec.server;
    let server_ns = server.namespace.clone().unwrap_or(ns);
    let sessions_dir = spec.host_paths.session_volume.as_str();
    let runtime_dir = spec.host_paths.runtime_dir.as_str();
    json!([
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}},
        {"name": "COMPASS_SERVER_ADDR", "value": format!("{}.{}.svc:{}", server.service_name, server_ns, server.port)},
        {"name": "COMPASS_TOKEN_FILE", "value": format!("{CREDENTIALS_DIR}/{token_key}")},
        {"name": "COMPASS_BACKEND", "value": "microvm"},
        {"name": "COMPASS_SESSIONS", "value": spec.sessions_per_node.to_string()},
        {"name": "COMPASS_GUEST_MEMORY_MIB", "value": spec.session.memory_mib.to_string()},
        {"name": "COMPASS_GUEST_MILLICPU", "value": spec.session.milli_cpu.to_string()},
        {"name": "COMPASS_SESSION_ROOT", "value": sessions_dir},
        {"name": "COMPASS_RUNTIME_DIR", "value": runtime_dir},
        {"name": "COMPASS_MICROVM_RUNROOT", "value": format!("{runtime_dir}/microvm")},
        {"name": "COMPASS_REAP_BUDGET_SECONDS", "value": spec.reap_budget_seconds.to_string()},
        {"name": "COMPASS_METRICS_ADDR", "value": format!(":{}", spec.metrics.port)},
    ])
}

/// The preflight init container: checks the node (KVM, the session volume's project
/// quota) under the Runner's confinement, with a small Guaranteed share and one KVM
/// device.
fn preflight_container(pool: &RunnerPool, inputs: &Inputs) -> Value {
    let spec = &pool.spec;
    let kvm = spec.kvm_resource_name.as_str();
    let sessions_dir = spec.host_paths.session_volume.as_str();
    json!({
        "name": PREFLIGHT_CONTAINER,
        "image": spec.preflight.image.clone().unwrap_or_else(|| inputs.preflight_image.clone()),
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--kvm-device=/dev/kvm",
            format!("--session-volume={sessions_dir}"),
            format!("--require-project-quota={}", spec.preflight.require_project_quota),
        ],
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "spec.nodeName"}}},
            {"name": podmotion_log::ENV, "value": inputs.log_format.to_string()},
        ],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {
            "requests": {"cpu": PREFLIGHT_CPU, "memory": PREFLIGHT_MEMORY, kvm: "1"},
            "limits": {"cpu": PREFLIGHT_CPU, "memory": PREFLIGHT_MEMORY, kvm: "1"},
        },
        "securityContext": container_security(pool),
        "volumeMounts": [{"name": SESSIONS_VOLUME, "mountPath": sessions_dir, "readOnly": true}],
    })
}

fn network_policy(pool: &RunnerPool, inputs: &Inputs) -> NetworkPolicy {
    let ns = pool.namespace().unwrap_or_default();
    let spec = &pool.spec;
    let ns_selector = |n: &str| json!({"matchLabels": {"kubernetes.io/metadata.name": n}});
    let mut egress = vec![json!({
        "to": [{"namespaceSelector": ns_selector("kube-system"), "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    })];
    // The Server's pods, on the port its Service forwards to. Unresolved (Service
    // missing or without selector): no rule, so nothing in-cluster is reachable, and
    // the status says why.
    if let Some(server) = &inputs.server {
        egress.push(json!({
            "to": [{"namespaceSelector": ns_selector(&server.namespace), "podSelector": {"matchLabels": server.selector}}],
            "ports": [{"protocol": "TCP", "port": server.target_port}],
        }));
    }
    egress.push(json!({
        "to": [
            {"ipBlock": {"cidr": "0.0.0.0/0", "except": DENIED_IPV4}},
            {"ipBlock": {"cidr": "::/0", "except": denied_ipv6()}},
        ],
    }));
    typed(
        "NetworkPolicy",
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta_json(pool, &child_name(pool), Some(&ns)),
            "spec": {
                "podSelector": {"matchLabels": pod_selector(pool)},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{
                    "from": [{"namespaceSelector": ns_selector(&spec.metrics.scrape_namespace)}],
                    "ports": [{"protocol": "TCP", "port": spec.metrics.port}],
                }],
                "egress": egress,
            },
        }),
    )
}
