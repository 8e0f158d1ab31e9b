//! What CRIU must be told to move a container's mount namespace from one pod to another.
//!
//! A container's mounts are of two kinds. Those the runtime makes from nothing (its
//! overlay root, `/proc`, `/dev` tmpfs, `/sys`, devpts, mqueue, the masks over `/proc`)
//! CRIU dumps and recreates. Those that come from the node — the runtime's bind mounts
//! (`/etc/hosts`, `/etc/resolv.conf`, `/etc/hostname`, `/dev/shm`, the service-account
//! token, `/dev/termination-log`, volumes) and the container's view of its cgroups —
//! belong to the pod, not to the process: they are dumped as *external* mounts keyed by
//! their mount point, and on restore each key is bound to the same mount of the target
//! pod's holder container, so the restored process sees the target pod's files and its
//! own (new) cgroup. The root is the holder's root filesystem (same image).
//!
//! Everything here is pure: runtime specs and mountinfo text in, CRIU arguments out.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One mount of an OCI runtime spec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecMount {
    pub destination: String,
    pub kind: String,
    pub source: String,
    pub bind: bool,
}

/// The mounts of an OCI runtime spec (`mounts[]`).
pub fn spec_mounts(spec: &serde_json::Value) -> Vec<SpecMount> {
    let s =
        |v: &serde_json::Value, k: &str| v.get(k).and_then(|x| x.as_str()).unwrap_or("").to_owned();
    spec.get("mounts")
        .and_then(|m| m.as_array())
        .into_iter()
        .flatten()
        .map(|m| {
            let kind = s(m, "type");
            let bind = kind == "bind"
                || m.get("options")
                    .and_then(|o| o.as_array())
                    .is_some_and(|o| o.iter().any(|x| x == "bind" || x == "rbind"));
            SpecMount {
                destination: s(m, "destination"),
                kind,
                source: s(m, "source"),
                bind,
            }
        })
        .collect()
}

/// One line of `/proc/<pid>/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Path of the mount inside the filesystem it comes from.
    pub root: String,
    pub mount_point: String,
    pub fstype: String,
}

/// Parses `/proc/<pid>/mountinfo` ([`podmotion_cri::mountinfo`]).
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    podmotion_cri::mountinfo::parse(text)
        .into_iter()
        .map(|m| MountInfo {
            root: m.root,
            mount_point: m.mount_point,
            fstype: m.fs_type,
        })
        .collect()
}

fn is_cgroup(fstype: &str) -> bool {
    fstype == "cgroup" || fstype == "cgroup2"
}

/// The mount points a container's dump declares external: the runtime's bind mounts
/// and every cgroup mount the process sees, in mount order (parents first). Each is
/// also a key of the restore.
pub fn dump_externals(spec: &[SpecMount], mountinfo: &[MountInfo]) -> Vec<String> {
    let mut keys: Vec<String> = Vec::new();
    for m in mountinfo {
        let from_spec = spec
            .iter()
            .any(|s| s.bind && s.destination == m.mount_point);
        if (from_spec || is_cgroup(&m.fstype)) && !keys.contains(&m.mount_point) {
            keys.push(m.mount_point.clone());
        }
    }
    keys
}

/// CRIU `--external` arguments of a dump.
pub fn dump_external_args(keys: &[String]) -> Vec<String> {
    keys.iter().map(|k| format!("mnt[{k}]:{k}")).collect()
}

/// Where the node's files are, seen from the agent: node path `p` is `<host_root>/p`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostView {
    pub host_root: PathBuf,
}

impl HostView {
    pub fn path(&self, node_path: &str) -> PathBuf {
        self.host_root.join(node_path.trim_start_matches('/'))
    }
}

/// What the restore needs of the target pod's holder container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub spec: Vec<SpecMount>,
    pub mountinfo: Vec<MountInfo>,
    /// The holder's root filesystem as the agent sees it.
    pub rootfs: PathBuf,
}

/// CRIU `--external mnt[KEY]:PATH` arguments of a restore: each dumped key bound to the
/// holder's mount at the same point. A key the holder lacks is an error (the two pods'
/// specs differ), reported before anything is restored.
pub fn restore_external_args(
    keys: &[String],
    holder: &Holder,
    host: &HostView,
) -> Result<Vec<String>, String> {
    keys.iter()
        .map(|k| {
            if let Some(s) = holder.spec.iter().find(|s| s.bind && s.destination == *k) {
                return Ok(format!("mnt[{k}]:{}", host.path(&s.source).display()));
            }
            // A cgroup mount shows the holder's own cgroup (its root in the
            // hierarchy: `/kubepods/<qos>/pod<uid>/<id>` with the cgroupfs driver,
            // `/kubepods.slice/…/cri-containerd-<id>.scope` with systemd's); the node
            // mounts every hierarchy at the same point.
            if let Some(m) = holder
                .mountinfo
                .iter()
                .rev()
                .find(|m| m.mount_point == *k && is_cgroup(&m.fstype))
            {
                // The kernel prints the root relative to the *reader's* cgroup
                // namespace: read from a private one (a cgroup v2 node, where the
                // runtime gives a container its own) it climbs (`/../…`) and names no
                // node path. Refused, never joined.
                if m.root.split('/').any(|c| c == "..") {
                    return Err(format!(
                        "the target pod's cgroup mount at {k} is seen from another cgroup namespace ({}): the agent must read it from the node's",
                        m.root
                    ));
                }
                let p = host.path(k).join(m.root.trim_start_matches('/'));
                return Ok(format!("mnt[{k}]:{}", p.display()));
            }
            Err(format!(
                "the target pod's container has no mount at {k} (the source container had one)"
            ))
        })
        .collect()
}

/// The root filesystem of container `id`, as the agent sees it: the spec's `root.path`
/// when absolute (CRI-O), else relative to containerd's task bundle next to its socket
/// (`<state>/io.containerd.runtime.v2.task/k8s.io/<id>/`).
pub fn rootfs(spec: &serde_json::Value, id: &str, cri_socket: &Path, host: &HostView) -> PathBuf {
    let root = spec
        .get("root")
        .and_then(|r| r.get("path"))
        .and_then(|p| p.as_str())
        .unwrap_or("rootfs");
    if root.starts_with('/') {
        return host.path(root);
    }
    cri_socket
        .parent()
        .unwrap_or(Path::new("/"))
        .join("io.containerd.runtime.v2.task/k8s.io")
        .join(id)
        .join(root)
}

/// The container's standard streams that are pipes (to the runtime's shim), by fd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StdioPipe {
    pub fd: i32,
    /// `pipe:[<inode>]`: CRIU's key for an inherited pipe.
    pub key: String,
}

/// The pipes among fds 0–2 of `pid` (read from /proc).
pub fn stdio_pipes(pid: i32) -> Vec<StdioPipe> {
    (0..3)
        .filter_map(|fd| {
            let l = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
            let key = l.to_string_lossy().into_owned();
            key.starts_with("pipe:[").then_some(StdioPipe { fd, key })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SOURCE_MOUNTINFO: &str = "\
246 177 0:69 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
248 246 0:82 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
249 246 0:83 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
252 246 0:77 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
253 252 0:85 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
254 253 0:29 /pm-real-0/kubepods/besteffort/podA/c1 /sys/fs/cgroup/cpu ro,nosuid master:6 - cgroup cgroup rw,cpu
262 253 0:37 /pm-real-0/kubepods/besteffort/podA/c1 /sys/fs/cgroup/systemd ro,nosuid master:14 - cgroup cgroup rw,name=systemd
263 246 254:0 /n/var/lib/kubelet/pods/A/etc-hosts /etc/hosts rw,relatime - ext4 /dev/vda rw
267 249 0:56 / /dev/shm rw,relatime - tmpfs shm rw,size=65536k
268 246 0:49 / /var/run/secrets/kubernetes.io/serviceaccount ro,relatime - tmpfs tmpfs rw
269 246 254:0 /n/data\\040dir /mnt/my\\040data rw,relatime - ext4 /dev/vda rw
194 248 0:83 /null /proc/interrupts rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
";

    fn spec(pod: &str) -> serde_json::Value {
        serde_json::json!({
            "root": {"path": "rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
                {"destination": "/etc/hosts", "type": "bind", "source": format!("/var/lib/kubelet/pods/{pod}/etc-hosts"), "options": ["rbind", "rw"]},
                {"destination": "/dev/shm", "type": "bind", "source": format!("/run/containerd/sandboxes/{pod}/shm"), "options": ["rbind"]},
                {"destination": "/var/run/secrets/kubernetes.io/serviceaccount", "type": "bind", "source": format!("/var/lib/kubelet/pods/{pod}/volumes/token"), "options": ["rbind", "ro"]},
                {"destination": "/mnt/my data", "source": format!("/var/lib/kubelet/pods/{pod}/data dir"), "options": ["rbind"]},
            ]
        })
    }

    #[test]
    fn a_containers_dump_declares_its_runtime_binds_and_cgroup_mounts_external() {
        let keys = dump_externals(&spec_mounts(&spec("A")), &parse_mountinfo(SOURCE_MOUNTINFO));
        assert_eq!(
            keys,
            [
                "/sys/fs/cgroup/cpu",
                "/sys/fs/cgroup/systemd",
                "/etc/hosts",
                "/dev/shm",
                "/var/run/secrets/kubernetes.io/serviceaccount",
                "/mnt/my data",
            ]
        );
        assert_eq!(
            dump_external_args(&keys[..1]),
            ["mnt[/sys/fs/cgroup/cpu]:/sys/fs/cgroup/cpu"]
        );
    }

    #[test]
    fn the_restore_binds_each_key_to_the_holders_mount_at_the_same_point() {
        let keys = dump_externals(&spec_mounts(&spec("A")), &parse_mountinfo(SOURCE_MOUNTINFO));
        let holder_mi = SOURCE_MOUNTINFO
            .replace("pm-real-0", "pm-real-1")
            .replace("podA/c1", "podB/h1");
        let holder = Holder {
            spec: spec_mounts(&spec("B")),
            mountinfo: parse_mountinfo(&holder_mi),
            rootfs: "/host/run/containerd/x/rootfs".into(),
        };
        let host = HostView {
            host_root: "/host".into(),
        };
        let args = restore_external_args(&keys, &holder, &host).unwrap();
        assert_eq!(
            args,
            [
                "mnt[/sys/fs/cgroup/cpu]:/host/sys/fs/cgroup/cpu/pm-real-1/kubepods/besteffort/podB/h1",
                "mnt[/sys/fs/cgroup/systemd]:/host/sys/fs/cgroup/systemd/pm-real-1/kubepods/besteffort/podB/h1",
                "mnt[/etc/hosts]:/host/var/lib/kubelet/pods/B/etc-hosts",
                "mnt[/dev/shm]:/host/run/containerd/sandboxes/B/shm",
                "mnt[/var/run/secrets/kubernetes.io/serviceaccount]:/host/var/lib/kubelet/pods/B/volumes/token",
                "mnt[/mnt/my data]:/host/var/lib/kubelet/pods/B/data dir",
            ]
        );
    }

    #[test]
    fn a_systemd_scopes_cgroup_mounts_bind_the_holders_scope_v1_and_unified() {
        let scope = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6fecc63a_68d4.slice/cri-containerd-3d359f10a9c1.scope";
        let host = HostView {
            host_root: "/host".into(),
        };
        // A hybrid node: one bind per v1 hierarchy, each of the scope.
        let hybrid = SOURCE_MOUNTINFO.replace("/pm-real-0/kubepods/besteffort/podA/c1", scope);
        let keys = dump_externals(&spec_mounts(&spec("A")), &parse_mountinfo(&hybrid));
        let holder = Holder {
            spec: spec_mounts(&spec("B")),
            mountinfo: parse_mountinfo(&hybrid),
            rootfs: "/r".into(),
        };
        let args = restore_external_args(&keys[..2], &holder, &host).unwrap();
        assert_eq!(
            args,
            [
                format!("mnt[/sys/fs/cgroup/cpu]:/host/sys/fs/cgroup/cpu{scope}"),
                format!("mnt[/sys/fs/cgroup/systemd]:/host/sys/fs/cgroup/systemd{scope}"),
            ]
        );
        // A unified node: the container's cgroup2 mount, read from the node's cgroup
        // namespace, has the scope as its root.
        let unified = format!(
            "246 177 0:69 / / rw - overlay overlay rw\n253 252 0:26 {scope} /sys/fs/cgroup ro,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
        );
        let keys = dump_externals(&[], &parse_mountinfo(&unified));
        assert_eq!(keys, ["/sys/fs/cgroup"]);
        let holder = Holder {
            spec: vec![],
            mountinfo: parse_mountinfo(&unified),
            rootfs: "/r".into(),
        };
        assert_eq!(
            restore_external_args(&keys, &holder, &host).unwrap(),
            [format!("mnt[/sys/fs/cgroup]:/host/sys/fs/cgroup{scope}")]
        );
        // The same mount read from inside another (private) cgroup namespace climbs:
        // refused with what went wrong, never bound to a wrong directory.
        let climbing = unified.replace(
            scope,
            "/../../kubepods-burstable-pod6fecc63a_68d4.slice/cri-containerd-3d359f10a9c1.scope",
        );
        let holder = Holder {
            spec: vec![],
            mountinfo: parse_mountinfo(&climbing),
            rootfs: "/r".into(),
        };
        let e = restore_external_args(&keys, &holder, &host).unwrap_err();
        assert!(e.contains("another cgroup namespace"), "{e}");
    }

    #[test]
    fn a_mount_the_holder_lacks_is_refused_before_restoring() {
        let holder = Holder {
            spec: vec![],
            mountinfo: vec![],
            rootfs: "/r".into(),
        };
        let host = HostView {
            host_root: "/".into(),
        };
        let e = restore_external_args(&["/etc/hosts".into()], &holder, &host).unwrap_err();
        assert!(e.contains("/etc/hosts"), "{e}");
    }

    #[test]
    fn the_root_is_containerds_bundle_rootfs_or_an_absolute_spec_root_under_the_host_view() {
        let host = HostView {
            host_root: "/host".into(),
        };
        let sock = Path::new("/host/run/containerd/containerd.sock");
        assert_eq!(
            rootfs(&spec("B"), "abc", sock, &host),
            Path::new("/host/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc/rootfs")
        );
        let crio =
            serde_json::json!({"root": {"path": "/var/lib/containers/storage/overlay/x/merged"}});
        assert_eq!(
            rootfs(&crio, "abc", sock, &host),
            Path::new("/host/var/lib/containers/storage/overlay/x/merged")
        );
    }

    #[test]
    fn a_childs_stdout_pipe_is_found_and_its_dev_null_stdin_is_not() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let pipes = stdio_pipes(child.id() as i32);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(pipes.len(), 1, "{pipes:?}");
        assert_eq!(pipes[0].fd, 1);
        assert!(pipes[0].key.starts_with("pipe:["), "{pipes:?}");
    }
}
