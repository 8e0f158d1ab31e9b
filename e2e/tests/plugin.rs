//! `kubectl podmotion` against the local control plane (`hack/cluster.sh up`; a kwok
//! pod, no operator, no real node): the commands that only create, read and delete
//! PodMigrations — `migrate --wait=false`, `-o json|yaml` of `migrate` and `status`,
//! Ctrl-C while `migrate` waits (the migration goes on), and `migrate-cancel` (deletes
//! it and waits until its finalizers are done). Where the operator's finalizer would
//! roll the migration back, the test holds the object with a finalizer of its own and
//! lets it go, so the wait is the plugin's and the test sees both sides of it.
//!
//! The plugin binary: build it first with `cargo build -p kubectl-podmotion` (same
//! `CARGO_TARGET_DIR`); as in `real_plugin.rs`, the test takes it from the target
//! directory it runs from and refuses it when it is older than the plugin's sources
//! (`PODMOTION_PLUGIN_BIN` overrides the path). Fails without a cluster unless
//! PODMOTION_E2E=0.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Output};
use std::sync::mpsc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_e2e::operator::install_crds;
use podmotion_e2e::plugin::{kubectl_podmotion, plugin_bin, spawn_lines as spawn};
use podmotion_e2e::{PodSecurity, TIMEOUT, TestNamespace, from_json, random_suffix, wait_for};
use serde_json::{Value, json};

/// The test's own finalizer: stands for the operator's rollback, which the plugin waits on.
const HOLD: &str = "e2e.podmotion.io/hold";

fn run(bin: &Path, args: &[&str]) -> Output {
    kubectl_podmotion(bin, args)
        .output()
        .expect("running kubectl podmotion")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Waits for a line containing `want`; kills the child and fails otherwise.
fn wait_line(child: &mut Child, rx: &mpsc::Receiver<String>, want: &str, seen: &mut Vec<String>) {
    loop {
        match rx.recv_timeout(TIMEOUT) {
            Ok(l) => {
                let hit = l.contains(want);
                seen.push(l);
                if hit {
                    return;
                }
            }
            Err(e) => {
                let _ = child.kill();
                panic!("no line with {want:?} ({e}); so far: {seen:#?}");
            }
        }
    }
}

fn stderr_of(child: &mut Child) -> String {
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    err
}

/// The namespace with the CRDs and one pod on a kwok node (nothing runs in it; the
/// plugin only reads its UID).
async fn world(prefix: &str) -> Option<(TestNamespace, Pod)> {
    let ns = TestNamespace::new(prefix, PodSecurity::Baseline).await?;
    install_crds(&ns.client).await;
    let pods: Api<Pod> = ns.api();
    let pod: Pod = from_json(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0"},
        "spec": {
            "nodeName": "pm-node-0",
            "containers": [{"name": "app", "image": "registry.example/web:1"}]
        }
    }));
    let pod = pods.create(&PostParams::default(), &pod).await.unwrap();
    Some((ns, pod))
}

async fn hold(pms: &Api<PodMigration>, name: &str) {
    pms.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": [HOLD]}})),
    )
    .await
    .unwrap();
}

/// Drops the test's finalizer. With the resourceVersion read, so a finalizer the
/// garbage collector removed meanwhile (`foregroundDeletion`) is never written back
/// (the API server refuses a new finalizer on a deleting object): a conflict reads again.
async fn release(pms: &Api<PodMigration>, name: &str) {
    for _ in 0..20 {
        let pm = pms.get(name).await.unwrap();
        let rest: Vec<String> = pm
            .finalizers()
            .iter()
            .filter(|f| *f != HOLD)
            .cloned()
            .collect();
        let patch = json!({"metadata": {
            "finalizers": rest,
            "resourceVersion": pm.resource_version(),
        }});
        match pms
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => panic!("releasing {name}: {e}"),
        }
    }
    panic!("releasing {name}: 20 conflicts in a row");
}

#[tokio::test]
async fn migrate_without_waiting_prints_the_name_or_the_object_and_status_prints_a_list() {
    let Some((ns, pod)) = world("plugin-nowait").await else {
        return;
    };
    let bin = plugin_bin();
    let pms: Api<PodMigration> = ns.api();
    let name = format!("nowait-{}", random_suffix());

    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "--name",
            &name,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert_eq!(
        text(&out.stdout),
        format!("podmigration.podmotion.io/{name} created\n"),
        "as `kubectl create` prints it; stderr: {}",
        text(&out.stderr)
    );
    let pm = pms.get(&name).await.expect("the PodMigration exists");
    assert_eq!(pm.spec.pod_name, "web-0");
    assert_eq!(pm.spec.pod_uid, pod.metadata.uid, "the pod's UID is pinned");
    assert!(pm.metadata.deletion_timestamp.is_none());

    let json_name = format!("json-{}", random_suffix());
    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "-o",
            "json",
            "--name",
            &json_name,
            "--mode",
            "Cold",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("-o json is JSON ({e}): {}", text(&out.stdout)));
    assert_eq!(v["kind"], "PodMigration");
    assert_eq!(v["apiVersion"], "podmotion.io/v1alpha1");
    assert_eq!(v["metadata"]["name"], json_name.as_str());
    assert_eq!(v["metadata"]["namespace"], ns.name.as_str());
    assert_eq!(v["spec"]["mode"], "Cold");
    let stored = pms.get(&json_name).await.unwrap();
    assert_eq!(
        v["metadata"]["uid"].as_str(),
        stored.metadata.uid.as_deref(),
        "the object printed is the one the API server stored"
    );
    assert!(v["metadata"].get("managedFields").is_none(), "{v}");

    let out = run(&bin, &["status", "-n", &ns.name, "-o", "json"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let list: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(list["kind"], "List");
    let mut names: Vec<&str> = list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| {
            assert_eq!(i["kind"], "PodMigration", "{i}");
            i["metadata"]["name"].as_str().unwrap()
        })
        .collect();
    names.sort();
    let mut want = vec![name.as_str(), json_name.as_str()];
    want.sort();
    assert_eq!(names, want);

    let out = run(&bin, &["status", "-n", &ns.name, "-o", "yaml"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let yaml: Value = serde_saphyr::from_str(&text(&out.stdout))
        .unwrap_or_else(|e| panic!("-o yaml is YAML ({e}): {}", text(&out.stdout)));
    assert_eq!(yaml["kind"], "List");
    assert_eq!(yaml["items"].as_array().map(Vec::len), Some(2));

    // The default is still the table, which now names both.
    let out = run(&bin, &["status", "-n", &ns.name]);
    let table = text(&out.stdout);
    assert!(table.contains(&format!("pmig/{name}")), "{table}");
    assert!(table.contains(&format!("pmig/{json_name}")), "{table}");

    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "-o",
            "wide",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap refuses an unknown format: {out:?}"
    );
}

#[tokio::test]
async fn ctrl_c_while_migrate_waits_leaves_the_migration_and_names_migrate_cancel() {
    let Some((ns, _pod)) = world("plugin-int").await else {
        return;
    };
    let bin = plugin_bin();
    let pms: Api<PodMigration> = ns.api();
    let name = format!("int-{}", random_suffix());
    let (mut child, rx) = spawn(&bin, &["migrate", "web-0", "-n", &ns.name, "--name", &name]);
    let mut seen = vec![];
    wait_line(&mut child, &rx, "created in namespace", &mut seen);
    // Still following: nothing ends a migration without an operator.
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "{seen:#?}");
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    seen.extend(rx.iter());
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(130), "{seen:#?}\n{err}");
    let cancel = format!("kubectl podmotion migrate-cancel {name} -n {}", ns.name);
    assert!(
        seen.iter().any(|l| l.ends_with(&cancel)),
        "names the command that cancels it: {seen:#?}"
    );
    assert!(
        seen.iter()
            .any(|l| l.contains(&format!("{}/{name} goes on", ns.name))),
        "{seen:#?}"
    );
    let pm = pms
        .get(&name)
        .await
        .expect("Ctrl-C leaves the PodMigration in place");
    assert!(
        pm.metadata.deletion_timestamp.is_none(),
        "Ctrl-C did not delete (cancel) the migration"
    );
}

#[tokio::test]
async fn migrate_cancel_deletes_the_migration_and_waits_until_its_finalizers_are_done() {
    let Some((ns, _pod)) = world("plugin-cancel").await else {
        return;
    };
    let bin = plugin_bin();
    let pms: Api<PodMigration> = ns.api();
    let name = format!("cancel-{}", random_suffix());
    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "--name",
            &name,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    hold(&pms, &name).await;

    let (mut child, rx) = spawn(&bin, &["migrate-cancel", &name, "-n", &ns.name]);
    let mut seen = vec![];
    wait_line(&mut child, &rx, "cancelled", &mut seen);
    wait_for(&pms, &name, TIMEOUT, "deletion requested", |m| {
        m.is_some_and(|m| m.metadata.deletion_timestamp.is_some())
    })
    .await
    .unwrap();
    // The finalizer holds the object: the plugin keeps waiting.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        child.try_wait().unwrap().is_none(),
        "migrate-cancel returned while the rollback (finalizer) was not done: {seen:#?}"
    );
    release(&pms, &name).await;
    let status = child.wait().unwrap();
    seen.extend(rx.iter());
    let err = stderr_of(&mut child);
    assert_eq!(status.code(), Some(0), "{seen:#?}\n{err}");
    assert!(seen.iter().any(|l| l.contains("is gone")), "{seen:#?}");
    assert!(
        pms.get_opt(&name).await.unwrap().is_none(),
        "gone, as it said"
    );

    // --wait=false: returns once the deletion is accepted; the finalizer still holds it.
    let name2 = format!("cancel-nowait-{}", random_suffix());
    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "--name",
            &name2,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    hold(&pms, &name2).await;
    let out = run(
        &bin,
        &["migrate-cancel", &name2, "-n", &ns.name, "--wait=false"],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(text(&out.stdout).contains("cancelled"), "{out:?}");
    let pm = pms.get(&name2).await.unwrap();
    assert!(
        pm.metadata.deletion_timestamp.is_some(),
        "deletion requested"
    );
    release(&pms, &name2).await;

    // Nothing to cancel: a missing migration, and one that already ended.
    let out = run(
        &bin,
        &["migrate-cancel", "no-such-migration", "-n", &ns.name],
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains(&format!(
            "podmigration no-such-migration not found in namespace {}",
            ns.name
        )),
        "{out:?}"
    );
    let done = format!("done-{}", random_suffix());
    let out = run(
        &bin,
        &[
            "migrate",
            "web-0",
            "-n",
            &ns.name,
            "--wait=false",
            "--name",
            &done,
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    pms.patch_status(
        &done,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Succeeded"}})),
    )
    .await
    .unwrap();
    let out = run(&bin, &["migrate-cancel", &done, "-n", &ns.name]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        text(&out.stderr).contains("already ended Succeeded: nothing to cancel"),
        "{out:?}"
    );
    let pm = pms.get(&done).await.unwrap();
    assert!(
        pm.metadata.deletion_timestamp.is_none(),
        "an ended migration is left as it is"
    );
}
