//! A workload that runs as its image's own non-root user (uid 65532, the testload
//! image's `USER`), reached, dumped and restored on this machine's kernel by a root
//! that holds exactly the chart's capabilities (no `CAP_SYS_PTRACE`, and no
//! `CAP_SYS_RESOURCE`, which this machine's bounding set lacks). The agent's whole
//! gRPC flow on a real container (its own mount namespace and /proc, which CRIU's
//! parasite needs for a non-root task) is proven on the real nodes
//! (e2e/tests/real_nonroot.rs); the testbed's workloads share the host's /proc.
//! Run with `cargo test -p podmotion-agent --test nonroot -- --test-threads=1`.
//! `PODMOTION_ROOT_TESTS=0` skips them; otherwise a missing CRIU fails them.

use podmotion_agent::testbed::ask;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

static SERIAL: Mutex<()> = Mutex::new(());

const USER: (u32, u32) = (65532, 65532);

/// The agent's capabilities as the chart's default values list them
/// (`migrationAgent.agent.capabilities`), read from the chart itself.
fn chart_capabilities() -> Vec<String> {
    let values = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../charts/podmotion/values.yaml"
    ))
    .expect("chart values");
    let mut in_agent = false;
    let mut caps = vec![];
    let mut lines = values.lines();
    while let Some(l) = lines.next() {
        if l == "  agent:" {
            in_agent = true;
        } else if in_agent && l == "    capabilities:" {
            for l in lines.by_ref() {
                match l.trim_start().strip_prefix("- ") {
                    Some(c) if l.starts_with("      - ") => caps.push(c.trim().to_string()),
                    _ => break,
                }
            }
            break;
        }
    }
    assert!(
        caps.len() > 5,
        "capabilities not found in values.yaml: {caps:?}"
    );
    assert!(
        caps.iter()
            .all(|c| c != "SYS_PTRACE" && c != "SYS_RESOURCE")
    );
    caps
}

fn uid_of(pid: i32) -> u32 {
    podmotion_agent::creds::owner_of(pid).unwrap().uid
}

/// Where the late `PermissionDenied` of issue 39 came from: the agent's own read of
/// the source's network namespace link, which the kernel allows a caller of another
/// uid only with CAP_SYS_PTRACE. As the chart's agent (root, its capabilities) it is
/// refused; as the process's own user, with the same capabilities, it is allowed.
#[test]
fn the_charts_agent_reads_another_users_namespace_only_as_that_user() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let mut sleeper = Command::new("setpriv")
        .args([
            "--reuid",
            "65532",
            "--regid",
            "65532",
            "--clear-groups",
            "sleep",
            "60",
        ])
        .spawn()
        .unwrap();
    let pid = sleeper.id() as i32;
    while uid_of(pid) != USER.0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    let caps: Vec<String> = chart_capabilities()
        .iter()
        .map(|c| format!("+{}", c.to_lowercase()))
        .collect();
    let as_chart = |args: &[&str]| {
        Command::new("setpriv")
            .arg(format!("--bounding-set=-all,{}", caps.join(",")))
            .arg("--inh-caps=-all")
            .args(args)
            .output()
            .unwrap()
    };
    let link = format!("/proc/{pid}/ns/net");
    let refused = as_chart(&["readlink", "-v", &link]);
    let owner = as_chart(&[
        "setpriv",
        "--reuid",
        "65532",
        "--regid",
        "65532",
        "--clear-groups",
        "readlink",
        &link,
    ]);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("Permission denied"),
        "{refused:?}"
    );
    assert!(owner.status.success(), "{owner:?}");
    assert!(String::from_utf8_lossy(&owner.stdout).starts_with("net:["));
}

/// `args` run by a root whose capabilities are the chart's (the agent's container).
fn as_chart_agent(args: &[&std::ffi::OsStr]) -> std::process::Output {
    let caps: Vec<String> = chart_capabilities()
        .iter()
        .map(|c| format!("+{}", c.to_lowercase()))
        .collect();
    Command::new("setpriv")
        .arg(format!("--bounding-set=-all,{}", caps.join(",")))
        .arg("--inh-caps=-all")
        .args(args)
        .output()
        .unwrap()
}

fn ask_counter(port: u16) -> std::io::Result<u64> {
    let mut s = std::net::TcpStream::connect_timeout(
        &format!("127.0.0.1:{port}").parse().unwrap(),
        Duration::from_secs(2),
    )?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    Ok(ask(&mut s, "get")?.parse().expect("number"))
}

/// The measurement behind the agent's non-root path, on this kernel with CRIU 4.2.1,
/// by a root holding only the chart's capabilities: CRIU as root cannot dump a tree
/// of uid 65532 (it cannot seize it without CAP_SYS_PTRACE); the agent's own launch
/// stage (`podmotion-agent __criu-as-owner`: CRIU as the tree's user, the agent's
/// capabilities kept as ambient ones, `--unprivileged`) dumps it; CRIU as root with
/// the same capabilities restores it; and the restored tree runs as 65532 with its
/// in-memory counter continued.
#[test]
fn a_tree_of_uid_65532_is_dumped_as_its_user_and_restored_with_its_state() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !podmotion_agent::testbed::root_tests_enabled() {
        return;
    }
    let criu = podmotion_agent::testbed::criu_path();
    let agent = env!("CARGO_BIN_EXE_podmotion-agent");
    let port = 20_000 + (std::process::id() % 20_000) as u16;
    let dir = std::env::temp_dir().join(format!("pm-nonroot-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut workload = Command::new("setsid")
        .args([
            "setpriv",
            "--reuid",
            "65532",
            "--regid",
            "65532",
            "--clear-groups",
        ])
        .arg(env!("CARGO_BIN_EXE_podmotion-testload"))
        .args(["serve", &port.to_string(), "4"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let pid = workload.id() as i32;
    let mut before = None;
    for _ in 0..400 {
        if let Ok(c) = ask_counter(port) {
            before = Some(c);
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let before = before.expect("the workload serves");
    assert_eq!(uid_of(pid), USER.0);
    let pid_s = pid.to_string();
    let d = |name: &str| {
        let p = dir.join(name);
        std::fs::create_dir_all(&p).unwrap();
        p
    };
    let (as_root, as_owner) = (d("as-root"), d("as-owner"));
    let os = |s: &str| std::ffi::OsString::from(s);

    // CRIU as root with the chart's capabilities: refused.
    let refused = as_chart_agent(&[
        criu.as_os_str(),
        &os("dump"),
        &os("-t"),
        &os(&pid_s),
        &os("-D"),
        as_root.as_os_str(),
        &os("-o"),
        &os("dump.log"),
        &os("-v4"),
        &os("--leave-running"),
    ]);
    let log = std::fs::read_to_string(as_root.join("dump.log")).unwrap_or_default();
    assert!(!refused.status.success(), "{log}");
    assert!(log.contains("Operation not permitted"), "{log}");
    assert!(running(pid), "a refused dump leaves the tree running");

    // The agent's stage: CRIU as the tree's owner. The tree is dumped and ends.
    let dumped = as_chart_agent(&[
        std::ffi::OsStr::new(agent),
        &os("__criu-as-owner"),
        &os("65532"),
        &os("65532"),
        criu.as_os_str(),
        &os("--unprivileged"),
        &os("dump"),
        &os("-t"),
        &os(&pid_s),
        &os("-D"),
        as_owner.as_os_str(),
        &os("-o"),
        &os("dump.log"),
        &os("-v4"),
    ]);
    let log = std::fs::read_to_string(as_owner.join("dump.log")).unwrap_or_default();
    assert!(dumped.status.success(), "{dumped:?}\n{log}");
    assert!(log.contains("Dumping finished successfully"), "{log}");
    // Reaped, so that its PID is free for the restore.
    workload.wait().unwrap();

    // Restored by CRIU as root with the chart's capabilities (the agent's restore).
    let restored = as_chart_agent(&[
        criu.as_os_str(),
        &os("restore"),
        &os("-D"),
        as_owner.as_os_str(),
        &os("-o"),
        &os("restore.log"),
        &os("-v4"),
        &os("-d"),
    ]);
    let log = std::fs::read_to_string(as_owner.join("restore.log")).unwrap_or_default();
    assert!(restored.status.success(), "{restored:?}\n{log}");
    let after = ask_counter(port).expect("the restored tree serves");
    let owner = uid_of(pid);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(after > before, "counter went from {before} to {after}");
    assert_eq!(owner, USER.0, "the restored tree is still its user's");
}

fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("State:") && (l.contains("S (") || l.contains("R (")))
        })
        .unwrap_or(false)
}
