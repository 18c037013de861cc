//! Addresses as the mesh config writes them.

use std::fmt;
use std::net::IpAddr;

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
            return Ok(NetworkCidr { network: String::new(), cidr });
        }
        let parsed = s.split_once('/').and_then(|(network, rest)| Some(NetworkCidr { network: network.to_string(), cidr: rest.parse().ok()? }));
        parsed.ok_or_else(|| serde::de::Error::custom(format!("invalid VIP range {s:?}: expected \"<network>/<ip>/<length>\" or \"<ip>/<length>\"")))
    }
}

impl fmt::Display for NetworkCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.cidr.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_ranges_name_their_network() {
        let a: NetworkAddress = serde_yaml::from_str("net-b/10.0.0.1").unwrap();
        assert_eq!((a.network.as_str(), a.to_string().as_str()), ("net-b", "net-b/10.0.0.1"));
        let a: NetworkAddress = serde_yaml::from_str("10.0.0.1").unwrap();
        assert_eq!(a.to_string(), "/10.0.0.1");
        let r: NetworkCidr = serde_yaml::from_str("10.200.0.0/16").unwrap();
        assert_eq!((r.network.as_str(), r.to_string().as_str()), ("", "/10.200.0.0/16"));
        let r: NetworkCidr = serde_yaml::from_str("net-b/10.200.0.0/16").unwrap();
        assert_eq!(r.to_string(), "net-b/10.200.0.0/16");
        assert!(r.cidr.contains("10.200.9.9".parse().unwrap()));
        for bad in ["net-b/10.200.0.0/40", "10.200.0.0/x", "net/b/10.0.0.0/8"] {
            let e = serde_yaml::from_str::<NetworkCidr>(bad).unwrap_err().to_string();
            assert!(e.contains("invalid VIP range"), "{bad}: {e}");
        }
    }
}
