//! `kubectl podmotion`: the client side of PodMotion for people at a terminal.
//!
//! `migrate` creates a PodMigration, follows it with a watch and prints its progress
//! (a rewritten line on a terminal, plain lines otherwise), then the measured downtime
//! and the network outcome (`--wait=false`: it returns once the PodMigration exists);
//! Ctrl-C stops following and leaves the migration running, and `migrate-cancel`
//! deletes the PodMigration, which rolls it back. `status` prints one
//! table of every PodMigration, NodeAgentAttachment and RunnerPool the user may list,
//! with what needs attention. `intercept` sends a workload's connections on one port
//! (or, with `--header`, only the matching HTTP requests) to a local port through the
//! attach agents of a NodeAgentAttachment; `env` and `cp` read a replica's environment
//! and files through an agent. The plugin uses the user's kubeconfig and RBAC only.
//!
//! The pure parts (what to print, the table, the wording of API errors) live in
//! [`progress`], [`table`], [`explain`] and the tops of [`attachment`] and
//! [`intercept`]; [`migrate`], [`status`], [`intercept::run`], [`attachment`] and
//! [`agent`] do the I/O.
#![forbid(unsafe_code)]

pub mod agent;
pub mod attachment;
pub mod cli;
pub mod cp;
pub mod drain;
pub mod env;
pub mod explain;
pub mod intercept;
pub mod migrate;
pub mod output;
pub mod pcapng;
pub mod progress;
pub mod status;
pub mod table;
pub mod wiretap;

use anyhow::Context;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// Text from the cluster or an agent (statuses, conditions, API and agent errors,
/// names) made safe to print on a terminal: every C0 control (ESC, CR and newline
/// included), DEL and every C1 control is written as an escape (`\x1b`, `\u{9b}`), so
/// a workload or a writer of a status cannot move the cursor, rewrite earlier lines,
/// set the window title or forge output. Everything else is kept. The one sanitiser
/// for everything the plugin prints that it did not write itself.
pub fn sanitize(s: &str) -> std::borrow::Cow<'_, str> {
    let control = |c: char| c.is_control();
    if !s.chars().any(control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c as u32 {
            n @ (0..=0x1f | 0x7f) => out.push_str(&format!("\\x{n:02x}")),
            n @ 0x80..=0x9f => out.push_str(&format!("\\u{{{n:x}}}")),
            _ => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

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
    // A 429 is an answer here, as for kubectl: `drain` shows the PodMigration an
    // eviction waits on. kube's default retry would repeat the eviction until it went
    // through, and the plugin would report a moved pod as evicted.
    config.default_retry = false;
    Ok(Client::try_from(config)?)
}

#[cfg(test)]
mod tests {
    use super::sanitize;

    #[test]
    fn controls_from_the_cluster_are_escaped_and_the_rest_is_kept() {
        let cases = [
            (
                "plain: ok (é, 漢字, emoji 🚀)",
                "plain: ok (é, 漢字, emoji 🚀)",
            ),
            ("\x1b[2J\x1b]0;pwned\x07", "\\x1b[2J\\x1b]0;pwned\\x07"),
            (
                "line\nforged: Succeeded\r",
                "line\\x0aforged: Succeeded\\x0d",
            ),
            ("tab\tnul\0del\x7f", "tab\\x09nul\\x00del\\x7f"),
            (
                "c1 csi \u{9b}31m and \u{85}",
                "c1 csi \\u{9b}31m and \\u{85}",
            ),
        ];
        for (input, want) in cases {
            assert_eq!(sanitize(input), want, "{input:?}");
            assert!(!sanitize(input).chars().any(char::is_control), "{input:?}");
        }
    }
}
