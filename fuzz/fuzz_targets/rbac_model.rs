//! See `ztunnel::fuzzing::rbac_model` (feature `fuzzing`): L4 authorization of arbitrary
//! policies and connections against a reference model.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ztunnel::fuzzing::rbac_model(data));
