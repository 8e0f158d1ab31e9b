//! The chaos run (issue 21; not a test, a binary like the benchmarks).
//!
//!     hack/cluster.sh up
//!     cargo build -p podmotion-operator -p podmotion-agent -p podmotion-e2e --bin chaos
//!       (podmotion-agent: the agent and testload binaries of the live migrations)
//!     $CARGO_TARGET_DIR/debug/chaos                  # short: ~90 s of faults (CI)
//!     $CARGO_TARGET_DIR/debug/chaos --long --api-restart
//!
//! Two replicas of the real `podmotion-operator` binary (built next to this one) run
//! with leader election on (their own Lease, 4 s) in a namespace of their own, scoped
//! to an application namespace of their own. They reach the API server only through
//! the fault-injecting proxy of `podmotion_e2e::chaos`, which answers a share of their
//! writes with 409 or 429. Meanwhile:
//!
//! * the current leader (the Lease's holder) is SIGKILLed every few seconds (short) or
//!   every 10–30 s (long, as Knative's chaosduck), and a new replica started in its
//!   place; a replica that exits by itself is restarted too (and counted);
//! * with `--api-restart`, the API server is restarted once halfway
//!   (`hack/cluster.sh restart-component kube-apiserver`);
//! * the three kinds churn on the kwok nodes: Deployments with NodeAgentAttachments
//!   scale between 0 and 3 replicas and one attachment is deleted and recreated,
//!   RunnerPools change `sessionsPerNode`, dry-run PodMigrations are created and
//!   deleted (some before they finish: abort by deletion);
//! * live migrations (unless `--no-live-migrations`; they need root and CRIU): the one
//!   pod of the Deployment `live` on `pm-node-0`/`pm-node-1` is a real process (the
//!   testload server, a counter), and the two nodes' agents are real `podmotion-agent`
//!   processes with their brokers (`podmotion_e2e::kwok_agents`, shared with
//!   `tests/migration_full_stack.rs`), which the replicas reach through the endpoint
//!   override. One PodMigration after another moves the process to the other node
//!   (Cold, CRIU dump, transfer, restore), a third of them deleted at a random moment
//!   in flight (abort and roll back, or finish when past the commit). Before the
//!   faults start, one live migration without faults (`live-0`: no kill, nothing
//!   injected, not deleted) must move the process, or the run fails: a run whose
//!   migrations all roll back under the faults would otherwise prove the rollback
//!   and never the commit. The summary counts the migrations under faults that
//!   committed and that rolled back (deleted in flight, or failed).
//!
//! Each replica logs to `<run dir>/<identity>.log` with every reconcile's start and end
//! and every pause of its watches (`PODMOTION_CHAOS_RUST_LOG` replaces that filter); a
//! convergence violation prints the tail of those lines for each replica.
//!
//! Invariants, sampled every 2 s during the run: no two live agent Jobs for one target
//! pod; at most one DaemonSet, NetworkPolicy and Secret of each kind per RunnerPool; the
//! migrated workload's pods are exactly the ones it started with, all Running, and no
//! migration target pod exists (dry runs touch nothing); every deleted PodMotion object
//! is gone within 60 s of its deletion (no wedged finalizer); the live workload's
//! processes, sampled every 100 ms, are never two running copies and never none (a
//! frozen source next to its restored copy is one running copy). After each live
//! migration: exactly one copy runs, in the pod Kubernetes kept (the source after a
//! rollback, the target after a commit); its counter, read over the client connection
//! opened before the migration (or a new one), did not run backwards and advances;
//! no checkpoint image is left on either node within 60 s. After the last fault:
//! convergence within 60 s — every object's status observes its generation and is
//! Ready/settled, exactly the expected children exist per owner (one agent Job with its
//! Secret per ready pod of an attached workload, the deny-ingress NetworkPolicy; the
//! DaemonSet, NetworkPolicy and credential Secret of each RunnerPool) and none else
//! (orphans), and the live migration in flight then has ended. Then every PodMotion object is deleted with the operators still running,
//! and must be gone within 60 s. Prints a summary table; exits 1 on any violation, 2 if
//! the run could not be set up.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_agent::testbed::ask;
use podmotion_api::conditions::is_true;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{condition_types as ct, labels};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_e2e::chaos::{Rng, start_proxy};
use podmotion_e2e::kwok_agents::{KwokAgents, PodSide, WorkloadMarker, container_id};
use podmotion_e2e::{
    TIMEOUT, connect, from_json, pod_running_ready, random_suffix, restricted_container, wait_list,
};
use serde_json::json;
use tokio::sync::watch;

/// Everything must settle within this long after the last fault, and every deleted
/// object be gone within this long after its deletion.
const CONVERGENCE: Duration = Duration::from_secs(60);
/// The replicas' log filter (`PODMOTION_CHAOS_RUST_LOG` replaces it): every reconcile's
/// start and end, and every pause of a controller's watches, besides the usual.
const REPLICA_LOG: &str = "info,kube=warn,kube_runtime::utils::stream_backoff=debug,podmotion_operator::controllers::shell=debug";
/// How often the invariants are sampled during the run.
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// The replicas' Lease duration (renewed every third of it).
const LEASE_SECONDS: u32 = 4;
const ATTACHED: [&str; 2] = ["attach-a", "attach-b"];
const POOLS: [&str; 2] = ["pool-a", "pool-b"];
const MIG_NODES: [&str; 2] = ["pm-node-0", "pm-node-1"];
const AGENT_POLICY: &str = "podmotion-node-agent-deny-ingress";
/// The Deployment whose one pod's process the live migrations move.
const LIVE: &str = "live";
/// The live workload's memory, and the transfer rate its migrations are held to (a
/// few seconds in flight: deletions land in every phase).
const LIVE_BALLAST_MIB: usize = 8;
const LIVE_BANDWIDTH: u64 = 4 << 20;
/// How often the live workload's processes are sampled.
const LIVE_SAMPLE_EVERY: Duration = Duration::from_millis(100);

struct Opts {
    long: bool,
    duration: Duration,
    /// Seconds between leader kills; `None`: no kills (`--no-leader-kills`).
    kill_every: Option<(u64, u64)>,
    share_per_mille: u32,
    api_restart: bool,
    plant_violation: bool,
    /// Migrate a live process between two kwok nodes through process-level agents.
    live: bool,
    seed: u64,
}

fn usage() -> &'static str {
    "usage: chaos [--long] [--duration SECONDS] [--write-fault-share PER_MILLE] [--api-restart] [--seed N]\n\
     short (default): 90 s of faults, leader killed every 4-8 s; --long: 600 s, every 10-30 s.\n\
     --write-fault-share: per mille of the operators' writes answered 409/429 (default 200).\n\
     --no-leader-kills: never kill the leader (with --write-fault-share 0: a run without faults).\n\
     --api-restart: restart the API server once halfway (hack/cluster.sh restart-component).\n\
     --plant-violation: negative control: plant a second DaemonSet of a RunnerPool; the run must fail.\n\
     --no-live-migrations: skip the PodMigrations that move a live process through process-level\n\
     agents on two kwok nodes (they need root and CRIU; PODMOTION_ROOT_TESTS=0 skips them too)."
}

fn parse_opts() -> anyhow::Result<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let long = args.iter().any(|a| a == "--long");
    let mut o = Opts {
        long,
        duration: Duration::from_secs(if long { 600 } else { 90 }),
        kill_every: Some(if long { (10, 30) } else { (4, 8) }),
        share_per_mille: 200,
        api_restart: false,
        plant_violation: false,
        live: {
            let skip = std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0");
            if skip {
                podmotion_e2e::refuse_skip_under_ci("PODMOTION_ROOT_TESTS");
            }
            !skip
        },
        seed: u64::from_str_radix(&random_suffix(), 16).unwrap_or(1),
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value\n{}", usage()))
        };
        match a.as_str() {
            "--long" => {}
            "--api-restart" => o.api_restart = true,
            "--plant-violation" => o.plant_violation = true,
            "--no-live-migrations" => o.live = false,
            "--no-leader-kills" => o.kill_every = None,
            "--duration" => {
                let v = value(a)?;
                let s: u64 = v
                    .parse()
                    .with_context(|| format!("--duration {v:?}: not a number of seconds"))?;
                anyhow::ensure!(s >= 10, "--duration must be at least 10 s");
                o.duration = Duration::from_secs(s);
            }
            "--write-fault-share" => {
                let v = value(a)?;
                o.share_per_mille = v.parse().ok().filter(|s| *s <= 1000).with_context(|| {
                    format!("--write-fault-share {v:?}: a per mille value 0..=1000")
                })?;
            }
            "--seed" => {
                let v = value(a)?;
                o.seed = v
                    .parse()
                    .with_context(|| format!("--seed {v:?}: not a number"))?;
            }
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{}", usage()),
        }
    }
    Ok(o)
}

/// Counters and findings shared by the run's tasks.
#[derive(Default)]
struct Tally {
    leader_kills: u64,
    kill_rounds_without_leader: u64,
    self_exits: Vec<String>,
    replica_starts: u64,
    api_restarts: u64,
    api_restart_secs: Vec<f64>,
    failovers: Vec<f64>,
    checks: u64,
    sample_rounds: u64,
    sample_rounds_skipped: u64,
    /// Each distinct violation and how many times it was seen.
    violations: BTreeMap<String, u64>,
    churn: BTreeMap<&'static str, u64>,
    driver_errors: u64,
    deleted: Vec<Deleted>,
    deletion_secs: Vec<f64>,
    /// Migration children seen by the sampler (target pods, transfer keys).
    seen_migration_children: BTreeSet<String>,
    /// Live migrations (a process moved by the process-level agents), by outcome.
    live_outcomes: BTreeMap<String, u64>,
    /// Live migrations under faults that moved the process, that rolled back after
    /// the run deleted them in flight, and that rolled back by themselves (failed).
    live_committed: u64,
    live_rolled_back_deleted: u64,
    live_rolled_back_failed: u64,
    /// How the live migration without faults (before them) ended.
    live_control: Option<String>,
    /// Live migrations deleted before they ended, by the phase they were deleted in.
    live_deleted_in: BTreeMap<String, u64>,
    /// Samples of the live workload's processes (exactly one copy, at most one running).
    live_process_samples: u64,
    /// Per-round checks of the live workload (one copy, where its pod is; counter
    /// monotonic and advancing; no checkpoint image left).
    live_round_checks: u64,
    /// Client connections the live workload still served after a round / reconnects.
    live_conn_kept: u64,
    live_conn_reopened: u64,
    /// From the last fault to the end of the live migration in flight then.
    live_settle_secs: Option<f64>,
}

/// A PodMotion object whose deletion the run requested.
struct Deleted {
    kind: &'static str,
    name: String,
    uid: String,
    at: Instant,
    gone: bool,
    reported: bool,
}

type Shared = Arc<Mutex<Tally>>;

fn violation(t: &Shared, v: String) {
    let mut t = t.lock().unwrap();
    let seen = t.violations.entry(v.clone()).or_default();
    if *seen == 0 {
        eprintln!("[chaos] VIOLATION: {v}");
    }
    *seen += 1;
}

/// The run's namespaces and names.
#[derive(Clone)]
struct Names {
    sys: String,
    app: String,
    lease: String,
    dir: PathBuf,
}

// ------------------------------------------------------------------ objects

fn deployment(name: &str, replicas: i32, nodes: Option<&[&str]>) -> Deployment {
    let mut container = restricted_container("app");
    container["ports"] = json!([{"containerPort": 8080, "name": "http"}]);
    let placement = match nodes {
        Some(nodes) => json!({"nodeSelector": {"type": "kwok"}, "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}]}}}}),
        None => json!({"nodeSelector": {"type": "kwok"}, "tolerations": [{"operator": "Exists"}]}),
    };
    let mut spec = json!({"containers": [container]});
    for (k, v) in placement.as_object().unwrap() {
        spec[k] = v.clone();
    }
    from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": spec}}
    }))
}

fn attachment(name: &str) -> NodeAgentAttachment {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": name},
        "spec": {"workloadRef": {"kind": "Deployment", "name": name}, "mode": "Intercept"}
    }))
}

fn pool(app: &str, name: &str, sessions: i32) -> RunnerPool {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "RunnerPool",
        "metadata": {"name": name},
        "spec": {
            "image": "registry.example/compass/runner@sha256:4f1c3a2b5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708",
            "sessionsPerNode": sessions,
            "session": {"memoryMiB": 512, "milliCPU": 250},
            "server": {"serviceName": "compass-server", "port": 8443},
            "priorityClass": {"name": format!("{app}-{name}"), "value": 100000},
        }
    }))
}

/// A PodMigration of `pod`: a dry run, or a real one whose agents are unreachable
/// (it prepares a target pod and a transfer key, fails at the agent and rolls back).
fn migration(name: &str, pod: &str, dry_run: bool) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod, "dryRun": dry_run, "progressTimeoutSeconds": 10}
    }))
}

async fn create_namespace(client: &Client, name: &str) -> anyhow::Result<()> {
    let ns: Namespace = from_json(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": {
            "podmotion.io/e2e": "chaos",
            "pod-security.kubernetes.io/enforce": "privileged",
        }}
    }));
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

async fn setup(client: &Client, n: &Names, live: bool) -> anyhow::Result<Vec<Pod>> {
    podmotion_e2e::operator::install_crds(client).await;
    create_namespace(client, &n.sys).await?;
    create_namespace(client, &n.app).await?;
    let pp = PostParams::default();
    let svc: Service = from_json(json!({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "compass-server"},
        "spec": {"selector": {"app": "compass-server"}, "ports": [{"name": "grpc", "port": 8443, "targetPort": 9443}]}
    }));
    Api::<Service>::namespaced(client.clone(), &n.app)
        .create(&pp, &svc)
        .await?;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), &n.app);
    for d in ATTACHED {
        deps.create(&pp, &deployment(d, 2, None)).await?;
        Api::<NodeAgentAttachment>::namespaced(client.clone(), &n.app)
            .create(&pp, &attachment(d))
            .await?;
    }
    deps.create(&pp, &deployment("mig", 2, Some(&MIG_NODES)))
        .await?;
    if live {
        deps.create(&pp, &deployment(LIVE, 1, Some(&MIG_NODES)))
            .await?;
    }
    for p in POOLS {
        Api::<RunnerPool>::namespaced(client.clone(), &n.app)
            .create(&pp, &pool(&n.app, p, 2))
            .await?;
    }
    wait_list(
        &Api::<Pod>::namespaced(client.clone(), &n.app),
        "app=mig",
        TIMEOUT,
        "the migrated workload's 2 pods Running",
        |ps| ps.len() == 2 && ps.iter().all(pod_running_ready),
    )
    .await
}

// ------------------------------------------------------------------ replicas

struct Replica {
    identity: String,
    child: tokio::process::Child,
}

struct Replicas {
    bin: PathBuf,
    names: Names,
    kubeconfig: PathBuf,
    /// The migration agents' flags (endpoints, TLS, master key) of the live agents;
    /// empty: MIG_NODES' agents are unreachable.
    agent_args: Vec<String>,
    slots: Vec<Replica>,
    generation: u64,
}

impl Replicas {
    fn spawn(&mut self, slot: usize) -> anyhow::Result<Replica> {
        self.generation += 1;
        let n = &self.names;
        let identity = format!("chaos-{slot}-{}", self.generation);
        let log = std::fs::File::create(n.dir.join(format!("{identity}.log")))?;
        let agent_args = if self.agent_args.is_empty() {
            let endpoints = MIG_NODES
                .iter()
                .map(|node| format!("{node}=https://127.0.0.1:9"))
                .collect::<Vec<_>>()
                .join(",");
            vec!["--migration-agent-endpoint".to_string(), endpoints]
        } else {
            self.agent_args.clone()
        };
        let child = tokio::process::Command::new(&self.bin)
            .args(["--namespace", &n.sys, "--identity", &identity])
            .args(["--controllers", "migration,attachment,runner-pool"])
            .args(["--http-addr", "127.0.0.1:0"])
            .args(["--leader-lease-name", &n.lease])
            .args(["--leader-lease-seconds", &LEASE_SECONDS.to_string()])
            .args(["--attachment-watch-namespace", &n.app])
            .args(["--attachment-sweep-seconds", "5"])
            .args(["--migration-namespace", &n.app])
            .args(["--migration-agent-namespace", &n.sys])
            .args(&agent_args)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("PODMOTION_RUNNER_POOL_NAMESPACE", &n.app)
            .env(
                "PODMOTION_PREFLIGHT_IMAGE",
                "registry.example/podmotion/preflight:chaos",
            )
            .env(
                "RUST_LOG",
                std::env::var("PODMOTION_CHAOS_RUST_LOG").unwrap_or(REPLICA_LOG.into()),
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        Ok(Replica { identity, child })
    }

    fn identities(&self) -> Vec<String> {
        self.slots.iter().map(|r| r.identity.clone()).collect()
    }
}

fn operator_bin() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let bin = me
        .parent()
        .context("the binary has no directory")?
        .join("podmotion-operator");
    anyhow::ensure!(
        bin.exists(),
        "{} missing: cargo build -p podmotion-operator (same profile as this binary)",
        bin.display()
    );
    Ok(bin)
}

async fn lease_holder(client: &Client, n: &Names) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), &n.sys)
        .get_opt(&n.lease)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Chaos,
    Settle,
    Stop,
}

/// Keeps two replicas running; in `Chaos`, SIGKILLs the leader every `kill_every` s.
async fn run_replicas(
    mut r: Replicas,
    client: Client,
    tally: Shared,
    mut phase: watch::Receiver<Phase>,
    kill_every: Option<(u64, u64)>,
    seed: u64,
    ids: Arc<Mutex<Vec<String>>>,
) {
    let mut rng = Rng::new(seed ^ 0x6b69_6c6c);
    let (kills, kill_every) = (kill_every.is_some(), kill_every.unwrap_or((1, 1)));
    let mut next_kill = Instant::now() + Duration::from_secs(rng.range(kill_every.0, kill_every.1));
    let mut killed_at: Option<(Instant, String)> = None;
    loop {
        let now_phase = *phase.borrow_and_update();
        if now_phase == Phase::Stop {
            for mut rep in r.slots.drain(..) {
                let _ = rep.child.kill().await;
            }
            return;
        }
        // Replicas that exited by themselves are counted and replaced.
        for slot in 0..r.slots.len() {
            if let Ok(Some(status)) = r.slots[slot].child.try_wait() {
                let who = r.slots[slot].identity.clone();
                let last = std::fs::read_to_string(r.names.dir.join(format!("{who}.log")))
                    .ok()
                    .and_then(|s| s.lines().last().map(str::to_string))
                    .unwrap_or_default();
                eprintln!("[chaos] replica {who} exited by itself ({status}): {last}");
                tally
                    .lock()
                    .unwrap()
                    .self_exits
                    .push(format!("{who} ({status}): {last}"));
                match r.spawn(slot) {
                    Ok(rep) => {
                        r.slots[slot] = rep;
                        *ids.lock().unwrap() = r.identities();
                        tally.lock().unwrap().replica_starts += 1;
                    }
                    Err(e) => violation(&tally, format!("could not restart a replica: {e:#}")),
                }
            }
        }
        let holder = lease_holder(&client, &r.names).await;
        if let (Some((at, old)), Some(h)) = (&killed_at, &holder)
            && h != old
            && r.identities().contains(h)
        {
            tally
                .lock()
                .unwrap()
                .failovers
                .push(at.elapsed().as_secs_f64());
            killed_at = None;
        }
        if kills && now_phase == Phase::Chaos && Instant::now() >= next_kill {
            next_kill = Instant::now() + Duration::from_secs(rng.range(kill_every.0, kill_every.1));
            match holder
                .as_ref()
                .and_then(|h| r.slots.iter().position(|rep| &rep.identity == h))
            {
                Some(slot) => {
                    let who = r.slots[slot].identity.clone();
                    let _ = r.slots[slot].child.start_kill(); // SIGKILL
                    let _ = r.slots[slot].child.wait().await;
                    eprintln!("[chaos] SIGKILLed the leader {who}");
                    killed_at = Some((Instant::now(), who));
                    {
                        let mut t = tally.lock().unwrap();
                        t.leader_kills += 1;
                    }
                    match r.spawn(slot) {
                        Ok(rep) => {
                            r.slots[slot] = rep;
                            *ids.lock().unwrap() = r.identities();
                            tally.lock().unwrap().replica_starts += 1;
                        }
                        Err(e) => violation(&tally, format!("could not restart a replica: {e:#}")),
                    }
                }
                None => {
                    // The lease is still held by a replica killed before (not yet
                    // expired) or the API server is away: try again shortly.
                    tally.lock().unwrap().kill_rounds_without_leader += 1;
                    next_kill = Instant::now() + Duration::from_secs(1);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = phase.changed() => {}
        }
    }
}

// ------------------------------------------------------------------ churn

async fn churn(
    client: Client,
    n: Names,
    mig_pods: Vec<String>,
    dry_only: bool,
    tally: Shared,
    seed: u64,
    mut phase: watch::Receiver<Phase>,
) {
    let mut rng = Rng::new(seed ^ 0x6368_7572);
    let mut live_migrations: Vec<(String, String)> = Vec::new();
    let mut counter = 0u64;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), &n.app);
    let pools: Api<RunnerPool> = Api::namespaced(client.clone(), &n.app);
    let migs: Api<PodMigration> = Api::namespaced(client.clone(), &n.app);
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), &n.app);
    let pp = PatchParams::default();
    while *phase.borrow_and_update() == Phase::Chaos {
        let roll = rng.range(0, 99);
        let res: anyhow::Result<&'static str> = async {
            Ok(match roll {
                0..=29 => {
                    let d = ATTACHED[rng.range(0, 1) as usize];
                    let replicas = rng.range(0, 3);
                    deps.patch(
                        d,
                        &pp,
                        &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                    )
                    .await?;
                    "Deployment scaled"
                }
                30..=49 => {
                    let p = POOLS[rng.range(0, 1) as usize];
                    let s = rng.range(1, 4);
                    pools
                        .patch(
                            p,
                            &pp,
                            &Patch::Merge(json!({"spec": {"sessionsPerNode": s}})),
                        )
                        .await?;
                    "RunnerPool sessionsPerNode changed"
                }
                50..=69 if live_migrations.len() < 4 => {
                    counter += 1;
                    // With live agents, real migrations are the live workload's (their
                    // own driver): those of `mig` would reach the same agents.
                    let dry = rng.range(0, 1) == 0 || dry_only;
                    let name = format!("{}-{counter}", if dry { "dry" } else { "real" });
                    let pod = &mig_pods[rng.range(0, mig_pods.len() as u64 - 1) as usize];
                    let m = migs
                        .create(&PostParams::default(), &migration(&name, pod, dry))
                        .await?;
                    live_migrations.push((name, m.uid().unwrap_or_default()));
                    if dry {
                        "PodMigration (dry run) created"
                    } else {
                        "PodMigration (agents unreachable) created"
                    }
                }
                50..=89 if !live_migrations.is_empty() => {
                    let i = rng.range(0, live_migrations.len() as u64 - 1) as usize;
                    let (name, uid) = live_migrations.remove(i);
                    let finished = migs
                        .get_opt(&name)
                        .await?
                        .and_then(|m| m.status)
                        .is_some_and(|s| terminal(&s.phase));
                    migs.delete(&name, &DeleteParams::default()).await?;
                    record_deletion(&tally, "PodMigration", name, uid);
                    if finished {
                        "PodMigration deleted (finished)"
                    } else {
                        "PodMigration deleted (in flight: abort)"
                    }
                }
                _ => {
                    // The attachment of attach-b: deleted, or recreated once gone.
                    match naas.get_opt("attach-b").await? {
                        Some(a) if a.metadata.deletion_timestamp.is_none() => {
                            naas.delete("attach-b", &DeleteParams::default()).await?;
                            record_deletion(
                                &tally,
                                "NodeAgentAttachment",
                                "attach-b".into(),
                                a.uid().unwrap_or_default(),
                            );
                            "NodeAgentAttachment deleted"
                        }
                        Some(_) => "NodeAgentAttachment still deleting (skipped)",
                        None => {
                            naas.create(&PostParams::default(), &attachment("attach-b"))
                                .await?;
                            "NodeAgentAttachment recreated"
                        }
                    }
                }
            })
        }
        .await;
        match res {
            Ok(what) => *tally.lock().unwrap().churn.entry(what).or_default() += 1,
            Err(e) => {
                eprintln!("[chaos] churn write failed (API server away?): {e:#}");
                tally.lock().unwrap().driver_errors += 1;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(rng.range(400, 1200))) => {}
            _ = phase.changed() => {}
        }
    }
    // Every attachment exists again for the final convergence.
    if naas.get_opt("attach-b").await.ok().flatten().is_none() {
        let _ = naas
            .create(&PostParams::default(), &attachment("attach-b"))
            .await;
    }
}

fn record_deletion(tally: &Shared, kind: &'static str, name: String, uid: String) {
    tally.lock().unwrap().deleted.push(Deleted {
        kind,
        name,
        uid,
        at: Instant::now(),
        gone: false,
        reported: false,
    });
}

// ------------------------------------------------------------------ live migrations

/// The live workload: its process, the agents of the two kwok nodes, and whether the
/// process sampler is watching (not while a fresh workload replaces a moved one).
struct Live {
    agents: Arc<Mutex<KwokAgents>>,
    watching: Arc<AtomicBool>,
    /// The last migration moved the process: the next round starts a fresh workload
    /// in the pod that now holds it.
    fresh: Arc<AtomicBool>,
}

/// Samples the live workload's processes every [`LIVE_SAMPLE_EVERY`] until `stop`:
/// never two running copies, never none.
fn live_sampler(
    marker: WorkloadMarker,
    watching: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    tally: Shared,
) {
    while !stop.load(Ordering::Relaxed) {
        if watching.load(Ordering::Relaxed) {
            let procs = marker.processes();
            // The flag may have dropped while /proc was read (a reset began).
            if watching.load(Ordering::Relaxed) {
                tally.lock().unwrap().live_process_samples += 1;
                let running = procs.iter().filter(|p| p.running).count();
                if running > 1 {
                    violation(
                        &tally,
                        format!("two running copies of the live workload: {procs:?}"),
                    );
                } else if procs.is_empty() {
                    violation(
                        &tally,
                        "the live workload's process is gone (no copy)".into(),
                    );
                }
            }
        }
        std::thread::sleep(LIVE_SAMPLE_EVERY);
    }
}

/// The live workload's one pod once it runs with a container ID and nothing else of
/// it is left (a migration's target pod deleted, a source pod gone).
async fn live_pod(client: &Client, n: &Names) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &n.app);
    let t0 = Instant::now();
    let mut last = String::new();
    while t0.elapsed() < CONVERGENCE {
        match pods
            .list(&ListParams::default().labels(&format!("app={LIVE}")))
            .await
        {
            Ok(l) => {
                let ps = l.items;
                if ps.len() == 1
                    && ps[0].metadata.deletion_timestamp.is_none()
                    && pod_running_ready(&ps[0])
                    && container_id(&ps[0]).is_some()
                {
                    return Ok(ps[0].clone());
                }
                last = format!("{:?}", ps.iter().map(|p| p.name_any()).collect::<Vec<_>>());
            }
            Err(e) => last = format!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bail!("the live workload has no single running pod within {CONVERGENCE:?}: {last}")
}

fn live_migration(name: &str, pod: &str, target: &str) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod, "targetNode": target, "mode": "Cold",
                 "tcpPreservation": "BestEffort", "freezeBudgetMillis": 60000,
                 "bandwidthLimitBytesPerSecond": LIVE_BANDWIDTH,
                 "progressTimeoutSeconds": 30, "deadlineSeconds": 120}
    }))
}

/// One counter read over `conn`, or over a new connection if that one is gone; the
/// counter and whether the old connection still served.
fn read_counter(
    agents: &KwokAgents,
    conn: &mut std::net::TcpStream,
) -> anyhow::Result<(u64, bool)> {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    if let Ok(v) = ask(conn, "get")
        && let Ok(v) = v.parse()
    {
        return Ok((v, true));
    }
    *conn = agents.tb.connect_timeout(Duration::from_secs(5))?;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(5)));
    Ok((ask(conn, "get")?.parse()?, false))
}

/// Migrates the live workload's process back and forth between the two kwok nodes
/// while the faults last, deleting a third of the migrations at a random moment, and
/// checks after each: the workload runs exactly once, in the pod Kubernetes keeps, its
/// counter continued; no checkpoint image is left.
async fn live_migrations(
    client: Client,
    n: Names,
    live: Live,
    tally: Shared,
    seed: u64,
    phase: watch::Receiver<Phase>,
) {
    if let Err(e) = live_rounds(&client, &n, &live, &tally, seed, phase).await {
        violation(&tally, format!("live migrations: {e:#}"));
    }
}

async fn live_rounds(
    client: &Client,
    n: &Names,
    live: &Live,
    tally: &Shared,
    seed: u64,
    phase: watch::Receiver<Phase>,
) -> anyhow::Result<()> {
    let mut rng = Rng::new(seed ^ 0x6c69_7665);
    let mut settle_at: Option<Instant> = None;
    for round in 1.. {
        if *phase.borrow() != Phase::Chaos {
            break;
        }
        let delete_after =
            (rng.range(0, 2) == 0).then(|| Duration::from_millis(rng.range(0, 5000)));
        let end = live_round(
            client,
            n,
            live,
            tally,
            &format!("live-{round}"),
            delete_after,
            Some((&phase, &mut settle_at)),
        )
        .await?;
        let mut t = tally.lock().unwrap();
        *t.live_outcomes.entry(end.outcome).or_default() += 1;
        match (end.committed, end.deleted) {
            (true, _) => t.live_committed += 1,
            (false, true) => t.live_rolled_back_deleted += 1,
            (false, false) => t.live_rolled_back_failed += 1,
        }
    }
    Ok(())
}

/// How one live migration ended.
struct RoundEnd {
    /// The process runs in the target pod (the migration committed).
    committed: bool,
    /// The run deleted the PodMigration before it ended.
    deleted: bool,
    /// What the summary counts it as.
    outcome: String,
}

/// One live migration of the workload to the other kwok node (deleted `delete_after`
/// its creation, if given) and the checks after it: the workload runs exactly once, in
/// the pod Kubernetes keeps, its counter continued; no checkpoint image is left.
/// `faults` (the run's phase and when it left `Chaos`) is given for the rounds under
/// faults: the migration in flight at the last fault must end within CONVERGENCE.
async fn live_round(
    client: &Client,
    n: &Names,
    live: &Live,
    tally: &Shared,
    name: &str,
    delete_after: Option<Duration>,
    mut faults: Option<(&watch::Receiver<Phase>, &mut Option<Instant>)>,
) -> anyhow::Result<RoundEnd> {
    let name = name.to_string();
    let migs: Api<PodMigration> = Api::namespaced(client.clone(), &n.app);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &n.app);
    let mut pod = live_pod(client, n).await?;
    if live.fresh.load(Ordering::Relaxed) {
        live.watching.store(false, Ordering::Relaxed);
        // The pod the last migration handed over is adopted (PID 1 of its container
        // is PodMotion's holder). It could move again (docs/migration-controller.md,
        // "Moving a pod again"), but each round starts from an ordinary pod so that
        // rounds compare alike: delete it, and its ReplicaSet makes a new one.
        pods.delete(&pod.name_any(), &DeleteParams::default().grace_period(0))
            .await
            .with_context(|| format!("deleting the adopted pod {}", pod.name_any()))?;
        let old = pod.name_any();
        let t0 = Instant::now();
        pod = loop {
            let p = live_pod(client, n).await?;
            if p.name_any() != old {
                break p;
            }
            anyhow::ensure!(
                t0.elapsed() < CONVERGENCE,
                "the adopted pod {old} was not replaced within {CONVERGENCE:?}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let cid = container_id(&pod).unwrap_or_default();
        let agents = live.agents.clone();
        let cid = cid.clone();
        tokio::task::spawn_blocking(move || {
            let mut a = agents.lock().unwrap();
            let pid = a.fresh_workload(LIVE_BALLAST_MIB);
            a.tb.register_container(&cid, pid);
        })
        .await?;
        live.watching.store(true, Ordering::Relaxed);
        live.fresh.store(false, Ordering::Relaxed);
    }
    let pod = pod;
    let source_node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let target_node = MIG_NODES
        .iter()
        .find(|n| **n != source_node)
        .copied()
        .unwrap_or(MIG_NODES[0]);
    let agents = live.agents.clone();
    let (mut conn, before) = tokio::task::spawn_blocking(move || {
        let a = agents.lock().unwrap();
        let mut c = a.tb.connect_timeout(Duration::from_secs(5))?;
        let (v, _) = read_counter(&a, &mut c)?;
        anyhow::Ok((c, v))
    })
    .await??;

    let t0 = Instant::now();
    loop {
        match migs
            .create(
                &PostParams::default(),
                &live_migration(&name, &pod.name_any(), target_node),
            )
            .await
        {
            Ok(_) => break,
            Err(e) if t0.elapsed() > CONVERGENCE => {
                bail!("creating PodMigration {name}: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let (mut target_pod, mut played, mut deleted) = (None::<String>, false, false);
    let mut final_phase = None;
    let mut last_status = String::new();
    let started = Instant::now();
    loop {
        if let Some((phase, settle_at)) = &mut faults
            && *phase.borrow() != Phase::Chaos
            && settle_at.is_none()
        {
            **settle_at = Some(Instant::now());
        }
        if started.elapsed() > Duration::from_secs(180) {
            let logs = live.agents.lock().unwrap().logs();
            bail!(
                "PodMigration {name} did not end within 180 s (deleted: {deleted}); status {last_status}\n{logs}"
            );
        }
        let m = match migs.get_opt(&name).await {
            Ok(m) => m,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let st = m.as_ref().and_then(|m| m.status.clone());
        if let Some(st) = &st {
            // Why it waits, if it does (Pending: not Migratable, or Stalled).
            let waits: Vec<String> = st
                .conditions
                .iter()
                .filter(|c| {
                    (c.type_ == ct::MIGRATABLE && c.status != "True")
                        || (c.type_ == ct::STALLED && c.status == "True")
                })
                .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                .collect();
            last_status = format!("{:?} {:?} {waits:?}", st.phase, st.failure_message);
        }
        if target_pod.is_none() {
            target_pod = st.as_ref().and_then(|s| s.target_pod.clone());
        }
        if let (Some(t), false) = (&target_pod, played)
            && let Ok(Some(p)) = pods.get_opt(t).await
            && let Some(tcid) = container_id(&p)
        {
            let agents = live.agents.clone();
            tokio::task::spawn_blocking(move || agents.lock().unwrap().play_target(&tcid)).await?;
            played = true;
        }
        if let Some(after) = delete_after
            && !deleted
            && started.elapsed() >= after
            && m.is_some()
        {
            let at = st
                .as_ref()
                .map(|s| format!("{:?}", s.phase))
                .unwrap_or_else(|| "no status".into());
            if migs.delete(&name, &DeleteParams::default()).await.is_ok() {
                deleted = true;
                let uid = m.as_ref().and_then(|m| m.uid()).unwrap_or_default();
                record_deletion(tally, "PodMigration", name.clone(), uid);
                *tally.lock().unwrap().live_deleted_in.entry(at).or_default() += 1;
            }
        }
        match (&m, &st) {
            (None, _) if deleted => break,
            (Some(_), Some(s)) if !deleted && terminal(&s.phase) => {
                final_phase = Some(format!(
                    "{:?}{}",
                    s.phase,
                    s.failure_reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ));
                break;
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if let Some((_, Some(at))) = &faults {
        tally.lock().unwrap().live_settle_secs = Some(at.elapsed().as_secs_f64());
        if at.elapsed() > CONVERGENCE {
            violation(
                tally,
                format!(
                    "PodMigration {name} ended {:.0} s after the last fault",
                    at.elapsed().as_secs_f64()
                ),
            );
        }
    }

    // Which pod Kubernetes keeps says where the one copy must run.
    let kept = live_pod(client, n).await?;
    let side = if kept.name_any() == pod.name_any() {
        PodSide::Source
    } else if Some(kept.name_any()) == target_pod {
        PodSide::Target
    } else {
        bail!(
            "after {name} the live workload's pod is {}, neither the source {} nor the target {target_pod:?}",
            kept.name_any(),
            pod.name_any()
        );
    };
    let agents = live.agents.clone();
    let tally2 = tally.clone();
    let name2 = name.clone();
    tokio::task::spawn_blocking(move || {
        let a = agents.lock().unwrap();
        check_live_round(&a, &tally2, &name2, side, &mut conn, before)
    })
    .await?;
    // Cleanup zeroized and removed every checkpoint image on both nodes.
    let t0 = Instant::now();
    loop {
        let left = live.agents.lock().unwrap().checkpoint_files();
        if left.is_empty() {
            tally.lock().unwrap().live_round_checks += 1;
            break;
        }
        if t0.elapsed() > CONVERGENCE {
            violation(
                tally,
                format!("checkpoint images left {CONVERGENCE:?} after {name} ended: {left:?}"),
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let outcome = match (side, deleted) {
        (PodSide::Target, false) => "moved the process".to_string(),
        (PodSide::Target, true) => "moved the process (deleted after the commit)".into(),
        (PodSide::Source, true) => "rolled back (deleted in flight)".into(),
        (PodSide::Source, false) => {
            format!("rolled back ({})", final_phase.unwrap_or_default())
        }
    };
    eprintln!("[chaos] live migration {name}: {outcome}; last status {last_status}");
    if !deleted {
        let uid = migs
            .get_opt(&name)
            .await
            .ok()
            .flatten()
            .and_then(|m| m.uid())
            .unwrap_or_default();
        if migs.delete(&name, &DeleteParams::default()).await.is_ok() {
            record_deletion(tally, "PodMigration", name.clone(), uid);
        }
    }
    match side {
        // The next round starts a fresh workload in the pod that now holds it.
        PodSide::Target => live.fresh.store(true, Ordering::Relaxed),
        // The source runs on: only the target's holder and address go.
        PodSide::Source => {
            let agents = live.agents.clone();
            tokio::task::spawn_blocking(move || agents.lock().unwrap().reset_target()).await?;
        }
    }
    Ok(RoundEnd {
        committed: side == PodSide::Target,
        deleted,
        outcome,
    })
}

/// After a live migration ended: exactly one copy runs, in the pod on `side`; its
/// counter continued from `before` (the process state moved, not a fresh start) and
/// keeps advancing (it was thawed or restored, not left frozen).
fn check_live_round(
    agents: &KwokAgents,
    tally: &Shared,
    name: &str,
    side: PodSide,
    conn: &mut std::net::TcpStream,
    before: u64,
) {
    let t0 = Instant::now();
    let mut procs = agents.workload_processes();
    while !(procs.len() == 1 && procs[0].running && procs[0].side == side)
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(100));
        procs = agents.workload_processes();
    }
    tally.lock().unwrap().live_round_checks += 1;
    if !(procs.len() == 1 && procs[0].running && procs[0].side == side) {
        violation(
            tally,
            format!(
                "after {name} the live workload runs as {procs:?}, expected one running copy in the {side:?} pod"
            ),
        );
        return;
    }
    if side == PodSide::Target {
        agents.tb.route_to_target();
    }
    let counted = read_counter(agents, conn).and_then(|(a, kept)| {
        std::thread::sleep(Duration::from_millis(300));
        let (b, _) = read_counter(agents, conn)?;
        Ok((a, b, kept))
    });
    let mut t = tally.lock().unwrap();
    t.live_round_checks += 2;
    match counted {
        Ok((after, again, kept)) => {
            if kept {
                t.live_conn_kept += 1;
            } else {
                t.live_conn_reopened += 1;
            }
            drop(t);
            if after < before {
                violation(
                    tally,
                    format!(
                        "after {name} the live workload's counter ran backwards: {before} → {after} (a fresh process?)"
                    ),
                );
            }
            if again <= after {
                violation(
                    tally,
                    format!(
                        "after {name} the live workload does not run: counter {after} → {again}"
                    ),
                );
            }
        }
        Err(e) => {
            drop(t);
            violation(
                tally,
                format!("after {name} the live workload does not answer: {e:#}"),
            );
        }
    }
}

// ------------------------------------------------------------------ invariants

fn live<K: kube::Resource>(items: Vec<K>) -> Vec<K> {
    items
        .into_iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .collect()
}

/// (owner UID label, kind, name) of every object of `api` that `sel` selects.
async fn owned<K>(api: Api<K>, sel: &ListParams) -> anyhow::Result<Vec<(String, String, String)>>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    Ok(api
        .list(sel)
        .await?
        .items
        .iter()
        .map(|o| {
            (
                label(o, labels::OWNER_UID).into(),
                K::kind(&()).into(),
                o.name_any(),
            )
        })
        .collect())
}

fn label<'a, K: kube::Resource>(o: &'a K, key: &str) -> &'a str {
    o.meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
        .unwrap_or("")
}

fn terminal(p: &MigrationPhase) -> bool {
    matches!(
        p,
        MigrationPhase::Succeeded | MigrationPhase::Failed | MigrationPhase::Aborted
    )
}

/// Whether the object `kind`/`name` still exists with `uid`.
async fn still_there(
    client: &Client,
    ns: &str,
    kind: &str,
    name: &str,
    uid: &str,
) -> kube::Result<bool> {
    let uid_of = |m: Option<kube::api::ObjectMeta>| m.and_then(|m| m.uid);
    let found = match kind {
        "PodMigration" => uid_of(
            Api::<PodMigration>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|o| o.metadata),
        ),
        "RunnerPool" => uid_of(
            Api::<RunnerPool>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|o| o.metadata),
        ),
        _ => uid_of(
            Api::<NodeAgentAttachment>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|o| o.metadata),
        ),
    };
    Ok(found.as_deref() == Some(uid))
}

/// The invariants that hold at every moment, even mid-fault. Returns the violations
/// and the number of checks made.
async fn sample(
    client: &Client,
    n: &Names,
    mig_uids: &BTreeSet<String>,
    tally: &Shared,
) -> kube::Result<(Vec<String>, u64)> {
    let mut v = Vec::new();
    let mut checks = 0u64;
    // One live agent Job per target pod.
    let jobs = live(
        Api::<Job>::namespaced(client.clone(), &n.sys)
            .list(
                &ListParams::default()
                    .labels(&format!("{}=NodeAgentAttachment", labels::OWNER_KIND)),
            )
            .await?
            .items,
    );
    let mut per_pod: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for j in &jobs {
        per_pod
            .entry(label(j, labels::TARGET_POD_UID))
            .or_default()
            .push(j.name_any());
    }
    for (pod, js) in &per_pod {
        checks += 1;
        if js.len() > 1 {
            v.push(format!("duplicate agent Jobs for target pod {pod}: {js:?}"));
        }
    }
    // At most one child of each kind per RunnerPool.
    let sel = ListParams::default().labels(&format!("{}=RunnerPool", labels::OWNER_KIND));
    let mut per_owner: BTreeMap<(String, &str), Vec<String>> = BTreeMap::new();
    for o in live(
        Api::<DaemonSet>::namespaced(client.clone(), &n.app)
            .list(&sel)
            .await?
            .items,
    ) {
        per_owner
            .entry((label(&o, labels::OWNER_UID).into(), "DaemonSet"))
            .or_default()
            .push(o.name_any());
    }
    for o in live(
        Api::<NetworkPolicy>::namespaced(client.clone(), &n.app)
            .list(&sel)
            .await?
            .items,
    ) {
        per_owner
            .entry((label(&o, labels::OWNER_UID).into(), "NetworkPolicy"))
            .or_default()
            .push(o.name_any());
    }
    for o in live(
        Api::<Secret>::namespaced(client.clone(), &n.app)
            .list(&sel)
            .await?
            .items,
    ) {
        per_owner
            .entry((label(&o, labels::OWNER_UID).into(), "Secret"))
            .or_default()
            .push(o.name_any());
    }
    for ((uid, kind), names) in &per_owner {
        checks += 1;
        if names.len() > 1 {
            v.push(format!(
                "RunnerPool {uid} has {} {kind}s: {names:?}",
                names.len()
            ));
        }
    }
    // The migrated workload runs exactly as it started: same pods, all Running (no
    // migration reaches an agent, so none may touch a source pod); at most one target
    // pod and one transfer key per migration.
    let pods = Api::<Pod>::namespaced(client.clone(), &n.app);
    let mig: Vec<Pod> = pods
        .list(&ListParams::default().labels("app=mig"))
        .await?
        .items;
    let uids: BTreeSet<String> = mig.iter().filter_map(|p| p.uid()).collect();
    checks += 1;
    if &uids != mig_uids || !mig.iter().all(pod_running_ready) {
        v.push(format!(
            "the migrated workload changed: pods {:?} (expected {mig_uids:?}), running {:?}",
            uids,
            mig.iter().map(pod_running_ready).collect::<Vec<_>>()
        ));
    }
    let mut per_migration: BTreeMap<(String, &str), Vec<String>> = BTreeMap::new();
    for p in live(
        pods.list(&ListParams::default().labels(labels::MIGRATION))
            .await?
            .items,
    ) {
        per_migration
            .entry((label(&p, labels::MIGRATION).into(), "target pod"))
            .or_default()
            .push(p.name_any());
    }
    let psel = ListParams::default().labels(&format!("{}=PodMigration", labels::OWNER_KIND));
    for s in live(
        Api::<Secret>::namespaced(client.clone(), &n.app)
            .list(&psel)
            .await?
            .items,
    ) {
        per_migration
            .entry((label(&s, labels::OWNER_UID).into(), "transfer-key Secret"))
            .or_default()
            .push(s.name_any());
    }
    for ((owner, what), names) in &per_migration {
        checks += 1;
        tally
            .lock()
            .unwrap()
            .seen_migration_children
            .extend(names.iter().map(|n| format!("{what} {n}")));
        if names.len() > 1 {
            v.push(format!(
                "PodMigration {owner} has {} {what}s: {names:?}",
                names.len()
            ));
        }
    }
    // No wedged finalizer: every deletion completes within CONVERGENCE.
    let pending: Vec<(usize, &'static str, String, String, Instant)> = tally
        .lock()
        .unwrap()
        .deleted
        .iter()
        .enumerate()
        .filter(|(_, d)| !d.gone)
        .map(|(i, d)| (i, d.kind, d.name.clone(), d.uid.clone(), d.at))
        .collect();
    for (i, kind, name, uid, at) in pending {
        checks += 1;
        let there = still_there(client, &n.app, kind, &name, &uid).await?;
        let mut t = tally.lock().unwrap();
        let d = &mut t.deleted[i];
        if !there {
            d.gone = true;
            let secs = d.at.elapsed().as_secs_f64();
            t.deletion_secs.push(secs);
        } else if at.elapsed() > CONVERGENCE && !d.reported {
            d.reported = true;
            v.push(format!(
                "{kind} {name} still present {:.0} s after its deletion (finalizer wedged?)",
                at.elapsed().as_secs_f64()
            ));
        }
    }
    Ok((v, checks))
}

async fn sampler(
    client: Client,
    n: Names,
    mig_uids: BTreeSet<String>,
    tally: Shared,
    mut phase: watch::Receiver<Phase>,
) {
    while *phase.borrow_and_update() != Phase::Stop {
        match sample(&client, &n, &mig_uids, &tally).await {
            Ok((vs, checks)) => {
                let mut t = tally.lock().unwrap();
                t.checks += checks;
                t.sample_rounds += 1;
                drop(t);
                for v in vs {
                    violation(&tally, v);
                }
            }
            Err(e) => {
                eprintln!("[chaos] sample skipped (API server away?): {e}");
                tally.lock().unwrap().sample_rounds_skipped += 1;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(SAMPLE_EVERY) => {}
            _ = phase.changed() => {}
        }
    }
}

/// `Ok(checks)` when everything has settled: statuses observe their generation, every
/// owner has exactly its expected children and nothing is orphaned. `Err(why)` otherwise.
async fn converged(
    client: &Client,
    n: &Names,
    replicas: &[String],
    checks: &mut u64,
) -> anyhow::Result<()> {
    let app = |c: &Client| c.clone();
    let holder = lease_holder(client, n).await;
    *checks += 1;
    if !holder.as_ref().is_some_and(|h| replicas.contains(h)) {
        bail!("no live replica holds the Lease (holder {holder:?})");
    }
    // Attachments: status current; one Job (with its Secret, resumed) per ready pod of
    // each attached Deployment; no other agent Job; the deny-ingress policy.
    let naas = Api::<NodeAgentAttachment>::namespaced(app(client), &n.app)
        .list(&ListParams::default())
        .await?
        .items;
    let mut want: BTreeSet<String> = BTreeSet::new();
    for a in &naas {
        *checks += 1;
        if a.metadata.deletion_timestamp.is_some() {
            bail!("attachment {} still deleting", a.name_any());
        }
        let st = a.status.as_ref();
        if st.and_then(|s| s.observed_generation) != a.metadata.generation {
            bail!(
                "attachment {} status observes generation {:?}, not {:?}",
                a.name_any(),
                st.and_then(|s| s.observed_generation),
                a.metadata.generation
            );
        }
        let d = Api::<Deployment>::namespaced(app(client), &n.app)
            .get(&a.name_any())
            .await?;
        let replicas = d.spec.replicas.unwrap_or(1);
        let pods = Api::<Pod>::namespaced(app(client), &n.app)
            .list(&ListParams::default().labels(&format!("app={}", a.name_any())))
            .await?
            .items;
        if pods.len() != usize::try_from(replicas).unwrap_or(0)
            || !pods.iter().all(pod_running_ready)
        {
            bail!(
                "Deployment {} not settled ({} pods for {replicas} replicas)",
                a.name_any(),
                pods.len()
            );
        }
        if st.map(|s| s.total_targets) != Some(replicas) {
            bail!(
                "attachment {} reports {:?} targets for {replicas} pods",
                a.name_any(),
                st.map(|s| s.total_targets)
            );
        }
        want.extend(pods.iter().filter_map(|p| p.uid()));
    }
    let jobs = Api::<Job>::namespaced(app(client), &n.sys)
        .list(&ListParams::default().labels(&format!("{}=NodeAgentAttachment", labels::OWNER_KIND)))
        .await?
        .items;
    let have: Vec<&str> = jobs
        .iter()
        .map(|j| label(j, labels::TARGET_POD_UID))
        .collect();
    *checks += 1;
    if have.iter().copied().collect::<BTreeSet<_>>() != want.iter().map(String::as_str).collect()
        || have.len() != want.len()
    {
        bail!(
            "agent Jobs target {have:?}, the attached pods are {want:?} (orphaned, missing or duplicate Jobs)"
        );
    }
    // Each Job's credential lives in the attachment's namespace (the tenant's), named
    // like the Job and owned by its target pod; the agents' namespace holds none.
    let secrets = Api::<Secret>::namespaced(app(client), &n.app);
    for j in &jobs {
        *checks += 1;
        if j.metadata.deletion_timestamp.is_some()
            || j.spec.as_ref().and_then(|s| s.suspend) == Some(true)
        {
            bail!(
                "agent Job {} is terminating or still suspended",
                j.name_any()
            );
        }
        let s = secrets.get_opt(&j.name_any()).await?;
        let target = label(j, labels::TARGET_POD_UID);
        let owned = s.as_ref().is_some_and(|s| {
            s.owner_references()
                .iter()
                .any(|o| o.kind == "Pod" && o.uid == target)
        });
        if !owned {
            bail!(
                "agent Job {} has no credential Secret of its own in {} (owned by its target pod)",
                j.name_any(),
                n.app
            );
        }
    }
    let agent_secrets = secrets
        .list(&ListParams::default().labels(labels::TARGET_POD_UID))
        .await?
        .items;
    for s in &agent_secrets {
        *checks += 1;
        if !jobs.iter().any(|j| j.name_any() == s.name_any()) {
            bail!(
                "agent Secret {} is orphaned (no Job of its name)",
                s.name_any()
            );
        }
    }
    *checks += 1;
    if !jobs.is_empty()
        && Api::<NetworkPolicy>::namespaced(app(client), &n.sys)
            .get_opt(AGENT_POLICY)
            .await?
            .is_none()
    {
        bail!("the agents' NetworkPolicy {AGENT_POLICY} is missing");
    }
    // RunnerPools: status current, Ready, the capacity of the current spec; exactly the
    // DaemonSet, NetworkPolicy and credential Secret of each pool, nothing orphaned.
    let pools = Api::<RunnerPool>::namespaced(app(client), &n.app)
        .list(&ListParams::default())
        .await?
        .items;
    let mut expected: BTreeSet<(String, String, String)> = BTreeSet::new();
    for p in &pools {
        *checks += 1;
        let st = p.status.as_ref();
        if st.and_then(|s| s.observed_generation) != p.metadata.generation {
            bail!(
                "RunnerPool {} status observes generation {:?}, not {:?}",
                p.name_any(),
                st.and_then(|s| s.observed_generation),
                p.metadata.generation
            );
        }
        let Some(st) = st else {
            bail!("RunnerPool {} has no status", p.name_any())
        };
        if !is_true(&st.conditions, ct::READY)
            || st.desired_nodes < 1
            || st.ready_nodes != st.desired_nodes
            || st.session_capacity != p.spec.sessions_per_node * st.desired_nodes
        {
            bail!(
                "RunnerPool {} not Ready with its capacity: {st:?}",
                p.name_any()
            );
        }
        let uid = p.uid().unwrap_or_default();
        for (kind, name) in [
            ("DaemonSet", p.name_any()),
            ("NetworkPolicy", p.name_any()),
            ("Secret", format!("{}-credentials", p.name_any())),
        ] {
            expected.insert((uid.clone(), kind.to_string(), name));
        }
    }
    let sel = ListParams::default().labels(&format!("{}=RunnerPool", labels::OWNER_KIND));
    let mut children: BTreeSet<(String, String, String)> = BTreeSet::new();
    children.extend(owned(Api::<DaemonSet>::namespaced(app(client), &n.app), &sel).await?);
    children.extend(owned(Api::<NetworkPolicy>::namespaced(app(client), &n.app), &sel).await?);
    children.extend(owned(Api::<Secret>::namespaced(app(client), &n.app), &sel).await?);
    *checks += 1;
    if children != expected {
        bail!("RunnerPool children {children:?}, expected {expected:?}");
    }
    // PodMigrations: finished, status current.
    for m in Api::<PodMigration>::namespaced(app(client), &n.app)
        .list(&ListParams::default())
        .await?
        .items
    {
        *checks += 1;
        let st = m.status.as_ref();
        if m.metadata.deletion_timestamp.is_some() {
            bail!("PodMigration {} still deleting", m.name_any());
        }
        let done = st.is_some_and(|s| terminal(&s.phase));
        if !done || st.and_then(|s| s.observed_generation) != m.metadata.generation {
            bail!(
                "PodMigration {} not finished/current: {:?}",
                m.name_any(),
                st.map(|s| (&s.phase, s.observed_generation))
            );
        }
    }
    // Every migration has finished: no target pod or transfer key is left (a failed one
    // rolled back).
    let targets = Api::<Pod>::namespaced(app(client), &n.app)
        .list(&ListParams::default().labels(labels::MIGRATION))
        .await?
        .items;
    let keys = Api::<Secret>::namespaced(app(client), &n.app)
        .list(&ListParams::default().labels(&format!("{}=PodMigration", labels::OWNER_KIND)))
        .await?
        .items;
    *checks += 1;
    if !targets.is_empty() || !keys.is_empty() {
        bail!(
            "finished migrations left target pods {:?} and transfer keys {:?}",
            targets.iter().map(|p| p.name_any()).collect::<Vec<_>>(),
            keys.iter().map(|s| s.name_any()).collect::<Vec<_>>()
        );
    }
    Ok(())
}

/// Waits up to [`CONVERGENCE`] for [`converged`]; returns how long it took.
async fn await_convergence(
    client: &Client,
    n: &Names,
    replicas: &[String],
    tally: &Shared,
    what: &str,
) -> Option<Duration> {
    let t0 = Instant::now();
    let mut why = String::new();
    let mut checks = 0;
    while t0.elapsed() < CONVERGENCE {
        match converged(client, n, replicas, &mut checks).await {
            Ok(()) => {
                tally.lock().unwrap().checks += checks;
                if !why.is_empty() {
                    eprintln!(
                        "[chaos] converged {what} in {:.1} s; last unmet: {why}",
                        t0.elapsed().as_secs_f64()
                    );
                }
                return Some(t0.elapsed());
            }
            Err(e) => why = format!("{e:#}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tally.lock().unwrap().checks += checks;
    violation(
        tally,
        format!("no convergence {what} within {CONVERGENCE:?}: {why}"),
    );
    print_replica_tails(n, replicas);
    None
}

/// After a convergence violation: what each replica last did (reconciles, failures,
/// paused watches), so a failed run explains itself where only its output is kept.
fn print_replica_tails(n: &Names, replicas: &[String]) {
    const KEEP: usize = 15;
    for who in replicas {
        let path = n.dir.join(format!("{who}.log"));
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let lines: Vec<String> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|j| {
                let msg = j["message"].as_str().unwrap_or_default();
                msg.starts_with("reconcile")
                    || msg.contains("backing off")
                    || msg.contains("leadership")
                    || j["level"] == "WARN"
            })
            .map(|j| {
                let f = &j;
                let fields = [
                    "message",
                    "controller",
                    "name",
                    "outcome",
                    "error",
                    "duration",
                ]
                .iter()
                .filter_map(|k| match &f[*k] {
                    serde_json::Value::Null => None,
                    serde_json::Value::String(v) => Some(v.clone()),
                    v => Some(v.to_string()),
                })
                .collect::<Vec<_>>()
                .join(" ");
                format!("  {} {fields}", j["timestamp"].as_str().unwrap_or_default())
            })
            .collect();
        eprintln!(
            "[chaos] replica {who}: last {KEEP} of {} noted lines ({})",
            lines.len(),
            path.display()
        );
        for l in lines.iter().skip(lines.len().saturating_sub(KEEP)) {
            eprintln!("{l}");
        }
    }
}

// ------------------------------------------------------------------ run

/// The negative control: a DaemonSet labelled as a second child of `pool-a` (and so an
/// orphan the operator does not know of). The sampled check and the final convergence
/// must both report it.
async fn plant_violation(client: &Client, n: &Names) -> anyhow::Result<()> {
    let pool = Api::<RunnerPool>::namespaced(client.clone(), &n.app)
        .get(POOLS[0])
        .await?;
    let ds: DaemonSet = from_json(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "planted-second-daemonset", "labels": {
            labels::OWNER_KIND: "RunnerPool",
            labels::OWNER_UID: pool.uid().unwrap_or_default(),
        }},
        "spec": {
            "selector": {"matchLabels": {"app": "planted"}},
            "template": {"metadata": {"labels": {"app": "planted"}}, "spec": {
                "nodeSelector": {"podmotion.io/chaos-nowhere": "true"},
                "containers": [restricted_container("app")]
            }}
        }
    }));
    Api::<DaemonSet>::namespaced(client.clone(), &n.app)
        .create(&PostParams::default(), &ds)
        .await?;
    eprintln!(
        "[chaos] planted a second DaemonSet of {} (negative control)",
        POOLS[0]
    );
    Ok(())
}

async fn restart_api_server() -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new("bash")
        .arg(podmotion_e2e::repo_root().join("hack/cluster.sh"))
        .args(["restart-component", "kube-apiserver"])
        .output()
        .await?;
    anyhow::ensure!(
        out.status.success(),
        "hack/cluster.sh restart-component kube-apiserver: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(t0.elapsed())
}

fn write_proxy_kubeconfig(
    path: &std::path::Path,
    addr: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let cfg = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: chaos\n  cluster:\n    server: http://{addr}\nusers:\n- name: chaos\n  user: {{}}\ncontexts:\n- name: chaos\n  context:\n    cluster: chaos\n    user: chaos\ncurrent-context: chaos\n"
    );
    std::fs::write(path, cfg)?;
    Ok(())
}

/// Deletes every PodMotion object with the operators running; all must be gone within
/// [`CONVERGENCE`]. Then the namespaces (and any PriorityClass left) go.
async fn teardown(client: &Client, n: &Names, tally: &Shared, operators_up: bool) {
    let dp = DeleteParams::default();
    let app = n.app.as_str();
    let t0 = Instant::now();
    if operators_up {
        for m in Api::<PodMigration>::namespaced(client.clone(), app)
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
        {
            let _ = Api::<PodMigration>::namespaced(client.clone(), app)
                .delete(&m.name_any(), &dp)
                .await;
        }
        for a in ATTACHED {
            let _ = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
                .delete(a, &dp)
                .await;
        }
        for p in POOLS {
            let _ = Api::<RunnerPool>::namespaced(client.clone(), app)
                .delete(p, &dp)
                .await;
        }
        loop {
            let left = async {
                let m = Api::<PodMigration>::namespaced(client.clone(), app)
                    .list(&ListParams::default())
                    .await?
                    .items
                    .len();
                let a = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
                    .list(&ListParams::default())
                    .await?
                    .items
                    .len();
                let p = Api::<RunnerPool>::namespaced(client.clone(), app)
                    .list(&ListParams::default())
                    .await?
                    .items
                    .len();
                let j = Api::<Job>::namespaced(client.clone(), &n.sys)
                    .list(
                        &ListParams::default()
                            .labels(&format!("{}=NodeAgentAttachment", labels::OWNER_KIND)),
                    )
                    .await?
                    .items
                    .len();
                Ok::<_, kube::Error>(m + a + p + j)
            }
            .await
            .unwrap_or(usize::MAX);
            if left == 0 {
                tally.lock().unwrap().checks += 1;
                eprintln!(
                    "[chaos] every PodMotion object and agent Job deleted in {:.1} s",
                    t0.elapsed().as_secs_f64()
                );
                break;
            }
            if t0.elapsed() > CONVERGENCE {
                violation(
                    tally,
                    format!(
                        "{left} PodMotion object(s) or agent Job(s) left {CONVERGENCE:?} after the final deletion (finalizer wedged?)"
                    ),
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    // Whatever is left (a failed run): strip finalizers so the namespaces can go.
    let strip = PatchParams::default();
    let nofin = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    for m in Api::<PodMigration>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<PodMigration>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
    for m in Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
    for m in Api::<RunnerPool>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<RunnerPool>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
    for p in POOLS {
        let _ = Api::<PriorityClass>::all(client.clone())
            .delete(&format!("{app}-{p}"), &dp)
            .await;
    }
    for ns in [&n.app, &n.sys] {
        let _ = Api::<Namespace>::all(client.clone()).delete(ns, &dp).await;
    }
}

fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn max(xs: &[f64]) -> f64 {
    xs.iter().copied().fold(0.0, f64::max)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let opts = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("chaos: {e:#}");
            std::process::exit(2);
        }
    };
    match run(opts).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("chaos: could not run: {e:#}");
            std::process::exit(2);
        }
    }
}

async fn run(o: Opts) -> anyhow::Result<bool> {
    let started = Instant::now();
    let bin = operator_bin()?;
    let client = connect().await?;
    let suffix = random_suffix();
    let dir = std::env::temp_dir().join(format!("pm-chaos-{suffix}"));
    std::fs::create_dir_all(&dir)?;
    let n = Names {
        sys: format!("chaos-sys-{suffix}"),
        app: format!("chaos-app-{suffix}"),
        lease: format!("chaos-{suffix}"),
        dir: dir.clone(),
    };
    eprintln!(
        "[chaos] {} run, seed {}: namespaces {} and {}, logs in {}",
        if o.long { "long" } else { "short" },
        o.seed,
        n.sys,
        n.app,
        dir.display()
    );
    let tally: Shared = Arc::new(Mutex::new(Tally::default()));
    let (phase_tx, phase_rx) = watch::channel(Phase::Settle);
    if o.live {
        podmotion_e2e::kwok_agents::check_requirements()
            .context("live migrations (--no-live-migrations skips them)")?;
    }
    let stop_live_sampler = Arc::new(AtomicBool::new(false));
    let mut live_sampler_thread = None;
    // The live agents, kept to save their logs whatever the run's end.
    let mut live_agents = None;

    let res = async {
        let mig_pods = setup(&client, &n, o.live).await?;
        // The live workload: agents for MIG_NODES, its process in its pod.
        let live = if o.live {
            let pod = live_pod(&client, &n).await?;
            let cid = container_id(&pod).unwrap_or_default();
            let agents = tokio::task::spawn_blocking(move || {
                let mut a = KwokAgents::start("chaos", MIG_NODES)?;
                let pid = a.fresh_workload(LIVE_BALLAST_MIB);
                a.tb.register_container(&cid, pid);
                anyhow::Ok(a)
            })
            .await??;
            let live = Live {
                agents: Arc::new(Mutex::new(agents)),
                watching: Arc::new(AtomicBool::new(true)),
                fresh: Arc::new(AtomicBool::new(false)),
            };
            live_agents = Some(live.agents.clone());
            let (marker, watching, stop, t) = (
                live.agents.lock().unwrap().marker(),
                live.watching.clone(),
                stop_live_sampler.clone(),
                tally.clone(),
            );
            live_sampler_thread = Some(std::thread::spawn(move || {
                live_sampler(marker, watching, stop, t)
            }));
            Some(live)
        } else {
            None
        };
        let mig_uids: BTreeSet<String> = mig_pods.iter().filter_map(|p| p.uid()).collect();
        let mig_names: Vec<String> = mig_pods.iter().map(|p| p.name_any()).collect();

        let (addr, proxy) = start_proxy(connect().await?, 0, o.seed).await?;
        let kubeconfig = dir.join("proxy.kubeconfig");
        write_proxy_kubeconfig(&kubeconfig, addr)?;
        let mut reps = Replicas {
            bin,
            names: n.clone(),
            kubeconfig,
            agent_args: live
                .as_ref()
                .map(|l| l.agents.lock().unwrap().operator_args())
                .unwrap_or_default(),
            slots: Vec::new(),
            generation: 0,
        };
        for slot in 0..2 {
            let r = reps.spawn(slot)?;
            reps.slots.push(r);
        }
        let replica_ids = Arc::new(Mutex::new(reps.identities()));
        let replicas_task = tokio::spawn(run_replicas(
            reps,
            client.clone(),
            tally.clone(),
            phase_rx.clone(),
            o.kill_every,
            o.seed,
            replica_ids.clone(),
        ));
        let sampler_task = tokio::spawn(sampler(
            client.clone(),
            n.clone(),
            mig_uids.clone(),
            tally.clone(),
            phase_rx.clone(),
        ));

        // Baseline: without faults the operators settle everything.
        let ids = || replica_ids.lock().unwrap().clone();
        let t0 = Instant::now();
        let mut c = 0;
        let baseline = loop {
            match converged(&client, &n, &ids(), &mut c).await {
                Ok(()) => break Some(t0.elapsed()),
                Err(e) if t0.elapsed() > Duration::from_secs(120) => {
                    bail!("the baseline (no faults) did not settle within 120 s: {e:#}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        };
        eprintln!(
            "[chaos] baseline settled in {:.1} s; faults start",
            baseline.unwrap_or_default().as_secs_f64()
        );

        // The control: one live migration without faults (no kill, nothing injected,
        // not deleted) must move the process. Without it, a run whose migrations all
        // roll back under the faults cannot tell the faults from a harness or product
        // that never commits.
        if let Some(l) = &live {
            let end = live_round(&client, &n, l, &tally, "live-0", None, None).await;
            let outcome = match end {
                Ok(end) if end.committed => end.outcome,
                Ok(end) => {
                    violation(
                        &tally,
                        format!(
                            "the live migration without faults (live-0) did not move the process: {}",
                            end.outcome
                        ),
                    );
                    end.outcome
                }
                Err(e) => {
                    violation(&tally, format!("live migration without faults: {e:#}"));
                    format!("error: {e:#}")
                }
            };
            tally.lock().unwrap().live_control = Some(outcome);
        }
        if o.plant_violation {
            plant_violation(&client, &n).await?;
        }
        proxy
            .share_per_mille
            .store(o.share_per_mille, Ordering::Relaxed);
        let _ = phase_tx.send(Phase::Chaos);
        let chaos_t0 = Instant::now();
        let churn_task = tokio::spawn(churn(
            client.clone(),
            n.clone(),
            mig_names,
            live.is_some(),
            tally.clone(),
            o.seed,
            phase_rx.clone(),
        ));
        let live_task = live.as_ref().map(|l| {
            tokio::spawn(live_migrations(
                client.clone(),
                n.clone(),
                Live {
                    agents: l.agents.clone(),
                    watching: l.watching.clone(),
                    fresh: l.fresh.clone(),
                },
                tally.clone(),
                o.seed,
                phase_rx.clone(),
            ))
        });
        let mut restarted = !o.api_restart;
        while chaos_t0.elapsed() < o.duration {
            if !restarted && chaos_t0.elapsed() >= o.duration / 2 {
                restarted = true;
                eprintln!("[chaos] restarting the API server");
                match restart_api_server().await {
                    Ok(d) => {
                        let mut t = tally.lock().unwrap();
                        t.api_restarts += 1;
                        t.api_restart_secs.push(d.as_secs_f64());
                        eprintln!("[chaos] API server back after {:.1} s", d.as_secs_f64());
                    }
                    Err(e) => violation(&tally, format!("the API server restart failed: {e:#}")),
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // The last fault: no more kills, no more injected errors.
        let _ = phase_tx.send(Phase::Settle);
        proxy.share_per_mille.store(0, Ordering::Relaxed);
        let faults_secs = chaos_t0.elapsed();
        let last_fault = Instant::now();
        let _ = churn_task.await;
        // The live migration in flight ends (it must, within CONVERGENCE) while the
        // rest settles.
        let replicas_now = ids();
        let (conv, _) = tokio::join!(
            await_convergence(&client, &n, &replicas_now, &tally, "after the last fault"),
            async {
                if let Some(t) = live_task {
                    let _ = t.await;
                }
            }
        );
        let conv = conv.map(|_| last_fault.elapsed());
        stop_live_sampler.store(true, Ordering::Relaxed);
        // A last sampled round after convergence.
        tokio::time::sleep(SAMPLE_EVERY).await;
        teardown(&client, &n, &tally, true).await;
        let _ = phase_tx.send(Phase::Stop);
        let _ = sampler_task.await;
        let _ = replicas_task.await;
        Ok::<_, anyhow::Error>((proxy, baseline, conv, faults_secs))
    }
    .await;
    let _ = phase_tx.send(Phase::Stop);
    stop_live_sampler.store(true, Ordering::Relaxed);
    if let Some(t) = live_sampler_thread {
        let _ = t.join();
    }
    if let Some(a) = live_agents {
        let a = a.lock().unwrap_or_else(|e| e.into_inner());
        for (i, node) in MIG_NODES.iter().enumerate() {
            let _ = std::fs::write(dir.join(format!("agent-{node}.log")), a.tb.agent_log(i));
        }
    }
    let (proxy, baseline, conv, faults_secs) = match res {
        Ok(v) => v,
        Err(e) => {
            teardown(&client, &n, &tally, false).await;
            return Err(e);
        }
    };

    let t = tally.lock().unwrap();
    let conflicts = proxy.conflicts.load(Ordering::Relaxed);
    let throttles = proxy.throttles.load(Ordering::Relaxed);
    let total = t.leader_kills + conflicts + throttles + t.api_restarts;
    println!();
    println!(
        "chaos run: {} ({} s of faults, write fault share {}‰, seed {})",
        if o.long { "long" } else { "short" },
        faults_secs.as_secs(),
        o.share_per_mille,
        o.seed
    );
    println!("{:<44} {:>8}", "fault", "count");
    println!("{:<44} {:>8}", "leader SIGKILLed", t.leader_kills);
    println!(
        "{:<44} {:>8}",
        "write answered 409 Conflict (proxy)", conflicts
    );
    println!(
        "{:<44} {:>8}",
        "write answered 429 Too Many Requests (proxy)", throttles
    );
    println!("{:<44} {:>8}", "API server restarted", t.api_restarts);
    println!("{:<44} {:>8}", "total faults", total);
    println!(
        "{:<44} {:>8}",
        "writes forwarded",
        proxy.writes_forwarded.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "reads/watches forwarded",
        proxy.reads_forwarded.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "proxy: API server unreachable (503)",
        proxy.upstream_errors.load(Ordering::Relaxed)
    );
    println!(
        "{:<44} {:>8}",
        "replicas started (after the first two)", t.replica_starts
    );
    println!(
        "{:<44} {:>8}",
        "replicas that exited by themselves",
        t.self_exits.len()
    );
    println!(
        "{:<44} {:>8}",
        "kill rounds without a live leader (retried)", t.kill_rounds_without_leader
    );
    for (what, c) in &t.churn {
        println!("{:<44} {:>8}", format!("churn: {what}"), c);
    }
    println!(
        "{:<44} {:>8}",
        "migration target pods seen",
        t.seen_migration_children
            .iter()
            .filter(|c| c.starts_with("target pod"))
            .count()
    );
    println!(
        "{:<44} {:>8}",
        "migration transfer keys seen",
        t.seen_migration_children
            .iter()
            .filter(|c| c.starts_with("transfer-key"))
            .count()
    );
    for (what, c) in &t.live_outcomes {
        println!("{:<44} {:>8}", format!("live migration: {what}"), c);
    }
    for (at, c) in &t.live_deleted_in {
        println!(
            "{:<44} {:>8}",
            format!("live migration deleted in phase {at}"),
            c
        );
    }
    if o.live {
        println!(
            "{:<44} {:>8}",
            "live migration without faults (live-0)",
            t.live_control.as_deref().unwrap_or("-")
        );
        println!(
            "{:<44} {:>8}",
            "live under faults: committed / rolled back",
            format!(
                "{} / {}",
                t.live_committed,
                t.live_rolled_back_deleted + t.live_rolled_back_failed
            )
        );
        println!(
            "{:<44} {:>8}",
            "  rolled back: deleted in flight / failed",
            format!(
                "{} / {}",
                t.live_rolled_back_deleted, t.live_rolled_back_failed
            )
        );
        println!(
            "{:<44} {:>8}",
            "live: client connection kept / reopened",
            format!("{} / {}", t.live_conn_kept, t.live_conn_reopened)
        );
        println!(
            "{:<44} {:>8}",
            "live: process samples (one copy, ≤1 running)", t.live_process_samples
        );
        println!(
            "{:<44} {:>8}",
            "live: per-round checks (copy, counter, images)", t.live_round_checks
        );
        println!(
            "{:<44} {:>8}",
            "live: last migration ended after last fault (s)",
            t.live_settle_secs
                .map(|s| format!("{s:.1}"))
                .unwrap_or_else(|| "-".into())
        );
    } else {
        println!("live migrations: skipped (--no-live-migrations or PODMOTION_ROOT_TESTS=0)");
    }
    println!(
        "{:<44} {:>8}",
        "churn writes failed (API server away)", t.driver_errors
    );
    println!(
        "{:<44} {:>8}",
        "sampled rounds (skipped: API away)",
        format!("{} ({})", t.sample_rounds, t.sample_rounds_skipped)
    );
    println!(
        "{:<44} {:>8}",
        "invariant checks",
        t.checks + t.live_process_samples + t.live_round_checks
    );
    println!("{:<44} {:>8}", "violations (distinct)", t.violations.len());
    println!(
        "{:<44} {:>8}",
        "failover after a kill: median / max (s)",
        format!("{:.1} / {:.1}", median(&t.failovers), max(&t.failovers))
    );
    println!(
        "{:<44} {:>8}",
        "deletion latency: median / max (s)",
        format!(
            "{:.1} / {:.1}",
            median(&t.deletion_secs),
            max(&t.deletion_secs)
        )
    );
    if !t.api_restart_secs.is_empty() {
        println!(
            "{:<44} {:>8}",
            "API server restart took (s)",
            format!("{:.1}", max(&t.api_restart_secs))
        );
    }
    println!(
        "{:<44} {:>8}",
        "baseline settled in (s)",
        format!("{:.1}", baseline.unwrap_or_default().as_secs_f64())
    );
    println!(
        "{:<44} {:>8}",
        "converged after the last fault in (s)",
        conv.map(|d| format!("{:.1}", d.as_secs_f64()))
            .unwrap_or_else(|| "NO".into())
    );
    println!(
        "{:<44} {:>8}",
        "run length (s)",
        started.elapsed().as_secs()
    );
    for e in &t.self_exits {
        println!("self-exit: {e}");
    }
    for (v, times) in &t.violations {
        println!("VIOLATION (seen {times}x): {v}");
    }
    Ok(t.violations.is_empty())
}
