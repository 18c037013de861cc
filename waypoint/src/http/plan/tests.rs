use std::path::Path;

use http::Request;

use super::*;

const MESH: &str = "workloads:\n\
    - {uid: echo, name: echo, namespace: default, serviceAccount: echo, workloadIps: [10.0.0.2], protocol: HBONE, node: node1, services: {default/echo.default.svc.cluster.local: {80: 8080}}}\n\
    services:\n\
    - {name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {80: 8080}}\n";
const SVC: &str = "parentRefs: [{kind: Service, group: \"\", name: echo}]";

fn plan(l7: &str, req: Request<()>) -> (Result<(), LocalReply>, Notes, http::request::Parts) {
    let (r, notes, parts) = plan_as(MESH, Protocol::Http1, l7, req);
    (r.map(|_| ()), notes, parts)
}

/// The plan for `req` from a client speaking `proto`: whether it goes upstream as HTTP/2.
fn plan_as(
    mesh: &str,
    proto: Protocol,
    l7: &str,
    req: Request<()>,
) -> (Result<bool, LocalReply>, Notes, http::request::Parts) {
    plan_with(mesh, proto, l7, req, |p| p.http2)
}

/// The plan for `req`, `f` reading what a test wants of it.
fn plan_with<T>(
    mesh: &str,
    proto: Protocol,
    l7: &str,
    req: Request<()>,
    f: impl FnOnce(Plan) -> T,
) -> (Result<T, LocalReply>, Notes, http::request::Parts) {
    plan_any(mesh, proto, l7, req, |p| {
        assert_eq!(p.backend.endpoints.len(), 1);
        assert_eq!(
            p.backend.endpoints[0].0,
            "10.0.0.2:8080".parse().expect("addr")
        );
        f(p)
    })
}

/// The plan as made for `me` (the waypoint's own workload, default: one with no
/// locality), whatever its backend.
fn plan_any<T>(
    mesh: &str,
    proto: Protocol,
    l7: &str,
    req: Request<()>,
    f: impl FnOnce(Plan) -> T,
) -> (Result<T, LocalReply>, Notes, http::request::Parts) {
    let cfg = Config::parse(Path::new("t.yaml"), &format!("{mesh}{l7}")).expect("test config");
    let gateway = ObjectName {
        namespace: "default".into(),
        name: "waypoint".into(),
    };
    let identity: Identity = "spiffe://cluster.local/ns/default/sa/waypoint"
        .parse()
        .expect("identity");
    let tunnel = Tunnel {
        src_identity: "spiffe://cluster.local/ns/default/sa/client"
            .parse()
            .expect("identity"),
        src_addr: "10.0.0.1:40000".parse().expect("addr"),
        target: "10.96.0.10:80".parse().expect("addr"),
        trace: ztunnel::hbone::TraceParent::new(),
    };
    let jwks = authn::JwksStore::new(authn::JwksSettings::default());
    let me = cfg
        .state
        .workload_by_uid(&ztunnel::state::WorkloadUid("waypoint".into()))
        .map(|w| (**w).clone())
        .unwrap_or_else(|| ztunnel::state::Workload::new("waypoint", "waypoint", "default"));
    let inb = Inbound {
        me: &me,
        gateway: &gateway,
        root_namespace: "istio-system",
        identity: &identity,
        tunnel: &tunnel,
        cfg: &cfg,
        proto,
        jwks: &jwks,
    };
    let (mut parts, ()) = req.into_parts();
    let mut notes = Notes::default();
    let r = admit(&inb, &mut parts, &mut notes)
        .and_then(|a| build(&inb, a, &mut parts, &mut notes))
        .map(f);
    (r, notes, parts)
}

#[test]
fn the_service_port_protocol_picks_the_upstream_http_version() {
    let with = |proto: &str| {
        MESH.replace(
            "ports: {80: 8080}}\n",
            &format!("ports: {{80: 8080}}, appProtocols: {{80: {proto}}}}}\n"),
        )
    };
    // A port named http: HTTP/1.1 upstream even for an HTTP/2 client (nginx on a plain port).
    let (r, _, parts) = plan_as(&with("HTTP11"), Protocol::Http2, "", get("/x"));
    assert_eq!(r.ok(), Some(false));
    assert_eq!(
        (parts.version, parts.uri.to_string()),
        (http::Version::HTTP_11, "/x".to_string())
    );
    assert_eq!(
        parts.headers.get("host").map(|v| v.as_bytes()),
        Some(&b"echo.default.svc.cluster.local"[..])
    );
    // http2 / grpc / h2c ports: HTTP/2 with prior knowledge even for an HTTP/1.1 client.
    for proto in ["HTTP2", "GRPC"] {
        let (r, _, parts) = plan_as(&with(proto), Protocol::Http1, "", get("/x"));
        assert_eq!(r.ok(), Some(true), "{proto}");
        assert_eq!(
            parts.uri.to_string(),
            "http://echo.default.svc.cluster.local/x"
        );
        assert!(
            parts.headers.get("host").is_none(),
            "{proto}: HTTP/2 carries :authority, not Host"
        );
    }
    // Unknown (an unnamed port), TCP, TLS: the client's version, as Istio's waypoint.
    for (mesh, client, want) in [
        (MESH.to_string(), Protocol::Http2, true),
        (MESH.to_string(), Protocol::Http1, false),
        (with("TCP"), Protocol::Http2, true),
    ] {
        assert_eq!(plan_as(&mesh, client, "", get("/x")).0.ok(), Some(want));
    }
}

fn get(path: &str) -> Request<()> {
    Request::get(path)
        .header("host", "echo.default.svc.cluster.local")
        .body(())
        .expect("request")
}

fn status(r: &Result<(), LocalReply>) -> Option<(u16, &'static str)> {
    r.as_ref().err().map(|e| (e.status.as_u16(), e.flags))
}

#[test]
fn without_routes_the_addressed_service_gets_the_normalized_path() {
    let (r, notes, parts) = plan("", get("/a/./b/../c?x=1"));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(parts.uri, "/a/c?x=1");
    assert_eq!(notes.path.as_deref(), Some("/a/c"));
    assert_eq!(
        notes.backend_service.map(|s| s.name.clone()).as_deref(),
        Some("echo")
    );
    assert!(parts.headers.contains_key("x-forwarded-client-cert"));
}

#[test]
fn a_deny_policy_gives_403() {
    let l7 = "authorizationPolicies:\n- {name: p, namespace: default, targetRefs: [{kind: Service, name: echo}], action: DENY, rules: [{}]}\n";
    let (r, notes, _) = plan(l7, get("/"));
    assert_eq!(status(&r), Some((403, "DENY")));
    assert_eq!(notes.denied_by.as_deref(), Some("default/p"));
}

/// Authentication runs before authorization: a bad token is 401 even where a
/// policy would allow, no token reaches the policy (here 403).
#[test]
fn a_bad_token_gives_401_before_policy() {
    let jwks = r#"{"keys":[{"kty":"EC","crv":"P-256","kid":"a","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;
    let l7 = format!(
        "requestAuthentications:\n- {{name: jwt, namespace: default, targetRefs: [{{kind: Service, name: echo}}], jwtRules: [{{issuer: iss, jwks: '{jwks}'}}]}}\n\
         authorizationPolicies:\n- {{name: p, namespace: default, targetRefs: [{{kind: Service, name: echo}}], rules: [{{from: [{{source: {{requestPrincipals: ['*']}}}}]}}]}}\n"
    );
    let (r, _, _) = plan(&l7, get("/"));
    assert_eq!(status(&r), Some((403, "DENY")));
    // iss "iss", signed by no key of the set.
    let bad = "eyJhbGciOiJFUzI1NiIsImtpZCI6ImEifQ.eyJpc3MiOiJpc3MiLCJzdWIiOiJ4In0.AAAA";
    let req = Request::get("/")
        .header("host", "echo.default.svc.cluster.local")
        .header("authorization", format!("Bearer {bad}"))
        .body(())
        .expect("request");
    let (r, _, _) = plan(&l7, req);
    assert_eq!(status(&r), Some((401, "-")));
    let e = r.expect_err("refused");
    assert_eq!(e.message, "Jwt verification fails");
    assert_eq!(
        e.www_authenticate.as_deref(),
        Some("Bearer realm=\"http://echo.default.svc.cluster.local/\", error=\"invalid_token\"")
    );
}

#[test]
fn no_matching_route_gives_404() {
    let l7 = format!("httpRoutes:\n- {{name: echo, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: PathPrefix, value: /api}}}}]}}]}}\n");
    let (r, notes, _) = plan(&l7, get("/other"));
    assert_eq!(status(&r), Some((404, "NR")));
    let (r, notes_api, _) = plan(&l7, get("/api/x"));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        (notes.route, notes_api.route.as_deref()),
        (None, Some("default/echo#0"))
    );
}

fn ws_get(path: &str) -> Request<()> {
    Request::get(path)
        .header("host", "echo.default.svc.cluster.local")
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .body(())
        .expect("request")
}

#[test]
fn websocket_upgrades_are_authorized_routed_and_kept() {
    let l7 = "authorizationPolicies:\n- {name: p, namespace: default, targetRefs: [{kind: Service, name: echo}], action: DENY, rules: [{to: [{operation: {paths: [/private]}}]}]}\n";
    let (r, _, parts) = plan(l7, ws_get("/chat"));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(
        parts.headers.get("upgrade").map(|v| v.as_bytes()),
        Some(&b"websocket"[..])
    );
    assert_eq!(
        parts.headers.get("connection").map(|v| v.as_bytes()),
        Some(&b"upgrade"[..])
    );
    assert!(parts.headers.contains_key("sec-websocket-key"));
    assert_eq!(status(&plan(l7, ws_get("/private")).0), Some((403, "DENY")));
    // Any other upgrade is dropped, as Envoy without upgrade config (h2c included).
    let h2c = Request::get("/")
        .header("host", "echo")
        .header("connection", "upgrade, http2-settings")
        .header("upgrade", "h2c")
        .body(())
        .expect("request");
    let (r, _, parts) = plan("", h2c);
    assert!(r.is_ok());
    assert!(parts.headers.get("upgrade").is_none() && parts.headers.get("connection").is_none());
}

#[test]
fn an_extended_connect_goes_to_each_backend_in_its_version() {
    let connect = || {
        let mut r = Request::connect("http://echo.default.svc.cluster.local/chat")
            .version(http::Version::HTTP_2)
            .body(())
            .expect("request");
        r.extensions_mut()
            .insert(hyper::ext::Protocol::from_static("websocket"));
        r
    };
    // HTTP/1.1 backend (port of unknown protocol: an HTTP/2 client would get h2, so
    // name it http): an upgrade GET.
    let h1 = MESH.replace(
        "ports: {80: 8080}}\n",
        "ports: {80: 8080}, appProtocols: {80: HTTP11}}\n",
    );
    let (r, _, parts) = plan_as(&h1, Protocol::Http2, "", connect());
    assert_eq!(r.ok(), Some(false));
    assert_eq!(
        (parts.method.as_str(), parts.uri.to_string()),
        ("GET", "/chat".to_string())
    );
    assert_eq!(
        parts.headers.get("upgrade").map(|v| v.as_bytes()),
        Some(&b"websocket"[..])
    );
    // HTTP/2 backend: extended CONNECT again.
    let h2 = MESH.replace(
        "ports: {80: 8080}}\n",
        "ports: {80: 8080}, appProtocols: {80: HTTP2}}\n",
    );
    let (r, _, parts) = plan_as(&h2, Protocol::Http2, "", connect());
    assert_eq!(r.ok(), Some(true));
    assert_eq!(parts.method, Method::CONNECT);
    assert_eq!(
        parts
            .extensions
            .get::<hyper::ext::Protocol>()
            .map(|p| p.as_str()),
        Some("websocket")
    );
    assert!(parts.headers.get("upgrade").is_none());
    // Policies see the GET whatever the client's version.
    let deny_get = "authorizationPolicies:\n- {name: p, namespace: default, targetRefs: [{kind: Service, name: echo}], action: DENY, rules: [{to: [{operation: {methods: [GET]}}]}]}\n";
    assert_eq!(
        plan_as(&h2, Protocol::Http2, deny_get, connect())
            .0
            .err()
            .map(|e| e.status.as_u16()),
        Some(403)
    );
}

/// A backend in another namespace is resolved only with a ReferenceGrant there for
/// routes of this kind from this namespace: otherwise 500, as Gateway API requires.
#[test]
fn cross_namespace_backends_need_a_reference_grant() {
    let mesh = MESH
        .replace("services: {default/echo.default.svc.cluster.local: {80: 8080}}", "services: {default/echo.default.svc.cluster.local: {80: 8080}, shop/api.shop.svc.cluster.local: {80: 8080}}")
        + "- {name: api, namespace: shop, hostname: api.shop.svc.cluster.local, vips: [\"/10.96.0.20\"], ports: {80: 8080}}\n";
    let route = format!("httpRoutes:\n- {{name: r, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: api, namespace: shop, port: 80}}]}}]}}\n");
    let (r, _, _) = plan_as(&mesh, Protocol::Http1, &route, get("/"));
    let e = r.expect_err("no grant");
    assert_eq!((e.status.as_u16(), e.flags), (500, "NR"));
    assert!(e.message.contains("ReferenceGrant"), "{}", e.message);
    let grant = |kind: &str, name: &str| {
        format!("referenceGrants:\n- {{name: g, namespace: shop, from: [{{group: gateway.networking.k8s.io, kind: {kind}, namespace: default}}], to: [{{group: '', kind: Service{name}}}]}}\n")
    };
    assert!(plan_as(
        &mesh,
        Protocol::Http1,
        &format!("{route}{}", grant("HTTPRoute", ", name: api")),
        get("/")
    )
    .0
    .is_ok());
    assert!(
        plan_as(
            &mesh,
            Protocol::Http1,
            &format!("{route}{}", grant("HTTPRoute", "")),
            get("/")
        )
        .0
        .is_ok(),
        "every Service"
    );
    assert!(
        plan_as(
            &mesh,
            Protocol::Http1,
            &format!("{route}{}", grant("GRPCRoute", "")),
            get("/")
        )
        .0
        .is_err(),
        "another route kind"
    );
    assert!(
        plan_as(
            &mesh,
            Protocol::Http1,
            &format!("{route}{}", grant("HTTPRoute", ", name: db")),
            get("/")
        )
        .0
        .is_err(),
        "another Service"
    );
}

/// A backendRef's header modifiers apply to requests sent to it, before the rule's
/// (so the rule's `set` wins on the same header, as Envoy's route headers over its
/// weighted cluster's); its response modifier comes before the rule's too.
#[test]
fn a_backends_header_modifiers_apply_to_its_requests() {
    let l7 = format!(
        "httpRoutes:\n- {{name: echo, namespace: default, {SVC}, rules: [{{\
         filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{set: [{{name: x-both, value: rule}}]}}}}, \
                   {{type: ResponseHeaderModifier, responseHeaderModifier: {{add: [{{name: x-resp, value: rule}}]}}}}], \
         backendRefs: [{{name: echo, port: 80, filters: [\
           {{type: RequestHeaderModifier, requestHeaderModifier: {{set: [{{name: x-both, value: backend}}, {{name: x-backend, value: echo}}], remove: [x-drop]}}}}, \
           {{type: ResponseHeaderModifier, responseHeaderModifier: {{add: [{{name: x-resp, value: backend}}]}}}}]}}]}}]}}\n"
    );
    let req = Request::get("/")
        .header("host", "echo.default.svc.cluster.local")
        .header("x-drop", "1")
        .body(())
        .expect("request");
    let (r, _, parts) = plan_with(MESH, Protocol::Http1, &l7, req, |p| {
        let mut h = HeaderMap::new();
        for m in &p.response_modifiers {
            m.apply(&mut h);
        }
        h.get_all("x-resp")
            .iter()
            .map(|v| v.to_str().unwrap_or_default().to_string())
            .collect::<Vec<_>>()
    });
    assert_eq!(r.expect("planned"), ["backend", "rule"]);
    let h = |n: &str| {
        parts
            .headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(
        (
            h("x-both").as_deref(),
            h("x-backend").as_deref(),
            h("x-drop")
        ),
        (Some("rule"), Some("echo"), None)
    );
}

/// Endpoints as the plan has them, for a request to the echo VIP.
fn endpoints(mesh: &str, l7: &str, path: &str) -> Result<Vec<String>, LocalReply> {
    let req = Request::get(path)
        .header("host", "echo.default.svc.cluster.local")
        .body(())
        .expect("request");
    let (r, _, _) = plan_any(mesh, Protocol::Http1, l7, req, |p| {
        let mut v: Vec<String> = p
            .backend
            .endpoints
            .iter()
            .map(|(a, _)| a.to_string())
            .collect();
        v.sort();
        v
    });
    r
}

const SPREAD: &str = "workloads:\n\
    - {uid: waypoint, name: waypoint, namespace: default, workloadIps: [10.0.0.9], protocol: HBONE, locality: {region: r1, zone: z1}}\n\
    - {uid: a, name: a, namespace: default, workloadIps: [10.0.0.2], protocol: HBONE, locality: {region: r1, zone: z1}, labels: {version: v1}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}\n\
    - {uid: b, name: b, namespace: default, workloadIps: [10.0.0.3], protocol: HBONE, locality: {region: r1, zone: z2}, labels: {version: v2}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}\n\
    - {uid: c, name: c, namespace: default, workloadIps: [10.0.0.4], protocol: HBONE, locality: {region: r2, zone: z9}, services: {default/echo.default.svc.cluster.local: {80: 8080}}}\n\
    services:\n";

/// A VirtualService destination's subset: the DestinationRule's labels pick the
/// endpoints (a workload whose labels are not known is in no subset); a subset no
/// rule defines gets 503 NC.
#[test]
fn subsets_select_endpoints_by_labels() {
    let mesh = format!("{SPREAD}- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}}}\n");
    let l7 = "destinationRules:\n- {name: echo, namespace: default, host: echo, subsets: [{name: v1, labels: {version: v1}}, {name: v2, labels: {version: v2}}, {name: all}]}\n\
              virtualServices:\n- {name: echo, namespace: default, hosts: [echo], http: [\
              {match: [{uri: {prefix: /v1}}], route: [{destination: {host: echo, subset: v1}}]}, \
              {match: [{uri: {prefix: /v2}}], route: [{destination: {host: echo, subset: v2}}]}, \
              {match: [{uri: {prefix: /all}}], route: [{destination: {host: echo, subset: all}}]}, \
              {match: [{uri: {prefix: /v3}}], route: [{destination: {host: echo, subset: v3}}]}]}\n";
    assert_eq!(endpoints(&mesh, l7, "/v1").expect("v1"), ["10.0.0.2:8080"]);
    assert_eq!(endpoints(&mesh, l7, "/v2").expect("v2"), ["10.0.0.3:8080"]);
    assert_eq!(
        endpoints(&mesh, l7, "/all").expect("all").len(),
        3,
        "an empty selector takes every endpoint"
    );
    let e = endpoints(&mesh, l7, "/v3").expect_err("no such subset");
    assert_eq!((e.status.as_u16(), e.flags), (503, "NC"));
    assert!(e.message.contains("subset \"v3\""), "{}", e.message);
}

/// The Service's load-balancing mode, as ztunnel's: FAILOVER prefers the endpoints
/// closest to the waypoint, STRICT uses only those matching every scope;
/// PASSTHROUGH goes to the original destination.
#[test]
fn the_services_load_balancing_mode_picks_the_endpoints() {
    let svc = |lb: &str| {
        format!("{SPREAD}- {{name: echo, namespace: default, hostname: echo.default.svc.cluster.local, vips: [\"/10.96.0.10\"], ports: {{80: 8080}}{lb}}}\n")
    };
    assert_eq!(endpoints(&svc(""), "", "/").expect("all").len(), 3);
    let failover = svc(", loadBalancer: {mode: Failover, routingPreferences: [Region, Zone]}");
    assert_eq!(
        endpoints(&failover, "", "/").expect("failover"),
        ["10.0.0.2:8080"]
    );
    let strict = svc(", loadBalancer: {mode: Strict, routingPreferences: [Region]}");
    assert_eq!(
        endpoints(&strict, "", "/").expect("strict"),
        ["10.0.0.2:8080", "10.0.0.3:8080"]
    );
    let passthrough = svc(", loadBalancer: {mode: Passthrough}");
    assert_eq!(
        endpoints(&passthrough, "", "/").expect("passthrough"),
        ["10.96.0.10:80"]
    );
}

#[test]
fn unproxiable_requests_are_refused() {
    let connect = Request::connect("echo:80").body(()).expect("request");
    assert_eq!(status(&plan("", connect).0), Some((405, "-")));
    let no_host = Request::get("/").body(()).expect("request");
    assert_eq!(status(&plan("", no_host).0), Some((400, "-")));
    let userinfo = Request::get("/")
        .header("host", "u@echo")
        .body(())
        .expect("request");
    assert_eq!(status(&plan("", userinfo).0), Some((400, "-")));
    let two_hosts = Request::get("/")
        .header("host", "echo")
        .header("host", "other")
        .body(())
        .expect("request");
    let e = plan("", two_hosts).0.expect_err("two Hosts");
    let want = "the request has 2 Host headers; one is allowed";
    assert_eq!((e.status.as_u16(), e.message.as_str()), (400, want));
}

/// A Host that is not `host[:port]` is refused before anything reads it: `web/admin#`
/// was matched by policy as a host, with the path `/public`, and sent to an HTTP/2
/// backend as `http://web/admin#/public`, which asks for `/admin` (issue 39).
#[test]
fn a_host_header_cannot_smuggle_a_path_past_policy() {
    let h2 = MESH.replace(PORTS, &format!("{PORTS}, appProtocols: {{80: HTTP2}}"));
    let policies = format!(
        "authorizationPolicies:\n{}{}",
        deny("admin", "paths: ['/admin*']"),
        deny("host", "hosts: [admin.example.com]")
    );
    let outcome = |host: &str, path: &str| {
        let req = Request::get(path)
            .header("host", host)
            .body(())
            .expect("request");
        let (r, notes, parts) = plan_as(&h2, Protocol::Http1, &policies, req);
        (
            r.map_err(|e| (e.status.as_u16(), e.message)),
            notes.denied_by,
            parts,
        )
    };
    let smuggling = [
        "echo.default.svc.cluster.local/admin#",
        "echo/admin?",
        "admin.example.com/",
        "echo?/admin",
        "echo#/admin",
        "u@echo/admin",
        "echo:80/admin",
        "[::1]/admin",
    ];
    for host in smuggling {
        let (r, denied_by, _) = outcome(host, "/public");
        let want = Authority::parse(host).err().map(|e| e.to_string());
        assert_eq!(
            (r.err(), denied_by),
            (Some((400, want.unwrap_or_default())), None)
        );
    }
    // The policies themselves hold, whatever the authority's spelling.
    for (host, path, by) in [
        (
            "echo.default.svc.cluster.local",
            "/admin/x",
            "default/admin",
        ),
        ("admin.example.com", "/public", "default/host"),
        ("ADMIN.example.com.:8080", "/public", "default/host"),
    ] {
        let (r, denied_by, _) = outcome(host, path);
        let got = (r.err().map(|e| e.0), denied_by);
        assert_eq!(got, (Some(403), Some(by.to_string())), "{host}{path}");
    }
    // What policy allowed is what the HTTP/2 backend gets, authority and path apart.
    let (r, _, parts) = outcome("echo.default.svc.cluster.local:80", "/public");
    assert_eq!(r.ok(), Some(true));
    let authority = parts.uri.authority().map(|a| a.as_str());
    let want = Some("echo.default.svc.cluster.local:80");
    assert_eq!((authority, parts.uri.path()), (want, "/public"));
    assert!(parts.headers.get("host").is_none());
    // An HTTP/2 client's :authority is held to the same rule (h2 refuses a `/` in it
    // already), and a Host beside it is checked too.
    for (host, want) in [("echo", 200), ("echo/admin#", 400)] {
        let req = Request::get("http://echo.default.svc.cluster.local/public")
            .version(http::Version::HTTP_2)
            .header("host", host)
            .body(())
            .expect("request");
        let r = plan_as(&h2, Protocol::Http2, &policies, req).0;
        assert_eq!(
            r.map_or_else(|e| e.status.as_u16(), |_| 200),
            want,
            "{host}"
        );
    }
}

/// An absolute-form target's authority wins over Host (RFC 9112 3.2.2, as hyper and
/// Envoy): policy reads it, and an HTTP/1.1 backend gets it as its Host.
#[test]
fn an_absolute_form_authority_wins_over_host() {
    let policies = format!(
        "authorizationPolicies:\n{}",
        deny("host", "hosts: [admin.example.com]")
    );
    let abs = |authority: &str, host: &str| {
        let uri = format!("http://{authority}/public");
        Request::get(uri)
            .header("host", host)
            .body(())
            .expect("request")
    };
    let echo = "echo.default.svc.cluster.local";
    let (r, _, parts) = plan(&policies, abs(echo, "admin.example.com"));
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(parts.uri, "/public");
    let host = parts.headers.get("host").map(|v| v.as_bytes());
    assert_eq!(host, Some(echo.as_bytes()));
    let r = plan(&policies, abs("admin.example.com", echo)).0;
    assert_eq!(status(&r), Some((403, "DENY")));
}

const PORTS: &str = "ports: {80: 8080}";

/// A DENY policy on the echo Service, for requests with `operation`.
fn deny(name: &str, operation: &str) -> String {
    let target = "targetRefs: [{kind: Service, name: echo}]";
    let rules = format!("rules: [{{to: [{{operation: {{{operation}}}}}]}}]");
    format!("- {{name: {name}, namespace: default, {target}, action: DENY, {rules}}}\n")
}

fn cors_route(cors: &str) -> String {
    format!("httpRoutes:\n- {{name: echo, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {cors}}}]}}]}}\n")
}

fn cors_req(method: Method, origin: &str, request_method: Option<&str>) -> Request<()> {
    let mut b = Request::builder()
        .method(method)
        .uri("/api")
        .header("host", "echo.default.svc.cluster.local")
        .header("origin", origin);
    if let Some(m) = request_method {
        b = b
            .header("access-control-request-method", m)
            .header("access-control-request-headers", "x-token,content-type");
    }
    b.body(()).expect("request")
}

/// The CORS headers of the plan (an actual request) or of the preflight's reply.
fn cors_of(l7: &str, req: Request<()>) -> Result<Option<HeaderMap>, LocalReply> {
    plan_with(MESH, Protocol::Http1, l7, req, |p| p.cors).0
}

fn hv<'h>(h: &'h HeaderMap, name: &str) -> Option<&'h str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

#[test]
fn a_cors_preflight_is_answered_by_the_waypoint() {
    let l7 = cors_route("{allowOrigins: ['https://app.example.com'], allowMethods: [GET, PUT], allowHeaders: [x-token], exposeHeaders: [x-trace, x-id], maxAge: 600}");
    let e = cors_of(
        &l7,
        cors_req(Method::OPTIONS, "https://app.example.com", Some("PUT")),
    )
    .expect_err("answered here");
    assert_eq!((e.status.as_u16(), e.plain), (200, true));
    let h = e.headers.as_deref().expect("cors headers");
    assert_eq!(
        hv(h, "access-control-allow-origin"),
        Some("https://app.example.com")
    );
    assert_eq!(hv(h, "access-control-allow-methods"), Some("GET,PUT"));
    assert_eq!(hv(h, "access-control-allow-headers"), Some("x-token"));
    assert_eq!(hv(h, "access-control-max-age"), Some("600"));
    assert_eq!(hv(h, "access-control-allow-credentials"), None);
    assert_eq!(
        hv(h, "access-control-expose-headers"),
        None,
        "exposed on actual responses only"
    );

    // Another origin's preflight is answered too (istiod: unmatchedPreflights IGNORE),
    // without Access-Control-Allow-Origin, so the browser fails it.
    let e = cors_of(
        &l7,
        cors_req(Method::OPTIONS, "https://evil.example.org", Some("PUT")),
    )
    .expect_err("answered here");
    assert_eq!(e.status.as_u16(), 200);
    assert_eq!(
        hv(
            e.headers.as_deref().expect("headers"),
            "access-control-allow-origin"
        ),
        None
    );

    // A bad origin is refused when the file loads, the field named.
    let bad = Config::parse(
        Path::new("t.yaml"),
        &format!("{MESH}{}", cors_route("{allowOrigins: [app.example.com]}")),
    )
    .err()
    .expect("refused");
    let want = "httpRoutes[0].rules[0].filters[0].cors.allowOrigins[0]: \"app.example.com\" is not an origin (no scheme); write \"*\" or scheme://host[:port], e.g. https://app.example.com, https://*.example.com (HTTPRoute default/echo)";
    assert!(bad.to_string().contains(want), "{bad}");

    // OPTIONS without Access-Control-Request-Method is no preflight: it goes on.
    let h = cors_of(
        &l7,
        cors_req(Method::OPTIONS, "https://app.example.com", None),
    )
    .expect("forwarded")
    .expect("allowed origin");
    assert_eq!(
        hv(&h, "access-control-allow-origin"),
        Some("https://app.example.com")
    );
}

#[test]
fn an_allowed_origin_gets_cors_headers_on_the_response() {
    let l7 = cors_route("{allowOrigins: ['https://*.example.com'], allowCredentials: true, exposeHeaders: [x-trace, x-id]}");
    let h = cors_of(&l7, cors_req(Method::POST, "https://a.b.example.com", None))
        .expect("forwarded")
        .expect("allowed origin");
    assert_eq!(
        hv(&h, "access-control-allow-origin"),
        Some("https://a.b.example.com")
    );
    assert_eq!(hv(&h, "access-control-allow-credentials"), Some("true"));
    assert_eq!(
        hv(&h, "access-control-expose-headers"),
        Some("x-trace,x-id")
    );
    assert_eq!(h.len(), 3);
    // Not allowed, or no Origin: the response is left alone.
    assert!(
        cors_of(&l7, cors_req(Method::POST, "https://example.org", None))
            .expect("forwarded")
            .is_none()
    );
    assert!(
        cors_of(&l7, cors_req(Method::POST, "http://a.example.com", None))
            .expect("forwarded")
            .is_none()
    );
    assert!(cors_of(&l7, get("/api")).expect("forwarded").is_none());
    // A rule without the filter: nothing either.
    assert!(
        cors_of("", cors_req(Method::POST, "https://a.example.com", None))
            .expect("forwarded")
            .is_none()
    );
}

#[test]
fn wildcards_echo_what_the_browser_asks() {
    let l7 = cors_route(
        "{allowOrigins: ['*'], allowCredentials: true, allowMethods: ['*'], allowHeaders: ['*']}",
    );
    let e = cors_of(
        &l7,
        cors_req(Method::OPTIONS, "http://localhost:3000", Some("DELETE")),
    )
    .expect_err("answered here");
    let h = e.headers.as_deref().expect("headers");
    // With credentials Gateway API forbids `*`; Envoy echoes in every case.
    assert_eq!(
        hv(h, "access-control-allow-origin"),
        Some("http://localhost:3000")
    );
    assert_eq!(hv(h, "access-control-allow-methods"), Some("DELETE"));
    assert_eq!(
        hv(h, "access-control-allow-headers"),
        Some("x-token,content-type")
    );
    assert_eq!(hv(h, "access-control-allow-credentials"), Some("true"));
    assert_eq!(
        hv(h, "access-control-max-age"),
        Some("5"),
        "Gateway API's default"
    );
    // `*` takes any serialized origin, not `null` or a URL with a path.
    for bad in ["null", "https://a.example.com/x", "file://"] {
        let e =
            cors_of(&l7, cors_req(Method::OPTIONS, bad, Some("GET"))).expect_err("answered here");
        assert_eq!(
            hv(
                e.headers.as_deref().expect("headers"),
                "access-control-allow-origin"
            ),
            None,
            "{bad}"
        );
    }
}

#[test]
fn cors_runs_after_authorization_and_before_redirects() {
    // Denied by policy: 403, no preflight answer (RBAC runs first in Envoy too).
    let deny = "authorizationPolicies:\n- {name: p, namespace: default, targetRefs: [{kind: Service, name: echo}], action: DENY, rules: [{to: [{operation: {methods: [OPTIONS]}}]}]}\n";
    let l7 = format!(
        "{deny}{}",
        cors_route("{allowOrigins: ['https://app.example.com']}")
    );
    assert_eq!(
        status(
            &plan(
                &l7,
                cors_req(Method::OPTIONS, "https://app.example.com", Some("GET"))
            )
            .0
        ),
        Some((403, "DENY"))
    );
    // A redirect rule: its preflight is still answered; its redirect carries the headers.
    let l7 = format!("httpRoutes:\n- {{name: echo, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestRedirect, requestRedirect: {{hostname: other.example.com}}}}, {{type: CORS, cors: {{allowOrigins: ['https://app.example.com']}}}}]}}]}}\n");
    let e = cors_of(
        &l7,
        cors_req(Method::OPTIONS, "https://app.example.com", Some("GET")),
    )
    .expect_err("preflight");
    assert_eq!((e.status.as_u16(), e.redirect.as_deref()), (200, None));
    let e =
        cors_of(&l7, cors_req(Method::GET, "https://app.example.com", None)).expect_err("redirect");
    assert_eq!(e.status.as_u16(), 302);
    assert_eq!(
        hv(
            e.headers.as_deref().expect("headers"),
            "access-control-allow-origin"
        ),
        Some("https://app.example.com")
    );
    // So does a local reply after routing (here: a backend that does not exist).
    let l7 = format!("httpRoutes:\n- {{name: echo, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: gone, port: 80}}], filters: [{{type: CORS, cors: {{allowOrigins: ['*']}}}}]}}]}}\n");
    let e = cors_of(&l7, cors_req(Method::GET, "https://app.example.com", None))
        .expect_err("no backend");
    assert_eq!(e.status.as_u16(), 500);
    assert_eq!(
        hv(
            e.headers.as_deref().expect("headers"),
            "access-control-allow-origin"
        ),
        Some("https://app.example.com")
    );
}

mod egress;
