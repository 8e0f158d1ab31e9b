//! The command line: `kubectl podmotion <command>`. kubectl runs the plugin with the
//! arguments after `podmotion`; global flags mirror kubectl's.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(
    name = "kubectl-podmotion",
    bin_name = "kubectl podmotion",
    version,
    about = "PodMotion from kubectl: migrate a pod with live progress; status of every PodMotion resource"
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Debug, Clone)]
pub struct Global {
    /// Path to the kubeconfig file (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Act as this user (impersonation, as `kubectl --as`).
    #[arg(long = "as", global = true)]
    pub as_user: Option<String>,
    /// Namespace (default: the context's namespace).
    #[arg(short = 'n', long, global = true)]
    pub namespace: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Live-migrate a pod to another node and follow it to the end.
    Migrate(Migrate),
    /// One table of every PodMigration, NodeAgentAttachment and RunnerPool you can see.
    Status(Status),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    #[value(name = "PreCopy", alias = "precopy")]
    PreCopy,
    #[value(name = "Cold", alias = "cold")]
    Cold,
}

#[derive(Args, Debug)]
pub struct Migrate {
    /// The pod to move.
    pub pod: String,
    /// Target node (default: the operator picks a node with a ready agent that fits).
    #[arg(long = "to")]
    pub to: Option<String>,
    /// How memory is moved.
    #[arg(long, value_enum, default_value = "PreCopy")]
    pub mode: Mode,
    /// Run the checks only; freeze nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Name of the PodMigration (default: `<pod>-<random>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Abort (server side: the migration's deadlineSeconds) when it has not
    /// committed after this long: `90s`, `15m`, `1h`.
    #[arg(long, default_value = "15m", value_parser = parse_duration)]
    pub timeout: Duration,
    /// Longest freeze you accept, in milliseconds (spec.freezeBudgetMillis).
    #[arg(long)]
    pub freeze_budget_millis: Option<i64>,
}

#[derive(Args, Debug)]
pub struct Status {
    /// All namespaces.
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
}

/// `90`, `90s`, `15m`, `1h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, 's')) => (&s[..i], 1),
        Some((i, 'm')) => (&s[..i], 60),
        Some((i, 'h')) => (&s[..i], 3600),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration such as 90s, 15m or 1h"))?;
    Ok(Duration::from_secs(n * mult))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("15m"), Ok(Duration::from_secs(900)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert!(parse_duration("soon").is_err());
    }

    #[test]
    fn migrate_takes_the_flags_of_the_issue() {
        let c = Cli::try_parse_from([
            "kubectl-podmotion",
            "migrate",
            "web-0",
            "-n",
            "shop",
            "--to",
            "pm-real-1",
            "--mode",
            "Cold",
            "--dry-run",
            "--timeout",
            "2m",
        ])
        .unwrap();
        assert_eq!(c.global.namespace.as_deref(), Some("shop"));
        let Command::Migrate(m) = c.command else {
            panic!()
        };
        assert_eq!(m.pod, "web-0");
        assert_eq!(m.to.as_deref(), Some("pm-real-1"));
        assert_eq!(m.mode, Mode::Cold);
        assert!(m.dry_run);
        assert_eq!(m.timeout, Duration::from_secs(120));
    }
}
