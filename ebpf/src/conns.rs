//! The per-connection maps (original destinations, delivery exemptions) and the
//! per-netns usage that bounds them: their layouts, mirrored from capture.bpf.c, and the
//! purge a loading ztunnel runs over what the pinned maps carried across its restart.

use std::collections::{HashMap as StdHashMap, HashSet};

use aya::maps::{HashMap, MapData, MapError};

/// Mirrors `struct addr6`: an address in network order, IPv4 v4-mapped.
pub(crate) type Addr6 = [u8; 16];

/// Mirrors `struct conn_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    pub netns: u64,
    pub src_ip: Addr6,
    pub dst_ip: Addr6,
    pub src_port: u16,
    pub dst_port: u16,
    pub pad: u32,
}

/// Mirrors `struct orig_dst`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct OrigDst {
    pub ip: Addr6,
    pub port: u16,
    pub pad: u16,
}

/// Mirrors `struct cookie_entry`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct CookieEntry {
    pub dst: OrigDst,
    pub client_port: u32,
    pub netns: u64,
    pub client_ip: Addr6,
}

/// Mirrors `struct tuple_key`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TupleKey {
    pub netns: u64,
    pub ip: Addr6,
    pub port: u32,
    pub pad: u32,
}

/// Mirrors `struct tuple_value`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TupleValue {
    pub dst: OrigDst,
    pub pad: u32,
    pub cookie: u64,
}

/// Mirrors `struct netns_usage`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NetnsUsage {
    pub local: i32,
    pub orig: i32,
}

// SAFETY: each is repr(C) with only integer fields, laid out without implicit padding
// (explicit `pad` fields), as the kernel copies them byte for byte.
unsafe impl aya::Pod for ConnKey {}
unsafe impl aya::Pod for OrigDst {}
unsafe impl aya::Pod for CookieEntry {}
unsafe impl aya::Pod for TupleKey {}
unsafe impl aya::Pod for TupleValue {}
unsafe impl aya::Pod for NetnsUsage {}

pub(crate) struct ConnMaps {
    pub local_conns: HashMap<MapData, ConnKey, u8>,
    pub local_by_cookie: HashMap<MapData, u64, ConnKey>,
    pub orig_by_cookie: HashMap<MapData, u64, CookieEntry>,
    pub orig_by_tuple: HashMap<MapData, TupleKey, TupleValue>,
}

/// What [`purge`] removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Purged {
    /// Entries of netns that are no longer enrolled.
    pub unenrolled: usize,
    /// Exemptions and tuple entries no socket refers to any more.
    pub orphans: usize,
}

/// Drops entries of netns not in `enrolled` and entries nothing refers to (left by an
/// older ztunnel's programs, or by a program detached while its sockets lived), then
/// recounts each netns's usage from what is left, so a drifted count can neither lock
/// a pod out nor let it past its share.
pub(crate) fn purge(
    maps: &mut ConnMaps,
    usage: &mut HashMap<MapData, u64, NetnsUsage>,
    enrolled: &HashSet<u64>,
) -> Result<Purged, MapError> {
    let mut purged = Purged::default();
    let mut counts: StdHashMap<u64, NetnsUsage> = enrolled
        .iter()
        .map(|n| (*n, NetnsUsage::default()))
        .collect();

    let mut referenced = HashSet::new();
    let locals: Vec<(u64, ConnKey)> = maps.local_by_cookie.iter().filter_map(Result::ok).collect();
    for (cookie, key) in locals {
        match counts.get_mut(&key.netns) {
            Some(u) => {
                u.local += 1;
                referenced.insert(key);
            }
            None => {
                purged.unenrolled += 1;
                ignore_missing(maps.local_by_cookie.remove(&cookie))?;
            }
        }
    }
    let exempt: Vec<ConnKey> = maps.local_conns.keys().filter_map(Result::ok).collect();
    for key in exempt.into_iter().filter(|k| !referenced.contains(k)) {
        purged.orphans += 1;
        ignore_missing(maps.local_conns.remove(&key))?;
    }

    let origs: Vec<(u64, CookieEntry)> =
        maps.orig_by_cookie.iter().filter_map(Result::ok).collect();
    let mut live = HashSet::new();
    for (cookie, e) in origs {
        match counts.get_mut(&e.netns) {
            Some(u) => {
                u.orig += 1;
                live.insert(cookie);
            }
            None => {
                purged.unenrolled += 1;
                ignore_missing(maps.orig_by_cookie.remove(&cookie))?;
            }
        }
    }
    let tuples: Vec<(TupleKey, TupleValue)> =
        maps.orig_by_tuple.iter().filter_map(Result::ok).collect();
    for (key, _) in tuples
        .into_iter()
        .filter(|(_, v)| !live.contains(&v.cookie))
    {
        purged.orphans += 1;
        ignore_missing(maps.orig_by_tuple.remove(&key))?;
    }

    let stale: Vec<u64> = usage
        .keys()
        .filter_map(Result::ok)
        .filter(|n| !counts.contains_key(n))
        .collect();
    for n in stale {
        ignore_missing(usage.remove(&n))?;
    }
    for (n, u) in counts {
        usage.insert(n, u, 0)?;
    }
    Ok(purged)
}

pub(crate) fn ignore_missing(r: Result<(), MapError>) -> Result<(), MapError> {
    match r {
        Err(MapError::KeyNotFound) => Ok(()),
        Err(MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_match_the_c_structs() {
        // Sizes the kernel checks against the maps' key/value sizes at load; a mismatch
        // would be refused there, this catches it at `cargo test`.
        assert_eq!(std::mem::size_of::<ConnKey>(), 48);
        assert_eq!(std::mem::size_of::<OrigDst>(), 20);
        assert_eq!(std::mem::size_of::<CookieEntry>(), 48);
        assert_eq!(std::mem::size_of::<TupleKey>(), 32);
        assert_eq!(std::mem::size_of::<TupleValue>(), 32);
        assert_eq!(std::mem::size_of::<NetnsUsage>(), 8);
    }
}
