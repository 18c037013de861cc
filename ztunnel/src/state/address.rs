//! Addresses as the mesh config writes them.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

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
