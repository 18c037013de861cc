//! A fake istiod for end-to-end tests: a real gRPC server over TLS (client certificates
//! verified when presented) serving delta ADS (`istio.workload.Address`,
//! `istio.security.Authorization`) and the Istio CA (`CreateCertificate`), both checking
//! the bearer token and cluster id as istiod does. Tests change its resources and watch
//! what the proxies ACK, NACK and ask for. It runs inside a network namespace of the
//! test topology and can be killed and restarted (same address, same CA).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result};
use prost::Message;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName,
    DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tonic::{Request, Response, Status, Streaming};
use ztunnel::xds::proto::envoy::service::discovery::v3::{
    aggregated_discovery_service_server::{
        AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
    },
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use ztunnel::xds::proto::istio::security as pb_sec;
use ztunnel::xds::proto::istio::v1::auth::{
    istio_certificate_service_server::{IstioCertificateService, IstioCertificateServiceServer},
    IstioCertificateRequest, IstioCertificateResponse,
};
use ztunnel::xds::proto::istio::workload as pb;
use ztunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

use crate::netsim::Netns;

pub const ISTIOD_SAN: &str = "istiod.istio-system.svc";
pub const TOKEN: &str = "token-for-ztunnel";
/// Where [`start_base_mesh`] runs the fake istiod (node 1).
pub const ISTIOD: &str = "10.0.0.1:15012";
/// The echo service of the base mesh ([`start_base_mesh`]).
pub const ECHO_VIP: [u8; 4] = [10, 96, 0, 10];
pub const ECHO: &str = "echo.default.svc.cluster.local";
pub const CLUSTER_ID: &str = "Kubernetes";

/// What a proxy sent on its xDS stream.
#[derive(Clone, Debug)]
pub struct Seen {
    pub type_url: String,
    pub nonce: String,
    pub nack: Option<String>,
    pub initial_versions: HashMap<String, String>,
    pub node_id: Option<String>,
    /// Identity in the client certificate of the connection, if any.
    pub client_identity: Option<String>,
    /// The node metadata of the request, if it had a node.
    pub node_metadata: Option<prost_types::Struct>,
    /// The stream's ASCII request headers (gRPC metadata).
    pub headers: HashMap<String, String>,
    /// When the request arrived (`bench scale` times pushes to their ACK).
    pub at: Instant,
}

/// A response istiod sent on a stream, as it was handed to the stream.
#[derive(Clone, Debug)]
pub struct Sent {
    pub type_url: String,
    pub nonce: String,
    pub resources: usize,
    pub removed: usize,
    pub at: Instant,
}

/// A request's ASCII gRPC metadata as name → value.
fn ascii_headers(m: &tonic::metadata::MetadataMap) -> HashMap<String, String> {
    m.iter()
        .filter_map(|kv| match kv {
            tonic::metadata::KeyAndValueRef::Ascii(k, v) => {
                Some((k.as_str().to_string(), v.to_str().ok()?.to_string()))
            }
            _ => None,
        })
        .collect()
}

/// A certificate the CA issued.
#[derive(Clone, Debug)]
pub struct Issued {
    pub identity: String,
    pub impersonated: Option<String>,
    pub validity_secs: i64,
    pub token: String,
    pub at: SystemTime,
    /// The request's ASCII headers.
    pub headers: HashMap<String, String>,
}

#[derive(Default)]
pub struct Resources {
    /// name -> (version, encoded resource): encoded, so a test can push malformed bytes.
    pub addresses: BTreeMap<String, (u64, Vec<u8>)>,
    pub authorizations: BTreeMap<String, (u64, Vec<u8>)>,
    next_version: u64,
    /// Authorizations are not sent while true (a proxy then lacks its first full state).
    pub hold_authorizations: bool,
    pub seen: Vec<Seen>,
    /// Every response, in order: with `seen`, what a proxy took to apply each one.
    pub sent: Vec<Sent>,
    pub issued: Vec<Issued>,
    /// Identities the CA answers with a certificate for someone else.
    pub wrong_identity_for: HashSet<String>,
    /// Identities whose certificate requests are accepted and never answered.
    pub stall_for: HashSet<String>,
    /// Tokens accepted (the current one); others get UNAUTHENTICATED.
    pub tokens: HashSet<String>,
}

impl Resources {
    fn bump(&mut self) -> u64 {
        self.next_version += 1;
        self.next_version
    }

    pub fn set_workload(&mut self, w: pb::Workload) {
        let v = self.bump();
        let name = w.uid.clone();
        let bytes = pb::Address {
            r#type: Some(pb::address::Type::Workload(w)),
        }
        .encode_to_vec();
        self.addresses.insert(name, (v, bytes));
    }

    pub fn set_service(&mut self, s: pb::Service) {
        let v = self.bump();
        let name = format!("{}/{}", s.namespace, s.hostname);
        let bytes = pb::Address {
            r#type: Some(pb::address::Type::Service(s)),
        }
        .encode_to_vec();
        self.addresses.insert(name, (v, bytes));
    }

    pub fn set_raw_address(&mut self, name: &str, bytes: Vec<u8>) {
        let v = self.bump();
        self.addresses.insert(name.to_string(), (v, bytes));
    }

    pub fn set_policy(&mut self, p: pb_sec::Authorization) {
        let v = self.bump();
        let name = format!("{}/{}", p.namespace, p.name);
        self.authorizations.insert(name, (v, p.encode_to_vec()));
    }

    pub fn remove_address(&mut self, name: &str) {
        self.addresses.remove(name);
    }

    pub fn remove_policy(&mut self, name: &str) {
        self.authorizations.remove(name);
    }

    pub fn issued_for(&self, identity: &str) -> usize {
        self.issued
            .iter()
            .filter(|i| i.identity == identity)
            .count()
    }

    pub fn nacks(&self) -> Vec<String> {
        self.seen.iter().filter_map(|s| s.nack.clone()).collect()
    }

    pub fn acks(&self, type_url: &str) -> usize {
        self.seen
            .iter()
            .filter(|s| s.type_url == type_url && !s.nonce.is_empty() && s.nack.is_none())
            .count()
    }
}

/// The mesh CA (root) and istiod's serving certificate, kept across restarts.
pub struct Pki {
    pub root_pem: String,
    pub root_path: PathBuf,
    root_key: KeyPair,
    root_params: CertificateParams,
    server_chain: Vec<rustls_pki_types::CertificateDer<'static>>,
    server_key: rustls_pki_types::PrivateKeyDer<'static>,
}

impl Pki {
    pub fn new(dir: &Path) -> Result<Pki> {
        let root_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut root_params = CertificateParams::default();
        root_params.distinguished_name = DistinguishedName::new();
        root_params
            .distinguished_name
            .push(DnType::OrganizationName, "cluster.local");
        root_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        root_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let root = root_params.self_signed(&root_key)?;
        let root_pem = root.pem();
        let root_path = dir.join("root-cert.pem");
        std::fs::write(&root_path, &root_pem)?;
        let issuer = Issuer::from_params(&root_params, &root_key);
        let server_key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)?;
        let mut sp = CertificateParams::new(vec![ISTIOD_SAN.to_string()])?;
        sp.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = sp.signed_by(&server_key, &issuer)?;
        let server_chain = vec![server.der().clone()];
        let server_key = rustls_pki_types::PrivateKeyDer::Pkcs8(server_key.serialize_der().into());
        Ok(Pki {
            root_pem,
            root_path,
            root_key,
            root_params,
            server_chain,
            server_key,
        })
    }

    fn sign(
        &self,
        csr_pem: &str,
        identity_override: Option<&str>,
        validity: Duration,
    ) -> Result<(String, String), String> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| format!("bad CSR: {e}"))?;
        let requested = csr
            .params
            .subject_alt_names
            .iter()
            .find_map(|s| match s {
                SanType::URI(u) => Some(u.to_string()),
                _ => None,
            })
            .ok_or("CSR without a URI SAN")?;
        if let Some(other) = identity_override {
            csr.params.subject_alt_names = vec![SanType::URI(
                other.to_string().try_into().map_err(|e| format!("{e}"))?,
            )];
        }
        let now = SystemTime::now();
        csr.params.not_before = (now - Duration::from_secs(60)).into();
        csr.params.not_after = (now + validity).into();
        csr.params.serial_number = Some(SerialNumber::from_slice(&rand::random::<[u8; 16]>()));
        csr.params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        csr.params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        csr.params.use_authority_key_identifier_extension = true;
        let issuer = Issuer::from_params(&self.root_params, &self.root_key);
        let cert = csr
            .signed_by(&issuer)
            .map_err(|e| format!("signing failed: {e}"))?;
        Ok((requested, cert.pem()))
    }

    fn server_tls(&self) -> Result<rustls::ServerConfig> {
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::pem::PemObject::pem_slice_iter(self.root_pem.as_bytes()) {
            roots.add(c?)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        // Client certificates are verified when presented; the token authenticates a
        // proxy that has none yet (its first certificate request).
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .allow_unauthenticated()
        .build()?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.server_chain.clone(), self.server_key.clone_key())?;
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(cfg)
    }
}

/// The identity in a connection's client certificate.
#[derive(Clone, Debug)]
struct Peer(Option<String>);

#[derive(Clone)]
struct Ads {
    res: Arc<Mutex<Resources>>,
    changed: watch::Receiver<u64>,
}

type ResponseStream =
    Pin<Box<dyn futures_util::Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

fn check_auth<T>(res: &Mutex<Resources>, req: &Request<T>) -> Result<String, Status> {
    let token = req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or_else(|| Status::unauthenticated("no bearer token"))?
        .to_string();
    if !res.lock().unwrap().tokens.contains(&token) {
        return Err(Status::unauthenticated(format!("unknown token {token:?}")));
    }
    if req
        .metadata()
        .get("clusterid")
        .and_then(|v| v.to_str().ok())
        != Some(CLUSTER_ID)
    {
        return Err(Status::unauthenticated("wrong or missing clusterid"));
    }
    Ok(token)
}

/// What one proxy holds of one type, by name and version.
#[derive(Default)]
struct ClientView {
    subscribed: bool,
    versions: HashMap<String, String>,
}

impl Ads {
    /// The delta between what the client holds and what we have.
    fn delta(
        &self,
        type_url: &str,
        view: &mut ClientView,
        nonce: &mut u64,
    ) -> Option<DeltaDiscoveryResponse> {
        let res = self.res.lock().unwrap();
        if type_url == AUTHORIZATION_TYPE && res.hold_authorizations {
            return None;
        }
        let source = if type_url == ADDRESS_TYPE {
            &res.addresses
        } else {
            &res.authorizations
        };
        let mut resources = Vec::new();
        for (name, (v, bytes)) in source {
            let v = v.to_string();
            if view.versions.get(name) != Some(&v) {
                resources.push(Resource {
                    name: name.clone(),
                    version: v.clone(),
                    resource: Some(prost_types::Any {
                        type_url: type_url.to_string(),
                        value: bytes.clone(),
                    }),
                    ..Default::default()
                });
                view.versions.insert(name.clone(), v);
            }
        }
        let removed: Vec<String> = view
            .versions
            .keys()
            .filter(|n| !source.contains_key(*n))
            .cloned()
            .collect();
        for n in &removed {
            view.versions.remove(n);
        }
        // The first response of a subscription is sent even when empty: it is the state.
        if resources.is_empty() && removed.is_empty() && view.subscribed {
            return None;
        }
        view.subscribed = true;
        *nonce += 1;
        let r = DeltaDiscoveryResponse {
            type_url: type_url.to_string(),
            resources,
            removed_resources: removed,
            nonce: nonce.to_string(),
            system_version_info: String::new(),
        };
        drop(res);
        let sent = Sent {
            type_url: r.type_url.clone(),
            nonce: r.nonce.clone(),
            resources: r.resources.len(),
            removed: r.removed_resources.len(),
            at: Instant::now(),
        };
        self.res.lock().unwrap().sent.push(sent);
        Some(r)
    }
}

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream = ResponseStream;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<ResponseStream>, Status> {
        check_auth(&self.res, &request)?;
        let peer = request
            .extensions()
            .get::<Peer>()
            .cloned()
            .unwrap_or(Peer(None));
        let headers = ascii_headers(request.metadata());
        let mut incoming = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<DeltaDiscoveryResponse, Status>>(16);
        let ads = self.clone();
        tokio::spawn(async move {
            let mut views: HashMap<String, ClientView> = HashMap::new();
            let mut changed = ads.changed.clone();
            let mut nonce = 0u64;
            loop {
                tokio::select! {
                    msg = incoming.message() => {
                        let Ok(Some(req)) = msg else { return };
                        ads.res.lock().unwrap().seen.push(Seen {
                            type_url: req.type_url.clone(),
                            nonce: req.response_nonce.clone(),
                            nack: req.error_detail.as_ref().map(|s| s.message.clone()),
                            initial_versions: req.initial_resource_versions.clone(),
                            node_id: req.node.as_ref().map(|n| n.id.clone()),
                            client_identity: peer.0.clone(),
                            node_metadata: req.node.as_ref().and_then(|n| n.metadata.clone()),
                            headers: headers.clone(),
                            at: Instant::now(),
                        });
                        if req.response_nonce.is_empty() {
                            // A subscription: the client's view starts from what it announces.
                            let view = views.entry(req.type_url.clone()).or_default();
                            view.versions = req.initial_resource_versions.clone();
                            if let Some(r) = ads.delta(&req.type_url, view, &mut nonce) {
                                if tx.send(Ok(r)).await.is_err() { return; }
                            }
                        }
                    }
                    r = changed.changed() => {
                        if r.is_err() { return; }
                        for (type_url, view) in views.iter_mut() {
                            if let Some(r) = ads.delta(type_url, view, &mut nonce) {
                                if tx.send(Ok(r)).await.is_err() { return; }
                            }
                        }
                    }
                }
            }
        });
        let stream =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        Ok(Response::new(Box::pin(stream)))
    }
}

#[derive(Clone)]
struct CaService {
    res: Arc<Mutex<Resources>>,
    pki: Arc<Pki>,
}

#[tonic::async_trait]
impl IstioCertificateService for CaService {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let token = check_auth(&self.res, &request)?;
        let headers = ascii_headers(request.metadata());
        let req = request.into_inner();
        let impersonated = req
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get("ImpersonatedIdentity"))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            });
        let csr_id = CertificateSigningRequestParams::from_pem(&req.csr)
            .ok()
            .and_then(|c| {
                c.params.subject_alt_names.iter().find_map(|s| match s {
                    SanType::URI(u) => Some(u.to_string()),
                    _ => None,
                })
            })
            .ok_or_else(|| Status::invalid_argument("CSR without a URI SAN"))?;
        if impersonated.as_ref().is_some_and(|i| *i != csr_id) {
            return Err(Status::permission_denied(
                "ImpersonatedIdentity differs from the CSR",
            ));
        }
        if self.res.lock().unwrap().stall_for.contains(&csr_id) {
            // A CA that took the request and never answers.
            std::future::pending::<()>().await;
        }
        let wrong = self
            .res
            .lock()
            .unwrap()
            .wrong_identity_for
            .contains(&csr_id)
            .then(|| "spiffe://cluster.local/ns/default/sa/someone-else".to_string());
        let validity =
            Duration::from_secs(u64::try_from(req.validity_duration).unwrap_or(3600).max(1));
        let (identity, leaf) = self
            .pki
            .sign(&req.csr, wrong.as_deref(), validity)
            .map_err(Status::invalid_argument)?;
        self.res.lock().unwrap().issued.push(Issued {
            identity,
            impersonated,
            validity_secs: req.validity_duration,
            token,
            at: SystemTime::now(),
            headers,
        });
        Ok(Response::new(IstioCertificateResponse {
            cert_chain: vec![leaf, self.pki.root_pem.clone()],
        }))
    }
}

pub struct FakeIstiod {
    pub res: Arc<Mutex<Resources>>,
    pub pki: Arc<Pki>,
    pub addr: SocketAddr,
    netns: Netns,
    changed: watch::Sender<u64>,
    server: Option<tokio::task::JoinHandle<()>>,
    conns: Arc<Mutex<JoinSet<()>>>,
}

impl Drop for FakeIstiod {
    fn drop(&mut self) {
        self.kill();
    }
}

impl FakeIstiod {
    /// Starts serving on `addr` inside `netns`; the root certificate goes to `dir`.
    pub fn start(netns: &Netns, addr: SocketAddr, dir: &Path) -> Result<FakeIstiod> {
        let pki = Arc::new(Pki::new(dir)?);
        let res = Arc::new(Mutex::new(Resources::default()));
        res.lock().unwrap().tokens.insert(TOKEN.to_string());
        let (changed, _) = watch::channel(0u64);
        let mut f = FakeIstiod {
            res,
            pki,
            addr,
            netns: netns.clone(),
            changed,
            server: None,
            conns: Default::default(),
        };
        f.restart()?;
        Ok(f)
    }

    /// Tells every open stream that resources changed.
    pub fn push(&self) {
        self.changed.send_modify(|v| *v += 1);
    }

    /// Changes resources and pushes the change.
    pub fn update(&self, f: impl FnOnce(&mut Resources)) {
        f(&mut self.res.lock().unwrap());
        self.push();
    }

    /// Drops the listener and every connection, as if istiod died.
    pub fn kill(&mut self) {
        if let Some(s) = self.server.take() {
            s.abort();
        }
        self.conns.lock().unwrap().abort_all();
    }

    /// Serves again on the same address with the same CA and resources.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let listener = self.netns.listen(self.addr.port())?;
        let tls = tokio_rustls::TlsAcceptor::from(Arc::new(self.pki.server_tls()?));
        let ads = AggregatedDiscoveryServiceServer::new(Ads {
            res: self.res.clone(),
            changed: self.changed.subscribe(),
        });
        let ca = IstioCertificateServiceServer::new(CaService {
            res: self.res.clone(),
            pki: self.pki.clone(),
        });
        let conns = self.conns.clone();
        self.server = Some(tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (tls, ads, ca) = (tls.clone(), ads.clone(), ca.clone());
                conns.lock().unwrap().spawn(async move {
                    let Ok(stream) = tls.accept(tcp).await else {
                        return;
                    };
                    let peer = Peer(
                        stream
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|c| ztunnel::tls::identity_from_cert(c).ok())
                            .map(|i| i.to_string()),
                    );
                    let svc = hyper::service::service_fn(
                        move |mut req: http::Request<hyper::body::Incoming>| {
                            req.extensions_mut().insert(peer.clone());
                            let (mut ads, mut ca) = (ads.clone(), ca.clone());
                            async move {
                                use tower::Service;
                                let resp = if req.uri().path().starts_with(
                                    "/envoy.service.discovery.v3.AggregatedDiscoveryService/",
                                ) {
                                    ads.call(req).await
                                } else {
                                    ca.call(req).await
                                };
                                Ok::<_, std::convert::Infallible>(
                                    resp.unwrap_or_else(|e| match e {}),
                                )
                            }
                        },
                    );
                    let _ = hyper_util::server::conn::auto::Builder::new(
                        hyper_util::rt::TokioExecutor::new(),
                    )
                    .http2_only()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), svc)
                    .await;
                });
            }
        }));
        Ok(())
    }

    /// Waits until `f` holds for the resources' record.
    pub async fn wait(
        &self,
        what: &str,
        timeout: Duration,
        f: impl Fn(&Resources) -> bool,
    ) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if f(&self.res.lock().unwrap()) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                let r = self.res.lock().unwrap();
                anyhow::bail!(
                    "timed out waiting for {what}; seen {:?}; issued {:?}",
                    r.seen,
                    r.issued
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Environment for a ztunnel (or waypoint) using this istiod.
    pub fn env(&self, token_path: &Path) -> Vec<(String, String)> {
        let url = format!("https://{}", self.addr);
        vec![
            ("XDS_ADDRESS".into(), url.clone()),
            ("CA_ADDRESS".into(), url),
            ("ALT_XDS_HOSTNAME".into(), ISTIOD_SAN.into()),
            ("ALT_CA_HOSTNAME".into(), ISTIOD_SAN.into()),
            (
                "XDS_ROOT_CA".into(),
                self.pki.root_path.display().to_string(),
            ),
            (
                "CA_ROOT_CA".into(),
                self.pki.root_path.display().to_string(),
            ),
            ("ISTIO_TOKEN_PATH".into(), token_path.display().to_string()),
            ("ISTIO_META_CLUSTER_ID".into(), CLUSTER_ID.into()),
        ]
    }
}

/// A workload as istiod describes a pod: uid `Kubernetes//Pod/default/<name>`; its
/// services by hostname (namespace default) or `<namespace>/<hostname>`.
pub fn pod_workload(
    name: &str,
    ip: impl Into<std::net::IpAddr>,
    node: usize,
    sa: &str,
    services: &[(&str, u32, u32)],
) -> pb::Workload {
    let address = match ip.into() {
        std::net::IpAddr::V4(a) => a.octets().to_vec(),
        std::net::IpAddr::V6(a) => a.octets().to_vec(),
    };
    pb::Workload {
        uid: pod_uid(name),
        name: name.into(),
        namespace: "default".into(),
        addresses: vec![address],
        tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
        service_account: sa.into(),
        node: format!("node{node}"),
        canonical_name: sa.into(),
        workload_name: sa.into(),
        cluster_id: CLUSTER_ID.into(),
        services: services
            .iter()
            .map(|(host, port, target)| {
                (
                    // `<namespace>/<hostname>`, or a hostname of namespace default.
                    if host.contains('/') {
                        host.to_string()
                    } else {
                        format!("default/{host}")
                    },
                    pb::PortList {
                        ports: vec![pb::Port {
                            service_port: *port,
                            target_port: *target,
                            app_protocol: 0,
                        }],
                    },
                )
            })
            .collect(),
        ..Default::default()
    }
}

pub fn pod_uid(name: &str) -> String {
    format!("{CLUSTER_ID}//Pod/default/{name}")
}

pub fn service(name: &str, vip: [u8; 4], port: u32, target: u32) -> pb::Service {
    pb::Service {
        name: name.into(),
        namespace: "default".into(),
        hostname: format!("{name}.default.svc.cluster.local"),
        addresses: vec![pb::NetworkAddress {
            network: String::new(),
            address: vip.to_vec(),
            length: None,
        }],
        ports: vec![pb::Port {
            service_port: port,
            target_port: target,
            app_protocol: 0,
        }],
        ..Default::default()
    }
}

/// An L4 policy: `action` for the listed principals, in namespace default.
pub fn principal_policy(
    name: &str,
    action: pb_sec::Action,
    principals: &[&str],
) -> pb_sec::Authorization {
    use pb_sec::string_match::MatchType;
    pb_sec::Authorization {
        name: name.into(),
        namespace: "default".into(),
        scope: pb_sec::Scope::Namespace as i32,
        action: action as i32,
        rules: vec![pb_sec::Rule {
            clauses: vec![pb_sec::Clause {
                matches: vec![pb_sec::Match {
                    principals: principals
                        .iter()
                        .map(|p| pb_sec::StringMatch {
                            match_type: Some(MatchType::Exact(p.to_string())),
                        })
                        .collect(),
                    ..Default::default()
                }],
            }],
        }],
        dry_run: false,
    }
}

/// Reads an HTTP/1.1 response from the readiness endpoint in `ns`.
pub async fn readiness(ns: &Netns, addr: SocketAddr) -> Result<(u16, String)> {
    http_get(ns, addr, "/healthz/ready").await
}

/// GET `path` on `addr` from inside `ns`: (status, body).
pub async fn http_get(ns: &Netns, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = ns.connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out))
        .await
        .with_context(|| format!("GET {path} timed out"))??;
    let text = String::from_utf8_lossy(&out).to_string();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Ok((code, body))
}

/// The fake istiod on node 1 with the mesh the xDS suite and the soak start from: n1p1
/// (sa sleep) on node 1, n2p1 (sa echo) on node 2 serving the echo service (80 -> 8080),
/// then `setup`'s changes; and the service-account token file ztunnel presents.
pub fn start_base_mesh(
    topo: &crate::netsim::Topology,
    setup: impl FnOnce(&mut Resources),
) -> Result<(FakeIstiod, PathBuf)> {
    let token = topo.dir.join("istio-token");
    std::fs::write(&token, TOKEN)?;
    let istiod = FakeIstiod::start(topo.node(1), ISTIOD.parse()?, &topo.dir)?;
    istiod.update(|r| {
        r.set_workload(pod_workload("n1p1", topo.pod("n1p1").ip, 1, "sleep", &[]));
        r.set_workload(pod_workload(
            "n2p1",
            topo.pod("n2p1").ip,
            2,
            "echo",
            &[(ECHO, 80, 8080)],
        ));
        r.set_service(service("echo", ECHO_VIP, 80, 8080));
        setup(r);
    });
    Ok((istiod, token))
}

/// A CNI agent stand-in (`ztunnel cni-server`) on node `n`, listening; returns it, its
/// pods directory (what `ztunnel enroll` writes to) and its ZDS socket.
pub fn start_cni_agent(
    topo: &crate::netsim::Topology,
    n: usize,
) -> Result<(crate::netsim::Child, PathBuf, PathBuf)> {
    let pods_dir = topo.dir.join(format!("pods-node{n}"));
    let socket = topo.dir.join(format!("zds-node{n}.sock"));
    let cni = topo.node(n).spawn(
        crate::bins::ztunnel(),
        &[
            "cni-server",
            "--socket",
            &socket.display().to_string(),
            "--pods-dir",
            &pods_dir.display().to_string(),
        ],
        &[("RUST_LOG", "info")],
        &topo.dir.join(format!("cni-node{n}.log")),
    )?;
    cni.wait_log("listening", crate::netsim::READY)?;
    Ok((cni, pods_dir, socket))
}
