//! Finding the request's tokens and verifying them against the providers (`jwtRules`)
//! that attach to its target (semantics in `authn`).

use std::collections::HashSet;

use base64::Engine;
use http::header::{HeaderMap, HeaderName, HeaderValue, COOKIE};
use http::StatusCode;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{DecodingKey, Validation};
use serde_json::Value;

use super::jwks::JwksStore;
use super::model::{JwtRule, RequestAuthentication, DEFAULT_HEADER, DEFAULT_PARAM, DEFAULT_PREFIX};

/// Envoy's clock skew for `exp` and `nbf`.
const CLOCK_SKEW_SECONDS: u64 = 60;

/// Why a request's token was refused; the reply is Envoy's status and body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    #[error("Jwt is not in the form of Header.Payload.Signature with two dots and 3 sections")]
    BadFormat,
    #[error("Jwt issuer is not configured")]
    UnknownIssuer,
    #[error("Jwt is expired")]
    Expired,
    #[error("Jwt not yet valid")]
    NotYetValid,
    #[error("Audiences in Jwt are not allowed")]
    Audience,
    #[error("Jwt verification fails")]
    Signature,
    #[error("Jwks doesn't have key to match kid or alg from Jwt")]
    NoMatchingKey,
    #[error("Jwks remote fetch is failed")]
    JwksNotFetched,
    /// A registered claim of the wrong JSON type: refused as Envoy's parser refuses it,
    /// not skipped (a string `exp` must not make a token ageless).
    #[error("Jwt payload [{0}] field is not a string")]
    ClaimNotString(&'static str),
    #[error("Jwt payload [{0}] field is not an integer")]
    ClaimNotInteger(&'static str),
    #[error("Jwt payload [{0}] field is not a positive 64 bit integer")]
    ClaimOutOfRange(&'static str),
    #[error("Jwt payload [aud] field is not a string or string list")]
    AudNotString,
}

impl Failure {
    /// 401, except a wrong audience: 403, as Envoy.
    pub fn status(&self) -> StatusCode {
        if *self == Failure::Audience {
            StatusCode::FORBIDDEN
        } else {
            StatusCode::UNAUTHORIZED
        }
    }
}

/// A verified token, for AuthorizationPolicy.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestAuth {
    /// `<iss>/<sub>`.
    pub principal: String,
    /// The payload's claims (a JSON object).
    pub claims: Value,
    /// Top-level string claims matched as space-separated lists.
    space_delimited: Vec<String>,
}

/// A claim as AuthorizationPolicy matches it: strings, or lists of strings.
#[derive(Debug, PartialEq, Eq)]
pub enum Claim<'a> {
    Missing,
    Values(Vec<&'a str>),
    /// Present but neither a string nor a list of strings (a number, an object...).
    Unsupported,
}

impl RequestAuth {
    pub fn new(claims: Value, space_delimited: Vec<String>) -> RequestAuth {
        let s = |k: &str| {
            claims
                .get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        RequestAuth {
            principal: format!("{}/{}", s("iss"), s("sub")),
            claims,
            space_delimited,
        }
    }

    /// `request.auth.claims[a][b]...`: `path` is `["a", "b"]`.
    pub fn claim(&self, path: &[&str]) -> Claim<'_> {
        let mut v = &self.claims;
        for p in path {
            match v.get(p) {
                Some(next) => v = next,
                None => return Claim::Missing,
            }
        }
        let split = path.len() == 1 && self.space_delimited.iter().any(|c| c == path[0]);
        match v {
            Value::String(s) if split => {
                Claim::Values(s.split(' ').filter(|p| !p.is_empty()).collect())
            }
            Value::String(s) => Claim::Values(vec![s.as_str()]),
            Value::Array(items) => items
                .iter()
                .map(Value::as_str)
                .collect::<Option<Vec<_>>>()
                .map_or(Claim::Unsupported, Claim::Values),
            _ => Claim::Unsupported,
        }
    }
}

/// Where a provider looks for its token.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Location<'a> {
    Header { name: &'a str, prefix: &'a str },
    Param(&'a str),
    Cookie(&'a str),
}

fn locations(rule: &JwtRule) -> Vec<Location<'_>> {
    let mut l: Vec<Location> = rule
        .from_headers
        .iter()
        .map(|h| Location::Header {
            name: &h.name,
            prefix: &h.prefix,
        })
        .collect();
    l.extend(rule.from_params.iter().map(|p| Location::Param(p)));
    l.extend(rule.from_cookies.iter().map(|c| Location::Cookie(c)));
    if l.is_empty() {
        l = vec![
            Location::Header {
                name: DEFAULT_HEADER,
                prefix: DEFAULT_PREFIX,
            },
            Location::Param(DEFAULT_PARAM),
        ];
    }
    l
}

/// The tokens at one location.
fn extract(loc: &Location, headers: &HeaderMap, query: Option<&str>) -> Vec<String> {
    match loc {
        Location::Header { name, prefix } => headers
            .get_all(*name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .filter_map(|v| {
                // The scheme is case-insensitive (RFC 7235): `bearer x` is `Bearer x`.
                let rest = if prefix.is_empty() {
                    Some(v)
                } else {
                    v.get(..prefix.len())
                        .filter(|p| p.eq_ignore_ascii_case(prefix))
                        .map(|_| &v[prefix.len()..])
                };
                rest.map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(str::to_string)
            })
            .collect(),
        Location::Param(name) => query
            .into_iter()
            .flat_map(|q| q.split('&'))
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.to_string())
            .collect(),
        Location::Cookie(name) => headers
            .get_all(COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|c| c.trim().split_once('='))
            .filter(|(k, v)| k == name && !v.is_empty())
            .map(|(_, v)| v.to_string())
            .collect(),
    }
}

/// Authenticates the request under the RequestAuthentications that attach to its
/// target: `Ok(None)` without a token, `Ok(Some)` with verified ones (the first gives
/// the principal), `Err` when one does not verify. Headers are rewritten for the
/// backend: outputs set (client-sent values of those headers removed first, as Envoy),
/// verified tokens removed from their header unless `forwardOriginalToken`.
pub fn authenticate(
    policies: &[&RequestAuthentication],
    store: &JwksStore,
    headers: &mut HeaderMap,
    query: Option<&str>,
) -> Result<Option<RequestAuth>, Failure> {
    let rules: Vec<&JwtRule> = policies.iter().flat_map(|p| p.jwt_rules.iter()).collect();
    for r in &rules {
        for h in std::iter::once(r.output_payload_to_header.as_str())
            .chain(r.output_claim_to_headers.iter().map(|c| c.header.as_str()))
        {
            if !h.is_empty() {
                headers.remove(h);
            }
        }
    }
    // A stand-in for an unreadable RequestAuthentication: no token can be trusted.
    if policies.iter().any(|p| p.reject_tokens) {
        let defaults = [
            Location::Header {
                name: DEFAULT_HEADER,
                prefix: DEFAULT_PREFIX,
            },
            Location::Param(DEFAULT_PARAM),
        ];
        if defaults
            .iter()
            .any(|l| !extract(l, headers, query).is_empty())
        {
            return Err(Failure::Signature);
        }
    }
    let mut locs: Vec<Location> = Vec::new();
    for r in &rules {
        for l in locations(r) {
            if !locs.contains(&l) {
                locs.push(l);
            }
        }
    }
    let mut found: Vec<(Location, String)> = Vec::new();
    for l in locs {
        for t in extract(&l, headers, query) {
            found.push((l.clone(), t));
        }
    }
    let mut first: Option<RequestAuth> = None;
    let mut outputs: Vec<(HeaderName, HeaderValue)> = Vec::new();
    let mut remove: Vec<&str> = Vec::new();
    for (loc, token) in &found {
        let (rule, claims) = verify_token(&rules, loc, token, store)?;
        let mut space_delimited = vec!["scope".to_string(), "permission".to_string()];
        space_delimited.extend(rule.space_delimited_claims.iter().cloned());
        if !rule.output_payload_to_header.is_empty() {
            // The payload as the token carries it: base64url.
            if let (Ok(n), Some(Ok(v))) = (
                HeaderName::from_bytes(rule.output_payload_to_header.as_bytes()),
                token.split('.').nth(1).map(HeaderValue::from_str),
            ) {
                outputs.push((n, v));
            }
        }
        for c in &rule.output_claim_to_headers {
            let mut v = &claims;
            let mut found = true;
            for p in c.claim.split('.') {
                match v.get(p) {
                    Some(next) => v = next,
                    None => found = false,
                }
            }
            let text = match v {
                _ if !found => None,
                Value::String(s) => Some(s.clone()),
                Value::Number(n) => Some(n.to_string()),
                Value::Bool(b) => Some(b.to_string()),
                _ => None,
            };
            if let (Ok(n), Some(Ok(v))) = (
                HeaderName::from_bytes(c.header.as_bytes()),
                text.map(|t| HeaderValue::from_str(&t)),
            ) {
                outputs.push((n, v));
            }
        }
        if let (Location::Header { name, .. }, false) = (loc, rule.forward_original_token) {
            remove.push(name);
        }
        if first.is_none() {
            first = Some(RequestAuth::new(claims, space_delimited));
        }
    }
    for name in remove {
        headers.remove(name);
    }
    for (n, v) in outputs {
        headers.insert(n, v);
    }
    Ok(first)
}

/// A token found at `loc`: verified by the first provider of its issuer that reads
/// that location and accepts it.
fn verify_token<'r>(
    rules: &[&'r JwtRule],
    loc: &Location,
    token: &str,
    store: &JwksStore,
) -> Result<(&'r JwtRule, Value), Failure> {
    let parts: Vec<&str> = token.split('.').collect();
    if parts.len() != 3 {
        return Err(Failure::BadFormat);
    }
    let payload = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(parts[1].trim_end_matches('='))
        .map_err(|_| Failure::BadFormat)?;
    let unverified: Value = serde_json::from_slice(&payload).map_err(|_| Failure::BadFormat)?;
    check_claim_types(&unverified)?;
    let iss = unverified
        .get("iss")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let mut last = Failure::UnknownIssuer;
    for rule in rules
        .iter()
        .filter(|r| r.issuer == iss && locations(r).contains(loc))
    {
        match verify_with(rule, token, store) {
            Ok(claims) => return Ok((rule, claims)),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn verify_with(rule: &JwtRule, token: &str, store: &JwksStore) -> Result<Value, Failure> {
    let header = jsonwebtoken::decode_header(token).map_err(|_| Failure::BadFormat)?;
    let set: std::sync::Arc<JwkSet> = match &rule.jwks.0 {
        Some(set) => set.clone(),
        None => rule
            .jwks_source()
            .and_then(|src| store.keys(&src))
            .ok_or(Failure::JwksNotFetched)?,
    };
    let keys: Vec<&Jwk> = set
        .keys
        .iter()
        .filter(|k| {
            header.kid.is_none() || k.common.key_id.is_none() || k.common.key_id == header.kid
        })
        .filter(|k| {
            k.common
                .key_algorithm
                .is_none_or(|a| format!("{a:?}") == format!("{:?}", header.alg))
        })
        .collect();
    if keys.is_empty() {
        return Err(Failure::NoMatchingKey);
    }
    // jsonwebtoken checks only the signature: its claim checks pass a token whose `aud`
    // is missing or whose `exp` is not an unsigned integer, so `check_claims` does
    // Envoy's, once the signature holds.
    let mut v = Validation::new(header.alg);
    v.required_spec_claims = HashSet::new();
    v.validate_exp = false;
    v.validate_nbf = false;
    v.validate_aud = false;
    let mut last = Failure::Signature;
    for k in keys {
        let Ok(dk) = DecodingKey::from_jwk(k) else {
            continue;
        };
        match jsonwebtoken::decode::<Value>(token, &dk, &v) {
            Ok(data) => return check_claims(rule, data.claims, now_seconds()),
            Err(e) => match e.kind() {
                ErrorKind::InvalidSignature
                | ErrorKind::InvalidAlgorithm
                | ErrorKind::InvalidKeyFormat
                | ErrorKind::InvalidRsaKey(_)
                | ErrorKind::InvalidEcdsaKey => last = Failure::Signature,
                _ => last = Failure::BadFormat,
            },
        }
    }
    Err(last)
}

fn now_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default()
}

/// Envoy's payload parse (jwt_verify_lib `Jwt::parseFromString`): `iss`, `sub`, `jti`
/// strings, `iat`, `nbf`, `exp` non-negative integers, `aud` a string or a list of
/// strings, each when present; anything else refuses the token (401).
fn check_claim_types(claims: &Value) -> Result<(), Failure> {
    let Some(obj) = claims.as_object() else {
        return Err(Failure::BadFormat);
    };
    for name in ["iss", "sub", "jti"] {
        if obj.get(name).is_some_and(|v| !v.is_string()) {
            return Err(Failure::ClaimNotString(name));
        }
    }
    for name in ["iat", "nbf", "exp"] {
        if let Some(v) = obj.get(name) {
            numeric_date(name, v)?;
        }
    }
    match obj.get("aud") {
        None | Some(Value::String(_)) => Ok(()),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(Failure::AudNotString),
    }
}

/// A NumericDate claim as Envoy reads it: a JSON number, whole seconds, in u64's range.
fn numeric_date(name: &'static str, v: &Value) -> Result<u64, Failure> {
    let Some(n) = v.as_number() else {
        return Err(Failure::ClaimNotInteger(name));
    };
    if let Some(u) = n.as_u64() {
        return Ok(u);
    }
    match n.as_f64() {
        Some(f) if f >= 0.0 && f < u64::MAX as f64 => Ok(f as u64),
        _ => Err(Failure::ClaimOutOfRange(name)),
    }
}

/// The checks after the signature, as Envoy's jwt_authn makes them: `nbf` and `exp`
/// with its clock skew (0 means unset, as Envoy), then the audiences: when the rule
/// lists some, the token must name one of them; a token without `aud` names none.
fn check_claims(rule: &JwtRule, claims: Value, now: u64) -> Result<Value, Failure> {
    check_claim_types(&claims)?;
    let date = |name: &'static str| claims.get(name).map(|v| numeric_date(name, v)).transpose();
    if let Some(nbf) = date("nbf")?.filter(|&n| n > 0) {
        if now.saturating_add(CLOCK_SKEW_SECONDS) < nbf {
            return Err(Failure::NotYetValid);
        }
    }
    if let Some(exp) = date("exp")?.filter(|&e| e > 0) {
        if now > exp.saturating_add(CLOCK_SKEW_SECONDS) {
            return Err(Failure::Expired);
        }
    }
    if !rule.audiences.is_empty() {
        let named: Vec<&str> = match claims.get("aud") {
            Some(Value::String(a)) => vec![a.as_str()],
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        if !named.iter().any(|a| {
            rule.audiences
                .iter()
                .any(|want| sanitize_audience(want) == sanitize_audience(a))
        }) {
            return Err(Failure::Audience);
        }
    }
    Ok(claims)
}

/// Envoy compares audiences without an `http://` or `https://` prefix and one trailing
/// slash (jwt_verify_lib `CheckAudience`).
fn sanitize_audience(aud: &str) -> &str {
    let a = aud
        .strip_prefix("http://")
        .or_else(|| aud.strip_prefix("https://"))
        .unwrap_or(aud);
    a.strip_suffix('/').unwrap_or(a)
}
