//! The command line, and the chart values it implies (the agents' checkpoint tmpfs and
//! memory limit for the largest size).

use anyhow::{Context, bail};

use super::figures::Mode;

pub(super) struct Args {
    pub(super) rounds: usize,
    pub(super) sizes: Vec<u32>,
    pub(super) dirty_kib: u32,
    /// The first round's Cold starts with the PodMigration instead of raw CRIU.
    pub(super) mig_first: bool,
    /// After each PodMigration, print the operator's and both agents' log lines about it,
    /// in time order (where the freeze goes between the dump and the restore).
    pub(super) timeline: bool,
}

pub(super) fn parse_args() -> anyhow::Result<Args> {
    let mut a = Args {
        rounds: 3,
        sizes: vec![64, 512],
        dirty_kib: 1024,
        mig_first: false,
        timeline: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--rounds" => a.rounds = value()?.parse()?,
            "--sizes" => {
                a.sizes = value()?
                    .split(',')
                    .map(str::parse)
                    .collect::<Result<_, _>>()?
            }
            "--dirty-kib" => a.dirty_kib = value()?.parse()?,
            "--mig-first" => a.mig_first = true,
            "--timeline" => a.timeline = true,
            other => bail!(
                "unknown argument {other}; usage: bench_real_migration [--rounds N] [--sizes 64,512] [--dirty-kib 1024] [--mig-first] [--timeline]"
            ),
        }
    }
    Ok(a)
}

/// The chart's values for the run: the agents' checkpoint size and memory limits for
/// the pods' sizes, post-copy on, and (`--timeline`) the operator's debug log.
pub(super) fn chart_values(args: &Args) -> Vec<String> {
    let (checkpoint_mib, agent_limit_mib) = agent_memory_mib(&args.sizes);
    eprintln!("agents: checkpointSizeLimit {checkpoint_mib}Mi, memory limit {agent_limit_mib}Mi");
    let mut values = vec![
        "--set-string".to_owned(),
        format!(
            "migrationAgent.checkpointSizeLimit={checkpoint_mib}Mi,\
             migrationAgent.agent.resources.limits.memory={agent_limit_mib}Mi"
        ),
        "--set".to_owned(),
        "migrationAgent.postCopy.enabled=true".to_owned(),
    ];
    if args.timeline {
        // The timeline shows each reconcile of the migration (its start and length).
        values.extend([
            "--set".to_owned(),
            r"operator.logFilter=info\,podmotion_operator=debug\,kube=warn".to_owned(),
        ]);
    }
    values
}

/// The chart's `migrationAgent.checkpointSizeLimit` and the agent container's memory
/// limit (MiB) for pods of `sizes` MiB in every mode: the largest pod's memory as many
/// times as a mode stages it ([`Mode::images_per_pod`]), plus a quarter (the images'
/// own overhead, the agent's 10% room margin) and 256 MiB; the limit is that plus
/// 1 GiB for the agent and its CRIU. Never below the chart's defaults (2Gi, 3Gi).
fn agent_memory_mib(sizes: &[u32]) -> (u32, u32) {
    let staged = sizes
        .iter()
        .flat_map(|s| Mode::ALL.map(|m| s * m.images_per_pod()))
        .max()
        .unwrap_or(0);
    let checkpoint = (staged + staged / 4 + 256).max(2048);
    (checkpoint, (checkpoint + 1024).max(3072))
}
