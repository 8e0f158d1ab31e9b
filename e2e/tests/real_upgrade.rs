//! Issue 43: an upgrade does not break what runs. On the real nodes, through the chart
//! installed from our images, with a testload replica (64 MiB of ballast) moving between
//! the two real nodes:
//!
//! 1. **The operator upgraded in flight.** A Cold PodMigration limited to 8 MiB/s (about
//!    8 s of transfer, the source frozen) is under way when `helm upgrade` to the next
//!    build starts, with `migrationAgent.updateStrategy.type=OnDelete`: the operator's
//!    Deployment rolls (a new leader takes the migration over), the agents stay. The
//!    migration ends Succeeded, or rolled back with the source serving alone.
//! 2. **Two agent versions together.** The agent pod of the replica's node is deleted,
//!    so that node runs the next build's agent while the other still runs the installed
//!    one: a migration from the upgraded node to the other, and one back, both succeed.
//! 3. **The agents upgraded in flight.** A second `helm upgrade`, to a third build with
//!    the chart's default strategy (RollingUpdate), starts while another limited
//!    migration is frozen in its transfer: both agents roll, the migration ends
//!    Succeeded or rolled back with the source serving alone, and once the rollout is
//!    done a migration succeeds.
//!
//! Sampled every 200 ms through every migration: never two running copies of the state.
//! Each move carries the counter on.
//!
//! **What the builds are.** "The next build" is compiled from this tree with the
//! workspace's and the chart's versions bumped to 0.1.1 (a `git worktree` of HEAD,
//! `hack/images.sh operator agent broker`): other binaries, new digests, a new chart.
//! The test checks that the upgraded node's agent says it is 0.1.1 and the other one
//! 0.1.0, so step 2 moves pods between two builds of the agent. The code of the two
//! builds differs in its version only; that agents with other changes interoperate rests
//! on the wire contract (`executors/wire/tests/proto_contract.rs`: the proto only grows,
//! older encodings decode) and on the transfer's sealing label naming its scheme, not
//! the release (`executors/wire/src/transfer.rs`). "The third build" is the next one's
//! images with their `org.opencontainers.image.version` label set to 0.1.2 (rebuilt by
//! buildah: new digests, so the pods are replaced as by a release) and its chart's
//! version bumped: a rollout, not a third compile.
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationPhase, PodMigrationStatus};
use podmotion_e2e::real::copies::sample;
use podmotion_e2e::real::procs::workload_processes;
use podmotion_e2e::real::testload::{
    self, MIGRATION_TIMEOUT, POD_TIMEOUT, World, addr, counter, counter_when_reachable, node_of,
    other_node, restart_count, source_serves_alone,
};
use podmotion_e2e::real::{Images, chart_args, helm, output_text};
use podmotion_e2e::{
    from_json, pod_running_ready, random_suffix, repo_root, wait_list, without_crate_env,
};
use serde_json::json;

const APP: &str = "upgraded";
/// The images a build replaces in an upgrade, by their name in the values file.
const REPLACED: [&str; 3] = ["operator", "agent", "broker"];
const AGENT_PODS: &str = "app.kubernetes.io/component=migration-agent";

/// A build to upgrade to (see the module's doc): its chart and values.
struct NextBuild {
    dir: PathBuf,
    /// The git worktree it was compiled from, if it was.
    worktree: Option<PathBuf>,
    chart: PathBuf,
    values: PathBuf,
    /// The new image references, by name.
    refs: BTreeMap<&'static str, String>,
}

impl Drop for NextBuild {
    fn drop(&mut self) {
        if let Some(wt) = &self.worktree {
            let _ = Command::new("git")
                .current_dir(repo_root())
                .args(["worktree", "remove", "--force"])
                .arg(wt)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `text` with the first `key: …` line of YAML (or `key = "…"` of TOML) set to `version`.
fn bump(text: &str, key: &str, value: &str) -> String {
    let mut done = false;
    let out: String = text
        .lines()
        .map(|l| {
            let hit =
                !done && (l.starts_with(&format!("{key}:")) || l.starts_with(&format!("{key} =")));
            done |= hit;
            match l {
                _ if hit && l.contains(':') => format!("{key}: {value}\n"),
                _ if hit => format!("{key} = {value}\n"),
                l => format!("{l}\n"),
            }
        })
        .collect();
    assert!(done, "no {key} to bump in {text:.200}");
    out
}

fn bump_file(path: &std::path::Path, keys: &[(&str, &str)]) {
    let mut text = std::fs::read_to_string(path).unwrap();
    for (k, v) in keys {
        text = bump(&text, k, v);
    }
    std::fs::write(path, text).unwrap();
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(out.status.success(), "{what}: {}", output_text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl NextBuild {
    /// Compiles this tree with the workspace's and the chart's versions set to `version`
    /// (a worktree of HEAD) and pushes its operator, agent and broker images; the other
    /// images stay the installed ones.
    fn from_source(images: &Images, version: &str) -> NextBuild {
        let dir = std::env::temp_dir().join(format!("pm-upgrade-{}", random_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let wt = dir.join("tree");
        run(
            Command::new("git")
                .current_dir(repo_root())
                .args(["worktree", "add", "--detach", "--quiet"])
                .arg(&wt)
                .arg("HEAD"),
            "git worktree add",
        );
        let quoted = format!("\"{version}\"");
        bump_file(&wt.join("Cargo.toml"), &[("version", &quoted)]);
        bump_file(
            &wt.join("charts/podmotion/Chart.yaml"),
            &[("version", version), ("appVersion", &quoted)],
        );
        run(
            without_crate_env(&mut Command::new("cargo"))
                .current_dir(&wt)
                .args(["update", "--workspace", "--offline", "--quiet"]),
            "cargo update --workspace (the lock file's own versions)",
        );
        let started = Instant::now();
        // Without this test's own cargo variables: left set, ring's build script would
        // run again and everything above it compile again, here and in the next build
        // of the original (`without_crate_env`).
        let mut build = Command::new("bash");
        without_crate_env(&mut build)
            .current_dir(&wt)
            .args(["hack/images.sh"])
            .args(REPLACED)
            // Built at the same fixed path as the original (hack/images.sh,
            // build_rust): the dependencies compiled for the installed images are
            // reused, only the workspace's crates compile.
            .env("PODMOTION_RUN", dir.join("run"));
        let lines = run(&mut build, "hack/images.sh in the bumped worktree");
        eprintln!(
            "[upgrade] built {version} from source in {:.0?}",
            started.elapsed()
        );
        let mut values = std::fs::read_to_string(&images.path).unwrap();
        let mut refs = BTreeMap::new();
        for name in REPLACED {
            let old = installed(images, name);
            let (repo, _) = old.split_once('@').expect("a pinned image");
            let new = lines
                .lines()
                .find(|l| l.starts_with(&format!("{repo}@")))
                .unwrap_or_else(|| panic!("hack/images.sh printed no {repo}: {lines}"));
            let digest = new.split_once('@').unwrap().1;
            repin(&mut values, &mut refs, name, &old, digest);
        }
        let values_path = dir.join("values.yaml");
        std::fs::write(&values_path, values).unwrap();
        NextBuild {
            chart: wt.join("charts/podmotion"),
            worktree: Some(wt),
            dir,
            values: values_path,
            refs,
        }
    }

    /// `base`'s operator, agent and broker images relabelled `version` by buildah (new
    /// digests, same binaries), with a copy of `base`'s chart bumped to `version`.
    fn relabel(base: &NextBuild, version: &str) -> NextBuild {
        let dir = std::env::temp_dir().join(format!("pm-upgrade-{}", random_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let buildah = |args: &[&str]| {
            let mut c = Command::new("buildah");
            c.arg("--root")
                .arg(dir.join("root"))
                .arg("--runroot")
                .arg(dir.join("runroot"))
                .args(["--storage-driver", "vfs"])
                .args(args);
            c
        };
        let mut values = std::fs::read_to_string(&base.values).unwrap();
        let mut refs = BTreeMap::new();
        for name in REPLACED {
            let old = &base.refs[name];
            let (repo, _) = old.split_once('@').expect("a pinned image");
            let ctr = format!("next-{name}");
            let local = format!("localhost/{ctr}:{version}");
            let from = format!("docker://{old}");
            run(
                &mut buildah(&[
                    "from",
                    "--quiet",
                    "--tls-verify=false",
                    "--name",
                    &ctr,
                    &from,
                ]),
                &format!("buildah from {old}"),
            );
            let label = format!("org.opencontainers.image.version={version}");
            run(
                &mut buildah(&["config", "--label", &label, &ctr]),
                "buildah config",
            );
            run(
                &mut buildah(&["commit", "--quiet", "--format", "oci", &ctr, &local]),
                "buildah commit",
            );
            let digest_file = dir.join(format!("{name}.digest"));
            let dest = format!("docker://{repo}:{version}");
            run(
                buildah(&["push", "--quiet", "--tls-verify=false", "--digestfile"])
                    .arg(&digest_file)
                    .args([&local, &dest]),
                &format!("buildah push {dest}"),
            );
            let digest = std::fs::read_to_string(&digest_file)
                .unwrap()
                .trim()
                .to_owned();
            repin(&mut values, &mut refs, name, old, &digest);
        }
        let values_path = dir.join("values.yaml");
        std::fs::write(&values_path, values).unwrap();
        let chart = dir.join("podmotion");
        run(
            Command::new("cp").arg("-RL").arg(&base.chart).arg(&chart),
            "copying the chart",
        );
        let quoted = format!("\"{version}\"");
        bump_file(
            &chart.join("Chart.yaml"),
            &[("version", version), ("appVersion", &quoted)],
        );
        NextBuild {
            dir,
            worktree: None,
            chart,
            values: values_path,
            refs,
        }
    }

    /// `helm upgrade` arguments that take the world's release to this build, with
    /// `extra` ones.
    fn upgrade_args(&self, w: &World, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["upgrade".to_owned(), w.release().to_owned()];
        let mut rest = chart_args(&w.images, &w.op.name, &w.app.name, "podmotion-e2e-upgrade");
        rest[0] = self.chart.to_string_lossy().into_owned();
        args.extend(rest);
        args.extend([
            "--values".to_owned(),
            self.values.to_string_lossy().into_owned(),
        ]);
        args.extend(extra.iter().map(|a| a.to_string()));
        args.extend(["--timeout", "5m"].map(String::from));
        args
    }

    /// A call that starts `helm upgrade` to this build (on a thread: it waits for the
    /// rollout) and keeps its handle in `slot`.
    fn starter(&self, w: &World, extra: &[&str], slot: &Upgrade) -> Box<dyn FnOnce() + Send> {
        let (args, slot) = (self.upgrade_args(w, extra), slot.clone());
        Box::new(move || {
            let handle = std::thread::spawn(move || {
                let out = helm(&args.iter().map(String::as_str).collect::<Vec<_>>());
                assert!(out.status.success(), "helm upgrade: {}", output_text(&out));
            });
            *slot.lock().unwrap() = Some(handle);
        })
    }
}

/// Re-pins image `name` in `values` from `old` (`repo@digest`) to `digest` of the same
/// repository, and records the new reference in `refs`; the digest must be new.
fn repin(
    values: &mut String,
    refs: &mut BTreeMap<&'static str, String>,
    name: &'static str,
    old: &str,
    digest: &str,
) {
    let (repo, old_digest) = old.split_once('@').expect("a pinned image");
    assert_ne!(digest, old_digest, "{name}: the new build has a new digest");
    assert_eq!(
        values.matches(old_digest).count(),
        1,
        "{name}'s digest in the values"
    );
    *values = values.replace(old_digest, digest);
    refs.insert(name, format!("{repo}@{digest}"));
}

/// The installed image `name` (one of [`REPLACED`]).
fn installed(images: &Images, name: &str) -> String {
    match name {
        "operator" => images.operator(),
        "agent" => images.agent(),
        _ => images.broker(),
    }
    .unwrap()
}

/// The version an agent pod says it is, from its "agent serving" log line.
async fn agent_version(agents: &Api<Pod>, pod: &str) -> String {
    let only_agent = kube::api::LogParams {
        container: Some("agent".into()),
        ..Default::default()
    };
    let log = agents
        .logs(pod, &only_agent)
        .await
        .unwrap_or_else(|e| panic!("logs of agent {pod}: {e}"));
    log.lines()
        .filter(|l| l.contains("agent serving"))
        .find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            v.pointer("/version")
                .or_else(|| v.pointer("/fields/version"))
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("agent {pod} logged no version: {log:.2000}"))
}

/// The chart (`podmotion-<version>`) the world's release was last upgraded to.
fn release_chart(w: &World) -> String {
    let out = helm(&["list", "-n", &w.op.name, "-o", "json"]);
    assert!(out.status.success(), "helm list: {}", output_text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    list.as_array()
        .into_iter()
        .flatten()
        .find(|r| r["name"] == w.release())
        .and_then(|r| r["chart"].as_str())
        .unwrap_or_else(|| panic!("release {} not listed: {list}", w.release()))
        .to_owned()
}

/// Where a `helm upgrade` started in flight keeps its thread.
type Upgrade = std::sync::Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>;

/// Waits for the upgrade started in `slot` to finish; fails if it was never started or
/// failed.
fn upgraded(slot: &Upgrade, what: &str) {
    let handle = slot.lock().unwrap().take();
    handle
        .unwrap_or_else(|| panic!("{what}: the upgrade never started"))
        .join()
        .unwrap_or_else(|_| panic!("{what}: the upgrade failed"));
}

/// The image of container `container` of each Ready pod matching `selector` in `ns`, by
/// node, once there is exactly one such pod per node in `nodes` and `ok` holds for
/// their images.
async fn images_by_node(
    client: &kube::Client,
    ns: &str,
    selector: &str,
    container: &str,
    nodes: &[String],
    what: &str,
    ok: impl Fn(&BTreeMap<String, String>) -> bool,
) -> BTreeMap<String, String> {
    let by_node = |ps: &[Pod]| -> BTreeMap<String, String> {
        ps.iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && pod_running_ready(p))
            .filter(|p| nodes.contains(&node_of(p)))
            .map(|p| {
                let spec = p.spec.as_ref().unwrap();
                let c = spec.containers.iter().find(|c| c.name == container);
                (
                    node_of(p),
                    c.and_then(|c| c.image.clone()).unwrap_or_default(),
                )
            })
            .collect()
    };
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let ps = wait_list(&api, selector, POD_TIMEOUT, what, |ps| {
        let m = by_node(ps);
        m.len() == nodes.len() && ok(&m)
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    by_node(&ps)
}

/// A Cold PodMigration of `source` to `to`, limited to `rate` bytes/s when given.
async fn start(pms: &Api<PodMigration>, name: &str, source: &Pod, to: &str, rate: Option<i64>) {
    let mut spec = json!({"podName": source.name_any(), "targetNode": to, "mode": "Cold",
        "freezeBudgetMillis": 60000,
        "probe": {"tcpSocket": {"port": testload::PORT}}});
    if let Some(rate) = rate {
        spec["bandwidthLimitBytesPerSecond"] = json!(rate);
    }
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": name}, "spec": spec
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
}

/// Follows migration `name` of `source` to its end, sampling the copies of the state
/// every 200 ms (never two running); `at_freeze` is called once, when the source is seen
/// stopped in the checkpoint or the transfer (the migration must get there).
async fn follow(
    pms: &Api<PodMigration>,
    pods: &Api<Pod>,
    name: &str,
    source: &Pod,
    mut at_freeze: Option<Box<dyn FnOnce() + Send>>,
) -> PodMigrationStatus {
    let found = workload_processes(&[source.uid().unwrap()]);
    assert_eq!(
        found.len(),
        1,
        "{name}: one workload process in the source pod"
    );
    let source_proc = found[0].clone();
    let start = Instant::now();
    loop {
        let st = pms
            .get_opt(name)
            .await
            .unwrap()
            .and_then(|m| m.status)
            .unwrap_or_default();
        let (procs, copies, _) = sample(pods, &source_proc, st.target_pod.as_deref()).await;
        assert!(
            copies.len() <= 1,
            "{name}: two copies run (phase {:?}): {copies:?}",
            st.phase
        );
        let frozen = procs.iter().any(|p| p.same(&source_proc) && !p.runs());
        if frozen
            && matches!(
                st.phase,
                MigrationPhase::Checkpointing | MigrationPhase::Transferring
            )
            && let Some(f) = at_freeze.take()
        {
            eprintln!("{name}: the source is frozen in {:?}: upgrading", st.phase);
            f();
        }
        if st.phase.is_terminal() {
            assert!(
                at_freeze.is_none(),
                "{name} ended ({:?}) before the upgrade could start in flight: {st:?}",
                st.phase
            );
            return st;
        }
        assert!(
            start.elapsed() < MIGRATION_TIMEOUT,
            "{name} did not end in {MIGRATION_TIMEOUT:?}: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// After migration `name` of `source` (counter `before`): moved (Succeeded: the target
/// pod on the other node, Ready, never restarted, its counter past `before`) or, where
/// `rollback_ok`, rolled back with the source serving alone. Returns the pod that serves.
async fn whole(
    pods: &Api<Pod>,
    name: &str,
    st: &PodMigrationStatus,
    source: &Pod,
    before: u64,
    rollback_ok: bool,
) -> Pod {
    if st.phase != MigrationPhase::Succeeded {
        assert!(
            rollback_ok && matches!(st.phase, MigrationPhase::Failed | MigrationPhase::Aborted),
            "{name} ended {:?}: {st:?}",
            st.phase
        );
        eprintln!(
            "{name}: rolled back ({:?}: {:?})",
            st.failure_reason, st.failure_message
        );
        source_serves_alone(pods, APP, source, before, name).await;
        return pods.get(&source.name_any()).await.unwrap();
    }
    let target = st.target_pod.clone().expect("a target pod");
    let moved = wait_list(pods, &format!("app={APP}"), POD_TIMEOUT, name, |ps| {
        ps.len() == 1 && ps[0].name_any() == target && pod_running_ready(&ps[0])
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"))[0]
        .clone();
    assert_ne!(
        node_of(&moved),
        node_of(source),
        "{name}: moved to the other node"
    );
    assert_eq!(restart_count(&moved), 0, "{name}: the moved pod restarted");
    let after = counter_when_reachable(&addr(&moved), name);
    assert!(
        after > before,
        "{name}: the counter went on: {before} then {after}"
    );
    eprintln!(
        "{name}: moved {} -> {} (downtime {:?} ms), counter {before} -> {after}",
        node_of(source),
        node_of(&moved),
        st.downtime_millis
    );
    moved
}

/// Migrates `pod` to the other real node and follows it; `at_freeze` as in [`follow`].
async fn migrate(
    w: &World,
    name: &str,
    pod: &Pod,
    rate: Option<i64>,
    at_freeze: Option<Box<dyn FnOnce() + Send>>,
) -> (PodMigrationStatus, u64) {
    let pms: Api<PodMigration> = w.app.api();
    let pods: Api<Pod> = w.app.api();
    let before = counter(&addr(pod));
    start(&pms, name, pod, &other_node(&w.nodes, pod), rate).await;
    (follow(&pms, &pods, name, pod, at_freeze).await, before)
}

#[tokio::test]
async fn an_upgrade_in_flight_leaves_every_migration_whole_and_two_agent_versions_move_pods() {
    let Some(w) = World::new("upgrade", APP, 64, &[]).await else {
        return;
    };
    let pods: Api<Pod> = w.app.api();
    let client = w.op.client.clone();
    let agents = w.agents();
    // The agent image on each node, once there is one agent pod per node.
    let all_agents = || {
        images_by_node(
            &client,
            &agents,
            AGENT_PODS,
            "agent",
            &w.nodes,
            "agents",
            |_| true,
        )
    };
    let installed = all_agents().await;
    let old_agent = w.images.agent().unwrap();
    assert!(installed.values().all(|i| *i == old_agent), "{installed:?}");
    // 64 MiB at 8 MiB/s: the frozen source waits about 8 s for its transfer.
    let slow = Some(8 << 20);

    // 1. The operator upgraded while a migration is frozen; the agents stay (OnDelete).
    let next = NextBuild::from_source(&w.images, "0.1.1");
    let slot = Upgrade::default();
    // helm's default `--wait` (kstatus) would wait for agent pods OnDelete never
    // replaces; `legacy` waits for the operator and counts such a DaemonSet ready.
    let on_delete = [
        "--set",
        "migrationAgent.updateStrategy.type=OnDelete",
        "--wait=legacy",
    ];
    let start_next = next.starter(&w, &on_delete, &slot);
    let source = w.source.clone();
    let (st, before) = migrate(
        &w,
        "during-operator-upgrade",
        &source,
        slow,
        Some(start_next),
    )
    .await;
    let here = whole(&pods, "during-operator-upgrade", &st, &source, before, true).await;
    upgraded(&slot, "to the next build");
    assert_eq!(release_chart(&w), "podmotion-0.1.1");
    let ops: Api<Pod> = w.op.api();
    wait_list(
        &ops,
        "app.kubernetes.io/component=operator",
        POD_TIMEOUT,
        "the next operator",
        |ps| {
            !ps.is_empty()
                && ps.iter().all(|p| {
                    p.spec.as_ref().unwrap().containers[0].image.as_deref()
                        == Some(next.refs["operator"].as_str())
                        && pod_running_ready(p)
                })
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let still = all_agents().await;
    assert_eq!(
        still, installed,
        "OnDelete: no agent was replaced by the upgrade"
    );

    // 2. The replica's node gets the next agent; the other keeps the installed one.
    let upgraded_node = node_of(&here);
    let agent_api: Api<Pod> = Api::namespaced(client.clone(), &agents);
    let on_node = ListParams::default()
        .labels(AGENT_PODS)
        .fields(&format!("spec.nodeName={upgraded_node}"));
    for p in agent_api.list(&on_node).await.unwrap() {
        agent_api
            .delete(&p.name_any(), &DeleteParams::default())
            .await
            .unwrap();
    }
    let next_agent = next.refs["agent"].clone();
    let mixed = images_by_node(
        &client,
        &agents,
        AGENT_PODS,
        "agent",
        &w.nodes,
        "one agent upgraded",
        |m| m.get(&upgraded_node) == Some(&next_agent),
    )
    .await;
    let other = other_node(&w.nodes, &here);
    assert_eq!(
        mixed[&other], old_agent,
        "the other node keeps the installed agent"
    );
    // Two builds of the agent, not one relabelled: each says its own version.
    for p in agent_api
        .list(&ListParams::default().labels(AGENT_PODS))
        .await
        .unwrap()
    {
        let node = p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default();
        let want = if node == upgraded_node {
            "0.1.1"
        } else {
            env!("CARGO_PKG_VERSION")
        };
        assert_eq!(
            agent_version(&agent_api, &p.name_any()).await,
            want,
            "the agent on {node}"
        );
    }
    let (st, before) = migrate(&w, "upgraded-to-installed", &here, None, None).await;
    let there = whole(&pods, "upgraded-to-installed", &st, &here, before, false).await;
    let (st, before) = migrate(&w, "installed-to-upgraded", &there, None, None).await;
    let back = whole(&pods, "installed-to-upgraded", &st, &there, before, false).await;

    // 3. A third build with the chart's default strategy, while a migration is frozen.
    let third = NextBuild::relabel(&next, "0.1.2");
    let slot = Upgrade::default();
    let start_third = third.starter(&w, &["--wait"], &slot);
    let (st, before) = migrate(&w, "during-agent-rollout", &back, slow, Some(start_third)).await;
    let now = whole(&pods, "during-agent-rollout", &st, &back, before, true).await;
    upgraded(&slot, "to the third build");
    assert_eq!(release_chart(&w), "podmotion-0.1.2");
    let third_agent = third.refs["agent"].clone();
    images_by_node(
        &client,
        &agents,
        AGENT_PODS,
        "agent",
        &w.nodes,
        "every agent rolled",
        |m| m.values().all(|i| *i == third_agent),
    )
    .await;
    let (st, before) = migrate(&w, "after-the-rollout", &now, None, None).await;
    whole(&pods, "after-the-rollout", &st, &now, before, false).await;
}
