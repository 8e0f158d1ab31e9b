//! Running PodMotion's controllers inside a test process against the local control
//! plane: the CRDs installed from the types, a [`Context`] as the binary builds it
//! (leader election off), and a handle that stops the controller gracefully.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, GroupVersionKind, Patch, PatchParams};
use podmotion_operator::config::{ControllerKind, LeaderConfig, OperatorConfig};
use podmotion_operator::context::Context;
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{TIMEOUT, wait_for};

/// Applies every PodMotion CRD generated from the types (server-side, forced) and
/// waits until each is Established. Returns their API resources.
pub async fn install_crds(client: &Client) -> Vec<ApiResource> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut out = Vec::new();
    for (_, crd) in podmotion_api::crds::all() {
        let name = crd.metadata.name.clone().expect("generated CRDs are named");
        crds.patch(
            &name,
            &PatchParams::apply("podmotion-e2e").force(),
            &Patch::Apply(&crd),
        )
        .await
        .unwrap_or_else(|e| panic!("apply CRD {name}: {e}"));
        wait_for(&crds, &name, TIMEOUT, "CRD Established", |c| {
            c.and_then(|c| c.status.as_ref())
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        })
        .await
        .unwrap_or_else(|e| panic!("CRD {name}: {e}"));
        for v in &crd.spec.versions {
            let gvk = GroupVersionKind::gvk(&crd.spec.group, &v.name, &crd.spec.names.kind);
            out.push(ApiResource::from_gvk_with_plural(
                &gvk,
                &crd.spec.names.plural,
            ));
        }
    }
    out
}

/// The attachment controller's configuration the in-process e2e operators use: the
/// chart's defaults, a placeholder agent image (kwok runs no container), Jobs in the
/// operator's namespace, watching `watch_ns`.
pub fn test_attachment_config(
    watch_ns: &str,
) -> podmotion_operator::controllers::attachment::AttachmentConfig {
    podmotion_operator::controllers::attachment::AttachmentConfig {
        job_prefix: "pm-agent".into(),
        agent_image: "registry.example/podmotion/attach:e2e".into(),
        cri_socket_path: "/run".into(),
        sweep_seconds: 5,
        write_parallelism: 16,
        backoff_limit: 3,
        image_pull_secrets: Vec::new(),
        pod_annotations: Default::default(),
        metrics_port: 9090,
        control_port: 15000,
        max_wiretaps: 4,
        jobs_namespace: None,
        watch_namespace: Some(watch_ns.into()),
    }
}

/// Operator settings for a test: `namespace` as the operator's, leader election off.
pub fn test_config(namespace: &str, kind: ControllerKind) -> OperatorConfig {
    OperatorConfig {
        namespace: namespace.into(),
        identity: format!("e2e-{namespace}"),
        controllers: vec![kind],
        http_addr: "127.0.0.1:0".parse().expect("loopback address"),
        leader: LeaderConfig {
            enabled: false,
            lease_name: "unused".into(),
            lease_seconds: 15,
        },
        concurrency: 4,
        log_format: Default::default(),
        node_arch: podmotion_operator::platform::DEFAULT_ARCH.into(),
    }
}

/// A controller running in this test process.
pub struct InProcessController {
    /// Its metrics, as `/metrics` would serve them.
    pub metrics: Arc<Metrics>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl InProcessController {
    /// Builds the [`Context`] for `config` and spawns `run(ctx)` (a controller's
    /// `run_with` with its settings bound).
    pub fn spawn<F, Fut>(client: &Client, config: OperatorConfig, run: F) -> InProcessController
    where
        F: FnOnce(Arc<Context>) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let (stop, rx) = watch::channel(false);
        let metrics = Arc::new(Metrics::new());
        let ctx = Arc::new(Context::new(
            client.clone(),
            config,
            Leadership::always(),
            metrics.clone(),
            rx,
        ));
        let fut = run(ctx);
        let task = tokio::spawn(async move {
            if let Err(e) = fut.await {
                eprintln!("controller ended: {e:#}");
            }
        });
        InProcessController {
            metrics,
            stop,
            task,
        }
    }

    /// Asks the controller to shut down gracefully; aborts it after 10 s.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let abort = self.task.abort_handle();
        if tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .is_err()
        {
            abort.abort();
        }
    }
}
