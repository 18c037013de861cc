//! AuthorizationPolicy action CUSTOM: the requests a CUSTOM policy's rules match are
//! checked with an external authorizer, a meshConfig `extensionProvider`
//! (`envoyExtAuthzHttp` or `envoyExtAuthzGrpc`), before the DENY and ALLOW policies, as
//! Istio's waypoint (Envoy's ext_authz filter) does.
//!
//! Istio's rules, kept here: the CUSTOM policies of one target must all name one
//! provider; a provider that is missing, invalid or not an authorizer makes its
//! policies deny what they match ("deny due to bad CUSTOM action"), and so do
//! policies of a target with several providers. A check that cannot be made answers
//! `statusOnError` (403) unless the provider fails open.
//!
//! Opaque TCP (a port of unknown protocol whose bytes are not HTTP, a TCP port, a
//! TCPRoute): a gRPC provider checks the connection as Envoy's network ext_authz filter
//! does, once before any byte is relayed, with the peers' addresses and principals and no
//! request (`check::tcp_check_message`). An HTTP provider has no request to send, so a
//! CUSTOM policy with one that would check the connection denies it (fail closed).
//! Istio's waypoint instead leaves an HTTP provider out of its TCP chain; here that would
//! let a client skip the authorizer by making its request look opaque (a pause, padding).

pub mod check;
pub mod proto;
pub mod provider;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::authz::{self, AuthorizationPolicy};
pub use check::{CheckRequest, Decision};
pub use provider::{Checked, MeshConfig, Provider};

/// The mesh config's providers by name, each checked.
pub type Providers = Arc<BTreeMap<String, Checked>>;

/// What the CUSTOM policies of a target make of one request.
#[derive(Debug, PartialEq)]
pub enum Custom<'a> {
    /// No CUSTOM policy matches: no check.
    Skip,
    /// Check with this provider (`policy`: the first matching policy, for the log).
    Check {
        provider: &'a Provider,
        policy: String,
    },
    /// Denied without a check: the policy, and why its provider cannot be used.
    Deny { policy: String, reason: String },
}

/// Decides whether (and with whom) a request is checked, from the CUSTOM policies that
/// apply to its target.
pub fn decide<'a>(
    providers: &'a BTreeMap<String, Checked>,
    policies: &[&AuthorizationPolicy],
    req: &authz::Request,
) -> Custom<'a> {
    let matches = authz::custom_matches(policies.iter().copied(), req);
    decide_matched(providers, &matches, false)
}

/// As `decide`, for the TCP form of the policies (opaque traffic).
pub fn decide_tcp<'a>(
    providers: &'a BTreeMap<String, Checked>,
    tcp_policies: &[AuthorizationPolicy],
    req: &authz::Request,
) -> Custom<'a> {
    let matches = authz::custom_matches(tcp_policies.iter(), req);
    decide_matched(providers, &matches, true)
}

fn decide_matched<'a>(
    providers: &'a BTreeMap<String, Checked>,
    matches: &[(&AuthorizationPolicy, bool)],
    tcp: bool,
) -> Custom<'a> {
    let Some((first, _)) = matches.iter().find(|(_, m)| *m) else {
        return Custom::Skip;
    };
    let policy = first.key();
    let name = |p: &AuthorizationPolicy| {
        p.provider
            .as_ref()
            .map(|r| r.name.clone())
            .unwrap_or_default()
    };
    let mut names: Vec<String> = matches.iter().map(|(p, _)| name(p)).collect();
    names.sort();
    names.dedup();
    if names.len() > 1 {
        return Custom::Deny {
            policy,
            reason: format!("CUSTOM policies of one target name several providers ({}); Istio allows one per workload", names.join(", ")),
        };
    }
    let provider_name = name(first);
    match providers.get(&provider_name) {
        None => Custom::Deny { policy, reason: format!("provider {provider_name:?} is not among meshConfig extensionProviders") },
        Some(Err(e)) => Custom::Deny { policy, reason: format!("provider {provider_name:?} is invalid: {e}") },
        Some(Ok(Provider::NotAuthz(kind))) => {
            Custom::Deny { policy, reason: format!("provider {provider_name:?} is a {kind} provider, not an ext_authz one") }
        }
        // Fail closed: an HTTP authorizer has no request to be asked about.
        Some(Ok(Provider::Http(_))) if tcp => Custom::Deny {
            policy,
            reason: format!(
                "CUSTOM provider {provider_name:?} is an HTTP authorizer and cannot check opaque TCP; \
                 declare the port's protocol HTTP, use an envoyExtAuthzGrpc provider, or leave the port out of the policy"
            ),
        },
        Some(Ok(p)) => Custom::Check { provider: p, policy },
    }
}
