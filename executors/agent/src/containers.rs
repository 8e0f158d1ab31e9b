//! Container ID → host PID, for `Prepare`.
//!
//! The operator names the containers of a pod by the IDs the kubelet reports
//! (`containerd://…`); it never sees host PIDs. On a node the agent asks the container
//! runtime over its CRI socket (the same client the attach executor uses). Local runs,
//! where kwok simulates the nodes and real processes stand for containers, use a
//! container table instead: a file of `<container-id> <pid> [<rootfs>]` lines kept by
//! whoever starts those processes — the runtime's role, played by the test harness. A
//! row with a root filesystem stands for a container with a mount namespace of its own
//! rooted there (the agent's testbed: see `testbed::Testbed::start_container`).
//!
//! A container reported by the kubelet may not be known to the runtime (or written to
//! the table) for a moment; resolution retries for a bounded time before giving up.
//!
//! The container's bare ID (runtime prefix stripped) goes with the PID: the broker pins
//! the PID only if its cgroup is that container's. An ID that is not a plausible
//! runtime ID (`ContainerId`: no `/`, no `..`) is refused before anything is asked.

use std::path::PathBuf;
use std::time::Duration;

use crate::mounts::{HostView, SpecMount, rootfs, spec_mounts};
use podmotion_cri as cri;
use podmotion_wire::ids::ContainerId;
use tonic::Status;

/// Where container IDs are resolved.
#[derive(Clone, Debug)]
pub enum Containers {
    /// The node's run directory (or the socket's directory) holding a CRI socket at
    /// one of the well-known paths (containerd, CRI-O, cri-dockerd); `host` is where
    /// the node's root filesystem is seen (paths of the runtime spec are node paths).
    Cri { run_dir: PathBuf, host: HostView },
    /// Local runs: a file of `<container-id> <pid> [<rootfs>]` lines.
    Table { path: PathBuf },
}

/// How long a container that is not (yet) known is waited for.
const SETTLE: Duration = Duration::from_secs(10);

impl Containers {
    /// Where the node's files are seen from the agent.
    pub fn host(&self) -> HostView {
        match self {
            Containers::Cri { host, .. } => host.clone(),
            Containers::Table { .. } => HostView {
                host_root: "/".into(),
            },
        }
    }
}

/// A resolved container: its bare ID (the runtime's, without the kubelet's prefix), its
/// host PID and, for a real container, what its mount namespace is made of.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub container: ContainerId,
    pub pid: i32,
    pub fs: Option<ContainerFs>,
}

/// A real container's runtime bind mounts and root filesystem (agent paths), and the
/// process its runtime started.
#[derive(Clone, Debug)]
pub struct ContainerFs {
    pub spec: Vec<SpecMount>,
    pub rootfs: PathBuf,
    pub workload: Option<podmotion_wire::agent::Workload>,
}

impl Containers {
    /// The first of `ids` (the pod's first container: the tree CRIU dumps on the
    /// source, the holder on the target): its bare ID, its host PID and, through CRI,
    /// its mounts. An ID that is not a valid [`ContainerId`] once its runtime prefix is
    /// stripped is an invalid argument, refused at once.
    pub async fn resolve(&self, ids: &[String]) -> Result<Resolved, Status> {
        let Some(id) = ids.first() else {
            return Err(Status::invalid_argument(
                "neither a pid nor a container ID was given",
            ));
        };
        let requested = ContainerId::parse(cri::strip_runtime_prefix(id))
            .map_err(|e| Status::invalid_argument(format!("container {id:?}: {e}")))?;
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let res = match self {
                Containers::Cri { run_dir, host } => match cri::discover(run_dir, id).await {
                    Ok(c) => c
                        .running_container(id)
                        .await
                        .map(|r| {
                            let fs = r.runtime_spec.as_ref().map(|spec| ContainerFs {
                                spec: spec_mounts(spec),
                                rootfs: rootfs(spec, &r.id, c.socket(), host),
                                workload: crate::holder::workload_from_spec(spec),
                            });
                            (r.id, r.pid, fs)
                        })
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Containers::Table { path } => lookup(path, id).map(|(pid, rootfs)| {
                    let fs = rootfs.map(|rootfs| ContainerFs {
                        spec: Vec::new(),
                        rootfs,
                        workload: None,
                    });
                    (requested.to_string(), pid, fs)
                }),
            };
            match res {
                Ok((bare, pid, fs)) => {
                    let pid = i32::try_from(pid)
                        .map_err(|_| Status::internal(format!("container {id}: pid {pid}")))?;
                    // The runtime's own ID of what it found (CRI): what its cgroup is
                    // named by.
                    let container = ContainerId::parse(&bare).map_err(|e| {
                        Status::internal(format!("container {id}: the runtime's ID {bare:?}: {e}"))
                    })?;
                    return Ok(Resolved { container, pid, fs });
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(Status::not_found(format!("container {id}: {e}")));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// `id`'s PID in the table at `path` (the last line naming it wins), and its root
/// filesystem if the line names one.
fn lookup(path: &std::path::Path, id: &str) -> Result<(u32, Option<PathBuf>), String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("container table {}: {e}", path.display()))?;
    let (_, pid, rootfs) = text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((f.next()?, f.next()?, f.next()))
        })
        .rfind(|(c, _, _)| {
            *c == id || cri::strip_runtime_prefix(c) == cri::strip_runtime_prefix(id)
        })
        .ok_or_else(|| format!("not in the container table {}", path.display()))?;
    let pid = pid
        .parse::<u32>()
        .map_err(|e| format!("container table {}: {e}", path.display()))?;
    Ok((pid, rootfs.map(PathBuf::from)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_maps_ids_with_or_without_the_runtime_prefix_and_the_last_line_wins() {
        let dir = std::env::temp_dir().join(format!("pm-ctable-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table");
        std::fs::write(
            &path,
            "kwok://u1-app 100\n\nkwok://u2-app 200 /run/rootfs\nkwok://u1-app 101\n",
        )
        .unwrap();
        assert_eq!(lookup(&path, "kwok://u1-app"), Ok((101, None)));
        assert_eq!(
            lookup(&path, "u2-app"),
            Ok((200, Some(PathBuf::from("/run/rootfs"))))
        );
        assert!(lookup(&path, "kwok://u3-app").is_err());
        assert!(lookup(&dir.join("missing"), "kwok://u1-app").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn no_container_id_is_an_invalid_argument_not_a_wait() {
        let c = Containers::Table {
            path: "/nonexistent".into(),
        };
        let e = c.resolve(&[]).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }

    #[tokio::test]
    async fn a_resolved_container_carries_its_id_without_the_runtime_prefix() {
        let dir = std::env::temp_dir().join(format!("pm-ctable-id-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table");
        std::fs::write(&path, "kwok://u1-app 100\nkwok://u2-app 200 /run/r2\n").unwrap();
        let c = Containers::Table { path };
        let r = c.resolve(&["kwok://u1-app".into()]).await.unwrap();
        assert_eq!((r.container.as_str(), r.pid), ("u1-app", 100));
        assert!(r.fs.is_none(), "a row without a root filesystem");
        let r = c.resolve(&["u1-app".into()]).await.unwrap();
        assert_eq!(r.container.as_str(), "u1-app");
        // A row with one: a container with a mount namespace of its own rooted there.
        let fs = c.resolve(&["u2-app".into()]).await.unwrap().fs.unwrap();
        assert_eq!(fs.rootfs, PathBuf::from("/run/r2"));
        assert!(fs.spec.is_empty() && fs.workload.is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An ID that could not name a container's cgroup is refused at once (no settle
    /// wait), even one the table would map to a pid.
    #[tokio::test]
    async fn a_malformed_container_id_is_an_invalid_argument_not_a_wait() {
        let dir = std::env::temp_dir().join(format!("pm-ctable-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("table");
        std::fs::write(&path, "kwok://u1/app 100\nkwok://.. 101\n").unwrap();
        let c = Containers::Table { path };
        for bad in [
            "kwok://u1/app",
            "kwok://..",
            "containerd://../x",
            "a/b",
            "",
            "kwok://",
        ] {
            let t = std::time::Instant::now();
            let e = c.resolve(&[bad.into()]).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}: {e}");
            assert!(t.elapsed() < SETTLE / 2, "{bad:?} waited");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
