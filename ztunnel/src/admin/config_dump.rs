//! `/config_dump`: the proxy's state in the JSON shape Istio's ztunnel uses (camelCase;
//! `workloads`, `services`, `policies`, `certificates`, `config`, `version`), which
//! `istioctl ztunnel-config` reads.

use serde_json::{json, Map, Value};

use crate::identity::manager::CertManager;
use crate::rbac::{Authorization, Match, PolicyAction, PolicyScope, StringMatch};
use crate::state::{
    GatewayAddress, GatewayDestination, HealthStatus, MeshState, Service, Workload,
};

/// Istio's GatewayAddress: `destination` is one string, `network/ip` or
/// `namespace/hostname` (upstream's untagged enum; istioctl decodes a string).
fn gateway(g: &GatewayAddress) -> Value {
    let destination = match &g.destination {
        GatewayDestination::Address(a) => a.to_string(),
        GatewayDestination::Hostname(h) => h.0.clone(),
    };
    json!({ "destination": destination, "hboneMtlsPort": g.hbone_mtls_port })
}

/// Inserts `key` unless the value is its type's default (upstream's
/// `skip_serializing_if = "is_default"`).
fn insert_unless_default(m: &mut Map<String, Value>, key: &str, v: Value) {
    let default = match &v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(_) => false,
    };
    if !default {
        m.insert(key.to_string(), v);
    }
}

fn ports(p: &std::collections::BTreeMap<u16, u16>) -> Value {
    Value::Object(p.iter().map(|(k, v)| (k.to_string(), json!(v))).collect())
}

fn health(h: HealthStatus) -> &'static str {
    match h {
        HealthStatus::Healthy => "Healthy",
        HealthStatus::Unhealthy => "Unhealthy",
    }
}

/// A workload as upstream serializes it: fields at their default are left out; the
/// service list is `namespace/hostname` strings (the ports live in the services'
/// endpoints).
pub fn workload(w: &Workload) -> Value {
    let mut services: Vec<&str> = w.services.keys().map(|k| k.0.as_str()).collect();
    services.sort_unstable();
    let mut m = Map::new();
    m.insert(
        "workloadIps".into(),
        json!(w
            .workload_ips
            .iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()),
    );
    insert_unless_default(
        &mut m,
        "waypoint",
        w.waypoint.as_ref().map_or(Value::Null, gateway),
    );
    insert_unless_default(
        &mut m,
        "networkGateway",
        w.network_gateway.as_ref().map_or(Value::Null, gateway),
    );
    m.insert("protocol".into(), json!(w.protocol.as_str()));
    m.insert("networkMode".into(), json!("Standard"));
    insert_unless_default(&mut m, "uid", json!(w.uid.0));
    m.insert("name".into(), json!(w.name));
    m.insert("namespace".into(), json!(w.namespace));
    insert_unless_default(&mut m, "trustDomain", json!(w.trust_domain));
    insert_unless_default(&mut m, "serviceAccount", json!(w.service_account));
    insert_unless_default(&mut m, "network", json!(w.network));
    insert_unless_default(&mut m, "workloadName", json!(w.workload_name));
    insert_unless_default(&mut m, "workloadType", json!(w.workload_type));
    insert_unless_default(&mut m, "canonicalName", json!(w.canonical_name));
    insert_unless_default(&mut m, "canonicalRevision", json!(w.canonical_revision));
    insert_unless_default(&mut m, "hostname", json!(w.hostname));
    insert_unless_default(&mut m, "node", json!(w.node));
    // Istio's dump shape: {"protocol": "PROXY", "port": N} (port null when unset).
    if let Some(t) = crate::state::ApplicationTunnel::effective(w.application_tunnel) {
        m.insert(
            "applicationTunnel".into(),
            json!({"protocol": "PROXY", "port": t.port}),
        );
    }
    insert_unless_default(
        &mut m,
        "authorizationPolicies",
        json!(w.authorization_policies),
    );
    m.insert("status".into(), json!(health(w.status)));
    m.insert(
        "networkMode".into(),
        json!(match w.network_mode {
            crate::state::NetworkMode::Standard => "Standard",
            crate::state::NetworkMode::HostNetwork => "HostNetwork",
        }),
    );
    m.insert("clusterId".into(), json!(w.cluster_id));
    if w.locality != crate::state::Locality::default() {
        let l = &w.locality;
        m.insert(
            "locality".into(),
            json!({ "region": l.region, "zone": l.zone, "subzone": l.subzone }),
        );
    }
    insert_unless_default(&mut m, "services", json!(services));
    m.insert("capacity".into(), json!(w.capacity));
    Value::Object(m)
}

pub fn service(state: &MeshState, s: &Service) -> Value {
    let key = s.namespaced_hostname();
    // Upstream keys endpoints by workload uid.
    let mut endpoints = Map::new();
    for w in state.workloads() {
        if let Some(p) = w.services.get(&key) {
            endpoints.insert(
                w.uid.0.clone(),
                json!({ "workloadUid": w.uid.0, "port": ports(p), "status": health(w.status) }),
            );
        }
    }
    // As istiod sent it (or the local config set it); unset (istiod's AUTOMATIC) is left
    // out as Istio's ztunnel does, not guessed from the VIPs.
    let ip_families = s.ip_families.map_or(Value::Null, |f| json!(f.name()));
    let mut m = Map::new();
    m.insert("name".into(), json!(s.name));
    m.insert("namespace".into(), json!(s.namespace));
    m.insert("hostname".into(), json!(s.hostname));
    m.insert(
        "vips".into(),
        json!(s.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>()),
    );
    m.insert("ports".into(), ports(&s.ports));
    m.insert("endpoints".into(), Value::Object(endpoints));
    m.insert("subjectAltNames".into(), json!(s.subject_alt_names));
    insert_unless_default(
        &mut m,
        "waypoint",
        s.waypoint.as_ref().map_or(Value::Null, gateway),
    );
    let weighted: Vec<Value> = s
        .weighted_waypoints
        .iter()
        .map(|w| json!({ "destination": gateway(&w.destination), "weight": w.weight }))
        .collect();
    insert_unless_default(&mut m, "weightedWaypoints", Value::Array(weighted));
    insert_unless_default(&mut m, "ipFamilies", ip_families);
    insert_unless_default(
        &mut m,
        "cidrVips",
        json!(s
            .cidr_vips
            .iter()
            .map(|c| c.to_string())
            .collect::<Vec<_>>()),
    );
    if let Some(lb) = &s.load_balancer {
        // Istio's serde shape: variant names as strings.
        let scopes: Vec<String> = lb
            .routing_preferences
            .iter()
            .map(|p| format!("{p:?}"))
            .collect();
        m.insert(
            "loadBalancer".into(),
            json!({ "routingPreferences": scopes, "mode": format!("{:?}", lb.mode), "healthPolicy": format!("{:?}", lb.health_policy) }),
        );
    }
    m.insert("canonical".into(), json!(s.canonical));
    m.insert("visibility".into(), json!(s.visibility.name()));
    Value::Object(m)
}

fn strings(v: &[StringMatch]) -> Value {
    Value::Array(
        v.iter()
            .map(|m| match m {
                StringMatch::Exact(s) => json!({ "Exact": s }),
                StringMatch::Prefix(s) => json!({ "Prefix": s }),
                StringMatch::Suffix(s) => json!({ "Suffix": s }),
                StringMatch::Presence => json!({ "Presence": {} }),
            })
            .collect(),
    )
}

/// Istio's `RbacMatch`: empty lists are left out (an empty match dumps as `{}`).
fn rbac_match(m: &Match) -> Value {
    let cidrs =
        |v: &[crate::rbac::Cidr]| json!(v.iter().map(|c| c.0.to_string()).collect::<Vec<_>>());
    let sas = |v: &[crate::rbac::ServiceAccountMatch]| {
        json!(v
            .iter()
            .map(|s| json!({ "namespace": s.namespace, "serviceAccount": s.service_account }))
            .collect::<Vec<_>>())
    };
    let mut o = Map::new();
    insert_unless_default(&mut o, "namespaces", strings(&m.namespaces));
    insert_unless_default(&mut o, "notNamespaces", strings(&m.not_namespaces));
    insert_unless_default(&mut o, "serviceAccounts", sas(&m.service_accounts));
    insert_unless_default(&mut o, "notServiceAccounts", sas(&m.not_service_accounts));
    insert_unless_default(&mut o, "principals", strings(&m.principals));
    insert_unless_default(&mut o, "notPrincipals", strings(&m.not_principals));
    insert_unless_default(&mut o, "sourceIps", cidrs(&m.source_ips));
    insert_unless_default(&mut o, "notSourceIps", cidrs(&m.not_source_ips));
    insert_unless_default(&mut o, "destinationIps", cidrs(&m.destination_ips));
    insert_unless_default(&mut o, "notDestinationIps", cidrs(&m.not_destination_ips));
    insert_unless_default(&mut o, "destinationPorts", json!(m.destination_ports));
    insert_unless_default(
        &mut o,
        "notDestinationPorts",
        json!(m.not_destination_ports),
    );
    Value::Object(o)
}

pub fn policy(p: &Authorization) -> Value {
    let rules: Vec<Value> = p
        .rules
        .iter()
        .map(|r| {
            Value::Array(
                r.iter()
                    .map(|c| Value::Array(c.iter().map(rbac_match).collect()))
                    .collect(),
            )
        })
        .collect();
    let mut v = json!({
        "name": p.name,
        "namespace": p.namespace,
        "scope": match p.scope { PolicyScope::Global => "Global", PolicyScope::Namespace => "Namespace", PolicyScope::WorkloadSelector => "WorkloadSelector" },
        "action": match p.action { PolicyAction::Allow => "Allow", PolicyAction::Deny => "Deny" },
        "rules": rules,
        "dryRun": p.dry_run,
    });
    // A deny-all standing in for a policy istiod sent that we could not convert: why.
    if let Some(reason) = &p.unenforceable {
        v["unenforceable"] = json!(reason);
    }
    v
}

fn rfc3339(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|d| {
            d.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// Istio's `der_to_pem`: 60-column base64 lines.
fn pem(der: &[u8]) -> String {
    let b64 = base64(der);
    let mut out = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in b64.as_bytes().chunks(60) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END CERTIFICATE-----\n");
    out
}

fn cert_dump(der: &rustls_pki_types::CertificateDer<'_>) -> Value {
    use x509_parser::prelude::*;
    // Istio's ztunnel dumps the PEM text base64-encoded once more (istioctl decodes it).
    let pem = base64(pem(der.as_ref()).as_bytes());
    match X509Certificate::from_der(der.as_ref()) {
        Ok((_, c)) => {
            let t = |secs: i64| {
                std::time::UNIX_EPOCH
                    + std::time::Duration::from_secs(u64::try_from(secs).unwrap_or(0))
            };
            json!({
                "pem": pem,
                // Decimal, as Istio's ztunnel prints it.
                "serialNumber": c.serial.to_string(),
                "validFrom": rfc3339(t(c.validity().not_before.timestamp())),
                "expirationTime": rfc3339(t(c.validity().not_after.timestamp())),
            })
        }
        Err(e) => json!({ "pem": pem, "error": e.to_string() }),
    }
}

/// Standard base64 (RFC 4648, padded, one line).
fn base64(data: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(TABLE[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Istio's `CertsDump`: state `Initializing`, `Available`, or `Unavailable: <error>`
/// (its `CertState` printed the way its admin server prints it).
pub fn certificates(certs: &CertManager) -> Value {
    use crate::identity::manager::HeldCert;
    Value::Array(
        certs
            .states()
            .into_iter()
            .map(|(id, held)| match held {
                HeldCert::Available(c) => json!({
                    "identity": id.to_string(),
                    "state": "Available",
                    "certChain": c.cert.chain.iter().map(cert_dump).collect::<Vec<_>>(),
                    "rootCerts": c.cert.roots.iter().map(cert_dump).collect::<Vec<_>>(),
                }),
                HeldCert::Initializing => json!({ "identity": id.to_string(), "state": "Initializing", "certChain": [], "rootCerts": [] }),
                HeldCert::Unavailable(err) => {
                    json!({ "identity": id.to_string(), "state": format!("Unavailable: {err}"), "certChain": [], "rootCerts": [] })
                }
            })
            .collect(),
    )
}

/// The whole dump. `config` is the proxy's own settings.
pub fn dump(state: &MeshState, certs: &CertManager, config: Value) -> Value {
    let mut workloads: Vec<_> = state.workloads().collect();
    workloads.sort_by(|a, b| a.uid.cmp(&b.uid));
    let mut services: Vec<_> = state.services().collect();
    services.sort_by_key(|s| s.namespaced_hostname());
    json!({
        "workloads": workloads.iter().map(|w| workload(w)).collect::<Vec<_>>(),
        "services": services.iter().map(|s| service(state, s)).collect::<Vec<_>>(),
        "policies": state.policies().map(|p| policy(p)).collect::<Vec<_>>(),
        // Endpoints of services not yet known; ours are never staged.
        "stagedServices": {},
        // Upstream's local config section; ours is merged into the lists above.
        "staticConfig": { "workloads": [], "policies": [], "services": [] },
        "certificates": certificates(certs),
        "config": config,
        "version": version(),
    })
}

/// Istio's `workloadState`: each pod proxy by uid, `Pending` (no connections yet) or
/// `Up` with its open connections, and who it is for.
pub fn workload_state(states: &[crate::proxy::states::ProxyStateView]) -> Value {
    let mut m = Map::new();
    for st in states {
        let mut e = Map::new();
        e.insert(
            "state".into(),
            json!(if st.connections.is_some() {
                "Up"
            } else {
                "Pending"
            }),
        );
        if let Some((inbound, outbound)) = &st.connections {
            let inbound: Vec<Value> = inbound
                .iter()
                .map(|c| json!({ "src": c.src.to_string(), "originalDst": c.service, "actualDst": c.dst.to_string(), "protocol": c.protocol.as_str() }))
                .collect();
            let outbound: Vec<Value> = outbound
                .iter()
                .map(|c| {
                    json!({ "src": c.src.to_string(), "originalDst": c.original_dst.to_string(), "actualDst": c.actual_dst.to_string(), "protocol": c.protocol.as_str() })
                })
                .collect();
            e.insert(
                "connections".into(),
                json!({ "inbound": inbound, "outbound": outbound }),
            );
        }
        let i = &st.info;
        e.insert("info".into(), json!({ "name": i.name, "namespace": i.namespace, "serviceAccount": i.service_account }));
        m.insert(st.uid.0.clone(), Value::Object(e));
    }
    Value::Object(m)
}

/// Upstream's BuildInfo fields.
pub fn version() -> Value {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "gitRevision": option_env!("ZTUNNEL_GIT_REVISION").unwrap_or("unknown"),
        "rustVersion": option_env!("CARGO_PKG_RUST_VERSION").unwrap_or(""),
        "buildProfile": if cfg!(debug_assertions) { "debug" } else { "release" },
        "buildStatus": "Clean",
        "istioVersion": option_env!("ZTUNNEL_ISTIO_VERSION").unwrap_or("unknown"),
        // Istio's spelling of its build feature ("tls-aws-lc" in its default build).
        "cryptoProvider": "tls-ring",
    })
}

/// A duration as upstream's serde writes it.
pub fn duration(d: std::time::Duration) -> Value {
    json!({ "secs": d.as_secs(), "nanos": d.subsec_nanos() })
}

/// A listen address as upstream's `Address` enum: localhost (dual stack flag, port) or
/// an explicit socket address.
pub fn address(a: std::net::SocketAddr) -> Value {
    if a.ip().is_loopback() {
        json!({ "Localhost": [a.is_ipv6(), a.port()] })
    } else {
        json!({ "SocketAddr": a.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Shared with the end-to-end tests (tests/src/json_schema.rs; ztunnel cannot depend on them).
    mod json_schema {
        include!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/src/json_schema.rs"
        ));
    }

    const SCHEMA: &str = include_str!("../../tests/data/config_dump.schema.json");

    /// The dump of a state with waypoints (by address and by hostname), an application
    /// tunnel, a policy and an issued certificate, checked against upstream's shape
    /// (the config section is checked end to end, with the binary's real config).
    /// The state of `cfg` and a certificate manager on a throw-away CA holding a
    /// certificate for `ns/sa`.
    fn fixture(
        cfg: crate::config::LocalConfig,
        tag: &str,
    ) -> (
        crate::state::MeshState,
        std::sync::Arc<CertManager>,
        std::sync::Arc<crate::identity::manager::CertState>,
    ) {
        let state = cfg.into_state(std::path::Path::new("t.yaml")).unwrap();
        let dir = std::env::temp_dir().join(format!("zt-{tag}-{}", std::process::id()));
        let ca = crate::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let certs = CertManager::new(std::sync::Arc::new(crate::identity::manager::LocalCa {
            ca,
            ttl: std::time::Duration::from_secs(3600),
        }));
        let id = crate::identity::Identity::new("cluster.local", "ns", "sa");
        certs.allow(&id);
        let issued = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(certs.fetch(&id))
            .unwrap();
        (state, certs, issued)
    }

    #[test]
    fn dump_matches_upstream_schema() {
        let cfg = crate::config::LocalConfig::parse(
            std::path::Path::new("t.yaml"),
            "workloads:\n- {uid: u1, name: a, namespace: ns, serviceAccount: sa, workloadIps: [10.0.0.1], protocol: HBONE, node: n1, services: {ns/s.ns.svc: {80: 8080}}, waypoint: {destination: \"ns/wp.ns.svc.cluster.local\"}, applicationTunnel: {protocol: PROXY}}\n\
             - {uid: u2, name: b, namespace: ns, workloadIps: [10.0.0.2]}\n\
             - {uid: u3, name: c, namespace: ns, hostname: api.example.com, services: {ns/api.example.com: {443: 443}}}\n\
             - {uid: u4, name: d, namespace: ns, network: net-b, networkGateway: {destination: \"net-b/172.18.0.9\"}, services: {ns/s.ns.svc: {80: 8080}}}\n\
             services:\n- {name: s, namespace: ns, hostname: s.ns.svc, vips: [\"/10.96.0.1\", \"net-b/10.96.9.1\"], cidrVips: [\"net-b/10.200.0.0/16\"], ports: {80: 8080}, waypoint: {destination: \"/10.0.0.9\"}, ingressUseWaypoint: true,\n\
               weightedWaypoints: [{destination: {destination: \"/10.0.0.9\"}, weight: 9}, {destination: {destination: \"ns/canary.ns.svc.cluster.local\", hboneMtlsPort: 15009}, weight: 1}]}\n\
             policies:\n- {name: p, namespace: ns, scope: Namespace, action: Deny, rules: [[[{principals: [{Exact: td/ns/x/sa/y}]}]]]}\n",
        )
        .unwrap();
        let (state, certs, _) = fixture(cfg, "schema");
        certs.allow(&crate::identity::Identity::new(
            "cluster.local",
            "ns",
            "pending",
        ));
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        let mut d = dump(&state, &certs, json!({}));
        d["workloadState"] = workload_state(&proxy_states());
        let bad: Vec<String> = json_schema::violations(&schema, &d)
            .into_iter()
            .filter(|v| !v.starts_with("$.config"))
            .collect();
        assert!(bad.is_empty(), "{bad:#?}\n{d:#}");
        assert_eq!(
            d["workloads"][0]["waypoint"]["destination"],
            "ns/wp.ns.svc.cluster.local"
        );
        assert_eq!(d["services"][0]["waypoint"]["destination"], "/10.0.0.9");
        // The weighted set in upstream's shape; ingress_use_waypoint is not in upstream's
        // dump (its ztunnel does not keep it), so not in ours either.
        assert_eq!(
            d["services"][0]["weightedWaypoints"],
            json!([{"destination": {"destination": "/10.0.0.9", "hboneMtlsPort": 15008}, "weight": 9},
                   {"destination": {"destination": "ns/canary.ns.svc.cluster.local", "hboneMtlsPort": 15009}, "weight": 1}])
        );
        assert!(d["services"][0].get("ingressUseWaypoint").is_none());
        assert_eq!(
            d["workloads"][0]["applicationTunnel"],
            json!({"protocol": "PROXY", "port": null})
        );
        // A hostname workload: the name, no IPs; left out where it is empty (as upstream).
        assert_eq!(
            (
                &d["workloads"][2]["hostname"],
                &d["workloads"][2]["workloadIps"]
            ),
            (&json!("api.example.com"), &json!([]))
        );
        assert!(d["workloads"][0].get("hostname").is_none());
        // A remote network's endpoint: its network and the gateway to it, as upstream
        // names them; VIPs and ranges with their network.
        assert_eq!(
            (
                &d["workloads"][3]["network"],
                &d["workloads"][3]["networkGateway"]
            ),
            (
                &json!("net-b"),
                &json!({"destination": "net-b/172.18.0.9", "hboneMtlsPort": 15008})
            )
        );
        assert!(
            d["workloads"][0].get("networkGateway").is_none()
                && d["workloads"][0].get("network").is_none()
        );
        assert_eq!(
            (&d["services"][0]["vips"], &d["services"][0]["cidrVips"]),
            (
                &json!(["/10.96.0.1", "net-b/10.96.9.1"]),
                &json!(["net-b/10.200.0.0/16"])
            )
        );
        // The shapes this dump had before (istioctl could not decode them) are caught.
        let mut old = d.clone();
        old["workloads"][0]["waypoint"]["destination"] =
            json!({"Hostname": {"namespace": "ns", "hostname": "wp"}});
        old["workloads"][0]["services"] = json!({"ns/s.ns.svc": {"80": 8080}});
        old["certificates"][0]
            .as_object_mut()
            .unwrap()
            .remove("rootCerts");
        let found = json_schema::violations(&schema, &old);
        for want in [
            "$.workloads[0].waypoint.destination",
            "$.workloads[0].services",
            "$.certificates[0]: missing required field \"rootCerts\"",
        ] {
            assert!(
                found.iter().any(|v| v.starts_with(want)),
                "{want}: {found:#?}"
            );
        }
    }

    /// One pod proxy up with an inbound and an outbound connection, one pending.
    fn proxy_states() -> Vec<crate::proxy::states::ProxyStateView> {
        use crate::proxy::pod::{InboundView, OutboundView};
        use crate::proxy::states::{ProxyInfo, ProxyStateView};
        let info = |n: &str| ProxyInfo {
            name: n.into(),
            namespace: "ns".into(),
            service_account: "sa".into(),
        };
        let a = |s: &str| s.parse().unwrap();
        vec![
            ProxyStateView {
                uid: crate::state::WorkloadUid("u1".into()),
                info: info("a"),
                connections: Some((
                    vec![InboundView {
                        src: a("10.0.0.2:40000"),
                        service: Some("s.ns.svc".into()),
                        dst: a("10.0.0.1:8080"),
                        protocol: crate::state::Protocol::HBONE,
                    }],
                    vec![OutboundView {
                        src: a("10.0.0.1:41000"),
                        original_dst: a("10.96.0.1:80"),
                        actual_dst: a("10.0.0.3:15008"),
                        protocol: crate::state::Protocol::HBONE,
                    }],
                )),
            },
            ProxyStateView {
                uid: crate::state::WorkloadUid("u3".into()),
                info: info("c"),
                connections: None,
            },
        ]
    }

    #[test]
    fn workload_state_as_upstream() {
        let d = workload_state(&proxy_states());
        assert_eq!(d["u1"]["state"], "Up");
        assert_eq!(
            d["u1"]["info"],
            json!({"name": "a", "namespace": "ns", "serviceAccount": "sa"})
        );
        assert_eq!(
            d["u1"]["connections"]["inbound"][0],
            json!({"src": "10.0.0.2:40000", "originalDst": "s.ns.svc", "actualDst": "10.0.0.1:8080", "protocol": "HBONE"})
        );
        assert_eq!(
            d["u1"]["connections"]["outbound"][0]["actualDst"],
            "10.0.0.3:15008"
        );
        assert_eq!(d["u3"]["state"], "Pending");
        assert!(
            d["u3"].get("connections").is_none(),
            "a pending proxy has no connections, as upstream"
        );
    }

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
        assert!(
            !base64(&[0u8; 300]).contains('\n'),
            "one line, as Istio's STANDARD engine"
        );
        // PEM lines are 60 columns as Istio's der_to_pem writes them.
        let p = pem(&[0u8; 60]);
        assert_eq!(
            p.lines().map(str::len).collect::<Vec<_>>(),
            [27, 60, 20, 25]
        );
    }

    #[test]
    fn ip_families_as_istiod_sent_them() {
        let st = MeshState::default();
        let svc = |yaml: &str| serde_yaml::from_str::<Service>(yaml).unwrap();
        let set = "{name: s, namespace: ns, hostname: s.ns.svc, vips: [/10.96.0.1, \"/fd00::1\"], ipFamilies: Dual}";
        assert_eq!(service(&st, &svc(set))["ipFamilies"], "Dual");
        let headless = "{name: s, namespace: ns, hostname: s.ns.svc, ipFamilies: IPv4}";
        assert_eq!(service(&st, &svc(headless))["ipFamilies"], "IPv4");
        // Unset (istiod's AUTOMATIC): left out as Istio's ztunnel does, whatever the VIPs.
        let unset =
            "{name: s, namespace: ns, hostname: s.ns.svc, vips: [/10.96.0.1, \"/fd00::1\"]}";
        assert!(service(&st, &svc(unset)).get("ipFamilies").is_none());
    }

    #[tokio::test]
    async fn a_failed_certificate_is_unavailable_with_its_error() {
        let dir = std::env::temp_dir().join(format!("zt-unavail-{}", std::process::id()));
        let ca = crate::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        // Issues only for "ok": the other identity's fetch fails as a CA error would.
        struct OnlyOk(crate::identity::manager::LocalCa);
        impl crate::identity::manager::CaClient for OnlyOk {
            fn sign<'a>(
                &'a self,
                id: &'a crate::identity::Identity,
            ) -> crate::identity::manager::SignFuture<'a> {
                if id.service_account == "ok" {
                    return self.0.sign(id);
                }
                Box::pin(async move {
                    Err(crate::identity::manager::CertError::Remote {
                        identity: id.clone(),
                        reason: "CSR rejected".into(),
                    })
                })
            }
        }
        let certs = CertManager::new(std::sync::Arc::new(OnlyOk(
            crate::identity::manager::LocalCa {
                ca,
                ttl: std::time::Duration::from_secs(3600),
            },
        )));
        let (ok, bad, pending) = (
            crate::identity::Identity::new("cluster.local", "ns", "ok"),
            crate::identity::Identity::new("cluster.local", "ns", "bad"),
            crate::identity::Identity::new("cluster.local", "ns", "pending"),
        );
        for id in [&ok, &bad, &pending] {
            certs.allow(id);
        }
        certs.fetch(&ok).await.unwrap();
        assert!(certs.fetch(&bad).await.is_err());
        let d = certificates(&certs);
        let by_id = |sa: &str| {
            d.as_array()
                .unwrap()
                .iter()
                .find(|c| c["identity"].as_str().unwrap().ends_with(sa))
                .unwrap()
                .clone()
        };
        let bad_dump = by_id("/sa/bad");
        assert!(
            bad_dump["state"]
                .as_str()
                .unwrap()
                .starts_with("Unavailable: "),
            "{bad_dump}"
        );
        assert!(
            bad_dump["state"].as_str().unwrap().contains("CSR rejected"),
            "{bad_dump}"
        );
        assert_eq!(
            (&bad_dump["certChain"], &bad_dump["rootCerts"]),
            (&json!([]), &json!([]))
        );
        assert_eq!(by_id("/sa/pending")["state"], "Initializing");
        assert_eq!(by_id("/sa/ok")["state"], "Available");
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        let bad: Vec<String> = json_schema::violations(&schema, &json!({"certificates": d}))
            .into_iter()
            .filter(|v| v.starts_with("$.certificates"))
            .collect();
        assert!(bad.is_empty(), "{bad:#?}");
    }

    #[test]
    fn state_in_istio_shape() {
        let cfg = crate::config::LocalConfig::parse(
            std::path::Path::new("t.yaml"),
            "workloads:\n- {uid: u1, name: a, namespace: ns, serviceAccount: sa, workloadIps: [10.0.0.1], protocol: HBONE, node: n1, services: {ns/s.ns.svc: {80: 8080}}, waypoint: {destination: \"/10.0.0.9\"}}\n\
             services:\n- {name: s, namespace: ns, hostname: s.ns.svc, vips: [\"/10.96.0.1\"], ports: {80: 8080}}\n\
             policies:\n- {name: p, namespace: ns, scope: Namespace, action: Deny, rules: [[[{principals: [{Exact: td/ns/x/sa/y}], destinationPorts: [80]}]]]}\n",
        )
        .unwrap();
        let (state, certs, issued) = fixture(cfg, "dump");
        let d = dump(&state, &certs, json!({}));
        assert_eq!(
            d["certificates"][0]["identity"],
            "spiffe://cluster.local/ns/ns/sa/sa"
        );
        assert_eq!(d["certificates"][0]["state"], "Available");
        let serial = u128::from_str_radix(&issued.cert.serial, 16)
            .unwrap()
            .to_string();
        assert_eq!(
            d["certificates"][0]["certChain"][0]["serialNumber"],
            serial.as_str()
        );
        // Base64 of the PEM text, as Istio's ztunnel dumps it.
        let pem_b64 = d["certificates"][0]["certChain"][0]["pem"]
            .as_str()
            .unwrap();
        assert_eq!(
            pem_b64,
            base64(pem(issued.cert.chain[0].as_ref()).as_bytes())
        );
        assert!(
            pem_b64.starts_with(&base64(b"-----BEGIN CERTIFICATE-----\nMII")[..40]),
            "{pem_b64}"
        );
        assert!(d["certificates"][0]["certChain"][0]["expirationTime"]
            .as_str()
            .unwrap()
            .ends_with('Z'));
        assert_eq!(d["workloads"][0]["uid"], "u1");
        assert_eq!(d["workloads"][0]["workloadIps"][0], "10.0.0.1");
        assert_eq!(d["workloads"][0]["protocol"], "HBONE");
        assert_eq!(d["workloads"][0]["services"], json!(["ns/s.ns.svc"]));
        assert_eq!(d["workloads"][0]["waypoint"]["destination"], "/10.0.0.9");
        assert_eq!(d["services"][0]["vips"][0], "/10.96.0.1");
        assert_eq!(d["services"][0]["endpoints"]["u1"]["workloadUid"], "u1");
        assert_eq!(d["services"][0]["endpoints"]["u1"]["port"]["80"], 8080);
        assert!(
            d["services"][0].get("ipFamilies").is_none(),
            "unset: left out as upstream"
        );
        assert!(
            d["services"][0].get("waypoint").is_none(),
            "no waypoint: left out as upstream"
        );
        assert!(
            d["services"][0].get("weightedWaypoints").is_none(),
            "an empty set: left out as upstream"
        );
        assert_eq!(
            d["certificates"][0]["certChain"].as_array().unwrap().len(),
            1,
            "the leaf; the root is in rootCerts"
        );
        assert_eq!(
            d["certificates"][0]["rootCerts"].as_array().unwrap().len(),
            1
        );
        assert_eq!(d["policies"][0]["action"], "Deny");
        assert_eq!(
            d["policies"][0]["rules"][0][0][0]["principals"][0]["Exact"],
            "td/ns/x/sa/y"
        );
        assert_eq!(
            d["policies"][0]["rules"][0][0][0]["destinationPorts"][0],
            80
        );
        assert!(
            d["policies"][0]["rules"][0][0][0]
                .get("notPrincipals")
                .is_none(),
            "empty lists left out as upstream"
        );
    }
}
