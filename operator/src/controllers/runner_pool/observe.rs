//! The RunnerPool controller's reads: what rendering needs (eligible nodes, the
//! Server's Service, the credential token), what the status needs (namespace labels,
//! Runner pods, NetworkPolicies) and the referenced PriorityClass's value. Nodes, pods
//! and policies come from the controller's caches; the rest is read by name (see the
//! module above for why).

use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::api::scheduling::v1::PriorityClass;
use kube::ResourceExt;
use kube::api::Api;
use podmotion_api::RunnerPool;

use super::settings::RunnerPoolConfig;
use super::state::Shared;
use super::{caches, children};
use crate::context::Context;
use crate::controllers::shell::{ReconcileError, api_err};
use crate::runner_pool::priority::Referenced;
use crate::runner_pool::{Facts, Inputs, ServerEndpoint, render, server_namespace};

/// What a live pool's round reads.
pub(super) struct Observation {
    pub(super) inputs: Inputs,
    pub(super) facts: Facts,
    pub(super) priority: Referenced,
}

/// Everything a live pool's round reads, at once.
pub(super) async fn observation(
    s: &Shared,
    pool: &RunnerPool,
) -> Result<Observation, ReconcileError> {
    let ctx = &s.ctx;
    let (inputs, facts, priority) = tokio::try_join!(
        inputs(s, pool),
        facts(s, pool),
        referenced_priority(ctx, pool)
    )?;
    Ok(Observation {
        inputs,
        facts,
        priority,
    })
}

/// The facts rendering needs: eligible nodes (cached), the Server's Service, the token.
async fn inputs(s: &Shared, pool: &RunnerPool) -> Result<Inputs, ReconcileError> {
    let (ctx, cfg) = (&s.ctx, &s.cfg);
    let client = ctx.client.clone();
    let platform = ctx.config.platform();
    let eligible = s
        .nodes
        .select(|_, l| caches::eligible(pool, &platform, l))
        .len();
    let server_ns = server_namespace(pool);
    let service = Api::<Service>::namespaced(client.clone(), &server_ns)
        .get_opt(&pool.spec.server.service_name)
        .await
        .map_err(api_err("get", "the Server's Service"))?;
    Ok(Inputs {
        preflight_image: cfg.preflight_image.clone(),
        log_format: ctx.config.log_format,
        platform,
        eligible_nodes: eligible,
        server: ServerEndpoint::resolve(pool, &server_ns, service),
        credential_token: credential_token(ctx, cfg, pool).await?,
    })
}

/// The generated Secret's token: the existing one where Secrets may be read, else
/// a fresh one (used only when the Secret is created, once); `None` when the pool
/// references its own Secret.
async fn credential_token(
    ctx: &Context,
    cfg: &RunnerPoolConfig,
    pool: &RunnerPool,
) -> Result<Option<String>, ReconcileError> {
    if pool.spec.credentials.secret_name.is_some() {
        return Ok(None);
    }
    if !cfg.reads_secrets() {
        return Ok(Some(children::fresh_token()));
    }
    let (name, key) = render::credential_secret(pool);
    let existing =
        Api::<Secret>::namespaced(ctx.client.clone(), &pool.namespace().unwrap_or_default())
            .get_opt(&name)
            .await
            .map_err(api_err("get", "the credential Secret"))?
            .and_then(|s| s.data)
            .and_then(|d| d.get(&key).cloned())
            .filter(|v| !v.0.is_empty());
    Ok(Some(match existing {
        Some(token) => String::from_utf8_lossy(&token.0).into_owned(),
        None => children::fresh_token(),
    }))
}

/// The value of the PriorityClass the pool references (nothing is read when the
/// pool creates its own).
async fn referenced_priority(
    ctx: &Context,
    pool: &RunnerPool,
) -> Result<Referenced, ReconcileError> {
    let pc = &pool.spec.priority_class;
    if pc.create {
        return Ok(Referenced::NotRead);
    }
    let class = Api::<PriorityClass>::all(ctx.client.clone())
        .get_opt(&pc.name)
        .await
        .map_err(api_err("get", format!("PriorityClass {}", pc.name)))?;
    Ok(class.map_or(Referenced::Missing, |c| {
        Referenced::Value(c.value.unwrap_or(0))
    }))
}

/// The facts the status needs: namespace labels (read), Runner pods and
/// NetworkPolicies (cached).
async fn facts(s: &Shared, pool: &RunnerPool) -> Result<Facts, ReconcileError> {
    let ns = pool.namespace().unwrap_or_default();
    let namespace = Api::<Namespace>::all(s.ctx.client.clone())
        .get_metadata_opt(&ns)
        .await
        .map_err(api_err("get", format!("Namespace {ns}")))?;
    let selector = render::pod_selector(pool);
    let mut pods: Vec<_> = s
        .pods
        .select(|(pod_ns, _), p| {
            *pod_ns == ns && selector.iter().all(|(k, v)| p.labels().get(k) == Some(v))
        })
        .iter()
        .map(|p| p.as_ref().clone())
        .collect();
    pods.sort_by_key(|p| p.name_any());
    let mut policies: Vec<_> = s
        .policies
        .select(|(np_ns, _), _| *np_ns == ns)
        .iter()
        .map(|p| p.as_ref().clone())
        .collect();
    policies.sort_by_key(|p| p.name_any());
    Ok(Facts {
        namespace_labels: namespace.map(|n| n.labels().clone()).unwrap_or_default(),
        pods,
        policies,
    })
}
