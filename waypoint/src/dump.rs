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
    // CUSTOM policies' authorizers, checked: their kind, or why they cannot be used.
    let providers: serde_json::Map<String, Value> = cfg
        .providers
        .iter()
        .map(|(name, p)| (name.clone(), match p {
            Ok(p) => json!({"kind": p.kind()}),
            Err(e) => json!({"error": e}),
        }))
        .collect();
    d["extensionProviders"] = Value::Object(providers);
    // In a cluster: where they were read, or why there are none.
    if let Some(src) = l7.get("extensionProviders") {
        who["extensionProviders"] = src.clone();
    }
    d["waypoint"] = who;
    d
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
}
