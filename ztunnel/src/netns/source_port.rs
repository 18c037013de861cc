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

/// A pod's ephemeral port range and the ports it reserves (`ip_local_port_range`,
/// `ip_local_reserved_ports`): the ports the kernel itself would choose from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourcePorts {
    range: RangeInclusive<u16>,
    reserved: Vec<RangeInclusive<u16>>,
}

impl Default for SourcePorts {
    /// The kernel's default range, nothing reserved.
    fn default() -> Self {
        SourcePorts { range: 32768..=60999, reserved: Vec::new() }
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
        let (Some(Ok(low)), Some(Ok(high)), None) = (bounds.next(), bounds.next(), bounds.next()) else {
            return None;
        };
        if low == 0 || low > high {
            return None;
        }
        let mut kept = Vec::new();
        for item in reserved.trim().split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (a, b) = item.split_once('-').unwrap_or((item, item));
            let (a, b) = (a.trim().parse::<u16>().ok()?, b.trim().parse::<u16>().ok()?);
            kept.push(a..=b);
        }
        Some(SourcePorts { range: low..=high, reserved: kept })
    }

    /// A random port of the range that is neither reserved nor one `avoid` names; None
    /// if the draws found only such ports (then the kernel chooses).
    pub fn pick(&self, avoid: impl Fn(u16) -> bool) -> Option<u16> {
        let mut rng = rand::rng();
        (0..DRAWS)
            .map(|_| rng.random_range(self.range.clone()))
            .find(|p| !self.reserved.iter().any(|r| r.contains(p)) && !avoid(*p))
    }
}

/// The original tuples of the connections the proxy accepted inside one pod (captured
/// plaintext keeps the client's address and the app's as its own). A delivery from such
/// a client to the same destination must not take that client's port: its tuple would be
/// the accepted socket's reversed, its SYN would land on that socket, and the connect
/// would hang until its timeout (with 1 in 28,232 odds per connection from a random pick).
/// Bounded by the pod's open connections; counted, as a closed connection's handler may
/// still hold its entry when the client reuses the port. The converse, a client's kernel
/// giving a new connection the port of one of our open deliveries from its address, is
/// not ours to prevent: any proxy that keeps the client's address but not its port has it.
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
        for bad in ["", "1024", "2000 1000", "0 10", "1 2 3", "a b", "1024 70000"] {
            assert_eq!(SourcePorts::parse(bad, ""), None, "{bad:?}");
        }
        assert_eq!(SourcePorts::parse("1024 2000", "12x"), None);
    }

    #[test]
    fn a_pick_stays_in_the_range_and_off_reserved_ports() {
        let p = SourcePorts::parse("1024 1030", "1024-1028").unwrap();
        for _ in 0..200 {
            let port = p.pick(|_| false);
            assert!(matches!(port, None | Some(1029) | Some(1030)), "{port:?}");
            assert!(matches!(p.pick(|p| p == 1029), None | Some(1030)), "a port to avoid is never picked");
        }
        assert!((0..20).any(|_| p.pick(|_| false).is_some()));
        let all = SourcePorts::parse("1024 1025", "1024-1025").unwrap();
        assert_eq!(all.pick(|_| false), None, "nothing to pick: the kernel chooses");
    }

    #[test]
    fn a_held_tuple_stays_until_its_last_guard_drops() {
        let tuples = Arc::new(AcceptedTuples::default());
        let (client, local): (SocketAddr, SocketAddr) = ("10.0.0.1:40000".parse().unwrap(), "10.0.0.2:8080".parse().unwrap());
        let first = tuples.hold(client, local);
        let again = tuples.hold(client, local);
        assert!(tuples.holds(client, local));
        assert!(!tuples.holds(client, "10.0.0.2:8081".parse().unwrap()));
        drop(first);
        assert!(tuples.holds(client, local), "the second connection on the tuple still holds it");
        drop(again);
        assert!(!tuples.holds(client, local));
        assert!(tuples.lock().is_empty(), "nothing kept of closed connections");
    }
}
