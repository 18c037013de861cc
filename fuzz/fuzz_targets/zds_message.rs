//! See `ztunnel::fuzzing::zds_message` for the input format and the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ztunnel::fuzzing::zds_message(data));
