//! Generates Envoy's ext_authz types and gRPC service (CUSTOM AuthorizationPolicies)
//! from proto/: our own .proto files, written from their names and field numbers.
//! (OpenTelemetry's OTLP messages come from the `opentelemetry-proto` crate.)
//! google.rpc.Status is ztunnel's. protox parses in Rust, so no protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(
        ["proto/envoy/service/auth/v3/external_auth.proto"],
        ["proto", "../ztunnel/proto"],
    )?;
    tonic_prost_build::configure()
        .build_client(false)
        // The server side serves the end-to-end tests' ext_authz servers.
        .build_server(true)
        .extern_path(".google.rpc", "::ztunnel::xds::proto::google::rpc")
        .compile_fds(fds)?;
    Ok(())
}
