//! The mesh Service a mesh config names for the waypoint's own calls (an ext_authz
//! provider's `service`, a tracing provider's), as Istio's `LookupCluster` finds it:
//! `<namespace>/<hostname>` names the namespace; a bare hostname must exist in one
//! namespace only, since any tenant may declare a ServiceEntry for any hostname in its
//! own namespace and would otherwise receive other tenants' headers and bodies (and
//! answer "allow"). Stricter than Istio in one way: a `<name>.<namespace>.svc.<domain>`
//! hostname is a Kubernetes Service's and is only taken from that namespace.

use std::sync::Arc;

use ztunnel::state::{MeshState, NamespacedHostname, Service};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LookupError {
    #[error("the service name is empty")]
    Empty,
    #[error("could not find service {0} in the mesh state")]
    NotFound(String),
    #[error("found {host} in multiple namespaces {namespaces:?}, specify the namespace explicitly in the format of <Namespace>/<Hostname>")]
    Ambiguous {
        host: String,
        namespaces: Vec<String>,
    },
}

/// The namespace a `<name>.<namespace>.svc.<domain>` hostname belongs to.
fn cluster_local_namespace(host: &str) -> Option<&str> {
    let mut labels = host.split('.');
    let (name, ns, svc) = (labels.next()?, labels.next()?, labels.next()?);
    let domain = labels.next()?;
    (!name.is_empty() && !ns.is_empty() && svc == "svc" && !domain.is_empty()).then_some(ns)
}

/// The Service `name` (`[<namespace>/]<hostname>`) names, or why there is none.
pub fn provider_service<'s>(
    state: &'s MeshState,
    name: &str,
) -> Result<&'s Arc<Service>, LookupError> {
    if name.is_empty() {
        return Err(LookupError::Empty);
    }
    let not_found = || LookupError::NotFound(name.to_string());
    if let Some((ns, host)) = name.split_once('/') {
        if ns.is_empty() || host.is_empty() || host.contains('/') {
            return Err(not_found());
        }
        return state
            .service_by_hostname(&NamespacedHostname(format!("{ns}/{host}")))
            .ok_or_else(not_found);
    }
    if let Some(ns) = cluster_local_namespace(name) {
        return state
            .service_by_hostname(&NamespacedHostname(format!("{ns}/{name}")))
            .ok_or_else(not_found);
    }
    let mut found: Vec<&Arc<Service>> = state
        .services()
        .filter(|s| s.hostname.eq_ignore_ascii_case(name))
        .collect();
    match found.len() {
        0 => Err(not_found()),
        1 => Ok(found[0]),
        _ => {
            found.sort_by(|a, b| a.namespace.cmp(&b.namespace));
            let mut namespaces: Vec<String> = found.iter().map(|s| s.namespace.clone()).collect();
            namespaces.dedup();
            Err(LookupError::Ambiguous {
                host: name.to_string(),
                namespaces,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(services: &str) -> MeshState {
        let services: Vec<Service> = serde_yaml::from_str(services).expect("services");
        MeshState::build(Vec::new(), services, Vec::new()).expect("state")
    }

    /// A tenant's ServiceEntry for another tenant's authorizer hostname, in its own
    /// namespace, never receives the checks: a `.svc.` name is its namespace's, a bare
    /// external name in two namespaces is refused, `ns/host` picks one.
    #[test]
    fn another_namespace_cannot_capture_a_providers_service() {
        let st = state(
            "- {name: ext-authz, namespace: foo, hostname: ext-authz.foo.svc.cluster.local}\n\
             - {name: evil, namespace: evil, hostname: ext-authz.foo.svc.cluster.local}\n\
             - {name: authz, namespace: sec, hostname: authz.example.com}\n\
             - {name: authz, namespace: evil, hostname: authz.example.com}\n\
             - {name: only, namespace: evil, hostname: squat.bar.svc.cluster.local}\n\
             - {name: one, namespace: ops, hostname: collector.example.com}\n",
        );
        let ns = |r: Result<&Arc<Service>, LookupError>| r.map(|s| s.namespace.clone());
        for _ in 0..8 {
            // The old lookup took the first in hash order: never the other tenant's.
            assert_eq!(
                ns(provider_service(&st, "ext-authz.foo.svc.cluster.local")),
                Ok("foo".to_string())
            );
        }
        assert_eq!(
            provider_service(&st, "authz.example.com").map(|s| s.namespace.clone()),
            Err(LookupError::Ambiguous {
                host: "authz.example.com".into(),
                namespaces: vec!["evil".into(), "sec".into()]
            })
        );
        assert_eq!(
            ns(provider_service(&st, "sec/authz.example.com")),
            Ok("sec".to_string())
        );
        // A `.svc.` name that only another namespace declares is not found.
        assert!(matches!(
            provider_service(&st, "squat.bar.svc.cluster.local"),
            Err(LookupError::NotFound(_))
        ));
        assert_eq!(
            ns(provider_service(&st, "collector.example.com")),
            Ok("ops".to_string())
        );
        assert!(matches!(
            provider_service(&st, "a/b/c"),
            Err(LookupError::NotFound(_))
        ));
        assert_eq!(
            provider_service(&st, "").map(|_| ()),
            Err(LookupError::Empty)
        );
    }
}
