//! Benchmark (not a test): how long the attachment controller takes to create the agent
//! Jobs of an N-replica workload, against a plain client creating the same N Jobs, side
//! by side against the same API server in one run.
//!
//!     hack/cluster.sh up
//!     cargo run --release -p podmotion-e2e --bin bench_attach_jobs -- [replicas] [rounds]
//!
//! Each round times, to the same stop on both sides (a watch on the Jobs' namespace,
//! established before the clock starts, has seen all N Jobs):
//! (a) a plain client POSTing the N rendered Jobs, 16 in flight, from its first POST;
//! (b) the controller, already running and synced, from the POST of a
//!     NodeAgentAttachment (so including the controller's own work before its first
//!     Job); it also reports when the N Jobs are resumed with their credential Secrets.
//! Each side also reports when its first Job was seen. Then both go on to *runnable*
//! (DESIGN.md §4: "the same holds until every Job is runnable"), to the same stop (a
//! pod watch, established before the clock, has seen every Job's pod Running): the
//! plain client makes the controller's writes after its Jobs — per Job a credential
//! Secret, then the resume patch, 16 in flight — and the controller is only waited for.
//! Rounds alternate the order; the headlines are the medians of the per-round ratios.
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy};
use kube::runtime::watcher::Event;
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::labels;
use podmotion_e2e::bench_attach::{
    PARALLEL, Watch, apply_attachment_crd, attachment_reconciles, delete_namespaces, median,
    namespace, settle, start_controller, synced_watch,
};
use podmotion_e2e::{
    connect, from_json, pod_running_ready, random_suffix, restricted_container, wait_list,
};
use podmotion_operator::attachment::plan::Resume;
use podmotion_operator::attachment::render::{self, Settings};
use podmotion_operator::attachment::{AttachmentView, JobView, ObservedGroup, PodView, plan};
use podmotion_operator::metrics::Metrics;
use serde_json::json;
use std::sync::Arc;

/// Waits until `n` objects match `sel` in `api` (or none, for `n == 0`).
async fn count<K>(api: &Api<K>, sel: &str, n: usize) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    wait_list(api, sel, Duration::from_secs(300), "bench objects", |l| {
        l.len() == n
    })
    .await
    .map(|_| ())
}

async fn delete_all(jobs: &Api<Job>, sel: &str) -> anyhow::Result<()> {
    let dp = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..Default::default()
    };
    jobs.delete_collection(&dp, &ListParams::default().labels(sel))
        .await?;
    count(jobs, sel, 0).await
}

/// Reads `w` until `n` distinct Jobs were seen: (first seen, all seen) since `t0`.
async fn seen_all(
    w: &mut Watch<Job>,
    n: usize,
    t0: Instant,
) -> anyhow::Result<(Duration, Duration)> {
    let mut names = std::collections::BTreeSet::new();
    let mut first = None;
    while names.len() < n {
        match w.try_next().await? {
            Some(Event::Apply(j)) => {
                first.get_or_insert_with(|| t0.elapsed());
                names.insert(j.name_any());
            }
            Some(_) => {}
            None => anyhow::bail!("Job watch ended"),
        }
    }
    Ok((first.unwrap_or_default(), t0.elapsed()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let replicas: usize = args.first().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let rounds: usize = args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(3);
    let client = connect().await?;
    let id = random_suffix();
    let (app_ns, agents_ns, plain_ns) = (
        format!("bench-app-{id}"),
        format!("bench-agents-{id}"),
        format!("bench-plain-{id}"),
    );
    namespace(&client, &app_ns, "restricted").await?;
    namespace(&client, &agents_ns, "privileged").await?;
    namespace(&client, &plain_ns, "privileged").await?;
    apply_attachment_crd(&client).await?;
    let pods = ready_workload(&client, &app_ns, replicas).await?;
    eprintln!("{replicas} replicas ready");

    // The controller, in this process, synced before anything is timed.
    let metrics = Arc::new(Metrics::new());
    let (stop, controller) = start_controller(&client, &agents_ns, &app_ns, metrics.clone())?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let plain_jobs = rendered_jobs(&app_ns, &plain_ns, &pods);
    assert_eq!(plain_jobs.len(), replicas);
    let bench = Bench {
        replicas,
        plain_api: Api::namespaced(client.clone(), &plain_ns),
        plain_secrets: Api::namespaced(client.clone(), &plain_ns),
        plain_pods: Api::namespaced(client.clone(), &plain_ns),
        agent_pods: Api::namespaced(client.clone(), &agents_ns),
        agent_jobs: Api::namespaced(client.clone(), &agents_ns),
        // The agents' tokens live beside the workload (docs/attachment.md, "Credentials").
        agent_secrets: Api::namespaced(client.clone(), &app_ns),
        naas: Api::namespaced(client.clone(), &app_ns),
        sel: format!("{}={app_ns}", labels::TARGET_NAMESPACE),
        metrics,
    };
    let mut samples = Samples::default();
    for round in 0..rounds {
        for which in if round % 2 == 0 {
            ["plain", "operator"]
        } else {
            ["operator", "plain"]
        } {
            if which == "plain" {
                bench.plain_round(round, &plain_jobs, &mut samples).await?;
            } else {
                bench.operator_round(round, &mut samples).await?;
            }
        }
    }
    samples.print(replicas, rounds);
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), controller).await;
    delete_namespaces(&client, &[app_ns, agents_ns, plain_ns]).await;
    Ok(())
}

/// The workload: N ready replicas over every kwok node.
async fn ready_workload(
    client: &Client,
    app_ns: &str,
    replicas: usize,
) -> anyhow::Result<Vec<Pod>> {
    let deploy: Deployment = from_json(json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
          "template": {"metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [restricted_container("app")], "nodeSelector": {"type": "kwok"}, "tolerations": [{"operator": "Exists"}]}}}
    }));
    Api::<Deployment>::namespaced(client.clone(), app_ns)
        .create(&PostParams::default(), &deploy)
        .await?;
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), app_ns);
    wait_list(
        &pods_api,
        "app=web",
        Duration::from_secs(300),
        "ready replicas",
        |ps| ps.len() == replicas && ps.iter().all(pod_running_ready),
    )
    .await
}

/// The plain client's Jobs: exactly what the controller's own plan renders for these
/// pods.
fn rendered_jobs(app_ns: &str, plain_ns: &str, pods: &[Pod]) -> Vec<Job> {
    let settings = Settings {
        namespace: plain_ns.to_string(),
        job_prefix: "pm-agent".into(),
        ..Settings::default()
    };
    let naa: NodeAgentAttachment = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
        "metadata": {"name": "bench", "namespace": app_ns},
        "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
    }));
    let group = ObservedGroup {
        namespace: app_ns.to_string(),
        workload: naa.spec.workload_ref.clone(),
        workload_exists: true,
        attachments: vec![AttachmentView::from_object(&naa, None)],
        pods: pods.iter().map(PodView::from_pod).collect(),
        jobs: vec![],
        node_labels: Default::default(),
        now: k8s_openapi::jiff::Timestamp::now(),
    };
    plan(&group, &settings)
        .create
        .into_iter()
        .map(|c| c.job)
        .collect()
}

/// The APIs one run's rounds use, and the controller's metrics.
struct Bench {
    replicas: usize,
    plain_api: Api<Job>,
    /// The plain client's credential Secrets (beside its Jobs).
    plain_secrets: Api<Secret>,
    plain_pods: Api<Pod>,
    agent_pods: Api<Pod>,
    agent_jobs: Api<Job>,
    agent_secrets: Api<Secret>,
    naas: Api<NodeAgentAttachment>,
    /// The Jobs of the workload's namespace (both sides label them alike).
    sel: String,
    metrics: Arc<Metrics>,
}

/// Every round's measurements, in round order.
#[derive(Default)]
struct Samples {
    /// Plain client: all N Jobs seen.
    plain: Vec<Duration>,
    plain_first: Vec<Duration>,
    /// Controller: all N Jobs seen.
    op_jobs: Vec<Duration>,
    /// Controller: all N Jobs resumed with their Secrets.
    op_all: Vec<Duration>,
    /// Plain client / controller: every Job's pod Running (runnable).
    plain_runnable: Vec<Duration>,
    op_runnable: Vec<Duration>,
    op_first: Vec<Duration>,
    op_reconciles: Vec<u64>,
}

/// Reads `w` until `n` distinct pods were seen Running: when, since `t0`.
async fn all_running(w: &mut Watch<Pod>, n: usize, t0: Instant) -> anyhow::Result<Duration> {
    let mut names = std::collections::BTreeSet::new();
    while names.len() < n {
        match w.try_next().await? {
            Some(Event::Apply(p)) => {
                if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
                    names.insert(p.name_any());
                }
            }
            Some(_) => {}
            None => anyhow::bail!("pod watch ended"),
        }
    }
    Ok(t0.elapsed())
}

impl Bench {
    /// What the controller writes to make one created Job runnable, by a plain client:
    /// its credential Secret (beside the plain Jobs), then the resume patch.
    async fn plain_resume(&self, j: JobView) -> anyhow::Result<()> {
        let r = Resume::of(&j);
        let token: [u8; 32] = std::array::from_fn(|i| i as u8);
        let mut secret = render::credentials(
            &Settings::default(),
            render::CredentialOf {
                job: &r.job,
                target_namespace: &r.target_namespace,
                target_pod: &r.target_pod,
                target_pod_uid: &r.target_pod_uid,
            },
            &token,
        );
        secret.metadata.namespace = None;
        secret.metadata.owner_references = None;
        self.plain_secrets
            .create(&PostParams::default(), &secret)
            .await?;
        self.plain_api
            .patch(
                &r.job,
                &PatchParams::default(),
                &Patch::Merge(render::resume_patch(&token)),
            )
            .await?;
        Ok(())
    }

    /// The plain client POSTs the rendered Jobs, then they are deleted.
    async fn plain_round(
        &self,
        round: usize,
        plain_jobs: &[Job],
        s: &mut Samples,
    ) -> anyhow::Result<()> {
        let replicas = self.replicas;
        let mut seen = synced_watch(&self.plain_api, &self.sel).await?;
        let mut running = synced_watch(&self.plain_pods, &self.sel).await?;
        let t0 = Instant::now();
        let posts = async {
            let created = stream::iter(plain_jobs.iter())
                .map(|j| {
                    let api = self.plain_api.clone();
                    async move { api.create(&PostParams::default(), j).await }
                })
                .buffer_unordered(PARALLEL)
                .try_collect::<Vec<_>>()
                .await?;
            Ok::<_, anyhow::Error>((created, t0.elapsed()))
        };
        let ((created, posted), (first, all)) =
            tokio::try_join!(posts, seen_all(&mut seen, replicas, t0))?;
        s.plain.push(all);
        s.plain_first.push(first);
        // Then the controller's writes after its Jobs, the same way: per Job, a
        // credential Secret, then the resume patch; and the same wait, for every pod.
        let resumes = async {
            stream::iter(created.iter().filter_map(JobView::from_job))
                .map(|j| self.plain_resume(j))
                .buffer_unordered(PARALLEL)
                .try_collect::<Vec<()>>()
                .await
        };
        let (_, runnable) = tokio::try_join!(resumes, all_running(&mut running, replicas, t0))?;
        s.plain_runnable.push(runnable);
        eprintln!(
            "round {round}: plain client: first Job seen {first:?}, last POST returned {posted:?}, all {replicas} seen {all:?}, every pod Running {runnable:?}"
        );
        delete_all(&self.plain_api, &self.sel).await?;
        self.plain_secrets
            .delete_collection(
                &DeleteParams::default(),
                &ListParams::default().labels(&format!("{}=node-agent", labels::COMPONENT)),
            )
            .await?;
        settle(Duration::from_secs(5)).await;
        Ok(())
    }

    /// A NodeAgentAttachment is created; the controller makes and resumes the Jobs;
    /// the attachment is deleted and its Jobs and Secrets are waited away.
    async fn operator_round(&self, round: usize, s: &mut Samples) -> anyhow::Result<()> {
        let (replicas, sel) = (self.replicas, &self.sel);
        let mut seen = synced_watch(&self.agent_jobs, sel).await?;
        let mut running = synced_watch(&self.agent_pods, sel).await?;
        let naa: NodeAgentAttachment = from_json(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
            "metadata": {"name": "bench"},
            "spec": {"workloadRef": {"kind": "Deployment", "name": "web"}, "mode": "Intercept"}
        }));
        let r0 = attachment_reconciles(&self.metrics);
        let t0 = Instant::now();
        self.naas.create(&PostParams::default(), &naa).await?;
        let (first, d) = seen_all(&mut seen, replicas, t0).await?;
        s.op_first.push(first);
        // Resumed: each Job's credential Secret exists and its pod may start.
        wait_list(
            &self.agent_jobs,
            sel,
            Duration::from_secs(300),
            "Jobs resumed",
            |js| {
                js.len() == replicas
                    && js
                        .iter()
                        .all(|j| j.spec.as_ref().and_then(|s| s.suspend) == Some(false))
            },
        )
        .await?;
        let d_all = t0.elapsed();
        let runnable = all_running(&mut running, replicas, t0).await?;
        s.op_jobs.push(d);
        s.op_all.push(d_all);
        s.op_runnable.push(runnable);
        eprintln!(
            "round {round}: operator: first Job seen {first:?}, all {replicas} seen {d:?} (all resumed with their Secrets {d_all:?}, every pod Running {runnable:?})"
        );
        self.naas.delete("bench", &DeleteParams::default()).await?;
        count(&self.agent_jobs, sel, 0).await?;
        wait_list(
            &self.naas,
            "",
            Duration::from_secs(120),
            "attachment gone",
            |l| l.is_empty(),
        )
        .await?;
        count(
            &self.agent_secrets,
            "app.kubernetes.io/component=node-agent",
            0,
        )
        .await?;
        let r = attachment_reconciles(&self.metrics) - r0;
        s.op_reconciles.push(r);
        eprintln!("round {round}: operator: {r} reconciles from create to deletion");
        settle(Duration::from_secs(5)).await;
        Ok(())
    }
}

impl Samples {
    fn print(&self, replicas: usize, rounds: usize) {
        // Rounds are paired (same load on the machine), so the headline is the median of
        // the per-round ratios; the medians of each side are printed too.
        let ratios = |op: &[Duration]| -> Vec<f64> {
            op.iter()
                .zip(&self.plain)
                .map(|(o, p)| o.as_secs_f64() / p.as_secs_f64())
                .collect()
        };
        let med = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.total_cmp(b));
            v[v.len() / 2]
        };
        let (rj, ra) = (ratios(&self.op_jobs), ratios(&self.op_all));
        let rr: Vec<f64> = self
            .op_runnable
            .iter()
            .zip(&self.plain_runnable)
            .map(|(o, p)| o.as_secs_f64() / p.as_secs_f64())
            .collect();
        println!("replicas: {replicas}, rounds: {rounds}, parallel writes: {PARALLEL}");
        println!(
            "per-round ratio operator/plain, Jobs:           {rj:.2?}  median {:.2}",
            med(rj.clone())
        );
        println!(
            "per-round ratio operator/plain, Jobs resumed with Secrets: {ra:.2?}  median {:.2}",
            med(ra.clone())
        );
        println!(
            "per-round ratio operator/plain, every pod Running (runnable): {rr:.2?}  median {:.2}",
            med(rr.clone())
        );
        println!(
            "median every pod Running: plain {:?}, operator {:?}",
            median(&self.plain_runnable),
            median(&self.op_runnable)
        );
        let (p, o, a) = (
            median(&self.plain),
            median(&self.op_jobs),
            median(&self.op_all),
        );
        println!(
            "median first Job seen: plain {:?}, operator {:?}",
            median(&self.plain_first),
            median(&self.op_first)
        );
        println!(
            "attachment reconciles per round, create to deletion: {:?}",
            self.op_reconciles
        );
        println!("median plain client, {replicas} Jobs:       {p:?}");
        println!("median operator, {replicas} Jobs:           {o:?}");
        println!("median operator, {replicas} Jobs resumed with Secrets: {a:?}");
    }
}
