//! PodMigration's rules on the real nodes, through the chart installed from our images
//! (issue 45): what `tests/migration.rs` proves with a shell stand-in agent on kwok
//! nodes, proven again with the real agents, CRIU and kubelets —
//!
//! * the deadline: a migration whose `deadlineSeconds` passes while its checkpoint
//!   streams ends `Aborted` with `DeadlineExceeded`, and the source, thawed, serves on
//!   (kwok: `a_migration_past_its_deadline_is_aborted_with_the_source_running`);
//! * concurrency: with `migration.maxPerNode=1` a second migration out of the same
//!   node waits `Pending` + `Reconciling/Queued`, unfrozen, until the first is done
//!   (one out of the other node runs meanwhile); with `migration.maxParallel=1` the
//!   same across nodes (kwok: `a_migration_over_the_parallel_limit_waits_queued_until_a_slot_frees`);
//! * a dry run: every check, `Succeeded`/`DryRunPassed`, and nothing frozen or made —
//!   the source's process is the same (pid and start time), never stopped, its
//!   container never restarted (kwok: `a_dry_run_checks_everything_and_freezes_nothing`);
//! * a `hostNetwork: true` pod is refused in `Pending` (`Stalled` and
//!   `Migratable=False`, `HostNamespaces`) before anything is frozen or made (kwok:
//!   `pods_that_must_never_move_are_refused_with_their_reason_before_anything_freezes`).
//!
//! Each test installs its own release (`real::helm_install`, through
//! `real::testload::World` where the workload namespace may be `baseline`). Needs the
//! cluster with two real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); without real nodes every test fails, unless
//! `PODMOTION_REAL_NODES=0` (refused under `CI`).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher::{self, Event};
use podmotion_api::PodMigration;
use podmotion_api::conditions::find;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_api::names::{condition_types as ct, reasons};
use podmotion_e2e::real::agents::no_checkpoint_files_left;
use podmotion_e2e::real::procs::{Proc, server_processes, workload_processes};
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter, ended, node_of, other_node,
    ready_replica, restart_count, source_serves_alone, target_pods_of,
};
use podmotion_e2e::real::{Images, helm_install, real_nodes};
use podmotion_e2e::{
    PodSecurity, TestNamespace, delete_and_wait, from_json, pod_running_ready, random_suffix,
    wait_for, wait_list,
};
use serde_json::{Value, json};

/// The only testload server process of pod `p` (its pid and start time tell a thawed
/// process from a restarted one).
fn server_process(p: &Pod) -> Proc {
    let procs = workload_processes(&[p.uid().unwrap()]);
    assert_eq!(
        procs.len(),
        1,
        "one server process in {}: {procs:?}",
        p.name_any()
    );
    procs[0].clone()
}

/// A PodMigration `name` of pod `pod` with `spec` added.
fn migration(name: &str, pod: &str, spec: Value) -> PodMigration {
    let mut s = json!({"podName": pod});
    for (k, v) in spec.as_object().unwrap() {
        s[k] = v.clone();
    }
    from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": s
    }))
}

/// A Cold move to `to` whose transfer is paced to 1 MiB/s (it lasts about a second per
/// MiB of the pod's ballast), with the freeze budget out of the way.
fn slow_move(to: &str) -> Value {
    json!({"targetNode": to, "mode": "Cold", "freezeBudgetMillis": 600000,
        "bandwidthLimitBytesPerSecond": 1048576,
        "probe": {"tcpSocket": {"port": testload::PORT}}})
}

/// An unpaced Cold move to `to`.
fn quick_move(to: &str) -> Value {
    json!({"targetNode": to, "mode": "Cold", "freezeBudgetMillis": 20000,
        "probe": {"tcpSocket": {"port": testload::PORT}}})
}

/// When the migration entered `phase`, if it did.
fn entered(st: &PodMigrationStatus, phase: MigrationPhase) -> Option<Time> {
    st.phase_transition_timestamps
        .iter()
        .find(|t| t.phase == phase)
        .map(|t| t.time.clone())
}

/// The condition `type_`'s (status, reason), if set.
fn condition(st: &PodMigrationStatus, type_: &str) -> Option<(String, String)> {
    find(&st.conditions, type_).map(|c| (c.status.clone(), c.reason.clone()))
}

/// Records the name of every pod the namespace ever shows while it runs: a target pod
/// made and removed between two reads is still seen.
struct PodsSeen {
    names: Arc<Mutex<BTreeSet<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PodsSeen {
    async fn start(pods: Api<Pod>) -> PodsSeen {
        let names = Arc::new(Mutex::new(BTreeSet::new()));
        let seen = names.clone();
        let (synced, ready) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut synced = Some(synced);
            let mut stream = watcher::watcher(pods, watcher::Config::default()).boxed();
            while let Ok(Some(ev)) = stream.try_next().await {
                match ev {
                    Event::Apply(p) | Event::InitApply(p) => {
                        seen.lock().unwrap().insert(p.name_any());
                    }
                    Event::InitDone => {
                        if let Some(s) = synced.take() {
                            let _ = s.send(());
                        }
                    }
                    _ => {}
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .expect("the pod watch listed in time")
            .expect("the pod watch runs");
        PodsSeen { names, task }
    }

    /// Every pod name seen so far.
    fn finish(self) -> BTreeSet<String> {
        self.task.abort();
        self.names.lock().unwrap().clone()
    }
}

/// Samples the state letter of process `pid` every 5 ms on a thread, so that a stop
/// (SIGSTOP: `T`; a ptrace stop, as CRIU holds a task while it dumps: `t`) that a
/// later look would miss is seen.
struct StateSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, BTreeSet<char>)>,
}

impl StateSampler {
    fn start(pid: u32) -> StateSampler {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut samples, mut states) = (0, BTreeSet::new());
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                if let Some(state) = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.trim_start().chars().next())
                {
                    states.insert(state);
                    samples += 1;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (samples, states)
        });
        StateSampler { stop, thread }
    }

    /// How many samples were taken, and every state seen.
    fn finish(self) -> (usize, BTreeSet<char>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the sampler")
    }
}

/// A migration whose deadline passes while its checkpoint streams (96 MiB at 1 MiB/s
/// against a 30 s deadline) ends `Aborted` with `DeadlineExceeded`, after it had
/// reached `Transferring` with the source stopped (its state sampled every 5 ms); the
/// source — the same process, thawed, never restarted — serves its counter on, a
/// connection it held before the freeze still answers, no target pod is left, and no
/// checkpoint image stays on either node.
#[tokio::test]
async fn a_migration_past_its_deadline_is_aborted_and_the_source_serves_on() {
    let Some(w) = World::new("mig-deadline", "late", 96, &[]).await else {
        return;
    };
    let pods: Api<Pod> = w.app.api();
    let pms: Api<PodMigration> = w.app.api();
    let before_proc = server_process(&w.source);
    let mut held = TcpStream::connect(addr(&w.source)).unwrap();
    held.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut held_reader = BufReader::new(held.try_clone().unwrap());
    let mut line = String::new();
    writeln!(held, "get").unwrap();
    held_reader.read_line(&mut line).unwrap();
    let before: u64 = line.trim().parse().unwrap();

    let states = StateSampler::start(before_proc.pid);
    let mut spec = slow_move(&w.target_node());
    spec["deadlineSeconds"] = json!(30);
    spec["progressTimeoutSeconds"] = json!(300);
    pms.create(
        &PostParams::default(),
        &migration("late", &w.source.name_any(), spec),
    )
    .await
    .unwrap();
    let st = ended(&pms, "late").await;
    let (samples, seen) = states.finish();
    assert_eq!(st.phase, MigrationPhase::Aborted, "{st:?}");
    assert_eq!(
        st.failure_reason.as_deref(),
        Some(reasons::DEADLINE_EXCEEDED),
        "{st:?}"
    );
    // The deadline struck mid-flight, with the source frozen: not before the start.
    assert!(
        entered(&st, MigrationPhase::Transferring).is_some(),
        "the migration never reached Transferring: the deadline proved nothing: {st:?}"
    );
    assert!(
        entered(&st, MigrationPhase::Restoring).is_none(),
        "the transfer finished before the deadline: {st:?}"
    );

    // Frozen when the deadline struck (CRIU leaves it stopped from the dump on).
    assert!(
        seen.iter().any(|s| matches!(s, 'T' | 't')),
        "the source was never seen stopped: states {seen:?} in {samples} samples"
    );
    source_serves_alone(&pods, "late", &w.source, before, "after the deadline").await;
    let now = server_process(&w.source);
    assert!(
        now.same(&before_proc) && now.runs(),
        "the source's process was not thawed in place: {before_proc:?} then {now:?}"
    );
    // The connection the source held before its freeze is still its own.
    writeln!(held, "get").unwrap();
    line.clear();
    held_reader.read_line(&mut line).unwrap();
    let held_after: u64 = line
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("the held connection after the abort: {line:?}: {e}"));
    assert!(held_after > before, "{held_after} <= {before}");
    no_checkpoint_files_left(
        "after the deadline",
        &w.op.client,
        &w.agents(),
        w.nodes.len(),
    )
    .await;
}

/// A dry run runs every check and ends `Succeeded` with `Ready`/`DryRunPassed` and
/// `Migratable=True`, the target it would use in its status, and does nothing: no
/// target pod ever appears, no transfer key is made, no freeze is recorded, no
/// downtime; the source's server is the same process (pid and start time), never seen
/// stopped while the dry run ran (its state sampled every 5 ms), its container never
/// restarted, and it serves on.
#[tokio::test]
async fn a_dry_run_checks_everything_and_freezes_nothing() {
    let Some(w) = World::new("mig-dry", "dry", 16, &[]).await else {
        return;
    };
    let pods: Api<Pod> = w.app.api();
    let pms: Api<PodMigration> = w.app.api();
    let before_proc = server_process(&w.source);
    let before = counter(&addr(&w.source));
    let seen = PodsSeen::start(pods.clone()).await;
    let states = StateSampler::start(before_proc.pid);
    let target = w.target_node();
    let spec = json!({"targetNode": target, "mode": "Cold", "dryRun": true,
        "probe": {"tcpSocket": {"port": testload::PORT}}});
    pms.create(
        &PostParams::default(),
        &migration("rehearsal", &w.source.name_any(), spec),
    )
    .await
    .unwrap();
    let st = ended(&pms, "rehearsal").await;
    let (samples, states) = states.finish();
    assert!(samples > 0, "the source's state was never sampled");
    assert!(
        !states.iter().any(|s| matches!(s, 'T' | 't')),
        "the source's process was stopped during the dry run: states {states:?} in {samples} samples"
    );
    assert_eq!(st.phase, MigrationPhase::Succeeded, "{st:?}");
    assert_eq!(
        condition(&st, ct::READY),
        Some(("True".into(), reasons::DRY_RUN_PASSED.into())),
        "{st:?}"
    );
    assert_eq!(
        condition(&st, ct::MIGRATABLE).map(|c| c.0),
        Some("True".into()),
        "{st:?}"
    );
    // The checks ran against the real nodes: the target it would use is named.
    assert_eq!(st.target_node.as_deref(), Some(target.as_str()), "{st:?}");
    assert!(
        st.target_pod.is_none() && st.downtime_millis.is_none(),
        "{st:?}"
    );
    assert!(
        st.freezes.is_empty() && st.total_frozen_millis.unwrap_or(0) == 0,
        "a dry run froze the pod: {st:?}"
    );
    assert_eq!(
        st.source_node.as_deref(),
        Some(node_of(&w.source).as_str()),
        "{st:?}"
    );
    for phase in [
        MigrationPhase::Preparing,
        MigrationPhase::Checkpointing,
        MigrationPhase::Transferring,
        MigrationPhase::Restoring,
    ] {
        assert!(entered(&st, phase).is_none(), "{phase:?} entered: {st:?}");
    }
    let names = seen.finish();
    let made: Vec<&String> = names
        .iter()
        .filter(|n| **n != w.source.name_any())
        .collect();
    assert!(made.is_empty(), "pods made during the dry run: {made:?}");
    let secrets: Api<Secret> = w.app.api();
    assert!(
        secrets
            .get_opt("rehearsal-transfer-key")
            .await
            .unwrap()
            .is_none(),
        "a transfer key was made"
    );
    let now = server_process(&w.source);
    assert!(
        now.same(&before_proc) && now.runs(),
        "the source's process changed or is stopped: {before_proc:?} then {now:?}"
    );
    let pod = pods.get(&w.source.name_any()).await.unwrap();
    assert_eq!(restart_count(&pod), 0, "the source's container restarted");
    assert!(pod_running_ready(&pod) && pod.metadata.deletion_timestamp.is_none());
    let after = counter(&addr(&pod));
    assert!(
        after > before,
        "the source serves on: {before} then {after}"
    );
}

/// A Running, Ready `hostNetwork: true` pod of a Deployment on a real node: its
/// migration is refused in `Pending` — `Stalled` and `Migratable=False` with
/// `HostNamespaces`, the message naming `hostNetwork` — and stays there; no target pod
/// ever appears, the pod's server is the same process, never seen stopped, never
/// restarted, and serves on; deleting the migration leaves the pod as it was.
#[tokio::test]
async fn a_host_network_pod_is_refused_in_pending_before_anything_freezes() {
    let Some(op) = TestNamespace::new("mig-hostnet-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    // hostNetwork is forbidden below the privileged level.
    let Some(app) = TestNamespace::new("mig-hostnet", PodSecurity::Privileged).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let _uninstall = helm_install(
        &format!("pm{}", random_suffix()),
        &images,
        &op.name,
        &app.name,
        "podmotion-e2e-mig-hostnet",
        &[],
    );
    let port = testload::random_host_port();
    let edge = testload::deployment("edge", &images.testload().unwrap(), 1);
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &testload::on_host_network(edge, port),
        )
        .await
        .unwrap();
    let pods: Api<Pod> = app.api();
    let source = wait_list(&pods, "app=edge", POD_TIMEOUT, "the replica Ready", |ps| {
        ps.len() == 1 && pod_running_ready(&ps[0])
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    assert_eq!(source.spec.as_ref().unwrap().host_network, Some(true));
    let host_addr = format!("{}:{port}", testload::pod_ip(&source));
    let before = counter(&host_addr);
    let before_proc = host_server_process(&source, port);

    let seen = PodsSeen::start(pods.clone()).await;
    let states = StateSampler::start(before_proc.pid);
    let pms: Api<PodMigration> = app.api();
    let spec = json!({"targetNode": other_node(&nodes, &source), "mode": "Cold",
        "freezeBudgetMillis": 20000});
    pms.create(
        &PostParams::default(),
        &migration("edge", &source.name_any(), spec),
    )
    .await
    .unwrap();
    let refused = |m: Option<&PodMigration>| {
        m.and_then(|m| m.status.as_ref()).is_some_and(|st| {
            st.phase == MigrationPhase::Pending
                && condition(st, ct::STALLED)
                    == Some(("True".into(), reasons::HOST_NAMESPACES.into()))
                && condition(st, ct::MIGRATABLE)
                    == Some(("False".into(), reasons::HOST_NAMESPACES.into()))
        })
    };
    let st = wait_for(&pms, "edge", POD_TIMEOUT, "refused HostNamespaces", refused)
        .await
        .unwrap_or_else(|e| panic!("{e:#}"))
        .and_then(|m| m.status)
        .unwrap();
    let message = &find(&st.conditions, ct::MIGRATABLE).unwrap().message;
    assert!(message.contains("hostNetwork"), "{message}");
    // Refused is final: a few reconciles later it is still Pending, nothing started.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let now = pms.get("edge").await.unwrap();
    assert!(refused(Some(&now)), "{:?}", now.status);
    let st = now.status.unwrap();
    assert!(
        st.phase_transition_timestamps
            .iter()
            .all(|t| t.phase == MigrationPhase::Pending),
        "{st:?}"
    );
    assert!(st.target_pod.is_none(), "{st:?}");

    delete_and_wait(&pms, "edge", &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    let names = seen.finish();
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        vec![source.name_any()],
        "only the source pod ever existed"
    );
    let (samples, states) = states.finish();
    assert!(
        samples > 0 && !states.iter().any(|s| matches!(s, 'T' | 't')),
        "the pod's process was stopped: states {states:?} in {samples} samples"
    );
    let now = pods.get(&source.name_any()).await.unwrap();
    assert_eq!(now.uid(), source.uid());
    assert_eq!(restart_count(&now), 0, "the pod's container restarted");
    assert!(pod_running_ready(&now));
    let now_proc = host_server_process(&now, port);
    assert!(
        now_proc.same(&before_proc) && now_proc.runs(),
        "{before_proc:?} then {now_proc:?}"
    );
    let after = counter(&host_addr);
    assert!(after > before, "the pod serves on: {before} then {after}");
}

/// The testload server process of the host-network pod `p`, serving on `port`.
fn host_server_process(p: &Pod, port: u16) -> Proc {
    let procs = server_processes(&[p.uid().unwrap()], port);
    assert_eq!(procs.len(), 1, "one server on port {port}: {procs:?}");
    procs[0].clone()
}

/// One more testload replica `name` (1 MiB of ballast) on real node `node`; the pod,
/// once Ready. Placed by a preferred node affinity: a required one (or a nodeSelector)
/// would rightly keep it from moving (`TargetDoesNotFit`).
async fn replica_on(w: &World, name: &str, node: &str) -> Pod {
    let mut d =
        serde_json::to_value(testload::deployment(name, &w.images.testload().unwrap(), 1)).unwrap();
    d["spec"]["template"]["spec"]["affinity"] = json!({"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "preference": {
            "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In",
                                  "values": [node]}]}}]}});
    w.app
        .api::<Deployment>()
        .create(&PostParams::default(), &from_json(d))
        .await
        .unwrap();
    let p = ready_replica(&w.app.api::<Pod>(), name).await;
    assert_eq!(node_of(&p), node, "{name}");
    p
}

/// Waits until migration `name` has left `Pending` (or ended); its status.
async fn started(pms: &Api<PodMigration>, name: &str) -> PodMigrationStatus {
    wait_for(pms, name, MIGRATION_TIMEOUT, "past Pending", |m| {
        m.and_then(|m| m.status.as_ref())
            .is_some_and(|s| s.phase != MigrationPhase::Pending)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .and_then(|m| m.status)
    .unwrap()
}

/// Migration `queued` is `Pending` with `Reconciling/Queued` while `running` has not
/// ended: nothing of it started — its source pod has no target pod and its server
/// process runs, unfrozen.
async fn waits_queued_behind(w: &World, queued: &str, source: &Pod, running: &str) {
    let pms: Api<PodMigration> = w.app.api();
    let is_queued = |st: &PodMigrationStatus| {
        st.phase == MigrationPhase::Pending
            && condition(st, ct::RECONCILING) == Some(("True".into(), reasons::QUEUED.into()))
    };
    // Queued, or started anyway (then it fails at once, not at the timeout).
    let st = wait_for(&pms, queued, MIGRATION_TIMEOUT, "Queued", |m| {
        m.and_then(|m| m.status.as_ref())
            .is_some_and(|st| is_queued(st) || st.phase != MigrationPhase::Pending)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))
    .and_then(|m| m.status)
    .unwrap();
    assert!(is_queued(&st), "{queued} was not held by the limit: {st:?}");
    let first = pms.get(running).await.unwrap().status.unwrap();
    assert!(
        !first.phase.is_terminal(),
        "{running} ended before {queued} was seen queued: the limit was not tested: {first:?}"
    );
    // Queued, not refused: it passed its checks and waits for the slot alone.
    assert_eq!(
        condition(&st, ct::MIGRATABLE).map(|c| c.0),
        Some("True".into()),
        "{st:?}"
    );
    assert!(
        st.target_pod.is_none()
            && st
                .phase_transition_timestamps
                .iter()
                .all(|t| t.phase == MigrationPhase::Pending),
        "{queued} started while queued: {st:?}"
    );
    let all = w.app.api::<Pod>().list(&Default::default()).await.unwrap();
    assert!(
        target_pods_of(&all.items, &source.name_any()).is_empty(),
        "{queued} made a target pod while queued"
    );
    let proc = server_process(source);
    assert!(
        proc.runs(),
        "{queued}'s source is stopped while queued: {proc:?}"
    );
}

/// Both migrations ended `Succeeded`, and `second` left `Pending` only once `first` had
/// ended (the operator's own timestamps).
async fn ran_after(pms: &Api<PodMigration>, first: &str, second: &str) {
    let a = ended(pms, first).await;
    let b = ended(pms, second).await;
    assert_eq!(a.phase, MigrationPhase::Succeeded, "{first}: {a:?}");
    assert_eq!(b.phase, MigrationPhase::Succeeded, "{second}: {b:?}");
    let a_end = entered(&a, MigrationPhase::Succeeded).unwrap();
    let b_start = entered(&b, MigrationPhase::Preparing).unwrap();
    assert!(
        b_start.0 >= a_end.0,
        "{second} started ({b_start:?}) before {first} ended ({a_end:?})"
    );
}

/// With `migration.maxPerNode=1`: while a slow migration moves a pod out of node A, a
/// second migration out of A waits `Pending` + `Reconciling/Queued` (nothing of it
/// frozen or made), and one out of node B runs at once; once the first has ended the
/// second runs, and all three succeed.
#[tokio::test]
async fn with_one_slot_per_node_a_second_migration_out_of_the_node_waits_queued() {
    let extra = ["--set", "migration.maxPerNode=1"];
    let Some(w) = World::new("mig-per-node", "first", 32, &extra).await else {
        return;
    };
    let (a, b) = (node_of(&w.source), w.target_node());
    let second = replica_on(&w, "second", &a).await;
    let other = replica_on(&w, "other", &b).await;
    let pms: Api<PodMigration> = w.app.api();
    let pp = PostParams::default();
    pms.create(
        &pp,
        &migration("move-first", &w.source.name_any(), slow_move(&b)),
    )
    .await
    .unwrap();
    let st = started(&pms, "move-first").await;
    assert!(!st.phase.is_terminal(), "move-first ended at once: {st:?}");
    let quick = quick_move(&b);
    pms.create(&pp, &migration("move-second", &second.name_any(), quick))
        .await
        .unwrap();
    waits_queued_behind(&w, "move-second", &second, "move-first").await;

    // Out of the other node: not held by node A's slot.
    let quick = quick_move(&a);
    pms.create(&pp, &migration("move-other", &other.name_any(), quick))
        .await
        .unwrap();
    let st = started(&pms, "move-other").await;
    let first = pms.get("move-first").await.unwrap().status.unwrap();
    assert!(
        !first.phase.is_terminal(),
        "move-first ended before move-other started ({st:?}): nothing was shown"
    );
    let done = ended(&pms, "move-other").await;
    assert_eq!(done.phase, MigrationPhase::Succeeded, "{done:?}");
    let first = ended(&pms, "move-first").await;
    assert!(
        entered(&done, MigrationPhase::Preparing).unwrap().0
            < entered(&first, MigrationPhase::Succeeded).unwrap().0,
        "move-other waited for move-first: {done:?} / {first:?}"
    );
    ran_after(&pms, "move-first", "move-second").await;
}

/// With `migration.maxParallel=1`: while a slow migration moves a pod out of node A, a
/// migration out of node B waits `Pending` + `Reconciling/Queued` (nothing of it frozen
/// or made); once the first has ended it runs, and both succeed.
#[tokio::test]
async fn with_one_slot_in_the_cluster_a_migration_out_of_another_node_waits_queued() {
    let extra = ["--set", "migration.maxParallel=1"];
    let Some(w) = World::new("mig-parallel", "first", 32, &extra).await else {
        return;
    };
    let (a, b) = (node_of(&w.source), w.target_node());
    let second = replica_on(&w, "second", &b).await;
    let pms: Api<PodMigration> = w.app.api();
    let pp = PostParams::default();
    pms.create(
        &pp,
        &migration("move-first", &w.source.name_any(), slow_move(&b)),
    )
    .await
    .unwrap();
    let st = started(&pms, "move-first").await;
    assert!(!st.phase.is_terminal(), "move-first ended at once: {st:?}");
    let quick = quick_move(&a);
    pms.create(&pp, &migration("move-second", &second.name_any(), quick))
        .await
        .unwrap();
    waits_queued_behind(&w, "move-second", &second, "move-first").await;
    ran_after(&pms, "move-first", "move-second").await;
    no_checkpoint_files_left("after both moves", &w.op.client, &w.agents(), w.nodes.len()).await;
}
