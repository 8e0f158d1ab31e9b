//! A pre-copy round on the source, and what each dump (a round's or the final one)
//! froze the process tree for. Without memory tracking (no soft-dirty on the kernel),
//! a round is a full dump that stops the tree while CRIU collects every page and then
//! resumes it: a stall the workload feels as surely as the final freeze. Each freeze is
//! recorded in the migration's status (`MigrationStatus.freezes`) by CRIU's own figure
//! ([`crate::criu_stats`]), or, where CRIU left none, by the agent's clock around the
//! call, and says which.

use super::helpers::{now_us, run_criu};
use super::parts::PartDump;
use super::state::Migration;
use crate::criu::{Criu, Opts};
use crate::criu_stats::{self, DumpStats};
use crate::images;
use podmotion_wire::agent::{FreezeClock, FreezeRecord, MigrationStatus, Phase};
use podmotion_wire::ids::MigrationUid;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tonic::Status;

/// One pre-copy round (see [`super::Agent::pre_dump_impl`]).
pub(super) struct PreDumpRound {
    /// A CRIU pre-dump (memory tracking), or a full dump leaving the tree running.
    pub(super) kind: i32,
    pub(super) opts: Opts,
    /// The round's directory (`pre-<n>`).
    pub(super) dir: PathBuf,
    pub(super) criu: Criu,
    /// Who CRIU runs as: the tree's owner ([`crate::creds`]).
    pub(super) owner: crate::creds::Owner,
    /// The same round of the pod's other containers.
    pub(super) parts: Vec<PartDump>,
}

/// A pre-copy round, run by a task that owns the migration until CRIU is done: every
/// container of the pod at once, each by a CRIU of its own. Its freeze is recorded.
pub(super) async fn pre_dump_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    r: PreDumpRound,
) -> Result<MigrationStatus, Status> {
    let t = Instant::now();
    let mut dirs = vec![r.dir.clone()];
    dirs.extend(r.parts.iter().map(|p| p.dir.clone()));
    let others = futures::future::join_all(r.parts.into_iter().map(|p| {
        let log = p.dir.join("pre-dump.log");
        run_criu(r.criu.clone(), r.kind, p.opts, log, p.owner)
    }));
    let first = run_criu(
        r.criu.clone(),
        r.kind,
        r.opts,
        r.dir.join("pre-dump.log"),
        r.owner,
    );
    let (first, others) = tokio::join!(first, others);
    first?;
    for (o, p) in others.into_iter().zip(&m.parts) {
        o.map_err(|e| Status::new(e.code(), format!("container {}: {}", p.name, e.message())))?;
    }
    m.timings.last_round_us = t.elapsed().as_micros() as u64;
    m.timings.pre_dump_total_us += m.timings.last_round_us;
    m.timings.last_pre_dump_us = now_us();
    m.iteration += 1;
    let (round, wall) = (m.iteration, Duration::from_micros(m.timings.last_round_us));
    record_freeze(&mut m, round, false, &dirs, wall);
    m.phase = Phase::PreDumping;
    m.last_round_bytes = images::size(&r.dir);
    m.image_bytes = images::size(&m.dir);
    Ok(m.status())
}

/// Records the final dump's freeze (the round after the last pre-copy round), from
/// its image dirs: `dir`, then the other containers'.
pub(super) fn record_final_freeze(m: &mut Migration, dir: &Path, part_dirs: &[PathBuf]) {
    let mut dirs = vec![dir.to_path_buf()];
    dirs.extend_from_slice(part_dirs);
    let (round, wall) = (m.iteration + 1, Duration::from_micros(m.timings.dump_us));
    record_freeze(m, round, true, &dirs, wall);
}

/// Records what the dump of `round` into `dirs` (one per container) froze the tree
/// for; `wall`: the agent's clock around it, used where CRIU left no figure.
pub(super) fn record_freeze(
    m: &mut Migration,
    round: u32,
    final_dump: bool,
    dirs: &[PathBuf],
    wall: Duration,
) {
    let stats: Vec<_> = dirs.iter().map(|d| criu_stats::read(d)).collect();
    let bytes = dirs.iter().map(|d| page_bytes(d)).sum();
    let f = freeze_of(round, final_dump, stats, bytes, wall, &m.uid);
    tracing::info!(
        uid = %m.uid,
        round,
        final_dump,
        frozen_us = f.frozen_us,
        freezing_us = f.freezing_us,
        pages = f.pages_written,
        clock = f.clock().as_str_name(),
        "the tree's freeze"
    );
    m.freezes.push(f);
}

/// The freeze of one dump of every container of the pod, from each container's CRIU
/// statistics (`stats`, in the order of the dirs): the containers were frozen at the
/// same time, so the pod's freeze is its longest container's; pages add up. Where any
/// container's statistics are missing or unreadable, the agent's clock (`wall`) for
/// all, said so in `clock` and in the log.
fn freeze_of(
    round: u32,
    final_dump: bool,
    stats: Vec<Result<Option<DumpStats>, String>>,
    bytes_written: u64,
    wall: Duration,
    uid: &MigrationUid,
) -> FreezeRecord {
    let all: Result<Vec<DumpStats>, String> = stats
        .into_iter()
        .map(|s| s.and_then(|s| s.ok_or_else(|| "CRIU wrote no statistics".to_string())))
        .collect();
    let base = FreezeRecord {
        round,
        final_dump,
        bytes_written,
        ..Default::default()
    };
    match all {
        Ok(all) if !all.is_empty() => {
            let longest = all
                .iter()
                .max_by_key(|s| s.freezing_us + s.frozen_us)
                .expect("not empty");
            FreezeRecord {
                frozen_us: longest.frozen_us,
                freezing_us: longest.freezing_us,
                pages_written: all.iter().map(|s| s.pages_written).sum(),
                clock: FreezeClock::Criu as i32,
                ..base
            }
        }
        other => {
            let why = other.err().unwrap_or_else(|| "no dump".into());
            tracing::warn!(%uid, round, error = %why, "no CRIU statistics of the freeze; the agent's clock around the dump stands for it");
            FreezeRecord {
                frozen_us: wall.as_micros() as u64,
                clock: FreezeClock::Agent as i32,
                ..base
            }
        }
    }
}

/// Bytes of the page images (`pages-*.img`) CRIU wrote into `dir`.
fn page_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            name.starts_with("pages-") && name.ends_with(".img")
        })
        .filter_map(|e| e.metadata().ok())
        .filter(|md| md.is_file())
        .map(|md| md.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uid() -> MigrationUid {
        MigrationUid::parse("3f2a0c1e-8b4d-4c6e-9a1f-5d7b2e8c0a13").unwrap()
    }

    fn stats(freezing_us: u64, frozen_us: u64, pages_written: u64) -> DumpStats {
        DumpStats {
            freezing_us,
            frozen_us,
            pages_written,
            ..Default::default()
        }
    }

    #[test]
    fn a_pod_s_round_is_frozen_as_long_as_its_longest_container_and_writes_all_pages() {
        let f = freeze_of(
            2,
            false,
            vec![
                Ok(Some(stats(900, 440_000, 110_000))),
                Ok(Some(stats(20_000, 430_000, 2_000))),
            ],
            458_752_000,
            Duration::from_millis(900),
            &uid(),
        );
        assert_eq!(
            f,
            FreezeRecord {
                round: 2,
                final_dump: false,
                frozen_us: 430_000,
                freezing_us: 20_000,
                pages_written: 112_000,
                bytes_written: 458_752_000,
                clock: FreezeClock::Criu as i32,
            }
        );
    }

    #[test]
    fn without_criu_s_figure_for_every_container_the_agent_s_clock_stands_and_says_so() {
        for missing in [Ok(None), Err("stats-dump: magic".to_string())] {
            let f = freeze_of(
                1,
                true,
                vec![Ok(Some(stats(900, 440_000, 110_000))), missing],
                4096,
                Duration::from_micros(612_345),
                &uid(),
            );
            assert_eq!(f.clock(), FreezeClock::Agent);
            assert_eq!((f.frozen_us, f.freezing_us), (612_345, 0));
            assert_eq!((f.round, f.final_dump, f.bytes_written), (1, true, 4096));
            assert_eq!(f.pages_written, 0, "unknown, not a part's count");
        }
    }

    #[test]
    fn only_page_images_count_as_written_bytes() {
        let dir = std::env::temp_dir().join(format!("warm-pages-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("pages-9.img.d")).unwrap();
        std::fs::write(dir.join("pages-1.img"), vec![0u8; 8192]).unwrap();
        std::fs::write(dir.join("pages-2.img"), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.join("pagemap-1.img"), vec![0u8; 100]).unwrap();
        std::fs::write(dir.join("stats-dump"), vec![0u8; 60]).unwrap();
        assert_eq!(page_bytes(&dir), 12288);
        assert_eq!(page_bytes(&dir.join("absent")), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
