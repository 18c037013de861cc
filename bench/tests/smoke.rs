//! `bench --quick` (shortened further) end to end: every mode runs every scenario and produces numbers, and
//! the `capture` and `l7` comparisons run a round. Only that; the numbers themselves are
//! for docs/benchmarks.md. Needs root and the ztunnel
//! and waypoint binaries next to the bench binary (`cargo test --workspace` builds them).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn quick_run_produces_numbers_for_every_mode() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let dir = bench.parent().expect("bench binary has a directory");
    for b in ["ztunnel", "waypoint"] {
        assert!(
            dir.join(b).exists(),
            "{} missing: build the workspace first (cargo test --workspace does)",
            dir.join(b).display()
        );
    }
    let out = std::env::temp_dir().join(format!("bench-smoke-{}", std::process::id()));
    // Shorter than --quick alone (2 s steps, two rates, 64 MiB): this checks that numbers
    // come out, not what they are.
    let status = Command::new(&bench)
        .args([
            "--quick",
            "--duration",
            "0.5",
            "--rates",
            "1000",
            "--bulk-mib",
            "16",
            "--idle",
            "100",
            "--out",
        ])
        .arg(&out)
        .status()
        .expect("run bench");
    let json = std::fs::read_to_string(out.join("results.json")).expect("results.json");
    let md = std::fs::read_to_string(out.join("results.md")).expect("results.md");
    let svg = std::fs::read_to_string(out.join("latency.svg")).expect("latency.svg");
    let _ = std::fs::remove_dir_all(&out);
    assert!(status.success(), "bench --quick failed ({status}):\n{md}");
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let modes = ["direct", "ztunnel-l4", "ztunnel+waypoint"];
    let positive = |section: &str, field: &[&str]| {
        for m in modes {
            let rows: Vec<&serde_json::Value> = v[section]
                .as_array()
                .expect(section)
                .iter()
                .filter(|r| r["mode"] == m)
                .collect();
            assert!(!rows.is_empty(), "{section}: no row for {m}");
            for r in rows {
                let mut x = &r["result"];
                for f in field {
                    x = &x[f];
                }
                assert!(
                    x.as_f64().is_some_and(|n| n > 0.0),
                    "{section} {m}: {field:?} = {x}"
                );
            }
        }
    };
    positive("constant_rate", &["latency", "p99_us"]);
    positive("max_rate", &["rps"]);
    positive("bulk", &["gbit_per_s"]);
    positive("conn_rate", &["conn_per_s"]);
    positive("idle", &["established"]);
    assert!(
        v["errors"].as_array().is_some_and(|e| e.is_empty()),
        "errors: {}",
        v["errors"]
    );
    assert!(svg.contains("<polyline"), "no plot lines");
}

/// `--rounds 2`: each step runs once per round, the second round in reverse mode order;
/// idle tunnels only in the last round; results.md has the medians.
#[test]
fn rounds_alternate_the_order_and_report_medians() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let out = std::env::temp_dir().join(format!("bench-rounds-{}", std::process::id()));
    let run = Command::new(&bench)
        .args([
            "--quick",
            "--rounds",
            "2",
            "--duration",
            "0.3",
            "--modes",
            "direct,l4",
            "--scenarios",
            "max,idle",
            "--idle",
            "50",
            "--out",
        ])
        .arg(&out)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
    let json = std::fs::read_to_string(out.join("results.json")).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&out);
    assert!(
        run.status.success(),
        "bench --rounds 2 failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    let rows = |section: &str| -> Vec<(String, u64)> {
        v[section]
            .as_array()
            .expect(section)
            .iter()
            .map(|r| {
                (
                    r["mode"].as_str().unwrap_or_default().to_string(),
                    r["round"].as_u64().unwrap_or(99),
                )
            })
            .collect()
    };
    // Two connection counts (1, 32) x two modes x two rounds, in the order they ran.
    let order: Vec<(String, u64)> = rows("max_rate");
    let want: Vec<(String, u64)> = [
        ("direct", 0),
        ("ztunnel-l4", 0),
        ("direct", 0),
        ("ztunnel-l4", 0),
        ("ztunnel-l4", 1),
        ("direct", 1),
        ("ztunnel-l4", 1),
        ("direct", 1),
    ]
    .iter()
    .map(|(m, r)| (m.to_string(), *r))
    .collect();
    assert_eq!(order, want);
    assert_eq!(
        rows("idle"),
        vec![("ztunnel-l4".to_string(), 1), ("direct".to_string(), 1)]
    );
    assert!(
        stdout.contains("## Medians over 2 rounds"),
        "no medians:\n{stdout}"
    );
    assert!(
        stdout.contains("| max rate, 1 conn | ztunnel-l4 |"),
        "no max-rate median:\n{stdout}"
    );
}

/// `--passthrough` (the server outside the mesh, the client's ztunnel relaying plain TCP)
/// and `--plaintext-client` (the client outside, the server's ztunnel capturing it); the
/// waypoint mode, which needs both pods in the mesh, is refused by name.
#[test]
fn runs_with_a_pod_outside_the_mesh() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    for (flag, said) in [
        ("--passthrough", "**passthrough**"),
        ("--plaintext-client", "**plaintext client**"),
    ] {
        let out = std::env::temp_dir().join(format!("bench-outside-{}", std::process::id()));
        let run = Command::new(&bench)
            .args([
                "--quick",
                flag,
                "--duration",
                "0.3",
                "--modes",
                "direct,l4",
                "--scenarios",
                "max,bulk,idle",
                "--bulk-mib",
                "16",
                "--idle",
                "50",
                "--out",
            ])
            .arg(&out)
            .output()
            .expect("run bench");
        let md = std::fs::read_to_string(out.join("results.md")).unwrap_or_default();
        let json = std::fs::read_to_string(out.join("results.json")).unwrap_or_default();
        let _ = std::fs::remove_dir_all(&out);
        assert!(
            run.status.success(),
            "bench {flag} failed ({}):\n{md}\n{}",
            run.status,
            String::from_utf8_lossy(&run.stderr)
        );
        assert!(md.contains(said), "results.md does not say {said}:\n{md}");
        let v: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
        let row = |section: &str| {
            v[section]
                .as_array()
                .and_then(|rows| rows.iter().find(|r| r["mode"] == "ztunnel-l4").cloned())
                .unwrap_or_default()
        };
        assert!(
            row("bulk")["result"]["gbit_per_s"]
                .as_f64()
                .is_some_and(|g| g > 0.0),
            "{flag}: {}",
            row("bulk")
        );
        assert_eq!(
            row("idle")["result"]["established"].as_u64(),
            Some(50),
            "{flag}: {}",
            row("idle")
        );

        let refused = Command::new(&bench)
            .args([flag, "--modes", "waypoint", "--out"])
            .arg(&out)
            .output()
            .expect("run bench");
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success() && err.contains(flag) && err.contains("no waypoint applies"),
            "{err}"
        );
    }
}

/// `bench capture --quick` and `bench l7 --quick`: one small round of each comparison
/// completes and prints its medians.
#[test]
fn quick_comparisons_complete() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    for (args, table) in [
        (&["capture", "--quick"][..], "inbound ratios"),
        (
            &["l7", "--quick"][..],
            "proxy CPU per request: ext_authz/waypoint",
        ),
    ] {
        let out = Command::new(&bench).args(args).output().expect("run bench");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench {args:?} failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains(table),
            "bench {args:?} printed no {table:?}:\n{stdout}"
        );
    }
}

/// `bench scale --quick` (about 15 s): every curve yields its numbers, the tables, the
/// JSON and one plot per curve.
#[test]
fn quick_scale_curves_complete() {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_bench"));
    let out = std::env::temp_dir().join(format!("bench-scale-smoke-{}", std::process::id()));
    let run = Command::new(&bench)
        .args(["scale", "--quick", "--out"])
        .arg(&out)
        .output()
        .expect("run bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let json = std::fs::read_to_string(out.join("scale.json"));
    let svgs: Vec<String> = ["config", "pods", "tunnels"]
        .iter()
        .map(|c| std::fs::read_to_string(out.join(format!("scale-{c}.svg"))).unwrap_or_default())
        .collect();
    let _ = std::fs::remove_dir_all(&out);
    assert!(
        run.status.success(),
        "bench scale --quick failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let v: serde_json::Value =
        serde_json::from_str(&json.expect("scale.json")).expect("valid JSON");
    let positive = |curve: &str, field: &str| {
        let points = v[curve]["points"]
            .as_array()
            .unwrap_or_else(|| panic!("{curve}: no points"));
        assert!(points.len() >= 2, "{curve}: {points:?}");
        for p in points {
            assert!(
                p[field].as_f64().is_some_and(|n| n > 0.0),
                "{curve} {field}: {p}"
            );
        }
    };
    positive("config", "rss_mib");
    positive("config", "push_to_ack_median_ms");
    positive("pods", "enroll_served_median_ms");
    positive("pods", "fds");
    positive("tunnels", "victim_p99_us");
    assert!(
        v["config"]["policy_eval"]
            .as_array()
            .is_some_and(|p| p.len() >= 2),
        "{}",
        v["config"]
    );
    for svg in svgs {
        assert!(svg.contains("<polyline"), "a curve without a plot");
    }
}
