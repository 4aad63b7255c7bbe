//! LRU passivation on a real trace: a single-region node with
//! `active_entity_limit = c` replays the OLTP trace of the ARC paper in
//! order over one connection; the share of messages that found their entity
//! already active (from the node's counters) must equal the LRU hit ratios
//! published in the paper's Table IV, to two decimals.
//!
//! Source: N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead
//! Replacement Cache", USENIX FAST '03, Table IV (OLTP, LRU column).

mod support;

use std::time::{Duration, Instant};

use support::{node_binary, oltp_trace, run_bench};

const PUBLISHED: [(u64, &str); 5] = [
    (1000, "32.83"),
    (2000, "42.47"),
    (5000, "53.65"),
    (10000, "60.70"),
    (15000, "64.63"),
];

fn hit_ratio(limit: u64) -> (f64, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let limit_text = limit.to_string();
    let started = Instant::now();
    let out = run_bench(
        &[
            "run",
            "--spawn",
            "1",
            "--cores",
            "1",
            "--trace",
            oltp_trace().to_str().unwrap(),
            "--op",
            "counter-add",
            "--connections",
            "1",
            "--pipeline",
            "256",
            "--active-entity-limit",
            &limit_text,
            "--passivation",
            "lru",
            "--request-timeout",
            "30s",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(600),
    );
    assert!(
        out.status.success(),
        "c = {limit}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(report["errors"], 0, "c = {limit}: {report:#}");
    assert_eq!(
        report["messages_delivered"], 914_145,
        "c = {limit}: every reference delivered once"
    );
    let ratio = report["hit_ratio"]
        .as_f64()
        .expect("hit_ratio in the report");
    (ratio, started.elapsed())
}

#[test]
fn oltp_lru_hit_ratios_equal_the_arc_paper() {
    node_binary();
    // Two runs at a time: the machine has two cores.
    let mut results = Vec::new();
    for pair in PUBLISHED.chunks(2) {
        let handles: Vec<_> = pair
            .iter()
            .map(|&(limit, expected)| {
                std::thread::spawn(move || (limit, expected, hit_ratio(limit)))
            })
            .collect();
        for h in handles {
            results.push(h.join().unwrap());
        }
    }
    for (limit, expected, (ratio, took)) in &results {
        println!(
            "c = {limit}: hit ratio {ratio:.2}% (published {expected}%), {:.1} s",
            took.as_secs_f64()
        );
    }
    for (limit, expected, (ratio, _)) in results {
        assert_eq!(format!("{ratio:.2}"), expected, "c = {limit}");
    }
}
