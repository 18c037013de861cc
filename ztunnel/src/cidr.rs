//! IP blocks in policies: one type for L4 authorization (`rbac`) and the waypoint's L7
//! AuthorizationPolicy, so both compare IPv4-mapped peers and rules alike.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;

/// An IP or CIDR (`10.0.0.0/8`, `10.1.2.3`, `fd00::/8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr(pub IpNet);

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        // Compare IPv4-mapped IPv6 peers as IPv4 so a dual-stack socket cannot dodge a v4 rule.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match self.0 {
            // An IPv4-mapped IPv6 rule (`::ffff:10.0.0.0/104`) names IPv4 peers, which are
            // compared as IPv4 above: compare the rule as IPv4 too, or it would never match.
            IpNet::V6(net) if net.prefix_len() >= 96 => match net.network().to_ipv4_mapped() {
                Some(v4) => ipnet::Ipv4Net::new(v4, net.prefix_len() - 96)
                    .is_ok_and(|n| IpNet::V4(n).contains(&ip)),
                None => self.0.contains(&ip),
            },
            _ => self.0.contains(&ip),
        }
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse::<Cidr>().map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(net) = s.parse::<IpNet>() {
            return Ok(Cidr(net));
        }
        s.parse::<IpAddr>()
            .map(|ip| Cidr(IpNet::from(ip)))
            .map_err(|_| {
                format!("invalid IP or CIDR {s:?}: expected e.g. \"10.0.0.0/8\" or \"10.1.2.3\"")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_mapped_source_matches_v4_cidr() {
        let c: Cidr = "10.0.0.0/8".parse().unwrap();
        assert!(c.contains("::ffff:10.1.2.3".parse().unwrap()));
    }

    #[test]
    fn ipv4_mapped_cidr_matches_v4_sources() {
        // Written as IPv4-mapped IPv6, the rule still names IPv4 peers (a DENY must not be dead).
        let c: Cidr = "::ffff:10.0.0.0/104".parse().unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(c.contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        let host: Cidr = "::ffff:10.1.2.3".parse().unwrap();
        assert!(host.contains("10.1.2.3".parse().unwrap()));
        assert!(!host.contains("10.1.2.4".parse().unwrap()));
        // Plain IPv6 rules are untouched.
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd00::1".parse().unwrap()));
        assert!(!v6.contains("10.1.2.3".parse().unwrap()));
    }
}
