//! `bench scale` (issue 19 item 5): how ztunnel's costs grow with the size of the mesh
//! (config), with the pods enrolled on its node (pods) and with concurrent tunnels
//! (tunnels). Each curve is a few points of one run; results go to `<out>/scale.md`,
//! `<out>/scale.json` and one plot per curve (`scale-<curve>.svg`). See
//! docs/benchmarks.md ("Scale curves") for the method and the numbers.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use crate::plot::{Panel, Series};

mod config;
mod pods;
mod policy;
mod tunnels;

/// Also the main suite's medians over rounds (report.rs).
pub(crate) use config::median;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Curve {
    Config,
    Pods,
    Tunnels,
}

impl Curve {
    pub const ALL: [Curve; 3] = [Curve::Config, Curve::Pods, Curve::Tunnels];

    pub fn parse(s: &str) -> Result<Curve, String> {
        match s {
            "config" => Ok(Curve::Config),
            "pods" => Ok(Curve::Pods),
            "tunnels" => Ok(Curve::Tunnels),
            other => Err(format!(
                "unknown curve {other:?}: expected config, pods or tunnels"
            )),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Curve::Config => "config",
            Curve::Pods => "pods",
            Curve::Tunnels => "tunnels",
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ScaleResults {
    pub date: String,
    pub host: String,
    pub command: String,
    pub ztunnel: String,
    pub quick: bool,
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub config: Option<config::ConfigCurve>,
    pub pods: Option<pods::PodsCurve>,
    pub tunnels: Option<tunnels::TunnelsCurve>,
    pub errors: Vec<String>,
}

/// The last lines of a process's log, for errors.
pub fn log_tail(c: &mesh_tests::netsim::Child) -> String {
    let log = c.log_text();
    let tail: Vec<&str> = log.lines().rev().take(20).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

pub fn main(
    quick: bool,
    curves: Option<Vec<Curve>>,
    out: &Path,
    bins: &crate::modes::Binaries,
) -> Result<()> {
    let curves = curves.unwrap_or_else(|| Curve::ALL.to_vec());
    std::fs::create_dir_all(out).with_context(|| format!("create {}", out.display()))?;
    let ztunnel: PathBuf = std::fs::canonicalize(&bins.ztunnel)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let _g = rt.enter();
    let mut res = ScaleResults {
        date: crate::sh_out("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        host: crate::host_info(),
        command: std::env::args().collect::<Vec<_>>().join(" "),
        ztunnel: ztunnel.display().to_string(),
        quick,
        loadavg_start: crate::loadavg(),
        ..Default::default()
    };
    for c in &curves {
        if crate::cleanup::interrupted() {
            break;
        }
        progress!("scale: {} curve", c.name());
        let r = match c {
            Curve::Config => {
                config::run(&config::Plan::new(quick), &ztunnel).map(|r| res.config = Some(r))
            }
            Curve::Pods => {
                pods::run(&pods::Plan::new(quick), &ztunnel, &rt).map(|r| res.pods = Some(r))
            }
            Curve::Tunnels => {
                tunnels::run(&tunnels::Plan::new(quick), bins).map(|r| res.tunnels = Some(r))
            }
        };
        if let Err(e) = r {
            progress!("scale: {} curve FAILED: {e:#}", c.name());
            res.errors.push(format!("{}: {e:#}", c.name()));
        }
    }
    res.loadavg_end = crate::loadavg();
    let md = markdown(&res);
    print!("{md}");
    std::fs::write(out.join("scale.md"), &md)?;
    std::fs::write(out.join("scale.json"), serde_json::to_string_pretty(&res)?)?;
    for (name, svg) in plots(&res) {
        std::fs::write(out.join(format!("scale-{name}.svg")), svg)?;
    }
    progress!("wrote {}/scale.md, scale.json and the plots", out.display());
    if !res.errors.is_empty() {
        bail!(
            "{} curve(s) failed: {}",
            res.errors.len(),
            res.errors.join("; ")
        );
    }
    Ok(())
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map(|v| format!("{v:.digits$}"))
        .unwrap_or_else(|| "–".into())
}

pub fn markdown(res: &ScaleResults) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# bench scale, {}{}\n",
        res.date,
        if res.quick { " (quick)" } else { "" }
    );
    let _ = writeln!(
        s,
        "- host: {}\n- ztunnel: `{}`\n- command: `{}`",
        res.host, res.ztunnel, res.command
    );
    let _ = writeln!(
        s,
        "- load average: {} at start, {} at end\n",
        res.loadavg_start, res.loadavg_end
    );
    if let Some(c) = &res.config {
        let _ = writeln!(s, "## Config: mesh size (one ztunnel, fake istiod)\n");
        if let Some(sh) = c.shapes.first() {
            let _ = writeln!(s, "{} services, {} authorization policies, {} namespaces at every size. Empty mesh: RSS {:.1} MiB (anon {:.1}).\n", sh.services, sh.policies, sh.namespaces, c.baseline_rss_mib, c.baseline_anon_mib);
        }
        let _ = writeln!(s, "| workloads | start → full state ACKed | first Address response → ACK | RSS | MiB / 1k workloads above empty | marginal MiB / 1k | push → ACK median (max) | push response → ACK median | CPU per push |");
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        for p in &c.points {
            let _ = writeln!(
                s,
                "| {} | {:.0} ms | {:.0} ms | {:.1} MiB | {:.2} | {} | {:.1} ms ({:.1}) | {:.1} ms | {:.1} ms |",
                p.workloads,
                p.start_to_acked_ms,
                p.first_address_apply_ms,
                p.rss_mib,
                p.rss_mib_per_1k_workloads,
                opt(p.marginal_mib_per_1k_workloads, 2),
                p.push_to_ack_median_ms,
                p.push_to_ack_max_ms,
                p.push_apply_median_ms,
                p.cpu_ms_per_push
            );
        }
        let _ = writeln!(
            s,
            "\nPolicy evaluation (`MeshState::authorize`, in process, one destination):\n"
        );
        let _ = writeln!(s, "| policies | all in scope | none in scope |");
        let _ = writeln!(s, "|---:|---:|---:|");
        for p in &c.policy_eval {
            let _ = writeln!(
                s,
                "| {} | {:.0} ns | {:.0} ns |",
                p.policies, p.in_scope_ns, p.out_of_scope_ns
            );
        }
        s.push('\n');
    }
    if let Some(c) = &res.pods {
        let _ = writeln!(s, "## Pods on one node (ZDS, capture {})\n", c.capture);
        let _ = writeln!(s, "| pods | RSS | KiB / pod above 1 pod | open fds | fds / pod | ZDS Add → ACK median (max) | Add → served median (max) | idle CPU ({:.0} s) |", c.idle_seconds);
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---:|");
        for p in &c.points {
            let _ = writeln!(
                s,
                "| {} | {:.1} MiB | {} | {} | {} | {:.1} ms ({:.1}) | {:.1} ms ({:.1}) | {:.2} ms/s |",
                p.pods,
                p.rss_mib,
                opt(p.rss_kib_per_pod, 0),
                p.fds,
                opt(p.fds_per_pod, 1),
                p.enroll_ack_median_ms,
                p.enroll_ack_max_ms,
                p.enroll_served_median_ms,
                p.enroll_served_max_ms,
                p.idle_cpu_ms_per_s
            );
        }
        s.push('\n');
    }
    if let Some(c) = &res.tunnels {
        let _ = writeln!(s, "## Concurrent idle tunnels (capture {})\n", c.capture);
        if let Some(n) = c.capped_from {
            let _ = writeln!(
                s,
                "{n} tunnels asked for; the largest size here is set by {}.\n",
                c.capped_by.as_deref().unwrap_or("a limit")
            );
        }
        let _ = writeln!(
            s,
            "Victim: 1 KiB HTTP round trips on one more connection at {:.0} req/s for {:.0} s.\n",
            c.victim_rate, c.victim_seconds
        );
        let _ = writeln!(s, "| tunnels | opened in | RSS both ztunnels | bytes / tunnel above none | victim req/s | victim P50 | victim P99 |");
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|");
        for p in &c.points {
            let _ = writeln!(
                s,
                "| {} | {:.1} s | {:.1} MiB | {:.0} | {:.0} | {:.0} µs | {:.0} µs |",
                p.tunnels,
                p.open_seconds,
                p.rss_mib,
                p.bytes_per_tunnel,
                p.victim_rps,
                p.victim_p50_us,
                p.victim_p99_us
            );
        }
        s.push('\n');
    }
    for e in &res.errors {
        let _ = writeln!(s, "**FAILED**: {e}\n");
    }
    s
}

fn series(name: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        name: name.into(),
        points,
    }
}

fn panel(title: &str, x: &str, y: &str, log_x: bool, series: Vec<Series>) -> Panel {
    Panel {
        title: title.into(),
        x_label: x.into(),
        y_label: y.into(),
        log_x,
        series,
    }
}

/// One SVG per curve that has results: (curve name, SVG).
pub fn plots(res: &ScaleResults) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if let Some(c) = &res.config {
        let w = |f: fn(&config::ConfigPoint) -> f64| {
            c.points
                .iter()
                .map(|p| (p.workloads as f64, f(p)))
                .collect::<Vec<_>>()
        };
        let mut rss = w(|p| p.rss_mib);
        rss.insert(0, (0.0, c.baseline_rss_mib));
        let panels = vec![
            panel(
                "ztunnel RSS",
                "workloads",
                "MiB",
                false,
                vec![series("RSS", rss)],
            ),
            panel(
                "first full state",
                "workloads",
                "ms",
                false,
                vec![
                    series("start → ACKed", w(|p| p.start_to_acked_ms)),
                    series("Address response → ACK", w(|p| p.first_address_apply_ms)),
                ],
            ),
            panel(
                "one workload changed",
                "workloads",
                "ms",
                false,
                vec![
                    series("push → ACK (median)", w(|p| p.push_to_ack_median_ms)),
                    series("ztunnel CPU per push", w(|p| p.cpu_ms_per_push)),
                ],
            ),
            panel(
                "authorize() per connection",
                "policies",
                "ns",
                false,
                vec![
                    series(
                        "all in scope",
                        c.policy_eval
                            .iter()
                            .map(|p| (p.policies as f64, p.in_scope_ns))
                            .collect(),
                    ),
                    series(
                        "none in scope",
                        c.policy_eval
                            .iter()
                            .map(|p| (p.policies as f64, p.out_of_scope_ns))
                            .collect(),
                    ),
                ],
            ),
        ];
        out.push((
            "config",
            crate::plot::panels_svg(
                &format!(
                    "bench scale: mesh size (one ztunnel, fake istiod) — {}",
                    res.date
                ),
                &panels,
            ),
        ));
    }
    if let Some(c) = &res.pods {
        let x = |f: fn(&pods::PodsPoint) -> f64| {
            c.points
                .iter()
                .map(|p| (p.pods as f64, f(p)))
                .collect::<Vec<_>>()
        };
        let panels = vec![
            panel(
                "ztunnel RSS",
                "enrolled pods",
                "MiB",
                false,
                vec![series("RSS", x(|p| p.rss_mib))],
            ),
            panel(
                "open fds",
                "enrolled pods",
                "fds",
                false,
                vec![series("fds", x(|p| p.fds as f64))],
            ),
            panel(
                "enrollment (median of the pods since the previous point)",
                "enrolled pods",
                "ms",
                false,
                vec![
                    series("ZDS Add → ACK", x(|p| p.enroll_ack_median_ms)),
                    series("Add → served", x(|p| p.enroll_served_median_ms)),
                ],
            ),
            panel(
                "idle CPU",
                "enrolled pods",
                "CPU-ms per s",
                false,
                vec![series("ztunnel", x(|p| p.idle_cpu_ms_per_s))],
            ),
        ];
        out.push((
            "pods",
            crate::plot::panels_svg(
                &format!(
                    "bench scale: pods on one node ({}) — {}",
                    c.capture, res.date
                ),
                &panels,
            ),
        ));
    }
    if let Some(c) = &res.tunnels {
        let x = |f: fn(&tunnels::TunnelsPoint) -> f64| {
            c.points
                .iter()
                .map(|p| (p.tunnels as f64, f(p)))
                .collect::<Vec<_>>()
        };
        let panels = vec![
            panel(
                "RSS, both ztunnels",
                "idle tunnels",
                "MiB",
                false,
                vec![series("RSS", x(|p| p.rss_mib))],
            ),
            panel(
                &format!("victim at {:.0} req/s", c.victim_rate),
                "idle tunnels",
                "µs",
                false,
                vec![
                    series("P50", x(|p| p.victim_p50_us)),
                    series("P99", x(|p| p.victim_p99_us)),
                ],
            ),
        ];
        out.push((
            "tunnels",
            crate::plot::panels_svg(
                &format!(
                    "bench scale: concurrent idle tunnels ({}) — {}",
                    c.capture, res.date
                ),
                &panels,
            ),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curves_parse_by_name() {
        assert_eq!(Curve::parse("pods"), Ok(Curve::Pods));
        assert!(Curve::parse("nodes")
            .unwrap_err()
            .contains("config, pods or tunnels"));
    }

    #[test]
    fn every_curve_with_results_gets_a_table_and_a_plot() {
        let res = ScaleResults {
            config: Some(config::ConfigCurve {
                points: vec![config::ConfigPoint {
                    workloads: 1000,
                    rss_mib: 20.0,
                    ..Default::default()
                }],
                policy_eval: vec![policy::PolicyPoint {
                    policies: 10,
                    in_scope_ns: 100.0,
                    out_of_scope_ns: 50.0,
                }],
                ..Default::default()
            }),
            tunnels: Some(tunnels::TunnelsCurve {
                points: vec![tunnels::TunnelsPoint {
                    tunnels: 100,
                    ..Default::default()
                }],
                capped_from: Some(50_000),
                ..Default::default()
            }),
            ..Default::default()
        };
        let md = markdown(&res);
        assert!(
            md.contains("| 1000 |") && md.contains("| 10 | 100 ns | 50 ns |"),
            "{md}"
        );
        assert!(md.contains("50000 tunnels asked for"), "{md}");
        assert!(!md.contains("## Pods"), "{md}");
        let names: Vec<&str> = plots(&res)
            .into_iter()
            .map(|(n, svg)| {
                assert!(svg.contains("<polyline"), "{n}");
                n
            })
            .collect();
        assert_eq!(names, ["config", "tunnels"]);
    }
}
