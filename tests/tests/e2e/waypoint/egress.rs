//! Egress through the waypoint (issue 41 item 1), as Istio's waypoint does it: a pod
//! reaches hosts outside the mesh by name through ServiceEntries that use the waypoint,
//! in plain HTTP, and the waypoint originates TLS to them (DestinationRule SIMPLE); an
//! AuthorizationPolicy targeting the ServiceEntry allows one path and denies another; an
//! HTTPRoute attached to the ServiceEntry sends to a `Hostname` backend; a DYNAMIC_DNS
//! wildcard entry (`*.wild.test`) sends each request to its own Host, resolved by the
//! waypoint (503 when it does not resolve), and refuses Hosts its wildcard does not
//! cover without looking them up; with ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS, TLS
//! to its TLS port goes to the host the SNI names (covered names only), not terminated.

use std::time::Duration;

use anyhow::{Context, Result};
use mesh_tests::netsim::*;

use super::{start_nginx_in, CurlReply, L7Mesh, TestPki};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l7_egress_through_service_entries_and_dynamic_dns() -> Result<()> {
    for tool in ["nginx", "curl"] {
        anyhow::ensure!(
            sh("sh", &["-c", &format!("command -v {tool}")]).is_ok(),
            "{tool} is needed (scripts/deps.sh installs it)"
        );
    }
    let pki = TestPki::new("egress-se", &["api.external.test", "*.wild.test"])?;
    let ca = pki.path("ca.pem");
    let wp_ip = "10.10.1.12";
    // api.external.test: a DNS ServiceEntry, port 80 (http) to targetPort 443, its
    // endpoint known by hostname. *.wild.test: DYNAMIC_DNS (a VIP istiod allocated, no
    // endpoint). Both use the waypoint.
    let workloads = "- {uid: Kubernetes/networking.istio.io/ServiceEntry/default/api/api.external.test, name: api, namespace: default, \
                     hostname: api.external.test, protocol: TCP, services: {default/api.external.test: {80: 443}}}\n";
    let services = format!(
        "- {{name: api, namespace: default, hostname: api.external.test, vips: [\"/10.96.0.70\"], ports: {{80: 443}}, appProtocols: {{80: HTTP11}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n\
         - {{name: wild, namespace: default, hostname: \"*.wild.test\", vips: [\"/10.96.0.71\"], ports: {{80: 80, 443: 443}}, appProtocols: {{80: HTTP11, 443: TLS}}, waypoint: {{destination: \"/{wp_ip}\"}}}}\n"
    );
    let se = "{group: networking.istio.io, kind: ServiceEntry, name: api}";
    // wild-no-admin names port 80: a DENY rule with only HTTP attributes would deny every
    // TCP connection to the entry, its TLS port's too (Istio's TCP form of the policy).
    let l7 = format!(
        "destinationRules:\n\
         - {{name: api, namespace: default, host: api.external.test, trafficPolicy: {{tls: {{mode: SIMPLE, caCertificates: {ca}}}}}}}\n\
         - {{name: wild, namespace: default, host: \"*.wild.test\", trafficPolicy: {{portLevelSettings: [{{port: {{number: 80}}, tls: {{mode: SIMPLE, caCertificates: {ca}}}}}]}}}}\n\
         authorizationPolicies:\n\
         - {{name: api-paths, namespace: default, targetRefs: [{se}], action: ALLOW, rules: [{{to: [{{operation: {{paths: [\"/allowed*\", \"/to-wild*\"]}}}}]}}]}}\n\
         - {{name: tenant-allow-all, namespace: tenant, targetRefs: [{se}], action: ALLOW, rules: [{{}}]}}\n\
         - {{name: ghost-allow-all, namespace: default, targetRefs: [{{group: networking.istio.io, kind: ServiceEntry, name: ghost}}], action: ALLOW, rules: [{{}}]}}\n\
         - {{name: wild-no-admin, namespace: default, targetRefs: [{{group: networking.istio.io, kind: ServiceEntry, name: wild}}], action: DENY, rules: [{{to: [{{operation: {{ports: [\"80\"], paths: [/admin]}}}}]}}]}}\n\
         httpRoutes:\n\
         - {{name: api, namespace: default, parentRefs: [{se}], rules: [\
             {{matches: [{{path: {{type: PathPrefix, value: /to-wild}}}}], filters: [{{type: URLRewrite, urlRewrite: {{hostname: b.wild.test}}}}], \
               backendRefs: [{{group: networking.istio.io, kind: Hostname, name: \"*.wild.test\", port: 80}}]}}, \
             {{filters: [{{type: RequestHeaderModifier, requestHeaderModifier: {{set: [{{name: x-egress, value: route}}]}}}}]}}]}}\n"
    );
    let m = L7Mesh::start_with(
        "l7se",
        &l7,
        &[
            ("WAYPOINT_DNS_UPSTREAM", "10.0.0.2"),
            ("ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS", "true"),
        ],
        workloads,
        &services,
    )
    .await?;
    // Node 2's netns is outside the mesh: the external hosts' DNS server and their
    // nginx (TLS only, on 443).
    let node2 = m.mesh.topo.node(2);
    let ext: std::net::Ipv4Addr = "10.0.0.2".parse()?;
    let dns = DnsResponder::start(
        node2,
        &[
            ("api.external.test", &[ext]),
            ("a.wild.test", &[ext]),
            ("b.wild.test", &[ext]),
        ],
    )?;
    let (cert, key) = (pki.path("server.pem"), pki.path("server-key.pem"));
    let servers = format!(
        "ssl_certificate {cert}; ssl_certificate_key {key};
  server {{ listen 443 ssl; location / {{ return 200 \"host=$host sni=$ssl_server_name path=$uri x-egress=$http_x_egress\\n\"; }} }}"
    );
    let _nginx = start_nginx_in(
        node2,
        &m.mesh.topo.dir.join("nginx-egress"),
        &servers,
        &[443],
    )?;
    // The client pod resolves names through ztunnel's DNS proxy (the ServiceEntries'
    // VIPs; `a.wild.test` by the wildcard's).
    let _resolv = PodResolvConf::write(m.client(), "nameserver 10.0.0.2\n")?;

    let curl = |url: &str, extra: &[&str]| -> Result<CurlReply> {
        let mut args = vec!["-sS", "-i", "--max-time", "10"];
        args.extend_from_slice(extra);
        args.push(url);
        let out = m.client().exec("curl", &args).with_context(|| m.log())?;
        CurlReply::parse(&out)
    };

    // Plain HTTP from the pod to api.external.test:80; TLS from the waypoint to :443,
    // SNI the host; the route on the ServiceEntry set its header.
    let r = curl("http://api.external.test/allowed", &[])?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert_eq!(
        r.body.trim(),
        "host=api.external.test sni=api.external.test path=/allowed x-egress=route",
        "{}",
        m.log()
    );
    // The ALLOW policy on the ServiceEntry names other paths: RBAC's 403, whatever the
    // tenant's or the ghost ServiceEntry's allow-all policies say.
    let r = curl("http://api.external.test/denied", &[])?;
    assert_eq!(
        (r.status, r.body.trim()),
        (403, "RBAC: access denied"),
        "{}",
        m.log()
    );
    // No ALLOW matched (no policy named: Envoy's `rbac_access_denied_matched_policy[none]`).
    wait_for("the denial logged", Duration::from_secs(5), || {
        m.log().contains("dst.service=\"api.external.test\" protocol=\"http\" method=GET host=api.external.test path=/denied status=403 response_flags=\"DENY\"")
    })?;
    // The route's Hostname backend: the DYNAMIC_DNS entry, Host rewritten to b.wild.test.
    let r = curl("http://api.external.test/to-wild/x", &[])?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert_eq!(
        r.body.trim(),
        "host=b.wild.test sni=b.wild.test path=/to-wild/x x-egress=",
        "{}",
        m.log()
    );

    // DYNAMIC_DNS: the pod asks for a.wild.test (the wildcard's VIP), the waypoint
    // resolves the Host itself and originates TLS to it on 443.
    let r = curl("http://a.wild.test/hello", &[])?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert_eq!(
        r.body.trim(),
        "host=a.wild.test sni=a.wild.test path=/hello x-egress=",
        "{}",
        m.log()
    );
    let r = curl("http://a.wild.test/admin", &[])?;
    assert_eq!((r.status, r.body.trim()), (403, "RBAC: access denied"));
    // Hosts the wildcard does not cover, sent to the wildcard's VIP: 404, never looked
    // up, never sent.
    for host in [
        "evil.other.test",
        "a.wild.test.",
        "a.wild.test:443",
        "10.0.0.2",
        "wild.test",
    ] {
        let r = curl("http://10.96.0.71/hello", &["-H", &format!("host: {host}")])?;
        assert_eq!(r.status, 404, "{host}: {}\n{}", r.body, m.log());
        assert!(r.body.contains("*.wild.test"), "{host}: {}", r.body);
    }
    // Upper case is the same name.
    let r = curl("http://10.96.0.71/up", &["-H", "host: A.WILD.TEST"])?;
    assert_eq!(r.status, 200, "{}\n{}", r.body, m.log());
    assert!(
        r.body.to_ascii_lowercase().contains("sni=a.wild.test"),
        "{}",
        r.body
    );
    // A covered name that does not resolve: 503 saying why, as a hostname endpoint.
    let r = curl("http://10.96.0.71/", &["-H", "host: gone.wild.test"])?;
    assert_eq!(r.status, 503, "{}\n{}", r.body, m.log());
    assert!(
        r.body.contains("no address for gone.wild.test"),
        "{}",
        r.body
    );
    // TLS to the wildcard's TLS port (the opt-in ENABLE_WILDCARD_HOST_SERVICE_ENTRIES_FOR_TLS):
    // the waypoint reads the SNI, resolves it and relays the client's own TLS (not
    // terminated: curl checks nginx's certificate and nginx sees the client's SNI).
    let ca_arg = ca.clone();
    let r = curl("https://a.wild.test/tls", &["--cacert", &ca_arg])?;
    assert_eq!(
        r.status,
        200,
        "{}
{}",
        r.body,
        m.log()
    );
    assert_eq!(
        r.body.trim(),
        "host=a.wild.test sni=a.wild.test path=/tls x-egress=",
        "{}",
        m.log()
    );
    // An SNI the wildcard does not cover is not relayed, nor looked up.
    let resolve = "evil.other.test:443:10.96.0.71";
    let out = m.client().exec(
        "curl",
        &[
            "-sS",
            "--max-time",
            "10",
            "--cacert",
            &ca_arg,
            "--resolve",
            resolve,
            "https://evil.other.test/",
        ],
    );
    assert!(out.is_err(), "relayed: {out:?}");
    wait_for("the SNI refused", Duration::from_secs(5), || {
        m.log().contains("TLS to a DYNAMIC_DNS entry refused")
    })?;
    assert_eq!(
        dns.asked("evil.other.test"),
        0,
        "a Host or SNI outside the wildcard is never resolved"
    );
    assert_eq!(dns.asked("wild.test"), 0);
    assert!(dns.asked("a.wild.test") >= 1 && dns.asked("api.external.test") >= 1);
    Ok(())
}
