//! PostCopy (lazy pages) on the real nodes, through the chart installed from our images
//! (issue 18: "PostCopy has the same rollback guarantees as the other modes up to the
//! resume on the target, and tests for a source-agent crash during the lazy phase that
//! end in a clear terminal state (never a silent hang)").
//!
//! * A testload replica with 64 MiB of ballast moves with `mode: PostCopy`: it resumes
//!   on the target node before its memory is there, fetches every page from the frozen
//!   source (`status.progress.lazyBytes`), passes its probe and is adopted; the
//!   ballast's digest read from the restored copy is the one read from the source
//!   before, the counter never goes backwards, the status records the mode, and
//!   nothing of the source is given up before the last page (its process is there at
//!   every sample of the lazy phase).
//! * The same move limited to 1 MiB/s, so the lazy phase lasts about a minute: once the
//!   restored copy runs and has fetched pages, every process of the source node's
//!   agent pod (agent, broker, the CRIU serving the pages) is SIGKILLed from the host
//!   and the pod force-deleted. The pod's state is then lost (half its memory was only
//!   on the source): the target agent kills its copy before anything reads a missing
//!   page, and the migration ends `Failed` with reason `PostCopyFailed` within the
//!   progress timeout, never hanging, never with two running copies, and its status
//!   never says the source was resumed.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`, which raises the host's
//! `fs.pipe-max-size` for CRIU's page server) and the images pushed (`hack/images.sh`);
//! `hack/test.sh` does both.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationMode, MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::copies::{sample, says_resumed, status_texts};
use podmotion_e2e::real::force_delete_pod;
use podmotion_e2e::real::procs::{kill_pod_processes, workload_processes};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, ask, counter, counter_when_reachable,
    moved_copy_continues,
};
use podmotion_e2e::{from_json, pod_running_ready, wait_list};
use serde_json::json;

const BALLAST_MIB: u32 = 64;
/// The installer's choice that lets the agents restore lazily (CAP_SYS_PTRACE).
const POST_COPY: &[&str] = &["--set", "migrationAgent.postCopy.enabled=true"];
/// The progress timeout of the crash case: the bound of its lazy phase's end.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);

fn post_copy(pod: &str, target: &str, extra: serde_json::Value) -> PodMigration {
    let mut spec = json!({"podName": pod, "targetNode": target, "mode": "PostCopy",
        "freezeBudgetMillis": 30000,
        "progressTimeoutSeconds": PROGRESS_TIMEOUT.as_secs(),
        "probe": {"tcpSocket": {"port": testload::PORT}}});
    spec.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "lazy-move"}, "spec": spec
    }))
}

async fn status(pms: &Api<PodMigration>) -> PodMigrationStatus {
    pms.get_opt("lazy-move")
        .await
        .unwrap()
        .and_then(|m| m.status)
        .unwrap_or_default()
}

#[tokio::test]
async fn a_post_copy_migration_resumes_first_and_brings_every_page() {
    let Some(w) = World::new("lazy", "lazy", BALLAST_MIB, POST_COPY).await else {
        return;
    };
    let (app, source) = (&w.app, &w.source);
    let pods: Api<Pod> = app.api();
    let source_uid = source.uid().unwrap();
    let digest = ask(&addr(source), "digest").unwrap();
    let before = counter(&addr(source));
    let source_proc = workload_processes(std::slice::from_ref(&source_uid))
        .pop()
        .expect("the source's workload process");
    let pms: Api<PodMigration> = app.api();
    pms.create(
        &PostParams::default(),
        &post_copy(&source.name_any(), &w.target_node(), json!({})),
    )
    .await
    .unwrap();

    // Until the end: never two running copies; while pages come, the source is there.
    let start = Instant::now();
    let mut lazy_samples = 0usize;
    let st = loop {
        let st = status(&pms).await;
        let (procs, copies, _) = sample(&pods, &source_proc, st.target_pod.as_deref()).await;
        assert!(
            copies.len() <= 1,
            "two copies run ({:?}): {copies:?}",
            st.phase
        );
        let pages = st.progress.as_ref().and_then(|p| p.lazy_bytes).unwrap_or(0);
        if st.phase == MigrationPhase::Restoring && pages > 0 {
            assert!(
                procs.iter().any(|p| p.same(&source_proc)),
                "the source process went while the restored copy still fetched pages: {procs:?} ({st:?})"
            );
            lazy_samples += 1;
        }
        if st.phase.is_terminal() {
            break st;
        }
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "the migration did not end in {MIGRATION_TIMEOUT:?}: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("the PostCopy migration ended {:?}: {st:?}", st.phase);
    }
    assert_eq!(st.mode, Some(MigrationMode::PostCopy), "{st:?}");
    // The operator's log tells the same story at info: every phase the status records
    // (after the first, Pending, which nothing changes into), in order, by the uid.
    let uid = pms.get("lazy-move").await.unwrap().uid().unwrap();
    let logged = w.phase_changes_logged(&uid);
    let mut entered = logged.iter().map(|(to, _)| to.as_str());
    for t in st.phase_transition_timestamps.iter().skip(1) {
        let phase = format!("{:?}", t.phase);
        assert!(
            entered.any(|to| to == phase),
            "the operator's log has no info line entering {phase} (in order) for {uid}: \
             {logged:?}"
        );
    }
    assert_eq!(
        logged.last().map(|(to, _)| to.as_str()),
        Some("Succeeded"),
        "{logged:?}"
    );
    let progress = st.progress.clone().unwrap_or_default();
    let lazy = progress.lazy_bytes.unwrap_or(0);
    eprintln!(
        "PostCopy of {BALLAST_MIB} MiB: downtime {:?} ms, {} bytes before the resume, {lazy} bytes of pages after it",
        st.downtime_millis, progress.bytes_sent
    );
    assert!(
        lazy >= i64::from(BALLAST_MIB / 2) << 20,
        "the ballast came as lazy pages after the resume: {lazy} bytes ({st:?})"
    );
    assert!(
        progress.bytes_sent < i64::from(BALLAST_MIB / 2) << 20,
        "the memory is not in the images sent before the resume: {progress:?}"
    );
    assert!(st.downtime_millis.is_some(), "{st:?}");
    eprintln!("{lazy_samples} samples in the lazy phase, the source process there in each");
    assert!(
        lazy_samples > 0,
        "no sample in the lazy phase (Restoring with pages coming): the source's presence \
         while pages came is unproven ({st:?})"
    );
    let target = st.target_pod.clone().unwrap();
    let moved = wait_list(
        &pods,
        "app=lazy",
        POD_TIMEOUT,
        "only the target pod",
        |ps| ps.len() == 1 && ps[0].name_any() == target && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    moved_copy_continues(&moved, before, &digest);
}

#[tokio::test]
async fn a_source_agent_killed_in_the_lazy_phase_fails_clearly_and_never_leaves_two_copies() {
    let Some(w) = World::new("lazykill", "lazykill", BALLAST_MIB, POST_COPY).await else {
        return;
    };
    let (app, op, source) = (&w.app, &w.op, &w.source);
    let pods: Api<Pod> = app.api();
    let source_uid = source.uid().unwrap();
    let source_node = testload::node_of(source);
    let source_proc = workload_processes(std::slice::from_ref(&source_uid))
        .pop()
        .expect("the source's workload process");
    let pms: Api<PodMigration> = app.api();
    pms.create(
        &PostParams::default(),
        &post_copy(
            &source.name_any(),
            &w.target_node(),
            // 64 MiB of pages at 1 MiB/s: about a minute of lazy phase.
            json!({"bandwidthLimitBytesPerSecond": 1 << 20}),
        ),
    )
    .await
    .unwrap();
    let agents = w.agents();
    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents);
    let on_source = ListParams::default()
        .labels("app.kubernetes.io/component=migration-agent")
        .fields(&format!("spec.nodeName={source_node}"));

    let start = Instant::now();
    let mut killed_at: Option<Instant> = None;
    let st = loop {
        let st = status(&pms).await;
        let (_, copies, _) = sample(&pods, &source_proc, st.target_pod.as_deref()).await;
        assert!(
            copies.len() <= 1,
            "two copies run ({:?}): {copies:?}",
            st.phase
        );
        if killed_at.is_some() {
            for t in status_texts(&st) {
                assert!(!says_resumed(&t), "the status says resumed: {t:?} ({st:?})");
            }
        }
        if st.phase.is_terminal() {
            break st;
        }
        let pages = st.progress.as_ref().and_then(|p| p.lazy_bytes).unwrap_or(0);
        if killed_at.is_none() && st.phase == MigrationPhase::Restoring && pages > 0 {
            let victim = agent_pods.list(&on_source).await.unwrap().items;
            assert_eq!(victim.len(), 1, "one agent pod on {source_node}");
            let uid = victim[0].uid().unwrap();
            let killed = kill_pod_processes(&uid);
            force_delete_pod(&agents, &victim[0].name_any());
            killed_at = Some(Instant::now());
            eprintln!(
                "{pages} bytes of pages in: SIGKILLed {killed:?} and deleted the agent pod on {source_node}"
            );
            assert!(
                killed.iter().any(|(_, a)| a.ends_with("podmotion-agent")),
                "the agent is among the killed: {killed:?}"
            );
        }
        if let Some(at) = killed_at {
            // The target's session breaks at once; the rollback is bounded by the
            // progress timeout (an agent that does not answer) plus polling.
            assert!(
                at.elapsed() < 2 * PROGRESS_TIMEOUT + Duration::from_secs(30),
                "still {:?} {:?} after the source agent's kill: {st:?}",
                st.phase,
                at.elapsed()
            );
        }
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "the migration did not end in {MIGRATION_TIMEOUT:?}: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let Some(at) = killed_at else {
        app.dump();
        panic!("the migration ended before its lazy phase was seen: {st:?}");
    };
    eprintln!(
        "ended {:?} {:?} after the kill: {:?}: {:?}",
        st.phase,
        at.elapsed(),
        st.failure_reason,
        st.failure_message
    );
    assert_eq!(st.phase, MigrationPhase::Failed, "{st:?}");
    assert_eq!(
        st.failure_reason.as_deref(),
        Some("PostCopyFailed"),
        "{st:?}"
    );
    // No restored copy is left: the target pod goes, and no process of the migrated
    // state runs there.
    let target = st.target_pod.clone().unwrap();
    wait_list(
        &pods,
        "app=lazykill",
        POD_TIMEOUT,
        "the target pod gone",
        |ps| ps.iter().all(|p| p.name_any() != target),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    // The end state. No restored copy runs: the only process that may run the state is
    // the source itself. The status says the source's state is unknown and to delete
    // its pod if it does not serve; following that advice (or the source serving), the
    // workload serves again, from one replica.
    let (procs, copies, _) = sample(&pods, &source_proc, None).await;
    assert!(
        copies.iter().all(|p| p.same(&source_proc)),
        "a copy other than the source runs after the failure: {copies:?} (all: {procs:?})"
    );
    let serving = if copies.is_empty() {
        let message = st.failure_message.clone().unwrap_or_default();
        assert!(
            message.contains("delete it if it does not serve"),
            "the source does not run and the status does not say what to do: {message:?}"
        );
        eprintln!("the source does not run ({procs:?}): deleting its pod, as the status says");
        force_delete_pod(&app.name, &source.name_any());
        wait_list(
            &pods,
            "app=lazykill",
            POD_TIMEOUT,
            "a replacement replica Ready",
            |ps| {
                ps.len() == 1
                    && ps[0].uid().as_deref() != Some(source_uid.as_str())
                    && pod_running_ready(&ps[0])
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))[0]
            .clone()
    } else {
        eprintln!("the source runs again: {copies:?}");
        source.clone()
    };
    counter_when_reachable(&addr(&serving), "the workload after the failed move");
}
