//! What serde cannot check in a RequestAuthentication. Errors start with the field path
//! relative to the object, e.g. `jwtRules[0].jwksUri: ...`.

use super::model::{JwtRule, RequestAuthentication};
use crate::object::{ref_kind, ObjectRef};

impl RequestAuthentication {
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name: must not be empty".into());
        }
        if self.namespace.is_empty() {
            return Err("namespace: must not be empty".into());
        }
        if self.target_refs.is_empty() {
            return Err("targetRefs: required: the waypoint applies only RequestAuthentications that target its Gateway, \
                        a Service or (from the root namespace) the GatewayClass istio-waypoint"
                .into());
        }
        for (i, r) in self.target_refs.iter().enumerate() {
            validate_target_ref(r, &self.namespace).map_err(|e| format!("targetRefs[{i}].{e}"))?;
        }
        for (i, rule) in self.jwt_rules.iter().enumerate() {
            rule.validate().map_err(|e| format!("jwtRules[{i}].{e}"))?;
        }
        Ok(())
    }
}

fn validate_target_ref(r: &ObjectRef, namespace: &str) -> Result<(), String> {
    if ref_kind(r).is_none() {
        return Err(format!(
            "kind: {:?} (group {:?}) is not supported: the waypoint applies RequestAuthentications that target a \
             Service, a ServiceEntry, its Gateway or the GatewayClass istio-waypoint",
            r.kind.as_deref().unwrap_or_default(),
            r.group.as_deref().unwrap_or_default()
        ));
    }
    if r.name.is_empty() {
        return Err("name: must not be empty".into());
    }
    if let Some(ns) = r.namespace.as_deref().filter(|ns| *ns != namespace) {
        return Err(format!("namespace: {ns:?} differs from the object's namespace {namespace:?} (Istio requires its own)"));
    }
    if r.port.is_some() || r.section_name.is_some() {
        return Err("port/sectionName: RequestAuthentication targetRefs have neither".into());
    }
    Ok(())
}

impl JwtRule {
    fn validate(&self) -> Result<(), String> {
        if self.issuer.is_empty() {
            return Err("issuer: must not be empty".into());
        }
        for (i, a) in self.audiences.iter().enumerate() {
            if a.is_empty() {
                return Err(format!("audiences[{i}]: must not be empty"));
            }
        }
        if let Some(set) = &self.jwks.0 {
            if set.keys.is_empty() {
                return Err("jwks: has no keys".into());
            }
        } else if self.jwks_uri.is_empty() {
            // OpenID discovery: the issuer must be a URL to find its configuration at.
            check_uri(&self.issuer).map_err(|e| format!("jwksUri: required unless jwks is set or the issuer is a URL for OpenID discovery: issuer {e}"))?;
        } else {
            check_uri(&self.jwks_uri).map_err(|e| format!("jwksUri: {e}"))?;
        }
        for (i, h) in self.from_headers.iter().enumerate() {
            check_header(&h.name).map_err(|e| format!("fromHeaders[{i}].name: {e}"))?;
        }
        for (i, p) in self.from_params.iter().enumerate() {
            if p.is_empty() {
                return Err(format!("fromParams[{i}]: must not be empty"));
            }
        }
        for (i, c) in self.from_cookies.iter().enumerate() {
            if c.is_empty() || c.contains(['=', ';', ' ']) {
                return Err(format!("fromCookies[{i}]: {c:?} is not a cookie name"));
            }
        }
        if !self.output_payload_to_header.is_empty() {
            check_header(&self.output_payload_to_header)
                .map_err(|e| format!("outputPayloadToHeader: {e}"))?;
        }
        for (i, c) in self.output_claim_to_headers.iter().enumerate() {
            check_header(&c.header)
                .map_err(|e| format!("outputClaimToHeaders[{i}].header: {e}"))?;
            if c.claim.is_empty() {
                return Err(format!(
                    "outputClaimToHeaders[{i}].claim: must not be empty"
                ));
            }
        }
        if let Some(t) = &self.timeout {
            parse_timeout(t).map_err(|e| format!("timeout: {e}"))?;
        }
        Ok(())
    }

    /// The jwksUri fetch timeout: the rule's, else Istio's 5 s.
    pub fn fetch_timeout(&self) -> std::time::Duration {
        self.timeout
            .as_deref()
            .and_then(|t| parse_timeout(t).ok())
            .unwrap_or(std::time::Duration::from_secs(5))
    }
}

fn check_uri(v: &str) -> Result<(), String> {
    let uri: http::Uri = v.parse().map_err(|e| format!("{v:?} is not a URI: {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some_and(|h| !h.is_empty()) => Ok(()),
        _ => Err(format!(
            "{v:?} must be an http:// or https:// URL with a host"
        )),
    }
}

fn check_header(name: &str) -> Result<(), String> {
    // Pseudo-headers and hop-by-hop headers could not carry a token to or from here.
    if name.starts_with(':') {
        return Err(format!("{name:?}: pseudo-headers are not supported"));
    }
    http::HeaderName::from_bytes(name.as_bytes())
        .map(|_| ())
        .map_err(|_| format!("{name:?} is not a valid header name"))
}

/// `1.5s`, `500ms`, `2m` as in Istio (protobuf Duration in YAML).
fn parse_timeout(v: &str) -> Result<std::time::Duration, String> {
    let (num, unit) = v
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or((v, ""), |i| v.split_at(i));
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{v:?} is not a duration such as \"5s\""))?;
    let secs = match unit {
        "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        _ => return Err(format!("{v:?} is not a duration such as \"5s\"")),
    };
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(format!("{v:?} must be more than 0 and at most 1h"));
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}
