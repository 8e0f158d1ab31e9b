//! The end of the chaos run: every PodMotion object deleted with the operators still
//! running (all must be gone within CONVERGENCE), then whatever is left.

use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use podmotion_api::names::labels;
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use serde_json::json;

use super::state::{ATTACHED, CONVERGENCE, Names, POOLS, Shared, violation};

/// Deletes every PodMotion object with the operators running; all must be gone within
/// [`CONVERGENCE`]. Then the namespaces (and any PriorityClass left) go.
pub(crate) async fn teardown(client: &Client, n: &Names, tally: &Shared, operators_up: bool) {
    let dp = DeleteParams::default();
    let app = n.app.as_str();
    let t0 = Instant::now();
    if operators_up {
        delete_all(client, app, &dp).await;
        await_all_gone(client, n, tally, t0).await;
    }
    strip_finalizers(client, app).await;
    for p in POOLS {
        let _ = Api::<PriorityClass>::all(client.clone())
            .delete(&format!("{app}-{p}"), &dp)
            .await;
    }
    for ns in [&n.app, &n.sys] {
        let _ = Api::<Namespace>::all(client.clone()).delete(ns, &dp).await;
    }
}

/// Deletes every PodMigration, the attachments and the pools.
async fn delete_all(client: &Client, app: &str, dp: &DeleteParams) {
    for m in Api::<PodMigration>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<PodMigration>::namespaced(client.clone(), app)
            .delete(&m.name_any(), dp)
            .await;
    }
    for a in ATTACHED {
        let _ = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
            .delete(a, dp)
            .await;
    }
    for p in POOLS {
        let _ = Api::<RunnerPool>::namespaced(client.clone(), app)
            .delete(p, dp)
            .await;
    }
}

/// Waits until no PodMotion object or agent Job is left, up to CONVERGENCE after `t0`.
async fn await_all_gone(client: &Client, n: &Names, tally: &Shared, t0: Instant) {
    loop {
        let left = count_left(client, n).await.unwrap_or(usize::MAX);
        if left == 0 {
            tally.lock().unwrap().checks += 1;
            eprintln!(
                "[chaos] every PodMotion object and agent Job deleted in {:.1} s",
                t0.elapsed().as_secs_f64()
            );
            break;
        }
        if t0.elapsed() > CONVERGENCE {
            violation(
                tally,
                format!(
                    "{left} PodMotion object(s) or agent Job(s) left {CONVERGENCE:?} after the final deletion (finalizer wedged?)"
                ),
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How many PodMotion objects and agent Jobs are left.
async fn count_left(client: &Client, n: &Names) -> kube::Result<usize> {
    let app = n.app.as_str();
    let m = Api::<PodMigration>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await?
        .items
        .len();
    let a = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await?
        .items
        .len();
    let p = Api::<RunnerPool>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await?
        .items
        .len();
    let j = Api::<Job>::namespaced(client.clone(), &n.sys)
        .list(&ListParams::default().labels(&format!("{}=NodeAgentAttachment", labels::OWNER_KIND)))
        .await?
        .items
        .len();
    Ok(m + a + p + j)
}

/// Whatever is left (a failed run): strip finalizers so the namespaces can go.
async fn strip_finalizers(client: &Client, app: &str) {
    let strip = PatchParams::default();
    let nofin = Patch::Merge(json!({"metadata": {"finalizers": null}}));
    for m in Api::<PodMigration>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<PodMigration>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
    for m in Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<NodeAgentAttachment>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
    for m in Api::<RunnerPool>::namespaced(client.clone(), app)
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
    {
        let _ = Api::<RunnerPool>::namespaced(client.clone(), app)
            .patch(&m.name_any(), &strip, &nofin)
            .await;
    }
}
