//! `kubectl podmotion migrate`: create the PodMigration, follow it with a watch (no
//! polling) and print what changes until it ends (`--wait=false`: print its name and
//! return). Ctrl-C stops following and leaves the migration running, as `virtctl
//! migrate` does, and names the command that cancels it: `migrate-cancel`, which
//! deletes the PodMigration — its finalizer rolls the migration back and resumes the
//! source pod — and waits until it is gone.

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
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::cli::{Migrate, MigrateCancel, Mode};
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
/// On stderr when stdout is for the object (`-o`).
struct Printer {
    tty: bool,
    live: bool,
    start: Instant,
    stderr: bool,
}

impl Printer {
    fn new(stderr: bool) -> Printer {
        Printer {
            tty: if stderr {
                std::io::stderr().is_terminal()
            } else {
                std::io::stdout().is_terminal()
            },
            live: false,
            start: Instant::now(),
            stderr,
        }
    }

    fn out(&self) -> Box<dyn Write> {
        if self.stderr {
            Box::new(std::io::stderr().lock())
        } else {
            Box::new(std::io::stdout().lock())
        }
    }

    /// Prints a progress line; its text (from the migration's status) is sanitised.
    fn line(&mut self, text: &str) {
        let text = crate::sanitize(text);
        let mut out = self.out();
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
        let mut out = self.out();
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
            let _ = writeln!(self.out());
            self.live = false;
        }
    }
}

pub async fn run(client: Client, namespace: &str, args: &Migrate) -> anyhow::Result<u8> {
    let pod = get_pod(&client, namespace, &args.pod).await?;
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| migration_name(&args.pod, &random_suffix()));
    let pms: Api<PodMigration> = Api::namespaced(client.clone(), namespace);
    let pm = build(args, &name, pod.metadata.uid.clone());
    let created = create(&pms, namespace, &name, &pm).await?;
    if !args.wait {
        // As `kubectl create`: the name, or the object with `-o`.
        match args.output {
            Some(format) => print!(
                "{}",
                crate::output::render(&crate::output::object(&created)?, format)?
            ),
            None => println!("podmigration.podmotion.io/{name} created"),
        }
        return Ok(0);
    }
    // Before the first line: a Ctrl-C from then on is this command's, not the default
    // action's (which would end the process without saying the migration goes on).
    let mut sigint = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let mut p = Printer::new(args.output.is_some());
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
    let (exit, last) = follow(
        &pms,
        namespace,
        &name,
        Watching::Migration {
            give_up_after: args.timeout + DEADLINE_GRACE,
        },
        &mut sigint,
        &mut p,
    )
    .await?;
    if let (Some(format), Some(m)) = (args.output, last) {
        print!(
            "{}",
            crate::output::render(&crate::output::object(&m)?, format)?
        );
    }
    Ok(exit)
}

/// The pod to migrate; a failure said as kubectl says it.
async fn get_pod(client: &Client, namespace: &str, pod: &str) -> anyhow::Result<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.get(pod).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "get",
                resource: "pods",
                namespace: Some(namespace),
                name: Some(pod),
            },
            &e
        ))
    })
}

/// Creates the PodMigration `pm` (named `name`); a failure said as kubectl says it (a
/// conflict names the migration that exists).
async fn create(
    pms: &Api<PodMigration>,
    namespace: &str,
    name: &str,
    pm: &PodMigration,
) -> anyhow::Result<PodMigration> {
    pms.create(&PostParams::default(), pm).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "create",
                resource: PODMIGRATIONS,
                namespace: Some(namespace),
                name: (code(&e) == Some(409)).then_some(name),
            },
            &e
        ))
    })
}

/// `migrate-cancel NAME`: the abort `migrate`'s Ctrl-C used to do, on its own. Deletes
/// the PodMigration (foreground): its finalizer rolls the migration back and resumes
/// the source pod. A migration that already ended has nothing to cancel and is left as
/// it is. With `--wait`, follows the rollback until the object is gone.
pub async fn cancel(client: Client, namespace: &str, args: &MigrateCancel) -> anyhow::Result<u8> {
    let name = args.name.as_str();
    let pms: Api<PodMigration> = Api::namespaced(client, namespace);
    let pm = pms.get(name).await.map_err(|e| {
        anyhow::anyhow!(kube_error(
            Attempt {
                verb: "get",
                resource: PODMIGRATIONS,
                namespace: Some(namespace),
                name: Some(name),
            },
            &e
        ))
    })?;
    if let Some(phase) = pm.status.as_ref().map(|s| &s.phase)
        && final_report(&pm).is_some()
    {
        bail!(
            "PodMigration {namespace}/{name} already ended {phase:?}: nothing to cancel (kubectl delete podmigration {name} -n {namespace} removes the record)"
        );
    }
    let mut sigint = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let mut p = Printer::new(false);
    if pm.metadata.deletion_timestamp.is_some() {
        p.line(&format!(
            "PodMigration {name} is already being cancelled (rolling back)"
        ));
    } else {
        delete(&pms, namespace, name).await?;
        p.line(&format!(
            "podmigration.podmotion.io/{name} cancelled: its finalizer rolls the migration back and resumes the source pod"
        ));
    }
    if !args.wait {
        return Ok(0);
    }
    let (exit, _) = follow(
        &pms,
        namespace,
        name,
        Watching::Cancel {
            give_up_after: args.timeout,
        },
        &mut sigint,
        &mut p,
    )
    .await?;
    Ok(exit)
}

/// What [`follow`] waits for.
#[derive(Clone, Copy)]
enum Watching {
    /// The migration's end; after `give_up_after` this command deletes it (the
    /// server-side deadline should have ended it first).
    Migration { give_up_after: Duration },
    /// The deletion `migrate-cancel` asked for: until the object is gone, or
    /// `give_up_after` (the rollback goes on without the plugin).
    Cancel { give_up_after: Duration },
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
    /// The object as last seen (printed with `-o`).
    last: Option<PodMigration>,
    /// This is `migrate-cancel`: the migration being gone is its success.
    cancelling: bool,
}

/// Follows the PodMigration; the exit code and the object as last seen.
async fn follow(
    pms: &Api<PodMigration>,
    namespace: &str,
    name: &str,
    watching: Watching,
    sigint: &mut Signal,
    p: &mut Printer,
) -> anyhow::Result<(u8, Option<PodMigration>)> {
    let stream = watcher::watcher(
        pms.clone(),
        watcher::Config::default().fields(&format!("metadata.name={name}")),
    )
    .default_backoff();
    let mut stream = pin!(stream);
    let (give_up_after, cancelling) = match watching {
        Watching::Migration { give_up_after } => (give_up_after, false),
        Watching::Cancel { give_up_after } => (give_up_after, true),
    };
    let give_up = tokio::time::sleep(give_up_after);
    let mut give_up = pin!(give_up);
    let mut give_up_armed = true;
    let mut f = Following {
        aborting: cancelling,
        cancelling,
        ..Following::default()
    };
    loop {
        tokio::select! {
            ev = stream.next() => {
                let Some(ev) = watch_event(ev, p, namespace, name)? else { continue };
                if let Some(exit) = f.on_event(ev, p, namespace, name)? {
                    return Ok((exit, f.last));
                }
            }
            _ = sigint.recv() => {
                say_interrupted(&f, p, namespace, name);
                return Ok((INTERRUPTED, f.last));
            }
            _ = &mut give_up, if give_up_armed => {
                give_up_armed = false;
                if let Some(exit) = f.give_up(pms, namespace, name, give_up_after, p).await? {
                    return Ok((exit, f.last));
                }
            }
        }
    }
}

/// What `follow` prints on Ctrl-C: the watching ends, never the migration.
fn say_interrupted(f: &Following, p: &mut Printer, namespace: &str, name: &str) {
    p.end_live();
    if f.aborting {
        p.line(&format!(
            "not waiting any longer; PodMigration {namespace}/{name} is being deleted and rolls back on its own"
        ));
    } else {
        // As virtctl: Ctrl-C ends the watching, never the migration.
        for l in interrupted_lines(namespace, name) {
            p.line(&l);
        }
    }
}

/// What `migrate` prints on Ctrl-C: the migration goes on, and how to cancel it.
pub fn interrupted_lines(namespace: &str, name: &str) -> Vec<String> {
    vec![
        format!(
            "interrupted: no longer watching; PodMigration {namespace}/{name} goes on (kubectl podmotion status -n {namespace})"
        ),
        format!("to cancel it: kubectl podmotion migrate-cancel {name} -n {namespace}"),
    ]
}

/// `90s`, `5m`, `1m30s`: a duration as the user wrote it.
fn humanize(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s}s"),
        (m, 0) => format!("{m}m"),
        (m, s) => format!("{m}m{s}s"),
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
    /// `give_up_after` passed without the end [`follow`] waits for: `migrate-cancel`
    /// stops waiting (exit code 1); `migrate` deletes the migration (it rolls back) and
    /// follows its rollback, unless it is being deleted already. The exit code when the
    /// command ends here.
    async fn give_up(
        &mut self,
        pms: &Api<PodMigration>,
        namespace: &str,
        name: &str,
        give_up_after: Duration,
        p: &mut Printer,
    ) -> anyhow::Result<Option<u8>> {
        p.end_live();
        if self.cancelling {
            p.line(&format!(
                "PodMigration {namespace}/{name} is still rolling back after {}: not waiting any longer (it goes on without the plugin)",
                humanize(give_up_after)
            ));
            return Ok(Some(1));
        }
        if self.aborting {
            return Ok(None);
        }
        p.line(&format!(
            "PodMigration {name} did not end within its deadline and {}s of grace: deleting it (rolls back)",
            DEADLINE_GRACE.as_secs()
        ));
        self.aborting = true;
        delete(pms, namespace, name).await?;
        Ok(None)
    }

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
                let exit = self.on_update(&m, p);
                self.last = Some(m);
                return Ok(exit);
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
            return Ok(if self.cancelling { 0 } else { INTERRUPTED });
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
    fn ctrl_c_says_the_migration_goes_on_and_names_the_cancel_command() {
        let lines = interrupted_lines("shop", "web-0-ab12c");
        assert!(
            lines[0].contains("PodMigration shop/web-0-ab12c goes on"),
            "{lines:?}"
        );
        assert_eq!(
            lines[1],
            "to cancel it: kubectl podmotion migrate-cancel web-0-ab12c -n shop"
        );
        assert!(!lines.iter().any(|l| l.contains("delet")), "{lines:?}");
        assert_eq!(humanize(Duration::from_secs(300)), "5m");
        assert_eq!(humanize(Duration::from_secs(90)), "1m30s");
        assert_eq!(humanize(Duration::from_secs(45)), "45s");
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
