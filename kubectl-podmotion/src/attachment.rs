//! The NodeAgentAttachment the attach commands (`intercept`, `wiretap`, `env`) work
//! through: the one to reuse or to create on a workload's port, when its agents are
//! ready (followed with a watch, a line per change; `Stalled=True` ends the wait with
//! its message), how each target's agent is reached (a port-forward to the target pod,
//! with the token of the agent's credential Secret), and its deletion (foreground,
//! waiting until it is gone) when the command that created it ends.
//!
//! The pure parts decide the attachment to reuse or create ([`reusable`], [`build`]),
//! when it is ready and what to print ([`readiness`], [`progress_line`]); the rest does
//! the I/O.

use std::io::Write;
use std::pin::pin;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::{
    AgentPort, AttachMode, NodeAgentAttachmentSpec, TargetState, TargetStatus, WorkloadRef,
};

use crate::agent::Agent;
use crate::cli::Workload;
use crate::explain::{Attempt, code, kube_error, watch_refused};

const ATTACHMENTS: &str = "nodeagentattachments.podmotion.io";
/// How long Ctrl-C waits for a created attachment to be gone.
const DELETE_WAIT: Duration = Duration::from_secs(120);

/// `intercept-<workload>-<5 hex>`, at most 63 characters.
pub fn attachment_name(workload: &str, suffix: &str) -> String {
    named("intercept", workload, suffix)
}

/// `<command>-<workload>-<5 hex>`, at most 63 characters: the name of an attachment a
/// command creates.
pub(crate) fn named(command: &str, workload: &str, suffix: &str) -> String {
    crate::migrate::migration_name(&format!("{command}-{workload}"), suffix)
}

/// The namespace's attachments; a refusal names the verb and resource.
pub(crate) async fn list_attachments(
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
) -> anyhow::Result<Vec<NodeAgentAttachment>> {
    let listed = naas.list(&ListParams::default()).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "list",
                resource: ATTACHMENTS,
                namespace: Some(namespace),
                name: None,
            },
            &e
        ))
    })?;
    Ok(listed.items)
}

/// Creates `a`; a refusal names the verb, resource and namespace (and the name when it
/// is taken).
pub(crate) async fn create_attachment(
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    a: &NodeAgentAttachment,
) -> anyhow::Result<()> {
    let name = a.name_any();
    naas.create(&PostParams::default(), a).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "create",
                resource: ATTACHMENTS,
                namespace: Some(namespace),
                name: (code(&e) == Some(409)).then_some(name.as_str()),
            },
            &e
        ))
    })?;
    Ok(())
}

/// The attachment of `mode` on the workload's port that `intercept` and `wiretap` use:
/// an existing one (see [`reusable`]) or a new one named `name` (default
/// `<command>-<workload>-<5 hex>`). Returns its name and whether this command created
/// it (then the command deletes it when it ends).
pub(crate) async fn reuse_or_create(
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    w: &Workload,
    app: u16,
    mode: AttachMode,
    name: Option<String>,
) -> anyhow::Result<(String, bool)> {
    let listed = list_attachments(naas, namespace).await?;
    let kind = w.kind.as_str();
    if let Some(a) = reusable(&listed, w, app, mode) {
        let name = a.name_any();
        say(&format!(
            "using nodeagentattachment.podmotion.io/{name} ({mode:?} of {kind}/{}, port {app})",
            w.name
        ));
        return Ok((name, false));
    }
    let command = format!("{mode:?}").to_lowercase();
    let name = name.unwrap_or_else(|| named(&command, &w.name, &crate::migrate::random_suffix()));
    create_attachment(naas, namespace, &build(&name, w, app, mode)).await?;
    say(&format!(
        "nodeagentattachment.podmotion.io/{name} created in namespace {namespace}: {mode:?} of {kind}/{}, port {app}",
        w.name
    ));
    Ok((name, true))
}

/// The attachment to reuse: an attachment of the same workload and `mode`, not being
/// deleted, whose ports name `app` (or are empty: every declared port).
pub fn reusable<'a>(
    attachments: &'a [NodeAgentAttachment],
    workload: &Workload,
    app: u16,
    mode: AttachMode,
) -> Option<&'a NodeAgentAttachment> {
    attachments.iter().find(|a| {
        a.metadata.deletion_timestamp.is_none()
            && a.spec.mode == mode
            && a.spec.workload_ref.kind == workload.kind
            && a.spec.workload_ref.name == workload.name
            && (a.spec.ports.is_empty()
                || a.spec.ports.iter().any(|p| p.port == Some(i32::from(app))))
    })
}

/// The attachment `intercept` (mode Intercept) or `wiretap` (mode Wiretap) creates:
/// the workload, the mode, the one port.
pub fn build(name: &str, workload: &Workload, app: u16, mode: AttachMode) -> NodeAgentAttachment {
    let mut spec: NodeAgentAttachmentSpec = serde_json::from_value(serde_json::json!({
        "workloadRef": {"kind": workload.kind.as_str(), "name": workload.name},
        "mode": mode.as_str(),
    }))
    .expect("a spec with only workloadRef and mode deserializes with its defaults");
    spec.workload_ref = WorkloadRef {
        kind: workload.kind,
        name: workload.name.clone(),
    };
    spec.ports = vec![AgentPort {
        port: Some(i32::from(app)),
        name: None,
        protocol: Default::default(),
    }];
    NodeAgentAttachment::new(name, spec)
}

/// Where an attachment stands, for someone waiting to use its agents.
#[derive(Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Not yet; the line says what it waits for.
    Waiting(String),
    /// Every target's agent is ready.
    Ready,
    /// `Stalled=True`: the reason and message; waiting will not help.
    Stalled(String),
}

fn condition<'a>(
    a: &'a NodeAgentAttachment,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    a.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

/// Ready when the status describes this generation, `Ready=True` and every target runs.
pub fn readiness(a: &NodeAgentAttachment) -> Readiness {
    if let Some(c) = condition(a, "Stalled").filter(|c| c.status == "True") {
        return Readiness::Stalled(format!("{}: {}", c.reason, c.message));
    }
    let Some(st) = &a.status else {
        return Readiness::Waiting("waiting for the operator to take the attachment".into());
    };
    let current =
        st.observed_generation.is_some() && st.observed_generation == a.metadata.generation;
    let ready = condition(a, "Ready").is_some_and(|c| c.status == "True");
    let all_running =
        !st.targets.is_empty() && st.targets.iter().all(|t| t.state == TargetState::Running);
    if current && ready && all_running {
        return Readiness::Ready;
    }
    Readiness::Waiting(progress_line(a))
}

/// `agents 1/2 ready: web-abc on pm-real-0 Running, web-def on pm-real-1 Starting;
/// skipped: web-x (NotReady)`.
pub fn progress_line(a: &NodeAgentAttachment) -> String {
    let Some(st) = &a.status else {
        return "waiting for the operator to take the attachment".into();
    };
    let targets: Vec<String> = st
        .targets
        .iter()
        .map(|t| format!("{} on {} {:?}", t.pod, t.node, t.state))
        .collect();
    let mut line = format!("agents {}/{} ready", st.ready_targets, st.total_targets);
    if !targets.is_empty() {
        line.push_str(": ");
        line.push_str(&targets.join(", "));
    }
    if !st.skipped.is_empty() {
        let skipped: Vec<String> = st
            .skipped
            .iter()
            .map(|s| format!("{} ({:?})", s.pod, s.reason))
            .collect();
        line.push_str("; skipped: ");
        line.push_str(&skipped.join(", "));
    }
    if let Some(c) = condition(a, "Ready").filter(|c| c.status != "True" && !c.reason.is_empty()) {
        line.push_str(&format!(" [{}]", c.reason));
    }
    line
}

pub(crate) fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// The watch of one attachment, by name, retried with backoff.
pub(crate) fn watch_attachment(
    naas: &Api<NodeAgentAttachment>,
    name: &str,
) -> impl futures::Stream<Item = Result<Event<NodeAgentAttachment>, watcher::Error>> + use<> {
    watcher::watcher(
        naas.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff()
}

/// Follows the attachment until it is ready; prints each change; fails on Stalled.
pub(crate) async fn wait_ready(
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    name: &str,
    timeout: Duration,
    say: fn(&str),
) -> anyhow::Result<NodeAgentAttachment> {
    let mut stream = pin!(watch_attachment(naas, name));
    let start = Instant::now();
    let deadline = tokio::time::sleep(timeout);
    let mut deadline = pin!(deadline);
    let mut last = String::new();
    loop {
        tokio::select! {
            ev = stream.next() => {
                let Some(a) = attachment_in(ev, namespace, name)? else {
                    continue;
                };
                match readiness(&a) {
                    Readiness::Ready => {
                        say(&format!(
                            "[{:>5.1}s] {}",
                            start.elapsed().as_secs_f64(),
                            progress_line(&a)
                        ));
                        return Ok(a);
                    }
                    Readiness::Stalled(why) => bail!(
                        "NodeAgentAttachment {namespace}/{name} is Stalled: {why}"
                    ),
                    Readiness::Waiting(line) => {
                        if line != last {
                            say(&format!("[{:>5.1}s] {line}", start.elapsed().as_secs_f64()));
                            last = line;
                        }
                    }
                }
            }
            _ = &mut deadline => bail!(
                "the agents of NodeAgentAttachment {namespace}/{name} were not ready after {}s: {last}",
                timeout.as_secs()
            ),
        }
    }
}

/// The attachment an event of its watch carries; `None` for an event that carries none
/// (the watch's markers, an error the watch retries). Fails when the watch ended, was
/// refused, or saw the attachment deleted.
fn attachment_in(
    ev: Option<Result<Event<NodeAgentAttachment>, watcher::Error>>,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Option<NodeAgentAttachment>> {
    match ev {
        None => bail!("the watch of NodeAgentAttachment {namespace}/{name} ended"),
        Some(Err(e)) => {
            if let Some(refused) = watch_refused(Attempt::watch(ATTACHMENTS, namespace), &e) {
                bail!(refused);
            }
            Ok(None)
        }
        Some(Ok(Event::Apply(a) | Event::InitApply(a))) => Ok(Some(a)),
        Some(Ok(Event::Delete(_))) => {
            bail!("NodeAgentAttachment {namespace}/{name} was deleted while waiting for its agents")
        }
        Some(Ok(_)) => Ok(None),
    }
}

/// The agent of each target: reached through the target pod itself (its loopback, in
/// the attachment's namespace), with the token from the Secret the operator keeps
/// beside it. `_agents_namespace` (`--agents-namespace`) is no longer needed: nothing
/// is read or port-forwarded in the agents' namespace.
pub(crate) async fn agents_of(
    client: &Client,
    a: &NodeAgentAttachment,
    _agents_namespace: Option<&str>,
) -> anyhow::Result<Vec<Agent>> {
    let ns = a.namespace().unwrap_or_default();
    let targets = a
        .status
        .as_ref()
        .map(|s| s.targets.clone())
        .unwrap_or_default();
    let mut out = vec![];
    for t in &targets {
        out.push(agent_of(client, &ns, t).await?);
    }
    if out.is_empty() {
        bail!("the attachment has no targets");
    }
    Ok(out)
}

/// The agent of one target: a port-forward to the target pod (in `ns`, the
/// attachment's namespace) on the port and with the token of the agent's credential
/// Secret there (named like the agent Job).
async fn agent_of(client: &Client, ns: &str, t: &TargetStatus) -> anyhow::Result<Agent> {
    if t.state != TargetState::Running {
        bail!(
            "the agent for {} on {} is not running yet ({:?}): no agent on the node yet",
            t.pod,
            t.node,
            t.state
        );
    }
    let (token, control_port) = agent_credential(client, ns, &t.job).await?;
    Ok(Agent {
        pods: Api::namespaced(client.clone(), ns),
        namespace: ns.to_string(),
        pod: t.pod.clone(),
        control_port,
        token,
        target: t.pod.clone(),
        node: t.node.clone(),
    })
}

/// The token and the control port of the agent Job `job`, from its credential Secret
/// (same name) in the attachment's namespace.
async fn agent_credential(client: &Client, ns: &str, job: &str) -> anyhow::Result<(String, u16)> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret = secrets.get(job).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "get",
                resource: "secrets",
                namespace: Some(ns),
                name: Some(job)
            },
            &e
        ))
    })?;
    crate::agent::credential(&secret).with_context(|| format!("Secret {ns}/{job}"))
}

/// Running, not terminating, and `Ready=True`.
pub fn pod_ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().is_some_and(|s| {
            s.phase.as_deref() == Some("Running")
                && s.conditions
                    .iter()
                    .flatten()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// Deletes the attachment (foreground) and waits until it is gone.
pub(crate) async fn delete_and_wait(
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    name: &str,
) -> anyhow::Result<()> {
    match naas.delete(name, &DeleteParams::foreground()).await {
        Ok(_) => {}
        Err(e) if code(&e) == Some(404) => return Ok(()),
        Err(e) => bail!(kube_error(
            Attempt {
                verb: "delete",
                resource: ATTACHMENTS,
                namespace: Some(namespace),
                name: Some(name),
            },
            &e
        )),
    }
    let deadline = Instant::now() + DELETE_WAIT;
    loop {
        match naas.get_opt(name).await {
            Ok(None) => return Ok(()),
            Ok(Some(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok(Some(_)) => bail!(
                "NodeAgentAttachment {namespace}/{name} is still there {}s after its deletion",
                DELETE_WAIT.as_secs()
            ),
            Err(e) => bail!(kube_error(
                Attempt {
                    verb: "get",
                    resource: ATTACHMENTS,
                    namespace: Some(namespace),
                    name: Some(name),
                },
                &e
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::parse_workload;

    fn naa(v: serde_json::Value) -> NodeAgentAttachment {
        serde_json::from_value(v).unwrap()
    }

    fn attachment(
        name: &str,
        kind: &str,
        workload: &str,
        mode: &str,
        ports: serde_json::Value,
    ) -> NodeAgentAttachment {
        naa(serde_json::json!({
            "apiVersion": "podmotion.io/v1alpha1", "kind": "NodeAgentAttachment",
            "metadata": {"name": name, "namespace": "shop", "generation": 1},
            "spec": {"workloadRef": {"kind": kind, "name": workload}, "mode": mode, "ports": ports}
        }))
    }

    #[test]
    fn an_intercept_of_the_workload_covering_the_port_is_reused() {
        let w = parse_workload("deploy/web").unwrap();
        let list = vec![
            attachment("tap", "Deployment", "web", "Wiretap", serde_json::json!([])),
            attachment(
                "other",
                "Deployment",
                "api",
                "Intercept",
                serde_json::json!([]),
            ),
            attachment(
                "sts",
                "StatefulSet",
                "web",
                "Intercept",
                serde_json::json!([]),
            ),
            attachment(
                "p9090",
                "Deployment",
                "web",
                "Intercept",
                serde_json::json!([{"port": 9090}]),
            ),
            attachment(
                "p8080",
                "Deployment",
                "web",
                "Intercept",
                serde_json::json!([{"port": 8080}]),
            ),
        ];
        assert_eq!(
            reusable(&list, &w, 8080, AttachMode::Intercept).map(|a| a.name_any()),
            Some("p8080".into())
        );
        assert_eq!(
            reusable(&list, &w, 9090, AttachMode::Intercept).map(|a| a.name_any()),
            Some("p9090".into())
        );
        assert!(reusable(&list, &w, 7070, AttachMode::Intercept).is_none());
        let all = vec![attachment(
            "all",
            "Deployment",
            "web",
            "Intercept",
            serde_json::json!([]),
        )];
        assert_eq!(
            reusable(&all, &w, 7070, AttachMode::Intercept).map(|a| a.name_any()),
            Some("all".into())
        );
        let mut going = all.clone();
        going[0].metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Default::default()),
        );
        assert!(
            reusable(&going, &w, 7070, AttachMode::Intercept).is_none(),
            "an attachment being deleted is not reused"
        );
    }

    #[test]
    fn the_created_attachment_intercepts_the_one_port_of_the_workload() {
        let w = parse_workload("sts/db").unwrap();
        let a = build("intercept-db-ab12c", &w, 5432, AttachMode::Intercept);
        let v = serde_json::to_value(&a).unwrap();
        assert_eq!(
            v["spec"]["workloadRef"],
            serde_json::json!({"kind": "StatefulSet", "name": "db"})
        );
        assert_eq!(v["spec"]["mode"], "Intercept");
        assert_eq!(
            v["spec"]["ports"],
            serde_json::json!([{"port": 5432, "protocol": "TCP"}])
        );
        assert_eq!(attachment_name("db", "ab12c"), "intercept-db-ab12c");
        assert!(attachment_name(&"x".repeat(80), "ab12c").len() <= 63);
    }

    fn with_status(status: serde_json::Value, generation: i64) -> NodeAgentAttachment {
        let mut a = attachment("a", "Deployment", "web", "Intercept", serde_json::json!([]));
        a.metadata.generation = Some(generation);
        a.status = Some(serde_json::from_value(status).unwrap());
        a
    }

    fn cond(t: &str, s: &str, reason: &str, msg: &str) -> serde_json::Value {
        serde_json::json!({"type": t, "status": s, "reason": reason, "message": msg,
            "lastTransitionTime": "2026-01-01T00:00:00Z"})
    }

    #[test]
    fn ready_means_this_generation_ready_and_every_target_running() {
        let running = serde_json::json!([
            {"pod": "web-a", "node": "n0", "job": "j0", "state": "Running"},
            {"pod": "web-b", "node": "n1", "job": "j1", "state": "Running"}]);
        let ready = with_status(
            serde_json::json!({"observedGeneration": 2, "targets": running, "readyTargets": 2, "totalTargets": 2,
                "conditions": [cond("Ready", "True", "AgentsReady", "")]}),
            2,
        );
        assert_eq!(readiness(&ready), Readiness::Ready);
        let stale = with_status(serde_json::to_value(ready.status.clone()).unwrap(), 3);
        assert!(
            matches!(readiness(&stale), Readiness::Waiting(_)),
            "an older generation's status"
        );
        let starting = with_status(
            serde_json::json!({"observedGeneration": 1, "readyTargets": 1, "totalTargets": 2,
                "targets": [
                    {"pod": "web-a", "node": "n0", "job": "j0", "state": "Running"},
                    {"pod": "web-b", "node": "n1", "job": "j1", "state": "Starting"}],
                "skipped": [{"pod": "web-c", "reason": "NotReady"}],
                "conditions": [cond("Ready", "False", "AgentsStarting", "")]}),
            1,
        );
        assert_eq!(
            readiness(&starting),
            Readiness::Waiting(
                "agents 1/2 ready: web-a on n0 Running, web-b on n1 Starting; skipped: web-c (NotReady) [AgentsStarting]".into()
            )
        );
        let stalled = with_status(
            serde_json::json!({"observedGeneration": 1,
                "conditions": [cond("Stalled", "True", "PortConflict", "port 8080 is intercepted by web-x")]}),
            1,
        );
        assert_eq!(
            readiness(&stalled),
            Readiness::Stalled("PortConflict: port 8080 is intercepted by web-x".into())
        );
    }
}
