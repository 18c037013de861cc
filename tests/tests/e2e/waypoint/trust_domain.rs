//! `meshConfig.trustDomainAliases` in the waypoint, as istiod applies them to Istio's:
//! a policy written for a principal of an alias (`old-td/ns/default/sa/client`) matches
//! the same identity in the mesh's trust domain (the client's certificate says
//! `cluster.local`), and a principal of a trust domain that is no alias matches nothing.
//! Without the alias the same policy does not match the client.

use std::time::Duration;

use anyhow::Result;

use super::L7Mesh;

const POLICIES: &str = "authorizationPolicies:\n\
- {name: by-old-name, namespace: default, targetRefs: [{kind: Service, group: \"\", name: echo}], action: ALLOW,\n\
   rules: [{from: [{source: {principals: [old-td/ns/default/sa/client]}}], to: [{operation: {paths: [\"/allowed*\"]}}]}]}\n\
- {name: by-foreign-name, namespace: default, targetRefs: [{kind: Service, group: \"\", name: echo}], action: DENY,\n\
   rules: [{from: [{source: {principals: [evil-td/ns/default/sa/client]}}]}]}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_match_principals_across_trust_domain_aliases() -> Result<()> {
    let aliases = "meshConfig:\n  trustDomain: cluster.local\n  trustDomainAliases: [old-td]\n";
    let m = L7Mesh::start("l7td", &format!("{aliases}{POLICIES}"), &[]).await?;
    let mut c = m.h1().await?;
    let r = c.get("/allowed").await?;
    assert_eq!(
        r.status,
        200,
        "the alias's principal is the client's: {r:?}\n{}",
        m.log()
    );
    // Not an alias: the DENY for evil-td's client does not match ours.
    let r = c.get("/allowed/too").await?;
    assert_eq!(r.status, 200, "{r:?}");
    // Paths the ALLOW does not cover stay denied.
    let r = c.get("/other").await?;
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (403, "RBAC: access denied"),
        "{r:?}"
    );

    // Without the alias, the same policy names another identity: denied.
    let tmp = m.cfg_path.with_extension("tmp");
    std::fs::write(
        &tmp,
        format!(
            "{}meshConfig:\n  trustDomain: cluster.local\n{POLICIES}",
            m.base
        ),
    )?;
    std::fs::rename(&tmp, &m.cfg_path)?;
    // Polls the observable state until the reload applies (the waypoint logs it too).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut last = None;
    while std::time::Instant::now() < deadline {
        let mut c = m.h1().await?;
        last = Some(c.get("/allowed").await?);
        if last.as_ref().is_some_and(|r| r.status == 403) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = last.expect("asked at least once");
    assert_eq!(
        (r.status.as_u16(), r.body.trim()),
        (403, "RBAC: access denied"),
        "without the alias the client must not match: {r:?}\n{}",
        m.log()
    );
    Ok(())
}
