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

#[cfg(test)]
mod tests {
    /// Every e2e test's topology tag is its own (`netsim::prefix`): two tests with one tag
    /// fail at random when they run side by side, the second refused while the first
    /// lives. Found by reading the calls that take a tag first: `prefix`,
    /// `Topology::build*` and every e2e helper whose first parameter is `tag: &str`.
    #[test]
    fn e2e_topology_tags_are_unique() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
        let mut files = vec![root];
        let mut sources = Vec::new();
        while let Some(p) = files.pop() {
            if p.is_dir() {
                files.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
            } else if p.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&p).unwrap();
                sources.push((p, text));
            }
        }
        // The helpers that take a topology tag first (TestPki's `new` names a directory).
        let helper = regex::Regex::new(r"fn (\w+)\(\s*tag: &str").unwrap();
        let mut names: Vec<String> = sources
            .iter()
            .flat_map(|(_, t)| helper.captures_iter(t).map(|c| c[1].to_string()))
            .filter(|n| n != "new")
            .collect();
        names.sort();
        names.dedup();
        assert!(names.len() >= 5, "helpers found: {names:?}");
        let re = regex::Regex::new(&format!(
            r#"(?:\b(?:{})|prefix|Topology::build\w*)\(\s*(?:&prefix\(\s*)?"([A-Za-z0-9_-]+)""#,
            names.join("|")
        ))
        .unwrap();
        let mut seen: std::collections::BTreeMap<String, String> = Default::default();
        let mut dupes = Vec::new();
        for (p, text) in &sources {
            for c in re.captures_iter(text) {
                let line = text[..c.get(0).unwrap().start()].matches('\n').count() + 1;
                let at = format!("{}:{line}", p.display());
                if let Some(first) = seen.insert(c[1].to_string(), at.clone()) {
                    dupes.push(format!("{:?}: {first} and {at}", &c[1]));
                }
            }
        }
        assert!(
            seen.len() > 50,
            "found only {} tags: is the pattern stale?",
            seen.len()
        );
        assert!(dupes.is_empty(), "tags used twice:\n{}", dupes.join("\n"));
    }
}
