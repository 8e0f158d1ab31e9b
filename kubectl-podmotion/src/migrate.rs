//! `kubectl podmotion migrate`: create the PodMigration, follow it with a watch (no
//! polling) and print what changes until it ends; Ctrl-C deletes it — its finalizer
//! rolls the migration back and resumes the source pod — and waits until it is gone.

use std::io::{IsTerminal, Write};
use std::pin::pin;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use podmotion_api::PodMigration;
use podmotion_api::migration::{MigrationMode, PodMigrationSpec};
use tokio::signal::unix::{SignalKind, signal};

use crate::cli::{Migrate, Mode};
use crate::explain::{Attempt, code, kube_error, watch_refused};
use crate::progress::{Snapshot, changes, final_report, live_line, transfer_summary};

const PODMIGRATIONS: &str = "podmigrations.podmotion.io";
/// How long past `--timeout` the plugin waits for the server-side deadline to end the
/// migration (its rollback takes a moment) before giving up on it.
const DEADLINE_GRACE: Duration = Duration::from_secs(120);
/// Exit code after Ctrl-C (128 + SIGINT, as shells report it).
pub const INTERRUPTED: u8 = 130;

/// `<pod>-<5 hex>`, at most 63 characters (the PodMigration name limit).
pub fn migration_name(pod: &str, suffix: &str) -> String {
    let keep = 63 - suffix.len() - 1;
    let mut base: String = pod.chars().take(keep).collect();
    while base.ends_with(['-', '.']) {
        base.pop();
    }
    format!("{base}-{suffix}")
}

pub fn random_suffix() -> String {
    use std::hash::{BuildHasher, RandomState};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    format!(
        "{:05x}",
        RandomState::new().hash_one((nanos, std::process::id())) & 0xfffff
    )
}

/// The PodMigration the flags ask for.
pub fn build(args: &Migrate, name: &str, pod_uid: Option<String>) -> PodMigration {
    let mut spec: PodMigrationSpec = serde_json::from_value(serde_json::json!({
        "podName": args.pod,
    }))
    .expect("a spec with only podName deserializes with its defaults");
    spec.pod_uid = pod_uid;
    spec.target_node = args.to.clone();
    spec.mode = match args.mode {
        Mode::PreCopy => MigrationMode::PreCopy,
        Mode::Cold => MigrationMode::Cold,
        Mode::PostCopy => MigrationMode::PostCopy,
    };
    spec.dry_run = args.dry_run;
    spec.deadline_seconds = args.timeout.as_secs().clamp(10, 86_400) as i64;
    if let Some(ms) = args.freeze_budget_millis {
        spec.freeze_budget_millis = ms;
    }
    PodMigration::new(name, spec)
}

/// Prints progress lines; on a terminal the last line is a live line rewritten in place.
struct Printer {
    tty: bool,
    live: bool,
    start: Instant,
}

impl Printer {
    /// Prints a progress line; its text (from the migration's status) is sanitised.
    fn line(&mut self, text: &str) {
        let text = crate::sanitize(text);
        let mut out = std::io::stdout().lock();
        if self.live {
            let _ = write!(out, "\r\x1b[2K");
            self.live = false;
        }
        if self.tty {
            let _ = writeln!(out, "{text}");
        } else {
            let _ = writeln!(out, "[{:>6.1}s] {text}", self.start.elapsed().as_secs_f64());
        }
        let _ = out.flush();
    }

    fn live(&mut self, text: &str) {
        if !self.tty {
            return;
        }
        let text = crate::sanitize(text);
        let mut out = std::io::stdout().lock();
        let _ = write!(
            out,
            "\r\x1b[2K{text} {:.0}s",
            self.start.elapsed().as_secs_f64()
        );
        let _ = out.flush();
        self.live = true;
    }

    fn end_live(&mut self) {
        if self.live {
            println!();
            self.live = false;
        }
    }
}

pub async fn run(client: Client, namespace: &str, args: &Migrate) -> anyhow::Result<u8> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods.get(&args.pod).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "get",
                resource: "pods",
                namespace: Some(namespace),
                name: Some(&args.pod),
            },
            &e
        ))
    })?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| migration_name(&args.pod, &random_suffix()));
    let pms: Api<PodMigration> = Api::namespaced(client.clone(), namespace);
    let pm = build(args, &name, pod.metadata.uid.clone());
    pms.create(&PostParams::default(), &pm).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "create",
                resource: PODMIGRATIONS,
                namespace: Some(namespace),
                name: (code(&e) == Some(409)).then_some(name.as_str()),
            },
            &e
        ))
    })?;
    let mut p = Printer {
        tty: std::io::stdout().is_terminal(),
        live: false,
        start: Instant::now(),
    };
    p.line(&format!(
        "podmigration.podmotion.io/{name} created in namespace {namespace}: pod {} ({:?}{}{})",
        args.pod,
        pm.spec.mode,
        args.to
            .as_deref()
            .map(|n| format!(", to {n}"))
            .unwrap_or_default(),
        if args.dry_run { ", dry run" } else { "" }
    ));
    follow(
        &pms,
        namespace,
        &name,
        args.timeout + DEADLINE_GRACE,
        &mut p,
    )
    .await
}

/// What [`follow`] knows of the migration between events.
#[derive(Default)]
struct Following {
    /// The status last printed: only changes are printed.
    prev: Option<Snapshot>,
    /// This command deleted the migration (Ctrl-C or the deadline): it ends in a rollback.
    aborting: bool,
    /// The migration was in the watch's current list (reset at each re-list).
    seen: bool,
    /// The final report was printed.
    reported: bool,
}

async fn follow(
    pms: &Api<PodMigration>,
    namespace: &str,
    name: &str,
    give_up_after: Duration,
    p: &mut Printer,
) -> anyhow::Result<u8> {
    let stream = watcher::watcher(
        pms.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff();
    let mut stream = pin!(stream);
    let mut sigint = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let give_up = tokio::time::sleep(give_up_after);
    let mut give_up = pin!(give_up);
    let mut f = Following::default();
    loop {
        tokio::select! {
            ev = stream.next() => {
                let Some(ev) = watch_event(ev, p, namespace, name)? else { continue };
                if let Some(exit) = f.on_event(ev, p, namespace, name)? {
                    return Ok(exit);
                }
            }
            _ = sigint.recv() => {
                p.end_live();
                if f.aborting {
                    p.line(&format!(
                        "not waiting any longer; PodMigration {namespace}/{name} is being deleted and rolls back on its own"
                    ));
                    return Ok(INTERRUPTED);
                }
                f.aborting = true;
                p.line(&format!(
                    "interrupted: deleting PodMigration {name}; its finalizer rolls the migration back and resumes the source pod (Ctrl-C again to stop waiting)"
                ));
                delete(pms, namespace, name).await?;
            }
            _ = &mut give_up, if !f.aborting => {
                p.end_live();
                p.line(&format!(
                    "PodMigration {name} did not end within its deadline and {}s of grace: deleting it (rolls back)",
                    DEADLINE_GRACE.as_secs()
                ));
                f.aborting = true;
                delete(pms, namespace, name).await?;
            }
        }
    }
}

/// The event a watch item carries; `None` after an error the watch retries (said on a
/// line). Fails when the watch ended or was refused.
fn watch_event(
    ev: Option<Result<Event<PodMigration>, watcher::Error>>,
    p: &mut Printer,
    namespace: &str,
    name: &str,
) -> anyhow::Result<Option<Event<PodMigration>>> {
    match ev {
        None => bail!("the watch of PodMigration {namespace}/{name} ended"),
        Some(Err(e)) => {
            if let Some(refused) = watch_refused(Attempt::watch(PODMIGRATIONS, namespace), &e) {
                bail!(refused);
            }
            p.line(&format!("watch interrupted ({e}); resuming"));
            Ok(None)
        }
        Some(Ok(ev)) => Ok(Some(ev)),
    }
}

impl Following {
    /// Prints what the event changed; `Some(exit code)` when following is over.
    fn on_event(
        &mut self,
        ev: Event<PodMigration>,
        p: &mut Printer,
        namespace: &str,
        name: &str,
    ) -> anyhow::Result<Option<u8>> {
        match ev {
            Event::Init => self.seen = false,
            Event::InitDone if !self.seen => return self.gone(p, namespace, name).map(Some),
            Event::InitDone => {}
            Event::Apply(m) | Event::InitApply(m) => {
                self.seen = true;
                return Ok(self.on_update(&m, p));
            }
            Event::Delete(_) => {
                p.end_live();
                return self.gone(p, namespace, name).map(Some);
            }
        }
        Ok(None)
    }

    /// The changed lines, then the live line or, at a terminal phase, the final report
    /// (once); `Some(exit code)` at a terminal phase unless this command is aborting
    /// (then the deletion ends it).
    fn on_update(&mut self, m: &PodMigration, p: &mut Printer) -> Option<u8> {
        let status = m.status.clone()?;
        for l in changes(self.prev.as_ref(), &status) {
            // On a terminal the transfer summary lives in the live line.
            if p.tty && l.trim() == transfer_summary(&status) {
                continue;
            }
            p.line(&l);
        }
        self.prev = Some(Snapshot::of(&status));
        let Some((outcome, lines)) = final_report(m) else {
            p.live(&live_line(&status));
            return None;
        };
        p.end_live();
        if !self.reported {
            for l in &lines {
                p.line(l);
            }
            self.reported = true;
        }
        (!self.aborting).then(|| outcome.exit_code())
    }

    /// The migration is gone: the end of this command's abort, or someone else's delete.
    fn gone(&self, p: &mut Printer, namespace: &str, name: &str) -> anyhow::Result<u8> {
        if self.aborting {
            p.line(&format!(
                "PodMigration {name} is gone; the source pod runs where it was"
            ));
            return Ok(INTERRUPTED);
        }
        bail!("PodMigration {namespace}/{name} was deleted by someone else before it ended");
    }
}

async fn delete(pms: &Api<PodMigration>, namespace: &str, name: &str) -> anyhow::Result<()> {
    match pms.delete(name, &DeleteParams::foreground()).await {
        Ok(_) => Ok(()),
        Err(e) if code(&e) == Some(404) => Ok(()),
        Err(e) => bail!(kube_error(
            Attempt {
                verb: "delete",
                resource: PODMIGRATIONS,
                namespace: Some(namespace),
                name: Some(name),
            },
            &e
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_generated_name_fits_in_63_characters_and_ends_well() {
        assert_eq!(migration_name("web-0", "ab12c"), "web-0-ab12c");
        let long = format!("{}-x", "a".repeat(56));
        let n = migration_name(&long, "ab12c");
        assert!(n.len() <= 63, "{n}");
        assert!(!n.contains("--"), "{n}");
        assert!(n.ends_with("-ab12c"));
    }

    #[test]
    fn the_flags_become_the_spec() {
        let c = crate::cli::Cli::try_parse_from([
            "kubectl-podmotion",
            "migrate",
            "web-0",
            "--to",
            "n1",
            "--mode",
            "Cold",
            "--timeout",
            "2m",
        ])
        .unwrap();
        let crate::cli::Command::Migrate(args) = c.command else {
            panic!()
        };
        let pm = build(&args, "web-0-ab12c", Some("uid".into()));
        assert_eq!(pm.spec.pod_name, "web-0");
        assert_eq!(pm.spec.pod_uid.as_deref(), Some("uid"));
        assert_eq!(pm.spec.target_node.as_deref(), Some("n1"));
        assert_eq!(pm.spec.mode, MigrationMode::Cold);
        assert_eq!(pm.spec.deadline_seconds, 120);
        assert!(!pm.spec.dry_run);
        // Defaults of the type, as the API server would fill them.
        assert_eq!(pm.spec.freeze_budget_millis, 500);
    }
}
