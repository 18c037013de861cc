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

mod convert;
mod kind;
mod mesh;
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
use crate::object::{ObjectName, GATEWAY_GROUP, WAYPOINT_CLASS};
use crate::route::{HttpRoute, L4Route};
pub use convert::{
    authentication, grpc_route, policy, route, tcp_route, tls_route, virtual_service,
};
use convert::{convert, deny_all, flattened, parse_virtual_service, refs, reject_all, Converted};
use kind::{resource, route_kind_name, versions, Kind, KINDS};
use mesh::{mesh_default_retry, mesh_providers, mesh_tracing};

pub use scope::{AllowedNamespaces, LabelSelector, Scope, USE_WAYPOINT, USE_WAYPOINT_NAMESPACE};

/// What the Kubernetes API says, converted.
#[derive(Default)]
pub struct L7Config {
    pub routes: Vec<HttpRoute>,
    /// TCPRoutes, as HTTPRoutes with their one rule.
    pub tcp_routes: Vec<HttpRoute>,
    /// VirtualServices' `tls` and `tcp` rules and TLSRoutes (`route::l4`).
    pub l4_routes: Vec<L4Route>,
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
    /// Its defaultHttpRetryPolicy (None: Istio's own default).
    pub default_retry: Option<crate::route::MeshRetry>,
    /// meshConfig.h2UpgradePolicy is UPGRADE.
    pub h2_upgrade: bool,
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

fn str_field<'a>(v: &'a Value, k: &str) -> Option<&'a str> {
    v.get(k).and_then(Value::as_str)
}

/// A route's parent ref to a Service or a ServiceEntry (the egress layout) of `ns` (the
/// object's own namespace: Istio's waypoints take a route or policy only from the
/// Service's namespace or their own) that uses the waypoint.
fn names_used_service(r: &Value, ns: &str, scope: &Scope) -> bool {
    let group = str_field(r, "group");
    let core = str_field(r, "kind") == Some("Service") && matches!(group, None | Some(""));
    let service_entry = str_field(r, "kind") == Some("ServiceEntry")
        && group == Some(crate::object::NETWORKING_GROUP);
    let same_ns = str_field(r, "namespace").is_none_or(|n| n == ns);
    let name = str_field(r, "name").unwrap_or_default();
    (core || service_entry)
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

/// A VirtualService without `hosts`: a delegate, applied only through the roots that
/// name it.
fn hostless(obj: &DynamicObject) -> bool {
    obj.data
        .pointer("/spec/hosts")
        .and_then(Value::as_array)
        .is_none_or(|h| h.is_empty())
}

/// Whether this waypoint takes the route or policy (module docs).
fn selected(kind: Kind, obj: &DynamicObject, scope: &Scope, settings: &Settings) -> bool {
    let ns = obj.metadata.namespace.as_deref().unwrap_or_default();
    // A VirtualService the waypoint's namespace cannot see (`exportTo`) is not in
    // Istio's waypoint's scope either. (A DestinationRule's `exportTo` is applied when
    // it is looked up, `destination::rule_for`.)
    // A delegate (no hosts) is taken from any namespace; it applies only through a root
    // it is exported to (`delegate::merged`).
    if kind == Kind::VirtualService && hostless(obj) {
        return true;
    }
    if kind == Kind::VirtualService && !exported_to(obj, &settings.gateway.namespace) {
        return false;
    }
    // A DestinationRule with a `workloadSelector` is for the proxies of the workloads it
    // selects, in any namespace (the waypoint's own labels are not matched against it).
    if kind == Kind::DestinationRule && obj.data.pointer("/spec/workloadSelector").is_some() {
        return false;
    }
    if ns == settings.gateway.namespace {
        return true;
    }
    match kind {
        // Small, and any namespace may grant our routes its Services.
        Kind::ReferenceGrant => true,
        // Applied to the Services the waypoint sends to, whichever namespace has them.
        Kind::DestinationRule => true,
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
        Kind::HttpRoute | Kind::GrpcRoute | Kind::TcpRoute | Kind::TlsRoute => {
            refs(obj, "parentRefs")
                .into_iter()
                .any(|r| names_used_service(r, ns, scope))
        }
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
                        | Kind::TlsRoute
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
        let (providers, providers_dump) =
            mesh_providers(mesh, &settings.root_namespace, &settings.mesh_config_map);
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
        let (default_retry, default_retry_dump) = mesh_default_retry(mesh_value.as_ref());
        cfg.default_retry = default_retry;
        cfg.h2_upgrade = crate::destination::connection::mesh_h2_upgrade(mesh_value.as_ref());
        let (mut telemetries, mut telemetries_read) = (Vec::new(), Vec::new());
        let (mut routes, mut policies, mut authns, mut rejected) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut grpc_routes, mut tcp_routes, mut grants, mut destination_rules) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut virtual_services, mut tls_routes) = (Vec::new(), Vec::new());
        // Delegate VirtualServices (no hosts) that a root taken here names: read as written
        // each time, since a root's merge depends on them. Others (any namespace may make
        // them) are neither kept nor shown.
        let is_vs = |k: &&Key| k.0 == Kind::VirtualService;
        let referenced: BTreeSet<(String, String)> = taken
            .iter()
            .filter(|(k, obj)| is_vs(k) && !hostless(obj))
            .flat_map(|(k, obj)| {
                let rules = obj.data.pointer("/spec/http").and_then(Value::as_array);
                rules.into_iter().flatten().filter_map(move |r| {
                    let d = r.get("delegate")?;
                    let ns = d
                        .get("namespace")
                        .and_then(Value::as_str)
                        .filter(|n| !n.is_empty());
                    Some((
                        ns.unwrap_or(&k.1).to_string(),
                        d.get("name")?.as_str()?.to_string(),
                    ))
                })
            })
            .collect();
        let delegates: HashMap<(String, String), crate::route::VirtualService> = taken
            .iter()
            .filter(|(k, obj)| {
                is_vs(k) && hostless(obj) && referenced.contains(&(k.1.clone(), k.2.clone()))
            })
            .filter_map(|(k, obj)| {
                Some(((k.1.clone(), k.2.clone()), parse_virtual_service(obj).ok()?))
            })
            .collect();
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
                    _ => {
                        cfg.routes.push(r.clone());
                        routes.push(as_read);
                    }
                },
                Converted::Routes(Ok(r)) => {
                    cfg.routes.extend(r.http.clone());
                    cfg.l4_routes.extend(r.l4.clone());
                    match k.0 {
                        Kind::TlsRoute => tls_routes.push(as_read),
                        _ => virtual_services.push(as_read),
                    }
                }
                Converted::Route(Err(e)) | Converted::Routes(Err(e)) => rejected.push(json!({"kind": route_kind_name(k.0), "namespace": k.1, "name": k.2, "error": e})),
                Converted::Delegate => {
                    if delegates.contains_key(&(k.1.clone(), k.2.clone())) {
                        virtual_services.push(as_read);
                    }
                }
                Converted::Delegating(root) => {
                    let (merged, dropped) = crate::route::delegate::merged(root, |ns, name| delegates.get(&(ns.to_string(), name.to_string())));
                    for why in &dropped {
                        tracing::warn!(kind = "VirtualService", namespace = %k.1, name = %k.2, reason = %why, "delegate rule dropped");
                    }
                    match merged.routes() {
                        Ok(r) => {
                            cfg.routes.extend(r.http);
                            cfg.l4_routes.extend(r.l4);
                            let mut v = as_read;
                            if !dropped.is_empty() {
                                v["delegateRulesDropped"] = json!(dropped);
                            }
                            virtual_services.push(v);
                        }
                        Err(e) => {
                            tracing::warn!(kind = "VirtualService", namespace = %k.1, name = %k.2, error = %e, "object rejected; it does not apply");
                            rejected.push(json!({"kind": "VirtualService", "namespace": k.1, "name": k.2, "error": e}));
                        }
                    }
                }
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
                    let effect = if stand_in.is_some() { "traffic to its host fails (the rule cannot be applied exactly)" } else { "does not apply" };
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
            "tlsRoutes": tls_routes,
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
            "defaultHttpRetryPolicy": default_retry_dump,
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
mod tests;
