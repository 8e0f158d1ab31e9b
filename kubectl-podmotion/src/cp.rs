//! `kubectl podmotion cp <workload>:<path> <local>`: copies a file or a directory out
//! of a replica's container through its attach agent (`GET /v1/files`, which resolves
//! the path strictly inside the container's root), with the agent found or created as
//! for `env` ([`crate::env::with_agent`]).
//!
//! A regular file is written to `<local>` (or into it, when `<local>` is a directory)
//! with the file's permission bits, after checking that exactly the announced number of
//! bytes arrived. A directory arrives as a tar stream and is unpacked so that `<local>`
//! holds the directory's contents (as `kubectl cp` does); entries are written only
//! below `<local>`, never through a symlink. `-` as `<local>` writes the raw bytes (the
//! file, or the tar) to stdout. Only regular files, directories and symlinks are
//! copied; the agent leaves devices, FIFOs and sockets out.

use std::io::Read;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, bail};
use kube::Client;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, DuplexStream};

use crate::agent::Agent;
use crate::cli::Cp;
use crate::env::{container_id, progress, with_agent};

/// Longest JSON line the agent sends before the bytes.
const MAX_META: u64 = 4096;

/// What the agent says before the bytes.
#[derive(Debug, serde::Deserialize, PartialEq, Eq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Meta {
    File { size: u64, mode: u32 },
    Dir { mode: u32 },
}

/// Percent-encodes a query value: everything but unreserved characters and `/`.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The path of an entry of the agent's tar below `dest`: its first component (the
/// copied directory's own name) dropped; `None` for the top entry itself, an error for
/// anything but plain names.
pub fn entry_target(dest: &Path, entry: &Path) -> anyhow::Result<Option<PathBuf>> {
    let mut comps = entry.components();
    match comps.next() {
        Some(Component::Normal(_)) => {}
        _ => bail!(
            "tar entry {} is not below the copied directory",
            entry.display()
        ),
    }
    let mut out = dest.to_path_buf();
    let mut any = false;
    for c in comps {
        match c {
            Component::Normal(n) => {
                out.push(n);
                any = true;
            }
            Component::CurDir => {}
            _ => bail!("tar entry {} leaves the destination", entry.display()),
        }
    }
    Ok(any.then_some(out))
}

/// Refuses a target when any directory between `dest` and it is a symlink (an
/// archive's earlier symlink entry must never redirect a later entry out of `dest`),
/// and removes a symlink at the target itself so it is replaced, not written through.
fn no_symlink_between(dest: &Path, target: &Path) -> anyhow::Result<()> {
    let rel = target
        .strip_prefix(dest)
        .context("entry outside the destination")?;
    let mut p = dest.to_path_buf();
    let n = rel.components().count();
    for (i, c) in rel.components().enumerate() {
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_symlink() => {
                if i + 1 < n {
                    bail!("{} is a symlink: refusing to write through it", p.display());
                }
                std::fs::remove_file(&p)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// What was unpacked.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Unpacked {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
}

/// Unpacks the agent's tar of a directory into `dest` (created if missing).
pub fn unpack(tar: impl Read, dest: &Path) -> anyhow::Result<Unpacked> {
    std::fs::create_dir_all(dest).with_context(|| format!("creating {}", dest.display()))?;
    let mut a = tar::Archive::new(tar);
    a.set_preserve_permissions(true);
    a.set_preserve_mtime(true);
    let mut got = Unpacked::default();
    for e in a.entries().context("reading the tar stream")? {
        let mut e = e.context("reading the tar stream")?;
        let path = e.path()?.into_owned();
        let Some(target) = entry_target(dest, &path)? else {
            continue;
        };
        no_symlink_between(dest, &target)?;
        match e.header().entry_type() {
            tar::EntryType::Directory => {
                std::fs::create_dir_all(&target)?;
                got.dirs += 1;
            }
            tar::EntryType::Regular | tar::EntryType::Symlink => {
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent)?;
                }
                let symlink = e.header().entry_type() == tar::EntryType::Symlink;
                got.bytes += e.size();
                e.unpack(&target)
                    .with_context(|| format!("writing {}", target.display()))?;
                if symlink {
                    got.symlinks += 1;
                } else {
                    got.files += 1;
                }
            }
            _ => {}
        }
    }
    Ok(got)
}

/// Where a file is written: `<local>` itself, or `<local>/<name>` when `<local>` is an
/// existing directory (as `cp` does).
pub fn file_target(local: &Path, remote: &str) -> PathBuf {
    if local.is_dir() {
        let name = Path::new(remote)
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("file"));
        local.join(name)
    } else {
        local.to_path_buf()
    }
}

pub async fn run(client: Client, namespace: &str, args: &Cp) -> anyhow::Result<u8> {
    let (w, path) = &args.source;
    with_agent(
        "cp",
        &client,
        namespace,
        w,
        args.agent.agents_namespace.as_deref(),
        args.agent.timeout,
        |agent| copy(&client, namespace, agent, path, args),
    )
    .await?;
    Ok(0)
}

/// The agent's stream of one file or directory, after its metadata line.
type FileStream = BufReader<DuplexStream>;

async fn copy(
    client: &Client,
    namespace: &str,
    agent: Agent,
    path: &str,
    args: &Cp,
) -> anyhow::Result<()> {
    let (mut s, meta) = open_remote(client, namespace, &agent, path, args).await?;
    let stdout = args.local.as_os_str() == "-";
    match meta {
        Meta::File { size, mode } => {
            let mut body = (&mut s).take(size);
            let n = if stdout {
                to_stdout(&mut body).await?
            } else {
                to_local_file(&mut body, mode, &agent, path, &args.local).await?
            };
            if n != size {
                bail!("the copy of {path} ended after {n} of {size} bytes");
            }
        }
        Meta::Dir { .. } if stdout => {
            let n = to_stdout(&mut s).await?;
            progress(&format!(
                "{path}: {n} bytes of tar from pod {}",
                agent.target
            ));
        }
        Meta::Dir { .. } => to_local_dir(&mut s, &agent, path, &args.local).await?,
    }
    Ok(())
}

/// Asks the agent for `path` (in the chosen container, if any) and reads what it is.
async fn open_remote(
    client: &Client,
    namespace: &str,
    agent: &Agent,
    path: &str,
    args: &Cp,
) -> anyhow::Result<(FileStream, Meta)> {
    let mut query = format!("/v1/files?path={}", percent_encode(path));
    if let Some(id) =
        container_id(client, namespace, agent, args.agent.container.as_deref()).await?
    {
        query.push_str(&format!("&container={}", percent_encode(&id)));
    }
    let mut s = agent
        .upgrade(&query)
        .await
        .map_err(|e| anyhow::anyhow!("copying {path} from pod {}: {e:#}", agent.target))?;
    let mut line = Vec::new();
    (&mut s).take(MAX_META).read_until(b'\n', &mut line).await?;
    let meta: Meta = serde_json::from_slice(&line).with_context(|| {
        format!(
            "the agent's answer for {path}: {:?}",
            String::from_utf8_lossy(&line)
        )
    })?;
    Ok((s, meta))
}

/// Writes a file's bytes to its [`file_target`] with the remote mode's permission
/// bits; the byte count.
async fn to_local_file<R: tokio::io::AsyncRead + Unpin>(
    body: &mut R,
    mode: u32,
    agent: &Agent,
    path: &str,
    local: &Path,
) -> anyhow::Result<u64> {
    let target = file_target(local, path);
    let mut f = tokio::fs::File::create(&target)
        .await
        .with_context(|| format!("creating {}", target.display()))?;
    let n = tokio::io::copy(body, &mut f).await?;
    f.flush().await?;
    use std::os::unix::fs::PermissionsExt;
    tokio::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode & 0o777)).await?;
    progress(&format!(
        "{path} ({n} bytes) from pod {} (node {}) -> {}",
        agent.target,
        agent.node,
        target.display()
    ));
    Ok(n)
}

/// Unpacks a directory's tar stream into `local`; fails on a stream cut short.
async fn to_local_dir(
    s: &mut FileStream,
    agent: &Agent,
    path: &str,
    local: &Path,
) -> anyhow::Result<()> {
    // tar reads synchronously: the bytes go through a pipe of chunks.
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(8);
    let dest = local.to_path_buf();
    let unpacker = tokio::task::spawn_blocking(move || unpack(ChunkReader::new(rx), &dest));
    let mut buf = vec![0u8; 64 * 1024];
    let mut tail = Tail::default();
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        tail.push(&buf[..n]);
        if tx.send(buf[..n].to_vec()).is_err() {
            break;
        }
    }
    drop(tx);
    let got = unpacker.await??;
    // tar readers stop quietly at EOF between entries: only the end-of-archive
    // blocks the agent writes last say the stream is whole.
    if !tail.is_end_of_archive() {
        bail!("the copy of {path} was cut short (no end-of-archive in the tar stream)");
    }
    progress(&format!(
        "{path}: {} files, {} directories, {} symlinks ({} bytes) from pod {} (node {}) -> {}",
        got.files,
        got.dirs,
        got.symlinks,
        got.bytes,
        agent.target,
        agent.node,
        local.display()
    ));
    Ok(())
}

/// Copies `r` to stdout (a CLI's stdout: blocking writes are fine); the byte count.
async fn to_stdout<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<u64> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0;
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        out.write_all(&buf[..n])?;
        total += n as u64;
    }
    out.flush()?;
    Ok(total)
}

/// The last 1024 bytes of a stream.
#[derive(Default)]
pub struct Tail(Vec<u8>);

impl Tail {
    pub fn push(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
        let extra = self.0.len().saturating_sub(1024);
        self.0.drain(..extra);
    }

    /// Two zero blocks: the end of a tar archive.
    pub fn is_end_of_archive(&self) -> bool {
        self.0.len() == 1024 && self.0.iter().all(|b| *b == 0)
    }
}

/// A blocking reader over chunks sent from the async side.
struct ChunkReader {
    rx: std::sync::mpsc::Receiver<Vec<u8>>,
    cur: std::io::Cursor<Vec<u8>>,
}

impl ChunkReader {
    fn new(rx: std::sync::mpsc::Receiver<Vec<u8>>) -> Self {
        ChunkReader {
            rx,
            cur: std::io::Cursor::new(Vec::new()),
        }
    }
}

impl Read for ChunkReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            let n = Read::read(&mut self.cur, buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            match self.rx.recv() {
                Ok(chunk) => self.cur = std::io::Cursor::new(chunk),
                Err(_) => return Ok(0),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(percent_encode("/etc/os-release"), "/etc/os-release");
        assert_eq!(percent_encode("/a b/&x=%"), "/a%20b/%26x%3D%25");
        assert_eq!(percent_encode("containerd://ab"), "containerd%3A//ab");
    }

    #[test]
    fn the_agent_line_says_file_or_directory() {
        assert_eq!(
            serde_json::from_str::<Meta>(r#"{"kind":"file","mode":420,"size":11}"#).unwrap(),
            Meta::File {
                size: 11,
                mode: 420
            }
        );
        assert_eq!(
            serde_json::from_str::<Meta>(r#"{"kind":"dir","mode":493}"#).unwrap(),
            Meta::Dir { mode: 493 }
        );
        assert!(serde_json::from_str::<Meta>(r#"{"error":"nope"}"#).is_err());
    }

    #[test]
    fn tar_entries_land_below_the_destination_only() {
        let d = Path::new("/tmp/out");
        assert_eq!(entry_target(d, Path::new("data/")).unwrap(), None);
        assert_eq!(
            entry_target(d, Path::new("data/sub/b.bin")).unwrap(),
            Some(PathBuf::from("/tmp/out/sub/b.bin"))
        );
        assert!(entry_target(d, Path::new("data/../../etc/passwd")).is_err());
        assert!(entry_target(d, Path::new("/etc/passwd")).is_err());
        assert!(entry_target(d, Path::new("../x")).is_err());
    }

    fn tar_of(entries: &[(&str, tar::EntryType, &[u8], Option<&str>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, ty, body, link) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*ty);
            h.set_size(body.len() as u64);
            h.set_mode(0o644);
            match link {
                Some(l) => b.append_link(&mut h, path, l).unwrap(),
                None => b.append_data(&mut h, path, *body).unwrap(),
            }
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn a_directory_is_unpacked_into_the_destination_and_never_through_a_symlink() {
        use tar::EntryType as T;
        let base = std::env::temp_dir().join(format!("pm-cp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dest = base.join("out");
        let good = tar_of(&[
            ("data/", T::Directory, b"", None),
            ("data/a.txt", T::Regular, b"alpha", None),
            ("data/sub/", T::Directory, b"", None),
            ("data/sub/b.bin", T::Regular, &[0, 1, 2, 255], None),
            ("data/link", T::Symlink, b"", Some("../../secret")),
        ]);
        let got = unpack(good.as_slice(), &dest).unwrap();
        assert_eq!(
            got,
            Unpacked {
                files: 2,
                dirs: 1,
                symlinks: 1,
                bytes: 9
            }
        );
        assert_eq!(std::fs::read(dest.join("a.txt")).unwrap(), b"alpha");
        assert_eq!(
            std::fs::read(dest.join("sub/b.bin")).unwrap(),
            [0, 1, 2, 255]
        );
        assert_eq!(
            std::fs::read_link(dest.join("link")).unwrap(),
            Path::new("../../secret")
        );
        // A hostile stream: a symlink to outside, then a file through it.
        let outside = base.join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        let evil = tar_of(&[
            ("d/", T::Directory, b"", None),
            ("d/esc", T::Symlink, b"", Some(outside.to_str().unwrap())),
            ("d/esc/pwned", T::Regular, b"x", None),
        ]);
        let dest2 = base.join("out2");
        assert!(unpack(evil.as_slice(), &dest2).is_err());
        assert!(!outside.join("pwned").exists(), "written through a symlink");
        std::fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn only_a_tar_that_ends_with_its_end_blocks_is_whole() {
        use tar::EntryType as T;
        let whole = tar_of(&[("d/a", T::Regular, &[0; 600], None)]);
        let mut t = Tail::default();
        for c in whole.chunks(100) {
            t.push(c);
        }
        assert!(t.is_end_of_archive());
        let cut = &whole[..1024];
        let mut t = Tail::default();
        t.push(cut);
        assert!(
            !t.is_end_of_archive(),
            "a header and a zero-padded block are not the end"
        );
        let mut t = Tail::default();
        t.push(&[0; 512]);
        assert!(!t.is_end_of_archive());
    }

    #[test]
    fn a_file_goes_into_an_existing_directory_under_its_own_name() {
        let dir = std::env::temp_dir();
        assert_eq!(file_target(&dir, "/etc/os-release"), dir.join("os-release"));
        assert_eq!(
            file_target(Path::new("/nonexistent/x.txt"), "/etc/os-release"),
            PathBuf::from("/nonexistent/x.txt")
        );
    }
}
