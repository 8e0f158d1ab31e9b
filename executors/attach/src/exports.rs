//! Filesystem exports: a directory of symlinks into the target's root.
//!
//! A path under `/proc/<pid>/root` is resolved by the kernel in the target's mount
//! namespace and root, so a symlink to it gives the file servers (and anything else
//! running in the agent's own mount namespace) the container's view of that path,
//! without entering the namespace or copying. The links go through the agent's pin of
//! the target process (`<proc>/<agent pid>/fd/<n>/root/…`, [`crate::pinned`]), never
//! through the target's PID: once the target has exited they resolve to nothing, even
//! when its PID went to another process. The reported mounts are the target's own,
//! read from its mountinfo.

use crate::pinned::Pinned;
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
    #[error(
        "export path {0:?} must be absolute and must not contain '..' (the exports dir at least two levels deep)"
    )]
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

/// Replaces the exports directory with one symlink per exported path:
/// `<dir>/<container path>` → `<root>/<container path>` (`root` is the target's root
/// through its pin, [`Pinned::path`]`/root`); `/` exports
/// the whole root as `<dir>/root` and makes every other path redundant.
///
/// The directory's contents are rebuilt from scratch (restarts converge, stale links
/// vanish; `DirEntry::file_type` and `remove_dir_all` never follow symlinks). A path below another
/// exported path is already reachable through its ancestor's link and is skipped:
/// creating its link would mean creating directories *through* the ancestor's
/// symlink, i.e. writing into the target container's filesystem.
pub fn populate(dir: &Path, root: &Path, paths: &[String]) -> Result<Vec<Export>, ExportError> {
    let kept = outermost(paths)?;
    empty_exports_dir(dir)?;
    kept.into_iter()
        .map(|(comps, path)| link_export(dir, root, &comps, path))
        .collect()
}

/// The exported paths as components, duplicates and paths below another exported path
/// left out (sorted, so an ancestor comes before what is below it).
fn outermost(paths: &[String]) -> Result<Vec<(Vec<&str>, &String)>, ExportError> {
    let mut wanted: Vec<(Vec<&str>, &String)> = paths
        .iter()
        .map(|p| components(p).map(|c| (c, p)))
        .collect::<Result<_, _>>()?;
    wanted.sort();
    wanted.dedup_by(|b, a| b.0 == a.0);
    let mut kept: Vec<(Vec<&str>, &String)> = Vec::new();
    for (comps, path) in wanted {
        if !kept.iter().any(|(k, _)| comps.starts_with(k)) {
            kept.push((comps, path));
        }
    }
    Ok(kept)
}

/// Creates the exports directory, or empties it of what an earlier run made.
fn empty_exports_dir(dir: &Path) -> Result<(), ExportError> {
    let dir_err = |source| ExportError::Io {
        link: dir.to_owned(),
        source,
    };
    // The directory is deleted and rebuilt: never let that be `/` or a top-level dir.
    let depth = dir
        .components()
        .filter(|c| matches!(c, Component::Normal(_)))
        .count();
    if !dir.is_absolute() || depth < 2 {
        return Err(ExportError::BadPath(dir.display().to_string()));
    }
    // Emptied, not removed: in the Job it is an emptyDir mount point (rmdir → EBUSY).
    std::fs::create_dir_all(dir).map_err(dir_err)?;
    for entry in std::fs::read_dir(dir).map_err(dir_err)? {
        let entry = entry.map_err(dir_err)?;
        let ty = entry.file_type().map_err(dir_err)?;
        let r = if ty.is_dir() {
            // A real directory we made earlier; links inside it are removed as links.
            std::fs::remove_dir_all(entry.path())
        } else {
            std::fs::remove_file(entry.path())
        };
        r.map_err(dir_err)?;
    }
    Ok(())
}

/// The link of one exported path (`comps`; none for `/`, linked as `root`), into the
/// target's `root`.
fn link_export(dir: &Path, root: &Path, comps: &[&str], path: &str) -> Result<Export, ExportError> {
    let mut target = root.to_owned();
    let mut link = dir.to_owned();
    if comps.is_empty() {
        link.push("root");
    }
    for c in comps {
        target.push(c);
        link.push(c);
    }
    let io = |source| ExportError::Io {
        link: link.clone(),
        source,
    };
    // Parents are plain directories we create in a fresh tree: no earlier link
    // is an ancestor (filtered above), so nothing here resolves into the target.
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent).map_err(io)?;
    }
    std::os::unix::fs::symlink(&target, &link).map_err(io)?;
    Ok(Export {
        container_path: path.to_owned(),
        link,
        target,
    })
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

/// The mounts in mountinfo text ([`podmotion_cri::mountinfo`]), pseudo filesystems
/// left out.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    podmotion_cri::mountinfo::parse(text)
        .into_iter()
        .filter(|m| !PSEUDO_FS.contains(&m.fs_type.as_str()))
        .map(|m| Mount {
            mount_point: m.mount_point,
            fs_type: m.fs_type,
            source: m.source,
        })
        .collect()
}

pub fn read_mounts(target: &Pinned) -> std::io::Result<Vec<Mount>> {
    let text = String::from_utf8_lossy(&target.read("mountinfo")?).into_owned();
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
        let got = populate(
            &dir,
            Path::new("/proc/42/root"),
            &["/srv/www".into(), "/etc".into()],
        )
        .unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(
            std::fs::read_link(dir.join("srv/www")).unwrap(),
            Path::new("/proc/42/root/srv/www")
        );
        assert_eq!(
            std::fs::read_link(dir.join("etc")).unwrap(),
            Path::new("/proc/42/root/etc")
        );
        // Re-populating replaces the whole directory: new target, stale links gone.
        populate(&dir, Path::new("/proc/43/root"), &["/srv/www".into()]).unwrap();
        assert_eq!(
            std::fs::read_link(dir.join("srv/www")).unwrap(),
            Path::new("/proc/43/root/srv/www")
        );
        assert!(std::fs::symlink_metadata(dir.join("etc")).is_err());
        // `/` covers everything.
        let got = populate(
            &dir,
            Path::new("/proc/44/root"),
            &["/srv/www".into(), "/".into()],
        )
        .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(
            std::fs::read_link(dir.join("root")).unwrap(),
            Path::new("/proc/44/root")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_shallow_exports_dir_is_refused() {
        let root = Path::new("/proc/1/root");
        assert!(populate(Path::new("/"), root, &["/".into()]).is_err());
        assert!(populate(Path::new("/tmp"), root, &["/".into()]).is_err());
        assert!(populate(Path::new("rel/dir"), root, &["/".into()]).is_err());
    }

    #[test]
    fn nested_exports_never_write_into_the_target_filesystem() {
        let base = std::env::temp_dir().join(format!("pm-exports-nested-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let fake_proc = base.join("proc");
        std::fs::create_dir_all(fake_proc.join("42/root/srv")).unwrap();
        let dir = base.join("exports");
        let got = populate(
            &dir,
            &fake_proc.join("42/root"),
            &["/srv/new/deeper".into(), "/srv".into()],
        )
        .unwrap();
        assert_eq!(got.len(), 1, "the nested path is reachable through /srv");
        assert_eq!(got[0].container_path, "/srv");
        assert!(
            !fake_proc.join("42/root/srv/new").exists(),
            "nothing created in the target"
        );
        assert!(dir.join("srv/new/deeper").symlink_metadata().is_err());
        std::fs::remove_dir_all(&base).unwrap();
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
