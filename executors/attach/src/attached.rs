//! What one attachment holds once it is in place (the target's containers, its
//! exports, ports and nftables ruleset), as the control API (`api`) serves it. Kept
//! apart from `agent`, which builds it, so the API depends on the state and not on
//! the code that attaches.

use crate::cri;
use crate::environ::EnvEntry;
use crate::exports::{Export, Mount};
use crate::files::{FileError, Opened};
use crate::metrics::PortGauges;
use crate::nft::Ruleset;
use crate::pinned::Pinned;
use crate::port::{ModeError, Port};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone, serde::Serialize)]
pub struct Container {
    pub id: String,
    pub pid: u32,
    pub env: Vec<EnvEntry>,
    /// The container's process, pinned when the agent attached: every later access
    /// goes through it, never through `pid` (which another process may hold by then).
    #[serde(skip)]
    pub pin: Arc<Pinned>,
}

/// Everything the control API serves.
pub struct Attached {
    pub containers: Vec<Container>,
    pub exports_dir: PathBuf,
    pub exports: Vec<Export>,
    pub mounts: Vec<Mount>,
    pub ports: Vec<Arc<Port>>,
    pub ruleset: Ruleset,
    pub cri_socket: Option<PathBuf>,
    pub token: Option<String>,
}

impl Attached {
    pub fn health(&self) -> serde_json::Value {
        serde_json::json!({
            "status": "ok",
            "pid": self.containers[0].pid,
            "containers": self.containers.iter().map(|c| serde_json::json!({"id": c.id, "pid": c.pid, "running": c.pin.alive()})).collect::<Vec<_>>(),
            "cri_socket": self.cri_socket,
            "table": self.ruleset.table,
            "agent_gid": self.ruleset.agent_gid,
            "ports": self.ports.iter().map(|p| serde_json::json!({
                "port": p.app_port,
                "agent_port": p.agent_port,
                "intercepted": p.intercepted(),
                "filter": p.filter().map(|f| f.headers.clone()),
                "wiretaps": p.wiretaps(),
                "tap_drops": p.tap_drops.load(std::sync::atomic::Ordering::Relaxed),
            })).collect::<Vec<_>>(),
        })
    }

    /// The intercept and wiretap gauges of the metrics: intercepted ports by kind,
    /// and wiretaps over all ports.
    pub fn port_gauges(&self) -> PortGauges {
        let mut g = PortGauges::default();
        for p in &self.ports {
            if p.intercepted() {
                if p.filter().is_some() {
                    g.filtered += 1;
                } else {
                    g.whole += 1;
                }
            }
            g.wiretaps += p.wiretaps().len() as i64;
        }
        g
    }

    fn container(&self, id: Option<&str>) -> Option<&Container> {
        match id {
            None => self.containers.first(),
            Some(id) => self
                .containers
                .iter()
                .find(|c| c.id == id || cri::strip_runtime_prefix(&c.id) == id),
        }
    }

    pub fn env(&self, container: Option<&str>) -> Option<&[EnvEntry]> {
        self.container(container).map(|c| c.env.as_slice())
    }

    /// Opens `path` in the root of a target container (the first one, or the one with
    /// this id), strictly inside it ([`crate::files`]). The root is reached through the
    /// container's pinned process: a container that has exited is refused
    /// ([`FileError::Gone`]), whatever process has its PID now.
    pub fn open_file(&self, container: Option<&str>, path: &str) -> Result<Opened, FileError> {
        let c = self
            .container(container)
            .ok_or_else(|| FileError::NoContainer(container.unwrap_or_default().to_owned()))?;
        let gone = || FileError::Gone(c.id.clone());
        if !c.pin.alive() {
            return Err(gone());
        }
        let root = c.pin.root().map_err(|e| match e {
            nix::errno::Errno::ENOENT | nix::errno::Errno::ESRCH => gone(),
            e => FileError::Other {
                path: "/".into(),
                errno: e,
            },
        })?;
        crate::files::open_in(std::os::fd::AsFd::as_fd(&root), path)
    }

    pub fn exports(&self) -> serde_json::Value {
        serde_json::json!({ "dir": self.exports_dir, "exports": self.exports, "mounts": self.mounts })
    }

    pub fn port(&self, s: &str) -> Result<Arc<Port>, ModeError> {
        let n: u16 = s.parse().map_err(|_| ModeError::UnknownPort(0))?;
        self.ports
            .iter()
            .find(|p| p.app_port == n)
            .cloned()
            .ok_or(ModeError::UnknownPort(n))
    }
}
