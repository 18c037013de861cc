//! The config curve: one ztunnel against a fake istiod (tests/src/fake_istiod.rs, real
//! delta xDS and CA over TLS) serving a mesh of N workloads spread over a fixed set of
//! services and authorization policies. Per size, a fresh topology, istiod and ztunnel:
//! time to the first full state's ACK, RSS once it is applied, and single-workload pushes
//! timed from the change to the ACK with ztunnel's CPU per push.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use mesh_tests::fake_istiod::{self, FakeIstiod, Resources, Seen, Sent};
use mesh_tests::netsim::{self, Child, Topology};
use ztunnel::xds::proto::istio::security as pb_sec;
use ztunnel::xds::proto::istio::workload as pb;
use ztunnel::xds::{ADDRESS_TYPE, AUTHORIZATION_TYPE};

use crate::procstat;

/// What the fake istiod serves at one size.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct MeshShape {
    pub workloads: usize,
    pub services: usize,
    pub policies: usize,
    pub namespaces: usize,
}

impl MeshShape {
    /// WorkloadSelector policies: 3 in 5, a multiple of the namespace count so that
    /// policy `i % selector_policies` is in workload i's namespace.
    fn selector_policies(&self) -> usize {
        (self.policies * 3 / 5) / self.namespaces * self.namespaces
    }

    /// Workload i is an endpoint of service `i % services`, in that service's namespace.
    fn namespace_of_workload(&self, i: usize) -> usize {
        if self.services > 0 {
            (i % self.services) % self.namespaces
        } else {
            i % self.namespaces
        }
    }

    pub fn workload(&self, i: usize, revision: usize) -> pb::Workload {
        let ns = format!("ns-{}", self.namespace_of_workload(i));
        let ip = std::net::Ipv4Addr::from(0x0a80_0000u32 + i as u32);
        let mut services = std::collections::HashMap::new();
        if self.services > 0 {
            let j = i % self.services;
            services.insert(
                format!("{ns}/svc-{j}.{ns}.svc.cluster.local"),
                pb::PortList {
                    ports: vec![pb::Port {
                        service_port: 80,
                        target_port: 8080,
                        app_protocol: 0,
                    }],
                },
            );
        }
        let nsel = self.selector_policies();
        let authorization_policies =
            if nsel > 0 && (i % nsel) % self.namespaces == self.namespace_of_workload(i) {
                vec![format!("{ns}/sel-{}", i % nsel)]
            } else {
                vec![]
            };
        pb::Workload {
            uid: format!("{}//Pod/{ns}/w-{i}", fake_istiod::CLUSTER_ID),
            name: format!("w-{i}"),
            namespace: ns,
            addresses: vec![ip.octets().to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            service_account: format!("sa-{}", i % 500),
            // Other nodes: this ztunnel holds the mesh, it enrolls none of it.
            node: format!("node{}", 2 + i % 50),
            canonical_name: format!("app-{}", i % 1000),
            canonical_revision: format!("r{revision}"),
            workload_name: format!("app-{}", i % 1000),
            cluster_id: fake_istiod::CLUSTER_ID.into(),
            services,
            authorization_policies,
            ..Default::default()
        }
    }

    fn service(&self, j: usize) -> pb::Service {
        let ns = format!("ns-{}", j % self.namespaces);
        let vip = std::net::Ipv4Addr::from(0x0a60_0001u32 + j as u32);
        pb::Service {
            name: format!("svc-{j}"),
            namespace: ns.clone(),
            hostname: format!("svc-{j}.{ns}.svc.cluster.local"),
            addresses: vec![pb::NetworkAddress {
                network: String::new(),
                address: vip.octets().to_vec(),
                length: None,
            }],
            ports: vec![pb::Port {
                service_port: 80,
                target_port: 8080,
                app_protocol: 0,
            }],
            ..Default::default()
        }
    }

    /// Selector-scoped policies first, then namespace-scoped; one in ten a DENY; every
    /// other one names principals, the rest a port.
    fn policy(&self, k: usize) -> pb_sec::Authorization {
        use pb_sec::string_match::MatchType;
        let nsel = self.selector_policies();
        let ns = format!("ns-{}", k % self.namespaces);
        let (name, scope) = if k < nsel {
            (format!("sel-{k}"), pb_sec::Scope::WorkloadSelector)
        } else {
            (format!("nsp-{k}"), pb_sec::Scope::Namespace)
        };
        let action = if k % 10 == 9 {
            pb_sec::Action::Deny
        } else {
            pb_sec::Action::Allow
        };
        let m = if k.is_multiple_of(2) {
            pb_sec::Match {
                principals: vec![pb_sec::StringMatch {
                    match_type: Some(MatchType::Exact(format!(
                        "cluster.local/ns/{ns}/sa/sa-{}",
                        k % 500
                    ))),
                }],
                ..Default::default()
            }
        } else {
            pb_sec::Match {
                destination_ports: vec![8080 + (k % 10) as u32],
                ..Default::default()
            }
        };
        pb_sec::Authorization {
            name,
            namespace: ns,
            scope: scope as i32,
            action: action as i32,
            rules: vec![pb_sec::Rule {
                clauses: vec![pb_sec::Clause { matches: vec![m] }],
            }],
            dry_run: false,
        }
    }

    fn fill(&self, r: &mut Resources) {
        for j in 0..self.services {
            r.set_service(self.service(j));
        }
        for i in 0..self.workloads {
            r.set_workload(self.workload(i, 0));
        }
        for k in 0..self.policies {
            r.set_policy(self.policy(k));
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ConfigPoint {
    pub workloads: usize,
    pub services: usize,
    pub policies: usize,
    /// ztunnel started → both types' first full state ACKed (includes its start-up and
    /// first certificate).
    pub start_to_acked_ms: f64,
    /// First Address response handed to the stream → its ACK: encode, transfer, decode,
    /// convert, state build.
    pub first_address_apply_ms: f64,
    pub rss_mib: f64,
    pub anon_mib: f64,
    /// (RSS − empty-mesh RSS) per 1000 workloads (services and policies included).
    pub rss_mib_per_1k_workloads: f64,
    /// Between this size and the previous one: extra RSS per extra 1000 workloads.
    pub marginal_mib_per_1k_workloads: Option<f64>,
    pub pushes: usize,
    /// One workload changed → ztunnel's ACK of that push (includes the fake istiod's diff).
    pub push_to_ack_median_ms: f64,
    pub push_to_ack_max_ms: f64,
    /// Response handed to the stream → ACK: ztunnel's share of a push.
    pub push_apply_median_ms: f64,
    /// ztunnel CPU (utime + stime) over all pushes / pushes.
    pub cpu_ms_per_push: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ConfigCurve {
    pub shapes: Vec<MeshShape>,
    pub baseline_rss_mib: f64,
    pub baseline_anon_mib: f64,
    pub points: Vec<ConfigPoint>,
    pub policy_eval: Vec<super::policy::PolicyPoint>,
}

pub struct Plan {
    pub sizes: Vec<usize>,
    pub services: usize,
    pub policies: usize,
    pub namespaces: usize,
    pub pushes: usize,
    pub settle: Duration,
    pub policy_counts: Vec<usize>,
}

impl Plan {
    pub fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                sizes: vec![100, 1000],
                services: 100,
                policies: 50,
                namespaces: 10,
                pushes: 5,
                settle: Duration::from_millis(300),
                policy_counts: vec![0, 10, 100],
            }
        } else {
            Plan {
                sizes: vec![1000, 10_000, 50_000],
                services: 5000,
                policies: 1000,
                namespaces: 100,
                pushes: 20,
                settle: Duration::from_secs(2),
                policy_counts: vec![0, 10, 100, 1000],
            }
        }
    }
}

pub fn run(plan: &Plan, ztunnel: &Path) -> Result<ConfigCurve> {
    let mut curve = ConfigCurve::default();
    let empty = MeshShape {
        workloads: 0,
        services: 0,
        policies: 0,
        namespaces: plan.namespaces,
    };
    let base = measure(0, empty, plan, ztunnel).context("empty mesh")?;
    progress!(
        "config  empty mesh: ztunnel RSS {:.1} MiB (anon {:.1}), state ACKed {:.0} ms after start",
        base.rss_mib,
        base.anon_mib,
        base.start_to_acked_ms
    );
    curve.baseline_rss_mib = base.rss_mib;
    curve.baseline_anon_mib = base.anon_mib;
    for (i, &n) in plan.sizes.iter().enumerate() {
        crate::cleanup::check()?;
        let shape = MeshShape {
            workloads: n,
            services: plan.services,
            policies: plan.policies,
            namespaces: plan.namespaces,
        };
        let mut p =
            measure(i + 1, shape, plan, ztunnel).with_context(|| format!("{n} workloads"))?;
        p.rss_mib_per_1k_workloads = (p.rss_mib - base.rss_mib) / (n as f64 / 1000.0);
        if let Some(prev) = curve.points.last() {
            p.marginal_mib_per_1k_workloads =
                Some((p.rss_mib - prev.rss_mib) / ((n - prev.workloads) as f64 / 1000.0));
        }
        progress!(
            "config  {n:>6} workloads: ACKed {:.0} ms after start (apply {:.0} ms), RSS {:.1} MiB ({:.2} MiB/1k above empty), push→ACK median {:.1} ms max {:.1} ms (apply {:.1} ms), {:.2} CPU-ms/push",
            p.start_to_acked_ms,
            p.first_address_apply_ms,
            p.rss_mib,
            p.rss_mib_per_1k_workloads,
            p.push_to_ack_median_ms,
            p.push_to_ack_max_ms,
            p.push_apply_median_ms,
            p.cpu_ms_per_push
        );
        curve.shapes.push(shape);
        curve.points.push(p);
    }
    for &n in &plan.policy_counts {
        crate::cleanup::check()?;
        let p = super::policy::measure(n)?;
        progress!("config  authorize with {n:>4} policies: {:.0} ns/call in scope, {:.0} ns/call out of scope", p.in_scope_ns, p.out_of_scope_ns);
        curve.policy_eval.push(p);
    }
    Ok(curve)
}

fn ack_of<'a>(r: &'a Resources, type_url: &str, nth: usize) -> Option<&'a Seen> {
    r.seen
        .iter()
        .filter(|s| s.type_url == type_url && !s.nonce.is_empty() && s.nack.is_none())
        .nth(nth)
}

fn sent_for<'a>(r: &'a Resources, ack: &Seen) -> Option<&'a Sent> {
    r.sent
        .iter()
        .rev()
        .find(|s| s.type_url == ack.type_url && s.nonce == ack.nonce)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Waits for `f` over the fake istiod's record, failing early if ztunnel exits or NACKs.
fn wait_istiod<T>(
    istiod: &FakeIstiod,
    z: &mut Child,
    what: &str,
    timeout: Duration,
    f: impl Fn(&Resources) -> Option<T>,
) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        crate::cleanup::check()?;
        {
            let r = istiod
                .res
                .lock()
                .map_err(|_| anyhow::anyhow!("fake istiod state poisoned"))?;
            if let Some(nack) = r.nacks().first() {
                bail!("ztunnel NACKed: {nack}");
            }
            if let Some(t) = f(&r) {
                return Ok(t);
            }
        }
        if let Some(st) = z.wait_exit(Duration::ZERO) {
            bail!(
                "ztunnel exited ({st}) waiting for {what}; log tail:\n{}",
                super::log_tail(z)
            );
        }
        if Instant::now() > deadline {
            bail!(
                "timed out after {timeout:?} waiting for {what}; log tail:\n{}",
                super::log_tail(z)
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn measure(index: usize, shape: MeshShape, plan: &Plan, ztunnel: &Path) -> Result<ConfigPoint> {
    let prefix = netsim::prefix(&format!("scc{index}"));
    let topo = Topology::build(&prefix, &[0])?;
    crate::cleanup::register_prefix(&prefix, &topo.bpffs);
    let token = topo.dir.join("istio-token");
    std::fs::write(&token, fake_istiod::TOKEN)?;
    let istiod = FakeIstiod::start(topo.node(1), fake_istiod::ISTIOD.parse()?, &topo.dir)?;
    istiod.update(|r| shape.fill(r));
    let mut env = istiod.env(&token);
    env.extend([
        ("RUST_LOG".to_string(), "info".to_string()),
        ("RUST_BACKTRACE".into(), "0".into()),
        ("POD_NAME".into(), "ztunnel-node1".into()),
        ("INSTANCE_IP".into(), netsim::node_ip(1).to_string()),
    ]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // No pods: this ztunnel only holds the mesh state, so no capture is set up.
    let args = [
        "--node-name",
        "node1",
        "--capture",
        "none",
        "--state-dir",
        &topo.dir.join("state").display().to_string(),
    ];
    let t0 = Instant::now();
    let mut z = topo.node(1).spawn(
        &ztunnel.display().to_string(),
        &args,
        &env,
        &topo.dir.join("ztunnel.log"),
    )?;
    let pid = z.pid().context("ztunnel pid")?;
    crate::cleanup::register_pid(pid);
    // 50k workloads take a debug build minutes; a release build seconds.
    let first = Duration::from_secs(600);
    let (addr_ack, auth_ack, addr_sent) =
        wait_istiod(&istiod, &mut z, "the first full state's ACKs", first, |r| {
            let a = ack_of(r, ADDRESS_TYPE, 0)?;
            let p = ack_of(r, AUTHORIZATION_TYPE, 0)?;
            Some((a.at, p.at, sent_for(r, a)?.at))
        })?;
    let mut point = ConfigPoint {
        workloads: shape.workloads,
        services: shape.services,
        policies: shape.policies,
        start_to_acked_ms: ms(addr_ack.max(auth_ack) - t0),
        first_address_apply_ms: ms(addr_ack - addr_sent),
        ..Default::default()
    };
    std::thread::sleep(plan.settle);
    let rd = procstat::read(pid).context("ztunnel gone")?;
    point.rss_mib = rd.rss_kib as f64 / 1024.0;
    point.anon_mib = rd.anon_kib as f64 / 1024.0;
    if shape.workloads == 0 {
        return Ok(point);
    }
    let mut to_ack = Vec::new();
    let mut apply = Vec::new();
    let cpu_before = procstat::read(pid).context("ztunnel gone")?.cpu;
    for k in 0..plan.pushes {
        let acks_before = istiod
            .res
            .lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .acks(ADDRESS_TYPE);
        // One workload changes (its revision label), a different one each time.
        let w = shape.workload((k * 7919) % shape.workloads, k + 1);
        let t = Instant::now();
        istiod.update(|r| r.set_workload(w));
        let (ack, sent) = wait_istiod(
            &istiod,
            &mut z,
            "a push's ACK",
            Duration::from_secs(120),
            |r| {
                let a = ack_of(r, ADDRESS_TYPE, acks_before)?;
                Some((a.at, sent_for(r, a)?.at))
            },
        )?;
        to_ack.push(ms(ack - t));
        apply.push(ms(ack - sent));
        // Work after the ACK (if any) lands in this push's CPU, not in the next one's time.
        std::thread::sleep(Duration::from_millis(50));
    }
    let cpu = procstat::read(pid)
        .context("ztunnel gone")?
        .cpu
        .saturating_sub(cpu_before);
    point.pushes = plan.pushes;
    point.push_to_ack_median_ms = median(&mut to_ack);
    point.push_to_ack_max_ms = to_ack.iter().copied().fold(0.0, f64::max);
    point.push_apply_median_ms = median(&mut apply);
    point.cpu_ms_per_push = ms(cpu) / plan.pushes as f64;
    z.stop();
    Ok(point)
}

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_selector_policy_a_workload_names_is_in_its_namespace() {
        let shape = MeshShape {
            workloads: 1000,
            services: 100,
            policies: 50,
            namespaces: 10,
        };
        let mut named = 0;
        for i in 0..shape.workloads {
            let w = shape.workload(i, 0);
            for key in &w.authorization_policies {
                named += 1;
                let k: usize = key
                    .rsplit_once("/sel-")
                    .expect("selector policy key")
                    .1
                    .parse()
                    .expect("index");
                let p = shape.policy(k);
                assert_eq!(format!("{}/{}", p.namespace, p.name), *key);
                assert_eq!(p.namespace, w.namespace);
                assert_eq!(p.scope, pb_sec::Scope::WorkloadSelector as i32);
            }
            for svc in w.services.keys() {
                assert!(
                    svc.starts_with(&format!("{}/", w.namespace)),
                    "{svc} outside {}",
                    w.namespace
                );
            }
        }
        assert_eq!(
            named, shape.workloads,
            "every workload is selected by one policy"
        );
    }

    #[test]
    fn a_shape_converts_without_errors() {
        let shape = MeshShape {
            workloads: 20,
            services: 10,
            policies: 20,
            namespaces: 5,
        };
        let mut r = Resources::default();
        shape.fill(&mut r);
        assert_eq!((r.addresses.len(), r.authorizations.len()), (30, 20));
        let ips: std::collections::HashSet<_> = (0..shape.workloads)
            .map(|i| shape.workload(i, 0).addresses)
            .collect();
        assert_eq!(ips.len(), shape.workloads);
    }

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&mut []), 0.0);
    }
}
