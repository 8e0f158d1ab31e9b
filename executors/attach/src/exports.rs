//! Filesystem exports: a directory of symlinks into `/proc/<pid>/root/...`.
//!
//! A path under `/proc/<pid>/root` is resolved by the kernel in the target's mount
//! namespace and root, so a symlink to it gives the file servers (and anything else
//! running in the agent's own mount namespace) the container's view of that path,
//! without entering the namespace or copying. The reported mounts are the target's
//! own, read from its mountinfo.

use serde::Serialize;
use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Export {
    /// Path inside the container.
    pub container_path: String,
    /// Symlink in the exports directory.
    pub link: PathBuf,
    /// What the symlink points to.
    pub target: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mount {
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("export path {0:?} must be absolute and must not contain '..'")]
    BadPath(String),
    #[error("creating export {link}: {source}")]
    Io {
        link: PathBuf,
        source: std::io::Error,
    },
}

/// Normal components of an absolute container path; rejects `..` so a link name can
/// never escape the exports directory.
fn components(path: &str) -> Result<Vec<&str>, ExportError> {
    let p = Path::new(path);
    if !p.is_absolute() {
        return Err(ExportError::BadPath(path.to_owned()));
    }
    let mut out = Vec::new();
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(s) => out.push(
                s.to_str()
                    .ok_or_else(|| ExportError::BadPath(path.to_owned()))?,
            ),
            _ => return Err(ExportError::BadPath(path.to_owned())),
        }
    }
    Ok(out)
}

/// Creates (or re-points) `<dir>/<container path>` → `<proc_root>/<pid>/root/<container path>`
/// for each path. `/` exports the whole root as `<dir>/root`.
pub fn populate(
    dir: &Path,
    proc_root: &Path,
    pid: u32,
    paths: &[String],
) -> Result<Vec<Export>, ExportError> {
    let mut out = Vec::new();
    for path in paths {
        let comps = components(path)?;
        let mut target = proc_root.join(pid.to_string()).join("root");
        let mut link = dir.to_owned();
        if comps.is_empty() {
            link.push("root");
        }
        for c in &comps {
            target.push(c);
            link.push(c);
        }
        let io = |source| ExportError::Io {
            link: link.clone(),
            source,
        };
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent).map_err(io)?;
        }
        match std::fs::symlink_metadata(&link) {
            Ok(m) if m.file_type().is_symlink() => std::fs::remove_file(&link).map_err(io)?,
            Ok(_) => {
                return Err(io(std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "exists and is not a symlink",
                )));
            }
            Err(_) => {}
        }
        std::os::unix::fs::symlink(&target, &link).map_err(io)?;
        out.push(Export {
            container_path: path.clone(),
            link,
            target,
        });
    }
    Ok(out)
}

/// Kernel-provided and runtime-internal filesystems that are not useful to a client.
const PSEUDO_FS: &[&str] = &[
    "proc",
    "sysfs",
    "cgroup",
    "cgroup2",
    "devpts",
    "mqueue",
    "securityfs",
    "debugfs",
    "tracefs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "binfmt_misc",
];

/// Parses mountinfo (man 5 proc): mount point is field 5, then optional fields up to
/// `-`, then fs type and source. Octal escapes (`\040`) are decoded.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.len() < 5 || fields.len() < sep + 3 {
            continue;
        }
        let fs_type = fields[sep + 1];
        if PSEUDO_FS.contains(&fs_type) {
            continue;
        }
        out.push(Mount {
            mount_point: unescape(fields[4]),
            fs_type: fs_type.to_owned(),
            source: unescape(fields[sep + 2]),
        });
    }
    out
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn read_mounts(proc_root: &Path, pid: u32) -> std::io::Result<Vec<Mount>> {
    let text = std::fs::read_to_string(proc_root.join(pid.to_string()).join("mountinfo"))?;
    Ok(parse_mountinfo(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_paths_with_dotdot_are_rejected() {
        assert!(components("/srv/../etc").is_err());
        assert!(components("srv").is_err());
        assert_eq!(components("/srv/./www/").unwrap(), vec!["srv", "www"]);
    }

    #[test]
    fn links_point_into_the_targets_proc_root() {
        let dir = std::env::temp_dir().join(format!("pm-exports-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let got = populate(
            &dir,
            Path::new("/proc"),
            42,
            &["/srv/www".into(), "/".into()],
        )
        .unwrap();
        assert_eq!(
            std::fs::read_link(dir.join("srv/www")).unwrap(),
            Path::new("/proc/42/root/srv/www")
        );
        assert_eq!(
            std::fs::read_link(dir.join("root")).unwrap(),
            Path::new("/proc/42/root")
        );
        // Re-populating re-points instead of failing: restarts converge.
        populate(&dir, Path::new("/proc"), 43, &["/srv/www".into()]).unwrap();
        assert_eq!(
            std::fs::read_link(dir.join("srv/www")).unwrap(),
            Path::new("/proc/43/root/srv/www")
        );
        assert_eq!(got.len(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn mountinfo_skips_pseudo_filesystems_and_decodes_escapes() {
        let text = "22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=x\n\
                    23 22 0:22 / /proc rw - proc proc rw\n\
                    24 22 8:1 /vol /data\\040dir rw - ext4 /dev/vda rw\n\
                    25 22 8:1 /x /etc/hosts rw shared:1 - ext4 /dev/vda rw\n";
        let got = parse_mountinfo(text);
        let points: Vec<_> = got.iter().map(|m| m.mount_point.as_str()).collect();
        assert_eq!(points, vec!["/", "/data dir", "/etc/hosts"]);
        assert_eq!(got[2].fs_type, "ext4");
    }
}
