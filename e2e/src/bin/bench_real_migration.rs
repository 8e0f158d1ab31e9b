//! Benchmark (not a test): downtime of PodMigrations of a real container between the two
//! real nodes, beside raw CRIU of the same container, side by side in one run (issue 15;
//! the ratios issue 18 sets targets for).
//!
//!     eval "$(hack/cluster.sh env)"       # the cluster with real nodes, images pushed
//!     cargo build -p podmotion-e2e --bin bench_real_migration
//!     PODMOTION_IMAGES_VALUES=… PODMOTION_IMAGES_LIST=… \
//!       target/debug/bench_real_migration [--rounds 3] [--sizes 64,512,2048] [--dirty-kib 1024] [--mig-first] [--timeline]
//!
//! The chart is installed from our images by the real-node tests' fixture
//! ([`podmotion_e2e::real::helm_install`]), with the agents' checkpoint tmpfs
//! (`migrationAgent.checkpointSizeLimit`) and memory limit sized for the largest of
//! `--sizes` (MiB; `agent_memory_mib`: twice the pod for PreCopy, whose final dump
//! is written beside the warm copy without soft-dirty tracking, plus a quarter and
//! 256 MiB; the limit 1 GiB above; never below the chart's 2Gi / 3Gi — 5376Mi / 6400Mi
//! for 2048), and `migrationAgent.postCopy.enabled` for the PostCopy arm. Each PodMigration gets `deadlineSeconds` 900 and
//! `progressTimeoutSeconds` 600 (a 2 GiB one takes about half a minute here); the
//! testload pods have no memory limit. For each size two Deployments of the
//! `testload` fixture run on the real nodes (`serve 8080 <MiB> <dirty KiB/s>`, readiness
//! probe): `mig-<MiB>` is moved by a PodMigration to the other real node in every
//! migration round (then the adopted pod is deleted: an adopted pod cannot be migrated
//! again, so the next round moves the fresh pod its ReplicaSet makes); `raw-<MiB>` gives
//! a fresh pod of the same spec for every raw round. In every round, for each mode
//! (`Mode::ALL`: Cold, PreCopy, PostCopy), one PodMigration and one raw CRIU checkpoint/restore
//! run, alternating which goes first; nothing is timed before the pod's ballast is
//! written.
//!
//! * **PodMotion**: `status.downtimeMillis` as the operator reports it (the source agent's
//!   freeze start — before it locks the pod's network — to the target agent's CRIU
//!   restore returning), `status.progress.bytesSent`, and the agents' own log lines of
//!   that migration (final dump ms and bytes, restore ms).
//! * **Agent memory**, of the source's and the target's migration agent over each
//!   PodMigration (its creation to its final phase; the agents' pods are found in the
//!   release's agents namespace by node, their `podmotion-agent` process by pod UID in
//!   its cgroup, [`podmotion_e2e::real::agents::agent_pids`]). Two figures, not to be
//!   confused: **agent VmHWM**, the peak resident memory of the agent process itself
//!   (`/proc/<pid>/status`, reset before with `clear_refs` 5; DESIGN.md's "agent peak
//!   RSS"), and the **agent container memory-cgroup peak**: everything charged to the
//!   agent container — the agent, the CRIU it runs and the checkpoint images staged
//!   on its tmpfs — (cgroup v1 `memory.max_usage_in_bytes`, reset by writing 0; v2
//!   `memory.peak` through a file reset when the migration starts). A figure that
//!   cannot be read is printed `n/a`, with the reason once on stderr; the run goes on.
//! * **raw CRIU**, on the raw pod's node, through the same `criu swrk` RPC and the same
//!   dump options as the agent's final dump (its external netns and the container's
//!   runtime bind and cgroup mounts as external mounts, `tcp-established`,
//!   `leave-stopped`, cgroups ignored), CRIU run in that node's mount namespace; the
//!   images go to a directory on `/dev/shm` (tmpfs), are copied with `cp -r` to a second
//!   directory there (the same-host lower bound of a transfer), and are restored from
//!   it with the container's own root filesystem as root, each external mount bound to
//!   the same source mount, into a fresh network namespace (`tcp-close`, as the agents
//!   restore when the pod address cannot move). Downtime = dump + copy + restore. The
//!   restored copy must answer a counter at least as large as the one read before the
//!   dump; then it, the stopped source and the pod are killed, and the network namespace
//!   and the image directories removed.
//!
//! Printed: one row per round and mode (both sides, and both agents' VmHWM and cgroup
//! peak, source / target), then per size and mode the medians, the median ratio and
//! the largest VmHWM and cgroup peak over the rounds, plus PreCopy ÷ Cold and
//! PostCopy ÷ Cold. A PostCopy round's downtime is the same measure (freeze to the
//! restored copy running); its memory then comes over `LazyPages`, shown as
//! `+ … lazy` beside the bytes sent, and its total time includes that phase.
#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use podmotion_agent::containers::Containers;
use podmotion_agent::criu::{self, Criu, InheritFd, Opts, Req};
use podmotion_agent::mounts::{self, HostView};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::agents::agent_pids;
use podmotion_e2e::real::testload::{self, POD_TIMEOUT, addr, ask, node_of};
use podmotion_e2e::real::{Images, helm_install, kubectl, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, run_dir, wait_for,
    wait_list,
};
use serde_json::json;

/// A PodMigration mode the bench runs: every round runs each of [`Mode::ALL`], in
/// that order (a new mode is one more variant here and in `ALL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Cold,
    PreCopy,
    PostCopy,
}

impl Mode {
    const ALL: [Mode; 3] = [Mode::Cold, Mode::PreCopy, Mode::PostCopy];

    /// `spec.mode`.
    fn name(self) -> &'static str {
        match self {
            Mode::Cold => "Cold",
            Mode::PreCopy => "PreCopy",
            Mode::PostCopy => "PostCopy",
        }
    }

    /// How many times the pod's memory the source agent's checkpoint tmpfs holds at
    /// once (the chart's `migrationAgent.checkpointSizeLimit`): Cold the one dump,
    /// PreCopy without soft-dirty tracking the final dump beside the warm copy,
    /// PostCopy none (its memory stays in the stopped source until asked for).
    fn images_per_pod(self) -> u32 {
        match self {
            Mode::Cold => 1,
            Mode::PreCopy => 2,
            Mode::PostCopy => 0,
        }
    }
}

/// One raw CRIU checkpoint/copy/restore of a fresh pod's container.
#[derive(Debug)]
struct Raw {
    node: String,
    dump_ms: f64,
    copy_ms: f64,
    restore_ms: f64,
    bytes: u64,
}

impl Raw {
    fn downtime_ms(&self) -> f64 {
        self.dump_ms + self.copy_ms + self.restore_ms
    }
}

/// One PodMigration, as its status and the agents' logs report it.
#[derive(Debug)]
struct Mig {
    from: String,
    to: String,
    downtime_ms: i64,
    bytes_sent: i64,
    /// PostCopy: the memory the restored copy fetched after its resume.
    lazy_bytes: Option<i64>,
    iterations: i32,
    final_dump_ms: Option<u64>,
    final_dump_bytes: Option<u64>,
    restore_ms: Option<u64>,
    /// Creation of the PodMigration to its final phase, as `phaseTransitionTimestamps`
    /// say (second resolution).
    total_s: i64,
}

struct Row {
    size: u32,
    mode: Mode,
    round: usize,
    raw: Result<Raw, String>,
    mig: Result<Mig, String>,
    /// The two agents' memory over the PodMigration (also of one that failed, once it
    /// was created).
    agents: AgentPeaks,
}

/// Bytes, or why they could not be read (printed "n/a").
type Reading = Result<u64, String>;

/// The peak memory of the source's and the target's migration agent over one
/// PodMigration (`[source, target]`).
#[derive(Debug)]
struct AgentPeaks {
    /// `VmHWM` of the `podmotion-agent` process: its own peak resident memory.
    rss: [Reading; 2],
    /// The peak of the agent container's memory cgroup: the agent, the CRIU it runs
    /// and the checkpoint images staged on its tmpfs (`emptyDir` of medium Memory,
    /// charged to the container that writes them).
    cgroup: [Reading; 2],
}

impl AgentPeaks {
    fn not_measured(why: &str) -> AgentPeaks {
        let na = || Err(why.to_owned());
        AgentPeaks {
            rss: [na(), na()],
            cgroup: [na(), na()],
        }
    }

    fn rss_cell(&self) -> String {
        format!("{} / {}", reading(&self.rss[0]), reading(&self.rss[1]))
    }

    fn cgroup_cell(&self) -> String {
        format!(
            "{} / {}",
            reading(&self.cgroup[0]),
            reading(&self.cgroup[1])
        )
    }
}

fn reading(r: &Reading) -> String {
    r.as_ref().map_or_else(|_| "n/a".into(), |b| mib(*b))
}

struct Args {
    rounds: usize,
    sizes: Vec<u32>,
    dirty_kib: u32,
    /// The first round's Cold starts with the PodMigration instead of raw CRIU.
    mig_first: bool,
    /// After each PodMigration, print the operator's and both agents' log lines about it,
    /// in time order (where the freeze goes between the dump and the restore).
    timeline: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        rounds: 3,
        sizes: vec![64, 512],
        dirty_kib: 1024,
        mig_first: false,
        timeline: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--rounds" => a.rounds = value()?.parse()?,
            "--sizes" => {
                a.sizes = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--dirty-kib" => a.dirty_kib = value()?.parse()?,
            "--mig-first" => a.mig_first = true,
            "--timeline" => a.timeline = true,
            other => bail!(
                "unknown argument {other}; usage: bench_real_migration [--rounds N] [--sizes 64,512] [--dirty-kib 1024] [--mig-first] [--timeline]"
            ),
        }
    }
    Ok(a)
}

fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let (op, nodes, app) = namespaces_and_nodes().await?;
    let images = Images::load()?;
    let testload_image = images.testload()?;
    eprintln!(
        "load {} — installing the chart from {} ({testload_image})",
        uptime(),
        images.path.display()
    );
    let release = format!("pm{}", random_suffix());
    let agents_ns = format!("{}-agents", op.name);
    let values = chart_values(&args);
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-bench-real",
        &values.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let bench = Bench {
        work: Work::new()?,
        pods: app.api(),
        pms: app.api(),
        deploys: app.api(),
        agent_pods: Api::namespaced(op.client.clone(), &agents_ns),
        nodes,
        agents_ns,
        testload_image,
        args,
        said: Mutex::default(),
    };
    // SIGINT drops the run where it is: its guards kill what a raw round started, and
    // the namespaces and the release go as for a finished run.
    let (rows, loads) = tokio::select! {
        r = bench.run() => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    };
    print_table(&rows, &loads);
    Ok(())
}

/// The operator's namespace, the real nodes (two at least), and the workload's
/// namespace.
async fn namespaces_and_nodes() -> anyhow::Result<(TestNamespace, Vec<String>, TestNamespace)> {
    let Some(op) = TestNamespace::new("bench-real-op", PodSecurity::Restricted).await else {
        bail!("PODMOTION_E2E=0");
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        bail!("PODMOTION_REAL_NODES=0");
    };
    ensure!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // The workload runs as uid 0: see docs/migration-controller.md, "Container user".
    let Some(app) = TestNamespace::new("bench-real-app", PodSecurity::Baseline).await else {
        bail!("PODMOTION_E2E=0");
    };
    Ok((op, nodes, app))
}

/// The chart's values for the run: the agents' checkpoint size and memory limits for
/// the pods' sizes, post-copy on, and (`--timeline`) the operator's debug log.
fn chart_values(args: &Args) -> Vec<String> {
    let (checkpoint_mib, agent_limit_mib) = agent_memory_mib(&args.sizes);
    eprintln!("agents: checkpointSizeLimit {checkpoint_mib}Mi, memory limit {agent_limit_mib}Mi");
    let mut values = vec![
        "--set-string".to_owned(),
        format!(
            "migrationAgent.checkpointSizeLimit={checkpoint_mib}Mi,\
             migrationAgent.agent.resources.limits.memory={agent_limit_mib}Mi"
        ),
        "--set".to_owned(),
        "migrationAgent.postCopy.enabled=true".to_owned(),
    ];
    if args.timeline {
        // The timeline shows each reconcile of the migration (its start and length).
        values.extend([
            "--set".to_owned(),
            r"operator.logFilter=info\,podmotion_operator=debug\,kube=warn".to_owned(),
        ]);
    }
    values
}

/// The chart's `migrationAgent.checkpointSizeLimit` and the agent container's memory
/// limit (MiB) for pods of `sizes` MiB in every mode: the largest pod's memory as many
/// times as a mode stages it ([`Mode::images_per_pod`]), plus a quarter (the images'
/// own overhead, the agent's 10% room margin) and 256 MiB; the limit is that plus
/// 1 GiB for the agent and its CRIU. Never below the chart's defaults (2Gi, 3Gi).
fn agent_memory_mib(sizes: &[u32]) -> (u32, u32) {
    let staged = sizes
        .iter()
        .flat_map(|s| Mode::ALL.map(|m| s * m.images_per_pod()))
        .max()
        .unwrap_or(0);
    let checkpoint = (staged + staged / 4 + 256).max(2048);
    (checkpoint, (checkpoint + 1024).max(3072))
}

/// One run's settings, cluster handles and scratch.
struct Bench {
    work: Work,
    pods: Api<Pod>,
    pms: Api<PodMigration>,
    deploys: Api<Deployment>,
    /// The release's migration agents (one per real node).
    agent_pods: Api<Pod>,
    nodes: Vec<String>,
    agents_ns: String,
    testload_image: String,
    args: Args,
    /// Why a memory reading was n/a, said once each.
    said: Mutex<BTreeSet<String>>,
}

impl Bench {
    /// Every size's rounds (the load average after each size), its Deployments
    /// created first and deleted after.
    async fn run(&self) -> anyhow::Result<(Vec<Row>, Vec<String>)> {
        let mut rows = vec![];
        let mut loads = vec![format!("start {}", uptime())];
        for &size in &self.args.sizes {
            let names = self.create_deployments(size).await?;
            for round in 0..self.args.rounds {
                for (i, mode) in Mode::ALL.into_iter().enumerate() {
                    let raw_first = (round + i + usize::from(self.args.mig_first)) % 2 == 0;
                    rows.push(self.round(size, mode, round, raw_first).await);
                }
            }
            loads.push(format!("after {size} MiB {}", uptime()));
            // Free the memory before the next size.
            self.delete_deployments(names).await?;
        }
        Ok((rows, loads))
    }

    /// The `mig-<size>` and `raw-<size>` Deployments of the testload fixture.
    async fn create_deployments(&self, size: u32) -> anyhow::Result<Vec<String>> {
        let mut names = vec![];
        for kind in ["mig", "raw"] {
            let name = format!("{kind}-{size}");
            // The ballast is rewritten at the dirty rate while the pod runs.
            let mut d =
                serde_json::to_value(testload::deployment(&name, &self.testload_image, size))?;
            d["spec"]["template"]["spec"]["containers"][0]["args"]
                .as_array_mut()
                .context("testload args")?
                .push(json!(self.args.dirty_kib.to_string()));
            let d: Deployment = from_json(d);
            self.deploys.create(&PostParams::default(), &d).await?;
            names.push(name);
        }
        Ok(names)
    }

    /// Deletes the Deployments `names` and waits until their pods are gone.
    async fn delete_deployments(&self, names: Vec<String>) -> anyhow::Result<()> {
        for name in names {
            self.deploys.delete(&name, &DeleteParams::default()).await?;
            wait_list(
                &self.pods,
                &format!("app={name}"),
                POD_TIMEOUT,
                "the pods gone",
                |ps| ps.is_empty(),
            )
            .await?;
        }
        Ok(())
    }

    /// One raw round and one PodMigration of `size` MiB in `mode`, the raw one first
    /// when `raw_first`.
    async fn round(&self, size: u32, mode: Mode, round: usize, raw_first: bool) -> Row {
        let mut raw = None;
        let mut mig = None;
        let mut agents = AgentPeaks::not_measured("the PodMigration was not created");
        for side in 0..2 {
            if (side == 0) == raw_first {
                let r = raw_round(&self.pods, &format!("raw-{size}"), &self.work, &self.nodes)
                    .await
                    .map_err(|e| format!("{e:#}"));
                eprintln!("{size} MiB {} round {round} raw: {r:?}", mode.name());
                raw = Some(r);
            } else {
                let name = format!("{}-{size}-r{round}", mode.name().to_lowercase());
                let m = mig_round(self, &format!("mig-{size}"), &name, mode, &mut agents)
                    .await
                    .map_err(|e| format!("{e:#}"));
                eprintln!(
                    "{size} MiB {} round {round} PodMigration: {m:?}; agent VmHWM source / target: {}; \
                     agent container memory-cgroup peak (with the checkpoint tmpfs) source / target: {}",
                    mode.name(),
                    agents.rss_cell(),
                    agents.cgroup_cell()
                );
                mig = Some(m);
            }
        }
        Row {
            size,
            mode,
            round,
            raw: raw.unwrap(),
            mig: mig.unwrap(),
            agents,
        }
    }

    /// `why` as the reason a memory reading is n/a, said (to stderr) the first time.
    fn na(&self, why: String) -> Reading {
        if self.said.lock().unwrap().insert(why.clone()) {
            eprintln!("NOTE: an agent memory figure is n/a: {why}");
        }
        Err(why)
    }

    /// Starts watching the agents on `nodes` (`[source, target]`): their peaks reset.
    async fn watch_agents(&self, nodes: [&str; 2]) -> [Result<AgentWatch, String>; 2] {
        let pods = match self.agent_pods.list(&Default::default()).await {
            Ok(l) => l.items,
            Err(e) => {
                let why = format!("listing the agent pods in {}: {e}", self.agents_ns);
                return [Err(why.clone()), Err(why)];
            }
        };
        nodes.map(|node| {
            let pod = pods
                .iter()
                .find(|p| {
                    node_of(p) == node
                        && p.labels()
                            .get("app.kubernetes.io/component")
                            .map(String::as_str)
                            == Some("migration-agent")
                })
                .with_context(|| format!("no migration agent pod on {node}"))
                .map_err(|e| format!("{e:#}"))?;
            AgentWatch::start(&pod.uid().unwrap_or_default())
                .map_err(|e| format!("the agent on {node}: {e:#}"))
        })
    }

    /// The peaks since [`Bench::watch_agents`].
    fn agent_peaks(&self, watches: &mut [Result<AgentWatch, String>; 2]) -> AgentPeaks {
        let mut peaks = AgentPeaks::not_measured("");
        for (i, w) in watches.iter_mut().enumerate() {
            let (rss, cgroup) = match w {
                Ok(w) => (
                    w.rss_peak().map_err(|e| format!("{e:#}")),
                    w.cgroup_peak().map_err(|e| format!("{e:#}")),
                ),
                Err(why) => (Err(why.clone()), Err(why.clone())),
            };
            peaks.rss[i] = rss.or_else(|e| self.na(format!("agent VmHWM: {e}")));
            peaks.cgroup[i] = cgroup.or_else(|e| self.na(format!("agent memory-cgroup peak: {e}")));
        }
        peaks
    }
}

/// One node agent's process and memory cgroup, their peaks reset when it was found.
struct AgentWatch {
    pid: u32,
    cgroup: Result<CgroupPeak, String>,
}

/// The peak of a memory cgroup since it was reset.
enum CgroupPeak {
    /// cgroup v1: `memory.max_usage_in_bytes` (reset by writing 0).
    V1(PathBuf),
    /// cgroup v2: `memory.peak`, reset for reads through this open file only.
    V2(std::fs::File),
}

impl AgentWatch {
    /// The `podmotion-agent` process of the agent pod `uid` (`agent_pids`), its VmHWM
    /// reset (`clear_refs` 5) and its container's memory-cgroup peak reset.
    fn start(uid: &str) -> anyhow::Result<AgentWatch> {
        let pids = agent_pids(&[uid.to_owned()]);
        let [pid] = pids[..] else {
            bail!("{} podmotion-agent processes in pod {uid}", pids.len());
        };
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .with_context(|| format!("resetting VmHWM: /proc/{pid}/clear_refs"))?;
        let cgroup = CgroupPeak::reset(pid).map_err(|e| format!("{e:#}"));
        Ok(AgentWatch { pid, cgroup })
    }

    fn rss_peak(&self) -> anyhow::Result<u64> {
        let pid = self.pid;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("the agent process {pid} is gone (restarted?)"))?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no VmHWM in /proc/<pid>/status")?;
        Ok(kib << 10)
    }

    fn cgroup_peak(&mut self) -> anyhow::Result<u64> {
        let pid = self.pid;
        ensure!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "the agent process {pid} is gone (restarted?)"
        );
        match &mut self.cgroup {
            Ok(peak) => peak.read(),
            Err(why) => bail!("{why}"),
        }
    }
}

impl CgroupPeak {
    /// The memory cgroup of `pid` (cgroup v1 `memory` hierarchy, else v2), its peak reset.
    fn reset(pid: u32) -> anyhow::Result<CgroupPeak> {
        let path = format!("/proc/{pid}/cgroup");
        let cgroups = std::fs::read_to_string(&path).with_context(|| path.clone())?;
        let mut v2 = None;
        for line in cgroups.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(dir)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let dir = dir.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                let file = Path::new("/sys/fs/cgroup/memory")
                    .join(dir)
                    .join("memory.max_usage_in_bytes");
                std::fs::write(&file, "0")
                    .with_context(|| format!("resetting {}", file.display()))?;
                return Ok(CgroupPeak::V1(file));
            }
            if controllers.is_empty() {
                v2 = Some(dir.to_owned());
            }
        }
        let dir = v2.with_context(|| format!("no memory cgroup in {path}"))?;
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let file = Path::new(root).join(&dir).join("memory.peak");
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&file)
            {
                f.write_all(b"reset")
                    .with_context(|| format!("resetting {} (kernel < 6.12?)", file.display()))?;
                return Ok(CgroupPeak::V2(f));
            }
        }
        bail!("no memory.peak of the cgroup v2 {dir} (no v1 memory hierarchy either)")
    }

    fn read(&mut self) -> anyhow::Result<u64> {
        let text = match self {
            CgroupPeak::V1(file) => {
                std::fs::read_to_string(&*file).with_context(|| file.display().to_string())?
            }
            CgroupPeak::V2(f) => {
                let mut s = String::new();
                f.rewind()?;
                f.read_to_string(&mut s).context("reading memory.peak")?;
                s
            }
        };
        text.trim()
            .parse()
            .with_context(|| format!("memory peak {text:?}"))
    }
}

/// This run's scratch: the image directories (tmpfs) and the CRIU wrappers.
struct Work {
    /// `/dev/shm/pm-bench-real-<id>`: the images, on tmpfs.
    shm: PathBuf,
    /// `/tmp/pm-bench-real-<id>`: the wrapper scripts (executable).
    bin: PathBuf,
    id: String,
}

impl Work {
    fn new() -> anyhow::Result<Work> {
        let id = random_suffix();
        let w = Work {
            shm: PathBuf::from(format!("/dev/shm/pm-bench-real-{id}")),
            bin: PathBuf::from(format!("/tmp/pm-bench-real-{id}")),
            id,
        };
        for d in [&w.shm, &w.bin] {
            std::fs::create_dir_all(d)?;
            std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        }
        Ok(w)
    }

    /// A `criu` that runs in `node`'s mount namespace (where the runtime spec's paths
    /// and the container's root filesystem are), with `redirects` (shell) applied.
    fn criu(&self, node: &str, name: &str, redirects: &str) -> anyhow::Result<Criu> {
        let path = self.bin.join(name);
        let ns = run_dir().join("ns").join(node);
        let script = format!(
            "#!/bin/bash\nexec nsenter --mount={} -- {} \"$@\" {redirects}\n",
            ns.display(),
            podmotion_agent::testbed::criu_path().display()
        );
        std::fs::write(&path, script)?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
        Ok(Criu { binary: path })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.shm);
        let _ = std::fs::remove_dir_all(&self.bin);
    }
}

/// What one raw round leaves, removed on every exit path: the restored copy and the
/// stopped source (killed), the network namespace, the image directories.
struct RawCleanup {
    netns: String,
    dir: PathBuf,
    pids: Vec<i32>,
}

impl RawCleanup {
    /// A fresh image directory (with its `src`) on the run's tmpfs, and a fresh network
    /// namespace for the restored copy.
    fn new(work: &Work, n: &str) -> anyhow::Result<RawCleanup> {
        let cleanup = RawCleanup {
            netns: format!("pmbench-{}-{n}", work.id),
            dir: work.shm.join(n),
            pids: vec![],
        };
        std::fs::create_dir_all(cleanup.dir.join("src"))?;
        let st = Command::new("ip")
            .args(["netns", "add", &cleanup.netns])
            .status()?;
        ensure!(st.success(), "ip netns add {}", cleanup.netns);
        Ok(cleanup)
    }
}

impl Drop for RawCleanup {
    fn drop(&mut self) {
        for pid in &self.pids {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.netns])
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The one Running, Ready pod of `app` whose ballast is written.
async fn ready_pod(pods: &Api<Pod>, app: &str) -> anyhow::Result<Pod> {
    let p = wait_list(
        pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        "one Ready pod",
        |ps| {
            ps.len() == 1
                && pod_running_ready(&ps[0])
                && ps[0].metadata.deletion_timestamp.is_none()
        },
    )
    .await?[0]
        .clone();
    let a = addr(&p);
    for _ in 0..1500 {
        if ask(&a, "ballast").is_ok_and(|x| x == "filled") {
            return Ok(p);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    bail!("{}: the ballast was never filled", p.name_any())
}

fn netns_ino(pid: i32) -> anyhow::Result<String> {
    Ok(std::fs::read_link(format!("/proc/{pid}/ns/net"))?
        .to_string_lossy()
        .chars()
        .filter(char::is_ascii_digit)
        .collect())
}

fn criu_call(criu: Criu, req: Req, log: PathBuf) -> anyhow::Result<criu::Resp> {
    Ok(criu.call(req, Some(&log))?)
}

/// A raw round on a fresh pod of `app`, which is deleted afterwards whatever happened
/// (its container was dumped and killed, or may have been).
async fn raw_round(
    pods: &Api<Pod>,
    app: &str,
    work: &Work,
    nodes: &[String],
) -> anyhow::Result<Raw> {
    let pod = ready_pod(pods, app).await?;
    let res = raw_checkpoint_restore(&pod, work, nodes).await;
    delete_now(pods, &pod.name_any()).await?;
    res
}

/// Deletes the pod `name` without a grace period.
async fn delete_now(pods: &Api<Pod>, name: &str) -> anyhow::Result<()> {
    pods.delete(
        name,
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..Default::default()
        },
    )
    .await?;
    Ok(())
}

async fn raw_checkpoint_restore(pod: &Pod, work: &Work, nodes: &[String]) -> anyhow::Result<Raw> {
    let c = container_of(pod, nodes).await?;
    let before: u64 = ask(&addr(pod), "get")?.parse()?;

    let n = random_suffix();
    let mut cleanup = RawCleanup::new(work, &n)?;
    let (src, dst) = (cleanup.dir.join("src"), cleanup.dir.join("dst"));
    // Restore: fd 90 the fresh netns, 91–93 stand for the shim's stdio pipes (numbers
    // far above the RPC socket's, which the wrapper passes on).
    let dump_criu = work.criu(&c.node, &format!("criu-dump-{n}"), "")?;
    let restore_criu = work.criu(
        &c.node,
        &format!("criu-restore-{n}"),
        &format!(
            "90</run/netns/{} 91</dev/null 92>/dev/null 93>/dev/null",
            cleanup.netns
        ),
    )?;
    let dump = dump_opts(&c, &src);
    let restore = restore_opts(&c, &dst)?;

    // Frozen from here.
    let (r, dump_ms) = timed_criu(dump_criu, criu::REQ_DUMP, dump, src.join("dump.log")).await?;
    // Stopped, not dead: killed when the round ends.
    cleanup.pids.push(c.pid);
    r.context("raw criu dump")?;
    let t1 = Instant::now();
    let st = Command::new("cp").arg("-r").arg(&src).arg(&dst).status()?;
    let copy_ms = ms(t1.elapsed());
    ensure!(st.success(), "cp -r");
    let (r, restore_ms) = timed_criu(
        restore_criu,
        criu::REQ_RESTORE,
        restore,
        dst.join("restore.log"),
    )
    .await?;
    let resp = r.context("raw criu restore")?;
    let restored = resp.restore.map(|r| r.pid).unwrap_or(0);
    ensure!(restored > 0, "criu reported no restored pid");
    cleanup.pids.insert(0, restored);
    let bytes = podmotion_agent::images::size(&dst);

    let after = restored_counter(&cleanup.netns)?;
    ensure!(
        after >= before,
        "the restored copy's counter went back: {before} then {after}"
    );
    drop(cleanup);
    Ok(Raw {
        node: c.node,
        dump_ms,
        copy_ms,
        restore_ms,
        bytes,
    })
}

/// A pod's container as the agent finds it: its node, process, network namespace
/// and stdio pipes, its external mounts, and its mounts with the root filesystem at
/// its path in the node's mount namespace.
struct Source {
    node: String,
    pid: i32,
    ino: String,
    stdio: Vec<mounts::StdioPipe>,
    externals: Vec<String>,
    holder: mounts::Holder,
}

/// The container of `pod` (on one of `nodes`), resolved through the node's
/// containerd as the agent resolves it.
async fn container_of(pod: &Pod, nodes: &[String]) -> anyhow::Result<Source> {
    let node = node_of(pod);
    ensure!(nodes.contains(&node), "{} on {node}", pod.name_any());
    let cid = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.clone())
        .context("container ID")?;
    let id = cid.rsplit("://").next().unwrap_or(&cid).to_owned();
    // The node's containerd, as the agent finds it (from the host: the node's run dir).
    let node_run = run_dir().join("nodes").join(&node).join("run");
    let resolved = Containers::Cri {
        run_dir: node_run.clone(),
        host: HostView {
            host_root: "/".into(),
        },
    }
    .resolve(std::slice::from_ref(&cid))
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let pid = resolved.pid;
    let fs = resolved.fs.context("no runtime spec")?;
    // The root filesystem at its path in the node's mount namespace.
    let rootfs = Path::new("/run").join(fs.rootfs.strip_prefix(&node_run).with_context(|| {
        format!(
            "rootfs {} outside {}",
            fs.rootfs.display(),
            node_run.display()
        )
    })?);
    ensure!(
        rootfs.ends_with(Path::new(&id).join("rootfs")),
        "rootfs {}",
        rootfs.display()
    );
    let mountinfo =
        mounts::parse_mountinfo(&std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))?);
    let externals = mounts::dump_externals(&fs.spec, &mountinfo);
    let stdio = mounts::stdio_pipes(pid);
    let ino = netns_ino(pid)?;
    Ok(Source {
        node,
        pid,
        ino,
        stdio,
        externals,
        holder: mounts::Holder {
            spec: fs.spec,
            mountinfo,
            rootfs,
        },
    })
}

/// The agent's final-dump options: its external netns and mounts, established TCP,
/// left stopped.
fn dump_opts(c: &Source, src: &Path) -> Opts {
    let mut dump = Opts::new(src, "dump.log");
    dump.pid = Some(c.pid);
    dump.external = vec![format!("net[{}]:podnet", c.ino)];
    dump.external
        .extend(mounts::dump_external_args(&c.externals));
    dump.tcp_established = Some(true);
    dump.tcp_skip_in_flight = Some(true);
    dump.leave_stopped = Some(true);
    dump
}

/// The restore's options: the fresh netns as fd 90, the stdio pipes from 91, each
/// external mount bound to the same source mount, the container's own root filesystem
/// as root, `tcp-close`.
fn restore_opts(c: &Source, dst: &Path) -> anyhow::Result<Opts> {
    let mut restore = Opts::new(dst, "restore.log");
    restore.inherit_fd = vec![InheritFd {
        key: "podnet".into(),
        fd: 90,
    }];
    for p in &c.stdio {
        if !restore.inherit_fd.iter().any(|f| f.key == p.key) {
            restore.inherit_fd.push(InheritFd {
                key: p.key.clone(),
                fd: 91 + p.fd,
            });
        }
    }
    restore.external = mounts::restore_external_args(
        &c.externals,
        &c.holder,
        &HostView {
            host_root: "/".into(),
        },
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    restore.root = Some(c.holder.rootfs.to_string_lossy().into_owned());
    restore.tcp_close = Some(true);
    Ok(restore)
}

/// One CRIU request of `kind` (logged to `log`), off the async threads; its answer and
/// how many ms it took.
async fn timed_criu(
    criu: Criu,
    kind: i32,
    opts: Opts,
    log: PathBuf,
) -> anyhow::Result<(anyhow::Result<criu::Resp>, f64)> {
    let t = Instant::now();
    let r = tokio::task::spawn_blocking(move || {
        criu_call(
            criu,
            Req {
                r#type: kind,
                opts: Some(opts),
            },
            log,
        )
    })
    .await?;
    Ok((r, ms(t.elapsed())))
}

/// The counter the restored copy serves on (inside its network namespace `netns`).
fn restored_counter(netns: &str) -> anyhow::Result<u64> {
    let answer = Command::new("ip")
        .args(["netns", "exec", netns, "bash", "-c"])
        .arg(
            "ip link set lo up && exec 3<>/dev/tcp/127.0.0.1/8080 && echo get >&3 \
             && read -t 10 l <&3 && echo $l",
        )
        .output()?;
    String::from_utf8_lossy(&answer.stdout)
        .trim()
        .parse()
        .with_context(|| {
            format!(
                "the restored copy's counter: {}",
                String::from_utf8_lossy(&answer.stderr)
            )
        })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `key=value` or `"key":value` in a log line.
fn log_field(line: &str, key: &str) -> Option<u64> {
    for pat in [format!("{key}="), format!("\"{key}\":")] {
        if let Some(i) = line.find(&pat) {
            let rest = &line[i + pat.len()..];
            let digits: String = rest
                .trim_start_matches('"')
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            return digits.parse().ok();
        }
    }
    None
}

/// Generous bounds of one PodMigration (`spec`; the largest pods take minutes), and how
/// long the bench waits for its end.
const DEADLINE_S: u64 = 900;
const PROGRESS_TIMEOUT_S: u64 = 600;
const MIGRATION_WAIT: Duration = Duration::from_secs(DEADLINE_S + 120);

/// One PodMigration of the pod of `app` to the other real node; the agents' peaks over
/// it go to `agents` (also when it fails, once it was created).
async fn mig_round(
    b: &Bench,
    app: &str,
    name: &str,
    mode: Mode,
    agents: &mut AgentPeaks,
) -> anyhow::Result<Mig> {
    let (pods, nodes, agents_ns) = (&b.pods, &b.nodes, b.agents_ns.as_str());
    let pod = ready_pod(pods, app).await?;
    let from = node_of(&pod);
    let to = nodes
        .iter()
        .take(2)
        .find(|n| **n != from)
        .context("another real node")?
        .clone();
    let pm = migration(name, &pod, &to, mode);
    let (st, uid) = migrate(b, name, &pm, [&from, &to], agents).await?;
    ensure!(
        st.phase == MigrationPhase::Succeeded,
        "{name} ended {:?}: {:?} {:?}",
        st.phase,
        st.failure_reason,
        st.failure_message
    );
    let target = st.target_pod.clone().context("status.targetPod")?;
    wait_list(
        pods,
        &format!("app={app}"),
        POD_TIMEOUT,
        "only the target pod",
        |ps| ps.len() == 1 && ps[0].name_any() == target,
    )
    .await?;
    // Every round starts from an ordinary pod, so rounds compare alike (an adopted pod
    // can move again, but its tree is the holder's child): the next round migrates a
    // fresh pod of the same Deployment.
    delete_now(pods, &target).await?;
    let [dumped, restored] =
        agent_log_lines(agents_ns, &uid, ["dumped; source left stopped", "restored"]);
    mig_of(from, to, &st, dumped, restored)
}

/// The PodMigration `name` of `pod` to the node `to` in `mode`.
fn migration(name: &str, pod: &Pod, to: &str, mode: Mode) -> PodMigration {
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod.name_any(), "targetNode": to, "mode": mode.name(),
            "freezeBudgetMillis": 600000, "deadlineSeconds": DEADLINE_S,
            "progressTimeoutSeconds": PROGRESS_TIMEOUT_S,
            "probe": {"tcpSocket": {"port": 8080}}}
    }))
}

/// Creates `pm` (the PodMigration `name`) and waits for its end, the peaks of the
/// agents on `nodes` over it going to `agents`; its final status and UID. With
/// `--timeline`, prints where it went (also when it failed: where it stopped).
async fn migrate(
    b: &Bench,
    name: &str,
    pm: &PodMigration,
    nodes: [&str; 2],
    agents: &mut AgentPeaks,
) -> anyhow::Result<(PodMigrationStatus, String)> {
    let pms = &b.pms;
    let mut watches = b.watch_agents(nodes).await;
    let created = pms.create(&PostParams::default(), pm).await?;
    let ended = wait_for(pms, name, MIGRATION_WAIT, "the PodMigration to end", |m| {
        m.and_then(|m| m.status.as_ref())
            .is_some_and(|s| s.phase.is_terminal())
    })
    .await;
    *agents = b.agent_peaks(&mut watches);
    let st = ended?
        .and_then(|m| m.status)
        .context("the PodMigration's status")?;
    let uid = created.uid().unwrap_or_default();
    if b.args.timeline {
        // Also of a migration that failed: where it stopped.
        print_timeline(&b.agents_ns, name, &uid);
    }
    Ok((st, uid))
}

/// The migration's figures from its status and the agents' log lines of its final
/// dump and its restore.
fn mig_of(
    from: String,
    to: String,
    st: &PodMigrationStatus,
    dumped: Option<String>,
    restored: Option<String>,
) -> anyhow::Result<Mig> {
    let progress = st.progress.clone().unwrap_or_default();
    Ok(Mig {
        from,
        to,
        downtime_ms: st.downtime_millis.context("status.downtimeMillis")?,
        bytes_sent: progress.bytes_sent,
        lazy_bytes: progress.lazy_bytes,
        iterations: progress.iteration,
        final_dump_ms: dumped.as_deref().and_then(|l| log_field(l, "dump_ms")),
        final_dump_bytes: dumped.as_deref().and_then(|l| log_field(l, "bytes")),
        restore_ms: restored.as_deref().and_then(|l| log_field(l, "restore_ms")),
        total_s: whole_migration_s(st),
    })
}

/// Creation of the PodMigration to its final phase, as `phaseTransitionTimestamps` say.
fn whole_migration_s(st: &PodMigrationStatus) -> i64 {
    let stamps = &st.phase_transition_timestamps;
    match (stamps.first(), stamps.last()) {
        (Some(a), Some(b)) => (b.time.0 - a.time.0).get_seconds(),
        _ => 0,
    }
}

/// The operator's and both migration agents' log lines that name the migration (by name
/// or uid), merged in the order of their kubelet timestamps, to stderr.
fn print_timeline(agents_ns: &str, name: &str, uid: &str) {
    // The release's namespace is the agents' without its suffix (`helm_install`).
    let op_ns = agents_ns.strip_suffix("-agents").unwrap_or(agents_ns);
    let mut lines: Vec<String> = [
        (
            agents_ns,
            "app.kubernetes.io/component=migration-agent",
            "agent",
        ),
        (op_ns, "app.kubernetes.io/component=operator", "operator"),
    ]
    .iter()
    .flat_map(|(ns, selector, container)| {
        pod_logs(
            ns,
            selector,
            container,
            &["--timestamps", "--prefix", "--tail=4000"],
        )
        .lines()
        .filter(|l| l.contains(uid) || l.contains(name))
        .map(str::to_owned)
        .collect::<Vec<_>>()
    })
    .collect();
    // `--prefix` puts `[pod/<name>/<container>] ` before the timestamp.
    lines.sort_by_key(|l| {
        l.split_once("] ")
            .map_or(String::new(), |(_, t)| t.to_owned())
    });
    eprintln!("timeline of {name} ({uid}):");
    for l in lines {
        eprintln!("  {l}");
    }
}

/// The first line of the migration agents' logs (their last 2,000 lines) about the
/// migration `uid` that contains each of `what`.
fn agent_log_lines<const N: usize>(
    agents_ns: &str,
    uid: &str,
    what: [&str; N],
) -> [Option<String>; N] {
    let logs = pod_logs(
        agents_ns,
        "app.kubernetes.io/component=migration-agent",
        "agent",
        &["--tail=2000"],
    );
    what.map(|what| {
        logs.lines()
            .find(|l| l.contains(uid) && l.contains(what))
            .map(str::to_owned)
    })
}

/// `kubectl logs` of `container` in the pods of `ns` that `selector` picks, with `flags`.
fn pod_logs(ns: &str, selector: &str, container: &str, flags: &[&str]) -> String {
    let mut args = vec!["-n", ns, "logs", "-l", selector, "-c", container];
    args.extend_from_slice(flags);
    String::from_utf8_lossy(&kubectl(&args).stdout).into_owned()
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "–".into())
}

fn print_table(rows: &[Row], loads: &[String]) {
    println!("load (1/5/15 min): {}", loads.join("; "));
    println!();
    println!(
        "| size | mode | round | raw node | raw dump / cp / restore ms | raw ms | raw bytes | PodMotion from → to | PodMotion downtime ms | ÷ raw | final dump ms / bytes | restore ms | bytes sent | rounds | whole migration s | agent VmHWM src / tgt | agent container memory-cgroup peak incl. checkpoint tmpfs, src / tgt |"
    );
    println!("|---|---|---:|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---|---|");
    for r in rows {
        println!("{}", round_line(r));
    }
    println!();
    println!(
        "| size | mode | rounds ok | median raw ms | median PodMotion downtime ms | median of per-round ÷ raw | max agent VmHWM src / tgt | max agent container memory-cgroup peak incl. checkpoint tmpfs, src / tgt |"
    );
    println!("|---|---|---:|---:|---:|---:|---|---|");
    let mut sizes: Vec<u32> = rows.iter().map(|r| r.size).collect();
    sizes.dedup();
    for &size in &sizes {
        for mode in Mode::ALL {
            println!("{}", median_line(rows, size, mode));
        }
        for mode in [Mode::PreCopy, Mode::PostCopy] {
            println!("{}", over_cold_line(rows, size, mode));
        }
    }
}

/// One round's row of the first table.
fn round_line(r: &Row) -> String {
    let (raw_node, raw_parts, raw_ms, raw_bytes) = match &r.raw {
        Ok(x) => (
            x.node.clone(),
            format!("{:.0} / {:.0} / {:.0}", x.dump_ms, x.copy_ms, x.restore_ms),
            format!("{:.0}", x.downtime_ms()),
            mib(x.bytes),
        ),
        Err(e) => ("–".into(), format!("failed: {e}"), "–".into(), "–".into()),
    };
    let mig = match &r.mig {
        Ok(m) => format!(
            "{} → {} | {} | {} | {} / {} | {} | {} | {} | {}",
            m.from,
            m.to,
            m.downtime_ms,
            match &r.raw {
                Ok(x) => format!("{:.2}", m.downtime_ms as f64 / x.downtime_ms()),
                Err(_) => "–".into(),
            },
            opt(m.final_dump_ms),
            opt(m.final_dump_bytes.map(mib)),
            opt(m.restore_ms),
            match m.lazy_bytes {
                Some(l) => format!(
                    "{} + {} lazy",
                    mib(m.bytes_sent.max(0) as u64),
                    mib(l.max(0) as u64)
                ),
                None => mib(m.bytes_sent.max(0) as u64),
            },
            m.iterations,
            m.total_s
        ),
        Err(e) => format!("failed: {e} | – | – | – | – | – | – | –"),
    };
    format!(
        "| {} MiB | {} | {} | {raw_node} | {raw_parts} | {raw_ms} | {raw_bytes} | {mig} | {} | {} |",
        r.size,
        r.mode.name(),
        r.round + 1,
        r.agents.rss_cell(),
        r.agents.cgroup_cell()
    )
}

/// The medians of the rounds of `size` and `mode` where both sides succeeded.
fn median_line(rows: &[Row], size: u32, mode: Mode) -> String {
    let ok: Vec<(&Raw, &Mig)> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .filter_map(|r| Some((r.raw.as_ref().ok()?, r.mig.as_ref().ok()?)))
        .collect();
    let f = |v: Option<f64>, p: usize| v.map(|v| format!("{v:.p$}")).unwrap_or_else(|| "–".into());
    // Over every round of the PodMigration, whether or not raw CRIU succeeded.
    let agents: Vec<&AgentPeaks> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .map(|r| &r.agents)
        .collect();
    let max = |pick: fn(&AgentPeaks) -> &[Reading; 2]| {
        let side = |i: usize| {
            let max = agents.iter().filter_map(|a| pick(a)[i].as_ref().ok()).max();
            max.map_or_else(|| "n/a".into(), |b| mib(*b))
        };
        format!("{} / {}", side(0), side(1))
    };
    format!(
        "| {size} MiB | {} | {} | {} | {} | {} | {} | {} |",
        mode.name(),
        ok.len(),
        f(median(ok.iter().map(|(r, _)| r.downtime_ms()).collect()), 0),
        f(
            median(ok.iter().map(|(_, m)| m.downtime_ms as f64).collect()),
            0
        ),
        f(
            median(
                ok.iter()
                    .map(|(r, m)| m.downtime_ms as f64 / r.downtime_ms())
                    .collect()
            ),
            2
        ),
        max(|a| &a.rss),
        max(|a| &a.cgroup),
    )
}

/// `mode` ÷ Cold of the same round (PodMotion downtimes), for `size`.
fn over_cold_line(rows: &[Row], size: u32, mode: Mode) -> String {
    let ratios: Vec<f64> = rows
        .iter()
        .filter(|r| r.size == size && r.mode == mode)
        .filter_map(|p| {
            let c = rows
                .iter()
                .find(|c| c.size == size && c.mode == Mode::Cold && c.round == p.round)?;
            Some(p.mig.as_ref().ok()?.downtime_ms as f64 / c.mig.as_ref().ok()?.downtime_ms as f64)
        })
        .collect();
    format!(
        "| {size} MiB | {} ÷ Cold (PodMotion, same round) | {} | | | {} | | |",
        mode.name(),
        ratios.len(),
        median(ratios.clone())
            .map(|v| format!("{v:.2}"))
            .unwrap_or_else(|| "–".into())
    )
}
