//! The source node's agent pod crashes during the freeze, on the real nodes, through the
//! chart installed from our images (issue 16, "*real*: the agent pod and the broker
//! (not just the container) killed during the freeze — the source resumes within the
//! watchdog bound and status never says 'resumed' for an unknown state").
//!
//! A testload Deployment (one replica, 64 MiB of ballast, behind a Service) runs on a
//! real node. A Cold PodMigration to the other node is limited to 8 MiB/s, so the
//! transfer after the final dump lasts about 8 s while the source is frozen (stopped,
//! its links down). As soon as the source process is seen stopped, every process of the
//! source node's migration-agent pod — the agent, its broker sidecar, a CRIU still
//! running — is SIGKILLed from the host (no signal handler runs: neither the agent's
//! SIGTERM resume nor its watchdog can act), and the pod is force-deleted, so the
//! DaemonSet starts a new one that knows nothing of the migration.
//!
//! What must follow: the broker of the new pod finds the lock its predecessor recorded
//! on the node and rolls it back — the same source process (same pid, same start time)
//! runs again, within the freeze budget plus the watchdog margin of the kill, with its
//! network back; it serves its own counter, larger than before, through its address and
//! the Service (never going backwards). Sampled every 200 ms until the migration ends:
//! never two running copies of the state. The migration ends `Failed`, its message says
//! the source's state is unknown (the operator cannot know what a crashed agent left),
//! and no status text or Event of the migration says the source was resumed. One pod of
//! the app is left, the source, never restarted; no target pod.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::copies::{ServicePoller, sample, says_resumed, status_texts};
use podmotion_e2e::real::procs::{LogTail, Proc, kill_pod_processes, workload_processes};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter, node_of, source_serves_alone,
};
use podmotion_e2e::real::{force_delete_pod, kubectl, output_text};
use podmotion_e2e::{from_json, pod_running_ready, wait_list};
use serde_json::json;

const APP: &str = "crashed";
const MIGRATION: &str = "crash-move";
/// The migration's freeze budget; with the chart's watchdog margin (60 s, its default)
/// the bound by which a frozen source must run again.
const FREEZE_BUDGET: Duration = Duration::from_secs(30);
const WATCHDOG_MARGIN: Duration = Duration::from_secs(60);

/// Where the run is, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    /// Until the source is seen frozen (stopped) during the checkpoint or transfer.
    Migrating,
    /// The source node's agent pod was killed: until the source runs again.
    Crashed,
    /// The source runs again: until the migration ends.
    Resumed,
}

#[tokio::test]
async fn the_source_agent_pod_killed_during_the_freeze_resumes_the_source_and_never_says_so() {
    let Some(w) = World::new("crash", APP, 64, &[]).await else {
        return;
    };
    let (app, op, source) = (&w.app, &w.op, &w.source);
    let agents = w.agents();
    let svc_addr = w.service(APP).await;
    let pods: Api<Pod> = app.api();
    let source_uid = source.uid().unwrap();
    let source_node = node_of(source);
    let target_node = w.target_node();
    let before = counter(&addr(source));
    let found = workload_processes(std::slice::from_ref(&source_uid));
    assert_eq!(found.len(), 1, "one workload process in the source pod");
    let source_proc = found[0].clone();
    assert!(source_proc.runs(), "{source_proc:?}");

    let poller = ServicePoller::start(svc_addr);
    let pms: Api<PodMigration> = app.api();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": MIGRATION},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": FREEZE_BUDGET.as_millis() as i64,
            // 64 MiB at 8 MiB/s: the frozen source waits about 8 s for the transfer.
            "bandwidthLimitBytesPerSecond": 8 << 20,
            "probe": {"tcpSocket": {"port": testload::PORT}}}
    }));
    let pm_uid = pms
        .create(&PostParams::default(), &pm)
        .await
        .unwrap()
        .uid()
        .unwrap();

    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents);
    let on_source = ListParams::default()
        .labels("app.kubernetes.io/component=migration-agent")
        .fields(&format!("spec.nodeName={source_node}"));
    let mut stage = Stage::Migrating;
    let mut samples = 0usize;
    let mut max_copies = 0usize;
    let mut killed_at: Option<Instant> = None;
    let mut victim_uid = String::new();
    let mut victim_logs: Option<LogTail> = None;
    let mut frozen_for = Duration::ZERO;
    let start = Instant::now();
    let st = loop {
        let st = pms
            .get_opt(MIGRATION)
            .await
            .unwrap()
            .and_then(|m| m.status)
            .unwrap_or_default();
        let (procs, copies, _) = sample(&pods, &source_proc, st.target_pod.as_deref()).await;
        samples += 1;
        max_copies = max_copies.max(copies.len());
        if copies.len() > 1 {
            app.dump();
            panic!(
                "two copies run at sample {samples} ({stage:?}, phase {:?}): {copies:?}",
                st.phase
            );
        }
        let now = procs.iter().find(|p| p.same(&source_proc));
        if stage != Stage::Migrating {
            let Some(now) = now else {
                app.dump();
                panic!(
                    "the source process is gone after the agent's crash ({stage:?}, sample {samples}): {procs:?}; {st:?}"
                );
            };
            for t in status_texts(&st) {
                assert!(
                    !says_resumed(&t),
                    "after the agent's crash the status says resumed: {t:?} ({st:?})"
                );
            }
            if stage == Stage::Crashed && now.runs() {
                frozen_for = killed_at.unwrap().elapsed();
                eprintln!(
                    "sample {samples}: the source {} runs again ({}), {} ms after the kill; phase {:?}",
                    now.pid,
                    now.state,
                    frozen_for.as_millis(),
                    st.phase
                );
                stage = Stage::Resumed;
            }
        }
        if st.phase.is_terminal() {
            break st;
        }
        if stage == Stage::Migrating
            && matches!(
                st.phase,
                MigrationPhase::Checkpointing | MigrationPhase::Transferring
            )
            && now.is_some_and(|p| !p.runs())
        {
            let victim = agent_pods.list(&on_source).await.unwrap().items;
            assert_eq!(victim.len(), 1, "one agent pod on {source_node}");
            victim_uid = victim[0].uid().unwrap();
            let killed = kill_pod_processes(&victim_uid);
            killed_at = Some(Instant::now());
            // The kubelet may restart the killed broker in the crashed pod before it
            // sees the deletion; that broker then recovers the journal. Its log goes
            // with the pod: kept from the node as it is written.
            victim_logs = Some(LogTail::start(&source_node, &victim_uid, "netns-broker"));
            force_delete_pod(&agents, &victim[0].name_any());
            eprintln!(
                "sample {samples}: phase {:?}, source {} stopped ({}); SIGKILLed {killed:?} and deleted the agent pod {} on {source_node}",
                st.phase,
                source_proc.pid,
                now.map_or('?', |p| p.state),
                victim[0].name_any()
            );
            let names: Vec<&str> = killed.iter().map(|(_, a)| a.as_str()).collect();
            assert!(
                names.iter().any(|a| a.ends_with("podmotion-agent"))
                    && names.iter().any(|a| a.ends_with("podmotion-broker")),
                "the agent and the broker are among the killed: {killed:?}"
            );
            stage = Stage::Crashed;
        }
        if let Some(at) = killed_at
            && stage == Stage::Crashed
            && at.elapsed() >= FREEZE_BUDGET + WATCHDOG_MARGIN
        {
            dump_agents(&agents, &source_node);
            panic!(
                "the source is still frozen {:?} after its agent pod's crash (freeze budget {FREEZE_BUDGET:?} + watchdog margin {WATCHDOG_MARGIN:?}); phase {:?}",
                at.elapsed(),
                st.phase
            );
        }
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "the migration did not end in {MIGRATION_TIMEOUT:?} ({stage:?}): {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "ended {:?} ({:?}: {:?}); {samples} samples, max running copies {max_copies}",
        st.phase, st.failure_reason, st.failure_message
    );
    if stage == Stage::Migrating {
        app.dump();
        panic!("the migration ended before the source was seen frozen: {st:?}");
    }
    // The kill landed while frozen; the source may have run again only as the phase
    // turned terminal: wait for it, within the same bound.
    if stage == Stage::Crashed {
        let at = killed_at.unwrap();
        loop {
            let procs = workload_processes(std::slice::from_ref(&source_uid));
            match procs.iter().find(|p| p.same(&source_proc)) {
                Some(p) if p.runs() => break,
                Some(_) => {}
                None => panic!("the source process is gone after the agent's crash: {procs:?}"),
            }
            if at.elapsed() >= FREEZE_BUDGET + WATCHDOG_MARGIN {
                dump_agents(&agents, &source_node);
                panic!(
                    "the source is still frozen {:?} after its agent pod's crash: {procs:?}",
                    at.elapsed()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        frozen_for = at.elapsed();
    }
    assert_ended_unknown(&st);
    // Nor does any Event of the migration say the source was resumed.
    let events = app
        .api::<Event>()
        .list(&ListParams::default().fields(&format!(
            "involvedObject.kind=PodMigration,involvedObject.name={MIGRATION}"
        )))
        .await
        .unwrap();
    for e in &events.items {
        let m = e.message.clone().unwrap_or_default();
        assert!(!says_resumed(&m), "an Event says resumed: {m:?}");
    }

    // The source alone, never restarted, serving its own counter on through its address
    // (its links and routes are back), no target pod.
    let after = source_serves_alone(&pods, APP, source, before, "after the agent's crash").await;
    let procs = workload_processes(std::slice::from_ref(&source_uid));
    let running: Vec<&Proc> = procs.iter().filter(|p| p.runs()).collect();
    assert_eq!(running.len(), 1, "{procs:?}");
    assert!(running[0].same(&source_proc), "{procs:?}");
    // Who resumed it: a broker that started after the crash, from its predecessor's
    // journal on the node — the new pod's, or the crashed pod's own broker restarted by
    // the kubelet before the pod's deletion reached it (then the new pod's finds the
    // journal already recovered).
    let new_pod = new_broker_rolled_back(&agent_pods, &source_node, &victim_uid, &pm_uid).await;
    let kept = victim_logs.map(LogTail::stop).unwrap_or_default();
    let restarted = kept
        .iter()
        .filter(|(file, _)| file.as_str() != "0.log")
        .flat_map(|(_, text)| text.lines())
        .find(|l| l.contains(pm_uid.as_str()) && l.contains("rolling back"))
        .map(str::to_owned);
    eprintln!(
        "the source ran again {} ms after the kill; the new pod's broker: {new_pod:?}; the crashed pod's restarted broker: {restarted:?}",
        frozen_for.as_millis()
    );
    if new_pod.is_none() && restarted.is_none() {
        for (file, text) in &kept {
            eprintln!("----- crashed pod's netns-broker {file} -----\n{text}");
        }
    }
    assert!(
        new_pod.is_some() || restarted.is_some(),
        "no broker started on {source_node} after the crash logged rolling back migration {pm_uid}"
    );

    // Through the Service, the counter never went back and reached the source again.
    poller.finish_reaching(after, "the source again");
}

/// The migration failed, and says the source's state is unknown (never resumed).
fn assert_ended_unknown(st: &PodMigrationStatus) {
    assert_eq!(st.phase, MigrationPhase::Failed, "{st:?}");
    let message = st.failure_message.clone().unwrap_or_default();
    assert!(
        message.contains("source state unknown"),
        "the failure does not say the source's state is unknown: {message:?}"
    );
}

/// What a source left frozen needs explained (a rehearsal once saw one, 90 s, after a
/// kill in `Transferring`, with nothing else to go on): the agent pods of the release
/// with their nodes and phases, the namespace's Events, and every container's log of
/// the pods on `node` (the new broker's recovery is there).
fn dump_agents(agents_ns: &str, node: &str) {
    for args in [
        vec!["-n", agents_ns, "get", "pods", "-o", "wide"],
        vec!["-n", agents_ns, "get", "events", "--sort-by=.lastTimestamp"],
    ] {
        let out = kubectl(&args);
        eprintln!(
            "----- kubectl {} -----\n{}",
            args.join(" "),
            output_text(&out)
        );
    }
    let field = format!("spec.nodeName={node}");
    let names = kubectl(&[
        "-n",
        agents_ns,
        "get",
        "pods",
        "--field-selector",
        &field,
        "-o",
        "name",
    ]);
    for pod in String::from_utf8_lossy(&names.stdout).lines() {
        let out = kubectl(&["-n", agents_ns, "logs", pod, "--all-containers", "--prefix"]);
        eprintln!("----- {pod} logs -----\n{}", output_text(&out));
    }
}

/// The line of the broker in node `node`'s new agent pod (not the killed pod `victim`)
/// that says it rolled back migration `uid`, left locked by its predecessor.
async fn new_broker_rolled_back(
    agent_pods: &Api<Pod>,
    node: &str,
    victim: &str,
    uid: &str,
) -> Option<String> {
    let fresh =
        |p: &Pod| p.uid().as_deref() != Some(victim) && node_of(p) == node && pod_running_ready(p);
    let pods = wait_list(
        agent_pods,
        "app.kubernetes.io/component=migration-agent",
        POD_TIMEOUT,
        &format!("the new agent pod on {node} Ready"),
        |ps| ps.iter().any(fresh),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let pod = pods.iter().find(|p| fresh(p)).unwrap();
    let ns = pod.namespace().unwrap();
    let out = kubectl(&["-n", &ns, "logs", &pod.name_any(), "-c", "netns-broker"]);
    assert!(out.status.success(), "{}", output_text(&out));
    let log = String::from_utf8_lossy(&out.stdout).into_owned();
    let line = log
        .lines()
        .find(|l| l.contains(uid) && l.contains("rolling back"))
        .map(str::to_owned);
    if line.is_none() {
        eprintln!(
            "----- {}/{} netns-broker log -----\n{log}",
            ns,
            pod.name_any()
        );
    }
    line
}
