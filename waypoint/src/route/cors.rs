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
    max_age_value: HeaderValue,
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
            max_age_value: HeaderValue::from(max_age),
            allow_origins: raw.allow_origins,
            allow_credentials: raw.allow_credentials.unwrap_or(false),
            allow_methods: raw.allow_methods,
            allow_headers: raw.allow_headers,
            expose_headers: raw.expose_headers,
            max_age,
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
        h.insert(header::ACCESS_CONTROL_MAX_AGE, self.max_age_value.clone());
        CorsOutcome::Preflight(h)
    }
}
