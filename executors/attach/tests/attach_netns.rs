//! The attach executor against a real target "pod" (a process serving HTTP in its
//! own network namespace), as root, on this machine's kernel.

mod common;

use common::*;
use nix::sys::signal::Signal;
use podmotion_attach::netns::NetnsExecutor;
use podmotion_attach::nft::{Redirect, Ruleset};
use std::io::{BufRead, Read, Write};
use std::time::Duration;

fn target(pod: &NetnsPod) -> Vec<String> {
    vec!["--pid".into(), pod.pid().to_string()]
}

fn expected_ruleset() -> String {
    Ruleset {
        table: TABLE.into(),
        agent_gid: AGENT_GID,
        redirects: vec![Redirect {
            port: APP_PORT,
            to: AGENT_PORT,
        }],
    }
    .expected_listing()
}

#[test]
fn attached_agent_reads_env_in_order_and_serves_files_through_exports() {
    if !root_tests_enabled() {
        return;
    }
    // A non-root application: its /proc files are 0400 and owned by uid 1000, so the
    // agent reads them only with the Job's capabilities (it runs with exactly those).
    let pod = NetnsPod::start_as(
        1000,
        &[
            ("ZED", "z1"),
            ("A", "1"),
            ("ZED", "z2"),
            ("SKIP_ME", "x"),
            ("URL", "http://x/?a=b"),
            ("EMPTY", ""),
        ],
    );
    let agent = Agent::start(
        &target(&pod),
        &[
            "--export",
            pod.www.to_str().unwrap(),
            "--env-exclude",
            "SKIP_*",
            "--env-prefix",
            "T_",
        ],
    );

    let status = std::fs::read_to_string(format!("/proc/{}/status", pod.pid())).unwrap();
    assert!(
        status.lines().any(|l| l.starts_with("Uid:\t1000")),
        "{status}"
    );
    // The kernel holds the block as given (the fixture is not deduplicating)…
    let raw = std::fs::read(format!("/proc/{}/environ", pod.pid())).unwrap();
    assert_eq!(
        raw,
        b"ZED=z1\0A=1\0ZED=z2\0SKIP_ME=x\0URL=http://x/?a=b\0EMPTY=\0"
    );
    // …and the agent reports it in that order, duplicates kept, filtered and prefixed.
    let env = agent.json("/v1/env");
    let got: Vec<String> = env
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
    assert_eq!(
        got,
        [
            "T_ZED=z1",
            "T_A=1",
            "T_ZED=z2",
            "T_URL=http://x/?a=b",
            "T_EMPTY="
        ]
    );

    // Files: the export link resolves in the target's mount namespace.
    let exports = agent.json("/v1/exports");
    let link = exports["exports"][0]["link"].as_str().unwrap().to_owned();
    let secret =
        std::fs::read_to_string(std::path::Path::new(&link).join("sub/secret.txt")).unwrap();
    assert_eq!(
        secret,
        std::fs::read_to_string(pod.www.join("sub/secret.txt")).unwrap()
    );
    // The link goes through the agent's pin of the target, never the target's PID.
    let target = std::fs::read_link(&link).unwrap().display().to_string();
    let through_pin = format!("/proc/{}/fd/", agent.child.id());
    assert!(
        target.starts_with(&through_pin)
            && target.ends_with(&format!("/root{}", pod.www.display())),
        "{target}"
    );
    assert!(
        exports["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["mount_point"] == "/"),
        "target mounts listed: {exports}"
    );

    // The ruleset is what the config says, and the app still answers through it.
    assert_eq!(pod.nft_table(), expected_ruleset());
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
    assert!(pod.get_as_agent_gid_from_inside().contains("hello-app"));
}

#[test]
fn intercept_delivers_connections_to_the_client_stream_and_stopping_it_restores_the_app() {
    if !root_tests_enabled() {
        return;
    }
    let mut pod = NetnsPod::start(&[("A", "1")]);
    let app_pid = pod.pid();
    let agent = Agent::start(&target(&pod), &[]);

    let (status, body) = agent.call("POST", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 201, "{body}");
    let (status, _) = agent.call("POST", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 409, "a second intercept of the same port conflicts");

    let mut stream = agent.stream(&format!("/v1/intercepts/{APP_PORT}/accept"));
    let mut client = pod.client_connect(pod.app_addr()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client
        .write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();

    let mut head = String::new();
    stream.read_line(&mut head).unwrap();
    let head: serde_json::Value = serde_json::from_str(&head).unwrap();
    assert_eq!(head["original_dst"], pod.app_addr().to_string(), "{head}");
    let peer: std::net::SocketAddr = head["peer"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        peer.ip().to_string(),
        pod.client_ip,
        "the real client, not the agent"
    );
    let mut req = [0u8; 16];
    stream.read_exact(&mut req).unwrap();
    assert_eq!(&req, b"GET / HTTP/1.0\r\n");
    stream
        .get_mut()
        .write_all(b"HTTP/1.0 200 OK\r\n\r\nfrom-the-client")
        .unwrap();
    drop(stream);
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    assert!(answer.ends_with("from-the-client"), "{answer}");

    // The application itself is untouched: same process, still serving.
    assert!(pod.app_alive());
    assert_eq!(pod.pid(), app_pid);
    assert!(pod.get_as_agent_gid_from_inside().contains("hello-app"));

    let (status, _) = agent.call("DELETE", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 200);
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
    assert_eq!(agent.json("/healthz")["ports"][0]["intercepted"], false);
}

/// `GET /metrics` of an agent's metrics port: the text.
fn scrape(addr: std::net::SocketAddr) -> String {
    let s = std::net::TcpStream::connect(addr).unwrap();
    let out = http_get(s, "/metrics").unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

/// The value of `series` (`name{labels}` as served) in a scrape.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} not served:\n{text}"))
}

#[test]
fn the_agents_metrics_count_real_redirected_connections_by_mode_and_outcome() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[]);
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let agent = Agent::start(&target(&pod), &["--metrics-listen", &metrics.to_string()]);
    let text = scrape(metrics);
    assert_eq!(sample(&text, "podmotion_attach_ruleset_installed"), 1.0);
    assert_eq!(sample(&text, "podmotion_attach_redirected_ports"), 1.0);

    // Passed through: the application answers.
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
    // Intercepted: a client stream takes it.
    let (status, body) = agent.call("POST", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 201, "{body}");
    let mut stream = agent.stream(&format!("/v1/intercepts/{APP_PORT}/accept"));
    let mut client = pod.client_connect(pod.app_addr()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut head = String::new();
    stream.read_line(&mut head).unwrap();
    let mut req = [0u8; 18];
    stream.read_exact(&mut req).unwrap();
    let text = scrape(metrics);
    assert_eq!(
        sample(&text, r#"podmotion_attach_intercepts{kind="whole"}"#),
        1.0
    );
    drop(stream);
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    let (status, _) = agent.call("DELETE", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 200);

    let ended = |text: &str, mode: &str, outcome: &str| {
        sample(
            text,
            &format!(
                r#"podmotion_attach_connections_ended_total{{mode="{mode}",outcome="{outcome}"}}"#
            ),
        )
    };
    let mut text = String::new();
    // The pass-through's end is counted once both sides closed.
    let counted = wait_for(Duration::from_secs(10), || {
        text = scrape(metrics);
        ended(&text, "passthrough", "forwarded") >= 1.0
    });
    assert!(counted.is_ok(), "{text}");
    assert_eq!(ended(&text, "intercept", "delivered"), 1.0, "{text}");
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_connections_accepted_total{mode="passthrough"}"#
        ),
        1.0
    );
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_connections_accepted_total{mode="intercept"}"#
        ),
        1.0
    );
    // "GET / HTTP/1.0\r\nHost: x\r\n\r\n" (27 bytes) passed through, 18 intercepted.
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_connection_bytes_total{mode="passthrough",direction="from_peer"}"#
        ),
        27.0
    );
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_connection_bytes_total{mode="intercept",direction="from_peer"}"#
        ),
        18.0
    );
    assert_eq!(
        sample(&text, r#"podmotion_attach_intercepts{kind="whole"}"#),
        0.0
    );
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_api_requests_total{route="intercepts",code="201"}"#
        ),
        1.0
    );
    drop(agent);
}

/// Reads one HTTP response framed by Content-Length: (head, body).
fn read_response(r: &mut std::io::BufReader<std::net::TcpStream>) -> (String, String) {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "closed; so far {head:?}"
        );
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no Content-Length: {head}"));
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    (head, String::from_utf8(body).unwrap())
}

#[test]
fn filtered_intercept_routes_each_request_of_a_keep_alive_connection_by_its_header() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let agent = Agent::start(&target(&pod), &[]);
    let filter = r#"{"headers":[{"name":"X-Dev","value":"me"}]}"#;
    let mut c = std::net::TcpStream::connect(agent.control).unwrap();
    write!(
        c,
        "POST /v1/intercepts/{APP_PORT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{filter}",
        filter.len()
    )
    .unwrap();
    let mut answer = String::new();
    c.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert!(
        answer.contains(r#""headers":[{"name":"X-Dev","value":"me"}]"#),
        "{answer}"
    );
    assert_eq!(
        agent.json("/healthz")["ports"][0]["filter"][0]["name"],
        "X-Dev"
    );
    let mut stream = agent.stream(&format!("/v1/intercepts/{APP_PORT}/accept"));

    // One keep-alive connection from outside the pod, three requests.
    let caller = pod.client_connect(pod.app_addr()).unwrap();
    caller
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut w = caller.try_clone().unwrap();
    let mut r = std::io::BufReader::new(caller);
    // Matching, with a body: the client stream gets exactly this request.
    w.write_all(b"POST /mine HTTP/1.1\r\nHost: x\r\nx-dev: me\r\nContent-Length: 4\r\n\r\nping")
        .unwrap();
    let mut meta = String::new();
    stream.read_line(&mut meta).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    assert_eq!(meta["original_dst"], pod.app_addr().to_string(), "{meta}");
    let read_request = |stream: &mut std::io::BufReader<std::net::TcpStream>| {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            stream.read_line(&mut line).unwrap();
            head.push_str(&line);
            if line == "\r\n" {
                break head;
            }
        }
    };
    let head = read_request(&mut stream);
    assert!(head.starts_with("POST /mine HTTP/1.1\r\n"), "{head}");
    let mut body = [0u8; 4];
    stream.read_exact(&mut body).unwrap();
    assert_eq!(&body, b"ping");
    stream
        .get_mut()
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\nfrom-client")
        .unwrap();
    assert_eq!(read_response(&mut r).1, "from-client");
    // Matching again on the same connection: the same client stream, next request.
    w.write_all(b"GET /mine/2 HTTP/1.1\r\nHost: x\r\nX-Dev: me\r\n\r\n")
        .unwrap();
    let head = read_request(&mut stream);
    assert!(head.starts_with("GET /mine/2 HTTP/1.1\r\n"), "{head}");
    stream
        .get_mut()
        .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nclient-2")
        .unwrap();
    assert_eq!(read_response(&mut r).1, "client-2");
    // Not matching, on the same connection: the application answers (busybox httpd
    // says `Connection: close`, so the connection ends after its response).
    w.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Dev: someone-else\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut r).1, "hello-app\n");
    let mut rest = String::new();
    r.read_to_string(&mut rest).unwrap();
    assert_eq!(
        rest, "",
        "the connection ended after the app's Connection: close"
    );
    // HTTP/1.0 without the header on a fresh connection: the app, then the end.
    assert!(pod.client_get("/").unwrap().contains("hello-app"));

    let (status, _) = agent.call("DELETE", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 200);
    assert_eq!(
        agent.json("/healthz")["ports"][0]["filter"],
        serde_json::Value::Null
    );
}

#[test]
fn wiretap_copies_both_directions_while_the_app_still_answers() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let agent = Agent::start(&target(&pod), &[]);
    let (status, body) = agent.call("POST", &format!("/v1/wiretaps/{APP_PORT}"));
    assert_eq!(status, 201, "{body}");
    let id = body["id"].as_u64().unwrap();
    let mut tap = agent.stream(&format!("/v1/wiretaps/{APP_PORT}/{id}/stream"));

    let answer = pod.client_get("/index.html").unwrap();
    assert!(answer.contains("hello-app"), "the app answered: {answer}");

    let (mut to_app, mut from_app, mut kinds) = (Vec::new(), Vec::new(), Vec::new());
    while !kinds.contains(&3u8) {
        let mut hdr = [0u8; 9];
        tap.read_exact(&mut hdr).unwrap();
        let len = u32::from_be_bytes(hdr[5..9].try_into().unwrap()) as usize;
        let mut payload = vec![0u8; len];
        tap.read_exact(&mut payload).unwrap();
        kinds.push(hdr[0]);
        match hdr[0] {
            0 => assert!(String::from_utf8_lossy(&payload).contains(&pod.app_addr().to_string())),
            1 => to_app.extend(payload),
            2 => from_app.extend(payload),
            _ => {}
        }
    }
    assert!(String::from_utf8_lossy(&to_app).starts_with("GET /index.html HTTP/1.0"));
    assert!(String::from_utf8_lossy(&from_app).contains("hello-app"));

    let (status, _) = agent.call("DELETE", &format!("/v1/wiretaps/{APP_PORT}/{id}"));
    assert_eq!(status, 200);
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
}

fn killing_the_agent_leaves_no_table(sig: Signal) {
    let pod = NetnsPod::start(&[("A", "1")]);
    let mut agent = Agent::start(&target(&pod), &[]);
    assert!(pod.nft_tables().contains(TABLE));
    agent.signal(sig);
    let status = agent.child.wait().unwrap();
    if sig == Signal::SIGTERM {
        assert!(
            status.success(),
            "orderly exit on SIGTERM: {}",
            agent.stderr()
        );
    }
    // SIGKILL runs no code of ours: the kernel drops the owner-flagged table when
    // the dead process's netlink socket is released.
    let gone = wait_for(Duration::from_secs(5), || !pod.nft_tables().contains(TABLE));
    assert!(
        gone.is_ok(),
        "table left behind after {sig}: {}",
        pod.nft_tables()
    );
    // With the table gone the app is reached directly (no redirect to a dead port).
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
}

#[test]
fn sigterm_removes_the_table() {
    if root_tests_enabled() {
        killing_the_agent_leaves_no_table(Signal::SIGTERM);
    }
}

#[test]
fn sigkill_removes_the_table() {
    if root_tests_enabled() {
        killing_the_agent_leaves_no_table(Signal::SIGKILL);
    }
}

#[test]
fn a_second_agent_waits_for_the_first_and_converges_on_the_same_ruleset() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let first = Agent::start(&target(&pod), &[]);
    let ruleset_first = pod.nft_table();
    assert_eq!(ruleset_first, expected_ruleset());

    // The successor cannot take over a table owned by a live agent: it waits.
    let mut second = Agent::spawn(&target(&pod), &[]);
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        common::get(second.control, "/healthz").is_err(),
        "second agent must not be serving yet"
    );
    assert!(
        second.child.try_wait().unwrap().is_none(),
        "second agent waits: {}",
        second.stderr()
    );

    first.signal(Signal::SIGKILL);
    second.wait_ready(Duration::from_secs(20));
    assert_eq!(pod.nft_table(), ruleset_first);
    assert!(
        second.stderr().contains("waiting for the previous agent"),
        "{}",
        second.stderr()
    );
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
    drop(first);
}

#[test]
fn user_namespaced_target_is_rejected_with_a_clear_error() {
    if !root_tests_enabled() {
        return;
    }
    let mut target_proc = common::tool("unshare")
        .args([
            "--user",
            "--map-root-user",
            "--net",
            "busybox",
            "sleep",
            "60",
        ])
        .spawn()
        .unwrap();
    // Wait until the child has switched namespaces (unshare execs busybox after).
    let pid = target_proc.id();
    let own = std::fs::metadata("/proc/self/ns/user")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    wait_for(Duration::from_secs(5), || {
        std::fs::metadata(format!("/proc/{pid}/ns/user"))
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m) != own)
            .unwrap_or(false)
    })
    .unwrap();
    let (mut cmd, _, _, log, _) =
        agent_cmd(Some(AGENT_GID), &["--pid".into(), pid.to_string()], &[]);
    let status = cmd.status().unwrap();
    let _ = target_proc.kill();
    let _ = target_proc.wait();
    assert!(!status.success());
    let msg = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(log.parent().unwrap());
    assert!(msg.starts_with("UserNamespacedTarget:"), "{msg}");
    assert!(msg.contains("packet-mark"), "{msg}");
}

#[test]
fn agent_refuses_to_run_without_the_agent_gid() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let (mut cmd, _, _, log, _) = agent_cmd(None, &target(&pod), &[]);
    assert!(!cmd.status().unwrap().success());
    let msg = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_dir_all(log.parent().unwrap());
    assert!(msg.starts_with("WrongAgentGid:"), "{msg}");
    assert!(!pod.nft_tables().contains(TABLE), "nothing programmed");
}

fn thread_netns(tid: i32) -> u64 {
    std::fs::metadata(format!("/proc/self/task/{tid}/ns/net"))
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap()
}

#[test]
fn netns_worker_restores_its_namespace_and_a_thread_whose_restore_fails_is_retired() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let pod_ns = NetnsPod::ns_path(&pod.pod_ns);
    let pod_ino = std::fs::metadata(&pod_ns)
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let own_ino = std::fs::metadata("/proc/self/ns/net")
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    let inside = || {
        let tid = nix::unistd::gettid().as_raw();
        Ok((tid, thread_netns(tid)))
    };

    let ex = NetnsExecutor::open(&pod_ns).unwrap();
    let (t1, ns1) = ex.run_blocking(inside).unwrap();
    assert_eq!(ns1, pod_ino, "job runs inside the target namespace");
    wait_for(Duration::from_secs(2), || thread_netns(t1) == own_ino).expect("worker restored");
    let (t2, _) = ex.run_blocking(inside).unwrap();
    assert_eq!(t1, t2, "a healthy worker is reused");

    // Restore into something that is not a namespace: every restore fails.
    let bogus = std::os::fd::OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
    let ex = NetnsExecutor::with_restore(&pod_ns, bogus).unwrap();
    let (a, _) = ex.run_blocking(inside).unwrap();
    let (b, ns_b) = ex.run_blocking(inside).unwrap();
    assert_ne!(a, b, "the thread whose restore failed was not reused");
    assert_eq!(ns_b, pod_ino);
}

#[test]
fn ruleset_apply_is_an_idempotent_full_replace_and_a_foreign_session_is_refused() {
    use podmotion_attach::nft::{NftError, NftSession};
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let ex = NetnsExecutor::open(&NetnsPod::ns_path(&pod.pod_ns)).unwrap();
    let open = || NftSession::open_here().map_err(|e| std::io::Error::other(e.to_string()));
    let mine = ex.run_blocking(open).unwrap();
    let two_ports = Ruleset {
        table: TABLE.into(),
        agent_gid: AGENT_GID,
        redirects: vec![
            Redirect {
                port: 8080,
                to: 15001,
            },
            Redirect {
                port: 9090,
                to: 15002,
            },
        ],
    };
    mine.apply(&two_ports).unwrap();
    let first = pod.nft_table();
    assert_eq!(first, two_ports.expected_listing());
    mine.apply(&two_ports).unwrap();
    assert_eq!(
        pod.nft_table(),
        first,
        "re-applying the same config changes nothing"
    );

    let one_port = Ruleset {
        redirects: vec![Redirect {
            port: 8080,
            to: 15001,
        }],
        ..two_ports.clone()
    };
    mine.apply(&one_port).unwrap();
    let replaced = pod.nft_table();
    assert_eq!(replaced, one_port.expected_listing());
    assert!(
        !replaced.contains("9090"),
        "full replace drops rules no longer configured"
    );

    // Another socket cannot touch a table owned by a live one, and its delete
    // leaves it alone.
    let other = ex.run_blocking(open).unwrap();
    match other.apply(&two_ports) {
        Err(NftError::HeldByOther { owner, .. }) => assert_eq!(owner, mine.port_id().unwrap()),
        r => panic!("expected HeldByOther, got {r:?}"),
    }
    other.delete(TABLE).unwrap();
    assert_eq!(pod.nft_table(), replaced);
    // Not even a ruleset flush by another process (e.g. `nft flush ruleset` from an
    // init script in the pod) removes an owned table.
    common::run(common::tool("ip").args(["netns", "exec", &pod.pod_ns, "nft", "flush", "ruleset"]));
    assert_eq!(pod.nft_table(), replaced);

    // Closing the owner's socket removes the table; the other one can then apply.
    drop(mine);
    wait_for(Duration::from_secs(3), || !pod.nft_tables().contains(TABLE))
        .expect("owner close removes table");
    other.apply(&two_ports).unwrap();
    assert_eq!(pod.nft_table(), first);
    other.delete(TABLE).unwrap();
    assert!(!pod.nft_tables().contains(TABLE));
    other.delete(TABLE).unwrap(); // absent is fine
}

#[test]
fn ipv6_connections_are_redirected_and_passed_through_or_intercepted() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let agent = Agent::start(&target(&pod), &[]);
    // Pass-through over IPv6: forwarder on [::]:AGENT_PORT, original destination
    // from IP6T_SO_ORIGINAL_DST, dial from inside the namespace.
    let via6 = http_get(pod.client_connect(pod.app_addr6()).unwrap(), "/").unwrap();
    assert!(via6.contains("hello-app"), "{via6}");

    let (status, _) = agent.call("POST", &format!("/v1/intercepts/{APP_PORT}"));
    assert_eq!(status, 201);
    let mut stream = agent.stream(&format!("/v1/intercepts/{APP_PORT}/accept"));
    let mut client = pod.client_connect(pod.app_addr6()).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut head = String::new();
    stream.read_line(&mut head).unwrap();
    let head: serde_json::Value = serde_json::from_str(&head).unwrap();
    assert_eq!(head["original_dst"], pod.app_addr6().to_string());
    stream
        .get_mut()
        .write_all(b"HTTP/1.0 200 OK\r\n\r\nv6-intercepted")
        .unwrap();
    drop(stream);
    let mut answer = String::new();
    client.read_to_string(&mut answer).unwrap();
    assert!(answer.ends_with("v6-intercepted"), "{answer}");
}

#[test]
fn agent_removes_its_table_and_exits_when_the_target_process_ends() {
    if !root_tests_enabled() {
        return;
    }
    let mut pod = NetnsPod::start(&[("A", "1")]);
    let mut agent = Agent::start(&target(&pod), &[]);
    assert!(pod.nft_tables().contains(TABLE));
    pod.app.kill().unwrap();
    pod.app.wait().unwrap();
    let mut status = None;
    wait_for(Duration::from_secs(10), || {
        status = agent.child.try_wait().unwrap();
        status.is_some()
    })
    .expect("agent exits after its target");
    assert!(
        !status.unwrap().success(),
        "a gone target is a failure: the Job is replaced, not reused"
    );
    assert!(
        std::fs::read_to_string(&agent.termination_log)
            .unwrap()
            .starts_with("TargetGone:")
    );
    assert!(!pod.nft_tables().contains(TABLE));
}

#[test]
fn agent_in_its_own_job_pod_namespace_serves_the_api_there_and_forwards_in_the_target() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    // The Job pod's own network namespace, with loopback only.
    let job_ns = format!("{}-job", pod.pod_ns);
    common::run(common::tool("ip").args(["netns", "add", &job_ns]));
    common::run(common::tool("ip").args(["-n", &job_ns, "link", "set", "lo", "up"]));
    struct DelNs(String);
    impl Drop for DelNs {
        fn drop(&mut self) {
            let _ = common::tool("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _job_ns_guard = DelNs(job_ns.clone());

    let (cmd, control, exports, log, stderr) = agent_cmd(Some(AGENT_GID), &target(&pod), &[]);
    // Same command, started inside the Job namespace.
    let mut wrapped = common::tool("ip");
    wrapped
        .args(["netns", "exec", &job_ns])
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        if let Some(v) = v {
            wrapped.env(k, v);
        }
    }
    wrapped.stderr(std::fs::File::create(&stderr).unwrap());
    let mut agent = Agent::spawn_from((wrapped, control, exports, log, stderr), None);

    let job = NetnsExecutor::open(&NetnsPod::ns_path(&job_ns)).unwrap();
    let connect = |port: u16| {
        job.run_blocking(move || {
            std::net::TcpStream::connect_timeout(
                &([127, 0, 0, 1], port).into(),
                Duration::from_secs(2),
            )
        })
    };
    let http = |method: &str, path: &str| -> String {
        let mut s = connect(control.port()).expect("control API in the job namespace");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    wait_for(Duration::from_secs(20), || {
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "agent exited: {}",
            agent.stderr()
        );
        connect(control.port()).is_ok()
    })
    .expect("agent ready");
    assert!(http("GET", "/healthz").starts_with("HTTP/1.1 200"));
    // Not in the root namespace…
    assert!(std::net::TcpStream::connect_timeout(&control, Duration::from_millis(300)).is_err());
    // …and the forwarder is in the target, not in the agent's own namespace: the
    // netns thread went back to the Job namespace, not to the root one.
    assert!(
        connect(AGENT_PORT).is_err(),
        "no forwarder in the job namespace"
    );
    assert!(
        pod.client_get("/").unwrap().contains("hello-app"),
        "pass-through in the target"
    );
    assert!(http("POST", &format!("/v1/intercepts/{APP_PORT}")).starts_with("HTTP/1.1 201"));
    assert!(http("DELETE", &format!("/v1/intercepts/{APP_PORT}")).starts_with("HTTP/1.1 200"));
    agent.signal(Signal::SIGTERM);
    assert!(agent.child.wait().unwrap().success(), "{}", agent.stderr());
    assert!(!pod.nft_tables().contains(TABLE));
}

#[test]
fn exports_dir_can_be_a_mount_point_like_the_jobs_empty_dir() {
    if !root_tests_enabled() {
        return;
    }
    let base = std::env::temp_dir().join(format!("pmt-exports-mnt-{}", std::process::id()));
    let dir = base.join("exports");
    std::fs::create_dir_all(&dir).unwrap();
    common::run(
        common::tool("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&dir),
    );
    let me = std::process::id();
    let root = std::path::PathBuf::from(format!("/proc/{me}/root"));
    let first =
        podmotion_attach::exports::populate(&dir, &root, &["/etc".into(), "/usr/share".into()]);
    let second = podmotion_attach::exports::populate(&dir, &root, &["/usr/share".into()]);
    let stale = std::fs::symlink_metadata(dir.join("etc")).is_ok();
    let share = std::fs::read_link(dir.join("usr/share")).ok();
    common::run(common::tool("umount").arg(&dir));
    std::fs::remove_dir_all(&base).unwrap();
    assert!(first.is_ok() && second.is_ok(), "{first:?} {second:?}");
    assert!(!stale, "stale link removed");
    assert_eq!(
        share.unwrap(),
        std::path::Path::new(&format!("/proc/{me}/root/usr/share"))
    );
}

/// `GET /v1/files?path=…&container=…` (an upgrade): the status and everything the
/// agent sent after the head (the JSON line and the file's bytes, or the error).
fn file_request(agent: &Agent, path: &str, container: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(agent.control).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /v1/files?path={path}&container={container} HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: podmotion-stream\r\n\r\n"
    )
    .unwrap();
    let mut r = std::io::BufReader::new(s);
    let mut head = String::new();
    while !head.ends_with("\r\n\r\n") {
        assert!(r.read_line(&mut head).unwrap() > 0, "{head}");
    }
    let status: u16 = head[9..12].parse().unwrap();
    let mut body = String::new();
    if status == 101 {
        r.read_to_string(&mut body).unwrap();
    } else {
        let len: usize = head
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or(0);
        let mut b = vec![0u8; len];
        r.read_exact(&mut b).unwrap();
        body = String::from_utf8_lossy(&b).into_owned();
    }
    (status, body)
}

/// A root that is recognisably its own: a directory holding a static busybox and
/// `/marker` with `marker`.
fn make_root(dir: &std::path::Path, marker: &str) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(which("busybox").unwrap(), dir.join("busybox")).unwrap();
    std::fs::write(dir.join("marker"), marker).unwrap();
}

/// A process chrooted into `dir` (made by [`make_root`]).
fn chrooted(dir: &std::path::Path) -> std::process::Command {
    let mut c = tool("chroot");
    c.arg(dir).args(["/busybox", "sleep", "60"]);
    c.stdin(std::process::Stdio::null());
    c
}

fn root_is(pid: u32, dir: &std::path::Path) -> bool {
    std::fs::read_link(format!("/proc/{pid}/root")).is_ok_and(|r| r == dir)
}

/// Makes the kernel give `pid` to the next process it creates: `ns_last_pid` is set
/// to the number before it right before spawning. Another process on the machine may
/// take the number in between, so this retries; it never settles for another PID.
fn spawn_with_pid(pid: u32, mut cmd: impl FnMut() -> std::process::Command) -> std::process::Child {
    for _ in 0..500 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
        let mut c = cmd().spawn().unwrap();
        if c.id() == pid {
            return c;
        }
        let _ = c.kill();
        let _ = c.wait();
    }
    panic!("the kernel never handed out pid {pid} again");
}

#[test]
fn a_file_request_for_an_exited_container_fails_even_when_its_pid_went_to_another_process() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[("A", "1")]);
    let base = std::env::temp_dir().join(format!("pmt-reuse-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    // The secondary container: a process in the pod's network namespace, in a root of
    // its own.
    let sidecar_root = base.join("sidecar");
    let mut sidecar = {
        let mut c = tool("ip");
        make_root(&sidecar_root, "sidecar-file");
        c.args(["netns", "exec", &pod.pod_ns])
            .arg("chroot")
            .arg(&sidecar_root);
        c.args(["/busybox", "sleep", "60"])
            .stdin(std::process::Stdio::null());
        c.spawn().unwrap()
    };
    let pid = sidecar.id();
    wait_for(Duration::from_secs(5), || root_is(pid, &sidecar_root)).expect("sidecar chrooted");
    let agent = Agent::start(&["--pid".into(), format!("{},{pid}", pod.pid())], &[]);
    let container = format!("pid%3A%2F%2F{pid}");
    let (status, body) = file_request(&agent, "/marker", &container);
    assert_eq!(status, 101, "{body}");
    assert!(body.ends_with("sidecar-file"), "{body}");

    // The sidecar exits; a process of the node (here: a root of its own with a
    // secret) gets its PID.
    sidecar.kill().unwrap();
    sidecar.wait().unwrap();
    let node_root = base.join("node");
    make_root(&node_root, "node-secret");
    let mut node = spawn_with_pid(pid, || chrooted(&node_root));
    wait_for(Duration::from_secs(5), || root_is(pid, &node_root)).expect("node process chrooted");

    let (status, body) = file_request(&agent, "/marker", &container);
    assert!(
        !body.contains("node-secret"),
        "the node's file was served: {body}"
    );
    assert_eq!(status, 410, "{body}");
    assert!(body.contains("has exited"), "{body}");
    // The primary container is still served, and /healthz says which one is gone.
    let health = agent.json("/healthz");
    let running: Vec<bool> = health["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["running"].as_bool().unwrap())
        .collect();
    assert_eq!(running, [true, false], "{health}");
    let _ = node.kill();
    let _ = node.wait();
    let _ = std::fs::remove_dir_all(&base);
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn a_direct_connection_to_the_forwarder_port_is_dropped_not_looped() {
    if !root_tests_enabled() {
        return;
    }
    let pod = NetnsPod::start(&[]);
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let mut agent = Agent::start(&target(&pod), &["--metrics-listen", &metrics.to_string()]);
    let fds_before = open_fds(agent.child.id());
    // Straight to the forwarder's port, which nothing redirected.
    let forwarder: std::net::SocketAddr = format!("{}:{AGENT_PORT}", pod.pod_ip).parse().unwrap();
    let mut direct = pod.client_connect(forwarder).unwrap();
    direct
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = direct.write_all(b"GET / HTTP/1.0\r\n\r\n");
    let mut got = Vec::new();
    // Closed (a reset when our request was still unread), within the timeout.
    let read = direct.read_to_end(&mut got);
    let closed = match &read {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    assert!(
        closed && got.is_empty(),
        "closed at once, unanswered: {read:?} {:?}",
        String::from_utf8_lossy(&got)
    );
    // No chain of connections to itself: the agent runs and holds what it held before.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "the agent died: {}",
        agent.stderr()
    );
    let fds_after = open_fds(agent.child.id());
    assert!(
        fds_after <= fds_before + 4,
        "the agent's descriptors grew from {fds_before} to {fds_after}"
    );
    let text = scrape(metrics);
    assert_eq!(
        sample(
            &text,
            r#"podmotion_attach_errors_total{category="not_redirected"}"#
        ),
        1.0
    );
    // Redirected connections still reach the application.
    assert!(pod.client_get("/").unwrap().contains("hello-app"));
}
