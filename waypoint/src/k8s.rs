//! The waypoint's L7 config in a cluster: the HTTPRoutes and AuthorizationPolicies of its
//! namespace, watched from the Kubernetes API (and its Gateway, checked). Each object
//! becomes the same type the local config file uses and gets the same validation; an
//! invalid one is logged and left out while the others apply.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::{Map, Value};
use tokio::sync::watch;
use ztunnel::l7::authz::AuthorizationPolicy;
use ztunnel::l7::route::HttpRoute;

/// What the Kubernetes API says, converted.
#[derive(Default)]
pub struct L7Config {
    pub routes: Vec<HttpRoute>,
    pub policies: Vec<AuthorizationPolicy>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gateway,
    HttpRoute,
    AuthorizationPolicy,
}

fn resource(kind: Kind) -> ApiResource {
    let (group, version, k, plural) = match kind {
        Kind::Gateway => ("gateway.networking.k8s.io", "v1", "Gateway", "gateways"),
        Kind::HttpRoute => ("gateway.networking.k8s.io", "v1", "HTTPRoute", "httproutes"),
        Kind::AuthorizationPolicy => ("security.istio.io", "v1", "AuthorizationPolicy", "authorizationpolicies"),
    };
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: format!("{group}/{version}"),
        kind: k.into(),
        plural: plural.into(),
    }
}

/// The object's `spec` with `name` and `namespace` beside it: the local config shape.
fn flattened(obj: &DynamicObject) -> Result<Map<String, Value>, String> {
    let mut spec = match obj.data.get("spec") {
        Some(Value::Object(m)) => m.clone(),
        _ => return Err("has no spec".into()),
    };
    spec.insert("name".into(), Value::String(obj.metadata.name.clone().unwrap_or_default()));
    spec.insert("namespace".into(), Value::String(obj.metadata.namespace.clone().unwrap_or_default()));
    Ok(spec)
}

pub fn route(obj: &DynamicObject) -> Result<HttpRoute, String> {
    let r: HttpRoute = serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    r.validate()?;
    Ok(r)
}

/// The policy, or None when it is not the waypoint's to enforce (a `selector` policy is
/// for the workloads' own proxies).
pub fn policy(obj: &DynamicObject) -> Result<Option<AuthorizationPolicy>, String> {
    let mut spec = flattened(obj)?;
    // The deprecated single targetRef means the same as a one-element targetRefs.
    if let Some(one) = spec.remove("targetRef") {
        if spec.contains_key("targetRefs") {
            return Err("sets both targetRef and targetRefs".into());
        }
        spec.insert("targetRefs".into(), Value::Array(vec![one]));
    }
    if !spec.get("targetRefs").is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty())) {
        return Ok(None);
    }
    if spec.contains_key("selector") {
        return Err("sets both selector and targetRefs".into());
    }
    let p: AuthorizationPolicy = serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
    p.validate()?;
    Ok(Some(p))
}

#[derive(Default)]
struct Objects {
    synced: bool,
    buffer: Vec<DynamicObject>,
    routes: BTreeMap<String, HttpRoute>,
    policies: BTreeMap<String, AuthorizationPolicy>,
}

impl Objects {
    fn apply(&mut self, kind: Kind, gateway: &str, obj: &DynamicObject) {
        let name = obj.metadata.name.clone().unwrap_or_default();
        match kind {
            Kind::Gateway => {
                if name == gateway {
                    let class = obj.data.pointer("/spec/gatewayClassName").and_then(Value::as_str).unwrap_or("");
                    if class == "istio-waypoint" {
                        tracing::info!(gateway = %name, "serving Gateway");
                    } else {
                        tracing::warn!(gateway = %name, class, "our Gateway's class is not istio-waypoint");
                    }
                }
            }
            Kind::HttpRoute => match route(obj) {
                Ok(r) => {
                    self.routes.insert(name, r);
                }
                Err(e) => {
                    tracing::warn!(kind = "HTTPRoute", name = %name, error = %e, "object rejected; it does not apply");
                    self.routes.remove(&name);
                }
            },
            Kind::AuthorizationPolicy => match policy(obj) {
                Ok(Some(p)) => {
                    self.policies.insert(name, p);
                }
                Ok(None) => {
                    self.policies.remove(&name);
                }
                Err(e) => {
                    tracing::warn!(kind = "AuthorizationPolicy", name = %name, error = %e, "object rejected; it does not apply");
                    self.policies.remove(&name);
                }
            },
        }
    }

    fn delete(&mut self, obj: &DynamicObject) {
        let name = obj.metadata.name.clone().unwrap_or_default();
        self.routes.remove(&name);
        self.policies.remove(&name);
    }
}

/// Watches the namespace and publishes the converted config each time it changes, once
/// every kind has been listed. Runs until the process ends (the watchers retry with
/// backoff on their own).
pub async fn watch(client: kube::Client, namespace: String, gateway: String, out: watch::Sender<Option<Arc<L7Config>>>) {
    let streams = [Kind::Gateway, Kind::HttpRoute, Kind::AuthorizationPolicy].map(|kind| {
        let api = kube::Api::<DynamicObject>::namespaced_with(client.clone(), &namespace, &resource(kind));
        watcher::watcher(api, watcher::Config::default()).default_backoff().map(move |e| (kind, e)).boxed()
    });
    let mut events = futures_util::stream::select_all(streams);
    let mut by_kind: BTreeMap<u8, Objects> = BTreeMap::new();
    while let Some((kind, event)) = events.next().await {
        let objects = by_kind.entry(kind as u8).or_default();
        match event {
            Err(e) => {
                tracing::warn!(kind = ?kind, error = %e, "Kubernetes watch failed; retrying");
                continue;
            }
            Ok(Event::Init) => objects.buffer.clear(),
            Ok(Event::InitApply(o)) => objects.buffer.push(o),
            Ok(Event::InitDone) => {
                // A (re)list replaces what we had of this kind.
                let buffer = std::mem::take(&mut objects.buffer);
                objects.routes.clear();
                objects.policies.clear();
                for o in &buffer {
                    objects.apply(kind, &gateway, o);
                }
                objects.synced = true;
            }
            Ok(Event::Apply(o)) => objects.apply(kind, &gateway, &o),
            Ok(Event::Delete(o)) => objects.delete(&o),
        }
        if by_kind.len() == 3 && by_kind.values().all(|o| o.synced) {
            let cfg = L7Config {
                routes: by_kind.values().flat_map(|o| o.routes.values().cloned()).collect(),
                policies: by_kind.values().flat_map(|o| o.policies.values().cloned()).collect(),
            };
            tracing::info!(routes = cfg.routes.len(), policies = cfg.policies.len(), namespace = %namespace, "L7 config from Kubernetes");
            out.send_replace(Some(Arc::new(cfg)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(kind: &str, name: &str, spec: Value) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "x/v1", "kind": kind,
            "metadata": {"name": name, "namespace": "default", "resourceVersion": "1"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn routes_convert_from_kubernetes_objects() {
        // As the API server stores it, with Gateway API's defaults filled in.
        let r = route(&object("HTTPRoute", "echo", serde_json::json!({
            "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                       "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v1", "port": 80, "weight": 1}]}]
        })))
        .unwrap();
        assert_eq!((r.name.as_str(), r.namespace.as_str()), ("echo", "default"));
        let bad = route(&object("HTTPRoute", "bad", serde_json::json!({"parentRefs": [{"kind": "Service", "group": "", "name": "e"}], "rules": [{"backendRefs": [{"name": "x"}]}]})));
        assert!(bad.unwrap_err().contains("port"));
    }

    #[test]
    fn policies_for_the_waypoint_only() {
        let p = policy(&object("AuthorizationPolicy", "deny", serde_json::json!({
            "targetRef": {"group": "", "kind": "Service", "name": "echo"},
            "action": "DENY",
            "rules": [{"to": [{"operation": {"methods": ["DELETE"]}}]}]
        })))
        .unwrap()
        .unwrap();
        assert_eq!(p.target_refs.len(), 1);
        let sidecar = policy(&object("AuthorizationPolicy", "s", serde_json::json!({"selector": {"matchLabels": {"app": "x"}}, "action": "DENY", "rules": [{}]})));
        assert!(sidecar.unwrap().is_none(), "selector policies are not the waypoint's");
        let custom = policy(&object("AuthorizationPolicy", "c", serde_json::json!({"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "waypoint"}], "action": "CUSTOM", "provider": {"name": "x"}})));
        assert!(custom.is_err());
    }
}
