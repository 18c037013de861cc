//! Accepting connections: the accept loop of the pods' listeners, which stops at drain
//! and survives accept errors, and the file descriptor held in reserve so that a
//! process out of descriptors refuses queued connections instead of leaving them hanging.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};

use crate::drain::Drain;
use crate::metrics::Metrics;

/// Accept errors (e.g. EMFILE) must not spin a runtime thread or end the listener.
pub async fn accept_backoff(listener: &str, e: std::io::Error) {
    tracing::warn!(listener, error = %e, "accept failed; retrying");
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
}

/// One file descriptor held in reserve. When the process runs out of descriptors, a
/// connection waiting in a listener's queue cannot be accepted, so its client would hang
/// until it times out; releasing the reserve lets us accept it and reset it at once (the
/// client is refused, not left waiting), then the reserve is taken again.
static SPARE_FD: std::sync::Mutex<Option<std::fs::File>> = std::sync::Mutex::new(None);

/// Opens the reserve descriptor; call once at start.
pub fn reserve_spare_fd() {
    let mut spare = SPARE_FD.lock().unwrap_or_else(|p| p.into_inner());
    if spare.is_none() {
        *spare = std::fs::File::open("/dev/null").ok();
    }
}

fn out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}

/// Out of descriptors: refuse (reset) the connections waiting in `listener`'s queue,
/// using the reserve descriptor, count them, and back off briefly.
async fn refuse_queued(metrics: &Metrics, listener: &TcpListener, name: &str) {
    use std::os::fd::AsRawFd;
    let mut refused = 0u64;
    {
        let mut spare = SPARE_FD.lock().unwrap_or_else(|p| p.into_inner());
        if spare.take().is_some() {
            // The freed descriptor takes one queued connection at a time: accept, reset
            // (SO_LINGER 0), close, next. Done synchronously so nothing else takes the slot.
            loop {
                // SAFETY: plain syscalls on a listening socket we own; a returned fd is
                // closed below.
                let fd = unsafe {
                    libc::accept4(
                        listener.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                };
                if fd < 0 {
                    break;
                }
                let linger = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                // SAFETY: fd is the socket accept4 just returned; closed right after.
                unsafe {
                    libc::setsockopt(
                        fd,
                        libc::SOL_SOCKET,
                        libc::SO_LINGER,
                        (&linger as *const libc::linger).cast(),
                        std::mem::size_of::<libc::linger>() as libc::socklen_t,
                    );
                    libc::close(fd);
                }
                refused += 1;
            }
            *spare = std::fs::File::open("/dev/null").ok();
        } else {
            // Taken by someone else while we were short; get it back when one frees up.
            *spare = std::fs::File::open("/dev/null").ok();
        }
    }
    for _ in 0..refused {
        metrics.connection_refused("fd_exhaustion");
    }
    // Out of descriptors, accept fails at once whether or not anything waits: warn once a
    // second, not on every retry.
    static LAST_WARN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if LAST_WARN.swap(now, std::sync::atomic::Ordering::Relaxed) != now {
        tracing::warn!(
            listener = name,
            refused,
            "out of file descriptors: refusing new connections until some close"
        );
    }
    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
}

/// Accepts until draining starts; then the listener is dropped, so new connections to
/// this pod are refused while in-flight ones finish.
pub(crate) async fn accept_until_drain(
    drain: &Drain,
    metrics: &Metrics,
    listener: &TcpListener,
    name: &str,
) -> Option<(TcpStream, SocketAddr)> {
    loop {
        tokio::select! {
            _ = drain.signaled() => return None,
            r = listener.accept() => match r {
                Ok(c) => return Some(c),
                Err(e) if out_of_fds(&e) => refuse_queued(metrics, listener, name).await,
                Err(e) => {
                    metrics.connection_refused("accept_error");
                    accept_backoff(name, e).await
                }
            },
        }
    }
}
