//! The journal's memory per persistence id, measured: appends one 8-byte
//! event for each of `JOURNAL_BENCH_N` ids (default 1,000,000, named like
//! a core journal's durable counters, `counter|<id>`), durability `none`,
//! and prints the live heap bytes per id after the appends less before
//! (counted by a wrapper around the system allocator, every thread). The
//! records themselves are in the memory-mapped segments, which the heap
//! figure does not count: what is left is the journal's index of the ids
//! (the catalog, the segment indexes, the shared ids).
//!
//! Three rows: 16 MiB segments (a core journal's size: about 250,000 such
//! events each, so the ids spread over several sealed segments and the
//! active one); one segment large enough for every event; and 4 MiB
//! segments with 16 events per id, appended round-robin (a sixteenth of
//! the ids, so the same number of events, and about one event per id in
//! each of 16 segments): a sealed segment keeps 8 bytes per id once its
//! index file is durable (it is read in place from then on), so this row
//! must stay near the first instead of growing with the segments. A
//! fourth row opens the first row's journal again after a close and counts
//! what the open left on the heap (a restarted node's journal), the
//! highest heap during the open and the time it took; then the time a
//! read-only view of it takes to open (what a data core opened for each
//! sibling journal whenever a shard came with a newer generation) and to
//! be brought up to date after 1,000 more appends (`JournalReader::refresh`,
//! what it does now). Beside
//! them, measured in the same run, a reference: the same ids as `String`
//! keys of a `std::collections::HashMap<String, u64>`.
//!
//! Run: `cargo bench -p shardline-journal --bench pid_memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Instant;

use shardline_journal::{
    Durability, Journal, JournalOptions, PersistenceId, SequenceNr, WriterEpoch,
};

/// The system allocator, counting live bytes.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);
/// The highest `LIVE` since it was last reset (see [`reset_peak`]).
static PEAK: AtomicI64 = AtomicI64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed) + layout.size() as i64;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grow = new_size as i64 - layout.size() as i64;
        let now = LIVE.fetch_add(grow, Ordering::Relaxed) + grow;
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

/// Starts a new peak from the live bytes now.
fn reset_peak() {
    PEAK.store(live(), Ordering::Relaxed);
}

/// Heap bytes per id of a journal holding `rounds` events of each of `n`
/// ids (appended round-robin), in segments of `segment_bytes`; and the
/// number of segments it ended with and the time the appends took.
fn journal_row(n: usize, rounds: u64, segment_bytes: u64) -> (f64, u64, f64) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let options = JournalOptions {
        segment_size_bytes: segment_bytes,
        durability: Durability::None,
        zero_fill_segments: false,
        ..JournalOptions::default()
    };
    let (mut journal, _) = Journal::open(dir.path(), options).expect("journal opens");
    let before = live();
    let start = Instant::now();
    let payload = 1u64.to_le_bytes();
    let mut pids: Vec<PersistenceId> = Vec::with_capacity(if rounds > 1 { n } else { 0 });
    for round in 1..=rounds {
        for i in 0..n {
            let pid = if round == 1 {
                PersistenceId::new(&format!("counter|{i}")).expect("a valid id")
            } else {
                pids[i].clone()
            };
            journal
                .append(&pid, SequenceNr(round), WriterEpoch(0), &payload)
                .expect("append");
            if rounds > 1 && round == 1 {
                pids.push(pid);
            }
        }
    }
    drop(pids);
    let secs = start.elapsed().as_secs_f64();
    // Let the sync and meta threads finish what the rolls sent them (the
    // index files), so that their buffers are not counted; then one more
    // append, with which the writer takes up the durable index files (as
    // any append does), and the meta thread frees the indexes they
    // replace.
    let last = journal.next_lsn();
    journal
        .wait_durable(shardline_journal::Lsn(last.0 - 1))
        .expect("durable");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let extra = PersistenceId::new("counter|extra").expect("a valid id");
    journal
        .append(&extra, SequenceNr(1), WriterEpoch(0), &payload)
        .expect("append");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let per_id = (live() - before) as f64 / n as f64;
    let segments = std::fs::read_dir(dir.path())
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"))
                .count() as u64
        })
        .unwrap_or(0);
    drop(journal);
    (per_id, segments, secs)
}

/// Heap bytes per id of a journal of `n` ids (one event each, 16 MiB
/// segments) opened again after a close: what a restarted node's journal
/// holds before any append; the highest heap per id during the open; and
/// how long the open took (s).
fn reopen_row(n: usize) -> (f64, f64, f64, f64, f64) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let options = JournalOptions {
        segment_size_bytes: 16 << 20,
        durability: Durability::None,
        zero_fill_segments: false,
        ..JournalOptions::default()
    };
    let (mut journal, _) = Journal::open(dir.path(), options.clone()).expect("journal opens");
    let payload = 1u64.to_le_bytes();
    for i in 0..n {
        let pid = PersistenceId::new(&format!("counter|{i}")).expect("a valid id");
        journal
            .append(&pid, SequenceNr(1), WriterEpoch(0), &payload)
            .expect("append");
    }
    journal.close().expect("close");
    let before = live();
    reset_peak();
    let began = Instant::now();
    let (journal, _) = Journal::open(dir.path(), options).expect("journal opens again");
    let secs = began.elapsed().as_secs_f64();
    let peak = (PEAK.load(Ordering::Relaxed) - before) as f64 / n as f64;
    std::thread::sleep(std::time::Duration::from_millis(500));
    let per_id = (live() - before) as f64 / n as f64;
    // A read-only view of it while it is open: what a data core opens for
    // each sibling journal when a shard of a type comes with a newer
    // generation (`CoreLog::refresh_foreign` in the engine).
    let began = Instant::now();
    let reader = shardline_journal::JournalReader::open(dir.path()).expect("reader opens");
    let reader_secs = began.elapsed().as_secs_f64();
    // Then brought up to date after 1,000 more appends, as the engine does
    // for the next shard that comes with a newer generation.
    let mut journal = journal;
    for i in 0..1_000 {
        let pid = PersistenceId::new(&format!("counter|{i}")).expect("a valid id");
        journal
            .append(&pid, SequenceNr(2), WriterEpoch(0), &payload)
            .expect("append");
    }
    let began = Instant::now();
    let reader = reader.refresh().expect("reader refreshes");
    let refresh_secs = began.elapsed().as_secs_f64();
    assert_eq!(
        reader.highest_sequence_nr(&PersistenceId::new("counter|999").expect("id")),
        SequenceNr(2)
    );
    drop(reader);
    drop(journal);
    (per_id, peak, secs, reader_secs, refresh_secs)
}

fn reference_row(n: usize) -> f64 {
    let before = live();
    let mut m: HashMap<String, u64> = HashMap::new();
    for i in 0..n {
        m.insert(format!("counter|{i}"), 1);
    }
    let per_id = (live() - before) as f64 / n as f64;
    std::hint::black_box(&m);
    per_id
}

fn main() {
    let n: usize = std::env::var("JOURNAL_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let reference = reference_row(n);
    println!("journal memory per persistence id, {n} ids, one 8-byte event each");
    println!(
        "{:<44} {:>12} {:>9} {:>9}",
        "row", "heap B/id", "ratio", "segments"
    );
    println!(
        "{:<44} {:>12.0} {:>9.2} {:>9}",
        "reference HashMap<String, u64>", reference, 1.0, "-"
    );
    let one = 64 * (n as u64 + 1024);
    for (label, ids, rounds, size) in [
        ("journal, 16 MiB segments", n, 1, 16u64 << 20),
        ("journal, one segment", n, 1, one.max(1 << 20)),
        (
            "journal, 4 MiB segments, 16 events per id",
            n / 16,
            16,
            4u64 << 20,
        ),
    ] {
        let (per_id, segments, secs) = journal_row(ids, rounds, size);
        println!(
            "{label:<44} {per_id:>12.0} {:>9.2} {segments:>9}   ({:.0} k appends/s)",
            per_id / reference,
            (ids as u64 * rounds) as f64 / secs / 1e3
        );
    }
    let (per_id, peak, secs, reader_secs, refresh_secs) = reopen_row(n);
    println!(
        "{:<44} {per_id:>12.0} {:>9.2} {:>9}   (open {:.2} s, heap peak {peak:.0} B/id)",
        "journal, 16 MiB segments, opened again",
        per_id / reference,
        "-",
        secs,
    );
    println!(
        "a read-only view of it: opened in {:.3} s; refreshed after 1,000 more appends in {:.4} s ({:.0}x less)",
        reader_secs,
        refresh_secs,
        reader_secs / refresh_secs
    );
}
