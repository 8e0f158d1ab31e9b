//! The agent Job contract end to end, without a cluster: the attachment controller
//! renders a Job (`operator/core/src/attachment/render.rs`) and the attach executor parses
//! that Job's environment with its own code (`executors/attach/src/jobenv.rs`). Both use
//! one definition (`executors/attach-job`), and this test proves they agree: every
//! variable the operator sets is one the contract names, and what the executor reads
//! back is what the attachment asked for.

use std::collections::BTreeMap;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use podmotion_api::attachment::{AgentSettings, WorkloadKind, WorkloadRef};
use podmotion_attach::jobenv::{self, AgentConfig, config_keys, env};
use podmotion_attach::nft::Redirect;
use podmotion_e2e::from_json;
use podmotion_operator::attachment::PodView;
use podmotion_operator::attachment::render::{self, AgentProfile, AgentTarget, Settings};
use serde_json::json;

fn rendered(settings: &Settings) -> Job {
    let pod: Pod = from_json(json!({
        "metadata": {"name": "web-0", "uid": "uid-web-0", "labels": {"app": "web"}},
        "spec": {"nodeName": "n1", "containers": [
            {"name": "app", "image": "app", "ports": [{"containerPort": 8080}, {"containerPort": 9090}]},
            {"name": "side", "image": "side"}
        ]},
        "status": {"phase": "Running", "podIP": "198.18.0.7",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [
                {"name": "app", "containerID": "containerd://aaa", "ready": true, "restartCount": 0, "image": "app", "imageID": ""},
                {"name": "side", "containerID": "containerd://sss", "ready": true, "restartCount": 0, "image": "side", "imageID": ""}
            ]}
    }));
    let view = PodView::from_pod(&pod);
    let workload = WorkloadRef {
        kind: WorkloadKind::Deployment,
        name: "web".into(),
    };
    let agent = AgentSettings {
        gid: 4242,
        config: BTreeMap::from([
            (config_keys::ENV_PREFIX.to_string(), "WEB_".to_string()),
            (
                config_keys::ENV_EXCLUDE.to_string(),
                "SECRET*,TOKEN".to_string(),
            ),
        ]),
        ..Default::default()
    };
    let ids = BTreeMap::from([
        ("app".to_string(), "containerd://aaa".to_string()),
        ("side".to_string(), "containerd://sss".to_string()),
    ]);
    let containers = ["app".to_string(), "side".to_string()];
    let profile = AgentProfile {
        namespace: "shop",
        workload: &workload,
        agent: &agent,
    };
    let target = AgentTarget {
        pod: &view,
        containers: &containers,
        container_ids: &ids,
        ports: &[8080, 9090],
    };
    render::job(settings, &profile, &target, "podmotion-agent-1").0
}

fn env_of(job: &Job) -> BTreeMap<String, String> {
    let ps = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    ps.containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
        .collect()
}

fn mount_path(job: &Job, volume: &str) -> String {
    let ps = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    ps.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .unwrap_or_else(|| panic!("no mount of volume {volume}"))
        .mount_path
        .clone()
}

#[test]
fn what_the_operator_renders_is_what_the_executor_reads() {
    let job = rendered(&Settings::default());
    let vars = env_of(&job);
    for name in vars.keys() {
        assert!(
            env::ALL.contains(&name.as_str()),
            "{name} is set by the operator but not part of the contract"
        );
    }
    let config = AgentConfig::parse(&vars[env::AGENT_CONFIG]).unwrap();
    assert_eq!(config.agent_gid, Some(4242));
    assert_eq!(config.containers, ["app", "side"]);
    assert_eq!(config.config[config_keys::ENV_PREFIX], "WEB_");
    assert_eq!(
        jobenv::redirects(&config).unwrap(),
        [
            Redirect {
                port: 8080,
                to: jobenv::AGENT_PORT_BASE
            },
            Redirect {
                port: 9090,
                to: jobenv::AGENT_PORT_BASE + 1
            },
        ]
    );
    assert_eq!(
        jobenv::container_ids(&vars[env::AGENT_CONTAINER_IDS], &config.containers).unwrap(),
        ["containerd://aaa", "containerd://sss"],
        "the primary container first"
    );
    // Every path the executor is told is a mount of the Job.
    assert_eq!(vars[env::AGENT_CRI_SOCKET_DIR], mount_path(&job, "cri"));
    // The token's verifier comes from the pod annotation the resumption writes (the
    // token itself stays in the attachment's namespace); the control API's loopback
    // port is the installer's.
    let verifier = job
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .env
        .iter()
        .flatten()
        .find(|e| e.name == env::AGENT_TOKEN_SHA256)
        .and_then(|e| e.value_from.as_ref()?.field_ref.as_ref())
        .map(|f| f.field_path.clone());
    assert_eq!(
        verifier,
        Some(format!(
            "metadata.annotations['{}']",
            render::TOKEN_VERIFIER_ANNOTATION
        ))
    );
    let patch = render::resume_patch(b"token-bytes");
    assert_eq!(
        patch["spec"]["template"]["metadata"]["annotations"][render::TOKEN_VERIFIER_ANNOTATION],
        jobenv::token_verifier(&render::token_text(b"token-bytes")),
        "the agent's verifier is the token's, as the plugin sends it"
    );
    assert_eq!(
        vars[env::AGENT_CONTROL_PORT].parse::<u16>().ok(),
        Some(render::DEFAULT_CONTROL_PORT as u16)
    );
    assert_eq!(vars[env::EXPORTS_DIR], mount_path(&job, "exports"));
    assert_eq!(vars[env::AGENT_TARGET_POD], "web-0");
    assert_eq!(vars[env::AGENT_TARGET_POD_IP], "198.18.0.7");
    // The metrics listener is on the container port the PodMonitor scrapes (`metrics`),
    // and the log format is one the executor's --log-format takes.
    let listen: std::net::SocketAddr = vars[env::METRICS_LISTEN].parse().unwrap();
    let metrics_port = job
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("metrics"))
        .expect("a metrics port")
        .container_port;
    assert_eq!(i32::from(listen.port()), metrics_port);
    assert!(["json", "text"].contains(&vars[env::LOG_FORMAT].as_str()));
    // The GID the executor checks itself against is the Job's runAsGroup.
    let ps = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let sc = ps.containers[0].security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_group, config.agent_gid.map(i64::from));
}

#[test]
fn a_socket_path_from_the_installer_reaches_the_executor_as_the_socket() {
    let job = rendered(&Settings {
        cri_socket_path: "/run/k3s/containerd/containerd.sock".into(),
        ..Settings::default()
    });
    let vars = env_of(&job);
    assert_eq!(vars[env::CRI_SOCKET], mount_path(&job, "cri"));
    assert!(!vars.contains_key(env::AGENT_CRI_SOCKET_DIR));
}
