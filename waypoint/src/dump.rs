//! The waypoint's `/config_dump`: ztunnel's document (the workloads, services and L4
//! policies it knows, its certificates, its settings and version, in Istio ztunnel's
//! shapes) plus what only a waypoint has: who it is (`waypoint`) and the HTTPRoutes and
//! AuthorizationPolicies in force (`httpRoutes`, `authorizationPolicies`,
//! `requestAuthentications`, as read) and the CUSTOM policies' `extensionProviders`.

use std::net::IpAddr;

use serde_json::{json, Value};
use ztunnel::identity::{CertManager, Identity};

use crate::config::Config;
use crate::object::ObjectName;

/// Who the waypoint is.
pub struct Me {
    pub identity: Identity,
    pub gateway: ObjectName,
    pub workload_uid: String,
    pub ip: IpAddr,
    pub root_namespace: String,
}

/// The document for the config in force; `settings` is the binary's own (its `config`
/// section).
pub fn config_dump(me: &Me, cfg: &Config, certs: &CertManager, settings: Value) -> Value {
    let mut d = ztunnel::admin::config_dump::dump(&cfg.state, certs, settings);
    let l7 = &*cfg.dump;
    let mut who = json!({
        "identity": me.identity.to_string(),
        "gateway": format!("{}/{}", me.gateway.namespace, me.gateway.name),
        "workloadUid": me.workload_uid,
        "address": me.ip.to_string(),
        "rootNamespace": me.root_namespace,
        "configSource": l7.get("source").cloned().unwrap_or(Value::Null),
    });
    // In a cluster: what was rejected and who uses the waypoint (see `k8s`).
    for k in ["scope", "rejected"] {
        if let Some(v) = l7.get(k) {
            who[k] = v.clone();
        }
    }
    d["httpRoutes"] = l7.get("httpRoutes").cloned().unwrap_or_else(|| json!([]));
    d["grpcRoutes"] = l7.get("grpcRoutes").cloned().unwrap_or_else(|| json!([]));
    d["tcpRoutes"] = l7.get("tcpRoutes").cloned().unwrap_or_else(|| json!([]));
    d["referenceGrants"] = l7.get("referenceGrants").cloned().unwrap_or_else(|| json!([]));
    d["destinationRules"] = l7.get("destinationRules").cloned().unwrap_or_else(|| json!([]));
    d["virtualServices"] = l7.get("virtualServices").cloned().unwrap_or_else(|| json!([]));
    d["authorizationPolicies"] = l7.get("authorizationPolicies").cloned().unwrap_or_else(|| json!([]));
    d["requestAuthentications"] = l7.get("requestAuthentications").cloned().unwrap_or_else(|| json!([]));
    d["telemetries"] = l7.get("telemetries").cloned().unwrap_or_else(|| json!([]));
    // CUSTOM policies' authorizers, checked: their kind and the Service their checks go
    // to now, or why they cannot be used (a hostname in two namespaces is refused).
    let providers: serde_json::Map<String, Value> = cfg
        .providers
        .iter()
        .map(|(name, p)| (name.clone(), match p {
            Ok(p) => {
                let mut v = json!({"kind": p.kind()});
                if let Some(c) = p.common() {
                    v["service"] = service_found(cfg, &c.service);
                }
                v
            }
            Err(e) => json!({"error": e}),
        }))
        .collect();
    d["extensionProviders"] = Value::Object(providers);
    // In a cluster: where they were read, or why there are none.
    if let Some(src) = l7.get("extensionProviders") {
        who["extensionProviders"] = src.clone();
    }
    if let Some(t) = &cfg.tracing {
        who["tracing"] = json!({"provider": t.provider, "service": service_found(cfg, &t.service)});
    }
    d["waypoint"] = who;
    d
}

/// `{"name", "found": "<namespace>/<hostname>"}` or `{"name", "error"}`, for a Service a
/// provider names.
fn service_found(cfg: &Config, name: &str) -> Value {
    match crate::lookup::provider_service(&cfg.state, name) {
        Ok(s) => json!({"name": name, "found": format!("{}/{}", s.namespace, s.hostname)}),
        Err(e) => json!({"name": name, "error": e.to_string()}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ztunnels_document_and_the_waypoints_part() {
        let cfg = Config::parse(
            std::path::Path::new("wp.yaml"),
            "workloads:\n- {uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9]}\n\
             httpRoutes:\n- {name: echo, namespace: default, parentRefs: [{kind: Service, group: \"\", name: echo}]}\n\
             authorizationPolicies:\n- {name: deny, namespace: istio-system, action: DENY, targetRefs: [{kind: GatewayClass, name: istio-waypoint}], rules: [{}]}\n",
        )
        .unwrap();
        let dir = std::env::temp_dir().join(format!("wp-dump-{}", std::process::id()));
        let ca = ztunnel::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let certs = CertManager::new(std::sync::Arc::new(ztunnel::identity::manager::LocalCa { ca, ttl: std::time::Duration::from_secs(60) }));
        let me = Me {
            identity: Identity::new("cluster.local", "default", "waypoint"),
            gateway: ObjectName { namespace: "default".into(), name: "waypoint".into() },
            workload_uid: "wp".into(),
            ip: "10.0.0.9".parse().unwrap(),
            root_namespace: "istio-system".into(),
        };
        certs.allow(&me.identity);
        let d = config_dump(&me, &cfg, &certs, json!({"adminAddr": "x"}));
        assert_eq!(d["waypoint"]["gateway"], "default/waypoint");
        assert_eq!(d["waypoint"]["configSource"], "file wp.yaml");
        assert_eq!(d["httpRoutes"][0]["name"], "echo");
        assert_eq!(d["authorizationPolicies"][0]["targetRefs"][0]["kind"], "GatewayClass");
        assert_eq!(d["requestAuthentications"], json!([]));
        assert_eq!(d["workloads"][0]["uid"], "wp");
        assert_eq!(d["certificates"][0]["identity"], "spiffe://cluster.local/ns/default/sa/waypoint");
        assert_eq!(d["config"]["adminAddr"], "x");
        assert!(d["version"]["version"].is_string());
    }

    /// A provider whose bare hostname two namespaces declare (a tenant's ServiceEntry
    /// beside the real authorizer) is refused, and the dump says why.
    #[test]
    fn a_providers_ambiguous_service_is_shown() {
        let cfg = Config::parse(
            std::path::Path::new("wp.yaml"),
            "services:\n- {name: authz, namespace: sec, hostname: authz.example.com}\n- {name: authz, namespace: evil, hostname: authz.example.com}\n\
             - {name: ext, namespace: sec, hostname: ext.sec.svc.cluster.local}\n\
             meshConfig:\n  extensionProviders:\n  - {name: bare, envoyExtAuthzGrpc: {service: authz.example.com, port: 9000}}\n\
             \x20 - {name: named, envoyExtAuthzGrpc: {service: sec/authz.example.com, port: 9000}}\n\
             \x20 - {name: local, envoyExtAuthzHttp: {service: ext.sec.svc.cluster.local, port: 80}}\n",
        )
        .unwrap();
        let dir = std::env::temp_dir().join(format!("wp-dump-amb-{}", std::process::id()));
        let ca = ztunnel::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let certs = CertManager::new(std::sync::Arc::new(ztunnel::identity::manager::LocalCa { ca, ttl: std::time::Duration::from_secs(60) }));
        let me = Me {
            identity: Identity::new("cluster.local", "default", "waypoint"),
            gateway: ObjectName { namespace: "default".into(), name: "waypoint".into() },
            workload_uid: "wp".into(),
            ip: "10.0.0.9".parse().unwrap(),
            root_namespace: "istio-system".into(),
        };
        let d = config_dump(&me, &cfg, &certs, json!({}));
        let p = &d["extensionProviders"];
        assert!(p["bare"]["service"]["error"].as_str().unwrap_or_default().contains("multiple namespaces"), "{p}");
        assert_eq!(p["named"]["service"]["found"], "sec/authz.example.com");
        assert_eq!(p["local"]["service"]["found"], "sec/ext.sec.svc.cluster.local");
    }
}
