//! `kubectl podmotion drain NODE`: cordon the node and evict its pods as `kubectl
//! drain` does (DaemonSet pods and mirror pods are left alone), printing one line per
//! pod each time its state changes — migrating (the pod asked for it and PodMotion's
//! eviction webhook answered with a PodMigration), migrated (where to, with the
//! measured downtime), evicted, or blocked and why — until the node is empty. Ctrl-C
//! leaves the node cordoned and the migrations running, and says so.
//!
//! The pure part ([`skip_reason`], [`Outcome::of_eviction`], [`line`]) decides what a
//! pod is and what to print; [`run`] does the I/O. Evictions are retried every few
//! seconds, as `kubectl drain` retries a 429.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, EvictParams, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_api::names::{annotations, labels};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::Drain;
use crate::migrate::INTERRUPTED;

/// Why a pod on the node is not evicted, as `kubectl drain` decides.
pub fn skip_reason(pod: &Pod) -> Option<&'static str> {
    let owned_by = |kind: &str| {
        pod.owner_references()
            .iter()
            .any(|o| o.controller == Some(true) && o.kind == kind)
    };
    if pod.annotations().contains_key(annotations::CONFIG_MIRROR) {
        return Some("mirror pod (static, run by the kubelet)");
    }
    if owned_by("DaemonSet") {
        return Some("DaemonSet pod");
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Some("already being deleted");
    }
    None
}

/// What one eviction attempt of a pod came to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The eviction went through (or the pod is gone already).
    Evicted,
    /// 429: retry. PodMotion's webhook is migrating the pod (or a budget holds it).
    Retry(String),
    /// Refused: the drain cannot empty the node of this pod.
    Blocked(String),
}

impl Outcome {
    /// From the eviction's result: `Ok`, or the API error's code and message.
    pub fn of_eviction(result: Result<(), (u16, String)>) -> Outcome {
        match result {
            Ok(()) | Err((404, _)) => Outcome::Evicted,
            Err((429, m)) => Outcome::Retry(m),
            Err((_, m)) => Outcome::Blocked(m),
        }
    }
}

/// What the plugin shows of one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodState {
    Skipped(&'static str),
    /// Its eviction waits on a PodMigration: `(name, phase)`.
    Migrating(String, MigrationPhase),
    /// 429 without a PodMigration of ours (a PodDisruptionBudget, usually).
    Waiting(String),
    Migrated {
        target: Option<String>,
        downtime_millis: Option<i64>,
    },
    Evicted,
    Blocked(String),
}

/// The line printed when a pod's state changes.
pub fn line(pod: &str, state: &PodState) -> String {
    let what = match state {
        PodState::Skipped(why) => format!("skipped    {why}"),
        PodState::Migrating(m, phase) => format!("migrating  PodMigration {m} ({phase:?})"),
        PodState::Waiting(m) => format!("waiting    {}", first_line(m)),
        PodState::Migrated {
            target,
            downtime_millis,
        } => format!(
            "migrated   to {}, downtime {}",
            target.as_deref().unwrap_or("?"),
            downtime_millis.map_or("unknown".into(), |d| format!("{d} ms"))
        ),
        PodState::Evicted => "evicted".into(),
        PodState::Blocked(m) => format!("blocked    {}", first_line(m)),
    };
    format!("{pod:<40} {what}")
}

fn first_line(m: &str) -> &str {
    m.lines().next().unwrap_or(m)
}

/// Whether the pod is done with: it left the node one way or another, or cannot.
fn settled(s: &PodState) -> bool {
    matches!(
        s,
        PodState::Skipped(_) | PodState::Migrated { .. } | PodState::Evicted | PodState::Blocked(_)
    )
}

/// The state of a pod whose eviction was answered 429, from its PodMigration.
pub fn migrating_state(message: &str, migration: Option<&PodMigration>) -> PodState {
    match migration {
        Some(m) => {
            let status = m.status.clone().unwrap_or_default();
            match status.phase {
                MigrationPhase::Succeeded => PodState::Migrated {
                    target: status.target_node,
                    downtime_millis: status.downtime_millis,
                },
                phase => PodState::Migrating(m.name_any(), phase),
            }
        }
        None => PodState::Waiting(message.to_string()),
    }
}

const ROUND: Duration = Duration::from_secs(3);

/// Cordons `NODE`, then evicts until every pod left or is blocked. Exit code: 0 when
/// the node is empty of evictable pods, 1 when some are blocked, 130 after Ctrl-C.
pub async fn run(client: Client, args: &Drain) -> anyhow::Result<u8> {
    cordon(&client, &args.node).await?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={}", args.node));
    let mut shown: BTreeMap<String, PodState> = BTreeMap::new();
    // Pods we migrated: their PodMigration, found again after the source is gone.
    let mut migrations: BTreeMap<String, (String, String)> = BTreeMap::new();
    loop {
        let listed = pods.list(&on_node).await?.items;
        let present = evict_listed(&client, &listed, &mut shown, &mut migrations).await?;
        // Pods that left the node: migrated or evicted.
        show_gone(&client, &present, &mut shown, &migrations).await?;
        if let Some(code) = finished(&shown, &args.node) {
            return Ok(code);
        }
        tokio::select! {
            _ = tokio::time::sleep(ROUND) => {}
            _ = interrupt.recv() => {
                println!(
                    "interrupted: node/{} stays cordoned (kubectl uncordon {} to undo); the \
                     migrations already started keep running (kubectl get podmigrations -A \
                     -l {}={})",
                    args.node,
                    args.node,
                    labels::COMPONENT,
                    labels::EVICTION_COMPONENT
                );
                return Ok(INTERRUPTED);
            }
        }
    }
}

/// Marks `node` unschedulable, as `kubectl cordon` does.
async fn cordon(client: &Client, node: &str) -> anyhow::Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .patch(
            node,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"unschedulable": true}})),
        )
        .await
        .map_err(|e| anyhow::anyhow!("cordoning node {node}: {e}"))?;
    println!("node/{node} cordoned");
    Ok(())
}

/// Tries once more to evict each pod listed on the node that is not settled yet (or
/// skips it), showing what changed; returns the keys (`namespace/name`) of the pods
/// listed.
async fn evict_listed(
    client: &Client,
    listed: &[Pod],
    shown: &mut BTreeMap<String, PodState>,
    migrations: &mut BTreeMap<String, (String, String)>,
) -> anyhow::Result<BTreeSet<String>> {
    let mut present = BTreeSet::new();
    for pod in listed {
        let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
        present.insert(key.clone());
        if shown.get(&key).is_some_and(settled) {
            continue;
        }
        // Evicted, or a migrated source PodMotion is removing: wait until it is gone.
        if shown.contains_key(&key) && pod.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let state = match skip_reason(pod) {
            Some(why) => PodState::Skipped(why),
            None => evict_once(client, pod, migrations, &key).await?,
        };
        show(shown, &key, state);
    }
    Ok(present)
}

/// Shows where each unsettled pod that is no longer `present` on the node went:
/// migrated (from its PodMigration) or evicted. One whose migration has not ended yet
/// is looked at again next round.
async fn show_gone(
    client: &Client,
    present: &BTreeSet<String>,
    shown: &mut BTreeMap<String, PodState>,
    migrations: &BTreeMap<String, (String, String)>,
) -> anyhow::Result<()> {
    let gone: Vec<String> = shown
        .iter()
        .filter(|(k, s)| !present.contains(*k) && !settled(s))
        .map(|(k, _)| k.clone())
        .collect();
    for key in gone {
        let state = match migrations.get(&key) {
            Some((ns, name)) => {
                let api: Api<PodMigration> = Api::namespaced(client.clone(), ns);
                match api.get_opt(name).await? {
                    Some(m) => migrating_state("", Some(&m)),
                    None => PodState::Evicted,
                }
            }
            None => PodState::Evicted,
        };
        let state = match state {
            // Its source is gone: the migration's end is a matter of moments.
            PodState::Migrating(..) | PodState::Waiting(_) => continue,
            s => s,
        };
        show(shown, &key, state);
    }
    Ok(())
}

/// The exit code once every pod shown is settled, saying how the drain ended: 0 when
/// the node is drained, 1 when some pods blocked it; `None` while some are not.
fn finished(shown: &BTreeMap<String, PodState>, node: &str) -> Option<u8> {
    let unsettled = shown.values().filter(|s| !settled(s)).count();
    if unsettled != 0 {
        return None;
    }
    let blocked = shown
        .values()
        .filter(|s| matches!(s, PodState::Blocked(_)))
        .count();
    if blocked > 0 {
        println!("node/{node} cordoned; {blocked} pod(s) blocked the drain (see above)");
        return Some(1);
    }
    println!("node/{node} drained");
    Some(0)
}

fn show(shown: &mut BTreeMap<String, PodState>, key: &str, state: PodState) {
    if shown.get(key) != Some(&state) {
        println!("{}", line(key, &state));
        shown.insert(key.to_string(), state);
    }
}

/// One eviction attempt, and what it means for the pod.
async fn evict_once(
    client: &Client,
    pod: &Pod,
    migrations: &mut BTreeMap<String, (String, String)>,
    key: &str,
) -> anyhow::Result<PodState> {
    let ns = pod.namespace().unwrap_or_default();
    let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let result = match api.evict(&pod.name_any(), &EvictParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err((e.code, e.message)),
        Err(e) => return Err(e.into()),
    };
    Ok(match Outcome::of_eviction(result) {
        // Gone from the node once the API server deletes it; shown when it left.
        Outcome::Evicted => PodState::Waiting("evicted, terminating".into()),
        Outcome::Blocked(m) => PodState::Blocked(m),
        Outcome::Retry(m) => {
            let pm: Api<PodMigration> = Api::namespaced(client.clone(), &ns);
            let selector = format!(
                "{}={}",
                labels::EVICTED_POD_UID,
                pod.uid().unwrap_or_default()
            );
            let found = pm
                .list(&ListParams::default().labels(&selector))
                .await?
                .items
                .into_iter()
                .next();
            if let Some(m) = &found {
                migrations.insert(key.to_string(), (ns.clone(), m.name_any()));
            }
            migrating_state(&m, found.as_ref())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn daemonset_and_mirror_pods_are_skipped_like_kubectl_drain_does() {
        let ds = pod(json!({"metadata": {"name": "a", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "d", "uid": "u", "controller": true}]}}));
        assert_eq!(skip_reason(&ds), Some("DaemonSet pod"));
        let mirror = pod(json!({"metadata": {"name": "m",
            "annotations": {"kubernetes.io/config.mirror": "x"}}}));
        assert!(skip_reason(&mirror).unwrap().contains("mirror"));
        let rs = pod(json!({"metadata": {"name": "r", "ownerReferences": [
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "d", "uid": "u", "controller": true}]}}));
        assert_eq!(skip_reason(&rs), None);
    }

    #[test]
    fn a_429_retries_a_refusal_blocks_and_a_404_counts_as_evicted() {
        assert_eq!(Outcome::of_eviction(Ok(())), Outcome::Evicted);
        assert_eq!(
            Outcome::of_eviction(Err((404, "gone".into()))),
            Outcome::Evicted
        );
        assert_eq!(
            Outcome::of_eviction(Err((429, "migrating".into()))),
            Outcome::Retry("migrating".into())
        );
        assert_eq!(
            Outcome::of_eviction(Err((403, "HostNamespaces".into()))),
            Outcome::Blocked("HostNamespaces".into())
        );
        assert!(matches!(
            Outcome::of_eviction(Err((500, "failed calling webhook".into()))),
            Outcome::Blocked(_)
        ));
    }

    #[test]
    fn a_migration_shows_its_phase_then_where_it_went_and_its_downtime() {
        let mut m: PodMigration = serde_json::from_value(json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
            "metadata": {"name": "web-evict-1"},
            "spec": {"podName": "web"},
            "status": {"phase": "Transferring"},
        }))
        .unwrap();
        let s = migrating_state("429", Some(&m));
        assert_eq!(
            s,
            PodState::Migrating("web-evict-1".into(), MigrationPhase::Transferring)
        );
        assert!(
            line("shop/web", &s).contains("migrating  PodMigration web-evict-1 (Transferring)")
        );
        let st = m.status.as_mut().unwrap();
        st.phase = MigrationPhase::Succeeded;
        st.target_node = Some("pm-real-1".into());
        st.downtime_millis = Some(212);
        let done = migrating_state("429", Some(&m));
        assert_eq!(
            line("shop/web", &done),
            format!(
                "{:<40} migrated   to pm-real-1, downtime 212 ms",
                "shop/web"
            )
        );
        assert_eq!(
            migrating_state("budget", None),
            PodState::Waiting("budget".into())
        );
        assert!(settled(&done));
        assert!(!settled(&s));
    }

    #[test]
    fn a_blocked_pod_shows_the_first_line_of_why() {
        let l = line(
            "shop/host",
            &PodState::Blocked("HostNamespaces: no\nmore".into()),
        );
        assert!(l.ends_with("blocked    HostNamespaces: no"), "{l}");
    }
}
