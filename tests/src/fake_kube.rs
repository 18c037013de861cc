//! A fake Kubernetes API server for end-to-end tests: plain HTTP, resources by
//! `/apis/<group>/<version>[/namespaces/<ns>]/<plural>` and core ones by
//! `/api/v1[/namespaces/<ns>]/<plural>` (one namespace, or all of them; `namespaces`
//! itself is cluster-scoped), list and watch (a chunked stream of JSON events, replaying
//! what happened after the requested resourceVersion), with `labelSelector` (`k`, `!k`,
//! `k=v`, `k!=v`: an object that stops matching is DELETED for that watch, as the API
//! server does), as kube's watcher uses them, and discovery of the CRD kinds the waypoint
//! watches (`/apis/<group>/<version>`, a fixed list). Objects are JSON values the test
//! applies and deletes. It checks nothing (no RBAC, no schema): `kube_apiserver` is the
//! real API server.

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
    namespace: String,
    kind: &'static str,
    object: Value,
    /// The version it replaced (MODIFIED), for label selectors.
    prev: Option<Value>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    /// (plural, namespace, name) -> object; namespace "" for cluster-scoped kinds
    objects: std::collections::BTreeMap<(String, String, String), Value>,
    log: Vec<Event>,
}

/// `labelSelector` clauses: (key, None) exists, (key, Some(v)) equals; `negated` flips.
struct Selector(Vec<(String, Option<String>, bool)>);

impl Selector {
    fn parse(s: &str) -> Selector {
        let clauses = s
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(|c| {
                if let Some((k, v)) = c.split_once("!=") {
                    (k.to_string(), Some(v.to_string()), true)
                } else if let Some((k, v)) = c.split_once('=') {
                    (
                        k.to_string(),
                        Some(v.trim_start_matches('=').to_string()),
                        false,
                    )
                } else if let Some(k) = c.strip_prefix('!') {
                    (k.to_string(), None, true)
                } else {
                    (c.to_string(), None, false)
                }
            });
        Selector(clauses.collect())
    }

    fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        self.0.iter().all(|(k, v, negated)| {
            let found = match v {
                None => labels.get(k).is_some(),
                Some(v) => labels.get(k).and_then(Value::as_str) == Some(v.as_str()),
            };
            found != *negated
        })
    }
}

/// `namespaces` is the one cluster-scoped kind served here.
fn cluster_scoped(plural: &str) -> bool {
    plural == "namespaces"
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
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}

/// A list or watch path -> (apiVersion, plural, the namespace or None for all).
fn parse_path(path: &str) -> Option<(String, String, Option<String>)> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let (api, rest) = match parts.as_slice() {
        ["apis", group, version, rest @ ..] => (format!("{group}/{version}"), rest),
        ["api", version, rest @ ..] => (version.to_string(), rest),
        _ => return None,
    };
    match rest {
        ["namespaces", ns, plural] => Some((api, plural.to_string(), Some(ns.to_string()))),
        [plural] => Some((api, plural.to_string(), None)),
        _ => None,
    }
}

/// `%XX` and `+` decoded.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => match std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                Some(v) => {
                    out.push(v);
                    i += 2;
                }
                None => out.push(b'%'),
            },
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(q: &str, key: &str) -> Option<String> {
    q.split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .map(decode)
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
                    let svc = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let (s, t) = (s.clone(), t.clone());
                            async move { Ok::<_, Infallible>(handle(&s, &t, req)) }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        Ok(FakeKube {
            store,
            tick,
            addr,
            task,
        })
    }

    fn record(
        &self,
        plural: &str,
        namespace: &str,
        kind: &'static str,
        object: Value,
        prev: Option<Value>,
    ) {
        let mut s = self.store.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        s.log.push(Event {
            rv,
            plural: plural.to_string(),
            namespace: namespace.to_string(),
            kind,
            object,
            prev,
        });
        drop(s);
        self.tick.send_replace(rv);
    }

    /// Creates or replaces an object (metadata.name; metadata.namespace, default
    /// `default`, except for cluster-scoped kinds).
    pub fn apply(&self, plural: &str, mut object: Value) {
        let name = object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let ns = if cluster_scoped(plural) {
            String::new()
        } else {
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string()
        };
        let (kind, prev) = {
            let mut s = self.store.lock().unwrap();
            let rv = s.rv + 1;
            if !ns.is_empty() {
                object["metadata"]["namespace"] = json!(ns);
            }
            object["metadata"]["resourceVersion"] = json!(rv.to_string());
            object["metadata"]["uid"] = json!(format!("uid-{plural}-{ns}-{name}"));
            let prev = s
                .objects
                .insert((plural.to_string(), ns.clone(), name), object.clone());
            (if prev.is_some() { "MODIFIED" } else { "ADDED" }, prev)
        };
        self.record(plural, &ns, kind, object, prev);
    }

    /// Deletes an object of namespace `default`.
    pub fn delete(&self, plural: &str, name: &str) {
        self.delete_in(plural, "default", name)
    }

    pub fn delete_in(&self, plural: &str, namespace: &str, name: &str) {
        let ns = if cluster_scoped(plural) {
            ""
        } else {
            namespace
        };
        let gone = self.store.lock().unwrap().objects.remove(&(
            plural.to_string(),
            ns.to_string(),
            name.to_string(),
        ));
        if let Some(o) = gone {
            self.record(plural, ns, "DELETED", o, None);
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

/// The API groups' resources this fake serves, for discovery (`GET /apis/<group>/<version>`,
/// which clients ask before watching a kind of a CRD): (group/version, plural, kind).
const DISCOVERY: &[(&str, &str, &str)] = &[
    ("gateway.networking.k8s.io/v1", "gateways", "Gateway"),
    ("gateway.networking.k8s.io/v1", "httproutes", "HTTPRoute"),
    ("gateway.networking.k8s.io/v1", "grpcroutes", "GRPCRoute"),
    ("gateway.networking.k8s.io/v1", "tcproutes", "TCPRoute"),
    ("gateway.networking.k8s.io/v1", "tlsroutes", "TLSRoute"),
    (
        "gateway.networking.k8s.io/v1beta1",
        "referencegrants",
        "ReferenceGrant",
    ),
    (
        "networking.istio.io/v1",
        "destinationrules",
        "DestinationRule",
    ),
    (
        "networking.istio.io/v1",
        "virtualservices",
        "VirtualService",
    ),
    (
        "security.istio.io/v1",
        "authorizationpolicies",
        "AuthorizationPolicy",
    ),
    (
        "security.istio.io/v1",
        "requestauthentications",
        "RequestAuthentication",
    ),
    ("telemetry.istio.io/v1", "telemetries", "Telemetry"),
];

fn handle(
    store: &Arc<Mutex<Store>>,
    tick: &watch::Sender<u64>,
    req: http::Request<hyper::body::Incoming>,
) -> http::Response<Body> {
    if let ["apis", group, version] = req
        .uri()
        .path()
        .trim_start_matches('/')
        .split('/')
        .collect::<Vec<_>>()
        .as_slice()
    {
        let gv = format!("{group}/{version}");
        let resources: Vec<Value> = DISCOVERY
            .iter()
            .filter(|(g, _, _)| *g == gv)
            .map(|(_, plural, kind)| {
                json!({"name": plural, "singularName": "", "namespaced": true, "kind": kind,
                "verbs": ["get", "list", "watch"]})
            })
            .collect();
        if resources.is_empty() {
            return json_response(
                404,
                &json!({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}),
            );
        }
        return json_response(
            200,
            &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
        );
    }
    let Some((api_version, plural, namespace)) = parse_path(req.uri().path()) else {
        return json_response(
            404,
            &json!({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}),
        );
    };
    let q = req.uri().query().unwrap_or("");
    let selector = Arc::new(Selector::parse(
        &query(q, "labelSelector").unwrap_or_default(),
    ));
    let in_scope =
        move |p: &str, ns: &str| p == plural && namespace.as_deref().is_none_or(|n| n == ns);
    let watching = matches!(query(q, "watch").as_deref(), Some("true") | Some("1"));
    if !watching {
        let s = store.lock().unwrap();
        let items: Vec<Value> = s
            .objects
            .iter()
            .filter(|((p, ns, _), o)| in_scope(p, ns) && selector.matches(o))
            .map(|(_, o)| o.clone())
            .collect();
        return json_response(
            200,
            &json!({
                "apiVersion": api_version, "kind": "List",
                "metadata": {"resourceVersion": s.rv.to_string()},
                "items": items,
            }),
        );
    }
    // Watch: everything after the requested version, then live events.
    let since: u64 = query(q, "resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let store = store.clone();
    let rx = tick.subscribe();
    let stream = futures_util::stream::unfold((since, rx), move |(mut last, mut rx)| {
        let store = store.clone();
        let (in_scope, selector) = (in_scope.clone(), selector.clone());
        async move {
            loop {
                let next = {
                    let s = store.lock().unwrap();
                    // As this watch sees each event: an object that starts or stops
                    // matching the selector is ADDED or DELETED.
                    let seen = |e: &Event| {
                        let now = selector.matches(&e.object);
                        let before = e.prev.as_ref().is_some_and(|p| selector.matches(p));
                        let kind = match (e.kind, before, now) {
                            ("DELETED", _, true) => "DELETED",
                            ("MODIFIED", true, true) => "MODIFIED",
                            ("MODIFIED", true, false) => "DELETED",
                            (_, _, true) => "ADDED",
                            _ => return None,
                        };
                        Some((e.rv, json!({"type": kind, "object": e.object})))
                    };
                    let from = last;
                    let mut next = None;
                    for e in s
                        .log
                        .iter()
                        .filter(|e| e.rv > from && in_scope(&e.plural, &e.namespace))
                    {
                        last = e.rv;
                        next = seen(e);
                        if next.is_some() {
                            break;
                        }
                    }
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
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}
