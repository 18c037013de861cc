//! See `waypoint::fuzzing::http_authority`: a request's Host or :authority, parsed as
//! the waypoint parses it before policy, and the upstream URI made from it.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| waypoint::fuzzing::http_authority(data));
