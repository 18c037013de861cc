//! A fake Kubernetes API server for end-to-end tests: plain HTTP, namespaced custom
//! resources by `/apis/<group>/<version>/namespaces/<ns>/<plural>`, list and watch (a
//! chunked stream of JSON events, replaying what happened after the requested
//! resourceVersion), as kube's watcher uses them. Objects are JSON values the test applies
//! and deletes.
#![allow(dead_code)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Result;
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::netsim::Netns;

struct Event {
    rv: u64,
    plural: String,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// (plural, name) -> object
    objects: std::collections::BTreeMap<(String, String), Value>,
    log: Vec<Event>,
}

pub struct FakeKube {
    store: Arc<Mutex<Store>>,
    tick: watch::Sender<u64>,
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn json_response(status: u16, v: &Value) -> http::Response<Body> {
    let mut r = http::Response::new(http_body_util::Full::new(Bytes::from(v.to_string())).boxed());
    *r.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    r.headers_mut().insert("content-type", http::HeaderValue::from_static("application/json"));
    r
}

/// `/apis/<group>/<version>/namespaces/<ns>/<plural>` -> (apiVersion, plural).
fn parse_path(path: &str) -> Option<(String, String)> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        ["apis", group, version, "namespaces", _ns, plural] => Some((format!("{group}/{version}"), plural.to_string())),
        _ => None,
    }
}

fn query(q: &str, key: &str) -> Option<String> {
    q.split('&').find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=')).map(str::to_string)
}

impl FakeKube {
    /// Serves on `addr`'s port inside `netns`; clients are told to use `addr`.
    pub fn start(netns: &Netns, addr: SocketAddr) -> Result<FakeKube> {
        let listener = netns.listen(addr.port())?;
        let store = Arc::new(Mutex::new(Store::default()));
        let (tick, _) = watch::channel(0u64);
        let (s, t) = (store.clone(), tick.clone());
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (s, t) = (s.clone(), t.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let (s, t) = (s.clone(), t.clone());
                        async move { Ok::<_, Infallible>(handle(&s, &t, req)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Ok(FakeKube { store, tick, addr, task })
    }

    fn record(&self, plural: &str, kind: &'static str, object: Value) {
        let mut s = self.store.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        s.log.push(Event { rv, plural: plural.to_string(), kind, object });
        drop(s);
        self.tick.send_replace(rv);
    }

    /// Creates or replaces an object (metadata.name, namespace default).
    pub fn apply(&self, plural: &str, mut object: Value) {
        let name = object["metadata"]["name"].as_str().unwrap_or_default().to_string();
        let kind = {
            let mut s = self.store.lock().unwrap();
            let rv = s.rv + 1;
            object["metadata"]["namespace"] = json!("default");
            object["metadata"]["resourceVersion"] = json!(rv.to_string());
            object["metadata"]["uid"] = json!(format!("uid-{plural}-{name}"));
            let existed = s.objects.insert((plural.to_string(), name), object.clone()).is_some();
            if existed { "MODIFIED" } else { "ADDED" }
        };
        self.record(plural, kind, object);
    }

    pub fn delete(&self, plural: &str, name: &str) {
        let gone = self.store.lock().unwrap().objects.remove(&(plural.to_string(), name.to_string()));
        if let Some(o) = gone {
            self.record(plural, "DELETED", o);
        }
    }

    /// A kubeconfig pointing at this server.
    pub fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        std::fs::write(
            path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{}\"}}\nusers:\n- name: fake\n  user: {{token: test}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake, namespace: default}}\ncurrent-context: fake\n",
                self.addr
            ),
        )?;
        Ok(())
    }
}

fn handle(store: &Arc<Mutex<Store>>, tick: &watch::Sender<u64>, req: http::Request<hyper::body::Incoming>) -> http::Response<Body> {
    let Some((api_version, plural)) = parse_path(req.uri().path()) else {
        return json_response(404, &json!({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}));
    };
    let q = req.uri().query().unwrap_or("");
    let watching = matches!(query(q, "watch").as_deref(), Some("true") | Some("1"));
    if !watching {
        let s = store.lock().unwrap();
        let items: Vec<Value> = s.objects.iter().filter(|((p, _), _)| *p == plural).map(|(_, o)| o.clone()).collect();
        return json_response(200, &json!({
            "apiVersion": api_version, "kind": "List",
            "metadata": {"resourceVersion": s.rv.to_string()},
            "items": items,
        }));
    }
    // Watch: everything after the requested version, then live events.
    let since: u64 = query(q, "resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let store = store.clone();
    let rx = tick.subscribe();
    let stream = futures_util::stream::unfold((since, rx), move |(mut last, mut rx)| {
        let store = store.clone();
        let plural = plural.clone();
        async move {
            loop {
                let next = {
                    let s = store.lock().unwrap();
                    let next = s.log.iter().find(|e| e.rv > last && e.plural == plural).map(|e| (e.rv, json!({"type": e.kind, "object": e.object})));
                    if next.is_none() {
                        // Everything up to now was looked at; wait for what comes next.
                        last = last.max(s.rv);
                    }
                    next
                };
                if let Some((rv, ev)) = next {
                    last = rv;
                    let line = Bytes::from(format!("{ev}\n"));
                    return Some((Ok::<_, Infallible>(Frame::data(line)), (last, rx)));
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        }
    });
    let mut r = http::Response::new(StreamBody::new(stream).boxed());
    r.headers_mut().insert("content-type", http::HeaderValue::from_static("application/json"));
    r
}
