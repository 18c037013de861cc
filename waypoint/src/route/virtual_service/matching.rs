//! What a VirtualService match has beyond an HTTPRoute match (Istio's
//! `TranslateRouteMatch` and `TranslateRoute`): `port`, `authority`, `scheme`,
//! `withoutHeaders`, `sourceNamespace`; `ignoreUriCase` is compiled into the path match.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::super::action::{self, Matched};
use super::super::model::{
    HeaderMatch, MethodMatch, PathMatch, QueryParamMatch, RouteMatch, ValueMatch, VsConditions,
};

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase", deny_unknown_fields)]
pub struct VsMatch {
    pub name: Option<String>,
    pub uri: Option<StringMatch>,
    pub scheme: Option<StringMatch>,
    pub method: Option<StringMatch>,
    pub authority: Option<StringMatch>,
    pub headers: BTreeMap<String, StringMatch>,
    pub port: Option<u32>,
    pub source_labels: BTreeMap<String, String>,
    pub gateways: Vec<String>,
    pub query_params: BTreeMap<String, StringMatch>,
    pub ignore_uri_case: bool,
    pub without_headers: BTreeMap<String, StringMatch>,
    pub source_namespace: Option<String>,
    /// Envoy's per-route stats prefix: the waypoint keeps no per-route stats (ignored).
    pub stat_prefix: Option<String>,
}

/// Istio's StringMatch: one of exact, prefix, regex.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StringMatch {
    pub exact: Option<String>,
    pub prefix: Option<String>,
    pub regex: Option<String>,
}

impl StringMatch {
    /// Whether it is met by any value present (Istio's `canBeConvertedToPresentMatch`:
    /// an empty prefix, or the regex `*` or `.*`).
    fn presence_only(&self) -> bool {
        matches!(
            (&self.exact, &self.prefix, &self.regex),
            (None, Some(p), None) if p.is_empty()
        ) || matches!((&self.exact, &self.prefix, &self.regex), (None, None, Some(r)) if r == "*" || r == ".*")
    }

    /// As a full-match regex source, or an exact value.
    fn value(&self, field: &str) -> Result<ValueMatch, String> {
        match (&self.exact, &self.prefix, &self.regex) {
            (Some(e), None, None) => Ok(ValueMatch::Exact(e.clone())),
            (None, Some(p), None) => {
                ValueMatch::new("RegularExpression", &format!("{}.*", regex::escape(p)))
                    .map_err(|e| format!("{field}: {e}"))
            }
            (None, None, Some(r)) => {
                ValueMatch::new("RegularExpression", r).map_err(|e| format!("{field}: {e}"))
            }
            _ => Err(format!("{field}: set exactly one of exact, prefix, regex")),
        }
    }
}

/// What the conditions look at.
pub struct VsRequest<'a> {
    pub method: &'a str,
    pub authority: &'a str,
    pub port: u16,
    pub headers: &'a http::HeaderMap,
    /// The waypoint's namespace.
    pub waypoint_namespace: &'a str,
}

impl VsConditions {
    pub fn matches(&self, req: &VsRequest) -> bool {
        !self.dropped
            && self.port.is_none_or(|p| p == req.port)
            && self
                .source_namespace
                .as_deref()
                .is_none_or(|ns| ns == req.waypoint_namespace)
            && self
                .authority
                .as_ref()
                .is_none_or(|m| m.matches(req.authority.as_bytes()))
            && self.scheme.as_ref().is_none_or(|m| m.matches(b"http"))
            && self
                .method
                .as_ref()
                .is_none_or(|m| m.matches(req.method.as_bytes()))
            && self.without_headers.iter().all(|(h, presence)| {
                let mut values = req.headers.get_all(&h.name).iter().peekable();
                match (values.peek().is_none(), presence) {
                    (true, true) => true,
                    (true, false) => !h.value.matches(b""),
                    (false, true) => false,
                    (false, false) => !values.any(|v| h.value.matches(v.as_bytes())),
                }
            })
    }
}

impl VsMatch {
    /// The match as the waypoint applies it; errors name the field.
    pub(super) fn compile(&self, at: &str) -> Result<RouteMatch, String> {
        let m = self;
        // Envoy's `case_sensitive: false` applies to exact and prefix paths (ASCII
        // letters only), not to regexes.
        let ci = m.ignore_uri_case;
        let (path, matched) = match &m.uri {
            None => (None, Matched::Prefix(1)),
            Some(u) => {
                let (p, matched) = match (&u.exact, &u.prefix, &u.regex) {
                    (Some(e), None, None) if ci => (
                        PathMatch::new("RegularExpression", &action::ascii_case_insensitive(e)),
                        Matched::Whole,
                    ),
                    (Some(e), None, None) => (PathMatch::new("Exact", e), Matched::Whole),
                    // Istio's prefix is a string prefix, not Gateway API's by path element.
                    (None, Some(p), None) => {
                        let lit = if ci {
                            action::ascii_case_insensitive(p)
                        } else {
                            regex::escape(p)
                        };
                        (
                            PathMatch::new("RegularExpression", &format!("{lit}.*")),
                            Matched::Prefix(p.len()),
                        )
                    }
                    (None, None, Some(r)) => {
                        (PathMatch::new("RegularExpression", r), Matched::Whole)
                    }
                    _ => (
                        Err("set exactly one of exact, prefix, regex".into()),
                        Matched::Whole,
                    ),
                };
                (Some(p.map_err(|e| format!("{at}.uri: {e}"))?), matched)
            }
        };
        // Istio matches `method` as the `:method` header: exact, prefix or regex.
        let (method, method_value) = match &m.method {
            None => (None, None),
            Some(StringMatch {
                exact: Some(e),
                prefix: None,
                regex: None,
            }) => (
                Some(MethodMatch(
                    http::Method::from_bytes(e.as_bytes())
                        .map_err(|_| format!("{at}.method: {e:?} is not a method"))?,
                )),
                None,
            ),
            Some(s) => (None, Some(s.value(&format!("{at}.method"))?)),
        };
        let header = |k: &String, field: &str| {
            http::HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| format!("{at}.{field}: {k:?} is not a header name"))
        };
        let mut headers = Vec::new();
        for (k, v) in &m.headers {
            headers.push(HeaderMatch {
                name: header(k, "headers")?,
                value: v.value(&format!("{at}.headers.{k}"))?,
            });
        }
        let mut without_headers = Vec::new();
        for (k, v) in &m.without_headers {
            let hm = HeaderMatch {
                name: header(k, "withoutHeaders")?,
                value: v.value(&format!("{at}.withoutHeaders.{k}"))?,
            };
            without_headers.push((hm, v.presence_only()));
        }
        let mut query_params = Vec::new();
        for (k, v) in &m.query_params {
            query_params.push(QueryParamMatch {
                name: k.clone(),
                value: v.value(&format!("{at}.queryParams.{k}"))?,
            });
        }
        let port = m
            .port
            .map(|p| {
                u16::try_from(p)
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| format!("{at}.port: {p} is not a port"))
            })
            .transpose()?;
        let conditions = VsConditions {
            matched,
            port,
            authority: m
                .authority
                .as_ref()
                .map(|a| a.value(&format!("{at}.authority")))
                .transpose()?,
            scheme: m
                .scheme
                .as_ref()
                .map(|a| a.value(&format!("{at}.scheme")))
                .transpose()?,
            method: method_value,
            without_headers,
            source_namespace: m.source_namespace.clone().filter(|s| !s.is_empty()),
            dropped: false,
        };
        Ok(RouteMatch {
            path,
            headers,
            query_params,
            method,
            vs: Some(Box::new(conditions)),
        })
    }
}
