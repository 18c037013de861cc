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
use crate::lb::Picked;
use crate::upstream::{Body, BoxError};

/// The response body as sent downstream: counts bytes, notes gRPC trailers, holds the
/// endpoint's active-request slot, and writes the log when it ends.
pub struct Metered {
    inner: Body,
    bytes: u64,
    log: Option<RequestLog>,
    _picked: Option<Picked>,
}

impl Metered {
    /// `picked` (the endpoint's active-request slot) is held until the body ends.
    pub fn new(inner: Body, log: RequestLog, picked: Option<Picked>) -> Self {
        Metered { inner, bytes: 0, log: Some(log), _picked: picked }
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

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = Pin::new(&mut this.inner).poll_frame(cx);
        match &r {
            Poll::Ready(Some(Ok(f))) => {
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
                    log.error = Some(format!("response body: {e}"));
                    log.response_flags = "UPE";
                }
                this.finish();
            }
            Poll::Ready(None) => this.finish(),
            Poll::Pending => {}
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
/// with the body) comes first, then the rest as it arrives.
pub struct Downstream {
    ahead: std::collections::VecDeque<Frame<Bytes>>,
    /// None once the client's body has ended.
    rest: Option<Incoming>,
}

impl Downstream {
    pub fn new(body: Incoming) -> Downstream {
        Downstream { ahead: std::collections::VecDeque::new(), rest: Some(body) }
    }

    /// Reads ahead until at least `until` bytes are buffered or the body ends; returns
    /// the body's data read so far (it is still sent on, all of it) and whether the body
    /// ended within it.
    pub async fn read_ahead(&mut self, until: usize) -> Result<(Bytes, bool), hyper::Error> {
        use http_body_util::BodyExt;
        let mut buffered: usize = self.ahead.iter().filter_map(|f| f.data_ref()).map(Bytes::len).sum();
        while buffered < until {
            let Some(rest) = self.rest.as_mut() else { break };
            match rest.frame().await {
                Some(Ok(f)) => {
                    buffered += f.data_ref().map_or(0, Bytes::len);
                    self.ahead.push_back(f);
                }
                Some(Err(e)) => return Err(e),
                None => self.rest = None,
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

impl http_body::Body for Downstream {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Some(f) = self.ahead.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        match self.rest.as_mut() {
            Some(r) => Pin::new(r).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ahead.is_empty() && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self.ahead.iter().filter_map(|f| f.data_ref()).map(|d| d.len() as u64).sum();
        with_ahead(self.rest.as_ref().map_or_else(|| SizeHint::with_exact(0), |r| r.size_hint()), ahead)
    }
}

/// The size of a body `ahead` bytes longer than `rest` says.
fn with_ahead(rest: SizeHint, ahead: u64) -> SizeHint {
    // Upper first: SizeHint panics on a lower bound above its upper one.
    let mut h = SizeHint::new();
    if let Some(u) = rest.upper() {
        h.set_upper(u.saturating_add(ahead));
    }
    h.set_lower(rest.lower().saturating_add(ahead).min(h.upper().unwrap_or(u64::MAX)));
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

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    self.count.fetch_add(d.len() as u64, Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
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
    Empty::<Bytes>::new().map_err(|never| match never {}).boxed()
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
