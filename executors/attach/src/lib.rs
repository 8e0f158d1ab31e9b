//! Node-agent executor: attaches to a running pod from outside, without mutating or
//! restarting it. See `docs/attach-executor.md`.
//!
//! No `unsafe` anywhere: the kernel calls this crate needs (setns, netlink sockets,
//! SO_ORIGINAL_DST) go through nix's safe wrappers.
#![forbid(unsafe_code)]

pub mod agent;
pub mod api;
pub mod attached;
/// CRI client, shared with the migration agent (crate `podmotion-cri`).
pub use podmotion_cri as cri;
pub mod environ;
pub mod exports;
pub mod files;
pub mod filtered;
pub mod forward;
pub mod http;
pub mod jobenv;
pub mod metrics;
pub mod netns;
pub mod nft;
pub mod pinned;
pub mod port;
