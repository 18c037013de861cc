//! Which DestinationRule applies to a Service the waypoint sends to, as Istio's
//! `PushContext.destinationRule` picks it for the waypoint proxy (`super`'s docs).

use std::sync::Arc;

use ztunnel::state::Service;

use super::policy::{Policy, Resolved};
use super::spec::DestinationRule;

impl DestinationRule {
    fn exports(&self, to: &str) -> bool {
        self.export_to.iter().any(|e| e == to)
    }

    /// In Istio's namespace-local index: seen by a proxy of its own namespace.
    fn visible_in_own_namespace(&self) -> bool {
        self.export_to.is_empty()
            || self.exports("*")
            || self.exports(".")
            || self.exports(&self.namespace)
    }

    /// Exported to its own namespace only (Istio's `isPrivateOnly`, the set of
    /// `exportTo` values being `.` or the rule's namespace alone).
    fn private_only(&self) -> bool {
        let mut set: Vec<&str> = self.export_to.iter().map(String::as_str).collect();
        set.sort_unstable();
        set.dedup();
        set.len() == 1 && (set[0] == "." || set[0] == self.namespace)
    }

    /// Exported to a proxy of namespace `ns` (a rule of another namespace).
    fn exported_to(&self, ns: &str) -> bool {
        self.export_to.is_empty() || self.exports("*") || self.exports(ns)
    }

    /// How well `host` names the Service: 2 for its hostname (or short name in the
    /// rule's namespace), 1 for a wildcard suffix (longer suffixes are compared by the
    /// caller), None when it does not.
    fn matches(&self, svc: &Service) -> Option<(u8, usize)> {
        let host = self.host.to_ascii_lowercase();
        let short = format!("{host}.{}.svc.", self.namespace);
        if svc.hostname.eq_ignore_ascii_case(&host)
            || (!host.contains('.') && svc.hostname.to_ascii_lowercase().starts_with(&short))
        {
            return Some((2, host.len()));
        }
        if host == "*" {
            return Some((1, 0));
        }
        let suffix = host.strip_prefix('*')?;
        svc.hostname
            .to_ascii_lowercase()
            .ends_with(suffix)
            .then_some((1, suffix.len()))
    }
}

/// Who looks a rule up: Istio's proxy `ConfigNamespace` (the waypoint's own namespace)
/// and the mesh's root namespace.
#[derive(Clone, Copy, Debug)]
pub struct Client<'a> {
    pub namespace: &'a str,
    pub root_namespace: &'a str,
}

/// The rule for traffic from `client` to `svc`, as Istio's `PushContext.destinationRule`
/// picks it (module docs): the client's namespace, then the Service's namespace for
/// rules exported to the client, then the root namespace's likewise. A rule of any other
/// namespace never applies, so one tenant cannot throttle or weaken another's traffic.
pub fn rule_for<'r>(
    rules: &'r [(DestinationRule, Resolved)],
    client: Client<'_>,
    svc: &Service,
) -> Option<&'r Resolved> {
    let in_ns = |ns: &str| -> Vec<&'r (DestinationRule, Resolved)> {
        rules.iter().filter(|(r, _)| r.namespace == ns).collect()
    };
    // 1. The client's own namespace: every rule it can see there (Istio's namespace-local
    // index; from the root namespace, only the root's private rules, as Istio does).
    let own: Vec<_> = if client.namespace != client.root_namespace {
        in_ns(client.namespace)
            .into_iter()
            .filter(|(r, _)| r.visible_in_own_namespace())
            .collect()
    } else {
        in_ns(client.namespace)
            .into_iter()
            .filter(|(r, _)| r.private_only())
            .collect()
    };
    if let Some(found) = first_refused_or_first(most_specific(&own, svc)) {
        return Some(&found.1);
    }
    // 2. and 3. The Service's namespace, then the root's: the most specific host among
    // the rules they export, kept only when exported to the client.
    for ns in [svc.namespace.as_str(), client.root_namespace] {
        let exported: Vec<_> = in_ns(ns)
            .into_iter()
            .filter(|(r, _)| !r.private_only())
            .collect();
        let best = most_specific(&exported, svc);
        let exported: Vec<_> = best
            .into_iter()
            .filter(|r| r.0.exported_to(client.namespace))
            .collect();
        if let Some(found) = first_refused_or_first(exported) {
            return Some(&found.1);
        }
    }
    None
}

/// Among rules equally specific for a Service: one that cannot be applied (its host
/// fails), else the first listed. Istio merges such rules; failing closed when any of
/// them cannot be applied keeps the outcome from depending on the rules' names.
fn first_refused_or_first(
    rules: Vec<&(DestinationRule, Resolved)>,
) -> Option<&(DestinationRule, Resolved)> {
    let refused = rules
        .iter()
        .copied()
        .find(|r| r.1.policies().any(|p| p.refused.is_some()));
    refused.or(rules.first().copied())
}

/// How specifically a rule's host matches a service (greater: more specific).
type HostRank = (u8, usize);

/// The rules among `rules` for the most specific host that matches `svc` (an exact
/// hostname over wildcards, a longer wildcard over a shorter one), in listed order.
fn most_specific<'r>(
    rules: &[&'r (DestinationRule, Resolved)],
    svc: &Service,
) -> Vec<&'r (DestinationRule, Resolved)> {
    let ranked: Vec<(HostRank, &'r (DestinationRule, Resolved))> = rules
        .iter()
        .filter_map(|r| Some((r.0.matches(svc)?, *r)))
        .collect();
    let Some(best) = ranked.iter().map(|(rank, _)| *rank).max() else {
        return Vec::new();
    };
    ranked
        .into_iter()
        .filter(|(rank, _)| *rank == best)
        .map(|(_, r)| r)
        .collect()
}

/// The policy for traffic from `client` to `port` of `svc` (or of its `subset`), if a rule has one.
pub fn for_service<'r>(
    rules: &'r [(DestinationRule, Resolved)],
    client: Client<'_>,
    svc: &Service,
    port: u16,
    subset: Option<&str>,
) -> Option<&'r Arc<Policy>> {
    rule_for(rules, client, svc)?.policy(subset, port)
}
