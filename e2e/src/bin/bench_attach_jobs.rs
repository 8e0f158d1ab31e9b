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
//! Each side also reports when its first Job was seen. Rounds alternate the order; the
//! headline is the median of the per-round ratios.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Namespace, Pod, Secret};
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, PropagationPolicy,
};
use kube::runtime::watcher::{self, Event};
use kube::{Client, CustomResourceExt, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::labels;
use podmotion_e2e::{
    connect, from_json, pod_running_ready, random_suffix, restricted_container, wait_list,
};
use podmotion_operator::attachment::render::Settings;
use podmotion_operator::attachment::{AttachmentView, ObservedGroup, PodView, plan};
use podmotion_operator::config::{ControllerKind, LeaderConfig, OperatorConfig};
use podmotion_operator::context::Context;
use podmotion_operator::controllers::attachment::{AttachmentConfig, run_with};
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::{Metrics, ReconcileResult, ResultLabels};
use serde_json::json;

const PARALLEL: usize = 16;

async fn namespace(client: &Client, name: &str, level: &str) -> anyhow::Result<()> {
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([
                (
                    "pod-security.kubernetes.io/enforce".to_string(),
                    level.to_string(),
                ),
                ("podmotion.io/e2e".to_string(), "bench".to_string()),
            ])),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    Ok(())
}

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

/// Lets the control plane finish the previous round's aftermath (garbage collection of
/// Job pods, kwok status updates) so it does not bill the next measurement.
async fn settle() {
    tokio::time::sleep(Duration::from_secs(5)).await;
}

type JobWatch = futures::stream::BoxStream<'static, Result<Event<Job>, watcher::Error>>;

/// A Job watch on `sel`, its initial (empty) list drained, so that the clock starts
/// with the watch already established.
async fn synced_watch(api: &Api<Job>, sel: &str) -> anyhow::Result<JobWatch> {
    let mut w = watcher::watcher(api.clone(), watcher::Config::default().labels(sel)).boxed();
    while let Some(ev) = w.try_next().await? {
        if matches!(ev, Event::InitDone) {
            break;
        }
    }
    Ok(w)
}

/// Reads `w` until `n` distinct Jobs were seen: (first seen, all seen) since `t0`.
async fn seen_all(w: &mut JobWatch, n: usize, t0: Instant) -> anyhow::Result<(Duration, Duration)> {
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

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
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
    for ns in [app_ns, agents_ns, plain_ns] {
        let _ = Api::<Namespace>::all(client.clone())
            .delete(&ns, &DeleteParams::default())
            .await;
    }
    Ok(())
}

async fn apply_attachment_crd(client: &Client) -> anyhow::Result<()> {
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let crd = NodeAgentAttachment::crd();
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply("podmotion-bench").force(),
        &Patch::Apply(&crd),
    )
    .await?;
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

/// Runs the attachment controller in this process (agents' Jobs in `agents_ns`,
/// watching `app_ns`); it stops when `true` is sent on the returned channel.
fn start_controller(
    client: &Client,
    agents_ns: &str,
    app_ns: &str,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
)> {
    let config = OperatorConfig {
        namespace: agents_ns.to_string(),
        identity: "bench".into(),
        controllers: vec![ControllerKind::Attachment],
        http_addr: "127.0.0.1:0".parse()?,
        leader: LeaderConfig {
            enabled: false,
            lease_name: "unused".into(),
            lease_seconds: 15,
        },
        concurrency: 8,
        log_format: Default::default(),
        node_arch: podmotion_operator::platform::DEFAULT_ARCH.into(),
    };
    let (stop, rx) = tokio::sync::watch::channel(false);
    let ctx = Arc::new(Context::new(
        client.clone(),
        config,
        Leadership::always(),
        metrics,
        rx,
    ));
    let cfg = AttachmentConfig {
        job_prefix: "pm-agent".into(),
        agent_image: "registry.example/podmotion/attach:bench".into(),
        cri_socket_path: "/run".into(),
        sweep_seconds: 3600,
        write_parallelism: PARALLEL,
        backoff_limit: 3,
        image_pull_secrets: Vec::new(),
        pod_annotations: Default::default(),
        metrics_port: 9090,
        control_port: 15000,
        max_wiretaps: 4,
        jobs_namespace: None,
        watch_namespace: Some(app_ns.to_string()),
    };
    Ok((stop, tokio::spawn(run_with(ctx, cfg))))
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

/// Reconciles of the attachment controller so far (every result).
fn attachment_reconciles(metrics: &Metrics) -> u64 {
    [ReconcileResult::Success, ReconcileResult::Error]
        .into_iter()
        .map(|result| {
            metrics
                .reconciles
                .get_or_create(&ResultLabels {
                    controller: "attachment",
                    result,
                })
                .get()
        })
        .sum()
}

/// The APIs one run's rounds use, and the controller's metrics.
struct Bench {
    replicas: usize,
    plain_api: Api<Job>,
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
    op_first: Vec<Duration>,
    op_reconciles: Vec<u64>,
}

impl Bench {
    /// The plain client POSTs the rendered Jobs, then they are deleted.
    async fn plain_round(
        &self,
        round: usize,
        plain_jobs: &[Job],
        s: &mut Samples,
    ) -> anyhow::Result<()> {
        let replicas = self.replicas;
        let mut seen = synced_watch(&self.plain_api, &self.sel).await?;
        let t0 = Instant::now();
        let posts = async {
            stream::iter(plain_jobs.iter())
                .map(|j| {
                    let api = self.plain_api.clone();
                    async move { api.create(&PostParams::default(), j).await }
                })
                .buffer_unordered(PARALLEL)
                .try_collect::<Vec<_>>()
                .await?;
            Ok::<_, anyhow::Error>(t0.elapsed())
        };
        let (posted, (first, all)) = tokio::try_join!(posts, seen_all(&mut seen, replicas, t0))?;
        s.plain.push(all);
        s.plain_first.push(first);
        eprintln!(
            "round {round}: plain client: first Job seen {first:?}, last POST returned {posted:?}, all {replicas} seen {all:?}"
        );
        delete_all(&self.plain_api, &self.sel).await?;
        settle().await;
        Ok(())
    }

    /// A NodeAgentAttachment is created; the controller makes and resumes the Jobs;
    /// the attachment is deleted and its Jobs and Secrets are waited away.
    async fn operator_round(&self, round: usize, s: &mut Samples) -> anyhow::Result<()> {
        let (replicas, sel) = (self.replicas, &self.sel);
        let mut seen = synced_watch(&self.agent_jobs, sel).await?;
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
        s.op_jobs.push(d);
        s.op_all.push(d_all);
        eprintln!(
            "round {round}: operator: first Job seen {first:?}, all {replicas} seen {d:?} (all resumed with their Secrets {d_all:?})"
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
        settle().await;
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
        println!("replicas: {replicas}, rounds: {rounds}, parallel writes: {PARALLEL}");
        println!(
            "per-round ratio operator/plain, Jobs:           {rj:.2?}  median {:.2}",
            med(rj.clone())
        );
        println!(
            "per-round ratio operator/plain, Jobs resumed with Secrets: {ra:.2?}  median {:.2}",
            med(ra.clone())
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
