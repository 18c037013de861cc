use std::time::Duration;

use http::header::{HeaderMap, HeaderValue};
use http::Method;

use super::*;
use crate::object::{ObjectName, Target};

fn routes(yaml: &str) -> Vec<HttpRoute> {
    let routes: Vec<HttpRoute> = serde_yaml::from_str(yaml).expect("route yaml");
    for r in &routes {
        r.validate().expect("valid route");
    }
    routes
}

fn err(yaml: &str) -> String {
    match serde_yaml::from_str::<Vec<HttpRoute>>(yaml) {
        Err(e) => e.to_string(),
        Ok(rs) => rs
            .iter()
            .find_map(|r| r.validate().err())
            .expect("route must be refused"),
    }
}

mod virtual_service;

struct Req {
    method: Method,
    path: String,
    query: Option<String>,
    headers: HeaderMap,
    host: String,
    /// As sent (default: `host`).
    authority: Option<String>,
    port: u16,
    /// The waypoint's namespace.
    waypoint_ns: &'static str,
    /// The echo Service's namespace.
    svc_ns: &'static str,
}

fn req(path: &str) -> Req {
    let (path, query) = match path.split_once('?') {
        Some((p, q)) => (p.to_string(), Some(q.to_string())),
        None => (path.to_string(), None),
    };
    Req {
        method: Method::GET,
        path,
        query,
        headers: HeaderMap::new(),
        host: "echo.default.svc.cluster.local".into(),
        authority: None,
        port: 80,
        waypoint_ns: "default",
        svc_ns: "default",
    }
}

impl Req {
    fn header(mut self, k: &'static str, v: &'static str) -> Req {
        self.headers.append(k, HeaderValue::from_static(v));
        self
    }
    fn method(mut self, m: Method) -> Req {
        self.method = m;
        self
    }
    fn host(mut self, h: &str) -> Req {
        self.host = h.into();
        self
    }
    fn authority(mut self, a: &str) -> Req {
        self.authority = Some(a.into());
        self
    }
    fn port(mut self, p: u16) -> Req {
        self.port = p;
        self
    }
    fn waypoint_ns(mut self, ns: &'static str) -> Req {
        self.waypoint_ns = ns;
        self
    }
    fn svc_ns(mut self, ns: &'static str) -> Req {
        self.svc_ns = ns;
        self
    }
    /// `route#rule` chosen for the echo service on port 80.
    fn pick(&self, routes: &[HttpRoute]) -> Option<String> {
        let gw = ObjectName {
            namespace: self.waypoint_ns.into(),
            name: "waypoint".into(),
        };
        let svc = ObjectName {
            namespace: self.svc_ns.into(),
            name: "echo".into(),
        };
        let target = Target {
            gateway: &gw,
            service: Some(&svc),
            service_kind: Default::default(),
            root_namespace: "istio-system",
            port: self.port,
        };
        let refs: Vec<&HttpRoute> = routes.iter().collect();
        let r = RouteRequest {
            method: &self.method,
            path: &self.path,
            query: self.query.as_deref(),
            headers: &self.headers,
            host: &self.host,
            authority: self.authority.as_deref().unwrap_or(&self.host),
        };
        match select(&refs, &target, &r) {
            Selection::Matched(s) => Some(format!("{}#{}", s.route.name, s.rule_index)),
            Selection::NoMatch => Some("404".into()),
            Selection::NoRoutes => None,
        }
    }
}

const SVC: &str = "parentRefs: [{group: '', kind: Service, name: echo}]";

#[test]
fn precedence_follows_gateway_api() {
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /}}}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api/v1/}}}}]\n\
         \x20 - matches: [{{path: {{type: Exact, value: /api/v1/x}}}}]\n\
         \x20 - matches: [{{path: {{type: RegularExpression, value: '/api/v[0-9]+/y.*'}}}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, method: POST}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, headers: [{{name: x-a, value: '1'}}]}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, headers: [{{name: x-a, value: '1'}}, {{name: x-b, value: '1'}}]}}]\n\
         \x20 - matches: [{{path: {{type: PathPrefix, value: /api}}, queryParams: [{{name: q, value: 'a b'}}]}}]\n"
    ));
    assert_eq!(req("/other").pick(&rs).as_deref(), Some("a#0"));
    assert_eq!(req("/api").pick(&rs).as_deref(), Some("a#1"));
    assert_eq!(req("/api/").pick(&rs).as_deref(), Some("a#1"));
    assert_eq!(
        req("/apix").pick(&rs).as_deref(),
        Some("a#0"),
        "prefixes match whole segments"
    );
    assert_eq!(
        req("/api/v1").pick(&rs).as_deref(),
        Some("a#2"),
        "'/api/v1/' is the prefix /api/v1"
    );
    assert_eq!(
        req("/api/v1/x").pick(&rs).as_deref(),
        Some("a#3"),
        "exact beats everything"
    );
    assert_eq!(
        req("/api/v1/yes").pick(&rs).as_deref(),
        Some("a#4"),
        "regex beats a prefix"
    );
    assert_eq!(
        req("/api/v1/nope/y").pick(&rs).as_deref(),
        Some("a#2"),
        "regexes match the whole path"
    );
    assert_eq!(
        req("/api/z").method(Method::POST).pick(&rs).as_deref(),
        Some("a#5"),
        "method beats headers"
    );
    assert_eq!(
        req("/api/z").header("x-a", "1").pick(&rs).as_deref(),
        Some("a#6")
    );
    assert_eq!(
        req("/api/z")
            .header("x-a", "1")
            .header("x-b", "1")
            .pick(&rs)
            .as_deref(),
        Some("a#7")
    );
    assert_eq!(
        req("/api/z?q=a%20b").pick(&rs).as_deref(),
        Some("a#8"),
        "query values are decoded"
    );
    assert_eq!(
        req("/api/z?x=1&q=a%20b&q=c").pick(&rs).as_deref(),
        Some("a#8")
    );
    assert_eq!(
        req("/api/z?Q=a%20b").pick(&rs).as_deref(),
        Some("a#1"),
        "names are case-sensitive"
    );
}

#[test]
fn header_values_match_one_by_one() {
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - matches: [{{headers: [{{name: X-Version, value: v2}}]}}]\n\
         \x20 - matches: [{{headers: [{{type: RegularExpression, name: x-user, value: 'adm.n'}}]}}]\n"
    ));
    assert_eq!(
        req("/").header("x-version", "v2").pick(&rs).as_deref(),
        Some("a#0")
    );
    assert_eq!(
        req("/")
            .header("x-version", "v1")
            .header("x-version", "v2")
            .pick(&rs)
            .as_deref(),
        Some("a#0")
    );
    assert_eq!(
        req("/").header("x-version", "v1,v2").pick(&rs).as_deref(),
        Some("404"),
        "never split or joined"
    );
    assert_eq!(
        req("/").header("x-version", "V2").pick(&rs).as_deref(),
        Some("404"),
        "values are case-sensitive"
    );
    assert_eq!(
        req("/").header("x-user", "admin").pick(&rs).as_deref(),
        Some("a#1")
    );
    assert_eq!(
        req("/").header("x-user", "xadmin").pick(&rs).as_deref(),
        Some("404"),
        "regexes are anchored"
    );
}

#[test]
fn ties_go_to_the_first_route_and_rule() {
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: PathPrefix, value: /x}}}}]}}, {{matches: [{{path: {{type: PathPrefix, value: /x}}}}]}}]\n\
         - name: b\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: PathPrefix, value: /x/}}}}]}}]\n"
    ));
    assert_eq!(req("/x/1").pick(&rs).as_deref(), Some("a#0"));
}

#[test]
fn attachment_by_service_port_and_gateway() {
    let rs = routes(
        "- name: svc81\n  namespace: default\n  parentRefs: [{group: '', kind: Service, name: echo, port: 81}]\n\
         - name: gw\n  namespace: default\n  parentRefs: [{name: waypoint}]\n  hostnames: ['*.example.com']\n\
         - name: other\n  namespace: default\n  parentRefs: [{group: '', kind: Service, name: other}]\n",
    );
    // Port 80: the Service route is for port 81, so the Gateway route applies, by host.
    assert_eq!(
        req("/").host("a.example.com").pick(&rs).as_deref(),
        Some("gw#0")
    );
    assert_eq!(
        req("/").host("example.com").pick(&rs),
        None,
        "a Gateway route for other hosts does not apply"
    );
    assert_eq!(req("/").pick(&rs), None);
    // A Service route for the request's port takes precedence over Gateway routes.
    let rs = routes(&format!(
        "- name: gw\n  namespace: default\n  parentRefs: [{{name: waypoint}}]\n\
         - name: svc\n  namespace: default\n  {SVC}\n  rules: [{{matches: [{{path: {{type: Exact, value: /only}}}}]}}]\n"
    ));
    assert_eq!(req("/only").pick(&rs).as_deref(), Some("svc#0"));
    assert_eq!(
        req("/x").pick(&rs).as_deref(),
        Some("404"),
        "Gateway routes don't apply to a Service with routes"
    );
}

#[test]
fn weighted_backends() {
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - backendRefs: [{{name: v1, port: 80, weight: 90}}, {{name: v2, port: 80, weight: 10}}, {{name: v3, port: 80, weight: 0}}]\n\
         \x20 - backendRefs: [{{name: v1, port: 80, weight: 0}}]\n"
    ));
    let rule = &rs[0].rules[0];
    let mut counts = std::collections::HashMap::new();
    for roll in 0..1000u64 {
        *counts
            .entry(rule.pick_backend(roll).map(|b| b.backend.name.clone()))
            .or_insert(0) += 1;
    }
    assert_eq!(counts[&Some("v1".to_string())], 900);
    assert_eq!(counts[&Some("v2".to_string())], 100);
    assert!(!counts.contains_key(&Some("v3".to_string())));
    assert!(
        rs[0].rules[1].pick_backend(7).is_none(),
        "all weights 0: no backend"
    );
    assert_eq!(
        rule.backend_refs[0].service("default"),
        ObjectName {
            namespace: "default".into(),
            name: "v1".into()
        }
    );
}

#[test]
fn filters_rewrite_and_redirect() {
    let rw = |kind: &str, value: &str, path: &str, prefix: Option<&str>| {
        let m: PathModifier = serde_yaml::from_str(&format!(
            "{{type: {kind}, {}: '{value}'}}",
            if kind == "ReplaceFullPath" {
                "replaceFullPath"
            } else {
                "replacePrefixMatch"
            }
        ))
        .expect("modifier");
        m.apply(path, prefix)
    };
    assert_eq!(
        rw("ReplacePrefixMatch", "/v2", "/api/items", Some("/api")),
        "/v2/items"
    );
    assert_eq!(rw("ReplacePrefixMatch", "/v2", "/api", Some("/api")), "/v2");
    assert_eq!(
        rw("ReplacePrefixMatch", "/v2", "/api/", Some("/api")),
        "/v2/"
    );
    assert_eq!(
        rw("ReplacePrefixMatch", "/", "/api/items", Some("/api")),
        "/items"
    );
    assert_eq!(rw("ReplacePrefixMatch", "/", "/api", Some("/api")), "/");
    assert_eq!(
        rw("ReplacePrefixMatch", "/v2/", "/api/x", Some("/api")),
        "/v2/x"
    );
    assert_eq!(
        rw("ReplacePrefixMatch", "/pre", "/x", Some("")),
        "/pre/x",
        "prefix '/' keeps the whole path"
    );
    assert_eq!(rw("ReplaceFullPath", "/new", "/old/x", None), "/new");

    let redirect: RequestRedirect = serde_yaml::from_str(
        "{path: {type: ReplaceFullPath, replaceFullPath: /new}, statusCode: 301}",
    )
    .expect("redirect");
    let (s, l) = redirect.location("http", "echo", Some(80), "/old", Some("q=1"), None);
    assert_eq!((s.as_u16(), l.as_str()), (301, "http://echo/new?q=1"));
    let (s, l) = redirect.location("http", "echo", Some(8080), "/old", None, None);
    assert_eq!((s.as_u16(), l.as_str()), (301, "http://echo:8080/new"));
    let https: RequestRedirect =
        serde_yaml::from_str("{scheme: https, hostname: secure.example.com}").expect("redirect");
    let (s, l) = https.location("http", "echo", Some(8080), "/a", None, None);
    assert_eq!(
        (s.as_u16(), l.as_str()),
        (302, "https://secure.example.com/a"),
        "the scheme's own port"
    );
    let port: RequestRedirect =
        serde_yaml::from_str("{scheme: https, port: 8443}").expect("redirect");
    assert_eq!(
        port.location("http", "h", None, "/", None, None).1,
        "https://h:8443/"
    );

    let mut h = HeaderMap::new();
    h.insert("x-a", HeaderValue::from_static("old"));
    h.append("x-b", HeaderValue::from_static("1"));
    h.insert("x-gone", HeaderValue::from_static("1"));
    let m: HeaderModifier = serde_yaml::from_str(
        "{set: [{name: X-A, value: new}], add: [{name: x-b, value: '2'}], remove: [X-Gone]}",
    )
    .expect("modifier");
    m.apply(&mut h);
    assert_eq!(h.get_all("x-a").iter().collect::<Vec<_>>(), ["new"]);
    assert_eq!(h.get_all("x-b").iter().collect::<Vec<_>>(), ["1", "2"]);
    assert!(!h.contains_key("x-gone"));

    let mirror: RequestMirror =
        serde_yaml::from_str("{backendRef: {name: shadow, port: 80}, percent: 25}")
            .expect("mirror");
    assert!(mirror.sampled(0.2) && !mirror.sampled(0.3));
    let all: RequestMirror =
        serde_yaml::from_str("{backendRef: {name: shadow, port: 80}}").expect("mirror");
    assert!(all.sampled(0.999));
    let frac: RequestMirror = serde_yaml::from_str(
        "{backendRef: {name: s, port: 80}, fraction: {numerator: 1, denominator: 1000}}",
    )
    .expect("mirror");
    assert!(frac.sampled(0.0005) && !frac.sampled(0.002));
}

#[test]
fn durations() {
    let d = |s: &str| s.parse::<GatewayDuration>().map(|d| d.0);
    assert_eq!(d("10s"), Ok(Duration::from_secs(10)));
    assert_eq!(d("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(d("1h30m"), Ok(Duration::from_secs(5400)));
    assert_eq!(d("1m0s500ms"), Ok(Duration::from_millis(60_500)));
    assert_eq!(d("0s"), Ok(Duration::ZERO));
    for bad in [
        "",
        "10",
        "1.5s",
        "s",
        "10us",
        "-1s",
        "1h1m1s1ms1ms",
        "123456s",
        " 1s",
    ] {
        assert!(d(bad).is_err(), "{bad:?}");
    }
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - timeouts: {{request: 3s, backendRequest: 300ms}}\n    retry: {{attempts: 2, backoff: 10ms}}\n\
         \x20 - timeouts: {{request: 0s}}\n"
    ));
    assert_eq!(
        rs[0].rules[0].request_timeout(),
        Some(Duration::from_secs(3))
    );
    assert_eq!(
        rs[0].rules[0].backend_timeout(),
        Some(Duration::from_millis(300))
    );
    let retry = rs[0].rules[0].retry.as_ref().expect("retry");
    assert_eq!(
        (retry.attempts, retry.codes.as_slice(), retry.backoff),
        (Some(2), &[503][..], Some(Duration::from_millis(10)))
    );
    assert_eq!(
        rs[0].rules[1].request_timeout(),
        None,
        "0s disables the timeout"
    );
}

#[test]
fn bad_routes_are_refused_with_the_field_named() {
    let cases: &[(&str, &str)] = &[
        ("- {name: a, namespace: default}", "parentRefs: required"),
        ("- {name: a, namespace: default, parentRefs: [{kind: Service, name: echo}]}", "parentRefs[0]: kind \"Service\""),
        ("- {name: a, namespace: default, parentRefs: [{group: '', kind: Service, name: echo, namespace: other}]}", "parentRefs[0].namespace"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1}}]}}]}}"), "rules[0].backendRefs[0].port: required"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, namespace: ''}}]}}]}}"), "backendRefs[0].namespace: must not be empty"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Exact, value: /a/../b}}}}]}}]}}"), "write \"/b\""),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Regex, value: /a}}}}]}}]}}"), "path type \"Regex\""),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: RegularExpression, value: '(/a'}}}}]}}]}}"), "does not compile"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{method: get}}]}}]}}"), "method \"get\""),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{headers: [{{name: 'bad name', value: x}}]}}]}}]}}"), "not a valid header name"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{timeouts: {{request: 10}}}}]}}"), "is not a duration"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{timeouts: {{request: 1s, backendRequest: 2s}}}}]}}"), "longer than timeouts.request"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestRedirect}}]}}]}}"), "needs its `requestRedirect` field"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: Nope}}]}}]}}"), "filter type \"Nope\""),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{matches: [{{path: {{type: Exact, value: /a}}}}], filters: [{{type: URLRewrite, urlRewrite: {{path: {{type: ReplacePrefixMatch, replacePrefixMatch: /b}}}}}}]}}]}}"), "ReplacePrefixMatch needs"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestRedirect, requestRedirect: {{statusCode: 307}}}}]}}]}}"), "statusCode: 307"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{retry: {{codes: [200]}}}}]}}"), "retry.codes[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRef: [{{name: v1, port: 80}}]}}]}}"), "unknown field `backendRef`"),
        ("- {name: a, namespace: default, parentRefs: [{name: waypoint}], hostnames: ['10.0.0.1']}", "hostnames[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: RequestMirror, requestMirror: {{backendRef: {{name: s, port: 80, sectionName: x}}}}}}]}}]}}"), "requestMirror.backendRef.sectionName"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, sectionName: x}}]}}]}}"), "unknown field `sectionName`"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS}}]}}]}}"), "needs its `cors` field"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: [app.example.com]}}}}]}}]}}"), "cors.allowOrigins[0]: \"app.example.com\" is not an origin"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['ftp://a.example.com']}}}}]}}]}}"), "http or https"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['https://a.example.com/path']}}}}]}}]}}"), "allowOrigins[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['https://a.example.com:0']}}}}]}}]}}"), "port is 1-65535"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['https://a.*.example.com']}}}}]}}]}}"), "allowOrigins[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['*', 'https://a.example.com']}}}}]}}]}}"), "cors.allowOrigins: `*` allows everything"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigins: ['https://a.example.com', 'https://a.example.com']}}}}]}}]}}"), "allowOrigins[1]: \"https://a.example.com\" is listed twice"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowMethods: [get]}}}}]}}]}}"), "cors.allowMethods[0]: \"get\" is not one of"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowMethods: ['*', GET]}}}}]}}]}}"), "cors.allowMethods: `*`"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowHeaders: ['x token']}}}}]}}]}}"), "cors.allowHeaders[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{exposeHeaders: [X-A, x-a]}}}}]}}]}}"), "cors.exposeHeaders[1]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{maxAge: -1}}}}]}}]}}"), "cors.maxAge: -1 is not 1-"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{maxAge: 0}}}}]}}]}}"), "cors.maxAge: 0"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{allowOrigin: ['*']}}}}]}}]}}"), "unknown field `allowOrigin`"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{}}}}, {{type: CORS, cors: {{}}}}]}}]}}"), "CORS may each appear once"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, filters: [{{type: RequestMirror, requestMirror: {{backendRef: {{name: v2, port: 80}}}}}}]}}]}}]}}"),
         "rules[0].backendRefs[0].filters[0]: a backendRef's filters may only be RequestHeaderModifier and ResponseHeaderModifier"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, filters: [{{type: URLRewrite, urlRewrite: {{hostname: x}}}}]}}]}}]}}"), "backendRefs[0].filters[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{remove: ['bad name']}}}}]}}]}}]}}"),
         "backendRefs[0].filters[0].requestHeaderModifier.remove[0]"),
        (&format!("- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, filters: [{{type: ResponseHeaderModifier, responseHeaderModifier: {{remove: [a]}}}}, {{type: ResponseHeaderModifier, responseHeaderModifier: {{remove: [b]}}}}]}}]}}]}}"),
         "backendRefs[0].filters: RequestHeaderModifier and ResponseHeaderModifier may each appear once"),
    ];
    for (yaml, want) in cases {
        let e = err(yaml);
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

fn grpc_routes(yaml: &str) -> Result<Vec<HttpRoute>, String> {
    let rs: Vec<GrpcRoute> = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    rs.iter().map(|r| r.to_http()).collect()
}

/// GRPCRoute matches become path matches as Istio converts them: service and method
/// exactly, a service's methods, a method of any service, regular expressions.
#[test]
fn grpc_routes_match_services_and_methods() {
    let rs = grpc_routes(&format!(
        "- name: g\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - matches: [{{method: {{service: echo.Echo, method: Say}}}}]\n\
         \x20 - matches: [{{method: {{service: echo.Echo}}}}]\n\
         \x20 - matches: [{{method: {{method: Health}}}}]\n\
         \x20 - matches: [{{method: {{type: RegularExpression, service: 'admin\\..*', method: 'Get.*'}}}}]\n\
         \x20 - matches: [{{headers: [{{name: x-canary, value: 'yes'}}]}}]\n"
    ))
    .expect("converts");
    let post = |p: &str| req(p).method(Method::POST);
    assert_eq!(post("/echo.Echo/Say").pick(&rs).as_deref(), Some("g#0"));
    assert_eq!(post("/echo.Echo/Other").pick(&rs).as_deref(), Some("g#1"));
    assert_eq!(
        post("/grpc.health.v1.Health/Health").pick(&rs).as_deref(),
        Some("g#2")
    );
    assert_eq!(
        post("/admin.Users/GetUser").pick(&rs).as_deref(),
        Some("g#3")
    );
    assert_eq!(
        post("/admin.Users/DeleteUser").pick(&rs).as_deref(),
        Some("404")
    );
    assert_eq!(
        post("/other.Svc/Call")
            .header("x-canary", "yes")
            .pick(&rs)
            .as_deref(),
        Some("g#4")
    );
    // "echo.Echo" is not a prefix of "echo.EchoV2".
    assert_eq!(post("/echo.EchoV2/Say").pick(&rs).as_deref(), Some("404"));
    for (yaml, want) in [
        (
            "rules: [{matches: [{method: {}}]}]",
            "rules[0].matches[0].method: needs a service or a method",
        ),
        (
            "rules: [{matches: [{method: {service: 'a/b'}}]}]",
            "is not a gRPC name",
        ),
        (
            "rules: [{matches: [{method: {type: Prefix, service: a}}]}]",
            "type \"Prefix\"",
        ),
        (
            "rules: [{filters: [{type: URLRewrite, urlRewrite: {hostname: x}}]}]",
            "rules[0].filters[0]: GRPCRoute filters are",
        ),
        (
            "rules: [{matches: [{path: {value: /a}}]}]",
            "unknown field `path`",
        ),
    ] {
        let e = grpc_routes(&format!(
            "- name: g\n  namespace: default\n  {SVC}\n  {yaml}\n"
        ))
        .expect_err(yaml);
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

#[test]
fn backend_ref_filters_are_header_modifiers() {
    let rs = routes(&format!(
        "- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [\
         {{name: v1, port: 80, filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{set: [{{name: x-backend, value: v1}}]}}}}, \
                                         {{type: ResponseHeaderModifier, responseHeaderModifier: {{add: [{{name: x-served, value: v1}}]}}}}]}}, \
         {{name: v2, port: 80}}]}}]}}"
    ));
    let b = &rs[0].rules[0].backend_refs;
    assert_eq!(
        b[0].request_modifier().map(|m| m.set[0].name.as_str()),
        Some("x-backend")
    );
    assert_eq!(
        b[0].response_modifier().map(|m| m.add[0].value.as_bytes()),
        Some(&b"v1"[..])
    );
    assert!(b[1].filters.is_empty());
    // A TCPRoute's backends have none.
    let tcp: Vec<TcpRoute> = serde_yaml::from_str(&format!(
        "- {{name: t, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1, port: 80, filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{remove: [a]}}}}]}}]}}]}}"
    ))
    .expect("yaml");
    assert!(tcp[0]
        .to_http()
        .expect_err("filters")
        .contains("rules[0].backendRefs[0].filters"));
}

#[test]
fn tcp_routes_have_one_rule_with_backends() {
    let one = |yaml: &str| -> Result<HttpRoute, String> {
        let r: TcpRoute =
            serde_yaml::from_str(&format!("name: t\nnamespace: default\n{SVC}\n{yaml}"))
                .map_err(|e| e.to_string())?;
        r.to_http()
    };
    let r =
        one("rules: [{backendRefs: [{name: a, port: 9000, weight: 3}, {name: b, port: 9000}]}]")
            .expect("valid");
    assert_eq!(r.rules[0].backend_refs.len(), 2);
    assert!(one(
        "rules: [{backendRefs: [{name: a, port: 1}]}, {backendRefs: [{name: b, port: 1}]}]"
    )
    .expect_err("two rules")
    .contains("exactly one"));
    assert!(one("rules: [{backendRefs: []}]")
        .expect_err("no backends")
        .contains("rules[0].backendRefs: required"));
    assert!(one("rules: [{backendRefs: [{name: a}]}]")
        .expect_err("no port")
        .contains("port: required"));
    assert!(one("rules: [{matches: []}]")
        .expect_err("no matches in TCPRoute")
        .contains("unknown field `matches`"));
}

#[test]
fn session_persistence_is_checked_when_it_loads() {
    let ok = routes(&format!("- {{name: a, namespace: default, {SVC}, rules: [{{sessionPersistence: {{sessionName: s, absoluteTimeout: 1h, cookieConfig: {{lifetimeType: Permanent}}}}}}]}}"));
    let sp = ok[0].rules[0]
        .session_persistence
        .as_ref()
        .expect("session");
    assert_eq!((sp.name(), sp.kind), ("s", SessionKind::Cookie));
    for (yaml, want) in [
        ("{sessionName: 'a b'}", "sessionName"),
        ("{idleTimeout: 1m}", "idleTimeout: not supported"),
        (
            "{cookieConfig: {lifetimeType: Permanent}}",
            "absoluteTimeout: required",
        ),
        ("{type: Query}", "unknown variant"),
    ] {
        let e = err(&format!(
            "- {{name: a, namespace: default, {SVC}, rules: [{{sessionPersistence: {yaml}}}]}}"
        ));
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

#[test]
fn cors_filters_load_with_gateway_api_defaults() {
    let rs = routes(&format!(
        "- name: a\n  namespace: default\n  {SVC}\n  rules:\n\
         \x20 - filters:\n\
         \x20   - type: CORS\n\
         \x20     cors: {{allowOrigins: ['https://app.example.com', 'https://*.example.com', 'http://*:8080', 'http://10.0.0.1:3000'], allowMethods: [GET, PUT]}}\n"
    ));
    let cors = rs[0].rules[0].cors().expect("cors filter");
    assert_eq!((cors.max_age, cors.allow_credentials), (5, false));
    let origin = |o: &'static str| {
        let h = Req::header(req("/"), "origin", o).headers;
        matches!(cors.on_request(&Method::GET, &h), CorsOutcome::Response(_))
    };
    assert!(origin("https://app.example.com"));
    assert!(
        !origin("https://APP.EXAMPLE.COM"),
        "exact origins are case-sensitive (Envoy's exact match)"
    );
    assert!(origin("https://x.y.example.com"), "`*` spans labels");
    assert!(!origin("https://example.com"), "`*.` needs a label");
    assert!(origin("http://anything:8080") && !origin("http://anything:8081"));
    assert!(origin("http://10.0.0.1:3000"));
    assert!(!origin("https://app.example.com.evil.org"));
    // GRPCRoute has no CORS filter.
    let e = grpc_routes(&format!("- {{name: g, namespace: default, {SVC}, rules: [{{filters: [{{type: CORS, cors: {{}}}}]}}]}}")).expect_err("refused");
    assert!(e.contains("GRPCRoute filters are"), "{e}");
}
