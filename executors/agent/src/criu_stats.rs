//! CRIU's own account of a dump: after every successful dump and pre-dump CRIU writes
//! `stats-dump` into the images directory, and in it how long it held the process tree
//! frozen. That is the figure of a freeze the agent reports (a pre-copy round's stall,
//! the final dump's share of the downtime); the agent's clock around the call would
//! also count CRIU's start, its checks and its exit, during which the tree runs.
//!
//! The file is a CRIU image (criu/include/magic.h, criu/image.c, criu/protobuf.c):
//! two 32-bit words in the host's byte order, `IMG_SERVICE_MAGIC` and `STATS_MAGIC`,
//! then one protobuf entry, its 32-bit size first, of `StatsEntry` (images/stats.proto)
//! whose `dump` (`DumpStatsEntry`) holds the times in microseconds and the page counts.
//! The nodes this agent runs on are little-endian (x86_64, arm64), as the words are read.

use prost::Message;
use std::path::Path;

/// The file CRIU writes into the images directory after a dump or a pre-dump.
pub const DUMP_STATS_FILE: &str = "stats-dump";

/// `IMG_SERVICE_MAGIC`: the head of CRIU's service files (stats, irmap cache).
const SERVICE_MAGIC: u32 = 0x5510_5940;
/// `STATS_MAGIC`: the kind of the file.
const STATS_MAGIC: u32 = 0x5709_3306;
/// Far more than a `StatsEntry` ever takes (about 60 bytes): a bigger size is not one.
const MAX_ENTRY: usize = 4096;

/// `stats_entry` of images/stats.proto (only `dump`; `restore` is skipped as unknown).
#[derive(Clone, PartialEq, prost::Message)]
struct StatsEntry {
    #[prost(message, optional, tag = "1")]
    dump: Option<DumpStatsEntry>,
}

/// `dump_stats_entry` of images/stats.proto, the fields read here; proto2 `required`
/// fields are read as optional, so a missing one is told from a zero.
#[derive(Clone, PartialEq, prost::Message)]
struct DumpStatsEntry {
    #[prost(uint32, optional, tag = "1")]
    freezing_time: Option<u32>,
    #[prost(uint32, optional, tag = "2")]
    frozen_time: Option<u32>,
    #[prost(uint32, optional, tag = "3")]
    memdump_time: Option<u32>,
    #[prost(uint32, optional, tag = "4")]
    memwrite_time: Option<u32>,
    #[prost(uint64, optional, tag = "5")]
    pages_scanned: Option<u64>,
    #[prost(uint64, optional, tag = "6")]
    pages_skipped_parent: Option<u64>,
    #[prost(uint64, optional, tag = "7")]
    pages_written: Option<u64>,
}

/// What one dump cost the tree, by CRIU's account.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpStats {
    /// Microseconds CRIU took to seize and freeze the tree (`freezing_time`): the
    /// tasks stop one after the other within it.
    pub freezing_us: u64,
    /// Microseconds the whole tree stayed frozen (`frozen_time`), from the end of the
    /// freezing to its resume (a pre-copy round) or to its final state (a final dump
    /// leaves it stopped).
    pub frozen_us: u64,
    /// Microseconds spent collecting the memory (`memdump_time`).
    pub memdump_us: u64,
    /// Microseconds spent writing it (`memwrite_time`).
    pub memwrite_us: u64,
    pub pages_scanned: u64,
    /// Pages left out because the parent images hold them (memory tracking).
    pub pages_skipped_parent: u64,
    pub pages_written: u64,
}

/// Why a stats file was not read.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StatsError {
    #[error("{0} bytes: shorter than CRIU's image head")]
    Short(usize),
    #[error("magic {0:#010x} {1:#010x}: not CRIU's dump statistics")]
    Magic(u32, u32),
    #[error("an entry of {size} bytes where {left} are left")]
    Size { size: usize, left: usize },
    #[error("the entry does not decode: {0}")]
    Decode(String),
    #[error("no dump statistics in the entry (a restore's?)")]
    NoDump,
    #[error("no frozen time in the dump statistics")]
    NoFrozenTime,
}

/// Reads the dump statistics CRIU left in `dir`; `Ok(None)` if there are none (the
/// file is missing: a CRIU that does not write them, or a dump that failed).
pub fn read(dir: &Path) -> Result<Option<DumpStats>, String> {
    let path = dir.join(DUMP_STATS_FILE);
    match std::fs::read(&path) {
        Ok(b) => parse(&b)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Decodes a `stats-dump` image.
pub fn parse(bytes: &[u8]) -> Result<DumpStats, StatsError> {
    let word = |i: usize| {
        bytes
            .get(i * 4..i * 4 + 4)
            .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
    };
    let (Some(head), Some(kind), Some(size)) = (word(0), word(1), word(2)) else {
        return Err(StatsError::Short(bytes.len()));
    };
    if (head, kind) != (SERVICE_MAGIC, STATS_MAGIC) {
        return Err(StatsError::Magic(head, kind));
    }
    let (size, body) = (size as usize, &bytes[12..]);
    if size > body.len() || size > MAX_ENTRY {
        return Err(StatsError::Size {
            size,
            left: body.len(),
        });
    }
    let entry = StatsEntry::decode(&body[..size]).map_err(|e| StatsError::Decode(e.to_string()))?;
    let d = entry.dump.ok_or(StatsError::NoDump)?;
    let frozen = d.frozen_time.ok_or(StatsError::NoFrozenTime)?;
    Ok(DumpStats {
        freezing_us: d.freezing_time.unwrap_or(0).into(),
        frozen_us: frozen.into(),
        memdump_us: d.memdump_time.unwrap_or(0).into(),
        memwrite_us: d.memwrite_time.unwrap_or(0).into(),
        pages_scanned: d.pages_scanned.unwrap_or(0),
        pages_skipped_parent: d.pages_skipped_parent.unwrap_or(0),
        pages_written: d.pages_written.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `stats-dump` as CRIU 4 writes it, encoded by hand from images/stats.proto:
    /// freezing 1 200 µs, frozen 451 000 µs, memdump 300 000, memwrite 140 000, 131 072
    /// pages scanned, 0 skipped, 131 000 written, irmap 0, 0 lazy, 3 page pipes, 9
    /// buffers, 0 shared pages scanned, skipped and written.
    fn criu_stats_dump() -> Vec<u8> {
        let entry: &[u8] = &[
            0x0a, 0x27, // StatsEntry.dump, 39 bytes
            0x08, 0xb0, 0x09, // freezing_time 1200
            0x10, 0xb8, 0xc3, 0x1b, // frozen_time 451000
            0x18, 0xe0, 0xa7, 0x12, // memdump_time 300000
            0x20, 0xe0, 0xc5, 0x08, // memwrite_time 140000
            0x28, 0x80, 0x80, 0x08, // pages_scanned 131072
            0x30, 0x00, // pages_skipped_parent 0
            0x38, 0xb8, 0xff, 0x07, // pages_written 131000
            0x40, 0x00, // irmap_resolve 0
            0x48, 0x00, // pages_lazy 0
            0x50, 0x03, // page_pipes 3
            0x58, 0x09, // page_pipe_bufs 9
            0x60, 0x00, 0x68, 0x00, 0x70, 0x00, // shpages_*
        ];
        let mut b = Vec::new();
        b.extend_from_slice(&[0x40, 0x59, 0x10, 0x55]); // IMG_SERVICE_MAGIC, LE
        b.extend_from_slice(&[0x06, 0x33, 0x09, 0x57]); // STATS_MAGIC, LE
        b.extend_from_slice(&(entry.len() as u32).to_le_bytes());
        b.extend_from_slice(entry);
        b
    }

    #[test]
    fn the_stats_criu_writes_after_a_dump_are_read_to_the_microsecond() {
        assert_eq!(
            parse(&criu_stats_dump()),
            Ok(DumpStats {
                freezing_us: 1_200,
                frozen_us: 451_000,
                memdump_us: 300_000,
                memwrite_us: 140_000,
                pages_scanned: 131_072,
                pages_skipped_parent: 0,
                pages_written: 131_000,
            })
        );
    }

    #[test]
    fn another_image_or_a_cut_file_is_not_taken_for_stats() {
        let good = criu_stats_dump();
        assert_eq!(parse(&good[..10]), Err(StatsError::Short(10)));
        let mut inventory = good.clone();
        inventory[4..8].copy_from_slice(&0x5831_3116u32.to_le_bytes());
        assert!(matches!(
            parse(&inventory),
            Err(StatsError::Magic(_, 0x5831_3116))
        ));
        let cut = &good[..good.len() - 5];
        assert_eq!(parse(cut), Err(StatsError::Size { size: 41, left: 36 }));
        let mut garbage = good.clone();
        garbage[13] = 0x7f; // the dump entry claims 127 bytes of a 41-byte entry
        assert!(matches!(parse(&garbage), Err(StatsError::Decode(_))));
    }

    #[test]
    fn a_restore_s_stats_or_an_entry_without_a_frozen_time_has_no_freeze() {
        let image = |entry: &[u8]| {
            let mut b = criu_stats_dump()[..8].to_vec();
            b.extend_from_slice(&(entry.len() as u32).to_le_bytes());
            b.extend_from_slice(entry);
            b
        };
        // StatsEntry.restore (field 2): pages_compared 1, skipped_cow 0, times 5 and 7.
        let restore = image(&[0x12, 0x08, 0x08, 0x01, 0x10, 0x00, 0x18, 0x05, 0x20, 0x07]);
        assert_eq!(parse(&restore), Err(StatsError::NoDump));
        let no_frozen = image(&[0x0a, 0x03, 0x08, 0xb0, 0x09]);
        assert_eq!(parse(&no_frozen), Err(StatsError::NoFrozenTime));
    }

    #[test]
    fn a_missing_file_is_no_stats_and_a_bad_one_an_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("criu-stats-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(read(&dir), Ok(None));
        std::fs::write(dir.join(DUMP_STATS_FILE), criu_stats_dump()).unwrap();
        assert_eq!(read(&dir).unwrap().unwrap().frozen_us, 451_000);
        std::fs::write(dir.join(DUMP_STATS_FILE), b"not an image").unwrap();
        let e = read(&dir).unwrap_err();
        assert!(e.contains("stats-dump") && e.contains("magic"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
