//! Where a tenant reaches its agent (issue 41), as root on this machine's kernel: the
//! control API on the target pod's loopback, behind the token whose SHA-256 is all the
//! agent holds; the Job pod's own port answers `/healthz` and nothing else.

mod common;

use common::*;
use podmotion_attach::netns::NetnsExecutor;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const TOKEN: &str = "t0k3n-of-the-tenant";

/// One request to `127.0.0.1:<port>` from inside `ns` (as the kubelet's port-forward
/// dials it): the whole answer, or the connection error.
fn call_inside(ns: &NetnsExecutor, port: u16, headers: String) -> std::io::Result<String> {
    ns.run_blocking(move || {
        let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET /v1/env HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\nContent-Length: 0\r\n\r\n"
        )?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    })
    .map_err(|e| std::io::Error::other(e.to_string()))
}

#[test]
fn the_control_api_is_on_the_target_pods_loopback_and_the_job_port_answers_health_only() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("TENANT_MARK", "only-this-tenant")]);
    let verifier = podmotion_attach::jobenv::token_verifier(TOKEN);
    let port = free_port();
    let agent = Agent::start(
        &["--pid".into(), pod.pid().to_string()],
        &[
            "--token-sha256",
            &verifier,
            "--control-port",
            &port.to_string(),
        ],
    );
    let bearer = |t: &str| format!("Authorization: Bearer {t}\r\n");

    // The Job pod's own port: /healthz (the readiness probe), nothing else, token or not.
    assert_eq!(get(agent.control, "/healthz").unwrap().0, 200);
    let (status, body) = request_with(agent.control, "GET", "/v1/env", &bearer(TOKEN)).unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("loopback"), "{body}");

    // Inside the target's network namespace, on loopback: the API, behind the token.
    let target = NetnsExecutor::open(&NetnsPod::ns_path(&pod.pod_ns)).unwrap();
    let ok = call_inside(&target, port, bearer(TOKEN)).unwrap();
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    assert!(ok.contains("only-this-tenant"), "{ok}");
    let none = call_inside(&target, port, String::new()).unwrap();
    assert!(none.starts_with("HTTP/1.1 401"), "{none}");
    let verifier_as_token = call_inside(&target, port, bearer(&verifier)).unwrap();
    assert!(
        verifier_as_token.starts_with("HTTP/1.1 401"),
        "the verifier is not a credential: {verifier_as_token}"
    );

    // Loopback only: not from the pod's network, not on the host's loopback.
    let pod_addr: std::net::SocketAddr = format!("{}:{port}", pod.pod_ip).parse().unwrap();
    assert!(
        pod.client_connect(pod_addr).is_err(),
        "the control API is not reachable over the pod's network"
    );
    assert!(
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_millis(300))
            .is_err(),
        "nor in the agent's own namespace"
    );
}

#[test]
fn a_control_port_that_is_also_a_redirected_port_is_refused_before_attaching() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[]);
    let mut agent = Agent::spawn(
        &["--pid".into(), pod.pid().to_string()],
        &[
            "--token-sha256",
            &podmotion_attach::jobenv::token_verifier(TOKEN),
            "--control-port",
            &APP_PORT.to_string(),
        ],
    );
    let status = agent.child.wait().unwrap();
    assert!(!status.success());
    let why = std::fs::read_to_string(&agent.termination_log).unwrap_or_default();
    assert!(
        why.starts_with("ControlPortTaken:"),
        "{why}\n{}",
        agent.stderr()
    );
    let tables = pod.nft_tables();
    assert!(!tables.contains(TABLE), "nothing programmed: {tables}");
}
