//! PROXY protocol version 2 (the HAProxy spec, binary form), for Istio's "sandwich"
//! mode: a workload whose `application_tunnel` is PROXY gets, on each inbound HBONE
//! connection, a v2 header naming the original client and destination, with TLV
//! [`TLV_PEER_IDENTITY`] carrying the client's SPIFFE id, before the tunnelled bytes.
//!
//! `encode` writes that header; `parse` reads one strictly (any deviation from the spec
//! is an error, never a guess), so tests and receivers can trust what it returns.

use std::net::{IpAddr, SocketAddr};

use tokio::io::{AsyncRead, AsyncReadExt};

/// The 12 bytes every v2 header starts with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";

/// Istio's TLV type for the peer's SPIFFE id (a type the spec leaves to applications;
/// Istio's ztunnel writes it and Istio's waypoint configures Envoy to read it).
pub const TLV_PEER_IDENTITY: u8 = 0xD0;

/// Fixed part: signature, version/command, family/transport, length.
pub const FIXED_LEN: usize = 16;

const VERSION_2: u8 = 0x20;
const INET_ADDRS_LEN: usize = 12;
const INET6_ADDRS_LEN: usize = 36;
const UNIX_ADDRS_LEN: usize = 216;
const TLV_HEADER_LEN: usize = 3;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProxyProtocolError {
    /// Not an error for a stream reader: read at least this many bytes in all and retry.
    #[error("PROXY protocol header incomplete: {needed} bytes needed, {have} available; read more before parsing")]
    Incomplete { needed: usize, have: usize },
    #[error("not a PROXY protocol v2 header: the 12-byte signature does not match (is the sender configured for PROXY protocol v2?)")]
    BadSignature,
    #[error("PROXY protocol version {0} is not supported; only version 2 (binary) is")]
    BadVersion(u8),
    #[error("PROXY protocol command {0} is unknown; expected 0 (LOCAL) or 1 (PROXY)")]
    BadCommand(u8),
    #[error("PROXY protocol address family {0} is unknown; expected 0 (UNSPEC), 1 (INET), 2 (INET6) or 3 (UNIX)")]
    BadFamily(u8),
    #[error(
        "PROXY protocol transport {0} is unknown; expected 0 (UNSPEC), 1 (STREAM) or 2 (DGRAM)"
    )]
    BadTransport(u8),
    #[error("PROXY protocol header length {length} is shorter than the {needed}-byte address block of its family")]
    ShortAddresses { length: usize, needed: usize },
    #[error("PROXY protocol TLV at offset {offset} is truncated: it claims {claimed} bytes, {left} remain in the header")]
    TruncatedTlv {
        offset: usize,
        claimed: usize,
        left: usize,
    },
    #[error("PROXY protocol header would be {0} bytes; the length field allows at most 65535 after the fixed part, so send smaller TLVs")]
    TooLong(usize),
    #[error("PROXY protocol source {src} and destination {dst} differ in address family; both must be IPv4 or both IPv6")]
    MixedFamilies { src: SocketAddr, dst: SocketAddr },
    #[error("cannot read the PROXY protocol header: {0}")]
    Io(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// The connection was made by the proxy itself (health checks); addresses are to be ignored.
    Local,
    /// Relayed on behalf of the client in the address block.
    Proxy,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Unspec,
    Stream,
    Dgram,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addresses {
    Unspec,
    Ip {
        src: SocketAddr,
        dst: SocketAddr,
    },
    /// Two 108-byte socket paths, NUL padded, kept as sent.
    Unix {
        src: Vec<u8>,
        dst: Vec<u8>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tlv {
    pub kind: u8,
    pub value: Vec<u8>,
}

/// A parsed v2 header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub command: Command,
    pub transport: Transport,
    pub addresses: Addresses,
    pub tlvs: Vec<Tlv>,
}

impl Header {
    /// The first TLV of `kind`, if any.
    pub fn tlv(&self, kind: u8) -> Option<&[u8]> {
        self.tlvs
            .iter()
            .find(|t| t.kind == kind)
            .map(|t| t.value.as_slice())
    }

    /// The SPIFFE id Istio puts in TLV 0xD0, if present and UTF-8.
    pub fn peer_identity(&self) -> Option<&str> {
        self.tlv(TLV_PEER_IDENTITY)
            .and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// A PROXY (not LOCAL) v2 header for a TCP connection from `src` to `dst`, with `tlvs`.
/// Both addresses must be of one family; callers with a mix map IPv4 into IPv6 first
/// (see [`same_family`]).
pub fn encode(
    src: SocketAddr,
    dst: SocketAddr,
    tlvs: &[(u8, &[u8])],
) -> Result<Vec<u8>, ProxyProtocolError> {
    let (family, addr_len) = match (src.ip(), dst.ip()) {
        (IpAddr::V4(_), IpAddr::V4(_)) => (0x10, INET_ADDRS_LEN),
        (IpAddr::V6(_), IpAddr::V6(_)) => (0x20, INET6_ADDRS_LEN),
        _ => return Err(ProxyProtocolError::MixedFamilies { src, dst }),
    };
    let body = addr_len
        + tlvs
            .iter()
            .map(|(_, v)| TLV_HEADER_LEN + v.len())
            .sum::<usize>();
    let body_len =
        u16::try_from(body).map_err(|_| ProxyProtocolError::TooLong(FIXED_LEN + body))?;
    let mut out = Vec::with_capacity(FIXED_LEN + body);
    out.extend_from_slice(&SIGNATURE);
    out.push(VERSION_2 | 0x1); // PROXY
    out.push(family | 0x1); // STREAM
    out.extend_from_slice(&body_len.to_be_bytes());
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        _ => return Err(ProxyProtocolError::MixedFamilies { src, dst }),
    }
    out.extend_from_slice(&src.port().to_be_bytes());
    out.extend_from_slice(&dst.port().to_be_bytes());
    for (kind, value) in tlvs {
        // Each length fits: their sum (with the address block) fitted in a u16 above.
        let len = u16::try_from(value.len())
            .map_err(|_| ProxyProtocolError::TooLong(FIXED_LEN + body))?;
        out.push(*kind);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(value);
    }
    Ok(out)
}

/// `(src, dst)` in one family: when exactly one is IPv4, it becomes IPv4-mapped IPv6.
pub fn same_family(src: SocketAddr, dst: SocketAddr) -> (SocketAddr, SocketAddr) {
    let v6 = |a: SocketAddr| match a.ip() {
        IpAddr::V4(v4) => SocketAddr::new(IpAddr::V6(v4.to_ipv6_mapped()), a.port()),
        IpAddr::V6(_) => a,
    };
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(_), IpAddr::V6(_)) | (IpAddr::V6(_), IpAddr::V4(_)) => (v6(src), v6(dst)),
        _ => (src, dst),
    }
}

/// Parses one header from the start of `buf`; returns it and how many bytes it took
/// (the application's bytes follow). [`ProxyProtocolError::Incomplete`] says how many
/// bytes are needed in all; nothing else is recoverable.
pub fn parse(buf: &[u8]) -> Result<(Header, usize), ProxyProtocolError> {
    // Check what we have of the signature first, so non-PROXY input fails fast.
    let sig = buf.len().min(SIGNATURE.len());
    if buf[..sig] != SIGNATURE[..sig] {
        return Err(ProxyProtocolError::BadSignature);
    }
    let Some(fixed) = buf.get(..FIXED_LEN) else {
        return Err(ProxyProtocolError::Incomplete {
            needed: FIXED_LEN,
            have: buf.len(),
        });
    };
    let (ver_cmd, fam_proto) = (fixed[12], fixed[13]);
    if ver_cmd & 0xF0 != VERSION_2 {
        return Err(ProxyProtocolError::BadVersion(ver_cmd >> 4));
    }
    let command = match ver_cmd & 0x0F {
        0 => Command::Local,
        1 => Command::Proxy,
        c => return Err(ProxyProtocolError::BadCommand(c)),
    };
    let transport = match fam_proto & 0x0F {
        0 => Transport::Unspec,
        1 => Transport::Stream,
        2 => Transport::Dgram,
        t => return Err(ProxyProtocolError::BadTransport(t)),
    };
    let family = fam_proto >> 4;
    let addr_len = match family {
        0 => 0,
        1 => INET_ADDRS_LEN,
        2 => INET6_ADDRS_LEN,
        3 => UNIX_ADDRS_LEN,
        f => return Err(ProxyProtocolError::BadFamily(f)),
    };
    let length = usize::from(u16::from_be_bytes([fixed[14], fixed[15]]));
    if length < addr_len {
        return Err(ProxyProtocolError::ShortAddresses {
            length,
            needed: addr_len,
        });
    }
    let total = FIXED_LEN + length;
    let Some(body) = buf.get(FIXED_LEN..total) else {
        return Err(ProxyProtocolError::Incomplete {
            needed: total,
            have: buf.len(),
        });
    };
    let (addrs, mut rest) = body.split_at(addr_len);
    let addresses = match family {
        1 => {
            let ip = |b: &[u8]| IpAddr::from(<[u8; 4]>::try_from(b).unwrap_or_default());
            let port = |b: &[u8]| u16::from_be_bytes(<[u8; 2]>::try_from(b).unwrap_or_default());
            Addresses::Ip {
                src: SocketAddr::new(ip(&addrs[0..4]), port(&addrs[8..10])),
                dst: SocketAddr::new(ip(&addrs[4..8]), port(&addrs[10..12])),
            }
        }
        2 => {
            let ip = |b: &[u8]| IpAddr::from(<[u8; 16]>::try_from(b).unwrap_or_default());
            let port = |b: &[u8]| u16::from_be_bytes(<[u8; 2]>::try_from(b).unwrap_or_default());
            Addresses::Ip {
                src: SocketAddr::new(ip(&addrs[0..16]), port(&addrs[32..34])),
                dst: SocketAddr::new(ip(&addrs[16..32]), port(&addrs[34..36])),
            }
        }
        3 => Addresses::Unix {
            src: addrs[..108].to_vec(),
            dst: addrs[108..].to_vec(),
        },
        _ => Addresses::Unspec,
    };
    let mut tlvs = Vec::new();
    while !rest.is_empty() {
        let offset = total - rest.len();
        let Some(&[kind, hi, lo]) = rest.get(..TLV_HEADER_LEN) else {
            return Err(ProxyProtocolError::TruncatedTlv {
                offset,
                claimed: TLV_HEADER_LEN,
                left: rest.len(),
            });
        };
        let len = usize::from(u16::from_be_bytes([hi, lo]));
        let Some(value) = rest.get(TLV_HEADER_LEN..TLV_HEADER_LEN + len) else {
            return Err(ProxyProtocolError::TruncatedTlv {
                offset,
                claimed: len,
                left: rest.len() - TLV_HEADER_LEN,
            });
        };
        tlvs.push(Tlv {
            kind,
            value: value.to_vec(),
        });
        rest = &rest[TLV_HEADER_LEN + len..];
    }
    Ok((
        Header {
            command,
            transport,
            addresses,
            tlvs,
        },
        total,
    ))
}

/// Reads exactly one header from `r` (and not a byte more), for receivers and tests.
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Header, ProxyProtocolError> {
    let io = |e: std::io::Error| ProxyProtocolError::Io(e.to_string());
    let mut buf = vec![0u8; FIXED_LEN];
    r.read_exact(&mut buf).await.map_err(io)?;
    let needed = match parse(&buf) {
        Ok((h, _)) => return Ok(h),
        Err(ProxyProtocolError::Incomplete { needed, .. }) => needed,
        Err(e) => return Err(e),
    };
    buf.resize(needed, 0);
    r.read_exact(&mut buf[FIXED_LEN..]).await.map_err(io)?;
    parse(&buf).map(|(h, _)| h)
}

#[cfg(test)]
mod tests;
