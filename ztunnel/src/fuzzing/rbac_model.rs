//! L4 authorization against a reference model (the `rbac_model` fuzz target): arbitrary
//! policies (from small pools of names, addresses and ports, so matches are likely) and a
//! connection are evaluated by ztunnel (`MeshState::authorize`: scope selection +
//! `rbac::evaluate`) and by the straightforward model below, written from the semantics in
//! docs/interfaces.md. Any disagreement is a panic. Built for the fuzz crate (feature
//! `fuzzing`) and for unit tests, which replay the committed corpus.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use arbitrary::{Arbitrary, Unstructured};

use crate::identity::Identity;
use crate::rbac::{
    self, Authorization, Cidr, Decision, DenyReason, PolicyAction, PolicyScope,
    ServiceAccountMatch, StringMatch,
};
use crate::state::{MeshState, Protocol, Workload};

const NAMESPACES: [&str; 4] = ["default", "kube-system", "other", "default2"];
const ACCOUNTS: [&str; 3] = ["client", "admin", "default"];
const TRUST_DOMAINS: [&str; 2] = ["cluster.local", "other.td"];
const POLICY_NAMES: [&str; 3] = ["a", "b", "c"];
/// Fragments string matches are built from: whole principals, their parts, look-alikes.
const FRAGMENTS: [&str; 10] = [
    "cluster.local/ns/default/sa/client",
    "cluster.local/ns/",
    "/sa/client",
    "/sa/admin",
    "default",
    "kube",
    "",
    "cluster.local/ns/default/sa/",
    "other.td/ns/other/sa/default",
    "cluster.local.ns.default.sa.client",
];
const IPS: [IpAddr; 7] = [
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
    IpAddr::V4(Ipv4Addr::new(10, 1, 0, 1)),
    IpAddr::V4(Ipv4Addr::new(192, 168, 1, 1)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 2)),
    // IPv4-mapped: must be treated as 10.0.0.1.
    IpAddr::V6(Ipv6Addr::new(0, 0, 0, 0, 0, 0xffff, 0x0a00, 0x0001)),
];
const PORTS: [u16; 3] = [80, 8080, 9090];

fn pick<T: Copy>(pool: &[T], i: u8) -> T {
    pool[usize::from(i) % pool.len()]
}

#[derive(Arbitrary, Debug)]
enum Sm {
    Exact(u8),
    Prefix(u8),
    Suffix(u8),
    Presence,
}

#[derive(Arbitrary, Debug)]
struct Net {
    ip: u8,
    len: u8,
}

#[derive(Arbitrary, Debug, Default)]
struct M {
    namespaces: Vec<Sm>,
    not_namespaces: Vec<Sm>,
    principals: Vec<Sm>,
    not_principals: Vec<Sm>,
    source_ips: Vec<Net>,
    not_source_ips: Vec<Net>,
    destination_ips: Vec<Net>,
    not_destination_ips: Vec<Net>,
    destination_ports: Vec<u8>,
    not_destination_ports: Vec<u8>,
    service_accounts: Vec<(u8, u8)>,
    not_service_accounts: Vec<(u8, u8)>,
}

#[derive(Arbitrary, Debug)]
struct P {
    name: u8,
    namespace: u8,
    scope: u8,
    deny: bool,
    dry_run: bool,
    rules: Vec<Vec<Vec<M>>>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    policies: Vec<P>,
    /// (trust domain, namespace, service account) of the peer; None: plaintext.
    src: Option<(u8, u8, u8)>,
    src_ip: u8,
    dst_ip: u8,
    dst_port: u8,
    /// The destination workload's namespace and the WorkloadSelector policies it lists.
    dst_namespace: u8,
    selected: Vec<(u8, u8)>,
}

fn sm(m: &Sm) -> StringMatch {
    match m {
        Sm::Exact(i) => StringMatch::Exact(pick(&FRAGMENTS, *i).into()),
        Sm::Prefix(i) => StringMatch::Prefix(pick(&FRAGMENTS, *i).into()),
        Sm::Suffix(i) => StringMatch::Suffix(pick(&FRAGMENTS, *i).into()),
        Sm::Presence => StringMatch::Presence,
    }
}

/// A prefix length valid for the address (ztunnel refuses others at conversion).
fn net(n: &Net) -> (IpAddr, u8) {
    let ip = pick(&IPS, n.ip);
    let max = if ip.is_ipv4() { 32 } else { 128 };
    (ip, n.len % (max + 1))
}

fn cidr(n: &Net) -> Cidr {
    let (ip, len) = net(n);
    // ipnet keeps host bits; Istio's CIDRs may have them too, so don't truncate.
    Cidr(ipnet::IpNet::new(ip, len).unwrap_or_else(|_| unreachable!("length in range")))
}

fn sa(&(ns, sa): &(u8, u8)) -> ServiceAccountMatch {
    ServiceAccountMatch {
        namespace: pick(&NAMESPACES, ns).into(),
        service_account: pick(&ACCOUNTS, sa).into(),
    }
}

fn policy(p: &P) -> Authorization {
    Authorization {
        name: pick(&POLICY_NAMES, p.name).into(),
        namespace: pick(&NAMESPACES, p.namespace).into(),
        scope: [
            PolicyScope::Global,
            PolicyScope::Namespace,
            PolicyScope::WorkloadSelector,
        ][usize::from(p.scope % 3)],
        action: if p.deny {
            PolicyAction::Deny
        } else {
            PolicyAction::Allow
        },
        dry_run: p.dry_run,
        rules: p
            .rules
            .iter()
            .map(|r| {
                r.iter()
                    .map(|c| {
                        c.iter()
                            .map(|m| rbac::Match {
                                namespaces: m.namespaces.iter().map(sm).collect(),
                                not_namespaces: m.not_namespaces.iter().map(sm).collect(),
                                principals: m.principals.iter().map(sm).collect(),
                                not_principals: m.not_principals.iter().map(sm).collect(),
                                source_ips: m.source_ips.iter().map(cidr).collect(),
                                not_source_ips: m.not_source_ips.iter().map(cidr).collect(),
                                destination_ips: m.destination_ips.iter().map(cidr).collect(),
                                not_destination_ips: m
                                    .not_destination_ips
                                    .iter()
                                    .map(cidr)
                                    .collect(),
                                destination_ports: m
                                    .destination_ports
                                    .iter()
                                    .map(|p| pick(&PORTS, *p))
                                    .collect(),
                                not_destination_ports: m
                                    .not_destination_ports
                                    .iter()
                                    .map(|p| pick(&PORTS, *p))
                                    .collect(),
                                service_accounts: m.service_accounts.iter().map(sa).collect(),
                                not_service_accounts: m
                                    .not_service_accounts
                                    .iter()
                                    .map(sa)
                                    .collect(),
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect(),
        unenforceable: None,
    }
}

// ---------------------------------------------------------------------------------------
// The reference model: plain loops over the fuzzer's own structs, its own CIDR arithmetic.

struct Req {
    /// (trust domain, namespace, service account)
    id: Option<(&'static str, &'static str, &'static str)>,
    src_ip: IpAddr,
    dst_ip: IpAddr,
    dst_port: u16,
}

fn model_string(m: &Sm, v: &str) -> bool {
    match m {
        Sm::Exact(i) => v == pick(&FRAGMENTS, *i),
        Sm::Prefix(i) => v.starts_with(pick(&FRAGMENTS, *i)),
        Sm::Suffix(i) => v.ends_with(pick(&FRAGMENTS, *i)),
        Sm::Presence => !v.is_empty(),
    }
}

fn bits(ip: IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(v4) => (true, u128::from(u32::from(v4)) << 96),
        IpAddr::V6(v6) => {
            let x = u128::from(v6);
            // ::ffff:a.b.c.d is the IPv4 address a.b.c.d.
            if x >> 32 == 0xffff {
                (true, (x & 0xffff_ffff) << 96)
            } else {
                (false, x)
            }
        }
    }
}

fn model_contains(n: &Net, ip: IpAddr) -> bool {
    let (net_ip, len) = net(n);
    // A CIDR written as IPv4-mapped IPv6 with a prefix of 96 or more names IPv4 peers
    // (::ffff:10.0.0.0/104 is 10.0.0.0/8); a shorter one stays an IPv6 CIDR.
    let (net_v4, net_bits, len) = match net_ip {
        IpAddr::V4(v4) => (true, u128::from(u32::from(v4)) << 96, len),
        IpAddr::V6(v6) if len >= 96 && u128::from(v6) >> 32 == 0xffff => {
            (true, (u128::from(v6) & 0xffff_ffff) << 96, len - 96)
        }
        IpAddr::V6(v6) => (false, u128::from(v6), len),
    };
    let (ip_v4, ip_bits) = bits(ip);
    if net_v4 != ip_v4 {
        return false;
    }
    let mask = if len == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(len))
    };
    net_bits & mask == ip_bits & mask
}

/// Empty: no constraint; otherwise a value must be there and match one.
fn pos<T>(list: &[T], v: Option<&dyn Fn(&T) -> bool>) -> bool {
    if list.is_empty() {
        return true;
    }
    match v {
        None => false,
        Some(f) => list.iter().any(f),
    }
}

/// Empty: no constraint; an absent value passes; a present one must match none.
fn neg<T>(list: &[T], v: Option<&dyn Fn(&T) -> bool>) -> bool {
    match v {
        None => true,
        Some(f) => !list.iter().any(f),
    }
}

fn model_match(m: &M, r: &Req) -> bool {
    let principal = r.id.map(|(td, ns, sa)| format!("{td}/ns/{ns}/sa/{sa}"));
    // Istio's ztunnel: an anonymous peer's namespace is "".
    let anon_ns = r.id.map_or("", |(_, ns, _)| ns);
    let ns_f = Some(move |s: &Sm| model_string(s, anon_ns));
    let pr_f = principal
        .as_deref()
        .map(|p| move |s: &Sm| model_string(s, p));
    let sa_f = r.id.map(|(_, ns, sa)| {
        move |&(mns, msa): &(u8, u8)| pick(&NAMESPACES, mns) == ns && pick(&ACCOUNTS, msa) == sa
    });
    let src = |n: &Net| model_contains(n, r.src_ip);
    let dst = |n: &Net| model_contains(n, r.dst_ip);
    let port = |p: &u8| pick(&PORTS, *p) == r.dst_port;
    pos(
        &m.namespaces,
        ns_f.as_ref().map(|f| f as &dyn Fn(&Sm) -> bool),
    ) && neg(
        &m.not_namespaces,
        ns_f.as_ref().map(|f| f as &dyn Fn(&Sm) -> bool),
    ) && pos(
        &m.principals,
        pr_f.as_ref().map(|f| f as &dyn Fn(&Sm) -> bool),
    ) && neg(
        &m.not_principals,
        pr_f.as_ref().map(|f| f as &dyn Fn(&Sm) -> bool),
    ) && pos(
        &m.service_accounts,
        sa_f.as_ref().map(|f| f as &dyn Fn(&(u8, u8)) -> bool),
    ) && neg(
        &m.not_service_accounts,
        sa_f.as_ref().map(|f| f as &dyn Fn(&(u8, u8)) -> bool),
    ) && pos(&m.source_ips, Some(&src))
        && neg(&m.not_source_ips, Some(&src))
        && pos(&m.destination_ips, Some(&dst))
        && neg(&m.not_destination_ips, Some(&dst))
        && pos(&m.destination_ports, Some(&port))
        && neg(&m.not_destination_ports, Some(&port))
}

fn model_empty(m: &M) -> bool {
    let M {
        namespaces: a,
        not_namespaces: b,
        principals: c,
        not_principals: d,
        source_ips: e,
        not_source_ips: f,
        destination_ips: g,
        not_destination_ips: h,
        destination_ports: i,
        not_destination_ports: j,
        service_accounts: k,
        not_service_accounts: l,
    } = m;
    [
        a.len(),
        b.len(),
        c.len(),
        d.len(),
        e.len(),
        f.len(),
        g.len(),
        h.len(),
        i.len(),
        j.len(),
        k.len(),
        l.len(),
    ]
    .iter()
    .all(|n| *n == 0)
}

fn model_policy_matches(p: &P, r: &Req) -> bool {
    // Istio's ztunnel, loop for loop: no rules match nothing; any rule; all clauses of
    // it; an empty clause holds; any non-empty match of each clause (empty ones skipped).
    if p.rules.is_empty() {
        return false;
    }
    for rule in &p.rules {
        let mut rule_match = true;
        for clause in rule {
            let mut clause_match = false;
            for m in clause {
                if model_empty(m) {
                    continue;
                }
                if model_match(m, r) {
                    clause_match = true;
                    break;
                }
            }
            if clause.is_empty() {
                clause_match = true;
            }
            rule_match &= clause_match;
        }
        if rule_match {
            return true;
        }
    }
    false
}

fn key(p: &P) -> String {
    format!(
        "{}/{}",
        pick(&NAMESPACES, p.namespace),
        pick(&POLICY_NAMES, p.name)
    )
}

/// Ok(None) allow; Ok(Some(keys)) deny by one of these DENY policies; Err(()) no ALLOW matched.
fn model(input: &Input, r: &Req) -> Result<Option<Vec<String>>, ()> {
    let dst_ns = pick(&NAMESPACES, input.dst_namespace);
    let selected: Vec<String> = input
        .selected
        .iter()
        .map(|&(ns, n)| format!("{}/{}", pick(&NAMESPACES, ns), pick(&POLICY_NAMES, n)))
        .collect();
    // One policy per key: the first keeps it (`MeshState::build` ranks a config's
    // entries by order, the lower rank holding a contested key).
    let mut by_key: Vec<(String, &P)> = Vec::new();
    for p in &input.policies {
        let k = key(p);
        if !by_key.iter().any(|(other, _)| *other == k) {
            by_key.push((k, p));
        }
    }
    let in_scope = by_key.into_iter().filter(|(k, p)| match p.scope % 3 {
        0 => true,
        1 => pick(&NAMESPACES, p.namespace) == dst_ns,
        _ => selected.contains(k),
    });
    let (mut any_allow, mut allowed, mut denies) = (false, false, Vec::new());
    for (k, p) in in_scope {
        if p.dry_run {
            continue;
        }
        let m = model_policy_matches(p, r);
        if p.deny {
            if m {
                denies.push(k);
            }
        } else {
            any_allow = true;
            allowed |= m;
        }
    }
    if !denies.is_empty() {
        Ok(Some(denies))
    } else if !any_allow || allowed {
        Ok(None)
    } else {
        Err(())
    }
}

fn workload(namespace: &str, selected: Vec<String>, ip: IpAddr) -> Workload {
    Workload {
        service_account: "server".into(),
        workload_ips: vec![ip],
        protocol: Protocol::HBONE,
        authorization_policies: selected,
        ..Workload::new("dst", "dst", namespace)
    }
}

/// The `rbac_model` target: `data` is read as an [`Input`] the way cargo-fuzz reads a
/// typed target's input (`arbitrary_take_rest`); bytes that do not make one are skipped.
pub fn rbac_model(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let r = Req {
        id: input.src.map(|(td, ns, sa)| {
            (
                pick(&TRUST_DOMAINS, td),
                pick(&NAMESPACES, ns),
                pick(&ACCOUNTS, sa),
            )
        }),
        src_ip: pick(&IPS, input.src_ip),
        dst_ip: pick(&IPS, input.dst_ip),
        dst_port: pick(&PORTS, input.dst_port),
    };
    let selected: Vec<String> = input
        .selected
        .iter()
        .map(|&(ns, n)| format!("{}/{}", pick(&NAMESPACES, ns), pick(&POLICY_NAMES, n)))
        .collect();
    let wl = workload(pick(&NAMESPACES, input.dst_namespace), selected, r.dst_ip);
    let state = match MeshState::build(
        vec![wl.clone()],
        vec![],
        input.policies.iter().map(policy).collect(),
    ) {
        Ok(s) => s,
        Err(e) => panic!("a state with one workload cannot conflict: {e}"),
    };
    let conn = rbac::Connection {
        src_identity: r
            .id
            .map(|(td, ns, sa)| std::sync::Arc::new(Identity::new(td, ns, sa))),
        src_ip: r.src_ip,
        dst: SocketAddr::new(r.dst_ip, r.dst_port),
    };
    let got = state.authorize(&wl, &conn);
    let want = model(&input, &r);
    match (&got, &want) {
        (Decision::Allow, Ok(None)) => {}
        (Decision::Deny(DenyReason::NoAllowMatch), Err(())) => {}
        (Decision::Deny(DenyReason::DenyPolicy(k)), Ok(Some(keys))) if keys.contains(k) => {}
        _ => panic!("ztunnel decided {got:?}, the model {want:?} for {input:#?}"),
    }
}
