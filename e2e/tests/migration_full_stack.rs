//! Full stack: the PodMigration controller, on the real API server
//! (`hack/cluster.sh up`), drives the **real node agents** (`podmotion-agent` processes
//! with their netns brokers and CRIU) over gRPC and mutual TLS, for a kwok pod whose
//! container is a real process tree.
//!
//! What stands in for what: `podmotion_e2e::kwok_agents` (shared with the chaos run).
//! The two kwok nodes `pm-node-0` / `pm-node-1` are two agents on loopback, reached
//! through the controller's endpoint override; each agent takes images only from, and
//! streams only to, the other node's agent the controller names. The agents resolve
//! the controller's container IDs through the container table as they would over CRI.
//!
//! Needs root and CRIU (`hack/install-criu.sh`; PODMOTION_ROOT_TESTS=0 skips) and a
//! cluster (PODMOTION_E2E=0 skips).
//!
//! The agent binaries come from the workspace's target directory: `cargo test
//! --workspace` builds them; with `-p podmotion-e2e` alone, run `cargo build -p
//! podmotion-agent` first or the test runs whatever agent was built last.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_agent::testbed::{AGENT_NAMES, ask, root_tests_enabled};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::kwok_agents::{KwokAgents, container_id};
use podmotion_e2e::operator::install_crds;
use podmotion_e2e::{
    PodSecurity, TIMEOUT, TestNamespace, deployment_on_nodes, from_json, wait_for, wait_list,
};
use podmotion_operator::config::OperatorConfig;
use podmotion_operator::context::Context;
use podmotion_operator::controllers::migration::{MigrationConfig, run_configured};
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

const NODES: [&str; 2] = ["pm-node-0", "pm-node-1"];

/// The migration controller of this process, driving the agents over the wire.
fn start_controller(client: &Client, ns: &str, agents: &KwokAgents) -> JoinHandle<()> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        op: OperatorConfig,
        #[command(flatten)]
        mig: MigrationConfig,
    }
    // Not the workload's namespace: the pre-flight refuses every pod of the agents' one.
    let agents_ns = format!("{ns}-agents");
    let mut args: Vec<String> = [
        "podmotion-operator",
        "--no-leader-election",
        "--migration-namespace",
        ns,
        "--migration-agent-namespace",
        agents_ns.as_str(),
    ]
    .map(String::from)
    .to_vec();
    args.extend(agents.operator_args());
    let cli = Cli::try_parse_from(args).unwrap();
    let (tx, rx) = watch::channel(false);
    let ctx = Arc::new(Context::new(
        client.clone(),
        cli.op,
        Leadership::always(),
        Arc::new(Metrics::new()),
        rx,
    ));
    tokio::spawn(async move {
        let _keep = tx;
        run_configured(ctx, cli.mig).await.unwrap();
    })
}

/// The phase a PodMigration is in now (for failure messages).
async fn status_of(api: &Api<PodMigration>, name: &str) -> String {
    api.get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|m| m.status)
        .map(|s| serde_json::to_string_pretty(&s).unwrap())
        .unwrap_or_default()
}

/// One workload pod on a kwok node, the two real agents standing for the two agent
/// nodes, the workload's process tree, and the controller of this process.
struct FullStack {
    ns: TestNamespace,
    agents: KwokAgents,
    /// The source's node first.
    nodes: [&'static str; 2],
    source: Pod,
    /// Host pid of the root of the workload's process tree.
    workload: i32,
    controller: JoinHandle<()>,
}

impl FullStack {
    async fn new(prefix: &str) -> Option<FullStack> {
        if !root_tests_enabled() {
            return None;
        }
        let ns = TestNamespace::new(prefix, PodSecurity::Baseline).await?;
        install_crds(&ns.client).await;
        // The workload's pod: one replica on one of the two agent nodes.
        let deploy = deployment_on_nodes("web", 1, &NODES);
        ns.api::<Deployment>()
            .create(&PostParams::default(), &deploy)
            .await
            .unwrap();
        let pods = wait_list(
            &ns.api::<Pod>(),
            "app=web",
            TIMEOUT,
            "web pod with a container ID",
            |ps| ps.len() == 1 && container_id(&ps[0]).is_some(),
        )
        .await
        .unwrap();
        let source = pods[0].clone();
        // Agent 0 stands for the source's node, agent 1 for the other one.
        let source_node = source.spec.as_ref().unwrap().node_name.clone().unwrap();
        let nodes = if source_node == NODES[0] {
            NODES
        } else {
            [NODES[1], NODES[0]]
        };
        // Agent i's certificate identifies agent/<nodes[i]>: the node the controller
        // names as the peer of the other agent.
        let mut agents = KwokAgents::start(prefix.trim_start_matches("mig-"), nodes).unwrap();
        let workload = agents.tb.start_workload(16, 64).pid;
        agents
            .tb
            .register_container(&container_id(&source).unwrap(), workload);
        let controller = start_controller(&ns.client, &ns.name, &agents);
        Some(FullStack {
            ns,
            agents,
            nodes,
            source,
            workload,
            controller,
        })
    }

    /// The operator process dies and a new one starts (same flags and master key, no
    /// memory of the old one's calls).
    async fn restart_controller(&mut self) {
        self.controller.abort();
        let _ = (&mut self.controller).await;
        self.controller = start_controller(&self.ns.client, &self.ns.name, &self.agents);
    }

    /// The agent of `node` (0 = source) comes back on its port, empty.
    fn restart_agent(&mut self, node: usize) {
        self.agents.restart_agent(node);
    }

    /// Migrates the pod to the other node with `spec` (merged over the defaults) and
    /// waits for the end. Plays the runtime and the CNI for the target pod: once kwok
    /// runs it, its holder process starts, is registered under its container ID, and
    /// gets the pod address.
    async fn migrate(&mut self, spec: serde_json::Value) -> PodMigrationStatus {
        self.start_migration(spec).await;
        self.wait_end().await
    }

    /// Creates the PodMigration and plays runtime and CNI for its target pod.
    async fn start_migration(&mut self, spec: serde_json::Value) {
        let mut full = json!({"podName": self.source.name_any(), "targetNode": self.nodes[1],
            "tcpPreservation": "BestEffort", "progressTimeoutSeconds": 60, "deadlineSeconds": 240});
        for (k, v) in spec.as_object().unwrap() {
            full[k] = v.clone();
        }
        let pm: PodMigration = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "move-web"}, "spec": full
        }));
        let migrations = self.ns.api::<PodMigration>();
        migrations
            .create(&PostParams::default(), &pm)
            .await
            .unwrap();
        let target = wait_for(
            &migrations,
            "move-web",
            TIMEOUT,
            "a target pod named in status",
            |m| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| s.target_pod.is_some())
            },
        )
        .await
        .unwrap()
        .unwrap()
        .status
        .unwrap()
        .target_pod
        .unwrap();
        let target_pod = wait_for(
            &self.ns.api::<Pod>(),
            &target,
            TIMEOUT,
            "target pod with a container ID",
            |p| p.is_some_and(|p| container_id(p).is_some()),
        )
        .await
        .unwrap()
        .unwrap();
        self.agents.play_target(&container_id(&target_pod).unwrap());
    }

    async fn wait_phase(&self, want: MigrationPhase) {
        let migrations = self.ns.api::<PodMigration>();
        let got = wait_for(
            &migrations,
            "move-web",
            TIMEOUT,
            &format!("{want:?}"),
            |m| {
                m.and_then(|m| m.status.as_ref())
                    .is_some_and(|s| s.phase == want)
            },
        )
        .await;
        if got.is_err() {
            panic!(
                "never reached {want:?}; status: {}\n{}",
                status_of(&migrations, "move-web").await,
                self.logs()
            );
        }
    }

    /// Waits for the end of the migration; its final status.
    async fn wait_end(&self) -> PodMigrationStatus {
        let migrations = self.ns.api::<PodMigration>();
        let done = wait_for(
            &migrations,
            "move-web",
            Duration::from_secs(180),
            "Succeeded, Failed or Aborted",
            |m| {
                m.and_then(|m| m.status.as_ref()).is_some_and(|s| {
                    matches!(
                        s.phase,
                        MigrationPhase::Succeeded
                            | MigrationPhase::Failed
                            | MigrationPhase::Aborted
                    )
                })
            },
        )
        .await;
        match done {
            Ok(Some(pm)) => pm.status.unwrap(),
            _ => panic!(
                "the migration did not finish; status: {}\n{}",
                status_of(&migrations, "move-web").await,
                self.logs()
            ),
        }
    }

    fn logs(&self) -> String {
        self.agents.logs()
    }

    /// Cleanup zeroized and removed every checkpoint image on both nodes.
    async fn assert_no_images_left(&self) {
        for (node, name) in AGENT_NAMES.iter().enumerate() {
            let left = wait_until(Duration::from_secs(20), || {
                self.agents.tb.checkpoint_files(node).is_empty()
            })
            .await;
            assert!(
                left,
                "checkpoint images left on {name}: {:?}",
                self.agents.tb.checkpoint_files(node)
            );
        }
    }

    fn source_alive(&self) -> bool {
        std::fs::read_to_string(format!("/proc/{}/stat", self.workload))
            .is_ok_and(|s| !s.contains(") Z"))
    }

    /// After a committed migration: the source tree is gone (one copy), and once the
    /// pod address routes to the target the restored tree serves the client's old
    /// connection with the counter continued.
    fn assert_moved(&self, conn: &mut std::net::TcpStream, before: u64) {
        assert!(
            !self.source_alive(),
            "the source tree was not killed at commit"
        );
        self.agents.tb.route_to_target();
        let after: u64 = ask(conn, "get").unwrap().parse().unwrap();
        assert!(
            after >= before,
            "the counter ran backwards: {before} → {after}"
        );
    }

    /// The target pod of a rolled-back migration is deleted.
    async fn assert_target_gone(&self, st: &PodMigrationStatus) {
        let target = st.target_pod.clone().unwrap();
        wait_for(
            &self.ns.api::<Pod>(),
            &target,
            TIMEOUT,
            "target pod gone",
            |p| p.is_none(),
        )
        .await
        .unwrap();
    }

    /// The source tree runs (alive and not stopped) and serves on `conn`, counting on.
    async fn assert_source_serves(&self, conn: &mut std::net::TcpStream, before: u64) {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.workload)).unwrap_or_default();
        let state = stat.rsplit_once(") ").map(|(_, r)| &r[..1]);
        assert!(
            matches!(state, Some("S" | "R")),
            "the source is not running: {stat}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let after: u64 = ask(conn, "get").unwrap().parse().unwrap();
        assert!(
            after > before,
            "the source kept counting: {before} → {after}"
        );
        assert!(
            self.ns
                .api::<Pod>()
                .get_opt(&self.source.name_any())
                .await
                .unwrap()
                .is_some(),
            "the source pod stays"
        );
    }
}

impl Drop for FullStack {
    fn drop(&mut self) {
        self.controller.abort();
    }
}

/// Root tests share the machine's CRIU and cgroups: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The serial turn, a full stack, and a client's established connection to the pod
/// address with the workload's counter read over it; `None` where the test is skipped.
async fn start(
    prefix: &str,
) -> Option<(
    tokio::sync::MutexGuard<'static, ()>,
    FullStack,
    std::net::TcpStream,
    u64,
)> {
    let serial = SERIAL.lock().await;
    let fs = FullStack::new(prefix).await?;
    let mut conn = fs
        .agents
        .tb
        .connect_timeout(Duration::from_secs(5))
        .unwrap();
    let before: u64 = ask(&mut conn, "get").unwrap().parse().unwrap();
    Some((serial, fs, conn, before))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_migrates_a_real_process_tree_through_the_real_agents() {
    // A client with an established connection to the pod address, before the move.
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fs").await else {
        return;
    };

    let st = fs
        .migrate(json!({"mode": "Cold", "freezeBudgetMillis": 30000}))
        .await;
    assert_eq!(
        st.phase,
        MigrationPhase::Succeeded,
        "{st:#?}\n{}",
        fs.logs()
    );
    // The process state continued over the preserved connection, now served by the
    // restored tree on the target; the source tree was killed at commit.
    fs.assert_moved(&mut conn, before);
    let network = st.network.clone().expect("network outcome in status");
    assert_eq!(network.connections_preserved, 1, "{network:?}");
    assert_eq!(network.listeners_restored, 1, "{network:?}");
    assert!(
        st.downtime_millis.is_some_and(|d| d > 0),
        "downtime recorded: {:?}",
        st.downtime_millis
    );
    assert!(st.progress.as_ref().is_some_and(|p| p.bytes_sent > 0));

    // The source pod is gone; the target pod is on the target node and owned by the
    // ReplicaSet, which still has one replica.
    let ns = &fs.ns;
    wait_for(
        &ns.api::<Pod>(),
        &fs.source.name_any(),
        TIMEOUT,
        "source pod gone",
        |p| p.is_none(),
    )
    .await
    .unwrap();
    let target = st.target_pod.clone().unwrap();
    let moved = ns.api::<Pod>().get(&target).await.unwrap();
    assert_eq!(
        moved.spec.as_ref().unwrap().node_name.as_deref(),
        Some(fs.nodes[1])
    );
    let owner = moved
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .map(|o| o.kind.clone());
    assert_eq!(owner.as_deref(), Some("ReplicaSet"));
    let rs = ns
        .api::<ReplicaSet>()
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(
        rs.items[0].spec.replicas,
        Some(1),
        "the workload is never mutated"
    );
    fs.assert_no_images_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_copy_streams_rounds_while_the_pod_runs_and_freezes_within_budget() {
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fspc").await else {
        return;
    };
    // 16 MiB of ballast dirtied at 64 KiB/s: the first round moves it all and measures
    // the link, the next moves only what changed, which fits a generous budget.
    let st = fs
        .migrate(json!({"mode": "PreCopy", "freezeBudgetMillis": 20000,
                        "preCopy": {"maxRounds": 5, "dirtyThresholdBytes": 0}}))
        .await;
    assert_eq!(
        st.phase,
        MigrationPhase::Succeeded,
        "{st:#?}\n{}",
        fs.logs()
    );
    let progress = st.progress.clone().unwrap();
    assert!(progress.iteration >= 1, "{progress:?}");
    assert!(
        progress
            .transfer_rate_bytes_per_second
            .is_some_and(|r| r > 0),
        "a rate measured before the freeze: {progress:?}"
    );
    assert!(
        progress.bytes_sent > 16 << 20,
        "the warm copy crossed the wire: {progress:?}"
    );
    fs.assert_moved(&mut conn, before);
    fs.assert_no_images_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_freeze_that_cannot_fit_the_budget_aborts_before_freezing_and_the_source_runs_on() {
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fsbx").await else {
        return;
    };
    // 10 ms cannot hold even the final dump of 16 MiB.
    let st = fs
        .migrate(json!({"mode": "PreCopy", "freezeBudgetMillis": 10,
                        "preCopy": {"maxRounds": 2, "dirtyThresholdBytes": 0}}))
        .await;
    assert_eq!(st.phase, MigrationPhase::Aborted, "{st:#?}\n{}", fs.logs());
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(podmotion_api::names::reasons::FREEZE_BUDGET_EXCEEDED),
        "{st:#?}"
    );
    assert!(st.downtime_millis.is_none(), "never frozen: {st:#?}");
    // Both rounds streamed while the pod ran; the second moved only what changed.
    let progress = st.progress.clone().unwrap();
    assert_eq!(progress.iteration, 2, "{progress:?}");
    let dirty = progress.bytes_remaining_estimate.unwrap();
    assert!(
        dirty < 4 << 20,
        "the second round streams the dirty set, not the 16 MiB again: {progress:?}"
    );
    assert!(progress.bytes_sent < 24 << 20, "{progress:?}");
    // The source was never frozen: it serves on the same connection, counting on.
    fs.assert_source_serves(&mut conn, before).await;
    fs.assert_target_gone(&st).await;
    fs.assert_no_images_left().await;
}

/// A transfer slow enough to act in the middle of: 16 MiB at 2 MiB/s.
fn slow_cold() -> serde_json::Value {
    json!({"mode": "Cold", "freezeBudgetMillis": 120000,
           "bandwidthLimitBytesPerSecond": 2 << 20})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_migration_mid_transfer_rolls_back_to_the_running_source() {
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fsdel").await else {
        return;
    };
    fs.start_migration(slow_cold()).await;
    fs.wait_phase(MigrationPhase::Transferring).await;
    let migrations = fs.ns.api::<PodMigration>();
    let st = migrations.get("move-web").await.unwrap().status.unwrap();
    migrations
        .delete("move-web", &Default::default())
        .await
        .unwrap();
    wait_for(
        &migrations,
        "move-web",
        Duration::from_secs(120),
        "PodMigration gone after rollback",
        |m| m.is_none(),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", fs.logs()));
    // Frozen for the dump, thawed by the rollback: the same connection works again.
    fs.assert_source_serves(&mut conn, before).await;
    fs.assert_target_gone(&st).await;
    fs.assert_no_images_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_source_agent_mid_transfer_fails_the_migration_and_the_source_runs_on() {
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fskill").await else {
        return;
    };
    let mut spec = slow_cold();
    spec["progressTimeoutSeconds"] = json!(10);
    fs.start_migration(spec).await;
    fs.wait_phase(MigrationPhase::Transferring).await;
    // The agent dies with the source frozen; its broker's lease rolls the source back.
    fs.agents.tb.kill_agent(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    fs.restart_agent(0);
    let st = fs.wait_end().await;
    assert_eq!(st.phase, MigrationPhase::Failed, "{st:#?}\n{}", fs.logs());
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(podmotion_api::names::reasons::AGENT_ERROR),
        "{st:#?}"
    );
    assert!(
        st.failure_message
            .as_deref()
            .unwrap_or("")
            .contains("source agent"),
        "{st:#?}"
    );
    fs.assert_source_serves(&mut conn, before).await;
    fs.assert_target_gone(&st).await;
    fs.assert_no_images_left().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_the_operator_mid_transfer_resumes_with_one_copy_running() {
    let Some((_serial, mut fs, mut conn, before)) = start("mig-fsrst").await else {
        return;
    };
    fs.start_migration(slow_cold()).await;
    fs.wait_phase(MigrationPhase::Transferring).await;
    fs.restart_controller().await;
    let st = fs.wait_end().await;
    assert_eq!(
        st.phase,
        MigrationPhase::Succeeded,
        "{st:#?}\n{}",
        fs.logs()
    );
    // One copy: the source tree is gone, the restored one serves the old connection.
    fs.assert_moved(&mut conn, before);
    fs.assert_no_images_left().await;
}

async fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f()
}
