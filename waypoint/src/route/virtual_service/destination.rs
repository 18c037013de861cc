//! A VirtualService destination (Istio's `Destination`) and the Services its hosts name,
//! shared by its `http`, `tls` and `tcp` routes.

use serde::Deserialize;

use super::super::model::{BackendRef, Filter};
use crate::object::ObjectRef;

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

impl VsDestination {
    /// The weighted backend it names, with `filters`; `at` names it in errors
    /// (`route[k].destination`). Istio: the only destination of a rule (`one`) takes
    /// everything whatever its weight; of several, those of weight 0 take nothing.
    pub(super) fn backend_ref(
        &self,
        weight: Option<u32>,
        one: bool,
        ns: &str,
        at: &str,
        filters: Vec<Filter>,
    ) -> Result<BackendRef, String> {
        if self.subset.as_deref() == Some("") {
            return Err(format!("{at}.subset: must not be empty"));
        }
        let (name, namespace) = service_ref(&self.host, ns)
            .ok_or_else(|| format!("{at}.host: {:?} is not a Kubernetes Service", self.host))?;
        let weight = match weight {
            None | Some(0) if one => 1,
            w => w.unwrap_or(0),
        };
        Ok(BackendRef {
            backend: ObjectRef {
                name,
                namespace: (namespace != ns).then_some(namespace),
                port: self.port.as_ref().map(|p| p.number),
                ..ObjectRef::default()
            },
            weight,
            filters,
            subset: self.subset.clone(),
        })
    }
}
