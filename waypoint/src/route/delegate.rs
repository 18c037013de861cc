//! VirtualService delegation, as istiod merges it before any proxy sees it
//! (`pilot/pkg/model/virtualservice.go` `MergeHTTPRoutes`, `virtualservice_controller.go`):
//! a root rule with `delegate: {name, namespace}` is replaced by the delegate
//! VirtualService's rules (one without `hosts`), each with its matches merged into the
//! root's and the root's rewrite, timeout, retries, fault, mirrors, CORS and headers where
//! it sets none. A delegate that is missing or not exported to the root's namespace drops
//! only that root rule; a delegate rule whose matches conflict with the root's (not a
//! subset of one of them) is dropped; a delegate's own `delegate` is not followed (Istio
//! merges one level). Short hostnames in a delegate are its own namespace's.

use std::collections::BTreeMap;

use super::virtual_service::{StringMatch, VirtualService, VsHttpRoute, VsMatch};

/// `root` with its delegate rules replaced by the merged rules of the delegates `find`
/// gives (by namespace and name), and why any rule was dropped.
pub fn merged<'a>(
    root: &VirtualService,
    find: impl Fn(&str, &str) -> Option<&'a VirtualService>,
) -> (VirtualService, Vec<String>) {
    let mut out = root.clone();
    let mut dropped = Vec::new();
    if !root.http.iter().any(|r| r.delegate.is_some()) {
        return (out, dropped);
    }
    out.http.clear();
    for (i, rule) in root.http.iter().enumerate() {
        let Some(d) = &rule.delegate else {
            out.http.push(rule.clone());
            continue;
        };
        let ns = d
            .namespace
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or(&root.namespace);
        let Some(child) = find(ns, &d.name).filter(|c| c.hosts.is_empty()) else {
            dropped.push(format!(
                "http[{i}].delegate: VirtualService {ns}/{} not found (or it has hosts)",
                d.name
            ));
            continue;
        };
        if !crate::object::exported_to(&child.export_to, &child.namespace, &root.namespace) {
            dropped.push(format!(
                "http[{i}].delegate: VirtualService {ns}/{} is not exported to {}",
                d.name, root.namespace
            ));
            continue;
        }
        for (j, sub) in child.http.iter().enumerate() {
            let Some(m) = merge_rule(rule, sub, &child.namespace) else {
                dropped.push(format!(
                    "http[{i}].delegate: rule {j} of {ns}/{} conflicts with the root's matches",
                    d.name
                ));
                continue;
            };
            // A delegated rule that does not convert fails closed on its own matches: the
            // delegate's author cannot take the root's other rules down with it.
            match m.to_rule(&root.namespace) {
                Ok(_) => out.http.push(m),
                Err(e) => {
                    let why = format!("delegate {ns}/{} rule {j}: {e}", d.name);
                    let closed = VsHttpRoute {
                        name: m.name.clone(),
                        matches: m.matches.clone(),
                        refused: Some(why.clone()),
                        ..VsHttpRoute::default()
                    };
                    if closed.to_rule(&root.namespace).is_ok() {
                        out.http.push(closed);
                    }
                    dropped.push(format!("http[{i}].{why}"));
                }
            }
        }
    }
    (out, dropped)
}

/// Istio's `mergeHTTPRoute`: None on a match conflict.
fn merge_rule(root: &VsHttpRoute, sub: &VsHttpRoute, sub_ns: &str) -> Option<VsHttpRoute> {
    let mut m = sub.clone();
    m.matches = merge_matches(&root.matches, &sub.matches)?;
    m.name = match (&root.name, &sub.name) {
        (r, None) => r.clone(),
        (Some(r), Some(s)) => Some(format!("{r}-{s}")),
        (None, s) => s.clone(),
    };
    // The delegate's destinations are named from its own namespace.
    for d in &mut m.route {
        d.destination.host = qualified(&d.destination.host, sub_ns);
    }
    for d in m
        .mirror
        .iter_mut()
        .chain(m.mirrors.iter_mut().map(|x| &mut x.destination))
    {
        d.host = qualified(&d.host, sub_ns);
    }
    macro_rules! inherit {
        ($($f:ident),*) => { $( if m.$f.is_none() { m.$f = root.$f.clone(); } )* };
    }
    inherit!(
        rewrite,
        direct_response,
        timeout,
        retries,
        fault,
        mirror,
        mirror_percent,
        mirror_percentage,
        cors_policy,
        headers
    );
    if m.mirrors.is_empty() {
        m.mirrors = root.mirrors.clone();
    }
    // Istio's TranslateRoute: a redirect, else a direct response, else the route.
    if m.redirect.is_some() {
        m.direct_response = None;
        m.route.clear();
    } else if m.direct_response.is_some() {
        m.route.clear();
    }
    // One level: a delegate's delegate is not followed.
    m.delegate = None;
    Some(m)
}

/// A short name (`reviews`) as the Service of namespace `ns` it names.
fn qualified(host: &str, ns: &str) -> String {
    if host.contains('.') || host.is_empty() {
        host.to_string()
    } else {
        format!("{host}.{ns}.svc.cluster.local")
    }
}

/// Istio's `mergeHTTPMatchRequests`: every delegate match must merge with at least one
/// root match it does not conflict with; None when one cannot (the rule is dropped).
fn merge_matches(root: &[VsMatch], sub: &[VsMatch]) -> Option<Vec<VsMatch>> {
    if root.is_empty() {
        return Some(sub.to_vec());
    }
    if sub.is_empty() {
        return Some(root.to_vec());
    }
    let mut out = Vec::new();
    for s in sub {
        let before = out.len();
        for r in root.iter().filter(|r| !conflict(r, s)) {
            out.push(merge_match(r, s));
        }
        if out.len() == before {
            return None;
        }
    }
    Some(out)
}

fn merge_match(root: &VsMatch, sub: &VsMatch) -> VsMatch {
    let mut m = sub.clone();
    m.name = match (&root.name, &sub.name) {
        (r, None) => r.clone(),
        (Some(r), Some(s)) => Some(format!("{r}-{s}")),
        (None, s) => s.clone(),
    };
    for (mine, theirs) in [
        (&mut m.uri, &root.uri),
        (&mut m.scheme, &root.scheme),
        (&mut m.method, &root.method),
        (&mut m.authority, &root.authority),
    ] {
        if mine.is_none() {
            *mine = theirs.clone();
        }
    }
    let under = |a: &BTreeMap<String, StringMatch>, b: &BTreeMap<String, StringMatch>| {
        let mut m = a.clone();
        m.extend(b.iter().map(|(k, v)| (k.clone(), v.clone())));
        m
    };
    m.headers = under(&root.headers, &sub.headers);
    m.without_headers = under(&root.without_headers, &sub.without_headers);
    m.query_params = under(&root.query_params, &sub.query_params);
    let mut labels = root.source_labels.clone();
    labels.extend(sub.source_labels.clone());
    m.source_labels = labels;
    if m.port.unwrap_or(0) == 0 {
        m.port = root.port;
    }
    if m.source_namespace.as_deref().unwrap_or("").is_empty() {
        m.source_namespace = root.source_namespace.clone();
    }
    if m.gateways.is_empty() {
        m.gateways = root.gateways.clone();
    }
    if m.stat_prefix.as_deref().unwrap_or("").is_empty() {
        m.stat_prefix = root.stat_prefix.clone();
    }
    m
}

/// Istio's `hasConflict`: the delegate match is not within the root's.
fn conflict(root: &VsMatch, leaf: &VsMatch) -> bool {
    let pairs = [
        (&root.uri, &leaf.uri),
        (&root.scheme, &leaf.scheme),
        (&root.method, &leaf.method),
        (&root.authority, &leaf.authority),
    ];
    if pairs
        .iter()
        .any(|(r, l)| string_conflict(r.as_ref(), l.as_ref()))
    {
        return true;
    }
    for (maps_root, maps_leaf) in [
        (&root.headers, &leaf.headers),
        (&root.without_headers, &leaf.without_headers),
        (&root.query_params, &leaf.query_params),
    ] {
        if maps_leaf
            .iter()
            .any(|(k, l)| string_conflict(maps_root.get(k), Some(l)))
        {
            return true;
        }
    }
    if root.ignore_uri_case != leaf.ignore_uri_case {
        return true;
    }
    if let (Some(r), Some(l)) = (root.port.filter(|p| *p > 0), leaf.port.filter(|p| *p > 0)) {
        if r != l {
            return true;
        }
    }
    if let Some(r) = root.source_namespace.as_deref().filter(|n| !n.is_empty()) {
        if leaf.source_namespace.as_deref() != Some(r) {
            return true;
        }
    }
    if leaf
        .source_labels
        .iter()
        .any(|(k, v)| root.source_labels.get(k).is_some_and(|r| r != v))
    {
        return true;
    }
    if !root.gateways.is_empty() && !leaf.gateways.is_empty() {
        return leaf.gateways.iter().any(|g| !root.gateways.contains(g));
    }
    false
}

/// Istio's `stringMatchConflict`.
fn string_conflict(root: Option<&StringMatch>, leaf: Option<&StringMatch>) -> bool {
    let (Some(root), Some(leaf)) = (root, leaf) else {
        return false;
    };
    let set = |s: &Option<String>| s.as_deref().is_some_and(|v| !v.is_empty());
    let any = |m: &StringMatch| set(&m.regex) || set(&m.prefix) || set(&m.exact);
    if set(&root.regex) && any(leaf) {
        return true;
    }
    if set(&leaf.regex) && any(root) {
        return true;
    }
    if let Some(exact) = root.exact.as_deref().filter(|e| !e.is_empty()) {
        return set(&leaf.prefix) || leaf.exact.as_deref() != Some(exact);
    }
    if let Some(prefix) = root.prefix.as_deref().filter(|p| !p.is_empty()) {
        if let Some(p) = leaf.prefix.as_deref().filter(|p| !p.is_empty()) {
            return !p.starts_with(prefix);
        }
        if let Some(e) = leaf.exact.as_deref().filter(|e| !e.is_empty()) {
            return !e.starts_with(prefix);
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vs(yaml: &str) -> VirtualService {
        serde_yaml::from_str(yaml).expect("yaml")
    }

    /// Istio's merge: matches combined (the delegate's within the root's), the root's
    /// fields where the delegate sets none, names joined, conflicting rules dropped, short
    /// hosts in the delegate's namespace.
    #[test]
    fn delegate_rules_merge_as_istio_merges_them() {
        let root = vs("{name: root, namespace: shop, hosts: [reviews], http: [\
            {name: api, match: [{uri: {prefix: /api}, headers: {x-a: {exact: '1'}}}], delegate: {name: child, namespace: team}, \
             timeout: 3s, headers: {request: {set: {x-root: 'yes'}}}}, \
            {route: [{destination: {host: reviews}}]}]}");
        let child = vs("{name: child, namespace: team, http: [\
            {name: v1, match: [{uri: {prefix: /api/v1}}], route: [{destination: {host: ratings}}], timeout: 1s}, \
            {match: [{uri: {exact: /api}}], route: [{destination: {host: ratings}}]}, \
            {match: [{uri: {prefix: /other}}], route: [{destination: {host: ratings}}]}, \
            {route: [{destination: {host: ratings.other.svc.cluster.local}}]}]}");
        let (m, dropped) = merged(&root, |ns, name| {
            (ns == "team" && name == "child").then_some(&child)
        });
        assert_eq!(m.http.len(), 4, "{m:?}");
        let r0 = &m.http[0];
        assert_eq!(r0.name.as_deref(), Some("api-v1"));
        assert_eq!(r0.matches.len(), 1);
        assert_eq!(
            r0.matches[0].uri.as_ref().unwrap().prefix.as_deref(),
            Some("/api/v1")
        );
        assert!(
            r0.matches[0].headers.contains_key("x-a"),
            "the root's header match"
        );
        assert_eq!(r0.timeout.as_deref(), Some("1s"), "the delegate's own");
        assert!(r0.headers.is_some(), "the root's headers");
        assert_eq!(
            r0.route[0].destination.host,
            "ratings.team.svc.cluster.local"
        );
        assert_eq!(m.http[1].timeout.as_deref(), Some("3s"), "inherited");
        assert_eq!(
            m.http[1].matches[0].uri.as_ref().unwrap().exact.as_deref(),
            Some("/api")
        );
        // The delegate rule without matches takes the root's.
        assert_eq!(
            m.http[2].matches[0].uri.as_ref().unwrap().prefix.as_deref(),
            Some("/api")
        );
        assert_eq!(
            m.http[2].route[0].destination.host,
            "ratings.other.svc.cluster.local"
        );
        assert!(m.http[3].delegate.is_none() && m.http[3].route[0].destination.host == "reviews");
        assert_eq!(dropped.len(), 1, "/other is outside /api: {dropped:?}");
        assert!(
            dropped[0].contains("rule 2 of team/child conflicts"),
            "{dropped:?}"
        );
    }

    /// A delegate that is missing, has hosts (a root itself), or is not exported to the
    /// root's namespace drops only that rule: it never widens what the root serves.
    #[test]
    fn a_delegate_the_root_may_not_use_drops_its_rule() {
        let root = vs("{name: root, namespace: shop, hosts: [reviews], http: [\
            {match: [{uri: {prefix: /a}}], delegate: {name: gone}}, \
            {match: [{uri: {prefix: /b}}], delegate: {name: private, namespace: team}}, \
            {match: [{uri: {prefix: /c}}], delegate: {name: rooted, namespace: team}}, \
            {route: [{destination: {host: reviews}}]}]}");
        let private = vs("{name: private, namespace: team, exportTo: ['.'], http: [{route: [{destination: {host: secret}}]}]}");
        let rooted = vs("{name: rooted, namespace: team, hosts: [x], http: [{route: [{destination: {host: secret}}]}]}");
        let (m, dropped) = merged(&root, |ns, name| match (ns, name) {
            ("team", "private") => Some(&private),
            ("team", "rooted") => Some(&rooted),
            _ => None,
        });
        assert_eq!(m.http.len(), 1);
        assert_eq!(m.http[0].route[0].destination.host, "reviews");
        assert_eq!(dropped.len(), 3, "{dropped:?}");
        assert!(dropped[0].contains("shop/gone not found"), "{dropped:?}");
        assert!(dropped[1].contains("not exported to shop"), "{dropped:?}");
    }

    /// A delegated rule that does not convert fails closed on its own matches; the root's
    /// other rules stand. A root's directResponse beats a delegate's route (TranslateRoute).
    #[test]
    fn a_broken_delegate_rule_fails_closed_alone() {
        let root = vs("{name: root, namespace: shop, hosts: [reviews], http: [\
            {match: [{uri: {prefix: /team}}], delegate: {name: child, namespace: team}}, \
            {match: [{uri: {prefix: /gone}}], delegate: {name: child, namespace: team}, \
             directResponse: {status: 410}}, \
            {route: [{destination: {host: reviews}}]}]}");
        let child = vs("{name: child, namespace: team, http: [\
            {match: [{uri: {prefix: /team/bad}}], rewrite: {uriRegexRewrite: {match: '(', rewrite: x}}, \
             route: [{destination: {host: api}}]}, \
            {route: [{destination: {host: api}}]}]}");
        let (m, dropped) = merged(&root, |_, _| Some(&child));
        let r = m.to_http().expect("the root converts");
        // /team: the broken rule (closed), the good one; /gone: the broken rule matches
        // nothing under /gone (conflict), the good one answers 410; the root's own rule.
        assert_eq!(r.rules.len(), 4, "{:?}", r.rules);
        assert!(
            r.rules[0]
                .unenforceable
                .as_deref()
                .is_some_and(|u| u.contains("delegate team/child rule 0: rewrite.uriRegexRewrite")),
            "{:?}",
            r.rules[0].unenforceable
        );
        assert!(r.rules[1].unenforceable.is_none());
        assert!(
            matches!(
                r.rules[2].answer,
                Some(super::super::action::Answer::Direct(_))
            ),
            "the root's directResponse wins over the delegate's route"
        );
        assert!(r.rules[2].backend_refs.is_empty());
        assert!(r.rules[3].unenforceable.is_none());
        assert!(
            dropped.iter().any(|d| d.contains("rule 0: rewrite")),
            "{dropped:?}"
        );
    }

    #[test]
    fn string_conflicts_follow_istio() {
        let sm = |k: &str, v: &str| -> StringMatch {
            serde_yaml::from_str(&format!("{{{k}: '{v}'}}")).unwrap()
        };
        let c = |r: StringMatch, l: StringMatch| string_conflict(Some(&r), Some(&l));
        assert!(!c(sm("prefix", "/a"), sm("prefix", "/a/b")));
        assert!(c(sm("prefix", "/a/b"), sm("prefix", "/a")));
        assert!(!c(sm("prefix", "/a"), sm("exact", "/a/x")));
        assert!(c(sm("exact", "/a"), sm("prefix", "/a")));
        assert!(!c(sm("exact", "/a"), sm("exact", "/a")));
        assert!(c(sm("regex", ".*"), sm("exact", "/a")));
        assert!(c(sm("exact", "/a"), sm("regex", ".*")));
        assert!(!string_conflict(None, Some(&sm("regex", ".*"))));
    }
}
