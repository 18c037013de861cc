use super::*;

fn conn(id: Option<&str>, src: &str, dst: &str) -> Connection {
    Connection {
        src_identity: id.map(|s| std::sync::Arc::new(s.parse().unwrap())),
        src_ip: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
    }
}

fn policy(yaml: &str) -> Authorization {
    serde_yaml::from_str(yaml).unwrap()
}

const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/client";
const OTHER: &str = "spiffe://cluster.local/ns/other/sa/evil";

#[test]
fn no_policies_allow() {
    assert_eq!(
        evaluate([], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
}

#[test]
fn allow_by_principal_without_scheme() {
    let p = policy(
        "{name: a, namespace: default, scope: Namespace, action: Allow,
          rules: [[[{principals: [{Exact: cluster.local/ns/default/sa/client}]}]]]}",
    );
    assert_eq!(
        evaluate([&p], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    assert_eq!(
        evaluate([&p], &conn(Some(OTHER), "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(DenyReason::NoAllowMatch)
    );
    // A plaintext client has no principal: an ALLOW that needs one denies it.
    assert_eq!(
        evaluate([&p], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(DenyReason::NoAllowMatch)
    );
}

#[test]
fn deny_wins_over_allow() {
    let allow = policy("{name: a, namespace: default, scope: Global, action: Allow, rules: [[]]}");
    let deny = policy(
        "{name: d, namespace: default, scope: Global, action: Deny,
          rules: [[[{namespaces: [{Exact: other}]}]]]}",
    );
    assert_eq!(
        evaluate(
            [&allow, &deny],
            &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")
        ),
        Decision::Allow
    );
    assert_eq!(
        evaluate(
            [&allow, &deny],
            &conn(Some(OTHER), "10.0.0.1", "10.0.0.2:80")
        ),
        Decision::Deny(DenyReason::DenyPolicy("default/d".into()))
    );
}

#[test]
fn dots_are_not_wildcards() {
    let p = policy(
        "{name: a, namespace: default, scope: Global, action: Allow,
          rules: [[[{principals: [{Exact: cluster.local/ns/default/sa/client}]}]]]}",
    );
    let tricky = "spiffe://clusterXlocal/ns/default/sa/client";
    assert!(!p.matches(&conn(Some(tricky), "10.0.0.1", "10.0.0.2:80")));
}

#[test]
fn rule_is_and_of_clauses_clause_is_or_of_matches() {
    // (port 80 OR port 81) AND (namespace default)
    let p = policy(
        "{name: a, namespace: default, scope: Global, action: Allow,
          rules: [[[{destinationPorts: [80]}, {destinationPorts: [81]}], [{namespaces: [{Exact: default}]}]]]}",
    );
    assert!(p.matches(&conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")));
    assert!(p.matches(&conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:81")));
    assert!(!p.matches(&conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:82")));
    assert!(!p.matches(&conn(Some(OTHER), "10.0.0.1", "10.0.0.2:80")));
}

#[test]
fn match_fields_and_not_forms() {
    let m: Match = serde_yaml::from_str(
        "{sourceIps: [10.0.0.0/8], notSourceIps: [10.9.0.0/16], destinationIps: [10.1.1.1],
          notDestinationPorts: [22], serviceAccounts: [{namespace: default, serviceAccount: client}]}",
    )
    .unwrap();
    assert!(m.matches(&conn(Some(CLIENT), "10.0.0.1", "10.1.1.1:80")));
    assert!(
        !m.matches(&conn(Some(CLIENT), "10.9.0.1", "10.1.1.1:80")),
        "notSourceIps"
    );
    assert!(
        !m.matches(&conn(Some(CLIENT), "11.0.0.1", "10.1.1.1:80")),
        "sourceIps"
    );
    assert!(
        !m.matches(&conn(Some(CLIENT), "10.0.0.1", "10.1.1.2:80")),
        "destinationIps"
    );
    assert!(
        !m.matches(&conn(Some(CLIENT), "10.0.0.1", "10.1.1.1:22")),
        "notDestinationPorts"
    );
    assert!(
        !m.matches(&conn(Some(OTHER), "10.0.0.1", "10.1.1.1:80")),
        "serviceAccounts"
    );
    assert!(
        !m.matches(&conn(None, "10.0.0.1", "10.1.1.1:80")),
        "no identity"
    );
}

#[test]
fn negative_identity_fields_hold_for_anonymous_peers() {
    let deny = policy(
        "{name: d, namespace: default, scope: Global, action: Deny,
          rules: [[[{notPrincipals: [{Exact: cluster.local/ns/default/sa/client}]}]]]}",
    );
    assert_eq!(
        evaluate([&deny], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    assert!(matches!(
        evaluate([&deny], &conn(Some(OTHER), "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(_)
    ));
    assert!(matches!(
        evaluate([&deny], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(_)
    ));
}

#[test]
fn string_match_kinds() {
    let m: Vec<StringMatch> =
        serde_yaml::from_str("[{Exact: a}, {Prefix: pre}, {Suffix: fix}, {Presence: {}}]").unwrap();
    assert!(m[0].matches("a") && !m[0].matches("ab"));
    assert!(m[1].matches("prefix") && !m[1].matches("xpre"));
    assert!(m[2].matches("suffix") && !m[2].matches("fixx"));
    assert!(m[3].matches("x") && !m[3].matches(""));
}

#[test]
fn dry_run_is_not_enforced_and_not_counted() {
    let p = policy(
        "{name: a, namespace: default, scope: Global, action: Deny, dryRun: true, rules: [[]]}",
    );
    assert_eq!(
        evaluate([&p], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    let p = policy(
        "{name: a, namespace: default, scope: Global, action: Allow, dryRun: true, rules: []}",
    );
    assert_eq!(
        evaluate([&p], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
}

#[test]
fn allow_with_no_rules_allows_nothing() {
    let p = policy("{name: a, namespace: default, scope: Global, action: Allow}");
    assert!(matches!(
        evaluate([&p], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(_)
    ));
}

#[test]
fn rejects_bad_cidr_and_unknown_field() {
    assert!(serde_yaml::from_str::<Match>("{sourceIps: [10.0.0.0/99]}").is_err());
    let e = serde_yaml::from_str::<Match>("{principal: []}")
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `principal`"), "{e}");
}

/// What istiod sends for `DENY to.operation.methods: [DELETE]` (HTTP only): one rule, one
/// clause, one empty match. Istio's ztunnel skips the empty match, so the DENY is a
/// no-op at L4; taking it as match-all reset every connection to the workload.
#[test]
fn deny_with_only_http_attributes_denies_nothing() {
    let deny =
        policy("{name: d, namespace: default, scope: Namespace, action: Deny, rules: [[[{}]]]}");
    assert_eq!(
        evaluate([&deny], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    assert_eq!(
        evaluate([&deny], &conn(None, "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    // `from` with a principal and `to` with only methods: the `to` clause never holds.
    let mixed = policy(
        "{name: d, namespace: default, scope: Namespace, action: Deny,
          rules: [[[{}], [{principals: [{Exact: cluster.local/ns/default/sa/client}]}]]]}",
    );
    assert_eq!(
        evaluate([&mixed], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Allow
    );
    // An empty match beside a real one: the real one decides.
    let beside = policy(
        "{name: d, namespace: default, scope: Namespace, action: Deny,
          rules: [[[{}, {destinationPorts: [80]}]]]}",
    );
    assert!(matches!(
        evaluate([&beside], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(_)
    ));
    assert_eq!(
        evaluate([&beside], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:81")),
        Decision::Allow
    );
    // The same empty match in an ALLOW matches nothing either: the ALLOW in scope denies.
    let allow =
        policy("{name: a, namespace: default, scope: Namespace, action: Allow, rules: [[[{}]]]}");
    assert_eq!(
        evaluate([&allow], &conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80")),
        Decision::Deny(DenyReason::NoAllowMatch)
    );
}

/// Istio's ztunnel: no rules match nothing (even for DENY); a rule with no clauses and a
/// clause with no matches hold.
#[test]
fn empty_rules_and_clauses_as_istio() {
    let c = conn(Some(CLIENT), "10.0.0.1", "10.0.0.2:80");
    assert!(
        !policy("{name: d, namespace: default, scope: Global, action: Deny, rules: []}")
            .matches(&c)
    );
    assert!(
        policy("{name: d, namespace: default, scope: Global, action: Deny, rules: [[]]}")
            .matches(&c)
    );
    assert!(
        policy("{name: d, namespace: default, scope: Global, action: Deny, rules: [[[]]]}")
            .matches(&c)
    );
    assert!(policy("{name: d, namespace: default, scope: Global, action: Deny, rules: [[[], [{destinationPorts: [80]}]]]}").matches(&c));
    // What stands in for an unenforceable policy still denies everything in its scope.
    let d = Authorization::deny_all("default", "x", PolicyScope::Global, false, "test".into());
    assert!(matches!(evaluate([&d], &c), Decision::Deny(_)));
}

/// Istio's ztunnel compares an anonymous peer's namespace as "".
#[test]
fn anonymous_namespace_is_empty_string() {
    let anon = conn(None, "10.0.0.1", "10.0.0.2:80");
    let m = |yaml: &str| serde_yaml::from_str::<Match>(yaml).unwrap().matches(&anon);
    assert!(m("{namespaces: [{Prefix: ''}]}"));
    assert!(!m("{namespaces: [{Presence: {}}]}"));
    assert!(!m("{notNamespaces: [{Exact: ''}]}"));
    assert!(m("{notNamespaces: [{Exact: default}]}"));
    assert!(!m("{principals: [{Prefix: ''}]}"), "no principal at all");
    assert!(m("{notPrincipals: [{Prefix: ''}]}"));
}
