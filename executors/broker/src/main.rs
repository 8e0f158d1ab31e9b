//! podmotion-broker: serves the netns broker socket. See the crate docs and
//! docs/broker-ops.md.
#![forbid(unsafe_code)]

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use podmotion_broker::Broker;
use podmotion_broker::handover::{Cidr, parse_cidrs};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// `--address-handover-cidrs`: a comma-separated list, empty for none.
#[derive(Clone, Debug)]
struct Cidrs(Vec<Cidr>);

fn cidrs(s: &str) -> Result<Cidrs, String> {
    parse_cidrs(s).map(Cidrs)
}

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
    /// The pods cgroup roots (comma-separated): every registered process must live
    /// strictly below one. The default covers the kubelet's cgroupfs driver
    /// (`/kubepods`) and its systemd driver (`/kubepods.slice`).
    #[arg(long, env = "PODMOTION_PODS_CGROUP", default_value = podmotion_broker::DEFAULT_PODS_ROOTS)]
    pods_cgroup_root: String,
    /// The agent's uid (SO_PEERCRED).
    #[arg(long, env = "PODMOTION_AGENT_UID", default_value_t = 0)]
    allowed_uid: u32,
    /// The pod address hand-over (`adopt_address`): comma-separated CIDRs an adopted
    /// address must lie in (the nodes' shared pod segment, e.g. `198.18.0.0/16`). Empty
    /// (the default): the hand-over is off, `adopt_address` answers `handover_off`.
    #[arg(
        long,
        env = "PODMOTION_ADDRESS_HANDOVER_CIDRS",
        default_value = "",
        value_parser = cidrs
    )]
    address_handover_cidrs: Cidrs,
    /// The longest an adopted address stays after its adoption: the sweep withdraws it
    /// then, even while a moved connection still uses it.
    #[arg(
        long,
        env = "PODMOTION_ADDRESS_LINGER_SECONDS",
        default_value_t = 3600,
        value_parser = clap::value_parser!(u64).range(1..=86400)
    )]
    address_linger_seconds: u64,
    /// With the hand-over on, hold the node's neighbour entries for the source's
    /// addresses during the lock (off: measured on the real nodes, a held segment of
    /// a moved connection reached the target before its restore and was reset).
    #[arg(
        long,
        env = "PODMOTION_ADDRESS_HANDOVER_HOLD_NEIGHBOURS",
        default_value_t = false,
        action = clap::ArgAction::Set
    )]
    address_handover_hold_neighbours: bool,
    /// On SIGTERM, how long the broker serves on while registrations are left (its
    /// agent resuming or killing the sources it froze) before it rolls back what is
    /// left itself and exits. Keep it below the pod's termination grace period (60 s).
    #[arg(
        long,
        env = "PODMOTION_BROKER_STOP_GRACE_SECONDS",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(0..=3600)
    )]
    stop_grace_seconds: u64,
    /// How long to wait at start for another broker that holds the run directory to end
    /// (a replaced agent pod's, within its stop grace) before refusing to start. At
    /// least the stop grace, so that the broker of the pod that replaces a deleted one
    /// takes over as soon as the old one ends.
    #[arg(
        long,
        env = "PODMOTION_BROKER_RUN_DIR_WAIT_SECONDS",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(0..=3600)
    )]
    run_dir_wait_seconds: u64,
    /// Forward a locked source's new TCP connections to its restored target once the
    /// operator asks (`forward_connections`: an nftables table of the migration's in
    /// the node's network namespace, see docs/broker-ops.md). Off (the binary's
    /// default): `forward_connections` answers `forward_off`.
    #[arg(
        long,
        env = "PODMOTION_FORWARD_NEW_CONNECTIONS",
        default_value_t = false,
        action = clap::ArgAction::Set
    )]
    forward_new_connections: bool,
    /// Log format: `json` (one object per line) or `text`.
    #[arg(long, env = podmotion_log::ENV, default_value = "json")]
    log_format: podmotion_log::LogFormat,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    // Before any thread starts: every thread inherits the mask, so only the stopper
    // takes these signals.
    let stop_signals = SigSet::from_iter([Signal::SIGTERM, Signal::SIGINT]);
    stop_signals.thread_block()?;
    podmotion_log::init(a.log_format, "info");
    let broker = Broker::new(podmotion_broker::Config {
        run_dir: a.run_dir,
        pods_cgroup_root: a.pods_cgroup_root,
        allowed_uid: a.allowed_uid,
        same_netns_peers: true,
        container_cgroups: true,
        handover_cidrs: a.address_handover_cidrs.0.clone(),
        address_linger: Duration::from_secs(a.address_linger_seconds),
        sweep_interval: Duration::from_secs(2),
        hold_neighbours: a.address_handover_hold_neighbours,
        forward_new_connections: a.forward_new_connections,
    });
    let cidrs: Vec<String> = a
        .address_handover_cidrs
        .0
        .iter()
        .map(Cidr::to_string)
        .collect();
    tracing::info!(
        socket = %a.socket.display(),
        address_handover_cidrs = %cidrs.join(","),
        address_linger_seconds = a.address_linger_seconds,
        forward_new_connections = a.forward_new_connections,
        "broker serving"
    );
    spawn_stopper(
        Arc::clone(&broker),
        stop_signals,
        Duration::from_secs(a.stop_grace_seconds),
    );
    broker.serve(&a.socket, Duration::from_secs(a.run_dir_wait_seconds))?;
    Ok(())
}

/// Waits for SIGTERM or SIGINT, then stops the broker ([`Broker::stop`]) and exits 0.
fn spawn_stopper(broker: Arc<Broker>, signals: SigSet, grace: Duration) {
    std::thread::spawn(move || {
        let signal = match signals.wait() {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot wait for SIGTERM: the broker stops only when killed");
                return;
            }
        };
        tracing::info!(
            ?signal,
            registrations = broker.registrations(),
            grace_seconds = grace.as_secs(),
            "stopping: serving the agent's last calls"
        );
        let left = broker.stop(grace);
        tracing::info!(
            rolled_back = left,
            "stopped: the registrations left were ended as lost leases"
        );
        std::process::exit(0);
    });
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        super::Args::command().debug_assert();
    }

    #[test]
    fn the_hand_over_is_off_by_default_and_its_flags_parse() {
        let a = super::Args::try_parse_from(["b"]).unwrap();
        assert!(a.address_handover_cidrs.0.is_empty());
        assert_eq!(a.address_linger_seconds, 3600);
        // The chart's rendering of an empty list.
        let a = super::Args::try_parse_from(["b", "--address-handover-cidrs="]).unwrap();
        assert!(a.address_handover_cidrs.0.is_empty());
        let a = super::Args::try_parse_from([
            "b",
            "--address-handover-cidrs",
            "198.18.0.0/15, 2001:db8::/32",
            "--address-linger-seconds",
            "86400",
        ])
        .unwrap();
        let got: Vec<String> = a
            .address_handover_cidrs
            .0
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(got, ["198.18.0.0/15", "2001:db8::/32"]);
        for bad in [
            &["b", "--address-handover-cidrs", "198.18.0.0/15,10.0.0.1/8"][..],
            &["b", "--address-handover-cidrs", "pods"],
            &["b", "--address-linger-seconds", "0"],
            &["b", "--address-linger-seconds", "86401"],
        ] {
            let e = super::Args::try_parse_from(bad).unwrap_err().to_string();
            assert!(e.contains(bad[2].split(',').next_back().unwrap()), "{e}");
        }
    }
}
