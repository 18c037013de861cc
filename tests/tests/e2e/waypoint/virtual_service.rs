//! VirtualService route actions and matches as Istio's waypoint applies them, with real
//! clients (curl over HTTP/1.1 and HTTP/2, h2load) against the echo pods: `redirect`,
//! `directResponse`, `rewrite.uri` and `uriRegexRewrite`, rule `headers`, and the
//! matches `withoutHeaders`, `ignoreUriCase`, `authority`, `sourceLabels` (dropped);
//! a `method` regex; `delegate` (a delegate's rules merged under the root's); rules in order; `mirror` (the mirror's request seen by its backend) and `corsPolicy`
//! (a curl preflight answered, another origin's forwarded, as Envoy's
//! forward_not_matching_preflights).
//! Hostile inputs: case and percent-encoding tricks against `ignoreUriCase`, CRLF in the
//! query of a redirect, a Host that tries to reach another rule's `authority`.

use anyhow::{Context, Result};

use super::{L7Mesh, ECHO_VIP};

const L7: &str = r#"virtualServices:
- name: echo
  namespace: default
  hosts: [echo.default.svc.cluster.local]
  http:
  - match: [{sourceLabels: {app: client}}]
    directResponse: {status: 418, body: {string: "sourceLabels are not dropped"}}
  - match: [{uri: {prefix: /old}}]
    redirect: {uri: /new, redirectCode: 308}
  - match: [{uri: {prefix: /moved}}]
    redirect: {authority: example.com, scheme: https}
  - match: [{uri: {prefix: /gone}}]
    directResponse: {status: 410, body: {string: "gone for good"}}
  - match: [{uri: {prefix: /Admin}, ignoreUriCase: true}]
    directResponse: {status: 403, body: {string: "admin is closed"}}
  - match: [{uri: {prefix: /v1/}}]
    rewrite: {uri: /v2/}
    route: [{destination: {host: echo-v1}}]
  - match: [{uri: {regex: '/svc/[^/]+/.*'}}]
    rewrite: {uriRegexRewrite: {match: '^/svc/([^/]+)/(.*)$', rewrite: '/\2/of/\1'}}
    route: [{destination: {host: echo-v1}}]
  - match: [{uri: {prefix: /canary}, withoutHeaders: {x-canary: {exact: "yes"}}}]
    route: [{destination: {host: echo-v1}}]
  - match: [{uri: {prefix: /canary}}]
    route: [{destination: {host: echo-v2}}]
  - match: [{uri: {prefix: /internal}, authority: {exact: internal.example}}]
    route: [{destination: {host: echo-v2}}]
  - match: [{uri: {prefix: /mirror}}]
    mirror: {host: echo-v2}
    mirrorPercentage: {value: 100}
    route: [{destination: {host: echo-v1}}]
  - match: [{uri: {prefix: /methods}, method: {regex: "P(UT|ATCH)"}}]
    directResponse: {status: 202, body: {string: "a PUT or PATCH"}}
  - match: [{uri: {prefix: /team}}]
    delegate: {name: team-routes}
    headers: {response: {set: {x-delegated: "yes"}}}
  - match: [{uri: {prefix: /cors}}]
    corsPolicy:
      allowOrigins: [{prefix: "https://app."}]
      allowMethods: [GET, PUT]
      maxAge: 10m
    route: [{destination: {host: echo-v1}}]
  - route: [{destination: {host: echo-v1}}]
    headers:
      request: {set: {x-vs: applied}, remove: [x-drop]}
      response: {set: {x-resp: set-by-vs}}
- name: team-routes
  namespace: default
  http:
  - match: [{uri: {prefix: /team/v2}}]
    route: [{destination: {host: echo-v2}}]
  - match: [{uri: {prefix: /elsewhere}}]
    route: [{destination: {host: echo-v2}}]
  - route: [{destination: {host: echo-v1}}]
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_virtual_service_redirects_answers_rewrites_and_matches() -> Result<()> {
    let m = L7Mesh::start("l7vsa", L7, &[]).await?;
    let client = m.client();
    let curl = |args: &[&str]| -> Result<String> {
        let mut all = vec!["-sS", "--max-time", "10", "-D", "-"];
        all.extend_from_slice(args);
        client.exec("curl", &all).with_context(|| m.log())
    };
    let url = |p: &str| format!("http://{ECHO_VIP}{p}");
    let status = |out: &str| out.split_whitespace().nth(1).unwrap_or("").to_string();
    let header = |out: &str, name: &str| {
        out.lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
            .unwrap_or_default()
    };

    // The sourceLabels match is dropped (Istio's waypoint drops it, whatever the
    // client's labels): the first rule never answers.
    let out = curl(&[&url("/plain"), "-H", "x-drop: me"])?;
    assert_eq!(status(&out), "200", "{out}");
    assert!(
        out.contains("x-vs: applied") && !out.contains("x-drop"),
        "{out}"
    );
    assert_eq!(header(&out, "x-resp"), "set-by-vs", "{out}");

    // redirect: 308, the request's Host and query kept; HTTP/2 too.
    for proto in ["--http1.1", "--http2-prior-knowledge"] {
        let out = curl(&[proto, &url("/old/x?a=1")])?;
        assert_eq!(status(&out), "308", "{proto}: {out}");
        assert_eq!(
            header(&out, "location"),
            format!("http://{ECHO_VIP}/new?a=1")
        );
    }
    // A CRLF in the query stays percent-encoded: no header is injected.
    let out = curl(&[&url("/old?x=%0d%0aSet-Cookie:%20evil=1")])?;
    assert_eq!(
        header(&out, "location"),
        format!("http://{ECHO_VIP}/new?x=%0d%0aSet-Cookie:%20evil=1")
    );
    assert!(!out.to_ascii_lowercase().contains("\nset-cookie"), "{out}");
    // Istio's default code is 301; the scheme change drops nothing but the scheme.
    let out = curl(&[&url("/moved/y")])?;
    assert_eq!(
        (status(&out), header(&out, "location")),
        ("301".to_string(), "https://example.com/moved/y".to_string()),
        "{out}"
    );

    // directResponse: the status and body as configured.
    let out = curl(&[&url("/gone")])?;
    assert_eq!(status(&out), "410", "{out}");
    assert!(out.ends_with("gone for good"), "{out}");

    // ignoreUriCase: ASCII case, after normalization (an escaped letter is the letter);
    // what normalization takes elsewhere does not match.
    for p in ["/admin", "/ADMIN/keys", "/aDmIn", "/%41dmin", "/x/../Admin"] {
        let out = curl(&["--path-as-is", &url(p)])?;
        assert_eq!(status(&out), "403", "{p}: {out}");
    }
    for p in ["/Admin/../other", "/ad%2Fmin", "/adm\u{131}n"] {
        let out = curl(&["--path-as-is", &url(p)])?;
        assert_ne!(status(&out), "403", "{p}: {out}");
    }

    // rewrite.uri replaces the matched prefix; uriRegexRewrite every match; the query
    // is kept either way.
    let out = curl(&[&url("/v1/users?id=7")])?;
    assert!(out.contains("path=/v2/users?id=7"), "{out}");
    let out = curl(&[&url("/svc/books/list?all")])?;
    assert!(out.contains("path=/list/of/books?all"), "{out}");

    // withoutHeaders: the request without the header (or with another value) goes to
    // v1; with it, on to the next rule.
    let pod = |out: &str| header(out, "x-pod");
    assert_ne!(pod(&curl(&[&url("/canary")])?), "n1p3");
    assert_ne!(
        pod(&curl(&[&url("/canary"), "-H", "x-canary: no"])?),
        "n1p3"
    );
    assert_eq!(
        pod(&curl(&[&url("/canary"), "-H", "x-canary: yes"])?),
        "n1p3"
    );

    // authority: as sent, exactly; a look-alike Host falls through to the catch-all.
    assert_eq!(
        pod(&curl(&[&url("/internal"), "-H", "host: internal.example"])?),
        "n1p3"
    );
    for host in [
        "INTERNAL.example",
        "internal.example:80",
        "internal.example.evil.org",
    ] {
        let out = curl(&[&url("/internal"), "-H", &format!("host: {host}")])?;
        assert_ne!(pod(&out), "n1p3", "{host}: {out}");
    }

    // mirror: the answer is echo-v1's; echo-v2 (n1p3) gets the copy, its Host (curl's,
    // the VIP) with `-shadow` (Envoy's).
    let out = curl(&[&url("/mirror/1")])?;
    assert_eq!(status(&out), "200", "{out}");
    assert_ne!(header(&out, "x-pod"), "n1p3", "{out}");
    let shadow = &m.apps["n1p3"];
    mesh_tests::netsim::wait_for(
        "the mirrored request",
        std::time::Duration::from_secs(5),
        || {
            shadow.seen().iter().any(|r| {
                r.path == "/mirror/1"
                    && r.headers.get("host").and_then(|h| h.to_str().ok())
                        == Some(format!("{ECHO_VIP}-shadow").as_str())
            })
        },
    )
    .with_context(|| m.log())?;

    // delegate: the delegate's rules under the root's /team match, the root's response
    // headers inherited; its /elsewhere rule conflicts with /team and is dropped, so
    // /elsewhere falls to the root's last rule.
    let out = curl(&[&url("/team/v2/x")])?;
    assert_eq!(
        (
            status(&out).as_str(),
            header(&out, "x-pod").as_str(),
            header(&out, "x-delegated").as_str()
        ),
        ("200", "n1p3", "yes"),
        "{out}"
    );
    let out = curl(&[&url("/team/x")])?;
    assert_ne!(header(&out, "x-pod"), "n1p3", "{out}");
    assert_eq!(header(&out, "x-delegated"), "yes", "{out}");
    let out = curl(&[&url("/elsewhere")])?;
    assert_eq!(
        header(&out, "x-resp"),
        "set-by-vs",
        "the root's last rule: {out}"
    );
    m.waypoint
        .wait_log("delegate rule dropped", std::time::Duration::from_secs(5))?;

    // A method regex (Istio's `:method` header match): PUT and PATCH, not POST.
    for (method, want) in [("PUT", "202"), ("PATCH", "202"), ("POST", "200")] {
        let out = curl(&["-X", method, &url("/methods")])?;
        assert_eq!(status(&out), want, "{method}: {out}");
    }

    // corsPolicy: an allowed origin's preflight is answered here; another origin's goes
    // on to the backend (Istio's default unmatchedPreflights: FORWARD).
    let preflight = |origin: &str| {
        curl(&[
            "-X",
            "OPTIONS",
            "-H",
            &format!("Origin: {origin}"),
            "-H",
            "Access-Control-Request-Method: PUT",
            &url("/cors/items"),
        ])
    };
    let out = preflight("https://app.example.com")?;
    assert_eq!(status(&out), "200", "{out}");
    assert_eq!(
        header(&out, "access-control-allow-origin"),
        "https://app.example.com"
    );
    assert_eq!(header(&out, "access-control-allow-methods"), "GET,PUT");
    assert_eq!(header(&out, "access-control-max-age"), "600");
    assert_eq!(header(&out, "x-pod"), "", "answered by the waypoint: {out}");
    let out = preflight("https://evil.example.com")?;
    assert_eq!(header(&out, "access-control-allow-origin"), "", "{out}");
    assert_ne!(header(&out, "x-pod"), "", "forwarded to the backend: {out}");

    // h2load through the redirect and direct response rules: every answer the
    // waypoint's own.
    for (p, code) in [("/gone", "4xx"), ("/old", "3xx")] {
        let out = client.exec("h2load", &["-n", "200", "-c", "2", "-m", "4", &url(p)])?;
        let codes = out
            .lines()
            .find(|l| l.starts_with("status codes:"))
            .unwrap_or_default();
        assert!(
            codes.contains(&format!("200 {code}")),
            "{p}: {codes}\n{out}"
        );
    }
    Ok(())
}
