//! Reading files of the target's filesystem for `kubectl podmotion cp`, strictly inside
//! the target's root.
//!
//! The root is the target's root directory in its own mount namespace, opened through
//! the process pinned at attach time ([`crate::pinned`]), never through a PID. A path is resolved by the kernel with `openat2(2)` and
//! `RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`: `..` and absolute symlinks stay inside
//! the root, as in a chroot, and `/proc/<pid>/root`-style magic links (the target's
//! own `/proc`) are refused, so no path a tenant can plant leads out of the container.
//! The result is opened `O_PATH` first (opening a device or a FIFO can have effects or
//! block) and only a regular file or a directory is reopened to be read.
//!
//! A directory is sent as a tar stream (what `kubectl cp` users get): it is walked one
//! name at a time with `openat(…, O_NOFOLLOW)` from the directory's descriptor, so a
//! symlink inside it is archived as a symlink, never followed; FIFOs, sockets and
//! devices are left out and counted; directories of kernel filesystems (proc, sysfs,
//! cgroup) are archived empty.

use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat, openat2};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

/// Deepest directory nesting a tar stream follows.
const MAX_DEPTH: usize = 128;

/// What a path in the target's root is.
#[derive(Debug)]
pub enum Opened {
    /// A regular file, open for reading, its size and permission bits.
    File { file: File, size: u64, mode: u32 },
    /// A directory, open for listing.
    Dir { dir: OwnedFd, mode: u32 },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FileError {
    #[error("the path {0:?} must be absolute")]
    NotAbsolute(String),
    #[error("{0} does not exist in the container")]
    NotFound(String),
    #[error(
        "{0}: too many symlinks, a symlink loop, or a /proc magic link (refused: it could lead out of the container)"
    )]
    Loop(String),
    #[error("{0} would leave the container's root (refused)")]
    Escapes(String),
    #[error(
        "{0} is neither a regular file nor a directory (devices, FIFOs and sockets are not copied)"
    )]
    NotRegular(String),
    #[error("{0}: permission denied")]
    Denied(String),
    #[error("no container {0:?} in this attachment")]
    NoContainer(String),
    #[error(
        "container {0} has exited: its attachment has ended (the Job is replaced for a restarted container)"
    )]
    Gone(String),
    #[error("this kernel has no openat2(2) (Linux 5.6 or later is needed to read files safely)")]
    NoOpenat2,
    #[error("{path}: {errno}")]
    Other { path: String, errno: Errno },
}

impl FileError {
    fn of(path: &str, e: Errno) -> Self {
        let p = path.to_owned();
        match e {
            Errno::ENOENT | Errno::ENOTDIR => FileError::NotFound(p),
            Errno::ELOOP => FileError::Loop(p),
            Errno::EXDEV => FileError::Escapes(p),
            Errno::EACCES | Errno::EPERM => FileError::Denied(p),
            Errno::ENOSYS => FileError::NoOpenat2,
            errno => FileError::Other { path: p, errno },
        }
    }

    /// The HTTP status the control API answers with.
    pub fn status(&self) -> u16 {
        match self {
            FileError::NotAbsolute(_) | FileError::NotRegular(_) | FileError::Loop(_) => 400,
            FileError::NotFound(_) | FileError::NoContainer(_) => 404,
            FileError::Gone(_) => 410,
            FileError::Escapes(_) | FileError::Denied(_) => 403,
            FileError::NoOpenat2 => 501,
            FileError::Other { .. } => 500,
        }
    }
}

fn perm(st: &FileStat) -> u32 {
    st.st_mode & 0o7777
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

/// Reopens an `O_PATH` descriptor for reading through `/proc/self/fd` (the same inode:
/// nothing is resolved again by name).
fn reopen(fd: BorrowedFd<'_>, flags: OFlag) -> Result<OwnedFd, Errno> {
    nix::fcntl::open(
        format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
        flags | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
        Mode::empty(),
    )
}

/// Opens `path` (absolute, as the container sees it) inside the directory `root`.
pub fn open_in_root(root: &Path, path: &str) -> Result<Opened, FileError> {
    let root_fd = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| FileError::of("/", e))?;
    open_in(root_fd.as_fd(), path)
}

/// Opens `path` (absolute, as the container sees it) inside the open directory
/// `root_fd` (a target's root, from its pinned process).
pub fn open_in(root_fd: BorrowedFd<'_>, path: &str) -> Result<Opened, FileError> {
    if !path.starts_with('/') {
        return Err(FileError::NotAbsolute(path.to_owned()));
    }
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    // EAGAIN: a concurrent rename somewhere in the root; the kernel asks for a retry.
    let mut tries = 0;
    let fd = loop {
        match openat2(root_fd, path, how) {
            Err(Errno::EAGAIN) if tries < 8 => tries += 1,
            r => break r.map_err(|e| FileError::of(path, e))?,
        }
    };
    let st = fstat(fd.as_fd()).map_err(|e| FileError::of(path, e))?;
    match kind(&st) {
        SFlag::S_IFREG => {
            let file = File::from(
                reopen(fd.as_fd(), OFlag::O_RDONLY).map_err(|e| FileError::of(path, e))?,
            );
            Ok(Opened::File {
                file,
                size: st.st_size as u64,
                mode: perm(&st),
            })
        }
        SFlag::S_IFDIR => Ok(Opened::Dir {
            dir: reopen(fd.as_fd(), OFlag::O_RDONLY | OFlag::O_DIRECTORY)
                .map_err(|e| FileError::of(path, e))?,
            mode: perm(&st),
        }),
        _ => Err(FileError::NotRegular(path.to_owned())),
    }
}

/// What a tar stream left out.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct TarSummary {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// FIFOs, sockets, devices, and entries that could not be opened.
    pub skipped: u64,
}

/// A reader of exactly `size` bytes: the file's bytes, cut or padded with zeros when
/// the file changed size after its header was written (the tar stays well-formed).
fn exactly(file: File, size: u64) -> impl Read {
    file.take(size).chain(std::io::repeat(0)).take(size)
}

fn header(st: &FileStat, ty: tar::EntryType, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(ty);
    h.set_size(size);
    h.set_mode(perm(st));
    h.set_uid(st.st_uid.into());
    h.set_gid(st.st_gid.into());
    h.set_mtime(st.st_mtime.max(0) as u64);
    h
}

/// Kernel filesystems a copy does not descend into.
fn is_kernel_fs(fd: BorrowedFd<'_>) -> bool {
    use nix::sys::statfs::{
        CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, PROC_SUPER_MAGIC, SYSFS_MAGIC,
    };
    nix::sys::statfs::fstatfs(fd).is_ok_and(|s| {
        let t = s.filesystem_type();
        t == PROC_SUPER_MAGIC
            || t == SYSFS_MAGIC
            || t == CGROUP_SUPER_MAGIC
            || t == CGROUP2_SUPER_MAGIC
    })
}

/// Writes the directory `dir` as a tar stream whose entries are named `name/…`
/// (`name` is the copied directory's last component), and the end-of-archive blocks.
pub fn write_tar<W: Write>(
    dir: OwnedFd,
    name: &str,
    mode: u32,
    out: W,
) -> std::io::Result<TarSummary> {
    let mut b = tar::Builder::new(out);
    let mut summary = TarSummary::default();
    let st = fstat(dir.as_fd())?;
    let mut h = header(&st, tar::EntryType::Directory, 0);
    h.set_mode(mode);
    b.append_data(&mut h, format!("{name}/"), std::io::empty())?;
    summary.dirs += 1;
    walk(&mut b, dir, name, 0, &mut summary)?;
    b.into_inner()?.flush()?;
    Ok(summary)
}

fn walk<W: Write>(
    b: &mut tar::Builder<W>,
    dir: OwnedFd,
    prefix: &str,
    depth: usize,
    summary: &mut TarSummary,
) -> std::io::Result<()> {
    if depth >= MAX_DEPTH || is_kernel_fs(dir.as_fd()) {
        return Ok(());
    }
    let mut d = nix::dir::Dir::from_fd(dir)?;
    for n in sorted_names(&mut d)? {
        let shown = String::from_utf8_lossy(n.to_bytes()).into_owned();
        let path = format!("{prefix}/{shown}");
        append_entry(b, &d, &n, &path, depth, summary)?;
    }
    Ok(())
}

/// The names in `d` but `.` and `..`, sorted.
fn sorted_names(d: &mut nix::dir::Dir) -> std::io::Result<Vec<std::ffi::CString>> {
    let mut names: Vec<std::ffi::CString> = Vec::new();
    for e in d.iter() {
        let e = e?;
        let n = e.file_name();
        if n.to_bytes() != b"." && n.to_bytes() != b".." {
            names.push(n.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// Appends the entry `n` of `d` to the tar as `path`: a regular file, a directory with
/// what it holds, or a symlink; anything else, or an entry that cannot be opened, is
/// counted as skipped.
fn append_entry<W: Write>(
    b: &mut tar::Builder<W>,
    d: &nix::dir::Dir,
    n: &std::ffi::CStr,
    path: &str,
    depth: usize,
    summary: &mut TarSummary,
) -> std::io::Result<()> {
    // One component from the directory listing, not followed if it is a link:
    // nothing here resolves a path the container chose.
    let Ok(fd) = openat(
        d.as_fd(),
        n,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) else {
        summary.skipped += 1;
        return Ok(());
    };
    let Ok(st) = fstat(fd.as_fd()) else {
        summary.skipped += 1;
        return Ok(());
    };
    match kind(&st) {
        SFlag::S_IFREG => {
            let Ok(f) = reopen(fd.as_fd(), OFlag::O_RDONLY) else {
                summary.skipped += 1;
                return Ok(());
            };
            let size = st.st_size as u64;
            let mut h = header(&st, tar::EntryType::Regular, size);
            b.append_data(&mut h, path, exactly(File::from(f), size))?;
            summary.files += 1;
        }
        SFlag::S_IFDIR => {
            let Ok(sub) = reopen(fd.as_fd(), OFlag::O_RDONLY | OFlag::O_DIRECTORY) else {
                summary.skipped += 1;
                return Ok(());
            };
            let mut h = header(&st, tar::EntryType::Directory, 0);
            b.append_data(&mut h, format!("{path}/"), std::io::empty())?;
            summary.dirs += 1;
            walk(b, sub, path, depth + 1, summary)?;
        }
        SFlag::S_IFLNK => {
            let Ok(target) = nix::fcntl::readlinkat(d.as_fd(), n) else {
                summary.skipped += 1;
                return Ok(());
            };
            let mut h = header(&st, tar::EntryType::Symlink, 0);
            b.append_link(&mut h, path, Path::new(&target))?;
            summary.symlinks += 1;
        }
        _ => summary.skipped += 1,
    }
    Ok(())
}

/// `%XX`-decodes a query value (`+` stays `+`); `None` for a bad escape or bytes that
/// are not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// The decoded value of `key` in a query string.
pub fn query_param(query: Option<&str>, key: &str) -> Option<String> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(percent_decode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;

    /// A root with an outside neighbour holding a secret, and a hostile corpus of links.
    struct Corpus {
        base: PathBuf,
        root: PathBuf,
    }

    impl Corpus {
        fn new(tag: &str) -> Self {
            let base = std::env::temp_dir().join(format!("pm-files-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&base);
            let root = base.join("root");
            std::fs::create_dir_all(root.join("etc")).unwrap();
            std::fs::create_dir_all(root.join("data/sub")).unwrap();
            std::fs::write(base.join("secret"), b"OUTSIDE").unwrap();
            std::fs::write(root.join("etc/hostname"), b"inside\n").unwrap();
            std::fs::write(root.join("secret"), b"INSIDE").unwrap();
            std::fs::write(root.join("data/a.txt"), b"alpha").unwrap();
            std::fs::write(root.join("data/sub/b.bin"), [0u8, 1, 2, 255]).unwrap();
            // Hostile links: relative escape, absolute, loop, through /proc.
            symlink("../../secret", root.join("dotdot")).unwrap();
            symlink(base.join("secret"), root.join("abs")).unwrap();
            symlink("/secret", root.join("abs-inside")).unwrap();
            symlink("loop2", root.join("loop1")).unwrap();
            symlink("loop1", root.join("loop2")).unwrap();
            symlink("/proc/self/root/etc/hostname", root.join("magic")).unwrap();
            symlink("../../secret", root.join("data/escape")).unwrap();
            std::os::unix::net::UnixListener::bind(root.join("sock")).unwrap();
            Corpus { base, root }
        }

        fn read(&self, path: &str) -> Result<Vec<u8>, FileError> {
            match open_in_root(&self.root, path)? {
                Opened::File { mut file, .. } => {
                    let mut v = vec![];
                    file.read_to_end(&mut v).unwrap();
                    Ok(v)
                }
                Opened::Dir { .. } => Ok(b"<dir>".to_vec()),
            }
        }
    }

    impl Drop for Corpus {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }

    #[test]
    fn paths_and_links_resolve_inside_the_root_and_never_outside() {
        let c = Corpus::new("hostile");
        assert_eq!(c.read("/etc/hostname").unwrap(), b"inside\n");
        // `..` past the root stays at the root, as in a chroot.
        assert_eq!(c.read("/../../secret").unwrap(), b"INSIDE");
        assert_eq!(c.read("/dotdot").unwrap(), b"INSIDE");
        assert_eq!(c.read("/data/escape").unwrap(), b"INSIDE");
        assert_eq!(c.read("/abs-inside").unwrap(), b"INSIDE");
        // An absolute link to the host path of the outside file is looked up inside.
        assert!(matches!(c.read("/abs"), Err(FileError::NotFound(_))));
        assert!(matches!(c.read("/loop1"), Err(FileError::Loop(_))));
        // No /proc inside this root: the link's target does not exist there.
        assert!(matches!(c.read("/magic"), Err(FileError::NotFound(_))));
        assert!(matches!(c.read("/sock"), Err(FileError::NotRegular(_))));
        assert!(matches!(
            c.read("etc/hostname"),
            Err(FileError::NotAbsolute(_))
        ));
        assert_eq!(c.read("/data").unwrap(), b"<dir>");
    }

    #[test]
    fn proc_magic_links_are_refused_in_a_real_process_root() {
        // Our own root, as the agent sees a target's: `/proc/<pid>/root`. It has a
        // /proc whose magic links point anywhere; they must not be followed.
        let root = PathBuf::from(format!("/proc/{}/root", std::process::id()));
        for p in [
            "/proc/self/root/etc/hostname",
            "/proc/self/cwd",
            "/proc/self/exe",
            "/proc/thread-self/root/etc/hostname",
        ] {
            let r = open_in_root(&root, p);
            assert!(matches!(r, Err(FileError::Loop(_))), "{p}: {r:?}");
        }
        // Another process's magic links: refused (the ptrace check may refuse first).
        let r = open_in_root(&root, "/proc/1/root/etc/hostname");
        assert!(
            matches!(r, Err(FileError::Loop(_) | FileError::Denied(_))),
            "{r:?}"
        );
        // /proc/self itself is a plain symlink (to the pid), allowed; a file under it is readable.
        assert!(matches!(
            open_in_root(&root, "/proc/self/status"),
            Ok(Opened::File { .. })
        ));
        // /dev/null is opened O_PATH only and refused: no device is ever opened.
        assert!(matches!(
            open_in_root(&root, "/dev/null"),
            Err(FileError::NotRegular(_))
        ));
    }

    #[test]
    fn a_directory_becomes_a_tar_whose_links_are_archived_not_followed() {
        let c = Corpus::new("tar");
        let Opened::Dir { dir, mode } = open_in_root(&c.root, "/data").unwrap() else {
            panic!("a directory")
        };
        let mut buf = vec![];
        let s = write_tar(dir, "data", mode, &mut buf).unwrap();
        assert_eq!(
            s,
            TarSummary {
                files: 2,
                dirs: 2,
                symlinks: 1,
                skipped: 0
            }
        );
        let mut a = tar::Archive::new(buf.as_slice());
        let mut got = vec![];
        for e in a.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().display().to_string();
            let mut body = vec![];
            e.read_to_end(&mut body).unwrap();
            let link = e.link_name().unwrap().map(|l| l.display().to_string());
            got.push((path, body, link));
        }
        assert_eq!(
            got,
            vec![
                ("data/".into(), vec![], None),
                ("data/a.txt".into(), b"alpha".to_vec(), None),
                ("data/escape".into(), vec![], Some("../../secret".into())),
                ("data/sub/".into(), vec![], None),
                ("data/sub/b.bin".into(), vec![0, 1, 2, 255], None),
            ]
        );
        assert!(
            !buf.windows(7).any(|w| w == b"OUTSIDE"),
            "the outside file's bytes are not in the archive"
        );
    }

    #[test]
    fn special_files_are_skipped_in_a_tree() {
        let c = Corpus::new("special");
        let Opened::Dir { dir, mode } = open_in_root(&c.root, "/").unwrap() else {
            panic!("a directory")
        };
        let s = write_tar(dir, "root", mode, std::io::sink()).unwrap();
        assert_eq!(s.skipped, 1, "the socket");
        assert_eq!(s.symlinks, 7);
    }

    #[test]
    fn query_values_are_percent_decoded() {
        assert_eq!(
            query_param(Some("path=%2Fetc%2Fos-release&container=x"), "path").as_deref(),
            Some("/etc/os-release")
        );
        assert_eq!(
            query_param(Some("container=c1&path=/a%20b"), "container").as_deref(),
            Some("c1")
        );
        assert_eq!(query_param(Some("xpath=/a"), "path"), None);
        assert_eq!(query_param(Some("path=%zz"), "path"), None);
        assert_eq!(query_param(Some("path=%c3%28"), "path"), None, "not UTF-8");
        assert_eq!(query_param(None, "path"), None);
    }
}
