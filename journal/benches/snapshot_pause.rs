//! What a snapshot save costs the appending thread when many ids share
//! the sealed segments: appends two 8-byte events for each of
//! `JOURNAL_BENCH_N` ids (default 300,000, named like a core journal's
//! durable counters, `counter|<id>`) in two passes over 16 MiB segments,
//! durability `none`, then saves a snapshot of every id in a random order
//! and prints the percentiles of `save_snapshot`'s time (HdrHistogram, µs),
//! beside those of the appends measured in the same run as the reference.
//!
//! Each save checks whether the sealed segments holding its id became
//! obsolete (every id in them covered by a snapshot). That check resumes
//! where the last one stopped, so a segment's ids are each found covered
//! once over all saves.
//!
//! Run: `cargo bench -p shardline-journal --bench snapshot_pause`.

use std::time::Instant;

use hdrhistogram::Histogram;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use shardline_journal::{
    Durability, Journal, JournalOptions, PersistenceId, SequenceNr, WriterEpoch,
};

fn summary(name: &str, h: &Histogram<u64>) {
    println!(
        "{name:<14} count {:>8}  p50 {:>6} µs  p99 {:>6} µs  p99.9 {:>7} µs  max {:>8} µs",
        h.len(),
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
        h.max()
    );
}

fn main() {
    let n: usize = std::env::var("JOURNAL_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300_000);
    let dir = tempfile::tempdir().expect("tempdir");
    let options = JournalOptions {
        segment_size_bytes: 16 << 20,
        durability: Durability::None,
        ..JournalOptions::default()
    };
    let (mut j, _) = Journal::open(dir.path(), options).expect("open");
    let ids: Vec<PersistenceId> = (0..n)
        .map(|i| PersistenceId::new(&format!("counter|{i}")).expect("id"))
        .collect();
    let mut appends = Histogram::<u64>::new(3).expect("histogram");
    for seq in 1..=2 {
        for p in &ids {
            let t = Instant::now();
            j.append(p, SequenceNr(seq), WriterEpoch(0), &[7u8; 8])
                .expect("append");
            appends
                .record(t.elapsed().as_micros() as u64)
                .expect("an auto-resizing histogram records any value");
        }
    }
    let segments_before = j.segment_count();
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    let mut saves = Histogram::<u64>::new(3).expect("histogram");
    let started = Instant::now();
    for i in order {
        let t = Instant::now();
        j.save_snapshot(&ids[i], SequenceNr(2), WriterEpoch(0), b"state")
            .expect("snapshot");
        saves
            .record(t.elapsed().as_micros() as u64)
            .expect("an auto-resizing histogram records any value");
    }
    let total = started.elapsed();
    println!(
        "{n} ids, 2 events each, 16 MiB segments: {segments_before} segments before the saves, {} after; all saves {:.2} s",
        j.segment_count(),
        total.as_secs_f64()
    );
    summary("append", &appends);
    summary("save_snapshot", &saves);
    println!(
        "ratio save_snapshot / append: p99 {:.1}, max {:.1}",
        saves.value_at_quantile(0.99) as f64 / appends.value_at_quantile(0.99).max(1) as f64,
        saves.max() as f64 / appends.max().max(1) as f64
    );
    j.close().expect("close");
}
