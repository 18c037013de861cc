//! See `ztunnel::fuzzing::config_yaml` for the input format and the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ztunnel::fuzzing::config_yaml(data));
