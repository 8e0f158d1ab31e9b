//! The target's side of the image stream (`ReceiveImages`): [`receive_locked`] takes
//! the chunks off the connection, a writer thread opens them and [`Store`]s them in
//! the migration's checkpoint dir, and a stream that does not end verified leaves
//! nothing of itself behind.

use super::helpers::{Transferring, Transfers, blocking, cut_by_abort, io_internal};
use super::state::Migration;
use crate::images;
use podmotion_wire::agent::{ImageChunk, Phase, ReceiveSummary};
use podmotion_wire::transfer::{self, Sealer};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

/// Chunks queued between the connection and the receiver's writer thread.
const RECEIVE_QUEUE: usize = 4;

/// What the writer thread hands back: what the stream wrote, and the files and bytes
/// it stored (or why it stopped).
type WriterOutcome = (Written, Result<(u64, u64), Status>);

/// Stores one image stream (its first chunk already read) into the migration's
/// checkpoint dir, holding the migration to the stream's end. A stream that does not
/// end complete and verified (cut, refused, a chunk that does not open) leaves what was
/// there before it: the files it created or replaced are zeroized and removed, and the
/// phase is the one it found, so the next `Send` (a new stream) starts from the same
/// state the source records; earlier pre-copy rounds, which the source counts as sent,
/// stay.
pub(super) async fn receive_locked(
    mut m: tokio::sync::OwnedMutexGuard<Migration>,
    first: ImageChunk,
    mut s: Streaming<ImageChunk>,
    aborted: tokio::sync::watch::Receiver<bool>,
    transfers: Transfers,
) -> Result<ReceiveSummary, Status> {
    // The stream's header (its first chunk) carries the stream id.
    let sealer = Arc::new(
        Sealer::new(&m.key, m.uid.as_str(), &first.stream_id)
            .map_err(|e| Status::invalid_argument(e.to_string()))?,
    );
    let before = m.phase;
    m.phase = Phase::Receiving;
    let _transferring = Transferring::mark(&transfers, m.uid.as_str(), m.status());
    let dir = m.dir.clone();
    // This task takes chunks off the connection; a blocking thread opens and
    // writes them, so the network side never waits for the decryption or tmpfs.
    let (wtx, wrx) = mpsc::channel::<ImageChunk>(RECEIVE_QUEUE);
    let writer = spawn_writer(dir.clone(), Arc::clone(&sealer), wrx);
    let mut seq = 0u64;
    let uid = m.uid.to_string();
    let read = cut_by_abort(
        aborted,
        read_chunks(first, &mut s, &uid, &wtx, &mut seq),
        "the image stream",
    )
    .await;
    drop(wtx);
    drop(s);
    let (written, stored) = match writer.await {
        Ok((w, r)) => (Some(w), r),
        Err(e) => (None, Err(Status::internal(format!("image writer: {e}")))),
    };
    match verify_end(&sealer, stored, read, seq) {
        Ok((files, bytes)) => Ok(record_received(&mut m, &dir, files, bytes)),
        Err(e) => Err(undo_stream(&mut m, written, dir, before, e).await),
    }
}

/// The writer thread: opens each queued chunk and stores it, until the queue closes
/// or a chunk fails.
fn spawn_writer(
    dir: PathBuf,
    sealer: Arc<Sealer>,
    mut wrx: mpsc::Receiver<ImageChunk>,
) -> tokio::task::JoinHandle<WriterOutcome> {
    tokio::task::spawn_blocking(move || {
        let mut store = Store::new(&dir);
        let res = store_chunks(&mut store, &sealer, &mut wrx);
        (store.written(), res)
    })
}

/// Opens and stores the queued chunks; the files and bytes stored.
fn store_chunks(
    store: &mut Store,
    sealer: &Sealer,
    wrx: &mut mpsc::Receiver<ImageChunk>,
) -> Result<(u64, u64), Status> {
    while let Some(mut c) = wrx.blocking_recv() {
        transfer::check_image_path(&c.path).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let mut plain = std::mem::take(&mut c.sealed);
        sealer
            .open_in_place(c.seq, &c.path, c.offset, false, &mut plain)
            .map_err(|e| Status::permission_denied(e.to_string()))?;
        store.put(&c, plain)?;
    }
    Ok(store.stored())
}

/// Takes the stream's chunks off the connection in order and queues them for the
/// writer, up to the final chunk, whose sealed count it returns; `seq` counts the
/// chunks taken (the final one too). Nothing (`Ok(vec![])`) when the writer stopped:
/// it says why.
async fn read_chunks(
    first: ImageChunk,
    s: &mut Streaming<ImageChunk>,
    uid: &str,
    wtx: &mpsc::Sender<ImageChunk>,
    seq: &mut u64,
) -> Result<Vec<u8>, Status> {
    let mut next = Some(first);
    loop {
        let c = match next.take() {
            Some(c) => c,
            None => s
                .message()
                .await?
                .ok_or_else(|| Status::data_loss("stream ended without its final chunk"))?,
        };
        if c.seq != *seq || c.migration_uid != uid {
            return Err(Status::invalid_argument(
                "chunk out of order or for another migration",
            ));
        }
        *seq += 1;
        if c.end {
            return Ok(c.sealed);
        }
        if wtx.send(c).await.is_err() {
            // The writer stopped on an error; it says which below.
            return Ok(vec![]);
        }
    }
}

/// The stream ends well only if every chunk opened and was stored, and its final
/// chunk (`end`, the `seq`-th) authenticates the count. The files and bytes stored.
fn verify_end(
    sealer: &Sealer,
    stored: Result<(u64, u64), Status>,
    end: Result<Vec<u8>, Status>,
    seq: u64,
) -> Result<(u64, u64), Status> {
    let (files, bytes) = stored?;
    let end = end?;
    let count = sealer
        .open(seq - 1, "", 0, true, &end)
        .map_err(|e| Status::permission_denied(e.to_string()))?;
    if count != (seq - 1).to_be_bytes() {
        return Err(Status::data_loss("chunk count mismatch"));
    }
    Ok((files, bytes))
}

/// A stream stored and verified: its bytes counted, and the phase `Received` once
/// the manifest is there (pre-copy rounds arrive first; the round carrying the
/// manifest is the last).
fn record_received(m: &mut Migration, dir: &Path, files: u64, bytes: u64) -> ReceiveSummary {
    m.bytes_received += bytes;
    m.image_bytes = images::size(dir);
    m.phase = if dir.join("manifest.json").exists() {
        Phase::Received
    } else {
        Phase::Receiving
    };
    ReceiveSummary { files, bytes }
}

/// Never keep half an image: what the failed stream wrote goes (zeroized); what
/// earlier streams stored stays, as the source counts it sent, and the phase is the
/// one the stream found (`before`). Returns `e`.
async fn undo_stream(
    m: &mut Migration,
    written: Option<Written>,
    dir: PathBuf,
    before: Phase,
    e: Status,
) -> Status {
    let undone = match written {
        Some(w) => blocking(move || {
            w.undo(&dir);
            Ok(())
        })
        .await
        .ok(),
        None => None,
    };
    if undone.is_none() {
        // The writer panicked: what it wrote is unknown, so nothing stays.
        let _ = images::zeroize(&m.dir);
        if let Some(root) = m.dir.parent() {
            let _ = images::create(root, m.uid.as_str());
        }
    }
    m.image_bytes = images::size(&m.dir);
    m.phase = if undone.is_some() {
        before
    } else {
        Phase::Prepared
    };
    tracing::warn!(uid = %m.uid, error = %e, "image stream not stored; its files removed");
    e
}

/// Writes the opened chunks of one stream into a migration's checkpoint dir. Nothing
/// it writes leaves that dir: paths are `<dir>/<file>` or `<file>`, the only links are
/// CRIU's `parent` links one level down pointing at a sibling round (`../pre-<n>`),
/// and no write, copy or move follows a link.
///
/// A delta's file takes its base's place (see [`Store::put_from_base`]): the target
/// holds each image once, not a warm copy and its rebuild side by side.
pub(super) struct Store<'a> {
    dir: &'a Path,
    /// Files created from a delta base in this stream; their chunks patch in place.
    patched: std::collections::BTreeSet<String>,
    /// What this stream created or replaced, undone if the stream does not end well.
    written: Written,
    files: u64,
    bytes: u64,
}

/// Where one chunk is stored: its path in the checkpoint dir, and whether this stream
/// writes that path for the first time.
struct Destination<'c> {
    c: &'c ImageChunk,
    path: PathBuf,
    fresh: bool,
}

fn open_nofollow(p: &Path, o: &mut std::fs::OpenOptions) -> Result<std::fs::File, Status> {
    use std::os::unix::fs::OpenOptionsExt;
    o.custom_flags(nix::libc::O_NOFOLLOW)
        .open(p)
        .map_err(|e| Status::invalid_argument(format!("{}: {e}", p.display())))
}

/// Whether a round of the migration has a `parent` link (`<dir>/<round>/parent`): an
/// incremental CRIU dump, whose restore reads pages from the rounds it links to.
fn has_parent_link(dir: &Path) -> Result<bool, Status> {
    for e in std::fs::read_dir(dir).map_err(io_internal)? {
        let e = e.map_err(io_internal)?;
        let round = e.file_type().map_err(io_internal)?.is_dir();
        if round && std::fs::symlink_metadata(e.path().join("parent")).is_ok() {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `../pre-<n>`, or `../pre-<n>.<container>` for the pod's other containers
/// (`crate::pod`): a sibling round's directory, the only link target CRIU writes.
fn parent_link_ok(path: &str, target: &str) -> bool {
    let Some((_, name)) = path.split_once('/') else {
        // A top-level link would resolve `../x` next to this migration's dir: into
        // another migration's.
        return false;
    };
    let Some(round) = target.strip_prefix("../pre-") else {
        return false;
    };
    let (n, container) = match round.split_once('.') {
        Some((n, c)) => (n, Some(c)),
        None => (round, None),
    };
    name == "parent"
        && !n.is_empty()
        && n.len() <= 9
        && n.bytes().all(|b| b.is_ascii_digit())
        && container.is_none_or(|c| {
            !c.is_empty()
                && c.len() <= 63
                && c.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

impl<'a> Store<'a> {
    pub(super) fn new(dir: &'a Path) -> Self {
        Store {
            dir,
            patched: Default::default(),
            written: Default::default(),
            files: 0,
            bytes: 0,
        }
    }

    /// Stores one chunk whose path was checked and whose payload opened.
    pub(super) fn put(&mut self, c: &ImageChunk, plain: Vec<u8>) -> Result<(), Status> {
        transfer::check_image_path(&c.path).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let path = self.dir.join(&c.path);
        self.round_dir(&c.path)?;
        // A path this stream did not write yet: a new stream (a retried `Send`) sends
        // every file it carries whole, from offset 0, so a copy of it that an earlier
        // stream left (its end not recorded by the source) is replaced, not appended to
        // (a delta's rebuild is patched again: see `Start::Again`).
        let fresh = !self.written.files.contains(&c.path) && !self.patched.contains(&c.path);
        if fresh && !c.symlink && c.base.is_empty() && c.offset != 0 {
            return Err(Status::invalid_argument(format!(
                "{}: starts at offset {}",
                c.path, c.offset
            )));
        }
        let to = Destination { c, path, fresh };
        if c.symlink {
            return self.put_link(&to, plain);
        }
        if !c.base.is_empty() {
            return self.put_from_base(&to, &plain);
        }
        if self.patched.contains(&c.path) {
            return self.patch(c, &plain, &to.path);
        }
        self.append(&to, &plain)
    }

    /// The round directory a nested path is in must be a plain directory; a missing
    /// one is created, as this stream's.
    fn round_dir(&mut self, rel: &str) -> Result<(), Status> {
        let Some((top, _)) = rel.split_once('/') else {
            return Ok(());
        };
        let d = self.dir.join(top);
        match std::fs::symlink_metadata(&d) {
            Ok(md) if md.is_dir() => {}
            Ok(_) => {
                return Err(Status::invalid_argument(format!(
                    "{top} is not a directory"
                )));
            }
            Err(_) => {
                std::fs::create_dir(&d).map_err(io_internal)?;
                self.written.dirs.push(top.to_owned());
            }
        }
        Ok(())
    }

    /// A link chunk: only a round's parent link, and none in a stream that rebuilt a
    /// file in place of its base (the restore could need the base through it).
    fn put_link(&mut self, to: &Destination, plain: Vec<u8>) -> Result<(), Status> {
        let Destination { c, path, fresh } = to;
        let target = String::from_utf8(plain).map_err(|_| Status::invalid_argument("bad link"))?;
        if !parent_link_ok(&c.path, &target) {
            return Err(Status::invalid_argument(format!(
                "link {:?} -> {target:?} is not a round's parent link",
                c.path
            )));
        }
        if !self.written.in_place.is_empty() {
            return Err(Status::invalid_argument(format!(
                "parent link {:?} in a stream of deltas rebuilt in place of their bases",
                c.path
            )));
        }
        if *fresh {
            self.replace(&c.path, path)?;
        }
        std::os::unix::fs::symlink(&target, path).map_err(io_internal)
    }

    /// A delta's first chunk: the file starts as its base (which this agent holds), cut
    /// or grown to the length the chunk carries; the blocks that differ follow. The
    /// base is moved to the delta's path and rebuilt there ([`Start::Move`]), so the
    /// target never holds a second copy of it, and [`Written::undo`] puts it back as
    /// it was if the stream does not end well.
    ///
    /// Nothing reads the base after that: the restore reads the final dir alone unless
    /// a round links to a parent (`parent`, written by CRIU only for a dump with
    /// `parent_img`, i.e. when the source tracks dirty memory, and then the source
    /// sends no deltas: see `dump_opts` and `send_impl`); with such a link the base is
    /// copied instead ([`Start::Copy`]), and a stream that moved a base refuses one.
    /// The source names as base the namesake in the newest warm copy it counts as sent
    /// (`send::delta_base`), so once it recorded the stream, never that base again;
    /// until then a stream may name it again: see [`Start`]. Only a stream the target
    /// stored and the source did not record, followed by one naming the same base for
    /// another file (the unrecorded round and a newer one), finds it gone (refused).
    fn put_from_base(&mut self, to: &Destination, plain: &[u8]) -> Result<(), Status> {
        let Destination { c, path, fresh } = to;
        transfer::check_image_path(&c.base).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let len: [u8; 8] = plain
            .try_into()
            .map_err(|_| Status::invalid_argument("bad delta length"))?;
        let len = u64::from_be_bytes(len);
        if !fresh || c.base == c.path {
            return Err(Status::invalid_argument(format!(
                "{}: a delta written twice in one stream, or against itself",
                c.path
            )));
        }
        match self.start(c, path)? {
            Start::Move(f) => {
                let base = InPlace::of(&c.base, &c.path, &f)?;
                self.replace(&c.path, path)?;
                std::fs::rename(self.dir.join(&c.base), path).map_err(io_internal)?;
                self.rebuild_in_place(base, &f, len)?;
            }
            Start::Again(f) => {
                self.rebuild_in_place(InPlace::of(&c.path, &c.path, &f)?, &f, len)?
            }
            Start::Copy(mut from) => self.copy_base(c, path, &mut from, None, len)?,
            Start::Moved(i) => {
                let moved = self.dir.join(&self.written.in_place[i].to);
                let mut from = open_nofollow(&moved, std::fs::OpenOptions::new().read(true))?;
                self.copy_base(c, path, &mut from, Some(i), len)?;
            }
        }
        self.files += 1;
        self.patched.insert(c.path.clone());
        Ok(())
    }

    /// Where the delta `c` (to be stored at `path`) starts from.
    fn start(&self, c: &ImageChunk, path: &Path) -> Result<Start, Status> {
        let moved = |p: &InPlace| p.from == c.base && p.to != p.from;
        if let Some(i) = self.written.in_place.iter().rposition(moved) {
            return Ok(Start::Moved(i));
        }
        let gone =
            |e: std::io::Error| Status::failed_precondition(format!("delta base {}: {e}", c.base));
        match self.base_file(&c.base) {
            Ok(f) if has_parent_link(self.dir)? => Ok(Start::Copy(f)),
            Ok(f) => Ok(Start::Move(f)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if !std::fs::symlink_metadata(path).is_ok_and(|md| md.is_file()) {
                    return Err(gone(e));
                }
                let rw = open_nofollow(path, std::fs::OpenOptions::new().read(true).write(true))?;
                Ok(Start::Again(rw))
            }
            Err(e) => Err(gone(e)),
        }
    }

    /// A delta's base, opened to read and write: a regular file of this migration, in
    /// a plain round directory (never reached through a link).
    fn base_file(&self, base: &str) -> std::io::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt;
        if let Some((top, _)) = base.split_once('/')
            && !std::fs::symlink_metadata(self.dir.join(top))?.is_dir()
        {
            return Err(std::io::Error::other(format!("{top} is not a directory")));
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(self.dir.join(base))?;
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::other("not a regular file"));
        }
        Ok(f)
    }

    /// Records `p` (its file open as `f`) as rebuilt in place by this stream, and sets
    /// the file's length.
    fn rebuild_in_place(
        &mut self,
        mut p: InPlace,
        f: &std::fs::File,
        len: u64,
    ) -> Result<(), Status> {
        let cut = p.set_len(f, len);
        // Recorded even if the length could not be set: it is in its new place.
        self.written.in_place.push(p);
        cut.map_err(io_internal)
    }

    /// Copies the base (`from`) to the delta's path and sets its length. A base this
    /// stream moved already (`moved`, its index in `written.in_place`) is copied from
    /// where it went, and the bytes the stream overwrote there put back in the copy.
    fn copy_base(
        &mut self,
        c: &ImageChunk,
        path: &Path,
        from: &mut std::fs::File,
        moved: Option<usize>,
        len: u64,
    ) -> Result<(), Status> {
        self.replace(&c.path, path)?;
        let mut file = open_nofollow(
            path,
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true),
        )?;
        std::io::copy(from, &mut file).map_err(io_internal)?;
        if let Some(i) = moved {
            self.written.in_place[i]
                .put_back(&file)
                .map_err(io_internal)?;
        }
        file.set_len(len).map_err(io_internal)
    }

    /// A block of a delta, written in place inside the file (what it overwrites kept,
    /// in a file rebuilt in place of its base).
    fn patch(&mut self, c: &ImageChunk, plain: &[u8], path: &Path) -> Result<(), Status> {
        use std::os::unix::fs::FileExt;
        let f = open_nofollow(path, std::fs::OpenOptions::new().read(true).write(true))?;
        let len = f.metadata().map_err(io_internal)?.len();
        if c.offset + plain.len() as u64 > len {
            return Err(Status::invalid_argument(
                "delta block past the end of the file",
            ));
        }
        match self.written.in_place.iter_mut().find(|p| p.to == c.path) {
            Some(p) => p.write_at(&f, c.offset, plain),
            None => f.write_all_at(plain, c.offset),
        }
        .map_err(io_internal)?;
        self.bytes += plain.len() as u64;
        Ok(())
    }

    /// A chunk of a whole file, at its end: a fresh path starts the file anew.
    fn append(&mut self, to: &Destination, plain: &[u8]) -> Result<(), Status> {
        let Destination { c, path, fresh } = to;
        let mut f = if *fresh {
            self.replace(&c.path, path)?;
            open_nofollow(
                path,
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true),
            )?
        } else {
            open_nofollow(path, std::fs::OpenOptions::new().create(true).append(true))?
        };
        let md = f.metadata().map_err(io_internal)?;
        if !md.is_file() || md.len() != c.offset {
            return Err(Status::invalid_argument(format!(
                "{}: offset {} but have {}",
                c.path,
                c.offset,
                md.len()
            )));
        }
        if c.offset == 0 {
            self.files += 1;
        }
        f.write_all(plain).map_err(io_internal)?;
        self.bytes += plain.len() as u64;
        Ok(())
    }

    /// Takes `rel` (at `path`) as this stream's: a copy an earlier stream left there
    /// (its end not recorded by the source, which sends it whole again) is zeroized and
    /// replaced. Called only once the chunk that writes it was checked.
    fn replace(&mut self, rel: &str, path: &Path) -> Result<(), Status> {
        match std::fs::symlink_metadata(path) {
            Ok(md) if md.file_type().is_symlink() => {
                std::fs::remove_file(path).map_err(io_internal)?
            }
            Ok(md) if md.is_file() => images::zeroize_file(path).map_err(io_internal)?,
            Ok(_) => {
                return Err(Status::invalid_argument(format!(
                    "{rel} is not a regular file"
                )));
            }
            Err(_) => {}
        }
        self.written.files.insert(rel.to_owned());
        Ok(())
    }

    /// The files and bytes this stream stored so far.
    pub(super) fn stored(&self) -> (u64, u64) {
        (self.files, self.bytes)
    }

    /// What this stream wrote, for `Written::undo`.
    pub(super) fn written(&mut self) -> Written {
        std::mem::take(&mut self.written)
    }
}

/// Where a delta's file starts from (see [`Store::put_from_base`]).
enum Start {
    /// Its base (open), a plain file of this migration: moved to the delta's path.
    Move(std::fs::File),
    /// Its base, while a round links to a parent: copied, as the restore may read it.
    Copy(std::fs::File),
    /// A base this stream moved already (`written.in_place[i]`): the round the source
    /// did not record travels with a newer one, both against that base. Copied from
    /// where it went, as it was.
    Moved(usize),
    /// No base, and the delta's path holds a regular file (open) this stream did not
    /// write: the rebuild a stream the target stored left, which the source did not
    /// record and sends again, the same delta against the same base. Applied again in
    /// place (it writes the same bytes).
    Again(std::fs::File),
}

/// Pieces in which a file rebuilt in place is cut to a shorter length, each kept as
/// it is cut: the file and what undoes it never hold the tail twice.
const TAIL_PIECE: u64 = 1 << 20;

/// A file this stream rebuilt in place from a delta, and what puts it back as it was
/// before the stream.
struct InPlace {
    /// Where it was: the delta's base, which the stream moved to `to`, or `to` itself
    /// ([`Start::Again`]).
    from: String,
    to: String,
    /// Its length before the stream.
    len: u64,
    /// Each range the stream overwrote or cut (offset, old bytes), in that order.
    old: Vec<(u64, Vec<u8>)>,
}

impl InPlace {
    /// The file `f`, at `from` before the stream and rebuilt at `to`, as it is now.
    fn of(from: &str, to: &str, f: &std::fs::File) -> Result<InPlace, Status> {
        Ok(InPlace {
            from: from.to_owned(),
            to: to.to_owned(),
            len: f.metadata().map_err(io_internal)?.len(),
            old: vec![],
        })
    }

    /// Sets `f`'s length, keeping what it cuts.
    fn set_len(&mut self, f: &std::fs::File, len: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut now = f.metadata()?.len();
        while now > len {
            let at = now.saturating_sub(TAIL_PIECE).max(len);
            let mut was = vec![0; (now - at) as usize];
            f.read_exact_at(&mut was, at)?;
            f.set_len(at)?;
            self.old.push((at, was));
            now = at;
        }
        f.set_len(len)
    }

    /// Writes `data` into `f` at `at`, keeping the bytes it overwrites.
    fn write_at(&mut self, f: &std::fs::File, at: u64, data: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut was = vec![0; data.len()];
        f.read_exact_at(&mut was, at)?;
        self.old.push((at, was));
        f.write_all_at(data, at)
    }

    /// Makes `f` (the file at `to`, or a copy of it) what it was before the stream:
    /// the old bytes written back, newest first, then its old length.
    fn put_back(&self, f: &std::fs::File) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        for (at, was) in self.old.iter().rev() {
            f.write_all_at(was, *at)?;
        }
        f.set_len(self.len)
    }

    /// Puts the file back as it was, in its old place.
    fn undo(&self, dir: &Path) -> Result<(), Status> {
        let to = dir.join(&self.to);
        let f = open_nofollow(&to, std::fs::OpenOptions::new().write(true))?;
        self.put_back(&f).map_err(io_internal)?;
        if self.from != self.to {
            std::fs::rename(&to, dir.join(&self.from)).map_err(io_internal)?;
        }
        Ok(())
    }
}

/// The files and round directories one image stream created or replaced, and the
/// files it rebuilt in place.
#[derive(Default)]
pub(super) struct Written {
    files: std::collections::BTreeSet<String>,
    dirs: Vec<String>,
    in_place: Vec<InPlace>,
}

impl Written {
    /// Zeroizes and removes what the stream wrote (a directory it created goes whole),
    /// leaving what earlier streams stored: a file rebuilt in place is put back as it
    /// was first (newest first), a moved base in its round, before anything goes.
    pub(super) fn undo(self, dir: &Path) {
        for p in self.in_place.iter().rev() {
            if let Err(e) = p.undo(dir) {
                tracing::warn!(file = %p.to, error = %e.message(), "delta base not put back");
            }
        }
        for rel in &self.files {
            let p = dir.join(rel);
            let Ok(md) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if md.is_file() {
                let _ = images::zeroize_file(&p);
            }
            if !md.is_dir() {
                let _ = std::fs::remove_file(&p);
            }
        }
        for top in &self.dirs {
            let _ = images::zeroize(&dir.join(top));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_parent_link_names_a_sibling_round_of_some_container_and_nothing_else() {
        for ok in [
            "../pre-1",
            "../pre-12",
            "../pre-3.side",
            "../pre-3.log-shipper",
        ] {
            assert!(parent_link_ok("pre-2/parent", ok), "{ok}");
        }
        for bad in [
            "../pre-",
            "../pre-x",
            "../pre-1.",
            "../pre-1.Side",
            "../pre-1.a/b",
            "../pre-1..",
            "../final",
            "../../pre-1",
            "/pre-1",
            "pre-1",
        ] {
            assert!(!parent_link_ok("pre-2/parent", bad), "{bad}");
        }
        assert!(!parent_link_ok("pre-2/other", "../pre-1"));
        assert!(!parent_link_ok("parent", "../pre-1"));
    }

    fn sealer() -> Sealer {
        Sealer::new(
            &[7u8; transfer::KEY_LEN],
            "uid-1",
            &[1u8; transfer::STREAM_ID_LEN],
        )
        .unwrap()
    }

    #[test]
    fn a_stream_is_stored_only_if_its_final_chunk_authenticates_the_count() {
        let s = sealer();
        // Three chunks, then the final one (the fourth) sealing the count 3.
        let end = s.seal(3, "", 0, true, &3u64.to_be_bytes());
        assert_eq!(
            verify_end(&s, Ok((2, 10)), Ok(end.clone()), 4).unwrap(),
            (2, 10)
        );
        // The final chunk at another position does not open.
        let e = verify_end(&s, Ok((2, 10)), Ok(end), 5).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        // It opens but counts another number of chunks.
        let lying = s.seal(3, "", 0, true, &2u64.to_be_bytes());
        let e = verify_end(&s, Ok((2, 10)), Ok(lying), 4).unwrap_err();
        assert_eq!(e.code(), tonic::Code::DataLoss);
        // A writer that stopped (nothing read after it) says why, before the reader.
        let e = verify_end(
            &s,
            Err(Status::invalid_argument("bad path")),
            Err(Status::data_loss("cut")),
            1,
        )
        .unwrap_err();
        assert_eq!(e.message(), "bad path");
        let e = verify_end(&s, Ok((0, 0)), Err(Status::data_loss("cut")), 1).unwrap_err();
        assert_eq!(e.message(), "cut");
    }
}
