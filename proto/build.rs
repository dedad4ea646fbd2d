//! Generates the `sluice.v1` messages and tonic services from
//! `sluice/v1/*.proto`, with the protoc shipped in `protoc-bin-vendored` (a
//! system protoc is never used, so the build does not depend on the host).

use std::path::PathBuf;

const PROTOS: &[&str] = &["sluice/v1/stage.proto", "sluice/v1/admin.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let protos: Vec<PathBuf> = PROTOS.iter().map(|p| root.join(p)).collect();

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    // Ordered maps make encoding deterministic, so two settings built from
    // the same state encode to the same bytes.
    config.btree_map(["."]);

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_with_config(config, &protos, &[root])?;

    // Neither prost-build nor tonic-prost-build emits these; without them
    // cargo would re-run this script whenever any file of the crate changes.
    println!("cargo:rerun-if-changed=sluice/v1");
    println!("cargo:rerun-if-changed=build.rs");
    Ok(())
}
