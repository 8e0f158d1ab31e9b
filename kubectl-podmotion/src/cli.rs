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
    about = "PodMotion from kubectl: migrate a pod with live progress; intercept a workload's traffic; status of every PodMotion resource"
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
    /// Send a workload's incoming traffic on one port to a local port, until Ctrl-C.
    Intercept(Intercept),
    /// Print the environment a replica's container runs with, as a dotenv file.
    Env(Env),
    /// Copy a workload's traffic on one port into a pcapng file, until Ctrl-C.
    Wiretap(Wiretap),
    /// Copy a file or a directory out of a replica's container.
    Cp(Cp),
    /// Cordon a node and evict its pods like `kubectl drain`; the pods that ask for it
    /// are live-migrated by PodMotion's eviction webhook. One line per pod until the
    /// node is empty.
    Drain(Drain),
}

#[derive(Args, Debug)]
pub struct Drain {
    /// The node to drain.
    pub node: String,
}

/// The flags of the commands that work through one replica's agent (`env`, `cp`).
#[derive(Args, Debug)]
pub struct OneAgent {
    /// The container (default: the pod's first).
    #[arg(long, short = 'c')]
    pub container: Option<String>,
    /// Ignored, kept for scripts that pass it (see `intercept`).
    #[arg(long, env = "PODMOTION_AGENTS_NAMESPACE", hide = true)]
    pub agents_namespace: Option<String>,
    /// Give up when the agent is not ready after this long.
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Args, Debug)]
pub struct Cp {
    /// `<workload>:<absolute path>`, e.g. `deploy/web:/etc/nginx/nginx.conf`: a regular
    /// file, or a directory (copied with its files, subdirectories and symlinks).
    #[arg(value_parser = parse_remote)]
    pub source: (Workload, String),
    /// Where to write: a file, a directory (created if missing; a directory's contents
    /// go into it), or `-` for stdout (a file's bytes, or a directory as tar).
    pub local: PathBuf,
    #[command(flatten)]
    pub agent: OneAgent,
}

#[derive(Args, Debug)]
pub struct Wiretap {
    /// The workload: `NAME` (a Deployment), `deploy/NAME`, `sts/NAME`, `rs/NAME`, `ds/NAME`.
    #[arg(value_parser = parse_workload)]
    pub workload: Workload,
    /// The container port to tap.
    #[arg(long)]
    pub port: u16,
    /// The pcapng file to write (Wireshark, tshark).
    #[arg(short = 'w', long = "write")]
    pub write: PathBuf,
    /// Ignored, kept for scripts that pass it (see `intercept`).
    #[arg(long, env = "PODMOTION_AGENTS_NAMESPACE", hide = true)]
    pub agents_namespace: Option<String>,
    /// Name of the NodeAgentAttachment to create (default: `wiretap-<workload>-<random>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Give up when the agents are not ready after this long.
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Args, Debug)]
pub struct Env {
    /// The workload: `NAME` (a Deployment), `deploy/NAME`, `sts/NAME`, `rs/NAME`, `ds/NAME`.
    #[arg(value_parser = parse_workload)]
    pub workload: Workload,
    #[command(flatten)]
    pub agent: OneAgent,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    #[value(name = "PreCopy", alias = "precopy")]
    PreCopy,
    #[value(name = "Cold", alias = "cold")]
    Cold,
    /// Opt-in: the shortest freeze, but the pod's state is lost if the source's node or
    /// agent is lost before every page is in.
    #[value(name = "PostCopy", alias = "postcopy")]
    PostCopy,
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
pub struct Intercept {
    /// The workload: `NAME` (a Deployment), `deploy/NAME`, `sts/NAME`, `rs/NAME`,
    /// `ds/NAME` (long kind names accepted too).
    #[arg(value_parser = parse_workload)]
    pub workload: Workload,
    /// `APP[:LOCAL]`: the container port to intercept and the local port that gets
    /// its connections (default: the same number).
    #[arg(long, value_parser = parse_port_pair)]
    pub port: PortPair,
    /// `NAME=VALUE`: a filtered HTTP intercept — only HTTP/1.1 requests carrying this
    /// header come here; every other request is answered by the application.
    /// Repeat to require several headers.
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
    /// Ignored, kept for scripts that pass it: agents are reached through their
    /// target pods, in the workload's namespace, and nothing is read in the agents'.
    #[arg(long, env = "PODMOTION_AGENTS_NAMESPACE", hide = true)]
    pub agents_namespace: Option<String>,
    /// Name of the NodeAgentAttachment to create (default: `intercept-<workload>-<random>`).
    /// An existing Intercept attachment of the workload that covers the port is reused.
    #[arg(long)]
    pub name: Option<String>,
    /// Give up when the agents are not ready after this long: `90s`, `5m`.
    #[arg(long, default_value = "3m", value_parser = parse_duration)]
    pub timeout: Duration,
}

/// A workload reference: kind and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub kind: podmotion_api::attachment::WorkloadKind,
    pub name: String,
}

/// `--port APP[:LOCAL]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortPair {
    pub app: u16,
    pub local: u16,
}

/// `web`, `deploy/web`, `deployment.apps/web`, `sts/db`, `rs/x`, `ds/y`.
pub fn parse_workload(s: &str) -> Result<Workload, String> {
    use podmotion_api::attachment::WorkloadKind as K;
    let (kind, name) = match s.split_once('/') {
        None => (K::Deployment, s),
        Some((k, n)) => {
            let k = k.to_ascii_lowercase();
            let k = k.strip_suffix(".apps").unwrap_or(&k);
            let kind = match k {
                "deploy" | "deployment" | "deployments" => K::Deployment,
                "sts" | "statefulset" | "statefulsets" => K::StatefulSet,
                "rs" | "replicaset" | "replicasets" => K::ReplicaSet,
                "ds" | "daemonset" | "daemonsets" => K::DaemonSet,
                other => {
                    return Err(format!(
                        "{other:?} is not a workload kind: use deploy/, sts/, rs/ or ds/"
                    ));
                }
            };
            (kind, n)
        }
    };
    let valid = !name.is_empty()
        && name.len() <= 253
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if !valid {
        return Err(format!("{name:?} is not a workload name"));
    }
    Ok(Workload {
        kind,
        name: name.to_string(),
    })
}

/// `8080` or `8080:9090`.
pub fn parse_port_pair(s: &str) -> Result<PortPair, String> {
    let port = |p: &str| -> Result<u16, String> {
        match p.parse::<u16>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("{p:?} is not a port number (1-65535)")),
        }
    };
    match s.split_once(':') {
        None => port(s).map(|p| PortPair { app: p, local: p }),
        Some((a, l)) => Ok(PortPair {
            app: port(a)?,
            local: port(l)?,
        }),
    }
}

/// `NAME=VALUE`: an HTTP header name (a token) and its value.
pub fn parse_header(s: &str) -> Result<(String, String), String> {
    let (n, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if n.is_empty() || !n.chars().all(token) {
        return Err(format!("{n:?} is not an HTTP header name"));
    }
    if v.chars().any(|c| c.is_control()) {
        return Err(format!("the value of {n} holds a control character"));
    }
    Ok((n.to_string(), v.trim().to_string()))
}

#[derive(Args, Debug)]
pub struct Status {
    /// All namespaces.
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
}

/// `<workload>:<path>`: the workload (as for the other commands) and an absolute path.
pub fn parse_remote(s: &str) -> Result<(Workload, String), String> {
    let (w, path) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not <workload>:<absolute path>"))?;
    if !path.starts_with('/') {
        return Err(format!(
            "{path:?} must be an absolute path in the container"
        ));
    }
    Ok((parse_workload(w)?, path.to_string()))
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
    fn workloads_ports_and_headers_parse_as_kubectl_users_write_them() {
        use podmotion_api::attachment::WorkloadKind as K;
        assert_eq!(parse_workload("web").unwrap().kind, K::Deployment);
        assert_eq!(parse_workload("sts/db").unwrap().kind, K::StatefulSet);
        assert_eq!(
            parse_workload("deployment.apps/web").unwrap(),
            Workload {
                kind: K::Deployment,
                name: "web".into()
            }
        );
        assert_eq!(parse_workload("DaemonSet/x").unwrap().kind, K::DaemonSet);
        assert!(parse_workload("pod/web-0").is_err());
        assert!(parse_workload("deploy/Web").is_err());
        assert_eq!(
            parse_port_pair("8080").unwrap(),
            PortPair {
                app: 8080,
                local: 8080
            }
        );
        assert_eq!(
            parse_port_pair("8080:9090").unwrap(),
            PortPair {
                app: 8080,
                local: 9090
            }
        );
        assert!(parse_port_pair("0").is_err());
        assert!(parse_port_pair("http").is_err());
        assert_eq!(
            parse_header("X-User=alice").unwrap(),
            ("X-User".into(), "alice".into())
        );
        assert!(parse_header("X User=alice").is_err());
        assert!(parse_header("alice").is_err());
        let c = Cli::try_parse_from([
            "kubectl-podmotion",
            "intercept",
            "deploy/web",
            "--port",
            "8080:18080",
            "--header",
            "x-dev=me",
            "-n",
            "shop",
        ])
        .unwrap();
        let Command::Intercept(i) = c.command else {
            panic!()
        };
        assert_eq!(i.port.local, 18080);
        assert_eq!(i.headers, vec![("x-dev".to_string(), "me".to_string())]);
    }

    #[test]
    fn remote_paths_parse_as_workload_colon_absolute_path() {
        let (w, p) = parse_remote("deploy/web:/etc/os-release").unwrap();
        assert_eq!((w.name.as_str(), p.as_str()), ("web", "/etc/os-release"));
        let (w, p) = parse_remote("sts/db:/var/lib/data/").unwrap();
        assert_eq!(
            (w.kind, p.as_str()),
            (
                podmotion_api::attachment::WorkloadKind::StatefulSet,
                "/var/lib/data/"
            )
        );
        assert!(parse_remote("web").is_err());
        assert!(parse_remote("web:etc/passwd").is_err());
        assert!(parse_remote("pod/x:/a").is_err());
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
