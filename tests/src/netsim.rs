//! Simulated cluster on network namespaces for end-to-end tests and the demo.
//!
//! | what            | netns            | address (IPv4; IPv6)                                    |
//! |-----------------|------------------|---------------------------------------------------------|
//! | the network     | `{p}-wire`       | bridge br0                                              |
//! | node i          | `{p}-n{i}`       | eth0 10.0.0.i/24; fd00::i/64 (the node link)            |
//! | pod j on node i | `{p}-n{i}p{j}`   | eth0 10.10.i.(10+j)/32, gw 169.254.1.1; fd00:10:i::(10+j)/128, gw fe80::1 |
//!
//! Nodes route their pods' /32s (/128s) to the pod veths and other nodes' 10.10.k.0/24
//! (fd00:10:k::/64) via 10.0.0.k (fd00::k). `ZTUNNEL_TEST_IP_FAMILY` (v4, the default; v6;
//! dual) picks which of the two each pod and node gets ([`ip_family`]); suites that honour
//! it (l4) take addresses from the topology (`Pod::ip`, [`vip`], [`vips_yaml`]) rather
//! than writing them. Everything is removed on drop, also when a test panics.
//!
//! `Topology::build_networks` splits the nodes into networks joined only through a
//! gateway netns `{p}-gw` (see there).

use std::collections::HashMap;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

#[derive(Clone, Debug)]
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.name))
    }

    pub fn exec(&self, program: &str, args: &[&str]) -> Result<String> {
        let mut full = vec!["netns", "exec", &self.name, program];
        full.extend_from_slice(args);
        sh("ip", &full)
    }

    /// Runs `f` on a thread inside this netns; sockets made there stay in it.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        let ns = File::open(self.path()).with_context(|| format!("open netns {}", self.name))?;
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
                Ok(f())
            })
            .join()
            .map_err(|_| anyhow::anyhow!("netns thread panicked"))?
        })
    }

    /// A listener on every address of the tests' family (IPv6 and dual: `[::]`, which
    /// takes IPv4 too, v4-mapped).
    pub fn listen(&self, port: u16) -> Result<TcpListener> {
        let any: IpAddr = if ip_family() == IpFamily::V4 {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        self.listen_on(SocketAddr::new(any, port))
    }

    pub fn listen_on(&self, addr: SocketAddr) -> Result<TcpListener> {
        let l = self.run(|| std::net::TcpListener::bind(addr))??;
        l.set_nonblocking(true)?;
        Ok(TcpListener::from_std(l)?)
    }

    pub async fn connect(&self, addr: SocketAddr) -> Result<TcpStream> {
        let s = self.run(|| std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5)))?;
        let s = s.with_context(|| format!("connect to {addr} from {}", self.name))?;
        s.set_nonblocking(true)?;
        Ok(TcpStream::from_std(s)?)
    }

    /// Starts a process inside the netns, output appended to `log`; killed on drop.
    pub fn spawn(
        &self,
        program: &str,
        args: &[&str],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Result<Child> {
        let f = File::create(log)?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.name, program])
            .args(args)
            .stdin(Stdio::null());
        cmd.stdout(f.try_clone()?).stderr(f);
        for (k, v) in env {
            cmd.env(k, v);
        }
        Ok(Child {
            inner: Some(cmd.spawn().with_context(|| format!("spawn {program}"))?),
            log: log.to_path_buf(),
        })
    }
}

pub struct Child {
    inner: Option<std::process::Child>,
    pub log: PathBuf,
}

impl Child {
    /// The log so far; if it cannot be read, a line saying why (so a wait that times out
    /// on it shows the reason, not an empty log).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log.display()))
    }

    /// Waits for `needle` in the log; fails at once, with the log, if the process exits
    /// before writing it (a start that failed need not wait out the timeout).
    pub fn wait_log(&self, needle: &str, timeout: Duration) -> Result<()> {
        wait_for(
            &format!("{needle:?} in {}", self.log.display()),
            timeout,
            || self.log_text().contains(needle) || self.exited(),
        )
        .with_context(|| format!("log:\n{}", self.log_text()))?;
        // Read again after the exit was seen: its last lines are written by then.
        if !self.log_text().contains(needle) {
            anyhow::bail!(
                "the process exited before {needle:?} in {}; log:\n{}",
                self.log.display(),
                self.log_text()
            );
        }
        Ok(())
    }

    /// Whether the process has exited (a zombie not yet reaped, or gone), from /proc:
    /// the state after the command name in `/proc/<pid>/stat`.
    pub fn exited(&self) -> bool {
        let Some(pid) = self.pid() else {
            return true;
        };
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_some_and(|state| state == "Z" || state == "X"),
            Err(_) => true,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.inner.as_ref().map(|c| c.id())
    }

    /// CPU time (user + system) the process has used so far (`ip netns exec` execs the
    /// program, so the pid is the program's).
    pub fn cpu_time(&self) -> Option<Duration> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid()?)).ok()?;
        // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()??
            .max(1) as u64;
        Some(Duration::from_micros(ticks * 1_000_000 / hz))
    }

    /// Sends SIGTERM without waiting.
    pub fn terminate(&self) -> Result<()> {
        let pid = self
            .inner
            .as_ref()
            .map(|c| c.id())
            .context("process already reaped")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        Ok(())
    }

    /// Waits up to `timeout` for the process to exit; its status if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        let c = self.inner.as_mut()?;
        // Looks at least once: a zero timeout asks "has it exited?" (the bench's liveness check).
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.inner.take() {
            terminate(&mut c);
        }
    }
}

/// Ends a process as its pod's kubelet would: SIGTERM, then SIGKILL after 3 s.
pub fn terminate(c: &mut std::process::Child) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = c.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = c.kill();
    let _ = c.wait();
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    bail!("timed out waiting for {what}")
}

pub struct Pod {
    pub name: String,
    pub node: usize,
    /// The address tests reach the pod at: its IPv4 one in a v4 topology, its IPv6 one
    /// in a v6 or dual-stack one.
    pub ip: IpAddr,
    /// All its addresses (dual-stack: IPv4 first, as Kubernetes lists them).
    pub ips: Vec<IpAddr>,
    pub netns: Netns,
}

impl Pod {
    /// The pod's address of `ip`'s family, if it has one.
    pub fn ip_like(&self, ip: IpAddr) -> Option<IpAddr> {
        self.ips
            .iter()
            .copied()
            .find(|a| a.is_ipv6() == ip.is_ipv6())
    }
}

/// Which address families the topology has: `ZTUNNEL_TEST_IP_FAMILY` = v4 (default), v6
/// or dual.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IpFamily {
    V4,
    V6,
    Dual,
}

impl IpFamily {
    pub fn has_v4(self) -> bool {
        self != IpFamily::V6
    }

    pub fn has_v6(self) -> bool {
        self != IpFamily::V4
    }
}

pub fn ip_family() -> IpFamily {
    match std::env::var("ZTUNNEL_TEST_IP_FAMILY").as_deref() {
        Err(_) | Ok("") | Ok("v4") => IpFamily::V4,
        Ok("v6") => IpFamily::V6,
        Ok("dual") => IpFamily::Dual,
        Ok(other) => panic!("ZTUNNEL_TEST_IP_FAMILY={other:?}: expected v4, v6 or dual"),
    }
}

/// Service VIP number `n` in the tests' family: 10.96.0.n, or fd00:96::n (written with
/// n's decimal digits) in a v6 or dual-stack topology.
pub fn vip(n: u8) -> IpAddr {
    match ip_family() {
        IpFamily::V4 => Ipv4Addr::new(10, 96, 0, n).into(),
        IpFamily::V6 | IpFamily::Dual => v6_vip(n),
    }
}

fn v6_vip(n: u8) -> IpAddr {
    format!("fd00:96::{n}")
        .parse()
        .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED))
}

/// The `vips` list of a service with VIP number `n`: both families' VIPs in a dual-stack
/// topology (the tests dial [`vip`]).
pub fn vips_yaml(n: u8) -> String {
    match ip_family() {
        IpFamily::V4 => format!("[\"/10.96.0.{n}\"]"),
        IpFamily::V6 => format!("[\"/{}\"]", v6_vip(n)),
        IpFamily::Dual => format!("[\"/10.96.0.{n}\", \"/{}\"]", v6_vip(n)),
    }
}

/// Node `i`'s address on the node link in the tests' family.
pub fn node_ip(i: usize) -> IpAddr {
    match ip_family() {
        IpFamily::V4 => Ipv4Addr::new(10, 0, 0, i as u8).into(),
        IpFamily::V6 | IpFamily::Dual => format!("fd00::{i}")
            .parse()
            .unwrap_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED)),
    }
}

pub struct Topology {
    pub prefix: String,
    pub wire: Netns,
    pub nodes: Vec<Netns>,
    pub pods: Vec<Pod>,
    pub dir: PathBuf,
    /// A bpf filesystem of this topology's own, for ztunnels' eBPF pins (`ip netns exec`
    /// hides the host's /sys/fs/bpf). Unmounted on drop, which drops every pin in it.
    pub bpffs: PathBuf,
    /// With `build_networks`: each node's network (`net0`, `net1`, ...) and the gateway
    /// netns between them; empty and None for one network.
    pub networks: Vec<String>,
    pub gateway: Option<Netns>,
}

/// Fails if a ztunnel asked for eBPF capture fell back to nftables: the tests must
/// exercise the mode they claim to.
pub fn check_capture_mode(z: &Child) -> Result<()> {
    let log = z.log_text();
    let want = format!("capture={}", capture_mode());
    let want_json = format!("\"capture\":\"{}\"", capture_mode());
    if !log.contains(&want) && !log.contains(&want_json) {
        bail!("ztunnel is not running with {want}:\n{log}");
    }
    Ok(())
}

/// Records that the calling test does not check what its name says in this run (another
/// IP family, capture mode, no privilege), and why; the test then returns `Ok(())`:
/// `return skipped("IPv4 only")`. A test that returns early passes in libtest's count,
/// so this writes `SKIPPED: <test>: <why>` on stderr past the harness's capture (it shows
/// for a passing test) and appends it to the file `ZTUNNEL_TEST_SKIPS` names, if set:
/// `scripts/test.sh` counts and lists them at the end (docs/testing.md, "Skipped tests").
pub fn skipped(why: &str) -> Result<()> {
    use std::io::Write;
    let thread = std::thread::current();
    let line = format!(
        "SKIPPED: {}: {why} (ip family {:?}, capture {})\n",
        thread.name().unwrap_or("?"),
        ip_family(),
        capture_mode()
    );
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("ZTUNNEL_TEST_SKIPS") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("{path:?}"))?;
        f.write_all(line.as_bytes())?;
    }
    Ok(())
}

/// The capture mode the e2e tests run ztunnel with: ZTUNNEL_TEST_CAPTURE, default ebpf.
pub fn capture_mode() -> String {
    std::env::var("ZTUNNEL_TEST_CAPTURE").unwrap_or_else(|_| "ebpf".into())
}

impl Topology {
    /// ztunnel arguments selecting the test capture mode and node `n`'s pin directory.
    pub fn capture_args(&self, n: usize) -> Vec<String> {
        vec![
            "--capture".into(),
            capture_mode(),
            "--bpf-pin-dir".into(),
            self.bpffs.join(format!("node{n}")).display().to_string(),
        ]
    }
}

fn remove_prefixed(prefix: &str) {
    if let Ok(list) = sh("ip", &["netns", "list"]) {
        for line in list.lines() {
            if let Some(name) = line.split_whitespace().next() {
                if name.starts_with(&format!("{prefix}-")) {
                    let _ = sh("ip", &["netns", "del", name]);
                }
            }
        }
    }
}

impl Topology {
    /// `pods_per_node[i]` pods on node i+1. Pod names are `n{i}p{j}`. The addresses are of
    /// the tests' family ([`ip_family`]).
    pub fn build(prefix: &str, pods_per_node: &[usize]) -> Result<Topology> {
        Self::build_family(prefix, pods_per_node, ip_family())
    }

    /// [`Topology::build`] with the address families given (a test about dual-stack pods
    /// runs in every run).
    pub fn build_family(
        prefix: &str,
        pods_per_node: &[usize],
        family: IpFamily,
    ) -> Result<Topology> {
        if !nix::unistd::Uid::effective().is_root() {
            bail!("end-to-end tests need root (network namespaces); run them as root");
        }
        claim(prefix)?;
        let dir = std::env::temp_dir().join(format!("ztunnel-e2e-{prefix}"));
        record_for_cleanup(prefix, &dir)?;
        let bpffs = dir.join("bpf");
        let mut topo = Topology {
            prefix: prefix.into(),
            wire: Netns {
                name: format!("{prefix}-wire"),
            },
            nodes: vec![],
            pods: vec![],
            dir: dir.clone(),
            bpffs,
            networks: vec![],
            gateway: None,
        };
        // From here on, Drop cleans up whatever was created (and releases the prefix).
        // What a run that was killed left behind goes first.
        remove_prefixed(prefix);
        let _ = Command::new("umount")
            .args(["-l", &dir.join("bpf").display().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        std::fs::create_dir_all(&topo.bpffs)?;
        sh(
            "mount",
            &["-t", "bpf", "bpf", &topo.bpffs.display().to_string()],
        )?;
        let add = |name: &str| -> Result<Netns> {
            sh("ip", &["netns", "add", name])?;
            let ns = Netns { name: name.into() };
            ns.exec("ip", &["link", "set", "lo", "up"])?;
            for k in ["all", "default"] {
                ns.exec(
                    "sysctl",
                    &["-qw", &format!("net.ipv4.conf.{k}.rp_filter=0")],
                )?;
                // No duplicate address detection: addresses are usable at once (no
                // tentative seconds), and the topology has no duplicates to detect.
                ns.exec(
                    "sysctl",
                    &["-qw", &format!("net.ipv6.conf.{k}.accept_dad=0")],
                )?;
            }
            Ok(ns)
        };
        // Before `ip link set up`: an interface made in one netns and moved to another
        // keeps the settings it was made with.
        let no_dad = |ns: &Netns, ifname: &str| {
            ns.exec(
                "sysctl",
                &["-qw", &format!("net.ipv6.conf.{ifname}.accept_dad=0")],
            )
        };
        let wire = add(&topo.wire.name)?;
        wire.exec(
            "ip",
            &[
                "link",
                "add",
                "br0",
                "type",
                "bridge",
                "mcast_snooping",
                "0",
            ],
        )?;
        wire.exec("ip", &["link", "set", "br0", "up"])?;
        for (i, &npods) in pods_per_node.iter().enumerate() {
            let i = i + 1;
            let node = add(&format!("{prefix}-n{i}"))?;
            topo.nodes.push(node.clone());
            sh(
                "ip",
                &[
                    "-n",
                    &node.name,
                    "link",
                    "add",
                    "eth0",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &format!("p{i}"),
                    "netns",
                    &wire.name,
                ],
            )?;
            wire.exec(
                "ip",
                &["link", "set", &format!("p{i}"), "master", "br0", "up"],
            )?;
            no_dad(&node, "eth0")?;
            if family.has_v4() {
                node.exec(
                    "ip",
                    &["addr", "add", &format!("10.0.0.{i}/24"), "dev", "eth0"],
                )?;
            }
            if family.has_v6() {
                node.exec(
                    "ip",
                    &[
                        "addr",
                        "add",
                        &format!("fd00::{i}/64"),
                        "dev",
                        "eth0",
                        "nodad",
                    ],
                )?;
            }
            node.exec("ip", &["link", "set", "eth0", "up"])?;
            node.exec("sysctl", &["-qw", "net.ipv4.ip_forward=1"])?;
            node.exec("sysctl", &["-qw", "net.ipv6.conf.all.forwarding=1"])?;
            for j in 1..=npods {
                let v4 = IpAddr::V4(Ipv4Addr::new(10, 10, i as u8, 10 + j as u8));
                let v6: IpAddr = format!("fd00:10:{i}::{}", 10 + j).parse()?;
                let ips: Vec<IpAddr> = match family {
                    IpFamily::V4 => vec![v4],
                    IpFamily::V6 => vec![v6],
                    IpFamily::Dual => vec![v4, v6],
                };
                let pod = add(&format!("{prefix}-n{i}p{j}"))?;
                let veth = format!("vp{j}");
                sh(
                    "ip",
                    &[
                        "-n", &node.name, "link", "add", &veth, "type", "veth", "peer", "name",
                        "eth0", "netns", &pod.name,
                    ],
                )?;
                no_dad(&node, &veth)?;
                no_dad(&pod, "eth0")?;
                // Calico style: every pod's gateway is 169.254.1.1 (IPv6: fe80::1) on its own veth.
                node.exec("ip", &["addr", "add", "169.254.1.1/32", "dev", &veth])?;
                if family.has_v6() {
                    node.exec("ip", &["addr", "add", "fe80::1/64", "dev", &veth, "nodad"])?;
                }
                node.exec("ip", &["link", "set", &veth, "up"])?;
                for ip in &ips {
                    let host = if ip.is_ipv4() { 32 } else { 128 };
                    node.exec(
                        "ip",
                        &["route", "add", &format!("{ip}/{host}"), "dev", &veth],
                    )?;
                    pod.exec(
                        "ip",
                        &[
                            "addr",
                            "add",
                            &format!("{ip}/{host}"),
                            "dev",
                            "eth0",
                            "nodad",
                        ],
                    )?;
                }
                pod.exec("ip", &["link", "set", "eth0", "up"])?;
                pod.exec("sysctl", &["-qw", "net.ipv4.conf.eth0.rp_filter=0"])?;
                pod.exec("sysctl", &["-qw", "net.ipv4.conf.lo.rp_filter=0"])?;
                if family.has_v4() {
                    pod.exec(
                        "ip",
                        &[
                            "route",
                            "add",
                            "169.254.1.1",
                            "dev",
                            "eth0",
                            "scope",
                            "link",
                        ],
                    )?;
                    pod.exec(
                        "ip",
                        &[
                            "route",
                            "add",
                            "default",
                            "via",
                            "169.254.1.1",
                            "dev",
                            "eth0",
                        ],
                    )?;
                }
                if family.has_v6() {
                    pod.exec(
                        "ip",
                        &[
                            "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0",
                        ],
                    )?;
                }
                let ip = if family.has_v6() { v6 } else { v4 };
                topo.pods.push(Pod {
                    name: format!("n{i}p{j}"),
                    node: i,
                    ip,
                    ips,
                    netns: pod,
                });
            }
        }
        for (i, node) in topo.nodes.iter().enumerate() {
            for k in 1..=topo.nodes.len() {
                if k != i + 1 {
                    if family.has_v4() {
                        node.exec(
                            "ip",
                            &[
                                "route",
                                "add",
                                &format!("10.10.{k}.0/24"),
                                "via",
                                &format!("10.0.0.{k}"),
                            ],
                        )?;
                    }
                    if family.has_v6() {
                        node.exec(
                            "ip",
                            &[
                                "-6",
                                "route",
                                "add",
                                &format!("fd00:10:{k}::/64"),
                                "via",
                                &format!("fd00::{k}"),
                            ],
                        )?;
                    }
                }
            }
        }
        Ok(topo)
    }

    /// Nodes in separate networks, joined only through a gateway netns: `networks[n]` is
    /// the pods per node of network `net{n}` (nodes and pods numbered on across the
    /// networks, as `build` numbers them). Network n's nodes share bridge `br{n}` (the
    /// first network keeps br0) and route only to their own network's pods; a node of
    /// network n > 0 also has 10.0.n.i on its link. The gateway netns `{p}-gw` has a leg
    /// on each bridge (`eth{n}`, 10.0.n.254/24) with routes to every network's pods, and
    /// does not forward: one network reaches another's pods only through a process
    /// listening in the gateway netns (`gateway_ip`).
    pub fn build_networks(prefix: &str, networks: &[&[usize]]) -> Result<Topology> {
        let per_node: Vec<usize> = networks.iter().flat_map(|n| n.iter().copied()).collect();
        let mut topo = Topology::build(prefix, &per_node)?;
        topo.networks = networks
            .iter()
            .enumerate()
            .flat_map(|(n, nodes)| std::iter::repeat_n(format!("net{n}"), nodes.len()))
            .collect();
        let gw = Netns {
            name: format!("{prefix}-gw"),
        };
        sh("ip", &["netns", "add", &gw.name])?;
        topo.gateway = Some(gw.clone());
        gw.exec("ip", &["link", "set", "lo", "up"])?;
        for k in ["all", "default"] {
            gw.exec(
                "sysctl",
                &["-qw", &format!("net.ipv4.conf.{k}.rp_filter=0")],
            )?;
        }
        gw.exec("sysctl", &["-qw", "net.ipv4.ip_forward=0"])?;
        for n in 0..networks.len() {
            let bridge = format!("br{n}");
            if n > 0 {
                topo.wire
                    .exec("ip", &["link", "add", &bridge, "type", "bridge"])?;
                topo.wire.exec("ip", &["link", "set", &bridge, "up"])?;
            }
            let leg = format!("eth{n}");
            sh(
                "ip",
                &[
                    "-n",
                    &gw.name,
                    "link",
                    "add",
                    &leg,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &format!("g{n}"),
                    "netns",
                    &topo.wire.name,
                ],
            )?;
            topo.wire.exec(
                "ip",
                &["link", "set", &format!("g{n}"), "master", &bridge, "up"],
            )?;
            gw.exec(
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/24", Topology::gateway_ip(n)),
                    "dev",
                    &leg,
                ],
            )?;
            gw.exec("ip", &["link", "set", &leg, "up"])?;
        }
        let net_of = |i: usize| {
            topo.networks[i - 1]
                .trim_start_matches("net")
                .parse::<usize>()
                .unwrap_or(0)
        };
        for i in 1..=topo.nodes.len() {
            let n = net_of(i);
            let node = topo.node(i);
            if n > 0 {
                topo.wire.exec(
                    "ip",
                    &["link", "set", &format!("p{i}"), "master", &format!("br{n}")],
                )?;
                node.exec(
                    "ip",
                    &["addr", "add", &format!("10.0.{n}.{i}/24"), "dev", "eth0"],
                )?;
            }
            gw.exec(
                "ip",
                &[
                    "route",
                    "add",
                    &format!("10.10.{i}.0/24"),
                    "via",
                    &format!("10.0.{n}.{i}"),
                    "dev",
                    &format!("eth{n}"),
                ],
            )?;
            for k in (1..=topo.nodes.len()).filter(|&k| k != i && net_of(k) != n) {
                node.exec("ip", &["route", "del", &format!("10.10.{k}.0/24")])?;
            }
        }
        Ok(topo)
    }

    /// The gateway netns's address in network n (`build_networks`).
    pub fn gateway_ip(n: usize) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, n as u8, 254)
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn node(&self, i: usize) -> &Netns {
        &self.nodes[i - 1]
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        remove_prefixed(&self.prefix);
        let _ = sh("umount", &["-l", &self.bpffs.display().to_string()]);
        // ZTUNNEL_TEST_KEEP_LOGS=DIR keeps each test's logs for debugging.
        if let Some(keep) = std::env::var_os("ZTUNNEL_TEST_KEEP_LOGS") {
            let to = PathBuf::from(keep).join(&self.prefix);
            let _ = std::fs::create_dir_all(&to);
            for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
                if e.path().extension().is_some_and(|x| x == "log") {
                    let _ = std::fs::copy(e.path(), to.join(e.file_name()));
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        release(&self.prefix);
    }
}

/// Echo server in a pod. With a name it first sends "name\n" (to tell backends apart).
pub struct EchoServer {
    pub peers: Arc<Mutex<Vec<SocketAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoServer {
    pub fn start(ns: &Netns, port: u16, name: Option<&str>) -> Result<EchoServer> {
        Self::serve(ns.listen(port)?, name)
    }

    /// Echoes on a listener of the caller's.
    pub fn serve(l: TcpListener, name: Option<&str>) -> Result<EchoServer> {
        let peers = Arc::new(Mutex::new(Vec::new()));
        let p = peers.clone();
        let greeting = name.map(|n| format!("{n}\n"));
        let task = tokio::spawn(async move {
            while let Ok((mut s, peer)) = l.accept().await {
                // A dual-stack listener sees IPv4 clients v4-mapped: record them as IPv4.
                p.lock()
                    .unwrap()
                    .push(SocketAddr::new(peer.ip().to_canonical(), peer.port()));
                let greeting = greeting.clone();
                tokio::spawn(async move {
                    if let Some(g) = greeting {
                        if s.write_all(g.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        Ok(EchoServer { peers, task })
    }

    pub fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().unwrap().clone()
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// /etc/netns/<netns>/resolv.conf, which `ip netns exec` shows the pod's processes as
/// /etc/resolv.conf (their resolver asks that nameserver; ztunnel's DNS proxy captures
/// port 53 for the mesh's names); removed on drop.
pub struct PodResolvConf(PathBuf);

impl PodResolvConf {
    pub fn write(netns: &Netns, text: &str) -> Result<PodResolvConf> {
        let dir = Path::new("/etc/netns").join(&netns.name);
        let _ = std::fs::remove_dir_all(&dir);
        let guard = PodResolvConf(dir.clone());
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("resolv.conf"), text)?;
        Ok(guard)
    }
}

impl Drop for PodResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A small authoritative DNS server in a netns (UDP port 53): A questions for the names
/// it was given get their addresses (TTL 60), other names NXDOMAIN, other types an empty
/// answer. It counts the questions per name, so a test can see what a cache saved.
pub struct DnsResponder {
    asked: Arc<Mutex<HashMap<String, usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl DnsResponder {
    /// `records`: (name without the trailing dot, its IPv4 addresses).
    pub fn start(ns: &Netns, records: &[(&str, &[Ipv4Addr])]) -> Result<DnsResponder> {
        let sock = ns.run(|| std::net::UdpSocket::bind("0.0.0.0:53"))??;
        sock.set_nonblocking(true)?;
        let sock = tokio::net::UdpSocket::from_std(sock)?;
        let records: HashMap<String, Vec<Ipv4Addr>> = records
            .iter()
            .map(|(n, a)| (n.to_ascii_lowercase(), a.to_vec()))
            .collect();
        let asked = Arc::new(Mutex::new(HashMap::new()));
        let seen = asked.clone();
        let task = tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            while let Ok((n, peer)) = sock.recv_from(&mut buf).await {
                if let Some((name, answer)) = dns_answer(&buf[..n], &records) {
                    *seen.lock().unwrap().entry(name).or_insert(0) += 1;
                    let _ = sock.send_to(&answer, peer).await;
                }
            }
        });
        Ok(DnsResponder { asked, task })
    }

    /// How many questions (any type) named `name` (without the trailing dot).
    pub fn asked(&self, name: &str) -> usize {
        self.asked.lock().unwrap().get(name).copied().unwrap_or(0)
    }
}

impl Drop for DnsResponder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The answer to one DNS query (RFC 1035 wire format), and the name asked.
fn dns_answer(q: &[u8], records: &HashMap<String, Vec<Ipv4Addr>>) -> Option<(String, Vec<u8>)> {
    let mut labels = Vec::new();
    let mut i = 12;
    loop {
        let len = usize::from(*q.get(i)?);
        i += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + len)?).to_ascii_lowercase());
        i += len;
    }
    let question = q.get(12..i + 4)?;
    let qtype = u16::from_be_bytes([q[i], q[i + 1]]);
    let name = labels.join(".");
    let addrs = records.get(&name);
    let answers: &[Ipv4Addr] = match (addrs, qtype) {
        (Some(a), 1) => a,
        _ => &[],
    };
    let rcode = if addrs.is_some() { 0 } else { 3 };
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&q[0..2]);
    // QR, RD copied, RA; AA.
    out.extend_from_slice(&[0x84 | (q[2] & 0x01), 0x80 | rcode]);
    out.extend_from_slice(&[0, 1]);
    out.extend_from_slice(&(answers.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    out.extend_from_slice(question);
    for a in answers {
        // The question's name (pointer to offset 12), A, IN, TTL 60, 4 bytes.
        out.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        out.extend_from_slice(&a.octets());
    }
    Some((name, out))
}

/// Writes `data` while reading, half-closes, and returns everything read until EOF.
pub async fn echo_roundtrip(s: &mut TcpStream, data: &[u8]) -> Result<Vec<u8>> {
    let (mut r, mut w) = s.split();
    let write = async {
        w.write_all(data).await?;
        w.shutdown().await?;
        Ok::<_, std::io::Error>(())
    };
    let read = async {
        let mut out = Vec::with_capacity(data.len());
        r.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    };
    let (w, out) = tokio::join!(write, read);
    w?;
    Ok(out?)
}

pub async fn read_line(s: &mut TcpStream) -> Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        if s.read(&mut b).await? == 0 {
            break;
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
    }
    Ok(String::from_utf8_lossy(&line).to_string())
}

/// Deterministic pseudo-random bytes (xorshift), fast enough for 100 MiB.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A packet capture (tcpdump) on an interface inside a netns.
pub struct Capture {
    child: Child,
    file: PathBuf,
}

pub struct Packet {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub payload: Vec<u8>,
}

impl Capture {
    pub fn start(ns: &Netns, iface: &str, dir: &Path) -> Result<Capture> {
        let file = dir.join(format!("{}-{iface}.pcap", ns.name));
        let log = dir.join(format!("{}-{iface}.tcpdump.log", ns.name));
        let f = file.to_string_lossy().to_string();
        let child = ns.spawn(
            "tcpdump",
            &[
                "-i",
                iface,
                "-U",
                "--immediate-mode",
                "-n",
                "-Z",
                "root",
                "-s",
                "2048",
                "-w",
                &f,
                "tcp",
            ],
            &[],
            &log,
        )?;
        child.wait_log("listening on", Duration::from_secs(10))?;
        Ok(Capture { child, file })
    }

    pub fn stop(mut self) -> Result<Vec<Packet>> {
        std::thread::sleep(Duration::from_millis(200));
        self.child.stop();
        parse_pcap(&std::fs::read(&self.file)?)
    }
}

fn parse_pcap(b: &[u8]) -> Result<Vec<Packet>> {
    if b.len() < 24 {
        bail!("pcap too short");
    }
    let le = b[0..4] == [0xd4, 0xc3, 0xb2, 0xa1];
    let u32at = |o: usize| -> u32 {
        let a = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if le {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let linktype = u32at(20);
    let l2 = match linktype {
        1 => 14,
        113 => 16,
        other => bail!("unsupported pcap link type {other}"),
    };
    let mut out = Vec::new();
    let mut o = 24;
    while o + 16 <= b.len() {
        let incl = u32at(o + 8) as usize;
        let pkt = &b[o + 16..(o + 16 + incl).min(b.len())];
        o += 16 + incl;
        if pkt.len() < l2 + 20 {
            continue;
        }
        let ip = &pkt[l2..];
        // IPv4 with TCP, or IPv6 whose next header is TCP (no extension headers here).
        let (ihl, total, src_ip, dst_ip): (usize, usize, IpAddr, IpAddr) = match ip[0] >> 4 {
            4 if ip[9] == 6 => {
                let ihl = (ip[0] & 0xf) as usize * 4;
                let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
                (
                    ihl,
                    total,
                    Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]).into(),
                    Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]).into(),
                )
            }
            6 if ip.len() >= 40 && ip[6] == 6 => {
                let octets =
                    |at: usize| -> [u8; 16] { ip[at..at + 16].try_into().unwrap_or_default() };
                let total = 40 + u16::from_be_bytes([ip[4], ip[5]]) as usize;
                (
                    40,
                    total,
                    Ipv6Addr::from(octets(8)).into(),
                    Ipv6Addr::from(octets(24)).into(),
                )
            }
            _ => continue,
        };
        if ip.len() < ihl + 20 {
            continue;
        }
        let tcp = &ip[ihl..];
        let doff = (tcp[12] >> 4) as usize * 4;
        let src = SocketAddr::new(src_ip, u16::from_be_bytes([tcp[0], tcp[1]]));
        let dst = SocketAddr::new(dst_ip, u16::from_be_bytes([tcp[2], tcp[3]]));
        let end = total.min(ip.len());
        let payload = if ihl + doff < end {
            ip[ihl + doff..end].to_vec()
        } else {
            Vec::new()
        };
        out.push(Packet { src, dst, payload });
    }
    Ok(out)
}

pub const READY: Duration = Duration::from_secs(20);

/// Names a test's namespaces, links and files: `tag` must be unique in the test binary
/// (suites run side by side in one process; a second Topology with the same prefix
/// would remove the first one's namespaces and files mid-test: `Topology::build`
/// refuses a prefix that is in use). The whole process id keeps test processes that run
/// side by side (scripts/test.sh runs several) apart.
pub fn prefix(tag: &str) -> String {
    format!("z{}{tag}", std::process::id())
}

/// Prefixes of the topologies alive in this process.
static LIVE: std::sync::Mutex<std::collections::BTreeSet<String>> =
    std::sync::Mutex::new(std::collections::BTreeSet::new());

fn claim(prefix: &str) -> Result<()> {
    if !LIVE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(prefix.to_string())
    {
        bail!("prefix {prefix:?} belongs to a topology alive in this process (another test with the same tag): give this test a tag of its own");
    }
    Ok(())
}

/// Appends `prefix dir` to the file `ZTUNNEL_TEST_PREFIXES` names, if set: what a
/// killed run leaves (this prefix's network namespaces, the bpf filesystem mounted under
/// `dir`, `dir`) is then known exactly to `scripts/test.sh`'s cleanup on Ctrl-C, with no
/// guessing at names other runs on the machine may use.
fn record_for_cleanup(prefix: &str, dir: &Path) -> Result<()> {
    use std::io::Write;
    if let Some(path) = std::env::var_os("ZTUNNEL_TEST_PREFIXES") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("{path:?}"))?;
        f.write_all(format!("{prefix} {}\n", dir.display()).as_bytes())?;
    }
    Ok(())
}

fn release(prefix: &str) {
    LIVE.lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(prefix);
}

/// Workload YAML for a pod (all its addresses); uid = pod name; its node's network, if the
/// topology has several.
pub fn workload(topo: &Topology, pod: &str, sa: &str, extra: &str) -> String {
    workload_with_protocol(topo, pod, sa, "HBONE", extra)
}

/// Workload YAML for a waypoint pod as istiod describes Istio's: not captured, so its
/// protocol is TCP (ztunnel still reaches it over HBONE on its `hboneMtlsPort`).
pub fn waypoint_workload(topo: &Topology, pod: &str, sa: &str, extra: &str) -> String {
    workload_with_protocol(topo, pod, sa, "TCP", extra)
}

fn workload_with_protocol(
    topo: &Topology,
    pod: &str,
    sa: &str,
    protocol: &str,
    extra: &str,
) -> String {
    let p = topo.pod(pod);
    let network = topo
        .networks
        .get(p.node - 1)
        .map(|n| format!(", network: {n}"))
        .unwrap_or_default();
    format!(
        "- {{uid: {pod}, name: {pod}, namespace: default, serviceAccount: {sa}, workloadIps: {}, protocol: {protocol}, node: node{}{network}{extra}}}\n",
        ips_yaml(&p.ips),
        p.node
    )
}

/// A YAML list of addresses, quoted (an IPv6 address is not a plain YAML scalar).
pub fn ips_yaml(ips: &[IpAddr]) -> String {
    let quoted: Vec<String> = ips.iter().map(|ip| format!("\"{ip}\"")).collect();
    format!("[{}]", quoted.join(", "))
}

/// A ztunnel command line and its environment.
pub type ZtunnelCommand = (Vec<String>, Vec<(String, String)>);

pub struct Mesh {
    pub ztunnels: Vec<Child>,
    /// Command line and environment of each node's ztunnel, to start a replacement.
    pub commands: Vec<ZtunnelCommand>,
    pub topo: Topology,
}

impl Mesh {
    /// Fails naming the resource if a ztunnel NACKed anything its control plane sent (and
    /// if one applied nothing): what the suites against Istio's istiod check.
    pub fn no_nacks(&self) -> Result<()> {
        for (n, z) in self.ztunnels.iter().enumerate() {
            let log = z.log_text();
            anyhow::ensure!(
                log.contains("xDS update applied (ACK)"),
                "node{}'s ztunnel applied no xDS update:\n{log}",
                n + 1
            );
            if let Some(nack) = log.lines().find(|l| l.contains("(NACK)")) {
                anyhow::bail!("node{}'s ztunnel NACKed what istiod sent: {nack}", n + 1);
            }
        }
        Ok(())
    }

    /// Starts ztunnel on each node, enrolling `enrolled` pods, all using `config`
    /// (unless a node-specific config is given in `per_node`).
    pub fn start(
        topo: Topology,
        config: &str,
        enrolled: &[&str],
        per_node: &HashMap<usize, String>,
        env: &[(&str, &str)],
    ) -> Result<Mesh> {
        Mesh::start_with_node_env(topo, config, enrolled, per_node, env, &HashMap::new())
    }

    /// [`Mesh::start`], with `node_env[n]` added to node n's environment (after `env`).
    pub fn start_with_node_env(
        topo: Topology,
        config: &str,
        enrolled: &[&str],
        per_node: &HashMap<usize, String>,
        env: &[(&str, &str)],
        node_env: &HashMap<usize, Vec<(&str, &str)>>,
    ) -> Result<Mesh> {
        let state = topo.dir.join("ca");
        let mut commands = Vec::new();
        for n in 1..=topo.nodes.len() {
            let cfg_path: PathBuf = topo.dir.join(format!("mesh-node{n}.yaml"));
            std::fs::write(
                &cfg_path,
                per_node.get(&n).map(String::as_str).unwrap_or(config),
            )?;
            let mut args = vec![
                "--local-xds-path".to_string(),
                cfg_path.display().to_string(),
                "--node-name".into(),
                format!("node{n}"),
                "--state-dir".into(),
                state.display().to_string(),
            ];
            args.extend(topo.capture_args(n));
            for pod in enrolled.iter().map(|p| topo.pod(p)).filter(|p| p.node == n) {
                args.push("--pod".into());
                args.push(format!("{}={}", pod.name, pod.netns.path().display()));
            }
            let mut full_env = vec![
                ("RUST_LOG".to_string(), "info".to_string()),
                ("RUST_BACKTRACE".into(), "0".into()),
            ];
            // Each node's ztunnel in its own network (Istio's NETWORK).
            full_env.extend(
                topo.networks
                    .get(n - 1)
                    .map(|net| ("NETWORK".to_string(), net.clone())),
            );
            full_env.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            full_env.extend(
                node_env
                    .get(&n)
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.to_string(), v.to_string())),
            );
            commands.push((args, full_env));
        }
        let mut mesh = Mesh {
            ztunnels: Vec::new(),
            commands,
            topo,
        };
        for n in 1..=mesh.topo.nodes.len() {
            // The first node creates the CA; the others load it.
            let z = mesh.spawn_ztunnel(n, &format!("ztunnel-node{n}.log"))?;
            mesh.ztunnels.push(z);
        }
        Ok(mesh)
    }

    /// Starts ztunnel on each node with its configuration from istiod (`env` names it, see
    /// `istiod::FakeIstiod::env`) and `node_args[n - 1]` added to node n's command line.
    pub fn start_with_istiod(
        topo: Topology,
        node_args: &[Vec<String>],
        env: &[(String, String)],
    ) -> Result<Mesh> {
        Mesh::start_with_istiod_per_node(topo, node_args, env, &[])
    }

    /// As `start_with_istiod`, with `node_env[n - 1]` added to node n's environment after
    /// `env` (each node agent's own token, say).
    pub fn start_with_istiod_per_node(
        topo: Topology,
        node_args: &[Vec<String>],
        env: &[(String, String)],
        node_env: &[Vec<(String, String)>],
    ) -> Result<Mesh> {
        let mut commands = Vec::new();
        for n in 1..=topo.nodes.len() {
            let mut args = vec!["--node-name".to_string(), format!("node{n}")];
            args.extend(topo.capture_args(n));
            args.extend(node_args.get(n - 1).cloned().unwrap_or_default());
            let mut full_env = vec![
                ("RUST_LOG".to_string(), "info".to_string()),
                ("RUST_BACKTRACE".into(), "0".into()),
                ("POD_NAME".into(), format!("ztunnel-node{n}")),
                ("INSTANCE_IP".into(), node_ip(n).to_string()),
            ];
            full_env.extend(env.iter().cloned());
            full_env.extend(node_env.get(n - 1).into_iter().flatten().cloned());
            commands.push((args, full_env));
        }
        let mut mesh = Mesh {
            ztunnels: Vec::new(),
            commands,
            topo,
        };
        for n in 1..=mesh.topo.nodes.len() {
            let z = mesh.spawn_ztunnel(n, &format!("ztunnel-node{n}.log"))?;
            mesh.ztunnels.push(z);
        }
        Ok(mesh)
    }

    /// Starts (another) ztunnel for node `n` with its usual command line; waits until ready.
    pub fn spawn_ztunnel(&self, n: usize, log_name: &str) -> Result<Child> {
        let (args, env) = &self.commands[n - 1];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let z = self.topo.node(n).spawn(
            crate::bins::ztunnel(),
            &args,
            &env,
            &self.topo.dir.join(log_name),
        )?;
        z.wait_log("ztunnel ready", READY)?;
        check_capture_mode(&z)?;
        Ok(z)
    }

    /// Waits until every needle appears in the ztunnel logs (they are written just after
    /// the client sees its connection end).
    pub fn wait_logs(&self, needles: &[&str]) -> Result<()> {
        wait_for(
            &format!("{needles:?} in ztunnel logs"),
            Duration::from_secs(5),
            || {
                let l = self.logs();
                needles.iter().all(|n| l.contains(n))
            },
        )
        .with_context(|| self.logs())
    }

    /// Waits until one line of the ztunnel logs contains every needle (the same event,
    /// not needles scattered over several lines).
    pub fn wait_log_line(&self, needles: &[&str]) -> Result<()> {
        wait_for(
            &format!("one line with {needles:?} in ztunnel logs"),
            Duration::from_secs(5),
            || {
                self.logs()
                    .lines()
                    .any(|l| needles.iter().all(|n| l.contains(n)))
            },
        )
        .with_context(|| self.logs())
    }

    pub fn logs(&self) -> String {
        self.ztunnels
            .iter()
            .map(|z| z.log_text())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A client looping connections (connect, 1 KiB echo, close) from `from` to `to` on its
/// own thread inside the pod netns, until told to stop; returns (succeeded, failures).
pub fn connect_loop(
    from: &Pod,
    to: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<(usize, Vec<String>)> {
    use std::io::{Read, Write};
    let path = from.netns.path();
    std::thread::spawn(move || {
        let mut ok = 0;
        let mut failed = Vec::new();
        let ns = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => return (0, vec![e.to_string()]),
        };
        if let Err(e) = nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET) {
            return (0, vec![e.to_string()]);
        }
        let payload = pattern(1024, 3);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let started = std::time::SystemTime::now();
            let mut local = None;
            let attempt = (|| -> std::io::Result<Vec<u8>> {
                let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
                local = s.local_addr().ok();
                s.set_read_timeout(Some(Duration::from_secs(5)))?;
                s.write_all(&payload)?;
                s.shutdown(std::net::Shutdown::Write)?;
                let mut out = Vec::new();
                s.read_to_end(&mut out)?;
                Ok(out)
            })();
            match attempt {
                Ok(v) if v == payload => ok += 1,
                Ok(v) => failed.push(format!(
                    "{started:?} from {local:?}: short echo: {} of {} bytes",
                    v.len(),
                    payload.len()
                )),
                Err(e) => failed.push(format!("{started:?} from {local:?}: {e}")),
            }
        }
        (ok, failed)
    })
}

/// istio-cni's in-pod nftables rules (`istio-ambient-nat`, `istio-ambient-mangle`) with
/// its defaults, DNS capture left out (with it, a proxy without a DNS server on 15053
/// would break the pod's lookups): outbound TCP from the
/// pod to 15001, inbound TCP (not HBONE) to 15006, the proxy's own sockets (mark 0x539)
/// exempt, and replies to its transparent deliveries (connection mark 0x111) marked so
/// that the mark's route table sends them back over lo.
const ISTIO_CNI_RULES: &str = r#"table inet istio-ambient-nat {
  chain prerouting { type nat hook prerouting priority -100; policy accept; jump istio-prerouting; }
  chain output { type nat hook output priority -100; policy accept; jump istio-output; }
  chain istio-prerouting {
    meta l4proto tcp ip saddr 169.254.7.127 accept
    ip daddr != 127.0.0.1/32 tcp dport != 15008 meta mark & 0xfff != 0x539 redirect to :15006
  }
  chain istio-output {
    meta l4proto tcp ip daddr 169.254.7.127 accept
    meta l4proto tcp meta mark & 0xfff == 0x111 accept
    oifname "lo" ip daddr != 127.0.0.1/32 accept
    meta l4proto tcp ip daddr != 127.0.0.1/32 meta mark & 0xfff != 0x539 redirect to :15001
  }
}
table inet istio-ambient-mangle {
  chain prerouting { type filter hook prerouting priority -150; policy accept; jump istio-prerouting; }
  chain output { type route hook output priority -150; policy accept; jump istio-output; }
  chain istio-prerouting {
    meta mark & 0xfff == 0x539 ct mark set ct mark & 0xfffff000 | 0x111
  }
  chain istio-output {
    ct mark & 0xfff == 0x111 meta mark set ct mark
  }
}
"#;

/// istio-cni's route table for marked replies (`RouteTableInbound`).
const ISTIO_CNI_ROUTE_TABLE: &str = "100";

/// Installs istio-cni's in-pod capture in `pod`'s netns, as its agent does when a pod
/// joins ambient (rules, mark rule and route all go with the netns).
pub fn istio_cni_capture(pod: &Pod) -> Result<()> {
    let rules = std::env::temp_dir().join(format!("istio-cni-{}.nft", pod.netns.name));
    std::fs::write(&rules, ISTIO_CNI_RULES)?;
    let loaded = pod.netns.exec("nft", &["-f", &rules.display().to_string()]);
    let _ = std::fs::remove_file(&rules);
    loaded.with_context(|| format!("istio-cni rules in {}", pod.name))?;
    pod.netns.exec(
        "ip",
        &[
            "rule",
            "add",
            "fwmark",
            "0x111/0xfff",
            "pref",
            "32764",
            "lookup",
            ISTIO_CNI_ROUTE_TABLE,
        ],
    )?;
    pod.netns.exec(
        "ip",
        &[
            "route",
            "add",
            "local",
            "0.0.0.0/0",
            "dev",
            "lo",
            "table",
            ISTIO_CNI_ROUTE_TABLE,
        ],
    )?;
    Ok(())
}

#[cfg(test)]
mod child_tests {
    #[test]
    fn a_zero_timeout_still_sees_a_process_that_exited() {
        let inner = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let mut c = super::Child {
            inner: Some(inner),
            log: std::path::PathBuf::from("/dev/null"),
        };
        assert!(c.wait_exit(std::time::Duration::from_secs(5)).is_some());
        let inner = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let mut c = super::Child {
            inner: Some(inner),
            log: std::path::PathBuf::from("/dev/null"),
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(
            c.wait_exit(std::time::Duration::ZERO).is_some(),
            "an exited process must be noticed without waiting"
        );
        let inner = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .expect("spawn sleep");
        let mut c = super::Child {
            inner: Some(inner),
            log: std::path::PathBuf::from("/dev/null"),
        };
        assert!(c.wait_exit(std::time::Duration::ZERO).is_none());
        c.stop();
    }
}
