//! Issue 41 item 6: the waypoint's telemetry as Istio configures it: access-log filters in
//! CEL (the `cel` crate), Envoy's text and JSON access-log formats (meshConfig
//! `accessLogFormat` / `accessLogEncoding`, `envoyFileAccessLog` providers writing to
//! files), several providers each with its filter, and Telemetry `customTags` on the
//! exported spans (literal, environment, header, formatter). Hostile expressions and formats are refused at load, named.

use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::netsim::*;
use mesh_tests::test_servers;

use super::L7Mesh;

/// The lines of `path` (empty until it exists).
fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The waypoint's JSON access-log lines (its own log lines are text).
fn json_lines(log: &str) -> Vec<serde_json::Value> {
    log.lines()
        .filter(|l| l.starts_with('{'))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_formats_providers_cel_filters_and_custom_tags() -> Result<()> {
    let m = L7Mesh::start("l7tel", "", &[("WAYPOINT_TEAM_TAG", "from-env")]).await?;
    let dir = m.mesh.topo.dir.clone();
    let (text_log, istio_log) = (dir.join("access-text.log"), dir.join("access-istio.log"));
    let l7 = format!(
        r#"meshConfig:
  accessLogEncoding: JSON
  accessLogFormat: '{{"code": "%RESPONSE_CODE%", "path": "%REQ(:PATH)%", "ua": "%REQ(USER-AGENT)%", "peer": "%DOWNSTREAM_PEER_URI_SAN%", "upstream": "%UPSTREAM_HOST%", "cluster": "%UPSTREAM_CLUSTER%", "start": "%START_TIME%", "protocol": "%PROTOCOL%", "sent": "%BYTES_SENT%", "missing": "%REQ(X-NONE)%"}}'
  defaultProviders: {{tracing: [otel]}}
  defaultConfig: {{tracing: {{sampling: 100}}}}
  extensionProviders:
  - name: otel
    opentelemetry: {{service: authz.default.svc.cluster.local, port: 9100}}
  - name: file-text
    envoyFileAccessLog:
      path: {text}
      logFormat: {{text: '%REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% "%REQ(X-TEAM?USER-AGENT)%" %UPSTREAM_CLUSTER_RAW% %START_TIME(%Y)% %CEL(request.headers["x-team"] == "eng-core")%'}}
  - name: file-istio
    envoyFileAccessLog: {{path: {istio}}}
  - name: otel-als
    envoyOtelAls:
      service: authz.default.svc.cluster.local
      port: 8001
      logName: waypoint-als
      logFormat:
        text: "%REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE%"
        labels: {{code: "%RESPONSE_CODE%", ua: "%REQ(USER-AGENT)%"}}
telemetries:
- name: mesh-default
  namespace: istio-system
  accessLogging:
  - providers: [{{name: envoy}}]
    filter: {{expression: "response.code >= 400 || (size(request.url_path) > 10 && request.url_path.matches('^/long/[a-z]+$'))"}}
  - providers: [{{name: file-text}}]
    filter: {{expression: "'x-team' in request.headers && request.headers['x-team'].startsWith('eng')"}}
  - providers: [{{name: file-istio}}]
  - providers: [{{name: otel-als}}]
    filter: {{expression: "request.url_path.startsWith('/long')"}}
  tracing:
  - customTags:
      team: {{header: {{name: x-team, defaultValue: none}}}}
      cluster: {{literal: {{value: east}}}}
      from_env: {{environment: {{name: WAYPOINT_TEAM_TAG}}}}
      request: {{formatter: {{value: "%REQ(:METHOD)% %RESPONSE_CODE% %UPSTREAM_CLUSTER%"}}}}
"#,
        text = text_log.display(),
        istio = istio_log.display(),
    );
    let spans = test_servers::Spans::default();
    let attrs = test_servers::SpanAttributes::default();
    let _collector = test_servers::start_otlp_collector_with_attributes(
        m.mesh.topo.pod("n2p1"),
        9100,
        spans.clone(),
        attrs.clone(),
    )?;
    let records = test_servers::LogRecords::default();
    let _logs =
        test_servers::start_otlp_logs_collector(m.mesh.topo.pod("n2p1"), 8001, records.clone())?;
    std::fs::write(&m.cfg_path, format!("{}{l7}", m.base))?;
    wait_for("reload", Duration::from_secs(10), || {
        m.log().matches("config reloaded").count() >= 1
    })?;

    let mut c = m.h1().await?;
    assert_eq!(c.get("/status/404").await?.status, 404);
    assert_eq!(
        c.request("GET", "/quiet", &[("x-team", "eng-core")])
            .await?
            .status,
        200
    );
    assert_eq!(c.get("/long/abcdef").await?.status, 200);
    assert_eq!(c.get("/long/abc1").await?.status, 200);
    assert_eq!(
        c.request(
            "GET",
            "/other-team",
            &[("x-team", "ops"), ("user-agent", "als-test")]
        )
        .await?
        .status,
        200
    );

    // The envoy provider: Envoy's JSON line, for the requests its CEL filter takes.
    wait_for("JSON lines", Duration::from_secs(5), || {
        json_lines(&m.log()).len() >= 2
    })?;
    let json = json_lines(&m.log());
    let paths: Vec<&str> = json.iter().filter_map(|j| j["path"].as_str()).collect();
    assert_eq!(paths, ["/status/404", "/long/abcdef"], "{}", m.log());
    let j = &json[0];
    assert_eq!(j["code"], 404, "a lone operator keeps its type: {j}");
    assert_eq!(j["missing"], serde_json::Value::Null, "{j}");
    assert_eq!(j["protocol"], "HTTP/1.1");
    assert_eq!(j["peer"], "spiffe://cluster.local/ns/default/sa/client");
    assert_eq!(
        j["cluster"],
        "inbound-vip|80|http|echo.default.svc.cluster.local"
    );
    assert!(
        j["upstream"].as_str().is_some_and(|u| u.ends_with(":8080")),
        "{j}"
    );
    let start = j["start"].as_str().context("start")?;
    assert!(
        start.len() == 24 && start.ends_with('Z') && start.as_bytes()[10] == b'T',
        "{start}"
    );
    // No `request complete` line: the mesh config chose Envoy's format.
    assert!(!m.log().contains("request complete"), "{}", m.log());

    // file-text: its own format and filter.
    wait_for("text file", Duration::from_secs(5), || {
        !lines(&text_log).is_empty()
    })?;
    let year = &start[..4];
    assert_eq!(
        lines(&text_log),
        [format!(
            "GET /quiet 200 \"eng-core\" inbound-vip|80|http|echo.default.svc.cluster.local {year} true"
        )]
    );
    // file-istio: no filter, Istio's default text format, every request.
    wait_for("istio file", Duration::from_secs(5), || {
        lines(&istio_log).len() >= 5
    })?;
    let istio = lines(&istio_log);
    let first = &istio[0];
    assert!(
        first.starts_with(&format!(
            "[{start}] \"GET /status/404 HTTP/1.1\" 404 - via_upstream - \"-\" 0 "
        )),
        "{first}"
    );
    assert!(
        first.contains(" \"echo.default.svc.cluster.local\" ")
            && first
                .contains(" inbound-vip|80|http|echo.default.svc.cluster.local - 10.96.0.10:80 "),
        "{first}"
    );

    // envoyOtelAls: OTLP log records for the requests its filter takes, body and labels.
    wait_for("OTLP log records", Duration::from_secs(10), || {
        records.lock().unwrap().len() >= 2
    })?;
    let records = records.lock().unwrap().clone();
    let bodies: Vec<(&str, &str)> = records
        .iter()
        .map(|(n, b, _)| (n.as_str(), b.as_str()))
        .collect();
    assert_eq!(
        bodies,
        [
            ("waypoint-als", "GET /long/abcdef 200"),
            ("waypoint-als", "GET /long/abc1 200")
        ],
        "{records:?}"
    );
    assert!(
        records[0]
            .2
            .contains(&("code".to_string(), "200".to_string())),
        "{records:?}"
    );

    // Custom tags on the spans: header (with its default), literal, environment.
    wait_for("spans", Duration::from_secs(10), || {
        attrs.lock().unwrap().len() >= 5
    })?;
    let attrs = attrs.lock().unwrap().clone();
    let tag = |span: &(String, Vec<(String, String)>), k: &str| {
        span.1.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    };
    let quiet = attrs
        .iter()
        .find(|s| tag(s, "http.url").is_some_and(|u| u.ends_with("/quiet")))
        .with_context(|| format!("{attrs:?}"))?;
    assert_eq!(tag(quiet, "team").as_deref(), Some("eng-core"));
    assert_eq!(tag(quiet, "cluster").as_deref(), Some("east"));
    assert_eq!(tag(quiet, "from_env").as_deref(), Some("from-env"));
    assert_eq!(
        tag(quiet, "request").as_deref(),
        Some("GET 200 inbound-vip|80|http|echo.default.svc.cluster.local")
    );
    let other = attrs
        .iter()
        .find(|s| tag(s, "http.url").is_some_and(|u| u.ends_with("/status/404")))
        .with_context(|| format!("{attrs:?}"))?;
    assert_eq!(tag(other, "team").as_deref(), Some("none"));
    Ok(())
}

/// Expressions and formats built to blow up are refused when the config loads, the
/// field named, and the waypoint keeps its config and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_filters_and_formats_are_refused_at_load() -> Result<()> {
    let m = L7Mesh::start("l7telh", "", &[]).await?;
    let deep = format!("{}true{}", "(".repeat(1000), ")".repeat(1000));
    // `+` is not balanced as `||` and `&&` chains are: the tree is as deep as the chain.
    let chain = format!("response.code{} > 0", " + 1".repeat(400));
    let bomb = "request.url_path.matches('(a{1000}){1000}')".to_string();
    let huge = format!("response.code == {}", "1".repeat(100_000));
    let cases = [
        (
            format!("telemetries:\n- {{name: t, namespace: istio-system, accessLogging: [{{filter: {{expression: \"{deep}\"}}}}]}}\n"),
            "telemetries[0].accessLogging[0].filter.expression: nested deeper than 32",
        ),
        (
            format!("telemetries:\n- {{name: t, namespace: istio-system, accessLogging: [{{filter: {{expression: \"{chain}\"}}}}]}}\n"),
            "telemetries[0].accessLogging[0].filter.expression: nested deeper than 32",
        ),
        (
            format!("telemetries:\n- {{name: t, namespace: istio-system, accessLogging: [{{filter: {{expression: \"{bomb}\"}}}}]}}\n"),
            "telemetries[0].accessLogging[0].filter.expression: matches:",
        ),
        (
            format!("telemetries:\n- {{name: t, namespace: istio-system, accessLogging: [{{filter: {{expression: \"{huge}\"}}}}]}}\n"),
            "telemetries[0].accessLogging[0].filter.expression: longer than 4096 bytes",
        ),
        (
            format!("meshConfig:\n  accessLogFormat: '{}'\n", "%PROTOCOL%".repeat(5000)),
            "meshConfig.accessLogFormat: longer than 16384 bytes",
        ),
        (
            "meshConfig:\n  accessLogFormat: '%REQ(:PATH)% %CEL(xds.node)%'\n".to_string(),
            "meshConfig.accessLogFormat: at byte 13: CEL: the attribute xds.node is not supported",
        ),
    ];
    for (i, (l7, want)) in cases.iter().enumerate() {
        std::fs::write(&m.cfg_path, format!("{}{l7}", m.base))?;
        wait_for(want, Duration::from_secs(10), || {
            m.log().matches("config change rejected").count() > i
        })?;
        let log = m.log();
        let rejected = log
            .lines()
            .filter(|l| l.contains("config change rejected"))
            .nth(i)
            .context("line")?;
        assert!(rejected.contains(want), "want {want}\n{rejected}");
    }
    // Alive, on its first config: every request logged as before.
    let mut c = m.h1().await?;
    assert_eq!(c.get("/still-serving").await?.status, 200);
    wait_for("logged", Duration::from_secs(5), || {
        m.log().contains("path=/still-serving")
    })?;
    Ok(())
}

/// The sum of a metric's series in a Prometheus scrape (0 without any).
fn metric_sum(scrape: &str, name: &str) -> f64 {
    scrape
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Telemetry `reportingInterval`: the bytes of an opaque TCP connection through the
/// waypoint are counted while it is open (Envoy's periodic TCP reporting; Istio's
/// default 5 s, here 200 ms), not only when it closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_tcp_connections_are_counted_every_reporting_interval() -> Result<()> {
    let m = L7Mesh::start(
        "l7ri",
        "telemetries:\n- {name: t, namespace: istio-system, metrics: [{reportingInterval: 200ms}]}\n",
        &[],
    )
    .await?;
    let mut s = m
        .client()
        .connect(format!("{}:9000", super::ECHO_VIP).parse()?)
        .await?;
    let payload = b"counted while open";
    // The echo server's greeting (its pod's name), then the echo; the connection stays
    // open (no shutdown).
    let pod = read_line(&mut s).await?;
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(payload).await?;
        let mut back = vec![0u8; payload.len()];
        s.read_exact(&mut back).await?;
        assert_eq!(back, payload, "echoed by {pod}");
    }
    // Wait for the report (an event in the scrape) while the connection stays open; within
    // 3 s of its start, before Istio's default 5 s interval could have reported it.
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    let scrape = loop {
        let scrape = m.metrics().await?;
        if metric_sum(&scrape, "istio_tcp_received_bytes_total") >= payload.len() as f64 {
            break scrape;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "no bytes counted while the connection is open:\n{scrape}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        metric_sum(&scrape, "istio_tcp_connections_closed_total"),
        0.0,
        "still open"
    );
    assert!(metric_sum(&scrape, "istio_tcp_sent_bytes_total") >= payload.len() as f64);
    // Closed: counted once, the bytes not counted twice.
    drop(s);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let scrape = m.metrics().await?;
        if metric_sum(&scrape, "istio_tcp_connections_closed_total") >= 1.0 {
            assert_eq!(
                metric_sum(&scrape, "istio_tcp_received_bytes_total"),
                payload.len() as f64,
                "{scrape}"
            );
            break;
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "never closed:\n{scrape}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
