//! Per-connection L4 policy evaluation, in process: `MeshState::authorize` for one
//! destination workload with N policies in its scope (all evaluated: the only ALLOW that
//! matches sorts last) and with N policies out of it (other namespaces, or selecting
//! other workloads). Built only through the public API (`MeshState::build` from YAML),
//! so the same code measures any version of the state's internals.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;

use ztunnel::rbac::{Authorization, Connection, Decision};
use ztunnel::state::{MeshState, Workload};

#[derive(Clone, Debug, Default, Serialize)]
pub struct PolicyPoint {
    pub policies: usize,
    /// ns per `authorize` with every policy in the destination's scope.
    pub in_scope_ns: f64,
    /// ns per `authorize` with every policy outside it.
    pub out_of_scope_ns: f64,
}

const CLIENT: &str = "spiffe://cluster.local/ns/ns-0/sa/client";

/// `n` policies; `in_scope`: half namespace-scoped in the destination's namespace, half
/// selecting it, one in ten a DENY of someone else, the ALLOWs naming other principals
/// but the last. Out of scope: the same in another namespace or selecting nobody.
fn policies(n: usize, in_scope: bool) -> Result<Vec<Authorization>> {
    (0..n)
        .map(|k| {
            let selector = k % 2 == 1;
            let ns = if in_scope || selector { "ns-0" } else { "ns-1" };
            let scope = if selector { "WorkloadSelector" } else { "Namespace" };
            let (action, principal) = match k {
                _ if k + 1 == n => ("Allow", "cluster.local/ns/ns-0/sa/client".to_string()),
                _ if k % 10 == 9 => ("Deny", format!("cluster.local/ns/ns-9/sa/bad-{k}")),
                _ => ("Allow", format!("cluster.local/ns/ns-0/sa/other-{k}")),
            };
            let yaml = format!(
                "{{name: p-{k:05}, namespace: {ns}, scope: {scope}, action: {action}, rules: [[[{{principals: [{{Exact: \"{principal}\"}}], notDestinationPorts: [9999]}}]]]}}"
            );
            serde_yaml::from_str(&yaml).with_context(|| format!("policy {yaml}"))
        })
        .collect()
}

fn destination(n: usize, in_scope: bool) -> Result<Workload> {
    let selected: Vec<String> = (0..n)
        .filter(|k| k % 2 == 1 && in_scope)
        .map(|k| format!("\"ns-0/p-{k:05}\""))
        .collect();
    let yaml = format!(
        "{{uid: dst, name: dst, namespace: ns-0, serviceAccount: dst, workloadIps: [10.1.0.1], protocol: HBONE, authorizationPolicies: [{}]}}",
        selected.join(", ")
    );
    serde_yaml::from_str(&yaml).context("destination workload")
}

/// ns per call: the median of 5 batches, each at least 100 ms and 100 calls.
fn time_calls(state: &MeshState, wl: &Workload, conn: &Connection) -> f64 {
    let mut per_batch = Vec::new();
    for _ in 0..5 {
        let (start, mut calls) = (Instant::now(), 0u64);
        while calls < 100 || start.elapsed() < Duration::from_millis(100) {
            for _ in 0..10 {
                std::hint::black_box(
                    state.authorize(std::hint::black_box(wl), std::hint::black_box(conn)),
                );
            }
            calls += 10;
        }
        per_batch.push(start.elapsed().as_nanos() as f64 / calls as f64);
    }
    super::config::median(&mut per_batch)
}

pub fn measure(n: usize) -> Result<PolicyPoint> {
    let conn = Connection {
        src_identity: CLIENT.parse().ok().map(std::sync::Arc::new),
        src_ip: "10.1.0.2".parse()?,
        dst: "10.1.0.1:8080".parse()?,
    };
    let mut point = PolicyPoint {
        policies: n,
        ..Default::default()
    };
    for in_scope in [true, false] {
        let wl = destination(n, in_scope)?;
        let state = MeshState::build(vec![wl.clone()], vec![], policies(n, in_scope)?)
            .context("mesh state")?;
        // The verdict the construction promises: only the last ALLOW matches.
        let want = Decision::Allow;
        let got = state.authorize(&wl, &conn);
        anyhow::ensure!(
            got == want,
            "{n} policies (in scope: {in_scope}): {got:?}, expected {want:?}"
        );
        let ns = time_calls(&state, &wl, &conn);
        if in_scope {
            point.in_scope_ns = ns
        } else {
            point.out_of_scope_ns = ns
        }
    }
    Ok(point)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_scope_policies_apply_and_out_of_scope_ones_do_not() {
        let stranger = Connection {
            src_identity: "spiffe://cluster.local/ns/ns-5/sa/x"
                .parse()
                .ok()
                .map(std::sync::Arc::new),
            src_ip: "10.1.0.3".parse().unwrap(),
            dst: "10.1.0.1:8080".parse().unwrap(),
        };
        for n in [1, 10, 25] {
            // In scope: ALLOW policies apply and none names the stranger.
            let (wl, ps) = (destination(n, true).unwrap(), policies(n, true).unwrap());
            let st = MeshState::build(vec![wl.clone()], vec![], ps).unwrap();
            assert_ne!(
                st.authorize(&wl, &stranger),
                Decision::Allow,
                "{n} in scope"
            );
            // Out of scope: nothing applies.
            let (wl, ps) = (destination(n, false).unwrap(), policies(n, false).unwrap());
            let st = MeshState::build(vec![wl.clone()], vec![], ps).unwrap();
            assert_eq!(
                st.authorize(&wl, &stranger),
                Decision::Allow,
                "{n} out of scope"
            );
        }
        // The client is allowed either way (measure checks it before timing).
        assert!(measure(10).unwrap().in_scope_ns > 0.0);
    }
}
