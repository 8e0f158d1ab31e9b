//! Chaos on the real nodes, with the chart's operator, agents and brokers installed from
//! our images (issue 21, "with real agents on the real nodes where they exist";
//! `e2e/src/bin/chaos.rs` does the same with process-level agents on the kwok nodes and
//! a fault-injecting proxy, which an operator running in a pod does not go through).
//!
//! Two operator replicas (leader election, a 6 s Lease) run on the real nodes. One live
//! testload pod (16 MiB of ballast, behind a Service) is migrated between the two real
//! nodes, one PodMigration after another, Cold and PreCopy in turn, a third of them
//! deleted at a random moment 0–5 s after creation (abort by deletion). Meanwhile:
//! - **the leader is killed** every 8–16 s: the process in the Lease holder's pod is
//!   SIGKILLed on its node (mid-reconcile, mid-RPC) and the pod force-deleted, so its
//!   ReplicaSet starts a new one while the other replica takes the Lease over;
//! - **the API server is restarted once**, halfway (`hack/cluster.sh restart-component`).
//!
//! Invariants, checked continuously (every 200 ms, from the machine the nodes run on) and
//! after each migration:
//! - never two running copies of the workload's state (the original source process, or a
//!   restored one; a source frozen next to its restored copy is one), and never none
//!   (some process holds the state: running, or frozen); and never the source pod's
//!   container restarted afresh by the kubelet (a fresh workload beside the state's
//!   copy): the commit deletes the source pod before its agent's kill, so the kubelet
//!   does not restart the killed container (docs/migration-controller.md);
//! - the counter read through the Service, one new connection per read, never goes back
//!   (two copies serving);
//! - after each migration exactly one pod of the app is left, Ready; the one the phase
//!   says (the source after a rollback, the target after a commit; a deletion in
//!   `Committing` rolls forward), serving the same state: its counter is larger than
//!   before the migration, on a new connection;
//! - every migration ends (terminal phase, or gone after its deletion) within 300 s.
//!
//! The first migration runs before any fault and must commit (the control), and at least
//! one migration started under faults must commit too: a run whose migrations all roll
//! back under the faults proves the rollback and never the commit. When the window ends
//! with none committed, faults go on for another 60 s (three times at most) before the
//! test fails.
//! A committed pod is adopted; after a commit the Deployment is scaled to 0 and back to
//! 1, so the next migrations move a fresh pod (a new lineage, its own Service reader):
//! moving an adopted pod again is proven by `real_migration.rs`, not here.
//!
//! **After the last fault** (convergence, 60 s): every PodMigration finished; one Ready
//! pod of the app; no transfer-key Secret and no checkpoint image left on either node; a
//! running replica holds the Lease. Then every PodMigration is deleted and all are gone
//! within 60 s (no wedged finalizer). The summary prints the faults by kind, the checks
//! made and the violations; any violation fails the test.
//!
//! `PODMOTION_REAL_CHAOS_SECONDS` (default 120) sets the fault window,
//! `PODMOTION_REAL_CHAOS_SEED` the random seed (printed). It restarts the API server and
//! kills operator pods, so it has a test binary of its own (cargo runs test binaries one
//! at a time). Needs the cluster with real nodes and the images (`hack/test.sh`).

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_api::names::labels;
use podmotion_e2e::real::agents::{agent_pids, agent_pod_uids, checkpoint_files};
use podmotion_e2e::real::copies::ServicePoller;
use podmotion_e2e::real::procs::{Proc, pod_processes, workload_processes};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter_when_reachable, node_of,
};
use podmotion_e2e::real::{force_delete_pod, kubectl, output_text};
use podmotion_e2e::{from_json, pod_running_ready, wait_list};
use serde_json::json;

const APP: &str = "chaotic";
const PREFIX: &str = "rchaos";
/// The operator's Lease, in seconds: a killed leader's successor takes over within it.
const LEASE_SECONDS: u32 = 6;
/// Everything settles within this after the last fault.
const CONVERGENCE: Duration = Duration::from_secs(60);
/// How much longer faults go on when none of the migrations under them committed yet,
/// and how many times at most.
const EXTENSION: Duration = Duration::from_secs(60);
const MAX_EXTENSIONS: u32 = 3;

/// A small deterministic generator (xorshift64*), seeded and printed, so a run can be
/// repeated with `PODMOTION_REAL_CHAOS_SEED`.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..hi` milliseconds.
    fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo))
    }
}

#[derive(Default)]
struct Tally {
    leader_kills: u32,
    api_restarts: u32,
    deletions: u32,
    committed: u32,
    /// Commits of migrations started while faults were injected.
    committed_under_faults: u32,
    rolled_back: u32,
    process_samples: u64,
    checks: u64,
    /// Samples skipped because the API server did not answer.
    api_unanswered: u64,
    violations: Vec<String>,
}

impl Tally {
    fn violation(&mut self, what: String) {
        eprintln!("[real-chaos] VIOLATION: {what}");
        self.violations.push(what);
    }

    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.violation(what());
        }
    }

    fn faults(&self) -> u32 {
        self.leader_kills + self.api_restarts + self.deletions
    }
}

/// The fault schedule: leader kills every 8–16 s and one API server restart halfway,
/// while `until` has not passed.
struct Faults {
    rng: Rng,
    started: Instant,
    until: Instant,
    next_kill: Instant,
    restart_at: Instant,
    restart: Option<tokio::task::JoinHandle<Result<Duration, String>>>,
    restarted: bool,
    last_fault: Option<Instant>,
    /// Times the window was extended for want of a commit under faults.
    extensions: u32,
}

impl Faults {
    fn new(mut rng: Rng, window: Duration) -> Faults {
        let now = Instant::now();
        let next_kill = now + rng.millis(3_000, 8_000);
        Faults {
            rng,
            started: now,
            until: now + window,
            next_kill,
            restart_at: now + window / 2,
            restart: None,
            restarted: false,
            last_fault: None,
            extensions: 0,
        }
    }

    fn active(&self) -> bool {
        Instant::now() < self.until
    }

    /// Injects faults `by` longer (leader kills; the one API restart stays one).
    fn extend(&mut self, by: Duration) {
        self.until = Instant::now() + by;
        self.extensions += 1;
    }

    /// Injects what is due.
    async fn tick(&mut self, leases: &Api<Lease>, op_ns: &str, tally: &mut Tally) {
        let now = Instant::now();
        if let Some(h) = &self.restart
            && h.is_finished()
        {
            let h = self.restart.take().unwrap();
            match h.await.expect("restart task") {
                Ok(took) => eprintln!(
                    "[real-chaos] the API server answered again {} ms after its restart began",
                    took.as_millis()
                ),
                Err(e) => tally.violation(format!("the API server restart failed: {e}")),
            }
        }
        if !self.active() {
            return;
        }
        if !self.restarted && now >= self.restart_at {
            self.restarted = true;
            tally.api_restarts += 1;
            self.last_fault = Some(now);
            eprintln!(
                "[real-chaos] t+{:.1}s restarting the API server",
                self.started.elapsed().as_secs_f64()
            );
            self.restart = Some(tokio::spawn(restart_api_server()));
        }
        if now >= self.next_kill && self.restart.is_none() {
            match kill_leader(leases, op_ns).await {
                Ok(Some(who)) => {
                    tally.leader_kills += 1;
                    self.last_fault = Some(Instant::now());
                    eprintln!(
                        "[real-chaos] t+{:.1}s killed the leader {who}",
                        self.started.elapsed().as_secs_f64()
                    );
                    self.next_kill = Instant::now() + self.rng.millis(8_000, 16_000);
                }
                // No leader yet (the last one's Lease has not expired): try again soon.
                Ok(None) => self.next_kill = Instant::now() + Duration::from_secs(1),
                Err(e) => {
                    eprintln!("[real-chaos] leader kill skipped: {e}");
                    self.next_kill = Instant::now() + Duration::from_secs(1);
                }
            }
        }
    }

    /// Waits for a restart still under way.
    async fn finish(&mut self, tally: &mut Tally) {
        if let Some(h) = self.restart.take()
            && let Err(e) = h.await.expect("restart task")
        {
            tally.violation(format!("the API server restart failed: {e}"));
        }
    }
}

async fn restart_api_server() -> Result<Duration, String> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new("bash")
        .arg(podmotion_e2e::repo_root().join("hack/cluster.sh"))
        .args(["restart-component", "kube-apiserver"])
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(output_text(&out));
    }
    Ok(t0.elapsed())
}

/// SIGKILLs the operator process of the Lease holder's pod on its node and force-deletes
/// the pod (its ReplicaSet starts another; a container restarted in place would soon
/// wait in CrashLoopBackOff). `Ok(None)` when no running replica holds the Lease.
async fn kill_leader(leases: &Api<Lease>, op_ns: &str) -> Result<Option<String>, String> {
    let lease = leases
        .get(&format!("podmotion-e2e-{PREFIX}"))
        .await
        .map_err(|e| format!("the Lease: {e}"))?;
    let Some(holder) = lease.spec.and_then(|s| s.holder_identity) else {
        return Ok(None);
    };
    let pods: Api<Pod> = Api::namespaced(leases.clone().into_client(), op_ns);
    let Some(pod) = pods
        .get_opt(&holder)
        .await
        .map_err(|e| format!("pod {holder}: {e}"))?
    else {
        return Ok(None);
    };
    let uid = pod.uid().unwrap_or_default();
    let pids: Vec<u32> = pod_processes(&uid)
        .into_iter()
        .filter(|(_, argv0)| argv0.ends_with("podmotion-operator"))
        .map(|(pid, _)| pid)
        .collect();
    if pids.is_empty() {
        return Ok(None);
    }
    for pid in &pids {
        let _ = nix_kill(*pid);
    }
    force_delete_pod(op_ns, &holder);
    Ok(Some(format!("{holder} (pid {pids:?})")))
}

fn nix_kill(pid: u32) -> std::io::Result<()> {
    let out = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(output_text(&out)))
    }
}

/// The pods of the app's namespace (every pod there is the app's: the source, a target,
/// a fresh replica).
async fn app_pods(pods: &Api<Pod>) -> Option<Vec<Pod>> {
    pods.list(&ListParams::default())
        .await
        .ok()
        .map(|l| l.items)
}

/// What the continuous check watches: every testload server in any pod the namespace has
/// had (their UIDs, kept across API outages), and which process is the migration's
/// source (the original: same pid, same start time).
struct Watch {
    uids: Vec<String>,
    /// The source pod's UID and its workload process when the migration began.
    source: Option<Proc>,
    /// Fresh processes seen in a source pod (pid, start): its container restarted by the
    /// kubelet after the source was killed (a violation: the commit deletes the source
    /// pod before the kill).
    fresh: Vec<(u32, u64)>,
}

impl Watch {
    fn learn(&mut self, pods: &[Pod]) {
        for p in pods {
            if let Some(u) = p.uid()
                && !self.uids.contains(&u)
            {
                self.uids.push(u);
            }
        }
    }

    /// Remembers the source pod's one workload process before its migration begins.
    fn begin(&mut self, source: &Pod) {
        self.learn(std::slice::from_ref(source));
        let uid = source.uid().unwrap_or_default();
        let procs = workload_processes(std::slice::from_ref(&uid));
        assert_eq!(
            procs.len(),
            1,
            "one workload process in the source pod: {procs:?}"
        );
        self.source = procs.into_iter().next();
    }

    /// One look at the processes: never two running copies of the state (the original
    /// source process, or a process in any other pod: a restored copy), never none alive
    /// (running or frozen). A process that started in the source pod after the original
    /// is not a copy of the state but the container restarted from its image: a
    /// violation too (the commit deletes the source pod before the kill), remembered in
    /// `fresh` so it counts once. A "none" is looked at twice more before it counts (a /proc scan is not
    /// atomic: a restore can create its process behind the scan while the frozen source
    /// is killed before it).
    async fn sample(&mut self, tally: &mut Tally, when: &str) {
        tally.process_samples += 1;
        let source = self.source.clone().expect("a source process");
        let copies = |procs: &[Proc]| -> Vec<Proc> {
            procs
                .iter()
                .filter(|p| p.same(&source) || p.pod_uid != source.pod_uid)
                .cloned()
                .collect()
        };
        let mut procs = workload_processes(&self.uids);
        for _ in 0..2 {
            if !copies(&procs).is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
            procs = workload_processes(&self.uids);
        }
        let held = copies(&procs);
        let running: Vec<&Proc> = held.iter().filter(|p| p.runs()).collect();
        tally.check(running.len() <= 1, || {
            format!("{when}: two copies of the state run: {procs:?}")
        });
        tally.check(!held.is_empty(), || {
            format!("{when}: no process holds the workload's state: {procs:?}")
        });
        for p in &procs {
            if p.pod_uid == source.pod_uid
                && !p.same(&source)
                && !self.fresh.contains(&(p.pid, p.start))
            {
                tally.check(false, || {
                    format!(
                        "{when}: the source pod's container restarted afresh (pid {}, state {}) beside the state's copies {held:?}",
                        p.pid, p.state
                    )
                });
                self.fresh.push((p.pid, p.start));
            }
        }
    }
}

/// The one pod of the app, Ready, with its ballast written (a fresh replica).
async fn ready_pod(pods: &Api<Pod>) -> Pod {
    let p = wait_list(pods, "", POD_TIMEOUT, "one Ready pod of the app", |ps| {
        ps.len() == 1 && pod_running_ready(&ps[0])
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    testload::wait_ballast(&p);
    p
}

async fn scale(deploys: &Api<Deployment>, replicas: i32) {
    let patch = json!({"spec": {"replicas": replicas}});
    // The API server may be restarting (a fault of this test): retry until it is back.
    let began = Instant::now();
    loop {
        match deploys
            .patch(APP, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code < 500 => panic!("scale {APP} to {replicas}: {e}"),
            Err(e) => {
                assert!(
                    began.elapsed() < Duration::from_secs(60),
                    "scale {APP} to {replicas}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// A new lineage: the adopted pod is replaced by a fresh replica (scaled to 0, gone, then
/// 1), with its own Service reader. Returns the fresh pod.
async fn fresh_replica(deploys: &Api<Deployment>, pods: &Api<Pod>) -> Pod {
    scale(deploys, 0).await;
    wait_list(pods, "", POD_TIMEOUT, "no pod of the app", |ps| {
        ps.is_empty()
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    scale(deploys, 1).await;
    ready_pod(pods).await
}

/// How one migration ended, as the test saw it.
enum End {
    Phase(PodMigrationStatus),
    /// Deleted in flight and gone; the last status seen.
    Gone(PodMigrationStatus),
    TimedOut(PodMigrationStatus),
}

#[tokio::test]
async fn leader_kills_and_an_api_server_restart_never_lose_or_double_a_migrating_pod() {
    let Some(w) = World::new(
        PREFIX,
        APP,
        16,
        &[
            "--set",
            "operator.replicas=2",
            "--set",
            &format!("operator.leaderElection.leaseSeconds={LEASE_SECONDS}"),
        ],
    )
    .await
    else {
        return;
    };
    let window = Duration::from_secs(
        std::env::var("PODMOTION_REAL_CHAOS_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(120),
    );
    let seed = std::env::var("PODMOTION_REAL_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("[real-chaos] seed {seed}, {} s of faults", window.as_secs());
    let mut rng = Rng(seed);
    let app = &w.app;
    let pods: Api<Pod> = app.api();
    let pms: Api<PodMigration> = app.api();
    let deploys: Api<Deployment> = app.api();
    let leases: Api<Lease> = w.op.api();
    let service = w.service(APP).await;
    let mut tally = Tally::default();
    let mut watch = Watch {
        uids: vec![],
        source: None,
        fresh: vec![],
    };

    let mut source = w.source.clone();
    let mut poller = ServicePoller::start(service.clone());
    let mut faults: Option<Faults> = None;
    let mut round = 0u32;
    let mut control_committed = false;
    loop {
        if let Some(f) = faults.as_mut()
            && !f.active()
        {
            // A run whose migrations under faults all rolled back proved the rollback
            // only: faults go on (bounded) until one commits; the assertion below fails
            // a run where none did.
            if tally.committed_under_faults > 0 || f.extensions >= MAX_EXTENSIONS {
                break;
            }
            eprintln!(
                "[real-chaos] no migration committed under faults yet: {} s more of faults",
                EXTENSION.as_secs()
            );
            f.extend(EXTENSION);
        }
        let source_node = node_of(&source);
        let target_node = w
            .nodes
            .iter()
            .find(|n| **n != source_node)
            .expect("a second real node")
            .clone();
        let before = counter_when_reachable(&addr(&source), "before the migration");
        watch.begin(&source);
        let name = format!("m{round}");
        let mode = if round.is_multiple_of(2) {
            "Cold"
        } else {
            "PreCopy"
        };
        let pm: PodMigration = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": name},
            "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": mode,
                "freezeBudgetMillis": 30000, "progressTimeoutSeconds": 60,
                "probe": {"tcpSocket": {"port": testload::PORT}}}
        }));
        // Under faults the create itself may meet the API server's restart.
        let created = Instant::now();
        loop {
            match pms.create(&PostParams::default(), &pm).await {
                Ok(_) => break,
                Err(kube::Error::Api(e)) if e.code == 409 => break,
                Err(e) => {
                    assert!(
                        created.elapsed() < Duration::from_secs(60),
                        "creating {name}: {e}"
                    );
                    if let Some(f) = faults.as_mut() {
                        f.tick(&leases, &w.op.name, &mut tally).await;
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        let delete_at = (faults.is_some() && rng.next().is_multiple_of(3))
            .then(|| created + rng.millis(0, 5_000));
        let mut deleted = false;
        let mut last = PodMigrationStatus::default();
        let end = loop {
            if let Some(f) = faults.as_mut() {
                f.tick(&leases, &w.op.name, &mut tally).await;
            }
            match app_pods(&pods).await {
                Some(ps) => watch.learn(&ps),
                None => tally.api_unanswered += 1,
            }
            watch
                .sample(&mut tally, &format!("{name} ({:?})", last.phase))
                .await;
            if !deleted
                && delete_at.is_some_and(|at| Instant::now() >= at)
                && pms.delete(&name, &DeleteParams::default()).await.is_ok()
            {
                deleted = true;
                tally.deletions += 1;
                if let Some(f) = faults.as_mut() {
                    f.last_fault = Some(Instant::now());
                }
                eprintln!("[real-chaos] deleted {name} in {:?}", last.phase);
            }
            match pms.get_opt(&name).await {
                Ok(None) => break End::Gone(last),
                Ok(Some(m)) => {
                    last = m.status.unwrap_or_default();
                    if last.phase.is_terminal() {
                        break End::Phase(last);
                    }
                }
                Err(_) => tally.api_unanswered += 1,
            }
            if created.elapsed() > MIGRATION_TIMEOUT {
                break End::TimedOut(last);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // What is left: one Ready pod, the one the end says, serving the same state.
        let (status, gone) = match &end {
            End::Phase(s) => (s.clone(), false),
            End::Gone(s) => (s.clone(), true),
            End::TimedOut(s) => {
                tally.violation(format!(
                    "{name} did not end in {MIGRATION_TIMEOUT:?}: {s:?}"
                ));
                break;
            }
        };
        let kept = ready_pod(&pods).await;
        watch.learn(std::slice::from_ref(&kept));
        watch.sample(&mut tally, &format!("after {name}")).await;
        let moved = kept.uid() != source.uid();
        eprintln!(
            "[real-chaos] {name} ({mode}) ended {:?}{}: the {} serves on {}",
            status.phase,
            if gone { ", deleted" } else { "" },
            if moved { "target" } else { "source" },
            node_of(&kept)
        );
        if !gone {
            tally.check(moved == (status.phase == MigrationPhase::Succeeded), || {
                format!(
                    "{name} ended {:?} but the {} pod was kept: {:?}",
                    status.phase,
                    if moved { "target" } else { "source" },
                    status.failure_message
                )
            });
        }
        let after = counter_when_reachable(&addr(&kept), &format!("after {name}"));
        tally.check(after > before, || {
            format!(
                "{name}: the kept pod's counter {after} is not past {before}: the state was lost"
            )
        });
        if moved {
            tally.committed += 1;
            if faults.is_none() {
                control_committed = true;
            } else {
                tally.committed_under_faults += 1;
            }
        } else {
            tally.rolled_back += 1;
        }
        if faults.is_none() {
            // The control ran without faults; they start now.
            tally.check(control_committed, || {
                format!("the fault-free control migration {name} did not commit: {status:?}")
            });
            faults = Some(Faults::new(Rng(rng.next() | 1), window));
        }
        if moved {
            finish_lineage(poller, after, &mut tally);
            source = fresh_replica(&deploys, &pods).await;
            poller = ServicePoller::start(service.clone());
        } else {
            source = kept;
        }
        round += 1;
    }
    let mut faults = faults.expect("the control migration ran");
    faults.finish(&mut tally).await;
    let last_fault = faults.last_fault.unwrap_or_else(Instant::now);
    finish_lineage(poller, 0, &mut tally);

    // Convergence after the last fault.
    let converged = converge(&w, &pms, &pods, &leases, last_fault, &mut tally).await;

    // Every PodMigration deleted; all gone within 60 s (no wedged finalizer).
    let _ = pms
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let t0 = Instant::now();
    loop {
        let left = pms
            .list(&ListParams::default())
            .await
            .map(|l| l.items.len());
        if left.as_ref().is_ok_and(|n| *n == 0) {
            break;
        }
        if t0.elapsed() > CONVERGENCE {
            tally.violation(format!(
                "PodMigrations still there {CONVERGENCE:?} after their deletion: {left:?}"
            ));
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    eprintln!(
        "[real-chaos] summary (seed {seed}):\n\
         | Faults (leader kills / API restarts / deletions) | Migrations (committed, under faults / rolled back) | Process samples | Checks | API unanswered | Violations | Converged after the last fault | Source containers restarted afresh |\n\
         |---|---|---|---|---|---|---|---|\n\
         | {} ({} / {} / {}) | {} ({}, {} / {}) | {} | {} | {} | {} | {} | {} |",
        tally.faults(),
        tally.leader_kills,
        tally.api_restarts,
        tally.deletions,
        round,
        tally.committed,
        tally.committed_under_faults,
        tally.rolled_back,
        tally.process_samples,
        tally.checks,
        tally.api_unanswered,
        tally.violations.len(),
        converged.map_or("no".into(), |d| format!("{:.1} s", d.as_secs_f64())),
        watch.fresh.len(),
    );
    assert!(control_committed, "the control migration did not commit");
    assert!(
        tally.committed_under_faults >= 1,
        "no migration committed under faults ({} rolled back, the window extended {} times): \
         the run proved the rollback, never the commit under faults",
        tally.rolled_back,
        faults.extensions
    );
    assert!(
        tally.leader_kills >= 1 && tally.api_restarts == 1,
        "faults were not injected: {} leader kills, {} API restarts",
        tally.leader_kills,
        tally.api_restarts
    );
    assert!(
        tally.violations.is_empty(),
        "{} violations: {:#?}",
        tally.violations.len(),
        tally.violations
    );
}

/// Stops a lineage's Service reader: its counters never went back (two copies served)
/// and reached `at_least`.
fn finish_lineage(poller: ServicePoller, at_least: u64, tally: &mut Tally) {
    let result = poller.finish_checked(at_least);
    tally.check(result.is_ok(), || result.unwrap_err());
}

/// Waits, from `last_fault`, until everything settled (or `CONVERGENCE` passed, a
/// violation naming what had not): every PodMigration finished, one Ready pod of the
/// app, no transfer-key Secret, no checkpoint image on the release's agents, a running
/// replica holds the Lease. Returns how long after the last fault it converged.
async fn converge(
    w: &World,
    pms: &Api<PodMigration>,
    pods: &Api<Pod>,
    leases: &Api<Lease>,
    last_fault: Instant,
    tally: &mut Tally,
) -> Option<Duration> {
    let secrets: Api<Secret> = w.app.api();
    let op_pods: Api<Pod> = w.op.api();
    let keys = ListParams::default().labels(&format!("{}=PodMigration", labels::OWNER_KIND));
    loop {
        let mut waiting = vec![];
        match pms.list(&ListParams::default()).await {
            Ok(l) => {
                for m in l.items {
                    let p = m.status.as_ref().map(|s| s.phase);
                    if !p.is_some_and(|p| p.is_terminal()) {
                        waiting.push(format!("{} in {p:?}", m.name_any()));
                    }
                }
            }
            Err(e) => waiting.push(format!("PodMigrations: {e}")),
        }
        match app_pods(pods).await {
            Some(ps) if ps.len() == 1 && pod_running_ready(&ps[0]) => {}
            Some(ps) => waiting.push(format!(
                "pods {:?}",
                ps.iter().map(|p| p.name_any()).collect::<Vec<_>>()
            )),
            None => waiting.push("pods: no answer".into()),
        }
        match secrets.list(&keys).await {
            Ok(l) if l.items.is_empty() => {}
            Ok(l) => waiting.push(format!(
                "transfer keys {:?}",
                l.items.iter().map(|s| s.name_any()).collect::<Vec<_>>()
            )),
            Err(e) => waiting.push(format!("Secrets: {e}")),
        }
        let agent_uids = agent_pod_uids(&w.op.client, &w.agents()).await;
        for pid in agent_pids(&agent_uids) {
            let files = checkpoint_files(pid);
            if !files.is_empty() {
                waiting.push(format!("checkpoint files on agent {pid}: {files:?}"));
            }
        }
        match leases.get(&format!("podmotion-e2e-{PREFIX}")).await {
            Ok(l) => {
                let holder = l.spec.and_then(|s| s.holder_identity).unwrap_or_default();
                let runs = op_pods
                    .get_opt(&holder)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|p| {
                        pod_running_ready(&p) && p.metadata.deletion_timestamp.is_none()
                    });
                if !runs {
                    waiting.push(format!(
                        "the Lease's holder {holder:?} is not a running replica"
                    ));
                }
            }
            Err(e) => waiting.push(format!("Lease: {e}")),
        }
        tally.checks += 1;
        if waiting.is_empty() {
            let after = last_fault.elapsed();
            eprintln!(
                "[real-chaos] converged {:.1} s after the last fault",
                after.as_secs_f64()
            );
            return Some(after);
        }
        if last_fault.elapsed() > CONVERGENCE {
            tally.violation(format!(
                "not converged {CONVERGENCE:?} after the last fault: {waiting:?}"
            ));
            diagnose(w);
            return None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// What a failed convergence leaves to read: the PodMigrations, both namespaces, and the
/// logs of the release's agents and operator replicas.
fn diagnose(w: &World) {
    w.app.dump();
    w.op.dump();
    let agents = w.agents();
    for (title, args) in [
        (
            "PodMigrations",
            vec![
                "-n",
                w.app.name.as_str(),
                "get",
                "podmigrations",
                "-o",
                "yaml",
            ],
        ),
        (
            "agent logs",
            vec![
                "-n",
                agents.as_str(),
                "logs",
                "-l",
                "app.kubernetes.io/component=migration-agent",
                "--all-containers",
                "--prefix",
                "--tail=400",
            ],
        ),
        (
            "operator logs",
            vec![
                "-n",
                w.op.name.as_str(),
                "logs",
                "-l",
                "app.kubernetes.io/component=operator",
                "--prefix",
                "--tail=400",
            ],
        ),
    ] {
        let out = kubectl(&args);
        eprintln!("===== {title} =====\n{}", output_text(&out));
    }
}

#[test]
fn the_generator_is_deterministic_and_in_range() {
    let (mut a, mut b) = (Rng(42), Rng(42));
    for _ in 0..100 {
        let d = a.millis(8_000, 16_000);
        assert_eq!(d, b.millis(8_000, 16_000));
        assert!(d >= Duration::from_millis(8_000) && d < Duration::from_millis(16_000));
    }
}
