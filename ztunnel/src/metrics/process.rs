//! Process metrics (Prometheus' standard names), read from /proc at scrape time, plus
//! gauges computed from live state (certificates held and their nearest expiry).

use std::sync::Arc;
use std::time::SystemTime;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::identity::manager::CertManager;

#[derive(Debug, Default)]
pub struct ProcessCollector {
    /// Set once the certificate manager exists.
    pub certs: std::sync::OnceLock<Arc<CertManager>>,
}

struct Process {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    open_fds: i64,
    max_fds: i64,
    start_time: f64,
}

fn read_process() -> Option<Process> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name (which may contain spaces).
    let f: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    let tick = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)? as f64;
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .unwrap_or(4096) as i64;
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("btime ")
                .and_then(|v| v.trim().parse::<f64>().ok())
        })?;
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    let max_fds = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft as i64)
        .unwrap_or(0);
    Some(Process {
        cpu_seconds: (num(11)? + num(12)?) as f64 / tick,
        threads: num(17)? as i64,
        start_time: boot + num(19)? as f64 / tick,
        virtual_bytes: num(20)? as i64,
        resident_bytes: num(21)? as i64 * page,
        open_fds,
        max_fds,
    })
}

fn gauge<N: prometheus_client::encoding::EncodeGaugeValue>(
    e: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    v: N,
) -> std::fmt::Result
where
    ConstGauge<N>: EncodeMetric,
{
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut e: DescriptorEncoder) -> std::fmt::Result {
        if let Some(p) = read_process() {
            let c = ConstCounter::new(p.cpu_seconds);
            c.encode(e.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                None,
                c.metric_type(),
            )?)?;
            gauge(
                &mut e,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                p.resident_bytes,
            )?;
            gauge(
                &mut e,
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                p.virtual_bytes,
            )?;
            gauge(&mut e, "process_threads", "Number of OS threads", p.threads)?;
            gauge(
                &mut e,
                "process_open_fds",
                "Number of open file descriptors",
                p.open_fds,
            )?;
            gauge(
                &mut e,
                "process_max_fds",
                "Maximum number of open file descriptors",
                p.max_fds,
            )?;
            gauge(
                &mut e,
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds",
                p.start_time,
            )?;
        }
        // Scrapes are served on the runtime, so its task count is at hand (leak detector).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            gauge(
                &mut e,
                "ztunnel_tokio_alive_tasks",
                "Tasks alive on the proxy's runtime",
                rt.metrics().num_alive_tasks() as i64,
            )?;
        }
        if let Some(certs) = self.certs.get() {
            let held = certs.snapshot();
            let now = SystemTime::now();
            let nearest = held
                .iter()
                .filter_map(|(_, c)| c.as_ref())
                .map(|c| {
                    c.cert
                        .not_after
                        .duration_since(now)
                        .map(|d| d.as_secs_f64())
                        .unwrap_or(0.0)
                })
                .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.min(v))));
            gauge(
                &mut e,
                "ztunnel_certificates",
                "Certificates held (one per local identity)",
                held.iter().filter(|(_, c)| c.is_some()).count() as i64,
            )?;
            if let Some(n) = nearest {
                gauge(
                    &mut e,
                    "ztunnel_certificate_nearest_expiry_seconds",
                    "Seconds until the first held certificate expires",
                    n,
                )?;
            }
        }
        Ok(())
    }
}
