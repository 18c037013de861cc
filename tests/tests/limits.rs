//! Resource limits under load, end to end: a fast sender towards a slow reader must be
//! held back by flow control (TCP windows and HBONE's HTTP/2 windows) rather than by
//! ztunnel's memory. Run with `--nocapture` to see the measured numbers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mesh_tests::netsim::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const MIB: u64 = 1024 * 1024;

/// Byte `i` of an endless deterministic stream, computable at any offset (so the reader
/// can check each chunk where it lands without keeping the stream).
fn fill_pattern(offset: u64, buf: &mut [u8]) {
    let mut i = 0;
    while i < buf.len() {
        let pos = offset + i as u64;
        // splitmix64 of the 8-byte word index.
        let mut z = (pos / 8).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let word = z.to_le_bytes();
        let start = (pos % 8) as usize;
        let n = (8 - start).min(buf.len() - i);
        buf[i..i + n].copy_from_slice(&word[start..start + n]);
        i += n;
    }
}

/// FNV-1a over a byte stream, to print one checksum per side.
fn fnv(mut h: u64, data: &[u8]) -> u64 {
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}
const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn vm_rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// The largest receive and send buffers TCP may grow to in a netns (tcp_rmem, tcp_wmem maxima).
fn tcp_buffer_max(ns: &Netns) -> Result<(u64, u64)> {
    let max = |key: &str| -> Result<u64> {
        let v = ns.exec("sysctl", &["-n", key])?;
        v.split_whitespace()
            .last()
            .and_then(|x| x.parse().ok())
            .with_context(|| format!("{key}: {v}"))
    };
    Ok((max("net.ipv4.tcp_rmem")?, max("net.ipv4.tcp_wmem")?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_reader_backpressures_a_fast_sender() -> Result<()> {
    let topo = Topology::build(&prefix("lb"), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "sleep", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let pids: Vec<u32> = mesh
        .ztunnels
        .iter()
        .map(|z| z.pid().context("ztunnel pid"))
        .collect::<Result<_>>()?;

    // The reader: 1 MiB/s (token bucket, 64 KiB burst) until told to drain, checking
    // every byte against the pattern at its offset.
    let listener = server.netns.listen(9000)?;
    let read = Arc::new(AtomicU64::new(0));
    let drain = Arc::new(AtomicBool::new(false));
    let reader = {
        let (read, drain) = (read.clone(), drain.clone());
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await?;
            let mut buf = vec![0u8; 64 * 1024];
            let mut want = vec![0u8; 64 * 1024];
            let (mut tokens, mut last) = (0f64, Instant::now());
            let mut sum = FNV_START;
            loop {
                let limit = if drain.load(Ordering::Relaxed) {
                    buf.len()
                } else {
                    let now = Instant::now();
                    tokens = (tokens + now.duration_since(last).as_secs_f64() * MIB as f64)
                        .min(64.0 * 1024.0);
                    last = now;
                    if tokens < 4096.0 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    tokens as usize
                };
                let n = s.read(&mut buf[..limit]).await?;
                if n == 0 {
                    return Ok::<_, anyhow::Error>(sum);
                }
                tokens -= n as f64;
                let off = read.load(Ordering::Relaxed);
                fill_pattern(off, &mut want[..n]);
                anyhow::ensure!(
                    buf[..n] == want[..n],
                    "bytes at offset {off}..{} differ from what was sent",
                    off + n as u64
                );
                sum = fnv(sum, &buf[..n]);
                read.fetch_add(n as u64, Ordering::Relaxed);
            }
        })
    };

    // The sender: up to 1 GiB as fast as the socket takes it, counting what write() accepted.
    let sent = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut conn = client
        .netns
        .connect(SocketAddr::new(server.ip, 9000))
        .await?;
    let sender = {
        let (sent, stop) = (sent.clone(), stop.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut sum = FNV_START;
            let mut off = 0u64;
            while off < 1024 * MIB && !stop.load(Ordering::Relaxed) {
                fill_pattern(off, &mut buf);
                let n = conn.write(&buf).await?;
                sum = fnv(sum, &buf[..n]);
                off += n as u64;
                sent.store(off, Ordering::Relaxed);
            }
            conn.shutdown().await?;
            // Keep the socket until the reader has it all (the relay ends on our EOF).
            let mut rest = Vec::new();
            conn.read_to_end(&mut rest).await?;
            Ok::<_, anyhow::Error>((off, sum))
        })
    };

    // Sample RSS and progress for 25 s; the first 5 s fill the windows and buffers.
    let window = Duration::from_secs(25);
    let settle = Duration::from_secs(5);
    let rss_before: Vec<u64> = pids.iter().map(|p| vm_rss(*p).unwrap_or(0)).collect();
    let start = Instant::now();
    let mut rss_base = vec![0u64; pids.len()];
    let mut rss_max = vec![0u64; pids.len()];
    let (mut in_flight_max, mut in_flight_filled) = (0u64, 0u64);
    while start.elapsed() < window {
        tokio::time::sleep(Duration::from_millis(250)).await;
        anyhow::ensure!(
            !reader.is_finished() && !sender.is_finished(),
            "a side ended early"
        );
        let rss: Vec<u64> = pids
            .iter()
            .map(|p| vm_rss(*p).context("ztunnel exited"))
            .collect::<Result<_>>()?;
        let (s, r) = (sent.load(Ordering::Relaxed), read.load(Ordering::Relaxed));
        in_flight_max = in_flight_max.max(s.saturating_sub(r));
        if start.elapsed() < settle {
            rss_base = rss.clone();
            in_flight_filled = s.saturating_sub(r);
        } else {
            for (m, v) in rss_max.iter_mut().zip(&rss) {
                *m = (*m).max(*v);
            }
        }
    }
    let rss_end: Vec<u64> = pids.iter().map(|p| vm_rss(*p).unwrap_or(0)).collect();
    let (s, r) = (sent.load(Ordering::Relaxed), read.load(Ordering::Relaxed));
    let secs = start.elapsed().as_secs_f64();

    // What the path can hold: the sender's send buffer and the client ztunnel's receive
    // buffer (captured TCP), the HBONE stream window (which covers the client's h2 send
    // queue, the tunnel's TCP connection and the server's h2 receive buffer), a copy
    // buffer on each side, then the server ztunnel's send buffer and the reader's
    // receive buffer.
    let (rmem_c, wmem_c) = tcp_buffer_max(&client.netns)?;
    let (rmem_s, wmem_s) = tcp_buffer_max(&server.netns)?;
    let bound = wmem_c + rmem_c + 4 * MIB + 2 * 64 * 1024 + wmem_s + rmem_s;
    println!(
        "backpressure: {secs:.1} s: sender wrote {:.1} MiB, reader read {:.1} MiB ({:.2} MiB/s); in flight {:.1} MiB after fill, max {:.1} MiB (bound {:.1} MiB)",
        s as f64 / MIB as f64,
        r as f64 / MIB as f64,
        r as f64 / MIB as f64 / secs,
        in_flight_filled as f64 / MIB as f64,
        in_flight_max as f64 / MIB as f64,
        bound as f64 / MIB as f64
    );
    for (i, _) in pids.iter().enumerate() {
        println!(
            "backpressure: ztunnel node{}: RSS before {:.1} MiB, after fill {:.1} MiB, max {:.1} MiB, end {:.1} MiB",
            i + 1,
            rss_before[i] as f64 / MIB as f64,
            rss_base[i] as f64 / MIB as f64,
            rss_max[i] as f64 / MIB as f64,
            rss_end[i] as f64 / MIB as f64
        );
    }
    // scripts/test.sh runs this beside the e2e suites on 2 cores, so nothing here is a
    // timing: the reader's bucket allows 1 MiB/s (next to nothing for the path), and 60%
    // of that over the time actually measured leaves room for a loaded machine while a
    // stalled path (reads stop when the windows fill) reads a few MiB at most.
    assert!(
        r as f64 >= 0.6 * secs * MIB as f64,
        "the reader got only {r} bytes at 1 MiB/s in {secs:.1} s"
    );
    assert!(
        s < 1024 * MIB / 2,
        "the sender was not held back: {s} bytes accepted"
    );
    assert!(
        in_flight_max <= bound,
        "{in_flight_max} bytes accepted beyond what was read; the path holds at most {bound}"
    );
    for i in 0..pids.len() {
        let growth = rss_max[i].saturating_sub(rss_base[i]);
        assert!(
            growth < 16 * MIB,
            "ztunnel node{} RSS grew {growth} bytes while the transfer was blocked",
            i + 1
        );
    }

    // Drain: the sender stops and half-closes, the reader takes the rest at full speed;
    // it must have exactly the bytes the sender wrote, in order.
    stop.store(true, Ordering::Relaxed);
    drain.store(true, Ordering::Relaxed);
    // ~40 MiB at full speed: under a second here; 60 s only catches a hang, on any load.
    let (total, sent_sum) = tokio::time::timeout(Duration::from_secs(60), sender)
        .await
        .context("sender did not finish")???;
    let read_sum = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .context("reader did not finish")???;
    let got = read.load(Ordering::Relaxed);
    println!("backpressure: drained: sent {total} bytes (fnv {sent_sum:016x}), read {got} bytes (fnv {read_sum:016x})");
    assert_eq!(
        got, total,
        "the reader got a different number of bytes than were sent"
    );
    assert_eq!(read_sum, sent_sum);
    Ok(())
}

/// Streams stalled by their readers hold HBONE connection-window credit (4 MiB each, the
/// connection has 16 MiB): does another connection between the same pods, pooled on
/// the same HBONE connection, still get through? Not yet: credit is returned only once
/// bytes reach the app (that is what bounds memory), so four stalled streams use up the
/// connection window and every other stream on it waits (head-of-line blocking; Istio's
/// tuning has the same arithmetic). Kept as the reproducer for the fix, which has to
/// choose between the per-connection memory bound and this: e.g. the server growing the
/// connection window with its open streams, or the pool not placing new streams on a
/// connection whose window is exhausted. Run it with `--ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known head-of-line blocking on a pooled HBONE connection, see the comment"]
async fn stalled_streams_and_a_live_one_on_one_hbone_connection() -> Result<()> {
    let topo = Topology::build(&prefix("lc"), &[1, 1])?;
    let cfg = format!(
        "workloads:\n{}{}",
        workload(&topo, "n1p1", "sleep", ""),
        workload(&topo, "n2p1", "server", "")
    );
    let mesh = Mesh::start(topo, &cfg, &["n1p1", "n2p1"], &HashMap::new(), &[])?;
    let (client, server) = (mesh.topo.pod("n1p1"), mesh.topo.pod("n2p1"));
    let _echo = EchoServer::start(&server.netns, 8080, None)?;
    // Accepts and never reads.
    let listener = server.netns.listen(9000)?;
    let held = tokio::spawn(async move {
        let mut keep = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            keep.push(s);
        }
    });
    let sent = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    for i in 0..5u64 {
        let mut c = client
            .netns
            .connect(SocketAddr::new(server.ip, 9000))
            .await?;
        let sent = sent.clone();
        senders.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut off = 0;
            loop {
                fill_pattern(off + i * (1 << 40), &mut buf);
                match c.write(&buf).await {
                    Ok(n) => {
                        off += n as u64;
                        sent.fetch_add(n as u64, Ordering::Relaxed);
                    }
                    Err(_) => return,
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stalled = sent.load(Ordering::Relaxed);
    let started = Instant::now();
    let echo = async {
        let mut s = client
            .netns
            .connect(SocketAddr::new(server.ip, 8080))
            .await?;
        echo_roundtrip(&mut s, &pattern(1024, 1)).await
    };
    let r = tokio::time::timeout(Duration::from_secs(10), echo).await;
    println!(
        "stalled streams: 5 senders wrote {:.1} MiB towards readers that never read; a new echo on the same pod pair: {:?} after {:?}",
        stalled as f64 / MIB as f64,
        r.as_ref().map(|x| x.as_ref().map(|v| v.len())),
        started.elapsed()
    );
    for s in senders {
        s.abort();
    }
    held.abort();
    let got = r.context("an echo between the same pods waited 10 s behind stalled streams")??;
    assert_eq!(got, pattern(1024, 1));
    Ok(())
}
