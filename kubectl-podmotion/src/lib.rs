//! `kubectl podmotion`: the client side of PodMotion for people at a terminal.
//!
//! `migrate` creates a PodMigration, follows it with a watch and prints its progress
//! (a rewritten line on a terminal, plain lines otherwise), then the measured downtime
//! and the network outcome; Ctrl-C deletes it, which rolls it back. `status` prints one
//! table of every PodMigration, NodeAgentAttachment and RunnerPool the user may list,
//! with what needs attention. `intercept` sends a workload's connections on one port
//! (or, with `--header`, only the matching HTTP requests) to a local port through the
//! attach agents of a NodeAgentAttachment; `env` and `cp` read a replica's environment
//! and files through an agent. The plugin uses the user's kubeconfig and RBAC only.
//!
//! The pure parts (what to print, the table, the wording of API errors) live in
//! [`progress`], [`table`], [`explain`] and the top of [`intercept`]; [`migrate`],
//! [`status`], [`intercept::run`] and [`agent`] do the I/O.
#![forbid(unsafe_code)]

pub mod agent;
pub mod cli;
pub mod cp;
pub mod drain;
pub mod env;
pub mod explain;
pub mod intercept;
pub mod migrate;
pub mod pcapng;
pub mod progress;
pub mod status;
pub mod table;
pub mod wiretap;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// A client from `--kubeconfig`/`--context` or, as kubectl does, `$KUBECONFIG` and
/// `~/.kube/config` (in-cluster config last).
pub async fn client(g: &cli::Global) -> anyhow::Result<Client> {
    let options = KubeConfigOptions {
        context: g.context.clone(),
        ..Default::default()
    };
    let mut config = match &g.kubeconfig {
        Some(path) => {
            let k = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(k, &options).await?
        }
        None if g.context.is_some() => Config::from_kubeconfig(&options).await?,
        None => Config::infer()
            .await
            .context("no kubeconfig: set KUBECONFIG or --kubeconfig (as for kubectl)")?,
    };
    if let Some(user) = &g.as_user {
        config.auth_info.impersonate = Some(user.clone());
    }
    Ok(Client::try_from(config)?)
}
