//! One Kubernetes object as the waypoint's model: routes, VirtualServices, policies,
//! authentications, DestinationRules (or the stand-in that fails a rule's host), with the
//! error that keeps one out.

use kube::api::DynamicObject;
use serde_json::{Map, Value};

use super::kind::{route_kind_name, Kind};
use crate::authn::RequestAuthentication;
use crate::authz::AuthorizationPolicy;
use crate::object::ObjectRef;
use crate::route::{GrpcRoute, HttpRoute, L4Route, TcpRoute, TlsRoute};

/// The object's `spec` with `name` and `namespace` beside it: the local config shape.
pub(super) fn flattened(obj: &DynamicObject) -> Result<Map<String, Value>, String> {
    let mut spec = match obj.data.get("spec") {
        Some(Value::Object(m)) => m.clone(),
        _ => return Err("has no spec".into()),
    };
    spec.insert(
        "name".into(),
        Value::String(obj.metadata.name.clone().unwrap_or_default()),
    );
    spec.insert(
        "namespace".into(),
        Value::String(obj.metadata.namespace.clone().unwrap_or_default()),
    );
    Ok(spec)
}

/// For a DestinationRule that cannot be applied exactly (a field the waypoint does not
/// apply, TLS origination it cannot make, a value it cannot read): a rule for the same
/// host and `exportTo` whose traffic fails, since leaving it out would send the host's
/// traffic other than the rule asks (in plaintext, past its limits). A rule without a
/// host has no scope and does not apply.
fn refusing_destination_rule(
    obj: &DynamicObject,
    error: &str,
) -> Option<
    Box<(
        crate::destination::DestinationRule,
        crate::destination::Resolved,
    )>,
> {
    let spec = obj.data.get("spec")?;
    let host = spec
        .get("host")
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())?;
    let export_to = spec
        .get("exportTo")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    let d = crate::destination::DestinationRule {
        name: obj.metadata.name.clone().unwrap_or_default(),
        namespace: obj.metadata.namespace.clone().unwrap_or_default(),
        host: host.to_string(),
        traffic_policy: None,
        subsets: Vec::new(),
        export_to,
    };
    let resolved = crate::destination::Resolved::refusing(d.key(), error.to_string());
    Some(Box::new((d, resolved)))
}

pub fn route(obj: &DynamicObject) -> Result<HttpRoute, String> {
    let r: HttpRoute =
        serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    r.validate()?;
    Ok(r)
}

/// A VirtualService as written (`route::VirtualService`).
pub(super) fn parse_virtual_service(
    obj: &DynamicObject,
) -> Result<crate::route::VirtualService, String> {
    serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())
}

/// A VirtualService, as the HTTPRoute and L4 route it amounts to (`route::VirtualService`).
pub fn virtual_service(obj: &DynamicObject) -> Result<crate::route::VsRoutes, String> {
    parse_virtual_service(obj)?.routes()
}

/// A TLSRoute, as its L4 rules (`route::TlsRoute`).
pub fn tls_route(obj: &DynamicObject) -> Result<L4Route, String> {
    let r: TlsRoute =
        serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    r.to_l4()
}

/// A TCPRoute, as an HTTPRoute with its one rule (`route::TcpRoute`).
pub fn tcp_route(obj: &DynamicObject) -> Result<HttpRoute, String> {
    let r: TcpRoute =
        serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    r.to_http()
}

/// A GRPCRoute, as the HTTPRoute it amounts to (`route::GrpcRoute`).
pub fn grpc_route(obj: &DynamicObject) -> Result<HttpRoute, String> {
    let r: GrpcRoute =
        serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    r.to_http()
}

/// The spec of a security.istio.io object (AuthorizationPolicy, RequestAuthentication)
/// if it is the waypoint's: it has `targetRefs` (the deprecated single `targetRef` means
/// a one-element list). None without a spec or targets (a `selector` object is for the
/// workloads' own proxies); both a selector and targets is refused.
pub(super) fn waypoint_spec(
    obj: &DynamicObject,
) -> Result<Option<serde_json::Map<String, Value>>, String> {
    let Ok(mut spec) = flattened(obj) else {
        return Ok(None);
    };
    if let Some(one) = spec.remove("targetRef") {
        if spec.contains_key("targetRefs") {
            return Err("sets both targetRef and targetRefs".into());
        }
        spec.insert("targetRefs".into(), Value::Array(vec![one]));
    }
    if spec
        .get("targetRefs")
        .is_none_or(|t| t.as_array().is_none_or(|a| a.is_empty()))
    {
        return Ok(None);
    }
    if spec.contains_key("selector") {
        return Err("sets both selector and targetRefs".into());
    }
    Ok(Some(spec))
}

/// The policy, or None when it is not the waypoint's to enforce.
pub fn policy(obj: &DynamicObject) -> Result<Option<AuthorizationPolicy>, String> {
    let Some(spec) = waypoint_spec(obj)? else {
        return Ok(None);
    };
    let p: AuthorizationPolicy =
        serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
    p.validate()?;
    Ok(Some(p))
}

/// The RequestAuthentication, or None when it is not the waypoint's.
pub fn authentication(obj: &DynamicObject) -> Result<Option<RequestAuthentication>, String> {
    let Some(spec) = waypoint_spec(obj)? else {
        return Ok(None);
    };
    let a: RequestAuthentication =
        serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
    a.validate()?;
    Ok(Some(a))
}

/// The deny-all that replaces a policy `policy` refused, for the refs it names (see
/// `AuthorizationPolicy::deny_all`).
pub(super) fn deny_all(obj: &DynamicObject) -> AuthorizationPolicy {
    let unplaceable = ObjectRef::default();
    let refs: Vec<ObjectRef> = refs(obj, "targetRefs")
        .into_iter()
        .map(|r| serde_json::from_value(r.clone()).unwrap_or_else(|_| unplaceable.clone()))
        .collect();
    let namespace = obj.metadata.namespace.as_deref().unwrap_or_default();
    AuthorizationPolicy::deny_all(
        namespace,
        obj.metadata.name.as_deref().unwrap_or_default(),
        &refs,
    )
}

/// The stand-in for a RequestAuthentication `authentication` refused (see
/// `RequestAuthentication::reject_all`).
pub(super) fn reject_all(obj: &DynamicObject) -> RequestAuthentication {
    let unplaceable = ObjectRef::default();
    let refs: Vec<ObjectRef> = refs(obj, "targetRefs")
        .into_iter()
        .map(|r| serde_json::from_value(r.clone()).unwrap_or_else(|_| unplaceable.clone()))
        .collect();
    let namespace = obj.metadata.namespace.as_deref().unwrap_or_default();
    RequestAuthentication::reject_all(
        namespace,
        obj.metadata.name.as_deref().unwrap_or_default(),
        &refs,
    )
}

/// A DestinationRule with what it resolves to.
pub(super) type RuleAndPolicy = (
    crate::destination::DestinationRule,
    crate::destination::Resolved,
);

/// One object converted, at the resourceVersion it was converted for.
pub(super) enum Converted {
    Route(Result<HttpRoute, String>),
    /// A VirtualService (`http` and / or `tls` and `tcp` rules) or a TLSRoute.
    Routes(Result<crate::route::VsRoutes, String>),
    /// A VirtualService with `delegate` rules, merged with its delegates when published;
    /// or a delegate (no `hosts`), applied only through its roots.
    Delegating(Box<crate::route::VirtualService>),
    Delegate,
    Grant(Result<crate::grant::ReferenceGrant, String>),
    /// A rule that cannot be applied has the error and, when it names a host, a stand-in
    /// that fails that host's traffic.
    Destination(Result<Box<RuleAndPolicy>, (String, Option<Box<RuleAndPolicy>>)>),
    Policy(Result<Option<AuthorizationPolicy>, String>),
    Authentication(Result<Option<RequestAuthentication>, String>),
    /// Compiled when published (what it may name depends on the mesh config).
    Telemetry(Result<crate::telemetry::Telemetry, String>),
}

pub(super) fn convert(kind: Kind, obj: &DynamicObject) -> Converted {
    let (ns, name) = (
        obj.metadata.namespace.as_deref().unwrap_or_default(),
        obj.metadata.name.as_deref().unwrap_or_default(),
    );
    match kind {
        Kind::VirtualService => match parse_virtual_service(obj) {
            Ok(v) if v.is_delegate() => Converted::Delegate,
            Ok(v) if v.http.iter().any(|r| r.delegate.is_some()) => {
                Converted::Delegating(Box::new(v))
            }
            _ => convert_any(kind, obj, ns, name),
        },
        _ => convert_any(kind, obj, ns, name),
    }
}

fn convert_any(kind: Kind, obj: &DynamicObject, ns: &str, name: &str) -> Converted {
    match kind {
        Kind::VirtualService | Kind::TlsRoute => {
            let r = match kind {
                Kind::VirtualService => virtual_service(obj),
                _ => tls_route(obj).map(|l4| crate::route::VsRoutes {
                    http: None,
                    l4: Some(l4),
                }),
            };
            if let Err(e) = &r {
                let k = route_kind_name(kind);
                tracing::warn!(kind = k, namespace = ns, name, error = %e, "object rejected; it does not apply");
            }
            Converted::Routes(r)
        }
        Kind::HttpRoute | Kind::GrpcRoute | Kind::TcpRoute => {
            let r = match kind {
                Kind::HttpRoute => route(obj),
                Kind::GrpcRoute => grpc_route(obj),
                _ => tcp_route(obj),
            };
            if let Err(e) = &r {
                let k = route_kind_name(kind);
                tracing::warn!(kind = k, namespace = ns, name, error = %e, "object rejected; it does not apply");
            }
            Converted::Route(r)
        }
        Kind::ReferenceGrant => {
            let g = flattened(obj).and_then(|spec| {
                let g: crate::grant::ReferenceGrant =
                    serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
                g.validate().map(|()| g)
            });
            if let Err(e) = &g {
                // Left out: its backends stay unresolved (500), which is fail closed.
                tracing::warn!(kind = "ReferenceGrant", namespace = ns, name, error = %e, "object rejected; it does not apply");
            }
            Converted::Grant(g)
        }
        Kind::DestinationRule => {
            let d = flattened(obj).and_then(|spec| {
                let d: crate::destination::DestinationRule =
                    serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())?;
                let p = d.resolve()?;
                Ok(Box::new((d, p)))
            });
            Converted::Destination(d.map_err(|e| {
                let stand_in = refusing_destination_rule(obj, &e);
                match &stand_in {
                    Some(_) => tracing::error!(kind = "DestinationRule", namespace = ns, name, error = %e,
                        "DestinationRule cannot be applied exactly; traffic to its host fails instead"),
                    None => tracing::warn!(kind = "DestinationRule", namespace = ns, name, error = %e, "object rejected; it does not apply"),
                }
                (e, stand_in)
            }))
        }
        Kind::Telemetry => Converted::Telemetry(flattened(obj).and_then(|spec| {
            serde_json::from_value(Value::Object(spec)).map_err(|e| e.to_string())
        })),
        Kind::RequestAuthentication => {
            let a = authentication(obj);
            if let Err(e) = &a {
                tracing::error!(kind = "RequestAuthentication", namespace = ns, name, error = %e,
                    "RequestAuthentication cannot be applied; refusing every token to its targets instead");
            }
            Converted::Authentication(a)
        }
        _ => {
            let p = policy(obj);
            if let Err(e) = &p {
                // Never just left out: a lost DENY, or the only ALLOW for a target,
                // would let through what the policy meant to stop.
                let d = deny_all(obj);
                let targets: Vec<String> = d
                    .target_refs
                    .iter()
                    .map(|r| format!("{}/{}", r.kind.as_deref().unwrap_or_default(), r.name))
                    .collect();
                let targets = if d.unplaced {
                    format!("everything namespace {ns} may target")
                } else {
                    targets.join(",")
                };
                tracing::error!(kind = "AuthorizationPolicy", namespace = ns, name, error = %e, targets = %targets,
                    "policy cannot be enforced exactly; denying every request to its targets instead");
            }
            Converted::Policy(p)
        }
    }
}

/// `spec.<field>` and, for policies, the older single `spec.targetRef`.
pub(super) fn refs<'a>(obj: &'a DynamicObject, field: &str) -> Vec<&'a Value> {
    let spec = obj.data.get("spec");
    let many = spec
        .and_then(|s| s.get(field))
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    let one = spec
        .and_then(|s| s.get("targetRef"))
        .filter(|_| field == "targetRefs");
    many.chain(one).collect()
}
