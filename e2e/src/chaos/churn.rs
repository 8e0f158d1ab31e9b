//! The churn of the three kinds while the faults last: Deployments with attachments
//! scaled, RunnerPools resized, PodMigrations created and deleted, one attachment
//! deleted and recreated.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use serde_json::json;
use tokio::sync::watch;

use super::Rng;
use super::invariants::terminal;
use super::setup::{attachment, migration};
use super::state::{ATTACHED, Names, POOLS, Phase, Shared, record_deletion};

/// The churn's random source, its APIs, and the PodMigrations it created and has not
/// deleted yet (name, UID).
struct Churn {
    rng: Rng,
    live_migrations: Vec<(String, String)>,
    counter: u64,
    deps: Api<Deployment>,
    pools: Api<RunnerPool>,
    migs: Api<PodMigration>,
    naas: Api<NodeAgentAttachment>,
    pp: PatchParams,
    mig_pods: Vec<String>,
    dry_only: bool,
    tally: Shared,
}

pub(crate) async fn churn(
    client: Client,
    n: Names,
    mig_pods: Vec<String>,
    dry_only: bool,
    tally: Shared,
    seed: u64,
    mut phase: watch::Receiver<Phase>,
) {
    let mut c = Churn {
        rng: Rng::new(seed ^ 0x6368_7572),
        live_migrations: Vec::new(),
        counter: 0u64,
        deps: Api::namespaced(client.clone(), &n.app),
        pools: Api::namespaced(client.clone(), &n.app),
        migs: Api::namespaced(client.clone(), &n.app),
        naas: Api::namespaced(client.clone(), &n.app),
        pp: PatchParams::default(),
        mig_pods,
        dry_only,
        tally,
    };
    while *phase.borrow_and_update() == Phase::Chaos {
        match c.step().await {
            Ok(what) => *c.tally.lock().unwrap().churn.entry(what).or_default() += 1,
            Err(e) => {
                eprintln!("[chaos] churn write failed (API server away?): {e:#}");
                c.tally.lock().unwrap().driver_errors += 1;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(c.rng.range(400, 1200))) => {}
            _ = phase.changed() => {}
        }
    }
    // Every attachment exists again for the final convergence.
    if c.naas.get_opt("attach-b").await.ok().flatten().is_none() {
        let _ = c
            .naas
            .create(&PostParams::default(), &attachment("attach-b"))
            .await;
    }
}

impl Churn {
    /// One random change; what it was, for the summary.
    async fn step(&mut self) -> anyhow::Result<&'static str> {
        let roll = self.rng.range(0, 99);
        Ok(match roll {
            0..=29 => self.scale_deployment().await?,
            30..=49 => self.resize_pool().await?,
            50..=69 if self.live_migrations.len() < 4 => self.create_migration().await?,
            50..=89 if !self.live_migrations.is_empty() => self.delete_migration().await?,
            _ => self.delete_or_recreate_attachment().await?,
        })
    }

    async fn scale_deployment(&mut self) -> anyhow::Result<&'static str> {
        let d = ATTACHED[self.rng.range(0, 1) as usize];
        let replicas = self.rng.range(0, 3);
        self.deps
            .patch(
                d,
                &self.pp,
                &Patch::Merge(json!({"spec": {"replicas": replicas}})),
            )
            .await?;
        Ok("Deployment scaled")
    }

    async fn resize_pool(&mut self) -> anyhow::Result<&'static str> {
        let p = POOLS[self.rng.range(0, 1) as usize];
        let s = self.rng.range(1, 4);
        self.pools
            .patch(
                p,
                &self.pp,
                &Patch::Merge(json!({"spec": {"sessionsPerNode": s}})),
            )
            .await?;
        Ok("RunnerPool sessionsPerNode changed")
    }

    async fn create_migration(&mut self) -> anyhow::Result<&'static str> {
        self.counter += 1;
        // With live agents, real migrations are the live workload's (their
        // own driver): those of `mig` would reach the same agents.
        let dry = self.rng.range(0, 1) == 0 || self.dry_only;
        let name = format!("{}-{}", if dry { "dry" } else { "real" }, self.counter);
        let pod = &self.mig_pods[self.rng.range(0, self.mig_pods.len() as u64 - 1) as usize];
        let m = self
            .migs
            .create(&PostParams::default(), &migration(&name, pod, dry))
            .await?;
        self.live_migrations
            .push((name, m.uid().unwrap_or_default()));
        Ok(if dry {
            "PodMigration (dry run) created"
        } else {
            "PodMigration (agents unreachable) created"
        })
    }

    async fn delete_migration(&mut self) -> anyhow::Result<&'static str> {
        let i = self.rng.range(0, self.live_migrations.len() as u64 - 1) as usize;
        let (name, uid) = self.live_migrations.remove(i);
        let finished = self
            .migs
            .get_opt(&name)
            .await?
            .and_then(|m| m.status)
            .is_some_and(|s| terminal(&s.phase));
        self.migs.delete(&name, &DeleteParams::default()).await?;
        record_deletion(&self.tally, "PodMigration", name, uid);
        Ok(if finished {
            "PodMigration deleted (finished)"
        } else {
            "PodMigration deleted (in flight: abort)"
        })
    }

    /// The attachment of attach-b: deleted, or recreated once gone.
    async fn delete_or_recreate_attachment(&mut self) -> anyhow::Result<&'static str> {
        Ok(match self.naas.get_opt("attach-b").await? {
            Some(a) if a.metadata.deletion_timestamp.is_none() => {
                self.naas
                    .delete("attach-b", &DeleteParams::default())
                    .await?;
                record_deletion(
                    &self.tally,
                    "NodeAgentAttachment",
                    "attach-b".into(),
                    a.uid().unwrap_or_default(),
                );
                "NodeAgentAttachment deleted"
            }
            Some(_) => "NodeAgentAttachment still deleting (skipped)",
            None => {
                self.naas
                    .create(&PostParams::default(), &attachment("attach-b"))
                    .await?;
                "NodeAgentAttachment recreated"
            }
        })
    }
}
