//! What the bench measures: the modes it runs, one raw round's and one PodMigration's
//! figures, a round's row with the agents' memory peaks, and the units they print in.

use std::time::Duration;

/// A PodMigration mode the bench runs: every round runs each of [`Mode::ALL`], in
/// that order (a new mode is one more variant here and in `ALL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    Cold,
    PreCopy,
    PostCopy,
}

impl Mode {
    pub(super) const ALL: [Mode; 3] = [Mode::Cold, Mode::PreCopy, Mode::PostCopy];

    /// `spec.mode`.
    pub(super) fn name(self) -> &'static str {
        match self {
            Mode::Cold => "Cold",
            Mode::PreCopy => "PreCopy",
            Mode::PostCopy => "PostCopy",
        }
    }

    /// How many times the pod's memory the source agent's checkpoint tmpfs holds at
    /// once (the chart's `migrationAgent.checkpointSizeLimit`): Cold the one dump,
    /// PreCopy without soft-dirty tracking the final dump beside the warm copy,
    /// PostCopy none (its memory stays in the stopped source until asked for).
    pub(super) fn images_per_pod(self) -> u32 {
        match self {
            Mode::Cold => 1,
            Mode::PreCopy => 2,
            Mode::PostCopy => 0,
        }
    }
}

/// One raw CRIU checkpoint/copy/restore of a fresh pod's container.
#[derive(Debug)]
pub(super) struct Raw {
    pub(super) node: String,
    pub(super) dump_ms: f64,
    pub(super) copy_ms: f64,
    pub(super) restore_ms: f64,
    pub(super) bytes: u64,
}

impl Raw {
    pub(super) fn downtime_ms(&self) -> f64 {
        self.dump_ms + self.copy_ms + self.restore_ms
    }
}

/// One PodMigration, as its status and the agents' logs report it.
#[derive(Debug)]
pub(super) struct Mig {
    pub(super) from: String,
    pub(super) to: String,
    pub(super) downtime_ms: i64,
    /// The pre-copy rounds' freezes (`status.freezes` but the final dump's): without
    /// memory tracking each round stops the pod while CRIU collects its memory.
    pub(super) warm: WarmStalls,
    /// Every freeze of the pod, the warm rounds' and the downtime
    /// (`status.totalFrozenMillis`).
    pub(super) total_frozen_ms: i64,
    pub(super) bytes_sent: i64,
    /// PostCopy: the memory the restored copy fetched after its resume.
    pub(super) lazy_bytes: Option<i64>,
    pub(super) iterations: i32,
    pub(super) final_dump_ms: Option<u64>,
    pub(super) final_dump_bytes: Option<u64>,
    pub(super) restore_ms: Option<u64>,
    /// Creation of the PodMigration to its final phase, as `phaseTransitionTimestamps`
    /// say (second resolution).
    pub(super) total_s: i64,
}

/// The pre-copy rounds' freezes of one PodMigration.
#[derive(Debug, Default)]
pub(super) struct WarmStalls {
    pub(super) count: usize,
    pub(super) sum_ms: i64,
    /// Some were measured by the agent's clock (CRIU left no statistics), an upper
    /// bound, rather than by CRIU.
    pub(super) agent_clock: bool,
}

impl WarmStalls {
    /// `count / sum ms`, marked where the agent's clock stood in for CRIU's.
    pub(super) fn cell(&self) -> String {
        let mark = if self.agent_clock {
            " (agent clock)"
        } else {
            ""
        };
        format!("{} / {}{mark}", self.count, self.sum_ms)
    }
}

pub(super) struct Row {
    pub(super) size: u32,
    pub(super) mode: Mode,
    pub(super) round: usize,
    pub(super) raw: Result<Raw, String>,
    pub(super) mig: Result<Mig, String>,
    /// The two agents' memory over the PodMigration (also of one that failed, once it
    /// was created).
    pub(super) agents: AgentPeaks,
}

/// Bytes, or why they could not be read (printed "n/a").
pub(super) type Reading = Result<u64, String>;

/// The peak memory of the source's and the target's migration agent over one
/// PodMigration (`[source, target]`).
#[derive(Debug)]
pub(super) struct AgentPeaks {
    /// `VmHWM` of the `podmotion-agent` process: its own peak resident memory.
    pub(super) rss: [Reading; 2],
    /// The peak of the agent container's memory cgroup: the agent, the CRIU it runs
    /// and the checkpoint images staged on its tmpfs (`emptyDir` of medium Memory,
    /// charged to the container that writes them).
    pub(super) cgroup: [Reading; 2],
}

impl AgentPeaks {
    pub(super) fn not_measured(why: &str) -> AgentPeaks {
        let na = || Err(why.to_owned());
        AgentPeaks {
            rss: [na(), na()],
            cgroup: [na(), na()],
        }
    }

    pub(super) fn rss_cell(&self) -> String {
        format!("{} / {}", reading(&self.rss[0]), reading(&self.rss[1]))
    }

    pub(super) fn cgroup_cell(&self) -> String {
        format!(
            "{} / {}",
            reading(&self.cgroup[0]),
            reading(&self.cgroup[1])
        )
    }
}

pub(super) fn reading(r: &Reading) -> String {
    r.as_ref().map_or_else(|_| "n/a".into(), |b| mib(*b))
}

pub(super) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub(super) fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1 << 20) as f64)
}

pub(super) fn uptime() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
