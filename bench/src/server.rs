//! The server app in the server pod: HTTP/1.1 echo (8080), TCP echo (9000) and a sink
//! that answers the byte count it read (9001). Hand-written HTTP/1.1 (content-length
//! bodies only, keep-alive) so the app costs as little CPU as possible next to the
//! proxies being measured.
//!
//! It runs as a child process (this binary re-executed with `--serve NETNS`): 10,000
//! idle tunnels are 10,000 sockets on each side, and the two ends in one process would
//! pass the file limit, which an unprivileged container may not raise.

use std::io::{BufRead, Read};
use std::path::Path;

use anyhow::{bail, Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const HTTP_PORT: u16 = 8080;
pub const ECHO_PORT: u16 = 9000;
pub const SINK_PORT: u16 = 9001;
/// Largest request head accepted: the proxies add a few headers, nothing near this.
const MAX_HEAD: usize = 64 * 1024;

/// The server process; killed on drop.
pub struct Server {
    child: std::process::Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts the server in the netns at `ns` and waits until it listens.
    pub fn start(ns: &Path) -> Result<Server> {
        let mut child = std::process::Command::new(std::env::current_exe()?)
            .arg("--serve")
            .arg(ns)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .context("spawn the server process")?;
        crate::cleanup::register_pid(child.id());
        let mut line = String::new();
        let out = child.stdout.take().context("server stdout")?;
        std::io::BufReader::new(out).read_line(&mut line)?;
        let server = Server { child };
        if line.trim() != "ready" {
            bail!("server process did not start: {line:?}");
        }
        Ok(server)
    }
}

/// The `--serve NETNS` process: enter the netns, listen, say "ready", serve until stdin
/// closes (the parent exited or dropped us).
pub fn serve_main(ns: &Path) -> Result<()> {
    let f = std::fs::File::open(ns).with_context(|| format!("open {}", ns.display()))?;
    // Before the runtime exists: its threads inherit this thread's netns.
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let bind = |port: u16| -> Result<TcpListener> {
            let l = std::net::TcpListener::bind(("0.0.0.0", port))
                .with_context(|| format!("bind {port}"))?;
            l.set_nonblocking(true)?;
            Ok(TcpListener::from_std(l)?)
        };
        tokio::spawn(accept_loop(bind(HTTP_PORT)?, |s| Box::pin(http_conn(s))));
        tokio::spawn(accept_loop(bind(ECHO_PORT)?, |s| Box::pin(echo_conn(s))));
        tokio::spawn(accept_loop(bind(SINK_PORT)?, |s| Box::pin(sink_conn(s))));
        println!("ready");
        tokio::task::spawn_blocking(|| {
            let mut b = [0u8; 1];
            while std::io::stdin().read(&mut b).is_ok_and(|n| n > 0) {}
        })
        .await?;
        Ok(())
    })
}

type ConnFuture = std::pin::Pin<Box<dyn std::future::Future<Output = std::io::Result<()>> + Send>>;

async fn accept_loop(l: TcpListener, handler: fn(TcpStream) -> ConnFuture) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    // A peer going away mid-request is normal under load; nothing to report.
                    let _ = handler(s).await;
                });
            }
            // EMFILE and friends: back off instead of spinning.
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
        }
    }
}

pub fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Content-Length of a request or response head (0 when absent); None when malformed.
pub fn content_length(head: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(head).ok()?;
    for line in text.split("\r\n").skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                return v.trim().parse().ok();
            }
            if k.eq_ignore_ascii_case("transfer-encoding") {
                // Not used by our client; refuse rather than misparse.
                return None;
            }
        }
    }
    Some(0)
}

async fn http_conn(mut s: TcpStream) -> std::io::Result<()> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "bad request");
    let mut buf: Vec<u8> = Vec::with_capacity(8192);
    let mut out: Vec<u8> = Vec::with_capacity(2048);
    loop {
        let head_end = loop {
            if let Some(p) = find(&buf, b"\r\n\r\n") {
                break p + 4;
            }
            if buf.len() > MAX_HEAD || s.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        };
        let len = content_length(&buf[..head_end]).ok_or_else(bad)?;
        while buf.len() < head_end + len {
            if s.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        }
        out.clear();
        out.extend_from_slice(format!("HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {len}\r\n\r\n").as_bytes());
        out.extend_from_slice(&buf[head_end..head_end + len]);
        s.write_all(&out).await?;
        buf.drain(..head_end + len);
    }
}

async fn echo_conn(mut s: TcpStream) -> std::io::Result<()> {
    let (mut r, mut w) = s.split();
    tokio::io::copy(&mut r, &mut w).await?;
    w.shutdown().await
}

async fn sink_conn(mut s: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; 256 * 1024];
    let mut total: u64 = 0;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        total += n as u64;
    }
    s.write_all(&total.to_le_bytes()).await?;
    s.shutdown().await
}
