//! `podmotion-operator`: runs the controllers (`run`, the default) or releases every
//! PodMotion object before an uninstall (`reap-all`, the Helm pre-delete hook).
#![forbid(unsafe_code)]

mod uninstall;

use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::Api;
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, CustomResourceExt};
use podmotion_api::{NodeAgentAttachment, PodMigration, RunnerPool};
use podmotion_operator::agents::WireAgents;
use podmotion_operator::config::{ControllerKind, OperatorConfig, PkiConfig};
use podmotion_operator::context::Context;
use podmotion_operator::controllers::attachment::{self, AttachmentConfig};
use podmotion_operator::controllers::migration::{self, MigrationConfig};
use podmotion_operator::controllers::runner_pool;
use podmotion_operator::leader::Leadership;
use podmotion_operator::metrics::Metrics;
use podmotion_operator::pki::plan::{AgentPolicy, Lifetimes};
use podmotion_operator::pki::{Pki, PkiSettings};
use podmotion_operator::server;
use podmotion_operator::webhook::{Webhook, WebhookConfig};
use tokio::sync::watch;

#[derive(Parser, Debug)]
#[command(name = "podmotion-operator", version, about = "PodMotion operator")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    operator: OperatorConfig,
    #[command(flatten)]
    attachment: AttachmentConfig,
    #[command(flatten)]
    migration: MigrationConfig,
    #[command(flatten)]
    pki: PkiConfig,
    #[command(flatten)]
    eviction: WebhookConfig,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the enabled controllers (the default).
    Run,
    /// The Helm pre-delete hook: delete the in-flight PodMigrations and wait for their
    /// rollback, scale the operator Deployment to zero, remove the PodMotion finalizers
    /// in the watched namespaces and delete every attachment Job, then exit.
    ReapAll {
        /// The operator Deployment (in `--namespace`) to scale to zero before the
        /// finalizers are removed; without it nothing is scaled.
        operator_deployment: Option<String>,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    podmotion_log::init(cli.operator.log_format, "info,kube=warn");
    let metrics = Arc::new(Metrics::new());
    let client = podmotion_operator::client::infer(metrics.api_requests.clone())
        .await
        .context("no kubeconfig or in-cluster configuration")?;
    match cli.command.unwrap_or(Command::Run) {
        Command::Run => {
            run(
                client,
                metrics,
                cli.operator,
                Controllers {
                    attachment: cli.attachment,
                    migration: cli.migration,
                    pki: cli.pki,
                    eviction: cli.eviction,
                },
            )
            .await
        }
        Command::ReapAll {
            operator_deployment,
        } => {
            let release = podmotion_operator::claim::release_identity(
                &cli.operator.namespace,
                &cli.operator.leader.lease_name,
            );
            let hook = uninstall::Uninstall {
                jobs_namespace: cli.attachment.jobs_namespace_or(&cli.operator.namespace),
                namespace: cli.operator.namespace,
                operator_deployment,
                controllers: cli.operator.controllers,
                migration_scope: cli.migration.watch_namespace,
                attachment_scope: cli.attachment.watch_namespace,
                runner_pool_scope: runner_pool::RunnerPoolConfig::from_env()?.watch_namespace,
                release,
            };
            hook.run(&client).await?;
            tracing::info!("every PodMotion object released");
            Ok(())
        }
    }
}

/// Settings of the controllers that take flags.
struct Controllers {
    attachment: AttachmentConfig,
    migration: MigrationConfig,
    pki: PkiConfig,
    eviction: WebhookConfig,
}

/// Waits until the three CRDs are Established.
async fn wait_for_crds(client: &Client) -> anyhow::Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for name in [
        PodMigration::crd_name(),
        NodeAgentAttachment::crd_name(),
        RunnerPool::crd_name(),
    ] {
        tracing::info!(crd = name, "waiting for CRD to be established");
        await_condition(api.clone(), name, conditions::is_crd_established()).await?;
    }
    Ok(())
}

async fn run(
    client: Client,
    metrics: Arc<Metrics>,
    config: OperatorConfig,
    settings: Controllers,
) -> anyhow::Result<()> {
    let leader = if config.leader.enabled {
        Leadership::elected()
    } else {
        Leadership::always()
    };
    let (stop_tx, stop_rx) = watch::channel(false);
    let ctx = Arc::new(Context::new(
        client.clone(),
        config.clone(),
        leader.clone(),
        metrics,
        stop_rx,
    ));
    for kind in &config.controllers {
        ctx.readiness.register(kind.name());
    }
    let http = tokio::spawn(server::serve(ctx.clone(), config.http_addr));

    wait_for_crds(&client).await?;

    let pki = build_pki(&client, &config, &settings, &leader)?;
    let webhook = build_webhook(&ctx, &settings, pki.as_ref())?;
    let pki_task = run_pki(ctx.clone(), pki.clone());
    let tasks = spawn_controllers(&config, &ctx, settings, pki);
    let identity = config.identity.clone();
    let leader_cfg = config.leader.clone();
    let namespace = config.namespace.clone();
    let election = async move { leader.run(client, &namespace, &identity, &leader_cfg).await };
    supervise(ctx, stop_tx, http, webhook, pki_task, tasks, election).await
}

/// The run-time key material, when `--pki-ca-secret` names its CA Secret.
fn build_pki(
    client: &Client,
    config: &OperatorConfig,
    settings: &Controllers,
    leader: &Leadership,
) -> anyhow::Result<Option<Pki>> {
    let pki = match &settings.pki.ca_secret {
        Some(secret) => Some(
            Pki::new(
                client.clone(),
                pki_settings(config, settings, secret),
                leader.clone(),
            )?
            .with_protection(settings.pki.key_material_policy.clone()),
        ),
        None => None,
    };
    Ok(pki)
}

/// The eviction webhook: served by every replica, its certificate from the CA.
fn build_webhook(
    ctx: &Arc<Context>,
    settings: &Controllers,
    pki: Option<&Pki>,
) -> anyhow::Result<Option<(Arc<Webhook>, Pki)>> {
    let webhook = match (settings.eviction.enabled, pki) {
        (false, _) => None,
        (true, None) => anyhow::bail!(
            "--eviction-webhook needs the run-time PKI (--pki-ca-secret): its serving \
             certificate comes from the operator's CA"
        ),
        (true, Some(pki)) => Some((
            Arc::new(Webhook::new(
                ctx.clone(),
                settings.eviction.clone(),
                settings.migration.exec_probes,
                settings.migration.agent_namespace.clone(),
            )?),
            pki.clone(),
        )),
    };
    Ok(webhook)
}

/// Runs until the first of the leader election, the eviction webhook, the run-time key
/// material, a controller or the HTTP server stops (an error), or until the shutdown
/// signal, which stops the replica gracefully.
async fn supervise(
    ctx: Arc<Context>,
    stop_tx: watch::Sender<bool>,
    http: tokio::task::JoinHandle<anyhow::Result<()>>,
    webhook: Option<(Arc<Webhook>, Pki)>,
    pki_task: impl std::future::Future<Output = anyhow::Result<()>>,
    mut tasks: ControllerTasks,
    election: impl std::future::Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let serves_webhook = webhook.is_some();
    let webhook_task = serve_webhook(webhook);
    tokio::pin!(webhook_task);

    tokio::select! {
        res = election => {
            res.context("leader election")?;
        }
        res = &mut webhook_task => {
            res.context("eviction webhook")?;
            anyhow::bail!("eviction webhook stopped");
        }
        res = pki_task => {
            res.context("run-time key material")?;
            anyhow::bail!("run-time key material stopped");
        }
        Some(joined) = tasks.join_next() => {
            let (kind, res) = joined?;
            res.with_context(|| format!("{} controller stopped", kind.name()))?;
            anyhow::bail!("{} controller stopped", kind.name());
        }
        res = http => {
            res??;
        }
        _ = shutdown_signal() => {
            tracing::info!("shutting down");
            // Not ready first, so that the endpoints drop this replica; the webhook
            // keeps answering through its grace (crate::graceful) while the
            // controllers stop.
            ctx.readiness.set_stopping();
            let _ = stop_tx.send(true);
            let webhook_done = async {
                if serves_webhook && let Err(e) = webhook_task.await {
                    tracing::warn!(error = %e, "eviction webhook ended with an error");
                }
            };
            tokio::join!(drain(&mut tasks), webhook_done);
        }
    }
    Ok(())
}

/// The eviction webhook's task; never ends when the webhook is not served.
async fn serve_webhook(webhook: Option<(Arc<Webhook>, Pki)>) -> anyhow::Result<()> {
    match webhook {
        Some((w, pki)) => w.run(pki).await,
        None => std::future::pending().await,
    }
}

/// The run-time key material's task and the agents' certificate signer (a controller
/// through the shell); never ends when there is no key material to keep.
async fn run_pki(ctx: Arc<Context>, pki: Option<Pki>) -> anyhow::Result<()> {
    match pki {
        Some(p) => tokio::select! {
            r = p.clone().run() => r,
            r = podmotion_operator::pki::signer::run(ctx, p) => r,
        },
        None => std::future::pending().await,
    }
}

type ControllerTasks = tokio::task::JoinSet<(ControllerKind, anyhow::Result<()>)>;

/// Starts every enabled controller on its own task.
fn spawn_controllers(
    config: &OperatorConfig,
    ctx: &Arc<Context>,
    settings: Controllers,
    pki: Option<Pki>,
) -> ControllerTasks {
    let mut tasks = tokio::task::JoinSet::new();
    let settings = Arc::new(settings);
    for kind in config.controllers.clone() {
        let ctx = ctx.clone();
        let settings = settings.clone();
        let pki = pki.clone();
        tasks.spawn(async move { (kind, run_controller(kind, ctx, &settings, pki).await) });
    }
    tasks
}

/// Waits for every controller to stop after the shutdown signal, logging failures.
async fn drain(tasks: &mut ControllerTasks) {
    while let Some(joined) = tasks.join_next().await {
        if let Ok((kind, Err(e))) = joined {
            tracing::warn!(controller = kind.name(), error = %e, "controller ended with an error");
        }
    }
}

async fn run_controller(
    kind: ControllerKind,
    ctx: Arc<Context>,
    settings: &Controllers,
    pki: Option<Pki>,
) -> anyhow::Result<()> {
    match kind {
        ControllerKind::Attachment => attachment::run_with(ctx, settings.attachment.clone()).await,
        ControllerKind::Migration => {
            let mut cfg = settings.migration.clone();
            if let (None, Some(secret)) = (&cfg.key_file, &settings.pki.migration_key_secret) {
                cfg.key_file = Some(master_key_file(&ctx, &settings.pki, secret).await?);
            }
            match pki {
                // The operator's client certificate comes from the run-time CA and is
                // renewed in place; every connection to an agent uses the current one.
                Some(pki) => {
                    let agents = WireAgents::new(ctx.client.clone(), Some(pki.operator_tls()))
                        .with_settings(cfg.exec_probes, cfg.agent_call_timeout())
                        .with_leader(ctx.leader.clone());
                    migration::run_with(ctx, cfg, Arc::new(agents)).await
                }
                None => migration::run_configured(ctx, cfg).await,
            }
        }
        ControllerKind::RunnerPool => runner_pool::run(ctx).await,
    }
}

/// The PKI settings from the flags: the agents are the migration controller's.
fn pki_settings(config: &OperatorConfig, settings: &Controllers, secret: &str) -> PkiSettings {
    let m = &settings.migration;
    let p = &settings.pki;
    PkiSettings {
        namespace: config.namespace.clone(),
        ca_secret: secret.to_string(),
        bundle_namespace: m.agent_namespace.clone(),
        bundle_configmap: p.bundle_configmap.clone(),
        agents: AgentPolicy {
            namespace: m.agent_namespace.clone(),
            service_account: p.agent_service_account.clone(),
            pod_labels: m
                .agent_selector
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect(),
        },
        life: Lifetimes {
            ca: p.ca_seconds,
            leaf: p.leaf_seconds,
            propagation: p.propagation_seconds,
        },
    }
}

/// Reads (or, as the leader, creates) the master key Secret and writes the key where
/// the migration controller reads it: a 0400 file in the private key-material
/// directory (memory-backed in the chart).
async fn master_key_file(
    ctx: &Context,
    pki: &PkiConfig,
    secret: &str,
) -> anyhow::Result<std::path::PathBuf> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let key = podmotion_operator::pki::shell::master_key(
        &ctx.client,
        &ctx.config.namespace,
        secret,
        &ctx.writer,
        pki.key_material_policy.as_deref(),
    )
    .await
    .with_context(|| format!("migration master key Secret {secret}"))?;
    std::fs::create_dir_all(&pki.key_material_dir)
        .with_context(|| format!("creating {}", pki.key_material_dir.display()))?;
    let path = pki.key_material_dir.join("migration-key");
    let tmp = pki.key_material_dir.join(".migration-key.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(&key)?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("SIGTERM handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn node_arch_names_one_architecture_or_none() {
        let arch = |args: &[&str]| {
            let mut all = vec!["podmotion-operator"];
            all.extend_from_slice(args);
            Cli::try_parse_from(all).map(|c| c.operator.platform())
        };
        assert_eq!(arch(&[]).unwrap().arch(), Some("amd64"));
        assert_eq!(arch(&["--node-arch=arm64"]).unwrap().arch(), Some("arm64"));
        // Empty, as the chart passes `global.nodeArch: ""`: any architecture.
        assert_eq!(arch(&["--node-arch="]).unwrap().arch(), None);
        let e = arch(&["--node-arch=ARM 64"]).unwrap_err().to_string();
        assert!(e.contains("kubernetes.io/arch"), "{e}");
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_run_every_controller_with_leader_election() {
        let cli = Cli::try_parse_from(["podmotion-operator"]).unwrap();
        assert_eq!(cli.operator.controllers.len(), 3);
        assert!(cli.operator.leader.enabled);
        let cli = Cli::try_parse_from([
            "podmotion-operator",
            "--no-leader-election",
            "--controllers",
            "runner-pool",
            "reap-all",
        ])
        .unwrap();
        assert!(!cli.operator.leader.enabled);
        assert_eq!(cli.operator.controllers, vec![ControllerKind::RunnerPool]);
        assert!(matches!(
            cli.command,
            Some(Command::ReapAll {
                operator_deployment: None
            })
        ));
        assert_eq!(cli.operator.log_format, podmotion_log::LogFormat::Json);
        // After the subcommand too (the chart's hook passes it there).
        let cli = Cli::try_parse_from([
            "podmotion-operator",
            "reap-all",
            "pm-podmotion",
            "--log-format=text",
        ])
        .unwrap();
        assert_eq!(cli.operator.log_format, podmotion_log::LogFormat::Text);
        assert_eq!(cli.operator.node_arch, "amd64");
        assert_eq!(cli.operator.platform().to_string(), "linux/amd64");
        let cli = Cli::try_parse_from(["podmotion-operator", "reap-all", "pm-podmotion"]).unwrap();
        assert!(matches!(
            cli.command,
            Some(Command::ReapAll { operator_deployment: Some(d) }) if d == "pm-podmotion"
        ));
    }
}
