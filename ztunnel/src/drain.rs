//! Graceful drain: on SIGTERM, listeners stop accepting, HBONE connections get GOAWAY,
//! and in-flight connections may finish until a deadline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

pub struct Drain {
    tx: watch::Sender<bool>,
    active: AtomicUsize,
}

/// Counts one in-flight connection while alive.
pub struct ActiveGuard(Arc<Drain>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            tx: watch::channel(false).0,
            active: AtomicUsize::new(0),
        }
    }
}

impl Drain {
    pub fn start(&self) {
        self.tx.send_replace(true);
    }

    /// Resolves once draining has started (at once if it already has).
    pub async fn signaled(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    pub fn track(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        ActiveGuard(self.clone())
    }

    pub fn active(&self) -> usize {
        self.active.load(Ordering::Acquire)
    }

    /// Waits until no connection is in flight, or the deadline passes; true if idle.
    pub async fn wait_idle(&self, deadline: Duration) -> bool {
        let until = tokio::time::Instant::now() + deadline;
        while self.active() > 0 {
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }
}

/// Istio's drain deadline: the termination grace period minus 5 s when it is over 10 s,
/// else minus 1 s.
pub fn deadline_for_grace_period(grace: Duration) -> Duration {
    if grace > Duration::from_secs(10) {
        grace - Duration::from_secs(5)
    } else {
        grace.saturating_sub(Duration::from_secs(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_follows_istio() {
        assert_eq!(
            deadline_for_grace_period(Duration::from_secs(30)),
            Duration::from_secs(25)
        );
        assert_eq!(
            deadline_for_grace_period(Duration::from_secs(10)),
            Duration::from_secs(9)
        );
        assert_eq!(
            deadline_for_grace_period(Duration::from_secs(0)),
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn waits_for_active_connections() {
        let d = Arc::new(Drain::default());
        let g = d.track();
        assert!(!d.wait_idle(Duration::from_millis(50)).await);
        let d2 = d.clone();
        let waiter = tokio::spawn(async move { d2.wait_idle(Duration::from_secs(5)).await });
        drop(g);
        assert!(waiter.await.unwrap());
        d.start();
        d.signaled().await;
    }
}
