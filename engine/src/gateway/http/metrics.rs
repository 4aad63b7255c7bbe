//! `GET /metrics`: the Prometheus text exposition format, version 0.0.4,
//! written by its specification
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/>).
//!
//! The node fills a plain [`MetricsSnapshot`] (every data core contributes
//! its counters and HdrHistograms; histograms of the same series are merged
//! with [`hdrhistogram::Histogram::add`]), and [`write_prometheus`] renders
//! it. No registry, no atomics, no locks: the snapshot is built on request,
//! which fits the thread-per-core design (a metrics library with a shared
//! registry would put atomics on the data path).
//!
//! Latency histograms are recorded in microseconds and exported in seconds
//! with the fixed bucket bounds of [`LATENCY_BUCKETS_SECONDS`]; a bucket's
//! cumulative count is the number of recorded values at or below its bound
//! (to HdrHistogram's precision), and `_sum` is the sum of the recorded
//! values at that precision.

use std::fmt::Write as _;

use hdrhistogram::Histogram;

/// Upper bounds of the exported latency buckets, in seconds (50 µs .. 10 s;
/// `+Inf` is added).
pub const LATENCY_BUCKETS_SECONDS: [f64; 18] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Requests answered, by front, entity type and status code (a counter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestCount {
    /// `"http"` or `"native"`.
    pub front: &'static str,
    /// The entity type (`""` for requests that named none, like admin).
    pub type_name: String,
    /// The HTTP status code (the native front reports the mapped code).
    pub code: u16,
    /// Requests, count.
    pub count: u64,
}

/// A latency histogram of one front and entity type (merged over the
/// cores).
#[derive(Debug, Clone)]
pub struct LatencySeries {
    /// `"http"` or `"native"`.
    pub front: &'static str,
    /// The entity type.
    pub type_name: String,
    /// Recorded latencies, in microseconds.
    pub micros: Histogram<u64>,
}

/// A per-region gauge or counter value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionValue {
    /// The entity type.
    pub type_name: String,
    /// The data core (region) index.
    pub core: u16,
    /// The value (count).
    pub value: u64,
}

/// Dead letters by entity type and reason (a counter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterCount {
    /// The entity type.
    pub type_name: String,
    /// Why the messages were dropped (for example `buffer_full`,
    /// `shutting_down`, `unknown_type`).
    pub reason: String,
    /// Messages, count.
    pub count: u64,
}

/// Connections of one front on one core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionCount {
    /// `"http"`, `"native"` or `"cluster"`.
    pub front: &'static str,
    /// The data core index.
    pub core: u16,
    /// Open now (gauge).
    pub open: u64,
    /// Accepted since start (counter).
    pub accepted: u64,
    /// Of those, refused at once for the front's per-core connection limit
    /// (`http.max_connections_per_core`,
    /// `requests.max_native_connections_per_core`) (counter).
    pub refused: u64,
}

/// Everything `/metrics` shows, filled by the node on request. Empty
/// vectors render as metrics without samples (their `# HELP`/`# TYPE`
/// lines are still written so the names are discoverable).
#[derive(Debug, Clone, Default)]
pub struct MetricsSnapshot {
    /// `shardline_requests_total{front,type,code}`.
    pub requests: Vec<RequestCount>,
    /// `shardline_request_duration_seconds{front,type}` (histogram).
    pub request_latency: Vec<LatencySeries>,
    /// `shardline_buffered_messages{type,core}` (gauge).
    pub buffered_messages: Vec<RegionValue>,
    /// `shardline_dead_letters_total{type,reason}`.
    pub dead_letters: Vec<DeadLetterCount>,
    /// `shardline_shards{type,core}` (gauge): shards hosted per region.
    pub shards: Vec<RegionValue>,
    /// `shardline_active_entities{type,core}` (gauge).
    pub active_entities: Vec<RegionValue>,
    /// `shardline_messages_delivered_total{type,core}`.
    pub messages_delivered: Vec<RegionValue>,
    /// `shardline_hand_offs_total{type,core,phase="begun"}`: hand-offs a
    /// region started (shards told to stop by the coordinator).
    pub hand_offs_begun: Vec<RegionValue>,
    /// `shardline_hand_offs_total{type,core,phase="completed"}`: hand-offs
    /// a region finished (shard stopped and reported).
    pub hand_offs_completed: Vec<RegionValue>,
    /// `shardline_worker_activations{type,core}` (gauge): activations of a
    /// stateless worker type now.
    pub worker_activations: Vec<RegionValue>,
    /// `shardline_worker_activations_max{type,core}` (gauge): most
    /// activations at one time since start.
    pub worker_activations_max: Vec<RegionValue>,
    /// `shardline_worker_queued{type,core}` (gauge): requests waiting for an
    /// idle activation.
    pub worker_queued: Vec<RegionValue>,
    /// `shardline_worker_executed_total{type,core}`: requests executed by a
    /// core's activations.
    pub worker_executed: Vec<RegionValue>,
    /// `shardline_journal_flush_duration_seconds{core}` (histogram), in
    /// microseconds, one per core with a journal.
    pub journal_flush_micros: Vec<(u16, Histogram<u64>)>,
    /// `shardline_connections{front,core}` (gauge),
    /// `shardline_connections_accepted_total{front,core}` and
    /// `shardline_connections_refused_total{front,core}`.
    pub connections: Vec<ConnectionCount>,
    /// `shardline_ready` (gauge, 0 or 1).
    pub ready: bool,
}

/// One metric family of the connection counts: name, type, help, and the
/// field of [`ConnectionCount`] it shows.
type ConnectionFamily = (
    &'static str,
    &'static str,
    &'static str,
    fn(&ConnectionCount) -> u64,
);

/// Escapes a label value: backslash, double quote and line feed
/// (exposition format, "Text format details").
fn escape_label(v: &str, out: &mut String) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
    out.push_str(name);
    if !labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            escape_label(v, out);
            out.push('"');
        }
        out.push('}');
    }
    let _ = writeln!(out, " {value}");
}

fn region_values(out: &mut String, name: &str, kind: &str, help: &str, v: &[RegionValue]) {
    header(out, name, kind, help);
    for r in v {
        let core = r.core.to_string();
        sample(
            out,
            name,
            &[("type", &r.type_name), ("core", &core)],
            r.value,
        );
    }
}

/// Writes one histogram's buckets, sum and count; `micros` holds values in
/// microseconds, exported in seconds.
fn histogram(out: &mut String, name: &str, labels: &[(&str, &str)], micros: &Histogram<u64>) {
    let bucket = format!("{name}_bucket");
    for bound in LATENCY_BUCKETS_SECONDS {
        let bound_micros = (bound * 1e6).round() as u64;
        let cumulative = if micros.is_empty() {
            0
        } else {
            micros.count_between(0, bound_micros)
        };
        let le = format_float(bound);
        let mut with_le: Vec<(&str, &str)> = labels.to_vec();
        with_le.push(("le", &le));
        sample(out, &bucket, &with_le, cumulative);
    }
    let mut with_le: Vec<(&str, &str)> = labels.to_vec();
    with_le.push(("le", "+Inf"));
    sample(out, &bucket, &with_le, micros.len());
    let sum_micros: u128 = micros
        .iter_recorded()
        .map(|v| {
            u128::from(micros.median_equivalent(v.value_iterated_to()))
                * u128::from(v.count_at_value())
        })
        .sum();
    sample(
        out,
        &format!("{name}_sum"),
        labels,
        format_float(sum_micros as f64 / 1e6),
    );
    sample(out, &format!("{name}_count"), labels, micros.len());
}

/// Formats a float as Go's `strconv.FormatFloat(v, 'g', -1, 64)` would for
/// the values used here (shortest round-trip form), which Prometheus parses.
fn format_float(v: f64) -> String {
    if v.is_infinite() {
        return if v > 0.0 {
            "+Inf".into()
        } else {
            "-Inf".into()
        };
    }
    if v.is_nan() {
        return "NaN".into();
    }
    format!("{v}")
}

/// Renders the snapshot in the Prometheus text format (version 0.0.4).
pub fn write_prometheus(m: &MetricsSnapshot) -> String {
    let mut out = String::with_capacity(4096);
    header(
        &mut out,
        "shardline_requests_total",
        "counter",
        "Requests answered, by front, entity type and HTTP status code.",
    );
    for r in &m.requests {
        let code = r.code.to_string();
        sample(
            &mut out,
            "shardline_requests_total",
            &[("front", r.front), ("type", &r.type_name), ("code", &code)],
            r.count,
        );
    }
    header(
        &mut out,
        "shardline_request_duration_seconds",
        "histogram",
        "Time from reading a request to queueing its response, in seconds (HdrHistograms of all cores merged).",
    );
    for s in &m.request_latency {
        histogram(
            &mut out,
            "shardline_request_duration_seconds",
            &[("front", s.front), ("type", &s.type_name)],
            &s.micros,
        );
    }
    region_values(
        &mut out,
        "shardline_buffered_messages",
        "gauge",
        "Messages waiting in a region's buffers for a shard home.",
        &m.buffered_messages,
    );
    header(
        &mut out,
        "shardline_dead_letters_total",
        "counter",
        "Messages refused or dropped, by entity type and reason.",
    );
    for d in &m.dead_letters {
        sample(
            &mut out,
            "shardline_dead_letters_total",
            &[("type", &d.type_name), ("reason", &d.reason)],
            d.count,
        );
    }
    region_values(
        &mut out,
        "shardline_shards",
        "gauge",
        "Shards hosted by a region.",
        &m.shards,
    );
    region_values(
        &mut out,
        "shardline_active_entities",
        "gauge",
        "Live entities in a region.",
        &m.active_entities,
    );
    region_values(
        &mut out,
        "shardline_messages_delivered_total",
        "counter",
        "Messages handed to entities in a region.",
        &m.messages_delivered,
    );
    header(
        &mut out,
        "shardline_hand_offs_total",
        "counter",
        "Shard hand-offs of a region, by phase: begun (the coordinator's HandOff stopped the shard's entities) and completed (the shard stopped and was reported).",
    );
    for (phase, v) in [
        ("begun", &m.hand_offs_begun),
        ("completed", &m.hand_offs_completed),
    ] {
        for r in v {
            let core = r.core.to_string();
            sample(
                &mut out,
                "shardline_hand_offs_total",
                &[("type", &r.type_name), ("core", &core), ("phase", phase)],
                r.value,
            );
        }
    }
    region_values(
        &mut out,
        "shardline_worker_activations",
        "gauge",
        "Activations of a stateless worker type on a core.",
        &m.worker_activations,
    );
    region_values(
        &mut out,
        "shardline_worker_activations_max",
        "gauge",
        "Most activations of a stateless worker type on a core at one time.",
        &m.worker_activations_max,
    );
    region_values(
        &mut out,
        "shardline_worker_queued",
        "gauge",
        "Requests of a stateless worker type waiting for an idle activation.",
        &m.worker_queued,
    );
    region_values(
        &mut out,
        "shardline_worker_executed_total",
        "counter",
        "Requests of a stateless worker type executed on a core.",
        &m.worker_executed,
    );
    header(
        &mut out,
        "shardline_journal_flush_duration_seconds",
        "histogram",
        "Latency of each fdatasync of a data core's journal (group commit and sealed segments), in seconds.",
    );
    for (core, h) in &m.journal_flush_micros {
        let core = core.to_string();
        histogram(
            &mut out,
            "shardline_journal_flush_duration_seconds",
            &[("core", &core)],
            h,
        );
    }
    // The connection families, one per field of `ConnectionCount`.
    let families: [ConnectionFamily; 3] = [
        (
            "shardline_connections",
            "gauge",
            "Open client connections, by front and core.",
            |c| c.open,
        ),
        (
            "shardline_connections_accepted_total",
            "counter",
            "Client connections accepted, by front and core.",
            |c| c.accepted,
        ),
        (
            "shardline_connections_refused_total",
            "counter",
            "Client connections closed at once because the core had its front's most open connections (counted in accepted too), by front and core.",
            |c| c.refused,
        ),
    ];
    for (name, kind, help, value) in families {
        header(&mut out, name, kind, help);
        for c in &m.connections {
            let core = c.core.to_string();
            sample(
                &mut out,
                name,
                &[("front", c.front), ("core", &core)],
                value(c),
            );
        }
    }
    header(
        &mut out,
        "shardline_ready",
        "gauge",
        "1 when the node is ready to route (member Up, regions registered).",
    );
    sample(&mut out, "shardline_ready", &[], u8::from(m.ready));
    out
}

/// A new latency histogram in microseconds: 1 µs to 1 hour, 3 significant
/// digits (the engine's convention).
///
/// # Panics
/// Never: the bounds are constants accepted by `Histogram::new_with_bounds`.
pub fn new_latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("constant histogram bounds are valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_family_with_help_and_type() {
        let mut h1 = new_latency_histogram();
        let mut h2 = new_latency_histogram();
        for v in [40, 80, 900] {
            h1.record(v).unwrap();
        }
        h2.record(2_000_000).unwrap();
        h1.add(&h2).unwrap();
        let m = MetricsSnapshot {
            requests: vec![RequestCount {
                front: "http",
                type_name: "counter".into(),
                code: 200,
                count: 4,
            }],
            request_latency: vec![LatencySeries {
                front: "http",
                type_name: "counter".into(),
                micros: h1,
            }],
            dead_letters: vec![DeadLetterCount {
                type_name: "we\"ird\\\n".into(),
                reason: "buffer_full".into(),
                count: 2,
            }],
            shards: vec![RegionValue {
                type_name: "counter".into(),
                core: 1,
                value: 33,
            }],
            ready: true,
            ..Default::default()
        };
        let text = write_prometheus(&m);
        assert!(text.contains(
            "shardline_requests_total{front=\"http\",type=\"counter\",code=\"200\"} 4\n"
        ));
        assert!(
            text.contains(
                "shardline_request_duration_seconds_bucket{front=\"http\",type=\"counter\",le=\"0.00005\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains(
            "shardline_request_duration_seconds_bucket{front=\"http\",type=\"counter\",le=\"0.001\"} 3\n"
        ));
        assert!(text
            .contains("shardline_request_duration_seconds_bucket{front=\"http\",type=\"counter\",le=\"1\"} 3\n"));
        assert!(text.contains(
            "shardline_request_duration_seconds_bucket{front=\"http\",type=\"counter\",le=\"2.5\"} 4\n"
        ));
        assert!(text.contains(
            "shardline_request_duration_seconds_bucket{front=\"http\",type=\"counter\",le=\"+Inf\"} 4\n"
        ));
        assert!(text.contains(
            "shardline_request_duration_seconds_count{front=\"http\",type=\"counter\"} 4\n"
        ));
        assert!(text.contains("shardline_dead_letters_total{type=\"we\\\"ird\\\\\\n\",reason=\"buffer_full\"} 2\n"), "{text}");
        assert!(text.contains("shardline_shards{type=\"counter\",core=\"1\"} 33\n"));
        assert!(text.contains("shardline_ready 1\n"));
        // The sum is close to the recorded total (HdrHistogram precision).
        let sum_line = text
            .lines()
            .find(|l| l.starts_with("shardline_request_duration_seconds_sum"))
            .unwrap();
        let sum: f64 = sum_line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((sum - 2.001020).abs() < 0.01, "{sum}");
        // Every sample line belongs to a family declared before it.
        let mut declared = std::collections::HashSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                declared.insert(rest.split(' ').next().unwrap().to_string());
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                let base = name
                    .strip_suffix("_bucket")
                    .or_else(|| name.strip_suffix("_sum"))
                    .or_else(|| name.strip_suffix("_count"))
                    .filter(|b| declared.contains(*b))
                    .unwrap_or(name);
                assert!(declared.contains(base), "undeclared {name}");
            }
        }
    }

    #[test]
    fn buckets_are_cumulative_and_end_with_inf() {
        let mut h = new_latency_histogram();
        for v in 1..10_000u64 {
            h.record(v * 37).unwrap();
        }
        let m = MetricsSnapshot {
            request_latency: vec![LatencySeries {
                front: "native",
                type_name: "echo".into(),
                micros: h,
            }],
            ..Default::default()
        };
        let text = write_prometheus(&m);
        let counts: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with("shardline_request_duration_seconds_bucket"))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(counts.len(), LATENCY_BUCKETS_SECONDS.len() + 1);
        assert!(counts.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*counts.last().unwrap(), 9_999);
        assert_eq!(format_float(0.000_05), "0.00005");
        assert_eq!(format_float(1.0), "1");
    }
}
