//! The PodMotion operator's runtime: the thin controllers that feed the pure cores
//! observed state and apply what they return (`controllers`), the adapters to the node
//! agents (`agents`) and the PKI's API side (`pki::shell`), and what every controller
//! shares (`client`, `context`, `cache`, `events`, `leader`, `metrics`,
//! `release`, `server`), and [`writer`], the one door every API write goes through.
//!
//! The pure cores (`runner_pool`, `attachment`, `migration`, the PKI's `plan` and
//! `issue`, `meta`, `note`) live in the `podmotion-core` crate, whose dependencies
//! leave out the API client, the async runtime, the wire protocol and the clock; they
//! are re-exported here under their old paths. Everything that talks to the API server
//! lives in this crate and is proven against the real control plane in `e2e/`.
#![forbid(unsafe_code)]

pub mod agents;
pub mod cache;
pub mod client;
pub mod config;
pub mod context;
pub mod controllers;
pub mod events;
pub mod graceful;
pub mod leader;
pub mod metrics;
pub mod pki;
pub mod release;
pub mod server;
pub mod webhook;
pub mod writer;

pub use podmotion_core::{
    attachment, claim, eviction, meta, migration, note, platform, runner_pool,
};
