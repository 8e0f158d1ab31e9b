//! The real-node migration benchmark (`src/bin/bench_real_migration.rs`, whose `main`
//! is [`run`]; its doc says what is measured and printed): the command line and chart
//! values ([`args`]), the figures ([`figures`]), the run and its rounds ([`bench`]),
//! the raw CRIU side ([`raw`]), the PodMigration side ([`mig`]), the agents' memory
//! peaks ([`agent_memory`]) and the tables ([`table`]).

// As the binary it serves (`src/bin/bench_real_migration.rs`).
#![forbid(unsafe_code)]

use std::sync::Mutex;

use anyhow::{bail, ensure};
use kube::api::Api;

use crate::real::{Images, helm_install, real_nodes};
use crate::{PodSecurity, TestNamespace, random_suffix};

mod agent_memory;
mod args;
mod bench;
mod figures;
mod mig;
mod raw;
mod table;

use args::{chart_values, parse_args};
use bench::Bench;
use figures::uptime;
use raw::Work;
use table::print_table;

/// The whole run (the binary's `main`): the arguments, the namespaces, the chart, every
/// round, the tables.
pub async fn run() -> anyhow::Result<()> {
    let args = parse_args()?;
    let (op, nodes, app) = namespaces_and_nodes().await?;
    let images = Images::load()?;
    let testload_image = images.testload()?;
    eprintln!(
        "load {} — installing the chart from {} ({testload_image})",
        uptime(),
        images.path.display()
    );
    let release = format!("pm{}", random_suffix());
    let agents_ns = format!("{}-agents", op.name);
    let values = chart_values(&args);
    let _uninstall = helm_install(
        &release,
        &images,
        &op.name,
        &app.name,
        "podmotion-bench-real",
        &values.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let bench = Bench {
        work: Work::new()?,
        pods: app.api(),
        pms: app.api(),
        deploys: app.api(),
        agent_pods: Api::namespaced(op.client.clone(), &agents_ns),
        nodes,
        agents_ns,
        testload_image,
        args,
        said: Mutex::default(),
    };
    // SIGINT drops the run where it is: its guards kill what a raw round started, and
    // the namespaces and the release go as for a finished run.
    let (rows, loads) = tokio::select! {
        r = bench.run() => r?,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    };
    print_table(&rows, &loads);
    Ok(())
}

/// The operator's namespace, the real nodes (two at least), and the workload's
/// namespace.
async fn namespaces_and_nodes() -> anyhow::Result<(TestNamespace, Vec<String>, TestNamespace)> {
    let Some(op) = TestNamespace::new("bench-real-op", PodSecurity::Restricted).await else {
        bail!("PODMOTION_E2E=0");
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        bail!("PODMOTION_REAL_NODES=0");
    };
    ensure!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // The workload runs as uid 0: see docs/migration-controller.md, "Container user".
    let Some(app) = TestNamespace::new("bench-real-app", PodSecurity::Baseline).await else {
        bail!("PODMOTION_E2E=0");
    };
    Ok((op, nodes, app))
}
