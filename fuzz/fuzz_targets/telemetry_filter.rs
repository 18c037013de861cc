//! See `waypoint::fuzzing::telemetry_filter`: a Telemetry access-log filter (CEL) and an
//! access-log format (text and JSON), compiled, evaluated and rendered.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| waypoint::fuzzing::telemetry_filter(data));
