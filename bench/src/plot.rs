//! Hand-written SVG: latency percentiles by request rate, one line per mode (like Istio's
//! published charts), four panels (P50, P90, P99, P99.9). The y axis is logarithmic so a
//! saturated mode does not flatten the others.

use std::fmt::Write as _;

use crate::Results;

const COLORS: [&str; 5] = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756"];
const PW: f64 = 440.0; // panel width
const PH: f64 = 300.0; // panel height
const ML: f64 = 60.0; // left margin inside a panel (axis labels)
const MB: f64 = 40.0; // bottom margin
const MT: f64 = 30.0; // top margin (title)
const MR: f64 = 15.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

type Pick = fn(&crate::load::Percentiles) -> f64;

pub fn latency_svg(res: &Results) -> String {
    let panels: [(&str, Pick); 4] = [
        ("P50", |p| p.p50_us),
        ("P90", |p| p.p90_us),
        ("P99", |p| p.p99_us),
        ("P99.9", |p| p.p999_us),
    ];
    let rates: Vec<f64> = {
        let mut r: Vec<f64> = res
            .constant_rate
            .iter()
            .map(|r| r.result.target_rps)
            .collect();
        r.sort_by(f64::total_cmp);
        r.dedup();
        r
    };
    let legend_h = 30.0;
    let (w, h) = (2.0 * PW, 2.0 * PH + legend_h + 30.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="18" text-anchor="middle" font-size="14">HTTP/1.1 1 KiB, 4 connections, constant rate: latency (ms, log scale) by request rate — {}</text>"#,
        w / 2.0,
        esc(&res.date)
    );
    // All values across panels share one y range, so panels compare at a glance.
    let vals: Vec<f64> = res
        .constant_rate
        .iter()
        .flat_map(|r| {
            panels
                .iter()
                .map(move |(_, f)| f(&r.result.latency) / 1000.0)
        })
        .filter(|v| *v > 0.0)
        .collect();
    let lo = vals.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = vals.iter().cloned().fold(0.0, f64::max);
    if rates.is_empty() || !lo.is_finite() {
        let _ = writeln!(
            s,
            r#"<text x="20" y="60">no constant-rate results</text></svg>"#
        );
        return s;
    }
    let (ylo, yhi) = (
        10f64.powf(lo.log10().floor()),
        10f64.powf(hi.log10().ceil()),
    );
    let (xlo, xhi) = (rates[0], *rates.last().unwrap_or(&rates[0]));
    for (i, (title, f)) in panels.iter().enumerate() {
        let ox = (i % 2) as f64 * PW;
        let oy = 30.0 + (i / 2) as f64 * PH;
        let (x0, x1, y0, y1) = (ox + ML, ox + PW - MR, oy + PH - MB, oy + MT);
        let xs = |r: f64| {
            if xhi > xlo {
                x0 + (r - xlo) / (xhi - xlo) * (x1 - x0)
            } else {
                (x0 + x1) / 2.0
            }
        };
        let ys = |v: f64| {
            y0 - (v.max(ylo).log10() - ylo.log10()) / (yhi.log10() - ylo.log10()) * (y0 - y1)
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle" font-size="13" font-weight="bold">{title}</text>"#,
            (x0 + x1) / 2.0,
            oy + 18.0
        );
        let _ = writeln!(
            s,
            r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#888"/>"##,
            x1 - x0,
            y0 - y1
        );
        // y grid: 1, 2, 5 per decade.
        let mut d = ylo;
        while d <= yhi * 1.0001 {
            for m in [1.0, 2.0, 5.0] {
                let v = d * m;
                if v > yhi * 1.0001 {
                    break;
                }
                let y = ys(v);
                let _ = writeln!(
                    s,
                    r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/>"##
                );
                let _ = writeln!(
                    s,
                    r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
                    x0 - 4.0,
                    y + 4.0,
                    fmt_ms(v)
                );
            }
            d *= 10.0;
        }
        for &r in &rates {
            let x = xs(r);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{y0}" x2="{x:.1}" y2="{}" stroke="#888"/>"##,
                y0 + 4.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{}" text-anchor="middle">{r:.0}</text>"#,
                y0 + 16.0
            );
        }
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">req/s</text>"#,
            (x0 + x1) / 2.0,
            y0 + 32.0
        );
        for (mi, mode) in res.modes.iter().enumerate() {
            let color = COLORS[mi % COLORS.len()];
            let mut pts: Vec<(f64, f64)> = res
                .constant_rate
                .iter()
                .filter(|r| &r.mode == mode && r.round == 0)
                .map(|r| (xs(r.result.target_rps), ys(f(&r.result.latency) / 1000.0)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                path.join(" ")
            );
            for (x, y) in pts {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
                );
            }
        }
    }
    let ly = 30.0 + 2.0 * PH + 15.0;
    for (mi, mode) in res.modes.iter().enumerate() {
        let x = 80.0 + mi as f64 * 190.0;
        let color = COLORS[mi % COLORS.len()];
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            x + 24.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            x + 30.0,
            ly + 4.0,
            esc(mode)
        );
    }
    s.push_str("</svg>\n");
    s
}

fn fmt_ms(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

/// One line of an x/y panel.
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// An x/y line panel (`bench scale`'s curves): linear y from 0, so straight lines read
/// as linear growth; x linear or log.
pub struct Panel {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_x: bool,
    pub series: Vec<Series>,
}

/// Panels side by side, two per row, under one title; each panel has its own legend.
pub fn panels_svg(title: &str, panels: &[Panel]) -> String {
    let rows = panels.len().div_ceil(2).max(1);
    let cols = panels.len().clamp(1, 2);
    let legend_h = 18.0;
    let ph = PH + legend_h;
    let (w, h) = (cols as f64 * PW, rows as f64 * ph + 30.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="18" text-anchor="middle" font-size="14">{}</text>"#,
        w / 2.0,
        esc(title)
    );
    for (i, p) in panels.iter().enumerate() {
        let ox = (i % 2) as f64 * PW;
        let oy = 30.0 + (i / 2) as f64 * ph;
        panel(&mut s, p, ox, oy, legend_h);
    }
    s.push_str("</svg>\n");
    s
}

fn panel(s: &mut String, p: &Panel, ox: f64, oy: f64, legend_h: f64) {
    let (x0, x1, y0, y1) = (ox + ML, ox + PW - MR, oy + PH - MB, oy + MT);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="13" font-weight="bold">{}</text>"#,
        (x0 + x1) / 2.0,
        oy + 18.0,
        esc(&p.title)
    );
    let _ = writeln!(
        s,
        r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#888"/>"##,
        x1 - x0,
        y0 - y1
    );
    let pts: Vec<(f64, f64)> = p
        .series
        .iter()
        .flat_map(|l| l.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let xv = |x: f64| if p.log_x { x.max(1e-9).log10() } else { x };
    let mut xs: Vec<f64> = pts.iter().map(|(x, _)| *x).collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    if xs.is_empty() {
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">no data</text>"#,
            x0 + 10.0,
            y1 + 20.0
        );
        return;
    }
    let (xlo, xhi) = (xv(xs[0]), xv(xs[xs.len() - 1]));
    let yhi = nice_ceiling(pts.iter().map(|(_, y)| *y).fold(0.0, f64::max));
    let sx = |x: f64| {
        if xhi > xlo {
            x0 + (xv(x) - xlo) / (xhi - xlo) * (x1 - x0)
        } else {
            (x0 + x1) / 2.0
        }
    };
    let sy = |y: f64| y0 - y.max(0.0) / yhi * (y0 - y1);
    for k in 0..=4 {
        let v = yhi * k as f64 / 4.0;
        let y = sy(v);
        let _ = writeln!(
            s,
            r##"<line x1="{x0}" y1="{y:.1}" x2="{x1}" y2="{y:.1}" stroke="#ddd"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            x0 - 4.0,
            y + 4.0,
            fmt_num(v)
        );
    }
    // A label too close to the previous one (0 and 1k on a 50k axis) is left out; its tick stays.
    let mut last_label = f64::NEG_INFINITY;
    for &x in &xs {
        let px = sx(x);
        let _ = writeln!(
            s,
            r##"<line x1="{px:.1}" y1="{y0}" x2="{px:.1}" y2="{}" stroke="#888"/>"##,
            y0 + 4.0
        );
        if px - last_label >= 24.0 {
            let _ = writeln!(
                s,
                r#"<text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"#,
                y0 + 16.0,
                fmt_num(x)
            );
            last_label = px;
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        y0 + 32.0,
        esc(&p.x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" transform="rotate(-90 {} {})">{}</text>"#,
        ox + 14.0,
        (y0 + y1) / 2.0,
        ox + 14.0,
        (y0 + y1) / 2.0,
        esc(&p.y_label)
    );
    for (li, line) in p.series.iter().enumerate() {
        let color = COLORS[li % COLORS.len()];
        let mut pts: Vec<(f64, f64)> = line
            .points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| (sx(x), sy(y)))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let path: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
            path.join(" ")
        );
        for (x, y) in pts {
            let _ = writeln!(
                s,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3" fill="{color}"/>"#
            );
        }
        let lx = x0 + li as f64 * 150.0;
        let ly = oy + PH + legend_h / 2.0 - 4.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{color}" stroke-width="3"/>"#,
            lx + 18.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}">{}</text>"#,
            lx + 22.0,
            ly + 4.0,
            esc(&line.name)
        );
    }
}

/// 1, 2 or 5 times a power of ten, at least `v` (1 for nothing to show).
fn nice_ceiling(v: f64) -> f64 {
    if v <= 0.0 || !v.is_finite() {
        return 1.0;
    }
    let d = 10f64.powf(v.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * d)
        .find(|c| *c >= v * 0.9999)
        .unwrap_or(10.0 * d)
}

/// Axis labels: 50000 as 50k, small values with the digits they need.
fn fmt_num(v: f64) -> String {
    if v >= 1000.0 && (v / 1000.0).fract() == 0.0 {
        format!("{}k", v / 1000.0)
    } else if v >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_ticks_are_round_and_labels_short() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(3.2), 5.0);
        assert_eq!(nice_ceiling(47.0), 50.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
        assert_eq!(fmt_num(50_000.0), "50k");
        assert_eq!(fmt_num(12.4), "12");
        assert_eq!(fmt_num(0.25), "0.25");
        assert_eq!(fmt_num(2.0), "2");
    }

    #[test]
    fn a_panel_draws_one_line_per_series() {
        let p = Panel {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: true,
            series: vec![
                Series {
                    name: "a".into(),
                    points: vec![(1.0, 1.0), (10.0, 2.0)],
                },
                Series {
                    name: "b<".into(),
                    points: vec![(1.0, 3.0)],
                },
            ],
        };
        let svg = panels_svg("title", &[p]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("b&lt;"));
    }
}
