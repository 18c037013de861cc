//! Gateway API `ReferenceGrant`: a route may send to a Service of another namespace only
//! when a ReferenceGrant in that namespace allows routes of its kind from the route's
//! namespace (`from`) to that Service, or to every Service (`to` without a name). Without
//! one the backend is not resolved and its requests get 500 (connections: a reset), as
//! Gateway API requires; the route itself still applies.

use serde::Deserialize;

use crate::object::{ObjectName, GATEWAY_GROUP};

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReferenceGrant {
    pub name: String,
    pub namespace: String,
    pub from: Vec<GrantFrom>,
    pub to: Vec<GrantTo>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantFrom {
    pub group: String,
    pub kind: String,
    pub namespace: String,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantTo {
    pub group: String,
    pub kind: String,
    #[serde(default)]
    pub name: Option<String>,
}

impl ReferenceGrant {
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.namespace.is_empty() {
            return Err("name and namespace: required".into());
        }
        if self.from.is_empty() {
            return Err("from: at least one".into());
        }
        if self.to.is_empty() {
            return Err("to: at least one".into());
        }
        for (i, f) in self.from.iter().enumerate() {
            if f.namespace.is_empty() || f.kind.is_empty() {
                return Err(format!("from[{i}]: kind and namespace are required"));
            }
        }
        Ok(())
    }

    /// Whether this grant lets a route of `route_kind` in `route_ns` send to `backend`
    /// (a core Service).
    fn allows(&self, route_kind: &str, route_ns: &str, backend: &ObjectName) -> bool {
        self.namespace == backend.namespace
            && self.from.iter().any(|f| {
                f.group == GATEWAY_GROUP && f.kind == route_kind && f.namespace == route_ns
            })
            && self.to.iter().any(|t| {
                t.group.is_empty()
                    && t.kind == "Service"
                    && t.name.as_deref().is_none_or(|n| n == backend.name)
            })
    }
}

/// Whether a route of `route_kind` (`HTTPRoute`, `GRPCRoute`, `TCPRoute`) in `route_ns`
/// may send to `backend`: always in its own namespace, elsewhere by a grant.
pub fn permitted(
    grants: &[ReferenceGrant],
    route_kind: &str,
    route_ns: &str,
    backend: &ObjectName,
) -> bool {
    backend.namespace == route_ns
        || grants
            .iter()
            .any(|g| g.allows(route_kind, route_ns, backend))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_name_the_route_kind_namespace_and_service() {
        let grants: Vec<ReferenceGrant> = serde_yaml::from_str(
            "- name: g\n  namespace: backend\n  from: [{group: gateway.networking.k8s.io, kind: HTTPRoute, namespace: shop}]\n  to: [{group: '', kind: Service, name: api}]\n\
             - name: all\n  namespace: other\n  from: [{group: gateway.networking.k8s.io, kind: GRPCRoute, namespace: shop}]\n  to: [{group: '', kind: Service}]\n",
        )
        .expect("grants");
        let svc = |ns: &str, name: &str| ObjectName {
            namespace: ns.into(),
            name: name.into(),
        };
        assert!(
            permitted(&grants, "HTTPRoute", "shop", &svc("shop", "anything")),
            "own namespace"
        );
        assert!(permitted(
            &grants,
            "HTTPRoute",
            "shop",
            &svc("backend", "api")
        ));
        assert!(
            !permitted(&grants, "HTTPRoute", "shop", &svc("backend", "db")),
            "only the named Service"
        );
        assert!(
            !permitted(&grants, "HTTPRoute", "blog", &svc("backend", "api")),
            "only from the named namespace"
        );
        assert!(
            !permitted(&grants, "GRPCRoute", "shop", &svc("backend", "api")),
            "only for the named kind"
        );
        assert!(
            permitted(&grants, "GRPCRoute", "shop", &svc("other", "x")),
            "every Service when to has no name"
        );
        assert!(!permitted(&grants, "TCPRoute", "shop", &svc("other", "x")));
    }
}
