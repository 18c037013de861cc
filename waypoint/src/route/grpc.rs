//! Gateway API `GRPCRoute`, applied as the HTTPRoute it amounts to, as Istio converts
//! it: a method match becomes a path match on `/<service>/<method>` (Exact with both:
//! exact path; a service only: the prefix `/<service>/`; a method only, or
//! RegularExpression: a full-match regex), header matches and backends carry over, and
//! only the filters GRPCRoute has are taken (header modifiers and mirrors).

use serde::Deserialize;

use super::model::{
    BackendRef, Filter, HeaderMatch, HttpRoute, PathMatch, RouteKind, RouteMatch, RouteRule,
};
use crate::object::ObjectRef;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrpcRoute {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub parent_refs: Vec<ObjectRef>,
    #[serde(default)]
    pub hostnames: Vec<String>,
    #[serde(default = "default_rules")]
    pub rules: Vec<GrpcRule>,
}

fn default_rules() -> Vec<GrpcRule> {
    vec![GrpcRule::default()]
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct GrpcRule {
    pub name: Option<String>,
    pub matches: Vec<GrpcMatch>,
    pub filters: Vec<Filter>,
    pub backend_refs: Vec<BackendRef>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct GrpcMatch {
    pub method: Option<MethodMatch>,
    pub headers: Vec<HeaderMatch>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MethodMatch {
    #[serde(rename = "type", default = "exact")]
    pub kind: String,
    pub service: Option<String>,
    pub method: Option<String>,
}

fn exact() -> String {
    "Exact".into()
}

impl MethodMatch {
    /// The path match Istio makes of it.
    fn path(&self) -> Result<PathMatch, String> {
        let (service, method) = (
            self.service.as_deref().filter(|s| !s.is_empty()),
            self.method.as_deref().filter(|m| !m.is_empty()),
        );
        match self.kind.as_str() {
            "Exact" => {
                for (field, v) in [("service", service), ("method", method)] {
                    if v.is_some_and(|v| v.contains('/') || v.chars().any(char::is_whitespace)) {
                        return Err(format!(
                            "{field}: {v:?} is not a gRPC name (no '/' or spaces)",
                            v = v.unwrap_or_default()
                        ));
                    }
                }
                match (service, method) {
                    (Some(s), Some(m)) => PathMatch::new("Exact", &format!("/{s}/{m}")),
                    (Some(s), None) => PathMatch::new("PathPrefix", &format!("/{s}/")),
                    (None, Some(m)) => {
                        PathMatch::new("RegularExpression", &format!("/[^/]+/{}", regex::escape(m)))
                    }
                    (None, None) => Err("needs a service or a method (or both)".into()),
                }
            }
            "RegularExpression" => match (service, method) {
                (Some(s), Some(m)) => {
                    PathMatch::new("RegularExpression", &format!("/(?:{s})/(?:{m})"))
                }
                (Some(s), None) => PathMatch::new("RegularExpression", &format!("/(?:{s})/.+")),
                (None, Some(m)) => PathMatch::new("RegularExpression", &format!("/[^/]+/(?:{m})")),
                (None, None) => Err("needs a service or a method (or both)".into()),
            },
            other => Err(format!(
                "type {other:?} is not one of Exact, RegularExpression"
            )),
        }
    }
}

impl GrpcRoute {
    /// The HTTPRoute it amounts to; errors name the field (`rules[0].matches[1].method: ...`).
    pub fn to_http(&self) -> Result<HttpRoute, String> {
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, r) in self.rules.iter().enumerate() {
            for (j, f) in r.filters.iter().enumerate() {
                if matches!(
                    f,
                    Filter::RequestRedirect(_) | Filter::UrlRewrite(_) | Filter::Cors(_)
                ) {
                    return Err(format!(
                        "rules[{i}].filters[{j}]: GRPCRoute filters are RequestHeaderModifier, ResponseHeaderModifier and RequestMirror"
                    ));
                }
            }
            let mut matches = Vec::with_capacity(r.matches.len());
            for (j, m) in r.matches.iter().enumerate() {
                let path = match &m.method {
                    Some(mm) => Some(
                        mm.path()
                            .map_err(|e| format!("rules[{i}].matches[{j}].method: {e}"))?,
                    ),
                    None => None,
                };
                matches.push(RouteMatch {
                    path,
                    headers: m.headers.clone(),
                    ..RouteMatch::default()
                });
            }
            rules.push(RouteRule {
                name: r.name.clone(),
                matches,
                filters: r.filters.clone(),
                backend_refs: r.backend_refs.clone(),
                ..RouteRule::default()
            });
        }
        let route = HttpRoute {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            parent_refs: self.parent_refs.clone(),
            kind: RouteKind::Grpc,
            hostnames: self.hostnames.clone(),
            rules,
            export_to: Vec::new(),
        };
        route.validate()?;
        Ok(route)
    }
}
