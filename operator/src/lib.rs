//! The PodMotion operator as a library: pure reconcile cores (`runner_pool`,
//! `attachment`, `migration`), the thin controllers that feed them observed state and
//! apply what they return (`controllers`), and the runtime every controller shares
//! (`client`, `context`, `cache`, `children`, `events`, `leader`, `metrics`, `release`,
//! `server`); `meta`
//! is the pure object metadata the cores and the runtime share.
//!
//! The pure cores take plain structs and return desired objects and status; they never
//! touch the network. Everything that talks to the API server lives in `controllers`
//! and the runtime modules, and is proven against the real control plane in `e2e/`.
#![forbid(unsafe_code)]

pub mod agents;
pub mod attachment;
pub mod cache;
pub mod children;
pub mod client;
pub mod config;
pub mod context;
pub mod controllers;
pub mod events;
pub mod eviction;
pub mod leader;
pub mod meta;
pub mod metrics;
pub mod migration;
pub mod note;
pub mod pki;
pub mod release;
pub mod runner_pool;
pub mod server;
pub mod webhook;
