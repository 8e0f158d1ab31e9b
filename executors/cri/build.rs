//! Generates the CRI client from the upstream contract, `proto/runtime/v1/api.proto`
//! (vendored unmodified from k8s.io/cri-api, see `proto/README.md`): the .proto is
//! compiled in pure Rust (protox, so no `protoc` is needed) into a FileDescriptorSet,
//! from which tonic-prost-build generates the prost messages and the tonic
//! `RuntimeService` client (`$OUT_DIR/runtime.v1.rs`, included by `src/lib.rs` as
//! `v1`). The executors only call the runtime, so no server is generated.

const PROTO: &str = "proto/runtime/v1/api.proto";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed={PROTO}");

    let mut compiler = protox::Compiler::new(["proto"])?;
    // Source info carries the .proto comments into the generated docs.
    compiler.include_source_info(true).include_imports(true);
    compiler.open_file(PROTO)?;

    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(compiler.file_descriptor_set())?;
    Ok(())
}
