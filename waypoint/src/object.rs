//! The Kubernetes objects L7 config names: namespaced names, the Gateway API references
//! of routes and policies (`parentRefs`, `targetRefs`, `backendRefs`), and what a
//! request is addressed to.

use serde::Deserialize;

/// Gateway API's group (of `Gateway`, the default of `parentRefs`).
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";

/// The GatewayClass of every waypoint, as Istio names it: a policy in the root namespace
/// that targets it applies to all waypoints.
pub const WAYPOINT_CLASS: &str = "istio-waypoint";

/// Istio's default root namespace (meshConfig.rootNamespace).
pub const DEFAULT_ROOT_NAMESPACE: &str = "istio-system";

/// A namespaced Kubernetes object name.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectName {
    pub namespace: String,
    pub name: String,
}

/// What a request is addressed to, as seen by one waypoint: the waypoint's own Gateway
/// (routes and policies may attach to it) and, when the CONNECT target is a service
/// VIP, that service and its port.
#[derive(Clone, Copy, Debug)]
pub struct Target<'a> {
    pub gateway: &'a ObjectName,
    /// The mesh's root namespace: its policies targeting the GatewayClass
    /// `istio-waypoint` apply to every request through the waypoint.
    pub root_namespace: &'a str,
    pub service: Option<&'a ObjectName>,
    /// Where `service` comes from: a `Service` targetRef names only a Kubernetes
    /// Service, a `ServiceEntry` one only a ServiceEntry's hosts (Istio's registry check).
    pub service_kind: ServiceKind,
    /// The service port (CONNECT target port).
    pub port: u16,
}

/// Which registry a mesh service comes from. istiod describes both as ztunnel
/// `Service`s named after their object (a ServiceEntry: one per host, each named after
/// the ServiceEntry), so the hostname tells them apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServiceKind {
    #[default]
    Kubernetes,
    ServiceEntry,
}

impl ServiceKind {
    /// A Kubernetes Service's hostname is `<name>.<namespace>.svc.<domain>`; anything
    /// else is a ServiceEntry's host.
    pub fn of(svc: &ztunnel::state::Service) -> ServiceKind {
        let kube = svc
            .hostname
            .strip_prefix(svc.name.as_str())
            .and_then(|h| h.strip_prefix('.'))
            .and_then(|h| h.strip_prefix(svc.namespace.as_str()))
            .and_then(|h| h.strip_prefix(".svc."))
            .is_some_and(|domain| !domain.is_empty());
        if kube {
            ServiceKind::Kubernetes
        } else {
            ServiceKind::ServiceEntry
        }
    }
}

/// A Gateway API object reference: what a route or policy attaches to (`parentRefs` /
/// `targetRefs`: a `Service`, group "", the waypoint's `Gateway`, or for policies a
/// `ServiceEntry` or the `GatewayClass` of all waypoints) and what a route
/// sends to (`backendRefs`, a mirror's `backendRef`: a Service and its port). Which
/// fields each use allows is checked by the route's and the policy's validation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ObjectRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    /// Defaults to the route's / policy's own namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Service parents: the service port the route applies to (all when absent).
    /// Backends: the service port to send to.
    #[serde(default)]
    pub port: Option<u16>,
    /// Parents only.
    #[serde(default)]
    pub section_name: Option<String>,
}

impl ObjectRef {
    /// The object named, its namespace defaulting to `own_ns` (the route's or policy's).
    pub fn object_name(&self, own_ns: &str) -> ObjectName {
        ObjectName {
            namespace: self.namespace.as_deref().unwrap_or(own_ns).to_string(),
            name: self.name.clone(),
        }
    }
}

/// Whether an Istio networking object of namespace `own` with this `exportTo` is visible
/// in namespace `to`: empty or `*` everywhere, `.` its own namespace, or those named.
pub fn exported_to(export_to: &[String], own: &str, to: &str) -> bool {
    export_to.is_empty()
        || export_to
            .iter()
            .any(|e| e == "*" || e == to || (e == "." && own == to))
}

/// Istio's group of ServiceEntry.
pub const NETWORKING_GROUP: &str = "networking.istio.io";

/// What a policy's `targetRefs` may name: what Istio's `policyattachment.go` attaches
/// to a waypoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefKind {
    Service,
    ServiceEntry,
    Gateway,
    GatewayClass,
}

/// Service is in the core group ("", absent, or `core` as Istio canonicalizes it),
/// ServiceEntry in `networking.istio.io`, Gateway and GatewayClass in Gateway API's
/// (or absent).
pub fn ref_kind(r: &ObjectRef) -> Option<RefKind> {
    match (r.kind.as_deref(), r.group.as_deref()) {
        (Some("Service"), None | Some("" | "core")) => Some(RefKind::Service),
        (Some("ServiceEntry"), Some(NETWORKING_GROUP)) => Some(RefKind::ServiceEntry),
        (Some("Gateway"), None | Some(GATEWAY_GROUP)) => Some(RefKind::Gateway),
        (Some("GatewayClass"), None | Some(GATEWAY_GROUP)) => Some(RefKind::GatewayClass),
        _ => None,
    }
}

/// Where a stand-in for an object the waypoint cannot enforce goes (a deny-all policy, a
/// refuse-all RequestAuthentication): each of its `refs` taken wider (port and
/// sectionName dropped); `(refs, true)` when one cannot be placed (a kind the waypoint
/// does not serve, another namespace, no name) or there are none, and the caller covers
/// all its namespace could target.
pub fn place_widely(namespace: &str, refs: &[ObjectRef]) -> (Vec<ObjectRef>, bool) {
    let placed: Option<Vec<ObjectRef>> = refs
        .iter()
        .map(|r| {
            let ok = ref_kind(r).is_some()
                && !r.name.is_empty()
                && r.namespace.as_deref().is_none_or(|ns| ns == namespace);
            ok.then(|| ObjectRef {
                namespace: None,
                port: None,
                section_name: None,
                ..r.clone()
            })
        })
        .collect();
    match placed {
        Some(refs) if !refs.is_empty() => (refs, false),
        _ => (Vec::new(), true),
    }
}

/// Whether an object of `namespace` with these `refs` applies to the request's target:
/// as [`attaches`], or, for a stand-in whose targets could not be placed
/// ([`place_widely`]), whatever its namespace could target (the waypoint from its own or
/// the root namespace, else the namespace's Services).
pub fn applies(namespace: &str, refs: &[ObjectRef], unplaced: bool, target: &Target) -> bool {
    if unplaced {
        return namespace == target.gateway.namespace
            || namespace == target.root_namespace
            || target.service.is_some_and(|s| s.namespace == namespace);
    }
    attaches(namespace, refs, target)
}

/// Whether a policy of `namespace` (AuthorizationPolicy, RequestAuthentication) with
/// these `targetRefs` attaches to the request's target, as Istio attaches policies to
/// waypoints: a Service or ServiceEntry of the policy's own namespace (the hosts of the
/// ServiceEntry), the waypoint's Gateway (from the Gateway's namespace), or, from the
/// root namespace, the GatewayClass `istio-waypoint`.
pub fn attaches(namespace: &str, refs: &[ObjectRef], target: &Target) -> bool {
    refs.iter().any(|r| {
        // Validation rejects other namespaces; never let one widen the scope anyway.
        if r.namespace.as_deref().is_some_and(|ns| ns != namespace) {
            return false;
        }
        match ref_kind(r) {
            Some(kind @ (RefKind::Service | RefKind::ServiceEntry)) => {
                let registry = if kind == RefKind::Service {
                    ServiceKind::Kubernetes
                } else {
                    ServiceKind::ServiceEntry
                };
                target.service_kind == registry
                    && target
                        .service
                        .is_some_and(|s| s.name == r.name && s.namespace == namespace)
            }
            Some(RefKind::Gateway) => {
                target.gateway.name == r.name && target.gateway.namespace == namespace
            }
            Some(RefKind::GatewayClass) => {
                r.name == WAYPOINT_CLASS && namespace == target.root_namespace
            }
            None => false,
        }
    })
}
