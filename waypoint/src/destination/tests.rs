use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ztunnel::state::{Service, Workload};

use super::*;
use crate::lb::{Balancer, Choice, Circuits, LbPolicy, Limit, Outcome, OutlierConfig};

fn rules(yaml: &str) -> Result<Vec<(DestinationRule, Resolved)>, String> {
    let rs: Vec<DestinationRule> = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
    rs.into_iter()
        .map(|r| r.resolve().map(|p| (r, p)))
        .collect()
}

/// Ejection after `n` consecutive 5xx for `secs` seconds, local-origin failures counted
/// with them.
fn od(n: u32, secs: u64) -> OutlierConfig {
    OutlierConfig {
        consecutive_5xx: n,
        base_ejection: Duration::from_secs(secs),
        local_origin: None,
    }
}

/// The rule's policy for any port of the Service itself.
fn base(r: &Resolved) -> &Policy {
    r.policy(None, 1).expect("a policy")
}

fn service(ns: &str, host: &str) -> Service {
    serde_yaml::from_str(&format!("{{name: x, namespace: {ns}, hostname: {host}}}"))
        .expect("service")
}

#[test]
fn traffic_policies_parse_as_istio_writes_them() {
    let rs = rules(
        "- name: reviews\n  namespace: default\n  host: reviews\n  trafficPolicy:\n    loadBalancer: {consistentHash: {httpHeaderName: x-user}}\n\
         \x20   connectionPool: {tcp: {maxConnections: 10, connectTimeout: 1s}, http: {http2MaxRequests: 5, maxRetries: 1, http1MaxPendingRequests: 1}}\n\
         \x20   outlierDetection: {consecutive5xxErrors: 2, baseEjectionTime: 10s, interval: 1s, maxEjectionPercent: 50}\n\
         \x20   tls: {mode: ISTIO_MUTUAL}\n  subsets: [{name: v1, labels: {version: v1}}]\n",
    )
    .expect("valid");
    let p = base(&rs[0].1);
    assert_eq!(
        p.pick,
        Some(Pick::HashHeader(http::HeaderName::from_static("x-user")))
    );
    assert_eq!(
        (p.max_connections, p.max_requests, p.max_retries),
        (Some(10), Some(5), Some(1))
    );
    assert_eq!(p.outlier, Some(od(2, 10)));
    for (simple, want) in [
        ("ROUND_ROBIN", Pick::RoundRobin),
        ("LEAST_REQUEST", Pick::LeastRequest),
        ("RANDOM", Pick::Random),
    ] {
        let r = rules(&format!("- {{name: a, namespace: default, host: a, trafficPolicy: {{loadBalancer: {{simple: {simple}}}}}}}\n")).expect(simple);
        assert_eq!(base(&r[0].1).pick, Some(want));
    }
    // Istio's outlier defaults: 5 consecutive errors, 30 s.
    let r =
        rules("- {name: a, namespace: default, host: a, trafficPolicy: {outlierDetection: {}}}\n")
            .expect("defaults");
    assert_eq!(base(&r[0].1).outlier, Some(od(5, 30)));
}

/// connectionPool.http maxRequestsPerConnection and idleTimeout: how the upstream HTTP
/// connections are reused (0 is Istio's "no limit"; idleTimeout 0s turns it off).
#[test]
fn connection_reuse_limits_parse() {
    let reuse = |http: &str| {
        let rs = rules(&format!(
            "- {{name: r, namespace: default, host: reviews, trafficPolicy: {{connectionPool: {{http: {http}}}}}}}"
        ))
        .expect("valid");
        base(&rs[0].1).reuse
    };
    assert_eq!(
        reuse("{maxRequestsPerConnection: 3, idleTimeout: 2s}"),
        Reuse {
            max_requests: Some(3),
            idle: Some(Duration::from_secs(2)),
            ..Reuse::default()
        }
    );
    assert_eq!(
        reuse("{maxRequestsPerConnection: 0, idleTimeout: 0s}"),
        Reuse::default()
    );
    let e = rules("- {name: r, namespace: default, host: reviews, trafficPolicy: {connectionPool: {http: {idleTimeout: soon}}}}").expect_err("refused");
    assert!(e.contains("connectionPool.http.idleTimeout"), "{e}");
}

#[test]
fn what_cannot_be_applied_is_refused_with_the_field_named() {
    for (yaml, want) in [
        ("trafficPolicy: {loadBalancer: {simple: PASSTHROUGH}}", "trafficPolicy.loadBalancer.simple: PASSTHROUGH (send to the original destination) is not applied"),
        ("trafficPolicy: {loadBalancer: {simple: MAGIC}}", "trafficPolicy.loadBalancer.simple: \"MAGIC\" is not one of"),
        ("trafficPolicy: {loadBalancer: {consistentHash: {httpCookie: {name: 'a b', ttl: 10s}}}}", "trafficPolicy.loadBalancer.consistentHash.httpCookie.name: \"a b\" is not a cookie name"),
        ("trafficPolicy: {loadBalancer: {warmup: {duration: 10s}}}", "trafficPolicy.loadBalancer.warmup: the slow start"),
        ("trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN, warmupDurationSecs: 10s}}", "trafficPolicy.loadBalancer.warmupDurationSecs"),
        ("trafficPolicy: {loadBalancer: {zoneAwareLbSetting: {enabled: true}}}", "trafficPolicy.loadBalancer.zoneAwareLbSetting"),
        ("trafficPolicy: {proxyProtocol: {version: V2}}", "trafficPolicy.proxyProtocol: the waypoint does not send PROXY protocol"),
        ("subsets: [{name: v1, trafficPolicy: {proxyProtocol: {version: V1}}}]", "subsets[0].trafficPolicy.proxyProtocol"),
        ("trafficPolicy: {outlierDetection: {minHealthPercent: 50}}", "trafficPolicy.outlierDetection.minHealthPercent"),
        ("trafficPolicy: {retryBudget: {percent: 150}}", "trafficPolicy.retryBudget.percent: 150 is not between 0 and 100"),
        ("trafficPolicy: {connectionPool: {http: {maxConcurrentStreams: 4}}}", "trafficPolicy.connectionPool.http.maxConcurrentStreams"),
        ("trafficPolicy: {loadBalancer: {consistentHash: {httpHeaderName: x, ringHash: {}, maglev: {}}}}", "either ringHash or maglev"),
        ("trafficPolicy: {sidecarOnly: true}", "unknown field `sidecarOnly`"),
        ("trafficPolicy: {loadBalancer: {consistentHash: {}}}", "set exactly one of"),
        ("trafficPolicy: {loadBalancer: {localityLbSetting: {}}}", "trafficPolicy.loadBalancer.localityLbSetting: locality weights"),
        ("trafficPolicy: {tls: {mode: STRICT}}", "trafficPolicy.tls.mode: \"STRICT\" is not one of"),
        ("trafficPolicy: {tls: {mode: SIMPLE, credentialName: egress-secret}}", "trafficPolicy.tls.credentialName: the waypoint has no SDS"),
        ("trafficPolicy: {tls: {mode: MUTUAL, caCertificates: /etc/ca.pem}}", "trafficPolicy.tls.clientCertificate: required for MUTUAL"),
        ("trafficPolicy: {tls: {mode: SIMPLE, caCertificates: certs/ca.pem}}", "trafficPolicy.tls.caCertificates: \"certs/ca.pem\" is not an absolute file path"),
        ("trafficPolicy: {tls: {mode: SIMPLE, caCertificates: /nonexistent/ca.pem}}", "trafficPolicy.tls.caCertificates: cannot read /nonexistent/ca.pem"),
        ("trafficPolicy: {portLevelSettings: [{port: {number: 443}, tls: {mode: SIMPLE, sni: 'bad name'}}]}", "trafficPolicy.portLevelSettings[0].tls.sni"),
        ("trafficPolicy: {portLevelSettings: [{port: {number: 443}}, {port: {number: 443}}]}", "trafficPolicy.portLevelSettings[1].port.number: 443 is 0 or listed twice"),
        ("subsets: [{name: v1, trafficPolicy: {loadBalancer: {simple: PASSTHROUGH}}}]", "subsets[0].trafficPolicy.loadBalancer.simple"),
        ("subsets: [{name: v1}, {name: v1}]", "subsets[1].name: \"v1\" is empty or used twice"),
        ("trafficPolicy: {outlierDetection: {baseEjectionTime: soon}}", "trafficPolicy.outlierDetection.baseEjectionTime"),
    ] {
        let e = rules(&format!("- name: a\n  namespace: default\n  host: a\n  {yaml}\n")).expect_err(yaml);
        assert!(e.contains(want), "{yaml}\n  got: {e}\n  want: {want}");
    }
}

#[test]
fn the_best_matching_rule_applies() {
    let rs = rules(
        "- {name: wild, namespace: other, host: '*.svc.cluster.local', trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n\
         - {name: ns-wild, namespace: default, host: '*.default.svc.cluster.local', trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}}\n\
         - {name: short, namespace: default, host: reviews, trafficPolicy: {loadBalancer: {simple: LEAST_REQUEST}}}\n\
         - {name: fqdn-elsewhere, namespace: other, host: ratings.default.svc.cluster.local, trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n\
         - {name: fqdn-own, namespace: default, host: ratings.default.svc.cluster.local, trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}}\n",
    )
    .expect("valid");
    // The waypoint is in `other`: its own namespace's rules come first.
    let client = Client {
        namespace: "other",
        root_namespace: "istio-system",
    };
    let rule = |ns: &str, host: &str| {
        for_service(&rs, client, &service(ns, host), 80, None).map(|p| p.rule.clone())
    };
    assert_eq!(
        rule("default", "ratings.default.svc.cluster.local").as_deref(),
        Some("other/fqdn-elsewhere"),
        "the waypoint's namespace first"
    );
    assert_eq!(
        rule("shop", "cart.shop.svc.cluster.local").as_deref(),
        Some("other/wild")
    );
    // A short name means the rule's own namespace.
    assert_eq!(
        rule("shop", "reviews.shop.svc.cluster.local").as_deref(),
        Some("other/wild")
    );
    assert_eq!(rule("x", "api.example.com"), None);
    // Within the waypoint's namespace: exact beats wildcard, the longer wildcard wins.
    let client = Client {
        namespace: "default",
        root_namespace: "istio-system",
    };
    let rule = |ns: &str, host: &str| {
        for_service(&rs, client, &service(ns, host), 80, None).map(|p| p.rule.clone())
    };
    assert_eq!(
        rule("default", "reviews.default.svc.cluster.local").as_deref(),
        Some("default/short"),
        "exact beats wildcard"
    );
    assert_eq!(
        rule("default", "ratings.default.svc.cluster.local").as_deref(),
        Some("default/fqdn-own")
    );
    assert_eq!(
        rule("default", "details.default.svc.cluster.local").as_deref(),
        Some("default/ns-wild"),
        "the longer wildcard"
    );
    // `other` is neither the waypoint's, the Service's nor the root namespace.
    assert_eq!(
        rule("shop", "cart.shop.svc.cluster.local"),
        None,
        "a third namespace's rule never applies"
    );
}

/// Another tenant's rules never reach a waypoint's traffic: a `host: "*"` throttle and
/// an exact-host `insecureSkipVerify` from a namespace that sorts (and is listed)
/// first apply to neither the waypoint's nor a third namespace's Services; the
/// Service's own namespace's rule applies only when exported to the waypoint's.
#[test]
fn another_namespaces_rules_do_not_apply() {
    let rs = rules(
        "- {name: throttle, namespace: aaa-tenant, host: '*', trafficPolicy: {connectionPool: {http: {http2MaxRequests: 1}}}}\n\
         - {name: hijack, namespace: aaa-tenant, host: api.team.svc.cluster.local, trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n\
         - {name: private, namespace: team, host: api.team.svc.cluster.local, exportTo: ['.'], trafficPolicy: {loadBalancer: {simple: ROUND_ROBIN}}}\n\
         - {name: shared, namespace: team, host: web.team.svc.cluster.local, exportTo: [waypoints], trafficPolicy: {loadBalancer: {simple: LEAST_REQUEST}}}\n\
         - {name: elsewhere, namespace: team, host: db.team.svc.cluster.local, exportTo: [somewhere], trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n\
         - {name: mesh, namespace: istio-system, host: '*.svc.cluster.local', trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n",
    )
    .expect("valid");
    let client = Client {
        namespace: "waypoints",
        root_namespace: "istio-system",
    };
    let rule = |ns: &str, host: &str| {
        for_service(&rs, client, &service(ns, host), 80, None).map(|p| p.rule.clone())
    };
    // Exported to the waypoint's namespace by name.
    assert_eq!(
        rule("team", "web.team.svc.cluster.local").as_deref(),
        Some("team/shared")
    );
    // Private to `team`, or exported elsewhere: the root namespace's rule, never aaa-tenant's.
    assert_eq!(
        rule("team", "api.team.svc.cluster.local").as_deref(),
        Some("istio-system/mesh")
    );
    assert_eq!(
        rule("team", "db.team.svc.cluster.local").as_deref(),
        Some("istio-system/mesh")
    );
    assert_eq!(
        rule("other", "x.other.svc.cluster.local").as_deref(),
        Some("istio-system/mesh")
    );
    // Nothing for an external host: the tenant's `*` does not apply.
    assert_eq!(rule("ext", "api.example.com"), None);
    // A waypoint in aaa-tenant takes its own namespace's rules, as Istio's proxies do.
    let own = Client {
        namespace: "aaa-tenant",
        root_namespace: "istio-system",
    };
    assert_eq!(
        for_service(
            &rs,
            own,
            &service("team", "api.team.svc.cluster.local"),
            80,
            None
        )
        .map(|p| p.rule.as_str()),
        Some("aaa-tenant/hijack")
    );
    // A root-namespace rule exported only elsewhere does not apply.
    let rs = rules("- {name: mesh, namespace: istio-system, host: '*', exportTo: [team], trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n").expect("valid");
    assert!(for_service(
        &rs,
        client,
        &service("other", "x.other.svc.cluster.local"),
        80,
        None
    )
    .is_none());
}

fn endpoints(n: u8) -> Vec<(SocketAddr, Arc<Workload>)> {
    (1..=n)
        .map(|i| {
            let w: Workload = serde_yaml::from_str(&format!(
                "{{uid: w{i}, name: w{i}, namespace: default, workloadIps: [10.0.0.{i}]}}"
            ))
            .expect("workload");
            (format!("10.0.0.{i}:80").parse().expect("addr"), Arc::new(w))
        })
        .collect()
}

#[test]
fn a_consistent_hash_keeps_a_key_on_its_endpoint() {
    let b = Balancer::new(LbPolicy::RoundRobin, od(0, 1));
    let eps = endpoints(5);
    let hashed = |key: u64| Choice {
        pick: Some(Pick::HashSourceIp),
        hash: Some(key),
        ..Choice::default()
    };
    let first = b.pick_with(&eps, &[], &hashed(7)).expect("pick").addr;
    for _ in 0..20 {
        assert_eq!(
            b.pick_with(&eps, &[], &hashed(7)).expect("pick").addr,
            first
        );
    }
    // Keys spread over the endpoints.
    let mut seen = std::collections::HashSet::new();
    for k in 0..200 {
        seen.insert(b.pick_with(&eps, &[], &hashed(k)).expect("pick").addr);
    }
    assert!(seen.len() >= 4, "{seen:?}");
    // Another endpoint leaving moves only its own keys.
    let other = eps.iter().position(|(a, _)| *a != first).expect("another");
    let mut fewer = eps.clone();
    fewer.remove(other);
    assert_eq!(
        b.pick_with(&fewer, &[], &hashed(7)).expect("pick").addr,
        first
    );
}

#[test]
fn circuits_limit_what_is_in_flight() {
    let c = Circuits::default();
    let a = c
        .take("default/reviews", Limit::Requests, 2)
        .expect("first");
    let _b = c
        .take("default/reviews", Limit::Requests, 2)
        .expect("second");
    assert!(
        c.take("default/reviews", Limit::Requests, 2).is_none(),
        "the third overflows"
    );
    assert!(
        c.take("default/reviews", Limit::Retries, 2).is_some(),
        "limits are counted apart"
    );
    assert!(
        c.take("default/ratings", Limit::Requests, 2).is_some(),
        "and per Service"
    );
    drop(a);
    assert!(
        c.take("default/reviews", Limit::Requests, 2).is_some(),
        "a finished request frees its slot"
    );
    assert!(
        c.take("default/x", Limit::Retries, 0).is_none(),
        "maxRetries 0: no retry"
    );
}

#[test]
fn a_rules_outlier_detection_replaces_the_waypoints() {
    // The waypoint's own flags: never eject. The rule's: eject after one failure.
    let b = Balancer::new(LbPolicy::RoundRobin, od(0, 1));
    let eps = endpoints(2);
    let rule = Choice {
        outlier: Some(od(1, 60)),
        ..Choice::default()
    };
    let bad = b.pick_with(&eps, &[], &rule).expect("pick");
    let bad_addr = bad.addr;
    bad.report(Outcome::ServerError);
    drop(bad);
    for _ in 0..10 {
        assert_ne!(
            b.pick_with(&eps, &[], &rule).expect("pick").addr,
            bad_addr,
            "ejected by the rule's settings"
        );
    }
    // Without the rule the same failures never eject.
    let b = Balancer::new(LbPolicy::RoundRobin, od(0, 1));
    let p = b.pick(&eps, &[]).expect("pick");
    let addr = p.addr;
    p.report(Outcome::ServerError);
    drop(p);
    assert!((0..10).any(|_| b.pick(&eps, &[]).map(|p| p.addr) == Some(addr)));
}

/// Istio's merging: a port-level entry replaces the rule's policy whole for its port
/// (what it leaves out gets the defaults); a subset's policy overrides the rule's field
/// by field, and a subset's port-level entry replaces the merged policy whole.
#[test]
fn port_level_settings_and_subsets_merge_as_istio_merges_them() {
    let rs = rules(
        "- name: r\n  namespace: default\n  host: r\n  trafficPolicy:\n\
         \x20   loadBalancer: {simple: RANDOM}\n\
         \x20   connectionPool: {http: {http2MaxRequests: 7}}\n\
         \x20   portLevelSettings: [{port: {number: 9000}, loadBalancer: {simple: ROUND_ROBIN}}]\n\
         \x20 subsets:\n\
         \x20 - {name: v1, labels: {version: v1}, trafficPolicy: {loadBalancer: {simple: LEAST_REQUEST}}}\n\
         \x20 - {name: v2, labels: {version: v2}, trafficPolicy: {portLevelSettings: [{port: {number: 80}, outlierDetection: {}}]}}\n",
    )
    .expect("valid");
    let r = &rs[0].1;
    let at = |subset: Option<&str>, port: u16| r.policy(subset, port).expect("policy");
    assert_eq!(
        (at(None, 80).pick.clone(), at(None, 80).max_requests),
        (Some(Pick::Random), Some(7))
    );
    // Port 9000: its own entry, whole; the rule's connection pool is not inherited.
    assert_eq!(
        (at(None, 9000).pick.clone(), at(None, 9000).max_requests),
        (Some(Pick::RoundRobin), None)
    );
    // v1 overrides the load balancer only.
    assert_eq!(
        (
            at(Some("v1"), 80).pick.clone(),
            at(Some("v1"), 80).max_requests
        ),
        (Some(Pick::LeastRequest), Some(7))
    );
    // ... and on 9000 the rule's port entry is what it merges over.
    assert_eq!(
        (
            at(Some("v1"), 9000).pick.clone(),
            at(Some("v1"), 9000).max_requests
        ),
        (Some(Pick::LeastRequest), None)
    );
    // v2's port 80 entry replaces everything there; other ports keep the rule's policy.
    let v2 = at(Some("v2"), 80);
    assert_eq!(
        (v2.pick.clone(), v2.max_requests, v2.outlier),
        (None, None, Some(od(5, 30)))
    );
    assert_eq!(at(Some("v2"), 81).pick, Some(Pick::Random));
    assert!(
        r.policy(Some("v3"), 80).is_none(),
        "a subset the rule does not define"
    );
    assert_eq!(
        r.subset("v2")
            .and_then(|l| l.get("version"))
            .map(String::as_str),
        Some("v2")
    );
    // ISTIO_MUTUAL and DISABLE ask for nothing (HBONE is the mesh's mTLS).
    let rs = rules("- {name: a, namespace: default, host: a, trafficPolicy: {tls: {mode: ISTIO_MUTUAL, sni: x.example.com}}}\n").expect("valid");
    assert!(base(&rs[0].1).tls.is_none());
}

/// tcp.maxConnections with http1MaxPendingRequests: requests beyond the connections wait,
/// at most that many; one more overflows; a finished request lets the first waiter on.
#[tokio::test]
async fn requests_wait_for_a_connection_in_a_bounded_queue() {
    let c = Arc::new(Circuits::default());
    let first = c
        .connection("default/r", 1, Some(1))
        .await
        .expect("a connection");
    let c2 = c.clone();
    let waiter =
        tokio::spawn(async move { c2.connection("default/r", 1, Some(1)).await.map(|_| ()) });
    // Let the waiter queue up, then the queue is full.
    let mut full = false;
    for _ in 0..100 {
        tokio::task::yield_now().await;
        if c.connection("default/r", 1, Some(1)).await.is_err() {
            full = true;
            break;
        }
    }
    assert!(full, "a second waiter overflowed");
    assert!(
        !waiter.is_finished(),
        "the waiter waits while the connection is in use"
    );
    drop(first);
    assert_eq!(waiter.await.expect("task"), Ok(()));
    // No queue allowed: overflow at once; another Service is counted apart.
    let _busy = c
        .connection("default/r", 1, Some(0))
        .await
        .expect("free again");
    assert!(c.connection("default/r", 1, Some(0)).await.is_err());
    assert!(c.connection("default/other", 1, Some(0)).await.is_ok());
}

/// Fields Istio's waypoint does not read, or reads to the same effect as ours, are
/// accepted: the rule applies.
#[test]
fn what_istios_waypoint_ignores_is_accepted() {
    for yaml in [
        "trafficPolicy: {tunnel: {protocol: CONNECT, targetHost: egress.example, targetPort: 8443}}",
        "trafficPolicy: {loadBalancer: {consistentHash: {httpHeaderName: x, ringHash: {minimumRingSize: 1024}}}}",
        "trafficPolicy: {loadBalancer: {consistentHash: {useSourceIp: true, maglev: {tableSize: 65537}}}}",
        "trafficPolicy: {loadBalancer: {localityLbSetting: {enabled: false}}}",
        // Istio's slow start is for ROUND_ROBIN and LEAST_REQUEST only.
        "trafficPolicy: {loadBalancer: {simple: RANDOM, warmup: {duration: 10s}}}",
        "trafficPolicy: {outlierDetection: {consecutiveErrors: 3, minHealthPercent: 0}}",
        "trafficPolicy: {connectionPool: {http: {maxConcurrentStreams: 0}}}",
    ] {
        let rs = rules(&format!("- name: a\n  namespace: default\n  host: a\n  {yaml}\n"));
        assert!(rs.is_ok(), "{yaml}: {rs:?}");
    }
}

/// `consistentHash.httpCookie.ttl`: the cookie Envoy gives a request without one, in
/// Envoy's `Set-Cookie` form; its value names the client, so it hashes alike.
#[test]
fn a_cookie_with_a_ttl_is_generated_as_envoy_writes_it() {
    let rs = rules(
        "- {name: a, namespace: default, host: a, trafficPolicy: {loadBalancer: {consistentHash: {httpCookie: \
         {name: route, path: /shop, ttl: 90s, attributes: [{name: SameSite, value: Strict}, {name: Secure}]}}}}}\n",
    )
    .expect("valid");
    let p = base(&rs[0].1);
    assert_eq!(p.pick, Some(Pick::HashCookie("route".into())));
    let c = p.cookie.as_ref().expect("a generated cookie");
    let client: SocketAddr = "10.0.0.7:40000".parse().unwrap();
    let v = c.value_for(client);
    assert_eq!(v, c.value_for(client), "stable for a client");
    assert_ne!(v, c.value_for("10.0.0.8:40000".parse().unwrap()));
    assert_eq!(
        c.set_cookie(&v),
        format!("route=\"{v}\"; Max-Age=90; Path=/shop; SameSite=Strict; Secure; HttpOnly")
    );
    // Without a TTL the client's own cookie is hashed and none is given.
    let rs = rules(
        "- {name: a, namespace: default, host: a, trafficPolicy: {loadBalancer: {consistentHash: {httpCookie: {name: route}}}}}\n",
    )
    .expect("valid");
    assert!(base(&rs[0].1).cookie.is_none());
}

/// `retryBudget`: Istio's defaults (20 %, at least 3), a share of the requests in flight.
#[test]
fn a_retry_budget_is_a_share_of_the_requests_in_flight() {
    let share = |yaml: &str| {
        let rs = rules(&format!(
            "- {{name: a, namespace: default, host: a, trafficPolicy: {{retryBudget: {yaml}}}}}\n"
        ))
        .expect("valid");
        base(&rs[0].1).retry_budget.expect("a budget")
    };
    let d = share("{}");
    assert_eq!((d.allowed(0), d.allowed(10), d.allowed(100)), (3, 3, 20));
    let s = share("{percent: 50, minRetryConcurrency: 1}");
    assert_eq!((s.allowed(0), s.allowed(9)), (1, 4));
    // A port's entry keeps the rule's budget (Istio's MergeTrafficPolicy).
    let rs = rules(
        "- {name: a, namespace: default, host: a, trafficPolicy: {retryBudget: {percent: 10}, \
         portLevelSettings: [{port: {number: 80}, loadBalancer: {simple: RANDOM}}]}}\n",
    )
    .expect("valid");
    assert!(rs[0].1.policy(None, 80).unwrap().retry_budget.is_some());
}

/// `splitExternalLocalOriginErrors`: connect failures eject after
/// `consecutiveLocalOriginFailures` and do not count as 5xx; 5xx answers keep their own count.
#[test]
fn local_origin_failures_count_apart_when_split() {
    let rs = rules(
        "- {name: a, namespace: default, host: a, trafficPolicy: {outlierDetection: \
         {consecutive5xxErrors: 3, splitExternalLocalOriginErrors: true, consecutiveLocalOriginFailures: 2, baseEjectionTime: 60s}}}\n",
    )
    .expect("valid");
    let outlier = base(&rs[0].1).outlier.expect("outlier");
    assert_eq!(outlier.local_origin, Some(2));
    let b = Balancer::new(LbPolicy::RoundRobin, od(0, 1));
    let eps = endpoints(1);
    let rule = Choice {
        outlier: Some(outlier),
        ..Choice::default()
    };
    let report = |o: Outcome| b.pick_with(&eps, &[], &rule).expect("pick").report(o);
    // Two 5xx and a local failure: neither count reaches its limit.
    report(Outcome::ServerError);
    report(Outcome::ServerError);
    report(Outcome::LocalFailure);
    let stats = |b: &Arc<Balancer>| b.ejected(eps[0].0);
    assert!(!stats(&b), "2 of 3 5xx, 1 of 2 local failures");
    // The local failure did not break the 5xx run; the 5xx answer (a connection that
    // worked) starts the local count again.
    report(Outcome::ServerError);
    assert!(stats(&b), "the third 5xx in a row ejects");
    let b = Balancer::new(LbPolicy::RoundRobin, od(0, 1));
    let report = |o: Outcome| b.pick_with(&eps, &[], &rule).expect("pick").report(o);
    report(Outcome::LocalFailure);
    report(Outcome::ServerError);
    report(Outcome::LocalFailure);
    assert!(
        !stats(&b),
        "an answer between them starts the local count again"
    );
    report(Outcome::LocalFailure);
    assert!(stats(&b), "two local failures in a row eject");
}

/// Two rules for one host in one namespace: when one cannot be applied, its host fails,
/// whichever name sorts first (Istio merges them; the outcome does not hang on names).
#[test]
fn an_unappliable_rule_beside_a_valid_one_fails_the_host() {
    let mut rs = rules(
        "- {name: a-valid, namespace: default, host: reviews, trafficPolicy: {loadBalancer: {simple: RANDOM}}}\n",
    )
    .expect("valid");
    let broken: DestinationRule =
        serde_yaml::from_str("{name: b-broken, namespace: default, host: reviews}").unwrap();
    let stand_in = Resolved::refusing(broken.key(), "warmup: not applied".into());
    rs.push((broken, stand_in));
    let client = Client {
        namespace: "default",
        root_namespace: "istio-system",
    };
    let p = for_service(&rs, client, &service("default", "reviews"), 80, None).expect("a rule");
    assert_eq!(
        (p.rule.as_str(), p.refused.as_deref()),
        ("default/b-broken", Some("warmup: not applied"))
    );
}
