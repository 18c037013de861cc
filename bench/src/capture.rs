//! Capture benchmark (not a timed test): connection setup rate and 1 KiB round-trip
//! latency from a pod on node1 to a pod on node2, with eBPF capture, nftables capture,
//! and no capture (no ztunnel: plain pod-to-pod TCP), measured in the same run, rounds
//! interleaved, medians reported with ratios. Two scenarios: `mesh` (both pods
//! enrolled: outbound capture on the client, HBONE between the ztunnels) and `inbound`
//! (only the server enrolled: a plaintext client steered to 15006 by sk_lookup or
//! REDIRECT, which isolates inbound capture).
//!
//! `bench capture` gives the numbers (ARCHITECTURE.md, capture); `bench capture --quick`
//! is the smoke pass CI runs (bench/tests/smoke.rs).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mesh_tests::netsim::*;

struct Sizes {
    rounds: usize,
    connections: usize,
    round_trips: usize,
}

#[derive(Default, Clone)]
struct Sample {
    conn_per_s: f64,
    p50_us: f64,
    p99_us: f64,
}

fn measure(client: &Pod, to: SocketAddr, sizes: &Sizes) -> Result<Sample> {
    let (connections, round_trips) = (sizes.connections, sizes.round_trips);
    // Blocking sockets on a thread in the pod's netns: no runtime in the way.
    client.netns.run(move || {
        // Setup rate: connect, 1 byte each way, close.
        let start = Instant::now();
        for _ in 0..connections {
            let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
            s.set_nodelay(true)?;
            s.write_all(b"x")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).context("setup echo")?;
        }
        let conn_per_s = connections as f64 / start.elapsed().as_secs_f64();
        // Latency: 1 KiB out and back on one connection.
        let mut s = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_nodelay(true)?;
        let msg = pattern(1024, 9);
        let mut back = vec![0u8; 1024];
        let mut lat = Vec::with_capacity(round_trips);
        for _ in 0..round_trips {
            let t = Instant::now();
            s.write_all(&msg)?;
            s.read_exact(&mut back).context("1 KiB echo")?;
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        anyhow::ensure!(back == msg, "echo corrupted");
        lat.sort_by(f64::total_cmp);
        let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
        Ok(Sample {
            conn_per_s,
            p50_us: pct(0.50),
            p99_us: pct(0.99),
        })
    })?
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Both scenarios, `mesh` then `inbound`.
pub fn main(quick: bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _rt = rt.enter();
    let sizes = if quick {
        Sizes {
            rounds: 1,
            connections: 20,
            round_trips: 50,
        }
    } else {
        Sizes {
            rounds: 5,
            connections: 2000,
            round_trips: 5000,
        }
    };
    for scenario in ["mesh", "inbound"] {
        run(scenario, &sizes)?;
    }
    Ok(())
}

fn run(scenario: &str, sizes: &Sizes) -> Result<()> {
    println!("== scenario {scenario} ==");
    let modes = ["none", "nftables", "ebpf"];
    let mut results: HashMap<&str, Vec<Sample>> = HashMap::new();
    for round in 0..sizes.rounds {
        for mode in modes {
            // SAFETY: set before any ztunnel of this round starts; nothing reads it concurrently.
            unsafe { std::env::set_var("ZTUNNEL_TEST_CAPTURE", mode) };
            let topo = Topology::build(
                &prefix(&format!("b{}{round}{}", &scenario[..1], &mode[..1])),
                &[1, 1],
            )?;
            let cfg = format!(
                "workloads:\n{}{}",
                workload(&topo, "n1p1", "client", ""),
                workload(&topo, "n2p1", "server", "")
            );
            let enrolled: &[&str] = match (mode, scenario) {
                ("none", _) => &[],
                (_, "mesh") => &["n1p1", "n2p1"],
                _ => &["n2p1"],
            };
            let mesh = if mode == "none" {
                Mesh {
                    ztunnels: vec![],
                    commands: vec![],
                    topo,
                }
            } else {
                Mesh::start(topo, &cfg, enrolled, &HashMap::new(), &[])?
            };
            let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
            let _echo = EchoServer::start(&server.netns, 8080, None)?;
            let to = SocketAddr::new(server.ip, 8080);
            // Warm up (certificates, pooled HBONE connection).
            measure(
                client,
                to,
                &Sizes {
                    rounds: 1,
                    connections: 5,
                    round_trips: 20,
                },
            )?;
            let s = measure(client, to, sizes)?;
            println!(
                "round {round} {mode:<8}  {:>8.0} conn/s   1 KiB RTT p50 {:>7.1} us  p99 {:>7.1} us",
                s.conn_per_s, s.p50_us, s.p99_us
            );
            results.entry(mode).or_default().push(s);
        }
    }
    let med = |mode: &str, f: fn(&Sample) -> f64| median(results[mode].iter().map(f).collect());
    println!(
        "\nmedians of {} round(s): {} connections, {} round trips each",
        sizes.rounds, sizes.connections, sizes.round_trips
    );
    println!(
        "{:<8} {:<9} {:>10} {:>12} {:>12}",
        "scenario", "capture", "conn/s", "RTT p50 us", "RTT p99 us"
    );
    for mode in modes {
        println!(
            "{scenario:<8} {mode:<9} {:>10.0} {:>12.1} {:>12.1}",
            med(mode, |s| s.conn_per_s),
            med(mode, |s| s.p50_us),
            med(mode, |s| s.p99_us)
        );
    }
    let ratio = |a: &str, b: &str, f: fn(&Sample) -> f64| med(a, f) / med(b, f);
    println!("\n{scenario} ratios (same run):");
    for (a, b) in [("ebpf", "nftables"), ("ebpf", "none"), ("nftables", "none")] {
        println!(
            "  {a}/{b}: conn/s x{:.2}, RTT p50 x{:.2}, RTT p99 x{:.2}",
            ratio(a, b, |s| s.conn_per_s),
            ratio(a, b, |s| s.p50_us),
            ratio(a, b, |s| s.p99_us)
        );
    }
    println!();
    Ok(())
}
