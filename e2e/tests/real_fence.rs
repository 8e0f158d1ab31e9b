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

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::{Event, Pod, Service};
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, counter, node_of, pod_ip, restart_count,
};
use podmotion_e2e::real::{Images, entrypoint, helm_install, kubectl, output_text, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, wait_list,
};
use serde_json::json;

const APP: &str = "fenced";
/// The probe's port: nothing listens there until the gate opens.
const GATE_PORT: u16 = 9;

/// One testload server process (`serve`) found on the nodes, in a pod's cgroups.
#[derive(Clone, Debug, PartialEq)]
struct Proc {
    pid: u32,
    pod_uid: String,
    /// The state letter of /proc/<pid>/stat.
    state: char,
    /// Start time (clock ticks since boot): a pid reused by another process differs.
    start: u64,
}

impl Proc {
    /// Runs: not stopped (a frozen source is SIGSTOPped: `T`; `t` under ptrace, as CRIU
    /// holds it), not a zombie.
    fn runs(&self) -> bool {
        !matches!(self.state, 'T' | 't' | 'Z' | 'X')
    }
}

/// The testload server processes (port 8080) in the cgroups of the pods `pod_uids`
/// (cgroupfs writes the UID with dashes, the systemd driver with underscores). The
/// gate's listener runs in this test's cgroup, on another port: never counted.
fn workload_processes(pod_uids: &[String]) -> Vec<Proc> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let (Ok(cmd), Ok(cgroup), Ok(stat)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/cgroup")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
        ) else {
            continue;
        };
        let args: Vec<_> = cmd.split(|b| *b == 0).collect();
        if !(args.len() > 2 && args[1] == b"serve" && args[2] == b"8080") {
            continue;
        }
        let Some(uid) = pod_uids
            .iter()
            .find(|u| cgroup.contains(u.as_str()) || cgroup.contains(&u.replace('-', "_")))
        else {
            continue;
        };
        // "pid (comm) state ppid ..."; starttime is field 22.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let state = fields.first().and_then(|s| s.chars().next()).unwrap_or('?');
        let start = fields.get(19).and_then(|s| s.parse().ok()).unwrap_or(0);
        out.push(Proc {
            pid,
            pod_uid: uid.clone(),
            state,
            start,
        });
    }
    out
}

/// The copies of the workload's state among `procs` that run: the original source
/// process (`source`: same pid, same start) and the restored processes in the target
/// pod `target_uid`. (A container the kubelet restarts in the source pod after the
/// source's kill runs a fresh workload, not a copy: counted apart.)
fn running_copies(procs: &[Proc], source: &Proc, target_uid: Option<&str>) -> Vec<Proc> {
    procs
        .iter()
        .filter(|p| p.runs())
        .filter(|p| {
            (p.pid == source.pid && p.start == source.start)
                || Some(p.pod_uid.as_str()) == target_uid
        })
        .cloned()
        .collect()
}

/// Whether `text` says the source was resumed ("not resumed" does not).
fn says_resumed(text: &str) -> bool {
    text.replace("not resumed", "").contains("resumed")
}

/// Every text of a status a human reads: the failure message and the conditions'.
fn status_texts(st: &PodMigrationStatus) -> Vec<String> {
    let mut out: Vec<String> = st.failure_message.iter().cloned().collect();
    out.extend(st.conditions.iter().map(|c| c.message.clone()));
    out
}

/// Reads the counter through the Service on a thread, one new connection per read
/// (a frozen source answers late or never: short timeouts, failures counted, not
/// fatal), so a second copy serving an older counter shows as a jump back.
struct ServiceReader {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<u64>>>,
    failures: Arc<Mutex<usize>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ServiceReader {
    fn start(addr: String) -> ServiceReader {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(vec![]));
        let failures = Arc::new(Mutex::new(0));
        let (s, v, f) = (stop.clone(), seen.clone(), failures.clone());
        let thread = std::thread::spawn(move || {
            let sa = addr.parse().expect("ClusterIP:port");
            while !s.load(Ordering::SeqCst) {
                let read = (|| -> std::io::Result<u64> {
                    let c = TcpStream::connect_timeout(&sa, Duration::from_secs(2))?;
                    c.set_read_timeout(Some(Duration::from_secs(3)))?;
                    let mut w = c.try_clone()?;
                    writeln!(w, "get")?;
                    let mut line = String::new();
                    BufReader::new(c).read_line(&mut line)?;
                    line.trim()
                        .parse()
                        .map_err(|e| std::io::Error::other(format!("{line:?}: {e}")))
                })();
                match read {
                    Ok(n) => v.lock().unwrap().push(n),
                    Err(_) => *f.lock().unwrap() += 1,
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        ServiceReader {
            stop,
            seen,
            failures,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> (Vec<u64>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            t.join().expect("reader thread");
        }
        let seen = self.seen.lock().unwrap().clone();
        let failures = *self.failures.lock().unwrap();
        (seen, failures)
    }
}

impl Drop for ServiceReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The first place where `values` goes backwards, if any.
fn jump_back(values: &[u64]) -> Option<(usize, u64, u64)> {
    values
        .windows(2)
        .enumerate()
        .find(|(_, w)| w[1] < w[0])
        .map(|(i, w)| (i, w[0], w[1]))
}

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
    let Some(op) = TestNamespace::new("fence-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // The workload runs as uid 0: see docs/migration-controller.md, "Container user".
    let Some(app) = TestNamespace::new("fence-app", PodSecurity::Baseline).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let agents = format!("{}-agents", op.name);
    let _uninstall = helm_install(
        &format!("pm{}", random_suffix()),
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-fence",
        &[],
    );
    let testload_image = images.testload().unwrap();
    let testload_bin = entrypoint(&testload_image).unwrap_or_else(|e| panic!("{e:#}"));
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &testload::deployment(APP, &testload_image, 16),
        )
        .await
        .unwrap();
    let svc = app
        .api::<Service>()
        .create(&PostParams::default(), &testload::service(APP))
        .await
        .unwrap();
    let svc_addr = format!(
        "{}:{}",
        svc.spec.unwrap().cluster_ip.unwrap(),
        testload::PORT
    );
    let pods: Api<Pod> = app.api();
    let source = wait_list(
        &pods,
        &format!("app={APP}"),
        POD_TIMEOUT,
        "the replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    let source_uid = source.uid().unwrap();
    let source_node = node_of(&source);
    let target_node = nodes.iter().find(|n| **n != source_node).unwrap().clone();
    let before = counter(&format!("{}:{}", pod_ip(&source), testload::PORT));
    let found = workload_processes(std::slice::from_ref(&source_uid));
    assert_eq!(found.len(), 1, "one workload process in the source pod");
    let source_proc = found[0].clone();
    assert!(source_proc.runs(), "{source_proc:?}");

    let reader = ServiceReader::start(svc_addr.clone());
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
        let source_alive = procs
            .iter()
            .any(|p| p.pid == source_proc.pid && p.start == source_proc.start);
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
                    let victim = agent_pods.list(&on_source).await.unwrap().items;
                    assert_eq!(victim.len(), 1, "one agent pod on {source_node}");
                    let out = kubectl(&[
                        "-n",
                        &agents,
                        "delete",
                        "pod",
                        &victim[0].name_any(),
                        "--grace-period=0",
                        "--force",
                        "--wait=false",
                    ]);
                    assert!(out.status.success(), "{}", output_text(&out));
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
    for _ in 0..300 {
        if reader
            .seen
            .lock()
            .unwrap()
            .last()
            .is_some_and(|v| *v >= after)
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (values, failures) = reader.finish();
    eprintln!(
        "the Service gave {} counters ({failures} reads failed), {:?} .. {:?}",
        values.len(),
        values.first(),
        values.last()
    );
    if let Some((i, a, b)) = jump_back(&values) {
        panic!(
            "two copies served through the Service: read {i} saw {a}, read {} saw {b}",
            i + 1
        );
    }
    assert!(
        values.last().is_some_and(|v| *v >= after),
        "the Service never reached the moved copy: {:?}",
        values.last()
    );
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

#[test]
fn only_a_resume_that_is_not_denied_counts() {
    assert!(says_resumed("probe failed; the source pod was resumed"));
    assert!(!says_resumed(
        "the fenced source was killed on its node; the source was not resumed"
    ));
    assert!(!says_resumed("pod runs on node-b (downtime 180ms)"));
}

#[test]
fn a_stopped_source_beside_the_restored_copy_is_one_copy_and_a_thawed_one_two() {
    let source = Proc {
        pid: 10,
        pod_uid: "src".into(),
        state: 'T',
        start: 5,
    };
    let restored = Proc {
        pid: 20,
        pod_uid: "tgt".into(),
        state: 'S',
        start: 9,
    };
    let fresh = Proc {
        pid: 30,
        pod_uid: "src".into(),
        state: 'S',
        start: 12,
    };
    let frozen = [source.clone(), restored.clone(), fresh.clone()];
    assert_eq!(
        running_copies(&frozen, &source, Some("tgt")),
        vec![restored.clone()]
    );
    let thawed = Proc {
        state: 'S',
        ..source.clone()
    };
    assert_eq!(
        running_copies(&[thawed.clone(), restored.clone()], &source, Some("tgt")).len(),
        2
    );
    // A pid reused by another process is not the source.
    let reused = Proc {
        start: 99,
        ..thawed
    };
    assert_eq!(running_copies(&[reused], &source, Some("tgt")).len(), 0);
}
