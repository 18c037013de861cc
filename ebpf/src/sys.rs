//! bpffs and cgroup v2 discovery.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::EbpfError;

const BPF_FS_MAGIC: i64 = 0xcafe4a11;
const BPF_MOUNT: &str = "/sys/fs/bpf";
/// Where we mount cgroup v2 ourselves when the host has no cgroup2 mount.
const OWN_CGROUP2_MOUNT: &str = "/run/ztunnel/cgroup2";

fn fs_magic(path: &Path) -> std::io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

fn mount(fstype: &str, target: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(target)?;
    let src = CString::new(fstype).map_err(std::io::Error::other)?;
    let tgt = CString::new(target.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    if unsafe {
        libc::mount(
            src.as_ptr(),
            tgt.as_ptr(),
            src.as_ptr(),
            0,
            std::ptr::null(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes sure the pin directory is on a bpf filesystem, mounting /sys/fs/bpf if the
/// host has not (as Cilium's and Istio's agents do).
pub fn ensure_bpffs(pin_dir: &Path) -> Result<(), EbpfError> {
    let err = |path: &Path, source| EbpfError::BpfFs {
        path: path.to_path_buf(),
        source,
    };
    let under_default = pin_dir.starts_with(BPF_MOUNT);
    if under_default
        && fs_magic(Path::new(BPF_MOUNT)).map_err(|e| err(Path::new(BPF_MOUNT), e))? != BPF_FS_MAGIC
    {
        mount("bpf", Path::new(BPF_MOUNT)).map_err(|e| err(Path::new(BPF_MOUNT), e))?;
        tracing::info!(path = BPF_MOUNT, "mounted the bpf filesystem");
    }
    std::fs::create_dir_all(pin_dir).map_err(|e| err(pin_dir, e))?;
    if fs_magic(pin_dir).map_err(|e| err(pin_dir, e))? != BPF_FS_MAGIC {
        return Err(err(pin_dir, std::io::Error::other("not a bpf filesystem")));
    }
    Ok(())
}

/// The mount point of the cgroup v2 hierarchy's root, mounting it if nothing has. Inside
/// a cgroup namespace (a container's default on cgroup v2) the visible "root" is the
/// container's own cgroup: programs there would see only ztunnel's sockets and capture
/// nothing, so that is an error (the real root's directory is inode 1).
pub fn cgroup2_root() -> Result<PathBuf, EbpfError> {
    let found = std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .as_deref()
        .and_then(find_cgroup2_root);
    let path = match found {
        Some(p) => p,
        None => {
            let own = Path::new(OWN_CGROUP2_MOUNT);
            mount("cgroup2", own).map_err(|e| {
                tracing::warn!(error = %e, "cannot mount cgroup2");
                EbpfError::NoCgroup2
            })?;
            own.to_path_buf()
        }
    };
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(&path)
        .map_err(|source| EbpfError::Cgroup {
            path: path.clone(),
            source,
        })?
        .ino();
    if ino != 1 {
        return Err(EbpfError::NotCgroupRoot(path));
    }
    Ok(path)
}

/// mountinfo: `id parent maj:min root mountpoint opts [optional...] - fstype source superopts`.
fn find_cgroup2_root(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (pre, post) = line.split_once(" - ")?;
        let fstype = post.split_whitespace().next()?;
        let mut f = pre.split_whitespace();
        let root = f.nth(3)?;
        let mountpoint = f.next()?;
        (fstype == "cgroup2" && root == "/").then(|| PathBuf::from(mountpoint))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cgroup2_root_mount() {
        let mi = "30 24 0:26 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
                  31 24 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(
            find_cgroup2_root(mi),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let nested = "30 24 0:26 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            find_cgroup2_root(nested),
            None,
            "a bind mount of a sub-cgroup is not the root"
        );
        assert_eq!(find_cgroup2_root(""), None);
    }
}

/// bpf(2) attach types we create links for (uapi enum bpf_attach_type).
#[derive(Clone, Copy, Debug)]
#[repr(u32)]
pub enum AttachType {
    CgroupSockOps = 3,
    CgroupConnect4 = 10,
    CgroupConnect6 = 11,
    CgroupUdp4Sendmsg = 14,
    CgroupUdp6Sendmsg = 15,
    CgroupUdp4Recvmsg = 19,
    CgroupUdp6Recvmsg = 20,
    CgroupGetsockopt = 21,
    CgroupGetpeername4 = 29,
    CgroupGetpeername6 = 30,
    CgroupSockRelease = 34,
    SkLookup = 36,
}

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_CREATE: libc::c_long = 28;

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // The kernel zero-checks the tail of bpf_attr beyond what it reads; our attr structs
    // are prefixes of the union padded with zeros, passed with their exact size.
    // SAFETY: attr points to a live, initialized struct of the size we pass.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// BPF_LINK_CREATE: a link owning the attachment of `prog` to `target` (a cgroup or
/// netns fd). aya 0.14 cannot hand out every link kind as a pinnable fd, so we make them.
pub fn link_create(
    prog: std::os::fd::BorrowedFd<'_>,
    target: std::os::fd::BorrowedFd<'_>,
    attach: AttachType,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd};
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_fd: u32,
        attach_type: u32,
        flags: u32,
        pad: [u64; 4],
    }
    let mut attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_fd: target.as_raw_fd() as u32,
        attach_type: attach as u32,
        flags: 0,
        pad: [0; 4],
    };
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// The bpf_attr of BPF_OBJ_PIN and BPF_OBJ_GET: a path on bpffs (and for a pin, the fd).
#[repr(C)]
struct ObjPath {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    pad: u32,
}

/// `cmd` on the object at `path`; `path` stays alive across the call, which reads it.
fn bpf_obj(cmd: libc::c_long, path: &Path, bpf_fd: u32) -> std::io::Result<libc::c_long> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut attr = ObjPath {
        pathname: c.as_ptr() as u64,
        bpf_fd,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    bpf(cmd, &mut attr)
}

/// BPF_OBJ_PIN: pins an fd (link, map or program) at a path on bpffs.
pub fn obj_pin(fd: std::os::fd::BorrowedFd<'_>, path: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    bpf_obj(BPF_OBJ_PIN, path, fd.as_raw_fd() as u32).map(|_| ())
}

const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_DETACH: libc::c_long = 34;

/// BPF_OBJ_GET: a new fd for what is pinned at `path` on bpffs.
pub fn obj_get(path: &Path) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let fd = bpf_obj(BPF_OBJ_GET, path, 0)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// BPF_LINK_DETACH: ends a link's attachment now, whoever else still holds the link.
pub fn link_detach(link: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct LinkDetach {
        link_fd: u32,
        pad: u32,
    }
    let mut attr = LinkDetach {
        link_fd: link.as_raw_fd() as u32,
        pad: 0,
    };
    bpf(BPF_LINK_DETACH, &mut attr).map(|_| ())
}

const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_PROG_QUERY: libc::c_long = 16;

/// Number of keys in a map, by walking BPF_MAP_GET_NEXT_KEY.
pub fn count_keys(map: std::os::fd::BorrowedFd<'_>, key_size: usize) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct NextKey {
        map_fd: u32,
        pad: u32,
        key: u64,
        next_key: u64,
    }
    let mut cur = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut first = true;
    let mut n = 0;
    // A key deleted mid-walk restarts the walk at the first key; bound it.
    const LIMIT: usize = 1 << 22;
    while n < LIMIT {
        let mut attr = NextKey {
            map_fd: map.as_raw_fd() as u32,
            pad: 0,
            key: if first { 0 } else { cur.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(n),
            Err(e) => return Err(e),
        }
        n += 1;
        first = false;
        std::mem::swap(&mut cur, &mut next);
    }
    Err(std::io::Error::other(
        "map walk did not end (entries changing under it)",
    ))
}

/// Number of programs attached to `target` (a cgroup or netns fd) for `attach`.
pub fn query_attached(
    target: std::os::fd::BorrowedFd<'_>,
    attach: AttachType,
) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct Query {
        target_fd: u32,
        attach_type: u32,
        query_flags: u32,
        attach_flags: u32,
        prog_ids: u64,
        prog_cnt: u32,
        pad: [u32; 9],
    }
    let mut attr = Query {
        target_fd: target.as_raw_fd() as u32,
        attach_type: attach as u32,
        query_flags: 0,
        attach_flags: 0,
        prog_ids: 0,
        prog_cnt: 0,
        pad: [0; 9],
    };
    bpf(BPF_PROG_QUERY, &mut attr)?;
    Ok(attr.prog_cnt)
}
