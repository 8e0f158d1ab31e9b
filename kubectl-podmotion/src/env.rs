//! `kubectl podmotion env <workload> [--container C]`: the environment a replica's
//! container really runs with (its `/proc/<pid>/environ`, read by the attach agent),
//! printed as a dotenv file on stdout; progress goes to stderr.
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
use crate::cli::{Env, Workload};
use crate::explain::{Attempt, code, kube_error};
use crate::intercept::{
    Readiness, agents_of, create_attachment, delete_and_wait, list_attachments, readiness,
    wait_ready,
};

/// How often the ingest's session Lease is renewed while waiting (its default
/// duration is 60 s).
const RENEW_EVERY: Duration = Duration::from_secs(15);

/// One environment entry as the agent reports it.
#[derive(Debug, serde::Deserialize, PartialEq, Eq)]
pub struct EnvEntry {
    pub name: String,
    pub value: String,
}

/// A dotenv line: `NAME=value`, or `NAME="…"` with `\\`, `\"`, `\$`, `\n`, `\r`, `\t`
/// escaped when the value holds anything but plain characters.
pub fn dotenv_line(name: &str, value: &str) -> String {
    let plain = value
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "_-./:@%+,".contains(c));
    if plain {
        return format!("{name}={value}");
    }
    let mut q = String::with_capacity(value.len() + 2);
    for c in value.chars() {
        match c {
            '\\' => q.push_str("\\\\"),
            '"' => q.push_str("\\\""),
            '$' => q.push_str("\\$"),
            '\n' => q.push_str("\\n"),
            '\r' => q.push_str("\\r"),
            '\t' => q.push_str("\\t"),
            c => q.push(c),
        }
    }
    format!("{name}=\"{q}\"")
}

/// The dotenv file: entries in the process's order; a name that repeats keeps its
/// first value (the one `getenv` returns in the process).
pub fn dotenv(entries: &[EnvEntry]) -> String {
    let mut seen = HashSet::new();
    let mut out = String::new();
    for e in entries {
        if seen.insert(e.name.as_str()) {
            out.push_str(&dotenv_line(&e.name, &e.value));
            out.push('\n');
        }
    }
    out
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
                eprintln!("warning: renewing Lease {namespace}/{name}: {e}");
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
            let name = crate::intercept::named(command, &w.name, &crate::migrate::random_suffix());
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
    print!("{}", dotenv(&env));
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

    #[test]
    fn dotenv_quotes_what_a_shell_or_dotenv_reader_would_misread() {
        assert_eq!(dotenv_line("A", "1"), "A=1");
        assert_eq!(dotenv_line("URL", "http://x:8080/p"), "URL=http://x:8080/p");
        assert_eq!(dotenv_line("E", ""), "E=");
        assert_eq!(dotenv_line("S", "a b"), "S=\"a b\"");
        assert_eq!(
            dotenv_line("Q", "say \"hi\" $HOME\\n\nx"),
            "Q=\"say \\\"hi\\\" \\$HOME\\\\n\\nx\""
        );
        assert_eq!(dotenv_line("H", "a#b"), "H=\"a#b\"");
    }

    #[test]
    fn repeated_names_keep_the_value_getenv_sees() {
        let e = |n: &str, v: &str| EnvEntry {
            name: n.into(),
            value: v.into(),
        };
        assert_eq!(
            dotenv(&[e("B", "1"), e("A", "2"), e("B", "3")]),
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
