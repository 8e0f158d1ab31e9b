//! The image stream through the real sealing and storing code: no (key, nonce) pair
//! is ever used twice, and a hostile stream cannot write outside its migration.

use super::manifest::final_dir;
use super::pace::Pace;
use super::receive::Store;
use super::send::{BLOCK, collect, produce, stream_sealer};
use super::testkit::Scratch;
use super::*;
use podmotion_wire::transfer::{NonceLog, Sealer};
use std::collections::BTreeSet;

fn write(dir: &Path, rel: &str, len: usize, fill: u8) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, vec![fill; len]).unwrap();
}

/// One Send as `send_impl` runs it: a fresh stream sealer, `produce` over the
/// checkpoint dir, a target that takes `accept` chunks (all if `None`) and then
/// hangs up. Returns the paths now on the target, or the error.
fn send_once(
    dir: &Path,
    key: &[u8],
    uid: &str,
    already: &BTreeSet<String>,
    delta: bool,
    log: &NonceLog,
    accept: Option<usize>,
) -> Result<Vec<String>, Status> {
    let sealer = stream_sealer(key, uid)?.recording(log.clone());
    let (tx, mut rx) = tokio::sync::mpsc::channel::<ImageChunk>(1);
    let target = std::thread::spawn(move || {
        let mut got = 0;
        while accept.is_none_or(|n| got < n) {
            if rx.blocking_recv().is_none() {
                break;
            }
            got += 1;
        }
    });
    let r = produce(dir, uid, &sealer, &tx, already, delta, &Pace::new(0));
    drop(tx);
    target.join().unwrap();
    r.map(|(_, paths)| paths)
}

fn pre_copy_with_a_retried_send(delta: bool) -> Vec<(Vec<u8>, Vec<u8>)> {
    let d = Scratch::new("nonce");
    let key = [9u8; 32];
    let uid = "0b6a5d2e-4c1f-4f4e-9d7e-2a1b3c4d5e6f";
    let log: NonceLog = Default::default();
    let mut already = BTreeSet::new();
    for round in 1..=3u8 {
        let pre = format!("pre-{round}");
        write(&d.0, &format!("{pre}/pages-1.img"), 3 << 20, round);
        write(&d.0, &format!("{pre}/core-1.img"), 4096, round);
        if round > 1 {
            std::os::unix::fs::symlink(
                format!("../pre-{}", round - 1),
                d.0.join(&pre).join("parent"),
            )
            .unwrap();
        }
        let paths = send_once(&d.0, &key, uid, &already, delta, &log, None).unwrap();
        already.extend(paths);
    }
    write(&d.0, "final/pages-1.img", 3 << 20, 7);
    write(&d.0, "final/core-1.img", 4096, 7);
    write(&d.0, "manifest.json", 100, b'{');
    // The final Send fails after two chunks (the target hung up) and is retried.
    assert!(send_once(&d.0, &key, uid, &already, delta, &log, Some(2)).is_err());
    let paths = send_once(&d.0, &key, uid, &already, delta, &log, None).unwrap();
    assert!(paths.contains(&"manifest.json".to_string()));
    log.lock().unwrap().clone()
}

fn assert_no_pair_repeats(used: &[(Vec<u8>, Vec<u8>)]) {
    assert!(used.len() > 20, "the streams sealed {} chunks", used.len());
    let mut seen = BTreeSet::new();
    for (k, n) in used {
        assert!(
            seen.insert((k.clone(), n.clone())),
            "(key, nonce) reused: nonce {n:02x?} of {} sealed chunks",
            used.len()
        );
    }
}

#[test]
fn pre_copy_rounds_and_a_retried_send_never_reuse_a_key_nonce_pair() {
    assert_no_pair_repeats(&pre_copy_with_a_retried_send(false));
}

#[test]
fn warm_copy_deltas_and_a_retried_send_never_reuse_a_key_nonce_pair() {
    assert_no_pair_repeats(&pre_copy_with_a_retried_send(true));
}

fn chunk(path: &str, offset: u64) -> ImageChunk {
    ImageChunk {
        path: path.into(),
        offset,
        ..Default::default()
    }
}

fn link(path: &str) -> ImageChunk {
    ImageChunk {
        symlink: true,
        ..chunk(path, 0)
    }
}

fn delta(path: &str, base: &str) -> ImageChunk {
    ImageChunk {
        base: base.into(),
        ..chunk(path, 0)
    }
}

/// Every file under `dir` with its content (links as their targets).
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut e = Vec::new();
    collect(dir, dir, &mut e).unwrap();
    let mut out: Vec<_> = e
        .into_iter()
        .map(|(rel, is_link)| {
            let p = dir.join(&rel);
            let v = if is_link {
                std::fs::read_link(p)
                    .unwrap()
                    .into_os_string()
                    .into_encoded_bytes()
            } else {
                std::fs::read(p).unwrap()
            };
            (rel, v)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_hostile_stream_cannot_link_or_write_outside_its_migration() {
    let root = Scratch::new("corpus");
    let ours = root.0.join("mig-a");
    let other = root.0.join("mig-b");
    write(&other, "final/pages-1.img", 10, b'v');
    write(&other, "manifest.json", 10, b'{');
    write(&ours, "pre-1/pages-1.img", 10, 1);
    let before = tree(&other);
    let mut store = Store::new(&ours);
    // A planted top-level link (as an older receiver accepted it) is never followed.
    std::os::unix::fs::symlink("../mig-b", ours.join("pre-9")).unwrap();

    let refused: Vec<(&str, ImageChunk, Vec<u8>)> = vec![
        (
            "top-level link into another migration",
            link("pre-8"),
            b"../mig-b".to_vec(),
        ),
        (
            "top-level link named like a round",
            link("final"),
            b"../mig-b/final".to_vec(),
        ),
        (
            "parent link two levels up",
            link("pre-2/parent"),
            b"../../mig-b".to_vec(),
        ),
        (
            "parent link to an absolute path",
            link("pre-2/parent"),
            b"/etc".to_vec(),
        ),
        ("parent link to ..", link("pre-2/parent"), b"..".to_vec()),
        (
            "parent link into a file",
            link("pre-2/parent"),
            b"../manifest.json".to_vec(),
        ),
        (
            "link not named parent",
            link("pre-2/other"),
            b"../pre-1".to_vec(),
        ),
        (
            "write through a planted top-level link",
            chunk("pre-9/pages-1.img", 0),
            b"x".to_vec(),
        ),
        (
            "delta through a planted top-level link",
            delta("pre-9/pages-2.img", "pre-1/pages-1.img"),
            4u64.to_be_bytes().to_vec(),
        ),
        (
            "delta from a planted top-level link",
            delta("pre-2/pages-2.img", "pre-9/pages-1.img"),
            4u64.to_be_bytes().to_vec(),
        ),
        (
            "traversal",
            chunk("../mig-b/manifest.json", 0),
            b"x".to_vec(),
        ),
        ("absolute", chunk("/tmp/x", 0), b"x".to_vec()),
        (
            "too deep",
            chunk("pre-2/parent/pages-1.img", 0),
            b"x".to_vec(),
        ),
        (
            "delta base traversal",
            delta("pre-2/pages-3.img", "../mig-b/manifest.json"),
            4u64.to_be_bytes().to_vec(),
        ),
    ];
    for (what, c, plain) in refused {
        assert!(store.put(&c, plain).is_err(), "accepted: {what}");
    }
    // CRIU's own parent link is stored; nothing is then written or copied through it.
    store
        .put(&link("pre-2/parent"), b"../pre-1".to_vec())
        .unwrap();
    assert_eq!(
        std::fs::read_link(ours.join("pre-2/parent")).unwrap(),
        Path::new("../pre-1")
    );
    assert!(
        store.put(&chunk("pre-2/parent", 0), b"x".to_vec()).is_err(),
        "write through the parent link"
    );
    assert!(
        store
            .put(
                &delta("pre-2/parent", "pre-1/pages-1.img"),
                4u64.to_be_bytes().to_vec()
            )
            .is_err(),
        "delta onto the parent link"
    );
    // Ordinary chunks still land.
    store
        .put(&chunk("pre-2/pages-1.img", 0), b"abc".to_vec())
        .unwrap();
    store
        .put(&chunk("pre-2/pages-1.img", 3), b"def".to_vec())
        .unwrap();
    assert_eq!(
        std::fs::read(ours.join("pre-2/pages-1.img")).unwrap(),
        b"abcdef"
    );
    assert_eq!(tree(&other), before, "the other migration's images changed");
    assert!(
        !root.0.join("pre-8").exists() && !root.0.join("pages-1.img").exists(),
        "something was written next to the migrations"
    );
}

#[test]
fn the_manifest_names_only_a_plain_directory_of_its_checkpoint() {
    let root = Scratch::new("final");
    let ours = root.0.join("mig-a");
    write(&ours, "final/core-1.img", 10, 1);
    write(&ours, "manifest.json", 10, b'{');
    write(&root.0, "mig-b/final/core-1.img", 10, 2);
    std::os::unix::fs::symlink("../mig-b/final", ours.join("elsewhere")).unwrap();
    let named = |d: &str| Manifest {
        final_dir: d.into(),
        ..Default::default()
    };
    assert_eq!(
        final_dir(&ours, &named("final")).unwrap(),
        ours.join("final")
    );
    for bad in [
        "../mig-b/final",
        "/etc",
        "final/..",
        "..",
        "",
        "elsewhere",
        "manifest.json",
        "missing",
    ] {
        assert!(final_dir(&ours, &named(bad)).is_err(), "accepted {bad:?}");
    }
}

/// One Send through `produce` into a target's `Store`, as the two agents run it: the
/// target takes `accept` chunks (all if `None`), or up to one it refuses, and short of
/// the final chunk hangs up and undoes the stream, as `receive_locked` does. Returns
/// what the source sent and the paths now on the target, or why the stream failed (the
/// target's reason first).
fn send_into_until(
    src: &Path,
    dst: &Path,
    already: &BTreeSet<String>,
    accept: Option<usize>,
) -> Result<(u64, Vec<String>), Status> {
    let key = [5u8; 32];
    let uid = "m-delta";
    let sealer = stream_sealer(&key, uid).unwrap();
    let opener = Sealer::new(&key, uid, sealer.stream_id()).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<ImageChunk>(2);
    let dst = dst.to_path_buf();
    let target = std::thread::spawn(move || {
        let mut store = Store::new(&dst);
        let mut got = 0;
        let stored = loop {
            if accept.is_some_and(|n| got == n) {
                break Err(Status::aborted("target hung up"));
            }
            let Some(mut c) = rx.blocking_recv() else {
                break Err(Status::data_loss("no final chunk"));
            };
            got += 1;
            if c.end {
                break Ok(store.stored());
            }
            let mut plain = std::mem::take(&mut c.sealed);
            opener
                .open_in_place(c.seq, &c.path, c.offset, false, &mut plain)
                .unwrap();
            if let Err(e) = store.put(&c, plain) {
                break Err(e);
            }
        };
        drop(rx);
        if stored.is_err() {
            store.written().undo(&dst);
        }
        stored
    });
    let r = produce(src, uid, &sealer, &tx, already, true, &Pace::new(0));
    drop(tx);
    let (_, bytes) = target.join().unwrap()?;
    let (sent, paths) = r?;
    assert_eq!(bytes, sent, "the target counts the bytes the source sent");
    Ok((sent, paths))
}

/// One Send the target takes whole.
fn send_into(src: &Path, dst: &Path, already: &BTreeSet<String>) -> (u64, Vec<String>) {
    send_into_until(src, dst, already, None).unwrap()
}

/// `len` bytes, differing with `seed`.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

fn put_bytes(dir: &Path, rel: &str, data: &[u8]) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
}

fn inode(dir: &Path, rel: &str) -> u64 {
    std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(dir.join(rel)).unwrap())
}

/// A warm copy (`pre-1`: two images) stored on the target, and the final round's
/// images on the source: `pages-1.img` changed in three places (two blocks and a grown
/// tail: a delta of four chunks), `pages-2.img` in two blocks and cut by more than a
/// MiB (three chunks). Returns the final images and what the target holds.
fn warm_copy_on_target(src: &Path, dst: &Path) -> (Vec<u8>, Vec<u8>, BTreeSet<String>) {
    let warm = (pattern((3 << 20) + 100, 0), pattern((2 << 20) + 300, 0x5a));
    put_bytes(src, "pre-1/pages-1.img", &warm.0);
    put_bytes(src, "pre-1/pages-2.img", &warm.1);
    let (_, paths) = send_into(src, dst, &BTreeSet::new());
    let (mut fin1, mut fin2) = warm;
    fin1[2 * BLOCK] ^= 0xff;
    fin1[40 * BLOCK + 9] ^= 0xff;
    fin1.extend_from_slice(&[9u8; 5000]);
    fin2[BLOCK + 1] ^= 0xff;
    fin2[5 * BLOCK] ^= 0xff;
    fin2.truncate((1 << 20) - 10);
    put_bytes(src, "final/pages-1.img", &fin1);
    put_bytes(src, "final/pages-2.img", &fin2);
    (fin1, fin2, paths.into_iter().collect())
}

/// The target holds each image once: a delta's file is its base, moved and patched
/// (same inode, the base's path gone), not a copy beside it.
#[test]
fn a_delta_takes_its_bases_place_on_the_target_without_a_copy() {
    let (src, dst) = (Scratch::new("inplace-src"), Scratch::new("inplace-dst"));
    let (fin1, fin2, already) = warm_copy_on_target(&src.0, &dst.0);
    let warm = (
        inode(&dst.0, "pre-1/pages-1.img"),
        inode(&dst.0, "pre-1/pages-2.img"),
    );
    send_into(&src.0, &dst.0, &already);
    assert_final_images(&dst.0, &fin1, &fin2);
    assert_eq!(
        (
            inode(&dst.0, "final/pages-1.img"),
            inode(&dst.0, "final/pages-2.img")
        ),
        warm,
        "the final images are not the warm copy's files"
    );
    assert!(!dst.0.join("pre-1/pages-1.img").exists() && !dst.0.join("pre-1/pages-2.img").exists());
    assert_eq!(images::size(&dst.0), (fin1.len() + fin2.len()) as u64);
}

/// The target's final images hold exactly `fin1` and `fin2`.
fn assert_final_images(dst: &Path, fin1: &[u8], fin2: &[u8]) {
    assert_eq!(std::fs::read(dst.join("final/pages-1.img")).unwrap(), fin1);
    assert_eq!(std::fs::read(dst.join("final/pages-2.img")).unwrap(), fin2);
}

/// A delta stream cut after some of its blocks (one image rebuilt, the other moved,
/// cut and patched once) puts the warm copy back byte for byte, length and place, and
/// the retried stream (against the same base) rebuilds the final images.
#[test]
fn a_cut_delta_stream_puts_its_bases_back_and_a_retried_one_rebuilds_them() {
    let (src, dst) = (Scratch::new("cut-src"), Scratch::new("cut-dst"));
    let (fin1, fin2, already) = warm_copy_on_target(&src.0, &dst.0);
    let earlier = tree(&dst.0);
    let warm = inode(&dst.0, "pre-1/pages-2.img");
    // pages-1.img: its four chunks; pages-2.img: its first chunk and one block.
    let cut = send_into_until(&src.0, &dst.0, &already, Some(6)).unwrap_err();
    assert_eq!(cut.code(), tonic::Code::Aborted, "{cut:?}");
    assert_eq!(tree(&dst.0), earlier, "the warm copy was not put back");
    assert_eq!(inode(&dst.0, "pre-1/pages-2.img"), warm);
    assert!(!dst.0.join("final").exists());
    send_into(&src.0, &dst.0, &already);
    assert_final_images(&dst.0, &fin1, &fin2);
}

/// Streams the source did not record: a round stored on the target but not recorded
/// travels again with the final one, both against the same base (the second is copied
/// from where the first moved it, as it was), a stream cut there puts the base back,
/// and one sent again after the target stored it applies the same blocks again. A
/// newer round against a base such a stream moved finds it gone: refused, nothing
/// changed.
#[test]
fn rounds_the_source_did_not_record_are_rebuilt_against_the_base_they_moved() {
    let (src, dst) = (Scratch::new("unrec-src"), Scratch::new("unrec-dst"));
    let warm = pattern((2 << 20) + 7, 3);
    put_bytes(&src.0, "pre-1/pages-1.img", &warm);
    let (_, paths) = send_into(&src.0, &dst.0, &BTreeSet::new());
    let already: BTreeSet<String> = paths.into_iter().collect();
    let (mut pre2, mut fin) = (warm.clone(), warm.clone());
    pre2[3 * BLOCK] ^= 1;
    pre2.truncate(1 << 20);
    fin[7 * BLOCK] ^= 1;
    fin.extend_from_slice(&[4u8; 100]);
    put_bytes(&src.0, "pre-2/pages-1.img", &pre2);
    put_bytes(&src.0, "final/pages-1.img", &fin);
    let earlier = tree(&dst.0);
    // pre-2's image (its first chunk and one block), then final's first chunk.
    let cut = send_into_until(&src.0, &dst.0, &already, Some(3)).unwrap_err();
    assert_eq!(cut.code(), tonic::Code::Aborted, "{cut:?}");
    assert_eq!(tree(&dst.0), earlier, "the warm copy was not put back");
    let rebuilt = || {
        assert_eq!(
            std::fs::read(dst.0.join("pre-2/pages-1.img")).unwrap(),
            pre2
        );
        assert_eq!(std::fs::read(dst.0.join("final/pages-1.img")).unwrap(), fin);
    };
    send_into(&src.0, &dst.0, &already);
    rebuilt();
    assert!(!dst.0.join("pre-1/pages-1.img").exists());
    // The target stored it; the source sends it again, cut, then whole.
    let stored = tree(&dst.0);
    let cut = send_into_until(&src.0, &dst.0, &already, Some(3)).unwrap_err();
    assert_eq!(cut.code(), tonic::Code::Aborted, "{cut:?}");
    assert_eq!(tree(&dst.0), stored);
    send_into(&src.0, &dst.0, &already);
    rebuilt();
    std::fs::remove_file(src.0.join("final/pages-1.img")).unwrap();
    put_bytes(&src.0, "pre-3/pages-1.img", &fin);
    let e = send_into_until(&src.0, &dst.0, &already, None).unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert_eq!(tree(&dst.0), stored);
}

/// While a round links to a parent (an incremental dump, whose restore may read the
/// base), a delta copies its base; a stream that moved a base takes no parent link, and
/// its undo puts the base back even where its blocks overlapped.
#[test]
fn a_base_the_restore_may_read_through_a_parent_link_is_copied_not_moved() {
    let root = Scratch::new("parent");
    let dir = root.0.join("mig");
    write(&dir, "pre-1/pages-1.img", 10, 1);
    write(&dir, "pre-2/pages-1.img", 10, 2);
    std::os::unix::fs::symlink("../pre-1", dir.join("pre-2/parent")).unwrap();
    let len = || 12u64.to_be_bytes().to_vec();
    let mut store = Store::new(&dir);
    store
        .put(&delta("final/pages-1.img", "pre-2/pages-1.img"), len())
        .unwrap();
    assert_eq!(
        std::fs::read(dir.join("pre-2/pages-1.img")).unwrap(),
        [2; 10]
    );
    let mut copy = vec![2; 10];
    copy.extend([0, 0]);
    assert_eq!(std::fs::read(dir.join("final/pages-1.img")).unwrap(), copy);

    std::fs::remove_file(dir.join("pre-2/parent")).unwrap();
    let mut store = Store::new(&dir);
    store
        .put(&delta("pre-3/pages-1.img", "pre-2/pages-1.img"), len())
        .unwrap();
    assert!(!dir.join("pre-2/pages-1.img").exists());
    // Blocks that overlap are put back newest first.
    store
        .put(&chunk("pre-3/pages-1.img", 0), b"ab".to_vec())
        .unwrap();
    store
        .put(&chunk("pre-3/pages-1.img", 1), b"cd".to_vec())
        .unwrap();
    assert!(
        store
            .put(&link("pre-3/parent"), b"../pre-2".to_vec())
            .is_err()
    );
    store.written().undo(&dir);
    assert_eq!(
        std::fs::read(dir.join("pre-2/pages-1.img")).unwrap(),
        [2; 10]
    );
}

#[test]
fn a_delta_against_the_warm_copy_rebuilds_the_final_image_exactly() {
    let (src, dst) = (Scratch::new("delta-src"), Scratch::new("delta-dst"));
    let warm: Vec<u8> = (0..(3 << 20) + 100).map(|i| (i % 251) as u8).collect();
    std::fs::create_dir_all(src.0.join("pre-1")).unwrap();
    std::fs::write(src.0.join("pre-1/pages-1.img"), &warm).unwrap();
    let (_, paths) = send_into(&src.0, &dst.0, &BTreeSet::new());
    let already: BTreeSet<String> = paths.into_iter().collect();
    // Changed: one block, a run across the first window's end longer than a chunk,
    // the last partial block; and the image grew.
    let mut fin = warm.clone();
    fin[2 * BLOCK + 7] ^= 0xff;
    for b in &mut fin[(1 << 20) - BLOCK..(5 << 19)] {
        *b = !*b;
    }
    let last = fin.len() - 1;
    fin[last] ^= 1;
    fin.extend_from_slice(&[9u8; 5000]);
    std::fs::create_dir_all(src.0.join("final")).unwrap();
    std::fs::write(src.0.join("final/pages-1.img"), &fin).unwrap();
    let (sent, _) = send_into(&src.0, &dst.0, &already);
    assert_eq!(std::fs::read(dst.0.join("final/pages-1.img")).unwrap(), fin);
    assert!(
        sent < (2 << 20),
        "only the changed blocks cross: {sent} bytes of {}",
        fin.len()
    );
}

/// A stream that does not end well takes back only what it wrote (earlier rounds,
/// which the source counts as sent, stay), and a new stream replaces a file an earlier
/// stream left instead of refusing its offset 0.
#[test]
fn a_stream_that_fails_leaves_earlier_rounds_and_a_new_one_replaces_leftovers() {
    let root = Scratch::new("undo");
    let dir = root.0.join("mig");
    write(&dir, "pre-1/pages-1.img", 10, 1);
    let earlier = tree(&dir);
    let mut cut = Store::new(&dir);
    cut.put(&chunk("pre-2/pages-1.img", 0), b"abc".to_vec())
        .unwrap();
    cut.put(&link("pre-2/parent"), b"../pre-1".to_vec())
        .unwrap();
    cut.put(&chunk("pre-1/pages-2.img", 0), b"def".to_vec())
        .unwrap();
    cut.written().undo(&dir);
    assert_eq!(tree(&dir), earlier, "the cut stream's files stayed");
    assert!(!dir.join("pre-2").exists());

    // A round an earlier stream stored whole (the source never recorded its end): the
    // new stream sends it again from offset 0.
    write(&dir, "final/pages-1.img", 10, 7);
    let mut again = Store::new(&dir);
    again
        .put(&chunk("final/pages-1.img", 0), b"xyz".to_vec())
        .unwrap();
    again
        .put(&chunk("final/pages-1.img", 3), b"w".to_vec())
        .unwrap();
    assert_eq!(
        std::fs::read(dir.join("final/pages-1.img")).unwrap(),
        b"xyzw"
    );
    // A file's first chunk in a stream starts at offset 0.
    assert!(
        again
            .put(&chunk("pre-1/pages-1.img", 10), b"x".to_vec())
            .is_err()
    );
    assert_eq!(
        std::fs::read(dir.join("pre-1/pages-1.img")).unwrap(),
        vec![1; 10]
    );
}
