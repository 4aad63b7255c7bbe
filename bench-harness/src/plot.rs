//! Plots (plotters): the latency percentile plot and, below it, the p50,
//! p99 and max of each second over the run with the scenario's events
//! marked.
//!
//! The percentile plot follows HdrHistogram's plotter: the x axis is
//! `1/(1-percentile)` on a log scale (labelled 90%, 99%, 99.9%, …) so the
//! tail gets as much room as the median. Both panels put latency on a log
//! axis in ms with a tick per power of ten (0.1, 1, 10, 100 ms, …), so the
//! median stays readable next to a tail of seconds. The title and the run's
//! description are measured and shrunk or wrapped to fit the width.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use plotters::coord::Shift;
use plotters::prelude::*;

/// Width of every plot (pixels).
pub const PLOT_WIDTH: u32 = 1000;
/// Lowest latency a log axis shows (ms): the histograms' 1 µs resolution.
const LOWEST_MS: f64 = 0.001;

/// A point in time to mark on the scenario plot.
#[derive(Clone, Debug)]
pub struct Mark {
    /// Seconds since the start of the run.
    pub t_s: f64,
    /// What happened (`kill node-3`, `node-3 ready`, ...).
    pub label: String,
}

/// The per-second series of a run (seconds by intended send time).
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// `(second since start, median in ms)` for each second with successes.
    pub p50_ms: Vec<(f64, f64)>,
    /// `(second since start, p99 in ms)` for each second with successes.
    pub p99_ms: Vec<(f64, f64)>,
    /// `(second since start, highest latency in ms)` for each second with
    /// successes.
    pub max_ms: Vec<(f64, f64)>,
    /// `(second since start, errors)` for each second.
    pub errors: Vec<(f64, u64)>,
    /// Disturbance marks (scenario steps); empty for a steady load.
    pub marks: Vec<Mark>,
}

impl Timeline {
    /// Whether there is anything to plot (a second with successes or errors).
    pub fn is_empty(&self) -> bool {
        self.p99_ms.is_empty() && self.errors.iter().all(|e| e.1 == 0)
    }
}

/// The title of a plot: a headline and a description of the run (loop,
/// rate, connections), each fitted to the plot's width.
#[derive(Clone, Debug)]
pub struct PlotTitle {
    /// E.g. `shardline-bench demo: latency by percentile`.
    pub title: String,
    /// E.g. the run's `applied` line; empty for none.
    pub subtitle: String,
}

/// A log latency axis: `lo..hi` (ms) spanning whole powers of ten, with a
/// tick at each power of ten and light lines at 2x and 5x of each.
#[derive(Clone, Debug, PartialEq)]
pub struct LogAxis {
    /// Lower end (ms, a power of ten).
    pub lo: f64,
    /// Upper end (ms, a power of ten above `lo`).
    pub hi: f64,
    /// Labelled ticks (ms): every power of ten from `lo` to `hi`.
    pub ticks: Vec<f64>,
    /// Unlabelled grid lines (ms): 2x and 5x each power of ten below `hi`.
    pub light: Vec<f64>,
}

/// The log axis covering `values` (ms; values at or below 0 count as the
/// lowest resolvable latency, 1 µs). At least one decade; `0.1..10` ms when
/// `values` is empty.
pub fn log_axis(values: impl IntoIterator<Item = f64>) -> LogAxis {
    let (mut min, mut max) = (f64::INFINITY, 0.0f64);
    for v in values {
        let v = v.max(LOWEST_MS);
        if v.is_finite() {
            min = min.min(v);
            max = max.max(v);
        }
    }
    if !min.is_finite() {
        (min, max) = (0.1, 10.0);
    }
    let lo_exp = (min.log10() + 1e-9).floor() as i32;
    let hi_exp = ((max.log10() - 1e-9).ceil() as i32).max(lo_exp + 1);
    let ticks: Vec<f64> = (lo_exp..=hi_exp).map(|k| 10f64.powi(k)).collect();
    let light = (lo_exp..hi_exp)
        .flat_map(|k| [2.0, 5.0].map(|m| m * 10f64.powi(k)))
        .collect();
    LogAxis {
        lo: ticks[0],
        hi: *ticks.last().expect("at least two ticks"),
        ticks,
        light,
    }
}

/// A tick label of a log latency axis in ms: `0.001`, `0.1`, `1`, `10`,
/// `1000` (no trailing zeros, no exponent).
pub fn ms_label(ms: f64) -> String {
    if ms >= 1.0 {
        format!("{ms:.0}")
    } else {
        let digits = (-ms.log10() - 1e-9).ceil().max(1.0) as usize;
        let text = format!("{ms:.digits$}");
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Fits `text` into `max_width` pixels: the largest font size from
/// `max_size` down to `min_size` at which it fits on one line, else
/// `min_size` with the text wrapped at spaces into lines that fit (a
/// single word wider than `max_width` gets a line of its own). `measure`
/// gives the width in pixels of a line at a font size.
pub fn fit_text(
    text: &str,
    max_width: u32,
    max_size: u32,
    min_size: u32,
    measure: impl Fn(&str, u32) -> u32,
) -> (u32, Vec<String>) {
    for size in (min_size..=max_size).rev() {
        if measure(text, size) <= max_width {
            return (size, vec![text.to_string()]);
        }
    }
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let candidate = if line.is_empty() {
            word.to_string()
        } else {
            format!("{line} {word}")
        };
        if line.is_empty() || measure(&candidate, min_size) <= max_width {
            line = candidate;
        } else {
            lines.push(std::mem::replace(&mut line, word.to_string()));
        }
    }
    if !line.is_empty() {
        lines.push(line);
    }
    (min_size, lines)
}

/// Points of the percentile plot: `(1/(1-q), latency ms)` for each
/// percentile step of `h` (µs) below 100%.
pub fn percentile_points(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    h.iter_quantiles(5)
        .filter(|v| v.quantile_iterated_to() < 1.0)
        .map(|v| {
            (
                1.0 / (1.0 - v.quantile_iterated_to()),
                h.highest_equivalent(v.value_iterated_to()) as f64 / 1000.0,
            )
        })
        .collect()
}

/// Formats an x value `1/(1-q)` of the percentile plot as a percentile.
pub fn percentile_label(x: f64) -> String {
    let p = 100.0 * (1.0 - 1.0 / x.max(1.0));
    if p < 99.0 {
        format!("{p:.0}%")
    } else {
        let digits = (-(100.0 - p).log10() - 1e-6).ceil().max(0.0) as usize;
        format!("{p:.digits$}%")
    }
}

/// Writes the plot to `path` (`.svg` or `.png`, [`PLOT_WIDTH`] px wide):
/// the title, the percentile panel and, when `timeline` has data, the
/// per-second panel below it.
///
/// # Errors
/// An unknown extension, or a drawing or file error.
pub fn write_plot(
    path: &Path,
    title: &PlotTitle,
    h: &Histogram<u64>,
    timeline: Option<&Timeline>,
) -> Result<()> {
    let timeline = timeline.filter(|t| !t.is_empty());
    let height = if timeline.is_some() { 960 } else { 560 };
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match extension {
        "svg" => std::fs::write(path, svg_string(title, h, timeline)?)
            .map_err(|e| anyhow!("cannot write {}: {e}", path.display())),
        "png" => draw(
            BitMapBackend::new(path, (PLOT_WIDTH, height)).into_drawing_area(),
            title,
            h,
            timeline,
        ),
        other => bail!(
            "plot file {} must end in .svg or .png, not `{other}`",
            path.display()
        ),
    }
}

/// The plot as an SVG document (as [`write_plot`] writes to a `.svg` file).
///
/// # Errors
/// A drawing error.
pub fn svg_string(
    title: &PlotTitle,
    h: &Histogram<u64>,
    timeline: Option<&Timeline>,
) -> Result<String> {
    let timeline = timeline.filter(|t| !t.is_empty());
    let height = if timeline.is_some() { 960 } else { 560 };
    let mut out = String::new();
    draw(
        SVGBackend::with_string(&mut out, (PLOT_WIDTH, height)).into_drawing_area(),
        title,
        h,
        timeline,
    )?;
    Ok(out)
}

const FONT: &str = "sans-serif";
/// Horizontal room of the header lines (pixels).
const HEADER_WIDTH: u32 = PLOT_WIDTH - 40;

/// Draws the title and subtitle centred at the top of `root`; returns the
/// height they take (pixels).
fn draw_header<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, title: &PlotTitle) -> Result<u32>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plot: {e:?}");
    // The backend's own measure of the text (the font plotters renders
    // with); about 0.6 em per character when no font can be loaded.
    let measure = |text: &str, size: u32| -> u32 {
        root.estimate_text_size(text, &(FONT, size).into_font().into())
            .map(|(w, _)| w)
            .unwrap_or_else(|_| (text.chars().count() as f64 * size as f64 * 0.6).ceil() as u32)
    };
    let mut y = 10i32;
    for (text, max_size, min_size) in [(&title.title, 24, 14), (&title.subtitle, 15, 11)] {
        if text.is_empty() {
            continue;
        }
        let (size, lines) = fit_text(text, HEADER_WIDTH, max_size, min_size, measure);
        for line in lines {
            let width = measure(&line, size);
            let x = (PLOT_WIDTH.saturating_sub(width) / 2) as i32;
            root.draw_text(&line, &(FONT, size).into_font().color(&BLACK), (x, y))
                .map_err(e)?;
            y += (size as f64 * 1.3).ceil() as i32;
        }
    }
    Ok(y as u32 + 6)
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &PlotTitle,
    h: &Histogram<u64>,
    timeline: Option<&Timeline>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plot: {e:?}");
    root.fill(&WHITE).map_err(e)?;
    let header = draw_header(&root, title)?;
    let (_, body) = root.split_vertically(header);
    let (top, bottom) = match timeline {
        Some(_) => {
            let (a, b) = body.split_vertically(480);
            (a, Some(b))
        }
        None => (body, None),
    };
    let points = percentile_points(h);
    let x_max = points.last().map(|p| p.0).unwrap_or(10.0).max(10.0) * 1.5;
    let axis = log_axis(points.iter().map(|p| p.1));
    let mut chart = ChartBuilder::on(&top)
        .caption(
            format!("latency by percentile, {} requests", h.len()),
            (FONT, 17),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (1.0f64..x_max).log_scale(),
            (axis.lo..axis.hi)
                .log_scale()
                .with_key_points(axis.ticks.clone())
                .with_light_points(axis.light.clone()),
        )
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (ms, log scale)")
        .x_label_formatter(&|x| percentile_label(*x))
        .y_label_formatter(&|y| ms_label(*y))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            points.iter().map(|&(x, y)| (x, y.max(axis.lo))),
            BLUE.stroke_width(2),
        ))
        .map_err(e)?
        .label("latency by percentile")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(e)?;

    if let (Some(area), Some(t)) = (bottom, timeline) {
        draw_timeline(&area, t)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

/// The colours of the per-second series: p50, p99, max, errors, marks.
const P50_COLOR: RGBColor = RGBColor(0, 140, 60);
const P99_COLOR: RGBColor = RGBColor(20, 60, 220);
const MAX_COLOR: RGBColor = RGBColor(200, 30, 30);
const ERROR_COLOR: RGBColor = RGBColor(120, 0, 160);
const MARK_COLOR: RGBColor = RGBColor(200, 100, 0);

fn draw_timeline<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, t: &Timeline) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plot: {e:?}");
    // The time axis covers the seconds with data; later marks are not drawn.
    let t_max = t
        .p99_ms
        .iter()
        .chain(&t.p50_ms)
        .chain(&t.max_ms)
        .map(|p| p.0)
        .chain(t.errors.iter().filter(|p| p.1 > 0).map(|p| p.0))
        .fold(1.0f64, f64::max)
        + 1.0;
    let axis = log_axis(
        t.p50_ms
            .iter()
            .chain(&t.p99_ms)
            .chain(&t.max_ms)
            .map(|p| p.1),
    );
    let errors_max = t.errors.iter().map(|p| p.1).max().unwrap_or(0).max(1) as f64 * 1.3;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "p50, p99 and max latency and errors per second (by intended send time)",
            (FONT, 17),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .right_y_label_area_size(70)
        .build_cartesian_2d(
            0.0f64..t_max,
            (axis.lo..axis.hi)
                .log_scale()
                .with_key_points(axis.ticks.clone())
                .with_light_points(axis.light.clone()),
        )
        .map_err(e)?
        .set_secondary_coord(0.0f64..t_max, 0.0f64..errors_max);
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("latency (ms, log scale)")
        .y_label_formatter(&|y| ms_label(*y))
        .draw()
        .map_err(e)?;
    chart
        .configure_secondary_axes()
        .y_desc("errors per second")
        .draw()
        .map_err(e)?;
    for (series, name, color) in [
        (&t.max_ms, "max", MAX_COLOR),
        (&t.p99_ms, "p99", P99_COLOR),
        (&t.p50_ms, "p50", P50_COLOR),
    ] {
        let points: Vec<(f64, f64)> = series.iter().map(|&(x, y)| (x, y.max(axis.lo))).collect();
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(e)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 2, color.filled())))
            .map_err(e)?;
    }
    let errors: Vec<(f64, f64)> = t
        .errors
        .iter()
        .filter(|p| p.1 > 0)
        .map(|&(s, n)| (s, n as f64))
        .collect();
    chart
        .draw_secondary_series(
            errors
                .iter()
                .map(|&p| Cross::new(p, 4, ERROR_COLOR.stroke_width(2))),
        )
        .map_err(e)?
        .label("errors per second (right axis)")
        .legend(|(x, y)| Cross::new((x + 10, y), 4, ERROR_COLOR.stroke_width(2)));
    for (n, mark) in t.marks.iter().filter(|m| m.t_s <= t_max).enumerate() {
        chart
            .draw_series(LineSeries::new(
                vec![(mark.t_s, axis.lo), (mark.t_s, axis.hi)],
                MARK_COLOR.stroke_width(2),
            ))
            .map_err(e)?;
        // Staggered (evenly on the log axis) so that marks close in time
        // stay readable.
        let y = axis.lo * (axis.hi / axis.lo).powf(0.95 - 0.07 * (n % 4) as f64);
        chart
            .draw_series(std::iter::once(Text::new(
                format!(" {}", mark.label),
                (mark.t_s, y),
                (FONT, 14).into_font().color(&MARK_COLOR),
            )))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::latency_histogram;

    #[test]
    fn labels_read_as_percentiles() {
        assert_eq!(percentile_label(1.0), "0%");
        assert_eq!(percentile_label(2.0), "50%");
        assert_eq!(percentile_label(10.0), "90%");
        assert_eq!(percentile_label(100.0), "99%");
        assert_eq!(percentile_label(1000.0), "99.9%");
        assert_eq!(percentile_label(10000.0), "99.99%");
    }

    #[test]
    fn log_axes_span_whole_decades_with_readable_labels() {
        let a = log_axis([0.35, 2.0, 140.0]);
        assert_eq!((a.lo, a.hi), (0.1, 1000.0));
        let labels: Vec<String> = a.ticks.iter().map(|&t| ms_label(t)).collect();
        assert_eq!(labels, ["0.1", "1", "10", "100", "1000"]);
        assert_eq!(a.light.len(), 2 * 4);
        assert_eq!(log_axis([0.0]).lo, 0.001);
        assert_eq!(ms_label(0.001), "0.001");
        assert_eq!(ms_label(0.01), "0.01");
        let one = log_axis([1.0, 1.0]);
        assert!(one.lo < one.hi);
        assert_eq!(log_axis(std::iter::empty()).ticks, [0.1, 1.0, 10.0]);
    }

    #[test]
    fn titles_shrink_then_wrap_to_fit() {
        // 10 px per character at size 20, proportional to the size.
        let measure = |t: &str, size: u32| t.chars().count() as u32 * size / 2;
        assert_eq!(
            fit_text("short", 100, 20, 10, measure),
            (20, vec!["short".into()])
        );
        assert_eq!(fit_text("a bit longer", 100, 20, 10, measure).0, 16);
        let long = "open loop at 20000 requests/s over 3 connections, at most 64 in flight each";
        let (size, lines) = fit_text(long, 100, 20, 10, measure);
        assert_eq!(size, 10);
        assert!(lines.len() > 1);
        assert!(lines.iter().all(|l| measure(l, 10) <= 100), "{lines:?}");
        assert_eq!(lines.join(" "), long);
    }

    #[test]
    fn both_panels_render_with_log_ticks_three_series_and_marks() {
        let mut h = latency_histogram(3);
        for v in 1..=5000u64 {
            h.record(100 + v).unwrap();
        }
        h.record(150_000).unwrap();
        let points = percentile_points(&h);
        assert!(points
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        let timeline = Timeline {
            p50_ms: vec![(0.5, 0.4), (1.5, 0.6), (2.5, 0.5)],
            p99_ms: vec![(0.5, 1.0), (1.5, 25.0), (2.5, 1.2)],
            max_ms: vec![(0.5, 2.0), (1.5, 150.0), (2.5, 3.0)],
            errors: vec![(1.5, 3)],
            marks: vec![
                Mark {
                    t_s: 1.0,
                    label: "SIGKILL node-3".into(),
                },
                Mark {
                    t_s: 2.0,
                    label: "node-3 ready".into(),
                },
            ],
        };
        let title = PlotTitle {
            title: "shardline-bench demo: latency by percentile".into(),
            subtitle: "open loop at 20000 requests/s over 3 connection(s), at most 64 in flight each, \
                       914145 requests planned, and a description long enough to need wrapping or a smaller font"
                .into(),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        write_plot(&path, &title, &h, Some(&timeline)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert_eq!(svg, svg_string(&title, &h, Some(&timeline)).unwrap());
        assert!(svg.starts_with("<svg"));
        let texts = svg_texts(&svg);
        for tick in ["0.1", "1", "10", "100", "1000"] {
            assert!(
                texts.iter().any(|t| t == tick),
                "no tick {tick} in {texts:?}"
            );
        }
        for label in [
            "p50",
            "p99",
            "max",
            "SIGKILL node-3",
            "node-3 ready",
            "99.9%",
        ] {
            assert!(
                texts.iter().any(|t| t.trim() == label),
                "no `{label}` in {texts:?}"
            );
        }
        // Three per-second series and the percentile line, plus two marks.
        assert!(svg.matches("<polyline").count() >= 6, "{svg}");
        // Every header line fits the width: nothing starts left of the edge.
        let header: Vec<&String> = texts
            .iter()
            .filter(|t| t.contains("requests/s") || t.contains("demo:"))
            .collect();
        assert!(!header.is_empty());
        assert!(!svg.contains("x=\"-"), "text starts left of the plot");
        assert!(write_plot(&dir.path().join("p.gif"), &title, &h, None).is_err());
    }

    /// The contents of the `<text>` elements of an SVG document.
    fn svg_texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..t.find("</text>")?];
                Some(body.trim().to_string())
            })
            .collect()
    }
}
