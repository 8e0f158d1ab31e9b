//! `kubectl podmotion env <workload> [--container C]`: the environment a replica's
//! container really runs with (its `/proc/<pid>/environ`, read by the attach agent),
//! printed on stdout as POSIX sh assignments (`. app.env` reads them back, and so do
//! dotenv readers that understand single quotes); progress goes to stderr.
//!
//! The names and values are the workload's, so nothing in them may run: a value is
//! single-quoted unless it is plain characters (inside single quotes sh expands
//! nothing; a `'` is written `'\''`), and a name that is not a shell identifier is
//! left out and named on stderr.
//!
//! It uses a Ready attachment of the workload when there is one (any mode: every agent
//! serves the environment), and otherwise creates an `Ingest` attachment (one Job, kept
//! while its session Lease is renewed — this command renews it while it waits), reads
//! the environment and deletes the attachment again ([`with_agent`], which `cp` uses
//! too).

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{AttachMode, IngestSession, NodeAgentAttachmentSpec, WorkloadRef};

use crate::agent::Agent;
use crate::attachment::{
    Readiness, agents_of, create_attachment, delete_and_wait, list_attachments, readiness,
    wait_ready,
};
use crate::cli::{Env, Workload};
use crate::explain::{Attempt, code, kube_error};

/// How often the ingest's session Lease is renewed while waiting (its default
/// duration is 60 s).
const RENEW_EVERY: Duration = Duration::from_secs(15);

/// One environment entry as the agent reports it.
#[derive(Debug, serde::Deserialize, PartialEq, Eq)]
pub struct EnvEntry {
    pub name: String,
    pub value: String,
}

/// Whether `name` is a shell identifier (`[A-Za-z_][A-Za-z0-9_]*`), the only names an
/// assignment `NAME=value` takes; anything else would be run as a command.
pub fn is_shell_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// An assignment line for POSIX sh: `NAME=value` for a plain value, else
/// `NAME='value'` with each `'` written `'\''` (sh expands nothing inside single
/// quotes: no `$`, no backtick, no backslash). `name` must be a shell identifier.
pub fn sh_line(name: &str, value: &str) -> String {
    let plain = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_-./:@%+,".contains(c));
    if plain {
        return format!("{name}={value}");
    }
    format!("{name}='{}'", value.replace('\'', "'\\''"))
}

/// The env file: entries in the process's order; a name that repeats keeps its first
/// value (the one `getenv` returns in the process). Also the names left out because
/// they are not shell identifiers.
pub fn env_file(entries: &[EnvEntry]) -> (String, Vec<String>) {
    let mut seen = HashSet::new();
    let mut out = String::new();
    let mut skipped = Vec::new();
    for e in entries {
        if !is_shell_name(&e.name) {
            skipped.push(e.name.clone());
        } else if seen.insert(e.name.as_str()) {
            out.push_str(&sh_line(&e.name, &e.value));
            out.push('\n');
        }
    }
    (out, skipped)
}

/// A Ready attachment of the workload, any mode, not being deleted.
pub fn ready_attachment<'a>(
    attachments: &'a [NodeAgentAttachment],
    w: &Workload,
) -> Option<&'a NodeAgentAttachment> {
    attachments.iter().find(|a| {
        a.metadata.deletion_timestamp.is_none()
            && a.spec.workload_ref.kind == w.kind
            && a.spec.workload_ref.name == w.name
            && readiness(a) == Readiness::Ready
    })
}

/// The Ingest attachment `env` creates.
pub fn build_ingest(name: &str, w: &Workload) -> NodeAgentAttachment {
    let mut spec: NodeAgentAttachmentSpec = serde_json::from_value(serde_json::json!({
        "workloadRef": {"kind": w.kind.as_str(), "name": w.name},
        "mode": "Ingest",
        "ingest": {},
    }))
    .expect("an ingest spec deserializes with its defaults");
    spec.workload_ref = WorkloadRef {
        kind: w.kind,
        name: w.name.clone(),
    };
    spec.mode = AttachMode::Ingest;
    spec.ingest = Some(IngestSession {
        lease_name: None,
        lease_duration_seconds: 60,
    });
    NodeAgentAttachment::new(name, spec)
}

pub(crate) fn progress(line: &str) {
    eprintln!("{line}");
}

/// Renews the ingest's Lease (named after the attachment) until dropped.
fn renew_lease(client: Client, namespace: String, name: String) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let leases: Api<Lease> = Api::namespaced(client, &namespace);
        loop {
            let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                k8s_openapi::jiff::Timestamp::now(),
            );
            let patch = serde_json::json!({"spec": {"renewTime": now}});
            if let Err(e) = leases
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                && code(&e) != Some(404)
            {
                eprintln!(
                    "warning: renewing Lease {namespace}/{name}: {}",
                    crate::sanitize(&e.to_string())
                );
            }
            tokio::time::sleep(RENEW_EVERY).await;
        }
    })
}

/// Runs `f` with the agent of one replica of the workload: a Ready attachment's (any
/// mode: every agent serves the environment and the files), else an Ingest's that
/// this creates (named `<command>-<workload>-<5 hex>`), keeps alive while `f` runs
/// and deletes after. `env` and `cp` use it.
pub(crate) async fn with_agent<T, F, Fut>(
    command: &str,
    client: &Client,
    namespace: &str,
    w: &Workload,
    agents_namespace: Option<&str>,
    timeout: Duration,
    f: F,
) -> anyhow::Result<T>
where
    F: FnOnce(Agent) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), namespace);
    let listed = list_attachments(&naas, namespace).await?;
    let (attachment, created, renewer) = match ready_attachment(&listed, w) {
        Some(a) => {
            progress(&format!(
                "using nodeagentattachment.podmotion.io/{} ({:?})",
                a.name_any(),
                a.spec.mode
            ));
            (a.clone(), None, None)
        }
        None => {
            let name = crate::attachment::named(command, &w.name, &crate::migrate::random_suffix());
            create_attachment(&naas, namespace, &build_ingest(&name, w)).await?;
            progress(&format!(
                "nodeagentattachment.podmotion.io/{name} created in namespace {namespace}: Ingest of {}/{}",
                w.kind.as_str(),
                w.name
            ));
            let renewer = renew_lease(client.clone(), namespace.to_string(), name.clone());
            let ready = wait_ready(&naas, namespace, &name, timeout, progress).await;
            match ready {
                Ok(a) => (a, Some(name), Some(renewer)),
                Err(e) => {
                    renewer.abort();
                    delete_and_wait(&naas, namespace, &name).await?;
                    return Err(e);
                }
            }
        }
    };
    let result = async {
        let agents = agents_of(client, &attachment, agents_namespace).await?;
        let agent = agents.into_iter().next().context("no agent")?;
        f(agent).await
    }
    .await;
    if let Some(r) = renewer {
        r.abort();
    }
    if let Some(name) = created {
        delete_and_wait(&naas, namespace, &name).await?;
        progress(&format!("nodeagentattachment.podmotion.io/{name} deleted"));
    }
    result
}

pub async fn run(client: Client, namespace: &str, args: &Env) -> anyhow::Result<u8> {
    let env = with_agent(
        "env",
        &client,
        namespace,
        &args.workload,
        args.agent.agents_namespace.as_deref(),
        args.agent.timeout,
        |agent| read_env(&client, namespace, agent, args),
    )
    .await?;
    let (file, skipped) = env_file(&env);
    for name in skipped {
        eprintln!(
            "warning: left out the variable {}: its name is not a shell identifier",
            crate::sanitize(&name)
        );
    }
    print!("{file}");
    Ok(0)
}

/// The runtime's id of the replica's container named `container` (what the agent
/// knows containers by), or `None` for the pod's first.
pub(crate) async fn container_id(
    client: &Client,
    namespace: &str,
    agent: &Agent,
    container: Option<&str>,
) -> anyhow::Result<Option<String>> {
    let Some(c) = container else {
        return Ok(None);
    };
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(&agent.target).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "get",
                resource: "pods",
                namespace: Some(namespace),
                name: Some(&agent.target),
            },
            &e
        ))
    })?;
    let id = pod
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
        .into_iter()
        .find(|s| s.name == c)
        .and_then(|s| s.container_id)
        .with_context(|| format!("pod {} has no running container {c}", agent.target))?;
    Ok(Some(id))
}

async fn read_env(
    client: &Client,
    namespace: &str,
    agent: Agent,
    args: &Env,
) -> anyhow::Result<Vec<EnvEntry>> {
    let query = container_id(client, namespace, &agent, args.agent.container.as_deref())
        .await?
        .map(|id| format!("?container={id}"))
        .unwrap_or_default();
    progress(&format!(
        "environment of pod {}{} (node {})",
        agent.target,
        args.agent
            .container
            .as_deref()
            .map(|c| format!(", container {c}"))
            .unwrap_or_default(),
        agent.node
    ));
    let (code, body) = agent.call("GET", &format!("/v1/env{query}"), "").await?;
    if code != 200 {
        bail!("the agent for {} answered {code}: {body}", agent.target);
    }
    serde_json::from_str(&body).with_context(|| format!("the agent's environment: {body}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(n: &str, v: &str) -> EnvEntry {
        EnvEntry {
            name: n.into(),
            value: v.into(),
        }
    }

    #[test]
    fn values_are_single_quoted_so_sh_expands_nothing_in_them() {
        assert_eq!(sh_line("A", "1"), "A=1");
        assert_eq!(sh_line("URL", "http://x:8080/p"), "URL=http://x:8080/p");
        assert_eq!(sh_line("E", ""), "E=");
        assert_eq!(sh_line("S", "a b"), "S='a b'");
        assert_eq!(sh_line("B", "`id`"), "B='`id`'");
        assert_eq!(sh_line("D", "$(id) ${HOME}"), "D='$(id) ${HOME}'");
        assert_eq!(sh_line("Q", "it's"), r"Q='it'\''s'");
        assert_eq!(sh_line("N", "a\nb\\c"), "N='a\nb\\c'");
    }

    #[test]
    fn names_that_are_not_shell_identifiers_are_left_out_and_reported() {
        for ok in ["A", "_x", "PATH_2"] {
            assert!(is_shell_name(ok), "{ok}");
        }
        for bad in ["", "2A", "A-B", "A B", "x;id", "`id`", "A=B", "É"] {
            assert!(!is_shell_name(bad), "{bad}");
        }
        let (file, skipped) = env_file(&[e("OK", "1"), e("x;touch /tmp/p;y", "2"), e("B", "3")]);
        assert_eq!(file, "OK=1\nB=3\n");
        assert_eq!(skipped, ["x;touch /tmp/p;y"]);
    }

    /// What `sh` makes of the file: each hostile value comes back as it was, and
    /// nothing in it ran.
    #[test]
    fn sourcing_the_file_in_sh_gives_back_the_values_and_runs_nothing() {
        let dir = std::env::temp_dir().join(format!("pm-env-sh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ran = dir.join("ran");
        let hostile = [
            format!("`touch {}`", ran.display()),
            format!("$(touch {})", ran.display()),
            format!("'; touch {}; '", ran.display()),
            "a\\\"b\\$c\nd\te ~ * ?".to_owned(),
        ];
        let entries: Vec<EnvEntry> = hostile
            .iter()
            .enumerate()
            .map(|(i, v)| e(&format!("V{i}"), v))
            .collect();
        let (file, _) = env_file(&entries);
        std::fs::write(dir.join("app.env"), &file).unwrap();
        let script = format!(
            ". {}/app.env && printf '%s\\0' \"$V0\" \"$V1\" \"$V2\" \"$V3\"",
            dir.display()
        );
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let back: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .split_terminator('\0')
            .map(str::to_owned)
            .collect();
        let exists = ran.exists();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(back, hostile);
        assert!(!exists, "a value ran a command");
    }

    #[test]
    fn repeated_names_keep_the_value_getenv_sees() {
        assert_eq!(
            env_file(&[e("B", "1"), e("A", "2"), e("B", "3")]).0,
            "B=1\nA=2\n"
        );
    }

    #[test]
    fn an_ingest_is_created_when_no_ready_attachment_serves_the_workload() {
        let w = crate::cli::parse_workload("deploy/web").unwrap();
        let a = build_ingest("env-web-ab12c", &w);
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(v["spec"]["mode"], "Ingest");
        assert_eq!(v["spec"]["ingest"]["leaseDurationSeconds"], 60);
        assert!(v["spec"].get("ports").is_none(), "an ingest has no ports");
        assert!(ready_attachment(&[a], &w).is_none(), "no status: not ready");
    }
}
