//! The chaos run's command line.

use std::time::Duration;

use anyhow::{Context as _, bail};

use crate::random_suffix;

pub struct Opts {
    pub long: bool,
    pub duration: Duration,
    /// Seconds between leader kills; `None`: no kills (`--no-leader-kills`).
    pub kill_every: Option<(u64, u64)>,
    pub share_per_mille: u32,
    pub api_restart: bool,
    pub plant_violation: bool,
    /// Migrate a live process between two kwok nodes through process-level agents.
    pub live: bool,
    pub seed: u64,
}

pub fn usage() -> &'static str {
    "usage: chaos [--long] [--duration SECONDS] [--write-fault-share PER_MILLE] [--api-restart] [--seed N]\n\
     short (default): 90 s of faults, leader killed every 4-8 s; --long: 600 s, every 10-30 s.\n\
     --write-fault-share: per mille of the operators' writes answered 409/429 (default 200).\n\
     --no-leader-kills: never kill the leader (with --write-fault-share 0: a run without faults).\n\
     --api-restart: restart the API server once halfway (hack/cluster.sh restart-component).\n\
     --plant-violation: negative control: plant a second DaemonSet of a RunnerPool; the run must fail.\n\
     --no-live-migrations: skip the PodMigrations that move a live process through process-level\n\
     agents on two kwok nodes (they need root and CRIU; PODMOTION_ROOT_TESTS=0 skips them too)."
}

pub fn parse_opts() -> anyhow::Result<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let long = args.iter().any(|a| a == "--long");
    let mut o = Opts::defaults(long);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .with_context(|| format!("{name} needs a value\n{}", usage()))
        };
        match a.as_str() {
            "--long" => {}
            "--api-restart" => o.api_restart = true,
            "--plant-violation" => o.plant_violation = true,
            "--no-live-migrations" => o.live = false,
            "--no-leader-kills" => o.kill_every = None,
            "--duration" => o.duration = duration(&value(a)?)?,
            "--write-fault-share" => o.share_per_mille = write_fault_share(&value(a)?)?,
            "--seed" => {
                let v = value(a)?;
                o.seed = v
                    .parse()
                    .with_context(|| format!("--seed {v:?}: not a number"))?;
            }
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{}", usage()),
        }
    }
    Ok(o)
}

impl Opts {
    /// The options of a short run, or of a long one, before the arguments.
    fn defaults(long: bool) -> Opts {
        Opts {
            long,
            duration: Duration::from_secs(if long { 600 } else { 90 }),
            kill_every: Some(if long { (10, 30) } else { (4, 8) }),
            share_per_mille: 200,
            api_restart: false,
            plant_violation: false,
            live: {
                let skip = std::env::var("PODMOTION_ROOT_TESTS").as_deref() == Ok("0");
                if skip {
                    crate::refuse_skip_under_ci("PODMOTION_ROOT_TESTS");
                }
                !skip
            },
            seed: u64::from_str_radix(&random_suffix(), 16).unwrap_or(1),
        }
    }
}

/// `--duration`'s value.
fn duration(v: &str) -> anyhow::Result<Duration> {
    let s: u64 = v
        .parse()
        .with_context(|| format!("--duration {v:?}: not a number of seconds"))?;
    anyhow::ensure!(s >= 10, "--duration must be at least 10 s");
    Ok(Duration::from_secs(s))
}

/// `--write-fault-share`'s value.
fn write_fault_share(v: &str) -> anyhow::Result<u32> {
    v.parse()
        .ok()
        .filter(|s| *s <= 1000)
        .with_context(|| format!("--write-fault-share {v:?}: a per mille value 0..=1000"))
}
