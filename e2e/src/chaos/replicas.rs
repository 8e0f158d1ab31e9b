//! The operator replicas of the chaos run: two kept running, the leader SIGKILLed
//! every few seconds while the faults last.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Client;
use kube::api::Api;
use tokio::sync::watch;

use super::Rng;
use super::state::{LEASE_SECONDS, MIG_NODES, Names, Phase, REPLICA_LOG, Shared, violation};

pub(crate) struct Replica {
    identity: String,
    child: tokio::process::Child,
}

pub(crate) struct Replicas {
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
    /// The first two replicas of `bin`, reaching the API server through `kubeconfig`.
    pub(crate) fn start(
        bin: PathBuf,
        names: Names,
        kubeconfig: PathBuf,
        agent_args: Vec<String>,
    ) -> anyhow::Result<Replicas> {
        let mut reps = Replicas {
            bin,
            names,
            kubeconfig,
            agent_args,
            slots: Vec::new(),
            generation: 0,
        };
        for slot in 0..2 {
            let r = reps.spawn(slot)?;
            reps.slots.push(r);
        }
        Ok(reps)
    }

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

    pub(crate) fn identities(&self) -> Vec<String> {
        self.slots.iter().map(|r| r.identity.clone()).collect()
    }
}

pub(crate) fn operator_bin() -> anyhow::Result<PathBuf> {
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

pub(crate) async fn lease_holder(client: &Client, n: &Names) -> Option<String> {
    Api::<Lease>::namespaced(client.clone(), &n.sys)
        .get_opt(&n.lease)
        .await
        .ok()
        .flatten()
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
}

/// When to kill the leader next, and the kill whose failover is still awaited.
struct Kills {
    rng: Rng,
    kills: bool,
    kill_every: (u64, u64),
    next_kill: Instant,
    killed_at: Option<(Instant, String)>,
}

/// Keeps two replicas running; in `Chaos`, SIGKILLs the leader every `kill_every` s.
pub(crate) async fn run_replicas(
    mut r: Replicas,
    client: Client,
    tally: Shared,
    mut phase: watch::Receiver<Phase>,
    kill_every: Option<(u64, u64)>,
    seed: u64,
    ids: Arc<Mutex<Vec<String>>>,
) {
    let mut k = Kills::new(kill_every, seed);
    loop {
        let now_phase = *phase.borrow_and_update();
        if now_phase == Phase::Stop {
            for mut rep in r.slots.drain(..) {
                let _ = rep.child.kill().await;
            }
            return;
        }
        replace_exited(&mut r, &tally, &ids);
        let holder = lease_holder(&client, &r.names).await;
        k.note_failover(&r, &holder, &tally);
        if k.kills && now_phase == Phase::Chaos && Instant::now() >= k.next_kill {
            k.kill_leader(&mut r, &holder, &tally, &ids).await;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
            _ = phase.changed() => {}
        }
    }
}

/// Replicas that exited by themselves are counted and replaced.
fn replace_exited(r: &mut Replicas, tally: &Shared, ids: &Arc<Mutex<Vec<String>>>) {
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
            respawn(r, slot, tally, ids);
        }
    }
}

/// A new replica in `slot`, in place of the one that is gone.
fn respawn(r: &mut Replicas, slot: usize, tally: &Shared, ids: &Arc<Mutex<Vec<String>>>) {
    match r.spawn(slot) {
        Ok(rep) => {
            r.slots[slot] = rep;
            *ids.lock().unwrap() = r.identities();
            tally.lock().unwrap().replica_starts += 1;
        }
        Err(e) => violation(tally, format!("could not restart a replica: {e:#}")),
    }
}

impl Kills {
    fn new(kill_every: Option<(u64, u64)>, seed: u64) -> Kills {
        let mut rng = Rng::new(seed ^ 0x6b69_6c6c);
        let (kills, kill_every) = (kill_every.is_some(), kill_every.unwrap_or((1, 1)));
        let next_kill = Instant::now() + Duration::from_secs(rng.range(kill_every.0, kill_every.1));
        Kills {
            rng,
            kills,
            kill_every,
            next_kill,
            killed_at: None,
        }
    }

    /// A live replica other than the one killed holds the Lease: the failover's time.
    fn note_failover(&mut self, r: &Replicas, holder: &Option<String>, tally: &Shared) {
        if let (Some((at, old)), Some(h)) = (&self.killed_at, holder)
            && h != old
            && r.identities().contains(h)
        {
            tally
                .lock()
                .unwrap()
                .failovers
                .push(at.elapsed().as_secs_f64());
            self.killed_at = None;
        }
    }

    /// SIGKILLs the Lease's `holder` and starts a replica in its place.
    async fn kill_leader(
        &mut self,
        r: &mut Replicas,
        holder: &Option<String>,
        tally: &Shared,
        ids: &Arc<Mutex<Vec<String>>>,
    ) {
        let kill_every = self.kill_every;
        self.next_kill =
            Instant::now() + Duration::from_secs(self.rng.range(kill_every.0, kill_every.1));
        match holder
            .as_ref()
            .and_then(|h| r.slots.iter().position(|rep| &rep.identity == h))
        {
            Some(slot) => {
                let who = r.slots[slot].identity.clone();
                let _ = r.slots[slot].child.start_kill(); // SIGKILL
                let _ = r.slots[slot].child.wait().await;
                eprintln!("[chaos] SIGKILLed the leader {who}");
                self.killed_at = Some((Instant::now(), who));
                {
                    let mut t = tally.lock().unwrap();
                    t.leader_kills += 1;
                }
                respawn(r, slot, tally, ids);
            }
            None => {
                // The lease is still held by a replica killed before (not yet
                // expired) or the API server is away: try again shortly.
                tally.lock().unwrap().kill_rounds_without_leader += 1;
                self.next_kill = Instant::now() + Duration::from_secs(1);
            }
        }
    }
}
