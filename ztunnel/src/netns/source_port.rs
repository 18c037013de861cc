//! The source port of a connection the proxy makes into a pod on a client's behalf (from
//! the client's address, IP_TRANSPARENT). The client closes first, so the proxy's side of
//! that connection, not the client's, is left in TIME_WAIT, in the pod's netns, for every
//! connection: without the mesh the pod would hold none. When the kernel picks the port it
//! skips every port whose tuple is in TIME_WAIT (the pod's `tcp_tw_reuse` is rarely on),
//! so from about 470 connections a second from one client to one app port (28,232 ports
//! in 60 s) each connect scans the range, nearly all of the inbound ztunnel's CPU, and
//! then fails. A port chosen here and bound explicitly may take over a TIME_WAIT tuple
//! (the kernel allows it when the old connection used TCP timestamps, which protect the
//! new one from its stray segments), so the cost stays flat at any rate.
//!
//! The port comes from outside the pod's ephemeral range. A client outside the mesh
//! reaches the pod from its own ephemeral port, and a client on the cluster's nodes uses
//! the same range as the pod (the kernel's default, 32768–60999, nearly everywhere). Were
//! a delivery from that client's address open on port P, the client's next connection
//! from P would find its SYN taken by the app's side of that delivery, and hang: with
//! 9,000 deliveries open from one client, about one in three of its new connections did,
//! through Istio's ztunnel as through ours when both picked from that range.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::sync::{Arc, Mutex};

use rand::RngExt;

/// Ports picked at random before leaving the choice to the kernel.
pub const TRIES: usize = 8;

/// Draws for one pick: a reserved port or one to avoid costs a draw, not a connect, and
/// the kernel's choice (which knows nothing of the ports to avoid) should be rare even
/// where most of a narrow range is ruled out.
const DRAWS: usize = 64;

/// The lowest port a delivery comes from (below it, ports are privileged by convention).
const LOWEST: u16 = 1024;

/// A pod's ephemeral port range and the ports it reserves (`ip_local_port_range`,
/// `ip_local_reserved_ports`): deliveries come from the ports outside the first and off
/// the second (see the module's doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePorts {
    range: RangeInclusive<u16>,
    reserved: Vec<RangeInclusive<u16>>,
}

impl Default for SourcePorts {
    /// The kernel's default range, nothing reserved.
    fn default() -> Self {
        SourcePorts {
            range: 32768..=60999,
            reserved: Vec::new(),
        }
    }
}

impl SourcePorts {
    /// The calling thread's netns's settings; the default for what cannot be read.
    pub fn read() -> SourcePorts {
        let read = |name: &str| std::fs::read_to_string(format!("/proc/sys/net/ipv4/{name}"));
        match (read("ip_local_port_range"), read("ip_local_reserved_ports")) {
            (Ok(range), Ok(reserved)) => SourcePorts::parse(&range, &reserved).unwrap_or_default(),
            (Ok(range), Err(_)) => SourcePorts::parse(&range, "").unwrap_or_default(),
            _ => SourcePorts::default(),
        }
    }

    /// `range`: "low high"; `reserved`: "a,b-c,..." (either may be empty of ports).
    pub fn parse(range: &str, reserved: &str) -> Option<SourcePorts> {
        let mut bounds = range.split_whitespace().map(str::parse::<u16>);
        let (Some(Ok(low)), Some(Ok(high)), None) = (bounds.next(), bounds.next(), bounds.next())
        else {
            return None;
        };
        if low == 0 || low > high {
            return None;
        }
        let mut kept = Vec::new();
        for item in reserved
            .trim()
            .split(',')
            .map(str::trim)
            .filter(|i| !i.is_empty())
        {
            let (a, b) = item.split_once('-').unwrap_or((item, item));
            let (a, b) = (a.trim().parse::<u16>().ok()?, b.trim().parse::<u16>().ok()?);
            kept.push(a..=b);
        }
        Some(SourcePorts {
            range: low..=high,
            reserved: kept,
        })
    }

    /// A random port from [`LOWEST`] up, outside the ephemeral range, neither reserved nor
    /// one `avoid` names; None if the draws found only such ports or there are none (then
    /// the kernel chooses).
    pub fn pick(&self, avoid: impl Fn(u16) -> bool) -> Option<u16> {
        let (low, high) = (u32::from(*self.range.start()), u32::from(*self.range.end()));
        let below = low.saturating_sub(u32::from(LOWEST));
        let above = u32::from(u16::MAX) - high;
        if below + above == 0 {
            return None;
        }
        let mut rng = rand::rng();
        let port = |r: u32| {
            if r < below {
                u32::from(LOWEST) + r
            } else {
                high + 1 + (r - below)
            }
        };
        (0..DRAWS)
            .filter_map(|_| u16::try_from(port(rng.random_range(0..below + above))).ok())
            .find(|p| !self.reserved.iter().any(|r| r.contains(p)) && !avoid(*p))
    }
}

/// The original tuples of the connections the proxy accepted inside one pod (captured
/// plaintext keeps the client's address and the app's as its own). A delivery from such
/// a client to the same destination must not take that client's port: its tuple would be
/// the accepted socket's reversed, its SYN would land on that socket, and the connect
/// would hang until its timeout (once in 28,232 plaintext connections while deliveries
/// came from the clients' own range; now only a client whose port lies outside it can
/// meet one). Bounded by the pod's open connections; counted, as a closed connection's
/// handler may still hold its entry when the client reuses the port. The converse, a
/// client's new connection from the port of an open delivery, is what picking outside
/// the ephemeral range prevents (the module's doc).
#[derive(Debug, Default)]
pub struct AcceptedTuples(Mutex<HashMap<(SocketAddr, SocketAddr), u32>>);

impl AcceptedTuples {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(SocketAddr, SocketAddr), u32>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `client` → `local` until the returned guard drops.
    pub fn hold(self: &Arc<Self>, client: SocketAddr, local: SocketAddr) -> HeldTuple {
        *self.lock().entry((client, local)).or_default() += 1;
        HeldTuple(Box::new((self.clone(), client, local)))
    }

    /// Whether an accepted connection from `client` to `local` is open.
    pub fn holds(&self, client: SocketAddr, local: SocketAddr) -> bool {
        self.lock().contains_key(&(client, local))
    }
}

/// One accepted connection's tuple, held while the guard lives. Boxed: it stays in the
/// connection's task for its life, which should carry a pointer, not 72 bytes.
pub struct HeldTuple(Box<(Arc<AcceptedTuples>, SocketAddr, SocketAddr)>);

impl Drop for HeldTuple {
    fn drop(&mut self) {
        let (tuples, client, local) = &*self.0;
        let mut held = tuples.lock();
        if let Some(n) = held.get_mut(&(*client, *local)) {
            *n -= 1;
            if *n == 0 {
                held.remove(&(*client, *local));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settings_parse_as_the_kernel_writes_them() {
        let p = SourcePorts::parse("32768\t60999\n", "\n").unwrap();
        assert_eq!(p, SourcePorts::default());
        let p = SourcePorts::parse("1024 1030", "1024-1028,1030\n").unwrap();
        assert_eq!(p.reserved, vec![1024..=1028, 1030..=1030]);
        for bad in [
            "",
            "1024",
            "2000 1000",
            "0 10",
            "1 2 3",
            "a b",
            "1024 70000",
        ] {
            assert_eq!(SourcePorts::parse(bad, ""), None, "{bad:?}");
        }
        assert_eq!(SourcePorts::parse("1024 2000", "12x"), None);
    }

    #[test]
    fn a_pick_stays_outside_the_ephemeral_range_and_off_reserved_ports() {
        // Outside 1030-65533 from 1024 up: 1024-1029 and 65534-65535, of which 1024-1028
        // are reserved.
        let p = SourcePorts::parse("1030 65533", "1024-1028").unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let port = p.pick(|_| false);
            assert!(
                matches!(port, None | Some(1029) | Some(65534) | Some(65535)),
                "{port:?}"
            );
            seen.extend(port);
            assert!(
                matches!(p.pick(|p| p == 1029), None | Some(65534) | Some(65535)),
                "a port to avoid is never picked"
            );
        }
        assert_eq!(seen.len(), 3, "both sides of the range are used: {seen:?}");
        let default = SourcePorts::default();
        assert!((0..200)
            .filter_map(|_| default.pick(|_| false))
            .all(|p| p >= 1024 && !(32768..=60999).contains(&p)));
        let none = SourcePorts::parse("1024 65535", "").unwrap();
        assert_eq!(
            none.pick(|_| false),
            None,
            "nothing outside the range: the kernel chooses"
        );
        let all = SourcePorts::parse("1026 65535", "1024-1025").unwrap();
        assert_eq!(
            all.pick(|_| false),
            None,
            "all reserved: the kernel chooses"
        );
        let low = SourcePorts::parse("1000 65534", "").unwrap();
        assert_eq!(low.pick(|_| false), Some(65535), "never below 1024");
    }

    #[test]
    fn a_held_tuple_stays_until_its_last_guard_drops() {
        let tuples = Arc::new(AcceptedTuples::default());
        let (client, local): (SocketAddr, SocketAddr) = (
            "10.0.0.1:40000".parse().unwrap(),
            "10.0.0.2:8080".parse().unwrap(),
        );
        let first = tuples.hold(client, local);
        let again = tuples.hold(client, local);
        assert!(tuples.holds(client, local));
        assert!(!tuples.holds(client, "10.0.0.2:8081".parse().unwrap()));
        drop(first);
        assert!(
            tuples.holds(client, local),
            "the second connection on the tuple still holds it"
        );
        drop(again);
        assert!(!tuples.holds(client, local));
        assert!(
            tuples.lock().is_empty(),
            "nothing kept of closed connections"
        );
    }
}
