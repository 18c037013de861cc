use std::net::IpAddr;

use serde::Deserialize;
use ztunnel::identity::Identity;

use super::*;
use crate::object::{ObjectName, ObjectRef, ServiceKind, Target};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct File {
    authorization_policies: Vec<AuthorizationPolicy>,
}

fn parse(yaml: &str) -> Result<Vec<AuthorizationPolicy>, String> {
    serde_yaml::from_str::<File>(yaml)
        .map(|f| f.authorization_policies)
        .map_err(|e| e.to_string())
}

fn policy(yaml: &str) -> AuthorizationPolicy {
    let head =
        "name: p\nnamespace: default\ntargetRefs: [{kind: Service, group: \"\", name: echo}]\n";
    let p: AuthorizationPolicy = serde_yaml::from_str(&format!("{head}{yaml}")).unwrap();
    p.validate().unwrap();
    p
}

struct Req {
    id: Option<Identity>,
    ip: IpAddr,
    port: u16,
    host: String,
    method: String,
    path: String,
    headers: http::HeaderMap,
    auth: Option<crate::authn::RequestAuth>,
}

fn req() -> Req {
    Req {
        id: Some(Identity::new("cluster.local", "default", "client")),
        ip: "10.10.1.7".parse().unwrap(),
        port: 80,
        host: "echo.default.svc.cluster.local".into(),
        method: "GET".into(),
        path: "/".into(),
        headers: http::HeaderMap::new(),
        auth: None,
    }
}

impl Req {
    fn id(mut self, id: Option<(&str, &str)>) -> Self {
        self.id = id.map(|(ns, sa)| Identity::new("cluster.local", ns, sa));
        self
    }
    fn ip(mut self, ip: &str) -> Self {
        self.ip = ip.parse().unwrap();
        self
    }
    fn port(mut self, port: u16) -> Self {
        self.port = port;
        self
    }
    fn host(mut self, host: &str) -> Self {
        self.host = host.into();
        self
    }
    fn method(mut self, method: &str) -> Self {
        self.method = method.into();
        self
    }
    fn path(mut self, path: &str) -> Self {
        self.path = path.into();
        self
    }
    fn header(mut self, name: &'static str, value: &[u8]) -> Self {
        self.headers
            .append(name, http::HeaderValue::from_bytes(value).unwrap());
        self
    }
    /// A verified JWT with these claims.
    fn jwt(mut self, claims: serde_json::Value) -> Self {
        self.auth = Some(crate::authn::RequestAuth::new(claims, vec!["scope".into()]));
        self
    }
    fn verdict(&self, policies: &[&AuthorizationPolicy]) -> Verdict {
        let r = Request {
            source_principal: self.id.as_ref(),
            source_ip: self.ip,
            destination_port: self.port,
            host: &self.host,
            method: &self.method,
            path: &self.path,
            headers: &self.headers,
            auth: self.auth.as_ref(),
        };
        evaluate(policies.iter().copied(), &r)
    }
    fn allowed(&self, policies: &[&AuthorizationPolicy]) -> bool {
        self.verdict(policies).allowed
    }
}

const EXAMPLE: &str = r#"
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/default/sa/client", "*/sa/admin"]
        notPrincipals: ["cluster.local/ns/default/sa/root"]
        namespaces: [default]
        notNamespaces: [kube-system]
        ipBlocks: ["10.10.1.0/24", "10.10.2.5"]
        notIpBlocks: ["10.10.1.128/25"]
        remoteIpBlocks: ["fd00::/8"]
        notRemoteIpBlocks: ["fd00::1"]
    - source:
        serviceAccounts: ["default/client"]
        notServiceAccounts: ["default/other"]
    to:
    - operation:
        hosts: ["echo.default.svc.cluster.local", "*.example.com"]
        notHosts: ["internal.example.com"]
        ports: ["80"]
        notPorts: ["9090"]
        methods: ["GET"]
        notMethods: ["DELETE"]
        paths: ["/admin", "/admin/*", "*/info"]
        notPaths: ["/admin/public"]
    when:
    - key: request.headers[x-token]
      values: ["secret"]
      notValues: ["public"]
    - key: source.ip
      values: ["10.10.1.0/24"]
    - key: remote.ip
      notValues: ["10.10.9.9"]
    - key: source.namespace
      values: ["default"]
    - key: source.principal
      values: ["cluster.local/*"]
    - key: destination.port
      values: ["80"]
- name: gw
  namespace: default
  targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]
  rules: [{}]
"#;

#[test]
fn parses_example() {
    let ps = parse(EXAMPLE).unwrap();
    assert_eq!(ps.len(), 2);
    for p in &ps {
        p.validate().unwrap();
    }
    let p = &ps[0];
    assert_eq!(p.key(), "default/deny-admin");
    assert_eq!(p.action, Action::Deny);
    let src = &p.rules[0].from[0].source;
    assert_eq!(
        src.ip_blocks,
        vec![
            "10.10.1.0/24".parse().unwrap(),
            "10.10.2.5/32".parse().unwrap()
        ]
    );
    assert_eq!(src.remote_ip_blocks, vec!["fd00::/8".parse().unwrap()]);
    assert_eq!(
        p.rules[0].to[0].operation.paths,
        ["/admin", "/admin/*", "*/info"]
    );
    assert_eq!(p.rules[0].when.len(), 6);
    assert_eq!(ps[1].action, Action::Allow, "ALLOW is the default");
}

#[test]
fn rejected_when_loading() {
    let base =
        "authorizationPolicies:\n- name: p\n  namespace: default\n  targetRefs: [{kind: Service, name: echo}]\n";
    let cases = [
        (
            "  rules:\n  - from:\n    - source:\n        ipBlocks: [\"10.0.0.1\", \"10.0.0.300\"]\n",
            // serde_yaml names the list, not the element; line and column point at it.
            "authorizationPolicies[0].rules[0].from[0].source.ipBlocks: invalid IP or CIDR \"10.0.0.300\": expected e.g. \"10.0.0.0/8\" or \"10.1.2.3\" at line 8 column 19",
        ),
        ("  action: Deny\n", "authorizationPolicies[0]: unknown action \"Deny\""),
        ("  selector: {matchLabels: {app: echo}}\n", "authorizationPolicies[0]: unknown field `selector`"),
        ("  rules:\n  - to: [{operation: {path: [\"/a\"]}}]\n", "authorizationPolicies[0].rules[0].to[0].operation: unknown field `path`"),
        ("  rules:\n  - from: [{}]\n", "authorizationPolicies[0].rules[0].from[0]: missing field `source`"),
    ];
    for (extra, want) in cases {
        let err = parse(&format!("{base}{extra}")).unwrap_err();
        assert!(err.starts_with(want), "{extra}: {err}");
    }
}

#[test]
fn validation_errors() {
    let ok_ref = "targetRefs: [{kind: Service, name: echo}]";
    let cases: &[(&str, &str)] = &[
        ("name: ''\nnamespace: default\ntargetRefs: [{kind: Service, name: echo}]", "name: must not be empty"),
        ("name: p\nnamespace: ''\ntargetRefs: [{kind: Service, name: echo}]", "namespace: must not be empty"),
        ("name: p\nnamespace: default", "targetRefs: required"),
        ("name: p\nnamespace: default\ntargetRefs: []", "targetRefs: required"),
        ("name: p\nnamespace: default\ntargetRefs: [{name: echo}]", "targetRefs[0].kind: required"),
        (
            "name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a}, {kind: ServiceEntry, name: x}]",
            "targetRefs[1].group: \"\" is wrong for kind ServiceEntry, whose group is \"networking.istio.io\"",
        ),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, group: apps, name: a}]", "targetRefs[0].group:"),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Gateway, group: example.com, name: a}]", "targetRefs[0].group:"),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Gateway, group: '', name: a}]", "targetRefs[0].group: \"\" is wrong for kind Gateway"),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a, namespace: other}]", "targetRefs[0].namespace:"),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: a, port: 80}]", "targetRefs[0].port:"),
        ("name: p\nnamespace: default\ntargetRefs: [{kind: Service, name: ''}]", "targetRefs[0].name: must not be empty"),
    ];
    for (yaml, want) in cases {
        let p: AuthorizationPolicy = serde_yaml::from_str(yaml).unwrap();
        let err = p.validate().unwrap_err();
        assert!(err.starts_with(want), "{yaml}: {err}");
    }
    let rule_cases: &[(&str, &str)] = &[
        ("from: [{source: {requestPrincipals: ['a*b']}}]", "rules[0].from[0].source.requestPrincipals[0]: \"a*b\": a '*' may only"),
        ("from: [{source: {notRequestPrincipals: ['']}}]", "rules[0].from[0].source.notRequestPrincipals[0]: must not be empty"),
        ("from: [{source: {}}]", "rules[0].from[0].source: must set at least one field"),
        ("from: [{source: {principals: ['']}}]", "rules[0].from[0].source.principals[0]: must not be empty"),
        ("from: [{source: {principals: [a, 'cluster.local/ns/*/sa/admin']}}]", "rules[0].from[0].source.principals[1]: \"cluster.local/ns/*/sa/admin\": a '*' may only"),
        ("from: [{source: {notPrincipals: ['spiffe://cluster.local/ns/a/sa/b']}}]", "rules[0].from[0].source.notPrincipals[0]:"),
        ("from: [{source: {namespaces: ['*a*']}}]", "rules[0].from[0].source.namespaces[0]:"),
        ("from: [{source: {serviceAccounts: [client]}}]", "rules[0].from[0].source.serviceAccounts[0]: \"client\" is not"),
        ("from: [{source: {notServiceAccounts: ['default/*']}}]", "rules[0].from[0].source.notServiceAccounts[0]:"),
        ("from: [{source: {serviceAccounts: [default/a], namespaces: [default]}}]", "rules[0].from[0].source: cannot set serviceAccounts"),
        ("to: [{operation: {}}]", "rules[0].to[0].operation: must set at least one field"),
        ("to: [{operation: {ports: ['80']}}, {operation: {ports: ['http']}}]", "rules[0].to[1].operation.ports[0]: \"http\" is not a port"),
        ("to: [{operation: {notPorts: ['70000']}}]", "rules[0].to[0].operation.notPorts[0]:"),
        ("to: [{operation: {methods: [get]}}]", "rules[0].to[0].operation.methods[0]: \"get\" is not an uppercase HTTP method"),
        ("to: [{operation: {notMethods: ['*']}}]", "rules[0].to[0].operation.notMethods[0]:"),
        ("to: [{operation: {hosts: ['echo:80']}}]", "rules[0].to[0].operation.hosts[0]: \"echo:80\": the port"),
        ("to: [{operation: {notHosts: ['a.*.com']}}]", "rules[0].to[0].operation.notHosts[0]:"),
        ("to: [{operation: {paths: [admin]}}]", "rules[0].to[0].operation.paths[0]: \"admin\" must start with '/' or '*'"),
        ("to: [{operation: {paths: ['/a/*/b']}}]", "rules[0].to[0].operation.paths[0]:"),
        ("to: [{operation: {paths: ['/a/{*}/b']}}]", "rules[0].to[0].operation.paths[0]: \"/a/{*}/b\": path templates"),
        ("to: [{operation: {paths: ['/a//b']}}]", "rules[0].to[0].operation.paths[0]: \"/a//b\" is not in normalized form; requests are matched after normalization, so write \"/a/b\""),
        ("to: [{operation: {paths: ['/%61dmin']}}]", "rules[0].to[0].operation.paths[0]: \"/%61dmin\" is not in normalized form"),
        ("to: [{operation: {notPaths: ['/a/../b*']}}]", "rules[0].to[0].operation.notPaths[0]:"),
        ("to: [{operation: {paths: ['*/./info']}}]", "rules[0].to[0].operation.paths[0]:"),
        ("to: [{operation: {paths: ['/a%2Fb']}}]", "rules[0].to[0].operation.paths[0]: \"/a%2Fb\" can never match"),
        ("when: [{key: 'request.auth.claims[]', values: [x]}]", "rules[0].when[0].key: \"request.auth.claims[]\": claims are written"),
        ("when: [{key: 'request.auth.claims[a]b', values: [x]}]", "rules[0].when[0].key:"),
        ("when: [{key: request.auth.issuer, values: [x]}]", "rules[0].when[0].key: \"request.auth.issuer\" is not supported; supported keys: request.headers[<name>], source.ip"),
        ("when: [{key: connection.sni, values: [x]}]", "rules[0].when[0].key: \"connection.sni\" is not supported"),
        ("when: [{key: 'request.headers[a b]', values: [x]}]", "rules[0].when[0].key: \"a b\""),
        ("when: [{key: '', values: [x]}]", "rules[0].when[0].key: must not be empty"),
        ("when: [{key: source.ip}]", "rules[0].when[0]: at least one of values or notValues"),
        ("when: [{key: source.ip, values: ['10.0.0.300']}]", "rules[0].when[0].values[0]: invalid IP or CIDR \"10.0.0.300\""),
        ("when: [{key: destination.port, notValues: ['80', x]}]", "rules[0].when[0].notValues[1]:"),
        ("when: [{key: 'request.headers[x]', values: ['']}]", "rules[0].when[0].values[0]: must not be empty"),
        ("when: [{key: 'request.headers[x]', values: ['a*b']}]", "rules[0].when[0].values[0]:"),
    ];
    for (rule, want) in rule_cases {
        let yaml = format!("name: p\nnamespace: default\n{ok_ref}\nrules:\n- {rule}");
        let p: AuthorizationPolicy = serde_yaml::from_str(&yaml).unwrap();
        let err = p.validate().unwrap_err();
        assert!(err.starts_with(want), "{rule}: {err}");
    }
}

#[test]
fn validation_accepts() {
    for rules in [
        "rules: []",
        "rules: [{}]",
        "rules: [{from: [], to: [], when: []}]",
        "rules: [{to: [{operation: {paths: ['*', '/', '/admin*', '/admin/*', '*/info', '*.json', '/a/.well-known*']}}]}]",
        "rules: [{to: [{operation: {methods: [GET, M-SEARCH], hosts: ['*', '*.example.com', 'echo*', '[::1]']}}]}]",
        "rules: [{when: [{key: 'request.headers[X-Token]', values: ['*'], notValues: [a*, '*b']}]}]",
    ] {
        policy(rules);
    }
    // serde_yaml reads a plain scalar as a string, so unquoted ports work too.
    let p = policy("rules: [{to: [{operation: {ports: [80, '8080']}}]}]");
    assert_eq!(p.rules[0].to[0].operation.ports, ["80", "8080"]);
}

#[test]
fn applies_to() {
    let ps = parse(EXAMPLE).unwrap();
    let gw = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let echo = ObjectName {
        namespace: "default".into(),
        name: "echo".into(),
    };
    let other_ns = ObjectName {
        namespace: "prod".into(),
        name: "echo".into(),
    };
    let other_gw = ObjectName {
        namespace: "prod".into(),
        name: "waypoint".into(),
    };
    let t = |gateway, service| Target {
        gateway,
        service,
        service_kind: Default::default(),
        root_namespace: "istio-system",
        port: 80,
    };
    assert!(ps[0].applies_to(&t(&gw, Some(&echo))));
    assert!(!ps[0].applies_to(&t(&gw, Some(&other_ns))));
    assert!(!ps[0].applies_to(&t(&gw, None)));
    assert!(ps[1].applies_to(&t(&gw, None)));
    assert!(ps[1].applies_to(&t(&gw, Some(&other_ns))));
    assert!(!ps[1].applies_to(&t(&other_gw, Some(&echo))));
}

#[test]
fn applies_to_refs() {
    let gw = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let echo = ObjectName {
        namespace: "default".into(),
        name: "echo".into(),
    };
    let t = Target {
        gateway: &gw,
        service: Some(&echo),
        service_kind: Default::default(),
        root_namespace: "istio-system",
        port: 80,
    };
    let p = |refs: &str| -> AuthorizationPolicy {
        serde_yaml::from_str(&format!("name: p\nnamespace: default\ntargetRefs: {refs}")).unwrap()
    };
    assert!(p("[{kind: Gateway, name: waypoint}]").applies_to(&t));
    assert!(p("[{kind: Service, name: echo, namespace: default}]").applies_to(&t));
    assert!(p("[{kind: Service, name: other}, {kind: Service, name: echo}]").applies_to(&t));
    assert!(!p("[{kind: Service, name: echo, namespace: prod}]").applies_to(&t));
    assert!(!p("[{kind: Gateway, name: echo}]").applies_to(&t));
    assert!(!p("[{kind: Service, name: waypoint}]").applies_to(&t));
    assert!(!p("[{kind: ServiceEntry, group: networking.istio.io, name: echo}]").applies_to(&t));
    assert!(!p("[{name: echo}]").applies_to(&t));
}

/// Istio's attachment to waypoints: a root-namespace policy on the GatewayClass
/// `istio-waypoint` covers every waypoint; from elsewhere it covers nothing.
#[test]
fn root_namespace_policies_target_every_waypoint() {
    let gw = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let cart = ObjectName {
        namespace: "shop".into(),
        name: "cart".into(),
    };
    let p = |ns: &str, refs: &str| -> AuthorizationPolicy {
        let p: AuthorizationPolicy =
            serde_yaml::from_str(&format!("name: p\nnamespace: {ns}\ntargetRefs: {refs}")).unwrap();
        p.validate().unwrap();
        p
    };
    let class = "[{kind: GatewayClass, group: gateway.networking.k8s.io, name: istio-waypoint}]";
    for service in [None, Some(&cart)] {
        let t = Target {
            gateway: &gw,
            service,
            service_kind: Default::default(),
            root_namespace: "istio-system",
            port: 80,
        };
        assert!(p("istio-system", class).applies_to(&t));
        assert!(
            !p("default", class).applies_to(&t),
            "only from the root namespace"
        );
        assert!(
            !p("istio-system", "[{kind: GatewayClass, name: istio}]").applies_to(&t),
            "another class"
        );
    }
    let t = Target {
        gateway: &gw,
        service: None,
        service_kind: Default::default(),
        root_namespace: "mesh-root",
        port: 80,
    };
    assert!(
        !p("istio-system", class).applies_to(&t),
        "the root namespace is configurable"
    );
    assert!(p("mesh-root", class).applies_to(&t));
    // A policy of another namespace reaches only its own Services.
    let t = Target {
        gateway: &gw,
        service: Some(&cart),
        service_kind: Default::default(),
        root_namespace: "istio-system",
        port: 80,
    };
    assert!(p("shop", "[{kind: Service, name: cart}]").applies_to(&t));
    assert!(
        !p("shop", "[{kind: Gateway, name: waypoint}]").applies_to(&t),
        "the Gateway is default's"
    );
}

/// A deny-all stand-in that cannot be placed covers what its namespace could target.
#[test]
fn unplaced_deny_all_stays_in_its_namespace() {
    let gw = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let cart = ObjectName {
        namespace: "shop".into(),
        name: "cart".into(),
    };
    let echo = ObjectName {
        namespace: "default".into(),
        name: "echo".into(),
    };
    // A kind Istio does not attach to waypoints.
    let se = [ObjectRef {
        group: Some("apps".into()),
        kind: Some("Deployment".into()),
        name: "x".into(),
        ..ObjectRef::default()
    }];
    let t = |service| Target {
        gateway: &gw,
        service,
        service_kind: Default::default(),
        root_namespace: "istio-system",
        port: 80,
    };
    let own = AuthorizationPolicy::deny_all("default", "p", &se);
    assert!(
        own.applies_to(&t(None)) && own.applies_to(&t(Some(&cart))),
        "the waypoint's namespace: everything"
    );
    let root = AuthorizationPolicy::deny_all("istio-system", "p", &se);
    assert!(
        root.applies_to(&t(None)) && root.applies_to(&t(Some(&cart))),
        "the root namespace: everything"
    );
    let shop = AuthorizationPolicy::deny_all("shop", "p", &se);
    assert!(shop.applies_to(&t(Some(&cart))));
    assert!(
        !shop.applies_to(&t(Some(&echo))) && !shop.applies_to(&t(None)),
        "shop's policy never denies default's traffic"
    );
    let placed = AuthorizationPolicy::deny_all(
        "shop",
        "p",
        &[ObjectRef {
            kind: Some("Service".into()),
            name: "cart".into(),
            ..ObjectRef::default()
        }],
    );
    assert!(!placed.unplaced && placed.applies_to(&t(Some(&cart))));
    // A ServiceEntry ref is placed: its stand-in denies that ServiceEntry's hosts only,
    // not the whole waypoint (nor a Kubernetes Service of the same name).
    let se_ref = [ObjectRef {
        group: Some("networking.istio.io".into()),
        kind: Some("ServiceEntry".into()),
        name: "ext".into(),
        ..ObjectRef::default()
    }];
    let own = AuthorizationPolicy::deny_all("default", "p", &se_ref);
    let ext = ObjectName {
        namespace: "default".into(),
        name: "ext".into(),
    };
    let entry = Target {
        service_kind: ServiceKind::ServiceEntry,
        ..t(Some(&ext))
    };
    assert!(!own.unplaced && own.applies_to(&entry));
    assert!(
        !own.applies_to(&t(Some(&ext)))
            && !own.applies_to(&t(Some(&echo)))
            && !own.applies_to(&t(None))
    );
}

/// The policies of the waypoint end-to-end test (tests/tests/e2e/waypoint.rs).
#[test]
fn e2e_policies() {
    let ps = parse(
        r#"
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - to: [{operation: {ports: ["80"], paths: ["/admin", "/admin/*"]}}]
  - to: [{operation: {ports: ["80"], methods: ["DELETE"]}}]
  - to: [{operation: {ports: ["80"]}}]
    when: [{key: "request.headers[x-block]", values: ["yes"]}]
- name: allow-client
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: ALLOW
  rules:
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {notPaths: ["/admin-only"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client"]}}]
    to: [{operation: {ports: ["9000"]}}]
  - from: [{source: {principals: ["cluster.local/ns/default/sa/admin"]}}]
"#,
    )
    .unwrap();
    for p in &ps {
        p.validate().unwrap();
    }
    let all: Vec<&AuthorizationPolicy> = ps.iter().collect();
    assert!(req().path("/hello").allowed(&all));
    let v = req()
        .path(&crate::path::normalize("/x/%2e%2e/admin").unwrap())
        .verdict(&all);
    assert_eq!(v.denied_by.as_deref(), Some("default/deny-admin"));
    assert!(!req().path("/admin/x").allowed(&all));
    assert!(
        req().port(8080).path("/admin").allowed(&all),
        "the DENY rules name port 80"
    );
    assert!(!req().method("DELETE").allowed(&all));
    assert!(!req()
        .header("x-block", b"no")
        .header("x-block", b"yes")
        .allowed(&all));
    let v = req().path("/admin-only").verdict(&all);
    assert_eq!(
        v,
        Verdict {
            allowed: false,
            denied_by: None,
            audited_by: vec![]
        }
    );
    assert!(req().port(9000).path("/admin-only").allowed(&all));
    assert!(req()
        .id(Some(("default", "admin")))
        .path("/admin-only")
        .allowed(&all));
    assert!(!req().id(Some(("default", "other"))).allowed(&all));
    // Opaque TCP: the DENY rules keep only their ports (port 80 is denied outright),
    // and the ALLOW rules that need paths are gone (port 9000 stays allowed).
    let tcp: Vec<AuthorizationPolicy> = ps.iter().map(AuthorizationPolicy::for_tcp).collect();
    let tcp: Vec<&AuthorizationPolicy> = tcp.iter().collect();
    let opaque = |port: u16, sa: &str| {
        req()
            .id(Some(("default", sa)))
            .port(port)
            .method("")
            .path("")
            .host("")
            .allowed(&tcp)
    };
    assert!(
        !opaque(80, "client"),
        "HTTP-only DENY fields must not let TCP through"
    );
    assert!(opaque(9000, "client"));
    assert!(
        !opaque(8080, "client"),
        "the client's other ALLOW rule needs HTTP"
    );
    assert!(!opaque(80, "admin") && opaque(8080, "admin"));
}

#[test]
fn deny_by_path_and_method() {
    let deny = policy("action: DENY\nrules:\n- to: [{operation: {paths: ['/admin', '/admin/*']}}]\n- to: [{operation: {methods: [DELETE]}}]");
    let v = req().path("/admin").verdict(&[&deny]);
    assert_eq!(
        v,
        Verdict {
            allowed: false,
            denied_by: Some("default/p".into()),
            audited_by: vec![]
        }
    );
    assert!(!req().path("/admin/x/y").allowed(&[&deny]));
    assert!(
        req().path("/administrator").allowed(&[&deny]),
        "'/admin/*' is the prefix '/admin/'"
    );
    assert!(req().path("/x").allowed(&[&deny]));
    assert!(!req().method("DELETE").allowed(&[&deny]));
    assert!(
        req().method("delete").allowed(&[&deny]),
        "methods are case-sensitive, as in Istio"
    );
}

#[test]
fn allow_principal_only() {
    let allow =
        policy("rules:\n- from: [{source: {principals: ['cluster.local/ns/default/sa/client']}}]");
    assert_eq!(
        req().verdict(&[&allow]),
        Verdict {
            allowed: true,
            denied_by: None,
            audited_by: vec![]
        }
    );
    assert_eq!(
        req().id(Some(("default", "other"))).verdict(&[&allow]),
        Verdict {
            allowed: false,
            denied_by: None,
            audited_by: vec![]
        }
    );
    // A dot in a principal is a dot, never a regex wildcard.
    assert!(!req().id(Some(("defaultX", "client"))).allowed(&[&allow]));
}

#[test]
fn decisions_without_and_with_allow() {
    assert!(req().allowed(&[]), "no policy: allowed");
    let deny = policy("action: DENY\nrules: [{to: [{operation: {paths: ['/admin']}}]}]");
    assert!(
        req().allowed(&[&deny]),
        "no ALLOW policy and no DENY match: allowed"
    );
    let allow = policy("rules: [{to: [{operation: {paths: ['/public*']}}]}]");
    assert!(
        !req().path("/x").allowed(&[&deny, &allow]),
        "an ALLOW exists but none matches"
    );
    assert!(req().path("/public/a").allowed(&[&deny, &allow]));
    let allow_nothing = policy("rules: []");
    assert!(
        !req().allowed(&[&allow_nothing]),
        "ALLOW without rules matches nothing"
    );
    let deny_nothing = policy("action: DENY\nrules: []");
    assert!(req().allowed(&[&deny_nothing]));
    let allow_all = policy("rules: [{}]");
    assert!(req().allowed(&[&allow_all]));
    let deny_all = policy("action: DENY\nrules: [{}]");
    assert!(
        !req().allowed(&[&allow_all, &deny_all]),
        "DENY wins over ALLOW"
    );
}

#[test]
fn audit_does_not_decide() {
    let audit = policy("action: AUDIT\nrules: [{to: [{operation: {paths: ['/secret*']}}]}]");
    let v = req().path("/secret/x").verdict(&[&audit]);
    assert_eq!(
        v,
        Verdict {
            allowed: true,
            denied_by: None,
            audited_by: vec!["default/p".into()]
        }
    );
    assert_eq!(
        req().path("/x").verdict(&[&audit]).audited_by,
        Vec::<String>::new()
    );
    let allow = policy("rules: [{to: [{operation: {paths: ['/public']}}]}]");
    let v = req().path("/secret/x").verdict(&[&audit, &allow]);
    assert!(!v.allowed, "an AUDIT match doesn't allow");
    assert_eq!(v.audited_by, ["default/p"]);
}

#[test]
fn not_forms() {
    let allow = policy(
        "rules:\n- from: [{source: {notNamespaces: [kube-system], notPrincipals: ['*/sa/evil']}}]\n  to: [{operation: {notPaths: ['/admin*'], notMethods: [DELETE], notPorts: ['9090'], notHosts: ['*.internal']}}]",
    );
    assert!(req().allowed(&[&allow]));
    assert!(!req().id(Some(("kube-system", "x"))).allowed(&[&allow]));
    assert!(!req().id(Some(("default", "evil"))).allowed(&[&allow]));
    assert!(!req().path("/admin/x").allowed(&[&allow]));
    assert!(!req().method("DELETE").allowed(&[&allow]));
    assert!(!req().port(9090).allowed(&[&allow]));
    assert!(!req().host("db.internal:80").allowed(&[&allow]));
    let sa = policy("rules: [{from: [{source: {notServiceAccounts: [default/evil]}}]}]");
    assert!(req().allowed(&[&sa]));
    assert!(!req().id(Some(("default", "evil"))).allowed(&[&sa]));
    let sa = policy("rules: [{from: [{source: {serviceAccounts: [default/client]}}]}]");
    assert!(req().allowed(&[&sa]));
    assert!(!req().id(Some(("other", "client"))).allowed(&[&sa]));
}

#[test]
fn ip_blocks() {
    let allow = policy(
        "rules: [{from: [{source: {ipBlocks: ['10.10.1.0/24', '10.10.2.5'], notIpBlocks: ['10.10.1.128/25']}}]}]",
    );
    assert!(req().ip("10.10.1.7").allowed(&[&allow]));
    assert!(req().ip("10.10.2.5").allowed(&[&allow]));
    assert!(
        req().ip("::ffff:10.10.2.5").allowed(&[&allow]),
        "IPv4-mapped peers compare as IPv4"
    );
    assert!(!req().ip("10.10.2.6").allowed(&[&allow]));
    assert!(!req().ip("10.10.1.200").allowed(&[&allow]));
    let deny =
        policy("action: DENY\nrules: [{from: [{source: {remoteIpBlocks: ['192.168.0.0/16']}}]}]");
    assert!(!req().ip("::ffff:192.168.3.4").allowed(&[&deny]));
    assert!(req().ip("10.0.0.1").allowed(&[&deny]));
    let when = policy(
        "rules: [{when: [{key: source.ip, values: ['10.10.0.0/16']}, {key: remote.ip, notValues: ['10.10.9.9']}]}]",
    );
    assert!(req().ip("10.10.3.3").allowed(&[&when]));
    assert!(!req().ip("10.10.9.9").allowed(&[&when]));
    assert!(!req().ip("10.11.0.1").allowed(&[&when]));
}

#[test]
fn ipv4_mapped_ip_blocks_match_ipv4_peers() {
    // `::ffff:10.0.0.0/104` names the IPv4 peers 10.0.0.0/8, as in L4 policies.
    let deny =
        policy("action: DENY\nrules: [{from: [{source: {ipBlocks: ['::ffff:10.0.0.0/104']}}]}]");
    assert!(
        !req().ip("10.1.2.3").allowed(&[&deny]),
        "an IPv4 peer in the mapped block is denied"
    );
    assert!(
        !req().ip("::ffff:10.1.2.3").allowed(&[&deny]),
        "so is its IPv4-mapped form"
    );
    assert!(req().ip("11.1.2.3").allowed(&[&deny]));
    let when = policy(
        "action: DENY\nrules: [{when: [{key: source.ip, values: ['::ffff:10.0.0.0/104']}]}]",
    );
    assert!(!req().ip("10.1.2.3").allowed(&[&when]));
    let allow = policy("rules: [{from: [{source: {remoteIpBlocks: ['::ffff:192.168.0.0/112']}}]}]");
    assert!(req().ip("192.168.4.5").allowed(&[&allow]));
    assert!(!req().ip("192.169.4.5").allowed(&[&allow]));
}

#[test]
fn a_request_without_host_is_missing_the_host() {
    // No Host / :authority is a missing attribute, not the empty name: it satisfies
    // no ALLOW field about hosts (not even notHosts) and triggers any host DENY.
    let not_evil = policy("rules: [{to: [{operation: {notHosts: ['evil.com']}}]}]");
    assert!(req().host("echo").allowed(&[&not_evil]));
    assert!(
        !req().host("").allowed(&[&not_evil]),
        "a missing host passed an ALLOW notHosts"
    );
    let deny = policy("action: DENY\nrules: [{to: [{operation: {notHosts: ['echo']}}]}]");
    assert!(req().host("echo").allowed(&[&deny]));
    assert!(!req().host("").allowed(&[&deny]));
    let deny_hosts = policy("action: DENY\nrules: [{to: [{operation: {hosts: ['evil.com']}}]}]");
    assert!(
        !req().host("").allowed(&[&deny_hosts]),
        "doubt counts for a DENY"
    );
}

#[test]
fn hosts_ignore_port_and_case() {
    let allow = policy(
        "rules: [{to: [{operation: {hosts: ['echo.default.svc.cluster.local', '*.example.com', 'api.*']}}]}]",
    );
    for host in [
        "echo.default.svc.cluster.local",
        "ECHO.Default.svc.cluster.local:80",
        "echo.default.svc.cluster.local.",
        "a.example.com:8080",
        "A.EXAMPLE.COM",
        "api.foo",
    ] {
        assert!(req().host(host).allowed(&[&allow]), "{host}");
    }
    for host in [
        "example.com",
        "echo",
        "",
        "evil.com:80",
        "echo.default.svc.cluster.local.evil.com",
        "x.example.com.evil",
    ] {
        assert!(!req().host(host).allowed(&[&allow]), "{host}");
    }
    let deny = policy("action: DENY\nrules: [{to: [{operation: {hosts: ['evil.com']}}]}]");
    assert!(
        !req().host("EVIL.com:1234").allowed(&[&deny]),
        "a port can't dodge a DENY"
    );
    assert!(
        !req().host("evil.com.").allowed(&[&deny]),
        "a trailing dot can't dodge a DENY"
    );
    assert!(!req()
        .host("[::1]:80")
        .allowed(&[&policy("rules: [{to: [{operation: {hosts: ['[::2]']}}]}]")]));
    assert!(req()
        .host("[::1]:80")
        .allowed(&[&policy("rules: [{to: [{operation: {hosts: ['[::1]']}}]}]")]));
}

#[test]
fn paths_prefix_suffix_any() {
    let allow =
        policy("rules: [{to: [{operation: {paths: ['/exact', '/api/*', '/pre*', '*/info']}}]}]");
    for path in [
        "/exact",
        "/api/",
        "/api/v1/x",
        "/pre",
        "/prefix/a",
        "/info",
        "/a/b/info",
    ] {
        assert!(req().path(path).allowed(&[&allow]), "{path}");
    }
    for path in ["/exact/", "/Exact", "/api", "/info/", "/xinfo", "/", "/ex"] {
        assert!(!req().path(path).allowed(&[&allow]), "{path}");
    }
    let any = policy("rules: [{to: [{operation: {paths: ['*']}}]}]");
    assert!(req().path("/").allowed(&[&any]));
}

#[test]
fn ports() {
    let allow = policy("rules: [{to: [{operation: {ports: ['80', '8080']}}]}]");
    assert!(req().port(80).allowed(&[&allow]));
    assert!(req().port(8080).allowed(&[&allow]));
    assert!(!req().port(9090).allowed(&[&allow]));
    let when = policy("rules: [{when: [{key: destination.port, values: ['80']}]}]");
    assert!(req().port(80).allowed(&[&when]));
    assert!(!req().port(81).allowed(&[&when]));
}

#[test]
fn repeated_headers_allow() {
    let allow = policy("rules: [{when: [{key: 'request.headers[X-Role]', values: [good]}]}]");
    assert!(req().header("x-role", b"good").allowed(&[&allow]));
    assert!(req()
        .header("x-role", b"good")
        .header("x-role", b"good")
        .allowed(&[&allow]));
    assert!(
        !req()
            .header("x-role", b"good")
            .header("x-role", b"evil")
            .allowed(&[&allow]),
        "every value must match"
    );
    assert!(!req()
        .header("x-role", b"evil")
        .header("x-role", b"good")
        .allowed(&[&allow]));
    assert!(
        !req().allowed(&[&allow]),
        "an absent header matches no value"
    );
    // Never joined: "good,good" is one value and not "good".
    assert!(!req().header("x-role", b"good,good").allowed(&[&allow]));
    // Bytes that aren't UTF-8 compare as bytes and match no plain pattern.
    assert!(!req().header("x-role", b"go\xffod").allowed(&[&allow]));
    let not = policy("rules: [{when: [{key: 'request.headers[x-role]', notValues: [evil]}]}]");
    assert!(req().allowed(&[&not]), "absent header: notValues hold");
    assert!(req().header("x-role", b"good").allowed(&[&not]));
    assert!(!req()
        .header("x-role", b"good")
        .header("x-role", b"evil")
        .allowed(&[&not]));
    let presence = policy("rules: [{when: [{key: 'request.headers[x-token]', values: ['*']}]}]");
    assert!(req().header("x-token", b"t").allowed(&[&presence]));
    assert!(
        !req().header("x-token", b"").allowed(&[&presence]),
        "'*' needs a non-empty value"
    );
    assert!(!req()
        .header("x-token", b"t")
        .header("x-token", b"")
        .allowed(&[&presence]));
}

#[test]
fn repeated_headers_deny() {
    let deny =
        policy("action: DENY\nrules: [{when: [{key: 'request.headers[x-role]', values: [evil]}]}]");
    assert!(
        !req()
            .header("x-role", b"good")
            .header("x-role", b"evil")
            .allowed(&[&deny]),
        "one value is enough"
    );
    assert!(!req().header("X-Role", b"evil").allowed(&[&deny]));
    assert!(req().header("x-role", b"good").allowed(&[&deny]));
    assert!(req().allowed(&[&deny]));
    let not = policy(
        "action: DENY\nrules: [{when: [{key: 'request.headers[x-role]', notValues: [good]}]}]",
    );
    assert!(req().header("x-role", b"good").allowed(&[&not]));
    assert!(
        !req()
            .header("x-role", b"good")
            .header("x-role", b"evil")
            .allowed(&[&not]),
        "an innocent value can't hide another"
    );
    assert!(
        !req().allowed(&[&not]),
        "absent header: a DENY notValues holds"
    );
    let prefix =
        policy("action: DENY\nrules: [{when: [{key: 'request.headers[user-agent]', values: ['curl*', '*bot']}]}]");
    assert!(!req().header("user-agent", b"curl/8").allowed(&[&prefix]));
    assert!(!req().header("user-agent", b"xbot").allowed(&[&prefix]));
    assert!(req().header("user-agent", b"Curl/8").allowed(&[&prefix]));
}

#[test]
fn unknown_principal() {
    let anon = || req().id(None);
    // ALLOW: a missing identity satisfies no identity field, negative ones included,
    // or "anyone but the attacker" would let in someone we know nothing about.
    let not = policy(
        "rules: [{from: [{source: {notPrincipals: ['cluster.local/ns/default/sa/evil']}}]}]",
    );
    assert!(!anon().allowed(&[&not]));
    assert!(!anon().allowed(&[&policy("rules: [{from: [{source: {principals: ['*']}}]}]")]));
    assert!(!anon().allowed(&[&policy(
        "rules: [{from: [{source: {notNamespaces: [evil]}}]}]"
    )]));
    assert!(!anon().allowed(&[&policy(
        "rules: [{from: [{source: {notServiceAccounts: [default/evil]}}]}]"
    )]));
    assert!(!anon().allowed(&[&policy(
        "rules: [{when: [{key: source.namespace, notValues: [evil]}]}]"
    )]));
    // DENY principals ["*"]: Istio would NOT deny here ('*' is a presence match and
    // the principal is absent). We deny: a missing attribute counts for a DENY
    // match, so presenting no identity can never dodge a DENY; the doubt is
    // resolved against the unknown peer. (The waypoint always knows the peer from
    // HBONE mTLS, so this only concerns callers without one.)
    let deny_any = policy("action: DENY\nrules: [{from: [{source: {principals: ['*']}}]}]");
    let v = anon().verdict(&[&deny_any]);
    assert_eq!(v.denied_by.as_deref(), Some("default/p"));
    assert!(
        !req().allowed(&[&deny_any]),
        "and any known principal is denied too"
    );
    // The usual Istio "deny unauthenticated" policy still denies the anonymous peer
    // and lets known ones through.
    let deny_anon = policy("action: DENY\nrules: [{from: [{source: {notPrincipals: ['*']}}]}]");
    assert!(!anon().allowed(&[&deny_anon]));
    assert!(req().allowed(&[&deny_anon]));
    let deny_ns =
        policy("action: DENY\nrules: [{when: [{key: source.principal, values: ['*/sa/evil']}]}]");
    assert!(!anon().allowed(&[&deny_ns]));
    assert!(req().allowed(&[&deny_ns]));
}

#[test]
fn rule_and_or_semantics() {
    // Fields inside an operation are ANDed, operations ORed, rules ORed.
    let allow = policy(
        "rules:\n- to: [{operation: {methods: [GET], paths: ['/read*']}}, {operation: {methods: [POST], paths: ['/write']}}]\n  when: [{key: 'request.headers[x-ok]', values: ['1']}]\n- from: [{source: {principals: ['*/sa/admin']}}]",
    );
    let ok = || req().header("x-ok", b"1");
    assert!(ok().path("/read/a").allowed(&[&allow]));
    assert!(ok().method("POST").path("/write").allowed(&[&allow]));
    assert!(!ok().method("POST").path("/read").allowed(&[&allow]));
    assert!(
        !req().path("/read").allowed(&[&allow]),
        "when must hold too"
    );
    assert!(req()
        .id(Some(("ops", "admin")))
        .method("PUT")
        .path("/x")
        .allowed(&[&allow]));
}

#[test]
fn unvalidated_values_fail_closed() {
    let bad_allow = AuthorizationPolicy {
        name: "p".into(),
        namespace: "default".into(),
        target_refs: vec![],
        action: Action::Allow,
        provider: None,
        rules: vec![Rule {
            when: vec![Condition {
                key: "connection.sni".into(),
                values: vec!["x".into()],
                not_values: vec![],
            }],
            ..Rule::default()
        }],
        unplaced: false,
    };
    assert!(!req().allowed(&[&bad_allow]));
    let bad_deny = AuthorizationPolicy {
        action: Action::Deny,
        ..bad_allow.clone()
    };
    assert!(!req().allowed(&[&bad_deny]));
    let mut ports = bad_deny.clone();
    ports.rules[0] = Rule {
        to: vec![To {
            operation: Operation {
                not_ports: vec!["http".into()],
                ..Operation::default()
            },
        }],
        ..Rule::default()
    };
    assert!(!req().allowed(&[&ports]));
}

/// Istio's request principal and `request.auth.*`: no token means no principal and no
/// claims (known, not doubt), so `requestPrincipals` match nothing and
/// `notRequestPrincipals` / `notValues` hold, for ALLOW and DENY alike.
#[test]
fn request_principals_and_jwt_claims() {
    use serde_json::json;
    let alice = || {
        req().jwt(
            json!({"iss": "https://idp", "sub": "alice", "aud": ["web", "api"], "azp": "cli",
        "groups": ["dev", "ops"], "org": {"team": "core"}, "scope": "read write", "level": 3}),
        )
    };
    let allow = policy("rules: [{from: [{source: {requestPrincipals: ['https://idp/*']}}]}]");
    assert!(alice().allowed(&[&allow]));
    assert!(!req().allowed(&[&allow]), "no token, no principal");
    assert!(!req()
        .jwt(json!({"iss": "other", "sub": "alice"}))
        .allowed(&[&allow]));
    // Require a token: DENY notRequestPrincipals ['*'].
    let require =
        policy("action: DENY\nrules: [{from: [{source: {notRequestPrincipals: ['*']}}]}]");
    assert!(!req().allowed(&[&require]));
    assert!(alice().allowed(&[&require]));
    // A DENY on a principal does not catch requests without a token.
    let deny_alice = policy(
        "action: DENY\nrules: [{from: [{source: {requestPrincipals: ['https://idp/alice']}}]}]",
    );
    assert!(!alice().allowed(&[&deny_alice]));
    assert!(req().allowed(&[&deny_alice]));
    let when = |cond: &str| policy(&format!("rules: [{{when: [{cond}]}}]"));
    let cases = [
        (
            "{key: request.auth.principal, values: ['https://idp/alice']}",
            true,
            false,
        ),
        ("{key: request.auth.audiences, values: [api]}", true, false),
        (
            "{key: request.auth.presenter, values: ['cl*']}",
            true,
            false,
        ),
        (
            "{key: 'request.auth.claims[groups]', values: [ops]}",
            true,
            false,
        ),
        (
            "{key: 'request.auth.claims[groups]', notValues: [ops]}",
            false,
            true,
        ),
        (
            "{key: 'request.auth.claims[org][team]', values: [core]}",
            true,
            false,
        ),
        (
            "{key: 'request.auth.claims[org][team]', values: [other]}",
            false,
            false,
        ),
        (
            "{key: 'request.auth.claims[scope]', values: [write]}",
            true,
            false,
        ),
        (
            "{key: 'request.auth.claims[missing]', notValues: [x]}",
            true,
            true,
        ),
    ];
    for (cond, with_alice, without) in cases {
        let p = when(cond);
        assert_eq!(alice().allowed(&[&p]), with_alice, "{cond}");
        assert_eq!(req().allowed(&[&p]), without, "{cond} without a token");
    }
    // A claim that is no string (a number): doubt, against an ALLOW and for a DENY.
    assert!(!alice().allowed(&[&when("{key: 'request.auth.claims[level]', values: ['3']}")]));
    let deny = policy(
        "action: DENY\nrules: [{when: [{key: 'request.auth.claims[level]', notValues: ['3']}]}]",
    );
    assert!(!alice().allowed(&[&deny]));
    // On opaque TCP there is no JWT: an ALLOW needing one never allows, a DENY loses the field.
    let tcp = allow.for_tcp();
    assert!(tcp.rules.is_empty());
    let deny_tcp = deny_alice.for_tcp();
    assert_eq!(deny_tcp.rules[0].from[0].source, Source::default());
}

/// Every targetRef form Istio attaches to a waypoint validates (it was refused, and in
/// a cluster became a deny-all of the whole waypoint).
#[test]
fn istios_target_ref_forms_validate() {
    for refs in [
        "[{kind: Service, group: core, name: a}]",
        "[{kind: Service, group: '', name: a}]",
        "[{kind: ServiceEntry, group: networking.istio.io, name: ext}]",
        "[{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]",
        "[{kind: GatewayClass, group: gateway.networking.k8s.io, name: istio-waypoint}]",
    ] {
        let p: AuthorizationPolicy = serde_yaml::from_str(&format!(
            "name: p\nnamespace: default\ntargetRefs: {refs}\naction: DENY\nrules: [{{}}]"
        ))
        .expect(refs);
        assert_eq!(p.validate(), Ok(()), "{refs}");
    }
}
