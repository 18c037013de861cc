//! Generates the xDS, Istio workload/authorization and Istio CA types and gRPC stubs
//! from proto/ (our own .proto files, written from Istio's field numbers). protox
//! parses them in Rust, so no protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const FILES: [&str; 4] = [
        "proto/istio/workload/workload.proto",
        "proto/istio/security/authorization.proto",
        "proto/istio/ca/ca.proto",
        "proto/envoy/discovery.proto",
    ];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(FILES, ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
