//! The runtime path: a real containerd (CRI plugin, runc, loopback-only CNI) runs a
//! pod built from a locally made busybox image; the agent finds the runtime socket
//! under a mounted `/run`, resolves the container's PID over CRI, and attaches.

mod common;

use common::*;
use podmotion_attach::cri::{CriClient, v1};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

struct Containerd {
    dir: PathBuf,
    socket: PathBuf,
}

impl Containerd {
    fn up() -> Containerd {
        for tool in ["containerd", "ctr", "runc", "containerd-shim-runc-v2"] {
            assert!(
                which(tool).is_some(),
                "{tool} missing: run hack/install-attach-deps.sh (or PODMOTION_ROOT_TESTS=0 to skip)"
            );
        }
        assert!(
            Path::new("/usr/lib/cni/loopback").exists(),
            "CNI loopback plugin missing: run hack/install-attach-deps.sh"
        );
        let dir = std::env::temp_dir().join(format!("pmt-containerd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/cri-fixture.sh");
        let out = run(common::tool("bash").arg(&script).arg("up").arg(&dir));
        let socket = PathBuf::from(out.trim().lines().last().unwrap());
        Containerd { dir, socket }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        if std::env::var_os("PODMOTION_KEEP_FIXTURES").is_some() {
            eprintln!("keeping containerd fixture in {}", self.dir.display());
            return;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/cri-fixture.sh");
        let _ = common::tool("bash")
            .arg(script)
            .arg("down")
            .arg(&self.dir)
            .status();
    }
}

fn sandbox_config(name: &str) -> v1::PodSandboxConfig {
    v1::PodSandboxConfig {
        metadata: Some(v1::PodSandboxMetadata {
            name: name.into(),
            uid: format!("uid-{name}"),
            namespace: "podmotion-test".into(),
            attempt: 0,
        }),
        hostname: name.into(),
        log_directory: String::new(),
        ..Default::default()
    }
}

/// RunPodSandbox, the kubelet's first call for a pod.
async fn run_sandbox(cri: &CriClient, name: &str) -> (String, v1::PodSandboxConfig) {
    let config = sandbox_config(name);
    let sandbox = cri
        .runtime()
        .run_pod_sandbox(v1::RunPodSandboxRequest {
            config: Some(config.clone()),
            ..Default::default()
        })
        .await
        .expect("RunPodSandbox")
        .into_inner();
    (sandbox.pod_sandbox_id, config)
}

/// CreateContainer + StartContainer in a sandbox.
async fn run_container(
    cri: &CriClient,
    sandbox: &(String, v1::PodSandboxConfig),
    name: &str,
    argv: &[&str],
    env: &[(&str, &str)],
) -> String {
    let created = cri
        .runtime()
        .create_container(v1::CreateContainerRequest {
            pod_sandbox_id: sandbox.0.clone(),
            config: Some(v1::ContainerConfig {
                metadata: Some(v1::ContainerMetadata {
                    name: name.into(),
                    attempt: 0,
                }),
                image: Some(v1::ImageSpec {
                    image: "podmotion.test/busybox:1".into(),
                    ..Default::default()
                }),
                command: vec![argv[0].into()],
                args: argv[1..].iter().map(|a| (*a).into()).collect(),
                working_dir: "/".into(),
                envs: env
                    .iter()
                    .map(|(k, v)| v1::KeyValue {
                        key: (*k).into(),
                        value: (*v).into(),
                    })
                    .collect(),
                log_path: String::new(),
                ..Default::default()
            }),
            sandbox_config: Some(sandbox.1.clone()),
        })
        .await
        .expect("CreateContainer")
        .into_inner();
    cri.runtime()
        .start_container(v1::StartContainerRequest {
            container_id: created.container_id.clone(),
        })
        .await
        .expect("StartContainer");
    created.container_id
}

/// A unix-socket proxy in front of the runtime that counts client connections.
async fn counting_proxy(at: &Path, upstream: PathBuf) -> Arc<AtomicUsize> {
    let listener = tokio::net::UnixListener::bind(at).unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    tokio::spawn(async move {
        while let Ok((mut down, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let upstream = upstream.clone();
            tokio::spawn(async move {
                if let Ok(mut up) = tokio::net::UnixStream::connect(upstream).await {
                    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                }
            });
        }
    });
    count
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_resolves_a_containerd_container_over_cri_and_attaches() {
    if !root_tests_enabled() {
        return;
    }
    let containerd = Containerd::up();
    let cri = CriClient::connect(&containerd.socket).await.unwrap();
    let version = cri.version().await.unwrap();
    assert_eq!(version.runtime_name, "containerd");

    let pod = run_sandbox(&cri, "web-0").await;
    let sandbox = pod.0.clone();
    let app_argv = ["/bin/httpd", "-f", "-p", "8080", "-h", "/srv/www"];
    let app_env = [("ZED", "z"), ("APP_MODE", "cri"), ("A", "1")];
    let container = run_container(&cri, &pod, "app", &app_argv, &app_env).await;
    let sidecar = run_container(
        &cri,
        &pod,
        "side",
        &["/bin/sleep", "3600"],
        &[("SIDE", "car")],
    )
    .await;

    // The PID as containerd's own task service reports it (independent of CRI).
    let tasks = run(common::tool("ctr")
        .arg("-a")
        .arg(&containerd.socket)
        .args(["-n", "k8s.io", "tasks", "ls"]));
    let task_pid: u32 = tasks
        .lines()
        .find(|l| l.starts_with(&container))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("task for {container} not in {tasks}"));
    assert_eq!(
        cri.container_pid(&format!("containerd://{container}"))
            .await
            .unwrap(),
        task_pid
    );

    // Every well-known location is found, each alone in a mounted /run; so is the
    // socket mounted directly.
    for (i, rel) in podmotion_attach::cri::WELL_KNOWN_SOCKETS.iter().enumerate() {
        let run_dir = containerd.dir.join(format!("run-{i}"));
        let at = run_dir.join(rel);
        std::fs::create_dir_all(at.parent().unwrap()).unwrap();
        std::os::unix::fs::symlink(&containerd.socket, &at).unwrap();
        let found = podmotion_attach::cri::discover(&run_dir, &container).await;
        assert_eq!(found.map(|c| c.socket().to_owned()).ok(), Some(at), "{rel}");
    }
    let direct = podmotion_attach::cri::discover(&containerd.socket, &container).await;
    assert!(direct.is_ok(), "socket mounted directly");
    let empty = containerd.dir.join("run-empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = podmotion_attach::cri::discover(&empty, &container)
        .await
        .err()
        .unwrap();
    assert_eq!(err.category(), "NoCriSocket");

    // A node /run as the Job would mount it: a dead socket where containerd's usually
    // is, the live runtime at k3s's path. Discovery must skip the dead one.
    let host_run = containerd.dir.join("host-run");
    std::fs::create_dir_all(host_run.join("containerd")).unwrap();
    std::fs::create_dir_all(host_run.join("k3s/containerd")).unwrap();
    drop(
        std::os::unix::net::UnixListener::bind(host_run.join("containerd/containerd.sock"))
            .unwrap(),
    );
    let connections = counting_proxy(
        &host_run.join("k3s/containerd/containerd.sock"),
        containerd.socket.clone(),
    )
    .await;

    // Configured exactly as the attachment controller renders the Job: the
    // `node-agent` argument, AGENT_CONFIG, AGENT_CONTAINER_IDS (name → ID, primary
    // named in AGENT_CONFIG), AGENT_CRI_SOCKET_DIR, AGENT_CREDENTIALS_DIR with a token.
    let creds = containerd.dir.join("credentials");
    std::fs::create_dir_all(&creds).unwrap();
    std::fs::write(creds.join("token"), "job-token-123").unwrap();
    let agent_config = serde_json::json!({
        "namespace": "podmotion-test",
        "workload": {"kind": "Deployment", "name": "web"},
        "containers": ["app", "side"],
        "agentGID": AGENT_GID,
        "managerNamespace": "podmotion",
        "ports": [{"port": APP_PORT, "agentPort": AGENT_PORT}],
        "config": {"envExclude": "PATH,HOSTNAME"},
    });
    let ids = serde_json::json!({"side": format!("containerd://{sidecar}"), "app": format!("containerd://{container}")});
    let mut parts = agent_cmd_bare(Some(AGENT_GID), &["node-agent".to_owned()]);
    parts
        .0
        .args(["--export", "/srv/www", "--export", "/etc"])
        .env("AGENT_CONFIG", agent_config.to_string())
        .env("AGENT_CONTAINER_IDS", ids.to_string())
        .env("AGENT_CRI_SOCKET_DIR", &host_run)
        .env("AGENT_CREDENTIALS_DIR", &creds);
    let agent = tokio::task::spawn_blocking(move || {
        let mut a = Agent::spawn_from(parts, Some("job-token-123".into()));
        a.wait_ready(Duration::from_secs(30));
        a
    })
    .await
    .unwrap();
    let (unauthorized, _) = request_with(agent.control, "GET", "/v1/env", "").unwrap();
    assert_eq!(
        unauthorized, 401,
        "the control API requires the Job's token"
    );
    let health = agent.json("/healthz");
    assert_eq!(
        connections.load(Ordering::SeqCst),
        1,
        "one CRI connection for both containers"
    );
    assert_eq!(health["containers"].as_array().unwrap().len(), 2);
    let side_env = agent.json(&format!("/v1/env?container={sidecar}"));
    assert!(
        side_env
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "SIDE" && e["value"] == "car"),
        "{side_env}"
    );
    assert!(
        !side_env
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["name"] == "APP_MODE"),
        "each container's own environment"
    );
    assert_eq!(health["pid"], task_pid);
    assert_eq!(
        health["cri_socket"].as_str().unwrap(),
        host_run
            .join("k3s/containerd/containerd.sock")
            .display()
            .to_string()
    );

    // Env from the container's init process: CRI's env entries, in order.
    let env = agent.json("/v1/env");
    let env: Vec<String> = env
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}={}",
                e["name"].as_str().unwrap(),
                e["value"].as_str().unwrap()
            )
        })
        .collect();
    let pos = |needle: &str| {
        env.iter()
            .position(|e| e == needle)
            .unwrap_or_else(|| panic!("{needle} not in {env:?}"))
    };
    assert!(
        pos("ZED=z") < pos("APP_MODE=cri") && pos("APP_MODE=cri") < pos("A=1"),
        "{env:?}"
    );
    // AGENT_CONFIG's envExclude applied (the runtime adds PATH and HOSTNAME).
    let raw = String::from_utf8_lossy(&std::fs::read(format!("/proc/{task_pid}/environ")).unwrap())
        .into_owned();
    assert!(raw.contains("PATH=") && raw.contains("HOSTNAME="), "{raw}");
    assert!(
        !env.iter()
            .any(|e| e.starts_with("PATH=") || e.starts_with("HOSTNAME=")),
        "{env:?}"
    );

    // Files from the container's image, through the exports.
    assert_eq!(
        std::fs::read_to_string(agent.exports_dir.join("srv/www/index.html")).unwrap(),
        "hello from the container\n"
    );
    assert_eq!(
        std::fs::read_to_string(agent.exports_dir.join("etc/podmotion-release")).unwrap(),
        "podmotion image podmotion.test/busybox\n"
    );

    // The ruleset lives in the pod's own (CNI-created) namespace, and a pass-through
    // connection from inside the pod still reaches the application.
    let netns = format!("--net=/proc/{task_pid}/ns/net");
    assert_ne!(
        std::fs::metadata(format!("/proc/{task_pid}/ns/net"))
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap(),
        std::fs::metadata("/proc/self/ns/net")
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap(),
        "the CRI pod has its own network namespace"
    );
    let listing = nft_table_of(&["nsenter", &netns]);
    assert!(
        listing.contains(&format!("tcp dport {APP_PORT} redirect to :{AGENT_PORT}")),
        "{listing}"
    );
    let body = run(common::tool("nsenter")
        .args([netns.as_str(), "busybox", "wget", "-qO-"])
        .arg(format!("http://127.0.0.1:{APP_PORT}/")));
    assert_eq!(body, "hello from the container\n");

    // Intercepting inside the CRI pod: a loopback client in the pod reaches the
    // client stream instead of the app.
    let (status, _) = agent.call("POST", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 201);
    let agent = std::sync::Arc::new(agent);
    let a2 = agent.clone();
    let taker = std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let mut s = a2.stream(&format!("/v1/intercepts/{APP_PORT}/accept"));
        let mut head = String::new();
        s.read_line(&mut head).unwrap();
        s.get_mut()
            .write_all(b"HTTP/1.0 200 OK\r\n\r\nintercepted-in-cri-pod")
            .unwrap();
        head
    });
    std::thread::sleep(Duration::from_millis(300));
    let body = run(common::tool("nsenter")
        .args([netns.as_str(), "busybox", "wget", "-qO-"])
        .arg(format!("http://127.0.0.1:{APP_PORT}/")));
    assert_eq!(body, "intercepted-in-cri-pod");
    assert!(
        taker
            .join()
            .unwrap()
            .contains(&format!("127.0.0.1:{APP_PORT}"))
    );

    agent.signal(nix::sys::signal::Signal::SIGTERM);
    let gone = wait_for(Duration::from_secs(5), || {
        !run(common::tool("nsenter").args([netns.as_str(), "nft", "list", "tables"]))
            .contains(TABLE)
    });
    assert!(gone.is_ok(), "table removed on SIGTERM");

    let _ = cri
        .runtime()
        .stop_pod_sandbox(v1::StopPodSandboxRequest {
            pod_sandbox_id: sandbox.clone(),
        })
        .await;
    let _ = cri
        .runtime()
        .remove_pod_sandbox(v1::RemovePodSandboxRequest {
            pod_sandbox_id: sandbox,
        })
        .await;
}
