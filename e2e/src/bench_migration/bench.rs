//! One run: every size's Deployments and rounds, each round one raw CRIU
//! checkpoint/restore and one PodMigration per mode, with the agents' memory over it.

use std::collections::BTreeSet;
use std::sync::Mutex;

use anyhow::{Context, ensure};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use serde_json::json;

use super::agent_memory::AgentWatch;
use super::args::Args;
use super::figures::{AgentPeaks, Mig, Mode, Reading, Row, uptime};
use super::mig::{MIGRATION_WAIT, agent_log_lines, mig_of, migration, print_timeline};
use super::raw::{Work, delete_now, raw_round, ready_pod};
use crate::real::testload::{self, POD_TIMEOUT, node_of};
use crate::{from_json, wait_for, wait_list};

/// One run's settings, cluster handles and scratch.
pub(super) struct Bench {
    pub(super) work: Work,
    pub(super) pods: Api<Pod>,
    pub(super) pms: Api<PodMigration>,
    pub(super) deploys: Api<Deployment>,
    /// The release's migration agents (one per real node).
    pub(super) agent_pods: Api<Pod>,
    pub(super) nodes: Vec<String>,
    pub(super) agents_ns: String,
    pub(super) testload_image: String,
    pub(super) args: Args,
    /// Why a memory reading was n/a, said once each.
    pub(super) said: Mutex<BTreeSet<String>>,
}

impl Bench {
    /// Every size's rounds (the load average after each size), its Deployments
    /// created first and deleted after.
    pub(super) async fn run(&self) -> anyhow::Result<(Vec<Row>, Vec<String>)> {
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
    pub(super) async fn create_deployments(&self, size: u32) -> anyhow::Result<Vec<String>> {
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
    pub(super) async fn delete_deployments(&self, names: Vec<String>) -> anyhow::Result<()> {
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
    pub(super) async fn round(&self, size: u32, mode: Mode, round: usize, raw_first: bool) -> Row {
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
    pub(super) fn na(&self, why: String) -> Reading {
        if self.said.lock().unwrap().insert(why.clone()) {
            eprintln!("NOTE: an agent memory figure is n/a: {why}");
        }
        Err(why)
    }

    /// Starts watching the agents on `nodes` (`[source, target]`): their peaks reset.
    pub(super) async fn watch_agents(&self, nodes: [&str; 2]) -> [Result<AgentWatch, String>; 2] {
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
    pub(super) fn agent_peaks(&self, watches: &mut [Result<AgentWatch, String>; 2]) -> AgentPeaks {
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
