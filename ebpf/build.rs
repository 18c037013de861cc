//! Compiles the eBPF programs in bpf/ with clang -target bpf and leaves the object in
//! OUT_DIR for include_bytes. The machine has no rust-src, so aya-ebpf programs are not
//! an option; C with libbpf's headers is.

use std::path::{Path, PathBuf};
use std::process::Command;

const SOURCE: &str = "bpf/capture.bpf.c";

fn main() {
    println!("cargo:rerun-if-changed={SOURCE}");
    println!("cargo:rerun-if-env-changed=CLANG");
    println!("cargo:rerun-if-env-changed=ZTUNNEL_BUILD_WITHOUT_EBPF");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("capture.bpf.o");
    if std::env::var_os("ZTUNNEL_BUILD_WITHOUT_EBPF").is_some() {
        // An empty object: at run time eBPF capture reports "built without eBPF" and
        // ztunnel falls back to nftables.
        std::fs::write(&object, b"").expect("write empty eBPF object");
        println!(
            "cargo:warning=building without eBPF programs (ZTUNNEL_BUILD_WITHOUT_EBPF is set)"
        );
        return;
    }
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_string());
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let (bpf_arch, multiarch) = match arch.as_str() {
        "x86_64" => ("x86", "x86_64-linux-gnu"),
        "aarch64" => ("arm64", "aarch64-linux-gnu"),
        other => panic!("eBPF capture is built for x86_64 and aarch64 only, not {other}; set ZTUNNEL_BUILD_WITHOUT_EBPF=1 to build without it"),
    };
    for (header, package) in [
        ("bpf/bpf_helpers.h", "libbpf-dev"),
        ("linux/bpf.h", "linux-libc-dev"),
    ] {
        if !Path::new("/usr/include").join(header).exists() {
            panic!(
                "eBPF build: <{header}> is missing; install it with `apt-get install -y {package}` \
                 (or set ZTUNNEL_BUILD_WITHOUT_EBPF=1 to build with nftables capture only)"
            );
        }
    }
    let result = Command::new(&clang)
        .args(["-O2", "-g", "-Wall", "-Werror", "-target", "bpf"])
        .arg(format!("-D__TARGET_ARCH_{bpf_arch}"))
        .arg(format!("-I/usr/include/{multiarch}"))
        .args(["-c", SOURCE, "-o"])
        .arg(&object)
        .output();
    match result {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "eBPF build: `{clang}` not found; install it with `apt-get install -y clang llvm libbpf-dev` \
             (or set CLANG to its path, or ZTUNNEL_BUILD_WITHOUT_EBPF=1 to build with nftables capture only)"
        ),
        Err(e) => panic!("eBPF build: cannot run `{clang}`: {e}"),
        Ok(o) if !o.status.success() => panic!(
            "eBPF build: `{clang} -target bpf` failed on {SOURCE}:\n{}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Ok(_) => {}
    }
}
