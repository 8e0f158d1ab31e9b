//! RunnerPool's rules on the real runner node, through the chart installed from our
//! images (issue 45): what `tests/runner_pool.rs` proves with kwok playing the kubelets,
//! proven again where a kubelet really runs the Runner —
//!
//! * request sizing (docs/runner-pool.md, "Sizing: guest RAM is pod RAM"): the Runner
//!   container's requests and limits are the documented formula over the pool's
//!   session and overhead fields, the pod is Guaranteed, and the kubelet put exactly
//!   those limits on the container's cgroups; changing `sessionsPerNode` resizes it the
//!   same way through a rollout that never runs two Runners on one node (`maxSurge`
//!   0) and keeps `maxUnavailable` within the operator's cap (at most N-1 of N
//!   eligible nodes, at least 1) (kwok: `changing_capacity_rolls_the_daemonset_within_max_unavailable`);
//! * drift repair (docs/runner-pool.md, "Drift"): a DaemonSet edited by hand
//!   (privileged, a capability, another memory limit) is put back, the drift named in
//!   `ShapeDrift` Events, and the Runner that runs on the node afterwards is the
//!   contract's (kwok: `a_hand_edited_daemonset_is_reported_and_repaired`).
//!
//! The cluster has one real runner node by default (`REAL_RUNNER_NODES=1`, pm-real-2):
//! there a rollout can only show that the one Runner is replaced by one Runner (never
//! two at once) and that a `maxUnavailable` of 3 is capped to 1; that no more than
//! `maxUnavailable` nodes are without a ready Runner at once is asserted, but proves
//! something only with `REAL_RUNNER_NODES=2` or more.
//!
//! Needs the cluster with a runner node (`hack/cluster.sh up`, or `hack/cluster.sh
//! add-runner-nodes`) and the images pushed (`hack/images.sh`); without a runner node
//! every test fails, unless `PODMOTION_REAL_NODES=0` (refused under `CI`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Container, Event as CoreEvent, Pod, Service};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use podmotion_api::RunnerPool;
use podmotion_api::conditions::is_true;
use podmotion_api::names::{condition_types as ct, labels, reasons};
use podmotion_e2e::real::procs::pod_processes;
use podmotion_e2e::real::runner::{
    KVM, STANDIN_BIN, cgroup_value, pool_manifest, runner_nodes, standin_image,
};
use podmotion_e2e::real::{Images, Uninstall, helm_install};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, kubectl_wait, pod_running_ready, random_suffix,
    wait_for, wait_list,
};
use serde_json::{Value, json};

const TIMEOUT: Duration = Duration::from_secs(300);
const POOL: &str = "runners";

/// A release and a workloads' namespace (privileged: the Runner's hostPaths) with the
/// Server's Service, on the real runner nodes.
struct RunnerWorld {
    // Fields drop in this order: the release, then the namespaces.
    _uninstall: Uninstall,
    app: TestNamespace,
    _op: TestNamespace,
    nodes: Vec<String>,
}

impl RunnerWorld {
    async fn new(prefix: &str) -> Option<RunnerWorld> {
        let op = TestNamespace::new(&format!("{prefix}-op"), PodSecurity::Restricted).await?;
        let nodes = runner_nodes(&op.client).await?;
        // hostPath needs the privileged level (docs/runner-pool.md).
        let app = TestNamespace::new(prefix, PodSecurity::Privileged).await?;
        let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
        let uninstall = helm_install(
            &format!("pm{}", random_suffix()),
            &images,
            &op.name,
            &app.name,
            &format!("podmotion-e2e-{prefix}"),
            &[],
        );
        // The Server's Service the pool's egress rule resolves (no Server runs).
        let svc: Service = from_json(json!({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "compass-server"},
            "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443}]}
        }));
        app.api::<Service>()
            .create(&PostParams::default(), &svc)
            .await
            .unwrap();
        Some(RunnerWorld {
            _uninstall: uninstall,
            app,
            _op: op,
            nodes,
        })
    }

    /// Creates the pool `POOL` of the stand-in with `spec` and waits until
    /// `kubectl wait --for=condition=Ready` passes and every Runner pod is Ready; the
    /// pool and its pods.
    async fn ready_pool(&self, spec: Value) -> (RunnerPool, Vec<Pod>) {
        let pools: Api<RunnerPool> = self.app.api();
        let pool = pool_manifest(POOL, &self.app.name, &standin_image(), spec);
        pools.create(&PostParams::default(), &pool).await.unwrap();
        kubectl_wait(
            &self.app.name,
            &format!("runnerpool/{POOL}"),
            "Ready",
            TIMEOUT,
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
        (pools.get(POOL).await.unwrap(), self.runners(|_| true).await)
    }

    /// The Runner pods, one per runner node, all Running and Ready, once `cond` holds
    /// for each.
    async fn runners(&self, cond: impl Fn(&Pod) -> bool) -> Vec<Pod> {
        let n = self.nodes.len();
        wait_list(
            &self.app.api::<Pod>(),
            &runner_selector(),
            TIMEOUT,
            "a Ready Runner pod per runner node",
            |ps| {
                ps.len() == n
                    && ps.iter().all(|p| {
                        pod_running_ready(p) && p.metadata.deletion_timestamp.is_none() && cond(p)
                    })
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
    }
}

fn runner_selector() -> String {
    format!("{}=runner,{}={POOL}", labels::NAME, labels::INSTANCE)
}

/// Memory (MiB) and CPU (millicores) of one Runner pod by the documented formula.
fn documented_size(spec: &Value) -> (i64, i64) {
    let n = spec["sessionsPerNode"].as_i64().unwrap();
    let guest = spec["session"]["memoryMiB"].as_i64().unwrap();
    let cpu = spec["session"]["milliCPU"].as_i64().unwrap();
    let o = &spec["overhead"];
    let field = |k: &str| o[k].as_i64().unwrap();
    // ceil(guest × MiB per GiB / 1024), on non-negative numbers.
    let page_tables = (guest * field("pageTableMiBPerGuestGiB") + 1023) / 1024;
    let memory =
        n * (guest + field("perSessionMemoryMiB") + page_tables) + field("runnerMemoryMiB");
    let milli = n * (cpu + field("perSessionMilliCPU")) + field("runnerMilliCPU");
    (memory, milli)
}

/// A pool spec whose every sizing term differs from its default, so a term the
/// operator left out or defaulted shows in the size.
fn sizing_spec(sessions: i64) -> Value {
    json!({
        "sessionsPerNode": sessions,
        "session": {"memoryMiB": 256, "milliCPU": 200},
        "overhead": {"perSessionMemoryMiB": 64, "perSessionMilliCPU": 50,
            "pageTableMiBPerGuestGiB": 8, "runnerMemoryMiB": 96, "runnerMilliCPU": 60},
        "rollout": {"maxUnavailable": 3},
    })
}

fn container<'a>(pod: &'a Pod, name: &str) -> &'a Container {
    let spec = pod.spec.as_ref().unwrap();
    spec.init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name} in {}", pod.name_any()))
}

/// A container's requests and limits of `cpu`, `memory` and the KVM device.
fn resources(c: &Container) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let r = c.resources.clone().unwrap_or_default();
    let pick =
        |m: Option<BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>| {
            m.unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| ["cpu", "memory", KVM].contains(&k.as_str()))
                .map(|(k, v)| (k, v.0))
                .collect()
        };
    (pick(r.requests), pick(r.limits))
}

/// The limits the kubelet put on the Runner container of `pod` (its PID 1's cgroups):
/// memory in bytes and CPU in millicores (CFS quota over period).
fn kubelet_limits(pod: &Pod) -> (u64, u64) {
    let uid = pod.uid().unwrap();
    let pid = pod_processes(&uid)
        .into_iter()
        .map(|(pid, _)| pid)
        .find(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.strip_suffix(b"\0").unwrap_or(&c) == STANDIN_BIN.as_bytes())
        })
        .unwrap_or_else(|| panic!("no Runner PID 1 in pod {uid}: {:?}", pod_processes(&uid)));
    let read = |ctl: &str, v1: &str, v2: &str| {
        cgroup_value(pid, ctl, v1, v2).unwrap_or_else(|e| panic!("{e:#}"))
    };
    let memory = read("memory", "memory.limit_in_bytes", "memory.max");
    let memory: u64 = memory
        .parse()
        .unwrap_or_else(|_| panic!("memory limit {memory:?}"));
    let (quota, period) = match read("cpu", "cpu.cfs_quota_us", "cpu.max") {
        // v2: "<quota> <period>".
        v2 if v2.contains(' ') => {
            let (q, p) = v2.split_once(' ').unwrap();
            (q.to_owned(), p.to_owned())
        }
        v1 => (v1, read("cpu", "cpu.cfs_period_us", "cpu.max")),
    };
    let (quota, period): (u64, u64) = (
        quota
            .parse()
            .unwrap_or_else(|_| panic!("CPU quota {quota:?}")),
        period
            .parse()
            .unwrap_or_else(|_| panic!("CPU period {period:?}")),
    );
    (memory, quota * 1000 / period)
}

/// The Runner pod is of the documented size for `spec`: requests = limits on the
/// `runner` container (and the KVM device), the preflight's 32Mi/50m, Guaranteed QoS,
/// the grace period of every session's reap budget, and the kubelet enforcing it.
fn assert_sized(pod: &Pod, spec: &Value) {
    let (mib, milli) = documented_size(spec);
    let name = pod.name_any();
    let want: BTreeMap<String, String> = [
        ("cpu".to_string(), format!("{milli}m")),
        ("memory".to_string(), format!("{mib}Mi")),
        (KVM.to_string(), "1".to_string()),
    ]
    .into();
    let (requests, limits) = resources(container(pod, "runner"));
    assert_eq!(requests, want, "{name}: runner requests");
    assert_eq!(limits, want, "{name}: runner limits");
    // The preflight runs before the Runner: its own fixed size, the device too.
    let small: BTreeMap<String, String> = [
        ("cpu".to_string(), "50m".to_string()),
        ("memory".to_string(), "32Mi".to_string()),
        (KVM.to_string(), "1".to_string()),
    ]
    .into();
    let (requests, limits) = resources(container(pod, "preflight"));
    assert_eq!((&requests, &limits), (&small, &small), "{name}: preflight");
    let qos = pod.status.as_ref().and_then(|s| s.qos_class.clone());
    assert_eq!(qos.as_deref(), Some("Guaranteed"), "{name}: QoS class");
    let grace = pod.spec.as_ref().unwrap().termination_grace_period_seconds;
    let sessions = spec["sessionsPerNode"].as_i64().unwrap();
    assert_eq!(
        grace,
        Some(5 * sessions + 30),
        "{name}: reap budget × sessions + 30"
    );
    let (memory, cpu) = kubelet_limits(pod);
    assert_eq!(
        memory,
        (mib as u64) << 20,
        "{name}: the kubelet's memory limit"
    );
    assert_eq!(cpu, milli as u64, "{name}: the kubelet's CPU quota");
}

/// Watches the Runner pods: the most that were ever not terminal on one node at once,
/// and the most runner nodes ever without a Ready Runner at once.
struct RolloutWatch {
    worst: Arc<Mutex<(usize, usize)>>,
    task: tokio::task::JoinHandle<()>,
}

impl RolloutWatch {
    fn start(pods: Api<Pod>, nodes: Vec<String>) -> RolloutWatch {
        let worst = Arc::new(Mutex::new((0, 0)));
        let out = worst.clone();
        let task = tokio::spawn(async move {
            let config = watcher::Config::default().labels(&runner_selector());
            let mut stream = watcher::watcher(pods, config).boxed();
            let mut seen: BTreeMap<String, Pod> = BTreeMap::new();
            while let Ok(Some(ev)) = stream.try_next().await {
                match ev {
                    Event::Apply(p) | Event::InitApply(p) => {
                        seen.insert(p.name_any(), p);
                    }
                    Event::Delete(p) => {
                        seen.remove(&p.name_any());
                    }
                    _ => continue,
                }
                let on = |n: &String, ok: &dyn Fn(&Pod) -> bool| {
                    seen.values()
                        .filter(|p| p.spec.as_ref().and_then(|s| s.node_name.as_ref()) == Some(n))
                        .filter(|p| ok(p))
                        .count()
                };
                let live = |p: &Pod| !matches!(podmotion_e2e::pod_phase(p), "Succeeded" | "Failed");
                let ready =
                    |p: &Pod| pod_running_ready(p) && p.metadata.deletion_timestamp.is_none();
                let most = nodes.iter().map(|n| on(n, &live)).max().unwrap_or(0);
                let down = nodes.iter().filter(|n| on(n, &ready) == 0).count();
                let mut w = out.lock().unwrap();
                *w = (w.0.max(most), w.1.max(down));
            }
        });
        RolloutWatch { worst, task }
    }

    /// (most Runners not terminal on one node at once, most nodes without a Ready one).
    fn finish(self) -> (usize, usize) {
        self.task.abort();
        *self.worst.lock().unwrap()
    }
}

/// A pool whose every sizing term is set (2 sessions of 256 MiB / 200m; overheads 64
/// MiB / 50m per session, 8 MiB of page tables per GiB, 96 MiB / 60m for the Runner)
/// runs Runner pods of exactly the documented size — 740Mi and 560m, requests =
/// limits, Guaranteed, in `status.podMemory`/`podCpu` — whose cgroups on the real node
/// carry those limits. Then `sessionsPerNode: 1`: the DaemonSet (maxSurge 0,
/// `maxUnavailable` 3 capped to max(N-1, 1); the PodDisruptionBudget's `minAvailable`
/// N less that) rolls each Runner into a new pod of 418Mi and 310m, enforced alike,
/// the capacity follows, and never are two Runners live on a node at once.
#[tokio::test]
async fn a_runner_pod_is_sized_as_documented_and_the_kubelet_enforces_it_through_a_resize() {
    let Some(w) = RunnerWorld::new("rp-size").await else {
        return;
    };
    let spec = sizing_spec(2);
    assert_eq!(documented_size(&spec), (740, 560), "the formula, by hand");
    let (pool, pods) = w.ready_pool(spec.clone()).await;
    let st = pool.status.clone().unwrap();
    assert_eq!(
        (st.pod_memory.as_deref(), st.pod_cpu.as_deref()),
        (Some("740Mi"), Some("560m")),
        "{st:?}"
    );
    let n = w.nodes.len();
    assert_eq!(st.session_capacity, 2 * n as i32, "{st:?}");
    for p in &pods {
        assert_sized(p, &spec);
    }
    let cap = 3.clamp(1, n.saturating_sub(1).max(1)) as i32;
    let ds = w.app.api::<DaemonSet>().get(POOL).await.unwrap();
    let ru = ds.spec.update_strategy.unwrap().rolling_update.unwrap();
    assert_eq!(
        (ru.max_unavailable, ru.max_surge),
        (Some(IntOrString::Int(cap)), Some(IntOrString::Int(0))),
        "{n} eligible node(s)"
    );
    let pdb = w.app.api::<PodDisruptionBudget>().get(POOL).await.unwrap();
    assert_eq!(
        pdb.spec.unwrap().min_available,
        Some(IntOrString::Int(n as i32 - cap))
    );

    let watch = RolloutWatch::start(w.app.api(), w.nodes.clone());
    let old: Vec<String> = pods.iter().filter_map(|p| p.uid()).collect();
    let pools: Api<RunnerPool> = w.app.api();
    let updated = pools
        .patch(
            POOL,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"sessionsPerNode": 1}})),
        )
        .await
        .unwrap();
    let spec = sizing_spec(1);
    let after = wait_for(&pools, POOL, TIMEOUT, "resized, rolled out, Ready", |p| {
        p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            s.observed_generation == updated.metadata.generation
                && is_true(&s.conditions, ct::READY)
                && s.updated_nodes == n as i32
                && s.session_capacity == n as i32
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .unwrap();
    let st = after.status.unwrap();
    assert_eq!(
        (st.pod_memory.as_deref(), st.pod_cpu.as_deref()),
        (Some("418Mi"), Some("310m")),
        "{st:?}"
    );
    let pods = w
        .runners(|p| !old.contains(&p.uid().unwrap_or_default()))
        .await;
    for p in &pods {
        assert_sized(p, &spec);
    }
    let (most_on_a_node, most_down) = watch.finish();
    eprintln!(
        "rollout over {} runner pods: at most {most_down} node(s) without a ready Runner at once (maxUnavailable {cap}), at most {most_on_a_node} Runner on a node",
        pods.len()
    );
    assert_eq!(
        most_on_a_node, 1,
        "two Runners were live on one node at once"
    );
    assert!(
        most_down <= cap as usize,
        "{most_down} runner nodes without a ready Runner at once (maxUnavailable {cap})"
    );
}

/// The notes of every ShapeDrift Event, joined.
fn drift_notes(events: &[CoreEvent]) -> String {
    events
        .iter()
        .filter(|e| e.reason.as_deref() == Some(reasons::SHAPE_DRIFT))
        .filter_map(|e| e.message.clone())
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The Runner container runs unprivileged, with every capability dropped and none
/// added, and without privilege escalation.
fn unprivileged(c: &Container) -> bool {
    let Some(sc) = c.security_context.as_ref() else {
        return false;
    };
    let caps = sc.capabilities.clone().unwrap_or_default();
    sc.privileged != Some(true)
        && sc.allow_privilege_escalation == Some(false)
        && caps.add.unwrap_or_default().is_empty()
        && caps.drop == Some(vec!["ALL".to_string()])
}

/// On the real runner node, the Runner DaemonSet edited by hand as `kubectl edit`
/// would (privileged on, privilege escalation allowed, SYS_ADMIN added, 1Gi of memory):
/// the operator puts the contract back, names each edited field in `ShapeDrift`
/// Events, and the pool is `ShapeConformant` and Ready again; the Runner that runs on
/// each node afterwards is of the repaired template — unprivileged, no capability,
/// and the kubelet's memory limit the contract's, not 1Gi.
#[tokio::test]
async fn a_hand_edited_runner_daemonset_is_put_back_and_the_node_runs_the_contract() {
    let Some(w) = RunnerWorld::new("rp-drift").await else {
        return;
    };
    let spec = sizing_spec(1);
    let (_, before) = w.ready_pool(spec.clone()).await;
    let dss: Api<DaemonSet> = w.app.api();
    let edit = json!({"spec": {"template": {"spec": {"containers": [{
        "name": "runner",
        "securityContext": {
            "privileged": true,
            "allowPrivilegeEscalation": true,
            "capabilities": {"add": ["SYS_ADMIN"]},
        },
        "resources": {"limits": {"memory": "1Gi"}, "requests": {"memory": "1Gi"}},
    }]}}}});
    let edited = dss
        .patch(POOL, &PatchParams::default(), &Patch::Strategic(&edit))
        .await
        .unwrap();
    let c = &edited.spec.template.spec.as_ref().unwrap().containers[0];
    assert!(!unprivileged(c), "the edit did not take: {c:?}");

    let (mib, _) = documented_size(&spec);
    wait_for(&dss, POOL, TIMEOUT, "the contract restored", |ds| {
        ds.is_some_and(|ds| {
            let c = &ds.spec.template.spec.as_ref().unwrap().containers[0];
            unprivileged(c) && resources(c).1.get("memory") == Some(&format!("{mib}Mi"))
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let events = wait_list(
        &w.app.api::<CoreEvent>(),
        "",
        TIMEOUT,
        "ShapeDrift Events naming the edited fields",
        |evs| {
            let notes = drift_notes(evs);
            ["privileged", "SYS_ADMIN", "limits.memory"]
                .iter()
                .all(|f| notes.contains(f))
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("drift reported: {}", drift_notes(&events));
    let pools: Api<RunnerPool> = w.app.api();
    wait_for(&pools, POOL, TIMEOUT, "conformant and Ready again", |p| {
        p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            is_true(&s.conditions, ct::SHAPE_CONFORMANT) && is_true(&s.conditions, ct::READY)
        })
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));

    // What runs on the node now is the contract's Runner: the template the operator
    // put back (whatever the edit started), unprivileged, and sized as documented.
    let pods = w.runners(|p| unprivileged(container(p, "runner"))).await;
    for p in &pods {
        assert_sized(p, &spec);
    }
    eprintln!(
        "Runner pods before the edit {:?}, after the repair {:?}",
        before.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
        pods.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
}
