//! results.md (also printed), results.json and the plots.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};

use crate::scale::median;
use crate::{Results, Row};

const DIRECT: &str = "direct";

pub fn write_all(out: &Path, res: &Results) -> Result<()> {
    std::fs::write(out.join("results.json"), serde_json::to_string_pretty(res)?)
        .context("write results.json")?;
    let md = markdown(res);
    println!("\n{md}");
    std::fs::write(out.join("results.md"), &md).context("write results.md")?;
    std::fs::write(out.join("summary.md"), crate::summary::markdown(res))
        .context("write summary.md")?;
    let svg = crate::plot::latency_svg(res);
    let svg_path = out.join("latency.svg");
    std::fs::write(&svg_path, svg).context("write latency.svg")?;
    // PNG only where librsvg's converter is installed (Debian: librsvg2-bin).
    let png = out.join("latency.png");
    match std::process::Command::new("rsvg-convert")
        .arg("-b")
        .arg("white")
        .arg("-o")
        .arg(&png)
        .arg(&svg_path)
        .status()
    {
        Ok(s) if s.success() => {}
        Ok(s) => println!("note: rsvg-convert failed ({s}); no PNG"),
        Err(_) => {
            println!("note: rsvg-convert not installed (apt-get install librsvg2-bin); SVG only")
        }
    }
    Ok(())
}

fn ratio(v: f64, base: Option<f64>) -> String {
    match base {
        Some(b) if b > 0.0 => format!("×{:.2}", v / b),
        _ => "–".into(),
    }
}

/// Proxy figures, or a dash for a mode without proxies (direct).
fn px(u: &crate::Usage, v: f64, decimals: usize) -> String {
    if u.processes.is_empty() {
        "–".into()
    } else {
        format!("{v:.decimals$}")
    }
}

/// The direct row of `row`'s round matching `pred`, for ratios.
fn base<'a, T>(
    rows: &'a [Row<T>],
    row: &Row<T>,
    pred: impl Fn(&Row<T>) -> bool,
) -> Option<&'a Row<T>> {
    rows.iter()
        .find(|r| r.mode == DIRECT && r.round == row.round && pred(r))
}

/// The mode column: with several rounds, which round the row is from.
fn who<T>(r: &Row<T>, rounds: usize) -> String {
    if rounds > 1 {
        format!("{} [{}]", r.mode, r.round + 1)
    } else {
        r.mode.clone()
    }
}

fn ztunnel_max(r: &crate::Usage, f: impl Fn(&crate::ProcUsage) -> f64) -> f64 {
    r.processes
        .iter()
        .filter(|p| !p.name.starts_with("waypoint"))
        .map(f)
        .fold(0.0, f64::max)
}

pub fn markdown(res: &Results) -> String {
    let rounds = res.plan.as_ref().map_or(1, |p| p.rounds);
    let mut s = String::new();
    let _ = writeln!(s, "# Mesh benchmark results\n");
    let _ = writeln!(
        s,
        "- date: {}\n- host: {}\n- command: `{}`",
        res.date, res.host, res.command
    );
    let _ = writeln!(
        s,
        "- load average (1/5/15 min) at start: {}, at end: {}",
        res.loadavg_start, res.loadavg_end
    );
    if let Some(p) = &res.plan {
        let _ = writeln!(
            s,
            "- plan: {} s per step ({} s warm-up), rates {:?} req/s on {} connections, max rate on {:?} connections, bulk {} MiB, {} connection workers, {} idle tunnels{}{}",
            p.step_seconds,
            p.warmup_seconds,
            p.rates,
            p.rate_connections,
            p.max_rate_connections,
            p.bulk_bytes >> 20,
            p.conn_rate_workers,
            p.idle_connections,
            if p.quick { " (quick)" } else { "" },
            match p.outside {
                crate::Outside::None => "",
                crate::Outside::Server => "; **passthrough**: the server outside the mesh, the client's node proxy relays plain TCP to it",
                crate::Outside::Client => "; **plaintext client**: the client outside the mesh, the server's node proxy captures its plain TCP",
            }
        );
    }
    let _ = writeln!(s, "- modes: {}\n", res.modes.join(", "));
    let _ = writeln!(
        s,
        "Proxy columns cover every proxy process of the mode (both node proxies, and the waypoint): CPU seconds \
         (utime+stime) per 1000 requests/connections (per GiB for bulk), average cores busy (vCPU), peak RSS \
         (VmHWM, reset at the start of each step) and steady RSS (VmRSS at its end), summed, MiB. Latencies in µs.\n"
    );

    if !res.constant_rate.is_empty() {
        let _ = writeln!(
            s,
            "## Constant rate, HTTP/1.1 POST 1 KiB → 1 KiB, latency from the intended send time\n"
        );
        let _ = writeln!(
            s,
            "| mode | target req/s | achieved | P50 | P90 | P99 | P99.9 | P99 vs direct | proxy cpu-s/1k req | proxy vCPU | max ztunnel vCPU | peak RSS | steady RSS | of which anon | server app cpu-s/1k req |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &res.constant_rate {
            let b = base(&res.constant_rate, r, |x| {
                x.result.target_rps == r.result.target_rps
            });
            let l = &r.result.latency;
            let _ = writeln!(
                s,
                "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {:.3} |",
                who(r, rounds),
                r.result.target_rps,
                r.result.achieved_rps,
                l.p50_us,
                l.p90_us,
                l.p99_us,
                l.p999_us,
                b.map(|b| format!("{:+.0} µs ({})", l.p99_us - b.result.latency.p99_us, ratio(l.p99_us, Some(b.result.latency.p99_us)))).unwrap_or("–".into()),
                px(&r.usage, r.usage.cpu_s_per_1000, 3),
                px(&r.usage, r.usage.vcpu, 3),
                px(&r.usage, ztunnel_max(&r.usage, |p| p.vcpu), 3),
                px(&r.usage, r.usage.peak_mib, 1),
                px(&r.usage, r.usage.rss_mib, 1),
                px(&r.usage, r.usage.anon_mib, 1),
                r.usage.app_cpu_s_per_1000
            );
        }
        s.push('\n');
    }
    if !res.max_rate.is_empty() {
        let _ = writeln!(
            s,
            "## Maximum request rate (closed loop, HTTP/1.1 POST 1 KiB)\n"
        );
        let _ = writeln!(s, "| mode | connections | req/s | × direct | P50 | P99 | proxy cpu-s/1k req | proxy vCPU | peak RSS | steady RSS |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &res.max_rate {
            let b = base(&res.max_rate, r, |x| {
                x.result.connections == r.result.connections
            });
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {} | {:.0} | {:.0} | {} | {} | {} | {} |",
                who(r, rounds),
                r.result.connections,
                r.result.rps,
                ratio(r.result.rps, b.map(|b| b.result.rps)),
                r.result.latency.p50_us,
                r.result.latency.p99_us,
                px(&r.usage, r.usage.cpu_s_per_1000, 3),
                px(&r.usage, r.usage.vcpu, 2),
                px(&r.usage, r.usage.peak_mib, 1),
                px(&r.usage, r.usage.rss_mib, 1)
            );
        }
        s.push('\n');
    }
    if !res.bulk.is_empty() {
        let _ = writeln!(s, "## Single-stream bulk throughput\n");
        let _ = writeln!(s, "| mode | MiB | seconds | Gbit/s | × direct | proxy cpu-s/GiB | proxy vCPU | peak RSS | steady RSS |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &res.bulk {
            let b = base(&res.bulk, r, |_| true);
            let _ = writeln!(
                s,
                "| {} | {} | {:.2} | {:.2} | {} | {} | {} | {} | {} |",
                who(r, rounds),
                r.result.bytes >> 20,
                r.result.seconds,
                r.result.gbit_per_s,
                ratio(r.result.gbit_per_s, b.map(|b| b.result.gbit_per_s)),
                px(&r.usage, r.usage.cpu_s_per_1000, 3),
                px(&r.usage, r.usage.vcpu, 2),
                px(&r.usage, r.usage.peak_mib, 1),
                px(&r.usage, r.usage.rss_mib, 1)
            );
        }
        s.push('\n');
    }
    if !res.conn_rate.is_empty() {
        let _ = writeln!(s, "## New connections (connect + 1 KiB echo + close)\n");
        let _ = writeln!(s, "| mode | workers | conn/s | × direct | P50 | P99 | errors | proxy cpu-s/1k conn | proxy vCPU | peak RSS | steady RSS |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for r in &res.conn_rate {
            let b = base(&res.conn_rate, r, |_| true);
            let _ = writeln!(
                s,
                "| {} | {} | {:.0} | {} | {:.0} | {:.0} | {} | {} | {} | {} | {} |",
                who(r, rounds),
                r.result.workers,
                r.result.conn_per_s,
                ratio(r.result.conn_per_s, b.map(|b| b.result.conn_per_s)),
                r.result.latency.p50_us,
                r.result.latency.p99_us,
                r.result.errors,
                px(&r.usage, r.usage.cpu_s_per_1000, 3),
                px(&r.usage, r.usage.vcpu, 2),
                px(&r.usage, r.usage.peak_mib, 1),
                px(&r.usage, r.usage.rss_mib, 1)
            );
        }
        s.push('\n');
    }
    if !res.idle.is_empty() {
        let _ = writeln!(
            s,
            "## Concurrent idle tunnels (each proven by a 1-byte echo, then held)\n"
        );
        let _ = writeln!(s, "| mode | requested | open | open in s | proxy RSS before | with tunnels | bytes/tunnel | peak RSS |");
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &res.idle {
            let x = &r.result;
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.1} | {} | {} | {} | {} |",
                who(r, rounds),
                x.requested,
                x.established,
                x.open_seconds,
                px(&r.usage, x.rss_before_mib, 1),
                px(&r.usage, x.rss_after_mib, 1),
                px(&r.usage, x.bytes_per_conn, 0),
                px(&r.usage, r.usage.peak_mib, 1)
            );
        }
        s.push('\n');
    }
    if rounds > 1 {
        s.push_str(&medians(res, rounds));
    }
    s.push_str(&targets(res));
    if !res.errors.is_empty() {
        let _ = writeln!(s, "## Errors\n");
        for e in &res.errors {
            let _ = writeln!(s, "- {}", e.replace('\n', " "));
        }
        s.push('\n');
    }
    s
}

/// Where the targets stand, for each node-proxy mode.
fn targets(res: &Results) -> String {
    let mut s =
        String::from("## Targets\n\n| mode | target | measured | met |\n|---|---|---|---|\n");
    let yes = |b: bool| if b { "yes" } else { "**no**" };
    let at = |mode: &str, rate: f64| {
        res.constant_rate
            .iter()
            .find(|r| r.mode == mode && r.result.target_rps == rate)
    };
    for mode in ["ztunnel-l4", "reference-l4", "reference-zds-l4"] {
        if let Some(r) = at(mode, 1000.0) {
            let vcpu = ztunnel_max(&r.usage, |p| p.vcpu);
            let rss_mb = ztunnel_max(&r.usage, |p| p.rss_mib) * 1.048576;
            let anon_mb = ztunnel_max(&r.usage, |p| p.anon_mib) * 1.048576;
            let _ = writeln!(s, "| {mode} | < 0.06 vCPU per node proxy at 1000 req/s | {vcpu:.3} vCPU (busier of the two) | {} |", yes(vcpu < 0.06));
            // The 0.06 comes from other hardware. The server app (the same program in every
            // mode, one process hop per request) measured in the same step says what a hop
            // costs on this machine (see docs/benchmarks.md).
            let app = r.usage.app_cpu_s_per_1000;
            if app > 0.0 {
                let per_req_us = vcpu / r.result.achieved_rps.max(1.0) * 1e6;
                let _ = writeln!(
                    s,
                    "| {mode} | (yardstick) busier node proxy's CPU per request in server-app requests (a proxy is two hops: ≥ 2) | {:.1} ({per_req_us:.0} µs vs {:.0} µs) | – |",
                    per_req_us / (app * 1000.0),
                    app * 1000.0
                );
            }
            let _ = writeln!(
                s,
                "| {mode} | < 12 MB RSS per node proxy at 1000 req/s | {rss_mb:.1} MB (larger of the two; {anon_mb:.1} MB of it anonymous, the rest the mapped binary) | {} |",
                yes(rss_mb < 12.0)
            );
            if let Some(d) = at(DIRECT, 1000.0) {
                let added = r.result.latency.p99_us - d.result.latency.p99_us;
                let _ = writeln!(
                    s,
                    "| {mode} | added P99 < 0.3 ms over direct at 1000 req/s | {:+.3} ms | {} |",
                    added / 1000.0,
                    yes(added < 300.0)
                );
            }
        }
        let bulk = |m: &str| {
            res.bulk
                .iter()
                .find(|r| r.mode == m)
                .map(|r| r.result.gbit_per_s)
        };
        if let (Some(m), Some(d)) = (bulk(mode), bulk(DIRECT)) {
            let _ = writeln!(
                s,
                "| {mode} | bulk ≥ 60% of direct | {:.0}% ({m:.2} of {d:.2} Gbit/s) | {} |",
                m / d * 100.0,
                yes(m >= 0.6 * d)
            );
        }
    }
    s.push('\n');
    s
}

/// One step over the rounds: per mode its value and its proxies' CPU per unit, by round.
struct Step {
    label: String,
    unit: &'static str,
    cpu_unit: &'static str,
    modes: Vec<(String, Vec<f64>, Vec<f64>)>,
}

fn steps(res: &Results) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    let mut add = |label: String,
                   unit: &'static str,
                   cpu_unit: &'static str,
                   mode: &str,
                   value: f64,
                   cpu: Option<f64>| {
        let i = match out.iter().position(|s| s.label == label) {
            Some(i) => i,
            None => {
                out.push(Step {
                    label,
                    unit,
                    cpu_unit,
                    modes: Vec::new(),
                });
                out.len() - 1
            }
        };
        let modes = &mut out[i].modes;
        let j = match modes.iter().position(|(m, _, _)| m == mode) {
            Some(j) => j,
            None => {
                modes.push((mode.to_string(), Vec::new(), Vec::new()));
                modes.len() - 1
            }
        };
        modes[j].1.push(value);
        modes[j].2.extend(cpu);
    };
    let cpu = |u: &crate::Usage| (!u.processes.is_empty()).then_some(u.cpu_s_per_1000);
    for r in &res.constant_rate {
        let l = format!("constant {} req/s", r.result.target_rps);
        add(
            format!("{l}, P50"),
            "µs",
            "cpu-s/1k req",
            &r.mode,
            r.result.latency.p50_us,
            cpu(&r.usage),
        );
        add(
            format!("{l}, P99"),
            "µs",
            "cpu-s/1k req",
            &r.mode,
            r.result.latency.p99_us,
            cpu(&r.usage),
        );
    }
    for r in &res.max_rate {
        add(
            format!("max rate, {} conn", r.result.connections),
            "req/s",
            "cpu-s/1k req",
            &r.mode,
            r.result.rps,
            cpu(&r.usage),
        );
    }
    for r in &res.bulk {
        add(
            "bulk, one stream".into(),
            "Gbit/s",
            "cpu-s/GiB",
            &r.mode,
            r.result.gbit_per_s,
            cpu(&r.usage),
        );
    }
    for r in &res.conn_rate {
        add(
            "new connections".into(),
            "conn/s",
            "cpu-s/1k conn",
            &r.mode,
            r.result.conn_per_s,
            cpu(&r.usage),
        );
    }
    // Direct holds no tunnels: nothing to compare.
    for r in res.idle.iter().filter(|r| !r.usage.processes.is_empty()) {
        add(
            "idle tunnels, memory".into(),
            "B/tunnel",
            "cpu-s/1k conn",
            &r.mode,
            r.result.bytes_per_conn,
            cpu(&r.usage),
        );
    }
    out
}

/// Each step's median over the rounds, every round's value, and the medians' ratios to
/// ztunnel-l4's (the first mode with proxies when ztunnel-l4 did not run).
fn medians(res: &Results, rounds: usize) -> String {
    let steps = steps(res);
    // The modes with proxies (CPU figures), in the order they first ran.
    let proxied: Vec<&str> = steps
        .iter()
        .flat_map(|s| &s.modes)
        .filter(|(_, _, c)| !c.is_empty())
        .map(|(m, _, _)| m.as_str())
        .collect();
    let Some(y) = proxied
        .iter()
        .find(|m| **m == "ztunnel-l4")
        .or(proxied.first())
        .map(|m| m.to_string())
    else {
        return String::new();
    };
    let mut s = format!(
        "## Medians over {rounds} rounds (the modes in reverse order every other round)\n\n\
         | step | mode | median | each round | proxy CPU, median | value / {y} | proxy CPU / {y} |\n|---|---|---:|---|---:|---:|---:|\n"
    );
    for st in &steps {
        let mid = |m: &str| {
            st.modes.iter().find(|(n, _, _)| n == m).map(|(_, v, c)| {
                (
                    median(&mut v.clone()),
                    (!c.is_empty()).then(|| median(&mut c.clone())),
                )
            })
        };
        let theirs = mid(&y);
        for (mode, values, _) in &st.modes {
            let Some((v, c)) = mid(mode) else { continue };
            let precision = if st.unit == "Gbit/s" { 2 } else { 0 };
            let each: Vec<String> = values.iter().map(|x| format!("{x:.precision$}")).collect();
            let r = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 && mode != &y => format!("{:.2}", a / b),
                _ => "–".into(),
            };
            let _ = writeln!(
                s,
                "| {} | {mode} | {v:.precision$} {} | {} | {} | {} | {} |",
                st.label,
                st.unit,
                each.join(", "),
                c.map_or("–".into(), |c| format!("{c:.3} {}", st.cpu_unit)),
                r(Some(v), theirs.map(|t| t.0)),
                r(c, theirs.and_then(|t| t.1)),
            );
        }
    }
    s.push('\n');
    s
}
