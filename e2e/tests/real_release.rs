//! Issue 43: a release a user can install. `hack/release.sh REGISTRY` publishes the
//! images, the pinned chart and the plugin to a registry that speaks only TLS (a second
//! `registry` process with its own CA, started here); run twice on one commit it pushes
//! the same digests and says each is already published; a version tag that names other
//! content is refused, and moved only when asked. The chart installed from that registry
//! with `global.imageRegistry` as its only image value runs every PodMotion pod from the
//! released digests on the real nodes (which trust the CA through containerd's
//! `certs.d`, as a user's nodes would), and moves a pod.
//!
//! The other values are this cluster's facts (`hack/install-values.yaml`: real-node
//! selectors and tolerations, the API server's port, the kubelets' cgroup roots) and the
//! test's scoping (watched namespaces, leader lease), never an image. Not covered: a
//! registry that asks for credentials (`RELEASE_AUTH_FILE` is passed to skopeo as is).
//!
//! Needs the cluster with real nodes (`hack/cluster.sh up`) and the images pushed
//! (`hack/images.sh`); `hack/test.sh` does both.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams, PostParams};
use podmotion_api::PodMigration;
use podmotion_api::migration::MigrationPhase;
use podmotion_e2e::real::testload::{self, MIGRATION_TIMEOUT, POD_TIMEOUT, node_of};
use podmotion_e2e::real::{
    Images, Uninstall, helm, output_text, real_nodes, refuse_beside_a_cluster_wide_release,
};
use podmotion_e2e::{
    PodSecurity, TestNamespace, from_json, pod_running_ready, random_suffix, repo_root, run_dir,
    wait_for, wait_list, without_crate_env,
};
use serde_json::json;

/// The shipped images, by the name `hack/release.sh` publishes them under.
const SHIPPED: [&str; 5] = ["operator", "agent", "broker", "attach", "preflight"];

/// A registry on loopback that speaks only TLS, with a CA of its own; stopped and its
/// storage removed on drop.
struct TlsRegistry {
    dir: PathBuf,
    addr: String,
    child: Child,
}

impl TlsRegistry {
    fn start() -> TlsRegistry {
        let dir = std::env::temp_dir().join(format!("pm-release-{}", random_suffix()));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let [port] = podmotion_e2e::kwok_agents::free_ports::<1>();
        let addr = format!("127.0.0.1:{port}");
        let pki = format!(
            "set -e; cd '{d}'
             openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
               -subj /CN=podmotion-release-test-ca -keyout ca.key -out ca.crt
             openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
               -subj /CN=127.0.0.1 -keyout tls.key -out tls.csr
             printf 'subjectAltName=IP:127.0.0.1\\nextendedKeyUsage=serverAuth\\n' >ext
             openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 1 \
               -extfile ext -out tls.crt",
            d = dir.display()
        );
        let out = Command::new("bash").args(["-c", &pki]).output().unwrap();
        assert!(out.status.success(), "openssl: {}", output_text(&out));
        std::fs::write(
            dir.join("config.yml"),
            format!(
                "version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {d}/data}}\n\
                 http:\n  addr: {addr}\n  tls: {{certificate: {d}/tls.crt, key: {d}/tls.key}}\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let bin = Command::new("bash")
            .arg(repo_root().join("hack/registry.sh"))
            .arg("build")
            .output()
            .unwrap();
        assert!(bin.status.success(), "{}", output_text(&bin));
        let bin = String::from_utf8_lossy(&bin.stdout).trim().to_owned();
        let child = Command::new(bin)
            .arg("serve")
            .arg(dir.join("config.yml"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("registry.log")).unwrap())
            .spawn()
            .unwrap();
        let reg = TlsRegistry { dir, addr, child };
        for _ in 0..100 {
            if reg
                .curl(&["-o", "/dev/null", &format!("https://{}/v2/", reg.addr)])
                .status
                .success()
            {
                // Plain HTTP is not served: what the release pushed went over TLS.
                let plain = reg.curl(&["-o", "/dev/null", &format!("http://{}/v2/", reg.addr)]);
                assert!(
                    !plain.status.success(),
                    "the test registry answers plain HTTP"
                );
                return reg;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the TLS registry did not answer on {}", reg.addr);
    }

    fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    fn curl(&self, args: &[&str]) -> Output {
        Command::new("curl")
            .args(["-fsS", "--max-time", "10", "--cacert"])
            .arg(self.ca())
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for TlsRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Every real node's containerd trusts the registry's CA (`certs.d/<host:port>`, read at
/// each pull); removed on drop.
struct NodesTrust(Vec<PathBuf>);

impl NodesTrust {
    fn add(reg: &TlsRegistry, nodes: &[String]) -> NodesTrust {
        let mut dirs = Vec::new();
        for n in nodes {
            let etc = run_dir()
                .join("nodes")
                .join(n)
                .join("etc/containerd/certs.d");
            assert!(
                etc.is_dir(),
                "{} is not a real node's certs.d",
                etc.display()
            );
            let dir = etc.join(&reg.addr);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::copy(reg.ca(), dir.join("ca.crt")).unwrap();
            // The node sees its etc/containerd at /etc/containerd.
            std::fs::write(
                dir.join("hosts.toml"),
                format!(
                    "server = \"https://{a}\"\n[host.\"https://{a}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"/etc/containerd/certs.d/{a}/ca.crt\"\n",
                    a = reg.addr
                ),
            )
            .unwrap();
            dirs.push(dir);
        }
        NodesTrust(dirs)
    }
}

impl Drop for NodesTrust {
    fn drop(&mut self) {
        for d in &self.0 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// `hack/release.sh REGISTRY` with the registry's CA; the output, whatever the exit.
fn release(reg: &TlsRegistry, extra_env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("bash");
    without_crate_env(&mut cmd)
        .arg(repo_root().join("hack/release.sh"))
        .arg(&reg.addr)
        .env("RELEASE_CA_FILE", reg.ca())
        // The test may run on a working tree with changes; the release script's own
        // refusal of those is its default, not what this test is about.
        .env("RELEASE_ALLOW_DIRTY", "1")
        // The images hack/test.sh built (cargo profile `images`), not a second, cold
        // compilation with LTO (the release's default, `images-lto`): the publishing is
        // under test here, and it is the same for either profile.
        .env("IMAGES_CARGO_PROFILE", "images");
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

/// The references a successful release printed, by repository (`podmotion-agent`,
/// `kubectl-podmotion`, `charts/podmotion`).
fn published(out: &Output, reg: &TlsRegistry) -> BTreeMap<String, String> {
    assert!(
        out.status.success(),
        "hack/release.sh: {}",
        output_text(out)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let refs: BTreeMap<String, String> = text
        .lines()
        .map(|l| {
            let bare = l.strip_prefix("oci://").unwrap_or(l);
            let (name, digest) = bare.split_once('@').expect("pinned by digest");
            let repo = name
                .strip_prefix(&format!("{}/podmotion/", reg.addr))
                .unwrap_or_else(|| panic!("{l} is not in {}/podmotion/", reg.addr));
            assert!(digest.starts_with("sha256:") && digest.len() == 71, "{l}");
            (repo.to_owned(), digest.to_owned())
        })
        .collect();
    let mut want: Vec<String> = SHIPPED.iter().map(|n| format!("podmotion-{n}")).collect();
    want.extend(["kubectl-podmotion".into(), "charts/podmotion".into()]);
    want.sort();
    assert_eq!(refs.keys().cloned().collect::<Vec<_>>(), want, "{text}");
    refs
}

fn version() -> String {
    let chart = std::fs::read_to_string(repo_root().join("charts/podmotion/Chart.yaml")).unwrap();
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version: "))
        .unwrap()
        .trim()
        .to_owned()
}

/// The digest the registry's `repo:tag` names now (the manifest's own sha256).
fn tag_digest(reg: &TlsRegistry, repo: &str, tag: &str) -> String {
    let out = reg.curl(&[
        "-H",
        "Accept: application/vnd.oci.image.manifest.v1+json",
        &format!("https://{}/v2/podmotion/{repo}/manifests/{tag}", reg.addr),
    ]);
    assert!(out.status.success(), "{repo}:{tag}: {}", output_text(&out));
    let sum = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(&out.stdout)?;
            c.wait_with_output()
        })
        .unwrap();
    format!(
        "sha256:{}",
        String::from_utf8_lossy(&sum.stdout)
            .split_whitespace()
            .next()
            .unwrap()
    )
}

/// `skopeo copy` of `from` (in the local plain-HTTP registry) over `repo:tag` of `reg`.
fn overwrite_tag(reg: &TlsRegistry, from: &str, repo: &str, tag: &str) {
    let certs = reg.dir.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::copy(reg.ca(), certs.join("ca.crt")).unwrap();
    let out = Command::new("skopeo")
        .args([
            "copy",
            "--quiet",
            "--preserve-digests",
            "--src-tls-verify=false",
        ])
        .arg("--dest-cert-dir")
        .arg(&certs)
        .arg(format!("docker://{from}"))
        .arg(format!("docker://{}/podmotion/{repo}:{tag}", reg.addr))
        .output()
        .unwrap();
    assert!(out.status.success(), "skopeo copy: {}", output_text(&out));
}

#[tokio::test]
async fn a_release_pushed_twice_to_a_tls_registry_has_one_set_of_digests_and_installs_with_one_value()
 {
    let Some(op) = TestNamespace::new("release-op", PodSecurity::Restricted).await else {
        return;
    };
    let Some(nodes) = real_nodes(&op.client).await else {
        return;
    };
    assert!(nodes.len() >= 2, "two real nodes needed: {nodes:?}");
    let Some(app) = TestNamespace::new("release-app", PodSecurity::Baseline).await else {
        return;
    };
    let images = Images::load().unwrap_or_else(|e| panic!("{e:#}"));
    let version = version();
    let reg = TlsRegistry::start();

    // Twice on one commit: the same digests, the second run publishing nothing new.
    let first = published(&release(&reg, &[]), &reg);
    let again = release(&reg, &[]);
    assert_eq!(
        published(&again, &reg),
        first,
        "a second release moved a digest"
    );
    let said = String::from_utf8_lossy(&again.stderr);
    for repo in first.keys() {
        assert!(
            said.contains(&format!("podmotion/{repo}:{version}: already published")),
            "the second run did not find {repo} published: {said}"
        );
        assert_eq!(
            tag_digest(&reg, repo, &version),
            first[repo],
            "{repo}:{version}"
        );
    }

    // A version tag that names other content is refused, naming it, and left alone...
    let testload = images.testload().unwrap();
    overwrite_tag(&reg, &testload, "podmotion-preflight", &version);
    let moved = tag_digest(&reg, "podmotion-preflight", &version);
    assert_ne!(moved, first["podmotion-preflight"]);
    let refused = release(&reg, &[]);
    let text = output_text(&refused);
    assert!(
        !refused.status.success(),
        "a moved tag was accepted: {text}"
    );
    assert!(
        text.contains(&format!(
            "podmotion/podmotion-preflight:{version} already names {moved}"
        )),
        "{text}"
    );
    assert_eq!(tag_digest(&reg, "podmotion-preflight", &version), moved);
    // ...and moved back when asked.
    let replaced = published(&release(&reg, &[("RELEASE_REPLACE", "1")]), &reg);
    assert_eq!(replaced, first);
    assert_eq!(
        tag_digest(&reg, "podmotion-preflight", &version),
        first["podmotion-preflight"]
    );

    // The chart as users read it: its defaults are the released digests.
    let chart = format!("oci://{}/podmotion/charts/podmotion", reg.addr);
    let ca = reg.ca().to_string_lossy().into_owned();
    let shown = helm(&[
        "show",
        "values",
        &chart,
        "--version",
        &version,
        "--ca-file",
        &ca,
    ]);
    assert!(shown.status.success(), "{}", output_text(&shown));
    let shown = String::from_utf8_lossy(&shown.stdout);
    for n in SHIPPED {
        assert!(
            shown.contains(first[&format!("podmotion-{n}")].as_str()),
            "the released chart's values do not name {n}'s digest"
        );
    }

    // Installed from the registry with one image value, on nodes that trust its CA.
    let _trust = NodesTrust::add(&reg, &all_node_dirs());
    refuse_beside_a_cluster_wide_release();
    let release_name = format!("pm{}", random_suffix());
    let _uninstall = Uninstall {
        release: release_name.clone(),
        namespace: op.name.clone(),
    };
    let install_values = repo_root().join("hack/install-values.yaml");
    let install = helm(&[
        "install",
        &release_name,
        &chart,
        "--version",
        &version,
        "--ca-file",
        &ca,
        "-n",
        &op.name,
        "--values",
        install_values.to_str().unwrap(),
        "--set",
        &format!("global.imageRegistry={}", reg.addr),
        "--set",
        &format!(
            "migration.watchNamespace={a},attachment.watchNamespace={a},runnerPool.watchNamespace={a}",
            a = app.name
        ),
        "--set",
        "operator.leaderElection.leaseName=podmotion-e2e-release",
        // The CRDs outlive releases (kept on uninstall): adopted, as hack/install.sh does.
        "--take-ownership",
        "--force-conflicts",
        "--wait",
        "--timeout",
        "5m",
    ]);
    assert!(
        install.status.success(),
        "helm install: {}",
        output_text(&install)
    );
    // The operator's namespace and the agents' (the chart's `<namespace>-agents`).
    let mut ours = vec![];
    for ns in [op.name.clone(), format!("{}-agents", op.name)] {
        let pods: Api<Pod> = Api::namespaced(op.client.clone(), &ns);
        ours.extend(pods.list(&ListParams::default()).await.unwrap().items);
    }
    let mut seen = std::collections::BTreeSet::new();
    for p in &ours {
        let spec = p.spec.as_ref().unwrap();
        let containers = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten());
        for c in containers {
            let image = c.image.clone().unwrap_or_default();
            let (name, digest) = image
                .split_once('@')
                .unwrap_or_else(|| panic!("{}: {image} is not pinned", p.name_any()));
            let repo = name
                .strip_prefix(&format!("{}/podmotion/", reg.addr))
                .unwrap_or_else(|| panic!("{}: {image} is not from the release", p.name_any()));
            assert_eq!(
                first.get(repo),
                Some(&digest.to_owned()),
                "{}: {image}",
                p.name_any()
            );
            seen.insert(repo.to_owned());
        }
        let phase = p
            .status
            .as_ref()
            .and_then(|s| s.phase.clone())
            .unwrap_or_default();
        assert!(
            phase == "Succeeded" || pod_running_ready(p),
            "{} is not Running and Ready ({phase})",
            p.name_any()
        );
    }
    for n in ["operator", "agent", "broker"] {
        assert!(
            seen.contains(&format!("podmotion-{n}")),
            "no pod runs {n}: {seen:?}"
        );
    }
    // The images the operator runs itself (attachment Jobs, the preflight) are the
    // released ones too.
    let deployments: Api<Deployment> = op.api();
    let operator = deployments
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .next()
        .expect("the operator's Deployment");
    let spec = serde_json::to_string(&operator.spec).unwrap();
    for n in ["attach", "preflight"] {
        let want = format!(
            "{}/podmotion/podmotion-{n}@{}",
            reg.addr,
            first[&format!("podmotion-{n}")]
        );
        assert!(
            spec.contains(&want),
            "the operator is not given {want}: {spec}"
        );
    }

    // And it moves a pod between the real nodes.
    app.api::<Deployment>()
        .create(
            &PostParams::default(),
            &testload::deployment("released", &testload, 16),
        )
        .await
        .unwrap();
    let app_pods: Api<Pod> = app.api();
    let ready = wait_list(
        &app_pods,
        "app=released",
        POD_TIMEOUT,
        "the replica Ready",
        |ps| ps.len() == 1 && pod_running_ready(&ps[0]),
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let source = ready[0].clone();
    let pms: Api<PodMigration> = app.api();
    let pm: PodMigration = from_json(json!({
        "apiVersion": "podmotion.io/v1alpha1", "kind": "PodMigration",
        "metadata": {"name": "move-released"},
        // A 30 s freeze budget: this test is about the release's build, and under load
        // the default 500 ms once ran out in the final round (FreezeBudgetExceeded).
        "spec": {"podName": source.name_any(), "freezeBudgetMillis": 30000}
    }));
    pms.create(&PostParams::default(), &pm).await.unwrap();
    let m = wait_for(
        &pms,
        "move-released",
        MIGRATION_TIMEOUT,
        "the migration to end",
        |m| {
            m.and_then(|m| m.status.as_ref())
                .is_some_and(|s| s.phase.is_terminal())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let st = m.and_then(|m| m.status).expect("status");
    if st.phase != MigrationPhase::Succeeded {
        app.dump();
        op.dump();
        panic!("the released build did not move the pod: {st:?}");
    }
    let target = app_pods
        .get(st.target_pod.as_deref().unwrap())
        .await
        .unwrap();
    assert_ne!(node_of(&target), node_of(&source));
    eprintln!(
        "released {version} to {}: {} artifacts, moved a pod in {:?} ms of downtime",
        reg.addr,
        first.len(),
        st.downtime_millis
    );
}

/// The directory names of every node `hack/cluster.sh` runs a containerd for (the
/// runner nodes too: the released chart's pods may land there).
fn all_node_dirs() -> Vec<String> {
    let root = run_dir().join("nodes");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .filter_map(|e| e.ok())
        .filter(|e| Path::new(&e.path()).join("etc/containerd/certs.d").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(!names.is_empty(), "no real node under {}", root.display());
    names
}
