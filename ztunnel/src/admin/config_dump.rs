//! `/config_dump`: the proxy's state in the JSON shape Istio's ztunnel uses (camelCase;
//! `workloads`, `services`, `policies`, `certificates`, `config`, `version`), which
//! `istioctl ztunnel-config` reads.

use serde_json::{json, Map, Value};

use crate::identity::manager::CertManager;
use crate::rbac::{Authorization, Match, PolicyAction, PolicyScope, StringMatch};
use crate::state::{GatewayAddress, GatewayDestination, HealthStatus, MeshState, Protocol, Service, Workload};

fn gateway(g: &Option<GatewayAddress>) -> Value {
    match g {
        None => Value::Null,
        Some(g) => {
            let destination = match &g.destination {
                GatewayDestination::Address(a) => json!({ "Address": a.to_string() }),
                GatewayDestination::Hostname(h) => {
                    let (namespace, hostname) = h.0.split_once('/').unwrap_or(("", &h.0));
                    json!({ "Hostname": { "namespace": namespace, "hostname": hostname } })
                }
            };
            json!({ "destination": destination, "hboneMtlsPort": g.hbone_mtls_port })
        }
    }
}

fn ports(p: &std::collections::BTreeMap<u16, u16>) -> Value {
    Value::Object(p.iter().map(|(k, v)| (k.to_string(), json!(v))).collect())
}

pub fn workload(w: &Workload) -> Value {
    let services: Map<String, Value> = w.services.iter().map(|(k, p)| (k.0.clone(), ports(p))).collect();
    json!({
        "uid": w.uid.0,
        "workloadIps": w.workload_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>(),
        "waypoint": gateway(&w.waypoint),
        "networkGateway": null,
        "protocol": match w.protocol { Protocol::HBONE => "HBONE", Protocol::TCP => "TCP" },
        "networkMode": "Standard",
        "name": w.name,
        "namespace": w.namespace,
        "trustDomain": w.trust_domain,
        "serviceAccount": w.service_account,
        "network": w.network,
        "workloadName": w.workload_name,
        "workloadType": "pod",
        "canonicalName": w.canonical_name,
        "canonicalRevision": w.canonical_revision,
        "hostname": "",
        "node": w.node,
        "status": match w.status { HealthStatus::Healthy => "Healthy", HealthStatus::Unhealthy => "Unhealthy" },
        "clusterId": w.cluster_id,
        "authorizationPolicies": w.authorization_policies,
        "nativeTunnel": false,
        // Istio's dump shape: {"protocol": "PROXY", "port": N} (port omitted when unset).
        "applicationTunnel": crate::state::ApplicationTunnel::effective(w.application_tunnel).map(|t| match t.port {
            Some(p) => json!({"protocol": "PROXY", "port": p}),
            None => json!({"protocol": "PROXY"}),
        }),
        "services": services,
        "capacity": w.capacity,
    })
}

pub fn service(state: &MeshState, s: &Service) -> Value {
    let key = s.namespaced_hostname();
    let mut endpoints = Map::new();
    for w in state.workloads() {
        if let Some(p) = w.services.get(&key) {
            endpoints.insert(
                format!("{}:{}", key, w.uid),
                json!({ "workloadUid": w.uid.0, "service": key.0, "port": ports(p) }),
            );
        }
    }
    json!({
        "name": s.name,
        "namespace": s.namespace,
        "hostname": s.hostname,
        "vips": s.vips.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
        "ports": ports(&s.ports),
        "endpoints": endpoints,
        "subjectAltNames": s.subject_alt_names,
        "waypoint": gateway(&s.waypoint),
        "loadBalancer": null,
        "ipFamilies": "IPv4",
    })
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

fn rbac_match(m: &Match) -> Value {
    let cidrs = |v: &[crate::rbac::Cidr]| v.iter().map(|c| c.0.to_string()).collect::<Vec<_>>();
    let sas = |v: &[crate::rbac::ServiceAccountMatch]| {
        v.iter().map(|s| json!({ "namespace": s.namespace, "serviceAccount": s.service_account })).collect::<Vec<_>>()
    };
    json!({
        "namespaces": strings(&m.namespaces),
        "notNamespaces": strings(&m.not_namespaces),
        "serviceAccounts": sas(&m.service_accounts),
        "notServiceAccounts": sas(&m.not_service_accounts),
        "principals": strings(&m.principals),
        "notPrincipals": strings(&m.not_principals),
        "sourceIps": cidrs(&m.source_ips),
        "notSourceIps": cidrs(&m.not_source_ips),
        "destinationIps": cidrs(&m.destination_ips),
        "notDestinationIps": cidrs(&m.not_destination_ips),
        "destinationPorts": m.destination_ports,
        "notDestinationPorts": m.not_destination_ports,
    })
}

pub fn policy(p: &Authorization) -> Value {
    let rules: Vec<Value> = p
        .rules
        .iter()
        .map(|r| Value::Array(r.iter().map(|c| Value::Array(c.iter().map(rbac_match).collect())).collect()))
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
    let secs = t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|d| d.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_default()
}

fn cert_dump(der: &rustls_pki_types::CertificateDer<'_>) -> Value {
    use x509_parser::prelude::*;
    let pem = format!(
        "-----BEGIN CERTIFICATE-----\n{}\n-----END CERTIFICATE-----\n",
        base64_lines(der.as_ref())
    );
    match X509Certificate::from_der(der.as_ref()) {
        Ok((_, c)) => {
            let t = |secs: i64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(u64::try_from(secs).unwrap_or(0));
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

fn base64_lines(data: &[u8]) -> String {
    const TABLE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len() * 4 / 3 + 4);
    for chunk in data.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(TABLE[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    let bytes = out.into_bytes();
    bytes.chunks(64).map(|l| String::from_utf8_lossy(l).into_owned()).collect::<Vec<_>>().join("\n")
}

pub fn certificates(certs: &CertManager) -> Value {
    Value::Array(
        certs
            .snapshot()
            .into_iter()
            .map(|(id, cert)| match cert {
                Some(c) => {
                    let chain: Vec<Value> = c.cert.chain.iter().chain(c.cert.roots.iter()).map(cert_dump).collect();
                    json!({ "identity": id.to_string(), "state": "Available", "certChain": chain })
                }
                None => json!({ "identity": id.to_string(), "state": "Initializing", "certChain": [] }),
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
        "certificates": certificates(certs),
        "config": config,
        "version": { "version": env!("CARGO_PKG_VERSION"), "rustVersion": option_env!("CARGO_PKG_RUST_VERSION").unwrap_or(""), "buildProfile": if cfg!(debug_assertions) { "debug" } else { "release" } },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(base64_lines(b""), "");
        assert_eq!(base64_lines(b"f"), "Zg==");
        assert_eq!(base64_lines(b"fo"), "Zm8=");
        assert_eq!(base64_lines(b"foo"), "Zm9v");
        assert_eq!(base64_lines(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64_lines(&[0u8; 60]).split('\n').map(str::len).collect::<Vec<_>>(), [64, 16]);
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
        let state = cfg.into_state(std::path::Path::new("t.yaml")).unwrap();
        let dir = std::env::temp_dir().join(format!("zt-dump-{}", std::process::id()));
        let ca = crate::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let certs = CertManager::new(std::sync::Arc::new(crate::identity::manager::LocalCa { ca, ttl: std::time::Duration::from_secs(3600) }));
        let id = crate::identity::Identity::new("cluster.local", "ns", "sa");
        certs.allow(&id);
        let issued = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(certs.fetch(&id)).unwrap();
        let d = dump(&state, &certs, json!({}));
        assert_eq!(d["certificates"][0]["identity"], "spiffe://cluster.local/ns/ns/sa/sa");
        assert_eq!(d["certificates"][0]["state"], "Available");
        let serial = u128::from_str_radix(&issued.cert.serial, 16).unwrap().to_string();
        assert_eq!(d["certificates"][0]["certChain"][0]["serialNumber"], serial.as_str());
        assert!(d["certificates"][0]["certChain"][0]["pem"].as_str().unwrap().starts_with("-----BEGIN CERTIFICATE-----\nMII"));
        assert!(d["certificates"][0]["certChain"][0]["expirationTime"].as_str().unwrap().ends_with('Z'));
        assert_eq!(d["workloads"][0]["uid"], "u1");
        assert_eq!(d["workloads"][0]["workloadIps"][0], "10.0.0.1");
        assert_eq!(d["workloads"][0]["protocol"], "HBONE");
        assert_eq!(d["workloads"][0]["services"]["ns/s.ns.svc"]["80"], 8080);
        assert_eq!(d["workloads"][0]["waypoint"]["destination"]["Address"], "/10.0.0.9");
        assert_eq!(d["services"][0]["vips"][0], "/10.96.0.1");
        assert_eq!(d["services"][0]["endpoints"]["ns/s.ns.svc:u1"]["workloadUid"], "u1");
        assert_eq!(d["policies"][0]["action"], "Deny");
        assert_eq!(d["policies"][0]["rules"][0][0][0]["principals"][0]["Exact"], "td/ns/x/sa/y");
        assert_eq!(d["policies"][0]["rules"][0][0][0]["destinationPorts"][0], 80);
    }
}
