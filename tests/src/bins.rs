//! The binaries under test, `ztunnel` and `waypoint`, found in (and, under cargo, built
//! into) the target directory the running test binary came from.
//!
//! A package's integration tests only get `CARGO_BIN_EXE_*` for its own binaries, so this
//! crate asks cargo itself, once per process: `cargo test --workspace --no-run --test cli`
//! builds each binary exactly as `cargo test --workspace` does (the `cli` tests of the
//! ztunnel and waypoint packages depend on their binaries; same packages, same features,
//! so nothing is built twice), and its JSON messages name the executables. When the tests
//! run outside cargo (no `CARGO` in the environment), the binaries must already sit in the
//! target directory, beside `deps/`. `ZTUNNEL_TEST_BIN_DIR` overrides both.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use anyhow::{bail, Context, Result};

/// Where ztunnel and waypoint are, or why they could not be found or built.
static BINARIES: OnceLock<Result<Binaries, String>> = OnceLock::new();

#[derive(Debug)]
struct Binaries {
    ztunnel: PathBuf,
    waypoint: PathBuf,
}

/// The ztunnel binary. Panics with the reason when it cannot be found or built: no test
/// can run without it.
pub fn ztunnel() -> &'static str {
    path_str(&binaries().ztunnel)
}

/// The waypoint binary (see [`ztunnel`]).
pub fn waypoint() -> &'static str {
    path_str(&binaries().waypoint)
}

/// Runs these binaries instead of finding them (the bench passes the ones it measures).
/// Fails if the binaries were already located.
pub fn use_binaries(ztunnel: PathBuf, waypoint: PathBuf) -> Result<()> {
    BINARIES
        .set(Ok(Binaries { ztunnel, waypoint }))
        .map_err(|_| anyhow::anyhow!("the binaries under test were chosen already"))
}

fn path_str(p: &'static Path) -> &'static str {
    p.to_str().expect("target directory paths are UTF-8")
}

fn binaries() -> &'static Binaries {
    match BINARIES.get_or_init(|| locate().map_err(|e| format!("{e:#}"))) {
        Ok(b) => b,
        Err(e) => panic!("the binaries under test: {e}"),
    }
}

fn locate() -> Result<Binaries> {
    if let Some(dir) = std::env::var_os("ZTUNNEL_TEST_BIN_DIR") {
        return in_dir(Path::new(&dir));
    }
    let exe = std::env::current_exe().context("the test binary's own path")?;
    let profile_dir = profile_dir(&exe)?;
    match std::env::var_os("CARGO") {
        Some(cargo) => build(Path::new(&cargo), &profile_dir),
        None => in_dir(&profile_dir),
    }
}

/// `target/<profile>` from `target/<profile>/deps/<test binary>` (or from a binary
/// directly in it, as the bench is).
fn profile_dir(exe: &Path) -> Result<PathBuf> {
    let dir = exe.parent().context("test binary has no directory")?;
    let dir = if dir.file_name().is_some_and(|n| n == "deps") {
        dir.parent().context("deps has no parent")?
    } else {
        dir
    };
    Ok(dir.to_path_buf())
}

fn in_dir(dir: &Path) -> Result<Binaries> {
    let b = Binaries {
        ztunnel: dir.join("ztunnel"),
        waypoint: dir.join("waypoint"),
    };
    for p in [&b.ztunnel, &b.waypoint] {
        if !p.is_file() {
            bail!("{} is missing: build it first (`cargo test --workspace --no-run` or `cargo build --workspace --bins`)", p.display());
        }
    }
    Ok(b)
}

/// What cargo sets for a test process besides `CARGO_PKG_*` and `CARGO_BIN_*` (and
/// `CARGO`, which is kept: it is the cargo to run).
const CARGO_TEST_ENV: &[&str] = &[
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_MANIFEST_LINKS",
    "CARGO_CRATE_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
    "OUT_DIR",
];

/// Builds both binaries with the profile of `profile_dir` and returns what cargo reports.
fn build(cargo: &Path, profile_dir: &Path) -> Result<Binaries> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(cargo);
    // Cargo sets these for the test process; build scripts watch some of them (ring's
    // reruns on CARGO_PKG_NAME, CARGO_MANIFEST_DIR, ...), so passing them on would make
    // this build and the outer one rebuild each other's dependencies every time.
    for (key, _) in std::env::vars_os() {
        let k = key.to_string_lossy();
        if k.starts_with("CARGO_PKG_")
            || k.starts_with("CARGO_BIN_")
            || CARGO_TEST_ENV.contains(&k.as_ref())
        {
            cmd.env_remove(&key);
        }
    }
    cmd.current_dir(&workspace).args([
        "test",
        "--workspace",
        "--no-run",
        "--test",
        "cli",
        "--message-format=json-render-diagnostics",
    ]);
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(other) => {
            cmd.args(["--profile", other]);
        }
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", cargo.display()))?;
    if !out.status.success() {
        bail!(
            "building the binaries under test failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut found = (None, None);
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact"
            || !msg["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        {
            continue;
        }
        let Some(exe) = msg["executable"].as_str() else {
            continue;
        };
        match msg["target"]["name"].as_str() {
            Some("ztunnel") => found.0 = Some(PathBuf::from(exe)),
            Some("waypoint") => found.1 = Some(PathBuf::from(exe)),
            _ => {}
        }
    }
    match found {
        (Some(ztunnel), Some(waypoint)) => Ok(Binaries { ztunnel, waypoint }),
        _ => bail!("cargo built no ztunnel and waypoint binaries (the `cli` tests of both packages depend on them)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_directory_is_the_parent_of_deps() {
        assert_eq!(
            profile_dir(Path::new("/w/target/debug/deps/e2e-0123")).unwrap(),
            Path::new("/w/target/debug")
        );
        assert_eq!(
            profile_dir(Path::new("/w/target/release/bench")).unwrap(),
            Path::new("/w/target/release")
        );
    }

    #[test]
    fn a_directory_without_the_binaries_says_how_to_build_them() {
        let e = in_dir(Path::new("/nonexistent")).unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/ztunnel is missing") && e.contains("cargo test --workspace"),
            "{e}"
        );
    }
}
