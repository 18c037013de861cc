//! SPIFFE identities (`spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`).

use std::fmt;
use std::str::FromStr;

pub const DEFAULT_TRUST_DOMAIN: &str = "cluster.local";
const SPIFFE_PREFIX: &str = "spiffe://";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum IdentityError {
    #[error("identity {0:?} is not a SPIFFE id: expected spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>")]
    Malformed(String),
    #[error("identity {0:?} contains a control character or NUL; refusing it")]
    ControlCharacter(String),
}

/// A workload identity. Only the Istio SPIFFE shape is accepted, so comparisons are
/// exact field comparisons and never pattern matches.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub trust_domain: String,
    pub namespace: String,
    pub service_account: String,
}

impl Identity {
    pub fn new(trust_domain: &str, namespace: &str, service_account: &str) -> Self {
        Identity {
            trust_domain: trust_domain.to_string(),
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
        }
    }

    /// The identity without the `spiffe://` scheme, as AuthorizationPolicy principals are written.
    pub fn principal(&self) -> String {
        format!(
            "{}/ns/{}/sa/{}",
            self.trust_domain, self.namespace, self.service_account
        )
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SPIFFE_PREFIX}{}", self.principal())
    }
}

impl FromStr for Identity {
    type Err = IdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.chars().any(|c| c.is_control()) {
            return Err(IdentityError::ControlCharacter(
                s.escape_debug().to_string(),
            ));
        }
        let malformed = || IdentityError::Malformed(s.to_string());
        let rest = s.strip_prefix(SPIFFE_PREFIX).ok_or_else(malformed)?;
        let parts: Vec<&str> = rest.split('/').collect();
        match parts.as_slice() {
            [td, "ns", ns, "sa", sa] if !td.is_empty() && !ns.is_empty() && !sa.is_empty() => {
                Ok(Identity::new(td, ns, sa))
            }
            _ => Err(malformed()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id: Identity = "spiffe://cluster.local/ns/default/sa/client"
            .parse()
            .unwrap();
        assert_eq!(id, Identity::new("cluster.local", "default", "client"));
        assert_eq!(
            id.to_string(),
            "spiffe://cluster.local/ns/default/sa/client"
        );
        assert_eq!(id.principal(), "cluster.local/ns/default/sa/client");
    }

    #[test]
    fn rejects_malformed_and_nul() {
        for bad in [
            "cluster.local/ns/a/sa/b",
            "spiffe://cluster.local/ns/a/sa/",
            "spiffe://cluster.local/ns/a/sa/b/extra",
            "spiffe://cluster.local/namespace/a/sa/b",
            "spiffe:///ns/a/sa/b",
        ] {
            assert!(
                matches!(bad.parse::<Identity>(), Err(IdentityError::Malformed(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            "spiffe://cluster.local/ns/a/sa/b\0evil".parse::<Identity>(),
            Err(IdentityError::ControlCharacter(_))
        ));
    }
}
