//! Gateway API `TCPRoute` on a waypoint: connections to the Service (port) it attaches
//! to are relayed at L4, without looking for HTTP, to a backend picked by weight for
//! each connection. Held as an HTTPRoute with its one rule (attachment and weighted
//! picks are the same), and kept apart from the HTTP routes.

use serde::Deserialize;

use super::model::{BackendRef, HttpRoute, RouteKind, RouteRule};
use crate::object::ObjectRef;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TcpRoute {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub parent_refs: Vec<ObjectRef>,
    pub rules: Vec<TcpRule>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TcpRule {
    #[serde(default)]
    pub name: Option<String>,
    pub backend_refs: Vec<BackendRef>,
}

impl TcpRoute {
    /// As an HTTPRoute with one rule and no matches; errors name the field.
    pub fn to_http(&self) -> Result<HttpRoute, String> {
        let [rule] = self.rules.as_slice() else {
            return Err(format!(
                "rules: a TCPRoute has no matches to choose between rules, so exactly one is supported (found {})",
                self.rules.len()
            ));
        };
        if rule.backend_refs.is_empty() {
            return Err("rules[0].backendRefs: required (where the connections go)".into());
        }
        if let Some(i) = rule.backend_refs.iter().position(|b| !b.filters.is_empty()) {
            return Err(format!(
                "rules[0].backendRefs[{i}].filters: a TCPRoute's backends have no filters"
            ));
        }
        let route = HttpRoute {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            parent_refs: self.parent_refs.clone(),
            kind: RouteKind::Tcp,
            hostnames: Vec::new(),
            rules: vec![RouteRule {
                name: rule.name.clone(),
                backend_refs: rule.backend_refs.clone(),
                ..RouteRule::default()
            }],
            export_to: Vec::new(),
        };
        route.validate()?;
        Ok(route)
    }
}
