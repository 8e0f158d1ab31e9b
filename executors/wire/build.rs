//! Generates the agent API from its contract, `proto/podmotion/agent/v1/agent.proto`:
//! the .proto is compiled in pure Rust (protox, so no `protoc` is needed) into a
//! FileDescriptorSet, from which tonic-prost-build generates the prost messages and
//! the tonic client and server (`$OUT_DIR/podmotion.agent.v1.rs`, included by
//! `src/agent.rs`). The encoded descriptor set is written beside it
//! (`agent_descriptor.bin`, `podmotion_wire::proto::FILE_DESCRIPTOR_SET`).

use std::path::PathBuf;

const PROTO: &str = "proto/podmotion/agent/v1/agent.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={PROTO}");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);

    let mut compiler = protox::Compiler::new(["proto"])?;
    // Source info carries the .proto comments into the generated docs.
    compiler.include_source_info(true).include_imports(true);
    compiler.open_file(PROTO)?;
    std::fs::write(
        out.join("agent_descriptor.bin"),
        compiler.encode_file_descriptor_set(),
    )?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
