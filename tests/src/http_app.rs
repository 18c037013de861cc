//! Test HTTP application for waypoint tests: an HTTP/1.1 + HTTP/2 (prior knowledge)
//! server in a pod that answers with what it saw, plus small HTTP/1.1, HTTP/2 and gRPC
//! clients. Endpoints:
//! - any path: 200, body = `pod=<name>\nmethod=..\npath=..\nversion=..\n<header>: <value>\n...`
//! - `/status/<code>`: that status
//! - `/delay/<ms>`: 200 after the delay
//! - `/flaky`: 503 when the server was started flaky, else 200
//! - gRPC (content-type application/grpc): the request message echoed, grpc-status 0
//!
//! Every response carries `x-pod: <name>`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::netsim::Netns;

/// What a server saw of one request.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
}

pub struct HttpApp {
    pub name: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Accepted TCP connections (to tell keep-alive from a connection per request).
    pub connections: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpApp {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

async fn serve_one(
    name: String,
    flaky: bool,
    seen: Arc<Mutex<Vec<Seen>>>,
    req: Request<Incoming>,
) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    seen.lock().unwrap().push(Seen {
        method: parts.method.to_string(),
        path: parts.uri.to_string(),
        headers: parts.headers.clone(),
    });
    let path = parts.uri.path().to_string();
    let grpc = parts
        .headers
        .get("content-type")
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let mut resp = if grpc {
        // Unary gRPC: echo the message back, status in trailers.
        let trailers = {
            let mut t = HeaderMap::new();
            t.insert("grpc-status", "0".parse().unwrap());
            t
        };
        let frames = vec![
            Ok::<_, Infallible>(hyper::body::Frame::data(body)),
            Ok(hyper::body::Frame::trailers(trailers)),
        ];
        let mut r = Response::new(
            http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed(),
        );
        r.headers_mut()
            .insert("content-type", "application/grpc".parse().unwrap());
        r
    } else if let Some(code) = path
        .strip_prefix("/status/")
        .and_then(|c| c.parse::<u16>().ok())
    {
        let mut r = Response::new(full(format!("pod={name}\nstatus={code}\n")));
        *r.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
        r
    } else if let Some(ms) = path
        .strip_prefix("/delay/")
        .and_then(|c| c.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Response::new(full(format!("pod={name}\ndelayed={ms}\n")))
    } else if path == "/flaky" && flaky {
        let mut r = Response::new(full(format!("pod={name}\nflaky\n")));
        *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        r
    } else {
        let mut text = format!(
            "pod={name}\nmethod={}\npath={}\nversion={:?}\nbody_len={}\n",
            parts.method,
            parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or(""),
            parts.version,
            body.len()
        );
        for (k, v) in &parts.headers {
            text.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
        }
        Response::new(full(text))
    };
    resp.headers_mut().insert("x-pod", name.parse().unwrap());
    resp
}

impl HttpApp {
    pub fn start(ns: &Netns, port: u16, name: &str, flaky: bool) -> Result<HttpApp> {
        let l = ns.listen(port)?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let connections = Arc::new(Mutex::new(0));
        let (s, c, n) = (seen.clone(), connections.clone(), name.to_string());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = l.accept().await {
                *c.lock().unwrap() += 1;
                let (s, n) = (s.clone(), n.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| {
                        let (s, n) = (s.clone(), n.clone());
                        async move { Ok::<_, Infallible>(serve_one(n, flaky, s, req).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(HttpApp {
            name: name.to_string(),
            seen,
            connections,
            task,
        })
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A response as the test reads it.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
    pub raw: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Reply {
    pub fn pod(&self) -> String {
        self.headers
            .get("x-pod")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    }

    /// A `name: value` line the server echoed.
    pub fn echoed(&self, name: &str) -> Vec<String> {
        let prefix = format!("{name}: ");
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .map(str::to_string)
            .collect()
    }

    /// A `key=value` line of the server's reply.
    pub fn field(&self, key: &str) -> Option<String> {
        let prefix = format!("{key}=");
        self.body
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map(str::to_string)
    }
}

async fn read_reply(resp: Response<Incoming>) -> Result<Reply> {
    let (parts, body) = resp.into_parts();
    let collected = body.collect().await.context("reading response body")?;
    let trailers = collected.trailers().cloned();
    let bytes = collected.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body: String::from_utf8_lossy(&bytes).to_string(),
        raw: bytes,
        trailers,
    })
}

/// One HTTP/1.1 keep-alive connection from a pod.
pub struct H1Client {
    send: hyper::client::conn::http1::SendRequest<Body>,
    pub host: String,
}

impl H1Client {
    pub async fn connect(ns: &Netns, addr: SocketAddr, host: &str) -> Result<H1Client> {
        let s = ns.connect(addr).await?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(s)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H1Client {
            send,
            host: host.to_string(),
        })
    }

    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<Reply> {
        let mut b = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        self.send.ready().await.context("connection not reusable")?;
        let resp = tokio::time::timeout(
            Duration::from_secs(10),
            self.send.send_request(b.body(full(Bytes::new()))?),
        )
        .await
        .context("request timed out")??;
        read_reply(resp).await
    }

    pub async fn get(&mut self, path: &str) -> Result<Reply> {
        self.request("GET", path, &[]).await
    }
}

/// One HTTP/2 (prior knowledge) connection from a pod; clones share it.
#[derive(Clone)]
pub struct H2Client {
    send: hyper::client::conn::http2::SendRequest<Body>,
    pub authority: String,
}

impl H2Client {
    pub async fn connect(ns: &Netns, addr: SocketAddr, authority: &str) -> Result<H2Client> {
        let s = ns.connect(addr).await?;
        let (send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(s)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H2Client {
            send,
            authority: authority.to_string(),
        })
    }

    pub async fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Reply> {
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.authority));
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        let mut send = self.send.clone();
        send.ready().await?;
        let resp = tokio::time::timeout(
            Duration::from_secs(10),
            send.send_request(b.body(full(body))?),
        )
        .await
        .context("request timed out")??;
        read_reply(resp).await
    }

    /// A unary gRPC call: length-prefixed message out, message and grpc-status back.
    pub async fn grpc_unary(&self, method_path: &str, message: &[u8]) -> Result<(Reply, Bytes)> {
        let mut framed = BytesMut::new();
        framed.put_u8(0);
        framed.put_u32(message.len() as u32);
        framed.put_slice(message);
        let reply = self
            .request(
                "POST",
                method_path,
                &[("content-type", "application/grpc"), ("te", "trailers")],
                framed.freeze(),
            )
            .await?;
        let mut b = reply.raw.clone();
        if b.len() < 5 {
            return Ok((reply, Bytes::new()));
        }
        let _compressed = b.get_u8();
        let len = b.get_u32() as usize;
        if b.len() != len {
            bail!("gRPC frame says {len} bytes, got {}", b.len());
        }
        Ok((reply, b))
    }
}
