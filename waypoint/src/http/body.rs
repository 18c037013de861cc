//! The body types around a request: the counted request body, the response body that
//! writes the log when it ends, and a request body kept for retries and mirrors.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;

use super::log::{grpc_status_label, RequestLog};
use super::stream_idle::{StreamIdle, Timer};
use crate::lb::Picked;
use crate::upstream::{Body, BoxError};

/// The response body as sent downstream: counts bytes, notes gRPC trailers, holds the
/// endpoint's active-request slot, writes the log when it ends, and ends with an error
/// once the stream has been idle for the stream idle timeout.
pub struct Metered {
    inner: Body,
    bytes: u64,
    log: Option<RequestLog>,
    _picked: Option<Picked>,
    idle: StreamIdle,
    /// Armed when the body first waits.
    timer: Option<Timer>,
}

impl Metered {
    /// `picked` (the endpoint's active-request slot) is held until the body ends.
    pub fn new(inner: Body, log: RequestLog, picked: Option<Picked>) -> Self {
        Metered {
            inner,
            bytes: 0,
            log: Some(log),
            _picked: picked,
            idle: StreamIdle::default(),
            timer: None,
        }
    }

    /// The same, ended with an error when the stream has been idle for `idle`'s timeout.
    pub fn with_idle(mut self, idle: StreamIdle) -> Self {
        self.idle = idle;
        self
    }

    fn finish(&mut self) {
        if let Some(log) = self.log.take() {
            log.finish(self.bytes);
        }
        self._picked = None;
    }
}

impl http_body::Body for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
                this.idle.touch();
                if let Some(d) = f.data_ref() {
                    this.bytes += d.len() as u64;
                } else if let (Some(t), Some(log)) = (f.trailers_ref(), this.log.as_mut()) {
                    if let Some(v) = t.get("grpc-status") {
                        log.grpc_status = Some(grpc_status_label(v));
                    }
                }
            }
            Poll::Ready(Some(Err(e))) => {
                if let Some(log) = this.log.as_mut() {
                    // The request body's timer ended the upstream request.
                    if this.idle.fired() {
                        log.error = Some(format!(
                            "stream idle timeout: the request body stalled ({e})"
                        ));
                        log.response_flags = "SI";
                    } else {
                        log.error = Some(format!("response body: {e}"));
                        log.response_flags = "UPE";
                    }
                }
                this.finish();
            }
            Poll::Ready(None) => this.finish(),
            Poll::Pending => {
                if this.timer.is_none() {
                    this.timer = this.idle.timer();
                }
                if let Some(t) = this.timer.as_mut() {
                    if t.poll_expired(cx).is_ready() {
                        let timeout = this.idle.timeout().unwrap_or_default();
                        if let Some(log) = this.log.as_mut() {
                            log.error = Some(format!("stream idle timeout: nothing either way for {timeout:?} after the response head"));
                            log.response_flags = "SI";
                        }
                        this.finish();
                        this.timer = None;
                        return Poll::Ready(Some(Err(super::stream_idle::MESSAGE.into())));
                    }
                }
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        if let Some(log) = self.log.as_mut() {
            if !self.inner.is_end_stream() && log.error.is_none() {
                log.response_flags = "DC";
                log.error = Some("client went away before the response ended".into());
            }
        }
        self.finish();
    }
}

/// The request body as the client sends it: what was read ahead (an ext_authz check
/// with the body) comes first, then the rest as it arrives. Every frame read restarts
/// the stream's idle timer; a body that stalls for the timeout ends with an error (so
/// the upstream request it feeds is reset).
pub struct Downstream<B = Incoming> {
    ahead: std::collections::VecDeque<Frame<Bytes>>,
    /// None once the client's body has ended.
    rest: Option<B>,
    idle: StreamIdle,
    /// Armed when the body first waits.
    timer: Option<Timer>,
}

impl<B> Downstream<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    pub fn new(body: B, idle: StreamIdle) -> Downstream<B> {
        if body.is_end_stream() {
            idle.request_ended();
        }
        Downstream {
            ahead: std::collections::VecDeque::new(),
            rest: Some(body),
            idle,
            timer: None,
        }
    }

    /// Notes a frame read: activity, and maybe the body's end.
    fn read(&self) {
        self.idle.touch();
        if self.rest.as_ref().is_none_or(|r| r.is_end_stream()) {
            self.idle.request_ended();
        }
    }

    /// Reads ahead until at least `until` bytes are buffered or the body ends; returns
    /// the body's data read so far (it is still sent on, all of it) and whether the body
    /// ended within it.
    pub async fn read_ahead(&mut self, until: usize) -> Result<(Bytes, bool), BoxError> {
        use http_body_util::BodyExt;
        let mut buffered: usize = self
            .ahead
            .iter()
            .filter_map(|f| f.data_ref())
            .map(Bytes::len)
            .sum();
        while buffered < until {
            let Some(rest) = self.rest.as_mut() else {
                break;
            };
            match rest.frame().await {
                Some(Ok(f)) => {
                    buffered += f.data_ref().map_or(0, Bytes::len);
                    self.ahead.push_back(f);
                    self.read();
                }
                Some(Err(e)) => return Err(e.into()),
                None => {
                    self.rest = None;
                    self.read();
                }
            }
        }
        let ended = self.rest.as_ref().is_none_or(|r| r.is_end_stream());
        let mut data = bytes::BytesMut::with_capacity(buffered);
        for d in self.ahead.iter().filter_map(|f| f.data_ref()) {
            data.extend_from_slice(d);
        }
        Ok((data.freeze(), ended))
    }
}

impl<B> http_body::Body for Downstream<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if let Some(f) = this.ahead.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        let Some(rest) = this.rest.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(rest).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                this.read();
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                this.rest = None;
                this.timer = None;
                this.read();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.timer.is_none() {
                    this.timer = this.idle.timer();
                }
                match this.timer.as_mut().map(|t| t.poll_expired(cx)) {
                    Some(Poll::Ready(())) => {
                        this.timer = None;
                        this.rest = None;
                        Poll::Ready(Some(Err(super::stream_idle::MESSAGE.into())))
                    }
                    _ => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self
            .ahead
            .iter()
            .filter_map(|f| f.data_ref())
            .map(|d| d.len() as u64)
            .sum();
        with_ahead(
            self.rest
                .as_ref()
                .map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint()),
            ahead,
        )
    }
}

/// The size of a body `ahead` bytes longer than `rest` says.
fn with_ahead(rest: SizeHint, ahead: u64) -> SizeHint {
    // Upper first: SizeHint panics on a lower bound above its upper one.
    let mut h = SizeHint::new();
    if let Some(u) = rest.upper() {
        h.set_upper(u.saturating_add(ahead));
    }
    h.set_lower(
        rest.lower()
            .saturating_add(ahead)
            .min(h.upper().unwrap_or(u64::MAX)),
    );
    h
}

/// A request body that counts what passed through it.
pub struct Counted {
    inner: Downstream,
    count: Arc<AtomicU64>,
}

impl Counted {
    pub fn new(inner: Downstream, count: Arc<AtomicU64>) -> Self {
        Counted { inner, count }
    }
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.count.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

pub fn empty() -> Body {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}

/// A request body that may be sent more than once (retries, mirrors) or only once.
pub enum RequestBody {
    Buffered(Bytes),
    Streaming(Option<Body>),
}

impl RequestBody {
    pub fn take(&mut self) -> Option<Body> {
        match self {
            RequestBody::Buffered(b) => Some(full(b.clone())),
            RequestBody::Streaming(b) => b.take(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A body fed frame by frame from a channel; ends when the sender is dropped.
    struct Chan(tokio::sync::mpsc::Receiver<Bytes>);

    impl http_body::Body for Chan {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
        }
    }

    fn chan() -> (tokio::sync::mpsc::Sender<Bytes>, Chan) {
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        (tx, Chan(rx))
    }

    /// Sends a frame every 30 ms for `n` frames, then ends the body.
    async fn trickle(tx: tokio::sync::mpsc::Sender<Bytes>, n: usize) {
        for _ in 0..n {
            tokio::time::sleep(Duration::from_millis(30)).await;
            if tx.send(Bytes::from_static(b"x")).await.is_err() {
                return;
            }
        }
    }

    /// Reads `body` to its end: the bytes, or the error and when it came.
    async fn drain<B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin>(
        mut body: B,
    ) -> Result<usize, (BoxError, Duration)> {
        let start = Instant::now();
        let mut n = 0;
        while let Some(f) = body.frame().await {
            match f {
                Ok(f) => n += f.data_ref().map_or(0, Bytes::len),
                Err(e) => return Err((e, start.elapsed())),
            }
        }
        Ok(n)
    }

    // Real time (the crate's tokio has no paused clock): a 400 ms timeout against frames
    // every 30 ms, so only a stall of over 10 frames' time could fail the busy cases.
    const T: Duration = Duration::from_millis(400);

    fn metered(inner: Chan, idle: StreamIdle) -> Metered {
        Metered {
            inner: inner.boxed(),
            bytes: 0,
            log: None,
            _picked: None,
            idle,
            timer: None,
        }
    }

    #[tokio::test]
    async fn a_stalled_request_body_errors_after_the_stream_idle_timeout() {
        let idle = StreamIdle::new(Some(T));
        let (tx, rx) = chan();
        let body = Downstream::new(rx, idle.clone());
        tx.send(Bytes::from_static(b"first")).await.unwrap();
        let (e, after) = drain(body).await.expect_err("a stalled body never ended");
        assert_eq!(e.to_string(), "stream timeout");
        assert!(
            after >= T - Duration::from_millis(50) && after < T * 10,
            "ended after {after:?}"
        );
        assert!(idle.fired());
        drop(tx);
    }

    #[tokio::test]
    async fn a_trickling_request_body_is_not_idle() {
        let idle = StreamIdle::new(Some(T));
        let (tx, rx) = chan();
        let body = Downstream::new(rx, idle.clone());
        let (read, ()) = tokio::join!(drain(body), trickle(tx, 50));
        assert_eq!(read.map_err(|(e, _)| e.to_string()).unwrap(), 50);
        assert!(!idle.fired());
        // Its end is noted: a later timeout would be the backend's (504).
        assert_eq!(idle.reply().status, http::StatusCode::GATEWAY_TIMEOUT);
    }

    #[tokio::test]
    async fn a_stalled_response_body_errors_and_a_trickling_one_does_not() {
        let (_tx, rx) = chan();
        let (e, after) = drain(metered(rx, StreamIdle::new(Some(T))))
            .await
            .expect_err("a stalled response never ended");
        assert_eq!(e.to_string(), "stream timeout");
        assert!(
            after >= T - Duration::from_millis(50) && after < T * 10,
            "ended after {after:?}"
        );

        let (tx, rx) = chan();
        let (read, ()) = tokio::join!(
            drain(metered(rx, StreamIdle::new(Some(T)))),
            trickle(tx, 50)
        );
        assert_eq!(read.map_err(|(e, _)| e.to_string()).unwrap(), 50);

        // Without a timeout, a stall is no error.
        let (_tx, rx) = chan();
        assert!(
            tokio::time::timeout(T * 2, drain(metered(rx, StreamIdle::new(None))))
                .await
                .is_err()
        );
    }

    /// The clock is the stream's: a request body still moving keeps a quiet response
    /// going (a client-streaming call), as Envoy's timer counts both ways.
    #[tokio::test]
    async fn request_frames_keep_a_quiet_response_alive() {
        let idle = StreamIdle::new(Some(T));
        let (req_tx, req_rx) = chan();
        let (resp_tx, resp_rx) = chan();
        let request = Downstream::new(req_rx, idle.clone());
        let response = async {
            let r = drain(metered(resp_rx, idle.clone())).await;
            r.map_err(|(e, _)| e.to_string())
        };
        let client = async {
            let read = drain(request).await;
            // The request has ended: the response comes, then ends.
            resp_tx.send(Bytes::from_static(b"done")).await.unwrap();
            drop(resp_tx);
            read.map_err(|(e, _)| e.to_string())
        };
        let (resp, req, ()) = tokio::join!(response, client, trickle(req_tx, 50));
        assert_eq!((req.unwrap(), resp.unwrap()), (50, 4));
    }

    #[test]
    fn a_body_read_ahead_keeps_its_size() {
        let h = with_ahead(SizeHint::with_exact(5), 11);
        assert_eq!((h.lower(), h.upper()), (16, Some(16)));
        let h = with_ahead(SizeHint::new(), 11);
        assert_eq!((h.lower(), h.upper()), (11, None));
        let h = with_ahead(SizeHint::with_exact(u64::MAX), 1);
        assert_eq!((h.lower(), h.upper()), (u64::MAX, Some(u64::MAX)));
    }
}
