//! The migration node agent: a gRPC service (mutual TLS) the operator drives step by
//! step, idempotent per migration UID. CRIU runs through its RPC (`criu swrk`, see
//! [`criu`]); privileged node steps go through the netns broker; images live on tmpfs
//! and are zeroized on every exit path ([`images`]).
#![deny(unsafe_code)]

pub mod admission;
pub mod authz;
pub mod containers;
pub mod creds;
pub mod criu;
pub mod criu_stats;
pub mod csr;
pub mod holder;
pub mod images;
/// The only module with `unsafe`: kernel calls no safe wrapper offers.
#[allow(unsafe_code)]
mod kernel;
pub mod lazy;
pub mod metrics;
pub mod mounts;
pub mod pidns;
pub mod pod;
pub mod service;
/// The test harness (feature `testbed`, off by default: not in the shipped agent).
#[cfg(feature = "testbed")]
pub mod testbed;
