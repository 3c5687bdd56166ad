//! Charts of OMB result JSONs, as SVG written by hand: throughput over time
//! (publish and consume rate per period) and latency percentile curves
//! (publish, end-to-end) on a "nines" axis, where 90, 99, 99.9 and 99.99
//! are evenly spaced (x = −log10(1 − p/100)).
//!
//! Charts are drawn from the JSON, not from the runner's memory, so the
//! results of several runs (rotary and its peers, or OMB's own runs of
//! Kafka) share one picture: one series per result in each chart.

use anyhow::Context as _;
use serde_json::Value;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 500.0;
const PLOT_LEFT: f64 = 90.0;
const PLOT_RIGHT: f64 = 660.0;
const PLOT_TOP: f64 = 50.0;
const PLOT_BOTTOM: f64 = 430.0;
const LEGEND_LEFT: f64 = 680.0;
/// Where a legend entry's text starts.
const LEGEND_TEXT_LEFT: f64 = LEGEND_LEFT + 34.0;
/// Width allowed per character of legend text (12 px sans-serif), so that
/// the picture widens to hold the longest label.
const LEGEND_CHAR_WIDTH: f64 = 7.0;
/// Series colours, in order (Tableau 10).
const COLOURS: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];
/// Series with at most this many points also get a dot at each.
const DOTS_POINTS_MAX: usize = 40;
/// Percentile curves start here.
const PERCENTILE_MIN: f64 = 50.0;
/// Default period of a result without `sampleRateMillis` (OMB's).
const PERIOD_MS_DEFAULT: f64 = 10_000.0;

/// How the x axis maps values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XAxis {
    Linear,
    /// Values are percentiles; drawn at −log10(1 − p/100).
    Nines,
}

pub struct Series {
    pub label: String,
    /// `(x, y)`; for [`XAxis::Nines`] x is the percentile.
    pub points: Vec<(f64, f64)>,
    pub dashed: bool,
    /// Index into the colour palette (series of one result share it).
    pub colour: usize,
}

pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub x_axis: XAxis,
    pub series: Vec<Series>,
}

fn nines(p: f64) -> f64 {
    -(1.0 - p / 100.0).log10()
}

/// About `n` round tick values covering `[lo, hi]`.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let span = (hi - lo).max(f64::MIN_POSITIVE);
    let raw = span / n.max(1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    let mut out = Vec::new();
    let mut v = first;
    while v <= hi + step * 1e-9 && out.len() < 50 {
        out.push(v);
        v += step;
    }
    out
}

/// A tick label: short, without float noise (`12k`, `2.5`, `0.25`).
fn number(v: f64) -> String {
    let a = v.abs();
    if a >= 1e6 {
        trim(format!("{:.2}", v / 1e6)) + "M"
    } else if a >= 1e4 {
        trim(format!("{:.1}", v / 1e3)) + "k"
    } else if a >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.4}"))
    }
}

fn trim(s: String) -> String {
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn percentile_label(p: f64) -> String {
    trim(format!("{p:.4}"))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Chart {
    /// The picture's width: [`WIDTH`], or more when the longest legend
    /// label would run past it.
    fn width(&self) -> f64 {
        let chars = self
            .series
            .iter()
            .map(|s| s.label.chars().count())
            .max()
            .unwrap_or(0);
        WIDTH.max((LEGEND_TEXT_LEFT + chars as f64 * LEGEND_CHAR_WIDTH + 10.0).ceil())
    }

    /// The chart as a standalone SVG document.
    pub fn render(&self) -> String {
        let frame = self.frame();
        let width = self.width();
        let mut s = String::new();
        let _ = write!(
            s,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{HEIGHT}\" \
             viewBox=\"0 0 {width} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"12\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"{}\" y=\"28\" text-anchor=\"middle\" font-size=\"16\">{}</text>\n",
            (PLOT_LEFT + PLOT_RIGHT) / 2.0,
            escape(&self.title)
        );
        frame.grid(&mut s);
        self.axes(&mut s);
        // Series and legend.
        for (i, series) in self.series.iter().enumerate() {
            frame.series(&mut s, i, series);
        }
        s.push_str("</svg>\n");
        s
    }

    /// The axes' ranges and ticks: from 0 to the first tick above the data
    /// on y, over all the data (and at least the axis's own span) on x.
    fn frame(&self) -> Frame {
        let x_axis = self.x_axis;
        let all = || {
            self.series
                .iter()
                .flat_map(|s| s.points.iter())
                .filter(|(x, y)| x_of(x_axis, *x).is_finite() && y.is_finite())
        };
        let (mut x_lo, mut x_hi) = match self.x_axis {
            XAxis::Linear => (0.0, 1.0),
            XAxis::Nines => (nines(PERCENTILE_MIN), nines(99.0)),
        };
        let mut y_hi: f64 = 0.0;
        for (x, y) in all() {
            x_hi = x_hi.max(x_of(x_axis, *x));
            x_lo = x_lo.min(x_of(x_axis, *x));
            y_hi = y_hi.max(*y);
        }
        if y_hi <= 0.0 {
            y_hi = 1.0;
        }
        // The top of the axis is the first tick above the data.
        let mut y_ticks = ticks(0.0, y_hi * 1.05, 5);
        if let [.., a, b] = y_ticks[..] {
            if b < y_hi * 1.05 {
                y_ticks.push(b + (b - a));
            }
        }
        let y_top = y_ticks.last().copied().unwrap_or(y_hi).max(y_hi);
        let (x_ticks, x_labels) = x_ticks(x_axis, x_lo, &mut x_hi);
        Frame {
            x_axis,
            x_lo,
            x_hi,
            y_top,
            y_ticks,
            x_ticks,
            x_labels,
        }
    }

    /// The axes and their labels.
    fn axes(&self, s: &mut String) {
        let _ = write!(
            s,
            "<line x1=\"{PLOT_LEFT}\" y1=\"{PLOT_BOTTOM}\" x2=\"{PLOT_RIGHT}\" y2=\"{PLOT_BOTTOM}\" \
             stroke=\"black\"/>\n<line x1=\"{PLOT_LEFT}\" y1=\"{PLOT_TOP}\" x2=\"{PLOT_LEFT}\" \
             y2=\"{PLOT_BOTTOM}\" stroke=\"black\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n\
             <text x=\"20\" y=\"{:.1}\" text-anchor=\"middle\" \
             transform=\"rotate(-90 20 {:.1})\">{}</text>\n",
            (PLOT_LEFT + PLOT_RIGHT) / 2.0,
            PLOT_BOTTOM + 45.0,
            escape(&self.x_label),
            (PLOT_TOP + PLOT_BOTTOM) / 2.0,
            (PLOT_TOP + PLOT_BOTTOM) / 2.0,
            escape(&self.y_label)
        );
    }
}

/// A value's place on the x axis.
fn x_of(axis: XAxis, x: f64) -> f64 {
    match axis {
        XAxis::Linear => x,
        XAxis::Nines => nines(x),
    }
}

/// The x axis's ticks and their labels; on the nines axis, `x_hi` grows to
/// the last tick.
fn x_ticks(axis: XAxis, x_lo: f64, x_hi: &mut f64) -> (Vec<f64>, Vec<String>) {
    match axis {
        XAxis::Linear => {
            let t = ticks(x_lo, *x_hi, 8);
            let l = t.iter().map(|v| number(*v)).collect();
            (t, l)
        }
        XAxis::Nines => {
            let mut t = vec![nines(50.0)];
            let mut l = vec!["50".to_string()];
            let mut k = 1.0;
            while k <= x_hi.ceil() + 1e-9 && k <= 9.0 {
                t.push(k);
                l.push(percentile_label(100.0 - 100.0 * 10f64.powf(-k)));
                k += 1.0;
            }
            *x_hi = x_hi.max(*t.last().expect("at least one tick"));
            (t, l)
        }
    }
}

/// Where a chart's data lie on the page: the axes' ranges and ticks.
struct Frame {
    x_axis: XAxis,
    x_lo: f64,
    x_hi: f64,
    y_top: f64,
    y_ticks: Vec<f64>,
    x_ticks: Vec<f64>,
    x_labels: Vec<String>,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        let (x_lo, x_hi) = (self.x_lo, self.x_hi);
        PLOT_LEFT + (x - x_lo) / (x_hi - x_lo).max(f64::MIN_POSITIVE) * (PLOT_RIGHT - PLOT_LEFT)
    }

    fn py(&self, y: f64) -> f64 {
        PLOT_BOTTOM - y / self.y_top * (PLOT_BOTTOM - PLOT_TOP)
    }

    /// Grid lines and ticks, with their labels.
    fn grid(&self, s: &mut String) {
        for y in &self.y_ticks {
            let at = self.py(*y);
            let _ = writeln!(
                s,
                "<line x1=\"{PLOT_LEFT}\" y1=\"{at:.1}\" x2=\"{PLOT_RIGHT}\" y2=\"{at:.1}\" \
                 stroke=\"#e0e0e0\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                PLOT_LEFT - 6.0,
                at + 4.0,
                number(*y)
            );
        }
        for (x, label) in self.x_ticks.iter().zip(&self.x_labels) {
            let at = self.px(*x);
            let _ = writeln!(
                s,
                "<line x1=\"{at:.1}\" y1=\"{PLOT_TOP}\" x2=\"{at:.1}\" y2=\"{PLOT_BOTTOM}\" \
                 stroke=\"#e0e0e0\"/><line x1=\"{at:.1}\" y1=\"{PLOT_BOTTOM}\" x2=\"{at:.1}\" \
                 y2=\"{:.1}\" stroke=\"black\"/><text x=\"{at:.1}\" y=\"{:.1}\" \
                 text-anchor=\"middle\">{}</text>",
                PLOT_BOTTOM + 5.0,
                PLOT_BOTTOM + 19.0,
                escape(label)
            );
        }
    }

    /// The `i`-th series: its line, its dots when there are few, and its
    /// legend entry.
    fn series(&self, s: &mut String, i: usize, series: &Series) {
        let colour = COLOURS[series.colour % COLOURS.len()];
        let dash = if series.dashed {
            " stroke-dasharray=\"7 4\""
        } else {
            ""
        };
        let points: Vec<(f64, f64)> = series
            .points
            .iter()
            .filter(|(x, y)| x_of(self.x_axis, *x).is_finite() && y.is_finite())
            .map(|(x, y)| (self.px(x_of(self.x_axis, *x)), self.py(*y)))
            .collect();
        let mut coords = String::new();
        for (x, y) in &points {
            let _ = write!(coords, "{x:.1},{y:.1} ");
        }
        let _ = writeln!(
            s,
            "<polyline class=\"series\" data-label=\"{}\" fill=\"none\" stroke=\"{colour}\" \
             stroke-width=\"2\"{dash} points=\"{}\"/>",
            escape(&series.label),
            coords.trim_end()
        );
        if points.len() <= DOTS_POINTS_MAX {
            for (x, y) in &points {
                let _ = writeln!(
                    s,
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.5\" fill=\"{colour}\"/>"
                );
            }
        }
        let ly = PLOT_TOP + 10.0 + 20.0 * i as f64;
        let _ = writeln!(
            s,
            "<line x1=\"{LEGEND_LEFT}\" y1=\"{ly:.1}\" x2=\"{:.1}\" y2=\"{ly:.1}\" \
             stroke=\"{colour}\" stroke-width=\"2\"{dash}/><text x=\"{:.1}\" y=\"{:.1}\">{}</text>",
            LEGEND_LEFT + 28.0,
            LEGEND_TEXT_LEFT,
            ly + 4.0,
            escape(&series.label)
        );
    }
}

/// One result JSON and the name its series carry.
pub struct Labelled {
    pub label: String,
    pub result: Value,
}

/// Reads result JSONs and names each by its driver, adding the workload
/// and then the file name where that alone would be ambiguous.
pub fn load_results(paths: &[PathBuf]) -> anyhow::Result<Vec<Labelled>> {
    let mut out = Vec::new();
    for p in paths {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let result: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a result JSON", p.display()))?;
        anyhow::ensure!(
            result.get("publishRate").is_some(),
            "{} has no publishRate: not an OpenMessaging result",
            p.display()
        );
        out.push((p.clone(), result));
    }
    let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let mut labels: Vec<String> = out.iter().map(|(_, r)| text(r, "driver")).collect();
    let unique = |l: &[String]| {
        let mut s = l.to_vec();
        s.sort();
        s.dedup();
        s.len() == l.len()
    };
    if !unique(&labels) {
        labels = out
            .iter()
            .map(|(_, r)| format!("{} · {}", text(r, "driver"), text(r, "workload")))
            .collect();
    }
    if !unique(&labels) {
        labels = out
            .iter()
            .zip(&labels)
            .map(|((p, _), l)| {
                let stem = p
                    .file_stem()
                    .map_or(String::new(), |s| s.to_string_lossy().into_owned());
                format!("{l} ({stem})")
            })
            .collect();
    }
    Ok(out
        .into_iter()
        .zip(labels)
        .map(|((_, result), label)| Labelled { label, result })
        .collect())
}

fn numbers(v: &Value, key: &str) -> Vec<f64> {
    v.get(key)
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// `(percentile, value)` of a quantile map, sorted, from 50 up to (not
/// including) 100, which the nines axis cannot place.
fn quantile_curve(v: &Value, key: &str) -> Vec<(f64, f64)> {
    let mut points: Vec<(f64, f64)> = v
        .get(key)
        .and_then(Value::as_object)
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.parse::<f64>().ok()?, v.as_f64()?)))
                .filter(|(p, _)| (PERCENTILE_MIN..100.0).contains(p))
                .collect()
        })
        .unwrap_or_default();
    points.sort_by(|a, b| a.0.total_cmp(&b.0));
    points
}

/// The three charts of `results`.
pub fn charts(results: &[Labelled]) -> Vec<(&'static str, Chart)> {
    let mut throughput = Vec::new();
    let mut publish = Vec::new();
    let mut end_to_end = Vec::new();
    for (i, r) in results.iter().enumerate() {
        let period_s = r
            .result
            .get("sampleRateMillis")
            .and_then(Value::as_f64)
            .unwrap_or(PERIOD_MS_DEFAULT)
            / 1000.0;
        let over_time = |key: &str| -> Vec<(f64, f64)> {
            numbers(&r.result, key)
                .into_iter()
                .enumerate()
                .map(|(k, y)| ((k + 1) as f64 * period_s, y))
                .collect()
        };
        throughput.push(Series {
            label: format!("{} publish", r.label),
            points: over_time("publishRate"),
            dashed: false,
            colour: i,
        });
        throughput.push(Series {
            label: format!("{} consume", r.label),
            points: over_time("consumeRate"),
            dashed: true,
            colour: i,
        });
        publish.push(Series {
            label: r.label.clone(),
            points: quantile_curve(&r.result, "aggregatedPublishLatencyQuantiles"),
            dashed: false,
            colour: i,
        });
        end_to_end.push(Series {
            label: r.label.clone(),
            points: quantile_curve(&r.result, "aggregatedEndToEndLatencyQuantiles"),
            dashed: false,
            colour: i,
        });
    }
    let workloads: Vec<String> = {
        let mut w: Vec<String> = results
            .iter()
            .filter_map(|r| r.result.get("workload").and_then(Value::as_str))
            .map(str::to_string)
            .collect();
        w.dedup();
        w
    };
    let suffix = if workloads.len() == 1 {
        format!(" — {}", workloads[0])
    } else {
        String::new()
    };
    vec![
        (
            "throughput.svg",
            Chart {
                title: format!("Throughput over time{suffix}"),
                x_label: "seconds into the measured phase".into(),
                y_label: "messages/s".into(),
                x_axis: XAxis::Linear,
                series: throughput,
            },
        ),
        (
            "publish-latency.svg",
            Chart {
                title: format!("Publish latency by percentile{suffix}"),
                x_label: "percentile".into(),
                y_label: "publish latency (ms)".into(),
                x_axis: XAxis::Nines,
                series: publish,
            },
        ),
        (
            "end-to-end-latency.svg",
            Chart {
                title: format!("End-to-end latency by percentile{suffix}"),
                x_label: "percentile".into(),
                y_label: "end-to-end latency (ms)".into(),
                x_axis: XAxis::Nines,
                series: end_to_end,
            },
        ),
    ]
}

/// Writes the charts of `results` into `dir` (made if missing); returns
/// the files written.
pub fn write(results: &[Labelled], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("making {}", dir.display()))?;
    let mut written = Vec::new();
    for (file, chart) in charts(results) {
        let path = dir.join(file);
        std::fs::write(&path, chart.render())
            .with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.0, 37_000.0, 5);
        assert_eq!(t[1], 10_000.0);
        assert!(*t.last().unwrap() <= 37_000.0);
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(number(12_000.0), "12k");
        assert_eq!(number(2.5), "2.5");
        assert_eq!(number(0.25), "0.25");
        assert_eq!(number(1_500_000.0), "1.5M");
        assert_eq!(percentile_label(99.9), "99.9");
        assert_eq!(percentile_label(100.0 - 100.0 * 10f64.powf(-4.0)), "99.99");
    }

    #[test]
    fn nines_axis_spaces_the_nines_evenly() {
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
    }

    #[test]
    fn a_chart_has_one_polyline_per_series() {
        let c = Chart {
            title: "t <&>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_axis: XAxis::Nines,
            series: vec![
                Series {
                    label: "a".into(),
                    points: vec![(50.0, 1.0), (99.0, 2.0), (99.99, 5.0)],
                    dashed: false,
                    colour: 0,
                },
                Series {
                    label: "b".into(),
                    points: vec![(50.0, 2.0), (99.9, 3.0)],
                    dashed: true,
                    colour: 1,
                },
            ],
        };
        let svg = c.render();
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("t &lt;&amp;&gt;"));
        assert!(svg.contains(">99.99<"));
        assert!(svg.contains("width=\"900\""), "short labels keep the width");
    }

    #[test]
    fn a_long_legend_label_widens_the_picture() {
        let label = "rotary · 1-topic-16-partitions-1kb · publish".to_string();
        let c = Chart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_axis: XAxis::Linear,
            series: vec![Series {
                label: label.clone(),
                points: vec![(0.0, 1.0), (1.0, 2.0)],
                dashed: false,
                colour: 0,
            }],
        };
        let need = LEGEND_TEXT_LEFT + label.chars().count() as f64 * LEGEND_CHAR_WIDTH;
        assert!(c.width() > need && need > WIDTH);
        assert!(c
            .render()
            .contains(&format!("viewBox=\"0 0 {} {HEIGHT}\"", c.width())));
    }
}
