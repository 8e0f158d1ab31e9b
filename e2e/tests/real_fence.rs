//! The restore fence on the real nodes, through the chart installed from our images
//! (issue 16 finding 6, "*real*: the source agent killed after the target restored —
//! never two copies").
//!
//! A testload Deployment (one replica, behind a Service) runs on a real node. A Cold
//! PodMigration moves it to the other one; its application probe is a TCP connect to
//! port 9 of the restored pod, where nothing listens until the test opens a gate there
//! (a listener in the target pod's network namespace). So the migration sits in
//! `Restoring` after the target restored and the source was fenced. Then the source
//! node's migration agent pod is deleted with `--grace-period=0 --force`: the agent and
//! its broker sidecar go with the pod (the kubelet gives the containers its minimum
//! grace, so the agent may see SIGTERM; the broker's lease ends with the agent; the
//! DaemonSet starts a new pod that knows nothing of the migration). The fenced source
//! must then be killed on its node, never resumed. Once it is gone the gate opens, the
//! probe passes, and the migration commits.
//!
//! All along, sampled continuously until the migration ends: the copies of the
//! workload's state that run (the original source process, and the restored process in
//! the target pod; a stopped process does not run) are never two; the counter read
//! through the Service never goes backwards; and after the kill, nothing in the status
//! says the source was resumed. The migration ends `Succeeded`, the target adopted by
//! the ReplicaSet (one replica), the counter carried over. (Killed, the source's
//! container is restarted by the kubelet from its image, in the network the broker
//! left isolated, until the commit deletes the source pod: a fresh workload process,
//! not a copy of the state; it is printed, and the Service check shows it never
//! serves.)
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::ReplicaSet;
use k8s_openapi::api::core::v1::{Event, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::copies::{ServicePoller, says_resumed, status_texts};
use podmotion_e2e::real::procs::{Proc, running_copies, workload_processes};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, counter, node_of, pod_ip, restart_count,
};
use podmotion_e2e::real::{entrypoint, force_delete_pod};
use podmotion_e2e::{from_json, pod_running_ready, wait_list};
use serde_json::json;

const APP: &str = "fenced";
/// The probe's port: nothing listens there until the gate opens.
const GATE_PORT: u16 = 9;

/// The gate: a testload server listening on `GATE_PORT` in the network (and mount)
/// namespace of host PID `pid`, outside the pod's cgroups. `timeout` ends it even if
/// this test is killed; dropping the guard ends it at once (and the test checks it did).
struct Gate(std::process::Child);

impl Gate {
    fn open(pid: u32, binary: &str) -> Gate {
        let child = std::process::Command::new("timeout")
            .args([
                "300",
                "nsenter",
                "-t",
                &pid.to_string(),
                "--net",
                "--mount",
                "--",
            ])
            .args([binary, "serve", &GATE_PORT.to_string(), "0"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nsenter the gate");
        Gate(child)
    }
}

impl Drop for Gate {
    /// SIGTERM to `timeout`, which passes it on to the listener (a SIGKILL would end
    /// `timeout` alone and leave the listener running).
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let _ = self.0.wait();
    }
}

/// PIDs of testload servers on `GATE_PORT` in network namespace `ns` (a readlink of
/// /proc/<pid>/ns/net).
fn gate_listeners(ns: &std::path::Path) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<_> = cmd.split(|b| *b == 0).collect();
        let port = GATE_PORT.to_string();
        if args.len() > 2
            && args[1] == b"serve"
            && args[2] == port.as_bytes()
            && std::fs::read_link(format!("/proc/{pid}/ns/net")).is_ok_and(|l| l == ns)
        {
            out.push(pid);
        }
    }
    out
}

/// Where the run is, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stage {
    /// Until the target restored (phase Restoring, the source fenced, the restored
    /// process running in the target pod).
    Migrating,
    /// The source's agent pod was deleted: until the fenced source is gone.
    AgentKilled,
    /// The source was killed on its node; the gate opens after a few more samples.
    SourceGone,
    /// The probe may pass: until the end.
    GateOpen,
}

#[tokio::test]
async fn the_source_agent_killed_after_the_restore_never_leaves_two_copies() {
    let Some(w) = World::new("fence", APP, 16, &[]).await else {
        return;
    };
    let (app, op, source) = (&w.app, &w.op, &w.source);
    let agents = w.agents();
    let testload_bin =
        entrypoint(&w.images.testload().unwrap()).unwrap_or_else(|e| panic!("{e:#}"));
    let svc_addr = w.service(APP).await;
    let pods: Api<Pod> = app.api();
    let source_uid = source.uid().unwrap();
    let source_node = node_of(source);
    let target_node = w.target_node();
    let before = counter(&format!("{}:{}", pod_ip(source), testload::PORT));
    let found = workload_processes(std::slice::from_ref(&source_uid));
    assert_eq!(found.len(), 1, "one workload process in the source pod");
    let source_proc = found[0].clone();
    assert!(source_proc.runs(), "{source_proc:?}");

    let reader = ServicePoller::start(svc_addr.clone());
    let pms: Api<PodMigration> = app.api();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "fenced"},
        "spec": {"podName": source.name_any(), "targetNode": target_node, "mode": "Cold",
            "freezeBudgetMillis": 120000,
            // 30 attempts, a second apart: refused until the gate opens.
            "probe": {"tcpSocket": {"port": GATE_PORT}, "timeoutSeconds": 1,
                "failureThreshold": 30}}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();

    let agent_pods: Api<Pod> = Api::namespaced(op.client.clone(), &agents);
    let on_source = ListParams::default()
        .labels("app.kubernetes.io/component=migration-agent")
        .fields(&format!("spec.nodeName={source_node}"));
    let mut stage = Stage::Migrating;
    let mut gate = None;
    let mut samples = 0usize;
    let mut max_copies = 0usize;
    let mut max_instances = 0usize;
    let mut source_gone_at_sample = 0usize;
    let mut restored: Option<Proc> = None;
    // Wall-clock instants (this machine's clock, the API server's too) of the restored
    // copy seen and of the gate's opening, against the status's own timestamps.
    let mut restored_seen_at: Option<Timestamp> = None;
    let mut gate_opened_at: Option<Timestamp> = None;
    // The first running workload process that is no copy (a fresh container).
    let mut other: Option<(usize, Stage, Proc)> = None;
    let start = Instant::now();
    let st = loop {
        let m = pms.get_opt("fenced").await.unwrap();
        let st = m.and_then(|m| m.status).unwrap_or_default();
        let mut uids: Vec<String> = pods
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .filter_map(|p| p.uid())
            .collect();
        if !uids.contains(&source_uid) {
            uids.push(source_uid.clone());
        }
        let target_uid = match &st.target_pod {
            Some(t) => pods.get_opt(t).await.unwrap().and_then(|p| p.uid()),
            None => None,
        };
        if let Some(t) = &target_uid
            && !uids.contains(t)
        {
            uids.push(t.clone());
        }
        let procs = workload_processes(&uids);
        samples += 1;
        let copies = running_copies(&procs, &source_proc, target_uid.as_deref());
        max_copies = max_copies.max(copies.len());
        max_instances = max_instances.max(procs.iter().filter(|p| p.runs()).count());
        if other.is_none() {
            other = procs
                .iter()
                .find(|p| p.runs() && !copies.contains(p))
                .map(|p| (samples, stage, p.clone()));
        }
        if copies.len() > 1 {
            app.dump();
            panic!(
                "two copies run at sample {samples} ({stage:?}, phase {:?}): {copies:?} (source {source_proc:?}, target pod {target_uid:?}; all: {procs:?})",
                st.phase
            );
        }
        if stage != Stage::Migrating {
            for t in status_texts(&st) {
                assert!(
                    !says_resumed(&t),
                    "after the source's agent was killed the status says resumed: {t:?} ({st:?})"
                );
            }
        }
        if st.phase.is_terminal() {
            break st;
        }
        let source_alive = procs.iter().any(|p| p.same(&source_proc));
        match stage {
            Stage::Migrating => {
                let in_target: Vec<&Proc> = procs
                    .iter()
                    .filter(|p| Some(p.pod_uid.as_str()) == target_uid.as_deref() && p.runs())
                    .collect();
                if st.phase == MigrationPhase::Restoring
                    && st.downtime_millis.is_some()
                    && in_target.len() == 1
                {
                    let fenced = st
                        .conditions
                        .iter()
                        .any(|c| c.message.contains("source is fenced"));
                    assert!(fenced, "Restoring without the fence: {st:?}");
                    assert!(
                        source_alive,
                        "the source died before its agent was killed: {procs:?}"
                    );
                    restored = Some(in_target[0].clone());
                    restored_seen_at = Some(Timestamp::now());
                    let victim = agent_pods.list(&on_source).await.unwrap().items;
                    assert_eq!(victim.len(), 1, "one agent pod on {source_node}");
                    force_delete_pod(&agents, &victim[0].name_any());
                    eprintln!(
                        "sample {samples}: target restored (downtime {:?} ms, restored pid {}), source {} frozen ({}); deleted the agent pod {} on {source_node}",
                        st.downtime_millis,
                        in_target[0].pid,
                        source_proc.pid,
                        procs
                            .iter()
                            .find(|p| p.pid == source_proc.pid)
                            .map_or('?', |p| p.state),
                        victim[0].name_any()
                    );
                    stage = Stage::AgentKilled;
                }
            }
            Stage::AgentKilled => {
                if !source_alive {
                    eprintln!(
                        "sample {samples}: the fenced source is gone from {source_node} ({} ms after the start)",
                        start.elapsed().as_millis()
                    );
                    source_gone_at_sample = samples;
                    stage = Stage::SourceGone;
                }
            }
            // A few more samples with the source dead and the new agent starting: a
            // thaw would show here (it cannot: the process is gone), a second copy too.
            Stage::SourceGone if samples >= source_gone_at_sample + 10 => {
                let pid = restored.as_ref().unwrap().pid;
                gate = Some(Gate::open(pid, &testload_bin));
                gate_opened_at = Some(Timestamp::now());
                eprintln!("sample {samples}: gate opened in the restored pod's netns");
                stage = Stage::GateOpen;
            }
            Stage::SourceGone | Stage::GateOpen => {}
        }
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "the migration did not end in {MIGRATION_TIMEOUT:?} ({stage:?}): {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let gate_netns = restored
        .as_ref()
        .and_then(|r| std::fs::read_link(format!("/proc/{}/ns/net", r.pid)).ok());
    drop(gate);
    if let Some(ns) = gate_netns {
        let left = gate_listeners(&ns);
        assert!(left.is_empty(), "the gate's listener outlived it: {left:?}");
    }
    let restoring_s = restoring_seconds(&st);
    eprintln!(
        "ended {:?} ({:?}: {:?}); {samples} samples, max running copies {max_copies}, max running instances {max_instances}, Restoring ~{restoring_s:?} s",
        st.phase, st.failure_reason, st.failure_message
    );
    if let Some((at, stage, p)) = &other {
        let source_pod = p.pod_uid == source_uid;
        eprintln!(
            "a fresh workload process (not a copy) first ran at sample {at} ({stage:?}): {p:?}, in the source pod: {source_pod}"
        );
    }
    assert_ne!(
        stage,
        Stage::Migrating,
        "the migration ended before the target restored: {st:?}"
    );
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        panic!("the fenced migration did not commit: {st:?}");
    }
    assert_eq!(stage, Stage::GateOpen, "committed before the gate opened");
    // The status's timestamps tell the same story (they are to the second, and
    // truncation keeps the order): in order, Restoring before the restored copy was
    // seen, Committing only once the gate had opened (the probe could pass), then
    // Succeeded.
    let ts = &st.phase_transition_timestamps;
    let phases: Vec<MigrationPhase> = ts.iter().map(|t| t.phase).collect();
    assert!(
        phases.ends_with(&[
            MigrationPhase::Restoring,
            MigrationPhase::Committing,
            MigrationPhase::Succeeded
        ]),
        "phases {phases:?}"
    );
    assert!(
        ts.windows(2).all(|w| w[0].time.0 <= w[1].time.0),
        "the phase timestamps go back: {ts:?}"
    );
    let at = |p: MigrationPhase| ts.iter().find(|t| t.phase == p).unwrap().time.0.as_second();
    let (seen, opened) = (restored_seen_at.unwrap(), gate_opened_at.unwrap());
    assert!(
        at(MigrationPhase::Restoring) <= seen.as_second(),
        "Restoring entered at {}s, after the restored copy was seen at {seen}",
        at(MigrationPhase::Restoring)
    );
    assert!(
        at(MigrationPhase::Committing) >= opened.as_second(),
        "Committing entered at {}s, before the gate opened at {opened}: the probe did not hold it",
        at(MigrationPhase::Committing)
    );

    // The target: adopted by the ReplicaSet, the only pod of the app, never restarted.
    let target_name = st.target_pod.clone().expect("status.targetPod");
    let left = wait_list(
        &pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "only the target pod left, Ready",
        |ps| ps.len() == 1 && ps[0].name_any() == target_name && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let target = &left[0];
    assert_eq!(node_of(target), target_node);
    assert_eq!(restart_count(target), 0);
    let owner = target
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
        .cloned()
        .expect("the target pod has a controller");
    assert_eq!(owner.kind, "ReplicaSet");
    let rs = app.api::<ReplicaSet>().get(&owner.name).await.unwrap();
    assert_eq!(rs.spec.replicas, Some(1));
    // One process runs: the restored one (the source pod's object goes before the
    // kubelet has stopped what its container restarted: waited for).
    let uids = [target.uid().unwrap(), source_uid.clone()];
    let mut procs = workload_processes(&uids);
    for _ in 0..300 {
        if procs.iter().filter(|p| p.runs()).count() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        procs = workload_processes(&uids);
    }
    let running: Vec<_> = procs.iter().filter(|p| p.runs()).collect();
    assert_eq!(running.len(), 1, "{procs:?}");
    assert_eq!(Some(running[0].pid), restored.as_ref().map(|r| r.pid));
    // Nor does any Event of the migration say the source was resumed.
    let events = app
        .api::<Event>()
        .list(&ListParams::default().fields("involvedObject.name=fenced"))
        .await
        .unwrap();
    for e in &events.items {
        let m = e.message.clone().unwrap_or_default();
        assert!(!says_resumed(&m), "an Event says resumed: {m:?}");
    }

    // The counter carried over, and never went back through the Service.
    let after = counter(&format!("{}:{}", pod_ip(target), testload::PORT));
    assert!(after > before, "the counter went from {before} to {after}");
    // Reads until one after the commit reached the moved copy.
    reader.finish_reaching(after, "the moved copy");
}

/// Seconds between entering Restoring and the next phase (the status's timestamps).
fn restoring_seconds(st: &PodMigrationStatus) -> Option<i64> {
    let ts = &st.phase_transition_timestamps;
    let i = ts
        .iter()
        .position(|t| t.phase == MigrationPhase::Restoring)?;
    let next = ts.get(i + 1)?;
    Some(next.time.0.as_second() - ts[i].time.0.as_second())
}
