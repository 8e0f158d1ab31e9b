//! Generates the tonic client and server stubs of the agent service from the Rust
//! description below (tonic-build's `manual` module), so no `protoc` and no .proto
//! compiler are needed at build time. The messages are the prost structs in
//! `src/agent.rs`; their field numbers are the wire contract.

use tonic_build::manual::{Builder, Method, Service};

fn method(name: &str, route: &str, input: &str, output: &str, client_streaming: bool) -> Method {
    let b = Method::builder()
        .name(name)
        .route_name(route)
        .input_type(format!("crate::agent::{input}"))
        .output_type(format!("crate::agent::{output}"))
        .codec_path("tonic_prost::ProstCodec");
    if client_streaming {
        b.client_streaming().build()
    } else {
        b.build()
    }
}

fn main() {
    let svc = Service::builder()
        .name("MigrationAgent")
        .package("podmotion.agent.v1")
        .comment("Node agent of a live migration; every call is idempotent per migration UID.")
        .method(method(
            "prepare",
            "Prepare",
            "PrepareRequest",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "pre_dump",
            "PreDump",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "dump",
            "Dump",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "send",
            "Send",
            "SendRequest",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "receive_images",
            "ReceiveImages",
            "ImageChunk",
            "ReceiveSummary",
            true,
        ))
        .method(method(
            "fence",
            "Fence",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "restore",
            "Restore",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "commit",
            "Commit",
            "CommitRequest",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "abort",
            "Abort",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "cleanup",
            "Cleanup",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .method(method(
            "status",
            "Status",
            "MigrationRef",
            "MigrationStatus",
            false,
        ))
        .build();
    Builder::new().compile(&[svc]);
    println!("cargo:rerun-if-changed=build.rs");
}
