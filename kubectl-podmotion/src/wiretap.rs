//! `kubectl podmotion wiretap <workload> --port APP -w FILE.pcapng`: copies of every
//! connection to the port on every replica, while the application still answers them,
//! written as pcapng ([`crate::pcapng`]) until Ctrl-C. Creates (or reuses) a `Wiretap`
//! NodeAgentAttachment for the port, starts a wiretap on each agent and reads its
//! frame stream through a port-forward; Ctrl-C stops the wiretaps, closes the file and
//! deletes the attachment if this command created it.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use kube::Client;
use kube::api::Api;
use podmotion_api::NodeAgentAttachment;
use podmotion_api::attachment::AttachMode;
use tokio::io::AsyncReadExt;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::agent::Agent;
use crate::attachment::{agents_of, delete_and_wait, reuse_or_create, say, wait_ready};
use crate::cli::Wiretap;
use crate::pcapng::{Writer, header, parse_frame};

pub async fn run(client: Client, namespace: &str, args: &Wiretap) -> anyhow::Result<u8> {
    let naas: Api<NodeAgentAttachment> = Api::namespaced(client.clone(), namespace);
    let (name, created) = reuse_or_create(
        &naas,
        namespace,
        &args.workload,
        args.port,
        AttachMode::Wiretap,
        args.name.clone(),
    )
    .await?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let outcome = tap(&client, &naas, namespace, &name, args, &mut sigint).await;
    if created {
        delete_and_wait(&naas, namespace, &name).await?;
        say(&format!("nodeagentattachment.podmotion.io/{name} is gone"));
    }
    outcome
}

fn micros_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or_default()
}

/// Reads one agent's wiretap stream and forwards its frames, tagged with `src`.
async fn read_frames(
    agent: Agent,
    path: String,
    src: usize,
    tx: mpsc::Sender<(usize, u8, u32, Vec<u8>)>,
) {
    let mut s = match agent.upgrade(&path).await {
        Ok(s) => s,
        Err(e) => {
            // The agent's answer is its text: sanitised.
            eprintln!(
                "warning: wiretap stream of the agent for {}: {}",
                agent.target,
                crate::sanitize(&format!("{e:#}"))
            );
            return;
        }
    };
    let mut buf = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let mut used = 0;
        loop {
            let (kind, conn, payload, len) = match parse_frame(&buf[used..]) {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(e) => {
                    eprintln!(
                        "warning: wiretap stream of the agent for {}: {e}; this agent's stream ends here",
                        agent.target
                    );
                    return;
                }
            };
            if tx.send((src, kind, conn, payload.to_vec())).await.is_err() {
                return;
            }
            used += len;
        }
        buf.drain(..used);
    }
}

async fn tap(
    client: &Client,
    naas: &Api<NodeAgentAttachment>,
    namespace: &str,
    name: &str,
    args: &Wiretap,
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
    let mut file = std::fs::File::create(&args.write)
        .with_context(|| format!("creating {}", args.write.display()))?;
    file.write_all(&header())?;
    let app = args.port;
    let (started, failure) = start_wiretaps(&agents, app).await;
    let mut w = Writer::default();
    let mut readers = tokio::task::JoinSet::new();
    if failure.is_none() {
        readers =
            record_until_interrupted(&started, app, &mut file, &mut w, &args.write, sigint).await?;
    }
    for (a, id) in &started {
        let _ = a
            .call("DELETE", &format!("/v1/wiretaps/{app}/{id}"), "")
            .await;
    }
    readers.abort_all();
    file.flush()?;
    if let Some(f) = failure {
        bail!(f);
    }
    say(&format!(
        "wrote {} packets of {} connections to {}",
        w.packets,
        w.connections,
        args.write.display()
    ));
    Ok(0)
}

/// Starts a wiretap of port `app` on each agent in turn, up to the first that does
/// not: the agents and wiretap ids started, and why the first failure failed.
async fn start_wiretaps(agents: &[Agent], app: u16) -> (Vec<(Agent, u64)>, Option<String>) {
    let mut started: Vec<(Agent, u64)> = vec![];
    let mut failure = None;
    for a in agents {
        match a.call("POST", &format!("/v1/wiretaps/{app}"), "").await {
            Ok((201, body)) => match serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["id"].as_u64())
            {
                Some(id) => started.push((a.clone(), id)),
                None => failure = Some(format!("the agent for {} answered {body}", a.target)),
            },
            Ok((c, body)) => {
                failure = Some(format!(
                    "the agent for {} refused the wiretap ({c}): {body}",
                    a.target
                ))
            }
            Err(e) => failure = Some(format!("reaching the agent for {}: {e:#}", a.target)),
        }
        if failure.is_some() {
            break;
        }
    }
    (started, failure)
}

/// Reads every started wiretap's frames into `file` through `w` until Ctrl-C (or until
/// every stream ended); the reader tasks, for the caller to end once the wiretaps are
/// stopped.
async fn record_until_interrupted(
    started: &[(Agent, u64)],
    app: u16,
    file: &mut std::fs::File,
    w: &mut Writer,
    path: &std::path::Path,
    sigint: &mut tokio::signal::unix::Signal,
) -> anyhow::Result<tokio::task::JoinSet<()>> {
    let (tx, mut rx) = mpsc::channel(1024);
    let mut readers = tokio::task::JoinSet::new();
    for (i, (a, id)) in started.iter().enumerate() {
        readers.spawn(read_frames(
            a.clone(),
            format!("/v1/wiretaps/{app}/{id}/stream"),
            i,
            tx.clone(),
        ));
    }
    say(&format!(
        "tapping port {app} of {} replica(s) into {} (Ctrl-C to stop)",
        started.len(),
        path.display()
    ));
    drop(tx);
    loop {
        tokio::select! {
            f = rx.recv() => {
                let Some((src, kind, conn, payload)) = f else { break };
                file.write_all(&w.frame(src, kind, conn, &payload, micros_now()))?;
            }
            _ = sigint.recv() => break,
        }
    }
    Ok(readers)
}
