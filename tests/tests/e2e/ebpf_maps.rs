//! A hostile pod against the eBPF capture's shared maps (SECURITY.md, "eBPF maps"): its
//! connects must not fill node-wide maps, turn ztunnel's deliveries into a loop through
//! 15006, or push out other pods' state, and what it leaves must not survive a restart.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use mesh_tests::netsim::*;
use socket2::{Domain, Socket, Type};

/// One socket re-`connect()`ing to its own pod's address, port after port: every attempt
/// is refused (nothing listens), and each one ran through connect4 and sockops.
fn self_connect_loop(attacker: &Pod, attempts: u32) -> Result<u32> {
    let std::net::IpAddr::V4(ip) = attacker.ip else {
        anyhow::bail!("this test runs on an IPv4 topology")
    };
    attacker.netns.run(move || -> Result<u32> {
        let mut s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        let mut refused = 0;
        for i in 0..attempts {
            let port = 1 + (i % 65000) as u16;
            // Skip what the pod's own ztunnel listens on, and the app's port.
            if (15000..=15100).contains(&port) || port == 8080 {
                continue;
            }
            match s.connect(&SocketAddr::V4(SocketAddrV4::new(ip, port)).into()) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused += 1,
                Err(e) => anyhow::bail!("connect {ip}:{port} on attempt {i}: {e}"),
                // The kernel picked `port` as the source port too: TCP's self-connect.
                Ok(()) if s.local_addr()?.as_socket().map(|a| a.port()) == Some(port) => {
                    s = Socket::new(Domain::IPV4, Type::STREAM, None)?
                }
                Ok(()) => {
                    anyhow::bail!("{ip}:{port} accepted a connection; nothing should listen there")
                }
            }
        }
        Ok(refused)
    })?
}

/// Per-connection entries of node 1's pinned maps.
fn occupancy(mesh: &Mesh) -> Result<HashMap<&'static str, usize>> {
    let seen = ztunnel_ebpf::inspect(&mesh.topo.bpffs.join("node1"))?;
    Ok([
        "zt_local_conns",
        "zt_local_by_cookie",
        "zt_orig_by_cookie",
        "zt_orig_by_tuple",
    ]
    .into_iter()
    .map(|m| (m, seen.entries(m)))
    .collect())
}

async fn echo(from: &Pod, to: SocketAddr) -> Result<()> {
    let data = pattern(32 * 1024, 11);
    let mut s = from.netns.connect(to).await?;
    let back = echo_roundtrip(&mut s, &data).await?;
    ensure!(back == data, "{} -> {to}: echo differs", from.name);
    Ok(())
}

/// Deliveries into n1p2 from both nodes, and the attacker's own inbound.
async fn traffic_works(mesh: &Mesh) -> Result<()> {
    let victim = SocketAddr::new(mesh.topo.pod("n1p2").ip, 8080);
    echo(mesh.topo.pod("n2p1"), victim).await?; // HBONE in from node 2
    echo(mesh.topo.pod("n1p3"), victim).await?; // same node
    echo(
        mesh.topo.pod("n2p1"),
        SocketAddr::new(mesh.topo.pod("n1p1").ip, 8080),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_pod_cannot_exhaust_ebpf_maps() -> Result<()> {
    if capture_mode() != "ebpf" {
        return skipped("the eBPF maps exist only with eBPF capture");
    }
    let topo = Topology::build(&prefix("bm"), &[3, 1])?;
    let cfg = format!(
        "workloads:\n{}{}{}{}",
        workload(&topo, "n1p1", "attacker", ""),
        workload(&topo, "n1p2", "server", ""),
        workload(&topo, "n1p3", "client", ""),
        workload(&topo, "n2p1", "client", "")
    );
    let mut mesh = Mesh::start(
        topo,
        &cfg,
        &["n1p1", "n1p2", "n1p3", "n2p1"],
        &HashMap::new(),
        &[],
    )?;
    let _victim = EchoServer::start(&mesh.topo.pod("n1p2").netns, 8080, None)?;
    let _attacker_app = EchoServer::start(&mesh.topo.pod("n1p1").netns, 8080, None)?;
    traffic_works(&mesh).await?;

    // More attempts than zt_local_conns once held (65,536): each used to leave an entry,
    // and a full map lost ztunnel's deliveries their exemption from 15006.
    let refused = self_connect_loop(mesh.topo.pod("n1p1"), 70_000)?;
    ensure!(refused > 68_000, "only {refused} connects were refused");
    let after = occupancy(&mesh)?;
    println!("after 70,000 self-connects: {after:?}");
    for (map, n) in &after {
        ensure!(
            *n < 64,
            "{map} holds {n} entries after the attacker's self-connects"
        );
    }
    traffic_works(&mesh)
        .await
        .map_err(|e| e.context(format!("after the self-connect flood: {}", mesh.logs())))?;

    // A pod flooding captured connects (to an address outside the mesh, which refuses)
    // while another pod's connections through the same node proxy carry on.
    let stop = Arc::new(AtomicBool::new(false));
    let victim = connect_loop(
        mesh.topo.pod("n1p3"),
        SocketAddr::new(mesh.topo.pod("n1p2").ip, 8080),
        stop.clone(),
    );
    let flooding = {
        let path = mesh.topo.pod("n1p1").netns.path();
        let stop = stop.clone();
        std::thread::spawn(move || -> Result<u64> {
            let ns = std::fs::File::open(path)?;
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            let mut n = 0;
            let outside = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 2), 9));
            while !stop.load(Ordering::Relaxed) {
                let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
                s.set_nonblocking(true)?;
                let _ = s.connect(&outside.into());
                n += 1;
            }
            Ok(n)
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let flooded = flooding
        .join()
        .map_err(|_| anyhow::anyhow!("flood thread panicked"))??;
    let (ok, failed) = victim
        .join()
        .map_err(|_| anyhow::anyhow!("victim thread panicked"))?;
    println!(
        "flood: {flooded} connects; victim: {ok} ok, {} failed",
        failed.len()
    );
    ensure!(
        failed.is_empty(),
        "the victim's connections failed during the flood: {:?}",
        &failed[..failed.len().min(5)]
    );
    ensure!(
        ok > 10,
        "the victim made only {ok} connections during the flood"
    );

    // A new ztunnel takes the pinned maps over: what it finds is bounded, and it works.
    let old = mesh.ztunnels.remove(0);
    drop(old);
    let z = mesh.spawn_ztunnel(1, "ztunnel-node1-restarted.log")?;
    mesh.ztunnels.insert(0, z);
    wait_for(
        "node 1's per-connection maps to drain",
        Duration::from_secs(10),
        || {
            occupancy(&mesh)
                .map(|o| o.values().all(|n| *n < 64))
                .unwrap_or(false)
        },
    )?;
    traffic_works(&mesh)
        .await
        .map_err(|e| e.context(format!("after a ztunnel restart: {}", mesh.logs())))?;
    Ok(())
}
