//! eBPF traffic capture for ztunnel's enrolled pods: the programs in `bpf/capture.bpf.c`
//! (compiled by build.rs with clang -target bpf), loaded and attached with aya.
//!
//! Process-wide programs (connect4/6, sendmsg4/6, recvmsg4/6, sockops, getsockopt,
//! getpeername4/6, sock_release) sit
//! on the cgroup v2 root and act only on sockets of enrolled pods' netns; each pod adds an
//! sk_lookup program on its own netns. Maps and links are pinned under one directory on
//! bpffs, so capture stays in force while ztunnel restarts (fail closed: new connections
//! are refused or their SYNs dropped until the new proxy listens) and a new ztunnel
//! takes the same maps over.

use std::fs::File;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use aya::maps::{HashMap, MapData, MapError, SockHash};
use aya::programs::{CgroupSock, CgroupSockAddr, CgroupSockopt, ProgramError, SkLookup, SockOps};
use aya::{Ebpf, EbpfLoader};

mod conns;
mod sys;

static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/capture.bpf.o"));

/// The default pin directory, like Istio's /sys/fs/bpf/... convention.
pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/ztunnel";

/// Maps are pinned under `maps-<LAYOUT>`: a ztunnel whose map layout differs (key or
/// value sizes) must not open the old pins, whose smaller keys would still verify and
/// then silently match the wrong entries. Bump on any change to a map definition.
const MAP_LAYOUT: &str = "v3";

fn maps_dir(pin_dir: &Path) -> PathBuf {
    pin_dir.join(format!("maps-{MAP_LAYOUT}"))
}

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error("this ztunnel was built without eBPF programs (ZTUNNEL_BUILD_WITHOUT_EBPF); rebuild with clang and libbpf-dev installed, or use --capture nftables")]
    NotBuilt,
    #[error("eBPF capture needs root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)")]
    NotRoot,
    #[error("bpf filesystem at {path}: {source}; mount it with `mount -t bpf bpf /sys/fs/bpf`")]
    BpfFs {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no cgroup v2 hierarchy is mounted; mount one (`mount -t cgroup2 none /sys/fs/cgroup`) or pass --cgroup-path")]
    NoCgroup2,
    #[error("{0} is not the cgroup v2 root (ztunnel runs in a cgroup namespace: run it with cgroupns=host, or pass --cgroup-path to the host's cgroup2 root)")]
    NotCgroupRoot(PathBuf),
    #[error("cannot open cgroup {path}: {source}")]
    Cgroup {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot load the eBPF object (maps pinned in {pin_dir} may be from an incompatible ztunnel; remove that directory and re-enroll pods): {source}")]
    Object {
        pin_dir: PathBuf,
        source: Box<aya::EbpfError>,
    },
    #[error("the kernel refused eBPF program {program}: {source}")]
    Program {
        program: &'static str,
        source: ProgramError,
    },
    #[error("eBPF program {0} is missing from the object; the build is broken")]
    MissingProgram(&'static str),
    #[error("cannot attach eBPF program {program}: {source}")]
    Attach {
        program: &'static str,
        source: std::io::Error,
    },
    #[error("eBPF map {map}: {source}")]
    Map { map: &'static str, source: MapError },
    #[error("pin {path}: {source}")]
    Pin {
        path: PathBuf,
        source: std::io::Error,
    },
}

fn program_err(program: &'static str) -> impl FnOnce(ProgramError) -> EbpfError {
    move |source| EbpfError::Program { program, source }
}

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> EbpfError {
    move |source| EbpfError::Map { map, source }
}

/// A network namespace's cookie (SO_NETNS_COOKIE): the kernel's unique id for it, and
/// what the cgroup programs see via bpf_get_netns_cookie.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NetnsCookie(pub u64);

impl std::fmt::Display for NetnsCookie {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Mirrors `struct pod_config` in capture.bpf.c.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct PodConfig {
    /// Network order; 0: none.
    ip4: u32,
    flags: u32,
    /// All zero: no IPv6 capture (the pod's native IPv6 is refused).
    ip6: conns::Addr6,
}

/// An address as the maps key it (`struct addr6`): IPv6 as it is, IPv4 v4-mapped.
fn addr6(ip: IpAddr) -> conns::Addr6 {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn from_addr6(a: conns::Addr6) -> IpAddr {
    std::net::Ipv6Addr::from(a).to_canonical()
}

/// `pod_config.flags`: the pod's DNS goes to the DNS proxy (POD_DNS).
const POD_DNS: u32 = 1;

// SAFETY: repr(C), plain integers, no padding.
unsafe impl aya::Pod for PodConfig {}

/// One pod's view for capture.
pub struct PodCapture<'a> {
    /// The pod's netns (the sk_lookup program attaches to it).
    pub netns: BorrowedFd<'a>,
    pub cookie: NetnsCookie,
    /// The pod's addresses (one per family at most; the first of each counts), each with
    /// the inbound plaintext (15006) listener of its family, steered to by sk_lookup. No
    /// IPv6 address: the pod's native IPv6 is refused (fail closed).
    pub addresses: Vec<(IpAddr, BorrowedFd<'a>)>,
}

/// Options for [`Capture::load`].
#[derive(Clone, Debug)]
pub struct Options {
    pub pin_dir: PathBuf,
    /// The cgroup the process-wide programs attach to; default: the cgroup v2 root.
    pub cgroup: Option<PathBuf>,
    /// Inbound destination ports never captured.
    pub exempt_inbound_ports: Vec<u16>,
    /// Send enrolled pods' DNS (UDP and TCP port 53) to the DNS proxy (127.0.0.1:15053,
    /// `[::1]:15053` for IPv6).
    pub capture_dns: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            pin_dir: DEFAULT_PIN_DIR.into(),
            cgroup: None,
            exempt_inbound_ports: Vec::new(),
            capture_dns: false,
        }
    }
}

struct Maps {
    pods_netns: HashMap<MapData, u64, PodConfig>,
    /// pod IP (`addr6`) -> owning pod's netns cookie
    pods_ip: HashMap<MapData, conns::Addr6, u64>,
    inbound: SockHash<MapData, conns::Addr6>,
    /// netns cookie -> its share of the per-connection maps
    usage: HashMap<MapData, u64, conns::NetnsUsage>,
}

/// Loaded capture programs and their maps.
pub struct Capture {
    pin_dir: PathBuf,
    /// `pod_config.flags` of the pods this process enrolls.
    pod_flags: u32,
    // Holds the loaded sk_lookup program; the other programs live on in their pinned links.
    bpf: Mutex<Ebpf>,
    maps: Mutex<Maps>,
}

const MAPS: [&str; 9] = [
    "zt_pods_netns",
    "zt_pods_ip",
    "zt_inbound",
    "zt_exempt_ports",
    "zt_orig_by_cookie",
    "zt_orig_by_tuple",
    "zt_local_conns",
    "zt_local_by_cookie",
    "zt_netns_usage",
];

/// Program name in the object, and its pinned link's file name.
const GLOBAL_PROGRAMS: [&str; 11] = [
    "zt_connect4",
    "zt_connect6",
    "zt_sendmsg4",
    "zt_sendmsg6",
    "zt_recvmsg4",
    "zt_recvmsg6",
    "zt_sockops",
    "zt_getsockopt",
    "zt_getpeername4",
    "zt_getpeername6",
    "zt_sock_release",
];

impl Capture {
    /// Loads the programs, takes over (or creates) the pinned maps, and attaches the
    /// process-wide programs, replacing the links a previous ztunnel pinned.
    pub fn load(opts: &Options) -> Result<Capture, EbpfError> {
        if OBJECT.is_empty() {
            return Err(EbpfError::NotBuilt);
        }
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(EbpfError::NotRoot);
        }
        sys::ensure_bpffs(&opts.pin_dir)?;
        let cgroup_path = match &opts.cgroup {
            Some(p) => p.clone(),
            None => sys::cgroup2_root()?,
        };
        let cgroup = File::open(&cgroup_path).map_err(|source| EbpfError::Cgroup {
            path: cgroup_path.clone(),
            source,
        })?;
        for dir in [
            opts.pin_dir.join("links"),
            opts.pin_dir.join("pods"),
            maps_dir(&opts.pin_dir),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| EbpfError::Pin {
                path: dir.clone(),
                source,
            })?;
        }
        let pin_paths: Vec<(&str, PathBuf)> = MAPS
            .iter()
            .map(|m| (*m, maps_dir(&opts.pin_dir).join(m)))
            .collect();
        let mut loader = EbpfLoader::new();
        for (name, path) in &pin_paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut bpf = loader.load(OBJECT).map_err(|source| EbpfError::Object {
            pin_dir: opts.pin_dir.clone(),
            source: Box::new(source),
        })?;

        for name in GLOBAL_PROGRAMS {
            let link = attach_global(&mut bpf, name, cgroup.as_fd())?;
            replace_pin(link, &opts.pin_dir.join("links").join(name))?;
        }
        // Older layouts' map pins: their programs were just replaced (or are per-pod and
        // replaced on re-enrollment), so only the pins keep them alive.
        for e in std::fs::read_dir(&opts.pin_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("maps-") && e.path() != maps_dir(&opts.pin_dir) {
                tracing::info!(dir = %e.path().display(), "removing pinned maps of an older ztunnel");
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        let sk_lookup: &mut SkLookup = program(&mut bpf, "zt_sk_lookup")?;
        sk_lookup.load().map_err(program_err("zt_sk_lookup"))?;

        let mut exempt: HashMap<MapData, u16, u8> = take_map(&mut bpf, "zt_exempt_ports")?;
        // The pinned map outlives us: make it exactly this process's configuration.
        let stale: Vec<u16> = exempt.keys().filter_map(Result::ok).collect();
        for port in stale {
            let _ = exempt.remove(&port);
        }
        for port in &opts.exempt_inbound_ports {
            exempt
                .insert(port, 1, 0)
                .map_err(map_err("zt_exempt_ports"))?;
        }
        let mut maps = Maps {
            pods_netns: take_map(&mut bpf, "zt_pods_netns")?,
            pods_ip: take_map(&mut bpf, "zt_pods_ip")?,
            inbound: take_map(&mut bpf, "zt_inbound")?,
            usage: take_map(&mut bpf, "zt_netns_usage")?,
        };
        // What the pinned maps carried over from before this process: the pods stay
        // enrolled (the CNI agent's snapshot settles them), entries of anything else go.
        let enrolled: std::collections::HashSet<u64> =
            maps.pods_netns.keys().filter_map(Result::ok).collect();
        let mut conn_maps = conns::ConnMaps {
            local_conns: take_map(&mut bpf, "zt_local_conns")?,
            local_by_cookie: take_map(&mut bpf, "zt_local_by_cookie")?,
            orig_by_cookie: take_map(&mut bpf, "zt_orig_by_cookie")?,
            orig_by_tuple: take_map(&mut bpf, "zt_orig_by_tuple")?,
        };
        let purged = conns::purge(&mut conn_maps, &mut maps.usage, &enrolled)
            .map_err(map_err("zt_netns_usage"))?;
        if purged != conns::Purged::default() {
            tracing::info!(
                unenrolled = purged.unenrolled,
                orphans = purged.orphans,
                "removed stale per-connection eBPF entries"
            );
        }
        tracing::info!(pin_dir = %opts.pin_dir.display(), cgroup = %cgroup_path.display(), "eBPF capture loaded");
        let pod_flags = if opts.capture_dns { POD_DNS } else { 0 };
        Ok(Capture {
            pin_dir: opts.pin_dir.clone(),
            pod_flags,
            bpf: Mutex::new(bpf),
            maps: Mutex::new(maps),
        })
    }

    fn pod_link_path(&self, cookie: NetnsCookie) -> PathBuf {
        self.pin_dir.join("pods").join(cookie.to_string())
    }

    /// Starts capturing a pod. Its listeners must already be accepting: each step is one
    /// atomic map update or attach, ordered so that whatever a connection meets is
    /// complete: outbound first (it also lets sockops recognize the pod's calls to its
    /// own address), then the inbound listener, then inbound steering.
    /// On failure, what was already in place stays (fail closed): the pod may have been
    /// captured before (a restart), and a retry or a removal settles it.
    pub fn enroll(&self, pod: &PodCapture<'_>) -> Result<(), EbpfError> {
        let v4 = pod.addresses.iter().find_map(|(ip, _)| match ip {
            IpAddr::V4(a) => Some(u32::from_ne_bytes(a.octets())),
            IpAddr::V6(_) => None,
        });
        let v6 = pod.addresses.iter().find_map(|(ip, _)| match ip {
            IpAddr::V6(a) => Some(a.octets()),
            IpAddr::V4(_) => None,
        });
        let config = PodConfig {
            ip4: v4.unwrap_or(0),
            flags: self.pod_flags,
            ip6: v6.unwrap_or_default(),
        };
        self.lock_maps()
            .pods_netns
            .insert(pod.cookie.0, config, 0)
            .map_err(map_err("zt_pods_netns"))?;
        {
            let mut maps = self.lock_maps();
            for (ip, listener) in &pod.addresses {
                let key = addr6(*ip);
                maps.inbound
                    .insert(key, listener.as_raw_fd(), 0)
                    .map_err(map_err("zt_inbound"))?;
                maps.pods_ip
                    .insert(key, pod.cookie.0, 0)
                    .map_err(map_err("zt_pods_ip"))?;
            }
        }
        let link = {
            let mut bpf = self.bpf.lock().unwrap_or_else(|e| e.into_inner());
            let prog: &mut SkLookup = program(&mut bpf, "zt_sk_lookup")?;
            let fd = prog.fd().map_err(program_err("zt_sk_lookup"))?;
            sys::link_create(fd.as_fd(), pod.netns, sys::AttachType::SkLookup).map_err(
                |source| EbpfError::Attach {
                    program: "zt_sk_lookup",
                    source,
                },
            )?
        };
        replace_pin(link, &self.pod_link_path(pod.cookie))
    }

    /// Stops capturing a pod and removes every trace of it: map entries (of each of its
    /// addresses `ips`) and its sk_lookup link, in the reverse order of `enroll`.
    pub fn remove(&self, cookie: NetnsCookie, ips: &[IpAddr]) -> Result<(), EbpfError> {
        let mut maps = self.lock_maps();
        let path = self.pod_link_path(cookie);
        // Detached first: the kernel frees an unpinned link only after an RCU grace period
        // and a pass of its workqueue, so the pod would stay steered to our listener for a
        // moment after its removal is reported done. Unpinning detaches it too, later.
        match sys::obj_get(&path).and_then(|link| sys::link_detach(link.as_fd())) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot detach the pod's sk_lookup link now; the kernel detaches it once unpinned")
            }
        }
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(EbpfError::Pin { path, source }),
        }
        for ip in ips {
            let key = addr6(*ip);
            // The IP may belong to a newer pod by now (IPs are reused): leave its entries.
            let owner = maps.pods_ip.get(&key, 0).ok();
            if owner.is_none_or(|o| o == cookie.0) {
                ignore_missing(maps.pods_ip.remove(&key)).map_err(map_err("zt_pods_ip"))?;
                ignore_missing(maps.inbound.remove(&key)).map_err(map_err("zt_inbound"))?;
            }
        }
        ignore_missing(maps.pods_netns.remove(&cookie.0)).map_err(map_err("zt_pods_netns"))?;
        // Last: the pod's sockets can no longer take a share; those still open find no
        // usage to give back to, which is what they should find.
        ignore_missing(maps.usage.remove(&cookie.0)).map_err(map_err("zt_netns_usage"))?;
        Ok(())
    }

    /// Removes every pod not in `keep`: after a restart, the pods the CNI agent's
    /// snapshot no longer lists (removed while no ztunnel ran) would otherwise stay
    /// captured, their connections refused, forever.
    pub fn retain(&self, keep: &[NetnsCookie]) -> Result<usize, EbpfError> {
        let keep: std::collections::HashSet<u64> = keep.iter().map(|c| c.0).collect();
        let mut stale: std::collections::HashSet<u64> = std::collections::HashSet::new();
        {
            let maps = self.lock_maps();
            stale.extend(
                maps.pods_netns
                    .keys()
                    .filter_map(Result::ok)
                    .filter(|c| !keep.contains(c)),
            );
            stale.extend(
                maps.pods_ip
                    .iter()
                    .filter_map(Result::ok)
                    .map(|(_, c)| c)
                    .filter(|c| !keep.contains(c)),
            );
        }
        for e in std::fs::read_dir(self.pin_dir.join("pods"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Some(c) = e.file_name().to_str().and_then(|n| n.parse::<u64>().ok()) {
                if !keep.contains(&c) {
                    stale.insert(c);
                }
            }
        }
        for c in &stale {
            let ips: Vec<IpAddr> = {
                let maps = self.lock_maps();
                maps.pods_ip
                    .iter()
                    .filter_map(Result::ok)
                    .filter(|(_, o)| o == c)
                    .map(|(ip, _)| from_addr6(ip))
                    .collect()
            };
            self.remove(NetnsCookie(*c), &ips)?;
        }
        Ok(stale.len())
    }

    /// Entries in the pod maps (enrolled netns, enrolled IPs, inbound listeners).
    pub fn pod_entries(&self) -> (usize, usize, usize) {
        let maps = self.lock_maps();
        (
            maps.pods_netns.keys().count(),
            maps.pods_ip.keys().count(),
            maps.inbound.keys().count(),
        )
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    fn lock_maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a pin directory holds, for tests and diagnostics.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Inspection {
    /// (map name, entries) for each pinned map.
    pub maps: Vec<(String, usize)>,
    /// Pinned per-pod sk_lookup links (file names: netns cookies).
    pub pod_links: Vec<String>,
    /// Pinned process-wide links.
    pub global_links: Vec<String>,
}

impl Inspection {
    pub fn entries(&self, map: &str) -> usize {
        self.maps
            .iter()
            .find(|(m, _)| m == map)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    }
}

/// Reads a pin directory without loading anything.
pub fn inspect(pin_dir: &Path) -> std::io::Result<Inspection> {
    let mut out = Inspection::default();
    for name in MAPS {
        let path = maps_dir(pin_dir).join(name);
        if !path.exists() {
            continue;
        }
        let map = MapData::from_pin(&path).map_err(std::io::Error::other)?;
        let key_size = map.info().map_err(std::io::Error::other)?.key_size() as usize;
        let n = sys::count_keys(map.fd().as_fd(), key_size)?;
        out.maps.push((name.to_string(), n));
    }
    let list = |dir: PathBuf| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    out.pod_links = list(pin_dir.join("pods"));
    out.global_links = list(pin_dir.join("links"));
    Ok(out)
}

/// Number of sk_lookup programs attached to a network namespace.
pub fn sk_lookup_programs(netns: BorrowedFd<'_>) -> std::io::Result<u32> {
    sys::query_attached(netns, sys::AttachType::SkLookup)
}

use conns::ignore_missing;

fn program<'a, T>(bpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, EbpfError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    let p = bpf
        .program_mut(name)
        .ok_or(EbpfError::MissingProgram(name))?;
    p.try_into().map_err(program_err(name))
}

fn take_map<T>(bpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let m = bpf.take_map(name).ok_or(EbpfError::Map {
        map: name,
        source: MapError::InvalidName { name: name.into() },
    })?;
    T::try_from(m).map_err(map_err(name))
}

/// Loads one process-wide program and attaches it to the cgroup (alongside any other
/// programs there), returning its link.
fn attach_global(
    bpf: &mut Ebpf,
    name: &'static str,
    cgroup: BorrowedFd<'_>,
) -> Result<OwnedFd, EbpfError> {
    use sys::AttachType as A;
    macro_rules! load {
        ($ty:ty, $attach:expr) => {{
            let p: &mut $ty = program(bpf, name)?;
            p.load().map_err(program_err(name))?;
            let fd = p.fd().map_err(program_err(name))?;
            sys::link_create(fd.as_fd(), cgroup, $attach).map_err(|source| EbpfError::Attach {
                program: name,
                source,
            })
        }};
    }
    match name {
        "zt_sockops" => load!(SockOps, A::CgroupSockOps),
        "zt_getsockopt" => load!(CgroupSockopt, A::CgroupGetsockopt),
        "zt_sock_release" => load!(CgroupSock, A::CgroupSockRelease),
        "zt_getpeername4" => load!(CgroupSockAddr, A::CgroupGetpeername4),
        "zt_getpeername6" => load!(CgroupSockAddr, A::CgroupGetpeername6),
        "zt_connect6" => load!(CgroupSockAddr, A::CgroupConnect6),
        "zt_sendmsg4" => load!(CgroupSockAddr, A::CgroupUdp4Sendmsg),
        "zt_sendmsg6" => load!(CgroupSockAddr, A::CgroupUdp6Sendmsg),
        "zt_recvmsg4" => load!(CgroupSockAddr, A::CgroupUdp4Recvmsg),
        "zt_recvmsg6" => load!(CgroupSockAddr, A::CgroupUdp6Recvmsg),
        _ => load!(CgroupSockAddr, A::CgroupConnect4),
    }
}

/// Pins `link` at `path`, replacing (and so detaching) a link pinned there before. The
/// new link is attached before the old one goes, so capture never lapses; running both
/// for a moment is harmless (the second connect4 sees an already-rewritten loopback
/// destination, the second sk_lookup is not consulted once the first assigned).
fn replace_pin(link: OwnedFd, path: &Path) -> Result<(), EbpfError> {
    let pin_err = |source| EbpfError::Pin {
        path: path.to_path_buf(),
        source,
    };
    // bpffs refuses names with a '.'.
    let mut fresh = path.as_os_str().to_owned();
    fresh.push("-new");
    let fresh = PathBuf::from(fresh);
    let _ = std::fs::remove_file(&fresh);
    sys::obj_pin(link.as_fd(), &fresh).map_err(pin_err)?;
    // rename(2) over the old pin drops the kernel's reference to the old link.
    std::fs::rename(&fresh, path).map_err(pin_err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_addresses_are_16_bytes_ipv4_v4_mapped() {
        let v4: IpAddr = "10.10.1.11".parse().unwrap();
        assert_eq!(
            addr6(v4),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 10, 1, 11]
        );
        assert_eq!(from_addr6(addr6(v4)), v4);
        let v6: IpAddr = "fd00:10:1::11".parse().unwrap();
        assert_eq!(
            addr6(v6),
            [0xfd, 0, 0, 0x10, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x11]
        );
        assert_eq!(from_addr6(addr6(v6)), v6);
        // Mirrors `struct pod_config`: ip4, flags, ip6.
        assert_eq!(std::mem::size_of::<PodConfig>(), 24);
    }
}
