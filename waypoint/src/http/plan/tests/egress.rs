//! Egress through the waypoint: ServiceEntry parents, targets and hosts, and
//! DYNAMIC_DNS wildcard entries (`crate::egress`).

use super::*;

/// `*.wild.test` (DYNAMIC_DNS: a VIP, no endpoint) at the tunnel's target, beside
/// `api.external.test` (a DNS entry with a hostname endpoint) and a Kubernetes Service
/// `api` of the same namespace.
const WILD: &str = "workloads:\n\
    - {uid: api, name: api, namespace: egress, hostname: api.external.test, protocol: TCP, services: {egress/api.external.test: {80: 80}}}\n\
    services:\n\
    - {name: wild, namespace: egress, hostname: \"*.wild.test\", vips: [\"/10.96.0.10\"], ports: {80: 80}}\n\
    - {name: api, namespace: egress, hostname: api.external.test, vips: [\"/10.96.0.11\"], ports: {80: 80}}\n";

/// `api.external.test` at the tunnel's target.
const API: &str = "workloads:\n\
    - {uid: api, name: api, namespace: egress, hostname: api.external.test, protocol: TCP, services: {egress/api.external.test: {80: 80}}}\n\
    - {uid: echo, name: echo, namespace: egress, workloadIps: [10.0.0.2], protocol: HBONE, services: {egress/api.egress.svc.cluster.local: {80: 8080}}}\n\
    services:\n\
    - {name: api, namespace: egress, hostname: api.external.test, vips: [\"/10.96.0.10\"], ports: {80: 80}}\n\
    - {name: api, namespace: egress, hostname: api.egress.svc.cluster.local, vips: [\"/10.96.0.12\"], ports: {80: 8080}}\n\
    - {name: wild, namespace: egress, hostname: \"*.wild.test\", vips: [\"/10.96.0.11\"], ports: {80: 80}}\n";

fn to(host: &str, path: &str) -> Request<()> {
    Request::get(path)
        .header("host", host)
        .body(())
        .expect("request")
}

/// A local reply's status, flags and message.
type Refusal = (u16, &'static str, String);

/// What the plan sends to: endpoints by address and hostname endpoints by name:port.
fn sent(mesh: &str, l7: &str, req: Request<()>) -> Result<Vec<String>, Refusal> {
    plan_any(mesh, Protocol::Http1, l7, req, |p| {
        let mut v: Vec<String> = p
            .backend
            .endpoints
            .iter()
            .map(|(a, _)| a.to_string())
            .collect();
        v.extend(
            p.backend
                .unresolved
                .iter()
                .map(|(w, port)| format!("{}:{port}", w.hostname)),
        );
        v
    })
    .0
    .map_err(|e| (e.status.as_u16(), e.flags, e.message))
}

fn refusal(r: Result<Vec<String>, Refusal>) -> Refusal {
    r.expect_err("refused")
}

/// The request's own Host is the upstream, on port 80 (443 with TLS origination); a
/// Host outside the wildcard, with a port, or an IP literal has no route (404) and is
/// never looked up.
#[test]
fn dynamic_dns_sends_to_the_hosts_its_wildcard_covers() {
    assert_eq!(
        sent(WILD, "", to("a.wild.test", "/")),
        Ok(vec!["a.wild.test:80".into()])
    );
    assert_eq!(
        sent(WILD, "", to("B.Wild.Test", "/")),
        Ok(vec!["b.wild.test:80".into()])
    );
    for host in [
        "evil.other.test",
        "api.external.test",
        "a.wild.test.",
        "a.wild.test:80",
        "a.wild.test:8080",
        "wild.test",
        "10.96.0.10",
        "[fd00::1]",
    ] {
        let (status, flags, message) = refusal(sent(WILD, "", to(host, "/")));
        assert_eq!((status, flags), (404, "NR"), "{host}: {message}");
        assert!(message.contains("*.wild.test"), "{message}");
    }
    // With TLS origination (DestinationRule SIMPLE): 443, as Envoy's default for a
    // TLS cluster.
    let dr = "destinationRules:\n- {name: wild, namespace: egress, host: \"*.wild.test\", trafficPolicy: {tls: {mode: SIMPLE, insecureSkipVerify: true}}}\n";
    assert_eq!(
        sent(WILD, dr, to("a.wild.test", "/")),
        Ok(vec!["a.wild.test:443".into()])
    );
}

/// RBAC comes first, as Envoy's filter runs before the router: a DENY on the entry
/// answers 403 whatever the Host; an ALLOW on it is needed for any Host to pass.
#[test]
fn dynamic_dns_policies_come_before_the_host_check() {
    let deny = "authorizationPolicies:\n- {name: no-wild, namespace: egress, targetRefs: [{group: networking.istio.io, kind: ServiceEntry, name: wild}], action: DENY, rules: [{to: [{operation: {paths: [/admin]}}]}]}\n";
    assert_eq!(
        refusal(sent(WILD, deny, to("evil.other.test", "/admin"))).0,
        403
    );
    assert_eq!(
        refusal(sent(WILD, deny, to("a.wild.test", "/admin"))).0,
        403
    );
    assert_eq!(refusal(sent(WILD, deny, to("evil.other.test", "/"))).0, 404);
    assert!(sent(WILD, deny, to("a.wild.test", "/")).is_ok());
}

fn allow_api(paths: &str) -> String {
    format!("- {{name: api, namespace: egress, targetRefs: [{{group: networking.istio.io, kind: ServiceEntry, name: api}}], rules: [{{to: [{{operation: {{paths: {paths}}}}}]}}]}}\n")
}

/// An ALLOW on the ServiceEntry allows what it names, denies the rest (RBAC's 403);
/// policies of another namespace, on a ServiceEntry that does not exist, or on the
/// Kubernetes Service of the same name add nothing for it.
#[test]
fn service_entry_policies_allow_and_deny_as_istio_attaches_them() {
    let mut l7 = format!("authorizationPolicies:\n{}", allow_api("[/allowed]"));
    assert_eq!(
        sent(API, &l7, to("api.external.test", "/allowed")),
        Ok(vec!["api.external.test:80".into()])
    );
    let denied = refusal(sent(API, &l7, to("api.external.test", "/denied")));
    assert_eq!(denied, (403, "DENY", "RBAC: access denied".to_string()));
    // ALLOW-all policies that must not widen it: another namespace's on a ServiceEntry of
    // the same name, one on a ServiceEntry that does not exist, one on the Kubernetes
    // Service `api`, one naming the entry in another namespace (refused by validation in
    // the file, so set apart below).
    for (ns, refs) in [
        (
            "tenant",
            "[{group: networking.istio.io, kind: ServiceEntry, name: api}]",
        ),
        (
            "egress",
            "[{group: networking.istio.io, kind: ServiceEntry, name: ghost}]",
        ),
        ("egress", "[{kind: Service, group: '', name: api}]"),
    ] {
        l7.push_str(&format!(
            "- {{name: wide-{}, namespace: {ns}, targetRefs: {refs}, rules: [{{}}]}}\n",
            l7.len()
        ));
    }
    assert_eq!(
        refusal(sent(API, &l7, to("api.external.test", "/denied"))).0,
        403,
        "still denied"
    );
    // A DENY of another namespace on "its" ServiceEntry api does not reach egress/api.
    let other_deny = "authorizationPolicies:\n- {name: d, namespace: tenant, targetRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api}], action: DENY, rules: [{}]}\n";
    assert!(sent(API, other_deny, to("api.external.test", "/x")).is_ok());
    // A targetRef into another namespace is refused where the file loads.
    let cross = "authorizationPolicies:\n- {name: x, namespace: tenant, targetRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api, namespace: egress}], rules: [{}]}\n";
    assert!(Config::parse(Path::new("t.yaml"), &format!("{API}{cross}")).is_err());
}

/// An HTTPRoute on a ServiceEntry applies to its hosts (not to a Kubernetes Service
/// of the same name, nor the reverse), and may send to another entry's host by
/// Istio's `Hostname` backend kind, a DYNAMIC_DNS one included (the Host then must be
/// its wildcard's).
#[test]
fn routes_attach_to_service_entries_and_send_to_hosts() {
    let route = |parent: &str, backend: &str| {
        format!("httpRoutes:\n- {{name: r, namespace: egress, parentRefs: [{parent}], rules: [{{matches: [{{path: {{type: PathPrefix, value: /v2}}}}], backendRefs: [{backend}]}}]}}\n")
    };
    let se = "{group: networking.istio.io, kind: ServiceEntry, name: api}";
    let to_echo = "{name: api, port: 80}";
    let l7 = route(se, to_echo);
    assert_eq!(
        sent(API, &l7, to("api.external.test", "/v2/x")),
        Ok(vec!["10.0.0.2:8080".into()])
    );
    assert_eq!(
        refusal(sent(API, &l7, to("api.external.test", "/v1"))).0,
        404,
        "routes attached, none matched"
    );
    // A Service parent of the same name is the Kubernetes Service's only.
    let l7 = route("{kind: Service, group: '', name: api}", to_echo);
    assert_eq!(
        sent(API, &l7, to("api.external.test", "/v1")),
        Ok(vec!["api.external.test:80".into()])
    );
    // Hostname backends.
    let wild = "{group: networking.istio.io, kind: Hostname, name: \"*.wild.test\", port: 80}";
    let l7 = route(se, wild);
    assert_eq!(
        refusal(sent(API, &l7, to("api.external.test", "/v2"))).0,
        404
    );
    let rewrite = format!("httpRoutes:\n- {{name: r, namespace: egress, parentRefs: [{se}], rules: [{{filters: [{{type: URLRewrite, urlRewrite: {{hostname: v2.wild.test}}}}], backendRefs: [{wild}]}}]}}\n");
    assert_eq!(
        sent(API, &rewrite, to("api.external.test", "/")),
        Ok(vec!["v2.wild.test:80".into()])
    );
    let gone = route(
        se,
        "{group: networking.istio.io, kind: Hostname, name: gone.external.test, port: 80}",
    );
    let (status, _, message) = refusal(sent(API, &gone, to("api.external.test", "/v2")));
    assert_eq!(status, 500);
    assert!(message.contains("gone.external.test"), "{message}");
}

/// What the file refuses, with what to write instead.
#[test]
fn service_entry_refs_are_validated() {
    for (refs, want) in [
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api, sectionName: http}]",
            "sectionName",
        ),
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api, namespace: other}]",
            "differs from the route's namespace",
        ),
        (
            "parentRefs: [{kind: ServiceEntry, name: api}], rules: [{}]",
            "kind ServiceEntry with group networking.istio.io",
        ),
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api}], rules: [{backendRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api, port: 80}]}]",
            "kind: Hostname",
        ),
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api}], rules: [{backendRefs: [{group: networking.istio.io, kind: Hostname, name: api.external.test, namespace: egress, port: 80}]}]",
            "has no namespace",
        ),
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api}], rules: [{backendRefs: [{group: networking.istio.io, kind: Hostname, name: api.external.test}]}]",
            "port: required",
        ),
        (
            "parentRefs: [{group: networking.istio.io, kind: ServiceEntry, name: api}], rules: [{backendRefs: [{group: networking.istio.io, kind: Hostname, name: \"10.0.0.1\", port: 80}]}]",
            "IP addresses are not allowed",
        ),
    ] {
        let rules = if refs.contains("rules:") { "" } else { ", rules: [{}]" };
        let l7 = format!("httpRoutes:\n- {{name: r, namespace: egress, {refs}{rules}}}\n");
        let err = Config::parse(Path::new("t.yaml"), &format!("{API}{l7}")).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(want), "{refs}: {err}");
    }
}
