//! The names a query may stand for, as Istio's ztunnel expands them for a client pod in
//! namespace `ns` with cluster domain `cluster.local`:
//!
//! - the name as asked;
//! - its Kubernetes expansions, by the number of labels: `echo` → `echo.ns.svc.cluster.local`,
//!   `echo.other` → `echo.other.svc.cluster.local`, `echo.other.svc` →
//!   `echo.other.svc.cluster.local` (names of four labels or more are taken as they are);
//! - the name with one of the pod's search domains (`ns.svc.cluster.local`,
//!   `svc.cluster.local`, `cluster.local`) removed from its end, and that name's expansions.
//!   A resolver that appends search domains to a name that is already complete (`ndots:5`)
//!   gets its answer at once instead of after a round of NXDOMAINs; the answer is then a
//!   CNAME from the asked name to the stripped one, and the addresses under the stripped one.
//!
//! Every candidate is tried as it is, then as wildcards of decreasing specificity
//! (`a.b.c` → `*.b.c` → `*.c`), for services with wildcard hosts.
//!
//! Names here are lower-case ASCII without the trailing dot.

/// One candidate host for a query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    pub host: String,
    /// Set when the candidate came from removing a search domain: the name (without the
    /// search domain) that the answer's address records are under.
    pub stripped: Option<String>,
}

/// The Kubernetes search domains of a pod in `namespace`, most specific first.
pub fn search_domains(namespace: &str, cluster_domain: &str) -> [String; 3] {
    [
        format!("{namespace}.svc.{cluster_domain}"),
        format!("svc.{cluster_domain}"),
        cluster_domain.to_string(),
    ]
}

/// The Kubernetes service FQDNs a short name can expand to, from a pod in `namespace`.
pub fn kube_expansions(name: &str, namespace: &str, cluster_domain: &str) -> Option<String> {
    let labels: Vec<&str> = name.split('.').collect();
    match labels.as_slice() {
        [_] => Some(format!("{name}.{namespace}.svc.{cluster_domain}")),
        [_, _] => Some(format!("{name}.svc.{cluster_domain}")),
        [_, _, "svc"] => Some(format!("{name}.{cluster_domain}")),
        _ => None,
    }
}

/// `name` without `.{domain}` at its end, if it ends so and something is left.
pub fn strip_domain<'a>(name: &'a str, domain: &str) -> Option<&'a str> {
    let prefix = name.strip_suffix(domain)?.strip_suffix('.')?;
    (!prefix.is_empty()).then_some(prefix)
}

/// Every candidate for `name` asked by a pod in `namespace`, in the order they are tried,
/// without duplicates.
pub fn aliases(name: &str, namespace: &str, cluster_domain: &str) -> Vec<Alias> {
    let mut out: Vec<Alias> = Vec::new();
    let mut add = |host: String, stripped: Option<&str>| {
        if !out.iter().any(|a| a.host == host) {
            out.push(Alias {
                host,
                stripped: stripped.map(str::to_string),
            });
        }
    };
    add(name.to_string(), None);
    if let Some(fqdn) = kube_expansions(name, namespace, cluster_domain) {
        add(fqdn, None);
    }
    for domain in search_domains(namespace, cluster_domain) {
        if let Some(stripped) = strip_domain(name, &domain) {
            add(stripped.to_string(), Some(stripped));
            if let Some(fqdn) = kube_expansions(stripped, namespace, cluster_domain) {
                add(fqdn, Some(stripped));
            }
        }
    }
    out
}

/// `host`, then its wildcards from the most specific: `a.b.c`, `*.b.c`, `*.c`.
pub fn wildcards(host: &str) -> Vec<String> {
    let mut out = vec![host.to_string()];
    let mut rest = host;
    while let Some((_, r)) = rest.split_once('.') {
        out.push(format!("*.{r}"));
        rest = r;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(name: &str, ns: &str) -> Vec<(String, Option<String>)> {
        aliases(name, ns, "cluster.local")
            .into_iter()
            .map(|a| (a.host, a.stripped))
            .collect()
    }

    fn plain(h: &str) -> (String, Option<String>) {
        (h.to_string(), None)
    }

    fn via(h: &str, s: &str) -> (String, Option<String>) {
        (h.to_string(), Some(s.to_string()))
    }

    #[test]
    fn short_names_expand_with_the_pods_namespace() {
        assert_eq!(
            hosts("echo", "default"),
            vec![plain("echo"), plain("echo.default.svc.cluster.local")]
        );
        assert_eq!(
            hosts("echo", "ns1"),
            vec![plain("echo"), plain("echo.ns1.svc.cluster.local")]
        );
        assert_eq!(
            hosts("echo.other", "default"),
            vec![plain("echo.other"), plain("echo.other.svc.cluster.local")]
        );
        assert_eq!(
            hosts("echo.other.svc", "default"),
            vec![
                plain("echo.other.svc"),
                plain("echo.other.svc.cluster.local")
            ]
        );
        // Three labels not ending in svc, and four or more: taken as they are.
        assert_eq!(
            hosts("www.example.com", "default"),
            vec![plain("www.example.com")]
        );
        assert_eq!(hosts("a.b.c.svc", "default"), vec![plain("a.b.c.svc")]);
    }

    #[test]
    fn a_full_name_is_tried_first_then_with_search_domains_removed() {
        // The expansions of the stripped names are the asked name again: not repeated.
        assert_eq!(
            hosts("echo.default.svc.cluster.local", "default"),
            vec![
                plain("echo.default.svc.cluster.local"),
                via("echo", "echo"),
                via("echo.default", "echo.default"),
                via("echo.default.svc", "echo.default.svc"),
            ]
        );
    }

    #[test]
    fn search_domain_appended_to_a_complete_name() {
        // glibc with ndots:5 tries "www.example.com.default.svc.cluster.local" first.
        let a = hosts("www.example.com.default.svc.cluster.local", "default");
        assert_eq!(a[0], plain("www.example.com.default.svc.cluster.local"));
        assert!(
            a.contains(&via("www.example.com", "www.example.com")),
            "{a:?}"
        );
        // echo.other + the pod's first search domain.
        let a = hosts("echo.other.default.svc.cluster.local", "default");
        assert!(
            a.contains(&via("echo.other.svc.cluster.local", "echo.other")),
            "{a:?}"
        );
        // Another namespace's search domain is not the pod's: nothing stripped but svc.cluster.local.
        let a = hosts("echo.ns2.svc.cluster.local", "default");
        assert!(!a.iter().any(|(h, _)| h == "echo"), "{a:?}");
    }

    #[test]
    fn strip_needs_a_label_boundary_and_a_rest() {
        assert_eq!(strip_domain("a.cluster.local", "cluster.local"), Some("a"));
        assert_eq!(strip_domain("acluster.local", "cluster.local"), None);
        assert_eq!(strip_domain("cluster.local", "cluster.local"), None);
        assert_eq!(strip_domain(".cluster.local", "cluster.local"), None);
    }

    #[test]
    fn wildcards_from_most_specific() {
        assert_eq!(wildcards("svc1"), vec!["svc1"]);
        assert_eq!(
            wildcards("svc1.ns1.svc.cluster.local"),
            vec![
                "svc1.ns1.svc.cluster.local",
                "*.ns1.svc.cluster.local",
                "*.svc.cluster.local",
                "*.cluster.local",
                "*.local"
            ]
        );
    }
}
