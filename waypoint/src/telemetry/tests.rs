use super::*;
use serde_json::Value;

fn mesh(yaml: &str) -> MeshProviders {
    let v: Value = serde_yaml::from_str(yaml).expect("mesh yaml");
    MeshProviders::from_mesh(Some(&v), Some("otel"))
}

fn telemetries(yaml: &str, mesh: &MeshProviders) -> Result<Telemetries, String> {
    let list: Vec<Telemetry> = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    let compiled = list
        .iter()
        .map(|t| t.compile(mesh))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Telemetries::new(compiled, mesh.clone()))
}

fn gateway() -> ObjectName {
    ObjectName {
        namespace: "waypoints".into(),
        name: "waypoint".into(),
    }
}

fn applied(t: &Telemetries, svc: Option<(&str, &str)>) -> Arc<Applied> {
    let gw = gateway();
    let svc = svc.map(|(ns, n)| ObjectName {
        namespace: ns.into(),
        name: n.into(),
    });
    t.for_target(&Target {
        gateway: &gw,
        root_namespace: "istio-system",
        service: svc.as_ref(),
        service_kind: Default::default(),
        port: 80,
    })
}

fn log_of(a: &Applied) -> String {
    match &a.log {
        LogPolicy::Always => "always".into(),
        LogPolicy::Off => "off".into(),
        // One provider's filter as before; several: `name=filter` each.
        LogPolicy::Providers(p) if p.len() == 1 => format!(
            "on{:?}",
            p[0].filter
                .iter()
                .map(|e| e.source().to_string())
                .collect::<Vec<_>>()
        ),
        LogPolicy::Providers(p) => format!(
            "on{:?}",
            p.iter()
                .map(|p| format!(
                    "{}={}",
                    p.name,
                    p.filter.as_ref().map_or("", |e| e.source())
                ))
                .collect::<Vec<_>>()
        ),
    }
}

#[test]
fn access_logging_follows_the_telemetries_in_force() {
    let m = mesh("{}");
    // Nothing configured: every request, as before.
    assert_eq!(
        log_of(&applied(
            &telemetries("[]", &m).unwrap(),
            Some(("shop", "cart"))
        )),
        "always"
    );
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, accessLogging: [{providers: [{name: envoy}], filter: {expression: 'response.code >= 400'}}]}\n\
         - {name: off, namespace: shop, accessLogging: [{providers: [{name: envoy}], disabled: true}]}\n\
         - {name: cart, namespace: books, targetRefs: [{kind: Service, group: '', name: reviews}], accessLogging: [{providers: [{name: envoy}]}]}\n\
         - {name: sidecars, namespace: books, selector: {matchLabels: {app: x}}, accessLogging: [{providers: [{name: envoy}], disabled: true}]}\n",
        &m,
    )
    .unwrap();
    // Mesh-wide: only errors.
    assert_eq!(
        log_of(&applied(&t, Some(("books", "details")))),
        "on[\"response.code >= 400\"]"
    );
    // The Service's namespace turns it off.
    assert_eq!(log_of(&applied(&t, Some(("shop", "cart")))), "off");
    // A Telemetry on the Service: every request.
    assert_eq!(log_of(&applied(&t, Some(("books", "reviews")))), "on[]");
    // A CLIENT-only entry does not apply to a waypoint (SERVER), and as in istiod's merge,
    // no entry for it leaves it no access log.
    let t = telemetries("- {name: mesh, namespace: istio-system, accessLogging: [{providers: [{name: envoy}], match: {mode: CLIENT}}]}\n", &m).unwrap();
    assert_eq!(log_of(&applied(&t, None)), "off");
    // A default provider alone turns the log on; an entry without providers inherits it.
    let d = mesh("{defaultProviders: {accessLogging: [envoy]}}");
    assert_eq!(
        log_of(&applied(&telemetries("[]", &d).unwrap(), None)),
        "on[]"
    );
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, accessLogging: [{disabled: true}]}\n",
        &d,
    )
    .unwrap();
    assert_eq!(log_of(&applied(&t, None)), "off");
    // A stdout envoyFileAccessLog provider is the same log.
    let f = mesh("{extensionProviders: [{name: stdout, envoyFileAccessLog: {path: /dev/stdout}}]}");
    let t = telemetries("- {name: mesh, namespace: istio-system, accessLogging: [{providers: [{name: stdout}], filter: {expression: 'response.code == 503'}}]}\n", &f).unwrap();
    assert_eq!(log_of(&applied(&t, None)), "on[\"response.code == 503\"]");
}

#[test]
fn metric_overrides_remove_tags_and_drop_metrics() {
    let m = mesh("{}");
    let t = telemetries(
        "- name: mesh\n  namespace: istio-system\n  metrics:\n  - providers: [{name: prometheus}]\n    overrides:\n\
         \x20   - {match: {metric: ALL_METRICS}, tagOverrides: {source_principal: {operation: REMOVE}}}\n\
         \x20   - {match: {metric: REQUEST_DURATION, mode: SERVER}, disabled: true}\n\
         \x20   - {match: {metric: REQUEST_COUNT, mode: CLIENT}, tagOverrides: {response_code: {operation: REMOVE}}}\n\
         - name: ns\n  namespace: shop\n  metrics: [{overrides: [{match: {metric: REQUEST_COUNT}, tagOverrides: {destination_workload: {operation: REMOVE}}}]}]\n",
        &m,
    )
    .unwrap();
    let a = applied(&t, Some(("books", "details")));
    let http = a.http.as_ref().expect("overrides");
    assert_eq!(
        http.requests.remove,
        ["source_principal"],
        "a CLIENT override does not apply to a waypoint"
    );
    assert!(http.duration.disabled && !http.requests.disabled);
    assert_eq!(a.tcp.as_ref().expect("tcp")[0].remove, ["source_principal"]);
    let a = applied(&t, Some(("shop", "cart")));
    assert_eq!(
        a.http.as_ref().expect("overrides").requests.remove,
        ["source_principal", "destination_workload"]
    );
    // ALL_METRICS disabled: nothing is recorded.
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, metrics: [{overrides: [{disabled: true}]}]}\n",
        &m,
    )
    .unwrap();
    let a = applied(&t, None);
    assert!(
        a.http
            .as_ref()
            .is_some_and(|h| h.requests.disabled && h.response_bytes.disabled)
            && a.tcp.as_ref().is_some_and(|t| t.iter().all(|o| o.disabled))
    );
    // No overrides: the fast path.
    assert!(applied(&telemetries("[]", &m).unwrap(), None)
        .http
        .is_none());
}

/// `reportingInterval`: the most specific Telemetry's (Istio's merge); none, Istio's 5 s.
#[test]
fn tcp_reporting_interval_comes_from_the_most_specific_telemetry() {
    let m = mesh("{}");
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, metrics: [{reportingInterval: 30s}]}\n\
         - {name: ns, namespace: shop, metrics: [{reportingInterval: 250ms}]}\n\
         - {name: fast, namespace: blog, metrics: [{reportingInterval: 1ms}]}\n",
        &m,
    )
    .unwrap();
    let ms = std::time::Duration::from_millis;
    assert_eq!(
        applied(&t, Some(("books", "x"))).tcp_reporting,
        Some(ms(30_000))
    );
    assert_eq!(
        applied(&t, Some(("shop", "cart"))).tcp_reporting,
        Some(ms(250))
    );
    assert_eq!(
        applied(&t, Some(("blog", "x"))).tcp_reporting,
        Some(MIN_TCP_REPORTING),
        "bounded"
    );
    let none = telemetries("[]", &m).unwrap();
    assert_eq!(applied(&none, Some(("shop", "cart"))).tcp_reporting, None);
    assert_eq!(TCP_REPORTING, ms(5_000));
}

#[test]
fn tracing_overrides_sampling_and_span_reporting() {
    let m = mesh("{}");
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, tracing: [{randomSamplingPercentage: 100}]}\n\
         - {name: ns, namespace: shop, tracing: [{providers: [{name: otel}], disableSpanReporting: true}]}\n",
        &m,
    )
    .unwrap();
    let a = applied(&t, Some(("books", "x")));
    assert_eq!((a.sampling, a.spans_off), (Some(100.0), false));
    let a = applied(&t, Some(("shop", "cart")));
    assert_eq!((a.sampling, a.spans_off), (Some(100.0), true));
    assert!(a.tags.is_none());
}

#[test]
fn custom_tags_come_from_the_last_telemetry_that_sets_them() {
    let m = mesh("{}");
    let t = telemetries(
        "- {name: mesh, namespace: istio-system, tracing: [{customTags: {team: {literal: {value: mesh}}, user: {header: {name: x-user}}}}]}\n\
         - {name: ns, namespace: shop, tracing: [{customTags: {team: {literal: {value: shop}}}}]}\n",
        &m,
    )
    .unwrap();
    let values = |a: &Applied| -> Vec<(String, String)> {
        let h = [(http::HeaderName::from_static("x-user"), "ann".to_string())];
        a.tags
            .as_ref()
            .map(|t| t.values(&h, None).collect())
            .unwrap_or_default()
    };
    let pair = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        values(&applied(&t, Some(("books", "x")))),
        [pair("team", "mesh"), pair("user", "ann")]
    );
    // istiod's merge is shallow: the namespace's tags replace the mesh's.
    assert_eq!(
        values(&applied(&t, Some(("shop", "cart")))),
        [pair("team", "shop")]
    );
    // The ProxyConfig's tags (defaultConfig.tracing.custom_tags) when no Telemetry sets
    // any, with no Telemetry at all too.
    let m = mesh("{defaultConfig: {tracing: {custom_tags: {zone: {literal: {value: z1}}}}}}");
    assert_eq!(
        values(&applied(&telemetries("[]", &m).unwrap(), None)),
        [pair("zone", "z1")]
    );
    let t = telemetries(
        "- {name: ns, namespace: shop, tracing: [{customTags: {team: {literal: {value: shop}}}}]}\n",
        &m,
    )
    .unwrap();
    assert_eq!(
        values(&applied(&t, Some(("books", "x")))),
        [pair("zone", "z1")]
    );
    assert_eq!(
        values(&applied(&t, Some(("shop", "cart")))),
        [pair("team", "shop")]
    );
    let bad = mesh("{defaultConfig: {tracing: {customTags: {a: {nope: {}}}}}}");
    assert!(
        bad.errors()[0].starts_with("meshConfig.defaultConfig.tracing.customTags.a: not an object"),
        "{:?}",
        bad.errors()
    );
}

#[test]
fn what_the_waypoint_cannot_do_is_refused_with_the_field_named() {
    let m = mesh("{extensionProviders: [{name: file, envoyFileAccessLog: {path: /var/log/access.log, omitEmptyValues: true}}, {name: http-als, envoyHttpAls: {service: c, port: 4317}}]}");
    for (yaml, want) in [
        ("accessLogging: [{providers: [{name: http-als}]}]", "accessLogging[0].providers[0].name: \"http-als\" is not an access log this waypoint writes"),
        ("accessLogging: [{providers: [{name: file}]}]", "accessLogging[0].providers[0].name: \"file\""),
        ("accessLogging: [{filter: {expression: 'xds.cluster_name == \"x\"'}}]", "accessLogging[0].filter.expression: the attribute xds.cluster_name is not supported"),
        ("accessLogging: [{match: {mode: BOTH}}]", "accessLogging[0].match.mode: \"BOTH\""),
        ("metrics: [{providers: [{name: stackdriver}]}]", "metrics[0].providers[0].name: \"stackdriver\" is not a metrics provider"),
        ("metrics: [{reportingInterval: soon}]", "metrics[0].reportingInterval"),
        ("metrics: [{overrides: [{match: {customMetric: my_metric}}]}]", "metrics[0].overrides[0].match.customMetric"),
        ("metrics: [{overrides: [{match: {metric: REQUEST_BYTES}}]}]", "metrics[0].overrides[0].match.metric: \"REQUEST_BYTES\""),
        ("metrics: [{overrides: [{tagOverrides: {request_host: {value: request.host}}}]}]", "metrics[0].overrides[0].tagOverrides.request_host.operation: UPSERT"),
        ("metrics: [{overrides: [{tagOverrides: {nope: {operation: REMOVE}}}]}]", "metrics[0].overrides[0].tagOverrides.nope: not a label"),
        ("tracing: [{providers: [{name: zipkin}]}]", "tracing[0].providers[0].name: \"zipkin\""),
        ("tracing: [{customTags: {a: {formatter: {value: '%NOPE%'}}}}]", "tracing[0].customTags.a.formatter.value: %NOPE% is not supported"),
        ("tracing: [{randomSamplingPercentage: 101}]", "tracing[0].randomSamplingPercentage"),
        ("targetRefs: [{kind: Pod, name: x}]", "targetRefs[0]: kind \"Pod\""),
    ] {
        let e = telemetries(&format!("- {{name: t, namespace: default, {yaml}}}\n"), &m).err().unwrap_or_else(|| panic!("accepted: {yaml}"));
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

#[test]
fn access_log_providers_and_formats_from_the_mesh_config() {
    use super::format::LogFormat;
    // Nothing about access logs in the mesh config: the waypoint's own line.
    assert!(mesh("{}").envoy().is_own_line());
    // accessLogFormat / accessLogEncoding / accessLogFile: Envoy's line.
    assert!(matches!(
        mesh("{accessLogEncoding: JSON, accessLogFile: /dev/null}")
            .envoy()
            .format(),
        Some(LogFormat::Json(_))
    ));
    assert!(matches!(
        mesh("{accessLogFormat: '%RESPONSE_CODE%'}")
            .envoy()
            .format(),
        Some(LogFormat::Text(_))
    ));
    // JSON labels that are not JSON: Istio's default labels, as istiod does.
    assert!(
        mesh("{accessLogEncoding: JSON, accessLogFormat: 'not json'}")
            .errors()
            .is_empty()
    );
    for (y, want) in [
        ("{accessLogFormat: '%NOPE%'}", "meshConfig.accessLogFormat: %NOPE% is not supported"),
        ("{accessLogEncoding: XML}", "meshConfig.accessLogEncoding: \"XML\""),
        (
            "{extensionProviders: [{name: f, envoyFileAccessLog: {path: /dev/null, logFormat: {text: '%REQ%'}}}]}",
            "meshConfig.extensionProviders[0].envoyFileAccessLog.logFormat.text: at byte 0",
        ),
        (
            "{extensionProviders: [{name: f, envoyFileAccessLog: {path: /dev/null, logFormat: {labels: {a: '%X%'}}}}]}",
            "meshConfig.extensionProviders[0].envoyFileAccessLog.logFormat.labels: a: %X% is not supported",
        ),
    ] {
        let e = mesh(y).errors().join("; ");
        assert!(e.contains(want), "{y}: {e}");
    }
    // Two providers in force, each with its filter; a file provider writes Envoy's line.
    let m = mesh("{extensionProviders: [{name: json, envoyFileAccessLog: {path: /dev/null, logFormat: {labels: {code: '%RESPONSE_CODE%'}}}}]}");
    assert!(matches!(
        m.access_log("json").and_then(|o| o.format()),
        Some(LogFormat::Json(_))
    ));
    let t = telemetries("- {name: mesh, namespace: istio-system, accessLogging: [{providers: [{name: envoy}], filter: {expression: 'response.code >= 500'}}, {providers: [{name: json}]}]}\n", &m).unwrap();
    assert_eq!(
        log_of(&applied(&t, None)),
        "on[\"envoy=response.code >= 500\", \"json=\"]"
    );
}
