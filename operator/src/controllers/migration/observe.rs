//! The migration controller's reads: the pods, the agents' reports, and in `Pending`
//! the cluster's nodes and load (for the pre-flight checks and the slot), from the
//! controller's caches.
//!
//! Still read per reconcile (GET by name): the source and target pods, because the
//! machine acts on them and must see its own writes at once (a cache may lag behind a
//! create, a patch or a delete, and the target pod leaves the target-pod watch at the
//! hand-over), and, in `Pending` only, the source's PersistentVolumeClaims and their
//! PersistentVolumes: few, read only there, and not worth a cluster-wide watch.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::{Resource, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::finalizers;

use super::state::Shared;
use crate::controllers::shell::{ReconcileError, api_err};
use crate::migration::agent::{AgentClient, AgentEndpoint, AgentView};
use crate::migration::machine::{self, Knobs, Observed, Preflight};
use crate::migration::pending;
use crate::migration::preflight::{self, Limits};
use crate::migration::render;

/// The machine's input and the pods its actions act on.
pub(super) struct Observation {
    pub machine: Observed,
    pub source: Option<Pod>,
    pub target: Option<Pod>,
}

pub(super) async fn observe<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
) -> Result<Observation, ReconcileError> {
    let ns = pm.namespace().unwrap_or_default();
    let uid = pm.uid().unwrap_or_default();
    let pods: Api<Pod> = Api::namespaced(s.ctx.client.clone(), &ns);
    let status = pm.status.clone().unwrap_or_default();
    let now = Timestamp::now();
    let source = pods
        .get_opt(&pm.spec.pod_name)
        .await
        .map_err(api_err("get", "source pod"))?;
    // The pod this migration made, by the name only it makes, and only if it records
    // this migration: never the name in the status (writable by others).
    let target = match machine::target_pod_of_record(&pm.spec.pod_name, &uid, &status) {
        Some(t) => pods
            .get_opt(&t)
            .await
            .map_err(api_err("get", "target pod"))?
            .filter(|p| machine::is_target_pod_of(p, &pm.name_any(), &uid)),
        None => None,
    };
    let deleting = pm.meta().deletion_timestamp.is_some();
    let (preflight, slot_available) = match status.phase {
        MigrationPhase::Pending if !deleting => {
            let (verdict, slot) = evaluate_pending(s, pm, source.as_ref()).await?;
            (Some(verdict), slot)
        }
        _ => (None, true),
    };
    let machine = Observed {
        pod_name: pm.spec.pod_name.clone(),
        now,
        created: pm.meta().creation_timestamp.as_ref().map_or(now, |t| t.0),
        generation: pm.meta().generation,
        knobs: knobs(s, pm),
        has_finalizer: pm
            .finalizers()
            .iter()
            .any(|f| f == finalizers::MIGRATION_CLEANUP),
        deletion_requested: deleting,
        preflight,
        slot_available,
        // The source of record is the pod the migration pinned (a pod recreated under
        // the same name is a different pod; the machine compares UIDs).
        source_pod: source.as_ref().map(render::source_facts),
        target_pod: target.as_ref().map(render::target_facts),
        transfer_key_present: s.key_present(pm, status.phase),
        source_agent: agent_view(s, status.source_node.as_deref(), &uid).await?,
        target_agent: agent_view(s, status.target_node.as_deref(), &uid).await?,
        status,
    };
    Ok(Observation {
        machine,
        source,
        target,
    })
}

/// The machine's knobs: the PodMigration's, with the installer's settings.
fn knobs<A: AgentClient>(s: &Shared<A>, pm: &PodMigration) -> Knobs {
    Knobs::from_spec(&pm.spec)
        .with_service_sync(s.cfg.service_sync())
        .with_forward_new_connections(s.cfg.forward_new_connections)
}

/// Pre-flight inputs (the source's claims, nodes, their load, agents, other
/// migrations) and the verdict, plus whether a concurrency slot is free for it.
async fn evaluate_pending<A: AgentClient>(
    s: &Shared<A>,
    pm: &PodMigration,
    source: Option<&Pod>,
) -> Result<(Preflight, bool), ReconcileError> {
    if !(s.nodes.is_ready() && s.load.is_ready()) {
        // A verdict on a cache that has not listed yet ("no node fits") would be wrong.
        return Err(ReconcileError::wait(
            "node and pod caches not synced",
            Duration::from_millis(250),
        ));
    }
    let claims = match source {
        Some(pod) => read_claims(s, pm, pod).await?,
        None => vec![],
    };
    let endpoints = agent_endpoints(s).await?;
    let nodes = pending::node_facts(
        s.nodes.select(|_, _| true).iter().map(|n| n.as_ref()),
        &pending::requested_by_node(s.load.select(|_, _| true).iter().map(|l| l.as_ref())),
        |n| endpoints.contains_key(n),
    );
    let all: Vec<PodMigration> = s
        .store
        .state()
        .iter()
        .filter_map(|g| g.0.as_ref().ok().cloned())
        .collect();
    let limits = Limits {
        per_cluster: s.cfg.max_parallel,
        per_source_node: s.cfg.max_per_node,
    };
    Ok(pending::evaluate(
        pm,
        source,
        &pending::claim_facts(&claims),
        &nodes,
        &all,
        limits,
        pending::Installation {
            namespace: &s.ctx.config.namespace,
            agents_namespace: &s.cfg.agent_namespace,
            exec_probes: s.cfg.exec_probes,
        },
    ))
}

/// The PersistentVolumeClaims `pod` mounts, each with its bound PersistentVolume: to
/// tell whether its storage can follow it. Missing ones are left out (the pre-flight
/// refuses a claim it has no facts for).
async fn read_claims<A>(
    s: &Shared<A>,
    pm: &PodMigration,
    pod: &Pod,
) -> Result<Vec<(PersistentVolumeClaim, Option<PersistentVolume>)>, ReconcileError> {
    let client = s.ctx.client.clone();
    let ns = pm.namespace().unwrap_or_default();
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &ns);
    let pvs: Api<PersistentVolume> = Api::all(client);
    let mut names: Vec<String> = preflight::claim_names(pod)
        .into_iter()
        .map(|(_, c)| c)
        .collect();
    names.sort();
    names.dedup();
    let mut out = vec![];
    for name in names {
        let Some(pvc) = pvcs
            .get_opt(&name)
            .await
            .map_err(api_err("get", "persistentvolumeclaim"))?
        else {
            continue;
        };
        let pv = match pvc.spec.as_ref().and_then(|s| s.volume_name.clone()) {
            Some(v) if !v.is_empty() => pvs
                .get_opt(&v)
                .await
                .map_err(api_err("get", "persistentvolume"))?,
            _ => None,
        };
        out.push((pvc, pv));
    }
    Ok(out)
}

/// Node → agent endpoint: the Ready agent pods (from the watch), then the overrides.
async fn agent_endpoints<A>(s: &Shared<A>) -> Result<BTreeMap<String, String>, ReconcileError> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    // With overrides (local runs) the watch may never sync (no RBAC, no namespace).
    if s.cfg.agent_endpoints.is_empty()
        && tokio::time::timeout(Duration::from_secs(5), s.agent_pods.wait_until_ready())
            .await
            .is_err()
    {
        return Err(ReconcileError::Inconsistent(
            "the agent pod watch has not synced yet".into(),
        ));
    }
    for p in s.agent_pods.state() {
        let ready = p
            .status
            .as_ref()
            .and_then(|st| st.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let node = p.spec.as_ref().and_then(|sp| sp.node_name.clone());
        let ip = p.status.as_ref().and_then(|st| st.pod_ip.clone());
        if let (true, Some(node), Some(ip)) =
            (ready && p.metadata.deletion_timestamp.is_none(), node, ip)
        {
            out.insert(node, format!("https://{ip}:{}", s.cfg.agent_port));
        }
    }
    for (node, url) in &s.cfg.agent_endpoints {
        out.insert(node.clone(), url.clone());
    }
    Ok(out)
}

/// The agent endpoint of `node`, if a Ready agent serves it.
pub(super) async fn endpoint_of<A>(
    s: &Shared<A>,
    node: &str,
) -> Result<Option<AgentEndpoint>, ReconcileError> {
    let all = agent_endpoints(s).await?;
    Ok(all.get(node).map(|url| AgentEndpoint {
        node: node.into(),
        url: url.clone(),
    }))
}

async fn agent_view<A: AgentClient>(
    s: &Shared<A>,
    node: Option<&str>,
    uid: &str,
) -> Result<AgentView, ReconcileError> {
    let Some(node) = node else {
        return Ok(AgentView::Missing);
    };
    let Some(endpoint) = endpoint_of(s, node).await? else {
        return Ok(AgentView::Missing);
    };
    Ok(report_within(
        s.agents.as_ref(),
        &endpoint,
        uid,
        s.cfg.agent_call_timeout(),
    )
    .await)
}

/// The agent's report, or `Unreachable` when it fails or does not answer within
/// `limit`: a hung agent must not hold the reconcile (and every other migration's
/// turn) forever.
pub(super) async fn report_within<A: AgentClient>(
    agents: &A,
    endpoint: &AgentEndpoint,
    uid: &str,
    limit: Duration,
) -> AgentView {
    match tokio::time::timeout(limit, agents.report(endpoint, uid)).await {
        Ok(Ok(r)) => AgentView::reported(r),
        Ok(Err(e)) => AgentView::Unreachable(e.message),
        Err(_) => AgentView::Unreachable(format!(
            "no answer within {}s (--migration-agent-call-timeout-seconds)",
            limit.as_secs()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::agent::{AgentCallError, AgentReport, StepRequest};

    /// An agent that accepts the connection and never answers.
    struct Silent;

    impl AgentClient for Silent {
        async fn report(&self, _: &AgentEndpoint, _: &str) -> Result<AgentReport, AgentCallError> {
            std::future::pending().await
        }
        async fn start(&self, _: &AgentEndpoint, _: &StepRequest) -> Result<(), AgentCallError> {
            std::future::pending().await
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_agent_that_never_answers_is_unreachable_after_the_call_deadline() {
        let e = AgentEndpoint {
            node: "n0".into(),
            url: "https://10.0.0.1:7443".into(),
        };
        let view = report_within(&Silent, &e, "u1", Duration::from_secs(10)).await;
        match view {
            AgentView::Unreachable(m) => assert!(m.contains("no answer within 10s"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
