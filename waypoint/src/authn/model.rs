//! The RequestAuthentication model, as the config file and the Kubernetes API write it.

use std::sync::Arc;

use jsonwebtoken::jwk::JwkSet;
use serde::Deserialize;

use crate::object::{applies, place_widely, ObjectRef, Target};

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RequestAuthentication {
    pub name: String,
    pub namespace: String,
    #[serde(default)]
    pub target_refs: Vec<ObjectRef>,
    #[serde(default)]
    pub jwt_rules: Vec<JwtRule>,
    /// Set on the stand-in for a RequestAuthentication that could not be read
    /// (`reject_all`): every token in a default location is refused.
    #[serde(skip)]
    pub reject_tokens: bool,
    /// The stand-in's targets could not all be placed: it covers all its namespace may target.
    #[serde(skip)]
    pub unplaced: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtRule {
    pub issuer: String,
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Fetched by the waypoint (`JwksStore`); ignored when `jwks` is set, as in Istio.
    #[serde(default)]
    pub jwks_uri: String,
    /// An inline JSON Web Key Set, parsed once when the config is read.
    #[serde(default)]
    pub jwks: InlineJwks,
    #[serde(default)]
    pub from_headers: Vec<JwtHeader>,
    #[serde(default)]
    pub from_params: Vec<String>,
    #[serde(default)]
    pub from_cookies: Vec<String>,
    #[serde(default)]
    pub output_payload_to_header: String,
    #[serde(default)]
    pub output_claim_to_headers: Vec<ClaimToHeader>,
    #[serde(default)]
    pub forward_original_token: bool,
    /// Top-level string claims matched as space-separated lists, besides Istio's
    /// `scope` and `permission`.
    #[serde(default)]
    pub space_delimited_claims: Vec<String>,
    /// The jwksUri fetch timeout (Istio's duration form, e.g. `5s`); default 5 s.
    #[serde(default)]
    pub timeout: Option<String>,
}

/// `jwks`: written as a JSON string, as in Istio's CRD.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InlineJwks(pub Option<Arc<JwkSet>>);

impl InlineJwks {
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }
}

impl<'de> Deserialize<'de> for InlineJwks {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() {
            return Ok(InlineJwks(None));
        }
        let set: JwkSet = serde_json::from_str(&s)
            .map_err(|e| serde::de::Error::custom(format!("not a JSON Web Key Set: {e}")))?;
        Ok(InlineJwks(Some(Arc::new(set))))
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtHeader {
    pub name: String,
    /// Stripped from the value before the token (e.g. `Bearer `); the value must start with it.
    #[serde(default)]
    pub prefix: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClaimToHeader {
    pub header: String,
    /// A top-level claim, or a nested one written `a.b`.
    pub claim: String,
}

/// How a rule without `jwks` or `jwksUri` names its key source in `JwksStore`: OpenID
/// discovery from the issuer (`<issuer>/.well-known/openid-configuration`'s `jwks_uri`).
pub const DISCOVERY_PREFIX: &str = "openid:";

impl JwtRule {
    /// What `JwksStore` fetches for this rule (None with inline `jwks`): its `jwksUri`,
    /// else discovery from its issuer.
    pub fn jwks_source(&self) -> Option<String> {
        if !self.jwks.is_empty() {
            None
        } else if !self.jwks_uri.is_empty() {
            Some(self.jwks_uri.clone())
        } else {
            Some(format!("{DISCOVERY_PREFIX}{}", self.issuer))
        }
    }
}

/// Where a token may be: Istio's default when a rule names no location.
pub(super) const DEFAULT_HEADER: &str = "authorization";
pub(super) const DEFAULT_PREFIX: &str = "Bearer ";
pub(super) const DEFAULT_PARAM: &str = "access_token";

impl RequestAuthentication {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Whether it attaches to the request's target, as an AuthorizationPolicy does
    /// (`object::attaches`); a stand-in whose targets could not be placed covers all
    /// its namespace could target.
    pub fn applies_to(&self, target: &Target) -> bool {
        applies(&self.namespace, &self.target_refs, self.unplaced, target)
    }

    /// What stands in for a RequestAuthentication the waypoint cannot read: since it can
    /// no longer tell a good token from a bad one for these targets, every token in the
    /// default locations is refused (401) and requests without one pass on. Dropping it
    /// instead would let any token through unverified to a DENY on `requestPrincipals`.
    /// Targets are placed as for an unenforceable AuthorizationPolicy.
    pub fn reject_all(namespace: &str, name: &str, refs: &[ObjectRef]) -> RequestAuthentication {
        let (target_refs, unplaced) = place_widely(namespace, refs);
        RequestAuthentication {
            name: name.into(),
            namespace: namespace.into(),
            target_refs,
            jwt_rules: Vec::new(),
            reject_tokens: true,
            unplaced,
        }
    }
}
