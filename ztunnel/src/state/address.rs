//! Addresses as the mesh config writes them.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::Deserialize;

/// A destination address as HBONE names it (`ip:port`, IPv6 in brackets).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HboneAddress(pub SocketAddr);

impl fmt::Display for HboneAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SocketAddr's Display already brackets IPv6.
        write!(f, "{}", self.0)
    }
}

/// `network/ip` as used in service VIP lists; a bare IP means the default network.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NetworkAddress {
    pub network: String,
    pub address: IpAddr,
}

impl<'de> Deserialize<'de> for NetworkAddress {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let (network, ip) = match s.rsplit_once('/') {
            Some((n, ip)) => (n.to_string(), ip),
            None => (String::new(), s.as_str()),
        };
        let address = ip.parse().map_err(|_| {
            serde::de::Error::custom(format!("invalid address {s:?}: expected \"<network>/<ip>\" or \"<ip>\""))
        })?;
        Ok(NetworkAddress { network, address })
    }
}

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.address)
    }
}

/// The addresses of an enrolled pod that its proxy serves and captures: at most one per
/// family (a Kubernetes pod has one of each at most), never none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PodIps {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl PodIps {
    /// The first address of each family of `ips`, IPv6 only when `ipv6` (Istio's
    /// IPV6_ENABLED); None when that leaves nothing.
    pub fn of(ips: &[IpAddr], ipv6: bool) -> Option<PodIps> {
        let v4 = ips.iter().find_map(|ip| match ip {
            IpAddr::V4(a) => Some(*a),
            IpAddr::V6(_) => None,
        });
        let v6 = ips.iter().find_map(|ip| match ip {
            IpAddr::V6(a) if ipv6 => Some(*a),
            _ => None,
        });
        (v4.is_some() || v6.is_some()).then_some(PodIps { v4, v6 })
    }

    /// IPv4 if the pod has it, else IPv6: the address logs name it by.
    pub fn primary(&self) -> IpAddr {
        match (self.v4, self.v6) {
            (Some(a), _) => a.into(),
            (None, Some(a)) => a.into(),
            (None, None) => Ipv4Addr::UNSPECIFIED.into(),
        }
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => self.v4 == Some(a),
            IpAddr::V6(a) => self.v6 == Some(a),
        }
    }

    /// The pod's address in `ip`'s family, if it has one.
    pub fn of_family(&self, ip: IpAddr) -> Option<IpAddr> {
        match ip {
            IpAddr::V4(_) => self.v4.map(IpAddr::V4),
            IpAddr::V6(_) => self.v6.map(IpAddr::V6),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = IpAddr> {
        self.v4.map(IpAddr::V4).into_iter().chain(self.v6.map(IpAddr::V6))
    }
}

impl fmt::Display for PodIps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let all: Vec<String> = self.iter().map(|ip| ip.to_string()).collect();
        f.write_str(&all.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ips_one_per_family_and_ipv6_only_when_enabled() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let dual = [ip("10.0.0.1"), ip("fd00::1"), ip("10.0.0.2"), ip("fd00::2")];
        let p = PodIps::of(&dual, true).unwrap();
        assert_eq!(p.iter().collect::<Vec<_>>(), [ip("10.0.0.1"), ip("fd00::1")]);
        assert_eq!(p.to_string(), "10.0.0.1,fd00::1");
        assert!(p.contains(ip("fd00::1")) && !p.contains(ip("fd00::2")) && !p.contains(ip("10.0.0.2")));
        assert_eq!(p.of_family(ip("fd00:96::1")), Some(ip("fd00::1")));
        assert_eq!(p.of_family(ip("127.0.0.1")), Some(ip("10.0.0.1")));
        assert_eq!(p.primary(), ip("10.0.0.1"));
        // IPV6_ENABLED=false: the IPv6 address is not served; a v6-only pod has nothing.
        assert_eq!(PodIps::of(&dual, false).unwrap().v6, None);
        assert_eq!(PodIps::of(&[ip("fd00::1")], false), None);
        let v6 = PodIps::of(&[ip("fd00::1")], true).unwrap();
        assert_eq!((v6.primary(), v6.of_family(ip("10.0.0.9"))), (ip("fd00::1"), None));
        assert_eq!(PodIps::of(&[], true), None);
    }
}
