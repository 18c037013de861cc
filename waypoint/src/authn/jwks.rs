//! JWKS from `jwksUri` (or found by OpenID discovery from the issuer): fetched by the waypoint itself (Istio's istiod fetches them and
//! inlines them into Envoy's config), with a timeout, refreshed every
//! `JwksSettings::refresh`, retried sooner after a failure. A failed refresh keeps the
//! last good keys; until the first fetch succeeds the store has none for that URI, so
//! tokens that need them fail (as Istio's, which inlines a key set that matches nothing).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use http::header::{ACCEPT, HOST};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use jsonwebtoken::jwk::JwkSet;
use tokio::io::{AsyncRead, AsyncWrite};

use super::model::DISCOVERY_PREFIX;

/// A key set larger than this is refused (real ones are a few kB).
const MAX_JWKS_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    #[error("invalid jwksUri {0:?}")]
    Uri(String),
    #[error("connect: {0}")]
    Connect(#[source] std::io::Error),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("HTTP: {0}")]
    Http(#[from] hyper::Error),
    #[error("the server answered {0}")]
    Status(u16),
    #[error("body: {0}")]
    Body(String),
    #[error("not a JSON Web Key Set: {0}")]
    Parse(#[from] serde_json::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

#[derive(Clone, Copy, Debug)]
pub struct JwksSettings {
    /// How often a fetched key set is fetched again (Istio: 20 minutes).
    pub refresh: Duration,
    /// The first retry after a failed fetch; each further failure doubles it, up to `refresh`.
    pub retry: Duration,
}

impl Default for JwksSettings {
    fn default() -> Self {
        JwksSettings {
            refresh: Duration::from_secs(20 * 60),
            retry: Duration::from_secs(1),
        }
    }
}

struct Entry {
    keys: Arc<ArcSwapOption<JwkSet>>,
    timeout: Duration,
    task: tokio::task::AbortHandle,
}

/// The key sets of every `jwksUri` in the config, each kept fresh by its own task.
pub struct JwksStore {
    settings: JwksSettings,
    entries: Mutex<HashMap<String, Entry>>,
}

impl JwksStore {
    pub fn new(settings: JwksSettings) -> Arc<JwksStore> {
        Arc::new(JwksStore {
            settings,
            entries: Mutex::new(HashMap::new()),
        })
    }

    /// The last good key set of `uri`; None before the first fetch succeeded (or for a
    /// URI not in the config).
    pub fn keys(&self, uri: &str) -> Option<Arc<JwkSet>> {
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.get(uri).and_then(|e| e.keys.load_full())
    }

    /// Makes the store fetch exactly these URIs (with their fetch timeouts): new ones
    /// start fetching now, ones no longer wanted stop. Needs a Tokio runtime.
    pub fn sync(self: &Arc<Self>, wanted: impl IntoIterator<Item = (String, Duration)>) {
        let wanted: HashMap<String, Duration> = wanted.into_iter().collect();
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.retain(|uri, e| {
            let keep = wanted.get(uri) == Some(&e.timeout);
            if !keep {
                e.task.abort();
            }
            keep
        });
        for (uri, timeout) in wanted {
            if entries.contains_key(&uri) {
                continue;
            }
            let keys = Arc::new(ArcSwapOption::empty());
            let task = tokio::spawn(refresh(uri.clone(), timeout, self.settings, keys.clone()))
                .abort_handle();
            entries.insert(
                uri,
                Entry {
                    keys,
                    timeout,
                    task,
                },
            );
        }
    }
}

impl Drop for JwksStore {
    fn drop(&mut self) {
        for e in self
            .entries
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            e.task.abort();
        }
    }
}

async fn refresh(
    uri: String,
    timeout: Duration,
    settings: JwksSettings,
    keys: Arc<ArcSwapOption<JwkSet>>,
) {
    let mut retry = settings.retry;
    loop {
        let fetched = match uri.strip_prefix(DISCOVERY_PREFIX) {
            Some(issuer) => discover(issuer, timeout).await,
            None => fetch(&uri, timeout).await,
        };
        match fetched {
            Ok(set) => {
                tracing::info!(jwks_uri = %uri, keys = set.keys.len(), "JWKS fetched");
                keys.store(Some(Arc::new(set)));
                retry = settings.retry;
                tokio::time::sleep(settings.refresh).await;
            }
            Err(e) => {
                let kept = keys.load().is_some();
                tracing::warn!(jwks_uri = %uri, error = %e, kept_last_good_keys = kept, retry_in = ?retry, "JWKS fetch failed");
                tokio::time::sleep(retry).await;
                retry = (retry * 2).min(settings.refresh);
            }
        }
    }
}

/// OpenID discovery, as Istio's: `<issuer>/.well-known/openid-configuration` names the
/// `jwks_uri`, then that is fetched (each GET within `timeout`).
pub async fn discover(issuer: &str, timeout: Duration) -> Result<JwkSet, JwksError> {
    #[derive(serde::Deserialize)]
    struct OpenIdConfiguration {
        jwks_uri: String,
    }
    let url = format!(
        "{}/.well-known/openid-configuration",
        issuer.trim_end_matches('/')
    );
    let cfg: OpenIdConfiguration = serde_json::from_slice(&get_url(&url, timeout).await?)?;
    fetch(&cfg.jwks_uri, timeout).await
}

/// One GET of a key set, over plain HTTP or HTTPS (the system's roots), within `timeout`.
pub async fn fetch(uri: &str, timeout: Duration) -> Result<JwkSet, JwksError> {
    Ok(serde_json::from_slice(&get_url(uri, timeout).await?)?)
}

async fn get_url(uri: &str, timeout: Duration) -> Result<Bytes, JwksError> {
    let bad = || JwksError::Uri(uri.to_string());
    let parsed: http::Uri = uri.parse().map_err(|_| bad())?;
    let https = match parsed.scheme_str() {
        Some("https") => true,
        Some("http") => false,
        _ => return Err(bad()),
    };
    let host = parsed
        .host()
        .ok_or_else(bad)?
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let port = parsed.port_u16().unwrap_or(if https { 443 } else { 80 });
    let authority = parsed.authority().ok_or_else(bad)?.as_str().to_string();
    let path = parsed
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let body = tokio::time::timeout(timeout, async {
        let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(JwksError::Connect)?;
        if https {
            let name = rustls::pki_types::ServerName::try_from(host.clone())
                .map_err(|e| JwksError::Tls(e.to_string()))?;
            let tls = tokio_rustls::TlsConnector::from(client_config()?)
                .connect(name, tcp)
                .await
                .map_err(|e| JwksError::Tls(e.to_string()))?;
            get(tls, &authority, &path).await
        } else {
            get(tcp, &authority, &path).await
        }
    })
    .await
    .map_err(|_| JwksError::Timeout(timeout))??;
    Ok(body)
}

async fn get<IO: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    io: IO,
    authority: &str,
    path: &str,
) -> Result<Bytes, JwksError> {
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "JWKS connection ended with an error");
        }
    });
    let req = http::Request::get(path)
        .header(HOST, authority)
        .header(ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|e| JwksError::Body(e.to_string()))?;
    let resp = sender.send_request(req).await?;
    if resp.status() != http::StatusCode::OK {
        return Err(JwksError::Status(resp.status().as_u16()));
    }
    let body = Limited::new(resp.into_body(), MAX_JWKS_BYTES)
        .collect()
        .await
        .map_err(|e| JwksError::Body(e.to_string()))?;
    Ok(body.to_bytes())
}

/// TLS to JWKS servers: the system's roots, ring as everywhere else; built once.
fn client_config() -> Result<Arc<rustls::ClientConfig>, JwksError> {
    static CONFIG: OnceLock<Result<Arc<rustls::ClientConfig>, String>> = OnceLock::new();
    CONFIG
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            for e in &found.errors {
                tracing::warn!(error = %e, "cannot load some system root certificates");
            }
            let (added, _ignored) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err("no system root certificates".to_string());
            }
            let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
                rustls::crypto::ring::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
            cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
            Ok(Arc::new(cfg))
        })
        .clone()
        .map_err(JwksError::Tls)
}

#[cfg(test)]
mod tests {
    use super::*;

    const JWKS: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","kid":"a","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;

    /// A server that answers the first `good` requests with the key set, then fails.
    async fn server(good: usize) -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let h = hits.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let n = h.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let resp = if n < good {
                    format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{JWKS}", JWKS.len())
                } else {
                    "HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_string()
                };
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        (addr, hits)
    }

    #[tokio::test]
    async fn fetches_and_keeps_the_last_good_keys() {
        let (addr, hits) = server(1).await;
        let uri = format!("http://{addr}/jwks.json");
        let store = JwksStore::new(JwksSettings {
            refresh: Duration::from_millis(50),
            retry: Duration::from_millis(20),
        });
        assert!(store.keys(&uri).is_none());
        store.sync([(uri.clone(), Duration::from_secs(2))]);
        for _ in 0..100 {
            if hits.load(std::sync::atomic::Ordering::SeqCst) >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            hits.load(std::sync::atomic::Ordering::SeqCst) >= 3,
            "refreshed and retried"
        );
        // Refreshes fail from the second on: the first key set stays.
        assert_eq!(store.keys(&uri).map(|k| k.keys.len()), Some(1));
        // No longer in the config: forgotten.
        store.sync([]);
        assert!(store.keys(&uri).is_none());
    }

    /// OpenID discovery: the issuer's configuration names the key set's URL.
    #[tokio::test]
    async fn discovers_the_jwks_uri_from_the_issuer() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let body = if head.starts_with("GET /idp/.well-known/openid-configuration ") {
                    format!(r#"{{"issuer":"http://{addr}/idp","jwks_uri":"http://{addr}/keys"}}"#)
                } else if head.starts_with("GET /keys ") {
                    JWKS.to_string()
                } else {
                    String::new()
                };
                let status = if body.is_empty() {
                    "404 Not Found"
                } else {
                    "200 OK"
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        });
        let set = discover(&format!("http://{addr}/idp/"), Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(set.keys.len(), 1);
        assert!(matches!(
            discover(&format!("http://{addr}/other"), Duration::from_secs(2)).await,
            Err(JwksError::Status(404))
        ));
    }

    #[tokio::test]
    async fn unreachable_or_bad_servers_fail_within_the_timeout() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        // Accepts and never answers.
        let start = std::time::Instant::now();
        let e = fetch(&format!("http://{addr}/"), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert!(matches!(e, JwksError::Timeout(_)), "{e}");
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(l);
        let (addr, _) = server(0).await;
        let e = fetch(&format!("http://{addr}/"), Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(e, JwksError::Status(503)), "{e}");
        assert!(matches!(
            fetch("ftp://x/", Duration::from_secs(1)).await,
            Err(JwksError::Uri(_))
        ));
    }
}
