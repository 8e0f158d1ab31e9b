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
    /// Live-migrate a pod to another node and follow it to the end (`--wait=false`:
    /// start it and return).
    Migrate(Migrate),
    /// Cancel a migration: delete its PodMigration, whose finalizer rolls it back and
    /// resumes the source pod; waits until it is gone unless `--wait=false`.
    MigrateCancel(MigrateCancel),
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
    /// Print a shell completion script for `kubectl-podmotion` (bash or zsh).
    Completion(Completion),
}

#[derive(Args, Debug)]
pub struct Completion {
    /// The shell.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
}

/// `-o json|yaml`: the objects as the API server returns them, as `kubectl get -o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Json,
    Yaml,
}

#[derive(Args, Debug)]
pub struct MigrateCancel {
    /// The PodMigration to cancel (the name `migrate` printed).
    pub name: String,
    /// Wait until the PodMigration is gone (rolled back); `--wait=false` returns once
    /// the deletion is accepted.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true")]
    pub wait: bool,
    /// With `--wait`: give up waiting (the rollback goes on) after this long.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub timeout: Duration,
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
    /// Follow the migration until it ends (the default); `--wait=false` creates the
    /// PodMigration, prints its name and returns.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1,
          require_equals = true, default_missing_value = "true")]
    pub wait: bool,
    /// Print the PodMigration as JSON or YAML on stdout instead of its name (with
    /// `--wait`, as it ended; progress then goes to stderr).
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
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
    /// Print the objects as a JSON or YAML `List` instead of the table.
    #[arg(short = 'o', long, value_enum)]
    pub output: Option<Output>,
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

/// A duration as kubectl takes one (Go's `time.ParseDuration`): decimal numbers, each
/// with an optional fraction and a unit, in a row — `90s`, `1m30s`, `500ms`, `1.5h`,
/// `2h45m`; units `ns`, `us` (`µs`), `ms`, `s`, `m`, `h`. A plain number is seconds (as
/// kubectl's `--request-timeout`), kept for scripts written before. No sign: a
/// negative duration means nothing here.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| {
        format!(
            "{s:?} is not a duration ({why}): use a number and a unit, repeated, as kubectl does: 90s, 1m30s, 500ms, 1.5h (units ns, us, ms, s, m, h)"
        )
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("empty"));
    }
    if t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| bad("too long"));
    }
    if t.starts_with(['-', '+']) {
        return Err(bad("no sign allowed"));
    }
    let mut rest = t;
    let mut nanos: u128 = 0;
    while !rest.is_empty() {
        let (part, after) = duration_term(rest).map_err(|why| bad(&why))?;
        nanos = nanos.checked_add(part).ok_or_else(|| bad("too large"))?;
        rest = after;
    }
    let secs = u64::try_from(nanos / 1_000_000_000).map_err(|_| bad("too large"))?;
    Ok(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// The term of a duration at the start of `rest`, a number with an optional fraction
/// and its unit (`90s`, `1.5h`): its nanoseconds and what follows it; else why it is
/// not one.
fn duration_term(rest: &str) -> Result<(u128, &str), String> {
    let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (int, after) = rest.split_at(int_len);
    let (frac, after) = match after.strip_prefix('.') {
        Some(a) => {
            let n = a.bytes().take_while(u8::is_ascii_digit).count();
            a.split_at(n)
        }
        None => ("", after),
    };
    if int.is_empty() && frac.is_empty() {
        return Err("a unit without a number".into());
    }
    let unit_len = after
        .char_indices()
        .find(|(_, c)| c.is_ascii_digit() || *c == '.')
        .map_or(after.len(), |(i, _)| i);
    let (unit, after) = after.split_at(unit_len);
    let per: u128 = match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60_000_000_000,
        "h" => 3_600_000_000_000,
        "" => return Err("a number without a unit".into()),
        u => return Err(format!("unknown unit {u:?}")),
    };
    let too_big = || "too large".to_string();
    let whole: u128 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(|_| too_big())?
    };
    let mut part = whole.checked_mul(per).ok_or_else(too_big)?;
    // The fraction, exact to the nanosecond (digits past it are dropped, as Go does).
    let mut scale = per;
    for d in frac.bytes() {
        if scale < 10 {
            break;
        }
        scale /= 10;
        part += u128::from(d - b'0') * scale;
    }
    Ok((part, after))
}

/// The completion script for `kubectl-podmotion` (clap_complete): subcommands, flags
/// and the values of enumerated flags.
pub fn completion(shell: Shell) -> String {
    use clap::CommandFactory;
    // The binary's own name: a shell completes a command word, and `kubectl podmotion`
    // is two (kubectl completes a plugin's arguments only through its own
    // `kubectl_complete-<plugin>` protocol).
    let bin = "kubectl-podmotion";
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    match shell {
        Shell::Bash => clap_complete::generate(clap_complete::Shell::Bash, &mut cmd, bin, &mut out),
        Shell::Zsh => clap_complete::generate(clap_complete::Shell::Zsh, &mut cmd, bin, &mut out),
    }
    let script = String::from_utf8(out).expect("clap_complete writes UTF-8");
    match shell {
        // clap_complete 4.6's bash script names a subcommand's state from the binary's
        // name with `-` turned into `__` where its loop sets it, and into `__subcmd__`
        // where it is matched: with a `-` in the name (ours) nothing after the
        // subcommand completed. One name for both (the bash test below runs it).
        Shell::Bash => script.replace("kubectl__subcmd__podmotion", "kubectl__podmotion"),
        Shell::Zsh => script,
    }
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
    fn durations_parse_as_kubectl_and_go_write_them() {
        let ok = |s: &str| parse_duration(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(ok("90"), Duration::from_secs(90));
        assert_eq!(ok("90s"), Duration::from_secs(90));
        assert_eq!(ok("30s"), Duration::from_secs(30));
        assert_eq!(ok("15m"), Duration::from_secs(900));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        assert_eq!(ok("1m30s"), Duration::from_secs(90));
        assert_eq!(ok("2h45m"), Duration::from_secs(2 * 3600 + 45 * 60));
        assert_eq!(ok("500ms"), Duration::from_millis(500));
        assert_eq!(ok("1.5s"), Duration::from_millis(1500));
        assert_eq!(ok("1.5h"), Duration::from_secs(5400));
        assert_eq!(ok(".5m"), Duration::from_secs(30));
        assert_eq!(ok("1h2m3s4ms5us6ns"), Duration::new(3723, 4_005_006));
        assert_eq!(ok("10µs"), Duration::from_micros(10));
        assert_eq!(ok("0"), Duration::ZERO);
        assert_eq!(ok("0s"), Duration::ZERO);
        // Digits past the nanosecond are dropped, as Go does.
        assert_eq!(ok("1.0000000019s"), Duration::new(1, 1));
    }

    #[test]
    fn durations_that_are_not_go_durations_are_refused_with_the_accepted_form() {
        for bad in [
            "",
            "soon",
            "1x",
            "1d",
            "s",
            "1.5",
            "1m30",
            "-1s",
            "+1s",
            "1 m",
            "1..5s",
            "m30s",
            "1s-",
            "99999999999999999999h",
            "1e3s",
        ] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.contains("1m30s, 500ms"), "{bad:?}: {e}");
            assert!(e.starts_with(&format!("{bad:?} is not a duration")), "{e}");
        }
        assert!(
            parse_duration("1d")
                .unwrap_err()
                .contains("unknown unit \"d\"")
        );
        assert!(
            parse_duration("1m30")
                .unwrap_err()
                .contains("without a unit")
        );
        // Through clap, the message reaches the user.
        let e = Cli::try_parse_from(["kubectl-podmotion", "migrate", "web-0", "--timeout", "1d"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("units ns, us, ms, s, m, h"), "{e}");
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
    fn completion_scripts_name_every_subcommand_and_the_new_flags() {
        for shell in [Shell::Bash, Shell::Zsh] {
            let script = completion(shell);
            for word in [
                "migrate",
                "migrate-cancel",
                "status",
                "intercept",
                "env",
                "wiretap",
                "cp",
                "drain",
                "completion",
                "--wait",
                "--output",
                "--timeout",
            ] {
                assert!(script.contains(word), "{shell:?} script lacks {word}");
            }
        }
        assert!(completion(Shell::Bash).contains("kubectl-podmotion\n"));
        assert!(completion(Shell::Zsh).starts_with("#compdef kubectl-podmotion"));
        let c = Cli::try_parse_from(["kubectl-podmotion", "completion", "zsh"]).unwrap();
        assert!(matches!(
            c.command,
            Command::Completion(Completion { shell: Shell::Zsh })
        ));
        assert!(Cli::try_parse_from(["kubectl-podmotion", "completion", "fish"]).is_err());
    }

    /// The bash script run by bash, as a shell does on <TAB>: what it offers.
    fn bash_completes(words: &[&str]) -> Vec<String> {
        let script = std::env::temp_dir().join(format!(
            "kubectl-podmotion-completion-{}.bash",
            std::process::id()
        ));
        std::fs::write(&script, completion(Shell::Bash)).unwrap();
        let cword = words.len() - 1;
        let prev = if cword > 0 { words[cword - 1] } else { "" };
        let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
        let prog = format!(
            "source '{}'; COMP_WORDS=({}); COMP_CWORD={cword}; \
             f=$(complete -p kubectl-podmotion | sed -E 's/.*-F ([^ ]+).*/\\1/'); \
             $f kubectl-podmotion '{}' '{prev}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
            script.display(),
            quoted.join(" "),
            words[cword],
        );
        let out = std::process::Command::new("bash")
            .args(["-c", &prog])
            .output()
            .expect("bash");
        let _ = std::fs::remove_file(&script);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    #[test]
    fn the_bash_script_completes_subcommands_flags_and_values_in_bash() {
        assert_eq!(
            bash_completes(&["kubectl-podmotion", "mig"]),
            ["migrate", "migrate-cancel"]
        );
        assert_eq!(
            bash_completes(&["kubectl-podmotion", "migrate", "web-0", "--wa"]),
            ["--wait"]
        );
        assert_eq!(
            bash_completes(&["kubectl-podmotion", "migrate", "web-0", "--mode", ""]),
            ["PreCopy", "Cold", "PostCopy"]
        );
        assert_eq!(
            bash_completes(&["kubectl-podmotion", "status", "-o", ""]),
            ["json", "yaml"]
        );
        // At a positional, clap offers the flags too; the shells are among them.
        let shells = bash_completes(&["kubectl-podmotion", "completion", ""]);
        assert!(
            shells.contains(&"bash".to_string()) && shells.contains(&"zsh".to_string()),
            "{shells:?}"
        );
        assert!(!shells.contains(&"fish".to_string()), "{shells:?}");
    }

    #[test]
    fn wait_and_output_read_as_kubectl_flags() {
        let migrate = |extra: &[&str]| {
            let mut a = vec!["kubectl-podmotion", "migrate", "web-0"];
            a.extend_from_slice(extra);
            match Cli::try_parse_from(a).map(|c| c.command) {
                Ok(Command::Migrate(m)) => Ok((m.wait, m.output)),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e.to_string()),
            }
        };
        assert_eq!(migrate(&[]), Ok((true, None)));
        assert_eq!(migrate(&["--wait"]), Ok((true, None)));
        assert_eq!(migrate(&["--wait=false"]), Ok((false, None)));
        assert_eq!(
            migrate(&["--wait=true", "-o", "json"]),
            Ok((true, Some(Output::Json)))
        );
        assert_eq!(
            migrate(&["--wait=false", "--output", "yaml"]),
            Ok((false, Some(Output::Yaml)))
        );
        // `--wait false` would read `false` as a second pod: refused, as kubectl's bools.
        assert!(migrate(&["--wait", "false"]).is_err());
        assert!(migrate(&["-o", "wide"]).is_err());
        let c = Cli::try_parse_from([
            "kubectl-podmotion",
            "migrate-cancel",
            "web-0-ab12c",
            "--wait=false",
        ])
        .unwrap();
        let Command::MigrateCancel(m) = c.command else {
            panic!()
        };
        assert_eq!((m.name.as_str(), m.wait), ("web-0-ab12c", false));
        assert_eq!(m.timeout, Duration::from_secs(300));
        let c = Cli::try_parse_from(["kubectl-podmotion", "status", "-A", "-o", "yaml"]).unwrap();
        let Command::Status(s) = c.command else {
            panic!()
        };
        assert_eq!(s.output, Some(Output::Yaml));
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
