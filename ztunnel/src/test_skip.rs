//! Tests that cannot run here say so (docs/testing.md, "Skipped tests"): a test that
//! returns early passes in libtest's count, so it also writes `SKIPPED: <test>: <why>`
//! where a run reports it. Same format as `mesh_tests::netsim::skipped`.

use std::io::Write;

/// Records that the calling test did not check what its name says, and why: a line on
/// stderr written past the test harness's capture (so it shows for a passing test), and
/// appended to the file `ZTUNNEL_TEST_SKIPS` names if set (`scripts/test.sh` counts and
/// lists them at the end of a run). The test then returns.
pub fn skipped(why: &str) {
    let thread = std::thread::current();
    let line = format!("SKIPPED: {}: {why}\n", thread.name().unwrap_or("?"));
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("ZTUNNEL_TEST_SKIPS") {
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}
