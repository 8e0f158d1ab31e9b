//! The room the final dump needs: checked on the checkpoint volume before anything is
//! locked or frozen, estimated from the newest pre-copy round or the tree's memory.

use super::helpers::blocking;
use super::state::Migration;
use podmotion_broker::procfs;
use std::path::Path;
use tonic::Status;

/// The share of the final dump's estimate that the checkpoint volume must have free on
/// top of it, in percent.
const ROOM_MARGIN_PERCENT: u64 = 10;

/// What the room the final dump needs was estimated from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RoomBasis {
    /// The newest pre-copy round's images on disk.
    LastRound,
    /// The process tree's memory.
    Memory,
}

/// The room the final dump is expected to take on the checkpoint volume, in bytes, and
/// what it was estimated from; `None` where nothing tells.
///
/// - Without dirty-page tracking (`incremental` false: no parent images) the final
///   dump is a full one, written beside the warm copy: after a pre-copy round
///   (`iteration > 0`), the size of the newest round's images, a full copy of the same
///   tree; in Cold (no round), or if the round left nothing on disk, the memory CRIU
///   writes out for the tree (`memory`, see [`tree_memory`]).
/// - With tracking, the final dump holds the pages dirtied since the newest round: in
///   Cold the whole memory, after two rounds or more about the newest round (the pages
///   dirtied in one interval). After the first round alone (a full copy) nothing tells
///   how much is dirty, so nothing is refused.
///
/// The estimate leans low where it is unsure, so that a dump that fits by a wide
/// margin is never refused: it leaves out the images' metadata (kilobytes), memory
/// the tree gains after the round, and everything CRIU does not copy (clean file
/// pages); the margin ([`ROOM_MARGIN_PERCENT`]) covers ordinary growth.
fn final_dump_room(
    iteration: u32,
    last_round_bytes: u64,
    incremental: bool,
    memory: impl FnOnce() -> u64,
) -> Option<(u64, RoomBasis)> {
    match (iteration, incremental) {
        (0, _) => Some((memory(), RoomBasis::Memory)),
        (1, true) => None,
        (_, true) => Some((last_round_bytes, RoomBasis::LastRound)),
        (_, false) if last_round_bytes > 0 => Some((last_round_bytes, RoomBasis::LastRound)),
        (_, false) => Some((memory(), RoomBasis::Memory)),
    }
}

/// Whether `need` bytes (estimated from `basis`) plus the margin fit in `free` bytes;
/// if not, why, in words for the PodMigration's status: both sizes and the chart
/// value to raise.
fn room_decision(need: u64, basis: RoomBasis, free: u64) -> Result<(), String> {
    let wanted = need.saturating_add(need / 100 * ROOM_MARGIN_PERCENT);
    if free >= wanted {
        return Ok(());
    }
    const MIB: u64 = 1 << 20;
    let from = match basis {
        RoomBasis::LastRound => "the size of the newest pre-copy round",
        RoomBasis::Memory => "the process tree's memory",
    };
    Err(format!(
        "the checkpoint volume has {} MiB free, but the final dump needs about {} MiB \
         ({from}, plus {ROOM_MARGIN_PERCENT}%): raise the chart value \
         migrationAgent.checkpointSizeLimit (a tmpfs counted against the agent's memory: \
         migrationAgent.agent.resources.limits.memory may need raising with it); \
         nothing was frozen, the source keeps running",
        free / MIB,
        wanted.div_ceil(MIB),
    ))
}

/// Refuses the final dump (`resource_exhausted`: category `NoRoom`) when the checkpoint volume of `dir`
/// (`incremental`: the dump has a parent round) has not the room [`final_dump_room`] expects it to take. What cannot be read
/// (the volume's free space) never refuses it.
pub(super) async fn check_room(m: &Migration, dir: &Path, incremental: bool) -> Result<(), Status> {
    let (uid, dir, pid) = (m.uid.clone(), dir.to_path_buf(), m.process.pid);
    let (iteration, last_round) = (m.iteration, m.last_round_bytes);
    blocking(move || {
        let Some((need, basis)) =
            final_dump_room(iteration, last_round, incremental, || tree_memory(pid))
        else {
            return Ok(());
        };
        let free = match free_bytes(&dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(%uid, error = %e, "free space of the checkpoint volume unknown; dumping anyway");
                return Ok(());
            }
        };
        tracing::debug!(%uid, need, ?basis, free, "room for the final dump");
        room_decision(need, basis, free).map_err(|why| {
            tracing::warn!(%uid, need, ?basis, free, "final dump refused: {why}");
            Status::resource_exhausted(why)
        })
    })
    .await
}

/// Bytes an unprivileged writer may still use on the filesystem of `dir`.
fn free_bytes(dir: &Path) -> nix::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir)?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// The memory CRIU writes out for the tree rooted at `root`, in bytes: each process's
/// anonymous resident memory and swap (`RssAnon`, `VmSwap`: its private pages), plus
/// once the largest shared-memory resident set of one process (`RssShmem`: shared
/// memory is dumped once, however many processes map it). Clean file-backed pages are
/// not counted: CRIU does not copy them. A process that cannot be read counts nothing.
fn tree_memory(root: i32) -> u64 {
    let (mut private, mut shared) = (0u64, 0u64);
    for pid in procfs::tree(root) {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let kib = |key| status_kib(&status, key);
        private += (kib("RssAnon:") + kib("VmSwap:")) * 1024;
        shared = shared.max(kib("RssShmem:") * 1024);
    }
    private + shared
}

/// A `kB` field of `/proc/<pid>/status` (0 when absent).
fn status_kib(status: &str, key: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_final_dump_is_estimated_from_the_newest_round_or_the_memory() {
        let memory = || 700 * MIB;
        let no_memory = || -> u64 { panic!("the memory is not read when a round tells") };
        // Cold: the tree's memory, with or without tracking.
        for incremental in [false, true] {
            assert_eq!(
                final_dump_room(0, 0, incremental, memory),
                Some((700 * MIB, RoomBasis::Memory))
            );
        }
        // No tracking: the newest round is a full copy, as the final dump will be.
        assert_eq!(
            final_dump_room(1, 1024 * MIB, false, no_memory),
            Some((1024 * MIB, RoomBasis::LastRound))
        );
        assert_eq!(
            final_dump_room(3, 1030 * MIB, false, no_memory),
            Some((1030 * MIB, RoomBasis::LastRound))
        );
        // A round that left nothing on disk tells nothing.
        assert_eq!(
            final_dump_room(2, 0, false, memory),
            Some((700 * MIB, RoomBasis::Memory))
        );
        // Tracking: the first round was full, the final dump holds only dirty pages.
        assert_eq!(final_dump_room(1, 1024 * MIB, true, no_memory), None);
        assert_eq!(
            final_dump_room(2, 40 * MIB, true, no_memory),
            Some((40 * MIB, RoomBasis::LastRound))
        );
    }

    /// The real nodes' case: a 1 GiB PreCopy with the chart's 2Gi volume holding the
    /// warm copy.
    #[test]
    fn a_final_dump_that_does_not_fit_is_refused_naming_both_sizes_and_the_chart_value() {
        let warm = 1030 * MIB;
        let free = 2048 * MIB - warm;
        let why = room_decision(warm, RoomBasis::LastRound, free).unwrap_err();
        assert_eq!(
            why,
            "the checkpoint volume has 1018 MiB free, but the final dump needs about 1133 MiB \
             (the size of the newest pre-copy round, plus 10%): raise the chart value \
             migrationAgent.checkpointSizeLimit (a tmpfs counted against the agent's memory: \
             migrationAgent.agent.resources.limits.memory may need raising with it); \
             nothing was frozen, the source keeps running"
        );
        let why = room_decision(3 * MIB, RoomBasis::Memory, MIB).unwrap_err();
        assert!(
            why.starts_with("the checkpoint volume has 1 MiB free, but the final dump needs about 4 MiB (the process tree's memory, plus 10%)"),
            "{why}"
        );
    }

    #[test]
    fn a_final_dump_that_fits_with_its_margin_goes_ahead() {
        // With a 4Gi volume the same dump fits.
        assert_eq!(
            room_decision(1030 * MIB, RoomBasis::LastRound, 3066 * MIB),
            Ok(())
        );
        // Exactly the estimate and its margin.
        assert_eq!(
            room_decision(1000 * MIB, RoomBasis::Memory, 1100 * MIB),
            Ok(())
        );
        // Within the estimate but not its margin.
        assert!(room_decision(1000 * MIB, RoomBasis::Memory, 1050 * MIB).is_err());
        // Nothing to write.
        assert_eq!(room_decision(0, RoomBasis::LastRound, 0), Ok(()));
    }

    #[test]
    fn the_memory_fields_of_a_process_status_are_read_in_bytes() {
        let status = "Name:\tpostgres\nVmRSS:\t  180224 kB\nRssAnon:\t   16832 kB\n\
                      RssFile:\t    4096 kB\nRssShmem:\t  159296 kB\nVmSwap:\t     512 kB\n";
        assert_eq!(status_kib(status, "RssAnon:"), 16832);
        assert_eq!(status_kib(status, "RssShmem:"), 159296);
        assert_eq!(status_kib(status, "VmSwap:"), 512);
        assert_eq!(status_kib("Name:\tkthreadd\n", "RssAnon:"), 0);
        // This test process: its heap is anonymous memory.
        let me = tree_memory(std::process::id() as i32);
        assert!(me > 0 && me < 64 << 30, "{me}");
        assert_eq!(tree_memory(i32::MAX), 0);
    }
}
