//! Cleanup on Ctrl-C / SIGTERM and as a last resort.
//!
//! The normal path is RAII: every topology and proxy is owned by a netsim guard whose
//! Drop removes namespaces, unmounts the bpffs (dropping every pin) and stops the
//! processes; errors and panics unwind through them. A signal only sets a flag: every
//! load loop polls it and returns an error, so the same Drop path runs. If that does not
//! finish within `GRACE` (or a second signal arrives), a watchdog thread kills the
//! registered processes and removes the registered namespaces and mounts itself, then
//! exits: nothing is left behind even if a load thread is stuck in a syscall.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static SIGNALS: AtomicUsize = AtomicUsize::new(0);
static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    prefixes: Vec::new(),
    pids: Vec::new(),
    mounts: Vec::new(),
});
const GRACE: Duration = Duration::from_secs(20);

struct Registry {
    prefixes: Vec<String>,
    pids: Vec<u32>,
    mounts: Vec<std::path::PathBuf>,
}

extern "C" fn on_signal(_: nix::libc::c_int) {
    // Only an atomic store: async-signal-safe.
    SIGNALS.fetch_add(1, Ordering::SeqCst);
}

pub fn interrupted() -> bool {
    SIGNALS.load(Ordering::Relaxed) > 0
}

/// Fails once a signal arrived, to unwind through the guards.
pub fn check() -> anyhow::Result<()> {
    if interrupted() {
        anyhow::bail!("interrupted");
    }
    Ok(())
}

pub fn register_prefix(prefix: &str, bpffs: &std::path::Path) {
    if let Ok(mut r) = REGISTRY.lock() {
        r.prefixes.push(prefix.to_string());
        r.mounts.push(bpffs.to_path_buf());
    }
}

pub fn register_pid(pid: u32) {
    if let Ok(mut r) = REGISTRY.lock() {
        r.pids.push(pid);
    }
}

pub fn install() -> anyhow::Result<()> {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let act = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only touches an atomic.
        unsafe { sigaction(sig, &act) }?;
    }
    std::thread::spawn(|| {
        let mut first: Option<Instant> = None;
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let n = SIGNALS.load(Ordering::SeqCst);
            if n == 0 {
                continue;
            }
            let since = *first.get_or_insert_with(Instant::now);
            if n > 1 || since.elapsed() > GRACE {
                eprintln!("bench: forced cleanup");
                force_cleanup();
                std::process::exit(130);
            }
        }
    });
    Ok(())
}

fn force_cleanup() {
    let Ok(r) = REGISTRY.lock() else { return };
    for &pid in &r.pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    if let Ok(out) = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Some(name) = line.split_whitespace().next() else {
                continue;
            };
            if r.prefixes
                .iter()
                .any(|p| name.starts_with(&format!("{p}-")))
            {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "del", name])
                    .status();
            }
        }
    }
    for m in &r.mounts {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(m)
            .status();
        if let Some(dir) = m.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
