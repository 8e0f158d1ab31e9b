//! `kubectl podmotion intercept`: send a workload's incoming connections on one port to
//! a local port. Creates (or reuses) an `Intercept` NodeAgentAttachment for the port,
//! follows it with a watch until every target's agent is ready (a line per change; a
//! `Stalled=True` condition ends it with its message), then for each agent (one per
//! replica, serving on its target pod's loopback, reached by a port-forward to that pod
//! in the attachment's namespace) starts the intercept through its control API and
//! keeps a few accept streams open; every intercepted connection is bridged to
//! `localhost:LOCAL`. With `--header`, the agent intercepts only the HTTP/1.1 requests
//! carrying the headers; the application answers the others. Ctrl-C stops the intercept
//! on every agent and deletes the attachment if this command created it, waiting until
//! it is gone.
//!
//! The attachment (reused or created, waited for, its agents reached, deleted) is
//! [`crate::attachment`]'s, shared with `wiretap` and `env`. The pure parts of the
//! intercept itself (the request body, whether the agent filters) come first; the I/O
//! is in [`run`].

use std::collections::BTreeMap;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use kube::Client;
use kube::api::Api;
use kube::runtime::watcher::{self, Event};
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::AttachMode;
use tokio::io::AsyncWriteExt;
use tokio::signal::unix::{SignalKind, signal};

use crate::agent::Agent;
use crate::attachment::{
    Readiness, agents_of, delete_and_wait, readiness, reuse_or_create, say, wait_ready,
    watch_attachment,
};
use crate::cli::Intercept;

/// Accept streams each agent keeps open: connections arriving together are handed
/// over without waiting for a new port-forward.
const ACCEPTORS_PER_AGENT: usize = 4;

/// The body of `POST /v1/intercepts/PORT`: empty for a whole-port intercept, the
/// headers for a filtered HTTP intercept.
pub fn intercept_body(headers: &[(String, String)]) -> String {
    if headers.is_empty() {
        return String::new();
    }
    let hs: Vec<serde_json::Value> = headers
        .iter()
        .map(|(n, v)| serde_json::json!({"name": n, "value": v}))
        .collect();
    serde_json::json!({ "headers": hs }).to_string()
}

/// Whether the agent's answer to a filtered intercept says it filters: an agent that
/// predates filtered intercepts ignores the body and would take every request.
pub fn filter_acknowledged(answer: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(answer)
        .ok()
        .and_then(|v| v.get("headers").cloned())
        .is_some_and(|h| h.as_array().is_some_and(|a| !a.is_empty()))
}

pub async fn run(client: Client, namespace: &str, args: &Intercept) -> anyhow::Result<u8> {
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), namespace);
    let (name, created) = reuse_or_create(
        &naas,
        namespace,
        &args.workload,
        args.port.app,
        AttachMode::Intercept,
        args.name.clone(),
    )
    .await?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let outcome = intercept(&client, &naas, namespace, &name, args, &mut sigint).await;
    if created {
        say(&format!(
            "deleting nodeagentattachment.podmotion.io/{name} (created by this intercept)"
        ));
        delete_and_wait(&naas, namespace, &name).await?;
        say(&format!("nodeagentattachment.podmotion.io/{name} is gone"));
    } else {
        say(&format!(
            "nodeagentattachment.podmotion.io/{name} was there before this intercept: kept"
        ));
    }
    outcome
}

/// The intercept's accept tasks, by agent pod: the agent and its accept streams.
type Running = BTreeMap<String, (Agent, tokio::task::JoinSet<()>)>;

/// Waits for the agents, runs the intercept until Ctrl-C, stops it on every agent.
async fn intercept(
    client: &Client,
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    name: &str,
    args: &Intercept,
    sigint: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<u8> {
    let attachment = tokio::select! {
        a = wait_ready(naas, namespace, name, args.timeout, say) => a?,
        _ = sigint.recv() => {
            say("interrupted while waiting for the agents");
            return Ok(crate::migrate::INTERRUPTED);
        }
    };
    let agents = agents_of(client, &attachment, args.agents_namespace.as_deref()).await?;
    let app = args.port.app;
    let body = intercept_body(&args.headers);
    let started = start_on_every_agent(&agents, args, &body).await?;
    say(&format!(
        "intercepting {} to port {app} of {} replica(s) -> localhost:{} (Ctrl-C to stop)",
        what_is_intercepted(&args.headers),
        started.len(),
        args.port.local
    ));
    let stopping = Arc::new(AtomicBool::new(false));
    let mut running = Running::new();
    for a in started {
        let tasks = spawn_acceptors(&a, app, args.port.local, &stopping);
        running.insert(a.pod.clone(), (a, tasks));
    }
    follow_until_interrupted(
        client,
        watch_attachment(naas, name),
        args,
        &body,
        &mut running,
        &stopping,
        sigint,
    )
    .await;
    stopping.store(true, Ordering::SeqCst);
    say("interrupted: stopping the intercept");
    let agents: Vec<Agent> = running.values().map(|(a, _)| a.clone()).collect();
    stop_all(&agents, app).await;
    for (_, (_, mut tasks)) in running {
        tasks.abort_all();
    }
    Ok(0)
}

/// What an agent answered to `POST /v1/intercepts/PORT`.
enum StartAnswer {
    /// 201, and filtering if headers were asked for.
    Started,
    /// 201, but the agent ignored the headers (its image predates filtered intercepts):
    /// it now takes every request.
    Unfiltered,
    /// Any other status, with the agent's answer.
    Refused(u16, String),
}

async fn start_intercept(a: &Agent, args: &Intercept, body: &str) -> anyhow::Result<StartAnswer> {
    let app = args.port.app;
    Ok(
        match a
            .call("POST", &format!("/v1/intercepts/{app}"), body)
            .await?
        {
            (201, answer) if args.headers.is_empty() || filter_acknowledged(&answer) => {
                StartAnswer::Started
            }
            (201, _) => StartAnswer::Unfiltered,
            (c, answer) => StartAnswer::Refused(c, answer),
        },
    )
}

/// Starts the intercept on each agent in turn; on the first that does not take it,
/// stops it on those that did and fails with why.
async fn start_on_every_agent(
    agents: &[Agent],
    args: &Intercept,
    body: &str,
) -> anyhow::Result<Vec<Agent>> {
    let app = args.port.app;
    let mut started: Vec<Agent> = vec![];
    let mut failure = None;
    for a in agents {
        let t = &a.target;
        match start_intercept(a, args, body).await {
            Ok(StartAnswer::Started) => started.push(a.clone()),
            Ok(StartAnswer::Unfiltered) => {
                started.push(a.clone());
                failure = Some(format!(
                    "the agent for {t} does not filter by header (its image predates filtered HTTP intercepts): not intercepting"
                ));
            }
            Ok(StartAnswer::Refused(409, answer)) => {
                failure = Some(format!(
                    "port {app} of {t} is already intercepted by another client ({answer}); stop that intercept first"
                ));
            }
            Ok(StartAnswer::Refused(c, answer)) => {
                failure = Some(format!(
                    "the agent for {t} refused the intercept ({c}): {answer}"
                ));
            }
            Err(e) => failure = Some(format!("reaching the agent for {t}: {e:#}")),
        }
        if failure.is_some() {
            break;
        }
    }
    if let Some(f) = failure {
        stop_all(&started, app).await;
        bail!(f);
    }
    Ok(started)
}

/// `every connection`, or `HTTP requests with x-dev: me, …` for a filtered intercept.
fn what_is_intercepted(headers: &[(String, String)]) -> String {
    if headers.is_empty() {
        return "every connection".to_string();
    }
    let hs: Vec<String> = headers.iter().map(|(n, v)| format!("{n}: {v}")).collect();
    format!("HTTP requests with {}", hs.join(", "))
}

/// Replicas come and go: follows the attachment's targets until Ctrl-C.
async fn follow_until_interrupted(
    client: &Client,
    updates: impl futures::Stream<Item = Result<Event<NodeAgentAttachment>, watcher::Error>>,
    args: &Intercept,
    body: &str,
    running: &mut Running,
    stopping: &Arc<AtomicBool>,
    sigint: &mut tokio::signal::unix::Signal,
) {
    let mut stream = pin!(updates);
    let mut watching = true;
    loop {
        tokio::select! {
            _ = sigint.recv() => break,
            ev = stream.next(), if watching => match ev {
                None => watching = false,
                Some(Ok(Event::Apply(a) | Event::InitApply(a))) if readiness(&a) == Readiness::Ready => {
                    follow_targets(client, &a, args, body, running, stopping).await;
                }
                Some(_) => {}
            },
        }
    }
}

fn spawn_acceptors(
    a: &Agent,
    app: u16,
    local: u16,
    stopping: &Arc<AtomicBool>,
) -> tokio::task::JoinSet<()> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..ACCEPTORS_PER_AGENT {
        tasks.spawn(acceptor(a.clone(), app, local, stopping.clone()));
    }
    tasks
}

/// Brings the running agents in line with a Ready attachment's: a new replica's agent
/// gets the intercept and accept streams; a gone one's accept streams end.
async fn follow_targets(
    client: &Client,
    a: &NodeAgentAttachment,
    args: &Intercept,
    body: &str,
    running: &mut Running,
    stopping: &Arc<AtomicBool>,
) {
    let agents = match agents_of(client, a, args.agents_namespace.as_deref()).await {
        Ok(a) => a,
        Err(e) => {
            eprintln!("warning: following the attachment's replicas: {e:#}");
            return;
        }
    };
    let app = args.port.app;
    let gone: Vec<String> = running
        .keys()
        .filter(|p| !agents.iter().any(|a| &a.pod == *p))
        .cloned()
        .collect();
    for p in gone {
        if let Some((a, mut tasks)) = running.remove(&p) {
            tasks.abort_all();
            say(&format!(
                "replica {} on {} left (its agent {} is gone)",
                a.target, a.node, a.pod
            ));
        }
    }
    for ag in agents {
        if running.contains_key(&ag.pod) {
            continue;
        }
        let t = &ag.target;
        match start_intercept(&ag, args, body).await {
            Ok(StartAnswer::Started) => {
                say(&format!(
                    "replica {t} on {} joined: intercepting there too",
                    ag.node
                ));
                let tasks = spawn_acceptors(&ag, app, args.port.local, stopping);
                running.insert(ag.pod.clone(), (ag, tasks));
            }
            Ok(StartAnswer::Unfiltered) => {
                let _ = ag
                    .call("DELETE", &format!("/v1/intercepts/{app}"), "")
                    .await;
                eprintln!(
                    "warning: the agent for new replica {t} does not filter by header: not intercepting there"
                );
            }
            Ok(StartAnswer::Refused(c, answer)) => eprintln!(
                "warning: the agent for new replica {t} refused the intercept ({c}): {answer}"
            ),
            Err(e) => eprintln!("warning: reaching the agent for new replica {t}: {e:#}"),
        }
    }
}

/// Stops the intercept on each agent (the application gets its traffic back).
async fn stop_all(agents: &[Agent], app: u16) {
    for a in agents {
        match a.call("DELETE", &format!("/v1/intercepts/{app}"), "").await {
            Ok((c, _)) if (200..300).contains(&c) || c == 409 => {}
            Ok((c, answer)) => eprintln!(
                "warning: stopping the intercept on the agent for {} answered {c}: {answer}",
                a.target
            ),
            Err(e) => eprintln!(
                "warning: stopping the intercept on the agent for {}: {e:#}",
                a.target
            ),
        }
    }
}

/// Takes intercepted connections from one agent, one at a time, and bridges each to
/// `localhost:local` on its own task.
async fn acceptor(agent: Agent, app: u16, local: u16, stopping: Arc<AtomicBool>) {
    let mut backoff = Duration::from_millis(200);
    while !stopping.load(Ordering::SeqCst) {
        match agent.accept(app).await {
            Ok(Some((conn, mut stream))) => {
                backoff = Duration::from_millis(200);
                let target = agent.target.clone();
                tokio::spawn(async move {
                    match tokio::net::TcpStream::connect(("127.0.0.1", local)).await {
                        Ok(mut l) => {
                            if let Ok((up, down)) =
                                tokio::io::copy_bidirectional(&mut stream, &mut l).await
                                && up + down > 0
                            {
                                say(&format!(
                                    "{} -> {} ({target}): {up} bytes in, {down} bytes out",
                                    conn.peer, conn.original_dst
                                ));
                            }
                        }
                        Err(e) => {
                            eprintln!(
                                "warning: connection from {} not delivered: localhost:{local}: {e}",
                                conn.peer
                            );
                            let _ = stream.shutdown().await;
                        }
                    }
                });
            }
            Ok(None) => {}
            Err(e) => {
                if stopping.load(Ordering::SeqCst) {
                    return;
                }
                eprintln!(
                    "warning: accept stream of the agent for {}: {e:#}",
                    agent.target
                );
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filtered_intercept_sends_its_headers_and_needs_them_acknowledged() {
        assert_eq!(intercept_body(&[]), "");
        let body = intercept_body(&[("x-dev".into(), "me".into())]);
        assert_eq!(body, r#"{"headers":[{"name":"x-dev","value":"me"}]}"#);
        assert!(filter_acknowledged(
            r#"{"id":3,"port":8080,"headers":[{"name":"x-dev","value":"me"}]}"#
        ));
        assert!(
            !filter_acknowledged(r#"{"id":3,"port":8080}"#),
            "an old agent ignores the filter"
        );
    }
}
