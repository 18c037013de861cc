use super::*;

fn attrs<'a>(code: u16, headers: &'a [(HeaderName, String)]) -> Attributes<'a> {
    Attributes {
        code,
        grpc_status: None,
        method: "GET",
        path: "/api/items",
        query: Some("x=1"),
        host: "echo.default.svc.cluster.local",
        protocol: "HTTP/1.1",
        headers,
        source: "10.0.0.1:40000".parse().unwrap(),
        destination: "10.96.0.10:80".parse().unwrap(),
        upstream: None,
        peer_san: "spiffe://cluster.local/ns/default/sa/sleep",
        request_size: 0,
        request_total_size: 120,
        response_size: 2048,
        response_flags: "-",
    }
}

fn check(text: &str, code: u16) -> bool {
    let h = [
        (HeaderName::from_static("x-debug"), "on".to_string()),
        (HeaderName::from_static("user-agent"), "curl/8".to_string()),
    ];
    Expr::compile(text)
        .unwrap_or_else(|e| panic!("{text}: {e}"))
        .matches(&attrs(code, &h))
}

#[test]
fn istios_examples_evaluate() {
    assert!(check("response.code >= 400", 503) && !check("response.code >= 400", 200));
    assert!(check(
        "response.code == 200 && request.method == 'GET'",
        200
    ));
    assert!(check(
        "request.url_path.startsWith('/api') || response.code >= 500",
        200
    ));
    assert!(check(
        "request.path == '/api/items?x=1' && request.url_path.endsWith('items')",
        200
    ));
    assert!(check("request.headers['x-debug'] == \"on\"", 200));
    assert!(
        check("!(response.code in [200, 204])", 404) && !check("response.code in [200, 204]", 503)
    );
    assert!(check(
        "request.host.contains('default') && connection.mtls",
        200
    ));
    assert!(check(
        "connection.uri_san_peer_certificate.matches('^spiffe://cluster.local/ns/default/')",
        200
    ));
    assert!(check("source.port > 1024 && destination.port == 80", 200));
}

#[test]
fn the_rest_of_cel_evaluates_through_the_crate() {
    // What the hand-written subset refused: arithmetic, size(), string escapes,
    // ternaries, macros, has(), maps, the user agent and sizes.
    assert!(check("response.code / 100 == 5", 503));
    assert!(check("size(request.url_path) == 10", 200));
    assert!(check("'a\\'b' == \"a'b\"", 200));
    assert!(check("(response.code >= 500 ? 'err' : 'ok') == 'ok'", 200));
    assert!(check(
        "['x', 'on'].exists(v, v == request.headers['x-debug'])",
        200
    ));
    assert!(check("has(request.headers.x_debug) == false", 200));
    assert!(check("'x-debug' in request.headers", 200));
    assert!(check("{'a': 1}['a'] == 1", 200));
    assert!(check("type(response.code) == int && int('5') == 5", 200));
    assert!(check("request.useragent.startsWith('curl/')", 200));
    assert!(check("response.size > 1024 && request.size == 0", 200));
    assert!(check(
        "request.query == 'x=1' && request.protocol == 'HTTP/1.1'",
        200
    ));
}

#[test]
fn headers_read_by_name_are_the_ones_kept() {
    let e = Expr::compile("request.headers['x-a'] == '1' || has(request.headers.x_b)").unwrap();
    let names: Vec<&str> = e.headers().iter().map(HeaderName::as_str).collect();
    assert_eq!(names, ["x-a", "x_b"]);
    assert!(!e.all_headers());
    assert!(Expr::compile("'x-a' in request.headers")
        .unwrap()
        .all_headers());
    assert!(Expr::compile("request.headers.exists(k, k == 'a')")
        .unwrap()
        .all_headers());
    assert!(!Expr::compile("response.code == 200").unwrap().all_headers());
}

#[test]
fn errors_follow_cel() {
    // A missing header is an error: not logged, unless `||` has a true side.
    assert!(!check("request.headers['x-missing'] == 'a'", 200));
    assert!(!check("request.headers['x-missing'] != 'a'", 200));
    assert!(check(
        "request.headers['x-missing'] == 'a' || response.code == 200",
        200
    ));
    assert!(!check(
        "request.headers['x-missing'] == 'a' && response.code == 200",
        200
    ));
    assert!(
        !check(
            "request.headers['x-missing'] == 'a' && response.code == 500",
            200
        ),
        "false && error is false, not logged"
    );
    // Mixed types and non-boolean results are not true; absent attributes are errors.
    assert!(
        !check("response.code == '200'", 200)
            && !check("response.code", 200)
            && !check("response.grpc_status == 0", 200)
            && !check("upstream.port == 80", 200)
            && !check("request.referer == ''", 200)
    );
    assert!(!check("1 / 0 == 1", 200), "division by zero is an error");
    assert!(
        !check("response.code + 9223372036854775807 > 0", 200),
        "overflow is an error"
    );
    assert!(!check("-9223372036854775807 - response.code < 0", 200));
}

#[test]
fn what_is_not_supported_is_refused_by_name() {
    for (text, want) in [
        (
            "xds.cluster_name == 'x'",
            "the attribute xds.cluster_name is not supported",
        ),
        (
            "response.code_details == 'x'",
            "the attribute response.code_details is not supported",
        ),
        (
            "request.time > 0",
            "the attribute request.time is not supported",
        ),
        ("foo == 1", "foo is not one of Envoy's attributes"),
        ("response.code >= ", "not CEL"),
        ("response.code >= 400 400", "not CEL"),
        ("request.url_path.matches('(')", "matches:"),
        (
            "request.url_path.matches(request.host)",
            "the pattern must be a string literal",
        ),
        ("request.headers['bad header'] == 'x'", "not valid"),
    ] {
        let e = Expr::compile(text).expect_err(text).to_string();
        assert!(e.contains(want), "{text}: {e}");
    }
}

#[test]
fn hostile_expressions_are_refused_at_load_without_a_panic() {
    let deep = format!("{}true{}", "(".repeat(100), ")".repeat(100));
    assert_eq!(Expr::compile(&deep).unwrap_err(), ExprError::TooDeep);
    let deep = format!("{}1{}", "[".repeat(40), "]".repeat(40));
    assert_eq!(Expr::compile(&deep).unwrap_err(), ExprError::TooDeep);
    // Unbracketed chains nest the tree as deeply: bounded by the length and the walk.
    for chain in [
        format!("request{}", ".a".repeat((MAX_LEN - 10) / 2)),
        format!("1{}", " + 1".repeat((MAX_LEN - 10) / 4)),
        format!("request.path{}", "[0]".repeat((MAX_LEN - 20) / 3)),
    ] {
        assert_eq!(
            Expr::compile(&chain).unwrap_err(),
            ExprError::TooDeep,
            "{}",
            &chain[..20]
        );
    }
    // Repeated `!` and `-` fold as cel-go folds them (an even run is the operand).
    assert!(check(&format!("{}true", "!".repeat(MAX_LEN - 10)), 200));
    assert!(check(
        &format!("{}200 == response.code", "-".repeat(MAX_LEN - 30)),
        200
    ));
    // `||` and `&&` chains are balanced by the parser (as cel-go's): shallow, accepted.
    let chain = format!(
        "response.code == 1{}",
        " || response.code == 200".repeat(150)
    );
    assert!(check(&chain, 200) && !check(&chain, 500));
    let long = format!("request.host == '{}'", "a".repeat(MAX_LEN));
    assert!(matches!(
        Expr::compile(&long).unwrap_err(),
        ExprError::TooLong(_)
    ));
    // Regex bombs: refused by size, never run.
    // (The patterns are CEL string literals: `\\w` is the regex's `\w`.)
    for p in ["(a{1000}){1000}", r"(\\w{100}){100}", r"\\w{500}\\w{500}"] {
        let text = format!("request.url_path.matches('{p}')");
        let e = Expr::compile(&text).expect_err(p).to_string();
        assert!(e.starts_with("matches:"), "{p}: {e}");
    }
    // Quadratic comprehensions over literal lists stay bounded by the length.
    let list = format!("[{}]", vec!["1"; 200].join(","));
    let text = format!("{list}.all(x, {list}.exists(y, y == x))");
    assert!(check(&text, 200));
    // Malformed input of every kind: an error, never a panic.
    for text in [
        "", "'", "\"\\", "(((", ")))", "a.", "[1,", "{1:", "!", "\u{0}", "é == é",
    ] {
        let _ = Expr::compile(text);
    }
}

/// `response.flags`: Envoy's legacy bit vector of the response flags.
#[test]
fn response_flags_are_envoys_bits() {
    assert_eq!(flag_bits("-"), 0);
    assert_eq!(flag_bits("UF"), 0x20);
    assert_eq!(flag_bits("UF,URX"), 0x20 | 0x8000);
    assert_eq!(
        (flag_bits("UH"), flag_bits("NR"), flag_bits("DC")),
        (0x2, 0x100, 0x4000)
    );
    assert_eq!((flag_bits("UAEX"), flag_bits("DR")), (0x1000, 0x10000000));
    assert_eq!(flag_bits("NOPE"), 0);
    let h = [];
    let mut a = attrs(503, &h);
    a.response_flags = "UF,URX";
    for (text, want) in [
        ("response.flags == 32800u", true),
        ("response.flags != 0u", true),
        ("response.flags == 0u", false),
    ] {
        assert_eq!(Expr::compile(text).unwrap().matches(&a), want, "{text}");
    }
    a.response_flags = "-";
    assert!(Expr::compile("response.flags == 0u").unwrap().matches(&a));
}
