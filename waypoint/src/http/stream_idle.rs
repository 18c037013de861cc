//! Envoy's HTTP connection manager `stream_idle_timeout` (5 min by default, which Istio
//! keeps): a request stream (one request and its response) with no activity either way
//! for that long is ended. Before the response head the client gets Envoy's local reply
//! (`stream timeout`, 408 while the request is still arriving, else 504; flag `SI`);
//! after it the response body ends with an error (hyper resets the HTTP/2 stream or
//! closes the HTTP/1.1 connection). Upgraded WebSockets are exempt: the connection's
//! idle timeout covers them.
//!
//! No task per request: a clock shared by the request's body wrappers (every frame read
//! or sent touches it), and a `Sleep` in whichever future or body is waiting, which is
//! reset to the clock's deadline when it fires early.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::StatusCode;
use tokio::time::{Instant, Sleep};

/// Envoy's local reply body (and response code details `stream_idle_timeout`).
pub const MESSAGE: &str = "stream timeout";

struct Clock {
    timeout: Duration,
    start: Instant,
    /// Milliseconds from `start` to the last activity.
    last_ms: AtomicU64,
    /// The client's request body has ended (Envoy's `remoteDecodeComplete`).
    request_ended: AtomicBool,
    /// A body wrapper's timer fired.
    fired: AtomicBool,
}

/// One request stream's idle clock (nothing without a timeout).
#[derive(Clone, Default)]
pub struct StreamIdle(Option<Arc<Clock>>);

/// The stream was idle for the timeout.
#[derive(Debug)]
pub struct Expired;

impl StreamIdle {
    pub fn new(timeout: Option<Duration>) -> StreamIdle {
        StreamIdle(timeout.map(|timeout| {
            Arc::new(Clock {
                timeout,
                start: Instant::now(),
                last_ms: AtomicU64::new(0),
                request_ended: AtomicBool::new(false),
                fired: AtomicBool::new(false),
            })
        }))
    }

    /// Something moved: the timer restarts.
    pub fn touch(&self) {
        if let Some(c) = &self.0 {
            let ms = c.start.elapsed().as_millis() as u64;
            c.last_ms.fetch_max(ms, Ordering::Relaxed);
        }
    }

    pub fn request_ended(&self) {
        if let Some(c) = &self.0 {
            c.request_ended.store(true, Ordering::Relaxed);
        }
    }

    /// Whether a body wrapper's timer fired (an error of the exchange then means this).
    pub fn fired(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|c| c.fired.load(Ordering::Relaxed))
    }

    pub fn timeout(&self) -> Option<Duration> {
        self.0.as_ref().map(|c| c.timeout)
    }

    /// The status of Envoy's local reply (`reply::LocalReply` for `StreamIdle`): 408
    /// while the request was still arriving (the client stalled), 504 once it had all
    /// arrived (the backend did).
    pub fn status(&self) -> StatusCode {
        let ended = self
            .0
            .as_ref()
            .is_none_or(|c| c.request_ended.load(Ordering::Relaxed));
        if ended {
            StatusCode::GATEWAY_TIMEOUT
        } else {
            StatusCode::REQUEST_TIMEOUT
        }
    }

    /// `f`, unless the stream goes idle first (then `f` is dropped, and with it whatever
    /// it had upstream).
    pub async fn within<F: Future>(&self, f: F) -> Result<F::Output, Expired> {
        let Some(mut timer) = self.timer() else {
            return Ok(f.await);
        };
        let mut f = std::pin::pin!(f);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = f.as_mut().poll(cx) {
                return Poll::Ready(Ok(out));
            }
            timer.poll_expired(cx).map(|()| Err(Expired))
        })
        .await
    }

    /// A timer on this clock, for a body wrapper.
    pub fn timer(&self) -> Option<Timer> {
        let c = self.0.clone()?;
        let sleep = Box::pin(tokio::time::sleep_until(deadline(&c)));
        Some(Timer { clock: c, sleep })
    }
}

fn deadline(c: &Clock) -> Instant {
    c.start + Duration::from_millis(c.last_ms.load(Ordering::Relaxed)) + c.timeout
}

/// Fires once the clock's stream has been idle for its timeout.
pub struct Timer {
    clock: Arc<Clock>,
    sleep: Pin<Box<Sleep>>,
}

impl Timer {
    /// Ready once idle for the timeout (registers the waker otherwise); marks the clock.
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            if self.sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let d = deadline(&self.clock);
            if d <= Instant::now() {
                self.clock.fired.store(true, Ordering::Relaxed);
                return Poll::Ready(());
            }
            // Activity since it was set: wait for the new deadline.
            self.sleep.as_mut().reset(d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn within_ends_a_stalled_wait_and_not_a_busy_one() {
        let idle = StreamIdle::new(Some(Duration::from_millis(300)));
        // Touched every 20 ms for over 4 timeouts: never idle.
        let busy = async {
            for _ in 0..70 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                idle.touch();
            }
        };
        assert!(idle.within(busy).await.is_ok(), "idle while active");
        let start = std::time::Instant::now();
        assert!(idle.within(std::future::pending::<()>()).await.is_err());
        assert!(start.elapsed() < Duration::from_secs(5));
        // Without a timeout, never.
        let off = StreamIdle::new(None);
        assert!(tokio::time::timeout(
            Duration::from_millis(100),
            off.within(std::future::pending::<()>())
        )
        .await
        .is_err());
    }

    #[test]
    fn the_reply_is_envoys() {
        let idle = StreamIdle::new(Some(Duration::from_secs(1)));
        let r = idle.reply();
        assert_eq!(
            (r.status, r.flags, r.message.as_str()),
            (StatusCode::REQUEST_TIMEOUT, "SI", "stream timeout")
        );
        idle.request_ended();
        assert_eq!(idle.reply().status, StatusCode::GATEWAY_TIMEOUT);
    }
}
