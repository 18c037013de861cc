//! Idle timeouts for what the waypoint relays: an IO wrapper that counts the bytes it
//! moves, watched by ztunnel's `relay::idle_watchdog`. Without them a client could hold
//! tunnels (and the upstream connections behind them) open for ever by saying nothing.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Bytes moved either way through a [`Counted`] IO.
#[derive(Clone, Default)]
pub struct Activity(Arc<[AtomicU64; 2]>);

impl Activity {
    /// Completes once no byte moved either way for `timeout` (never without one).
    pub async fn idle(&self, timeout: Option<std::time::Duration>) {
        let [read, written] = &*self.0;
        ztunnel::relay::idle_watchdog([read, written], timeout).await
    }
}

/// An IO whose reads and writes count into an [`Activity`].
pub struct Counted<T> {
    inner: T,
    activity: Activity,
}

impl<T> Counted<T> {
    pub fn new(inner: T) -> (Counted<T>, Activity) {
        let activity = Activity::default();
        (
            Counted {
                inner,
                activity: activity.clone(),
            },
            activity,
        )
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Counted<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before);
        self.activity.0[0].fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Counted<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            self.activity.0[1].fetch_add(*n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Real time (the crate's tokio has no paused clock): writes every 20 ms against a
    /// 1 s timeout, so only a stall of the writer of over a second could fail it.
    #[tokio::test]
    async fn a_quiet_io_is_idle_and_a_busy_one_is_not() {
        let (a, mut b) = tokio::io::duplex(64);
        let (mut a, activity) = Counted::new(a);
        let t = Some(Duration::from_secs(1));
        let busy = async {
            for _ in 0..100 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                a.write_all(b"x").await.unwrap();
                let mut one = [0u8; 1];
                b.read_exact(&mut one).await.unwrap();
            }
        };
        tokio::select! {
            _ = busy => {}
            _ = activity.idle(t) => panic!("idle while bytes moved"),
        }
        // Then silence: idle within two timeouts (and some slack).
        tokio::time::timeout(Duration::from_secs(10), activity.idle(t))
            .await
            .expect("a silent IO was never idle");
        // Without a timeout, never.
        assert!(
            tokio::time::timeout(Duration::from_millis(100), activity.idle(None))
                .await
                .is_err()
        );
    }
}
