//! podmotion-broker: serves the netns broker socket. See the crate docs and
//! docs/broker-ops.md.
#![forbid(unsafe_code)]

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Unix socket to serve (root-owned, mode 0600).
    #[arg(
        long,
        env = "PODMOTION_BROKER_SOCKET",
        default_value = "/run/podmotion/broker.sock"
    )]
    socket: PathBuf,
    /// Runtime directory for netns bind mounts.
    #[arg(long, env = "PODMOTION_RUN_DIR", default_value = "/run/podmotion")]
    run_dir: PathBuf,
    /// cgroup v2 path under which every registered process must live.
    #[arg(long, env = "PODMOTION_PODS_CGROUP", default_value = "/kubepods")]
    pods_cgroup_root: String,
    /// The agent's uid (SO_PEERCRED).
    #[arg(long, env = "PODMOTION_AGENT_UID", default_value_t = 0)]
    allowed_uid: u32,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, env = podmotion_log::ENV, default_value = "json")]
    log_format: podmotion_log::LogFormat,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    podmotion_log::init(a.log_format, "info");
    let broker = podmotion_broker::Broker::new(podmotion_broker::Config {
        run_dir: a.run_dir,
        pods_cgroup_root: a.pods_cgroup_root,
        allowed_uid: a.allowed_uid,
        same_netns_peers: true,
        container_cgroups: true,
    });
    tracing::info!(socket = %a.socket.display(), "broker serving");
    broker.serve(&a.socket)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Args::command().debug_assert();
    }
}
