//! A VirtualService destination (Istio's `Destination`) and the Services its hosts name,
//! shared by its `http`, `tls` and `tcp` routes.

use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VsDestination {
    pub host: String,
    #[serde(default)]
    pub subset: Option<String>,
    #[serde(default)]
    pub port: Option<VsPort>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsPort {
    pub number: u16,
}

/// `reviews` (in `ns`) or `reviews.<ns>.svc.<domain>`: the Service named, or None.
pub(super) fn service_ref(host: &str, ns: &str) -> Option<(String, String)> {
    if !host.contains('.') {
        return (!host.is_empty() && host != "*").then(|| (host.to_string(), ns.to_string()));
    }
    let mut labels = host.split('.');
    let (name, svc_ns, svc) = (labels.next()?, labels.next()?, labels.next()?);
    (svc == "svc" && !name.is_empty() && !svc_ns.is_empty())
        .then(|| (name.to_string(), svc_ns.to_string()))
}
