//! One migration agent's memory peaks over a PodMigration: its process's VmHWM and its
//! container's memory-cgroup peak, both reset when the watch starts.

use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};

use crate::real::agents::agent_pids;

/// One node agent's process and memory cgroup, their peaks reset when it was found.
pub(super) struct AgentWatch {
    pid: u32,
    cgroup: Result<CgroupPeak, String>,
}

/// The peak of a memory cgroup since it was reset.
enum CgroupPeak {
    /// cgroup v1: `memory.max_usage_in_bytes` (reset by writing 0).
    V1(PathBuf),
    /// cgroup v2: `memory.peak`, reset for reads through this open file only.
    V2(std::fs::File),
}

impl AgentWatch {
    /// The `podmotion-agent` process of the agent pod `uid` (`agent_pids`), its VmHWM
    /// reset (`clear_refs` 5) and its container's memory-cgroup peak reset.
    pub(super) fn start(uid: &str) -> anyhow::Result<AgentWatch> {
        let pids = agent_pids(&[uid.to_owned()]);
        let [pid] = pids[..] else {
            bail!("{} podmotion-agent processes in pod {uid}", pids.len());
        };
        std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
            .with_context(|| format!("resetting VmHWM: /proc/{pid}/clear_refs"))?;
        let cgroup = CgroupPeak::reset(pid).map_err(|e| format!("{e:#}"));
        Ok(AgentWatch { pid, cgroup })
    }

    pub(super) fn rss_peak(&self) -> anyhow::Result<u64> {
        let pid = self.pid;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("the agent process {pid} is gone (restarted?)"))?;
        let kib: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .context("no VmHWM in /proc/<pid>/status")?;
        Ok(kib << 10)
    }

    pub(super) fn cgroup_peak(&mut self) -> anyhow::Result<u64> {
        let pid = self.pid;
        ensure!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "the agent process {pid} is gone (restarted?)"
        );
        match &mut self.cgroup {
            Ok(peak) => peak.read(),
            Err(why) => bail!("{why}"),
        }
    }
}

impl CgroupPeak {
    /// The memory cgroup of `pid` (cgroup v1 `memory` hierarchy, else v2), its peak reset.
    fn reset(pid: u32) -> anyhow::Result<CgroupPeak> {
        let path = format!("/proc/{pid}/cgroup");
        let cgroups = std::fs::read_to_string(&path).with_context(|| path.clone())?;
        let mut v2 = None;
        for line in cgroups.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(_), Some(controllers), Some(dir)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            let dir = dir.trim_start_matches('/');
            if controllers.split(',').any(|c| c == "memory") {
                let file = Path::new("/sys/fs/cgroup/memory")
                    .join(dir)
                    .join("memory.max_usage_in_bytes");
                std::fs::write(&file, "0")
                    .with_context(|| format!("resetting {}", file.display()))?;
                return Ok(CgroupPeak::V1(file));
            }
            if controllers.is_empty() {
                v2 = Some(dir.to_owned());
            }
        }
        let dir = v2.with_context(|| format!("no memory cgroup in {path}"))?;
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let file = Path::new(root).join(&dir).join("memory.peak");
            if let Ok(mut f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&file)
            {
                f.write_all(b"reset")
                    .with_context(|| format!("resetting {} (kernel < 6.12?)", file.display()))?;
                return Ok(CgroupPeak::V2(f));
            }
        }
        bail!("no memory.peak of the cgroup v2 {dir} (no v1 memory hierarchy either)")
    }

    fn read(&mut self) -> anyhow::Result<u64> {
        let text = match self {
            CgroupPeak::V1(file) => {
                std::fs::read_to_string(&*file).with_context(|| file.display().to_string())?
            }
            CgroupPeak::V2(f) => {
                let mut s = String::new();
                f.rewind()?;
                f.read_to_string(&mut s).context("reading memory.peak")?;
                s
            }
        };
        text.trim()
            .parse()
            .with_context(|| format!("memory peak {text:?}"))
    }
}
