//! Support for the end-to-end suites (`tests/`) and the bench: a cluster simulated on
//! network namespaces, the binaries under test, fakes of istiod and the Kubernetes API,
//! test applications and (possibly hostile) mesh peers.

pub mod bins;
pub mod crl;
pub mod fake_istiod;
pub mod fake_kube;
pub mod h2_raw;
pub mod hbone_peer;
pub mod http_app;
pub mod istio_xds;
pub mod istiod;
pub mod json_schema;
pub mod jwt;
pub mod kube_apiserver;
pub mod netsim;
pub mod test_servers;
