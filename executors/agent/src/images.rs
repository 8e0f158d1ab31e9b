//! Checkpoint images on tmpfs: `<root>/<uid>/` (0700), zeroized — every file
//! overwritten with zeros, synced, then removed — on every exit path, and swept at
//! agent start (a crashed agent's images never outlive it).

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

const TMPFS_MAGIC: i64 = 0x0102_1994;

/// Refuses a root that is not on tmpfs: images hold the whole memory of the workload.
pub fn check_root(root: &Path) -> std::io::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)?;
    let st = nix::sys::statfs::statfs(root).map_err(std::io::Error::from)?;
    if st.filesystem_type().0 as i64 != TMPFS_MAGIC {
        return Err(std::io::Error::other(format!(
            "{} is not on tmpfs",
            root.display()
        )));
    }
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700))
}

pub fn create(root: &Path, uid: &str) -> std::io::Result<PathBuf> {
    let d = root.join(uid);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&d)?;
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700))?;
    Ok(d)
}

/// Overwrites every regular file under `dir` with zeros, then removes the tree.
pub fn zeroize(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        return Ok(());
    }
    zero_files(dir)?;
    std::fs::remove_dir_all(dir)
}

fn zero_files(dir: &Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            zero_files(&e.path())?;
        } else if ft.is_file() {
            zeroize_file(&e.path())?;
        }
    }
    Ok(())
}

/// Overwrites one regular file with zeros (it stays, its length kept); never follows
/// a link.
pub fn zeroize_file(p: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(p)?;
    let len = f.metadata()?.len();
    let zeros = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        f.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// Zeroizes everything under the root (agent start).
pub fn sweep(root: &Path) -> std::io::Result<usize> {
    let mut n = 0;
    for e in std::fs::read_dir(root)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            zeroize(&e.path())?;
        } else {
            let _ = std::fs::remove_file(e.path());
        }
        n += 1;
    }
    Ok(n)
}

/// Total bytes of regular files under `dir`.
pub fn size(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => size(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroize_overwrites_before_removing() {
        let d = std::env::temp_dir().join(format!("pm-zero-{}", std::process::id()));
        std::fs::create_dir_all(d.join("final")).unwrap();
        std::fs::write(d.join("final/pages-1.img"), b"secret").unwrap();
        // Keep a second link to the inode to observe its content after removal.
        let keep = d.with_extension("keep");
        std::fs::hard_link(d.join("final/pages-1.img"), &keep).unwrap();
        zeroize(&d).unwrap();
        assert!(!d.exists());
        assert_eq!(std::fs::read(&keep).unwrap(), vec![0u8; 6]);
        std::fs::remove_file(keep).unwrap();
    }
}
