//! See `waypoint::fuzzing::tls_client_hello`: a connection's first bytes on a TLS port,
//! read as the waypoint reads its ClientHello (Envoy's tls_inspector), whole and split.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| waypoint::fuzzing::tls_client_hello(data));
