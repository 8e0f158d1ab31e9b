//! The operator's Lease deleted and created again, on the real nodes, through the chart
//! installed from our images (issue 16, the leader-term fence's hazard).
//!
//! The agents refuse a commanding call whose leader term is older than the newest they
//! have recorded on their node. A Lease's transition count restarts at 0 when the Lease
//! is deleted (its namespace deleted and the release reinstalled, another lease name, or
//! someone deleting it), so a term that were the count alone would lock the new leader
//! out of every node that saw a higher count. The term is the Lease's creation time,
//! then its count.
//!
//! Here: the chart runs the operator with leader election on. Its Lease is given a
//! count of 5 (what five takeovers leave) and the leader renews it, so it leads in term
//! 5; a PodMigration commits, and both real nodes' agents record term 5. The Lease is
//! deleted; the leader creates it again (count 0, a later creation time). A second
//! PodMigration, of another Deployment's pod, must commit too — commanded in term 0 of
//! the new Lease by the same operator process. With the count alone as the term, both
//! agents refuse it (`PermissionDenied`, "leader term 0 is older than term 5") and it
//! fails.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::procs::pod_processes;
use podmotion_e2e::real::testload::{self, POD_TIMEOUT, World, ended, node_of, wait_ballast};
use podmotion_e2e::{from_json, pod_running_ready, wait_for, wait_list};
use serde_json::json;

const APP: &str = "leased";
const SECOND_APP: &str = "leased-again";
/// The lease `World::new("lease", …)` installs the chart with.
const LEASE: &str = "podmotion-e2e-lease";
const LEASE_TIMEOUT: Duration = Duration::from_secs(60);

/// A Cold migration of `pod` to the real node that is not its own, which must succeed.
async fn migrate(w: &World, pms: &Api<PodMigration>, name: &str, pod: &Pod) {
    let source = node_of(pod);
    let target = w
        .nodes
        .iter()
        .find(|n| **n != source)
        .expect("a second real node");
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name},
        "spec": {"podName": pod.name_any(), "targetNode": target, "mode": "Cold",
            "freezeBudgetMillis": 60000,
            "probe": {"tcpSocket": {"port": testload::PORT}}}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let st = ended(pms, name).await;
    assert_eq!(st.phase, MigrationPhase::Succeeded, "{name}: {st:#?}");
}

/// The Lease once `cond` holds of it (a minute at most).
async fn lease_when(leases: &Api<Lease>, what: &str, cond: impl Fn(&Lease) -> bool) -> Lease {
    wait_for(leases, LEASE, LEASE_TIMEOUT, what, |l| l.is_some_and(&cond))
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
        .expect("the Lease")
}

fn renew_time(l: &Lease) -> Option<String> {
    l.spec
        .as_ref()
        .and_then(|s| s.renew_time.as_ref())
        .map(|t| t.0.to_string())
}

fn transitions(l: &Lease) -> Option<i32> {
    l.spec.as_ref().and_then(|s| s.lease_transitions)
}

/// What each real node's agent recorded as the newest leader term it admitted (the
/// chart's `agent-state` host path, read through the agent process's root), sorted.
async fn recorded_terms(w: &World) -> Vec<String> {
    let agents: Api<Pod> = Api::namespaced(w.op.client.clone(), &w.agents());
    let mut out = Vec::new();
    for pod in agents.list(&Default::default()).await.unwrap() {
        let uid = pod.uid().unwrap();
        let agent = pod_processes(&uid)
            .into_iter()
            .find(|(_, argv0)| argv0.ends_with("podmotion-agent"))
            .unwrap_or_else(|| panic!("no agent process in {}", pod.name_any()));
        let path = format!("/proc/{}/root/run/podmotion/agent/leader-term", agent.0);
        out.push(std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")));
    }
    out.sort();
    out
}

/// The record's text for a term of `lease` (`<creation time> <count>`).
fn record_of(lease: &Lease, count: i32) -> String {
    let created = lease.creation_timestamp().expect("creationTimestamp").0;
    format!("{} {count}\n", created.as_second())
}

fn held(l: &Lease) -> bool {
    l.spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .is_some_and(|h| !h.is_empty())
}

#[tokio::test]
async fn a_lease_deleted_and_created_again_still_commands_the_agents() {
    let Some(w) = World::new("lease", APP, 8, &[]).await else {
        return;
    };
    let leases: Api<Lease> = w.op.api();
    let pms: Api<PodMigration> = w.app.api();

    // The leader leads in term 5 of the first Lease: its renewal after the count was
    // raised carries the count on.
    let first = lease_when(&leases, "the leader holds the Lease", held).await;
    let patched = leases
        .patch(
            LEASE,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"leaseTransitions": 5}})),
        )
        .await
        .unwrap();
    let at_patch = renew_time(&patched);
    lease_when(&leases, "the leader renews the Lease in term 5", |l| {
        renew_time(l) != at_patch && transitions(l) == Some(5) && held(l)
    })
    .await;
    migrate(&w, &pms, "lease-first", &w.source).await;
    // Both nodes' agents admitted term 5 of the first Lease (and recorded it).
    let five = record_of(&first, 5);
    assert_eq!(recorded_terms(&w).await, vec![five.clone(), five]);

    // Deleted: the leader creates it again, counting from 0.
    leases.delete(LEASE, &Default::default()).await.unwrap();
    let again = lease_when(&leases, "the Lease created again and held", |l| {
        l.uid() != first.uid() && held(l)
    })
    .await;
    assert_eq!(transitions(&again), Some(0), "{again:?}");
    assert!(
        again.creation_timestamp() > first.creation_timestamp(),
        "{:?} then {:?}",
        first.creation_timestamp(),
        again.creation_timestamp()
    );

    // Another Deployment's pod (an adopted pod is not migrated again), commanded in
    // term 0 of the new Lease.
    let deploy = testload::deployment(SECOND_APP, &w.images.testload().unwrap(), 8);
    w.app
        .api::<Deployment>()
        .create(&PostParams::default(), &deploy)
        .await
        .unwrap();
    let second = wait_list(
        &w.app.api::<Pod>(),
        &format!("app={SECOND_APP}"),
        POD_TIMEOUT,
        "the second replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    wait_ballast(&second);
    migrate(&w, &pms, "lease-second", &second).await;
    let zero = record_of(&again, 0);
    assert_eq!(recorded_terms(&w).await, vec![zero.clone(), zero]);
}
