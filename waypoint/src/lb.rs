//! Per-endpoint load balancing (round robin or least request) with outlier ejection:
//! an endpoint that fails `consecutive_5xx` times in a row is left out for a while,
//! longer each time, unless that would leave no endpoint at all.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ztunnel::state::Workload;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LbPolicy {
    RoundRobin,
    /// Envoy's: the less loaded of two random endpoints (Istio's default).
    LeastRequest,
}

#[derive(Clone, Copy, Debug)]
pub struct OutlierConfig {
    /// 0 disables ejection.
    pub consecutive_5xx: u32,
    pub base_ejection: Duration,
}

#[derive(Default)]
struct EndpointStats {
    active: u32,
    consecutive_failures: u32,
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
}

impl Drop for Picked {
    fn drop(&mut self) {
        if let Some(s) = self.balancer.lock().get_mut(&self.addr) {
            s.active = s.active.saturating_sub(1);
        }
    }
}

impl Picked {
    /// Feeds the attempt's outcome to outlier detection (a 5xx or connect failure is a failure).
    pub fn report(&self, success: bool) {
        let cfg = self.balancer.outlier;
        let mut stats = self.balancer.lock();
        let s = stats.entry(self.addr).or_default();
        if success {
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
        s.consecutive_failures += 1;
        if cfg.consecutive_5xx > 0 && s.consecutive_failures >= cfg.consecutive_5xx {
            s.times_ejected = (s.times_ejected + 1).min(10);
            s.consecutive_failures = 0;
            let until = Instant::now() + cfg.base_ejection * s.times_ejected;
            s.ejected_until = Some(until);
            tracing::warn!(endpoint = %self.addr, workload = %self.workload.name, ejection_ms = (cfg.base_ejection * s.times_ejected).as_millis() as u64,
                "endpoint ejected after consecutive failures");
        }
    }
}

impl Balancer {
    pub fn new(policy: LbPolicy, outlier: OutlierConfig) -> Arc<Balancer> {
        Arc::new(Balancer { policy, outlier, next: AtomicUsize::new(0), stats: Mutex::new(HashMap::new()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, EndpointStats>> {
        self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Picks one of `endpoints` (address, workload), preferring ones not in `tried` (a
    /// retry goes elsewhere when it can) and not ejected.
    pub fn pick(self: &Arc<Self>, endpoints: &[(SocketAddr, Arc<Workload>)], tried: &[SocketAddr]) -> Option<Picked> {
        if endpoints.is_empty() {
            return None;
        }
        let now = Instant::now();
        let mut stats = self.lock();
        let ejected = |a: &SocketAddr| stats.get(a).and_then(|s| s.ejected_until).is_some_and(|t| t > now);
        // Widen the candidate set until something is left: fresh and healthy, then
        // healthy, then anything (Envoy's "panic mode" rather than failing every request).
        let candidates: Vec<usize> = [
            (0..endpoints.len()).filter(|&i| !tried.contains(&endpoints[i].0) && !ejected(&endpoints[i].0)).collect::<Vec<_>>(),
            (0..endpoints.len()).filter(|&i| !ejected(&endpoints[i].0)).collect(),
        ]
        .into_iter()
        .find(|c| !c.is_empty())
        .unwrap_or_else(|| (0..endpoints.len()).collect());
        let i = match self.policy {
            LbPolicy::RoundRobin => candidates[self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()],
            LbPolicy::LeastRequest => {
                let a = candidates[rand::random_range(0..candidates.len())];
                let b = candidates[rand::random_range(0..candidates.len())];
                let load = |i: usize| stats.get(&endpoints[i].0).map_or(0, |s| s.active);
                if load(b) < load(a) { b } else { a }
            }
        };
        let (addr, workload) = endpoints[i].clone();
        stats.entry(addr).or_default().active += 1;
        drop(stats);
        Some(Picked { workload, addr, balancer: self.clone() })
    }
}
