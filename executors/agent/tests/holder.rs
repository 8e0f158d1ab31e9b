//! The holder as PID 1 of a PID namespace, as in a target pod's container, on this
//! machine's kernel, as root: it ends with its workload (the init of a PID namespace
//! nested below its own, as CRIU restores one), and only with it. `PODMOTION_ROOT_TESTS=0`
//! skips it.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn root_tests() -> bool {
    if std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0") {
        eprintln!("PODMOTION_ROOT_TESTS=0: skipping");
        return false;
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "the holder's test needs root (PODMOTION_ROOT_TESTS=0 skips it)"
    );
    true
}

/// Runs `script` with `sh` inside the PID namespace of `pid` (as `kubectl exec`
/// enters a container), and waits for that shell.
fn exec_in(pid: u32, script: &str) {
    let st = Command::new("nsenter")
        .args(["-t", &pid.to_string(), "-p", "--", "sh", "-c", script])
        .stdin(Stdio::null())
        .status()
        .expect("nsenter");
    assert!(st.success(), "{script}");
}

/// A process whose command line is `argv`, found among the children of `parent`.
fn child_running(parent: u32, argv: &[&str]) -> u32 {
    let want: Vec<u8> = argv
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    for _ in 0..500 {
        let kids = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        for k in kids
            .split_whitespace()
            .filter_map(|k| k.parse::<u32>().ok())
        {
            if std::fs::read(format!("/proc/{k}/cmdline")).is_ok_and(|c| c == want) {
                return k;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{argv:?} did not start under {parent}");
}

#[test]
fn the_holder_reaps_strays_and_ends_only_with_its_nested_workload() {
    if !root_tests() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("pm-holder-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let hold = dir.join("hold");
    let st = Command::new(env!("CARGO_BIN_EXE_podmotion-agent"))
        .arg("install-holder")
        .arg(&hold)
        .status()
        .unwrap();
    assert!(st.success());
    let hold = hold.to_str().unwrap().to_owned();
    // The container: the holder as PID 1 of a new PID namespace with its own /proc,
    // as a runtime makes it (`unshare` waits for it and exits with its status, as a
    // runtime reports the container's).
    let mut container = Command::new("unshare")
        .args(["-p", "-f", "--mount-proc", "--kill-child", &hold, "hold"])
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let holder = child_running(container.id(), &[&hold, "hold"]);

    // A stray: a process of the holder's own namespace that ends as its child (what
    // `kubectl exec … &` leaves). The holder reaps it and holds on.
    exec_in(holder, "sleep 0.2 &");
    std::thread::sleep(Duration::from_millis(600));
    assert!(
        container.try_wait().unwrap().is_none(),
        "the holder ended with a stray of its own namespace"
    );

    // The workload: the init of a namespace nested below the holder's, left to the
    // holder as CRIU leaves the tree it restored (its parent gone).
    exec_in(
        holder,
        "unshare -p -f sh -c 'sleep 0.5; exit 7' & sleep 0.2; kill -9 $!",
    );
    let t = Instant::now();
    let status = loop {
        if let Some(st) = container.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the holder outlived its workload"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.code(),
        Some(7),
        "the holder ends with its workload's status"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
