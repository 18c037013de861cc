//! See `ztunnel::fuzzing::proxy_protocol` for the input format and the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ztunnel::fuzzing::proxy_protocol(data));
