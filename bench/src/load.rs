//! The load generator: blocking sockets on OS threads that entered the client pod's
//! netns. Blocking threads rather than async tasks because the constant-rate schedule
//! needs sub-millisecond send times (tokio's timer wheel has 1 ms resolution, which
//! would add up to 1 ms to every measured latency); `nanosleep` with a 1 ns timer slack
//! wakes within a few µs. Every loop is bounded in time and polls the interrupt flag.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::cleanup;

const IO_TIMEOUT: Duration = Duration::from_secs(10);
pub const PAYLOAD: usize = 1024;

/// Latency percentiles in µs.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Percentiles {
    pub count: u64,
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

fn new_hist() -> Histogram<u64> {
    // 1 µs .. 100 s at 3 significant digits.
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("constant histogram bounds are valid")
}

fn percentiles(h: &Histogram<u64>) -> Percentiles {
    let q = |q: f64| h.value_at_quantile(q) as f64;
    Percentiles {
        count: h.len(),
        p50_us: q(0.5),
        p90_us: q(0.9),
        p99_us: q(0.99),
        p999_us: q(0.999),
        max_us: h.max() as f64,
    }
}

/// Runs `n` threads inside the netns at `ns`, each given its index; collects results.
fn in_netns<R: Send + 'static>(
    ns: &Path,
    n: usize,
    f: impl Fn(usize) -> Result<R> + Send + Sync + 'static,
) -> Result<Vec<R>> {
    let f = std::sync::Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|i| {
            let (f, ns) = (f.clone(), ns.to_path_buf());
            std::thread::spawn(move || -> Result<R> {
                let file =
                    std::fs::File::open(&ns).with_context(|| format!("open {}", ns.display()))?;
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
                // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer slack
                // (default 50 µs), so sleeps end when asked.
                unsafe { nix::libc::prctl(nix::libc::PR_SET_TIMERSLACK, 1, 0, 0, 0) };
                f(i)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(r)) => out.push(r),
            Ok(Err(e)) => first_err = first_err.or(Some(e)),
            Err(_) => first_err = first_err.or(Some(anyhow::anyhow!("load thread panicked"))),
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

fn connect(to: SocketAddr) -> Result<TcpStream> {
    let s = TcpStream::connect_timeout(&to, IO_TIMEOUT).with_context(|| format!("connect {to}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(s)
}

/// A keep-alive HTTP/1.1 client sending POSTs of 1 KiB and expecting them echoed.
struct HttpClient {
    s: TcpStream,
    buf: Vec<u8>,
    req: std::sync::Arc<Vec<u8>>,
}

impl HttpClient {
    fn connect(to: SocketAddr, req: std::sync::Arc<Vec<u8>>) -> Result<HttpClient> {
        Ok(HttpClient {
            s: connect(to)?,
            buf: Vec::with_capacity(8192),
            req,
        })
    }

    fn request(&mut self) -> Result<()> {
        self.s.write_all(&self.req).context("send request")?;
        let mut tmp = [0u8; 16384];
        let head_end = loop {
            if let Some(p) = crate::server::find(&self.buf, b"\r\n\r\n") {
                break p + 4;
            }
            if self.buf.len() > 64 * 1024 {
                bail!("response head too long");
            }
            let n = self.s.read(&mut tmp).context("read response")?;
            if n == 0 {
                bail!("connection closed before the response");
            }
            self.buf.extend_from_slice(&tmp[..n]);
        };
        if !self.buf.starts_with(b"HTTP/1.1 200") {
            let line = String::from_utf8_lossy(&self.buf[..head_end.min(80)]).to_string();
            bail!("unexpected response {line:?}");
        }
        let len =
            crate::server::content_length(&self.buf[..head_end]).context("bad content-length")?;
        while self.buf.len() < head_end + len {
            let n = self.s.read(&mut tmp).context("read body")?;
            if n == 0 {
                bail!("connection closed in the body");
            }
            self.buf.extend_from_slice(&tmp[..n]);
        }
        if len != PAYLOAD {
            bail!("response body {len} bytes, want {PAYLOAD}");
        }
        self.buf.drain(..head_end + len);
        Ok(())
    }
}

fn request_bytes() -> std::sync::Arc<Vec<u8>> {
    let mut r = format!(
        "POST /bench HTTP/1.1\r\nhost: echo.default.svc.cluster.local\r\nuser-agent: bench\r\ncontent-type: application/octet-stream\r\ncontent-length: {PAYLOAD}\r\n\r\n"
    )
    .into_bytes();
    r.extend(mesh_tests::netsim::pattern(PAYLOAD, 7));
    std::sync::Arc::new(r)
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RateResult {
    pub target_rps: f64,
    pub achieved_rps: f64,
    pub connections: usize,
    /// Intended sends dropped because the run fell more than the grace period behind.
    pub missed: u64,
    pub latency: Percentiles,
}

/// Open-loop constant rate: each connection sends on a fixed schedule and latency runs
/// from the *intended* send time, so a stall is charged to every request it delayed
/// (no coordinated omission). A connection whose previous response is late sends the
/// next request at once.
pub fn constant_rate(
    ns: &Path,
    to: SocketAddr,
    rate: f64,
    conns: usize,
    duration: Duration,
) -> Result<RateResult> {
    let req = request_bytes();
    let interval = Duration::from_secs_f64(conns as f64 / rate);
    // Everyone starts on the same clock, connections spread evenly over one interval.
    let start = Instant::now() + Duration::from_millis(100);
    let end = start + duration;
    let grace = Duration::from_secs(2);
    let per_conn = in_netns(ns, conns, move |i| -> Result<(Histogram<u64>, u64, u64)> {
        let mut c = HttpClient::connect(to, req.clone())?;
        let mut h = new_hist();
        let mut t = start + interval.mul_f64(i as f64 / conns as f64);
        let (mut done, mut missed) = (0u64, 0u64);
        while t < end {
            cleanup::check()?;
            let now = Instant::now();
            if now < t {
                std::thread::sleep(t - now);
            } else if now > end + grace {
                // Far behind: count what was never sent instead of running on unbounded.
                missed += ((end - t).as_secs_f64() / interval.as_secs_f64()).ceil() as u64;
                break;
            }
            c.request()?;
            let lat = Instant::now().saturating_duration_since(t).as_micros() as u64;
            h.saturating_record(lat.max(1));
            done += 1;
            t += interval;
        }
        Ok((h, done, missed))
    })?;
    let mut h = new_hist();
    let (mut done, mut missed) = (0, 0);
    for (ph, d, m) in per_conn {
        h.add(&ph).context("merge histograms")?;
        done += d;
        missed += m;
    }
    let elapsed = start.elapsed().as_secs_f64().max(duration.as_secs_f64());
    Ok(RateResult {
        target_rps: rate,
        achieved_rps: done as f64 / elapsed,
        connections: conns,
        missed,
        latency: percentiles(&h),
    })
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct MaxRateResult {
    pub connections: usize,
    pub requests: u64,
    pub rps: f64,
    /// Closed loop: service time per request (no schedule to be late against).
    pub latency: Percentiles,
}

/// Closed loop: every connection sends its next request as soon as the last answer came.
pub fn max_rate(
    ns: &Path,
    to: SocketAddr,
    conns: usize,
    duration: Duration,
) -> Result<MaxRateResult> {
    let req = request_bytes();
    let start = Instant::now();
    let end = start + duration;
    let per_conn = in_netns(ns, conns, move |_| -> Result<(Histogram<u64>, u64)> {
        let mut c = HttpClient::connect(to, req.clone())?;
        let mut h = new_hist();
        let mut n = 0;
        while Instant::now() < end {
            cleanup::check()?;
            let t = Instant::now();
            c.request()?;
            h.saturating_record((t.elapsed().as_micros() as u64).max(1));
            n += 1;
        }
        Ok((h, n))
    })?;
    let elapsed = start.elapsed().as_secs_f64();
    let mut h = new_hist();
    let mut n = 0;
    for (ph, c) in per_conn {
        h.add(&ph).context("merge histograms")?;
        n += c;
    }
    Ok(MaxRateResult {
        connections: conns,
        requests: n,
        rps: n as f64 / elapsed,
        latency: percentiles(&h),
    })
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct BulkResult {
    pub bytes: u64,
    pub seconds: f64,
    pub gbit_per_s: f64,
}

/// One stream: `bytes` to the sink, which answers the count it read once we half-close.
pub fn bulk(ns: &Path, to: SocketAddr, bytes: u64) -> Result<BulkResult> {
    let r = in_netns(ns, 1, move |_| -> Result<BulkResult> {
        let chunk = mesh_tests::netsim::pattern(256 * 1024, 11);
        let start = Instant::now();
        let mut s = connect(to)?;
        let mut left = bytes;
        while left > 0 {
            cleanup::check()?;
            let n = left.min(chunk.len() as u64) as usize;
            s.write_all(&chunk[..n]).context("bulk write")?;
            left -= n as u64;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        let mut count = [0u8; 8];
        s.read_exact(&mut count).context("sink's byte count")?;
        let seconds = start.elapsed().as_secs_f64();
        let got = u64::from_le_bytes(count);
        if got != bytes {
            bail!("sink read {got} bytes, sent {bytes}");
        }
        Ok(BulkResult {
            bytes,
            seconds,
            gbit_per_s: bytes as f64 * 8.0 / seconds / 1e9,
        })
    })?;
    r.into_iter().next().context("no bulk result")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ConnRateResult {
    pub workers: usize,
    pub connections: u64,
    pub errors: u64,
    pub conn_per_s: f64,
    /// connect + 1 KiB echo + close, per connection.
    pub latency: Percentiles,
}

/// `workers` loops of connect, 1 KiB echo, close.
pub fn conn_rate(
    ns: &Path,
    to: SocketAddr,
    workers: usize,
    duration: Duration,
) -> Result<ConnRateResult> {
    let start = Instant::now();
    let end = start + duration;
    let per = in_netns(
        ns,
        workers,
        move |_| -> Result<(Histogram<u64>, u64, u64)> {
            let msg = mesh_tests::netsim::pattern(PAYLOAD, 5);
            let mut back = vec![0u8; PAYLOAD];
            let mut h = new_hist();
            let (mut ok, mut errors) = (0, 0);
            while Instant::now() < end {
                cleanup::check()?;
                let t = Instant::now();
                let r = (|| -> Result<()> {
                    let mut s = connect(to)?;
                    s.write_all(&msg)?;
                    s.read_exact(&mut back)?;
                    Ok(())
                })();
                match r {
                    Ok(()) if back == msg => {
                        h.saturating_record((t.elapsed().as_micros() as u64).max(1));
                        ok += 1;
                    }
                    _ => errors += 1,
                }
            }
            Ok((h, ok, errors))
        },
    )?;
    let elapsed = start.elapsed().as_secs_f64();
    let mut h = new_hist();
    let (mut ok, mut errors) = (0, 0);
    for (ph, o, e) in per {
        h.add(&ph).context("merge histograms")?;
        ok += o;
        errors += e;
    }
    if ok == 0 {
        bail!("no connection succeeded ({errors} errors)");
    }
    Ok(ConnRateResult {
        workers,
        connections: ok,
        errors,
        conn_per_s: ok as f64 / elapsed,
        latency: percentiles(&h),
    })
}

/// Idle connections held open from the client netns; dropped (closed) with the value.
pub struct IdleConns {
    pub conns: Vec<TcpStream>,
    pub open_seconds: f64,
}

/// Opens `n` connections to the echo port, each proven end to end by a 1-byte echo, within
/// `deadline`; fewer if it runs out of time (the count says how many).
pub fn open_idle(ns: &Path, to: SocketAddr, n: usize, deadline: Duration) -> Result<IdleConns> {
    let ns: PathBuf = ns.to_path_buf();
    let mut r = in_netns(&ns, 1, move |_| -> Result<IdleConns> {
        let start = Instant::now();
        let mut conns = Vec::with_capacity(n);
        while conns.len() < n && start.elapsed() < deadline {
            cleanup::check()?;
            let mut s = connect(to)?;
            s.write_all(b"x")?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).context("idle connection echo")?;
            conns.push(s);
        }
        Ok(IdleConns {
            conns,
            open_seconds: start.elapsed().as_secs_f64(),
        })
    })?;
    r.pop().context("no idle result")
}
