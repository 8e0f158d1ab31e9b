//! Convergence after the last fault: every status observes its generation and is
//! Ready/settled, exactly the expected children exist per owner, and none else.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::bail;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};
use podmotion_api::conditions::is_true;
use podmotion_api::names::{condition_types as ct, labels};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};

use super::invariants::{label, owned, terminal};
use super::replicas::lease_holder;
use super::state::{AGENT_POLICY, CONVERGENCE, Names, Shared, violation};
use crate::pod_running_ready;

/// `Ok(checks)` when everything has settled: statuses observe their generation, every
/// owner has exactly its expected children and nothing is orphaned. `Err(why)` otherwise.
pub(crate) async fn converged(
    client: &Client,
    n: &Names,
    replicas: &[String],
    checks: &mut u64,
) -> anyhow::Result<()> {
    lease_held(client, n, replicas, checks).await?;
    let want = attachments_settled(client, n, checks).await?;
    let jobs = agent_jobs(client, n, &want, checks).await?;
    agent_credentials(client, n, &jobs, checks).await?;
    agent_policy(client, n, &jobs, checks).await?;
    runner_pools_settled(client, n, checks).await?;
    migrations_finished(client, n, checks).await?;
    Ok(())
}

async fn lease_held(
    client: &Client,
    n: &Names,
    replicas: &[String],
    checks: &mut u64,
) -> anyhow::Result<()> {
    let holder = lease_holder(client, n).await;
    *checks += 1;
    if !holder.as_ref().is_some_and(|h| replicas.contains(h)) {
        bail!("no live replica holds the Lease (holder {holder:?})");
    }
    Ok(())
}

/// Attachments: status current, every attached Deployment settled. Returns the UIDs of
/// their pods, each of which must have one agent Job.
async fn attachments_settled(
    client: &Client,
    n: &Names,
    checks: &mut u64,
) -> anyhow::Result<BTreeSet<String>> {
    // Attachments: status current; one Job (with its Secret, resumed) per ready pod of
    // each attached Deployment; no other agent Job; the deny-ingress policy.
    let naas = Api::<NodeAgentAttachment>::namespaced(client.clone(), &n.app)
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
        let d = Api::<Deployment>::namespaced(client.clone(), &n.app)
            .get(&a.name_any())
            .await?;
        let replicas = d.spec.replicas.unwrap_or(1);
        let pods = Api::<Pod>::namespaced(client.clone(), &n.app)
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
    Ok(want)
}

/// One Job (resumed) per ready pod of each attached Deployment; no other agent Job.
async fn agent_jobs(
    client: &Client,
    n: &Names,
    want: &BTreeSet<String>,
    checks: &mut u64,
) -> anyhow::Result<Vec<Job>> {
    let jobs = Api::<Job>::namespaced(client.clone(), &n.sys)
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
    Ok(jobs)
}

/// Each Job's credential lives in the attachment's namespace (the tenant's), named
/// like the Job and owned by its target pod; the agents' namespace holds none.
async fn agent_credentials(
    client: &Client,
    n: &Names,
    jobs: &[Job],
    checks: &mut u64,
) -> anyhow::Result<()> {
    let secrets = Api::<Secret>::namespaced(client.clone(), &n.app);
    for j in jobs {
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
    Ok(())
}

/// The deny-ingress policy of the agents, if there are any.
async fn agent_policy(
    client: &Client,
    n: &Names,
    jobs: &[Job],
    checks: &mut u64,
) -> anyhow::Result<()> {
    *checks += 1;
    if !jobs.is_empty()
        && Api::<NetworkPolicy>::namespaced(client.clone(), &n.sys)
            .get_opt(AGENT_POLICY)
            .await?
            .is_none()
    {
        bail!("the agents' NetworkPolicy {AGENT_POLICY} is missing");
    }
    Ok(())
}

/// RunnerPools: status current, Ready, the capacity of the current spec; exactly the
/// DaemonSet, NetworkPolicy and credential Secret of each pool, nothing orphaned.
async fn runner_pools_settled(client: &Client, n: &Names, checks: &mut u64) -> anyhow::Result<()> {
    let expected = runner_pools_ready(client, n, checks).await?;
    let sel = ListParams::default().labels(&format!("{}=RunnerPool", labels::OWNER_KIND));
    let mut children: BTreeSet<(String, String, String)> = BTreeSet::new();
    children.extend(owned(Api::<DaemonSet>::namespaced(client.clone(), &n.app), &sel).await?);
    children.extend(
        owned(
            Api::<NetworkPolicy>::namespaced(client.clone(), &n.app),
            &sel,
        )
        .await?,
    );
    children.extend(owned(Api::<Secret>::namespaced(client.clone(), &n.app), &sel).await?);
    *checks += 1;
    if children != expected {
        bail!("RunnerPool children {children:?}, expected {expected:?}");
    }
    Ok(())
}

/// Every RunnerPool's status current, Ready, with the capacity of its spec. Returns
/// the children the pools must have: (owner UID, kind, name).
async fn runner_pools_ready(
    client: &Client,
    n: &Names,
    checks: &mut u64,
) -> anyhow::Result<BTreeSet<(String, String, String)>> {
    let pools = Api::<RunnerPool>::namespaced(client.clone(), &n.app)
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
    Ok(expected)
}

/// PodMigrations: finished, status current; no target pod or transfer key left.
async fn migrations_finished(client: &Client, n: &Names, checks: &mut u64) -> anyhow::Result<()> {
    // PodMigrations: finished, status current.
    for m in Api::<PodMigration>::namespaced(client.clone(), &n.app)
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
    let targets = Api::<Pod>::namespaced(client.clone(), &n.app)
        .list(&ListParams::default().labels(labels::MIGRATION))
        .await?
        .items;
    let keys = Api::<Secret>::namespaced(client.clone(), &n.app)
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
pub(crate) async fn await_convergence(
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
