//! End-to-end test harness: a simulated cluster built from Linux network
//! namespaces, plus small tokio apps, a packet capture and process helpers.
//!
//! Include it from a test file with `mod harness;` (or from a binary with
//! `#[path = ".../tests/harness.rs"] mod harness;`). Dependencies: anyhow,
//! tokio (full), nix (feature `sched`), libc. Needs root and the `ip`
//! (iproute2) and `tcpdump` binaries.
//!
//! # Topology
//!
//! `Topology::build("zt1a", &[("node1", &["a1", "a2"]), ("node2", &["b1"])])`
//! creates these network namespaces (all names are `{prefix}-...`):
//!
//! | netns            | interface | address                | notes                                        |
//! |------------------|-----------|------------------------|----------------------------------------------|
//! | `{prefix}-wire`  | `br0`     | none                   | Linux bridge = "the network" (STP off)       |
//! |                  | `n{i}`    | none                   | bridge port, veth peer of node i's `eth0`    |
//! | `{prefix}-{node}`| `eth0`    | `10.0.0.{i}/24`        | "the node link": captures happen here        |
//! |                  | `vp{j}`   | none                   | host side of pod j; proxy_arp=1, MAC ee:ee:ee:ee:ee:ee |
//! | `{prefix}-{pod}` | `eth0`    | `10.10.{i}.{10+j}/32`  | Calico style pod interface                   |
//!
//! `i` is the 1-based index of the node in the order given, `j` the 1-based
//! index of the pod within its node. So node i's pod CIDR is `10.10.{i}.0/24`.
//!
//! Routing:
//! * pod:  `169.254.1.1 dev eth0 scope link`, `default via 169.254.1.1 dev eth0`,
//!   and a permanent neighbour entry `169.254.1.1 -> ee:ee:ee:ee:ee:ee` (the MAC
//!   of every `vp{j}`), so the pod never depends on proxy ARP for its gateway.
//! * node: `ip_forward=1`, `10.10.{i}.{10+j}/32 dev vp{j}` for each local pod,
//!   `10.10.{k}.0/24 via 10.0.0.{k}` for every other node k, and
//!   `169.254.1.1 dev lo` (proxy ARP only answers for a destination the node
//!   has a unicast route to through another device; this keeps the proxy ARP
//!   path working if the pod's neighbour entry is ever flushed). No default
//!   route, so anything outside the cluster is unreachable (fails fast).
//! * `rp_filter=0` (all, default and every interface) in every namespace; in the
//!   wire netns bridged traffic is not passed to iptables/nftables.
//!
//! Everything is torn down on `Drop` (also while unwinding from a panic):
//! every process still inside one of the namespaces is SIGKILLed and every
//! namespace is deleted. Namespaces left by a crashed earlier run are removed
//! on the next `build` (same prefix, or any prefix whose owning process has
//! died, tracked in `/run/netns-harness/`).
//!
//! Tests in one process run in parallel: give each its own prefix
//! (`unique_prefix("tag")`).
#![allow(dead_code)]

use std::collections::HashSet;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpSocket, TcpStream};

/// MAC address of every host-side pod veth (as Calico does).
pub const GATEWAY_MAC: &str = "ee:ee:ee:ee:ee:ee";
/// The pods' (link-local, never assigned) default gateway.
pub const GATEWAY_IP: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// Name of the node link in every node netns (and of the pod interface).
pub const NODE_LINK: &str = "eth0";

const REGISTRY_DIR: &str = "/run/netns-harness";
const NETNS_DIR: &str = "/var/run/netns";

// ---------------------------------------------------------------------------
// misc helpers
// ---------------------------------------------------------------------------

/// Panic with a clear message unless running as root (uid 0).
pub fn require_root() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        panic!(
            "these tests need root (network namespaces, veths, tcpdump); running as euid {euid}. \
             Run them as root, e.g. `sudo -E cargo test`."
        );
    }
}

static PREFIX_COUNTER: AtomicU64 = AtomicU64::new(0);

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    if n == 0 {
        return "0".into();
    }
    let mut out = Vec::new();
    while n > 0 {
        out.push(DIGITS[(n % 36) as usize]);
        n /= 36;
    }
    out.reverse();
    String::from_utf8(out).expect("ascii")
}

/// A short prefix for namespace names: up to 3 chars of `tag` (lowercase
/// alphanumerics), then the process id in base 36, then a per-process counter
/// in base 36 (omitted for the first call). E.g. `"ech4fk"`, `"ech4fk1"`.
pub fn unique_prefix(tag: &str) -> String {
    let mut t: String = tag
        .chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .take(3)
        .collect();
    if t.is_empty() {
        t.push('t');
    }
    let n = PREFIX_COUNTER.fetch_add(1, Ordering::SeqCst);
    let mut p = format!("{t}{}", base36(std::process::id() as u64));
    if n > 0 {
        p.push_str(&base36(n));
    }
    p
}

/// Poll `f` every 20 ms until it returns true; error after `timeout`.
pub fn wait_for<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Retry connecting to `addr` from inside `netns` until a connection is
/// established (which is then closed again). Note that this makes one real
/// connection to the server, e.g. `EchoServer::connections()` counts it.
pub async fn wait_for_tcp(netns: &Netns, addr: SocketAddr, timeout: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_err;
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let attempt = remaining.min(Duration::from_secs(1)).max(Duration::from_millis(10));
        match netns.tcp_connect_async(addr, attempt).await {
            Ok(s) => {
                drop(s);
                return Ok(());
            }
            Err(e) => last_err = e,
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(last_err.context(format!(
                "timed out after {timeout:?} waiting for {addr} to accept TCP connections from netns {}",
                netns.name
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn fmt_cmd(program: &str, args: &[&str]) -> String {
    let mut s = program.to_string();
    for a in args {
        s.push(' ');
        if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"') {
            s.push_str(&format!("{a:?}"));
        } else {
            s.push_str(a);
        }
    }
    s
}

/// Run a command on the host, return its stdout; on failure the error names
/// the command and includes its stderr.
pub fn run_cmd(program: &str, args: &[&str]) -> anyhow::Result<String> {
    run_cmd_stdin(program, args, None)
}

fn run_cmd_stdin(program: &str, args: &[&str], stdin: Option<&[u8]>) -> anyhow::Result<String> {
    let cmdline = fmt_cmd(program, args);
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().with_context(|| format!("failed to start `{cmdline}`"))?;
    if let Some(input) = stdin {
        let mut si = child.stdin.take().context("child stdin")?;
        // Write from a thread so a chatty child can't deadlock us.
        let input = input.to_vec();
        let writer = std::thread::spawn(move || si.write_all(&input));
        let out = child.wait_with_output().with_context(|| format!("waiting for `{cmdline}`"))?;
        let _ = writer.join();
        return check_output(&cmdline, out);
    }
    let out = child.wait_with_output().with_context(|| format!("waiting for `{cmdline}`"))?;
    check_output(&cmdline, out)
}

fn check_output(cmdline: &str, out: std::process::Output) -> anyhow::Result<String> {
    if !out.status.success() {
        bail!(
            "`{cmdline}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            if out.stdout.is_empty() {
                String::new()
            } else {
                format!(" (stdout: {})", String::from_utf8_lossy(&out.stdout).trim())
            }
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deterministic pseudo-random bytes (splitmix64), fast enough for 100 MiB.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let mut x = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    let mut chunks = out.chunks_exact_mut(8);
    let mut next = || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for c in &mut chunks {
        c.copy_from_slice(&next().to_le_bytes());
    }
    let rem = chunks.into_remainder();
    if !rem.is_empty() {
        let v = next().to_le_bytes();
        let n = rem.len();
        rem.copy_from_slice(&v[..n]);
    }
    out
}

/// Compare two (possibly huge) buffers without dumping them into the error.
pub fn ensure_same(expected: &[u8], actual: &[u8]) -> anyhow::Result<()> {
    if let Some(i) = expected.iter().zip(actual).position(|(a, b)| a != b) {
        bail!(
            "data differs at byte {i} (expected {} bytes, got {})",
            expected.len(),
            actual.len()
        );
    }
    if expected.len() != actual.len() {
        bail!(
            "length differs: expected {} bytes, got {} (common prefix matches)",
            expected.len(),
            actual.len()
        );
    }
    Ok(())
}

/// Write `data` while concurrently reading (so large payloads can't deadlock),
/// then shut down the write side and read until EOF. Returns what came back.
pub async fn echo_roundtrip(stream: &mut TcpStream, data: &[u8]) -> anyhow::Result<Vec<u8>> {
    let (mut rd, mut wr) = stream.split();
    let write = async {
        wr.write_all(data).await.context("echo_roundtrip: write")?;
        wr.shutdown().await.context("echo_roundtrip: shutdown(write)")?;
        Ok::<_, anyhow::Error>(())
    };
    let read = async {
        let mut out = Vec::with_capacity(data.len());
        rd.read_to_end(&mut out).await.context("echo_roundtrip: read")?;
        Ok::<_, anyhow::Error>(out)
    };
    let ((), out) = tokio::try_join!(write, read)?;
    Ok(out)
}

/// Read one `\n`-terminated line (without the `\n`), byte by byte so nothing
/// after the newline is consumed. Errors on EOF before the newline.
pub async fn read_line<S: AsyncRead + Unpin + ?Sized>(stream: &mut S) -> anyhow::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = stream.read(&mut b).await.context("read_line")?;
        if n == 0 {
            bail!(
                "read_line: EOF before newline (got {:?})",
                String::from_utf8_lossy(&line)
            );
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
        if line.len() > 64 * 1024 {
            bail!("read_line: line longer than 64 KiB");
        }
    }
    String::from_utf8(line).context("read_line: not UTF-8")
}

fn require_tokio(what: &str) -> anyhow::Result<()> {
    tokio::runtime::Handle::try_current()
        .map(|_| ())
        .map_err(|_| anyhow!("{what} must be called inside a tokio runtime"))
}

// ---------------------------------------------------------------------------
// locking and the registry of live prefixes (for crash cleanup)
// ---------------------------------------------------------------------------

/// Inter-process (and inter-thread) lock serializing `ip netns add/del`.
struct GlobalLock(File);

impl GlobalLock {
    fn acquire() -> anyhow::Result<GlobalLock> {
        std::fs::create_dir_all(REGISTRY_DIR).with_context(|| format!("mkdir {REGISTRY_DIR}"))?;
        let path = format!("{REGISTRY_DIR}/.lock");
        let f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("open {path}"))?;
        use std::os::fd::AsRawFd as _;
        loop {
            // SAFETY: valid fd owned by `f`.
            let r = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
            if r == 0 {
                break;
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e).with_context(|| format!("flock {path}"));
            }
        }
        Ok(GlobalLock(f))
    }
}
// The lock is released when the File is closed.

fn proc_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm may contain spaces/parens: fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    // rest starts at field 3 (state); starttime is field 22.
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn owner_tag() -> String {
    let pid = std::process::id();
    format!("{pid} {}\n", proc_start_time(pid).unwrap_or(0))
}

fn owner_alive(tag: &str) -> bool {
    let mut it = tag.split_whitespace();
    let (Some(pid), Some(start)) = (it.next(), it.next()) else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    match proc_start_time(pid) {
        Some(s) => s == start || start == 0,
        None => false,
    }
}

/// All network namespace names in /var/run/netns.
pub fn list_netns() -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(NETNS_DIR) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e).with_context(|| format!("read_dir {NETNS_DIR}")),
    };
    for e in rd {
        let e = e.with_context(|| format!("read_dir {NETNS_DIR}"))?;
        if let Some(n) = e.file_name().to_str() {
            out.push(n.to_string());
        }
    }
    out.sort();
    Ok(out)
}

/// Pids of processes whose network namespace is `name` (like `ip netns pids`).
fn netns_pids(name: &str) -> Vec<i32> {
    let out = match run_cmd("ip", &["netns", "pids", name]) {
        Ok(o) => o,
        Err(_) => return Vec::new(),
    };
    let me = std::process::id() as i32;
    out.split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .filter(|&p| p > 1 && p != me)
        .collect()
}

/// SIGKILL everything inside the namespace, then delete it. Best effort;
/// returns a description of what went wrong, if anything.
fn destroy_netns(name: &str) -> Option<String> {
    let mut problems = Vec::new();
    for round in 0..50 {
        let pids = netns_pids(name);
        if pids.is_empty() {
            break;
        }
        for p in &pids {
            // SAFETY: plain syscall.
            unsafe { libc::kill(*p, libc::SIGKILL) };
        }
        if round == 49 {
            problems.push(format!("processes {pids:?} in netns {name} would not die"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let path = Path::new(NETNS_DIR).join(name);
    if path.exists() {
        let _lock = GlobalLock::acquire();
        if let Err(e) = run_cmd("ip", &["netns", "del", name]) {
            if path.exists() {
                problems.push(e.to_string());
            }
        }
    }
    if problems.is_empty() {
        None
    } else {
        Some(problems.join("; "))
    }
}

fn destroy_prefix(prefix: &str) {
    let want = format!("{prefix}-");
    if let Ok(names) = list_netns() {
        for n in names.iter().filter(|n| n.starts_with(&want)) {
            if let Some(p) = destroy_netns(n) {
                eprintln!("harness: cleanup of stale netns {n}: {p}");
            }
        }
    }
}

/// Remove namespaces of prefixes whose owning process has died.
fn reap_dead_owners() {
    let Ok(rd) = std::fs::read_dir(REGISTRY_DIR) else {
        return;
    };
    for e in rd.flatten() {
        let Some(prefix) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if prefix.starts_with('.') {
            continue;
        }
        let tag = std::fs::read_to_string(e.path()).unwrap_or_default();
        if !owner_alive(&tag) {
            destroy_prefix(&prefix);
            let _ = std::fs::remove_file(e.path());
        }
    }
}

// ---------------------------------------------------------------------------
// Netns
// ---------------------------------------------------------------------------

/// A named network namespace (`/var/run/netns/NAME`). Just a name: cheap to
/// clone; the Topology owns the lifetime of the namespace itself.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Netns {
    pub name: String,
}

impl fmt::Display for Netns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl Netns {
    /// Refer to an existing namespace by name (does not create it).
    pub fn new(name: impl Into<String>) -> Netns {
        Netns { name: name.into() }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/var/run/netns/NAME`.
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_DIR).join(&self.name)
    }

    /// Run `cmd args...` inside the netns (`ip netns exec`), return stdout.
    pub fn exec(&self, cmd: &str, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["netns", "exec", self.name.as_str(), cmd];
        full.extend_from_slice(args);
        run_cmd("ip", &full)
    }

    /// Like `exec`, feeding `input` on stdin (e.g. `nft -f -`).
    pub fn exec_stdin(&self, cmd: &str, args: &[&str], input: &[u8]) -> anyhow::Result<String> {
        let mut full = vec!["netns", "exec", self.name.as_str(), cmd];
        full.extend_from_slice(args);
        run_cmd_stdin("ip", &full, Some(input))
    }

    /// `ip -n NAME args...`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        run_cmd("ip", &full)
    }

    /// Write a sysctl in this netns. `key` is either dotted
    /// (`net.ipv4.ip_forward`) or a path below /proc/sys (`net/ipv4/ip_forward`).
    pub fn sysctl(&self, key: &str, value: &str) -> anyhow::Result<()> {
        self.sysctls(&[(key, value)])
    }

    /// Write several sysctls from one thread inside the netns.
    pub fn sysctls(&self, kvs: &[(&str, &str)]) -> anyhow::Result<()> {
        let name = self.name.clone();
        self.run(|| -> anyhow::Result<()> {
            for (k, v) in kvs {
                let rel = if k.contains('/') { k.to_string() } else { k.replace('.', "/") };
                let path = format!("/proc/sys/{rel}");
                std::fs::write(&path, v.as_bytes())
                    .with_context(|| format!("write {v:?} to {path} in netns {name}"))?;
            }
            Ok(())
        })?
    }

    /// Read a sysctl in this netns (trimmed).
    pub fn read_sysctl(&self, key: &str) -> anyhow::Result<String> {
        let rel = if key.contains('/') { key.to_string() } else { key.replace('.', "/") };
        let path = format!("/proc/sys/{rel}");
        let name = self.name.clone();
        self.run(move || {
            std::fs::read_to_string(&path)
                .map(|s| s.trim().to_string())
                .with_context(|| format!("read {path} in netns {name}"))
        })?
    }

    /// Spawn `program args...` inside the netns, inheriting stdout/stderr.
    pub fn spawn(&self, program: &str, args: &[&str]) -> anyhow::Result<Child> {
        self.spawn_inner(program, args, &[], None)
    }

    /// Spawn inside the netns with extra environment; stdout and stderr are
    /// both appended to `log` (created if missing).
    pub fn spawn_logged(
        &self,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
        log: &Path,
    ) -> anyhow::Result<Child> {
        self.spawn_inner(program, args, env, Some(log))
    }

    fn spawn_inner(
        &self,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
        log: Option<&Path>,
    ) -> anyhow::Result<Child> {
        let mut full = vec!["netns", "exec", self.name.as_str(), program];
        full.extend_from_slice(args);
        let cmdline = fmt_cmd("ip", &full);
        let mut cmd = Command::new("ip");
        cmd.args(&full).stdin(Stdio::null());
        for (k, v) in env {
            cmd.env(k, v);
        }
        if let Some(log) = log {
            let f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .with_context(|| format!("open log file {}", log.display()))?;
            let f2 = f.try_clone().with_context(|| format!("dup log file {}", log.display()))?;
            cmd.stdout(f).stderr(f2);
        }
        // Own process group, so kill() reaches whatever the program forks.
        cmd.process_group(0);
        let child = cmd.spawn().with_context(|| format!("failed to spawn `{cmdline}`"))?;
        Ok(Child {
            inner: child,
            status: None,
            cmdline,
            log: log.map(Path::to_path_buf),
        })
    }

    /// Run `f` on a fresh thread that has entered this netns
    /// (`setns(CLONE_NEWNET)`). Sockets created inside `f` belong to this
    /// netns for their whole life. A panic inside `f` is propagated.
    pub fn run<F, R>(&self, f: F) -> anyhow::Result<R>
    where
        F: FnOnce() -> R + Send,
        R: Send,
    {
        let path = self.path();
        let file = File::open(&path).with_context(|| format!("open netns {}", path.display()))?;
        std::thread::scope(|s| {
            let h = std::thread::Builder::new()
                .name(format!("netns-{}", self.name))
                .spawn_scoped(s, move || -> anyhow::Result<R> {
                    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                        .with_context(|| format!("setns into {}", path.display()))?;
                    drop(file);
                    Ok(f())
                })
                .context("spawn netns thread")?;
            match h.join() {
                Ok(r) => r,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// An unconnected tokio TCP socket (IPv4 or IPv6 per `v6`) created inside
    /// this netns. Bind/connect it from anywhere; it stays in this netns.
    pub fn tcp_socket(&self, v6: bool) -> anyhow::Result<TcpSocket> {
        let name = self.name.clone();
        self.run(move || if v6 { TcpSocket::new_v6() } else { TcpSocket::new_v4() })?
            .with_context(|| format!("create TCP socket in netns {name}"))
    }

    /// A listening tokio TcpListener bound to `addr` inside this netns
    /// (SO_REUSEADDR, backlog 1024). Must be called inside a tokio runtime.
    pub fn tcp_listener(&self, addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
        require_tokio("Netns::tcp_listener")?;
        let sock = self.tcp_socket(addr.is_ipv6())?;
        sock.set_reuseaddr(true).context("SO_REUSEADDR")?;
        sock.bind(addr)
            .with_context(|| format!("bind {addr} in netns {}", self.name))?;
        sock.listen(1024)
            .with_context(|| format!("listen on {addr} in netns {}", self.name))
    }

    /// Connect from inside this netns (blocking, up to `timeout`), returning a
    /// tokio TcpStream. Must be called inside a tokio runtime. It blocks the
    /// calling thread while the handshake happens (the kernel completes it,
    /// the server need not `accept` first).
    pub fn tcp_connect(&self, addr: SocketAddr, timeout: Duration) -> anyhow::Result<TcpStream> {
        require_tokio("Netns::tcp_connect")?;
        let name = self.name.clone();
        let std_stream = self
            .run(move || std::net::TcpStream::connect_timeout(&addr, timeout))?
            .with_context(|| format!("connect to {addr} from netns {name}"))?;
        std_stream.set_nonblocking(true).context("set_nonblocking")?;
        TcpStream::from_std(std_stream).context("register TcpStream with tokio")
    }

    /// Async version of `tcp_connect`.
    pub async fn tcp_connect_async(&self, addr: SocketAddr, timeout: Duration) -> anyhow::Result<TcpStream> {
        let sock = self.tcp_socket(addr.is_ipv6())?;
        match tokio::time::timeout(timeout, sock.connect(addr)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(e).with_context(|| format!("connect to {addr} from netns {}", self.name)),
            Err(_) => bail!("connect to {addr} from netns {}: timed out after {timeout:?}", self.name),
        }
    }
}

// ---------------------------------------------------------------------------
// Child
// ---------------------------------------------------------------------------

/// A spawned process (its own process group). On Drop (or `kill()`): SIGTERM
/// to the group, SIGKILL after 2 s, then reaped.
pub struct Child {
    inner: std::process::Child,
    status: Option<ExitStatus>,
    cmdline: String,
    log: Option<PathBuf>,
}

impl fmt::Debug for Child {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Child")
            .field("pid", &self.inner.id())
            .field("cmd", &self.cmdline)
            .field("status", &self.status)
            .finish()
    }
}

impl Child {
    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    /// The command line it was started with (for messages).
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    pub fn log_path(&self) -> Option<&Path> {
        self.log.as_deref()
    }

    /// Contents of the log file (empty if none or unreadable).
    pub fn read_log(&self) -> String {
        self.log
            .as_ref()
            .and_then(|p| std::fs::read(p).ok())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Send `sig` to the process group (only while not yet reaped).
    pub fn signal(&self, sig: i32) -> anyhow::Result<()> {
        if self.status.is_some() {
            bail!("`{}` already exited", self.cmdline);
        }
        // SAFETY: plain syscall; the group exists while its leader is unreaped.
        let r = unsafe { libc::kill(-(self.pid() as i32), sig) };
        if r != 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("kill(-{}, {sig}) for `{}`", self.pid(), self.cmdline));
        }
        Ok(())
    }

    /// Non-blocking: the exit status if it has exited (and reap it).
    pub fn try_wait(&mut self) -> anyhow::Result<Option<ExitStatus>> {
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let s = self
            .inner
            .try_wait()
            .with_context(|| format!("waitpid for `{}`", self.cmdline))?;
        self.status = s;
        Ok(s)
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.try_wait(), Ok(None))
    }

    /// Wait up to `timeout` for it to exit by itself.
    pub fn wait_timeout(&mut self, timeout: Duration) -> anyhow::Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM the process group, SIGKILL after 2 s, reap. Idempotent.
    pub fn kill(&mut self) -> anyhow::Result<ExitStatus> {
        if let Some(s) = self.status {
            return Ok(s);
        }
        let pgid = -(self.pid() as i32);
        if self.try_wait()?.is_none() {
            // SAFETY: plain syscalls.
            unsafe { libc::kill(pgid, libc::SIGTERM) };
            if self.wait_timeout(Duration::from_secs(2))?.is_none() {
                unsafe { libc::kill(pgid, libc::SIGKILL) };
            }
        }
        // Whatever else is left in the group (the leader is not reaped yet,
        // or was just reaped by try_wait: the pgid cannot be reused while
        // members remain).
        unsafe { libc::kill(pgid, libc::SIGKILL) };
        let s = self
            .inner
            .wait()
            .with_context(|| format!("waitpid for `{}`", self.cmdline))?;
        self.status = Some(s);
        Ok(s)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Err(e) = self.kill() {
            eprintln!("harness: failed to kill `{}`: {e:#}", self.cmdline);
        }
    }
}

// ---------------------------------------------------------------------------
// Topology
// ---------------------------------------------------------------------------

/// An IPv4 prefix, e.g. `10.10.1.0/24`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    pub addr: Ipv4Addr,
    pub len: u8,
}

impl Cidr {
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = if self.len == 0 { 0 } else { u32::MAX << (32 - self.len as u32) };
        (u32::from(ip) & mask) == (u32::from(self.addr) & mask)
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

#[derive(Clone, Debug)]
pub struct Node {
    name: String,
    index: u8,
    netns: Netns,
    pods: Vec<String>,
}

impl Node {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// 1-based position in the list given to `Topology::build`.
    pub fn index(&self) -> u8 {
        self.index
    }
    pub fn netns(&self) -> &Netns {
        &self.netns
    }
    /// `10.0.0.{i}`, on `eth0` (the node link).
    pub fn ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, 0, self.index)
    }
    /// `10.10.{i}.0/24`.
    pub fn pod_cidr(&self) -> Cidr {
        Cidr { addr: Ipv4Addr::new(10, 10, self.index, 0), len: 24 }
    }
    /// Name of the node link interface (`eth0`).
    pub fn link(&self) -> &'static str {
        NODE_LINK
    }
    /// Names of this node's pods, in order.
    pub fn pod_names(&self) -> &[String] {
        &self.pods
    }
}

#[derive(Clone, Debug)]
pub struct Pod {
    name: String,
    node_name: String,
    node_index: u8,
    index: u8,
    netns: Netns,
}

impl Pod {
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn netns(&self) -> &Netns {
        &self.netns
    }
    /// `10.10.{node index}.{10 + pod index}`.
    pub fn ip(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 10, self.node_index, 10 + self.index)
    }
    pub fn node_name(&self) -> &str {
        &self.node_name
    }
    /// 1-based position within its node.
    pub fn index(&self) -> u8 {
        self.index
    }
    /// Host-side veth name in the node netns (`vp{j}`).
    pub fn host_veth(&self) -> String {
        format!("vp{}", self.index)
    }
    /// `SocketAddr` of this pod's IP and `port`.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(self.ip(), port))
    }
}

/// The simulated cluster. See the module docs for the layout.
pub struct Topology {
    prefix: String,
    wire: Netns,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    /// Namespaces actually created (torn down in reverse order).
    created: Vec<String>,
    registered: bool,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 40
        && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
        && !n.starts_with('.')
}

impl Topology {
    /// Build the cluster. `nodes` = `[(node name, [pod names])]`; pod names
    /// must be unique across nodes and differ from node names and `wire`.
    pub fn build(prefix: &str, nodes: &[(&str, &[&str])]) -> anyhow::Result<Topology> {
        // SAFETY: no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("Topology::build needs root");
        }
        // No '-' in the prefix: `{prefix}-` must never match another
        // prefix's namespaces (stale cleanup removes everything matching).
        if prefix.is_empty()
            || prefix.len() > 20
            || !prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        {
            bail!("invalid prefix {prefix:?} (use 1-20 chars of [A-Za-z0-9_], e.g. unique_prefix(\"tag\"))");
        }
        if nodes.is_empty() || nodes.len() > 250 {
            bail!("need between 1 and 250 nodes, got {}", nodes.len());
        }
        let mut seen: HashSet<&str> = HashSet::new();
        seen.insert("wire");
        for (n, pods) in nodes {
            if !valid_name(n) || !seen.insert(n) {
                bail!("invalid or duplicate node name {n:?}");
            }
            if pods.len() > 240 {
                bail!("at most 240 pods per node ({n} has {})", pods.len());
            }
            for p in pods.iter() {
                if !valid_name(p) || !seen.insert(p) {
                    bail!("invalid or duplicate pod name {p:?}");
                }
            }
        }

        // Crash leftovers: our own prefix, and prefixes of dead processes.
        reap_dead_owners();
        destroy_prefix(prefix);
        std::fs::create_dir_all(REGISTRY_DIR).with_context(|| format!("mkdir {REGISTRY_DIR}"))?;
        let reg = Path::new(REGISTRY_DIR).join(prefix);
        std::fs::write(&reg, owner_tag()).with_context(|| format!("write {}", reg.display()))?;

        let mut topo = Topology {
            prefix: prefix.to_string(),
            wire: Netns::new(format!("{prefix}-wire")),
            nodes: Vec::new(),
            pods: Vec::new(),
            created: Vec::new(),
            registered: true,
        };
        for (i, (n, pods)) in nodes.iter().enumerate() {
            let index = (i + 1) as u8;
            topo.nodes.push(Node {
                name: n.to_string(),
                index,
                netns: Netns::new(format!("{prefix}-{n}")),
                pods: pods.iter().map(|p| p.to_string()).collect(),
            });
            for (j, p) in pods.iter().enumerate() {
                topo.pods.push(Pod {
                    name: p.to_string(),
                    node_name: n.to_string(),
                    node_index: index,
                    index: (j + 1) as u8,
                    netns: Netns::new(format!("{prefix}-{p}")),
                });
            }
        }
        // On error, `topo` is dropped here and removes what was created.
        topo.setup()
            .with_context(|| format!("building topology {prefix}"))?;
        Ok(topo)
    }

    fn add_netns(&mut self, ns: &Netns, forward: bool) -> anyhow::Result<()> {
        {
            let _lock = GlobalLock::acquire()?;
            run_cmd("ip", &["netns", "add", &ns.name])?;
        }
        self.created.push(ns.name.clone());
        ns.ip(&["link", "set", "lo", "up"])?;
        let fwd = if forward { "1" } else { "0" };
        ns.sysctls(&[
            // ip_forward first: changing it rewrites per-device settings.
            ("net/ipv4/ip_forward", fwd),
            ("net/ipv4/conf/all/rp_filter", "0"),
            ("net/ipv4/conf/default/rp_filter", "0"),
            ("net/ipv4/conf/lo/rp_filter", "0"),
        ])?;
        Ok(())
    }

    fn setup(&mut self) -> anyhow::Result<()> {
        let wire = self.wire.clone();
        self.add_netns(&wire, false)?;
        // Bridged frames must not go through (br_)netfilter in the wire netns.
        // These exist only if br_netfilter is loaded.
        for k in [
            "net/bridge/bridge-nf-call-iptables",
            "net/bridge/bridge-nf-call-ip6tables",
            "net/bridge/bridge-nf-call-arptables",
        ] {
            let _ = wire.sysctl(k, "0");
        }
        wire.ip(&["link", "add", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0"])?;
        wire.ip(&["link", "set", "br0", "up"])?;
        wire.sysctl("net/ipv4/conf/br0/rp_filter", "0")?;

        let nodes = self.nodes.clone();
        let pods = self.pods.clone();
        for node in &nodes {
            let ns = node.netns.clone();
            self.add_netns(&ns, true)?;
            let port = format!("n{}", node.index);
            wire.ip(&["link", "add", &port, "type", "veth", "peer", "name", NODE_LINK, "netns", &ns.name])?;
            wire.ip(&["link", "set", &port, "master", "br0"])?;
            wire.ip(&["link", "set", &port, "up"])?;
            wire.sysctl(&format!("net/ipv4/conf/{port}/rp_filter"), "0")?;
            ns.ip(&["addr", "add", &format!("{}/24", node.ip()), "dev", NODE_LINK])?;
            ns.ip(&["link", "set", NODE_LINK, "up"])?;
            ns.sysctl(&format!("net/ipv4/conf/{NODE_LINK}/rp_filter"), "0")?;
            for other in nodes.iter().filter(|o| o.index != node.index) {
                ns.ip(&[
                    "route",
                    "add",
                    &other.pod_cidr().to_string(),
                    "via",
                    &other.ip().to_string(),
                    "dev",
                    NODE_LINK,
                ])?;
            }
        }
        for pod in &pods {
            let node_ns = self.node(&pod.node_name).netns.clone();
            let ns = pod.netns.clone();
            self.add_netns(&ns, false)?;
            let vp = pod.host_veth();
            node_ns.ip(&[
                "link", "add", &vp, "address", GATEWAY_MAC, "type", "veth", "peer", "name", NODE_LINK, "netns",
                &ns.name,
            ])?;
            let ip = pod.ip().to_string();
            let gw = GATEWAY_IP.to_string();
            ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", NODE_LINK])?;
            ns.ip(&["link", "set", NODE_LINK, "up"])?;
            ns.sysctl(&format!("net/ipv4/conf/{NODE_LINK}/rp_filter"), "0")?;
            node_ns.ip(&["link", "set", &vp, "up"])?;
            node_ns.sysctls(&[
                (&format!("net/ipv4/conf/{vp}/rp_filter"), "0"),
                (&format!("net/ipv4/conf/{vp}/proxy_arp"), "1"),
                (&format!("net/ipv4/neigh/{vp}/proxy_delay"), "0"),
            ])?;
            node_ns.ip(&["route", "add", &format!("{ip}/32"), "dev", &vp])?;
            if pod.index == 1 {
                // Proxy ARP only answers for addresses the node has a unicast
                // route to via another device; without this (the node has no
                // default route) proxy ARP for the gateway would never answer.
                node_ns.ip(&["route", "add", &format!("{gw}/32"), "dev", "lo"])?;
            }
            ns.ip(&["route", "add", &gw, "dev", NODE_LINK, "scope", "link"])?;
            ns.ip(&["route", "add", "default", "via", &gw, "dev", NODE_LINK])?;
            ns.ip(&["neigh", "replace", &gw, "lladdr", GATEWAY_MAC, "dev", NODE_LINK, "nud", "permanent"])?;
        }
        Ok(())
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The `{prefix}-wire` netns holding the bridge `br0`.
    pub fn wire(&self) -> &Netns {
        &self.wire
    }

    /// Panics if there is no such node.
    pub fn node(&self, name: &str) -> &Node {
        self.nodes.iter().find(|n| n.name == name).unwrap_or_else(|| {
            panic!(
                "topology {}: no node {name:?} (nodes: {:?})",
                self.prefix,
                self.nodes.iter().map(|n| &n.name).collect::<Vec<_>>()
            )
        })
    }

    /// Panics if there is no such pod.
    pub fn pod(&self, name: &str) -> &Pod {
        self.pods.iter().find(|p| p.name == name).unwrap_or_else(|| {
            panic!(
                "topology {}: no pod {name:?} (pods: {:?})",
                self.prefix,
                self.pods.iter().map(|p| &p.name).collect::<Vec<_>>()
            )
        })
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// Names of all namespaces this topology created.
    pub fn netns_names(&self) -> &[String] {
        &self.created
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Pods first, then nodes, then the wire.
        for name in self.created.iter().rev() {
            if let Some(p) = destroy_netns(name) {
                eprintln!("harness: teardown of {}: {p}", self.prefix);
            }
        }
        self.created.clear();
        if self.registered {
            let _ = std::fs::remove_file(Path::new(REGISTRY_DIR).join(&self.prefix));
        }
    }
}

// ---------------------------------------------------------------------------
// EchoServer
// ---------------------------------------------------------------------------

#[derive(Default)]
struct EchoState {
    peers: Mutex<Vec<SocketAddr>>,
}

/// TCP echo server inside a netns (tokio tasks; aborted on Drop).
pub struct EchoServer {
    addr: SocketAddr,
    state: Arc<EchoState>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    /// Listen on `0.0.0.0:port` inside `netns` and echo every connection.
    /// Must be called inside a tokio runtime.
    pub fn start(netns: &Netns, port: u16) -> anyhow::Result<EchoServer> {
        Self::start_inner(netns, port, None)
    }

    /// Like `start`, but each connection first gets `name` + `\n`.
    pub fn start_named(netns: &Netns, port: u16, name: &str) -> anyhow::Result<EchoServer> {
        Self::start_inner(netns, port, Some(name.to_string()))
    }

    fn start_inner(netns: &Netns, port: u16, greeting: Option<String>) -> anyhow::Result<EchoServer> {
        require_tokio("EchoServer::start")?;
        let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
        let listener = netns.tcp_listener(addr)?;
        let addr = listener.local_addr().context("local_addr")?;
        let state = Arc::new(EchoState::default());
        let st = state.clone();
        let greeting: Option<Arc<[u8]>> = greeting.map(|g| format!("{g}\n").into_bytes().into());
        let task = tokio::spawn(async move {
            // Dropping the JoinSet (when this task is aborted) aborts all
            // connection tasks.
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        eprintln!("harness: echo server accept error: {e}");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if let Ok(mut p) = st.peers.lock() {
                    p.push(peer);
                }
                while conns.try_join_next().is_some() {}
                let greeting = greeting.clone();
                conns.spawn(async move {
                    let _ = echo_conn(stream, greeting).await;
                });
            }
        });
        Ok(EchoServer { addr, state, task })
    }

    /// The bound address (`0.0.0.0:port`).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// Peer address of every accepted connection, in accept order.
    pub fn peers(&self) -> Vec<SocketAddr> {
        self.state.peers.lock().map(|p| p.clone()).unwrap_or_default()
    }

    /// Number of accepted connections.
    pub fn connections(&self) -> usize {
        self.state.peers.lock().map(|p| p.len()).unwrap_or(0)
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn echo_conn(mut stream: TcpStream, greeting: Option<Arc<[u8]>>) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    if let Some(g) = greeting {
        stream.write_all(&g).await?;
    }
    let (mut rd, mut wr) = stream.split();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = rd.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        wr.write_all(&buf[..n]).await?;
    }
    wr.shutdown().await?;
    Ok(())
}

// ---------------------------------------------------------------------------
// Capture
// ---------------------------------------------------------------------------

/// One captured IPv4 TCP segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// TCP payload (truncated to what the 256-byte snaplen kept).
    pub payload: Vec<u8>,
    pub syn: bool,
    pub fin: bool,
    pub rst: bool,
}

impl Packet {
    /// Whether `needle` occurs in the (captured part of the) payload.
    pub fn contains(&self, needle: &[u8]) -> bool {
        !needle.is_empty() && self.payload.windows(needle.len()).any(|w| w == needle)
    }
}

static CAPTURE_COUNTER: AtomicU64 = AtomicU64::new(0);

/// `tcpdump` running inside a netns, writing to a temp pcap file.
pub struct Capture {
    child: Option<Child>,
    dir: PathBuf,
    file: PathBuf,
    log: PathBuf,
    what: String,
}

impl Capture {
    /// Capture TCP on `iface` inside `netns`. Returns once tcpdump is
    /// actually capturing.
    pub fn start(netns: &Netns, iface: &str) -> anyhow::Result<Capture> {
        Self::start_with_filter(netns, iface, "tcp")
    }

    /// Same with a custom pcap filter expression.
    pub fn start_with_filter(netns: &Netns, iface: &str, filter: &str) -> anyhow::Result<Capture> {
        let n = CAPTURE_COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("harness-cap-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let file = dir.join("cap.pcap");
        let log = dir.join("tcpdump.log");
        let what = format!("tcpdump on {iface} in netns {}", netns.name);
        let mut cap = Capture { child: None, dir, file, log, what };
        let file_s = cap.file.to_string_lossy().into_owned();
        let mut args = vec![
            "-i", iface, "-U", "-w", &file_s, "-s", "256",
            // Deliver packets as they come (no 1 s block timeout) and
            // keep root so the file can be written wherever it is.
            "--immediate-mode", "-Z", "root",
        ];
        args.extend(filter.split_whitespace());
        let child = netns.spawn_logged("tcpdump", &args, &[], &cap.log)?;
        cap.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = std::fs::read_to_string(&cap.log).unwrap_or_default();
            if log.contains("listening on") {
                break;
            }
            let child = cap.child.as_mut().context("tcpdump child")?;
            if let Some(st) = child.try_wait()? {
                bail!("{} exited ({st}) before capturing: {}", cap.what, log.trim());
            }
            if Instant::now() >= deadline {
                bail!("{} did not start capturing within 10s: {}", cap.what, log.trim());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(cap)
    }

    /// Stop tcpdump and return the captured IPv4 TCP packets.
    pub fn stop(mut self) -> anyhow::Result<Vec<Packet>> {
        // Give tcpdump a moment to drain the ring: on SIGINT it breaks out of
        // its loop and can drop what it hasn't read yet.
        std::thread::sleep(Duration::from_millis(150));
        if let Some(mut child) = self.child.take() {
            let _ = child.signal(libc::SIGINT);
            if child.wait_timeout(Duration::from_secs(5))?.is_none() {
                child.kill()?;
            }
        }
        let data = std::fs::read(&self.file)
            .with_context(|| format!("{}: read {}", self.what, self.file.display()))?;
        parse_pcap(&data).with_context(|| format!("{}: parse pcap", self.what))
    }

    /// tcpdump's stderr so far (its closing statistics after `stop`).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        drop(self.child.take());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Parse a classic pcap file (any endianness, µs or ns timestamps) with link
/// type Ethernet (1), Linux cooked v1 (113) / v2 (276) or raw IP (101, 12, 14)
/// into IPv4 TCP packets. A truncated final record is ignored.
pub fn parse_pcap(data: &[u8]) -> anyhow::Result<Vec<Packet>> {
    if data.len() < 24 {
        bail!("pcap file too short ({} bytes)", data.len());
    }
    let magic = [data[0], data[1], data[2], data[3]];
    let le = match magic {
        [0xd4, 0xc3, 0xb2, 0xa1] | [0x4d, 0x3c, 0xb2, 0xa1] => true,
        [0xa1, 0xb2, 0xc3, 0xd4] | [0xa1, 0xb2, 0x3c, 0x4d] => false,
        _ => bail!("not a classic pcap file (magic {magic:02x?}; pcapng is not supported)"),
    };
    let u32_at = |b: &[u8], o: usize| -> u32 {
        let a = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if le {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let linktype = u32_at(data, 20) & 0x0fff_ffff;
    let mut out = Vec::new();
    let mut off = 24;
    while off + 16 <= data.len() {
        let incl = u32_at(data, off + 8) as usize;
        let start = off + 16;
        let end = start.checked_add(incl).context("bad record length")?;
        if end > data.len() {
            break; // truncated final record
        }
        let frame = &data[start..end];
        off = end;
        let ip = match linktype {
            1 => {
                // Ethernet, possibly VLAN tagged.
                let mut o = 12;
                loop {
                    if frame.len() < o + 2 {
                        break None;
                    }
                    let et = u16::from_be_bytes([frame[o], frame[o + 1]]);
                    match et {
                        0x8100 | 0x88a8 => o += 4,
                        0x0800 => break Some(&frame[o + 2..]),
                        _ => break None,
                    }
                }
            }
            113 => (frame.len() >= 16 && frame[14..16] == [0x08, 0x00]).then(|| &frame[16..]),
            276 => (frame.len() >= 20 && frame[0..2] == [0x08, 0x00]).then(|| &frame[20..]),
            101 | 12 | 14 => Some(frame),
            other => bail!("unsupported pcap link type {other}"),
        };
        if let Some(ip) = ip {
            if let Some(p) = parse_ipv4_tcp(ip) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

fn parse_ipv4_tcp(ip: &[u8]) -> Option<Packet> {
    if ip.len() < 20 || ip[0] >> 4 != 4 || ip[9] != 6 {
        return None;
    }
    let ihl = ((ip[0] & 0x0f) as usize) * 4;
    // Only the first fragment carries the TCP header.
    let frag_off = u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff;
    if ihl < 20 || frag_off != 0 {
        return None;
    }
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    // total == 0 happens for (BIG TCP) GSO super-packets; use what we have.
    let ip_end = if total == 0 { ip.len() } else { total.min(ip.len()) };
    if ip_end < ihl + 20 {
        return None;
    }
    let tcp = &ip[ihl..ip_end];
    let src_ip = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst_ip = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let sport = u16::from_be_bytes([tcp[0], tcp[1]]);
    let dport = u16::from_be_bytes([tcp[2], tcp[3]]);
    let doff = ((tcp[12] >> 4) as usize) * 4;
    let flags = tcp[13];
    let payload = if doff >= 20 && doff <= tcp.len() { tcp[doff..].to_vec() } else { Vec::new() };
    Some(Packet {
        src: SocketAddr::V4(SocketAddrV4::new(src_ip, sport)),
        dst: SocketAddr::V4(SocketAddrV4::new(dst_ip, dport)),
        payload,
        syn: flags & 0x02 != 0,
        fin: flags & 0x01 != 0,
        rst: flags & 0x04 != 0,
    })
}

