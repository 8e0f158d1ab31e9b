//! Benchmark (not a test): the attachment controller at N objects (default 1,000).
//! For each NodeAgentAttachment, the time from its POST until all its children are
//! visible (DESIGN.md §4: p99 ≤ 1 s at 1,000 objects), and the operator's API writes
//! in an idle window once every object has converged (§4: zero, Lease renewals
//! excepted).
//!
//!     NODE_PODS=1000 hack/cluster.sh up     # room for 2N pods on the kwok nodes
//!     cargo build --release -p podmotion-e2e --bin bench_operator_scale
//!     target/release/bench_operator_scale [objects] [idle seconds]   # default 1000 60
//!
//! Each object is the attachment of its own one-replica Deployment: N Deployments and
//! their N Running pods on the kwok nodes are made before anything is timed. The
//! attachment controller runs in this process on the operator's own API client
//! (`podmotion_operator::client::from_config`: the bounded retry, and every request
//! counted in `podmotion_api_requests_total`), started and synced before the clock.
//! Watches of the agents' Jobs and Secrets are established; then the N attachments are
//! POSTed, 16 in flight, each one's clock starting just before its own POST. An
//! attachment's children are its agent Job, resumed (`suspend: false`), and the Job's
//! credential Secret; the time to the last of them is that object's figure, and its
//! p50, p99 and max are printed (also the time to the Job alone).
//!
//! Then the idle window: once the operator's request count has not moved for 10 s
//! (kwok starting the agents' pods, the attachments' status settling), the counts of
//! every series of `podmotion_api_requests_total` are read, and read again after the
//! window; the difference is printed by verb, resource and answer, the writes (create,
//! update, patch, delete) summed apart. Leader election is off here, so a write of
//! `leases` is the controller's own.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::names::labels;
use podmotion_e2e::bench_attach::{
    PARALLEL, apply_attachment_crd, attachment_reconciles, delete_namespaces, namespace,
    start_controller, synced_watch,
};
use podmotion_e2e::{
    connect, from_json, kube_config, pod_running_ready, random_suffix, restricted_container,
    wait_list,
};
use podmotion_operator::metrics::Metrics;
use serde_json::json;

/// How long the operator's request count must stand still before the idle window.
const QUIET: Duration = Duration::from_secs(10);
/// The longest wait for that.
const QUIET_TIMEOUT: Duration = Duration::from_secs(300);
/// The longest wait for the N objects' children.
const CONVERGE_TIMEOUT: Duration = Duration::from_secs(600);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let idle = Duration::from_secs(args.get(1).map(|s| s.parse()).transpose()?.unwrap_or(60));
    let client = connect().await?;
    let id = random_suffix();
    let (app_ns, agents_ns) = (format!("scale-app-{id}"), format!("scale-agents-{id}"));
    namespace(&client, &app_ns, "restricted").await?;
    namespace(&client, &agents_ns, "privileged").await?;
    apply_attachment_crd(&client).await?;
    let t = Instant::now();
    let unit_of_pod = workloads(&client, &app_ns, n).await?;
    eprintln!("{n} one-replica Deployments Running in {:?}", t.elapsed());

    // The controller, on the operator's own client, synced before anything is timed.
    let metrics = Arc::new(Metrics::new());
    let op_client = podmotion_operator::client::from_config(
        kube_config().await?,
        metrics.api_requests.clone(),
    )?;
    let (stop, controller) = start_controller(&op_client, &agents_ns, &app_ns, metrics.clone())?;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let before = requests(&metrics);
    let r0 = attachment_reconciles(&metrics);
    let converged = create_and_time(&client, &app_ns, &agents_ns, n, &unit_of_pod).await?;
    let during = diff(&requests(&metrics), &before);
    let reconciles = attachment_reconciles(&metrics) - r0;
    converged.print(n);
    println!(
        "while converging: {} reconciles; the operator's requests {}",
        reconciles,
        summary(&during)
    );

    idle_window(&metrics, idle, n).await?;
    // The attachments go while the controller runs (it removes their finalizers and
    // reaps their Jobs); a stopped controller would leave the namespace terminating.
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), &app_ns);
    naas.delete_collection(&DeleteParams::default(), &Default::default())
        .await?;
    wait_list(
        &naas,
        "",
        Duration::from_secs(600),
        "the attachments gone",
        |l| l.is_empty(),
    )
    .await?;
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), controller).await;
    delete_namespaces(&client, &[app_ns, agents_ns]).await;
    Ok(())
}

/// The operator's requests in an idle window of `idle` once it sent none for
/// [`QUIET`], printed (see the module doc).
async fn idle_window(metrics: &Metrics, idle: Duration, n: usize) -> anyhow::Result<()> {
    let waited = quiet(metrics).await?;
    let before = requests(metrics);
    let r0 = attachment_reconciles(metrics);
    tokio::time::sleep(idle).await;
    let window = diff(&requests(metrics), &before);
    let writes: u64 = window
        .iter()
        .filter(|(k, _)| is_write(k))
        .map(|(_, v)| v)
        .sum();
    println!(
        "idle window of {}s at {n} objects (after {:.1}s without a request): {} writes; every request {}; {} reconciles",
        idle.as_secs(),
        waited.as_secs_f64(),
        writes,
        summary(&window),
        attachment_reconciles(metrics) - r0
    );

    Ok(())
}

/// N one-replica Deployments `unit-<i>` over the kwok nodes, their pods Running and
/// Ready; returns each pod's unit number by pod UID.
async fn workloads(client: &Client, ns: &str, n: usize) -> anyhow::Result<BTreeMap<String, usize>> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), ns);
    stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            async move {
                let d: Deployment = from_json(json!({
                    "apiVersion": "apps/v1", "kind": "Deployment",
                    "metadata": {"name": format!("unit-{i}")},
                    "spec": {"replicas": 1, "selector": {"matchLabels": {"unit": i.to_string()}},
                      "template": {"metadata": {"labels": {"app": "scale", "unit": i.to_string()}},
                        "spec": {"containers": [restricted_container("app")],
                                 "nodeSelector": {"type": "kwok"},
                                 "tolerations": [{"operator": "Exists"}]}}}
                }));
                api.create(&PostParams::default(), &d).await
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pods = wait_list(
        &pods,
        "app=scale",
        Duration::from_secs(900),
        "the Deployments' pods Running",
        |ps| ps.len() == n && ps.iter().all(pod_running_ready),
    )
    .await?;
    let mut units = BTreeMap::new();
    for p in &pods {
        let unit = p.labels().get("unit").and_then(|u| u.parse().ok());
        if let (Some(uid), Some(unit)) = (p.uid(), unit) {
            units.insert(uid, unit);
        }
    }
    anyhow::ensure!(units.len() == n, "{} of {n} pods with a unit", units.len());
    Ok(units)
}

/// When each object's children were first seen, from its own POST.
struct Converged {
    job: Vec<Option<Duration>>,
    resumed: Vec<Option<Duration>>,
    secret: Vec<Option<Duration>>,
    /// From the first POST to the last child of all.
    total: Duration,
}

impl Converged {
    fn all(&self, i: usize) -> Option<Duration> {
        Some(self.resumed[i]?.max(self.secret[i]?))
    }

    fn print(&self, n: usize) {
        let pct = |v: Vec<Duration>| {
            let mut v = v;
            v.sort();
            let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
            format!(
                "p50 {} ms, p99 {} ms, max {} ms",
                at(0.5).as_millis(),
                at(0.99).as_millis(),
                at(1.0).as_millis()
            )
        };
        let jobs: Vec<Duration> = self.job.iter().flatten().copied().collect();
        let all: Vec<Duration> = (0..n).filter_map(|i| self.all(i)).collect();
        println!(
            "objects: {n} NodeAgentAttachments (one 1-replica Deployment each), {PARALLEL} POSTs in flight"
        );
        println!("CR → its Job seen:                         {}", pct(jobs));
        println!("CR → all children (Job resumed, Secret):   {}", pct(all));
        println!(
            "first POST → the last child of all {n}:    {} ms",
            self.total.as_millis()
        );
    }
}

/// A child of an attachment, as its watch saw it.
enum Seen {
    Job(Box<Job>),
    Secret(Box<Secret>),
}

/// When each attachment was POSTed (set just before its POST).
type Posted = Arc<std::sync::Mutex<Vec<Option<Instant>>>>;

/// POSTs the N attachments and times each one's children (see the module doc).
async fn create_and_time(
    client: &Client,
    app_ns: &str,
    agents_ns: &str,
    n: usize,
    unit_of_pod: &BTreeMap<String, usize>,
) -> anyhow::Result<Converged> {
    let mut events = children(client, app_ns, agents_ns).await?;
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), app_ns);
    let t0 = Instant::now();
    let posted: Posted = Arc::new(std::sync::Mutex::new(vec![None; n]));
    let mut c = Converged {
        job: vec![None; n],
        resumed: vec![None; n],
        secret: vec![None; n],
        total: Duration::ZERO,
    };
    let watch = async {
        let mut done = 0;
        while done < n {
            match events.try_next().await? {
                Some(Some(ev)) => done += usize::from(c.record(ev, &posted, unit_of_pod)),
                Some(None) => {}
                None => anyhow::bail!("a watch ended"),
            }
        }
        Ok::<_, anyhow::Error>(t0.elapsed())
    };
    let (_, total) = tokio::time::timeout(CONVERGE_TIMEOUT, async {
        tokio::try_join!(post_all(naas, n, posted.clone()), watch)
    })
    .await
    .map_err(|_| {
        anyhow::anyhow!("the {n} attachments' children not all seen in {CONVERGE_TIMEOUT:?}")
    })??;
    c.total = total;
    Ok(c)
}

/// The attachments' children as their watches see them (both established first).
async fn children(
    client: &Client,
    app_ns: &str,
    agents_ns: &str,
) -> anyhow::Result<impl futures::Stream<Item = Result<Option<Seen>, watcher::Error>>> {
    let sel = format!("{}={app_ns}", labels::TARGET_NAMESPACE);
    let jobs = synced_watch(&Api::<Job>::namespaced(client.clone(), agents_ns), &sel).await?;
    let secrets = synced_watch(
        &Api::<Secret>::namespaced(client.clone(), app_ns),
        &format!("{}=node-agent", labels::COMPONENT),
    )
    .await?;
    Ok(stream::select(
        jobs.map_ok(|e| match e {
            Event::Apply(j) | Event::InitApply(j) => Some(Seen::Job(Box::new(j))),
            _ => None,
        }),
        secrets.map_ok(|e| match e {
            Event::Apply(s) | Event::InitApply(s) => Some(Seen::Secret(Box::new(s))),
            _ => None,
        }),
    ))
}

/// POSTs attachment `unit-<i>` of Deployment `unit-<i>` for every i < n,
/// [`PARALLEL`] at once, noting each one's time in `posted` just before its POST.
async fn post_all(naas: Api<NodeAgentAttachment>, n: usize, posted: Posted) -> anyhow::Result<()> {
    stream::iter(0..n)
        .map(move |i| {
            let (naas, posted) = (naas.clone(), posted.clone());
            async move {
                let naa: NodeAgentAttachment = from_json(json!({
                    "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
                    "metadata": {"name": format!("unit-{i}")},
                    "spec": {"workloadRef": {"kind": "Deployment", "name": format!("unit-{i}")},
                             "mode": "Intercept"}
                }));
                posted.lock().expect("posted")[i] = Some(Instant::now());
                naas.create(&PostParams::default(), &naa).await
            }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

impl Converged {
    /// Records a child seen now; whether that completed its attachment.
    fn record(&mut self, ev: Seen, posted: &Posted, unit_of_pod: &BTreeMap<String, usize>) -> bool {
        let now = Instant::now();
        let labels = match &ev {
            Seen::Job(j) => j.labels(),
            Seen::Secret(s) => s.labels(),
        };
        let Some(i) = labels
            .get(labels::TARGET_POD_UID)
            .and_then(|uid| unit_of_pod.get(uid))
            .copied()
        else {
            return false;
        };
        // A child can be seen before its POST returned, never before it was sent.
        let since = posted.lock().expect("posted")[i].map(|p| now.saturating_duration_since(p));
        let was = self.all(i).is_some();
        match ev {
            Seen::Job(j) => {
                self.job[i] = self.job[i].or(since);
                if j.spec.as_ref().and_then(|s| s.suspend) == Some(false) {
                    self.resumed[i] = self.resumed[i].or(since);
                }
            }
            Seen::Secret(_) => self.secret[i] = self.secret[i].or(since),
        }
        !was && self.all(i).is_some()
    }
}

/// Every series of `podmotion_api_requests_total` now: its labels, as printed, and
/// its count.
fn requests(metrics: &Metrics) -> BTreeMap<String, u64> {
    metrics
        .encode()
        .lines()
        .filter_map(|l| l.strip_prefix("podmotion_api_requests_total{"))
        .filter_map(|l| {
            let (labels, value) = l.split_once("} ")?;
            Some((labels.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// What grew between `before` and `after`.
fn diff(after: &BTreeMap<String, u64>, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0);
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

fn is_write(labels: &str) -> bool {
    ["create", "update", "patch", "delete", "deletecollection"]
        .iter()
        .any(|v| labels.contains(&format!("verb=\"{v}\"")))
}

/// `{verb resource[/sub] code: count, …}`, largest first.
fn summary(d: &BTreeMap<String, u64>) -> String {
    let label = |labels: &str, key: &str| {
        labels
            .split(',')
            .find_map(|kv| kv.strip_prefix(&format!("{key}=\"")))
            .map(|v| v.trim_end_matches('"').to_string())
            .unwrap_or_default()
    };
    let mut v: Vec<(String, u64)> = d
        .iter()
        .map(|(k, n)| {
            let sub = label(k, "subresource");
            let sub = if sub.is_empty() {
                sub
            } else {
                format!("/{sub}")
            };
            (
                format!(
                    "{} {}{sub} {}",
                    label(k, "verb"),
                    label(k, "resource"),
                    label(k, "code")
                ),
                *n,
            )
        })
        .collect();
    v.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    let total: u64 = v.iter().map(|(_, n)| n).sum();
    let parts: Vec<String> = v.iter().map(|(k, n)| format!("{k}: {n}")).collect();
    format!("{total} [{}]", parts.join(", "))
}

/// Waits until the operator's request count stood still for [`QUIET`]; how long that
/// took.
async fn quiet(metrics: &Metrics) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut last = requests(metrics);
    let mut since = Instant::now();
    while since.elapsed() < QUIET {
        anyhow::ensure!(
            t.elapsed() < QUIET_TIMEOUT,
            "the operator kept sending requests for {QUIET_TIMEOUT:?}: {}",
            summary(&diff(&requests(metrics), &last))
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = requests(metrics);
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    Ok(t.elapsed())
}
