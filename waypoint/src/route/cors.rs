//! Gateway API's `CORS` route filter (`HTTPCORSFilter`), applied as Istio applies it:
//! istiod turns it into Envoy's CORS policy (`unmatchedPreflights: IGNORE`), so the
//! waypoint answers every preflight of the rule itself and adds the allow headers to
//! the responses of allowed origins.
//!
//! Origins match as istiod converts them: `*` any `scheme://host[:port]`, a value
//! without `*` exactly (case-sensitive), a value with one `*` anything in its place.
//! `Access-Control-Allow-Origin` is always the request's `Origin` (Envoy echoes it; never
//! `*`), so credentials work with `*` too. No `Vary: Origin` is added (Envoy adds none).

use http::header::{self, HeaderMap, HeaderValue};
use http::Method;
use serde::Deserialize;

/// Gateway API's default `maxAge` (seconds), which the API server writes when omitted.
const DEFAULT_MAX_AGE: i64 = 5;

/// A rule's CORS policy: the fields as written (checked by `validate`) and what a request
/// needs, built when the config loads.
#[derive(Clone, Debug)]
pub struct Cors {
    pub allow_origins: Vec<String>,
    pub allow_credentials: bool,
    pub allow_methods: Vec<String>,
    pub allow_headers: Vec<String>,
    pub expose_headers: Vec<String>,
    pub max_age: i64,
    origins: Vec<OriginMatch>,
    /// The joined list; None when unset or `*` (echo the request's).
    methods: Option<HeaderValue>,
    methods_any: bool,
    headers: Option<HeaderValue>,
    headers_any: bool,
    expose: Option<HeaderValue>,
    /// None: no `Access-Control-Max-Age` (a VirtualService policy without `maxAge`).
    max_age_value: Option<HeaderValue>,
    /// Envoy's `forward_not_matching_preflights`: a preflight from an origin not allowed
    /// goes to the backend (a VirtualService's default, `unmatchedPreflights: FORWARD`)
    /// rather than being answered here (Gateway API's, IGNORE).
    forward_unmatched_preflights: bool,
    /// Made from a VirtualService `corsPolicy` (Gateway API's CRD rules do not apply).
    pub virtual_service: bool,
}

/// One origin rule of a VirtualService `corsPolicy` (Istio's StringMatch).
pub enum OriginRule {
    Exact(String),
    Prefix(String),
    /// RE2, matching the whole origin.
    Regex(String),
}

/// One `allowOrigins` entry, as istiod converts it.
#[derive(Clone, Debug)]
enum OriginMatch {
    /// `*`: any serialized origin (`scheme://host[:port]`).
    Any,
    Exact(String),
    /// One `*`: the text around it, anything (maybe nothing) in its place.
    Wildcard {
        prefix: String,
        suffix: String,
    },
    Prefix(String),
    Regex(regex::Regex),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RawCors {
    #[serde(default)]
    allow_origins: Vec<String>,
    #[serde(default)]
    allow_credentials: Option<bool>,
    #[serde(default)]
    allow_methods: Vec<String>,
    #[serde(default)]
    allow_headers: Vec<String>,
    #[serde(default)]
    expose_headers: Vec<String>,
    /// Signed so that a negative value gets `validate`'s message, not serde's.
    #[serde(default)]
    max_age: Option<i64>,
}

impl<'de> Deserialize<'de> for Cors {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw = RawCors::deserialize(d)?;
        // Values `validate` refuses compile to nothing here; the route never loads.
        let joined = |v: &[String]| {
            (!v.is_empty())
                .then(|| HeaderValue::from_str(&v.join(",")).ok())
                .flatten()
        };
        let any = |v: &[String]| v.len() == 1 && v[0] == "*";
        let max_age = raw.max_age.unwrap_or(DEFAULT_MAX_AGE);
        Ok(Cors {
            origins: raw
                .allow_origins
                .iter()
                .map(|o| OriginMatch::new(o))
                .collect(),
            methods: if any(&raw.allow_methods) {
                None
            } else {
                joined(&raw.allow_methods)
            },
            methods_any: any(&raw.allow_methods),
            headers: if any(&raw.allow_headers) {
                None
            } else {
                joined(&raw.allow_headers)
            },
            headers_any: any(&raw.allow_headers),
            expose: joined(&raw.expose_headers),
            max_age_value: Some(HeaderValue::from(max_age)),
            forward_unmatched_preflights: false,
            virtual_service: false,
            allow_origins: raw.allow_origins,
            allow_credentials: raw.allow_credentials.unwrap_or(false),
            allow_methods: raw.allow_methods,
            allow_headers: raw.allow_headers,
            expose_headers: raw.expose_headers,
            max_age,
        })
    }
}

impl Cors {
    /// A VirtualService `corsPolicy`, as Istio's `TranslateCORSPolicy` gives it to Envoy:
    /// origins by StringMatch, the lists joined as written, `maxAge` in seconds (no
    /// header without it), preflights from other origins forwarded unless
    /// `unmatchedPreflights: IGNORE`.
    #[allow(clippy::too_many_arguments)]
    pub fn from_virtual_service(
        origins: Vec<OriginRule>,
        allow_methods: Vec<String>,
        allow_headers: Vec<String>,
        expose_headers: Vec<String>,
        max_age: Option<std::time::Duration>,
        allow_credentials: bool,
        forward_unmatched_preflights: bool,
    ) -> Result<Cors, String> {
        let joined = |field: &str, v: &[String]| -> Result<Option<HeaderValue>, String> {
            if v.is_empty() {
                return Ok(None);
            }
            HeaderValue::from_str(&v.join(","))
                .map(Some)
                .map_err(|_| format!("{field}: not a header value"))
        };
        let mut matchers = Vec::with_capacity(origins.len());
        for (i, o) in origins.into_iter().enumerate() {
            matchers.push(match o {
                OriginRule::Exact(e) => OriginMatch::Exact(e),
                OriginRule::Prefix(p) => OriginMatch::Prefix(p),
                OriginRule::Regex(r) => OriginMatch::Regex(
                    regex::RegexBuilder::new(&format!("^(?:{r})$"))
                        .size_limit(1 << 20)
                        .build()
                        .map_err(|e| format!("allowOrigins[{i}].regex: {e}"))?,
                ),
            });
        }
        // `*` alone echoes what the browser asks for, as for Gateway API's policy.
        let any = |v: &[String]| v.len() == 1 && v[0] == "*";
        let max_age_secs = max_age.map(|d| d.as_secs() as i64);
        Ok(Cors {
            allow_origins: Vec::new(),
            allow_credentials,
            origins: matchers,
            methods: joined("allowMethods", &allow_methods)?,
            methods_any: any(&allow_methods),
            headers: joined("allowHeaders", &allow_headers)?,
            headers_any: any(&allow_headers),
            expose: joined("exposeHeaders", &expose_headers)?,
            max_age_value: max_age_secs.map(HeaderValue::from),
            max_age: max_age_secs.unwrap_or(0),
            allow_methods,
            allow_headers,
            expose_headers,
            forward_unmatched_preflights,
            virtual_service: true,
        })
    }
}

impl OriginMatch {
    fn new(o: &str) -> OriginMatch {
        if o == "*" {
            return OriginMatch::Any;
        }
        match o.split_once('*') {
            Some((prefix, suffix)) => OriginMatch::Wildcard {
                prefix: prefix.into(),
                suffix: suffix.into(),
            },
            None => OriginMatch::Exact(o.into()),
        }
    }

    fn matches(&self, origin: &str) -> bool {
        match self {
            OriginMatch::Any => is_serialized_origin(origin),
            OriginMatch::Exact(e) => e == origin,
            OriginMatch::Wildcard { prefix, suffix } => {
                origin.len() >= prefix.len() + suffix.len()
                    && origin.starts_with(prefix.as_str())
                    && origin.ends_with(suffix.as_str())
            }
            OriginMatch::Prefix(p) => origin.starts_with(p.as_str()),
            OriginMatch::Regex(r) => r.is_match(origin),
        }
    }
}

/// `scheme://host[:port]`: a scheme (a letter, then letters, digits, `+ - .`), then a
/// non-empty authority without `/`, `?`, `#` or whitespace (the origin istiod allows
/// for `*`; `null` and URLs with a path are not origins).
fn is_serialized_origin(o: &str) -> bool {
    let Some((scheme, rest)) = o.split_once("://") else {
        return false;
    };
    let mut s = scheme.bytes();
    s.next().is_some_and(|b| b.is_ascii_alphabetic())
        && s.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        && !rest.is_empty()
        && !rest
            .bytes()
            .any(|b| matches!(b, b'/' | b'?' | b'#') || b.is_ascii_whitespace())
}

/// What a rule's CORS policy makes of a request.
#[derive(Debug)]
pub enum CorsOutcome {
    /// No `Origin`, or an actual request from an origin not allowed: untouched.
    NotCors,
    /// A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`): answered
    /// here with 200 and these headers, never forwarded. A refused origin gets no
    /// `Access-Control-Allow-Origin`, which fails it in the browser.
    Preflight(HeaderMap),
    /// An actual request from an allowed origin: these headers go on its response.
    Response(HeaderMap),
}

impl Cors {
    pub fn on_request(&self, method: &Method, req: &HeaderMap) -> CorsOutcome {
        let Some(origin) = req.get(header::ORIGIN).filter(|v| !v.is_empty()) else {
            return CorsOutcome::NotCors;
        };
        let allowed = origin
            .to_str()
            .is_ok_and(|o| self.origins.iter().any(|m| m.matches(o)));
        let request_method = req
            .get(header::ACCESS_CONTROL_REQUEST_METHOD)
            .filter(|v| !v.is_empty());
        let mut h = HeaderMap::new();
        if allowed {
            h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin.clone());
        }
        if self.allow_credentials {
            h.insert(
                header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
                HeaderValue::from_static("true"),
            );
        }
        let preflight = request_method.is_some() && method == Method::OPTIONS;
        if preflight && !allowed && self.forward_unmatched_preflights {
            return CorsOutcome::NotCors;
        }
        let Some(request_method) = request_method.filter(|_| method == Method::OPTIONS) else {
            if !allowed {
                return CorsOutcome::NotCors;
            }
            if let Some(e) = &self.expose {
                h.insert(header::ACCESS_CONTROL_EXPOSE_HEADERS, e.clone());
            }
            return CorsOutcome::Response(h);
        };
        // `*` echoes what the browser asks for: Gateway API requires that with
        // credentials, and Envoy does it in every case.
        if self.methods_any {
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, request_method.clone());
        } else if let Some(m) = &self.methods {
            h.insert(header::ACCESS_CONTROL_ALLOW_METHODS, m.clone());
        }
        if self.headers_any {
            if let Some(asked) = req
                .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
                .filter(|v| !v.is_empty())
            {
                h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
            }
        } else if let Some(a) = &self.headers {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, a.clone());
        }
        if let Some(v) = &self.max_age_value {
            h.insert(header::ACCESS_CONTROL_MAX_AGE, v.clone());
        }
        CorsOutcome::Preflight(h)
    }
}
