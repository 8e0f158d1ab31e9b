//! The live migrations of the chaos run: the live workload's process moved back and
//! forth between the two kwok nodes by process-level agents, and the checks after each.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_agent::testbed::ask;
use podmotion_api::names::condition_types as ct;
use podmotion_api::{PodMigration, PodMigrationStatus};
use serde_json::json;
use tokio::sync::watch;

use super::Rng;
use super::invariants::terminal;
use super::state::{
    CONVERGENCE, LIVE, LIVE_BALLAST_MIB, LIVE_BANDWIDTH, LIVE_SAMPLE_EVERY, MIG_NODES, Names,
    Phase, Shared, record_deletion, violation,
};
use crate::kwok_agents::{KwokAgents, PodSide, WorkloadMarker, WorkloadProcess, container_id};
use crate::{from_json, pod_running_ready};

/// The live workload: its process, the agents of the two kwok nodes, and whether the
/// process sampler is watching (not while a fresh workload replaces a moved one).
#[derive(Clone)]
pub struct Live {
    pub(crate) agents: Arc<Mutex<KwokAgents>>,
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
pub(crate) async fn live_migrations(
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
pub(crate) struct RoundEnd {
    /// The process runs in the target pod (the migration committed).
    pub(crate) committed: bool,
    /// The run deleted the PodMigration before it ended.
    pub(crate) deleted: bool,
    /// What the summary counts it as.
    pub(crate) outcome: String,
}

/// One live migration of the workload to the other kwok node (deleted `delete_after`
/// its creation, if given) and the checks after it: the workload runs exactly once, in
/// the pod Kubernetes keeps, its counter continued; no checkpoint image is left.
/// `faults` (the run's phase and when it left `Chaos`) is given for the rounds under
/// faults: the migration in flight at the last fault must end within CONVERGENCE.
pub(crate) async fn live_round(
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
    let pod = round_pod(client, n, live, &pods).await?;
    let target_node = other_node(&pod);
    let (mut conn, before) = open_counter(live).await?;
    create_live_migration(&migs, &name, &pod, target_node).await?;
    let Flight {
        target_pod,
        deleted,
        final_phase,
        last_status,
        ..
    } = follow(live, tally, &migs, &pods, &name, delete_after, &mut faults).await?;
    note_settled(tally, &name, &faults);
    // Which pod Kubernetes keeps says where the one copy must run.
    let side = kept_side(client, n, &name, &pod, &target_pod).await?;
    let agents = live.agents.clone();
    let tally2 = tally.clone();
    let name2 = name.clone();
    tokio::task::spawn_blocking(move || {
        let a = agents.lock().unwrap();
        check_live_round(&a, &tally2, &name2, side, &mut conn, before)
    })
    .await?;
    await_images_gone(live, tally, &name).await;
    let outcome = outcome(side, deleted, final_phase);
    eprintln!("[chaos] live migration {name}: {outcome}; last status {last_status}");
    if !deleted {
        delete_ended(&migs, tally, &name).await;
    }
    hand_over(live, side).await?;
    Ok(RoundEnd {
        committed: side == PodSide::Target,
        deleted,
        outcome,
    })
}

/// The live workload's pod for a round. After a round that moved the process, the
/// adopted pod is replaced by a new one with a fresh workload.
async fn round_pod(
    client: &Client,
    n: &Names,
    live: &Live,
    pods: &Api<Pod>,
) -> anyhow::Result<Pod> {
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
    Ok(pod)
}

/// The kwok node of MIG_NODES that `pod` is not on: the migration's target.
fn other_node(pod: &Pod) -> &'static str {
    let source_node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    MIG_NODES
        .iter()
        .find(|n| **n != source_node)
        .copied()
        .unwrap_or(MIG_NODES[0])
}

/// A client connection to the live workload, and its counter before the migration.
async fn open_counter(live: &Live) -> anyhow::Result<(TcpStream, u64)> {
    let agents = live.agents.clone();
    let (conn, before) = tokio::task::spawn_blocking(move || {
        let a = agents.lock().unwrap();
        let mut c = a.tb.connect_timeout(Duration::from_secs(5))?;
        let (v, _) = read_counter(&a, &mut c)?;
        anyhow::Ok((c, v))
    })
    .await??;
    Ok((conn, before))
}

/// Creates the live migration `name` of `pod` to `target_node`, retrying while the
/// API server is away (up to CONVERGENCE).
async fn create_live_migration(
    migs: &Api<PodMigration>,
    name: &str,
    pod: &Pod,
    target_node: &str,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        match migs
            .create(
                &PostParams::default(),
                &live_migration(name, &pod.name_any(), target_node),
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
    Ok(())
}

/// A live migration as it is followed: its target pod once known, whether the
/// target's workload was started, whether the run deleted it, how it ended.
struct Flight {
    target_pod: Option<String>,
    played: bool,
    deleted: bool,
    final_phase: Option<String>,
    last_status: String,
}

/// Follows the live migration `name` until it ends (deleting it `delete_after` its
/// creation, if given), for at most 180 s; notes when the faults ended, if they did
/// meanwhile.
async fn follow(
    live: &Live,
    tally: &Shared,
    migs: &Api<PodMigration>,
    pods: &Api<Pod>,
    name: &str,
    delete_after: Option<Duration>,
    faults: &mut Option<(&watch::Receiver<Phase>, &mut Option<Instant>)>,
) -> anyhow::Result<Flight> {
    let mut f = Flight {
        target_pod: None,
        played: false,
        deleted: false,
        final_phase: None,
        last_status: String::new(),
    };
    let started = Instant::now();
    loop {
        note_faults_ended(faults);
        if started.elapsed() > Duration::from_secs(180) {
            let (deleted, last_status) = (f.deleted, &f.last_status);
            let logs = live.agents.lock().unwrap().logs();
            bail!(
                "PodMigration {name} did not end within 180 s (deleted: {deleted}); status {last_status}\n{logs}"
            );
        }
        let m = match migs.get_opt(name).await {
            Ok(m) => m,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let st = m.as_ref().and_then(|m| m.status.clone());
        if let Some(st) = &st {
            f.last_status = status_line(st);
        }
        if f.target_pod.is_none() {
            f.target_pod = st.as_ref().and_then(|s| s.target_pod.clone());
        }
        f.play_target(live, pods).await?;
        if let Some(after) = delete_after
            && !f.deleted
            && started.elapsed() >= after
            && m.is_some()
        {
            f.delete(tally, migs, name, &m, &st).await;
        }
        if f.ended(&m, &st) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(f)
}

/// Under faults: when the faults ended, once they have.
fn note_faults_ended(faults: &mut Option<(&watch::Receiver<Phase>, &mut Option<Instant>)>) {
    if let Some((phase, settle_at)) = faults
        && *phase.borrow() != Phase::Chaos
        && settle_at.is_none()
    {
        **settle_at = Some(Instant::now());
    }
}

/// The status in a line: its phase, its failure, and why it waits, if it does
/// (Pending: not Migratable, or Stalled).
fn status_line(st: &PodMigrationStatus) -> String {
    let waits: Vec<String> = st
        .conditions
        .iter()
        .filter(|c| {
            (c.type_ == ct::MIGRATABLE && c.status != "True")
                || (c.type_ == ct::STALLED && c.status == "True")
        })
        .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
        .collect();
    format!("{:?} {:?} {waits:?}", st.phase, st.failure_message)
}

impl Flight {
    /// Starts the workload in the target pod once that has a container.
    async fn play_target(&mut self, live: &Live, pods: &Api<Pod>) -> anyhow::Result<()> {
        if let (Some(t), false) = (&self.target_pod, self.played)
            && let Ok(Some(p)) = pods.get_opt(t).await
            && let Some(tcid) = container_id(&p)
        {
            let agents = live.agents.clone();
            tokio::task::spawn_blocking(move || agents.lock().unwrap().play_target(&tcid)).await?;
            self.played = true;
        }
        Ok(())
    }

    /// Deletes the migration in flight, counted by the phase it was deleted in.
    async fn delete(
        &mut self,
        tally: &Shared,
        migs: &Api<PodMigration>,
        name: &str,
        m: &Option<PodMigration>,
        st: &Option<PodMigrationStatus>,
    ) {
        let at = st
            .as_ref()
            .map(|s| format!("{:?}", s.phase))
            .unwrap_or_else(|| "no status".into());
        if migs.delete(name, &DeleteParams::default()).await.is_ok() {
            self.deleted = true;
            let uid = m.as_ref().and_then(|m| m.uid()).unwrap_or_default();
            record_deletion(tally, "PodMigration", name.to_string(), uid);
            *tally.lock().unwrap().live_deleted_in.entry(at).or_default() += 1;
        }
    }

    /// Whether the migration has ended: gone once deleted, or (not deleted) in a
    /// terminal phase, which is noted.
    fn ended(&mut self, m: &Option<PodMigration>, st: &Option<PodMigrationStatus>) -> bool {
        match (m, st) {
            (None, _) if self.deleted => true,
            (Some(_), Some(s)) if !self.deleted && terminal(&s.phase) => {
                self.final_phase = Some(format!(
                    "{:?}{}",
                    s.phase,
                    s.failure_reason
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ));
                true
            }
            _ => false,
        }
    }
}

/// Under faults: how long after the last fault the migration `name` ended, and a
/// violation if that was more than CONVERGENCE.
fn note_settled(
    tally: &Shared,
    name: &str,
    faults: &Option<(&watch::Receiver<Phase>, &mut Option<Instant>)>,
) {
    if let Some((_, Some(at))) = faults {
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
}

/// The side of the pod Kubernetes kept after the migration `name` of `pod`.
async fn kept_side(
    client: &Client,
    n: &Names,
    name: &str,
    pod: &Pod,
    target_pod: &Option<String>,
) -> anyhow::Result<PodSide> {
    let kept = live_pod(client, n).await?;
    Ok(if kept.name_any() == pod.name_any() {
        PodSide::Source
    } else if Some(kept.name_any()) == *target_pod {
        PodSide::Target
    } else {
        bail!(
            "after {name} the live workload's pod is {}, neither the source {} nor the target {target_pod:?}",
            kept.name_any(),
            pod.name_any()
        );
    })
}

/// Cleanup zeroized and removed every checkpoint image on both nodes.
async fn await_images_gone(live: &Live, tally: &Shared, name: &str) {
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
}

/// What the summary counts a round as.
fn outcome(side: PodSide, deleted: bool, final_phase: Option<String>) -> String {
    match (side, deleted) {
        (PodSide::Target, false) => "moved the process".to_string(),
        (PodSide::Target, true) => "moved the process (deleted after the commit)".into(),
        (PodSide::Source, true) => "rolled back (deleted in flight)".into(),
        (PodSide::Source, false) => {
            format!("rolled back ({})", final_phase.unwrap_or_default())
        }
    }
}

/// Deletes the migration `name` that ended by itself.
async fn delete_ended(migs: &Api<PodMigration>, tally: &Shared, name: &str) {
    let uid = migs
        .get_opt(name)
        .await
        .ok()
        .flatten()
        .and_then(|m| m.uid())
        .unwrap_or_default();
    if migs.delete(name, &DeleteParams::default()).await.is_ok() {
        record_deletion(tally, "PodMigration", name.to_string(), uid);
    }
}

/// Readies the next round after the copy ended on `side`.
async fn hand_over(live: &Live, side: PodSide) -> anyhow::Result<()> {
    match side {
        // The next round starts a fresh workload in the pod that now holds it.
        PodSide::Target => live.fresh.store(true, Ordering::Relaxed),
        // The source runs on: only the target's holder and address go.
        PodSide::Source => {
            let agents = live.agents.clone();
            tokio::task::spawn_blocking(move || agents.lock().unwrap().reset_target()).await?;
        }
    }
    Ok(())
}

/// Whether `procs` are exactly one running copy, in the pod on `side`.
fn one_copy_in(procs: &[WorkloadProcess], side: PodSide) -> bool {
    procs.len() == 1 && procs[0].running && procs[0].side == side
}

/// After a live migration ended: exactly one copy runs, in the pod on `side`; its
/// counter continued from `before` (the process state moved, not a fresh start) and
/// keeps advancing (it was thawed or restored, not left frozen).
fn check_live_round(
    agents: &KwokAgents,
    tally: &Shared,
    name: &str,
    side: PodSide,
    conn: &mut TcpStream,
    before: u64,
) {
    let t0 = Instant::now();
    let mut procs = agents.workload_processes();
    while !one_copy_in(&procs, side) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
        procs = agents.workload_processes();
    }
    tally.lock().unwrap().live_round_checks += 1;
    if !one_copy_in(&procs, side) {
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
    check_counter(agents, tally, name, conn, before);
}

/// The live workload's counter, read over `conn` (or a new connection) twice, 300 ms
/// apart: not below `before`, and advancing.
fn check_counter(
    agents: &KwokAgents,
    tally: &Shared,
    name: &str,
    conn: &mut TcpStream,
    before: u64,
) {
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

/// Starts the live workload: the agents of MIG_NODES, its process in its pod, and the
/// thread that samples its processes until `stop`.
pub(crate) async fn start_live(
    client: &Client,
    n: &Names,
    tally: &Shared,
    stop: &Arc<AtomicBool>,
) -> anyhow::Result<(Live, JoinHandle<()>)> {
    let pod = live_pod(client, n).await?;
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
    let (marker, watching, stop, t) = (
        live.agents.lock().unwrap().marker(),
        live.watching.clone(),
        stop.clone(),
        tally.clone(),
    );
    let thread = std::thread::spawn(move || live_sampler(marker, watching, stop, t));
    Ok((live, thread))
}
