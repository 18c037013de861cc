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

/// A ProxyConfig that does not parse stops the start, naming the variable (istiod renders
/// PROXY_CONFIG; a broken one must not be half applied).
#[test]
fn refuses_a_proxy_config_that_does_not_parse() {
    for (var, value, said) in [
        (
            "PROXY_CONFIG",
            "{concurrency",
            "PROXY_CONFIG is not ProxyConfig JSON",
        ),
        (
            "PROXY_CONFIG",
            r#"{"terminationDrainDuration": "soon"}"#,
            "PROXY_CONFIG terminationDrainDuration",
        ),
        ("ISTIO_CPU_LIMIT", "lots", "ISTIO_CPU_LIMIT \"lots\""),
    ] {
        let out = Command::new(WAYPOINT)
            .args([
                "--local-xds-path",
                "/nonexistent.yaml",
                "--workload-uid",
                "x",
            ])
            .env(var, value)
            .output()
            .expect("run waypoint");
        assert_eq!(out.status.code(), Some(1), "{var}={value}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{var}={value}: {err}");
    }
}
