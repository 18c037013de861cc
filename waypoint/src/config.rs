//! The waypoint's config: mesh state plus L7 routes and policies, from the local config
//! file (reloaded when it changes; a file that fails to load is reported and the previous
//! config stays in force) or, in a cluster, from istiod's state and the Kubernetes API.
//! Requests in flight keep the snapshot they began with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use ztunnel::config::{ConfigError, LocalConfig};
use ztunnel::l7::authz::AuthorizationPolicy;
use ztunnel::l7::route::HttpRoute;
use ztunnel::state::MeshState;

pub struct Config {
    pub state: Arc<MeshState>,
    pub routes: Vec<HttpRoute>,
    pub policies: Vec<AuthorizationPolicy>,
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let mut cfg = LocalConfig::load(path)?;
        let routes = std::mem::take(&mut cfg.http_routes);
        let policies = std::mem::take(&mut cfg.authorization_policies);
        Ok(Config { state: Arc::new(cfg.into_state(path)?), routes, policies })
    }
}

/// Watches the file (see `ztunnel::config::watch_file`) and swaps in each new version
/// that loads. `on_change` sees every applied version.
pub async fn watch(path: PathBuf, current: Arc<ArcSwap<Config>>, interval: Duration, on_change: impl Fn(&Config) + Send + 'static) {
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
pub async fn combine(
    state: Arc<ztunnel::state::SharedState>,
    mut l7: tokio::sync::watch::Receiver<Option<Arc<crate::k8s::L7Config>>>,
    current: Arc<ArcSwap<Config>>,
) {
    let mut changes = state.changes();
    loop {
        let l = l7.borrow_and_update().clone().unwrap_or_default();
        current.store(Arc::new(Config { state: state.load_full(), routes: l.routes.clone(), policies: l.policies.clone() }));
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            r = l7.changed() => if r.is_err() { return },
        }
    }
}
