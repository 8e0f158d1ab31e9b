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
//!
//! The steps are `podmotion_e2e::chaos::scenario`'s; [`scenario`] below runs them in
//! order.
#![forbid(unsafe_code)]

use std::time::Instant;

use podmotion_e2e::chaos::opts::{Opts, parse_opts};
use podmotion_e2e::chaos::scenario::Run;
use podmotion_e2e::chaos::summary::Measured;

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

/// Prepares the run, runs its steps, stops what they started; then the summary (exit
/// 1 on a violation), or, if a step failed, the teardown without the operators (exit 2).
async fn run(o: Opts) -> anyhow::Result<bool> {
    let started = Instant::now();
    let mut run = Run::prepare(&o).await?;
    let res = scenario(&mut run, &o).await;
    run.stop();
    match res {
        Ok(measured) => Ok(run.summary(&o, &measured, started)),
        Err(e) => {
            run.tear_down_after_failure().await;
            Err(e)
        }
    }
}

/// The run, step by step: set up; start the live workload, the replicas behind the
/// proxy and the sampler; the baseline without faults and the live migration without
/// faults; the faults (kills, 409/429, churn, live migrations, the API server's
/// restart); convergence after the last fault; the teardown with the operators up.
async fn scenario(run: &mut Run, o: &Opts) -> anyhow::Result<Measured> {
    let mig_pods = run.set_up(o).await?;
    let live = run.start_live_workload(o).await?;
    let workers = run.start_replicas(o, &live, &mig_pods).await?;
    let baseline = run.baseline(&workers).await?;
    if let Some(l) = &live {
        run.control_round(l).await;
    }
    if o.plant_violation {
        run.plant_violation().await?;
    }
    let faults = run.start_faults(o, &workers, &live, &mig_pods);
    run.hold_faults(o, &faults).await;
    let mut settling = run.stop_faults(&workers, faults).await;
    let conv = run.converge(&workers, &mut settling).await;
    let proxy = run.tear_down(workers).await;
    Ok(Measured {
        proxy,
        baseline,
        conv,
        faults_secs: settling.faults_secs,
    })
}
