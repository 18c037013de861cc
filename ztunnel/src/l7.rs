//! L7 mesh config, enforced by the waypoint: Gateway API `HTTPRoute`s (routing) and
//! Istio `AuthorizationPolicy`s with `targetRefs` (L7 authorization), in the local config
//! file's `httpRoutes` and `authorizationPolicies` lists. ztunnel only validates them.

pub mod authz;
pub mod path;
pub mod route;

use serde::Deserialize;

/// A namespaced Kubernetes object name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    pub service: Option<&'a ObjectName>,
    /// The service port (CONNECT target port).
    pub port: u16,
}

/// A reference to the object a route or policy attaches to (`parentRefs` / `targetRefs`):
/// a `Service` (group "") or the waypoint's `Gateway` (group gateway.networking.k8s.io).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ParentRef {
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub name: String,
    /// Defaults to the route's / policy's own namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// Only for Service parents: the service port the route applies to (all when absent).
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default)]
    pub section_name: Option<String>,
}
