//! Benchmark (not a test): the operator's resident memory while it watches N pods.
//! DESIGN.md §4: RSS ≤ 32 MiB at 10,000 pods and ≤ 96 MiB at 50,000.
//!
//!     NODE_PODS=20000 hack/cluster.sh up      # room for --running pods on the kwok nodes
//!     cargo build --release -p podmotion-operator -p podmotion-e2e --bin podmotion-operator --bin bench_operator_rss
//!     target/release/bench_operator_rss [pods] [--controllers LIST] [--running] [--churn PER_S] [--window S]
//!
//! Runs the real `podmotion-operator` binary (built next to this one; by default with
//! all three controllers, `--controllers attachment` for the one that caches every pod
//! of the cluster, a projection of each, `crate::cache`). Measures VmRSS once it is
//! ready (every cache synced) with none of the benchmark's pods, then creates N pods
//! (two containers, probes, resources, labels and a 1 KiB annotation each: typical
//! Deployment pods), restarts the operator so that it lists them all from scratch, and
//! measures VmRSS and the peak (VmHWM) again. Without `--running` an unknown
//! `schedulerName` keeps the pods Pending; with it they are scheduled onto the kwok
//! nodes and Running (waited for). With `--churn R` (default 0), for `--window` seconds
//! (default 30) after that, R pods a second get a status write (a condition of their
//! own, as a kubelet's probe results would), and the RSS is sampled every second: its
//! largest sample and its last are printed with the peak.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use podmotion_e2e::{connect, from_json, random_suffix};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PARALLEL: usize = 32;

/// The benchmark's options (see the module doc).
struct Args {
    pods: usize,
    controllers: String,
    running: bool,
    churn: u32,
    window: Duration,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        pods: 10_000,
        controllers: "migration,attachment,runner-pool".into(),
        running: false,
        churn: 0,
        window: Duration::from_secs(30),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))
        };
        match arg.as_str() {
            "--controllers" => a.controllers = value("--controllers")?,
            "--running" => a.running = true,
            "--churn" => a.churn = value("--churn")?.parse()?,
            "--window" => a.window = Duration::from_secs(value("--window")?.parse()?),
            n => {
                a.pods = n
                    .parse()
                    .map_err(|_| anyhow::anyhow!("unknown argument {n}"))?
            }
        }
    }
    Ok(a)
}

fn pod(i: usize, running: bool) -> Pod {
    let mut p: Pod = from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": format!("rss-{i:05}"),
            "labels": {"app": "rss", "tier": "web", "pod-template-hash": "5d8f7c9b4",
                       "app.kubernetes.io/part-of": format!("shop-{}", i % 50)},
            "annotations": {
                "kubectl.kubernetes.io/restartedAt": "2026-11-29T12:00:00Z",
                "example.com/config": "x".repeat(1024),
            }
        },
        "spec": {
            "schedulerName": "podmotion-bench-nobody",
            "nodeSelector": {"type": "kwok"},
            "tolerations": [{"operator": "Exists"}],
            "containers": [
                {"name": "app", "image": "registry.example/shop/web:1.2.3",
                 "ports": [{"name": "http", "containerPort": 8080}],
                 "env": (0..6).map(|e| json!({"name": format!("SETTING_{e}"), "value": format!("value-{e}")})).collect::<Vec<_>>(),
                 "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "256Mi"}},
                 "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 5}},
                {"name": "proxy", "image": "registry.example/mesh/proxy:1.0",
                 "ports": [{"name": "admin", "containerPort": 15000}],
                 "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}}}
            ]
        }
    }));
    if running {
        // The default scheduler places it on a kwok node, which runs it.
        p.spec.as_mut().expect("spec").scheduler_name = None;
    }
    p
}

/// The operator binary built next to this benchmark.
fn operator_bin() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe()?;
    let bin = me
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no parent of {me:?}"))?
        .join("podmotion-operator");
    anyhow::ensure!(
        bin.exists(),
        "{bin:?} missing: cargo build --release -p podmotion-operator"
    );
    Ok(bin)
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn rss_kib(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("{name} missing in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Whether `GET /readyz` answers 200.
async fn ready(addr: &str) -> bool {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let req = format!("GET /readyz HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out.starts_with("HTTP/1.1 200") || out.starts_with("HTTP/1.0 200")
}

/// Starts the operator, waits until it is ready, lets it settle, and returns it with
/// its (RSS, peak) in KiB and how long it took to become ready.
async fn run_operator(
    ns: &str,
    addr: &str,
    controllers: &str,
) -> anyhow::Result<(tokio::process::Child, u64, u64, Duration)> {
    let t0 = Instant::now();
    let child = tokio::process::Command::new(operator_bin()?)
        .args([
            "--namespace",
            ns,
            "--controllers",
            controllers,
            "--no-leader-election",
            "--http-addr",
            addr,
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = child
        .id()
        .ok_or_else(|| anyhow::anyhow!("operator exited"))?;
    while !ready(addr).await {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(300),
            "operator not ready after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (rss, hwm) = rss_kib(pid)?;
    Ok((child, rss, hwm, took))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = parse_args()?;
    let n = a.pods;
    let client = connect().await?;
    let ns = create_bench_namespace(&client).await?;
    podmotion_e2e::operator::install_crds(&client).await;
    let addr = "127.0.0.1:18481";
    let before = Api::<Pod>::all(client.clone())
        .list_metadata(&ListParams::default())
        .await?
        .items
        .len();

    let (mut op, rss0, hwm0, took0) = run_operator(&ns, addr, &a.controllers).await?;
    op.kill().await?;
    eprintln!("baseline: {before} pods in the cluster, ready in {took0:?}, RSS {rss0} KiB");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let t = Instant::now();
    create_pods(&pods, n, a.running).await?;
    eprintln!("created {n} pods in {:?}", t.elapsed());
    if a.running {
        wait_running(&pods, n).await?;
        eprintln!("{n} pods Running after {:?}", t.elapsed());
    }

    let (mut op, rss1, hwm1, took1) = run_operator(&ns, addr, &a.controllers).await?;
    let pid = op.id().ok_or_else(|| anyhow::anyhow!("operator exited"))?;
    let churned = churn(&pods, n, a.churn, a.window, pid).await?;
    let (_, hwm2) = rss_kib(pid)?;
    op.kill().await?;

    report(
        &a,
        before,
        [(rss0, hwm0, took0), (rss1, hwm1, took1)],
        churned.map(|c| (c, hwm2)),
    );
    clean_up(&client, &pods, &ns).await
}

/// The operator's memory, ready without and with the benchmark's pods (`runs`: RSS,
/// peak, time to ready), and under churn (writes, largest and last RSS; the peak).
fn report(
    a: &Args,
    before: usize,
    runs: [(u64, u64, Duration); 2],
    churned: Option<((u64, u64, u64), u64)>,
) {
    let n = a.pods;
    let [(rss0, hwm0, took0), (rss1, hwm1, took1)] = runs;
    println!(
        "controllers: {}; pods {}",
        a.controllers,
        if a.running {
            "Running on the kwok nodes"
        } else {
            "Pending (no scheduler)"
        }
    );
    println!(
        "pods watched: {before} (baseline) and {} (with the benchmark's)",
        before + n
    );
    println!("ready after:  {took0:?} and {took1:?}");
    println!(
        "VmRSS:        {:.1} MiB and {:.1} MiB",
        rss0 as f64 / 1024.0,
        rss1 as f64 / 1024.0
    );
    println!(
        "VmHWM (peak): {:.1} MiB and {:.1} MiB",
        hwm0 as f64 / 1024.0,
        hwm1 as f64 / 1024.0
    );
    println!(
        "per pod:      {:.0} bytes resident",
        (rss1.saturating_sub(rss0) * 1024) as f64 / n as f64
    );
    if let Some(((writes, max, last), hwm2)) = churned {
        println!(
            "status churn: {writes} pod status writes in {}s; VmRSS largest {:.1} MiB, last {:.1} MiB; VmHWM {:.1} MiB",
            a.window.as_secs(),
            max as f64 / 1024.0,
            last as f64 / 1024.0,
            hwm2 as f64 / 1024.0
        );
    }
}

/// Waits until `n` pods of the namespace are Running (counted by a field selector,
/// metadata only, every 5 s).
async fn wait_running(pods: &Api<Pod>, n: usize) -> anyhow::Result<()> {
    let t = Instant::now();
    loop {
        let running = pods
            .list_metadata(&ListParams::default().fields("status.phase=Running"))
            .await?
            .items
            .len();
        if running >= n {
            return Ok(());
        }
        anyhow::ensure!(
            t.elapsed() < Duration::from_secs(1800),
            "{running} of {n} pods Running after 30 min (NODE_PODS too small?)"
        );
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
}

/// `per_s` pod status writes a second over `window` (pods taken in turn), sampling the
/// operator's RSS every second: (writes, largest RSS, last RSS) in KiB; `None` without
/// churn.
async fn churn(
    pods: &Api<Pod>,
    n: usize,
    per_s: u32,
    window: Duration,
    pid: u32,
) -> anyhow::Result<Option<(u64, u64, u64)>> {
    if per_s == 0 {
        return Ok(None);
    }
    let (mut writes, mut max, mut last) = (0u64, 0u64, 0u64);
    let t = Instant::now();
    let mut next = 0usize;
    while t.elapsed() < window {
        let tick = Instant::now();
        let batch: Vec<usize> = (0..per_s as usize).map(|k| (next + k) % n).collect();
        next = (next + per_s as usize) % n;
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        stream::iter(batch)
            .map(|i| {
                let (pods, now) = (pods.clone(), now.clone());
                async move {
                    let patch = json!({"status": {"conditions": [{
                        "type": "example.com/Probed", "status": "True",
                        "lastProbeTime": now, "lastTransitionTime": now}]}});
                    pods.patch_status(
                        &format!("rss-{i:05}"),
                        &PatchParams::default(),
                        &Patch::Strategic(patch),
                    )
                    .await
                }
            })
            .buffer_unordered(PARALLEL)
            .try_collect::<Vec<_>>()
            .await?;
        writes += u64::from(per_s);
        let (rss, _) = rss_kib(pid)?;
        (max, last) = (max.max(rss), rss);
        tokio::time::sleep(Duration::from_secs(1).saturating_sub(tick.elapsed())).await;
    }
    Ok(Some((writes, max, last)))
}

/// A fresh `bench-rss-<random>` namespace, labelled as an e2e benchmark's.
async fn create_bench_namespace(client: &kube::Client) -> anyhow::Result<String> {
    let ns = format!("bench-rss-{}", random_suffix());
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(ns.clone()),
                    labels: Some(BTreeMap::from([(
                        "podmotion.io/e2e".to_string(),
                        "bench".to_string(),
                    )])),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await?;
    Ok(ns)
}

/// Creates the benchmark's `n` pods, [`PARALLEL`] at a time.
async fn create_pods(pods: &Api<Pod>, n: usize, running: bool) -> anyhow::Result<()> {
    stream::iter(0..n)
        .map(|i| {
            let pods = pods.clone();
            async move { pods.create(&PostParams::default(), &pod(i, running)).await }
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Deletes the benchmark's pods (no grace period) and its namespace.
async fn clean_up(client: &kube::Client, pods: &Api<Pod>, ns: &str) -> anyhow::Result<()> {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    pods.delete_collection(&dp, &ListParams::default()).await?;
    Api::<Namespace>::all(client.clone())
        .delete(ns, &DeleteParams::default())
        .await?;
    Ok(())
}
