//! What the waypoint reads from Istio's mesh config (the root namespace's `istio`
//! ConfigMap, key `mesh`): extensionProviders, tracing, defaultHttpRetryPolicy.

use std::sync::Arc;

use kube::api::DynamicObject;
use serde_json::{json, Map, Value};

/// The mesh config's defaultHttpRetryPolicy, and what the admin endpoint shows of it.
/// One that does not convert is logged and Istio's own default applies (retries are
/// no policy: the waypoint does not fail every route for them).
pub(super) fn mesh_default_retry(mesh: Option<&Value>) -> (Option<crate::route::MeshRetry>, Value) {
    match crate::route::mesh_default_retry(mesh) {
        Ok(r) => {
            let dump = mesh
                .and_then(|m| m.get("defaultHttpRetryPolicy"))
                .cloned()
                .unwrap_or(Value::Null);
            (r, dump)
        }
        Err(e) => {
            tracing::error!(error = %e, "mesh config defaultHttpRetryPolicy cannot be applied; routes without a retry policy get Istio's default");
            (None, json!({"error": e.to_string()}))
        }
    }
}

/// The extensionProviders of the mesh config's ConfigMap (key `mesh`, Istio's MeshConfig
/// YAML), each checked, and what the admin endpoint shows of them. A ConfigMap that
/// does not parse gives none, so every CUSTOM policy denies what it matches.
/// The mesh config's tracing (off when there is none, or it is invalid: logged).
pub(super) fn mesh_tracing(
    obj: Option<&DynamicObject>,
) -> Option<Arc<crate::trace::TraceSettings>> {
    let text = obj?.data.pointer("/data/mesh").and_then(Value::as_str)?;
    let mesh: Value = serde_yaml::from_str(text).ok()?;
    match crate::trace::settings(&mesh) {
        Ok(t) => t.map(Arc::new),
        Err(e) => {
            tracing::error!(error = %e, "mesh config tracing is invalid; requests are not traced");
            None
        }
    }
}

pub(super) fn mesh_providers(
    obj: Option<&DynamicObject>,
    root_namespace: &str,
    config_map: &str,
) -> (crate::extauthz::Providers, Value) {
    let source = format!("ConfigMap {}/{} key mesh", root_namespace, config_map);
    let Some(obj) = obj else {
        return (
            Default::default(),
            json!({"source": source, "error": "not found (or not readable): CUSTOM policies deny what they match"}),
        );
    };
    let text = obj
        .data
        .pointer("/data/mesh")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let parsed = serde_yaml::from_str::<Option<crate::extauthz::MeshConfig>>(text)
        .map_err(|e| e.to_string())
        .and_then(|m| {
            crate::extauthz::provider::parse_all(&m.unwrap_or_default().extension_providers)
        });
    match parsed {
        Ok(providers) => {
            let dump: Map<String, Value> = providers
                .iter()
                .map(|(name, p)| {
                    (
                        name.clone(),
                        match p {
                            Ok(p) => json!({"kind": p.kind()}),
                            Err(e) => json!({"error": e}),
                        },
                    )
                })
                .collect();
            for (name, e) in providers
                .iter()
                .filter_map(|(n, p)| Some((n, p.as_ref().err()?)))
            {
                tracing::error!(provider = %name, error = %e, source = %source, "extensionProvider is invalid; CUSTOM policies naming it deny what they match");
            }
            (
                Arc::new(providers),
                json!({"source": source, "providers": dump}),
            )
        }
        Err(e) => {
            tracing::error!(error = %e, source = %source, "mesh config does not parse; CUSTOM policies deny what they match");
            (Default::default(), json!({"source": source, "error": e}))
        }
    }
}
