//! Plots (plotters): the latency percentile plot, and for scenarios the p99
//! of each second over time with the disturbance marked.
//!
//! The percentile plot follows HdrHistogram's plotter: the x axis is
//! `1/(1-percentile)` on a log scale (labelled 90%, 99%, 99.9%, …) so the
//! tail gets as much room as the median; the y axis is latency in ms.

use std::path::Path;

use anyhow::{anyhow, bail, Result};
use hdrhistogram::Histogram;
use plotters::coord::Shift;
use plotters::prelude::*;

/// A point in time to mark on the scenario plot.
#[derive(Clone, Debug)]
pub struct Mark {
    /// Seconds since the start of the run.
    pub t_s: f64,
    /// What happened (`kill node-3`, `node-3 ready`, ...).
    pub label: String,
}

/// The per-second series of a scenario run.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    /// `(second since start, p99 in ms)` for each second with successes.
    pub p99_ms: Vec<(f64, f64)>,
    /// `(second since start, errors)` for each second.
    pub errors: Vec<(f64, u64)>,
    /// Disturbance marks.
    pub marks: Vec<Mark>,
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

/// Writes the plot to `path` (`.svg` or `.png`, 1000 px wide).
///
/// # Errors
/// An unknown extension, or a drawing or file error.
pub fn write_plot(
    path: &Path,
    title: &str,
    h: &Histogram<u64>,
    timeline: Option<&Timeline>,
) -> Result<()> {
    let height = if timeline.is_some() { 900 } else { 520 };
    let extension = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match extension {
        "svg" => draw(
            SVGBackend::new(path, (1000, height)).into_drawing_area(),
            title,
            h,
            timeline,
        ),
        "png" => draw(
            BitMapBackend::new(path, (1000, height)).into_drawing_area(),
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

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    title: &str,
    h: &Histogram<u64>,
    timeline: Option<&Timeline>,
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let e = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("plot: {e:?}");
    root.fill(&WHITE).map_err(e)?;
    let (top, bottom) = match timeline {
        Some(_) => {
            let (a, b) = root.split_vertically(480);
            (a, Some(b))
        }
        None => (root.clone(), None),
    };
    let points = percentile_points(h);
    let x_max = points.last().map(|p| p.0).unwrap_or(10.0).max(10.0) * 1.5;
    let y_max = points.iter().map(|p| p.1).fold(0.0f64, f64::max).max(0.001) * 1.1;
    let mut chart = ChartBuilder::on(&top)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((1.0f64..x_max).log_scale(), 0.0f64..y_max)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (ms)")
        .x_label_formatter(&|x| percentile_label(*x))
        .draw()
        .map_err(e)?;
    chart
        .draw_series(LineSeries::new(
            points.iter().copied(),
            BLUE.stroke_width(2),
        ))
        .map_err(e)?
        .label(format!("latency, {} requests", h.len()))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(e)?;

    if let (Some(area), Some(t)) = (bottom, timeline) {
        // The time axis covers the seconds with data; later marks are not drawn.
        let t_max = t
            .p99_ms
            .iter()
            .map(|p| p.0)
            .chain(t.errors.iter().filter(|p| p.1 > 0).map(|p| p.0))
            .fold(1.0f64, f64::max)
            + 1.0;
        let y_max = t
            .p99_ms
            .iter()
            .map(|p| p.1)
            .fold(0.0f64, f64::max)
            .max(0.001)
            * 1.3;
        let errors_max = t.errors.iter().map(|p| p.1).max().unwrap_or(0).max(1) as f64 * 1.3;
        let mut chart = ChartBuilder::on(&area)
            .caption(
                "p99 latency and errors per second (by intended send time)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .right_y_label_area_size(70)
            .build_cartesian_2d(0.0f64..t_max, 0.0f64..y_max)
            .map_err(e)?
            .set_secondary_coord(0.0f64..t_max, 0.0f64..errors_max);
        chart
            .configure_mesh()
            .x_desc("time since start (s)")
            .y_desc("p99 (ms)")
            .draw()
            .map_err(e)?;
        chart
            .configure_secondary_axes()
            .y_desc("errors per second")
            .draw()
            .map_err(e)?;
        chart
            .draw_series(LineSeries::new(
                t.p99_ms.iter().copied(),
                BLUE.stroke_width(2),
            ))
            .map_err(e)?
            .label("p99 (ms)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
        chart
            .draw_series(t.p99_ms.iter().map(|&p| Circle::new(p, 2, BLUE.filled())))
            .map_err(e)?;
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
                    .map(|&p| Cross::new(p, 4, RED.stroke_width(2))),
            )
            .map_err(e)?
            .label("errors per second")
            .legend(|(x, y)| Cross::new((x + 10, y), 4, RED.stroke_width(2)));
        for (n, mark) in t.marks.iter().filter(|m| m.t_s <= t_max).enumerate() {
            let color = RGBColor(200, 100, 0);
            chart
                .draw_series(LineSeries::new(
                    vec![(mark.t_s, 0.0), (mark.t_s, y_max)],
                    color.stroke_width(2),
                ))
                .map_err(e)?;
            // Staggered so that marks close in time stay readable.
            let y = y_max * (0.95 - 0.07 * (n % 4) as f64);
            chart
                .draw_series(std::iter::once(Text::new(
                    format!(" {}", mark.label),
                    (mark.t_s, y),
                    ("sans-serif", 14).into_font().color(&color),
                )))
                .map_err(e)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
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
    fn svg_plots_are_written() {
        let mut h = latency_histogram(3);
        for v in 1..=5000u64 {
            h.record(100 + v).unwrap();
        }
        let points = percentile_points(&h);
        assert!(points
            .windows(2)
            .all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.svg");
        let timeline = Timeline {
            p99_ms: vec![(0.0, 1.0), (1.0, 5.0), (2.0, 1.2)],
            errors: vec![(1.0, 3)],
            marks: vec![Mark {
                t_s: 1.0,
                label: "kill node-3".into(),
            }],
        };
        write_plot(&path, "test", &h, Some(&timeline)).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("kill node-3") && svg.contains("polyline"));
        assert!(write_plot(&dir.path().join("p.gif"), "t", &h, None).is_err());
    }
}
