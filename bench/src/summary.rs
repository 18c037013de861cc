//! The current-results page (docs/benchmarks/current.md): one table per scenario with
//! every mode side by side (no mesh, ours, the reference node proxy), medians over the
//! rounds, and ours over the reference as a ratio. `results.md` keeps every step and
//! round; this page is what a reader compares.

use std::fmt::Write as _;

use crate::scale::median;
use crate::{Results, Row, Usage};

/// The order columns appear in; modes that did not run are left out.
const ORDER: [&str; 5] = [
    "direct",
    "ztunnel-l4",
    "ztunnel+waypoint",
    "reference-l4",
    "reference-zds-l4",
];
const OURS: &str = "ztunnel-l4";

/// One table row: a label and how to read its value from a result row (None: not
/// measured for that mode, e.g. proxy CPU with no proxy).
struct Metric<'a, T> {
    label: &'a str,
    decimals: usize,
    value: &'a dyn Fn(&Row<T>) -> Option<f64>,
}

fn proxied(u: &Usage) -> bool {
    !u.processes.is_empty()
}

fn cpu<T>(r: &Row<T>) -> Option<f64> {
    proxied(&r.usage).then_some(r.usage.cpu_s_per_1000)
}

fn rss<T>(r: &Row<T>) -> Option<f64> {
    proxied(&r.usage).then_some(r.usage.rss_mib)
}

/// The table of one scenario step: `rows` are every round of every mode for that step.
fn table<T>(out: &mut String, title: &str, rows: &[&Row<T>], metrics: &[Metric<'_, T>]) {
    let modes: Vec<&str> = ORDER
        .iter()
        .copied()
        .filter(|m| rows.iter().any(|r| r.mode == *m))
        .collect();
    if modes.is_empty() {
        return;
    }
    // The reference is the last reference mode that ran: Istio's ztunnel with its own
    // capture (reference-zds-l4) when both ran.
    let reference = modes
        .iter()
        .rev()
        .find(|m| m.starts_with("reference"))
        .copied();
    let ratio_col = reference.filter(|_| modes.contains(&OURS));
    let _ = write!(out, "### {title}\n\n| |");
    for m in &modes {
        let _ = write!(out, " {m} |");
    }
    if let Some(r) = ratio_col {
        let _ = write!(out, " {OURS} / {r} |");
    }
    out.push_str("\n|---|");
    for _ in &modes {
        out.push_str("---:|");
    }
    if ratio_col.is_some() {
        out.push_str("---:|");
    }
    out.push('\n');
    for metric in metrics {
        let mid = |mode: &str| -> Option<f64> {
            let mut v: Vec<f64> = rows
                .iter()
                .filter(|r| r.mode == mode)
                .filter_map(|r| (metric.value)(r))
                .collect();
            (!v.is_empty()).then(|| median(&mut v))
        };
        let _ = write!(out, "| {} |", metric.label);
        for m in &modes {
            match mid(m) {
                Some(v) => {
                    let _ = write!(out, " {v:.prec$} |", prec = metric.decimals);
                }
                None => out.push_str(" – |"),
            }
        }
        if let Some(r) = ratio_col {
            match (mid(OURS), mid(r)) {
                (Some(a), Some(b)) if b > 0.0 => {
                    let _ = write!(out, " {:.2} |", a / b);
                }
                _ => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out.push('\n');
}

/// Groups rows by a step key, keeping the order steps first ran in.
fn by_step<T, K: PartialEq + Copy>(
    rows: &[Row<T>],
    key: impl Fn(&Row<T>) -> K,
) -> Vec<(K, Vec<&Row<T>>)> {
    let mut out: Vec<(K, Vec<&Row<T>>)> = Vec::new();
    for r in rows {
        let k = key(r);
        match out.iter_mut().find(|(x, _)| *x == k) {
            Some((_, v)) => v.push(r),
            None => out.push((k, vec![r])),
        }
    }
    out
}

pub fn markdown(res: &Results) -> String {
    let rounds = res.plan.as_ref().map_or(1, |p| p.rounds.max(1));
    let mut s = String::from("# Current benchmark results\n\n");
    let commit = if res.commit.is_empty() {
        "not recorded"
    } else {
        res.commit.as_str()
    };
    let _ = writeln!(s, "- date: {}", res.date);
    let _ = writeln!(s, "- commit: {commit}");
    let _ = writeln!(s, "- machine: {}", res.host);
    let _ = writeln!(s, "- command: `{}`", res.command);
    let _ = writeln!(
        s,
        "- load average (1/5/15 min) at start: {}, at end: {}",
        res.loadavg_start, res.loadavg_end
    );
    let _ = writeln!(
        s,
        "- values: the median over {rounds} round(s); every step and round is in the run's \
         results.md. Proxy CPU and RSS are summed over every proxy process of the mode \
         (both node proxies, and the waypoint); `–`: not measured for that mode.\n"
    );
    if !res.errors.is_empty() {
        let _ = writeln!(
            s,
            "**The run reported errors:** {}\n",
            res.errors.join("; ")
        );
    }

    for (rate, rows) in by_step(&res.constant_rate, |r| r.result.target_rps.to_bits()) {
        let title = format!(
            "Constant rate {} req/s (HTTP/1.1 POST 1 KiB → 1 KiB), latency from the intended send time",
            f64::from_bits(rate)
        );
        table(
            &mut s,
            &title,
            &rows,
            &[
                Metric {
                    label: "P50, µs",
                    decimals: 0,
                    value: &|r| Some(r.result.latency.p50_us),
                },
                Metric {
                    label: "P99, µs",
                    decimals: 0,
                    value: &|r| Some(r.result.latency.p99_us),
                },
                Metric {
                    label: "proxy CPU, s per 1000 requests",
                    decimals: 3,
                    value: &cpu,
                },
                Metric {
                    label: "proxy RSS, MiB",
                    decimals: 1,
                    value: &rss,
                },
            ],
        );
    }
    for (conns, rows) in by_step(&res.max_rate, |r| r.result.connections) {
        table(
            &mut s,
            &format!(
                "Maximum request rate, {conns} connection(s) (closed loop, HTTP/1.1 POST 1 KiB)"
            ),
            &rows,
            &[
                Metric {
                    label: "requests/s",
                    decimals: 0,
                    value: &|r| Some(r.result.rps),
                },
                Metric {
                    label: "proxy CPU, s per 1000 requests",
                    decimals: 3,
                    value: &cpu,
                },
                Metric {
                    label: "proxy RSS, MiB",
                    decimals: 1,
                    value: &rss,
                },
            ],
        );
    }
    let bulk: Vec<_> = res.bulk.iter().collect();
    table(
        &mut s,
        "Bulk throughput, one stream",
        &bulk,
        &[
            Metric {
                label: "Gbit/s",
                decimals: 2,
                value: &|r| Some(r.result.gbit_per_s),
            },
            Metric {
                label: "proxy CPU, s per GiB",
                decimals: 3,
                value: &cpu,
            },
            Metric {
                label: "proxy RSS, MiB",
                decimals: 1,
                value: &rss,
            },
        ],
    );
    let conn: Vec<_> = res.conn_rate.iter().collect();
    table(
        &mut s,
        "New connections (connect + 1 KiB echo + close)",
        &conn,
        &[
            Metric {
                label: "connections/s",
                decimals: 0,
                value: &|r| Some(r.result.conn_per_s),
            },
            Metric {
                label: "proxy CPU, s per 1000 connections",
                decimals: 3,
                value: &cpu,
            },
        ],
    );
    let idle: Vec<_> = res.idle.iter().collect();
    table(
        &mut s,
        "Concurrent idle tunnels",
        &idle,
        &[
            Metric {
                label: "tunnels held",
                decimals: 0,
                value: &|r| Some(r.result.established as f64),
            },
            Metric {
                label: "memory per tunnel (all proxies), bytes",
                decimals: 0,
                value: &|r| proxied(&r.usage).then_some(r.result.bytes_per_conn),
            },
            Metric {
                label: "seconds to open them",
                decimals: 2,
                value: &|r| Some(r.result.open_seconds),
            },
        ],
    );
    s
}

/// Inserts a legend of the modes (what each binary was) after the header list.
pub fn with_legend(page: &str, labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return page.to_string();
    }
    let mut legend = String::from("- modes:\n");
    for (mode, text) in labels {
        let _ = writeln!(legend, "  - `{mode}`: {text}");
    }
    // The header list ends at the first blank line after the title.
    match page.find("\n\n### ") {
        Some(i) => {
            let (head, rest) = page.split_at(i);
            format!("{head}\n{}{rest}", legend.trim_end_matches('\n'))
        }
        None => format!("{page}\n{legend}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{BulkResult, Percentiles, RateResult};
    use crate::ProcUsage;

    fn usage(proxy: bool, cpu: f64) -> Usage {
        Usage {
            cpu_s_per_1000: cpu,
            rss_mib: 20.0,
            processes: if proxy {
                vec![ProcUsage::default()]
            } else {
                Vec::new()
            },
            ..Default::default()
        }
    }

    fn rate(mode: &str, round: usize, p50: f64, cpu: f64) -> Row<RateResult> {
        Row {
            mode: mode.into(),
            round,
            result: RateResult {
                target_rps: 1000.0,
                latency: Percentiles {
                    p50_us: p50,
                    ..Default::default()
                },
                ..Default::default()
            },
            usage: usage(mode != "direct", cpu),
        }
    }

    #[test]
    fn one_table_per_step_with_medians_and_ours_over_the_reference() {
        let res = Results {
            commit: "abc1234".into(),
            constant_rate: vec![
                rate("direct", 0, 100.0, 0.0),
                rate("ztunnel-l4", 0, 300.0, 0.2),
                rate("reference-zds-l4", 0, 400.0, 0.5),
                rate("ztunnel-l4", 1, 320.0, 0.3),
                rate("reference-zds-l4", 1, 380.0, 0.2),
                rate("ztunnel-l4", 2, 900.0, 0.25),
                rate("reference-zds-l4", 2, 420.0, 0.6),
            ],
            bulk: vec![Row {
                mode: "direct".into(),
                round: 0,
                result: BulkResult {
                    gbit_per_s: 10.0,
                    ..Default::default()
                },
                usage: usage(false, 0.0),
            }],
            ..Default::default()
        };
        let md = markdown(&res);
        assert!(md.contains("- commit: abc1234"), "{md}");
        assert!(
            md.contains(
                "| | direct | ztunnel-l4 | reference-zds-l4 | ztunnel-l4 / reference-zds-l4 |"
            ),
            "{md}"
        );
        // Medians: ours 320 µs, the reference's 400 µs; direct has no proxy CPU.
        assert!(md.contains("| P50, µs | 100 | 320 | 400 | 0.80 |"), "{md}");
        assert!(
            md.contains("| proxy CPU, s per 1000 requests | – | 0.250 | 0.500 | 0.50 |"),
            "{md}"
        );
        // A scenario with direct alone has no ratio column.
        assert!(md.contains("| | direct |\n"), "{md}");
        // Scenarios that did not run print nothing.
        assert!(!md.contains("New connections"), "{md}");
    }
}
