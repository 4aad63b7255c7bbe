//! Reports: the printed summary, HdrHistogram's percentile-distribution text
//! format (`.hgrm`), and the machine facts recorded in `--json`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::units::format_latency_us;

/// The percentiles every summary reports.
pub const PERCENTILES: [(&str, f64); 5] = [
    ("p50", 50.0),
    ("p90", 90.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
    ("p99.99", 99.99),
];

/// Latency figures of one histogram (µs).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LatencySummary {
    /// Samples (count).
    pub count: u64,
    /// Lowest latency (µs).
    pub min_us: u64,
    /// Median (µs).
    pub p50_us: u64,
    /// 90th percentile (µs).
    pub p90_us: u64,
    /// 99th percentile (µs).
    pub p99_us: u64,
    /// 99.9th percentile (µs).
    pub p99_9_us: u64,
    /// 99.99th percentile (µs).
    pub p99_99_us: u64,
    /// Highest latency (µs).
    pub max_us: u64,
}

impl LatencySummary {
    /// Reads the figures off a µs histogram (zeros when it is empty).
    pub fn of(h: &Histogram<u64>) -> LatencySummary {
        let at = |p: f64| {
            if h.is_empty() {
                0
            } else {
                h.value_at_percentile(p)
            }
        };
        LatencySummary {
            count: h.len(),
            min_us: if h.is_empty() { 0 } else { h.min() },
            p50_us: at(50.0),
            p90_us: at(90.0),
            p99_us: at(99.0),
            p99_9_us: at(99.9),
            p99_99_us: at(99.99),
            max_us: if h.is_empty() { 0 } else { h.max() },
        }
    }

    /// `p50 1.234 ms  p90 ...  max ...` on one line.
    pub fn line(&self) -> String {
        let values = [
            self.p50_us,
            self.p90_us,
            self.p99_us,
            self.p99_9_us,
            self.p99_99_us,
        ];
        let mut out = String::new();
        for ((name, _), v) in PERCENTILES.iter().zip(values) {
            let _ = write!(out, "{name} {}  ", format_latency_us(v));
        }
        let _ = write!(out, "max {}", format_latency_us(self.max_us));
        out
    }
}

/// Writes `h` (values in µs) in HdrHistogram's percentile-distribution text
/// format with values in milliseconds, as `outputPercentileDistribution(out,
/// 5, 1000.0)` of the Java HdrHistogram does: a header, one line per
/// percentile step (`Value Percentile TotalCount 1/(1-Percentile)`, 5 ticks
/// per half distance), and the Mean/StdDeviation, Max/Total count and
/// Buckets/SubBuckets footer. The result loads into HdrHistogram's plotter.
pub fn hgrm_text(h: &Histogram<u64>) -> String {
    const SCALE: f64 = 1000.0; // µs -> ms
    let digits = h.sigfig() as usize;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:>12} {:>14} {:>10} {:>14}\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let mut total = 0u64;
    if !h.is_empty() {
        for v in h.iter_quantiles(5) {
            total += v.count_since_last_iteration();
            let value = h.highest_equivalent(v.value_iterated_to()) as f64 / SCALE;
            let q = v.quantile_iterated_to();
            if q < 1.0 {
                let _ = writeln!(
                    out,
                    "{value:12.digits$} {q:2.12} {total:10} {:14.2}",
                    1.0 / (1.0 - q)
                );
            } else {
                let _ = writeln!(out, "{value:12.digits$} {q:2.12} {total:10}");
            }
        }
    }
    let (mean, stdev, max) = if h.is_empty() {
        (0.0, 0.0, 0.0)
    } else {
        (
            h.mean() / SCALE,
            h.stdev() / SCALE,
            h.highest_equivalent(h.max()) as f64 / SCALE,
        )
    };
    // Sub-buckets: the power of two that holds 2 * 10^digits values.
    let sub_buckets = (2 * 10u64.pow(digits as u32)).next_power_of_two();
    let _ = writeln!(
        out,
        "#[Mean    = {mean:12.digits$}, StdDeviation   = {stdev:12.digits$}]"
    );
    let _ = writeln!(
        out,
        "#[Max     = {max:12.digits$}, Total count    = {:12}]",
        h.len()
    );
    let _ = writeln!(
        out,
        "#[Buckets = {:12}, SubBuckets     = {sub_buckets:12}]",
        h.buckets()
    );
    out
}

/// Writes [`hgrm_text`] to `path`.
///
/// # Errors
/// When the file cannot be written.
pub fn write_hgrm(path: &Path, h: &Histogram<u64>) -> Result<()> {
    std::fs::write(path, hgrm_text(h)).with_context(|| format!("cannot write {}", path.display()))
}

/// Facts about the machine and the build recorded with every JSON report.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// `git rev-parse HEAD` of the workspace (with `-dirty` when it has
    /// uncommitted changes), or `unknown`.
    pub git_revision: String,
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel: String,
    /// CPU model name (`/proc/cpuinfo`).
    pub cpu: String,
    /// Logical CPUs available to this process (count).
    pub cpus: usize,
    /// Host name.
    pub hostname: String,
    /// Harness version.
    pub harness_version: &'static str,
}

impl Machine {
    /// Reads the facts; anything unreadable is `unknown`.
    pub fn read() -> Machine {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_else(|_| "unknown".into())
        };
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        Machine {
            git_revision: git_revision(),
            kernel: read("/proc/sys/kernel/osrelease"),
            cpu,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            hostname: read("/proc/sys/kernel/hostname"),
            harness_version: env!("CARGO_PKG_VERSION"),
        }
    }
}

fn git_revision() -> String {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(&workspace)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(rev) if !rev.is_empty() => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{rev}-dirty")
            } else {
                rev
            }
        }
        _ => "unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::latency_histogram;

    fn sample() -> Histogram<u64> {
        let mut h = latency_histogram(3);
        for v in 1..=1000u64 {
            h.record(v * 10).unwrap(); // 10 µs .. 10 ms
        }
        h
    }

    #[test]
    fn summary_reads_percentiles() {
        let h = sample();
        let s = LatencySummary::of(&h);
        assert_eq!(s.count, 1000);
        // Percentiles read as the highest value equivalent to the sample (3 digits).
        assert_eq!(s.p50_us, h.highest_equivalent(5000));
        assert_eq!(s.p99_us, h.highest_equivalent(9900));
        assert_eq!(s.max_us, h.highest_equivalent(10_000));
        assert!((5000..5010).contains(&s.p50_us) && (10_000..10_010).contains(&s.max_us));
        assert!(
            s.line()
                .starts_with("p50 5.003 ms  p90 9.007 ms  p99 9.903 ms"),
            "{}",
            s.line()
        );
        let empty = LatencySummary::of(&latency_histogram(3));
        assert_eq!(empty.count, 0);
    }

    #[test]
    fn hgrm_has_the_standard_layout() {
        let text = hgrm_text(&sample());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "       Value     Percentile TotalCount 1/(1-Percentile)"
        );
        assert_eq!(lines[1], "");
        // First data line: the lowest value (0.010 ms) at percentile 0.
        let first: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(first, vec!["0.010", "0.000000000000", "1", "1.00"]);
        // Last data line: percentile 1 with no 1/(1-p) column, all counted.
        let last_data = lines[lines.len() - 4];
        let fields: Vec<&str> = last_data.split_whitespace().collect();
        assert_eq!(fields.len(), 3, "{last_data}");
        assert_eq!(fields[1], "1.000000000000");
        assert_eq!(fields[2], "1000");
        assert!(lines[lines.len() - 3].starts_with("#[Mean    ="));
        assert!(lines[lines.len() - 2].contains("Total count    =         1000]"));
        assert!(lines[lines.len() - 1].contains("SubBuckets     =         2048]"));
        // Percentiles never decrease and counts are cumulative.
        let mut previous = (0.0f64, 0u64);
        for line in &lines[2..lines.len() - 3] {
            let f: Vec<&str> = line.split_whitespace().collect();
            let q: f64 = f[1].parse().unwrap();
            let c: u64 = f[2].parse().unwrap();
            assert!(q >= previous.0 && c >= previous.1);
            previous = (q, c);
        }
    }

    #[test]
    fn machine_facts_are_read() {
        let m = Machine::read();
        assert!(m.cpus >= 1);
        assert!(!m.kernel.is_empty());
    }
}
