//! Addresses as the mesh config writes them.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde::Deserialize;

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
            serde::de::Error::custom(format!(
                "invalid address {s:?}: expected \"<network>/<ip>\" or \"<ip>\""
            ))
        })?;
        Ok(NetworkAddress { network, address })
    }
}

impl fmt::Display for NetworkAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.address)
    }
}

/// A VIP range in a network (Istio's NetworkAddress with a prefix length): written
/// `"<network>/<cidr>"`, or `"<cidr>"` for the default network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkCidr {
    pub network: String,
    pub cidr: crate::cidr::Cidr,
}

impl<'de> Deserialize<'de> for NetworkCidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if let Ok(cidr) = s.parse() {
            return Ok(NetworkCidr {
                network: String::new(),
                cidr,
            });
        }
        let parsed = s.split_once('/').and_then(|(network, rest)| {
            Some(NetworkCidr {
                network: network.to_string(),
                cidr: rest.parse().ok()?,
            })
        });
        parsed.ok_or_else(|| serde::de::Error::custom(format!("invalid VIP range {s:?}: expected \"<network>/<ip>/<length>\" or \"<ip>/<length>\"")))
    }
}

impl fmt::Display for NetworkCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.cidr.0)
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
        self.v4
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.v6.map(IpAddr::V6))
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
    fn addresses_and_ranges_name_their_network() {
        let a: NetworkAddress = serde_yaml::from_str("net-b/10.0.0.1").unwrap();
        assert_eq!(
            (a.network.as_str(), a.to_string().as_str()),
            ("net-b", "net-b/10.0.0.1")
        );
        let a: NetworkAddress = serde_yaml::from_str("10.0.0.1").unwrap();
        assert_eq!(a.to_string(), "/10.0.0.1");
        let r: NetworkCidr = serde_yaml::from_str("10.200.0.0/16").unwrap();
        assert_eq!(
            (r.network.as_str(), r.to_string().as_str()),
            ("", "/10.200.0.0/16")
        );
        let r: NetworkCidr = serde_yaml::from_str("net-b/10.200.0.0/16").unwrap();
        assert_eq!(r.to_string(), "net-b/10.200.0.0/16");
        assert!(r.cidr.contains("10.200.9.9".parse().unwrap()));
        for bad in ["net-b/10.200.0.0/40", "10.200.0.0/x", "net/b/10.0.0.0/8"] {
            let e = serde_yaml::from_str::<NetworkCidr>(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("invalid VIP range"), "{bad}: {e}");
        }
    }

    #[test]
    fn pod_ips_one_per_family_and_ipv6_only_when_enabled() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let dual = [ip("10.0.0.1"), ip("fd00::1"), ip("10.0.0.2"), ip("fd00::2")];
        let p = PodIps::of(&dual, true).unwrap();
        assert_eq!(
            p.iter().collect::<Vec<_>>(),
            [ip("10.0.0.1"), ip("fd00::1")]
        );
        assert_eq!(p.to_string(), "10.0.0.1,fd00::1");
        assert!(
            p.contains(ip("fd00::1")) && !p.contains(ip("fd00::2")) && !p.contains(ip("10.0.0.2"))
        );
        assert_eq!(p.of_family(ip("fd00:96::1")), Some(ip("fd00::1")));
        assert_eq!(p.of_family(ip("127.0.0.1")), Some(ip("10.0.0.1")));
        assert_eq!(p.primary(), ip("10.0.0.1"));
        // IPV6_ENABLED=false: the IPv6 address is not served; a v6-only pod has nothing.
        assert_eq!(PodIps::of(&dual, false).unwrap().v6, None);
        assert_eq!(PodIps::of(&[ip("fd00::1")], false), None);
        let v6 = PodIps::of(&[ip("fd00::1")], true).unwrap();
        assert_eq!(
            (v6.primary(), v6.of_family(ip("10.0.0.9"))),
            (ip("fd00::1"), None)
        );
        assert_eq!(PodIps::of(&[], true), None);
    }
}
