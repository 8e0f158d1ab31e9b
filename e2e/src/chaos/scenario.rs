//! The steps of the chaos run, each named; `src/bin/chaos.rs` runs them in order.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use k8s_openapi::api::core::v1::Pod;
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::churn::churn;
use super::converge::{await_convergence, converged};
use super::invariants::sampler;
use super::live::{Live, live_migrations, live_round, start_live};
use super::opts::Opts;
use super::replicas::{Replicas, operator_bin, run_replicas};
use super::setup::{plant_violation, setup, write_proxy_kubeconfig};
use super::state::{MIG_NODES, Names, Phase, SAMPLE_EVERY, Shared, Tally, violation};
use super::summary::{Measured, print_summary};
use super::teardown::teardown;
use super::{ProxyStats, start_proxy};
use crate::kwok_agents::KwokAgents;
use crate::{connect, random_suffix};

/// The run: the operator binary, the client, its names, the tally its tasks share,
/// its phase, and the live workload's sampler and agents.
pub struct Run {
    bin: PathBuf,
    client: Client,
    n: Names,
    tally: Shared,
    phase_tx: watch::Sender<Phase>,
    phase_rx: watch::Receiver<Phase>,
    stop_live_sampler: Arc<AtomicBool>,
    live_sampler_thread: Option<std::thread::JoinHandle<()>>,
    /// The live agents, kept to save their logs whatever the run's end.
    live_agents: Option<Arc<Mutex<KwokAgents>>>,
}

/// What runs beside the steps: the proxy, the replicas behind it, the sampler.
pub struct Workers {
    proxy: Arc<ProxyStats>,
    replica_ids: Arc<Mutex<Vec<String>>>,
    replicas_task: JoinHandle<()>,
    sampler_task: JoinHandle<()>,
}

impl Workers {
    /// The replicas running now.
    fn ids(&self) -> Vec<String> {
        self.replica_ids.lock().unwrap().clone()
    }
}

/// The faults under way: since when, and the churn and the live migrations.
pub struct Faults {
    t0: Instant,
    churn_task: JoinHandle<()>,
    live_task: Option<JoinHandle<()>>,
}

/// After the last fault: how long the faults lasted, when they ended, and the live
/// migrations, whose round in flight then has yet to end.
pub struct Settling {
    pub faults_secs: Duration,
    last_fault: Instant,
    live_task: Option<JoinHandle<()>>,
}

impl Run {
    /// Finds the operator binary, connects, names the run's namespaces and its logs
    /// directory, and checks what the live migrations need.
    pub async fn prepare(o: &Opts) -> anyhow::Result<Run> {
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
            crate::kwok_agents::check_requirements()
                .context("live migrations (--no-live-migrations skips them)")?;
        }
        Ok(Run {
            bin,
            client,
            n,
            tally,
            phase_tx,
            phase_rx,
            stop_live_sampler: Arc::new(AtomicBool::new(false)),
            live_sampler_thread: None,
            live_agents: None,
        })
    }

    /// The namespaces, workloads, attachments and pools; the migrated workload's pods.
    pub async fn set_up(&self, o: &Opts) -> anyhow::Result<Vec<Pod>> {
        setup(&self.client, &self.n, o.live).await
    }

    /// The live workload (with `o.live`): agents for MIG_NODES, its process in its pod,
    /// and the sampler of its processes.
    pub async fn start_live_workload(&mut self, o: &Opts) -> anyhow::Result<Option<Live>> {
        if !o.live {
            return Ok(None);
        }
        let (live, thread) =
            start_live(&self.client, &self.n, &self.tally, &self.stop_live_sampler).await?;
        self.live_agents = Some(live.agents.clone());
        self.live_sampler_thread = Some(thread);
        Ok(Some(live))
    }

    /// The fault-injecting proxy (injecting nothing yet), the two replicas behind it,
    /// and the sampler of the invariants (`mig_pods`: the migrated workload as it
    /// starts).
    pub async fn start_replicas(
        &self,
        o: &Opts,
        live: &Option<Live>,
        mig_pods: &[Pod],
    ) -> anyhow::Result<Workers> {
        let mig_uids: BTreeSet<String> = mig_pods.iter().filter_map(|p| p.uid()).collect();
        let (addr, proxy) = start_proxy(connect().await?, 0, o.seed).await?;
        let kubeconfig = self.n.dir.join("proxy.kubeconfig");
        write_proxy_kubeconfig(&kubeconfig, addr)?;
        let agent_args = live
            .as_ref()
            .map(|l| l.agents.lock().unwrap().operator_args())
            .unwrap_or_default();
        let reps = Replicas::start(self.bin.clone(), self.n.clone(), kubeconfig, agent_args)?;
        let replica_ids = Arc::new(Mutex::new(reps.identities()));
        let replicas_task = tokio::spawn(run_replicas(
            reps,
            self.client.clone(),
            self.tally.clone(),
            self.phase_rx.clone(),
            o.kill_every,
            o.seed,
            replica_ids.clone(),
        ));
        let sampler_task = tokio::spawn(sampler(
            self.client.clone(),
            self.n.clone(),
            mig_uids,
            self.tally.clone(),
            self.phase_rx.clone(),
        ));
        Ok(Workers {
            proxy,
            replica_ids,
            replicas_task,
            sampler_task,
        })
    }

    /// Baseline: without faults the operators settle everything (within 120 s, or the
    /// run cannot go on). Returns how long that took.
    pub async fn baseline(&self, w: &Workers) -> anyhow::Result<Option<Duration>> {
        let t0 = Instant::now();
        let mut c = 0;
        let baseline = loop {
            match converged(&self.client, &self.n, &w.ids(), &mut c).await {
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
        Ok(baseline)
    }

    /// The control: one live migration without faults (no kill, nothing injected,
    /// not deleted) must move the process. Without it, a run whose migrations all
    /// roll back under the faults cannot tell the faults from a harness or product
    /// that never commits.
    pub async fn control_round(&self, l: &Live) {
        let (client, n, tally) = (&self.client, &self.n, &self.tally);
        let end = live_round(client, n, l, tally, "live-0", None, None).await;
        let outcome = match end {
            Ok(end) if end.committed => end.outcome,
            Ok(end) => {
                violation(
                    tally,
                    format!(
                        "the live migration without faults (live-0) did not move the process: {}",
                        end.outcome
                    ),
                );
                end.outcome
            }
            Err(e) => {
                violation(tally, format!("live migration without faults: {e:#}"));
                format!("error: {e:#}")
            }
        };
        tally.lock().unwrap().live_control = Some(outcome);
    }

    /// The negative control (`--plant-violation`): a second DaemonSet of a pool.
    pub async fn plant_violation(&self) -> anyhow::Result<()> {
        plant_violation(&self.client, &self.n).await
    }

    /// The faults start: the proxy answers its share of the writes with 409/429, the
    /// replicas' leader is killed, the churn and the live migrations begin.
    pub fn start_faults(
        &self,
        o: &Opts,
        w: &Workers,
        live: &Option<Live>,
        mig_pods: &[Pod],
    ) -> Faults {
        let mig_names: Vec<String> = mig_pods.iter().map(|p| p.name_any()).collect();
        w.proxy
            .share_per_mille
            .store(o.share_per_mille, Ordering::Relaxed);
        let _ = self.phase_tx.send(Phase::Chaos);
        let t0 = Instant::now();
        let churn_task = tokio::spawn(churn(
            self.client.clone(),
            self.n.clone(),
            mig_names,
            live.is_some(),
            self.tally.clone(),
            o.seed,
            self.phase_rx.clone(),
        ));
        let live_task = live.as_ref().map(|l| {
            tokio::spawn(live_migrations(
                self.client.clone(),
                self.n.clone(),
                l.clone(),
                self.tally.clone(),
                o.seed,
                self.phase_rx.clone(),
            ))
        });
        Faults {
            t0,
            churn_task,
            live_task,
        }
    }

    /// The faults last `o.duration`; with `--api-restart` the API server is restarted
    /// once halfway.
    pub async fn hold_faults(&self, o: &Opts, f: &Faults) {
        let mut restarted = !o.api_restart;
        while f.t0.elapsed() < o.duration {
            if !restarted && f.t0.elapsed() >= o.duration / 2 {
                restarted = true;
                eprintln!("[chaos] restarting the API server");
                match restart_api_server().await {
                    Ok(d) => {
                        let mut t = self.tally.lock().unwrap();
                        t.api_restarts += 1;
                        t.api_restart_secs.push(d.as_secs_f64());
                        eprintln!("[chaos] API server back after {:.1} s", d.as_secs_f64());
                    }
                    Err(e) => {
                        violation(&self.tally, format!("the API server restart failed: {e:#}"))
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The last fault: no more kills, no more injected errors; the churn ends.
    pub async fn stop_faults(&self, w: &Workers, f: Faults) -> Settling {
        let _ = self.phase_tx.send(Phase::Settle);
        w.proxy.share_per_mille.store(0, Ordering::Relaxed);
        let faults_secs = f.t0.elapsed();
        let last_fault = Instant::now();
        let _ = f.churn_task.await;
        Settling {
            faults_secs,
            last_fault,
            live_task: f.live_task,
        }
    }

    /// Convergence after the last fault (within CONVERGENCE), while the live migration
    /// in flight then ends (it must, within CONVERGENCE too). Returns how long after
    /// the last fault it converged; `None`: it did not.
    pub async fn converge(&self, w: &Workers, s: &mut Settling) -> Option<Duration> {
        let replicas_now = w.ids();
        let live_task = s.live_task.take();
        let (conv, _) = tokio::join!(
            await_convergence(
                &self.client,
                &self.n,
                &replicas_now,
                &self.tally,
                "after the last fault"
            ),
            async {
                if let Some(t) = live_task {
                    let _ = t.await;
                }
            }
        );
        conv.map(|_| s.last_fault.elapsed())
    }

    /// The end with the operators up: the live sampler stops, a last sampled round
    /// after convergence, every PodMotion object deleted (all gone within
    /// CONVERGENCE), then the sampler and the replicas stop. Returns the proxy's
    /// counters.
    pub async fn tear_down(&self, w: Workers) -> Arc<ProxyStats> {
        self.stop_live_sampler.store(true, Ordering::Relaxed);
        // A last sampled round after convergence.
        tokio::time::sleep(SAMPLE_EVERY).await;
        teardown(&self.client, &self.n, &self.tally, true).await;
        let _ = self.phase_tx.send(Phase::Stop);
        let _ = w.sampler_task.await;
        let _ = w.replicas_task.await;
        w.proxy
    }

    /// Whatever the steps' end: every task stops, the live sampler too, and the live
    /// agents' logs are saved in the run's directory.
    pub fn stop(&mut self) {
        let _ = self.phase_tx.send(Phase::Stop);
        self.stop_live_sampler.store(true, Ordering::Relaxed);
        if let Some(t) = self.live_sampler_thread.take() {
            let _ = t.join();
        }
        if let Some(a) = self.live_agents.take() {
            let a = a.lock().unwrap_or_else(|e| e.into_inner());
            for (i, node) in MIG_NODES.iter().enumerate() {
                let _ = std::fs::write(
                    self.n.dir.join(format!("agent-{node}.log")),
                    a.tb.agent_log(i),
                );
            }
        }
    }

    /// After a step failed: whatever is left goes (the operators are not relied on).
    pub async fn tear_down_after_failure(&self) {
        teardown(&self.client, &self.n, &self.tally, false).await;
    }

    /// Prints the summary table; whether the run found no violation.
    pub fn summary(&self, o: &Opts, m: &Measured, started: Instant) -> bool {
        print_summary(o, &self.tally, m, started)
    }
}

async fn restart_api_server() -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new("bash")
        .arg(crate::repo_root().join("hack/cluster.sh"))
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
