//! What the attachment benchmarks share (`src/bin/bench_attach_jobs.rs`,
//! `src/bin/bench_operator_scale.rs`): their namespaces, the CRD, the attachment
//! controller run in the benchmark's own process, and watches established before a
//! clock starts.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::operator::{test_attachment_config, test_config};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::watcher::{self, Event};
use kube::{Client, CustomResourceExt, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_operator::config::{ControllerKind, OperatorConfig};
use podmotion_operator::context::Context;
use podmotion_operator::controllers::attachment::{AttachmentConfig, run_with};
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::{Metrics, ReconcileResult, ResultLabels};

/// Writes in flight, on both sides of a comparison (the controller's
/// `write_parallelism` and the plain client's).
pub const PARALLEL: usize = 16;

/// A namespace labelled for the benchmark, enforcing the Pod Security `level`.
pub async fn namespace(client: &Client, name: &str, level: &str) -> anyhow::Result<()> {
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

/// Deletes the benchmark's namespaces (what fails is left: a rerun uses new names).
pub async fn delete_namespaces(client: &Client, names: &[String]) {
    for ns in names {
        let _ = Api::<Namespace>::all(client.clone())
            .delete(ns, &kube::api::DeleteParams::default())
            .await;
    }
}

/// The NodeAgentAttachment CRD, applied from the API types.
pub async fn apply_attachment_crd(client: &Client) -> anyhow::Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = NodeAgentAttachment::crd();
    crds.patch(
        &crd.name_any(),
        &PatchParams::apply("podmotion-bench").force(),
        &Patch::Apply(&crd),
    )
    .await?;
    Ok(())
}

/// Runs the attachment controller in this process on `client` (agents' Jobs in
/// `agents_ns`, watching `app_ns`); it stops when `true` is sent on the returned
/// channel.
pub fn start_controller(
    client: &Client,
    agents_ns: &str,
    app_ns: &str,
    metrics: Arc<Metrics>,
) -> anyhow::Result<(
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
)> {
    // The e2e operators' settings, with the chart's concurrency.
    let config = OperatorConfig {
        identity: "bench".into(),
        concurrency: 8,
        ..test_config(agents_ns, ControllerKind::Attachment)
    };
    let (stop, rx) = tokio::sync::watch::channel(false);
    let ctx = Arc::new(Context::new(
        client.clone(),
        config,
        Leadership::always(),
        metrics,
        rx,
    ));
    // No orphan sweep within a run: it would be requests the benchmarks do not time.
    let cfg = AttachmentConfig {
        sweep_seconds: 3600,
        write_parallelism: PARALLEL,
        ..test_attachment_config(app_ns)
    };
    Ok((stop, tokio::spawn(run_with(ctx, cfg))))
}

/// Reconciles of the attachment controller so far (every result).
pub fn attachment_reconciles(metrics: &Metrics) -> u64 {
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

/// A watch of `api`'s objects matching `sel`.
pub type Watch<K> = futures::stream::BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// A watch on `sel`, its initial list drained, so that a clock started after it is
/// established.
pub async fn synced_watch<K>(api: &Api<K>, sel: &str) -> anyhow::Result<Watch<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let mut w = watcher::watcher(api.clone(), watcher::Config::default().labels(sel)).boxed();
    while let Some(ev) = w.try_next().await? {
        if matches!(ev, Event::InitDone) {
            break;
        }
    }
    Ok(w)
}

/// The median of `v` (the upper one of an even count).
pub fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}

/// Waits `d` so that the control plane's aftermath of the previous step (garbage
/// collection, kwok's status updates) does not bill the next measurement.
pub async fn settle(d: Duration) {
    tokio::time::sleep(d).await;
}
