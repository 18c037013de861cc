//! The functional end-to-end suites in one test binary, a module each; run one with a
//! filter: `cargo test -p mesh-tests --test e2e l4::` (or one test by its name).

mod dns;
mod ebpf_maps;
mod enrollment;
mod hostile;
mod istio;
mod istiod;
mod kube_apiserver;
mod l4;
mod waypoint;
mod xds;
