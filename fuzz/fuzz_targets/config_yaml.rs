//! See `ztunnel::fuzzing::config_yaml` (the mesh part: state and lookups) and
//! `waypoint::fuzzing::config_yaml` (the L7 lists: routing and authorization) for the
//! input format and the properties checked: the same file feeds both proxies.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ztunnel::fuzzing::config_yaml(data);
    waypoint::fuzzing::config_yaml(data);
});
