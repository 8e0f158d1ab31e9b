//! The PodMigration controller against the real API server (`hack/cluster.sh up`):
//! finalizer, target pod on the target node, hand-over to the ReplicaSet, source pod
//! removal, status, rollback on deletion, agent loss and operator restart.
//!
//! What stands in for what: the pods are kwok's (nothing runs in them), so a real local
//! process (`sh` counting in a loop) stands for the source pod's container, and a
//! **process-level stand-in for the node agents** ([`ProcAgents`]) implements the
//! operator's `AgentClient` over it: `Dump` freezes the process with SIGSTOP and takes
//! its state (the counter), `Abort` thaws it with SIGCONT, `Restore` starts a new
//! process from that state, `Commit` kills the frozen source. It is *not* CRIU and not
//! the real agent (`executors/agent`, which replaces it once its wire client exists);
//! it exercises the controller's orchestration with real freeze/thaw/kill semantics.
//!
//! Needs `hack/cluster.sh up`; fails without a cluster unless PODMOTION_E2E=0.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::reasons;
use podmotion_e2e::kubectl_wait;
use podmotion_e2e::operator::install_crds;
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, deployment_on_nodes, from_json, pod_running_ready,
    wait_for, wait_list,
};
use podmotion_operator::config::OperatorConfig;
use podmotion_operator::context::Context;
use podmotion_operator::controllers::migration::{MigrationConfig, run_with};
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use podmotion_operator::migration::agent::{
    AgentCallError, AgentClient, AgentEndpoint, AgentProgress, AgentReport, Step, StepRequest,
    StepState,
};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const NODES: [&str; 2] = ["pm-node-0", "pm-node-1"];

// ------------------------------------------------------------ agent stand-in

/// A local process standing for a container: counts in a loop, writing its counter to
/// `file` every 20 ms.
struct Proc {
    child: Child,
    file: PathBuf,
}

impl Proc {
    fn start(file: PathBuf, from: u64) -> Proc {
        let script = format!(
            "i={from}; while :; do i=$((i+1)); echo $i > {f}.tmp && mv {f}.tmp {f}; sleep 0.02; done",
            f = file.display()
        );
        let child = Command::new("sh")
            .arg("-c")
            .arg(script)
            .spawn()
            .expect("spawn sh");
        Proc { child, file }
    }
    fn pid(&self) -> String {
        self.child.id().to_string()
    }
    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid())
            .status();
    }
    /// State letter from /proc (R/S running or sleeping, T stopped, Z/None gone).
    fn state(&mut self) -> Option<char> {
        if self.child.try_wait().ok().flatten().is_some() {
            return None;
        }
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        let after = stat.rsplit_once(')')?.1.trim_start();
        after.chars().next().filter(|c| *c != 'Z')
    }
    fn running(&mut self) -> bool {
        matches!(self.state(), Some(c) if c != 'T' && c != 't')
    }
    fn counter(&self) -> u64 {
        std::fs::read_to_string(&self.file)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Default)]
struct MigState {
    last: Option<(Step, StepState)>,
    progress: AgentProgress,
    /// The checkpoint (the counter) once dumped; "transferred" to the target.
    image: Option<u64>,
}

#[derive(Default)]
struct World {
    /// `<namespace>/<pod>` → the process standing for its container.
    containers: BTreeMap<String, Proc>,
    /// Restored processes by migration UID.
    restored: BTreeMap<String, Proc>,
    /// Per node: reachable?, and per migration UID its state on that node.
    down: BTreeMap<String, bool>,
    migs: BTreeMap<(String, String), MigState>,
    /// Running copies seen at once, at most (sampled on every call).
    max_copies: usize,
    /// Checkpointed counter values, by migration UID.
    checkpoints: BTreeMap<String, u64>,
    /// Delay before a step completes (to catch a migration mid-step).
    delays: BTreeMap<&'static str, Duration>,
    /// Steps that fail (by name).
    failing: Vec<&'static str>,
    /// Steps that fail on one node only (node, step name).
    failing_on: Vec<(String, &'static str)>,
}

/// The node agents of [`NODES`], over local processes. See the module documentation.
#[derive(Clone, Default)]
struct ProcAgents(Arc<Mutex<World>>);

fn step_name(s: Step) -> &'static str {
    match s {
        Step::PreDump(_) => "PreDump",
        Step::Dump => "Dump",
        Step::Transfer => "Transfer",
        Step::Restore => "Restore",
        Step::Probe => "Probe",
        Step::Abort => "Abort",
        Step::Commit => "Commit",
        _ => "other",
    }
}

impl ProcAgents {
    fn add_container(&self, ns: &str, pod: &str, dir: &std::path::Path) {
        let p = Proc::start(dir.join(format!("{pod}.counter")), 0);
        self.0
            .lock()
            .unwrap()
            .containers
            .insert(format!("{ns}/{pod}"), p);
    }
    /// How many (node, migration) pairs an agent was asked to act on.
    fn steps_started(&self) -> usize {
        self.0.lock().unwrap().migs.len()
    }
    fn fail(&self, step: &'static str) {
        self.0.lock().unwrap().failing.push(step);
    }
    fn fail_on(&self, node: &str, step: &'static str) {
        self.0.lock().unwrap().failing_on.push((node.into(), step));
    }
    fn delay(&self, step: &'static str, d: Duration) {
        self.0.lock().unwrap().delays.insert(step, d);
    }
    /// The agent process of `node` dies: CRIU's tracer goes with it, which resumes the
    /// frozen tasks; its in-memory state is lost.
    fn kill_agent(&self, node: &str) {
        let mut w = self.0.lock().unwrap();
        w.down.insert(node.into(), true);
        w.migs.retain(|(n, _), _| n != node);
        for p in w.containers.values() {
            p.signal("CONT");
        }
    }
    fn restart_agent(&self, node: &str) {
        self.0.lock().unwrap().down.insert(node.into(), false);
    }
    fn source_running(&self, key: &str) -> bool {
        self.0
            .lock()
            .unwrap()
            .containers
            .get_mut(key)
            .is_some_and(|p| p.running())
    }
    fn sample(w: &mut World) {
        let copies = w
            .containers
            .values_mut()
            .map(|p| p.running())
            .filter(|r| *r)
            .count()
            + w.restored
                .values_mut()
                .map(|p| p.running())
                .filter(|r| *r)
                .count();
        w.max_copies = w.max_copies.max(copies);
    }
    fn last_step(&self, node: &str, uid: &str) -> Option<(Step, StepState)> {
        self.0
            .lock()
            .unwrap()
            .migs
            .get(&(node.to_string(), uid.to_string()))
            .and_then(|m| m.last.clone())
    }

    /// Runs `step` now; returns the result state.
    fn run_step(w: &mut World, node: &str, r: &StepRequest) -> StepState {
        let key = format!("{}/{}", r.namespace, r.source_pod);
        let uid = r.migration_uid.clone();
        let fail = |m: &str| StepState::Failed {
            category: "StandInError".into(),
            message: m.into(),
        };
        if w.failing.contains(&step_name(r.step))
            || w.failing_on
                .contains(&(node.to_string(), step_name(r.step)))
        {
            return fail("injected failure");
        }
        match r.step {
            Step::Prepare => {
                let alive = w.containers.get_mut(&key).and_then(|p| p.state()).is_some();
                if !alive {
                    return fail("no process for the source pod");
                }
            }
            Step::Receive | Step::Probe | Step::Cleanup => {
                if r.step == Step::Probe && !w.restored.get_mut(&uid).is_some_and(|p| p.running()) {
                    return fail("restored process not running");
                }
            }
            Step::PreDump(n) => {
                let m = w.migs.entry((node.into(), uid.clone())).or_default();
                m.progress.iteration = n;
                m.progress.bytes_sent += 1 << 20;
                m.progress.dirty_bytes = Some((8u64 << 20) >> (2 * n));
                m.progress.rate_bytes_per_second = Some(100 << 20);
            }
            Step::Dump => {
                let Some(p) = w.containers.get(&key) else {
                    return fail("no source process");
                };
                p.signal("STOP");
                std::thread::sleep(Duration::from_millis(30));
                let value = p.counter();
                w.checkpoints.insert(uid.clone(), value);
                let m = w.migs.entry((node.into(), uid.clone())).or_default();
                m.image = Some(value);
                m.progress.frozen_at = Some(Timestamp::now());
            }
            Step::Transfer => {
                let image = w
                    .migs
                    .get(&(node.to_string(), uid.clone()))
                    .and_then(|m| m.image);
                let Some(image) = image else {
                    return fail("nothing dumped");
                };
                let target = (r.target_node.clone(), uid.clone());
                w.migs.entry(target).or_default().image = Some(image);
                let m = w.migs.entry((node.into(), uid.clone())).or_default();
                m.progress.bytes_sent += 4 << 20;
            }
            Step::Restore => {
                let image = w
                    .migs
                    .get(&(node.to_string(), uid.clone()))
                    .and_then(|m| m.image);
                let Some(image) = image else {
                    return fail("no image received");
                };
                // Next to the source's counter, in the test's own directory.
                let dir = w
                    .containers
                    .get(&key)
                    .and_then(|p| p.file.parent().map(PathBuf::from))
                    .unwrap_or_else(std::env::temp_dir);
                let file = dir.join(format!("restored-{uid}.counter"));
                w.restored.insert(uid.clone(), Proc::start(file, image));
                let m = w.migs.entry((node.into(), uid.clone())).or_default();
                m.progress.resumed_at = Some(Timestamp::now());
            }
            // The stand-in's fence is a no-op: its source is only ever resumed by Abort
            // (or, like a real agent's broker, when the stand-in agent is killed). It
            // has no network to forward (`start` answers the forward at once).
            Step::Fence | Step::Forward => {}
            Step::Commit => {
                if let Some(mut p) = w.containers.remove(&key) {
                    p.kill();
                }
            }
            Step::Abort => {
                if node == r.target_node {
                    if let Some(mut p) = w.restored.remove(&uid) {
                        p.kill();
                    }
                } else if let Some(p) = w.containers.get(&key) {
                    p.signal("CONT");
                }
            }
        }
        StepState::Done
    }
}

impl AgentClient for ProcAgents {
    async fn report(&self, e: &AgentEndpoint, uid: &str) -> Result<AgentReport, AgentCallError> {
        let mut w = self.0.lock().unwrap();
        Self::sample(&mut w);
        if w.down.get(&e.node).copied().unwrap_or(false) {
            return Err(AgentCallError {
                node: e.node.clone(),
                message: "connection refused".into(),
            });
        }
        Ok(match w.migs.get(&(e.node.clone(), uid.to_string())) {
            Some(m) => AgentReport {
                last: m.last.clone(),
                progress: m.progress.clone(),
            },
            None => AgentReport::default(),
        })
    }

    async fn start(&self, e: &AgentEndpoint, r: &StepRequest) -> Result<(), AgentCallError> {
        let key = (e.node.clone(), r.migration_uid.clone());
        let delay = {
            let mut w = self.0.lock().unwrap();
            if w.down.get(&e.node).copied().unwrap_or(false) {
                return Err(AgentCallError {
                    node: e.node.clone(),
                    message: "connection refused".into(),
                });
            }
            let m = w.migs.entry(key.clone()).or_default();
            if r.step == Step::Forward {
                // Reported apart from the steps, as the wire adapter does; nothing
                // to forward in a stand-in.
                m.progress.forward = Some(StepState::Done);
                return Ok(());
            }
            if m.last.as_ref().is_some_and(|(s, _)| *s == r.step) {
                return Ok(()); // idempotent
            }
            m.last = Some((r.step, StepState::Running));
            w.delays.get(step_name(r.step)).copied()
        };
        let this = self.clone();
        let node = e.node.clone();
        let r = r.clone();
        let finish = move || {
            let mut w = this.0.lock().unwrap();
            // A killed agent forgets; never complete a step it no longer knows.
            if !w
                .migs
                .get(&key)
                .is_some_and(|m| m.last == Some((r.step, StepState::Running)))
            {
                return;
            }
            let state = Self::run_step(&mut w, &node, &r);
            if let Some(m) = w.migs.get_mut(&key) {
                m.last = Some((r.step, state));
            }
            Self::sample(&mut w);
        };
        match delay {
            Some(d) => {
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    finish();
                });
            }
            None => finish(),
        }
        Ok(())
    }
}

// --------------------------------------------------------------- harness

/// The agents' namespace the in-process operator is given for workloads in `ns`: never
/// `ns` itself, since the pre-flight refuses every pod of the agents' namespace.
fn agents_namespace_of(ns: &str) -> String {
    format!("{ns}-agents")
}

/// The migration controller, in this process, for one namespace.
fn start_controller(client: &Client, ns: &str, agents: &ProcAgents) -> JoinHandle<()> {
    start_controller_with(client, ns, agents, true, &[])
}

/// `overrides`: reach the agents through endpoint overrides (local runs) rather than
/// through the Ready agent pods in the namespace.
fn start_controller_with(
    client: &Client,
    ns: &str,
    agents: &ProcAgents,
    overrides: bool,
    extra: &[&str],
) -> JoinHandle<()> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        op: OperatorConfig,
        #[command(flatten)]
        mig: MigrationConfig,
    }
    let endpoints = NODES
        .iter()
        .map(|n| format!("{n}=proc://{n}"))
        .collect::<Vec<_>>()
        .join(",");
    let agents_ns = agents_namespace_of(ns);
    let mut args = vec![
        "podmotion-operator",
        "--no-leader-election",
        "--migration-namespace",
        ns,
        "--migration-agent-namespace",
        agents_ns.as_str(),
    ];
    if overrides {
        args.extend(["--migration-agent-endpoint", endpoints.as_str()]);
    }
    args.extend(extra);
    let cli = Cli::try_parse_from(args).unwrap();
    let (_tx, rx) = watch::channel(false);
    let ctx = Arc::new(Context::new(
        client.clone(),
        cli.op,
        Leadership::always(),
        Arc::new(Metrics::new()),
        rx,
    ));
    let agents = Arc::new(agents.clone());
    tokio::spawn(async move {
        let _keep = _tx;
        run_with(ctx, cli.mig, agents).await.unwrap();
    })
}

struct Setup {
    ns: TestNamespace,
    agents: ProcAgents,
    controller: JoinHandle<()>,
    pod: Pod,
    pods: Vec<Pod>,
    dir: PathBuf,
}

impl Setup {
    async fn new(prefix: &str) -> Option<Setup> {
        Setup::new_with(prefix, true).await
    }

    async fn new_with(prefix: &str, overrides: bool) -> Option<Setup> {
        Setup::build(prefix, overrides, 1, &[]).await
    }

    /// A namespace, the controller, and a Deployment `web` of `replicas` pods on the
    /// two agent nodes, each with a process standing for its container.
    async fn build(
        prefix: &str,
        overrides: bool,
        replicas: usize,
        extra: &[&str],
    ) -> Option<Setup> {
        let ns = TestNamespace::new(prefix, PodSecurity::Baseline).await?;
        install_crds(&ns.client).await;
        let agents = ProcAgents::default();
        let controller = start_controller_with(&ns.client, &ns.name, &agents, overrides, extra);
        // Only the two nodes with a (stand-in) agent.
        let deploy = deployment_on_nodes("web", replicas, &NODES);
        ns.api::<Deployment>()
            .create(&PostParams::default(), &deploy)
            .await
            .unwrap();
        let pods = wait_list(
            &ns.api::<Pod>(),
            "app=web",
            TIMEOUT,
            "web pod Running",
            |ps| ps.len() == replicas && ps.iter().all(pod_running_ready),
        )
        .await
        .unwrap();
        let pod = pods[0].clone();
        let dir = std::env::temp_dir().join(format!("pm-e2e-{}", ns.name));
        std::fs::create_dir_all(&dir).unwrap();
        for p in &pods {
            agents.add_container(&ns.name, &p.name_any(), &dir);
        }
        Some(Setup {
            ns,
            agents,
            controller,
            pod,
            pods,
            dir,
        })
    }

    fn key(&self) -> String {
        format!("{}/{}", self.ns.name, self.pod.name_any())
    }

    async fn migrate(&self, extra: serde_json::Value) -> Api<PodMigration> {
        self.migrate_named("move-web", &self.pod.name_any(), extra)
            .await
    }

    async fn migrate_named(
        &self,
        name: &str,
        pod: &str,
        extra: serde_json::Value,
    ) -> Api<PodMigration> {
        let mut spec =
            json!({"podName": pod, "freezeBudgetMillis": 5000, "progressTimeoutSeconds": 10});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let pm: PodMigration = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": name}, "spec": spec
        }));
        let api = self.ns.api::<PodMigration>();
        api.create(&PostParams::default(), &pm).await.unwrap();
        api
    }

    async fn wait_phase(&self, api: &Api<PodMigration>, want: MigrationPhase) -> PodMigration {
        self.wait_phase_named(api, "move-web", want).await
    }

    async fn wait_phase_named(
        &self,
        api: &Api<PodMigration>,
        name: &str,
        want: MigrationPhase,
    ) -> PodMigration {
        let got = wait_for(
            api,
            name,
            Duration::from_secs(90),
            &format!("phase {want:?}"),
            |m| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| s.phase == want)
            },
        )
        .await;
        match got {
            Ok(Some(m)) => m,
            _ => {
                let now = api.get_opt(name).await.ok().flatten();
                let status = now
                    .as_ref()
                    .map(|m| serde_json::to_string_pretty(&m.status).unwrap());
                panic!(
                    "PodMigration never reached {want:?}; status now: {}",
                    status.unwrap_or_default()
                );
            }
        }
    }

    /// The ReplicaSet still has its one replica, Ready.
    async fn replicaset_settled(&self) -> ReplicaSet {
        let list = self
            .ns
            .api::<ReplicaSet>()
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap();
        let name = list.items[0].name_any();
        wait_for(
            &self.ns.api::<ReplicaSet>(),
            &name,
            TIMEOUT,
            "ReplicaSet at 1 ready replica",
            |rs| {
                rs.and_then(|r| r.status.as_ref()).is_some_and(|s| {
                    s.replicas == 1
                        && s.ready_replicas == Some(1)
                        && s.fully_labeled_replicas == Some(1)
                })
            },
        )
        .await
        .unwrap()
        .unwrap()
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.controller.abort();
        if let Ok(mut w) = self.agents.0.lock() {
            w.containers.clear();
            w.restored.clear();
        }
        // A killed loop's last `mv` may still land: retry briefly.
        for _ in 0..10 {
            if std::fs::remove_dir_all(&self.dir).is_ok() || !self.dir.exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

// ------------------------------------------------------------------ tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_pod_runs_on_the_target_owned_by_its_replicaset_and_its_state_continued() {
    let Some(s) = Setup::new("mig-ok").await else {
        return;
    };
    let source_node = s.pod.spec.as_ref().unwrap().node_name.clone().unwrap();
    let api = s.migrate(json!({})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Succeeded).await;
    let st = pm.status.clone().unwrap();
    // What a user's pipeline runs: kubectl sees the committed migration as Ready.
    kubectl_wait(&s.ns.name, "podmigration/move-web", "Ready", TIMEOUT)
        .await
        .unwrap();

    // Target pod: on the other node, adopted by the same ReplicaSet, source labels on.
    let target_name = st.target_pod.clone().unwrap();
    let target_node = st.target_node.clone().unwrap();
    assert_ne!(target_node, source_node);
    let target = wait_for(
        &s.ns.api::<Pod>(),
        &target_name,
        TIMEOUT,
        "target adopted",
        |p| {
            p.is_some_and(|p| {
                p.owner_references()
                    .iter()
                    .any(|o| o.kind == "ReplicaSet" && o.controller == Some(true))
            })
        },
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(
        target.spec.as_ref().unwrap().node_name.as_deref(),
        Some(target_node.as_str())
    );
    assert_eq!(target.labels().get("app").map(String::as_str), Some("web"));
    assert!(
        target
            .owner_references()
            .iter()
            .all(|o| o.kind != "PodMigration")
    );

    // Source pod gone; the ReplicaSet kept its count and did not replace anything.
    wait_for(
        &s.ns.api::<Pod>(),
        &s.pod.name_any(),
        TIMEOUT,
        "source pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    let rs = s.replicaset_settled().await;
    assert_eq!(rs.spec.replicas, Some(1));
    let pods =
        s.ns.api::<Pod>()
            .list(&ListParams::default().labels("app=web"))
            .await
            .unwrap();
    assert_eq!(
        pods.items.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
        vec![target_name.clone()]
    );

    // The workload objects were never written by the operator.
    let deploy = s.ns.api::<Deployment>().get("web").await.unwrap();
    assert_eq!(deploy.metadata.generation, Some(1));
    for managed in [
        deploy.metadata.managed_fields.clone(),
        rs.metadata.managed_fields.clone(),
    ] {
        assert!(
            managed
                .unwrap_or_default()
                .iter()
                .all(|m| m.manager.as_deref() != Some("podmotion.io/migration-controller")),
            "the operator wrote a workload object"
        );
    }

    // Status: downtime measured, progress, conditions.
    assert!(st.downtime_millis.is_some_and(|d| d >= 0), "{st:?}");
    assert!(
        st.progress
            .as_ref()
            .is_some_and(|p| p.iteration >= 1 && p.bytes_sent > 0),
        "{st:?}"
    );
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    );

    // The process's state continued: the restored counter starts where the dump froze it.
    let uid = pm.uid().unwrap();
    let (checkpoint, restored_counter, source_left, copies) = {
        let mut w = s.agents.0.lock().unwrap();
        let cp = w.checkpoints[&uid];
        let restored = w.restored.get_mut(&uid).expect("restored process");
        assert!(restored.running(), "restored process not running");
        std::thread::sleep(Duration::from_millis(200));
        (
            cp,
            restored.counter(),
            w.containers.contains_key(&s.key()),
            w.max_copies,
        )
    };
    assert!(checkpoint > 0, "nothing checkpointed");
    assert!(
        restored_counter > checkpoint,
        "restored counter {restored_counter} did not continue from {checkpoint}"
    );
    assert!(!source_left, "the source process was not killed at commit");
    assert_eq!(copies, 1, "two running copies were seen");
    // An Event per phase, reason = condition reason.
    let events =
        s.ns.api::<k8s_openapi::api::events::v1::Event>()
            .list(&ListParams::default())
            .await
            .unwrap();
    let reasons_seen: Vec<String> = events
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("move-web"))
        .filter_map(|e| e.reason.clone())
        .collect();
    for want in [
        reasons::MIGRATABLE,
        reasons::CHECKPOINTING,
        reasons::TRANSFERRING,
        reasons::RESTORING,
        reasons::COMMITTING,
        reasons::SUCCEEDED,
    ] {
        assert!(
            reasons_seen.iter().any(|r| r == want),
            "no {want} Event; saw {reasons_seen:?}"
        );
    }
    // The transfer key went with the migration's end.
    let secrets = s.ns.api::<k8s_openapi::api::core::v1::Secret>();
    wait_for(
        &secrets,
        "move-web-transfer-key",
        TIMEOUT,
        "transfer key deleted",
        |x| x.is_none(),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_migration_mid_transfer_rolls_back_with_the_source_running() {
    let Some(s) = Setup::new("mig-del").await else {
        return;
    };
    s.agents.delay("Transfer", Duration::from_secs(4));
    let api = s.migrate(json!({"freezeBudgetMillis": 60000})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Transferring).await;
    assert!(
        !s.agents.source_running(&s.key()),
        "source not frozen during transfer"
    );
    let target_name = pm.status.as_ref().unwrap().target_pod.clone().unwrap();

    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &api,
        "move-web",
        TIMEOUT,
        "PodMigration gone (finalizer released)",
        |m| m.is_none(),
    )
    .await
    .unwrap();
    assert!(
        s.agents.source_running(&s.key()),
        "source left frozen after abort"
    );
    wait_for(
        &s.ns.api::<Pod>(),
        &target_name,
        TIMEOUT,
        "target pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    let src = s.ns.api::<Pod>().get_opt(&s.pod.name_any()).await.unwrap();
    assert!(
        src.is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
        "source pod touched"
    );
    s.replicaset_settled().await;
    assert!(s.agents.0.lock().unwrap().max_copies <= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_source_agent_mid_dump_fails_the_migration_with_the_source_running() {
    let Some(s) = Setup::new("mig-kill").await else {
        return;
    };
    s.agents.delay("Dump", Duration::from_secs(3));
    let api = s.migrate(json!({"mode": "Cold"})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Checkpointing).await;
    let uid = pm.uid().unwrap();
    let source_node = pm.status.as_ref().unwrap().source_node.clone().unwrap();
    // Wait until the dump is under way, then kill the agent; it comes back empty.
    tokio::time::timeout(TIMEOUT, async {
        while s.agents.last_step(&source_node, &uid) != Some((Step::Dump, StepState::Running)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("dump started");
    s.agents.kill_agent(&source_node);
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.agents.restart_agent(&source_node);

    let pm = s.wait_phase(&api, MigrationPhase::Failed).await;
    let st = pm.status.unwrap();
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(reasons::AGENT_ERROR),
        "{st:?}"
    );
    assert!(
        st.failure_message
            .as_deref()
            .unwrap_or("")
            .contains("source agent"),
        "{st:?}"
    );
    assert!(
        s.agents.source_running(&s.key()),
        "source not running after the agent died"
    );
    let target = st.target_pod.unwrap();
    wait_for(
        &s.ns.api::<Pod>(),
        &target,
        TIMEOUT,
        "target pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    s.replicaset_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_operator_mid_transfer_resumes_and_never_runs_two_copies() {
    let Some(mut s) = Setup::new("mig-restart").await else {
        return;
    };
    s.agents.delay("Transfer", Duration::from_secs(3));
    // The freeze spans the restart here; the budget must not be what ends it.
    let api = s.migrate(json!({"freezeBudgetMillis": 60000})).await;
    s.wait_phase(&api, MigrationPhase::Transferring).await;
    s.controller.abort();
    let _ = (&mut s.controller).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    s.controller = start_controller(&s.ns.client, &s.ns.name, &s.agents);
    s.wait_phase(&api, MigrationPhase::Succeeded).await;
    wait_for(
        &s.ns.api::<Pod>(),
        &s.pod.name_any(),
        TIMEOUT,
        "source pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    s.replicaset_settled().await;
    assert_eq!(
        s.agents.0.lock().unwrap().max_copies,
        1,
        "two running copies were seen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_checks_everything_and_freezes_nothing() {
    let Some(s) = Setup::new("mig-dry").await else {
        return;
    };
    let api = s.migrate(json!({"dryRun": true})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Succeeded).await;
    let st = pm.status.unwrap();
    let cond = |t: &str| {
        st.conditions
            .iter()
            .find(|c| c.type_ == t)
            .cloned()
            .unwrap()
    };
    assert_eq!(cond("Ready").reason, reasons::DRY_RUN_PASSED);
    assert_eq!(cond("Migratable").status, "True");
    assert!(
        st.target_pod.is_none() && st.downtime_millis.is_none(),
        "{st:?}"
    );
    assert!(
        s.agents.0.lock().unwrap().migs.is_empty(),
        "an agent was asked to do something"
    );
    assert!(s.agents.source_running(&s.key()));
    let pods =
        s.ns.api::<Pod>()
            .list(&ListParams::default())
            .await
            .unwrap();
    assert_eq!(pods.items.len(), 1, "a target pod was created");
    let secrets = s.ns.api::<k8s_openapi::api::core::v1::Secret>();
    assert!(
        secrets
            .get_opt("move-web-transfer-key")
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmigratable_pod_is_reported_stalled_and_its_migration_deletes_cleanly() {
    let Some(s) = Setup::new("mig-bad").await else {
        return;
    };
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-web"}, "spec": {"podName": "no-such-pod"}
    }));
    let api = s.ns.api::<PodMigration>();
    api.create(&PostParams::default(), &pm).await.unwrap();
    wait_for(
        &api,
        "move-web",
        TIMEOUT,
        "Stalled SourcePodNotFound",
        |m| {
            m.and_then(|m| m.status.as_ref()).is_some_and(|st| {
                st.phase == MigrationPhase::Pending
                    && st.conditions.iter().any(|c| {
                        c.type_ == "Stalled"
                            && c.status == "True"
                            && c.reason == reasons::SOURCE_POD_NOT_FOUND
                    })
                    && st
                        .conditions
                        .iter()
                        .any(|c| c.type_ == "Migratable" && c.status == "False")
            })
        },
    )
    .await
    .unwrap();
    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(&api, "move-web", TIMEOUT, "PodMigration gone", |m| {
        m.is_none()
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_found_through_their_ready_pods_on_each_node() {
    let Some(s) = Setup::new_with("mig-agents", false).await else {
        return;
    };
    let api = s.migrate(json!({"dryRun": true})).await;
    // No agent pods: not migratable, and a dry run says why.
    let pm = s.wait_phase(&api, MigrationPhase::Failed).await;
    assert_eq!(
        pm.status.unwrap().failure_reason.as_deref(),
        Some(reasons::NO_AGENT_ON_NODE)
    );
    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(&api, "move-web", TIMEOUT, "deleted", |m| m.is_none())
        .await
        .unwrap();

    // One Ready agent pod per node (what the agent DaemonSet provides), in the agents'
    // own namespace.
    let agents_ns = agents_namespace_of(&s.ns.name);
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(s.ns.client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &from_json(json!({"apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": agents_ns, "labels": {"podmotion.io/e2e": "true"}}})),
        )
        .await
        .unwrap();
    let agent_pods: Api<Pod> = Api::namespaced(s.ns.client.clone(), &agents_ns);
    for node in NODES {
        let agent: Pod = from_json(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("agent-{node}"), "labels": {"app.kubernetes.io/name": "podmotion-agent"}},
            "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "registry.example/agent:1"}]}
        }));
        // The namespace's default ServiceAccount may not exist yet: pods wait for it.
        let mut tries = 0;
        while let Err(e) = agent_pods.create(&PostParams::default(), &agent).await {
            tries += 1;
            assert!(tries < 60, "creating agent pod on {node}: {e}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    wait_list(
        &agent_pods,
        "app.kubernetes.io/name=podmotion-agent",
        TIMEOUT,
        "agents Ready",
        |ps| ps.len() == 2 && ps.iter().all(pod_running_ready),
    )
    .await
    .unwrap();
    let api = s.migrate(json!({"dryRun": true})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Succeeded).await;
    let st = pm.status.unwrap();
    assert!(
        st.conditions
            .iter()
            .any(|c| c.type_ == "Migratable" && c.status == "True"),
        "{st:?}"
    );
    let _ = namespaces
        .delete(&agents_ns, &DeleteParams::default())
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_over_the_parallel_limit_waits_queued_until_a_slot_frees() {
    let Some(s) = Setup::build("mig-queue", true, 2, &["--migration-max-parallel", "1"]).await
    else {
        return;
    };
    s.agents.delay("Transfer", Duration::from_secs(2));
    let (a, b) = (s.pods[0].name_any(), s.pods[1].name_any());
    let api = s
        .migrate_named("move-a", &a, json!({"freezeBudgetMillis": 60000}))
        .await;
    s.wait_phase_named(&api, "move-a", MigrationPhase::Transferring)
        .await;
    s.migrate_named("move-b", &b, json!({"freezeBudgetMillis": 60000}))
        .await;
    wait_for(&api, "move-b", TIMEOUT, "move-b Queued", |m| {
        m.and_then(|m| m.status.as_ref()).is_some_and(|st| {
            st.phase == MigrationPhase::Pending
                && st
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Reconciling" && c.reason == reasons::QUEUED)
        })
    })
    .await
    .unwrap();
    let done_a = s
        .wait_phase_named(&api, "move-a", MigrationPhase::Succeeded)
        .await;
    let done_b = s
        .wait_phase_named(&api, "move-b", MigrationPhase::Succeeded)
        .await;
    let at = |m: &PodMigration, p: MigrationPhase| {
        m.status
            .as_ref()
            .unwrap()
            .phase_transition_timestamps
            .iter()
            .find(|t| t.phase == p)
            .map(|t| t.time.0)
            .unwrap()
    };
    assert!(
        at(&done_b, MigrationPhase::Preparing) >= at(&done_a, MigrationPhase::Succeeded),
        "move-b started before move-a finished"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_probe_rolls_back_to_the_source_and_kills_the_restored_copy() {
    let Some(s) = Setup::new("mig-probe").await else {
        return;
    };
    s.agents.fail("Probe");
    let api = s.migrate(json!({})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Failed).await;
    let st = pm.status.clone().unwrap();
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(reasons::PROBE_FAILED),
        "{st:?}"
    );
    assert!(s.agents.source_running(&s.key()), "source not resumed");
    {
        let mut w = s.agents.0.lock().unwrap();
        let uid = pm.uid().unwrap();
        assert!(
            w.checkpoints.contains_key(&uid),
            "never got as far as the dump"
        );
        assert!(
            w.restored.get_mut(&uid).is_none_or(|p| !p.running()),
            "restored copy left running"
        );
        assert_eq!(w.max_copies, 1, "two running copies were seen");
    }
    let target = st.target_pod.unwrap();
    wait_for(
        &s.ns.api::<Pod>(),
        &target,
        TIMEOUT,
        "target pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    let src = s.ns.api::<Pod>().get(&s.pod.name_any()).await.unwrap();
    assert!(src.metadata.deletion_timestamp.is_none());
    assert!(
        !src.annotations()
            .contains_key("controller.kubernetes.io/pod-deletion-cost"),
        "the source was marked for removal before the probe passed"
    );
    s.replicaset_settled().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_past_its_deadline_is_aborted_with_the_source_running() {
    let Some(s) = Setup::new("mig-deadline").await else {
        return;
    };
    s.agents.delay("Transfer", Duration::from_secs(30));
    let spec =
        json!({"deadlineSeconds": 10, "progressTimeoutSeconds": 120, "freezeBudgetMillis": 600000});
    let api = s.migrate(spec).await;
    let pm = s.wait_phase(&api, MigrationPhase::Aborted).await;
    let st = pm.status.unwrap();
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(reasons::DEADLINE_EXCEEDED),
        "{st:?}"
    );
    assert!(
        st.phase_transition_timestamps
            .iter()
            .any(|t| t.phase == MigrationPhase::Transferring)
    );
    assert!(
        s.agents.source_running(&s.key()),
        "source not resumed after the deadline"
    );
    let target = st.target_pod.unwrap();
    wait_for(
        &s.ns.api::<Pod>(),
        &target,
        TIMEOUT,
        "target pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
}

/// The restore fence: once the target restored, deleting the PodMigration does not roll
/// back (which would thaw the source behind a copy that already ran on): the migration
/// commits, the source is killed, one copy runs, and only then is the finalizer released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_migration_after_the_target_restored_commits_and_never_thaws_the_source() {
    let Some(s) = Setup::new("mig-fence").await else {
        return;
    };
    s.agents.delay("Probe", Duration::from_secs(4));
    let api = s.migrate(json!({"freezeBudgetMillis": 60000})).await;
    let pm = s.wait_phase(&api, MigrationPhase::Restoring).await;
    let uid = pm.uid().unwrap();
    let target_node = pm.status.as_ref().unwrap().target_node.clone().unwrap();
    // The restore is done and the probe runs: the restored copy is the workload now.
    tokio::time::timeout(TIMEOUT, async {
        while s.agents.last_step(&target_node, &uid) != Some((Step::Probe, StepState::Running)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("probe started");
    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &api,
        "move-web",
        TIMEOUT,
        "PodMigration gone (finalizer released)",
        |m| m.is_none(),
    )
    .await
    .unwrap();
    assert!(
        !s.agents.source_running(&s.key()),
        "the source was thawed after the target restored"
    );
    {
        let mut w = s.agents.0.lock().unwrap();
        assert!(
            w.restored.get_mut(&uid).is_some_and(|p| p.running()),
            "the restored copy was killed"
        );
        assert_eq!(w.max_copies, 1, "two running copies were seen");
    }
    wait_for(
        &s.ns.api::<Pod>(),
        &s.pod.name_any(),
        TIMEOUT,
        "source pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    s.replicaset_settled().await;
}

/// A source agent whose thaw fails every time cannot hold a deletion forever: the
/// rollback ends at its bound (the progress timeout), the finalizer is released, and
/// the Event says the source's state is unknown and what may be left, never "resumed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_thaw_that_always_fails_still_releases_the_deletion_saying_the_state_is_unknown() {
    let Some(s) = Setup::new("mig-thaw-fails").await else {
        return;
    };
    s.agents.delay("Transfer", Duration::from_secs(30));
    let api = s
        .migrate(json!({"freezeBudgetMillis": 600000, "progressTimeoutSeconds": 5}))
        .await;
    let pm = s.wait_phase(&api, MigrationPhase::Transferring).await;
    let source_node = pm.status.as_ref().unwrap().source_node.clone().unwrap();
    s.agents.fail_on(&source_node, "Abort");
    api.delete("move-web", &DeleteParams::default())
        .await
        .unwrap();
    wait_for(
        &api,
        "move-web",
        TIMEOUT,
        "PodMigration gone (finalizer released)",
        |m| m.is_none(),
    )
    .await
    .unwrap();
    let events =
        s.ns.api::<k8s_openapi::api::events::v1::Event>()
            .list(&ListParams::default())
            .await
            .unwrap();
    let notes: Vec<String> = events
        .items
        .iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("move-web"))
        .filter(|e| e.reason.as_deref() == Some(reasons::ABORTED))
        .filter_map(|e| e.note.clone())
        .collect();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("source state unknown") && n.contains("may still be frozen")),
        "no Event saying what may be left; saw {notes:?}"
    );
    assert!(
        notes.iter().all(|n| !n.contains("was resumed")),
        "{notes:?}"
    );
}

/// Pods PodMotion must never move, each sent to the real API server as a user would
/// create it: the migration is refused before anything is frozen (Pending, `Stalled` and
/// `Migratable=False` with the class's reason), no target pod is made, and deleting the
/// migration leaves nothing. One case per class of the hostile corpus (issue 21): a
/// hostNetwork pod, a DaemonSet's pod, a native sidecar and two containers in PostCopy
/// (which moves one process tree; PreCopy and Cold move every container), an emptyDir,
/// a GPU (extended resource), and a target that only the pod's own scheduling rules
/// exclude. (kube-system: the next test.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_must_never_move_are_refused_with_their_reason_before_anything_freezes() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    let Some(ns) = TestNamespace::new("mig-never", PodSecurity::Privileged).await else {
        return;
    };
    install_crds(&ns.client).await;
    let agents = ProcAgents::default();
    let controller = start_controller(&ns.client, &ns.name, &agents);
    let container = |name: &str| json!({"name": name, "image": "registry.example/web:1"});
    let on_node0 = |name: &str, extra: serde_json::Value| -> Pod {
        let mut pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {"case": name}},
            "spec": {"nodeName": NODES[0], "containers": [container("app")]}
        });
        for (k, v) in extra.as_object().unwrap() {
            pod["spec"][k] = v.clone();
        }
        from_json(pod)
    };
    // (case, pod, what the migration asks for, the refusal's reason)
    let cases: Vec<(&str, Option<Pod>, serde_json::Value, &str)> = vec![
        (
            "host-net",
            Some(on_node0("host-net", json!({"hostNetwork": true}))),
            json!({}),
            reasons::HOST_NAMESPACES,
        ),
        ("daemon", None, json!({}), reasons::UNSUPPORTED_OWNER),
        (
            "sidecar",
            Some(on_node0(
                "sidecar",
                json!({"initContainers": [{"name": "mesh", "image": "registry.example/mesh:1", "restartPolicy": "Always"}]}),
            )),
            json!({"mode": "PostCopy"}),
            reasons::MULTIPLE_CONTAINERS,
        ),
        (
            "two",
            Some(on_node0(
                "two",
                json!({"containers": [container("app"), container("log-shipper")]}),
            )),
            json!({"mode": "PostCopy"}),
            reasons::MULTIPLE_CONTAINERS,
        ),
        (
            "scratch",
            Some(on_node0(
                "scratch",
                json!({"volumes": [{"name": "scratch", "emptyDir": {}}],
                       "containers": [{"name": "app", "image": "registry.example/web:1",
                                       "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}]}),
            )),
            json!({}),
            reasons::LOCAL_DATA,
        ),
        (
            "gpu",
            Some(on_node0(
                "gpu",
                json!({"containers": [{"name": "app", "image": "registry.example/web:1",
                                       "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}),
            )),
            json!({}),
            reasons::EXTENDED_RESOURCES,
        ),
        (
            "pinned",
            Some(on_node0(
                "pinned",
                json!({"nodeSelector": {"kubernetes.io/hostname": NODES[0]}}),
            )),
            json!({"targetNode": NODES[1]}),
            reasons::TARGET_DOES_NOT_FIT,
        ),
    ];
    // A DaemonSet's pod on node 0 (the DaemonSet controller makes it).
    let ds: DaemonSet = from_json(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "daemon"},
        "spec": {
            "selector": {"matchLabels": {"case": "daemon"}},
            "template": {
                "metadata": {"labels": {"case": "daemon"}},
                "spec": {"nodeSelector": {"kubernetes.io/hostname": NODES[0]},
                         "containers": [container("app")]}
            }
        }
    }));
    ns.api::<DaemonSet>()
        .create(&PostParams::default(), &ds)
        .await
        .unwrap();
    let pods = ns.api::<Pod>();
    for (_, pod, _, _) in &cases {
        if let Some(pod) = pod {
            pods.create(&PostParams::default(), pod).await.unwrap();
        }
    }
    let mut names = BTreeMap::new();
    for (case, _, _, _) in &cases {
        let ready = wait_list(&pods, &format!("case={case}"), TIMEOUT, case, |ps| {
            ps.len() == 1 && ps.iter().all(pod_running_ready)
        })
        .await
        .unwrap();
        names.insert(*case, ready[0].name_any());
    }
    let api = ns.api::<PodMigration>();
    for (case, _, extra, _) in &cases {
        let mut spec = json!({"podName": names[case]});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let pm: PodMigration = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": case}, "spec": spec
        }));
        api.create(&PostParams::default(), &pm).await.unwrap();
    }
    for (case, _, _, reason) in &cases {
        let refused = |m: Option<&PodMigration>| {
            m.and_then(|m| m.status.as_ref()).is_some_and(|st| {
                st.phase == MigrationPhase::Pending
                    && st
                        .conditions
                        .iter()
                        .any(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == *reason)
                    && st.conditions.iter().any(|c| {
                        c.type_ == "Migratable" && c.status == "False" && c.reason == *reason
                    })
            })
        };
        if wait_for(&api, case, TIMEOUT, reason, refused)
            .await
            .is_err()
        {
            let now = api.get_opt(case).await.ok().flatten();
            panic!(
                "{case}: not refused with {reason}; status now: {}",
                serde_json::to_string_pretty(&now.and_then(|m| m.status)).unwrap()
            );
        }
    }
    // Nothing was frozen or made: no target pod, and every source pod still Running.
    let all = pods.list(&ListParams::default()).await.unwrap().items;
    assert_eq!(
        all.len(),
        cases.len(),
        "{:?}",
        all.iter().map(|p| p.name_any()).collect::<Vec<_>>()
    );
    assert!(all.iter().all(pod_running_ready));
    for (case, _, _, _) in &cases {
        api.delete(case, &DeleteParams::default()).await.unwrap();
        wait_for(&api, case, TIMEOUT, "deleted", |m| m.is_none())
            .await
            .unwrap();
    }
    assert_eq!(agents.steps_started(), 0, "an agent was asked to act");
    controller.abort();
}

/// A pod in kube-system is never moved, even by a migration created there by an admin:
/// refused as ProtectedNamespace, nothing frozen. (The objects live in kube-system, not a
/// test namespace, so they are removed before any assertion can fail.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_in_kube_system_is_never_moved() {
    let Some(ns) = TestNamespace::new("mig-system", PodSecurity::Baseline).await else {
        return;
    };
    install_crds(&ns.client).await;
    let agents = ProcAgents::default();
    let controller = start_controller(&ns.client, "kube-system", &agents);
    let name = format!("pm-e2e-{}", ns.name);
    let pods = Api::<Pod>::namespaced(ns.client.clone(), "kube-system");
    let api = Api::<PodMigration>::namespaced(ns.client.clone(), "kube-system");
    let pod: Pod = from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"nodeName": NODES[0], "containers": [{"name": "app", "image": "registry.example/web:1"}]}
    }));
    pods.create(&PostParams::default(), &pod).await.unwrap();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": {"podName": name}
    }));
    let outcome = async {
        wait_for(&pods, &name, TIMEOUT, "Running", |p| {
            p.is_some_and(pod_running_ready)
        })
        .await?;
        api.create(&PostParams::default(), &pm).await?;
        wait_for(&api, &name, TIMEOUT, "refused", |m| {
            m.and_then(|m| m.status.as_ref()).is_some_and(|st| {
                st.phase == MigrationPhase::Pending
                    && st.conditions.iter().any(|c| {
                        c.type_ == "Migratable"
                            && c.status == "False"
                            && c.reason == reasons::PROTECTED_NAMESPACE
                    })
            })
        })
        .await
    }
    .await;
    let status = api
        .get_opt(&name)
        .await
        .ok()
        .flatten()
        .and_then(|m| m.status);
    // Clean up first (the controller still runs to release the finalizer).
    let _ = api.delete(&name, &DeleteParams::default()).await;
    let gone = wait_for(&api, &name, TIMEOUT, "deleted", |m| m.is_none()).await;
    let _ = pods
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await;
    controller.abort();
    assert!(
        outcome.is_ok(),
        "not refused as ProtectedNamespace: {outcome:?}; status: {}",
        serde_json::to_string_pretty(&status).unwrap()
    );
    gone.unwrap();
    assert_eq!(agents.steps_started(), 0, "an agent was asked to act");
}
