//! The preflight binary against this machine's real kernel and /dev/kvm, as root and as
//! an unprivileged uid (the Runner's situation). Needs root for the uid switch; as a
//! non-root user the unprivileged half runs as that user instead.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const NOBODY: u32 = 65534;

/// A copy of the binary and a scratch dir any uid can use.
fn sandbox(tag: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("pf-e2e-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let bin = dir.join("podmotion-preflight");
    std::fs::copy(env!("CARGO_BIN_EXE_podmotion-preflight"), &bin).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    (dir, bin)
}

fn run(bin: &Path, dir: &Path, uid: Option<u32>, extra: &[&str]) -> (i32, Value, Value) {
    let log = dir.join(format!("termination-log-{}", uid.unwrap_or(0)));
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--termination-log={}", log.display()))
        .arg(format!("--session-volume={}", dir.display()))
        .arg("--require-project-quota=false")
        .args(extra);
    if let Some(uid) = uid {
        // std drops supplementary groups when root switches uid.
        cmd.uid(uid).gid(uid);
    }
    let out = output_of(&mut cmd);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.lines().count(), 1, "one verdict line: {stdout}");
    let verdict: Value = serde_json::from_str(stdout.trim()).unwrap();
    let written: Value = serde_json::from_str(
        std::fs::read_to_string(&log)
            .expect("termination log")
            .trim(),
    )
    .unwrap();
    (out.status.code().unwrap_or(-1), verdict, written)
}

/// Runs `cmd`, retrying "Text file busy": tests run in parallel threads, and a child
/// forked by one test while another copies its binary briefly holds the copy's write
/// descriptor (until its own exec), which makes exec of that copy fail with ETXTBSY.
fn output_of(cmd: &mut Command) -> std::process::Output {
    for _ in 0..100 {
        match cmd.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other.expect("run preflight"),
        }
    }
    panic!("the preflight binary stayed busy");
}

fn check<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

fn is_root() -> bool {
    effective_uid() == 0
}

fn effective_uid() -> u32 {
    // /proc/self/status "Uid: real effective saved fs"
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

#[test]
fn preflight_opens_kvm_and_creates_a_user_namespace_on_this_node() {
    let (dir, bin) = sandbox("self");
    let (code, verdict, written) = run(&bin, &dir, None, &[]);
    assert_eq!(
        verdict, written,
        "stdout and termination log carry the same verdict"
    );
    assert_eq!(verdict["preflight"], "v1");
    assert_eq!(check(&verdict, "userns")["ok"], true, "{verdict}");
    let kvm = Path::new("/dev/kvm");
    let expect_kvm = kvm.exists()
        && std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(kvm)
            .is_ok();
    assert_eq!(check(&verdict, "kvm")["ok"], expect_kvm, "{verdict}");
    assert_eq!(code == 0, verdict["ok"] == true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn as_the_unprivileged_runner_uid_kvm_follows_the_device_mode() {
    if !is_root() {
        eprintln!("not root: the current user is the unprivileged uid");
    }
    let (dir, bin) = sandbox("nobody");
    let uid = is_root().then_some(NOBODY);
    let (code, verdict, _) = run(&bin, &dir, uid, &[]);
    // An unprivileged user namespace works without any privilege (that is the point).
    assert_eq!(check(&verdict, "userns")["ok"], true, "{verdict}");
    let kvm = check(&verdict, "kvm");
    match std::fs::metadata("/dev/kvm") {
        Ok(m) => {
            let world_rw = m.permissions().mode() & 0o006 == 0o006;
            assert_eq!(
                kvm["ok"],
                world_rw,
                "mode {:o}: {verdict}",
                m.permissions().mode()
            );
            if !world_rw {
                let d = kvm["detail"].as_str().unwrap();
                assert!(d.contains("Permission denied") && d.contains("0666"), "{d}");
                assert_eq!(code, 1, "a failed check exits 1");
                assert_eq!(verdict["ok"], false);
            }
        }
        Err(_) => assert_eq!(kvm["ok"], false),
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_device_and_a_restricting_apparmor_sysctl_fail_with_exit_1() {
    let (dir, bin) = sandbox("neg");
    let sysctl = dir.join("restrict");
    std::fs::write(&sysctl, "1\n").unwrap();
    let (code, verdict, _) = run(
        &bin,
        &dir,
        None,
        &[
            "--kvm-device=/nonexistent/kvm",
            &format!("--apparmor-sysctl={}", sysctl.display()),
        ],
    );
    assert_eq!(code, 1);
    assert_eq!(verdict["ok"], false);
    assert_eq!(check(&verdict, "kvm")["ok"], false);
    assert_eq!(check(&verdict, "apparmor")["ok"], false);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_usage_error_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_podmotion-preflight"))
        .arg("--bogus=1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
