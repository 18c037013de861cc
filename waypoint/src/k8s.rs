//! The waypoint's L7 config in a cluster, watched from the Kubernetes API: what an Istio
//! waypoint takes. From its own namespace, every HTTPRoute (and GRPCRoute) and every AuthorizationPolicy
//! and RequestAuthentication with `targetRefs`; from a namespace with Services that use
//! it (`scope`), the routes whose `parentRefs` name such a Service and the policies whose
//! `targetRefs` do (or name such a ServiceEntry); from the root namespace, the policies that target the GatewayClass
//! `istio-waypoint` (every waypoint). Objects of other namespaces are not even converted, so their errors are
//! not ours to report.
//!
//! Each object becomes the same type the local config file uses and gets the same
//! validation; an invalid route is logged and left out while the others apply, and an
//! AuthorizationPolicy the waypoint cannot enforce exactly becomes a deny-all for what it
//! targets (logged, and counted in `ztunnel_unenforceable_policies{source="kubernetes"}`);
//! a RequestAuthentication it cannot read, likewise, refuses every token for its targets.

mod scope;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use futures_util::StreamExt;
use kube::api::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use serde_json::{json, Map, Value};
use tokio::sync::watch;
use ztunnel::identity::Identity;
use ztunnel::metrics::control::XdsMetrics;
use ztunnel::state::{MeshState, SharedState};

use crate::authn::RequestAuthentication;
use crate::authz::AuthorizationPolicy;
use crate::object::{ObjectName, ObjectRef, GATEWAY_GROUP, WAYPOINT_CLASS};
use crate::route::{GrpcRoute, HttpRoute, TcpRoute};

pub use scope::{AllowedNamespaces, LabelSelector, Scope, USE_WAYPOINT, USE_WAYPOINT_NAMESPACE};

/// What the Kubernetes API says, converted.
#[derive(Default)]
pub struct L7Config {
    pub routes: Vec<HttpRoute>,
    /// TCPRoutes, as HTTPRoutes with their one rule.
    pub tcp_routes: Vec<HttpRoute>,
    pub grants: Vec<crate::grant::ReferenceGrant>,
    pub destination_rules: Vec<(
        crate::destination::DestinationRule,
        crate::destination::Resolved,
    )>,
    pub policies: Vec<AuthorizationPolicy>,
    pub authentications: Vec<RequestAuthentication>,
    /// The mesh config's extensionProviders (the `istio` ConfigMap of the root namespace).
    pub providers: crate::extauthz::Providers,
    /// Request tracing from the same mesh config.
    pub tracing: Option<Arc<crate::trace::TraceSettings>>,
    /// Telemetry API objects, compiled against the same mesh config.
    pub telemetry: Arc<crate::telemetry::Telemetries>,
    /// How many of `policies` (and `authentications`) are stand-ins in place of ones that did not convert.
    pub unenforceable: usize,
    /// For the admin endpoint: the objects as read, what was rejected, and who uses the
    /// waypoint.
    pub dump: Arc<Value>,
}

/// Who this waypoint is, as the objects name it.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Its Gateway (namespace and name).
    pub gateway: ObjectName,
    /// The mesh's root namespace.
    pub root_namespace: String,
    /// Its identity, to find the services istiod routes through it.
    pub identity: Identity,
    /// The ConfigMap of the root namespace with Istio's MeshConfig (key `mesh`), for
    /// its extensionProviders: `istio`, or `istio-<revision>`.
    pub mesh_config_map: String,
    /// The Istio revision this waypoint belongs to: config labelled `istio.io/rev` for
    /// another is ignored (Istio's `LabelsInRevision`). None: all of it applies.
    pub revision: Option<String>,
}

/// Istio's `config.LabelsInRevision`: an object without `istio.io/rev` is global; with
/// it, it belongs to that revision only (when this proxy has one).
fn in_revision(obj: &DynamicObject, revision: Option<&str>) -> bool {
    let Some(rev) = revision else { return true };
    match obj.metadata.labels.as_ref().and_then(|l| l.get(REV_LABEL)) {
        None => true,
        Some(r) => r == rev,
    }
}

/// The label of an object's (or a proxy's) Istio revision.
const REV_LABEL: &str = "istio.io/rev";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Kind {
    Gateway,
    HttpRoute,
    GrpcRoute,
    TcpRoute,
    ReferenceGrant,
    DestinationRule,
    VirtualService,
    AuthorizationPolicy,
    RequestAuthentication,
    Telemetry,
    Service,
    Namespace,
    /// The mesh config's ConfigMap. Not waited for: without it (not there, or not
    /// readable) CUSTOM policies deny what they match and everything else applies.
    MeshConfig,
}

const KINDS: [Kind; 13] = [
    Kind::DestinationRule,
    Kind::VirtualService,
    Kind::Gateway,
    Kind::HttpRoute,
    Kind::GrpcRoute,
    Kind::TcpRoute,
    Kind::ReferenceGrant,
    Kind::AuthorizationPolicy,
    Kind::RequestAuthentication,
    Kind::Telemetry,
    Kind::Service,
    Kind::Namespace,
    Kind::MeshConfig,
];

fn resource(kind: Kind) -> ApiResource {
    let (group, version, k, plural) = match kind {
        Kind::Gateway => (GATEWAY_GROUP, "v1", "Gateway", "gateways"),
        Kind::HttpRoute => (GATEWAY_GROUP, "v1", "HTTPRoute", "httproutes"),
        Kind::GrpcRoute => (GATEWAY_GROUP, "v1", "GRPCRoute", "grpcroutes"),
        // `v1` since Gateway API v1.6.0 (standard channel); `v1alpha2` before (see
        // `versions`: the one served is watched).
        Kind::TcpRoute => (GATEWAY_GROUP, "v1", "TCPRoute", "tcproutes"),
        Kind::ReferenceGrant => (
            GATEWAY_GROUP,
            "v1beta1",
            "ReferenceGrant",
            "referencegrants",
        ),
        Kind::DestinationRule => (
            "networking.istio.io",
            "v1",
            "DestinationRule",
            "destinationrules",
        ),
        Kind::VirtualService => (
            "networking.istio.io",
            "v1",
            "VirtualService",
            "virtualservices",
        ),
        Kind::AuthorizationPolicy => (
            "security.istio.io",
            "v1",
            "AuthorizationPolicy",
            "authorizationpolicies",
        ),
        Kind::RequestAuthentication => (
            "security.istio.io",
            "v1",
            "RequestAuthentication",
            "requestauthentications",
        ),
        Kind::Telemetry => ("telemetry.istio.io", "v1", "Telemetry", "telemetries"),
        Kind::Service => ("", "v1", "Service", "services"),
        Kind::Namespace => ("", "v1", "Namespace", "namespaces"),
        Kind::MeshConfig => ("", "v1", "ConfigMap", "configmaps"),
    };
    ApiResource {
        group: group.into(),
        version: version.into(),
        api_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
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

/// For a DestinationRule that cannot be applied but asks for TLS origination (a `tls`
/// with mode SIMPLE or MUTUAL anywhere in it): a rule for the same host whose traffic
/// fails, since leaving it out would send in plaintext what was meant to be encrypted.
fn refusing_destination_rule(
    obj: &DynamicObject,
    error: &str,
) -> Option<
    Box<(
        crate::destination::DestinationRule,
        crate::destination::Resolved,
    )>,
> {
    fn asks_tls(v: &Value) -> bool {
        match v {
            Value::Object(m) => {
                let origination = m
                    .get("tls")
                    .and_then(|t| t.get("mode"))
                    .and_then(Value::as_str)
                    .is_some_and(|m| m == "SIMPLE" || m == "MUTUAL");
                origination || m.values().any(asks_tls)
            }
            Value::Array(a) => a.iter().any(asks_tls),
            _ => false,
        }
    }
    let spec = obj.data.get("spec")?;
    let host = spec
        .get("host")
        .and_then(Value::as_str)
        .filter(|h| !h.is_empty())?;
    if !asks_tls(spec) {
        return None;
    }
    let d = crate::destination::DestinationRule {
        name: obj.metadata.name.clone().unwrap_or_default(),
        namespace: obj.metadata.namespace.clone().unwrap_or_default(),
        host: host.to_string(),
        traffic_policy: None,
        subsets: Vec::new(),
        export_to: Vec::new(),
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

/// A VirtualService, as the HTTPRoute it amounts to (`route::VirtualService`).
pub fn virtual_service(obj: &DynamicObject) -> Result<HttpRoute, String> {
    let v: crate::route::VirtualService =
        serde_json::from_value(Value::Object(flattened(obj)?)).map_err(|e| e.to_string())?;
    v.to_http()
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
fn waypoint_spec(obj: &DynamicObject) -> Result<Option<serde_json::Map<String, Value>>, String> {
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

/// `spec.<field>` and, for policies, the older single `spec.targetRef`.
fn refs<'a>(obj: &'a DynamicObject, field: &str) -> Vec<&'a Value> {
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

/// The deny-all that replaces a policy `policy` refused, for the refs it names (see
/// `AuthorizationPolicy::deny_all`).
fn deny_all(obj: &DynamicObject) -> AuthorizationPolicy {
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
fn reject_all(obj: &DynamicObject) -> RequestAuthentication {
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

fn route_kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::VirtualService => "VirtualService",
        Kind::GrpcRoute => "GRPCRoute",
        Kind::TcpRoute => "TCPRoute",
        _ => "HTTPRoute",
    }
}

fn str_field<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

/// A ref to a Service of `ns` (the object's own namespace: Istio's waypoints take a
/// route or policy only from the Service's namespace or their own) that uses the waypoint.
fn names_used_service(r: &Value, ns: &str, scope: &Scope) -> bool {
    let core = matches!(str_field(r, "group"), None | Some(""));
    let same_ns = str_field(r, "namespace").is_none_or(|n| n == ns);
    let name = str_field(r, "name").unwrap_or_default();
    str_field(r, "kind") == Some("Service")
        && core
        && same_ns
        && scope.uses(&ObjectName {
            namespace: ns.into(),
            name: name.into(),
        })
}

/// A policy's ref to a Service or ServiceEntry of `ns` that uses the waypoint, in the
/// groups Istio accepts (`policyattachment.go`: Service in "" or `core`, ServiceEntry in
/// `networking.istio.io`). A ServiceEntry uses the waypoint when istiod says so (its
/// hosts are Services of its name in istiod's state) or by its namespace's label.
fn names_used_target(r: &Value, ns: &str, scope: &Scope) -> bool {
    let group = str_field(r, "group");
    let service =
        str_field(r, "kind") == Some("Service") && matches!(group, None | Some("" | "core"));
    let service_entry = str_field(r, "kind") == Some("ServiceEntry")
        && group == Some(crate::object::NETWORKING_GROUP);
    let same_ns = str_field(r, "namespace").is_none_or(|n| n == ns);
    let name = str_field(r, "name").unwrap_or_default();
    (service || service_entry)
        && same_ns
        && scope.uses(&ObjectName {
            namespace: ns.into(),
            name: name.into(),
        })
}

/// Whether an Istio networking object is visible in namespace `to` by its `exportTo`:
/// empty or `*` everywhere, `.` its own namespace, or the namespaces named.
fn exported_to(obj: &DynamicObject, to: &str) -> bool {
    let own = obj.metadata.namespace.as_deref().unwrap_or_default();
    let Some(list) = obj.data.pointer("/spec/exportTo").and_then(Value::as_array) else {
        return true;
    };
    let list: Vec<String> = list
        .iter()
        .filter_map(Value::as_str)
        .map(String::from)
        .collect();
    crate::object::exported_to(&list, own, to)
}

/// Whether this waypoint takes the route or policy (module docs).
fn selected(kind: Kind, obj: &DynamicObject, scope: &Scope, settings: &Settings) -> bool {
    let ns = obj.metadata.namespace.as_deref().unwrap_or_default();
    // A VirtualService the waypoint's namespace cannot see (`exportTo`) is not in
    // Istio's waypoint's scope either. (A DestinationRule's `exportTo` is applied when
    // it is looked up, `destination::rule_for`.)
    if kind == Kind::VirtualService && !exported_to(obj, &settings.gateway.namespace) {
        return false;
    }
    if ns == settings.gateway.namespace {
        return true;
    }
    match kind {
        // Small, and any namespace may grant our routes its Services.
        Kind::ReferenceGrant => true,
        // Applied to the Services the waypoint sends to, whichever namespace has them;
        // a `workloadSelector` one is a workload proxy's.
        Kind::DestinationRule => obj.data.pointer("/spec/workloadSelector").is_none(),
        // One whose hosts name a Service that uses the waypoint.
        Kind::VirtualService => obj
            .data
            .pointer("/spec/hosts")
            .and_then(Value::as_array)
            .is_some_and(|hosts| {
                hosts
                    .iter()
                    .filter_map(Value::as_str)
                    .filter_map(|h| crate::route::host_service(h, ns))
                    .any(|s| s.namespace == ns && scope.uses(&s))
            }),
        Kind::HttpRoute | Kind::GrpcRoute | Kind::TcpRoute => refs(obj, "parentRefs")
            .into_iter()
            .any(|r| names_used_service(r, ns, scope)),
        // The root namespace's (mesh-wide), and those of namespaces with Services that
        // use the waypoint (which of them apply is decided per request); `selector` ones
        // are the workloads' proxies'.
        Kind::Telemetry => {
            obj.data.pointer("/spec/selector").is_none()
                && (ns == settings.root_namespace
                    || scope
                        .services
                        .keys()
                        .chain(scope.from_istiod.iter())
                        .any(|s| s.namespace == ns && scope.uses(s)))
        }
        Kind::AuthorizationPolicy | Kind::RequestAuthentication => {
            refs(obj, "targetRefs").into_iter().any(|r| {
                let every_waypoint = str_field(r, "kind") == Some("GatewayClass")
                    && matches!(str_field(r, "group"), None | Some(GATEWAY_GROUP))
                    && str_field(r, "name") == Some(WAYPOINT_CLASS);
                names_used_target(r, ns, scope) || (ns == settings.root_namespace && every_waypoint)
            })
        }
        _ => false,
    }
}

/// A DestinationRule with what it resolves to.
type RuleAndPolicy = (
    crate::destination::DestinationRule,
    crate::destination::Resolved,
);

/// One object converted, at the resourceVersion it was converted for.
enum Converted {
    Route(Result<HttpRoute, String>),
    Grant(Result<crate::grant::ReferenceGrant, String>),
    /// A rule that cannot be applied has the error and, when it asked for TLS origination,
    /// a stand-in that fails its host's traffic.
    Destination(Result<Box<RuleAndPolicy>, (String, Option<Box<RuleAndPolicy>>)>),
    Policy(Result<Option<AuthorizationPolicy>, String>),
    Authentication(Result<Option<RequestAuthentication>, String>),
    /// Compiled when published (what it may name depends on the mesh config).
    Telemetry(Result<crate::telemetry::Telemetry, String>),
}

fn convert(kind: Kind, obj: &DynamicObject) -> Converted {
    let (ns, name) = (
        obj.metadata.namespace.as_deref().unwrap_or_default(),
        obj.metadata.name.as_deref().unwrap_or_default(),
    );
    match kind {
        Kind::HttpRoute | Kind::GrpcRoute | Kind::TcpRoute | Kind::VirtualService => {
            let r = match kind {
                Kind::HttpRoute => route(obj),
                Kind::GrpcRoute => grpc_route(obj),
                Kind::VirtualService => virtual_service(obj),
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
                        "DestinationRule asks for TLS origination and cannot be applied; traffic to its host fails instead"),
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

type Key = (Kind, String, String);

fn key(kind: Kind, obj: &DynamicObject) -> Key {
    (
        kind,
        obj.metadata.namespace.clone().unwrap_or_default(),
        obj.metadata.name.clone().unwrap_or_default(),
    )
}

/// What the watches have seen, and what was last published.
#[derive(Default)]
struct Store {
    synced: BTreeSet<Kind>,
    buffers: BTreeMap<Kind, Vec<DynamicObject>>,
    objects: BTreeMap<Key, DynamicObject>,
    converted: HashMap<Key, (String, Converted)>,
    /// The Services istiod's state routes through this waypoint.
    from_istiod: BTreeSet<ObjectName>,
    /// The selected objects' versions and the scope, last published.
    published: Option<Vec<String>>,
    refused: Vec<String>,
    /// The apiVersion each kind is watched at (see `versions`).
    served: BTreeMap<Kind, String>,
    /// Kinds not served, or not readable: the rest is served without them.
    unavailable: BTreeMap<Kind, Unavailable>,
    /// The last failure of each kind's watch since it was last listed.
    failed: BTreeMap<Kind, String>,
}

/// What an AuthorizationPolicy or RequestAuthentication the waypoint cannot list may
/// hide is denied (`Store::unreadable`): these stand-ins, named so.
const UNREADABLE_POLICIES: &str = "authorizationpolicies-unreadable";
const UNREADABLE_AUTHENTICATIONS: &str = "requestauthentications-unreadable";

impl Store {
    fn update(&mut self, kind: Kind, update: Update, settings: &Settings) {
        let name = resource(kind).kind;
        match update {
            Update::Served(v) => {
                self.served.insert(kind, v);
            }
            Update::Event(e) => {
                if matches!(*e, Event::InitDone) {
                    let was_unavailable = self.unavailable.remove(&kind).is_some();
                    if self.failed.remove(&kind).is_some() || was_unavailable {
                        tracing::info!(kind = %name, "Kubernetes kind listed again");
                    }
                }
                self.event(kind, *e, settings)
            }
            Update::Unavailable(u) => {
                if self.unavailable.get(&kind).map(Unavailable::state) != Some(u.state()) {
                    let effect = effect_without(kind, &u, self.synced.contains(&kind));
                    let hint = matches!(u, Unavailable::Forbidden(_)).then_some(
                        "the waypoint's service account needs get/list/watch on it across namespaces (the ClusterRole of charts/waypoint)",
                    );
                    tracing::warn!(kind = %name, reason = %u, effect, hint, "Kubernetes kind unavailable; serving without it");
                }
                if matches!(u, Unavailable::NotServed(_)) {
                    // Not served: there are no such objects (a deleted CRD deletes them).
                    self.objects.retain(|k, _| k.0 != kind);
                    self.buffers.remove(&kind);
                    self.synced.remove(&kind);
                    self.served.remove(&kind);
                }
                self.unavailable.insert(kind, u);
            }
            Update::Failed(e) => {
                tracing::warn!(kind = %name, error = %e, "Kubernetes watch failed; retrying");
                self.failed.insert(kind, e);
            }
        }
    }

    /// Whether `kind` may hide objects the waypoint must enforce: it was never listed
    /// and listing it is forbidden (a kind that is not served has no objects).
    fn unreadable(&self, kind: Kind) -> bool {
        matches!(self.unavailable.get(&kind), Some(Unavailable::Forbidden(_)))
            && !self.synced.contains(&kind)
    }

    /// Each kind's watch, for the admin endpoint.
    fn watches_dump(&self) -> Value {
        let mut m = Map::new();
        for kind in KINDS {
            let mut v = json!({});
            if let Some(av) = self.served.get(&kind) {
                v["apiVersion"] = json!(av);
            }
            v["state"] = json!(
                match (self.synced.contains(&kind), self.unavailable.get(&kind)) {
                    (_, Some(u)) => u.state(),
                    (true, None) => "listed",
                    (false, None) => "waiting",
                }
            );
            if let Some(u) = self.unavailable.get(&kind) {
                v["error"] = json!(u.to_string());
                v["effect"] = json!(effect_without(kind, u, self.synced.contains(&kind)));
            } else if let Some(e) = self.failed.get(&kind) {
                v["error"] = json!(e);
            }
            m.insert(resource(kind).kind, v);
        }
        Value::Object(m)
    }

    fn event(&mut self, kind: Kind, event: Event<DynamicObject>, settings: &Settings) {
        match event {
            Event::Init => {
                self.buffers.remove(&kind);
            }
            Event::InitApply(o) => self.buffers.entry(kind).or_default().push(o),
            Event::InitDone => {
                // A (re)list replaces what we had of this kind.
                self.objects.retain(|k, _| k.0 != kind);
                for o in self.buffers.remove(&kind).unwrap_or_default() {
                    self.apply(kind, o, settings);
                }
                self.synced.insert(kind);
            }
            Event::Apply(o) => self.apply(kind, o, settings),
            Event::Delete(o) => {
                self.objects.remove(&key(kind, &o));
            }
        }
    }

    fn apply(&mut self, kind: Kind, obj: DynamicObject, settings: &Settings) {
        let k = key(kind, &obj);
        // Config of another revision is not ours (dropped if it was ours before a relabel).
        // Services, Namespaces and the mesh ConfigMap are not filtered, nor is a Gateway:
        // istiod admits a Gateway by revision or tag, and a tag is not known here.
        let config = !matches!(
            kind,
            Kind::Service | Kind::Namespace | Kind::MeshConfig | Kind::Gateway
        );
        if config && !in_revision(&obj, settings.revision.as_deref()) {
            tracing::debug!(kind = ?kind, namespace = %k.1, name = %k.2, "labelled istio.io/rev for another revision; ignored");
            self.objects.remove(&k);
            return;
        }
        if kind == Kind::Gateway
            && k.1 == settings.gateway.namespace
            && k.2 == settings.gateway.name
        {
            let class = obj
                .data
                .pointer("/spec/gatewayClassName")
                .and_then(Value::as_str)
                .unwrap_or("");
            if class == WAYPOINT_CLASS {
                tracing::info!(gateway = %k.2, "serving Gateway");
            } else {
                tracing::warn!(gateway = %k.2, class, "our Gateway's class is not istio-waypoint");
            }
        }
        self.objects.insert(k, obj);
    }

    fn scope(&self, settings: &Settings) -> Scope {
        let of_kind = |kind: Kind| self.objects.iter().filter(move |(k, _)| k.0 == kind);
        let labels = |o: &DynamicObject| o.metadata.labels.clone().unwrap_or_default();
        let gw = &settings.gateway;
        Scope {
            gateway: gw.clone(),
            allowed: self
                .objects
                .get(&(Kind::Gateway, gw.namespace.clone(), gw.name.clone()))
                .map(|o| AllowedNamespaces::from_gateway(&o.data))
                .unwrap_or_default(),
            // Namespaces are cluster-scoped: their name is the key's.
            namespaces: of_kind(Kind::Namespace)
                .map(|(k, o)| (k.2.clone(), labels(o)))
                .collect(),
            services: of_kind(Kind::Service)
                .map(|(k, o)| {
                    (
                        ObjectName {
                            namespace: k.1.clone(),
                            name: k.2.clone(),
                        },
                        labels(o),
                    )
                })
                .collect(),
            from_istiod: self.from_istiod.clone(),
        }
    }

    /// The converted config, once every kind is listed and when it differs from what
    /// was published last.
    fn publish(&mut self, settings: &Settings) -> Option<L7Config> {
        if !KINDS.iter().all(|k| {
            *k == Kind::MeshConfig || self.synced.contains(k) || self.unavailable.contains_key(k)
        }) {
            return None;
        }
        let scope = self.scope(settings);
        let mut scope_dump = scope.dump();
        scope_dump["rootNamespace"] = json!(settings.root_namespace);
        let taken: Vec<(&Key, &DynamicObject)> = self
            .objects
            .iter()
            .filter(|(k, obj)| {
                matches!(
                    k.0,
                    Kind::HttpRoute
                        | Kind::GrpcRoute
                        | Kind::TcpRoute
                        | Kind::ReferenceGrant
                        | Kind::DestinationRule
                        | Kind::VirtualService
                        | Kind::AuthorizationPolicy
                        | Kind::RequestAuthentication
                        | Kind::Telemetry
                ) && selected(k.0, obj, &scope, settings)
            })
            .collect();
        // Unchanged selection, versions and scope: nothing to convert or publish.
        let version =
            |obj: &DynamicObject| obj.metadata.resource_version.clone().unwrap_or_default();
        let mesh = self.objects.get(&(
            Kind::MeshConfig,
            settings.root_namespace.clone(),
            settings.mesh_config_map.clone(),
        ));
        let watches = self.watches_dump();
        let mut fingerprint = vec![
            scope_dump.to_string(),
            mesh.map(version).unwrap_or_default(),
            watches.to_string(),
        ];
        fingerprint.extend(
            taken
                .iter()
                .map(|(k, obj)| format!("{:?} {}/{} {}", k.0, k.1, k.2, version(obj))),
        );
        if self.published.as_ref() == Some(&fingerprint) {
            return None;
        }
        let mut cfg = L7Config::default();
        let (providers, providers_dump) = mesh_providers(mesh, settings);
        cfg.providers = providers;
        cfg.tracing = mesh_tracing(mesh);
        let mesh_value = mesh
            .and_then(|m| m.data.pointer("/data/mesh"))
            .and_then(Value::as_str)
            .and_then(|t| serde_yaml::from_str::<Value>(t).ok());
        let mesh_providers = crate::telemetry::MeshProviders::from_mesh(
            mesh_value.as_ref(),
            cfg.tracing.as_ref().map(|t| t.provider.as_str()),
        );
        // Principals follow meshConfig.trustDomain and its aliases, as istiod writes them.
        let trust_domains = mesh_value
            .clone()
            .and_then(|v| serde_json::from_value::<crate::extauthz::MeshConfig>(v).ok())
            .unwrap_or_default()
            .trust_domain_bundle();
        let (mut telemetries, mut telemetries_read) = (Vec::new(), Vec::new());
        let (mut routes, mut policies, mut authns, mut rejected) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut grpc_routes, mut tcp_routes, mut grants, mut destination_rules) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut virtual_services = Vec::new();
        for (k, obj) in &taken {
            let rv = version(obj);
            if !matches!(self.converted.get(*k), Some((v, _)) if *v == rv) {
                self.converted.insert((*k).clone(), (rv, convert(k.0, obj)));
            }
            let Some((_, converted)) = self.converted.get(*k) else {
                continue;
            };
            let as_read = Value::Object(flattened(obj).unwrap_or_default());
            match converted {
                Converted::Route(Ok(r)) => match k.0 {
                    Kind::TcpRoute => {
                        cfg.tcp_routes.push(r.clone());
                        tcp_routes.push(as_read);
                    }
                    Kind::GrpcRoute => {
                        cfg.routes.push(r.clone());
                        grpc_routes.push(as_read);
                    }
                    Kind::VirtualService => {
                        cfg.routes.push(r.clone());
                        virtual_services.push(as_read);
                    }
                    _ => {
                        cfg.routes.push(r.clone());
                        routes.push(as_read);
                    }
                },
                Converted::Route(Err(e)) => rejected.push(json!({"kind": route_kind_name(k.0), "namespace": k.1, "name": k.2, "error": e})),
                Converted::Grant(Ok(g)) => {
                    cfg.grants.push(g.clone());
                    grants.push(as_read);
                }
                Converted::Grant(Err(e)) => rejected.push(json!({"kind": "ReferenceGrant", "namespace": k.1, "name": k.2, "error": e})),
                Converted::Destination(Ok(d)) => {
                    cfg.destination_rules.push((**d).clone());
                    destination_rules.push(as_read);
                }
                Converted::Destination(Err((e, stand_in))) => {
                    if let Some(d) = stand_in {
                        cfg.destination_rules.push((**d).clone());
                        cfg.unenforceable += 1;
                    }
                    let effect = if stand_in.is_some() { "traffic to its host fails (it asked for TLS origination)" } else { "does not apply" };
                    rejected.push(json!({"kind": "DestinationRule", "namespace": k.1, "name": k.2, "error": e, "effect": effect}));
                }
                Converted::Policy(Ok(Some(p))) => {
                    let mut p = p.clone();
                    trust_domains.apply(&mut p);
                    cfg.policies.push(p);
                    policies.push(as_read);
                }
                Converted::Policy(Ok(None)) | Converted::Authentication(Ok(None)) => {}
                Converted::Authentication(Ok(Some(a))) => {
                    cfg.authentications.push(a.clone());
                    authns.push(as_read);
                }
                Converted::Authentication(Err(e)) => {
                    let a = reject_all(obj);
                    cfg.authentications.push(a);
                    cfg.unenforceable += 1;
                    let mut v = as_read;
                    v["unenforceable"] = json!(e);
                    authns.push(v);
                }
                Converted::Telemetry(t) => match t.as_ref().map_err(Clone::clone).and_then(|t| t.compile(&mesh_providers)) {
                    Ok(c) => {
                        telemetries.push(c);
                        telemetries_read.push(as_read);
                    }
                    Err(e) => {
                        // Not a security policy: left out, as a route that does not convert.
                        tracing::warn!(kind = "Telemetry", namespace = %k.1, name = %k.2, error = %e, "object rejected; it does not apply");
                        rejected.push(json!({"kind": "Telemetry", "namespace": k.1, "name": k.2, "error": e}));
                    }
                },
                Converted::Policy(Err(e)) => {
                    cfg.policies.push(deny_all(obj));
                    cfg.unenforceable += 1;
                    let mut v = as_read;
                    v["unenforceable"] = json!(e);
                    policies.push(v);
                }
            }
        }
        // A kind that may hide a policy is not taken as empty: everything the waypoint
        // serves is denied (AuthorizationPolicy), every token refused
        // (RequestAuthentication), until it can be listed.
        if self.unreadable(Kind::AuthorizationPolicy) {
            cfg.policies.push(AuthorizationPolicy::deny_all(
                &settings.root_namespace,
                UNREADABLE_POLICIES,
                &[],
            ));
            cfg.unenforceable += 1;
            policies.push(json!({"namespace": settings.root_namespace, "name": UNREADABLE_POLICIES,
                "unenforceable": "AuthorizationPolicies cannot be listed (forbidden): every request to this waypoint is denied"}));
        }
        if self.unreadable(Kind::RequestAuthentication) {
            cfg.authentications.push(RequestAuthentication::reject_all(
                &settings.root_namespace,
                UNREADABLE_AUTHENTICATIONS,
                &[],
            ));
            cfg.unenforceable += 1;
            authns.push(json!({"namespace": settings.root_namespace, "name": UNREADABLE_AUTHENTICATIONS,
                "unenforceable": "RequestAuthentications cannot be listed (forbidden): every token is refused"}));
        }
        let keep: BTreeSet<&Key> = taken.iter().map(|(k, _)| *k).collect();
        self.converted.retain(|k, _| keep.contains(k));
        self.published = Some(fingerprint);
        let refused = scope.refused();
        if !refused.is_empty() && refused != self.refused {
            tracing::warn!(gateway = %format!("{}/{}", scope.gateway.namespace, scope.gateway.name), allowed = ?scope.allowed, refused = %refused.join(","),
                "labels ask for this waypoint from namespaces its Gateway does not admit (allowedRoutes.namespaces of the HBONE listener); istiod does not attach them either");
        }
        self.refused = refused;
        cfg.telemetry = Arc::new(crate::telemetry::Telemetries::new(
            telemetries,
            mesh_providers,
        ));
        cfg.dump = Arc::new(json!({
            "source": "kubernetes",
            "httpRoutes": routes,
            "grpcRoutes": grpc_routes,
            "tcpRoutes": tcp_routes,
            "referenceGrants": grants,
            "destinationRules": destination_rules,
            "virtualServices": virtual_services,
            "authorizationPolicies": policies,
            "requestAuthentications": authns,
            "telemetries": telemetries_read,
            "rejected": rejected,
            "scope": scope_dump,
            "extensionProviders": providers_dump,
            "kubernetes": watches,
        }));
        Some(cfg)
    }
}

/// What serving without `kind` means (logged, and in the admin endpoint).
fn effect_without(kind: Kind, u: &Unavailable, listed_before: bool) -> &'static str {
    let forbidden = matches!(u, Unavailable::Forbidden(_));
    match kind {
        _ if forbidden && listed_before => "the objects listed before are kept until it can be listed again",
        Kind::AuthorizationPolicy if forbidden => {
            "fail closed: every request to this waypoint is denied until AuthorizationPolicies can be listed"
        }
        Kind::RequestAuthentication if forbidden => {
            "fail closed: every request token is refused until RequestAuthentications can be listed"
        }
        Kind::MeshConfig => "no mesh config: CUSTOM policies deny what they match, no tracing",
        _ if forbidden => "served without it: objects of this kind may exist and are not applied",
        _ => "served without it: there can be no objects of this kind",
    }
}

/// The extensionProviders of the mesh config's ConfigMap (key `mesh`, Istio's MeshConfig
/// YAML), each checked, and what the admin endpoint shows of them. A ConfigMap that
/// does not parse gives none, so every CUSTOM policy denies what it matches.
/// The mesh config's tracing (off when there is none, or it is invalid: logged).
fn mesh_tracing(obj: Option<&DynamicObject>) -> Option<Arc<crate::trace::TraceSettings>> {
    let text = obj?.data.pointer("/data/mesh").and_then(Value::as_str)?;
    let mesh: Value = serde_yaml::from_str(text).ok()?;
    match crate::trace::settings(&mesh) {
        Ok(t) => t.map(Arc::new),
        Err(e) => {
            tracing::error!(error = %e, "mesh config tracing is invalid; requests are not traced");
            None
        }
    }
}

fn mesh_providers(
    obj: Option<&DynamicObject>,
    settings: &Settings,
) -> (crate::extauthz::Providers, Value) {
    let source = format!(
        "ConfigMap {}/{} key mesh",
        settings.root_namespace, settings.mesh_config_map
    );
    let Some(obj) = obj else {
        return (
            Default::default(),
            json!({"source": source, "error": "not found (or not readable): CUSTOM policies deny what they match"}),
        );
    };
    let text = obj
        .data
        .pointer("/data/mesh")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let parsed = serde_yaml::from_str::<Option<crate::extauthz::MeshConfig>>(text)
        .map_err(|e| e.to_string())
        .and_then(|m| {
            crate::extauthz::provider::parse_all(&m.unwrap_or_default().extension_providers)
        });
    match parsed {
        Ok(providers) => {
            let dump: Map<String, Value> = providers
                .iter()
                .map(|(name, p)| {
                    (
                        name.clone(),
                        match p {
                            Ok(p) => json!({"kind": p.kind()}),
                            Err(e) => json!({"error": e}),
                        },
                    )
                })
                .collect();
            for (name, e) in providers
                .iter()
                .filter_map(|(n, p)| Some((n, p.as_ref().err()?)))
            {
                tracing::error!(provider = %name, error = %e, source = %source, "extensionProvider is invalid; CUSTOM policies naming it deny what they match");
            }
            (
                Arc::new(providers),
                json!({"source": source, "providers": dump}),
            )
        }
        Err(e) => {
            tracing::error!(error = %e, source = %source, "mesh config does not parse; CUSTOM policies deny what they match");
            (Default::default(), json!({"source": source, "error": e}))
        }
    }
}

/// The Services whose waypoint (or one of whose weighted waypoints), in istiod's state,
/// is this one (by identity, as the tunnel checks it).
pub fn services_from_istiod(state: &MeshState, me: &Identity) -> BTreeSet<ObjectName> {
    state
        .services()
        .filter(|s| s.waypoints().any(|gw| state.is_waypoint(gw, me)))
        .map(|s| ObjectName {
            namespace: s.namespace.clone(),
            name: s.name.clone(),
        })
        .collect()
}

/// The versions of `kind` the waypoint can read, in the order it prefers them: the first
/// one the API server serves is watched (as Istio does, which reads TCPRoute at `v1`;
/// Gateway API v1.6.0's standard channel no longer serves `v1alpha2`).
fn versions(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::TcpRoute => &["v1", "v1alpha2"],
        Kind::ReferenceGrant => &["v1beta1", "v1"],
        _ => &[],
    }
}

/// Why a kind is not watched; the rest is served without it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
enum Unavailable {
    /// The API server does not serve it (its CRD is not installed, or not at a version
    /// the waypoint reads): there can be no such objects.
    #[error("not served by the API server ({0})")]
    NotServed(String),
    /// The waypoint's service account may not list it: there may be objects it cannot see.
    #[error("forbidden ({0})")]
    Forbidden(String),
}

impl Unavailable {
    fn state(&self) -> &'static str {
        match self {
            Unavailable::NotServed(_) => "notServed",
            Unavailable::Forbidden(_) => "forbidden",
        }
    }
}

/// What a kind's watch reports.
enum Update {
    /// Watching it at this apiVersion.
    Served(String),
    Event(Box<Event<DynamicObject>>),
    Unavailable(Unavailable),
    /// Any other failure (the API server unreachable, a 5xx): retried; until the kind is
    /// first listed, the waypoint waits for it.
    Failed(String),
}

/// The HTTP status of an API error, if the server answered.
fn status_code(e: &kube::Error) -> Option<u16> {
    match e {
        kube::Error::Api(s) => Some(s.code),
        _ => None,
    }
}

fn watch_status(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => status_code(e),
        watcher::Error::WatchError(s) => Some(s.code),
        watcher::Error::NoResourceVersion => None,
    }
}

/// The resource to watch for `kind`: the first of its versions the server serves.
async fn discover(client: &kube::Client, kind: Kind) -> Result<ApiResource, Update> {
    let base = resource(kind);
    let candidates = versions(kind);
    if candidates.is_empty() && base.group.is_empty() {
        return Ok(base);
    }
    let candidates: Vec<&str> = if candidates.is_empty() {
        vec![base.version.as_str()]
    } else {
        candidates.to_vec()
    };
    for v in &candidates {
        let api_version = format!("{}/{v}", base.group);
        match client.list_api_group_resources(&api_version).await {
            Ok(list) if list.resources.iter().any(|r| r.name == base.plural) => {
                return Ok(ApiResource {
                    version: (*v).to_string(),
                    api_version,
                    ..base
                });
            }
            Ok(_) => {}
            Err(e) if status_code(&e) == Some(404) => {}
            Err(e) if status_code(&e) == Some(403) => {
                return Err(Update::Unavailable(Unavailable::Forbidden(e.to_string())))
            }
            Err(e) => return Err(Update::Failed(e.to_string())),
        }
    }
    Err(Update::Unavailable(Unavailable::NotServed(format!(
        "{} at {}/{}",
        base.plural,
        base.group,
        candidates.join(", ")
    ))))
}

fn api_and_config(
    client: &kube::Client,
    kind: Kind,
    ar: &ApiResource,
    settings: &Settings,
) -> (kube::Api<DynamicObject>, watcher::Config) {
    match kind {
        // Only our own Gateway matters: its namespace's.
        Kind::Gateway => (
            kube::Api::namespaced_with(client.clone(), &settings.gateway.namespace, ar),
            watcher::Config::default(),
        ),
        // Only Services with the label can differ from their namespace.
        Kind::Service => (
            kube::Api::all_with(client.clone(), ar),
            watcher::Config::default().labels(USE_WAYPOINT),
        ),
        // One ConfigMap, by name (RBAC grants that one only).
        Kind::MeshConfig => (
            kube::Api::namespaced_with(client.clone(), &settings.root_namespace, ar),
            watcher::Config::default()
                .fields(&format!("metadata.name={}", settings.mesh_config_map)),
        ),
        _ => (
            kube::Api::all_with(client.clone(), ar),
            watcher::Config::default(),
        ),
    }
}

/// Watches one kind and reports to `tx` until the receiver is gone: finds the version
/// the server serves, lists and watches it; a kind not served or forbidden is reported
/// and looked for again with backoff (a CRD installed later, RBAC granted later, is
/// picked up), as is a watch that fails.
async fn watch_kind(
    client: kube::Client,
    kind: Kind,
    settings: Settings,
    tx: tokio::sync::mpsc::Sender<(Kind, Update)>,
) {
    const FIRST: std::time::Duration = std::time::Duration::from_millis(500);
    const MAX: std::time::Duration = std::time::Duration::from_secs(10);
    let mut delay = FIRST;
    loop {
        let ar = match discover(&client, kind).await {
            Ok(ar) => ar,
            Err(u) => {
                if tx.send((kind, u)).await.is_err() {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX);
                continue;
            }
        };
        if tx
            .send((kind, Update::Served(ar.api_version.clone())))
            .await
            .is_err()
        {
            return;
        }
        let (api, config) = api_and_config(&client, kind, &ar, &settings);
        let mut events = watcher::watcher(api, config).boxed();
        while let Some(e) = events.next().await {
            let update = match e {
                Ok(ev) => {
                    delay = FIRST;
                    Update::Event(Box::new(ev))
                }
                Err(e) => match watch_status(&e) {
                    Some(404) => Update::Unavailable(Unavailable::NotServed(e.to_string())),
                    Some(403) => Update::Unavailable(Unavailable::Forbidden(e.to_string())),
                    _ => Update::Failed(e.to_string()),
                },
            };
            let failed = !matches!(update, Update::Event(_));
            let gone = matches!(update, Update::Unavailable(Unavailable::NotServed(_)));
            if tx.send((kind, update)).await.is_err() {
                return;
            }
            if failed {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX);
            }
            // Its CRD was removed (or its version no longer served): find it again.
            if gone {
                break;
            }
        }
    }
}

/// Watches the Kubernetes API (and istiod's state, for which Services use the waypoint)
/// and publishes the converted config each time it changes, once every kind has been
/// listed or found unavailable (not served, or forbidden: the rest is served without
/// it, with a warning naming it). Runs until the process ends.
pub async fn watch(
    client: kube::Client,
    settings: Settings,
    state: Arc<SharedState>,
    out: watch::Sender<Option<Arc<L7Config>>>,
    metrics: XdsMetrics,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    for kind in KINDS {
        tokio::spawn(watch_kind(
            client.clone(),
            kind,
            settings.clone(),
            tx.clone(),
        ));
    }
    drop(tx);
    let mut changes = state.changes();
    let mut store = Store {
        from_istiod: services_from_istiod(&state.load_full(), &settings.identity),
        ..Store::default()
    };
    loop {
        tokio::select! {
            e = rx.recv() => match e {
                None => return,
                Some((kind, update)) => store.update(kind, update, &settings),
            },
            r = changes.changed() => {
                if r.is_err() {
                    return;
                }
                let now = services_from_istiod(&state.load_full(), &settings.identity);
                if now == store.from_istiod {
                    continue;
                }
                store.from_istiod = now;
            }
        }
        if let Some(cfg) = store.publish(&settings) {
            metrics.set_unenforceable("kubernetes", cfg.unenforceable);
            tracing::info!(routes = cfg.routes.len(), policies = cfg.policies.len(), unenforceable = cfg.unenforceable,
                namespaces = %namespaces(&cfg).join(","), "L7 config from Kubernetes");
            out.send_replace(Some(Arc::new(cfg)));
        }
    }
}

/// Keeps `labels` equal to the Pods' labels (by workload uid, `<cluster>//Pod/<ns>/<name>`,
/// as istiod names pod workloads), for DestinationRule subsets. Metadata only, and only
/// the labels are kept. Runs until the process ends (retrying with backoff).
pub async fn watch_pod_labels(
    client: kube::Client,
    cluster_id: String,
    labels: Arc<crate::labels::Labels>,
) {
    use k8s_openapi::api::core::v1::Pod;
    // Metadata-only requests: a Pod's spec and status never reach the waypoint.
    let api = kube::Api::<kube::core::PartialObjectMeta<Pod>>::all(client);
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    let uid = |m: &kube::api::ObjectMeta| {
        ztunnel::state::WorkloadUid(format!(
            "{cluster_id}//Pod/{}/{}",
            m.namespace.as_deref().unwrap_or_default(),
            m.name.as_deref().unwrap_or_default()
        ))
    };
    let mut relist = HashMap::new();
    while let Some(e) = events.next().await {
        match e {
            Err(e) => {
                tracing::warn!(kind = "Pod", error = %e, hint = "DestinationRule subsets need list/watch on pods (the ClusterRole of charts/waypoint)",
                "Kubernetes watch failed; retrying")
            }
            Ok(Event::Init) => relist.clear(),
            Ok(Event::InitApply(p)) => {
                relist.insert(
                    uid(&p.metadata),
                    Arc::new(p.metadata.labels.unwrap_or_default()),
                );
            }
            Ok(Event::InitDone) => {
                labels.replace(std::mem::take(&mut relist));
                tracing::debug!(pods = labels.len(), "pod labels listed");
            }
            Ok(Event::Apply(p)) => {
                labels.set(uid(&p.metadata), p.metadata.labels.unwrap_or_default())
            }
            Ok(Event::Delete(p)) => labels.remove(&uid(&p.metadata)),
        }
    }
}

/// The namespaces the config's objects come from, for the log.
fn namespaces(cfg: &L7Config) -> Vec<String> {
    let ns = cfg
        .routes
        .iter()
        .map(|r| r.namespace.clone())
        .chain(cfg.policies.iter().map(|p| p.namespace.clone()));
    ns.collect::<BTreeSet<_>>().into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::authz;
    use crate::object::{ServiceKind, Target};

    fn object_in(ns: &str, kind: &str, name: &str, spec: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "x/v1", "kind": kind,
            "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
            "spec": spec,
        }))
        .unwrap()
    }

    fn object(kind: &str, name: &str, spec: Value) -> DynamicObject {
        object_in("default", kind, name, spec)
    }

    /// A Namespace or Service with labels.
    fn labelled(ns: Option<&str>, name: &str, labels: &[(&str, &str)]) -> DynamicObject {
        let labels: Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        let mut meta = json!({"name": name, "resourceVersion": "1", "labels": labels});
        if let Some(ns) = ns {
            meta["namespace"] = json!(ns);
        }
        serde_json::from_value(json!({"apiVersion": "v1", "kind": "X", "metadata": meta})).unwrap()
    }

    fn settings() -> Settings {
        Settings {
            gateway: ObjectName {
                namespace: "default".into(),
                name: "waypoint".into(),
            },
            root_namespace: "istio-system".into(),
            identity: Identity::new("cluster.local", "default", "waypoint"),
            mesh_config_map: "istio".into(),
            revision: None,
        }
    }

    /// A store with every kind listed and `objects` in it.
    fn store(objects: Vec<(Kind, DynamicObject)>) -> Store {
        let mut s = Store::default();
        let settings = settings();
        for kind in KINDS {
            s.event(kind, Event::Init, &settings);
            for (_, o) in objects.iter().filter(|(k, _)| *k == kind) {
                s.event(kind, Event::InitApply(o.clone()), &settings);
            }
            s.event(kind, Event::InitDone, &settings);
        }
        s
    }

    /// Istio's `istio` ConfigMap in the root namespace gives the extensionProviders;
    /// without it the config still publishes and CUSTOM has no provider (denies).
    #[test]
    fn extension_providers_come_from_the_mesh_config_map() {
        let mesh = "defaultConfig: {discoveryAddress: istiod.istio-system.svc:15012}\nextensionProviders:\n\
                    - {name: authz, envoyExtAuthzGrpc: {service: authz.default.svc.cluster.local, port: 9000}}\n\
                    - {name: broken, envoyExtAuthzHttp: {service: x, port: 0}}\n";
        let cm: DynamicObject = serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "istio", "namespace": "istio-system", "resourceVersion": "7"}, "data": {"mesh": mesh}})).unwrap();
        let cfg = store(vec![(Kind::MeshConfig, cm)])
            .publish(&settings())
            .unwrap();
        assert!(
            matches!(
                cfg.providers.get("authz"),
                Some(Ok(crate::extauthz::Provider::Grpc(_)))
            ),
            "{:?}",
            cfg.providers
        );
        assert!(cfg.providers["broken"].is_err());
        assert_eq!(
            cfg.dump["extensionProviders"]["providers"]["authz"]["kind"],
            "envoyExtAuthzGrpc"
        );
        assert!(
            cfg.dump["extensionProviders"]["providers"]["broken"]["error"].is_string(),
            "{}",
            cfg.dump
        );
        // The ConfigMap is not waited for.
        let mut s = Store::default();
        for kind in KINDS.into_iter().filter(|k| *k != Kind::MeshConfig) {
            s.event(kind, Event::Init, &settings());
            s.event(kind, Event::InitDone, &settings());
        }
        let cfg = s
            .publish(&settings())
            .expect("published without the mesh config");
        assert!(cfg.providers.is_empty());
        assert!(cfg.dump["extensionProviders"]["error"]
            .as_str()
            .unwrap_or_default()
            .contains("not found"));
    }

    /// The mesh ConfigMap's trustDomainAliases rewrite policies' principals, as istiod
    /// writes them for Istio's waypoint.
    #[test]
    fn policy_principals_follow_the_mesh_config_trust_domain_aliases() {
        let mesh = "trustDomain: new-td\ntrustDomainAliases: [old-td]\n";
        let cm: DynamicObject = serde_json::from_value(json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "istio", "namespace": "istio-system", "resourceVersion": "7"}, "data": {"mesh": mesh}})).unwrap();
        let p = object(
            "AuthorizationPolicy",
            "p",
            json!({"targetRefs": [{"group": "", "kind": "Service", "name": "web"}], "action": "ALLOW",
                   "rules": [{"from": [{"source": {"principals": ["old-td/ns/a/sa/b", "other/ns/a/sa/b"]}}]}]}),
        );
        let cfg = store(vec![(Kind::MeshConfig, cm), (Kind::AuthorizationPolicy, p)])
            .publish(&settings())
            .unwrap();
        assert_eq!(
            cfg.policies[0].rules[0].from[0].source.principals,
            ["new-td/ns/a/sa/b", "old-td/ns/a/sa/b", "other/ns/a/sa/b"]
        );
    }

    /// With a revision, config labelled `istio.io/rev` for another revision is ignored
    /// (and dropped when relabelled away); unlabelled config applies; without one, all of
    /// it applies (Istio's `LabelsInRevision`).
    #[test]
    fn config_of_another_revision_is_ignored() {
        let policy = |name: &str, rev: Option<&str>| {
            let mut o = object(
                "AuthorizationPolicy",
                name,
                json!({"targetRefs": [{"group": "", "kind": "Service", "name": "web"}], "action": "DENY", "rules": [{}]}),
            );
            if let Some(r) = rev {
                o.metadata.labels = Some([(REV_LABEL.to_string(), r.to_string())].into());
            }
            o
        };
        let names = |settings: &Settings, objects: Vec<DynamicObject>| {
            let mut s = Store::default();
            for kind in KINDS {
                s.event(kind, Event::Init, settings);
                if kind == Kind::AuthorizationPolicy {
                    for o in &objects {
                        s.event(kind, Event::InitApply(o.clone()), settings);
                    }
                }
                s.event(kind, Event::InitDone, settings);
            }
            let cfg = s.publish(settings).unwrap();
            let mut n: Vec<String> = cfg.policies.iter().map(|p| p.name.clone()).collect();
            n.sort();
            (s, n)
        };
        let objects = vec![
            policy("global", None),
            policy("mine", Some("canary")),
            policy("theirs", Some("stable")),
        ];
        let canary = Settings {
            revision: Some("canary".into()),
            ..settings()
        };
        let (mut s, got) = names(&canary, objects.clone());
        assert_eq!(got, ["global", "mine"]);
        // Relabelled to another revision: gone.
        s.event(
            Kind::AuthorizationPolicy,
            Event::Apply(policy("mine", Some("stable"))),
            &canary,
        );
        let cfg = s.publish(&canary).unwrap();
        assert_eq!(
            cfg.policies
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>(),
            ["global"]
        );
        // No revision: everything.
        assert_eq!(names(&settings(), objects).1, ["global", "mine", "theirs"]);
    }

    /// DestinationRules, GRPCRoutes, TCPRoutes and ReferenceGrants from the API, each as
    /// the file writes it; a broken DestinationRule is rejected and named.
    #[test]
    fn traffic_objects_convert_from_kubernetes() {
        let svc = json!([{"group": "", "kind": "Service", "name": "echo"}]);
        let objs = vec![
            (
                Kind::DestinationRule,
                object(
                    "DestinationRule",
                    "dr",
                    json!({"host": "echo", "trafficPolicy": {"loadBalancer": {"simple": "RANDOM"}}}),
                ),
            ),
            (
                Kind::DestinationRule,
                object(
                    "DestinationRule",
                    "bad",
                    json!({"host": "echo", "trafficPolicy": {"loadBalancer": {"simple": "PASSTHROUGH"}}}),
                ),
            ),
            (
                Kind::DestinationRule,
                object(
                    "DestinationRule",
                    "sidecar",
                    json!({"host": "echo", "workloadSelector": {"matchLabels": {"app": "x"}}}),
                ),
            ),
            // Asks for TLS origination and cannot have it: its host's traffic fails instead.
            (
                Kind::DestinationRule,
                object(
                    "DestinationRule",
                    "tls",
                    json!({"host": "api.example.com", "trafficPolicy": {"portLevelSettings": [
                {"port": {"number": 443}, "tls": {"mode": "SIMPLE", "credentialName": "egress-ca"}}]}}),
                ),
            ),
            (
                Kind::GrpcRoute,
                object(
                    "GRPCRoute",
                    "g",
                    json!({"parentRefs": svc, "rules": [{"matches": [{"method": {"service": "a.B"}}]}]}),
                ),
            ),
            (
                Kind::TcpRoute,
                object(
                    "TCPRoute",
                    "t",
                    json!({"parentRefs": svc, "rules": [{"backendRefs": [{"name": "echo", "port": 9000}]}]}),
                ),
            ),
            (
                Kind::ReferenceGrant,
                object_in(
                    "shop",
                    "ReferenceGrant",
                    "rg",
                    json!({"from": [{"group": GATEWAY_GROUP, "kind": "HTTPRoute", "namespace": "default"}], "to": [{"group": "", "kind": "Service"}]}),
                ),
            ),
        ];
        let cfg = store(objs).publish(&settings()).unwrap();
        assert_eq!(
            cfg.destination_rules
                .iter()
                .map(|(d, _)| d.name.as_str())
                .collect::<Vec<_>>(),
            ["dr", "tls"]
        );
        assert_eq!(
            cfg.destination_rules[0]
                .1
                .policies()
                .next()
                .and_then(|p| p.pick.clone()),
            Some(crate::destination::Pick::Random)
        );
        let refused = cfg.destination_rules[1]
            .1
            .policy(None, 443)
            .and_then(|p| p.refused.clone())
            .unwrap_or_default();
        assert!(refused.contains("credentialName"), "{refused}");
        assert_eq!(cfg.destination_rules[1].0.host, "api.example.com");
        assert_eq!(cfg.unenforceable, 1);
        let rejected = cfg.dump["rejected"].as_array().unwrap();
        assert!(
            rejected.iter().any(|r| r["kind"] == "DestinationRule"
                && r["name"] == "bad"
                && r["effect"] == "does not apply"),
            "{}",
            cfg.dump
        );
        assert!(
            rejected.iter().any(|r| r["name"] == "tls"
                && r["effect"].as_str().unwrap_or_default().contains("fails")),
            "{}",
            cfg.dump
        );
        assert_eq!(
            (cfg.routes.len(), cfg.tcp_routes.len(), cfg.grants.len()),
            (1, 1, 1)
        );
        assert_eq!(cfg.routes[0].kind, crate::route::RouteKind::Grpc);
    }

    /// A VirtualService of a Service's namespace applies only when exported to the
    /// waypoint's namespace, as in Istio's waypoint scope; DestinationRules of every
    /// namespace are read (the lookup decides which one applies).
    #[test]
    fn virtual_services_honour_export_to() {
        let vs = |name: &str, export: Value| {
            object_in(
                "shop",
                "VirtualService",
                name,
                json!({"hosts": ["cart"], "exportTo": export,
                "http": [{"route": [{"destination": {"host": "cart"}}]}]}),
            )
        };
        let mut s = store(vec![
            (Kind::VirtualService, vs("private", json!(["."]))),
            (Kind::VirtualService, vs("elsewhere", json!(["blog"]))),
            (Kind::VirtualService, vs("to-us", json!(["default"]))),
            (Kind::VirtualService, vs("everyone", json!(["*"]))),
            (Kind::VirtualService, vs("unset", json!([]))),
            (
                Kind::VirtualService,
                object(
                    "VirtualService",
                    "own-hidden",
                    json!({"hosts": ["echo"], "exportTo": ["blog"],
                "http": [{"route": [{"destination": {"host": "echo"}}]}]}),
                ),
            ),
        ]);
        s.from_istiod.insert(ObjectName {
            namespace: "shop".into(),
            name: "cart".into(),
        });
        let cfg = s.publish(&settings()).unwrap();
        let mut names: Vec<&str> = cfg.dump["virtualServices"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        names.sort_unstable();
        assert_eq!(names, ["everyone", "to-us", "unset"], "{}", cfg.dump);
    }

    #[test]
    fn routes_convert_from_kubernetes_objects() {
        // As the API server stores it, with Gateway API's defaults filled in.
        let r = route(&object("HTTPRoute", "echo", json!({
            "parentRefs": [{"group": "", "kind": "Service", "name": "echo", "port": 80}],
            "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                       "backendRefs": [{"group": "", "kind": "Service", "name": "echo-v1", "port": 80, "weight": 1}]}]
        })))
        .unwrap();
        assert_eq!((r.name.as_str(), r.namespace.as_str()), ("echo", "default"));
        let bad = route(&object(
            "HTTPRoute",
            "bad",
            json!({"parentRefs": [{"kind": "Service", "group": "", "name": "e"}], "rules": [{"backendRefs": [{"name": "x"}]}]}),
        ));
        assert!(bad.unwrap_err().contains("port"));
    }

    #[test]
    fn policies_for_the_waypoint_only() {
        let p = policy(&object(
            "AuthorizationPolicy",
            "deny",
            json!({
                "targetRef": {"group": "", "kind": "Service", "name": "echo"},
                "action": "DENY",
                "rules": [{"to": [{"operation": {"methods": ["DELETE"]}}]}]
            }),
        ))
        .unwrap()
        .unwrap();
        assert_eq!(p.target_refs.len(), 1);
        let sidecar = policy(&object(
            "AuthorizationPolicy",
            "s",
            json!({"selector": {"matchLabels": {"app": "x"}}, "action": "DENY", "rules": [{}]}),
        ));
        assert!(
            sidecar.unwrap().is_none(),
            "selector policies are not the waypoint's"
        );
        let custom = policy(&object(
            "AuthorizationPolicy",
            "c",
            json!({"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "waypoint"}], "action": "CUSTOM", "provider": {"name": "x"}}),
        ));
        assert_eq!(
            custom.unwrap().unwrap().provider.map(|p| p.name).as_deref(),
            Some("x")
        );
        let no_provider = policy(&object(
            "AuthorizationPolicy",
            "c",
            json!({"targetRefs": [{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "waypoint"}], "action": "CUSTOM"}),
        ));
        assert!(no_provider.is_err());
    }

    #[test]
    fn request_authentications_convert_and_a_broken_one_refuses_tokens() {
        let jwks = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;
        let good = object(
            "RequestAuthentication",
            "jwt",
            json!({
            "targetRef": {"group": "", "kind": "Service", "name": "echo"},
            "jwtRules": [{"issuer": "iss", "jwks": jwks, "fromHeaders": [{"name": "x-jwt"}]}]}),
        );
        let a = authentication(&good).unwrap().unwrap();
        assert_eq!(
            (
                a.target_refs.len(),
                a.jwt_rules[0].from_headers[0].name.as_str()
            ),
            (1, "x-jwt")
        );
        let sidecar = object(
            "RequestAuthentication",
            "s",
            json!({"selector": {"matchLabels": {"app": "x"}}, "jwtRules": [{"issuer": "i", "jwks": jwks}]}),
        );
        assert!(authentication(&sidecar).unwrap().is_none());
        let broken = object(
            "RequestAuthentication",
            "broken",
            json!({
            "targetRefs": [{"group": "", "kind": "Service", "name": "other"}], "jwtRules": [{"issuer": "i", "jwksUri": "ftp://x"}]}),
        );
        let cfg = store(vec![
            (Kind::RequestAuthentication, good),
            (Kind::RequestAuthentication, broken),
        ])
        .publish(&settings())
        .unwrap();
        assert_eq!((cfg.authentications.len(), cfg.unenforceable), (2, 1));
        let stand_in = cfg
            .authentications
            .iter()
            .find(|a| a.name == "broken")
            .unwrap();
        assert!(stand_in.reject_tokens && stand_in.jwt_rules.is_empty());
        assert_eq!(stand_in.target_refs[0].name, "other");
        assert!(
            cfg.dump["requestAuthentications"][0]["unenforceable"].is_string(),
            "{}",
            cfg.dump
        );
    }

    fn verdict(cfg: &L7Config, service: Option<(&str, &str)>) -> authz::Verdict {
        verdict_kind(cfg, service, ServiceKind::Kubernetes)
    }

    fn verdict_kind(
        cfg: &L7Config,
        service: Option<(&str, &str)>,
        service_kind: ServiceKind,
    ) -> authz::Verdict {
        let gateway = ObjectName {
            namespace: "default".into(),
            name: "waypoint".into(),
        };
        let svc = service.map(|(ns, name)| ObjectName {
            namespace: ns.into(),
            name: name.into(),
        });
        let target = Target {
            gateway: &gateway,
            service: svc.as_ref(),
            service_kind,
            root_namespace: "istio-system",
            port: 80,
        };
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
            auth: None,
        };
        authz::evaluate(cfg.policies.iter().filter(|p| p.applies_to(&target)), &req)
    }

    /// A kind answered with 404 (its CRD not installed) or 403 (not listable) does not
    /// hold the config back: it publishes without it, and the dump names its state.
    /// AuthorizationPolicies that cannot be listed deny every request (a forbidden list
    /// may hide a DENY), RequestAuthentications refuse every token; not served, there
    /// are none, and nothing is denied for them.
    #[test]
    fn unavailable_kinds_do_not_block_and_unreadable_policies_fail_closed() {
        let settings = settings();
        let without = |gone: &[(Kind, Unavailable)]| {
            let mut s = Store::default();
            for kind in KINDS {
                if let Some((_, u)) = gone.iter().find(|(k, _)| *k == kind) {
                    s.update(kind, Update::Unavailable(u.clone()), &settings);
                    continue;
                }
                s.update(kind, Update::Served("v1".into()), &settings);
                for e in [Event::Init, Event::InitDone] {
                    s.update(kind, Update::Event(Box::new(e)), &settings);
                }
            }
            s
        };
        let not_served = || Unavailable::NotServed("404".into());
        let forbidden = || Unavailable::Forbidden("403".into());
        // Waiting for one kind that failed otherwise (unreachable): nothing published.
        let mut s = without(&[]);
        s.synced.remove(&Kind::Telemetry);
        s.update(
            Kind::Telemetry,
            Update::Failed("connection refused".into()),
            &settings,
        );
        assert!(s.publish(&settings).is_none());

        let cfg = without(&[
            (Kind::TcpRoute, not_served()),
            (Kind::Telemetry, forbidden()),
            (Kind::AuthorizationPolicy, not_served()),
        ])
        .publish(&settings)
        .expect("published without the unavailable kinds");
        assert!(verdict(&cfg, Some(("default", "echo"))).allowed);
        assert_eq!(cfg.unenforceable, 0);
        let w = &cfg.dump["kubernetes"];
        assert_eq!(w["TCPRoute"]["state"], "notServed", "{w}");
        assert_eq!(w["Telemetry"]["state"], "forbidden", "{w}");
        assert_eq!(w["HTTPRoute"]["state"], "listed", "{w}");

        let cfg = without(&[
            (Kind::AuthorizationPolicy, forbidden()),
            (Kind::RequestAuthentication, forbidden()),
        ])
        .publish(&settings)
        .unwrap();
        for svc in [("default", "echo"), ("other", "svc")] {
            let v = verdict(&cfg, Some(svc));
            assert!(!v.allowed, "{svc:?}");
            assert_eq!(
                v.denied_by.as_deref(),
                Some("istio-system/authorizationpolicies-unreadable")
            );
        }
        assert_eq!(cfg.unenforceable, 2);
        assert!(cfg.authentications.iter().any(|a| a.reject_tokens));
        assert!(
            cfg.dump["kubernetes"]["AuthorizationPolicy"]["effect"]
                .as_str()
                .is_some_and(|e| e.contains("fail closed")),
            "{}",
            cfg.dump
        );

        // Listed once, then forbidden: what was listed stays.
        let mut s = without(&[]);
        s.update(
            Kind::AuthorizationPolicy,
            Update::Unavailable(forbidden()),
            &settings,
        );
        assert!(!s.unreadable(Kind::AuthorizationPolicy));
        // A CRD deleted: its objects go with it.
        let mut s = store(vec![(
            Kind::HttpRoute,
            object(
                "HTTPRoute",
                "r",
                json!({"parentRefs": [{"group": "", "kind": "Service", "name": "echo"}], "rules": [{}]}),
            ),
        )]);
        assert_eq!(s.publish(&settings).unwrap().routes.len(), 1);
        s.update(
            Kind::HttpRoute,
            Update::Unavailable(not_served()),
            &settings,
        );
        assert!(s.publish(&settings).unwrap().routes.is_empty());
    }

    #[test]
    fn unenforceable_policies_deny_all_in_their_scope() {
        let cases = [
            // An ALLOW with a condition we do not know: dropping it would allow everyone.
            json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "ALLOW",
                   "rules": [{"when": [{"key": "connection.sni", "values": ["x"]}]}]}),
            // CUSTOM without its provider.
            json!({"targetRef": {"group": "", "kind": "Service", "name": "echo"}, "action": "CUSTOM", "rules": [{}]}),
            // A condition we cannot evaluate.
            json!({"targetRefs": [{"group": "", "kind": "Service", "name": "echo"}], "action": "DENY",
                   "rules": [{"when": [{"key": "request.auth.claims[]", "values": ["admin"]}]}]}),
        ];
        for spec in cases {
            let cfg = store(vec![(
                Kind::AuthorizationPolicy,
                object("AuthorizationPolicy", "p", spec.clone()),
            )])
            .publish(&settings())
            .unwrap();
            let v = verdict(&cfg, Some(("default", "echo")));
            assert!(!v.allowed, "{spec}: the unenforceable policy was dropped");
            assert_eq!(v.denied_by.as_deref(), Some("default/p"), "{spec}");
            assert!(
                verdict(&cfg, Some(("default", "other"))).allowed,
                "{spec}: only its targets are denied"
            );
            assert_eq!(cfg.unenforceable, 1);
            assert!(
                cfg.dump["authorizationPolicies"][0]["unenforceable"].is_string(),
                "{}",
                cfg.dump
            );
        }
        // A targetRef we cannot place (a kind Istio does not attach), in the waypoint's
        // namespace: everything that namespace may target, the whole waypoint, is denied.
        let pod = object(
            "AuthorizationPolicy",
            "pod",
            json!({
            "targetRefs": [{"group": "", "kind": "Pod", "name": "ext"}], "action": "DENY", "rules": [{}]}),
        );
        let cfg = store(vec![(Kind::AuthorizationPolicy, pod)])
            .publish(&settings())
            .unwrap();
        assert!(!verdict(&cfg, Some(("default", "other"))).allowed);
        assert!(!verdict(&cfg, None).allowed);
        assert_eq!(cfg.unenforceable, 1);
    }

    /// The egress layout: a DENY on a ServiceEntry (`networking.istio.io`), in the
    /// waypoint's namespace, is enforced on that ServiceEntry's hosts only (it was refused
    /// and became a deny-all of the whole waypoint).
    #[test]
    fn a_service_entry_target_in_the_waypoints_namespace() {
        let se = object(
            "AuthorizationPolicy",
            "se",
            json!({
            "targetRefs": [{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "ext"}], "action": "DENY", "rules": [{}]}),
        );
        let cfg = store(vec![(Kind::AuthorizationPolicy, se)])
            .publish(&settings())
            .unwrap();
        assert_eq!(cfg.unenforceable, 0, "{}", cfg.dump);
        let v = verdict_kind(&cfg, Some(("default", "ext")), ServiceKind::ServiceEntry);
        assert_eq!(v.denied_by.as_deref(), Some("default/se"));
        // Not a Kubernetes Service of that name, nor the waypoint's other targets.
        assert!(verdict(&cfg, Some(("default", "ext"))).allowed);
        assert!(verdict(&cfg, Some(("default", "other"))).allowed);
        assert!(verdict(&cfg, None).allowed);
    }

    /// Policies of another namespace on what Istio attaches to the waypoint: its
    /// ServiceEntry (used through us, as istiod says) and a Service written with group
    /// `core`. Both were never converted, so their DENY was not enforced (fail open).
    #[test]
    fn other_namespaces_service_entry_and_core_group_targets() {
        let deny = |ns: &str, name: &str, refs: Value| {
            object_in(
                ns,
                "AuthorizationPolicy",
                name,
                json!({"targetRefs": refs, "action": "DENY", "rules": [{}]}),
            )
        };
        let mut s = store(vec![
            (
                Kind::AuthorizationPolicy,
                deny(
                    "egress",
                    "no-ext",
                    json!([{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "ext"}]),
                ),
            ),
            (
                Kind::AuthorizationPolicy,
                deny(
                    "shop",
                    "no-cart",
                    json!([{"group": "core", "kind": "Service", "name": "cart"}]),
                ),
            ),
            // Not used through us: never taken.
            (
                Kind::AuthorizationPolicy,
                deny(
                    "other",
                    "elsewhere",
                    json!([{"group": "networking.istio.io", "kind": "ServiceEntry", "name": "x"}]),
                ),
            ),
        ]);
        s.from_istiod.insert(ObjectName {
            namespace: "egress".into(),
            name: "ext".into(),
        });
        s.from_istiod.insert(ObjectName {
            namespace: "shop".into(),
            name: "cart".into(),
        });
        let cfg = s.publish(&settings()).unwrap();
        assert_eq!(
            verdict_kind(&cfg, Some(("egress", "ext")), ServiceKind::ServiceEntry)
                .denied_by
                .as_deref(),
            Some("egress/no-ext")
        );
        assert_eq!(
            verdict(&cfg, Some(("shop", "cart"))).denied_by.as_deref(),
            Some("shop/no-cart")
        );
        assert!(verdict(&cfg, Some(("shop", "web"))).allowed);
        assert!(verdict(&cfg, None).allowed);
        assert_eq!(cfg.policies.len(), 2, "{}", cfg.dump);
        assert_eq!(cfg.unenforceable, 0);
    }

    /// What an Istio waypoint in `default` takes from other namespaces: `shop` uses it
    /// by its Namespace label, `blog` does not (only its Service `api` would, by its own
    /// labels, but the Gateway admits only `shop`); the root namespace's policies on
    /// the GatewayClass apply to every waypoint.
    #[test]
    fn other_namespaces_and_the_root_namespace() {
        let route_for = |ns: &str, svc: &str, broken: bool| {
            let rule = if broken {
                json!({"backendRefs": [{"name": svc}]})
            } else {
                json!({"backendRefs": [{"name": svc, "port": 80}]})
            };
            object_in(
                ns,
                "HTTPRoute",
                &format!("{svc}-route"),
                json!({"parentRefs": [{"group": "", "kind": "Service", "name": svc}], "rules": [rule]}),
            )
        };
        let deny = |ns: &str, name: &str, refs: Value| {
            object_in(
                ns,
                "AuthorizationPolicy",
                name,
                json!({"targetRefs": refs, "action": "DENY", "rules": [{"to": [{"operation": {"paths": ["/x"]}}]}]}),
            )
        };
        let gateway = object(
            "Gateway",
            "waypoint",
            json!({"gatewayClassName": "istio-waypoint", "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE",
            "allowedRoutes": {"namespaces": {"from": "Selector", "selector": {"matchLabels": {"mesh": "shared"}}}}}]}),
        );
        let class = json!([{"group": "gateway.networking.k8s.io", "kind": "GatewayClass", "name": "istio-waypoint"}]);
        let objects = vec![
            (Kind::Gateway, gateway),
            (
                Kind::Namespace,
                labelled(None, "default", &[("mesh", "shared")]),
            ),
            (
                Kind::Namespace,
                labelled(
                    None,
                    "shop",
                    &[
                        (USE_WAYPOINT, "waypoint"),
                        (USE_WAYPOINT_NAMESPACE, "default"),
                        ("mesh", "shared"),
                    ],
                ),
            ),
            (Kind::Namespace, labelled(None, "blog", &[])),
            (
                Kind::Service,
                labelled(Some("shop"), "legacy", &[(USE_WAYPOINT, "none")]),
            ),
            (
                Kind::Service,
                labelled(
                    Some("blog"),
                    "api",
                    &[
                        (USE_WAYPOINT, "waypoint"),
                        (USE_WAYPOINT_NAMESPACE, "default"),
                    ],
                ),
            ),
            (Kind::HttpRoute, route_for("shop", "cart", false)),
            (Kind::HttpRoute, route_for("shop", "legacy", true)),
            (Kind::HttpRoute, route_for("blog", "api", true)),
            (
                Kind::AuthorizationPolicy,
                deny(
                    "shop",
                    "cart-deny",
                    json!([{"group": "", "kind": "Service", "name": "cart"}]),
                ),
            ),
            (
                Kind::AuthorizationPolicy,
                deny(
                    "shop",
                    "ingress",
                    json!([{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "ingress"}]),
                ),
            ),
            (
                Kind::AuthorizationPolicy,
                deny("istio-system", "mesh-deny", class.clone()),
            ),
            (
                Kind::AuthorizationPolicy,
                deny(
                    "istio-system",
                    "ingress-jwt",
                    json!([{"kind": "Gateway", "group": "gateway.networking.k8s.io", "name": "ingress"}]),
                ),
            ),
            (Kind::AuthorizationPolicy, deny("blog", "class", class)),
        ];
        let mut s = store(objects);
        let cfg = s.publish(&settings()).unwrap();
        let names = |v: &Value| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|o| {
                    format!(
                        "{}/{}",
                        o["namespace"].as_str().unwrap(),
                        o["name"].as_str().unwrap()
                    )
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(names(&cfg.dump["httpRoutes"]), ["shop/cart-route"]);
        assert_eq!(
            names(&cfg.dump["authorizationPolicies"]),
            ["istio-system/mesh-deny", "shop/cart-deny"]
        );
        // The broken routes of Services that do not use us were never looked at.
        assert_eq!(cfg.dump["rejected"], json!([]), "{}", cfg.dump);
        assert_eq!(cfg.dump["scope"]["labelledNamespaces"], json!(["shop"]));
        assert_eq!(cfg.dump["scope"]["refusedByGateway"], json!(["blog/api"]));
        // The root namespace's policy covers every target of the waypoint.
        assert_eq!(
            verdict(&cfg, None).denied_by.as_deref(),
            None,
            "rules need /x"
        );
        // Nothing changed: nothing to publish.
        assert!(s.publish(&settings()).is_none());

        // istiod routes blog/api through us after all: its namespace's route is taken
        // (and found broken), and a policy on a GatewayClass outside the root still isn't.
        s.from_istiod.insert(ObjectName {
            namespace: "blog".into(),
            name: "api".into(),
        });
        let cfg = s.publish(&settings()).unwrap();
        assert_eq!(cfg.dump["rejected"][0]["name"], "api-route", "{}", cfg.dump);
        assert_eq!(
            names(&cfg.dump["authorizationPolicies"]),
            ["istio-system/mesh-deny", "shop/cart-deny"]
        );
    }
}
