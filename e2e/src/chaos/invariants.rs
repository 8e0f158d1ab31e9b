//! The invariants of the chaos run that hold at every moment, even mid-fault, sampled
//! every [`SAMPLE_EVERY`] while it runs.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::labels;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use tokio::sync::watch;

use super::state::{CONVERGENCE, Names, Phase, SAMPLE_EVERY, Shared, violation};
use crate::pod_running_ready;

pub(crate) fn live<K: kube::Resource>(items: Vec<K>) -> Vec<K> {
    items
        .into_iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .collect()
}

/// (owner UID label, kind, name) of every object of `api` that `sel` selects.
pub(crate) async fn owned<K>(
    api: Api<K>,
    sel: &ListParams,
) -> anyhow::Result<Vec<(String, String, String)>>
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

pub(crate) fn label<'a, K: kube::Resource>(o: &'a K, key: &str) -> &'a str {
    o.meta()
        .labels
        .as_ref()
        .and_then(|l| l.get(key))
        .map(String::as_str)
        .unwrap_or("")
}

pub(crate) fn terminal(p: &MigrationPhase) -> bool {
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

/// The violations found by one sample, and the number of checks made.
#[derive(Default)]
struct Sample {
    v: Vec<String>,
    checks: u64,
}

/// The invariants that hold at every moment, even mid-fault. Returns the violations
/// and the number of checks made.
async fn sample(
    client: &Client,
    n: &Names,
    mig_uids: &BTreeSet<String>,
    tally: &Shared,
) -> kube::Result<(Vec<String>, u64)> {
    let mut s = Sample::default();
    s.agent_jobs(client, n).await?;
    s.pool_children(client, n).await?;
    s.migrated_workload(client, n, mig_uids).await?;
    s.migration_children(client, n, tally).await?;
    s.deletions(client, n, tally).await?;
    Ok((s.v, s.checks))
}

impl Sample {
    /// One live agent Job per target pod.
    async fn agent_jobs(&mut self, client: &Client, n: &Names) -> kube::Result<()> {
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
            self.checks += 1;
            if js.len() > 1 {
                self.v
                    .push(format!("duplicate agent Jobs for target pod {pod}: {js:?}"));
            }
        }
        Ok(())
    }

    /// At most one child of each kind per RunnerPool.
    async fn pool_children(&mut self, client: &Client, n: &Names) -> kube::Result<()> {
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
            self.checks += 1;
            if names.len() > 1 {
                self.v.push(format!(
                    "RunnerPool {uid} has {} {kind}s: {names:?}",
                    names.len()
                ));
            }
        }
        Ok(())
    }

    /// The migrated workload runs exactly as it started: same pods, all Running (no
    /// migration reaches an agent, so none may touch a source pod).
    async fn migrated_workload(
        &mut self,
        client: &Client,
        n: &Names,
        mig_uids: &BTreeSet<String>,
    ) -> kube::Result<()> {
        let pods = Api::<Pod>::namespaced(client.clone(), &n.app);
        let mig: Vec<Pod> = pods
            .list(&ListParams::default().labels("app=mig"))
            .await?
            .items;
        let uids: BTreeSet<String> = mig.iter().filter_map(|p| p.uid()).collect();
        self.checks += 1;
        if &uids != mig_uids || !mig.iter().all(pod_running_ready) {
            self.v.push(format!(
                "the migrated workload changed: pods {:?} (expected {mig_uids:?}), running {:?}",
                uids,
                mig.iter().map(pod_running_ready).collect::<Vec<_>>()
            ));
        }
        Ok(())
    }

    /// At most one target pod and one transfer key per migration.
    async fn migration_children(
        &mut self,
        client: &Client,
        n: &Names,
        tally: &Shared,
    ) -> kube::Result<()> {
        let pods = Api::<Pod>::namespaced(client.clone(), &n.app);
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
            self.checks += 1;
            tally
                .lock()
                .unwrap()
                .seen_migration_children
                .extend(names.iter().map(|n| format!("{what} {n}")));
            if names.len() > 1 {
                self.v.push(format!(
                    "PodMigration {owner} has {} {what}s: {names:?}",
                    names.len()
                ));
            }
        }
        Ok(())
    }

    /// No wedged finalizer: every deletion completes within CONVERGENCE.
    async fn deletions(&mut self, client: &Client, n: &Names, tally: &Shared) -> kube::Result<()> {
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
            self.checks += 1;
            let there = still_there(client, &n.app, kind, &name, &uid).await?;
            let mut t = tally.lock().unwrap();
            let d = &mut t.deleted[i];
            if !there {
                d.gone = true;
                let secs = d.at.elapsed().as_secs_f64();
                t.deletion_secs.push(secs);
            } else if at.elapsed() > CONVERGENCE && !d.reported {
                d.reported = true;
                self.v.push(format!(
                    "{kind} {name} still present {:.0} s after its deletion (finalizer wedged?)",
                    at.elapsed().as_secs_f64()
                ));
            }
        }
        Ok(())
    }
}

pub(crate) async fn sampler(
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
