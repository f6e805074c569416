//! Compiles `proto/` with protox (pure Rust) so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "z29c/v1/common.proto",
        "z29c/v1/workflow.proto",
        "z29c/v1/gateway.proto",
        "z29c/v1/review.proto",
        "z29c/v1/envelopes.proto",
    ];
    let fds = protox::compile(files, [&root])?;
    // decode failures are the caller's mistake: INVALID_ARGUMENT, not INTERNAL (see codec.rs)
    tonic_prost_build::configure()
        .codec_path("crate::codec::Z29cCodec")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed={}", root.display());
    Ok(())
}
