//! `meshConfig.trustDomain` and `trustDomainAliases`, applied to policies as istiod
//! applies them to Istio's waypoint (`trustdomain.Bundle.ReplaceTrustDomainAliases`, in
//! `MigrateTrustDomain`): a `source.principals` / `notPrincipals` value, or a
//! `source.principal` condition value, whose trust domain is the mesh's, one of its
//! aliases, or `cluster.local` (which stands for the local trust domain) is replaced by
//! the same identity in every one of them. So after a trust-domain migration a policy
//! written for `old-td/ns/a/sa/b` still matches `new-td/ns/a/sa/b`. A principal of any
//! other trust domain, one whose trust domain is `*`, and one that is not
//! `<td>/ns/<ns>/sa/<sa>` are kept as written.

use super::model::{AuthorizationPolicy, Key};

/// Istio's default trust domain, and the name that stands for the local one.
pub const CLUSTER_LOCAL: &str = "cluster.local";

/// The mesh's trust domain first, then its aliases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    trust_domains: Vec<String>,
}

impl Default for Bundle {
    fn default() -> Self {
        Bundle::new(CLUSTER_LOCAL, &[])
    }
}

impl Bundle {
    pub fn new(trust_domain: &str, aliases: &[String]) -> Bundle {
        let mut trust_domains = vec![trust_domain.to_string()];
        trust_domains.extend(aliases.iter().cloned());
        Bundle { trust_domains }
    }

    /// Istio's `ReplaceTrustDomainAliases`.
    pub fn replace(&self, principals: &[String]) -> Vec<String> {
        let mut out = Vec::with_capacity(principals.len());
        for p in principals {
            let parts: Vec<&str> = p.split('/').collect();
            // Not `<td>/ns/<ns>/sa/<sa>`, or a trust domain of `*`: not enforced.
            if parts.len() != 5 || parts[0] == "*" {
                out.push(p.clone());
                continue;
            }
            let td = parts[0];
            if !(string_match(td, &self.trust_domains) || td == CLUSTER_LOCAL) {
                out.push(p.clone());
                continue;
            }
            let rest = parts[1..].join("/");
            let mut mine: Vec<String> = Vec::new();
            for t in &self.trust_domains {
                // A `*`-prefixed trust domain matching the principal's keeps it as written.
                let new = if suffix_match(t, td) {
                    p.clone()
                } else {
                    format!("{t}/{rest}")
                };
                if !mine.contains(&new) {
                    mine.push(new);
                }
            }
            out.extend(mine);
        }
        out
    }

    /// Rewrites every principal of `policy` (see the module's text).
    pub fn apply(&self, policy: &mut AuthorizationPolicy) {
        for rule in &mut policy.rules {
            for from in &mut rule.from {
                let s = &mut from.source;
                if !s.principals.is_empty() {
                    s.principals = self.replace(&s.principals);
                }
                if !s.not_principals.is_empty() {
                    s.not_principals = self.replace(&s.not_principals);
                }
            }
            for c in &mut rule.when {
                if matches!(super::model::parse_key(&c.key), Ok(Key::SourcePrincipal)) {
                    if !c.values.is_empty() {
                        c.values = self.replace(&c.values);
                    }
                    if !c.not_values.is_empty() {
                        c.not_values = self.replace(&c.not_values);
                    }
                }
            }
        }
    }
}

/// Istio's `stringMatch` of trust domains: the pattern may be on either side.
fn string_match(a: &str, list: &[String]) -> bool {
    list.iter().any(|s| {
        a == s
            || s == "*"
            || prefix_match(a, s)
            || prefix_match(s, a)
            || suffix_match(a, s)
            || suffix_match(s, a)
    })
}

fn prefix_match(a: &str, pattern: &str) -> bool {
    pattern.strip_suffix('*').is_some_and(|p| a.starts_with(p))
}

fn suffix_match(a: &str, pattern: &str) -> bool {
    pattern.strip_prefix('*').is_some_and(|p| a.ends_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    /// Istio's own cases (`bundle_test.go`), as istiod writes them into Envoy's RBAC.
    #[test]
    fn principals_follow_the_trust_domain_and_its_aliases_as_istio_replaces_them() {
        let b = Bundle::new("td1", &v(&["cluster.local"]));
        assert_eq!(
            b.replace(&v(&["cluster.local/ns/foo/sa/bar"])),
            v(&["td1/ns/foo/sa/bar", "cluster.local/ns/foo/sa/bar"])
        );
        // `cluster.local` stands for the local trust domain even when it is no alias.
        let b = Bundle::new("td1", &[]);
        assert_eq!(
            b.replace(&v(&["cluster.local/ns/foo/sa/bar"])),
            v(&["td1/ns/foo/sa/bar"])
        );
        let b = Bundle::new("td1", &v(&["td2", "td3"]));
        assert_eq!(
            b.replace(&v(&["td2/ns/foo/sa/bar"])),
            v(&[
                "td1/ns/foo/sa/bar",
                "td2/ns/foo/sa/bar",
                "td3/ns/foo/sa/bar"
            ])
        );
        // Another trust domain, `*`, and what is not a SPIFFE path are kept as written.
        assert_eq!(
            b.replace(&v(&["other/ns/foo/sa/bar", "*/ns/foo/sa/bar", "foo", "*"])),
            v(&["other/ns/foo/sa/bar", "*/ns/foo/sa/bar", "foo", "*"])
        );
        // A wildcard trust domain in the principal matches the list; the one it matches
        // keeps it as written.
        let b = Bundle::new("new-td", &v(&["old-td"]));
        assert_eq!(
            b.replace(&v(&["*-td/ns/foo/sa/bar"])),
            v(&["*-td/ns/foo/sa/bar"])
        );
        assert_eq!(
            b.replace(&v(&["*td/ns/foo/sa/bar"])),
            v(&["*td/ns/foo/sa/bar"])
        );
    }

    /// A policy's principals and `source.principal` conditions are rewritten; its other
    /// fields and keys are not.
    #[test]
    fn a_policys_principals_are_rewritten_and_nothing_else() {
        let mut p: AuthorizationPolicy = serde_yaml::from_str(
            "{name: p, namespace: default, rules: [{from: [{source: {principals: [old-td/ns/a/sa/b], notPrincipals: [old-td/ns/a/sa/c], namespaces: [a]}}],
              when: [{key: source.principal, values: [old-td/ns/a/sa/b]}, {key: \"request.headers[x]\", values: [old-td/ns/a/sa/b]}]}]}",
        )
        .unwrap();
        Bundle::new("new-td", &v(&["old-td"])).apply(&mut p);
        let s = &p.rules[0].from[0].source;
        assert_eq!(s.principals, v(&["new-td/ns/a/sa/b", "old-td/ns/a/sa/b"]));
        assert_eq!(
            s.not_principals,
            v(&["new-td/ns/a/sa/c", "old-td/ns/a/sa/c"])
        );
        assert_eq!(s.namespaces, v(&["a"]));
        assert_eq!(
            p.rules[0].when[0].values,
            v(&["new-td/ns/a/sa/b", "old-td/ns/a/sa/b"])
        );
        assert_eq!(p.rules[0].when[1].values, v(&["old-td/ns/a/sa/b"]));
    }
}
