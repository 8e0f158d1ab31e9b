//! `podmotion-runner-standin`: a stand-in for the Compass Runner (which does not exist
//! here) in the RunnerPool's DaemonSet. It does what the pod shape is for, from inside
//! the pod, and reports it: opens the KVM device read-write and asks its API version,
//! creates a user namespace and mounts in it (passt's pattern), mounts a fresh /proc in
//! a new user + PID namespace (virtiofsd's sandbox), and records how the device, the
//! user namespace and the confinement look from inside (the seed's R7 questions).
//!
//! The report is printed once as a JSON line on stdout (the pod's log) and served, with
//! the readiness and metrics endpoints the RunnerPool renders, on `COMPASS_METRICS_ADDR`
//! (default `:9090`): `/readyz` answers 200 only when every probe passed, `/metrics` is
//! Prometheus text, `/report` the JSON. `podmotion-runner-standin report` runs the probes
//! again and prints the report (for `kubectl exec`). It exits on SIGTERM.
//!
//! Like the Runner's VMM children, it starts one long-lived child per session
//! (`COMPASS_SESSIONS`), each in a user namespace of its own (passt's pattern): the
//! seed's question whether a container restart strands such processes is answered by
//! restarting the container and looking for them on the node.
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use podmotion_preflight::{
    Check, PROC_PROBE_ARG, PROC_PROBE_INNER_ARG, USERNS_PROBE_ARG, check_capabilities,
    check_host_users, check_kvm, check_proc_mount, check_seccomp, check_userns, kvm,
    proc_probe_inner, proc_probe_outer, userns_probe,
};
use serde::Serialize;

/// Version tag of the report.
const REPORT_VERSION: &str = "standin-v1";
/// Hidden argument: run as one session's stand-in child until killed.
const SESSION_ARG: &str = "--internal-session";

/// A session child: a user namespace of its own (our uid mapped to root in it), then
/// nothing until killed; it never exits by itself.
fn session_child() -> Result<(), String> {
    use nix::sched::{CloneFlags, unshare};
    let (uid, gid) = (nix::unistd::getuid(), nix::unistd::getgid());
    unshare(CloneFlags::CLONE_NEWUSER).map_err(|e| format!("unshare(CLONE_NEWUSER): {e}"))?;
    std::fs::write("/proc/self/setgroups", "deny").map_err(|e| format!("setgroups: {e}"))?;
    std::fs::write("/proc/self/uid_map", format!("0 {uid} 1"))
        .map_err(|e| format!("uid_map: {e}"))?;
    std::fs::write("/proc/self/gid_map", format!("0 {gid} 1"))
        .map_err(|e| format!("gid_map: {e}"))?;
    loop {
        std::thread::park();
    }
}

#[derive(Serialize)]
struct Facts {
    /// uid:gid of this process.
    ids: String,
    /// `/proc/self/uid_map` and `gid_map`, one mapping per line joined by ", ".
    uid_map: String,
    gid_map: String,
    /// Owner uid:gid and mode of the KVM device as seen in the container.
    kvm_owner: Option<String>,
    kvm_mode: Option<String>,
    kvm_api_version: Option<i32>,
    /// Whether the credential file (`COMPASS_TOKEN_FILE`) is readable, and its size.
    token_file: String,
    node: String,
    /// PIDs (in the container's PID namespace) of the session children started.
    session_pids: Vec<u32>,
}

#[derive(Serialize)]
struct Report {
    runner: &'static str,
    ok: bool,
    checks: Vec<Check>,
    facts: Facts,
}

fn maps(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| {
            s.lines()
                .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_else(|e| format!("unreadable: {e}"))
}

fn report(exe: &Path) -> Report {
    let device = "/dev/kvm";
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let meta = std::fs::metadata(device).ok();
    let api = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .ok()
        .and_then(|f| kvm::api_version(&f).ok());
    let token_file = match std::env::var("COMPASS_TOKEN_FILE") {
        Err(_) => "COMPASS_TOKEN_FILE not set".to_string(),
        Ok(p) => match std::fs::read(&p) {
            Ok(b) => format!("{p}: readable, {} bytes", b.len()),
            Err(e) => format!("{p}: {e}"),
        },
    };
    let checks = vec![
        check_kvm(device),
        check_userns(exe),
        check_proc_mount(exe),
        check_host_users(&std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default()),
        check_seccomp(&status),
        check_capabilities(&status),
    ];
    Report {
        runner: REPORT_VERSION,
        ok: checks.iter().all(|c| c.ok),
        checks,
        facts: Facts {
            ids: format!("{}:{}", nix::unistd::getuid(), nix::unistd::getgid()),
            uid_map: maps("/proc/self/uid_map"),
            gid_map: maps("/proc/self/gid_map"),
            kvm_owner: meta.as_ref().map(|m| format!("{}:{}", m.uid(), m.gid())),
            kvm_mode: meta
                .as_ref()
                .map(|m| format!("{:04o}", m.permissions().mode() & 0o7777)),
            kvm_api_version: api,
            token_file,
            node: std::env::var("NODE_NAME").unwrap_or_default(),
            session_pids: vec![],
        },
    }
}

fn metrics(r: &Report) -> String {
    let mut out = String::from(
        "# HELP podmotion_runner_standin_probe_ok 1 when the in-pod probe passed.\n\
         # TYPE podmotion_runner_standin_probe_ok gauge\n",
    );
    for c in &r.checks {
        out.push_str(&format!(
            "podmotion_runner_standin_probe_ok{{probe=\"{}\"}} {}\n",
            c.name,
            u8::from(c.ok)
        ));
    }
    out.push_str(&format!(
        "# HELP podmotion_runner_standin_kvm_api_version KVM_GET_API_VERSION from inside the pod.\n\
         # TYPE podmotion_runner_standin_kvm_api_version gauge\n\
         podmotion_runner_standin_kvm_api_version {}\n",
        r.facts.kvm_api_version.unwrap_or(0)
    ));
    out
}

fn answer(mut s: TcpStream, ready: bool, report_json: &str, metrics_text: &str) {
    let mut line = String::new();
    if BufReader::new(&s).read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    let (code, ctype, body) = match path {
        "/readyz" | "/healthz" | "/livez" if ready => ("200 OK", "text/plain", "ok\n"),
        "/readyz" | "/healthz" | "/livez" => (
            "503 Service Unavailable",
            "text/plain",
            "a probe failed: see /report\n",
        ),
        "/metrics" => ("200 OK", "text/plain; version=0.0.4", metrics_text),
        "/report" => ("200 OK", "application/json", report_json),
        _ => ("404 Not Found", "text/plain", "not found\n"),
    };
    let _ = write!(
        s,
        "HTTP/1.1 {code}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn listen_addr() -> String {
    let a = std::env::var("COMPASS_METRICS_ADDR").unwrap_or_else(|_| ":9090".into());
    match a.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => a,
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    if let Some(code) = run_probe(&args, &exe) {
        return code;
    }
    let serve = match args.first().map(String::as_str) {
        Some("report") => false,
        None => true,
        Some(other) => {
            eprintln!("usage: podmotion-runner-standin [report] (unknown {other:?})");
            return ExitCode::from(2);
        }
    };
    let mut r = report(&exe);
    if serve {
        start_sessions(&exe, &mut r);
    }
    let json = serde_json::to_string(&r).expect("the report serializes");
    println!("{json}");
    if !serve {
        return ExitCode::SUCCESS;
    }
    serve_until_terminated(&r, json)
}

/// A probe or session child of this binary (its first argument names it): its exit
/// code, `None` when this is neither.
fn run_probe(args: &[String], exe: &Path) -> Option<ExitCode> {
    let result = match args.first().map(String::as_str) {
        Some(USERNS_PROBE_ARG) => userns_probe(),
        Some(PROC_PROBE_ARG) => proc_probe_outer(exe),
        Some(PROC_PROBE_INNER_ARG) => proc_probe_inner(),
        Some(SESSION_ARG) => session_child(),
        _ => return None,
    };
    Some(match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    })
}

/// Starts one session child per `COMPASS_SESSIONS` (at most 64), recording their pids.
fn start_sessions(exe: &Path, r: &mut Report) {
    let sessions: usize = std::env::var("COMPASS_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    for _ in 0..sessions.min(64) {
        match std::process::Command::new(exe).arg(SESSION_ARG).spawn() {
            Ok(c) => r.facts.session_pids.push(c.id()),
            Err(e) => eprintln!("starting a session child: {e}"),
        }
    }
}

/// Serves the readiness, metrics and report endpoints until SIGTERM or SIGINT.
fn serve_until_terminated(r: &Report, json: String) -> ExitCode {
    // SIGTERM (the kubelet stopping the pod) is taken by sigwait below: blocked here,
    // before any thread starts, so that every thread inherits the mask.
    let mut term = nix::sys::signal::SigSet::empty();
    term.add(nix::sys::signal::Signal::SIGTERM);
    term.add(nix::sys::signal::Signal::SIGINT);
    if let Err(e) = term.thread_block() {
        eprintln!("blocking SIGTERM: {e}");
        return ExitCode::FAILURE;
    }
    let addr = listen_addr();
    let listener = match TcpListener::bind(&addr) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("listen on {addr}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shared = Arc::new((r.ok, json, metrics(r)));
    std::thread::spawn(move || {
        for s in listener.incoming().flatten() {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || answer(s, shared.0, &shared.1, &shared.2));
        }
    });
    match term.wait() {
        Ok(sig) => eprintln!("{sig}: exiting"),
        Err(e) => eprintln!("sigwait: {e}"),
    }
    ExitCode::SUCCESS
}
