//! The node agents of one release on the real nodes, seen from the machine they run on:
//! their processes (by pod UID in the cgroup path) and what they keep under their
//! checkpoint root — shared by the real-node migration tests that check no checkpoint
//! image is left behind.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::{Api, ListParams};

use super::procs::in_pod;

/// Host PIDs of the node agents (the agent binary serving gRPC) that run in the pods
/// `agent_pods` (by pod UID in the process's cgroup path; cgroupfs writes the UID with
/// dashes, the systemd driver with underscores). Scoped to one release's agents: tests
/// run in parallel, each with its own release, and another test's in-flight migration
/// holds images on its own agents.
pub fn agent_pids(agent_pods: &[String]) -> Vec<u32> {
    let mut out = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd);
        if !(cmd.starts_with("/usr/local/bin/podmotion-agent\0")
            && cmd.contains("--checkpoints-root"))
        {
            continue;
        }
        let Ok(cgroup) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
            continue;
        };
        if agent_pods.iter().any(|uid| in_pod(&cgroup, uid)) {
            out.push(pid);
        }
    }
    out
}

/// The UIDs of the agent pods in namespace `agents` (one release's DaemonSet).
pub async fn agent_pod_uids(client: &kube::Client, agents: &str) -> Vec<String> {
    Api::<Pod>::namespaced(client.clone(), agents)
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(|p| p.uid().unwrap())
        .collect()
}

/// Every checkpoint root of this release's agents is empty within `CLEANUP_TIMEOUT`,
/// with one agent found per real node. The operator asks the agents to clean up once
/// the phase is final (after a thaw or kill that is still running has finished), so
/// the images go shortly after the phase is terminal, not with it.
pub async fn no_checkpoint_files_left(
    when: &str,
    client: &kube::Client,
    agents: &str,
    nodes: usize,
) {
    let pods = agent_pod_uids(client, agents).await;
    let start = std::time::Instant::now();
    loop {
        let pids = agent_pids(&pods);
        assert_eq!(pids.len(), nodes, "agents of {agents} found: {pids:?}");
        let left: Vec<(u32, Vec<String>)> = pids
            .into_iter()
            .map(|pid| (pid, checkpoint_files(pid)))
            .filter(|(_, files)| !files.is_empty())
            .collect();
        if left.is_empty() {
            eprintln!(
                "checkpoint images gone {when} ({} ms after the check began)",
                start.elapsed().as_millis()
            );
            return;
        }
        assert!(
            start.elapsed() < CLEANUP_TIMEOUT,
            "agents keep checkpoint files {when} for {CLEANUP_TIMEOUT:?}: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub const CLEANUP_TIMEOUT: Duration = Duration::from_secs(60);

/// Every file under the checkpoint root of the agent `agent_pid` (seen through its root).
pub fn checkpoint_files(agent_pid: u32) -> Vec<String> {
    let root = format!("/proc/{agent_pid}/root/run/podmotion/checkpoints");
    let mut out = vec![];
    let mut stack = vec![std::path::PathBuf::from(&root)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.to_string_lossy().into_owned());
            }
        }
    }
    out
}
