//! The waypoint's L7 config in a cluster: the HTTPRoutes and AuthorizationPolicies of its
//! namespace, watched from the Kubernetes API (and its Gateway, checked). Each object
//! becomes the same type the local config file uses and gets the same validation; an
//! invalid route is logged and left out while the others apply, and an
//! AuthorizationPolicy the waypoint cannot enforce exactly becomes a deny-all for what it
//! targets (logged, and counted in `ztunnel_unenforceable_policies{source="kubernetes"}`).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::{Map, Value};
use tokio::sync::watch;
use ztunnel::metrics::control::XdsMetrics;

use crate::authz::AuthorizationPolicy;
use crate::object::ObjectRef;
use crate::route::HttpRoute;

/// What the Kubernetes API says, converted.
#[derive(Default)]
pub struct L7Config {
    pub routes: Vec<HttpRoute>,
    pub policies: Vec<AuthorizationPolicy>,
    /// How many of `policies` are deny-alls in place of ones that did not convert.
    pub unenforceable: usize,
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
    // Without a spec there are no targetRefs: not the waypoint's.
    let Ok(mut spec) = flattened(obj) else { return Ok(None) };
    // The deprecated single targetRef means the same as a one-element targetRefs.
    if let Some(one) = spec.remove("targetRef") {
        if spec.contains_key("targetRefs") {
            return Err("sets both targetRef and targetRefs".into());
        }
        spec.insert("targetRefs".into(), Value::Array(vec![one]));
    }
    if spec.get("targetRefs").is_none_or(|t| t.as_array().is_none_or(|a| a.is_empty())) {
        return Ok(None);
    }
    if spec.contains_key("selector") {
        return Err("sets both selector and targetRefs".into());
    }
    let p: AuthorizationPolicy = serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
    p.validate()?;
    Ok(Some(p))
}

/// The deny-all that replaces a policy `policy` refused, for the refs it names (see
/// `AuthorizationPolicy::deny_all`; refs that don't parse make it cover the waypoint).
fn deny_all(obj: &DynamicObject, gateway: &str) -> AuthorizationPolicy {
    let spec = obj.data.get("spec");
    let many = spec.and_then(|s| s.get("targetRefs")).and_then(Value::as_array).cloned().unwrap_or_default();
    let one = spec.and_then(|s| s.get("targetRef")).cloned();
    let unplaceable = ObjectRef::default();
    let refs: Vec<ObjectRef> =
        many.into_iter().chain(one).map(|r| serde_json::from_value(r).unwrap_or_else(|_| unplaceable.clone())).collect();
    let namespace = obj.metadata.namespace.as_deref().unwrap_or_default();
    AuthorizationPolicy::deny_all(namespace, obj.metadata.name.as_deref().unwrap_or_default(), &refs, gateway)
}

#[derive(Default)]
struct Objects {
    synced: bool,
    buffer: Vec<DynamicObject>,
    routes: BTreeMap<String, HttpRoute>,
    policies: BTreeMap<String, AuthorizationPolicy>,
    /// Names of the policies in `policies` that are deny-alls standing in for others.
    unenforceable: std::collections::BTreeSet<String>,
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
            Kind::AuthorizationPolicy => {
                self.unenforceable.remove(&name);
                match policy(obj) {
                    Ok(Some(p)) => {
                        self.policies.insert(name, p);
                    }
                    Ok(None) => {
                        self.policies.remove(&name);
                    }
                    Err(e) => {
                        // Never just left out: a lost DENY, or the only ALLOW for a
                        // target, would let through what the policy meant to stop.
                        let p = deny_all(obj, gateway);
                        let targets: Vec<String> = p.target_refs.iter().map(|r| format!("{}/{}", r.kind.as_deref().unwrap_or_default(), r.name)).collect();
                        tracing::error!(kind = "AuthorizationPolicy", name = %name, error = %e, targets = %targets.join(","),
                            "policy cannot be enforced exactly; denying every request to its targets instead");
                        self.unenforceable.insert(name.clone());
                        self.policies.insert(name, p);
                    }
                }
            }
        }
    }

    fn delete(&mut self, obj: &DynamicObject) {
        let name = obj.metadata.name.clone().unwrap_or_default();
        self.routes.remove(&name);
        self.policies.remove(&name);
        self.unenforceable.remove(&name);
    }
}

/// Watches the namespace and publishes the converted config each time it changes, once
/// every kind has been listed. Runs until the process ends (the watchers retry with
/// backoff on their own).
pub async fn watch(client: kube::Client, namespace: String, gateway: String, out: watch::Sender<Option<Arc<L7Config>>>, metrics: XdsMetrics) {
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
                objects.unenforceable.clear();
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
                unenforceable: by_kind.values().map(|o| o.unenforceable.len()).sum(),
            };
            metrics.set_unenforceable("kubernetes", cfg.unenforceable);
            tracing::info!(routes = cfg.routes.len(), policies = cfg.policies.len(), unenforceable = cfg.unenforceable, namespace = %namespace, "L7 config from Kubernetes");
            out.send_replace(Some(Arc::new(cfg)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ztunnel::identity::Identity;

    use crate::authz;
    use crate::object::{ObjectName, Target};

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

    fn verdict(objects: &Objects, service: Option<&str>) -> authz::Verdict {
        let gateway = ObjectName { namespace: "default".into(), name: "waypoint".into() };
        let svc = service.map(|name| ObjectName { namespace: "default".into(), name: name.into() });
        let target = Target { gateway: &gateway, service: svc.as_ref(), port: 80 };
        let id = Identity::new("cluster.local", "default", "sleep");
        let headers = http::HeaderMap::new();
        let req = authz::Request {
            source_principal: Some(&id),
            source_ip: "10.0.0.1".parse().unwrap(),
            destination_port: 80,
            host: "echo",
            method: "GET",
            path: "/",
            headers: &headers,
        };
        authz::evaluate(objects.policies.values().filter(|p| p.applies_to(&target)), &req)
    }

    #[test]
    fn unenforceable_policies_deny_all_in_their_scope() {
        let cases = [
            // An ALLOW that needs JWT: dropping it would allow everyone.
            serde_json::json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "ALLOW",
                               "rules": [{"from": [{"source": {"requestPrincipals": ["*"]}}]}]}),
            // ext-authz, which we don't have.
            serde_json::json!({"targetRef": {"group": "", "kind": "Service", "name": "echo"}, "action": "CUSTOM", "provider": {"name": "x"}, "rules": [{}]}),
            // A condition we cannot evaluate.
            serde_json::json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "DENY",
                               "rules": [{"when": [{"key": "request.auth.claims[group]", "values": ["admin"]}]}]}),
        ];
        for spec in cases {
            let mut objects = Objects::default();
            objects.apply(Kind::AuthorizationPolicy, "waypoint", &object("AuthorizationPolicy", "p", spec.clone()));
            let v = verdict(&objects, Some("echo"));
            assert!(!v.allowed, "{spec}: the unenforceable policy was dropped");
            assert_eq!(v.denied_by.as_deref(), Some("default/p"), "{spec}");
            assert!(verdict(&objects, Some("other")).allowed, "{spec}: only its targets are denied");
        }
        // A targetRef we cannot place: the whole waypoint is denied.
        let mut objects = Objects::default();
        objects.apply(Kind::AuthorizationPolicy, "waypoint", &object("AuthorizationPolicy", "se", serde_json::json!({
            "targetRefs": [{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "ext"}], "action": "DENY", "rules": [{}]})));
        assert!(!verdict(&objects, Some("other")).allowed);
        assert!(!verdict(&objects, None).allowed);
    }
}
