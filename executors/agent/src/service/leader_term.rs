//! The leader-term fence's memory on the node. The agent refuses a commanding call whose
//! operator leader term ([`LeaderTerm`]: the Lease's creation time, then its transition
//! count) is older than the newest it has seen ([`authz::admit_term`]);
//! that newest term is kept in a small file on the node ([`TermRecord`]) as well as in
//! memory ([`TermFence`]), so an agent restarted (pod deleted, crash, upgrade) starts
//! from it instead of from 0, and a replica that still believes it leads cannot
//! command the restarted agent again.
//!
//! The record is `<state dir>/leader-term`: the Lease's creation time (Unix seconds) and
//! the transition count in decimal ASCII, a space between them and a newline
//! (`1764770000 7\n`), nothing else; a term without a creation time (epoch 0: an
//! operator, or a record, from before the epoch) is the count alone (`7\n`). It only
//! ever rises, and it rises *before* the call that
//! raised it is admitted, so an agent that crashes right after acting on a term comes
//! back knowing it. Each write is atomic — a temporary file in the same directory,
//! fsync, rename over the record, fsync the directory — and made under an exclusive
//! lock on `<state dir>/.lock` after re-reading the record, so two agent processes on
//! one directory (a pod still stopping while its successor starts) cannot lower it
//! either.
//!
//! The chart's state dir is the hostPath `/run/podmotion/<namespace>.<release>/agent`,
//! on the node's `/run`: a tmpfs, cleared when the node reboots. That loses nothing
//! this fence protects: a reboot ends every process, freeze, migration, checkpoint
//! image and broker journal on the node, so the in-flight commands of a stale leader
//! name migrations and containers that no longer exist there, and every other node
//! still refuses it. Until the current leader's first call after the reboot, a stale
//! leader could start a *new* migration on that node only, from container IDs it
//! observed after the reboot, and only as far as the other node of that migration
//! also admits it — the same exposure every agent had after any restart before the
//! term was recorded. A record on a persistent disk would close that gap, but it would
//! also keep the refusal described next across reboots, where today a reboot ends it.
//!
//! The transition count restarts at 0 when the Lease is deleted (its namespace deleted
//! and the release reinstalled, or `operator.leaderElection.leaseName` changed); the
//! creation time, compared first, is what makes the new Lease's term 0 newer than every
//! term of the one it replaced. Two cases remain where a new leader is refused: a Lease
//! created again within the same second as the one it replaced (which then lived under
//! a second and counted no more than a transition or two), and an API server whose
//! clock went back past the replaced Lease's creation. The agents then refuse the new
//! leader (`PermissionDenied`, "leader term 0 … is older than term N …") until the
//! record is removed on each node (`rm /run/podmotion/<namespace>.<release>/agent/leader-term`,
//! then restart the agent) or the node reboots: loud, never silent.
//!
//! [`authz::admit_term`]: crate::authz::admit_term

use crate::authz::Rpc;
use podmotion_wire::agent::LeaderTerm;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The record's file name in the state directory.
pub const RECORD: &str = "leader-term";
const LOCK: &str = ".lock";
const TEMP: &str = ".leader-term.tmp";
/// Longer than two `u64`s in decimal, a space and a newline: anything longer is not a
/// term.
const MAX_LEN: u64 = 64;

/// Why the record could not be read or raised.
#[derive(Debug, thiserror::Error)]
pub enum TermRecordError {
    #[error("leader-term record {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The agent does not lower its fence on its own: removing the record is a
    /// decision for whoever knows which leader is current.
    #[error(
        "leader-term record {} is corrupt (holds {content:?}, not `<epoch> <term>` or `<term>` in decimal and a newline); \
         the agent will not lower its leader-term fence on its own: if no stale operator replica \
         can reach this node, remove the file and restart the agent",
        path.display()
    )]
    Corrupt { path: PathBuf, content: String },
}

/// The newest leader term this node's agent has admitted, as kept in the state
/// directory. Reading a record that is not there gives term 0 of epoch 0.
///
/// A record that is there but unreadable or corrupt is an error, never 0: the agent
/// refuses to start (its log and exit status say which file and why) rather than
/// start from 0 with a warning, because a fence that lowers itself silently is no
/// fence — the replica it exists to stop would be admitted again, and a warning or a
/// metric is seen only after the fact. The writes are atomic, so the agent never
/// leaves a torn record itself (a leftover temporary file is ignored); a corrupt one
/// was put there by something else, and whoever removes it decides the fence may start
/// from 0.
#[derive(Debug)]
pub struct TermRecord {
    dir: PathBuf,
}

impl TermRecord {
    /// The record in `dir`, created (mode 0755, with its parents) if missing so that a
    /// wrong path fails at start, not at the first call.
    pub fn open(dir: &Path) -> Result<Self, TermRecordError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|source| TermRecordError::Io {
                path: dir.to_owned(),
                source,
            })?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    pub fn path(&self) -> PathBuf {
        self.dir.join(RECORD)
    }

    /// The recorded term: the oldest (epoch 0, term 0) if there is no record.
    pub fn read(&self) -> Result<LeaderTerm, TermRecordError> {
        let path = self.path();
        let io = |source| TermRecordError::Io {
            path: path.clone(),
            source,
        };
        let mut content = Vec::new();
        match std::fs::File::open(&path) {
            Ok(f) => f.take(MAX_LEN + 1).read_to_end(&mut content).map_err(io)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(LeaderTerm::default());
            }
            Err(e) => return Err(io(e)),
        };
        parse(&content).ok_or_else(|| TermRecordError::Corrupt {
            path: path.clone(),
            content: String::from_utf8_lossy(&content).into_owned(),
        })
    }

    /// Makes the record at least `term` and returns what it holds now (`term`, or a
    /// newer one another agent process recorded). Never lowers it. Returns only once
    /// the record is durable.
    pub fn raise(&self, term: LeaderTerm) -> Result<LeaderTerm, TermRecordError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| TermRecordError::Io { path, source }
        };
        let lock_path = self.dir.join(LOCK);
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        // Released when `lock` is dropped (closed), on every path out.
        lock.lock().map_err(io(&lock_path))?;
        let recorded = self.read()?;
        if recorded >= term {
            return Ok(recorded);
        }
        let temp = self.dir.join(TEMP);
        let mut f = std::fs::File::create(&temp).map_err(io(&temp))?;
        f.write_all(format(term).as_bytes()).map_err(io(&temp))?;
        f.sync_all().map_err(io(&temp))?;
        drop(f);
        let path = self.path();
        std::fs::rename(&temp, &path).map_err(io(&path))?;
        // The rename is durable only once the directory is.
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(io(&self.dir))?;
        Ok(term)
    }
}

/// The record's text for `t`: `<epoch> <term>\n`, or `<term>\n` for epoch 0.
fn format(t: LeaderTerm) -> String {
    if t.epoch == 0 {
        format!("{}\n", t.term)
    } else {
        format!("{} {}\n", t.epoch, t.term)
    }
}

/// What [`format`] writes, exactly: no sign, one space, no leading zeros but `0` itself.
fn parse(content: &[u8]) -> Option<LeaderTerm> {
    let line = std::str::from_utf8(content.strip_suffix(b"\n")?).ok()?;
    match line.split_once(' ') {
        None => Some(LeaderTerm::new(0, decimal(line)?)),
        Some((epoch, term)) => {
            let epoch = decimal(epoch)?;
            (epoch != 0).then_some(LeaderTerm::new(epoch, decimal(term)?))
        }
    }
}

/// A `u64` in canonical decimal.
fn decimal(text: &str) -> Option<u64> {
    let well_formed = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    well_formed.then(|| text.parse().ok()).flatten()
}

/// The fence's state: the newest term seen (in memory; what a call is judged
/// against) and, with a record, the newest the record is known to hold. Every term
/// a commanding call was admitted with is at most `recorded`.
#[derive(Debug, Default)]
struct Seen {
    highest: LeaderTerm,
    recorded: LeaderTerm,
}

/// The leader-term fence of one agent: the highest term seen, recorded on the node
/// when there is a [`TermRecord`] (the binary always has one; an agent built
/// in-process without one forgets on restart).
#[derive(Debug, Default)]
pub(crate) struct TermFence {
    seen: Mutex<Seen>,
    record: Option<TermRecord>,
}

impl TermFence {
    /// A fence that starts from what `record` holds and keeps it up to date.
    pub(crate) fn recorded(record: TermRecord) -> Result<Self, TermRecordError> {
        let term = record.read()?;
        Ok(Self {
            seen: Mutex::new(Seen {
                highest: term,
                recorded: term,
            }),
            record: Some(record),
        })
    }

    /// The newest term seen.
    pub(crate) fn highest(&self) -> LeaderTerm {
        self.seen.lock().expect("term fence").highest
    }

    /// Sees the term `presented` with a call of `rpc` and returns the highest term to
    /// judge the call against ([`crate::authz::admit_term`]). A commanding call that
    /// the fence would admit with a term higher than the record holds raises the
    /// record first; if that fails, the error refuses the call (the term is still
    /// remembered in memory, and the next such call tries again). `Status` acts on
    /// nothing and never writes.
    pub(crate) fn observe(
        &self,
        rpc: Rpc,
        presented: Option<LeaderTerm>,
    ) -> Result<LeaderTerm, TermRecordError> {
        // Held across the write (rare: once per leader term; fast on tmpfs), so calls
        // are judged in the order their terms were recorded.
        let mut seen = self.seen.lock().expect("term fence");
        let before = seen.highest;
        let Some(term) = presented else {
            return Ok(before);
        };
        seen.highest = seen.highest.max(term);
        let admitted = crate::authz::admit_term(rpc, presented, before).is_ok();
        match &self.record {
            Some(record) if rpc.commands() && admitted && term > seen.recorded => {
                let now = record.raise(term)?;
                seen.recorded = now;
                seen.highest = seen.highest.max(now);
                // Another agent process on this node may have recorded a higher term.
                Ok(before.max(now))
            }
            _ => Ok(before),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authz::admit_term;

    /// A term without an epoch.
    fn t(term: u64) -> LeaderTerm {
        LeaderTerm::new(0, term)
    }

    /// A fresh directory under the system temp dir, removed on drop.
    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Dir {
            Dir(std::env::temp_dir().join(format!(
                "pm-term-{tag}-{}-{}",
                std::process::id(),
                rand::random::<u64>()
            )))
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn contents(d: &Dir) -> String {
        std::fs::read_to_string(d.0.join(RECORD)).unwrap()
    }

    #[test]
    fn a_missing_record_is_term_zero_and_its_directory_is_made() {
        let d = Dir::new("missing");
        let r = TermRecord::open(&d.0.join("agent")).unwrap();
        assert!(d.0.join("agent").is_dir());
        assert_eq!(r.read().unwrap(), t(0));
        assert!(!r.path().exists(), "reading writes nothing");
    }

    #[test]
    fn a_raised_record_is_what_a_new_agent_reads() {
        let d = Dir::new("reread");
        assert_eq!(TermRecord::open(&d.0).unwrap().raise(t(7)).unwrap(), t(7));
        assert_eq!(contents(&d), "7\n");
        assert_eq!(TermRecord::open(&d.0).unwrap().read().unwrap(), t(7));
        // Nothing but the record and the lock is left behind.
        let mut names: Vec<String> = std::fs::read_dir(&d.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [LOCK, RECORD]);
    }

    #[test]
    fn the_larger_term_wins_and_the_record_is_never_lowered() {
        let d = Dir::new("monotonic");
        let r = TermRecord::open(&d.0).unwrap();
        assert_eq!(r.raise(t(5)).unwrap(), t(5));
        assert_eq!(r.raise(t(9)).unwrap(), t(9));
        assert_eq!(contents(&d), "9\n");
        assert_eq!(r.raise(t(6)).unwrap(), t(9));
        assert_eq!(r.raise(t(0)).unwrap(), t(9));
        assert_eq!(contents(&d), "9\n");
        // Raised by another agent process on the same directory: adopted, not
        // overwritten with a lower term.
        let other = TermRecord::open(&d.0).unwrap();
        assert_eq!(other.raise(t(12)).unwrap(), t(12));
        assert_eq!(r.raise(t(10)).unwrap(), t(12));
        assert_eq!(contents(&d), "12\n");
        assert_eq!(r.raise(t(u64::MAX)).unwrap(), t(u64::MAX));
        assert_eq!(r.read().unwrap(), t(u64::MAX));
    }

    #[test]
    fn a_corrupt_record_is_an_error_never_term_zero() {
        let d = Dir::new("corrupt");
        let r = TermRecord::open(&d.0).unwrap();
        let too_big = format!("{}0\n", u64::MAX);
        for bad in [
            "",
            "\n",
            "7",
            "07\n",
            "-7\n",
            " 7\n",
            "7 \n",
            "7\n\n",
            "7\n8\n",
            "seven\n",
            "0x7\n",
            too_big.as_str(),
            "1764770000  7\n",
            "1764770000 7 8\n",
            " 1764770000 7\n",
            "1764770000 \n",
            " 7\n",
            "0 7\n",
            "01764770000 7\n",
            "1764770000 07\n",
            "1764770000\t7\n",
        ] {
            std::fs::write(r.path(), bad).unwrap();
            match r.read() {
                Err(TermRecordError::Corrupt { content, .. }) => assert_eq!(content, bad),
                other => panic!("{bad:?}: {other:?}"),
            }
            // Nor is it lowered, or overwritten, by a raise.
            assert!(r.raise(t(3)).is_err(), "{bad:?}");
            assert_eq!(std::fs::read_to_string(r.path()).unwrap(), bad);
        }
        std::fs::write(r.path(), vec![b'7'; 4096]).unwrap();
        assert!(matches!(r.read(), Err(TermRecordError::Corrupt { .. })));
        std::fs::write(r.path(), b"\xff\n").unwrap();
        assert!(matches!(r.read(), Err(TermRecordError::Corrupt { .. })));
        // An unreadable one (here: a directory in its place) is an error too.
        std::fs::remove_file(r.path()).unwrap();
        std::fs::create_dir(r.path()).unwrap();
        assert!(matches!(r.read(), Err(TermRecordError::Io { .. })));
        assert!(TermFence::recorded(TermRecord::open(&d.0).unwrap()).is_err());
        // Well-formed records read as themselves.
        std::fs::remove_dir(r.path()).unwrap();
        for (good, term) in [
            ("0\n", t(0)),
            ("7\n", t(7)),
            ("18446744073709551615\n", t(u64::MAX)),
            ("1764770000 0\n", LeaderTerm::new(1_764_770_000, 0)),
            (
                "18446744073709551615 18446744073709551615\n",
                LeaderTerm::new(u64::MAX, u64::MAX),
            ),
        ] {
            std::fs::write(r.path(), good).unwrap();
            assert_eq!(r.read().unwrap(), term, "{good:?}");
            assert_eq!(format(term), good);
        }
    }

    #[test]
    fn a_leftover_temporary_file_is_ignored_and_replaced() {
        let d = Dir::new("leftover");
        let r = TermRecord::open(&d.0).unwrap();
        std::fs::write(d.0.join(TEMP), "garbage").unwrap();
        assert_eq!(r.read().unwrap(), t(0));
        assert_eq!(r.raise(t(4)).unwrap(), t(4));
        assert_eq!(contents(&d), "4\n");
        assert!(!d.0.join(TEMP).exists());
    }

    /// Judges a call as the agent does: the fence, then [`admit_term`].
    fn call(f: &TermFence, rpc: Rpc, term: u64) -> Result<(), String> {
        call_in(f, rpc, t(term))
    }

    fn call_in(f: &TermFence, rpc: Rpc, term: LeaderTerm) -> Result<(), String> {
        let highest = f.observe(rpc, Some(term)).map_err(|e| e.to_string())?;
        admit_term(rpc, Some(term), highest).map_err(|d| d.to_string())
    }

    #[test]
    fn a_fence_starts_from_the_record_and_records_a_term_before_admitting_it() {
        let d = Dir::new("fence");
        let f = TermFence::recorded(TermRecord::open(&d.0).unwrap()).unwrap();
        assert_eq!(f.highest(), t(0));
        call(&f, Rpc::Prepare, 7).unwrap();
        // Recorded by the time the call is admitted.
        assert_eq!(contents(&d), "7\n");
        // Status acts on nothing: remembered, not recorded.
        call(&f, Rpc::Status, 8).unwrap();
        assert_eq!(contents(&d), "7\n");
        // A refused call records nothing either.
        assert!(call(&f, Rpc::Dump, 6).unwrap_err().contains("term 8"));
        assert_eq!(contents(&d), "7\n");
        call(&f, Rpc::Dump, 8).unwrap();
        assert_eq!(contents(&d), "8\n");

        // The next agent on this directory: term 6 and 7 refused, 8 and 9 admitted.
        let next = TermFence::recorded(TermRecord::open(&d.0).unwrap()).unwrap();
        assert_eq!(next.highest(), t(8));
        for (rpc, term) in [(Rpc::Abort, 6), (Rpc::Prepare, 7)] {
            let e = call(&next, rpc, term).unwrap_err();
            assert!(e.contains(&format!("leader term {term}")), "{e}");
        }
        call(&next, Rpc::Status, 1).unwrap();
        call(&next, Rpc::Commit, 8).unwrap();
        call(&next, Rpc::Commit, 9).unwrap();
        assert_eq!(contents(&d), "9\n");
        // No term (leader election off): not fenced, nothing written.
        assert_eq!(next.observe(Rpc::Dump, None).unwrap(), t(9));
    }

    /// The hazard the epoch removes: a Lease deleted and created again counts from 0.
    #[test]
    fn a_recreated_lease_leads_after_a_restart_and_the_replaced_one_does_not() {
        let d = Dir::new("epoch");
        let replaced = LeaderTerm::new(1_764_000_000, 41);
        let recreated = LeaderTerm::new(1_764_770_000, 0);
        // An agent from before the epoch left the count alone.
        let record = TermRecord::open(&d.0).unwrap();
        std::fs::write(d.0.join(RECORD), "41\n").unwrap();
        let f = TermFence::recorded(record).unwrap();
        assert_eq!(f.highest(), t(41));
        // The first leader with an epoch is newer than the record without one.
        call_in(&f, Rpc::Prepare, replaced).unwrap();
        assert_eq!(contents(&d), "1764000000 41\n");
        call_in(&f, Rpc::Dump, recreated).unwrap();
        assert_eq!(contents(&d), "1764770000 0\n");
        let next = TermFence::recorded(TermRecord::open(&d.0).unwrap()).unwrap();
        assert_eq!(next.highest(), recreated);
        let e = call_in(&next, Rpc::Commit, replaced).unwrap_err();
        assert!(
            e.contains("term 41 of the Lease created at 1764000000"),
            "{e}"
        );
        assert!(
            call(&next, Rpc::Commit, 99).is_err(),
            "no epoch: older than any"
        );
        call_in(&next, Rpc::Commit, LeaderTerm::new(recreated.epoch, 1)).unwrap();
        assert_eq!(contents(&d), "1764770000 1\n");
    }

    #[test]
    fn a_term_that_cannot_be_recorded_is_not_admitted_and_still_fences() {
        let d = Dir::new("unwritable");
        let f = TermFence::recorded(TermRecord::open(&d.0).unwrap()).unwrap();
        call(&f, Rpc::Prepare, 3).unwrap();
        // The directory goes away and a file takes its place: every write fails.
        std::fs::remove_dir_all(&d.0).unwrap();
        std::fs::write(&d.0, "not a directory").unwrap();
        let e = call(&f, Rpc::Prepare, 5).unwrap_err();
        assert!(e.contains("leader-term record"), "{e}");
        // Remembered all the same: the stale term 4 is refused.
        assert!(call(&f, Rpc::Dump, 4).unwrap_err().contains("term 5"));
        // The directory is back: the next call with term 5 records it and is admitted.
        std::fs::remove_file(&d.0).unwrap();
        std::fs::create_dir(&d.0).unwrap();
        call(&f, Rpc::Dump, 5).unwrap();
        assert_eq!(contents(&d), "5\n");
    }

    #[test]
    fn a_fence_without_a_record_only_remembers() {
        let f = TermFence::default();
        call(&f, Rpc::Prepare, 7).unwrap();
        assert!(call(&f, Rpc::Prepare, 6).is_err());
        assert_eq!(f.highest(), t(7));
    }
}
