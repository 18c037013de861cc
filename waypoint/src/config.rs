//! The waypoint's config: mesh state plus L7 routes and policies, from the local config
//! file (reloaded when it changes; a file that fails to load is reported and the previous
//! config stays in force) or, in a cluster, from istiod's state and the Kubernetes API.
//! Requests in flight keep the snapshot they began with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde::Deserialize;
use ztunnel::config::LocalConfig;
use ztunnel::state::MeshState;

use crate::authn::RequestAuthentication;
use crate::authz::AuthorizationPolicy;
use crate::destination::{DestinationRule, Resolved};
use crate::extauthz::{self, MeshConfig, Providers};
use crate::grant::ReferenceGrant;
use crate::k8s::L7Config;
use crate::labels::Labels;
use crate::route::{GrpcRoute, HttpRoute, L4Route, MeshRetry, TcpRoute, TlsRoute, VirtualService};
use crate::telemetry::{MeshProviders, Telemetries, Telemetry};
use crate::trace::TraceSettings;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read, or its mesh part (ztunnel's) is invalid.
    #[error(transparent)]
    Mesh(#[from] ztunnel::config::ConfigError),
    /// serde_yaml's message names the field path, line and column.
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_yaml::Error,
    },
    #[error("invalid config file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

pub struct Config {
    pub state: Arc<MeshState>,
    pub routes: Vec<HttpRoute>,
    /// TCPRoutes, each as an HTTPRoute with its one rule (`route::TcpRoute`).
    pub tcp_routes: Vec<HttpRoute>,
    /// VirtualServices' `tls` and `tcp` rules and TLSRoutes (`route::l4`).
    pub l4_routes: Vec<L4Route>,
    /// ReferenceGrants: which Services of other namespaces routes may send to.
    pub grants: Vec<ReferenceGrant>,
    /// DestinationRules with the policy each asks for (`destination`).
    pub destination_rules: Vec<(DestinationRule, Resolved)>,
    pub policies: Vec<AuthorizationPolicy>,
    pub authentications: Vec<RequestAuthentication>,
    /// The mesh config's extensionProviders (CUSTOM policies' authorizers), by name.
    pub providers: Providers,
    /// Request tracing (meshConfig defaultProviders.tracing), None when off.
    pub tracing: Option<Arc<TraceSettings>>,
    /// meshConfig.defaultHttpRetryPolicy: the retry policy of routes that set none (None:
    /// Istio's own default, `http::forward`).
    pub default_retry: Option<MeshRetry>,
    /// meshConfig.h2UpgradePolicy is UPGRADE: HTTP/1.1 ports get HTTP/2 upstream unless
    /// a DestinationRule says otherwise.
    pub h2_upgrade: bool,
    /// Workload labels (DestinationRule subsets): the file's, or the Pods' in a cluster.
    pub labels: Arc<Labels>,
    /// Telemetry API objects (access logging, metric and tracing overrides), compiled.
    pub telemetry: Arc<Telemetries>,
    /// The L7 part for the admin endpoint: the routes and policies as they were read
    /// (`httpRoutes`, `authorizationPolicies`) and where from (`source`); in a cluster
    /// also what was rejected and who uses the waypoint (see `k8s`).
    pub dump: Arc<serde_json::Value>,
}

/// The waypoint's part of the local config file: its L7 lists. The rest is
/// ztunnel's `LocalConfig`, which checks it (and only accepts these two).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct L7Lists {
    #[serde(default)]
    http_routes: Vec<HttpRoute>,
    #[serde(default)]
    grpc_routes: Vec<GrpcRoute>,
    #[serde(default)]
    tcp_routes: Vec<TcpRoute>,
    #[serde(default)]
    tls_routes: Vec<TlsRoute>,
    #[serde(default)]
    reference_grants: Vec<ReferenceGrant>,
    #[serde(default)]
    destination_rules: Vec<DestinationRule>,
    #[serde(default)]
    virtual_services: Vec<VirtualService>,
    #[serde(default)]
    authorization_policies: Vec<AuthorizationPolicy>,
    #[serde(default)]
    request_authentications: Vec<RequestAuthentication>,
    #[serde(default)]
    telemetries: Vec<Telemetry>,
    #[serde(default)]
    mesh_config: Option<serde_json::Value>,
}

/// The same lists as written, for the admin endpoint.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawL7Lists {
    #[serde(default)]
    http_routes: Vec<serde_json::Value>,
    #[serde(default)]
    grpc_routes: Vec<serde_json::Value>,
    #[serde(default)]
    tcp_routes: Vec<serde_json::Value>,
    #[serde(default)]
    tls_routes: Vec<serde_json::Value>,
    #[serde(default)]
    reference_grants: Vec<serde_json::Value>,
    #[serde(default)]
    destination_rules: Vec<serde_json::Value>,
    #[serde(default)]
    virtual_services: Vec<serde_json::Value>,
    #[serde(default)]
    authorization_policies: Vec<serde_json::Value>,
    #[serde(default)]
    request_authentications: Vec<serde_json::Value>,
    #[serde(default)]
    telemetries: Vec<serde_json::Value>,
    #[serde(default)]
    mesh_config: Option<serde_json::Value>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ztunnel::config::ConfigError::Read {
                path: path.to_path_buf(),
                source,
            })?;
        Config::parse(path, &text)
    }

    /// The mesh state and the L7 config of one version of the file (`path` names it in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let mesh = LocalConfig::parse(path, text)?;
        let mut l7: L7Lists = serde_yaml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        for (i, r) in l7.http_routes.iter().enumerate() {
            r.validate().map_err(|e| {
                invalid(format!(
                    "httpRoutes[{i}].{e} (HTTPRoute {}/{})",
                    r.namespace, r.name
                ))
            })?;
        }
        // A GRPCRoute is applied as the HTTPRoute it amounts to, after the HTTPRoutes.
        for (i, g) in l7.grpc_routes.iter().enumerate() {
            let r = g.to_http().map_err(|e| {
                invalid(format!(
                    "grpcRoutes[{i}].{e} (GRPCRoute {}/{})",
                    g.namespace, g.name
                ))
            })?;
            l7.http_routes.push(r);
        }
        // A VirtualService is applied as the HTTPRoute it amounts to, after the routes,
        // and its `tls` and `tcp` rules as an L4 route; a delegate (no hosts) only through
        // the roots that delegate to it.
        let mut l4_routes = Vec::new();
        for (i, v) in l7.virtual_services.iter().enumerate() {
            if v.is_delegate() {
                continue;
            }
            let (v, dropped) = crate::route::delegate::merged(v, |ns, name| {
                l7.virtual_services
                    .iter()
                    .find(|c| c.namespace == ns && c.name == name)
            });
            for why in dropped {
                tracing::warn!(kind = "VirtualService", namespace = %v.namespace, name = %v.name, reason = %why, "delegate rule dropped");
            }
            let r = v.routes().map_err(|e| {
                invalid(format!(
                    "virtualServices[{i}].{e} (VirtualService {}/{})",
                    v.namespace, v.name
                ))
            })?;
            l7.http_routes.extend(r.http);
            l4_routes.extend(r.l4);
        }
        for (i, t) in l7.tls_routes.iter().enumerate() {
            l4_routes.push(t.to_l4().map_err(|e| {
                invalid(format!(
                    "tlsRoutes[{i}].{e} (TLSRoute {}/{})",
                    t.namespace, t.name
                ))
            })?);
        }
        let mut tcp_routes = Vec::with_capacity(l7.tcp_routes.len());
        for (i, t) in l7.tcp_routes.iter().enumerate() {
            tcp_routes.push(t.to_http().map_err(|e| {
                invalid(format!(
                    "tcpRoutes[{i}].{e} (TCPRoute {}/{})",
                    t.namespace, t.name
                ))
            })?);
        }
        for (i, g) in l7.reference_grants.iter().enumerate() {
            g.validate().map_err(|e| {
                invalid(format!(
                    "referenceGrants[{i}].{e} (ReferenceGrant {}/{})",
                    g.namespace, g.name
                ))
            })?;
        }
        let mut destination_rules = Vec::with_capacity(l7.destination_rules.len());
        for (i, d) in l7.destination_rules.iter().enumerate() {
            let p = d.resolve().map_err(|e| {
                invalid(format!(
                    "destinationRules[{i}].{e} (DestinationRule {}/{})",
                    d.namespace, d.name
                ))
            })?;
            destination_rules.push((d.clone(), p));
        }
        for (i, p) in l7.authorization_policies.iter().enumerate() {
            p.validate().map_err(|e| {
                invalid(format!(
                    "authorizationPolicies[{i}].{e} (AuthorizationPolicy {}/{})",
                    p.namespace, p.name
                ))
            })?;
        }
        for (i, a) in l7.request_authentications.iter().enumerate() {
            a.validate().map_err(|e| {
                invalid(format!(
                    "requestAuthentications[{i}].{e} (RequestAuthentication {}/{})",
                    a.namespace, a.name
                ))
            })?;
        }
        let mesh_config: MeshConfig = match &l7.mesh_config {
            None => MeshConfig::default(),
            Some(v) => serde_json::from_value(v.clone())
                .map_err(|e| invalid(format!("meshConfig: {e}")))?,
        };
        // Principals follow meshConfig.trustDomain and its aliases, as istiod writes them.
        let trust_domains = mesh_config.trust_domain_bundle();
        for p in &mut l7.authorization_policies {
            trust_domains.apply(p);
        }
        // In the file every provider must be valid: a typo is the author's to fix now,
        // not a deny at the first request.
        let providers = extauthz::provider::parse_all(&mesh_config.extension_providers)
            .map_err(|e| invalid(format!("meshConfig.{e}")))?;
        let tracing = match &l7.mesh_config {
            Some(v) => crate::trace::settings(v)
                .map_err(|e| invalid(format!("meshConfig.{e}")))?
                .map(Arc::new),
            None => None,
        };
        let default_retry = crate::route::mesh_default_retry(l7.mesh_config.as_ref())
            .map_err(|e| invalid(format!("meshConfig.{e}")))?;
        if let Some((name, Err(e))) = providers.iter().find(|(_, p)| p.is_err()) {
            return Err(invalid(format!(
                "meshConfig.{e} (extensionProvider {name})"
            )));
        }
        let mesh_providers = MeshProviders::from_mesh(
            l7.mesh_config.as_ref(),
            tracing.as_ref().map(|t| t.provider.as_str()),
        );
        if let Some(e) = mesh_providers.errors().first() {
            return Err(invalid(e.clone()));
        }
        let mut telemetries = Vec::new();
        for (i, t) in l7.telemetries.iter().enumerate() {
            // A `selector` Telemetry is a workload proxy's, not the waypoint's.
            if t.is_workload_scoped() {
                continue;
            }
            telemetries.push(t.compile(&mesh_providers).map_err(|e| {
                invalid(format!(
                    "telemetries[{i}].{e} (Telemetry {}/{})",
                    t.namespace, t.name
                ))
            })?);
        }
        let raw: RawL7Lists = serde_yaml::from_str(text).map_err(|source| ConfigError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
        let dump = serde_json::json!({
            "source": format!("file {}", path.display()),
            "httpRoutes": raw.http_routes,
            "grpcRoutes": raw.grpc_routes,
            "tcpRoutes": raw.tcp_routes,
            "tlsRoutes": raw.tls_routes,
            "referenceGrants": raw.reference_grants,
            "destinationRules": raw.destination_rules,
            "virtualServices": raw.virtual_services,
            "authorizationPolicies": raw.authorization_policies,
            "requestAuthentications": raw.request_authentications,
            "telemetries": raw.telemetries,
            "meshConfig": raw.mesh_config,
        });
        Ok(Config {
            state: Arc::new(mesh.into_state(path)?),
            routes: l7.http_routes,
            tcp_routes,
            l4_routes,
            grants: l7.reference_grants,
            destination_rules,
            policies: l7.authorization_policies,
            authentications: l7.request_authentications,
            providers: Arc::new(providers),
            tracing,
            default_retry,
            h2_upgrade: crate::destination::connection::mesh_h2_upgrade(l7.mesh_config.as_ref()),
            labels: Arc::new(
                Labels::from_file(text).map_err(|source| ConfigError::Parse {
                    path: path.to_path_buf(),
                    source,
                })?,
            ),
            telemetry: Arc::new(Telemetries::new(telemetries, mesh_providers)),
            dump: Arc::new(dump),
        })
    }

    /// Every jwksUri the config's RequestAuthentications need fetched, with its timeout.
    /// (`openid:<issuer>` for one found by OpenID discovery).
    pub fn jwks_uris(&self) -> Vec<(String, Duration)> {
        let rules = self.authentications.iter().flat_map(|a| a.jwt_rules.iter());
        rules
            .filter_map(|r| r.jwks_source().map(|s| (s, r.fetch_timeout())))
            .collect()
    }

    /// In a cluster, before istiod and the Kubernetes API have said anything.
    pub fn empty(state: Arc<MeshState>) -> Config {
        let dump = serde_json::json!({ "source": "kubernetes", "httpRoutes": [], "grpcRoutes": [], "tcpRoutes": [], "tlsRoutes": [], "referenceGrants": [], "destinationRules": [], "virtualServices": [], "authorizationPolicies": [], "requestAuthentications": [], "telemetries": [] });
        Config {
            state,
            routes: Vec::new(),
            tcp_routes: Vec::new(),
            l4_routes: Vec::new(),
            grants: Vec::new(),
            destination_rules: Vec::new(),
            policies: Vec::new(),
            authentications: Vec::new(),
            providers: Providers::default(),
            tracing: None,
            default_retry: None,
            h2_upgrade: false,
            labels: Arc::default(),
            telemetry: Arc::default(),
            dump: Arc::new(dump),
        }
    }
}

/// Watches the file (see `ztunnel::config::watch_file`) and swaps in each new version
/// that loads. `on_change` sees every applied version.
pub async fn watch(
    path: PathBuf,
    current: Arc<ArcSwap<Config>>,
    interval: Duration,
    on_change: impl Fn(&Config) + Send + 'static,
) {
    ztunnel::config::watch_file(path.clone(), interval, || async {
        let p = path.clone();
        match tokio::task::spawn_blocking(move || Config::load(&p)).await {
            Ok(Ok(cfg)) => {
                tracing::info!(path = %path.display(), routes = cfg.routes.len(), policies = cfg.policies.len(), "config reloaded");
                on_change(&cfg);
                current.store(Arc::new(cfg));
            }
            Ok(Err(e)) => tracing::error!(error = %e, "config change rejected; keeping the previous config"),
            Err(e) => tracing::error!(error = %e, "config reload task failed"),
        }
    })
    .await
}

/// In a cluster: a new config whenever istiod's state or the Kubernetes objects change.
/// `labels` are the Pods', kept current by their own watch.
pub async fn combine(
    state: Arc<ztunnel::state::SharedState>,
    labels: Arc<Labels>,
    mut l7: tokio::sync::watch::Receiver<Option<Arc<L7Config>>>,
    current: Arc<ArcSwap<Config>>,
    on_change: impl Fn(&Config) + Send + 'static,
) {
    let mut changes = state.changes();
    loop {
        let l = l7.borrow_and_update().clone().unwrap_or_default();
        let dump = if l.dump.is_null() {
            Config::empty(state.load_full()).dump
        } else {
            l.dump.clone()
        };
        let cfg = Config {
            state: state.load_full(),
            routes: l.routes.clone(),
            tcp_routes: l.tcp_routes.clone(),
            l4_routes: l.l4_routes.clone(),
            grants: l.grants.clone(),
            destination_rules: l.destination_rules.clone(),
            policies: l.policies.clone(),
            authentications: l.authentications.clone(),
            providers: l.providers.clone(),
            tracing: l.tracing.clone(),
            default_retry: l.default_retry.clone(),
            h2_upgrade: l.h2_upgrade,
            labels: labels.clone(),
            telemetry: l.telemetry.clone(),
            dump,
        };
        on_change(&cfg);
        current.store(Arc::new(cfg));
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            r = l7.changed() => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MESH: &str =
        "workloads:\n- {uid: w, name: w, namespace: default, workloadIps: [10.0.0.1]}\n";
    const SVC: &str = "parentRefs: [{kind: Service, group: \"\", name: echo}]";

    fn err(l7: &str) -> String {
        match Config::parse(Path::new("/etc/mesh/l7.yaml"), &format!("{MESH}{l7}")) {
            Ok(_) => panic!("accepted: {l7}"),
            Err(e) => e.to_string(),
        }
    }

    /// meshConfig.defaultHttpRetryPolicy: Istio's HTTPRetry, the policy of routes that
    /// set none; `attempts: 0` turns retries off; a bad one refuses the file, named.
    #[test]
    fn mesh_default_retry_policy() {
        let cfg = Config::parse(
            Path::new("f.yaml"),
            &format!("{MESH}meshConfig:\n  defaultHttpRetryPolicy: {{attempts: 3, retryOn: 'gateway-error,429', perTryTimeout: 2s, backoff: 50ms}}\n"),
        )
        .unwrap();
        let d = cfg.default_retry.expect("policy");
        assert_eq!(
            (
                d.retry.attempts,
                d.retry.codes.clone(),
                d.retry.backoff,
                d.per_try_timeout
            ),
            (
                Some(3),
                vec![429, 502, 503, 504],
                Some(Duration::from_millis(50)),
                Some(Duration::from_secs(2))
            )
        );
        let off = Config::parse(
            Path::new("f.yaml"),
            &format!("{MESH}meshConfig: {{defaultHttpRetryPolicy: {{attempts: 0}}}}\n"),
        )
        .unwrap();
        assert_eq!(off.default_retry.map(|d| d.retry.attempts), Some(Some(0)));
        let unset =
            Config::parse(Path::new("f.yaml"), &format!("{MESH}meshConfig: {{}}\n")).unwrap();
        assert!(unset.default_retry.is_none(), "Istio's own default");
        // retryOn unset: Istio's defaultRetryOn (a failed connection; no 5xx answer).
        let dflt = Config::parse(
            Path::new("f.yaml"),
            &format!("{MESH}meshConfig: {{defaultHttpRetryPolicy: {{attempts: 1}}}}\n"),
        )
        .unwrap();
        assert_eq!(dflt.default_retry.map(|d| d.retry.codes), Some(vec![503]));
        for (bad, want) in [
            (
                "{attempts: 2, retryOn: sometimes}",
                "meshConfig.defaultHttpRetryPolicy.retryOn: \"sometimes\"",
            ),
            (
                "{attempts: 2, perTryTimeout: soon}",
                "defaultHttpRetryPolicy.perTryTimeout",
            ),
            (
                "{attempts: 2, retryRemoteLocalities: true}",
                "retryRemoteLocalities",
            ),
            ("{attempts: 2, tries: 3}", "unknown field `tries`"),
        ] {
            let e = err(&format!("meshConfig: {{defaultHttpRetryPolicy: {bad}}}\n"));
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn loads_mesh_and_l7() {
        let l7 = format!(
            "httpRoutes:\n- {{name: echo, namespace: default, {SVC}}}\nauthorizationPolicies:\n- {{name: p, namespace: default, targetRefs: [{{kind: Service, name: echo}}], rules: [{{}}]}}\n"
        );
        let cfg = Config::parse(Path::new("f.yaml"), &format!("{MESH}{l7}")).unwrap();
        assert_eq!(
            (
                cfg.routes.len(),
                cfg.policies.len(),
                cfg.state.workloads().count()
            ),
            (1, 1, 1)
        );
        // The admin endpoint shows them as written.
        assert_eq!(cfg.dump["httpRoutes"][0]["parentRefs"][0]["name"], "echo");
        assert_eq!(cfg.dump["authorizationPolicies"][0]["name"], "p");
        assert_eq!(cfg.dump["source"], "file f.yaml");
    }

    /// ztunnel accepts the L7 lists without reading them; the waypoint refuses a bad one
    /// with the file, the field path and (for what serde sees) the line.
    #[test]
    fn bad_l7_config_names_file_and_field() {
        let e = err(&format!("httpRoutes:\n- {{name: a, namespace: default, {SVC}, rules: [{{backendRef: [{{name: v1, port: 80}}]}}]}}\n"));
        assert!(e.starts_with("invalid config file /etc/mesh/l7.yaml: httpRoutes[0].rules[0]: unknown field `backendRef`"), "{e}");
        assert!(e.contains("line 4"), "{e}");
        let e = err(&format!("httpRoutes:\n- {{name: a, namespace: default, {SVC}, rules: [{{backendRefs: [{{name: v1}}]}}]}}\n"));
        assert!(e.starts_with("invalid config file /etc/mesh/l7.yaml: httpRoutes[0].rules[0].backendRefs[0].port: required"), "{e}");
        assert!(e.ends_with("(HTTPRoute default/a)"), "{e}");
        let e = err("authorizationPolicies:\n- name: p\n  namespace: default\n  targetRefs: [{kind: Service, name: echo}]\n  rules: [{from: [{source: {ipBlocks: [10.0.0.300]}}]}]\n");
        assert!(e.contains("/etc/mesh/l7.yaml: authorizationPolicies[0].rules[0].from[0].source.ipBlocks: invalid IP or CIDR"), "{e}");
        assert!(e.contains("line 7"), "{e}");
        let e = err("authorizationPolicies:\n- {name: p, namespace: default, targetRefs: [{kind: Service, name: echo}], rules: [{to: [{operation: {paths: ['/a/../admin']}}]}]}\n");
        assert!(e.contains("authorizationPolicies[0].rules[0].to[0].operation.paths[0]: \"/a/../admin\" is not in normalized form"), "{e}");
        assert!(e.ends_with("(AuthorizationPolicy default/p)"), "{e}");
    }

    #[test]
    fn request_authentications_load_and_name_their_jwks_uris() {
        let ra = "requestAuthentications:\n- {name: jwt, namespace: default, targetRefs: [{kind: Service, name: echo}], jwtRules: [{issuer: i, jwksUri: 'http://idp/jwks', timeout: 2s}]}\n";
        let cfg = Config::parse(Path::new("f.yaml"), &format!("{MESH}{ra}")).unwrap();
        assert_eq!(
            cfg.jwks_uris(),
            [("http://idp/jwks".to_string(), Duration::from_secs(2))]
        );
        assert_eq!(cfg.dump["requestAuthentications"][0]["name"], "jwt");
        let e = err("requestAuthentications:\n- {name: jwt, namespace: default, targetRefs: [{kind: Service, name: echo}], jwtRules: [{issuer: i}]}\n");
        assert!(
            e.contains("requestAuthentications[0].jwtRules[0].jwksUri: required unless")
                && e.ends_with("(RequestAuthentication default/jwt)"),
            "{e}"
        );
    }

    #[test]
    fn mesh_errors_are_ztunnels() {
        let Err(e) = Config::parse(
            Path::new("m.yaml"),
            "workloads:\n- {uid: w, name: w, namespace: default, workloadIPs: [10.0.0.1]}\n",
        ) else {
            panic!("accepted")
        };
        let e = e.to_string();
        assert!(
            e.contains("m.yaml") && e.contains("unknown field `workloadIPs`"),
            "{e}"
        );
    }
}
