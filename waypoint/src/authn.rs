//! Istio `RequestAuthentication` (JWT) with `targetRefs`, checked by the waypoint per
//! request before authorization.
//!
//! Semantics (Istio's, as its Envoy config builds them): the `jwtRules` of every
//! RequestAuthentication that attaches to the request's target are one set of
//! providers. Each token found in a provider's locations (`fromHeaders`, `fromParams`,
//! `fromCookies`; by default `Authorization: Bearer` and the `access_token` parameter)
//! must verify with a provider of its issuer that reads that location: signature by a
//! key of the provider's JWKS, `exp`/`nbf` (60 s of clock skew), `aud` when the provider
//! lists audiences. A request with no token passes on unauthenticated (policy decides);
//! one with a token that does not verify is answered 401 (403 for a wrong audience,
//! as Envoy), whatever the policies say. A verified token makes the request principal
//! `<iss>/<sub>` and its claims available to AuthorizationPolicy, may be copied to
//! headers (`outputPayloadToHeader`, `outputClaimToHeaders`) and is removed from its
//! header unless `forwardOriginalToken`.
//!
//! Keys come from the inline `jwks` or from `jwksUri`, fetched by `jwks::JwksStore`
//! (with a timeout, refreshed periodically, the last good keys kept while the server
//! is unreachable); until the first fetch succeeds, tokens of that provider fail.

mod jwks;
mod model;
mod validate;
mod verify;

pub use jwks::{JwksSettings, JwksStore};
pub use model::{ClaimToHeader, JwtHeader, JwtRule, RequestAuthentication};
pub use verify::{authenticate, Claim, Failure, RequestAuth};

#[cfg(test)]
mod tests;
