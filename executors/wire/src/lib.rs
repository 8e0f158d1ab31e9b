//! Wire protocol shared by the operator and the migration executors.
//!
//! * [`agent`]: the messages of the `podmotion.agent.v1.MigrationAgent` gRPC service,
//!   generated with its client and server (re-exported in [`proto`]) from the contract
//!   `proto/podmotion/agent/v1/agent.proto` (build.rs: protox and tonic-prost-build,
//!   so building needs no `protoc`).
//! * [`identity`]: who a peer is, from the URI SAN of its certificate (operator or
//!   the agent of one node), and a TLS server verifier that trusts that identity.
//! * [`client`]: the small API the operator uses to drive one agent over mutual TLS.
//! * [`transfer`]: the AEAD sealing of checkpoint image chunks with the per-migration
//!   key (on top of mTLS between the agents).
//! * [`broker`]: the frame format and request/response types of the netns broker's
//!   Unix socket, with the server-side validators ([`ids`]).
#![forbid(unsafe_code)]

pub mod agent;
pub mod broker;
pub mod client;
pub mod identity;
pub mod ids;
pub mod transfer;

/// Generated gRPC stubs (`migration_agent_client` / `migration_agent_server`) and the
/// contract's descriptor.
pub mod proto {
    pub use crate::agent::{migration_agent_client, migration_agent_server};

    /// The compiled contract (`proto/podmotion/agent/v1/agent.proto`): an encoded
    /// `google.protobuf.FileDescriptorSet`, e.g. for a reflection service.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/agent_descriptor.bin"));
}
