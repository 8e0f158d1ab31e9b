//! Running `kubectl podmotion` as a user does: the plugin binary of this tree, first on
//! `$PATH`, behind `kubectl` with the test cluster's kubeconfig.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use crate::{kubeconfig_path, kubectl_path, repo_root};

/// The plugin binary of this tree: `PODMOTION_PLUGIN_BIN`, or `kubectl-podmotion` in the
/// target directory the running test lives in (build it first: `cargo build -p
/// kubectl-podmotion`, same `CARGO_TARGET_DIR`), refused when older than any of the
/// plugin's sources.
pub fn plugin_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("PODMOTION_PLUGIN_BIN") {
        return PathBuf::from(p);
    }
    // <target>/debug/deps/<test>-<hash> -> <target>/debug/kubectl-podmotion
    let exe = std::env::current_exe().expect("the test's path");
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the target directory")
        .join("kubectl-podmotion");
    let hint = "build it first: cargo build -p kubectl-podmotion (same CARGO_TARGET_DIR), or set PODMOTION_PLUGIN_BIN";
    let built = std::fs::metadata(&bin)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| panic!("{}: {e}; {hint}", bin.display()));
    let mut stack = vec![repo_root().join("kubectl-podmotion")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(t) = e.metadata().and_then(|m| m.modified()) {
                assert!(
                    t <= built,
                    "{} is older than {}: {hint}",
                    bin.display(),
                    p.display()
                );
            }
        }
    }
    bin
}

/// `kubectl podmotion <args>` with the plugin's directory first on `$PATH`, as a user who
/// installed it. kubectl takes no flags before a plugin's name: the kubeconfig comes
/// from the environment.
pub fn kubectl_podmotion(bin: &Path, args: &[&str]) -> Command {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin.parent().expect("plugin directory").to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    let mut cmd = Command::new(kubectl_path().expect("kubectl"));
    cmd.env("PATH", std::env::join_paths(paths).unwrap())
        .env("KUBECONFIG", kubeconfig_path())
        .arg("podmotion")
        .args(args);
    cmd
}

/// `kubectl podmotion <args>` started, with its stdout's lines on a channel (stderr
/// piped, read by whoever waits on the child).
pub fn spawn_lines(bin: &Path, args: &[&str]) -> (Child, mpsc::Receiver<String>) {
    let mut child = kubectl_podmotion(bin, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning kubectl podmotion");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    (child, rx)
}
