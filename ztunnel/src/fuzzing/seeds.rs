//! Writes the seed corpora committed in `fuzz/corpus/`: small valid inputs of each
//! target's format, so the fuzzers start from the interesting shapes.

use std::path::Path;

use prost::Message;

use crate::xds::proto::istio::{security as pb_sec, workload as pb};

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join(name), bytes).unwrap();
}

fn hbone(dir: &Path) {
    for (name, text) in [
        ("v4", "CONNECT\n10.10.2.11:8080\nforwarded: for=\"10.10.1.11:40000\"\nbaggage: k8s.namespace.name=default\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
        ("v6", "CONNECT\n[fd00::1]:80\nforwarded: for=\"[fd00::2]:1234\";host=echo.default.svc.cluster.local"),
        ("hostname", "CONNECT\necho.default.svc.cluster.local:80"),
        ("get", "GET\nhttp://10.0.0.1:80/path?q=1\nhost: x"),
        ("userinfo", "CONNECT\nuser@10.0.0.1:80"),
    ] {
        write(dir, "hbone_connect", name, text.as_bytes());
    }
}

fn config(dir: &Path) {
    let full = r#"workloads:
- uid: cluster1//Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  workloadIps: ["10.10.1.11", "fd00::11"]
  protocol: HBONE
  node: node1
  services:
    default/echo.default.svc.cluster.local: {80: 8080}
  waypoint: {destination: "/10.10.1.99"}
  applicationTunnel: {protocol: PROXY, port: 15088}
  authorizationPolicies: [default/sel]
- {uid: w, name: waypoint, namespace: default, workloadIps: [10.10.1.99], protocol: HBONE, capacity: 2, status: Healthy}
services:
- name: echo
  namespace: default
  hostname: echo.default.svc.cluster.local
  vips: ["/10.96.0.10"]
  ports: {80: 8080}
  subjectAltNames: ["spiffe://cluster.local/ns/default/sa/echo"]
  waypoint: {destination: default/waypoint.default.svc.cluster.local, hboneMtlsPort: 15008}
policies:
- name: sel
  namespace: default
  scope: WorkloadSelector
  action: Deny
  dryRun: false
  rules:
  - - - principals: [{Exact: cluster.local/ns/default/sa/client}]
        notNamespaces: [{Prefix: kube}]
        sourceIps: ["10.0.0.0/8"]
        notDestinationPorts: [9090]
        serviceAccounts: [{namespace: default, serviceAccount: client}]
      - destinationIps: ["fd00::/8"]
        notPrincipals: [{Suffix: /sa/admin}, {Presence: {}}]
"#;
    write(dir, "config_yaml", "full", full.as_bytes());
    write(dir, "config_yaml", "dns_state", super::DNS_STATE.as_bytes());
    let l7 = r#"httpRoutes:
- name: echo
  namespace: default
  parentRefs: [{group: "", kind: Service, name: echo, port: 80}]
  rules:
  - matches: [{headers: [{name: x-version, value: v2}], path: {type: PathPrefix, value: /api}, method: GET, queryParams: [{name: a, value: b}]}]
    backendRefs: [{name: echo-v1, port: 80, weight: 90}, {name: echo-v2, port: 80, weight: 10}]
    retry: {attempts: 2, codes: [503], backoff: 10ms}
    timeouts: {request: 3s, backendRequest: 300ms}
  - matches: [{path: {type: Exact, value: /old}}]
    filters: [{type: RequestRedirect, requestRedirect: {path: {type: ReplaceFullPath, replaceFullPath: /new}, statusCode: 301}}]
  - matches: [{path: {type: PathPrefix, value: /api}}]
    filters:
    - {type: URLRewrite, urlRewrite: {path: {type: ReplacePrefixMatch, replacePrefixMatch: /v2}}}
    - {type: RequestHeaderModifier, requestHeaderModifier: {set: [{name: x-route, value: api}], remove: [x-drop]}}
    - {type: RequestMirror, requestMirror: {backendRef: {name: echo-v2, port: 80}}}
    backendRefs: [{name: echo-v1, port: 80}]
authorizationPolicies:
- name: deny-admin
  namespace: default
  targetRefs: [{kind: Service, group: "", name: echo}]
  action: DENY
  rules:
  - from: [{source: {principals: ["cluster.local/ns/default/sa/client", "*/sa/admin"], ipBlocks: ["10.10.1.0/24"], notNamespaces: [kube-system]}}]
    to: [{operation: {hosts: ["*.example.com"], ports: ["80"], methods: ["GET"], paths: ["/admin/*"]}}]
    when: [{key: "request.headers[x-block]", values: ["yes"]}]
"#;
    write(dir, "config_yaml", "l7", l7.as_bytes());
}

fn framed(kind: u8, resources: &[Vec<u8>]) -> Vec<u8> {
    let mut out = vec![kind];
    for r in resources {
        out.extend_from_slice(&u16::try_from(r.len()).unwrap().to_be_bytes());
        out.extend_from_slice(r);
    }
    out
}

fn xds(dir: &Path) {
    let w = pb::Workload {
        uid: "Kubernetes//Pod/default/echo-1".into(),
        name: "echo-1".into(),
        namespace: "default".into(),
        addresses: vec![vec![10, 10, 2, 11]],
        tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
        service_account: "echo".into(),
        node: "node2".into(),
        services: [(
            "default/echo.default.svc.cluster.local".to_string(),
            pb::PortList {
                ports: vec![pb::Port {
                    service_port: 80,
                    target_port: 8080,
                    app_protocol: 0,
                }],
            },
        )]
        .into(),
        application_tunnel: Some(pb::ApplicationTunnel {
            protocol: 1,
            port: 15088,
        }),
        waypoint: Some(pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Address(
                pb::NetworkAddress {
                    network: String::new(),
                    address: vec![10, 10, 1, 99],
                    length: None,
                },
            )),
            hbone_mtls_port: 15008,
        }),
        authorization_policies: vec!["default/p".into()],
        ..Default::default()
    };
    let s = pb::Service {
        name: "echo".into(),
        namespace: "default".into(),
        hostname: "echo.default.svc.cluster.local".into(),
        addresses: vec![pb::NetworkAddress {
            network: String::new(),
            address: vec![10, 96, 0, 10],
            length: None,
        }],
        ports: vec![pb::Port {
            service_port: 80,
            target_port: 8080,
            app_protocol: 0,
        }],
        subject_alt_names: vec!["spiffe://cluster.local/ns/default/sa/echo".into()],
        ..Default::default()
    };
    let addr = |t| pb::Address { r#type: Some(t) }.encode_to_vec();
    let wl = addr(pb::address::Type::Workload(w));
    let svc = addr(pb::address::Type::Service(s));
    write(
        dir,
        "xds_resources",
        "workload",
        &framed(0, std::slice::from_ref(&wl)),
    );
    write(
        dir,
        "xds_resources",
        "workload_and_service",
        &framed(0, &[wl, svc]),
    );
    use pb_sec::string_match::MatchType;
    let a = pb_sec::Authorization {
        name: "p".into(),
        namespace: "default".into(),
        scope: pb_sec::Scope::WorkloadSelector as i32,
        action: pb_sec::Action::Deny as i32,
        rules: vec![pb_sec::Rule {
            clauses: vec![pb_sec::Clause {
                matches: vec![pb_sec::Match {
                    principals: vec![pb_sec::StringMatch {
                        match_type: Some(MatchType::Exact(
                            "cluster.local/ns/default/sa/sleep".into(),
                        )),
                    }],
                    not_namespaces: vec![pb_sec::StringMatch {
                        match_type: Some(MatchType::Prefix("kube".into())),
                    }],
                    source_ips: vec![pb_sec::Address {
                        address: vec![10, 0, 0, 0],
                        length: 8,
                    }],
                    destination_ports: vec![8080],
                    service_accounts: vec![pb_sec::ServiceAccountMatch {
                        namespace: "default".into(),
                        service_account: "sleep".into(),
                    }],
                    ..Default::default()
                }],
            }],
        }],
        dry_run: true,
    };
    write(
        dir,
        "xds_resources",
        "authorization",
        &framed(1, &[a.encode_to_vec()]),
    );
}

fn zds(dir: &Path) {
    use crate::zds::*;
    let add = WorkloadRequest {
        payload: Some(Payload::Add(AddWorkload {
            uid: "u".into(),
            workload_info: Some(WorkloadInfo {
                name: "pod".into(),
                namespace: "ns".into(),
                service_account: "sa".into(),
            }),
        })),
    };
    write(dir, "zds_message", "add", &add.encode_to_vec());
    write(
        dir,
        "zds_message",
        "del",
        &WorkloadRequest {
            payload: Some(Payload::Del(DelWorkload { uid: "u".into() })),
        }
        .encode_to_vec(),
    );
    write(
        dir,
        "zds_message",
        "keep",
        &WorkloadRequest {
            payload: Some(Payload::Keep(KeepWorkload { uid: "u".into() })),
        }
        .encode_to_vec(),
    );
    write(
        dir,
        "zds_message",
        "snapshot",
        &WorkloadRequest {
            payload: Some(Payload::SnapshotSent(SnapshotSent {})),
        }
        .encode_to_vec(),
    );
    write(
        dir,
        "zds_message",
        "hello",
        &ZdsHello {
            version: Version::V1 as i32,
        }
        .encode_to_vec(),
    );
    write(
        dir,
        "zds_message",
        "ack",
        &WorkloadResponse::ack(Some("no such pod".into())).encode_to_vec(),
    );
}

fn dns(dir: &Path) {
    use hickory_proto::op::{Edns, Message as Dns, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};
    let q = |name: &str, t: RecordType, edns: bool| {
        let mut m = Dns::new(0x1234, MessageType::Query, OpCode::Query);
        m.metadata.recursion_desired = true;
        m.queries
            .push(Query::query(Name::from_ascii(name).unwrap(), t));
        if edns {
            let mut e = Edns::new();
            e.set_max_payload(1232);
            e.set_dnssec_ok(true);
            m.edns = Some(e);
        }
        m.to_vec().unwrap()
    };
    for (file, name, t, edns) in [
        ("echo_a", "echo.", RecordType::A, false),
        ("echo_ns_aaaa", "echo.default.", RecordType::AAAA, true),
        (
            "echo_fqdn",
            "echo.default.svc.cluster.local.",
            RecordType::A,
            false,
        ),
        (
            "headless",
            "headless.default.svc.cluster.local.",
            RecordType::A,
            true,
        ),
        ("wildcard", "x.wild.example.com.", RecordType::A, false),
        ("external", "www.example.org.", RecordType::A, false),
        ("txt", "echo.default.", RecordType::TXT, false),
    ] {
        write(dir, "dns_message", file, &q(name, t, edns));
    }
}

fn proxy_protocol(dir: &Path) {
    use crate::proxy_protocol::{encode, SIGNATURE, TLV_PEER_IDENTITY};
    let id = b"spiffe://cluster.local/ns/default/sa/client";
    let v4 = encode(
        "10.10.1.11:40000".parse().unwrap(),
        "10.10.2.11:8080".parse().unwrap(),
        &[(TLV_PEER_IDENTITY, id)],
    )
    .unwrap();
    let mut with_payload = v4.clone();
    with_payload.extend_from_slice(b"GET / HTTP/1.1\r\n\r\n");
    write(dir, "proxy_protocol", "v4_identity", &v4);
    write(dir, "proxy_protocol", "v4_payload", &with_payload);
    let v6 = encode(
        "[fd00::1]:1".parse().unwrap(),
        "[fd00::2]:2".parse().unwrap(),
        &[(TLV_PEER_IDENTITY, id), (0x04, b"")],
    )
    .unwrap();
    write(dir, "proxy_protocol", "v6_two_tlvs", &v6);
    let mut local = SIGNATURE.to_vec();
    local.extend_from_slice(&[0x20, 0x00, 0, 0]);
    write(dir, "proxy_protocol", "local", &local);
}

fn rbac(dir: &Path) {
    // Arbitrary bytes: the target builds policies from whatever it gets.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..4 {
        let bytes: Vec<u8> = (0..256)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        write(dir, "rbac_model", &format!("random{i}"), &bytes);
    }
}

#[test]
#[ignore = "writes files; run by hand to refresh fuzz/corpus"]
fn write_seeds() {
    let Ok(dir) = std::env::var("ZTUNNEL_FUZZ_SEEDS") else {
        panic!("set ZTUNNEL_FUZZ_SEEDS to the corpus directory")
    };
    let dir = Path::new(&dir);
    hbone(dir);
    config(dir);
    xds(dir);
    zds(dir);
    dns(dir);
    proxy_protocol(dir);
    rbac(dir);
}

/// Each fuzz target's name (its directory under fuzz/corpus and fuzz/regressions) and
/// entry point.
type Target = (&'static str, fn(&[u8]));
const TARGETS: [Target; 7] = [
    ("hbone_connect", super::hbone_connect),
    ("config_yaml", super::config_yaml),
    ("xds_resources", super::xds_resources),
    ("zds_message", super::zds_message),
    ("dns_message", super::dns_message),
    ("proxy_protocol", super::proxy_protocol),
    ("rbac_model", super::rbac_model),
];

/// Every seed goes through its target without a panic (the targets' properties hold).
#[test]
fn seeds_pass_the_targets() {
    let dir = std::env::temp_dir().join(format!("ztunnel-seeds-{}", std::process::id()));
    hbone(&dir);
    config(&dir);
    xds(&dir);
    zds(&dir);
    dns(&dir);
    proxy_protocol(&dir);
    rbac(&dir);
    for (target, f) in TARGETS {
        for e in std::fs::read_dir(dir.join(target)).unwrap() {
            f(&std::fs::read(e.unwrap().path()).unwrap());
        }
    }
    // The config seeds are valid configs (a fuzzer starting from errors learns less).
    for e in std::fs::read_dir(dir.join("config_yaml")).unwrap() {
        let text = std::fs::read_to_string(e.unwrap().path()).unwrap();
        crate::config::LocalConfig::parse(Path::new("seed.yaml"), &text)
            .unwrap()
            .into_state(Path::new("seed.yaml"))
            .unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every committed input, `fuzz/corpus/<target>/` (the seeds above and what fuzzing runs
/// kept) and `fuzz/regressions/<target>/` (inputs that once crashed), goes through its
/// target: CI replays them here rather than building the instrumented fuzz targets.
#[test]
fn committed_inputs_pass_the_targets() {
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
    let replayed: usize = TARGETS
        .iter()
        .map(|&(target, f)| super::replay_committed(&fuzz, target, f))
        .sum();
    assert!(
        replayed >= 30,
        "only {replayed} committed inputs under {}",
        fuzz.display()
    );
}
