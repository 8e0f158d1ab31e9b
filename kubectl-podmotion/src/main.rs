//! `kubectl-podmotion`: parse the command line, connect with the user's kubeconfig, run
//! the command; the exit code says how it ended (0 success, 1 failed or error, 2
//! aborted, 130 interrupted).
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use kubectl_podmotion::cli::{Cli, Command};
use kubectl_podmotion::{client, cp, drain, env, intercept, migrate, status, wiretap};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // Agent and API errors carry text from the cluster: sanitised.
            eprintln!("error: {}", kubectl_podmotion::sanitize(&format!("{e:#}")));
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<u8> {
    if let Command::Completion(args) = &cli.command {
        // Needs no cluster: written before any kubeconfig is read.
        print!("{}", kubectl_podmotion::cli::completion(args.shell));
        return Ok(0);
    }
    let client = client(&cli.global).await?;
    let namespace = cli
        .global
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_string());
    match &cli.command {
        Command::Migrate(args) => migrate::run(client, &namespace, args).await,
        Command::MigrateCancel(args) => migrate::cancel(client, &namespace, args).await,
        Command::Completion(_) => unreachable!("answered above"),
        Command::Intercept(args) => intercept::run(client, &namespace, args).await,
        Command::Env(args) => env::run(client, &namespace, args).await,
        Command::Wiretap(args) => wiretap::run(client, &namespace, args).await,
        Command::Cp(args) => cp::run(client, &namespace, args).await,
        Command::Drain(args) => drain::run(client, args).await,
        Command::Status(args) => {
            let ns = (!args.all_namespaces).then_some(namespace.as_str());
            let (table, problems) = status::run(client, ns, args.output).await?;
            print!("{table}");
            for p in &problems {
                eprintln!("warning: {p}");
            }
            Ok(if problems.is_empty() { 0 } else { 1 })
        }
    }
}
