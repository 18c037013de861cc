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
    for k in ["scope", "rejected", "kubernetes"] {
        if let Some(v) = l7.get(k) {
            who[k] = v.clone();
        }
    }
    d["httpRoutes"] = l7.get("httpRoutes").cloned().unwrap_or_else(|| json!([]));
    d["grpcRoutes"] = l7.get("grpcRoutes").cloned().unwrap_or_else(|| json!([]));
    d["tcpRoutes"] = l7.get("tcpRoutes").cloned().unwrap_or_else(|| json!([]));
    d["tlsRoutes"] = l7.get("tlsRoutes").cloned().unwrap_or_else(|| json!([]));
    d["referenceGrants"] = l7
        .get("referenceGrants")
        .cloned()
        .unwrap_or_else(|| json!([]));
    d["destinationRules"] = l7
        .get("destinationRules")
        .cloned()
        .unwrap_or_else(|| json!([]));
    d["virtualServices"] = l7
        .get("virtualServices")
        .cloned()
        .unwrap_or_else(|| json!([]));
    d["authorizationPolicies"] = l7
        .get("authorizationPolicies")
        .cloned()
        .unwrap_or_else(|| json!([]));
    let mut authns = l7
        .get("requestAuthentications")
        .cloned()
        .unwrap_or_else(|| json!([]));
    redact_inline_jwks(&mut authns);
    d["requestAuthentications"] = authns;
    d["telemetries"] = l7.get("telemetries").cloned().unwrap_or_else(|| json!([]));
    // CUSTOM policies' authorizers, checked: their kind and the Service their checks go
    // to now, or why they cannot be used (a hostname in two namespaces is refused).
    let providers: serde_json::Map<String, Value> = cfg
        .providers
        .iter()
        .map(|(name, p)| {
            (
                name.clone(),
                match p {
                    Ok(p) => {
                        let mut v = json!({"kind": p.kind()});
                        if let Some(c) = p.common() {
                            v["service"] = service_found(cfg, &c.service);
                        }
                        v
                    }
                    Err(e) => json!({"error": e}),
                },
            )
        })
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

/// The private members of a JWK (RFC 7518 6.2.2, 6.3.2; `k` of a symmetric key, 6.4.1).
const PRIVATE_JWK_MEMBERS: [&str; 8] = ["d", "p", "q", "dp", "dq", "qi", "oth", "k"];

/// Inline JWKS (`jwtRules[].jwks`, a JSON string) as the dump shows them: keys' public
/// members only, since an `oct` key or a private key pasted in by mistake is a secret
/// that the admin endpoint must not hand out. One that does not parse is withheld whole.
fn redact_inline_jwks(authns: &mut Value) {
    let rules = authns
        .as_array_mut()
        .into_iter()
        .flatten()
        .filter_map(|a| a.get_mut("jwtRules")?.as_array_mut())
        .flatten();
    for rule in rules {
        let Some(text) = rule.get("jwks").and_then(Value::as_str) else {
            continue;
        };
        let shown = match serde_json::from_str::<Value>(text) {
            Ok(mut set) => {
                for key in set
                    .get_mut("keys")
                    .and_then(Value::as_array_mut)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_object_mut)
                {
                    for m in PRIVATE_JWK_MEMBERS {
                        if key.contains_key(m) {
                            key.insert(m.to_string(), json!("<redacted>"));
                        }
                    }
                }
                set.to_string()
            }
            Err(_) => "<redacted>".to_string(),
        };
        rule["jwks"] = json!(shown);
    }
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

    /// The dump of `cfg` for waypoint `wp` (default/waypoint at 10.0.0.9), with a
    /// certificate from a CA made for the test (`tag` names its directory).
    fn dump_of(cfg: &Config, tag: &str) -> Value {
        let dir = std::env::temp_dir().join(format!("wp-dump-{tag}-{}", std::process::id()));
        let ca = ztunnel::identity::ca::Ca::load_or_create(&dir, None, None).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let certs = CertManager::new(std::sync::Arc::new(ztunnel::identity::manager::LocalCa {
            ca,
            ttl: std::time::Duration::from_secs(60),
        }));
        let me = Me {
            identity: Identity::new("cluster.local", "default", "waypoint"),
            gateway: ObjectName {
                namespace: "default".into(),
                name: "waypoint".into(),
            },
            workload_uid: "wp".into(),
            ip: "10.0.0.9".parse().unwrap(),
            root_namespace: "istio-system".into(),
        };
        certs.allow(&me.identity);
        config_dump(&me, cfg, &certs, json!({"adminAddr": "x"}))
    }

    #[test]
    fn ztunnels_document_and_the_waypoints_part() {
        let cfg = Config::parse(
            std::path::Path::new("wp.yaml"),
            "workloads:\n- {uid: wp, name: wp, namespace: default, serviceAccount: waypoint, workloadIps: [10.0.0.9]}\n\
             httpRoutes:\n- {name: echo, namespace: default, parentRefs: [{kind: Service, group: \"\", name: echo}]}\n\
             authorizationPolicies:\n- {name: deny, namespace: istio-system, action: DENY, targetRefs: [{kind: GatewayClass, name: istio-waypoint}], rules: [{}]}\n",
        )
        .unwrap();
        let d = dump_of(&cfg, "main");
        assert_eq!(d["waypoint"]["gateway"], "default/waypoint");
        assert_eq!(d["waypoint"]["configSource"], "file wp.yaml");
        assert_eq!(d["httpRoutes"][0]["name"], "echo");
        assert_eq!(
            d["authorizationPolicies"][0]["targetRefs"][0]["kind"],
            "GatewayClass"
        );
        assert_eq!(d["requestAuthentications"], json!([]));
        assert_eq!(d["workloads"][0]["uid"], "wp");
        assert_eq!(
            d["certificates"][0]["identity"],
            "spiffe://cluster.local/ns/default/sa/waypoint"
        );
        assert_eq!(d["config"]["adminAddr"], "x");
        assert!(d["version"]["version"].is_string());
    }

    #[test]
    fn inline_jwks_show_public_members_only() {
        let set = json!({"keys": [{"kty": "oct", "kid": "s", "k": "c2VjcmV0"}, {"kty": "EC", "crv": "P-256", "x": "X", "y": "Y", "d": "D"}]}).to_string();
        let mut a = json!([{"name": "jwt", "jwtRules": [{"issuer": "i", "jwks": set}, {"issuer": "j", "jwks": "{not json"}, {"issuer": "k", "jwksUri": "https://x"}]}]);
        redact_inline_jwks(&mut a);
        let rules = &a[0]["jwtRules"];
        let shown: Value = serde_json::from_str(rules[0]["jwks"].as_str().unwrap()).unwrap();
        assert_eq!(
            shown["keys"][0],
            json!({"kty": "oct", "kid": "s", "k": "<redacted>"})
        );
        assert_eq!(
            shown["keys"][1],
            json!({"kty": "EC", "crv": "P-256", "x": "X", "y": "Y", "d": "<redacted>"})
        );
        assert_eq!(rules[1]["jwks"], "<redacted>");
        assert_eq!(rules[2], json!({"issuer": "k", "jwksUri": "https://x"}));
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
        let d = dump_of(&cfg, "amb");
        let p = &d["extensionProviders"];
        assert!(
            p["bare"]["service"]["error"]
                .as_str()
                .unwrap_or_default()
                .contains("multiple namespaces"),
            "{p}"
        );
        assert_eq!(p["named"]["service"]["found"], "sec/authz.example.com");
        assert_eq!(
            p["local"]["service"]["found"],
            "sec/ext.sec.svc.cluster.local"
        );
    }
}
