//! The built `waypoint` binary's command line. These tests also make `cargo test` build
//! the binary, which the end-to-end suites (the `mesh-tests` package) run.

use std::process::Command;

const WAYPOINT: &str = env!("CARGO_BIN_EXE_waypoint");

#[test]
fn prints_its_version() {
    let out = Command::new(WAYPOINT)
        .arg("--version")
        .output()
        .expect("run waypoint");
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("waypoint {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn refuses_an_unknown_flag_with_its_usage() {
    let out = Command::new(WAYPOINT)
        .arg("--no-such-flag")
        .output()
        .expect("run waypoint");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("'--no-such-flag'") && err.contains("Usage: waypoint"),
        "{err}"
    );
}
