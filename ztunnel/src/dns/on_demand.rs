//! On-demand DNS, as Istio's ztunnel does it: a connection routed to a workload that has
//! a `hostname` and no IP (the endpoint of a DNS-resolved ServiceEntry) gets the name
//! resolved through the node's upstream resolvers (the DNS proxy's: ztunnel's own
//! resolv.conf or `--dns-upstream`, queried from ztunnel's netns with the proxy mark),
//! then goes to one of the addresses, the original destination's family preferred,
//! picked at random.
//!
//! The name is asked as it is (absolute, no search domains), for A records, and AAAA
//! too when IPv6 is on (Istio asks both then, and filters afterwards). Answers are kept
//! node-wide in a bounded cache for their TTL (negative ones for their SOA's, as the
//! forwarding cache does, `cache`), so a busy egress host costs one query per TTL; the
//! concurrent connections that miss the cache for one name share one query.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};
use rand::seq::IndexedRandom;

use super::cache::{self, Cache, CacheKey};
use super::error::DnsError;
use super::forwarder::Forwarder;
use crate::metrics::on_demand_dns::OnDemandDnsMetrics;
use crate::state::Workload;

/// CNAMEs followed in one answer, at most.
const MAX_CNAME_CHAIN: usize = 8;
/// Questions in flight upstream for on-demand DNS, node-wide.
const MAX_IN_FLIGHT: usize = 256;

#[derive(Debug, Clone, thiserror::Error)]
pub enum OnDemandError {
    #[error("{0:?} is not a DNS name")]
    BadName(String),
    #[error("lookup failed: {0}")]
    Upstream(Arc<DnsError>),
    #[error("no address for {name} (upstream answered {rcode})")]
    NoAddress { name: String, rcode: ResponseCode },
    #[error("the lookup of {0} ended without an answer")]
    Aborted(String),
}

#[derive(Clone, Debug)]
pub struct OnDemandConfig {
    pub upstreams: Vec<SocketAddr>,
    /// Ask AAAA as well as A (Istio's IPV6_ENABLED); off while pod traffic is IPv4 only.
    pub ipv6: bool,
    /// Cached answers, at most (Istio's ztunnel keeps 4096); 0 turns the cache off.
    pub cache_entries: usize,
    pub cache_bytes: usize,
    pub attempt_timeout: Duration,
    pub total_timeout: Duration,
}

impl Default for OnDemandConfig {
    fn default() -> Self {
        OnDemandConfig {
            upstreams: Vec::new(),
            ipv6: false,
            cache_entries: 4096,
            cache_bytes: 1 << 20,
            attempt_timeout: Duration::from_secs(2),
            total_timeout: Duration::from_secs(5),
        }
    }
}

type Addresses = Result<Arc<Vec<IpAddr>>, OnDemandError>;
type Flight = Shared<BoxFuture<'static, Addresses>>;

struct Inner {
    forwarder: Forwarder,
    cache: Cache,
    /// Lookups under way, by question; each entry is removed by its own task.
    flights: Mutex<HashMap<CacheKey, Flight>>,
}

/// The node's on-demand resolver, shared by every pod's outbound connections.
pub struct OnDemandResolver {
    inner: Arc<Inner>,
    ipv6: bool,
    metrics: OnDemandDnsMetrics,
}

impl OnDemandResolver {
    pub fn new(cfg: OnDemandConfig, metrics: OnDemandDnsMetrics) -> OnDemandResolver {
        let inner = Inner {
            forwarder: Forwarder::new(
                cfg.upstreams,
                cfg.attempt_timeout,
                cfg.total_timeout,
                MAX_IN_FLIGHT,
            ),
            cache: Cache::new(cfg.cache_entries, cfg.cache_bytes),
            flights: Mutex::new(HashMap::new()),
        };
        OnDemandResolver {
            inner: Arc::new(inner),
            ipv6: cfg.ipv6,
            metrics,
        }
    }

    /// The address a connection from `src`, originally to `original`, goes to for a
    /// workload known by `hostname`; counted in `istio_on_demand_dns_total`.
    pub async fn resolve(
        &self,
        src: &Workload,
        hostname: &str,
        original: IpAddr,
    ) -> Result<IpAddr, OnDemandError> {
        self.metrics.request(src, hostname);
        let addrs = self.addresses(hostname).await?;
        pick(&addrs, original.is_ipv6()).ok_or_else(|| OnDemandError::NoAddress {
            name: hostname.into(),
            rcode: ResponseCode::NoError,
        })
    }

    /// Every address of `hostname`, for a proxy that balances over all of them (the
    /// waypoint, as Envoy's STRICT_DNS clusters do); counted as `resolve` is.
    pub async fn resolve_all(
        &self,
        src: &Workload,
        hostname: &str,
    ) -> Result<Vec<IpAddr>, OnDemandError> {
        self.metrics.request(src, hostname);
        let addrs = self.addresses(hostname).await?;
        if addrs.is_empty() {
            return Err(OnDemandError::NoAddress {
                name: hostname.into(),
                rcode: ResponseCode::NoError,
            });
        }
        Ok(addrs)
    }

    /// Every address of `hostname` (an IP literal is its own address).
    pub async fn addresses(&self, hostname: &str) -> Result<Vec<IpAddr>, OnDemandError> {
        if let Ok(ip) = hostname.parse::<IpAddr>() {
            return Ok(vec![ip]);
        }
        let bad = || OnDemandError::BadName(hostname.to_string());
        let name = Name::from_ascii(hostname).map_err(|_| bad())?;
        let mut name = name.to_lowercase();
        name.set_fqdn(true);
        let types: &[RecordType] = if self.ipv6 {
            &[RecordType::A, RecordType::AAAA]
        } else {
            &[RecordType::A]
        };
        let answers = futures_util::future::join_all(
            types.iter().map(|t| lookup(&self.inner, key(&name, *t))),
        )
        .await;
        // Any family that answered will do; else the first failure says why.
        let mut first_err = None;
        let mut out = Vec::new();
        for a in answers {
            match a {
                Ok(addrs) => out.extend(addrs.iter().copied()),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) if out.is_empty() => Err(e),
            _ => Ok(out),
        }
    }

    /// (entries, bytes) in the cache.
    pub fn cache_usage(&self) -> (usize, usize) {
        self.inner.cache.usage()
    }
}

fn key(name: &Name, qtype: RecordType) -> CacheKey {
    CacheKey {
        name: name.to_ascii(),
        qtype,
        qclass: DNSClass::IN,
        dnssec_ok: false,
        checking_disabled: false,
    }
}

/// One question, from the cache, from a lookup already under way, or asked upstream.
async fn lookup(inner: &Arc<Inner>, key: CacheKey) -> Addresses {
    if let Some(hit) = inner.cache.get(&key, Instant::now()) {
        return match Message::from_vec(&hit.wire) {
            Ok(m) => addresses_in(&m, &key).map(Arc::new),
            Err(_) => Err(OnDemandError::Aborted(key.name.clone())),
        };
    }
    let flight = {
        let mut flights = inner.flights.lock().unwrap_or_else(|p| p.into_inner());
        match flights.get(&key) {
            Some(f) => f.clone(),
            None => {
                // A task of its own: the answer is cached even if every waiting
                // connection goes away. It removes its entry under this lock, so only
                // after the entry is in.
                let (i, k) = (inner.clone(), key.clone());
                let task = tokio::spawn(async move {
                    let r = ask(&i, &k).await;
                    i.flights
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&k);
                    r
                });
                let name = key.name.clone();
                let f = async move { task.await.unwrap_or(Err(OnDemandError::Aborted(name))) }
                    .boxed()
                    .shared();
                flights.insert(key.clone(), f.clone());
                f
            }
        }
    };
    flight.await
}

/// Asks upstream and caches what may be cached.
async fn ask(inner: &Inner, key: &CacheKey) -> Addresses {
    let name = Name::from_ascii(&key.name).map_err(|_| OnDemandError::BadName(key.name.clone()))?;
    let q = Query::query(name, key.qtype);
    let answer = inner
        .forwarder
        .ask(&q, false, false)
        .await
        .map_err(|e| OnDemandError::Upstream(Arc::new(e)))?;
    if let Some(ttl) = cache::cache_ttl(&answer.message) {
        inner
            .cache
            .insert(key.clone(), answer.wire, ttl, Instant::now());
    }
    tracing::debug!(hostname = %key.name.trim_end_matches('.'), query = %key.qtype, upstream = %answer.server,
        answers = answer.message.answers.len(), "on-demand DNS lookup");
    addresses_in(&answer.message, key).map(Arc::new)
}

/// The addresses an answer gives for the question's name, following its CNAME chain.
fn addresses_in(m: &Message, key: &CacheKey) -> Result<Vec<IpAddr>, OnDemandError> {
    let lower = |n: &Name| n.to_lowercase().to_ascii();
    let mut chain = vec![key.name.clone()];
    for _ in 0..MAX_CNAME_CHAIN {
        let Some(last) = chain.last() else { break };
        let next = m.answers.iter().find_map(|r| match &r.data {
            RData::CNAME(c) if lower(&r.name) == *last => Some(lower(&c.0)),
            _ => None,
        });
        match next {
            Some(n) if !chain.contains(&n) => chain.push(n),
            _ => break,
        }
    }
    let addrs: Vec<IpAddr> = m
        .answers
        .iter()
        .filter(|r| chain.contains(&lower(&r.name)))
        .filter_map(|r| match &r.data {
            RData::A(a) if key.qtype == RecordType::A => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) if key.qtype == RecordType::AAAA => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect();
    if addrs.is_empty() {
        let name = key.name.trim_end_matches('.').to_string();
        return Err(OnDemandError::NoAddress {
            name,
            rcode: m.metadata.response_code,
        });
    }
    Ok(addrs)
}

/// One of `addrs` at random, of the family asked for if there is one (a v4 client on a
/// v6 address fails in a v4-only network, and the other way round).
pub fn pick(addrs: &[IpAddr], prefer_v6: bool) -> Option<IpAddr> {
    let same: Vec<IpAddr> = addrs
        .iter()
        .copied()
        .filter(|a| a.is_ipv6() == prefer_v6)
        .collect();
    let from = if same.is_empty() { addrs } else { &same[..] };
    from.choose(&mut rand::rng()).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{MessageType, OpCode};
    use hickory_proto::rr::rdata::{A, AAAA, CNAME, SOA};
    use hickory_proto::rr::Record;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake upstream on loopback: `host.example` has two A records (TTL `ttl`), a CNAME
    /// `alias.example` to it, an AAAA; anything else NXDOMAIN with a 1 s negative TTL.
    /// Counts the questions it gets.
    async fn upstream(ttl: u32) -> (SocketAddr, Arc<AtomicUsize>) {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let asked = Arc::new(AtomicUsize::new(0));
        let n = asked.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 1500];
            while let Ok((len, peer)) = sock.recv_from(&mut buf).await {
                let Ok(req) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                n.fetch_add(1, Ordering::SeqCst);
                let q = req.queries[0].clone();
                let mut r = Message::new(req.metadata.id, MessageType::Response, OpCode::Query);
                r.queries = req.queries.clone();
                let host = Name::from_ascii("host.example.").unwrap();
                match (
                    q.name().to_ascii().to_ascii_lowercase().as_str(),
                    q.query_type(),
                ) {
                    ("host.example.", RecordType::A) => {
                        r.answers.push(Record::from_rdata(
                            host.clone(),
                            ttl,
                            RData::A(A::new(192, 0, 2, 1)),
                        ));
                        r.answers.push(Record::from_rdata(
                            host.clone(),
                            ttl,
                            RData::A(A::new(192, 0, 2, 2)),
                        ));
                    }
                    ("host.example.", RecordType::AAAA) => {
                        r.answers.push(Record::from_rdata(
                            host.clone(),
                            ttl,
                            RData::AAAA(AAAA::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)),
                        ));
                    }
                    ("alias.example.", RecordType::A) => {
                        // A stray record for another name must not be taken.
                        r.answers.push(Record::from_rdata(
                            Name::from_ascii("other.example.").unwrap(),
                            ttl,
                            RData::A(A::new(198, 51, 100, 9)),
                        ));
                        r.answers.push(Record::from_rdata(
                            q.name().clone(),
                            ttl,
                            RData::CNAME(CNAME(host.clone())),
                        ));
                        r.answers.push(Record::from_rdata(
                            host.clone(),
                            ttl,
                            RData::A(A::new(192, 0, 2, 1)),
                        ));
                    }
                    _ => {
                        r.metadata.response_code = ResponseCode::NXDomain;
                        let zone = Name::from_ascii("example.").unwrap();
                        r.authorities.push(Record::from_rdata(
                            zone.clone(),
                            1,
                            RData::SOA(SOA::new(zone.clone(), zone, 1, 1, 1, 1, 1)),
                        ));
                    }
                }
                // Slow enough that concurrent lookups overlap.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = sock.send_to(&r.to_vec().unwrap(), peer).await;
            }
        });
        (addr, asked)
    }

    fn resolver(up: SocketAddr, ipv6: bool, cache_entries: usize) -> OnDemandResolver {
        let cfg = OnDemandConfig {
            upstreams: vec![up],
            ipv6,
            cache_entries,
            ..Default::default()
        };
        OnDemandResolver::new(cfg, OnDemandDnsMetrics::default())
    }

    fn sorted(mut v: Vec<IpAddr>) -> Vec<String> {
        v.sort();
        v.iter().map(|a| a.to_string()).collect()
    }

    // The forwarder marks its sockets (SO_MARK): root only, as the e2e tests run.
    fn can_mark() -> bool {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
        s.set_mark(crate::marks::PROXY_MARK).is_ok()
    }

    #[tokio::test]
    async fn answers_are_cached_for_their_ttl() {
        if !can_mark() {
            return crate::test_skip::skipped(
                "cannot set SO_MARK (needs CAP_NET_ADMIN: run as root)",
            );
        }
        let (up, asked) = upstream(1).await;
        let r = resolver(up, false, 16);
        assert_eq!(
            sorted(r.addresses("Host.Example").await.unwrap()),
            ["192.0.2.1", "192.0.2.2"]
        );
        assert_eq!(
            sorted(r.addresses("host.example.").await.unwrap()),
            ["192.0.2.1", "192.0.2.2"]
        );
        assert_eq!(
            asked.load(Ordering::SeqCst),
            1,
            "the second lookup came from the cache"
        );
        // Past the TTL it is asked again.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        r.addresses("host.example").await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        // Negative answers are cached too (for their SOA's TTL), and say why.
        let e = r.addresses("missing.example").await.unwrap_err();
        assert!(
            e.to_string()
                .contains("no address for missing.example (upstream answered Non-Existent Domain"),
            "{e}"
        );
        r.addresses("missing.example").await.unwrap_err();
        assert_eq!(asked.load(Ordering::SeqCst), 3);
        // IP literals need no lookup.
        assert_eq!(
            r.addresses("192.0.2.77").await.unwrap(),
            vec!["192.0.2.77".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(asked.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn the_cache_is_bounded() {
        if !can_mark() {
            return crate::test_skip::skipped(
                "cannot set SO_MARK (needs CAP_NET_ADMIN: run as root)",
            );
        }
        let (up, asked) = upstream(60).await;
        let r = resolver(up, false, 2);
        for name in ["host.example", "alias.example", "missing.example"] {
            let _ = r.addresses(name).await;
        }
        assert_eq!(r.cache_usage().0, 2, "at most the bound");
        // host.example was the least recently used: gone, asked again.
        r.addresses("host.example").await.unwrap();
        assert_eq!(asked.load(Ordering::SeqCst), 4);
        let off = resolver(up, false, 0);
        off.addresses("host.example").await.unwrap();
        assert_eq!(off.cache_usage(), (0, 0));
    }

    #[tokio::test]
    async fn concurrent_lookups_share_one_question() {
        if !can_mark() {
            return crate::test_skip::skipped(
                "cannot set SO_MARK (needs CAP_NET_ADMIN: run as root)",
            );
        }
        let (up, asked) = upstream(60).await;
        let r = Arc::new(resolver(up, false, 16));
        let tasks: Vec<_> = (0..20)
            .map(|_| {
                let r = r.clone();
                tokio::spawn(async move { r.addresses("host.example").await })
            })
            .collect();
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap().len(), 2);
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert!(
            r.inner.flights.lock().unwrap().is_empty(),
            "finished lookups leave nothing behind"
        );
    }

    #[tokio::test]
    async fn cname_chains_families_and_the_original_destinations_family() {
        if !can_mark() {
            return crate::test_skip::skipped(
                "cannot set SO_MARK (needs CAP_NET_ADMIN: run as root)",
            );
        }
        let (up, _) = upstream(60).await;
        let v4 = resolver(up, false, 16);
        assert_eq!(
            sorted(v4.addresses("alias.example").await.unwrap()),
            ["192.0.2.1"],
            "through the CNAME, not the stray record"
        );
        let dual = resolver(up, true, 16);
        assert_eq!(
            sorted(dual.addresses("host.example").await.unwrap()),
            ["192.0.2.1", "192.0.2.2", "2001:db8::1"]
        );
        let src = Workload::new("c", "client", "default");
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert!(dual
            .resolve(&src, "host.example", v6)
            .await
            .unwrap()
            .is_ipv6());
        for _ in 0..10 {
            assert!(dual
                .resolve(&src, "host.example", "10.0.0.1".parse().unwrap())
                .await
                .unwrap()
                .is_ipv4());
        }
        // An A-only name still answers (the AAAA failure is not the connection's).
        assert_eq!(
            sorted(dual.addresses("alias.example").await.unwrap()),
            ["192.0.2.1"]
        );
    }

    #[test]
    fn picks_the_asked_family_when_it_can() {
        let addrs: Vec<IpAddr> = ["192.0.2.1", "2001:db8::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        for _ in 0..20 {
            assert_eq!(pick(&addrs, false), Some(addrs[0]));
            assert_eq!(pick(&addrs, true), Some(addrs[1]));
        }
        // The other family rather than nothing; nothing from nothing.
        assert_eq!(pick(&addrs[..1], true), Some(addrs[0]));
        assert_eq!(pick(&[], false), None);
        let many: Vec<IpAddr> = (1..=4).map(|i| IpAddr::from([192, 0, 2, i])).collect();
        let seen: std::collections::BTreeSet<_> =
            (0..200).filter_map(|_| pick(&many, false)).collect();
        assert_eq!(seen.len(), 4, "spread over every address");
    }

    #[tokio::test]
    async fn names_that_cannot_be_asked() {
        let r = resolver("127.0.0.1:9".parse().unwrap(), false, 16);
        assert!(matches!(
            r.addresses("bad name").await,
            Err(OnDemandError::BadName(_))
        ));
        let none = OnDemandResolver::new(OnDemandConfig::default(), OnDemandDnsMetrics::default());
        let e = none.addresses("host.example").await.unwrap_err();
        assert!(e.to_string().contains("no upstream DNS server"), "{e}");
    }
}
