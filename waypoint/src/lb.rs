//! Per-endpoint load balancing (round robin, least request, random, or a consistent
//! hash) with outlier ejection: an endpoint that fails `consecutive_5xx` times in a row
//! is left out for a while, longer each time, unless that would leave no endpoint at
//! all. A Service's DestinationRule may choose its own (`destination`); and `Circuits`
//! counts what its connection pool limits (circuit breaking).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ztunnel::state::Workload;

pub use crate::destination::OutlierConfig;
use crate::destination::Pick;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LbPolicy {
    RoundRobin,
    /// Envoy's: the less loaded of two random endpoints (Istio's default).
    LeastRequest,
}

/// How one attempt to an endpoint ended, for outlier detection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// An answer that is no 5xx.
    Success,
    /// A 5xx answer.
    ServerError,
    /// No answer: the connection failed or was reset, or the attempt timed out.
    LocalFailure,
}

#[derive(Default)]
struct EndpointStats {
    active: u32,
    consecutive_failures: u32,
    consecutive_local_failures: u32,
    ejected_until: Option<Instant>,
    times_ejected: u32,
}

pub struct Balancer {
    policy: LbPolicy,
    outlier: OutlierConfig,
    next: AtomicUsize,
    stats: Mutex<HashMap<SocketAddr, EndpointStats>>,
}

/// An endpoint chosen for one attempt; its active-request count drops with this guard.
pub struct Picked {
    pub workload: Arc<Workload>,
    pub addr: SocketAddr,
    balancer: Arc<Balancer>,
    /// The outlier settings in force for this endpoint's Service.
    outlier: OutlierConfig,
    /// Circuit-breaker slots the request holds until its response is done.
    slots: Vec<Slot>,
}

impl Drop for Picked {
    fn drop(&mut self) {
        if let Some(s) = self.balancer.lock().get_mut(&self.addr) {
            s.active = s.active.saturating_sub(1);
        }
    }
}

impl Picked {
    /// Keeps `slot` taken for as long as this pick (the response) lives.
    pub fn hold(&mut self, slot: Slot) {
        self.slots.push(slot);
    }

    /// Feeds the attempt's outcome to outlier detection.
    pub fn report(&self, outcome: Outcome) {
        let cfg = self.outlier;
        let mut stats = self.balancer.lock();
        let s = stats.entry(self.addr).or_default();
        // Split: an answer means the connection worked (Envoy's LOCAL_ORIGIN_CONNECT_SUCCESS).
        if outcome != Outcome::LocalFailure {
            s.consecutive_local_failures = 0;
        }
        let (count, limit) = match (outcome, cfg.local_origin) {
            (Outcome::Success, _) => {
                s.consecutive_failures = 0;
                // Envoy's multiplier decay: each ejection-length of health after the last
                // ejection ended takes one step off the next ejection's length.
                if let Some(until) = s.ejected_until.filter(|_| s.times_ejected > 0) {
                    if until.elapsed() > cfg.base_ejection {
                        s.times_ejected -= 1;
                        s.ejected_until = (s.times_ejected > 0).then(Instant::now);
                    }
                }
                return;
            }
            (Outcome::LocalFailure, Some(n)) => {
                s.consecutive_local_failures += 1;
                (s.consecutive_local_failures, n)
            }
            (Outcome::ServerError | Outcome::LocalFailure, _) => {
                s.consecutive_failures += 1;
                (s.consecutive_failures, cfg.consecutive_5xx)
            }
        };
        if limit > 0 && count >= limit {
            s.times_ejected = (s.times_ejected + 1).min(10);
            s.consecutive_failures = 0;
            s.consecutive_local_failures = 0;
            let until = Instant::now() + cfg.base_ejection * s.times_ejected;
            s.ejected_until = Some(until);
            tracing::warn!(endpoint = %self.addr, workload = %self.workload.name, ejection_ms = (cfg.base_ejection * s.times_ejected).as_millis() as u64,
                local_origin = outcome == Outcome::LocalFailure && cfg.local_origin.is_some(),
                "endpoint ejected after consecutive failures");
        }
    }
}

impl Balancer {
    pub fn new(policy: LbPolicy, outlier: OutlierConfig) -> Arc<Balancer> {
        Arc::new(Balancer {
            policy,
            outlier,
            next: AtomicUsize::new(0),
            stats: Mutex::new(HashMap::new()),
        })
    }

    /// Whether `addr` is ejected now.
    #[cfg(test)]
    pub fn ejected(&self, addr: SocketAddr) -> bool {
        self.lock()
            .get(&addr)
            .and_then(|s| s.ejected_until)
            .is_some_and(|t| t > Instant::now())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, EndpointStats>> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Picks one of `endpoints` (address, workload), preferring ones not in `tried` (a
    /// retry goes elsewhere when it can) and not ejected.
    pub fn pick(
        self: &Arc<Self>,
        endpoints: &[(SocketAddr, Arc<Workload>)],
        tried: &[SocketAddr],
    ) -> Option<Picked> {
        self.pick_with(endpoints, tried, &Choice::default())
    }

    /// As `pick`, as a Service's DestinationRule asks (`choice`).
    pub fn pick_with(
        self: &Arc<Self>,
        endpoints: &[(SocketAddr, Arc<Workload>)],
        tried: &[SocketAddr],
        choice: &Choice,
    ) -> Option<Picked> {
        if endpoints.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut stats = self.lock();
        let ejected = |a: &SocketAddr| {
            stats
                .get(a)
                .and_then(|s| s.ejected_until)
                .is_some_and(|t| t > now)
        };
        // Widen the candidate set until something is left: fresh and healthy, then
        // healthy, then anything (Envoy's "panic mode" rather than failing every request).
        let candidates: Vec<usize> = [
            (0..endpoints.len())
                .filter(|&i| !tried.contains(&endpoints[i].0) && !ejected(&endpoints[i].0))
                .collect::<Vec<_>>(),
            (0..endpoints.len())
                .filter(|&i| !ejected(&endpoints[i].0))
                .collect(),
        ]
        .into_iter()
        .find(|c| !c.is_empty())
        .unwrap_or_else(|| (0..endpoints.len()).collect());
        let preferred = choice
            .prefer
            .and_then(|a| candidates.iter().copied().find(|&i| endpoints[i].0 == a));
        let how = match (&choice.pick, choice.hash) {
            // A hash policy without its key in this request: random, as Envoy's ring.
            (
                Some(
                    Pick::HashHeader(_)
                    | Pick::HashCookie(_)
                    | Pick::HashQuery(_)
                    | Pick::HashSourceIp,
                ),
                None,
            ) => Pick::Random,
            (Some(p), _) => p.clone(),
            (None, _) => match self.policy {
                LbPolicy::RoundRobin => Pick::RoundRobin,
                LbPolicy::LeastRequest => Pick::LeastRequest,
            },
        };
        let i = match how {
            _ if preferred.is_some() => candidates
                .iter()
                .copied()
                .find(|i| Some(*i) == preferred)
                .unwrap_or(candidates[0]),
            Pick::RoundRobin => {
                candidates[self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()]
            }
            Pick::LeastRequest => {
                let a = candidates[rand::random_range(0..candidates.len())];
                let b = candidates[rand::random_range(0..candidates.len())];
                let load = |i: usize| stats.get(&endpoints[i].0).map_or(0, |s| s.active);
                if load(b) < load(a) {
                    b
                } else {
                    a
                }
            }
            Pick::Random => candidates[rand::random_range(0..candidates.len())],
            // Rendezvous hashing: the endpoint with the highest hash of (key, address)
            // keeps its keys while others come and go.
            Pick::HashHeader(_) | Pick::HashCookie(_) | Pick::HashQuery(_) | Pick::HashSourceIp => {
                let key = choice.hash.unwrap_or_default();
                let score = |i: &usize| {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    (key, endpoints[*i].0).hash(&mut h);
                    h.finish()
                };
                candidates
                    .iter()
                    .copied()
                    .max_by_key(score)
                    .unwrap_or(candidates[0])
            }
        };
        let (addr, workload) = endpoints[i].clone();
        stats.entry(addr).or_default().active += 1;
        drop(stats);
        Some(Picked {
            workload,
            addr,
            balancer: self.clone(),
            outlier: choice.outlier.unwrap_or(self.outlier),
            slots: Vec::new(),
        })
    }
}

/// A consistent-hash key from a request's value (a header's, a cookie's, the client's IP).
pub fn hash_of(v: impl std::hash::Hash) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    v.hash(&mut h);
    h.finish()
}

/// What a Service's DestinationRule changes in one pick: the way (None: the
/// waypoint's policy), the request's hash key for a consistent hash, the outlier settings.
#[derive(Clone, Debug, Default)]
pub struct Choice {
    /// A session's endpoint: taken when it is a healthy candidate.
    pub prefer: Option<SocketAddr>,
    pub pick: Option<Pick>,
    pub hash: Option<u64>,
    pub outlier: Option<OutlierConfig>,
}

/// In-flight counts per Service for DestinationRule connection pool limits, and the
/// queues of requests waiting for one of a Service's HTTP/1.1 connections. One entry per
/// Service (and limit) that has such a limit (the config bounds them).
#[derive(Default)]
pub struct Circuits {
    counts: Mutex<HashMap<(String, Limit), Arc<AtomicUsize>>>,
    gates: Mutex<HashMap<(String, u32), Arc<Gate>>>,
}

/// A Service's HTTP/1.1 connections in use (each carries one request at a time), and
/// the requests waiting for one.
struct Gate {
    connections: Arc<tokio::sync::Semaphore>,
    waiting: AtomicUsize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Limit {
    Requests,
    Retries,
    Connections,
}

/// A slot taken under a limit, given back on drop.
pub struct Slot(Taken);

enum Taken {
    Count(Arc<AtomicUsize>),
    Connection(#[allow(dead_code)] tokio::sync::OwnedSemaphorePermit),
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Taken::Count(c) = &self.0 {
            c.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Too many requests in flight or waiting: Envoy's overflow.
#[derive(Debug, PartialEq, Eq)]
pub struct Overflow;

/// Takes one back from the waiting count when the wait ends, however it ends.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Circuits {
    /// A slot for one more of `limit` to `service`, or None when `max` are in flight
    /// (the circuit is open: Envoy's overflow).
    pub fn take(&self, service: &str, limit: Limit, max: u32) -> Option<Slot> {
        let c = {
            let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
            m.entry((service.to_string(), limit)).or_default().clone()
        };
        let max = max as usize;
        let mut cur = c.load(Ordering::Acquire);
        loop {
            if cur >= max {
                return None;
            }
            match c.compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(Slot(Taken::Count(c))),
                Err(now) => cur = now,
            }
        }
    }

    /// How many of `limit` to `service` are in flight now (0 when none is counted).
    pub fn in_flight(&self, service: &str, limit: Limit) -> usize {
        let m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        m.get(&(service.to_string(), limit))
            .map_or(0, |c| c.load(Ordering::Acquire))
    }

    /// One of `service`'s HTTP/1.1 connections (DestinationRule `tcp.maxConnections`):
    /// at once when fewer than `max` are in use, else after waiting in a queue of at
    /// most `max_pending` requests (`http.http1MaxPendingRequests`; None: Istio's
    /// default, no bound but what the waypoint's own limits give); a full queue is an
    /// overflow.
    pub async fn connection(
        &self,
        service: &str,
        max: u32,
        max_pending: Option<u32>,
    ) -> Result<Slot, Overflow> {
        let gate = {
            let mut m = self.gates.lock().unwrap_or_else(|p| p.into_inner());
            m.entry((service.to_string(), max))
                .or_insert_with(|| {
                    Arc::new(Gate {
                        connections: Arc::new(tokio::sync::Semaphore::new(max as usize)),
                        waiting: AtomicUsize::new(0),
                    })
                })
                .clone()
        };
        if let Ok(p) = gate.connections.clone().try_acquire_owned() {
            return Ok(Slot(Taken::Connection(p)));
        }
        let bound = max_pending.map_or(usize::MAX, |n| n as usize);
        if gate.waiting.fetch_add(1, Ordering::AcqRel) >= bound {
            gate.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(Overflow);
        }
        let _waiting = Waiting(&gate.waiting);
        // The semaphore is never closed.
        gate.connections
            .clone()
            .acquire_owned()
            .await
            .map(|p| Slot(Taken::Connection(p)))
            .map_err(|_| Overflow)
    }
}
