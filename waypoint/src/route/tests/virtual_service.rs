//! VirtualServices as Istio's waypoint applies them.

use std::time::Duration;

use super::*;

fn vs(yaml: &str) -> Result<HttpRoute, String> {
    let v: VirtualService = serde_yaml::from_str(&format!(
        "name: v\nnamespace: default\nhosts: [echo]\n{yaml}"
    ))
    .map_err(|e| e.to_string())?;
    v.to_http()
}

/// A VirtualService attaches only through a waypoint of a namespace it is exported to
/// (the waypoint here is in `default`; the file path, as the cluster's).
#[test]
fn virtual_services_honour_export_to() {
    let with = |export: &str| {
        vs(&format!(
            "exportTo: {export}\nhttp: [{{route: [{{destination: {{host: echo}}}}]}}]"
        ))
        .expect(export)
    };
    for (export, applies) in [
        ("[]", true),
        ("['*']", true),
        ("['.']", true),
        ("[default]", true),
        ("[shop]", false),
        ("[shop, '.']", true),
    ] {
        assert_eq!(
            req("/").pick(&[with(export)]).is_some(),
            applies,
            "exportTo {export}"
        );
    }
    // From another namespace, `.` is that namespace's own.
    let mut other = with("['.']");
    other.namespace = "shop".into();
    other.parent_refs[0].namespace = Some("default".into());
    assert_eq!(req("/").pick(&[other]), None);
}

/// A VirtualService as the HTTPRoute it amounts to: Istio's string prefix (not by path
/// element), headers, weights, timeouts, retries and its fault injection.
#[test]
fn virtual_services_route_and_inject_faults() {
    let r = vs("http:\n\
        - match: [{uri: {prefix: /api}, headers: {x-user: {exact: jason}}}]\n\
        \x20 route: [{destination: {host: echo-v2, port: {number: 80}}}]\n\
        \x20 timeout: 2s\n\
        \x20 retries: {attempts: 3, perTryTimeout: 500ms, retryOn: 'gateway-error,connect-failure'}\n\
        - match: [{uri: {exact: /abort}}]\n\
        \x20 fault: {abort: {httpStatus: 418, percentage: {value: 100}}}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - route: [{destination: {host: echo-v1}, weight: 80}, {destination: {host: echo-v2}, weight: 20}]\n\
        \x20 headers: {request: {set: {x-vs: 'yes'}}}\n")
    .expect("converts");
    assert_eq!(r.kind, RouteKind::Virtual);
    let rs = vec![r];
    assert_eq!(
        req("/apix").header("x-user", "jason").pick(&rs).as_deref(),
        Some("v#0"),
        "a string prefix"
    );
    assert_eq!(
        req("/api").pick(&rs).as_deref(),
        Some("v#2"),
        "the header must match"
    );
    assert_eq!(req("/abort").pick(&rs).as_deref(), Some("v#1"));
    let rule0 = &rs[0].rules[0];
    assert_eq!(
        (rule0.request_timeout(), rule0.backend_timeout()),
        (
            Some(Duration::from_secs(2)),
            Some(Duration::from_millis(500))
        )
    );
    let retry = rule0.retry.as_ref().expect("retry");
    assert_eq!(
        (retry.attempts, retry.codes.clone()),
        (Some(3), vec![502, 503, 504])
    );
    let fault = rs[0].rules[1].fault.expect("fault");
    assert_eq!(
        (fault.abort_for(0.99), fault.delay_for(0.0)),
        (Some(418), None)
    );
    let half = vs("http: [{fault: {delay: {fixedDelay: 1s, percentage: {value: 50}}}, route: [{destination: {host: echo}}]}]").expect("delay");
    let f = half.rules[0].fault.expect("fault");
    assert_eq!(
        (f.delay_for(0.2), f.delay_for(0.7)),
        (Some(Duration::from_secs(1)), None)
    );
    assert_eq!(
        rs[0].rules[2]
            .backend_refs
            .iter()
            .map(|b| b.weight)
            .collect::<Vec<_>>(),
        [80, 20]
    );
    let sub = vs("http: [{route: [{destination: {host: echo, subset: v1}, weight: 90}, {destination: {host: echo, subset: v2}, weight: 10}]}]").expect("subsets");
    assert_eq!(
        sub.rules[0]
            .backend_refs
            .iter()
            .map(|b| b.subset.as_deref())
            .collect::<Vec<_>>(),
        [Some("v1"), Some("v2")]
    );
    // Per-destination headers are that backend's header modifiers.
    let d = vs("http: [{route: [{destination: {host: echo-v1}, headers: {request: {set: {x-v: '1'}}, response: {add: {x-from: v1}}}}, {destination: {host: echo-v2}}]}]").expect("headers");
    let b = &d.rules[0].backend_refs;
    assert_eq!(
        b[0].request_modifier().map(|m| m.set[0].value.as_bytes()),
        Some(&b"1"[..])
    );
    assert_eq!(
        b[0].response_modifier().map(|m| m.add[0].name.as_str()),
        Some("x-from")
    );
    assert!(b[1].request_modifier().is_none() && b[1].response_modifier().is_none());
    for (yaml, want) in [
        ("http: [{route: [{destination: {host: echo, subset: ''}}]}]", "http[0].route[0].destination.subset: must not be empty"),
        ("http: [{rewrite: {uri: /x, uriRegexRewrite: {match: a, rewrite: b}}, route: [{destination: {host: echo}}]}]", "http[0].rewrite: set one of"),
        ("http: [{redirect: {uri: /x}, route: [{destination: {host: echo}}]}]", "sends nowhere"),
        ("http: [{redirect: {uri: /x, redirectCode: 305}}]", "redirect.redirectCode: 305"),
        ("http: [{redirect: {uri: \"/x\\r\\nSet-Cookie: a=b\"}}]", "control character"),
        ("http: [{redirect: {authority: \"a b\"}}]", "redirect.authority"),
        ("http: [{directResponse: {status: 99}}]", "directResponse.status: 99"),
        ("http: [{directResponse: {status: 200, body: {string: a, bytes: YQ==}}}]", "set one of string and bytes"),
        ("http: [{rewrite: {uriRegexRewrite: {match: '^/(a)', rewrite: '/\\2'}}, route: [{destination: {host: echo}}]}]", "names a group"),
        ("http: [{match: [{port: 70000}], route: [{destination: {host: echo}}]}]", "match[0].port: 70000"),
        ("http: [{route: [{destination: {host: api.example.com}}]}]", "is not a Kubernetes Service"),
        ("http: [{fault: {abort: {percentage: {value: 10}}}, route: [{destination: {host: echo}}]}]", "fault.abort.httpStatus"),
        ("gateways: [istio-system/ingress]\nhttp: [{route: [{destination: {host: echo}}]}]", "gateways"),
        ("http: [{match: [{uri: {exact: /a, prefix: /b}}], route: [{destination: {host: echo}}]}]", "set exactly one of"),
    ] {
        let e = vs(yaml).expect_err(yaml);
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

/// Istio's order, not Gateway API's precedence: the first rule and match that matches.
#[test]
fn virtual_service_rules_match_in_order() {
    let rs = vec![vs("http:\n\
        - match: [{uri: {prefix: /api}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {exact: /api/x}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - route: [{destination: {host: echo}}]\n\
        - match: [{uri: {exact: /never}}]\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts")];
    assert_eq!(req("/api/x").pick(&rs).as_deref(), Some("v#0"));
    assert_eq!(
        req("/never").pick(&rs).as_deref(),
        Some("v#2"),
        "a catch-all ends the list"
    );
}

/// Matches Istio's waypoint drops: `sourceLabels` (istio/istio#51565), `gateways`
/// without `mesh`; `sourceNamespace` is the waypoint's.
#[test]
fn virtual_service_matches_istio_drops() {
    let rs = vec![vs("http:\n\
        - match: [{sourceLabels: {app: sleep}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{gateways: [istio-system/ingress], uri: {prefix: /}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{sourceLabels: {app: sleep}, uri: {prefix: /a}}, {uri: {prefix: /b}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{gateways: [mesh], sourceNamespace: other, uri: {prefix: /c}}]\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts")];
    assert_eq!(
        req("/").pick(&rs).as_deref(),
        Some("404"),
        "rules 0 and 1 are gone"
    );
    assert_eq!(req("/a").pick(&rs).as_deref(), Some("404"));
    assert_eq!(req("/b").pick(&rs).as_deref(), Some("v#2"));
    assert_eq!(
        req("/c").pick(&rs).as_deref(),
        Some("404"),
        "the waypoint is in default"
    );
    assert_eq!(
        req("/c").waypoint_ns("other").pick(&rs).as_deref(),
        Some("v#3"),
        "a waypoint of namespace other"
    );
}

/// `port`, `authority` (as sent, port included, case-sensitive), `scheme`,
/// `withoutHeaders` (a missing header is empty; a presence match needs it absent).
#[test]
fn virtual_service_match_conditions() {
    let rs = vec![vs("http:\n\
        - match: [{port: 8080}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{authority: {exact: echo.default.svc.cluster.local}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{withoutHeaders: {x-canary: {exact: 'yes'}}, uri: {prefix: /w}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{withoutHeaders: {x-debug: {regex: '.*'}}, uri: {prefix: /p}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{scheme: {exact: https}}]\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts")];
    assert_eq!(req("/").port(8080).pick(&rs).as_deref(), Some("v#0"));
    assert_eq!(req("/").pick(&rs).as_deref(), Some("v#1"));
    assert_eq!(
        req("/")
            .authority("echo.default.svc.cluster.local:80")
            .pick(&rs)
            .as_deref(),
        Some("404"),
        "the authority as sent, port included"
    );
    assert_eq!(
        req("/")
            .authority("ECHO.default.svc.cluster.local")
            .pick(&rs)
            .as_deref(),
        Some("404")
    );
    assert_eq!(
        req("/")
            .authority("echo.default.svc.cluster.local.evil.org")
            .pick(&rs)
            .as_deref(),
        Some("404")
    );
    let other = |r: Req| r.authority("other");
    assert_eq!(other(req("/w")).pick(&rs).as_deref(), Some("v#2"));
    assert_eq!(
        other(req("/w").header("x-canary", "yes"))
            .pick(&rs)
            .as_deref(),
        Some("404")
    );
    assert_eq!(
        other(req("/w").header("x-canary", "no"))
            .pick(&rs)
            .as_deref(),
        Some("v#2")
    );
    assert_eq!(
        other(req("/w").header("x-canary", "no").header("x-canary", "yes"))
            .pick(&rs)
            .as_deref(),
        Some("404"),
        "one value matching is enough to exclude"
    );
    assert_eq!(other(req("/p")).pick(&rs).as_deref(), Some("v#3"));
    assert_eq!(
        other(req("/p").header("x-debug", "")).pick(&rs).as_deref(),
        Some("404"),
        "present, even empty"
    );
    assert_eq!(
        other(req("/s")).pick(&rs).as_deref(),
        Some("404"),
        "the waypoint's scheme is http"
    );
}

/// `ignoreUriCase`: ASCII letters only, as Envoy compares; regexes keep their case.
#[test]
fn virtual_service_ignore_uri_case() {
    let rs = vec![vs("http:\n\
        - match: [{uri: {prefix: /Secret}, ignoreUriCase: true}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {exact: /a.b}, ignoreUriCase: true}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {regex: '/re'}, ignoreUriCase: true}]\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts")];
    assert_eq!(req("/sEcReT/x").pick(&rs).as_deref(), Some("v#0"));
    assert_eq!(
        req("/\u{17f}ecret").pick(&rs).as_deref(),
        Some("404"),
        "U+017F folds to s only in Unicode"
    );
    assert_eq!(req("/\u{212a}").pick(&rs).as_deref(), Some("404"));
    assert_eq!(req("/A.B").pick(&rs).as_deref(), Some("v#1"));
    assert_eq!(
        req("/aXb").pick(&rs).as_deref(),
        Some("404"),
        "the dot is a literal"
    );
    assert_eq!(
        req("/RE").pick(&rs).as_deref(),
        Some("404"),
        "a regex keeps its case"
    );
    assert_eq!(req("/re").pick(&rs).as_deref(), Some("v#2"));
}

/// A VirtualService of the waypoint's namespace may name another namespace's Service;
/// one of a third namespace may not (`getVirtualServiceForWaypoint`).
#[test]
fn virtual_service_hosts_in_other_namespaces() {
    let mut v: VirtualService = serde_yaml::from_str(
        "name: v\nnamespace: waypoints\nhosts: [echo.shop.svc.cluster.local]\nhttp: [{route: [{destination: {host: echo.shop.svc.cluster.local}}]}]",
    )
    .expect("parses");
    let rs = vec![v.to_http().expect("converts")];
    assert_eq!(
        req("/")
            .svc_ns("shop")
            .waypoint_ns("waypoints")
            .pick(&rs)
            .as_deref(),
        Some("v#0")
    );
    assert_eq!(req("/").svc_ns("shop").waypoint_ns("other").pick(&rs), None);
    v.namespace = "third".into();
    let rs = vec![v.to_http().expect("converts")];
    assert_eq!(
        req("/").svc_ns("shop").waypoint_ns("waypoints").pick(&rs),
        None
    );
}

/// What is converted for the plan: redirect, direct response, rewrites, headers; what
/// the waypoint does not do yet fails the rule closed, named.
#[test]
fn virtual_service_actions_and_unenforceable_fields() {
    let r = vs("http:\n\
        - match: [{uri: {prefix: /old}}]\n\
        \x20 redirect: {uri: /new, authority: example.com, redirectCode: 308}\n\
        - match: [{uri: {prefix: /gone}}]\n\
        \x20 directResponse: {status: 410, body: {string: gone}}\n\
        - match: [{uri: {prefix: /v1}}]\n\
        \x20 rewrite: {uri: /v2}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {prefix: /m}}]\n\
        \x20 delegate: {name: child}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {prefix: /h}}]\n\
        \x20 headers: {request: {set: {host: rewritten.example, ':path': /x, x-a: '100%%'}, remove: [':authority', x-b]}}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{uri: {prefix: /f}}]\n\
        \x20 headers: {request: {set: {x-ip: '%DOWNSTREAM_REMOTE_ADDRESS%'}}}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - route: [{destination: {host: echo}}]\n\
        \x20 retries: {attempts: 2, retryRemoteLocalities: true}\n")
    .expect("converts");
    assert!(matches!(r.rules[0].answer, Some(Answer::Redirect(_))));
    assert!(matches!(r.rules[1].answer, Some(Answer::Direct(_))));
    assert!(matches!(r.rules[2].uri_rewrite, Some(UriRewrite::Prefix(ref p)) if p == "/v2"));
    assert!(
        r.rules[3]
            .unenforceable
            .as_deref()
            .is_some_and(|u| u.starts_with("delegate:")),
        "{:?}",
        r.rules[3].unenforceable
    );
    let h = &r.rules[4];
    assert!(h.unenforceable.is_none(), "{:?}", h.unenforceable);
    let host = h.filters.iter().find_map(|f| match f {
        Filter::UrlRewrite(u) => u.hostname.clone(),
        _ => None,
    });
    assert_eq!(
        host.as_deref(),
        Some("rewritten.example"),
        "host in headers is the host rewrite"
    );
    let m = h
        .filters
        .iter()
        .find_map(|f| match f {
            Filter::RequestHeaderModifier(m) => Some(m),
            _ => None,
        })
        .expect("modifier");
    assert_eq!(
        m.set
            .iter()
            .map(|h| (h.name.as_str(), h.value.to_str().unwrap_or("")))
            .collect::<Vec<_>>(),
        [("x-a", "100%")],
        "internal headers dropped, %% is %"
    );
    assert_eq!(m.remove, ["x-b"]);
    assert!(r.rules[5]
        .unenforceable
        .as_deref()
        .is_some_and(|u| u.contains("%COMMAND%")));
    assert!(r.rules[6]
        .unenforceable
        .as_deref()
        .is_some_and(|u| u.contains("retryRemoteLocalities")));
}

/// `mirror` (percentage, deprecated integer percent, subset) and `mirrors` become the
/// rule's RequestMirror filters, as Istio's `TranslateRoute` builds Envoy's mirror
/// policies; `corsPolicy` its CORS filter with Istio's StringMatch origins.
#[test]
fn virtual_service_mirrors_and_cors_policy() {
    let r = vs("http:\n\
        - mirror: {host: echo-v2, subset: canary, port: {number: 8080}}\n\
        \x20 mirrorPercentage: {value: 12.5}\n\
        \x20 mirrors: [{destination: {host: shadow.other.svc.cluster.local}}, {destination: {host: echo}, percentage: {value: 0}}]\n\
        \x20 corsPolicy: {allowOrigins: [{exact: 'https://a.example'}, {prefix: 'https://b.'}, {regex: 'https://.*[.]c[.]example'}], \
             allowMethods: [GET, POST], maxAge: 24h, allowCredentials: true}\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - mirror: {host: echo}\n\
        \x20 mirrorPercent: 30\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts");
    let mirrors = |i: usize| -> Vec<RequestMirror> {
        r.rules[i]
            .filters
            .iter()
            .filter_map(|f| match f {
                Filter::RequestMirror(m) => Some(m.clone()),
                _ => None,
            })
            .collect()
    };
    let m = mirrors(0);
    assert_eq!(m.len(), 3, "{m:?}");
    assert_eq!(
        (
            m[0].backend_ref.name.as_str(),
            m[0].backend_ref.port,
            m[0].subset.as_deref()
        ),
        ("echo-v2", Some(8080), Some("canary"))
    );
    assert!(m[0].sampled(0.12) && !m[0].sampled(0.13), "12.5 %");
    assert_eq!(m[1].backend_ref.namespace.as_deref(), Some("other"));
    assert!(m[1].sampled(0.999), "all without a percentage");
    assert!(!m[2].sampled(0.0), "0 %: none");
    assert!(mirrors(1)[0].sampled(0.29) && !mirrors(1)[0].sampled(0.31));
    assert!(r.rules[0].unenforceable.is_none());

    let cors = r.rules[0].cors().expect("a CORS filter");
    let preflight = |origin: &str| {
        let mut h = http::HeaderMap::new();
        h.insert("origin", origin.parse().unwrap());
        h.insert("access-control-request-method", "POST".parse().unwrap());
        cors.on_request(&http::Method::OPTIONS, &h)
    };
    for ok in [
        "https://a.example",
        "https://b.anything",
        "https://x.c.example",
    ] {
        match preflight(ok) {
            CorsOutcome::Preflight(h) => {
                assert_eq!(h["access-control-allow-origin"], ok);
                assert_eq!(h["access-control-allow-methods"], "GET,POST");
                assert_eq!(h["access-control-max-age"], "86400");
                assert_eq!(h["access-control-allow-credentials"], "true");
            }
            other => panic!("{ok}: {other:?}"),
        }
    }
    // Istio's default for a VirtualService: a preflight of another origin goes on to the
    // backend (Envoy's forward_not_matching_preflights).
    for not in [
        "https://a.example.evil",
        "https://x.c.example.evil",
        "http://b.x",
    ] {
        assert!(matches!(preflight(not), CorsOutcome::NotCors), "{not}");
    }
    let ignore = vs(
        "http:\n- corsPolicy: {allowOrigin: ['https://a.example'], unmatchedPreflights: IGNORE}\n\
                      \x20 route: [{destination: {host: echo}}]\n",
    )
    .expect("converts");
    let mut h = http::HeaderMap::new();
    h.insert("origin", "https://evil.example".parse().unwrap());
    h.insert("access-control-request-method", "GET".parse().unwrap());
    match ignore.rules[0]
        .cors()
        .unwrap()
        .on_request(&http::Method::OPTIONS, &h)
    {
        CorsOutcome::Preflight(h) => {
            assert!(h.get("access-control-allow-origin").is_none());
            assert!(h.get("access-control-max-age").is_none(), "no maxAge: none");
        }
        other => panic!("answered here: {other:?}"),
    }
    for (yaml, want) in [
        (
            "corsPolicy: {allowOrigins: [{regex: '('}]}",
            "corsPolicy.allowOrigins[0].regex",
        ),
        (
            "corsPolicy: {allowOrigins: [{exact: a, prefix: b}]}",
            "corsPolicy.allowOrigins[0]: set exactly one",
        ),
        (
            "corsPolicy: {unmatchedPreflights: MAYBE}",
            "corsPolicy.unmatchedPreflights",
        ),
        (
            "mirror: {host: echo}\n  mirrorPercentage: {value: 101}",
            "mirror.percentage.value",
        ),
        (
            "mirrors: [{destination: {host: '*.example.com'}}]",
            "mirrors[0].destination.host",
        ),
    ] {
        let e = vs(&format!(
            "http:\n- {yaml}\n  route: [{{destination: {{host: echo}}}}]\n"
        ))
        .expect_err(yaml);
        assert!(e.contains(want), "{yaml}: {e}");
    }
}

/// `method` as Istio matches it (the `:method` header): exact, and also prefix and regex.
#[test]
fn virtual_service_method_matches_prefix_and_regex() {
    let rs = vec![vs("http:\n\
        - match: [{method: {prefix: GE}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{method: {regex: 'P(UT|ATCH)'}}]\n\
        \x20 route: [{destination: {host: echo}}]\n\
        - match: [{method: {exact: DELETE}}]\n\
        \x20 route: [{destination: {host: echo}}]\n")
    .expect("converts")];
    let pick = |m: Method| req("/").method(m).pick(&rs);
    assert_eq!(pick(Method::GET).as_deref(), Some("v#0"));
    assert_eq!(pick(Method::PUT).as_deref(), Some("v#1"));
    assert_eq!(pick(Method::PATCH).as_deref(), Some("v#1"));
    assert_eq!(pick(Method::DELETE).as_deref(), Some("v#2"));
    // The regex matches the whole method; no prefix of it.
    assert_eq!(
        pick(Method::from_bytes(b"PUTX").unwrap()).as_deref(),
        Some("404")
    );
    assert_eq!(pick(Method::POST).as_deref(), Some("404"));
    let e =
        vs("http:\n- match: [{method: {regex: '('}}]\n  route: [{destination: {host: echo}}]\n")
            .expect_err("bad regex");
    assert!(e.contains("match[0].method"), "{e}");
}
