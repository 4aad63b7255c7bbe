//! `shardline-bench journal`: the journal's throughput and append-to-durable
//! latency under each durability policy, against a raw baseline measured
//! in the same run.
//!
//! ```text
//!  journal run:  appender ──append──► mmap'd segment      sync thread: fdatasync per policy
//!                   │ append time per LSN                    │ durable_lsn
//!                   ▼                                        ▼
//!                observer thread (waits on the DurabilityWatcher) → durable time per LSN
//!  raw run:      writer ──pwrite(record bytes)──► preallocated, zero-filled file
//!                flusher thread: fdatasync with the same cadence → durable time per offset
//! ```
//!
//! Per policy and record size it prints records/s, MB/s (MB = 10^6 bytes of
//! encoded records, headers included, the same bytes for both runs), the
//! ratio journal/raw, and HdrHistogram percentiles (p50, p99, p99.9, max)
//! of append-to-durable latency (under `none`: the append call itself,
//! since nothing is flushed). Under `always`, at most `--window` records
//! are in flight (appended, not yet durable): the writer waits for the
//! oldest, like that many entities each waiting for its own write. It also
//! times `msync` against `fdatasync` of one dirty 4 KiB page.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;
use shardline_journal::format::{self, RecordFields, RecordKind};
use shardline_journal::storage;
use shardline_journal::{
    Durability, DurabilityWatcher, Journal, JournalOptions, Lsn, PersistenceId, SequenceNr,
    WriterEpoch,
};

/// Arguments of `shardline-bench journal`.
#[derive(Debug, clap::Args)]
pub struct JournalArgs {
    /// Records to append per policy and size.
    #[arg(long, default_value_t = 1_000_000)]
    pub records: u64,
    /// Payload sizes in bytes, comma separated (try 64,256,4096).
    #[arg(long, value_delimiter = ',', default_value = "256")]
    pub size: Vec<usize>,
    /// Directory for the journal and raw files (default: a temporary
    /// directory, removed afterwards).
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Write every figure as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Policies to run, comma separated: none, interval, always.
    #[arg(long, value_delimiter = ',', default_value = "none,interval,always")]
    pub policies: Vec<String>,
    /// Flush interval of the `interval` policy, in microseconds.
    #[arg(long, default_value_t = 1000)]
    pub interval_us: u64,
    /// Under `always`: records in flight (appended, not yet durable).
    #[arg(long, default_value_t = 1024)]
    pub window: u64,
    /// Segment size of the journal, in bytes.
    #[arg(long, default_value_t = 64 << 20)]
    pub segment_size_bytes: u64,
    /// Preallocate without zero-filling (journal segments and the raw
    /// file alike): space stays as unwritten extents.
    #[arg(long)]
    pub no_zero_fill: bool,
    /// Open loop: offer this many records per second (journal and raw
    /// alike) and measure latency from each record's intended append time.
    /// Without it the appender runs flat out, and under `interval` the
    /// latency then measures the backlog of a producer faster than the disk.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Persistence ids the records go to, round-robin (count; at least
    /// 1). Many ids (a data core's hundreds of thousands of entities) make
    /// each segment's index large: its sort and encoding at every roll is
    /// then part of what the run measures.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    pub ids: u64,
}

/// Sleeps until record `i`'s intended time under an open-loop `rate`
/// (records/s) and returns that time (ns since `start`); without a rate,
/// returns now.
fn pace(start: Instant, rate: Option<f64>, i: u64) -> u64 {
    let now = start.elapsed().as_nanos() as u64;
    let Some(r) = rate else { return now };
    let intended = (i as f64 * 1e9 / r) as u64;
    if intended > now {
        std::thread::sleep(Duration::from_nanos(intended - now));
    }
    intended
}

/// Percentiles of one histogram, in nanoseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    /// Recorded values.
    pub count: u64,
    /// Median, ns.
    pub p50_ns: u64,
    /// 99th percentile, ns.
    pub p99_ns: u64,
    /// 99.9th percentile, ns.
    pub p999_ns: u64,
    /// Maximum, ns.
    pub max_ns: u64,
}

impl Percentiles {
    fn of(h: &Histogram<u64>) -> Self {
        Percentiles {
            count: h.len(),
            p50_ns: h.value_at_quantile(0.50),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
        }
    }

    fn line(&self) -> String {
        format!(
            "p50 {} p99 {} p99.9 {} max {}",
            us(self.p50_ns),
            us(self.p99_ns),
            us(self.p999_ns),
            us(self.max_ns)
        )
    }
}

fn us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.1} µs", ns as f64 / 1e3)
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("static histogram bounds are valid")
}

/// One policy × size result.
#[derive(Debug, Clone, Serialize)]
pub struct JournalResult {
    /// `none`, `interval` or `always`.
    pub policy: String,
    /// Payload size, bytes.
    pub size_bytes: usize,
    /// Encoded record size (header + persistence id + payload), bytes.
    pub record_bytes: u64,
    /// Records appended.
    pub records: u64,
    /// Journal: records per second (until the last record is durable; for
    /// `none`, until the last append returned).
    pub records_per_s: f64,
    /// Journal: MB/s of encoded records (MB = 10^6 bytes).
    pub mb_per_s: f64,
    /// Raw baseline: records per second.
    pub raw_records_per_s: f64,
    /// Raw baseline: MB/s of the same bytes.
    pub raw_mb_per_s: f64,
    /// `mb_per_s / raw_mb_per_s`.
    pub ratio_vs_raw: f64,
    /// Journal append-to-durable latency (`none`: append call latency).
    pub latency: Percentiles,
    /// Raw write-to-durable latency (`none`: write call latency).
    pub raw_latency: Percentiles,
    /// Journal: the append call itself, from the intended append time
    /// (with `--rate`) or from the call (without).
    pub append_call: Percentiles,
    /// Raw baseline: duration of each `fdatasync` call.
    pub raw_flush: Option<Percentiles>,
    /// Journal p99 over raw p99 latency.
    pub p99_ratio_vs_raw: f64,
    /// Journal p99 over raw p99 `fdatasync` duration.
    pub p99_ratio_vs_raw_flush: Option<f64>,
}

/// `msync` against `fdatasync` of one dirty 4 KiB page.
#[derive(Debug, Clone, Serialize)]
pub struct SyncComparison {
    /// `msync(MS_SYNC)` of the dirtied page.
    pub msync: Percentiles,
    /// `fdatasync` of the file.
    pub fdatasync: Percentiles,
}

#[derive(Debug, Serialize)]
struct JsonReport {
    records: u64,
    sizes_bytes: Vec<usize>,
    interval_us: u64,
    window: u64,
    segment_size_bytes: u64,
    zero_fill: bool,
    rate_per_s: Option<f64>,
    dir: String,
    git_revision: Option<String>,
    cpus: usize,
    results: Vec<JournalResult>,
    msync_vs_fdatasync: SyncComparison,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    None,
    Interval(Duration),
    Always,
}

impl Policy {
    fn name(self) -> &'static str {
        match self {
            Policy::None => "none",
            Policy::Interval(_) => "interval",
            Policy::Always => "always",
        }
    }
}

/// Runs the benchmark, printing as it goes.
///
/// # Errors
/// I/O errors on the bench directory, journal errors, JSON write errors.
pub fn run(args: &JournalArgs) -> Result<Vec<JournalResult>> {
    let tmp;
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            d.clone()
        }
        None => {
            tmp = tempfile::Builder::new()
                .prefix("shardline-journal-bench")
                .tempdir_in(
                    std::env::var_os("TMPDIR")
                        .map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from),
                )
                .or_else(|_| tempfile::tempdir())?;
            tmp.path().to_path_buf()
        }
    };
    let mut policies = Vec::new();
    for p in &args.policies {
        policies.push(match p.as_str() {
            "none" => Policy::None,
            "interval" => Policy::Interval(Duration::from_micros(args.interval_us.max(1))),
            "always" => Policy::Always,
            other => anyhow::bail!("unknown policy {other:?} (none, interval, always)"),
        });
    }
    if args.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        anyhow::bail!("--rate must be a positive number of records per second");
    }
    println!(
        "journal bench: {} records per run{}, payload sizes {:?} B, interval {} µs, always-window {}, segments {} MiB, zero-fill {}, dir {}",
        args.records,
        args.rate.map_or(String::new(), |r| format!(" offered at {r:.0} rec/s")),
        args.size,
        args.interval_us,
        args.window,
        args.segment_size_bytes >> 20,
        !args.no_zero_fill,
        dir.display()
    );
    let cmp = sync_comparison(&dir)?;
    println!(
        "msync vs fdatasync of one dirty 4 KiB page ({} each): msync {} | fdatasync {}",
        cmp.msync.count,
        cmp.msync.line(),
        cmp.fdatasync.line()
    );
    let mut results = Vec::new();
    for &size in &args.size {
        for &policy in &policies {
            let r = run_one(&dir, args, policy, size)?;
            println!(
                "{:<8} {:>5} B  journal {:>10.0} rec/s {:>8.1} MB/s | raw {:>10.0} rec/s {:>8.1} MB/s | ratio {:.2}x",
                r.policy, r.size_bytes, r.records_per_s, r.mb_per_s, r.raw_records_per_s, r.raw_mb_per_s, r.ratio_vs_raw
            );
            let what = if policy == Policy::None {
                "append call"
            } else {
                "append-to-durable"
            };
            println!("         {what:<18} journal: {}", r.latency.line());
            println!("         {what:<18} raw:     {}", r.raw_latency.line());
            if let Some(f) = &r.raw_flush {
                println!("         journal append:    {}", r.append_call.line());
                println!("         raw fdatasync:     {}", f.line());
                println!(
                    "         p99 journal/raw: {:.2}x (vs raw write-to-durable), {:.2}x (vs raw fdatasync)",
                    r.p99_ratio_vs_raw,
                    r.p99_ratio_vs_raw_flush.unwrap_or(0.0)
                );
            }
            results.push(r);
        }
    }
    if let Some(path) = &args.json {
        let report = JsonReport {
            records: args.records,
            sizes_bytes: args.size.clone(),
            interval_us: args.interval_us,
            window: args.window,
            segment_size_bytes: args.segment_size_bytes,
            zero_fill: !args.no_zero_fill,
            rate_per_s: args.rate,
            dir: dir.display().to_string(),
            git_revision: git_revision(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            results: results.clone(),
            msync_vs_fdatasync: cmp,
        };
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(results)
}

fn git_revision() -> Option<String> {
    let out = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `n` ids, `bench|` and a number zero-padded to one width (at least 2
/// digits), so that every record has the same size.
fn ids(n: u64) -> Vec<PersistenceId> {
    let width = n.saturating_sub(1).max(10).ilog10() as usize + 1;
    (0..n)
        .map(|i| PersistenceId::new(&format!("bench|{i:0width$}")).expect("valid id"))
        .collect()
}

fn payload(size: usize) -> Vec<u8> {
    (0..size).map(|i| (i * 31 + 7) as u8).collect()
}

/// Latency per record from append times and (durable LSN, time) events.
fn durable_latencies(append_ns: &[u64], first: u64, events: &[(u64, u64)]) -> Histogram<u64> {
    let mut h = histogram();
    let mut e = 0;
    for (i, &t) in append_ns.iter().enumerate() {
        let lsn = first + i as u64;
        while e < events.len() && events[e].0 < lsn {
            e += 1;
        }
        if let Some(&(_, done)) = events.get(e) {
            let _ = h.record(done.saturating_sub(t).max(1));
        }
    }
    h
}

fn run_one(dir: &Path, args: &JournalArgs, policy: Policy, size: usize) -> Result<JournalResult> {
    let n = args.records;
    let ids = ids(args.ids);
    let data = payload(size);
    let record_bytes = format::record_len_bytes(ids[0].as_bytes().len(), size);
    let (j_elapsed, j_hist, j_calls) = run_journal(dir, args, policy, &ids, &data)?;
    let (r_elapsed, r_hist, r_flush) = run_raw(dir, args, policy, &ids, &data)?;
    let bytes = (record_bytes * n) as f64;
    let mb_per_s = bytes / j_elapsed.as_secs_f64() / 1e6;
    let raw_mb_per_s = bytes / r_elapsed.as_secs_f64() / 1e6;
    let latency = Percentiles::of(&j_hist);
    let raw_latency = Percentiles::of(&r_hist);
    let raw_flush = r_flush.as_ref().map(Percentiles::of);
    Ok(JournalResult {
        policy: policy.name().to_string(),
        size_bytes: size,
        record_bytes,
        records: n,
        records_per_s: n as f64 / j_elapsed.as_secs_f64(),
        mb_per_s,
        raw_records_per_s: n as f64 / r_elapsed.as_secs_f64(),
        raw_mb_per_s,
        ratio_vs_raw: mb_per_s / raw_mb_per_s,
        p99_ratio_vs_raw: latency.p99_ns as f64 / raw_latency.p99_ns.max(1) as f64,
        p99_ratio_vs_raw_flush: raw_flush
            .as_ref()
            .map(|f| latency.p99_ns as f64 / f.p99_ns.max(1) as f64),
        latency,
        raw_latency,
        append_call: Percentiles::of(&j_calls),
        raw_flush,
    })
}

fn run_journal(
    dir: &Path,
    args: &JournalArgs,
    policy: Policy,
    ids: &[PersistenceId],
    data: &[u8],
) -> Result<(Duration, Histogram<u64>, Histogram<u64>)> {
    let jdir = dir.join(format!("journal-{}-{}", policy.name(), data.len()));
    let _ = std::fs::remove_dir_all(&jdir);
    let options = JournalOptions {
        segment_size_bytes: args.segment_size_bytes,
        durability: match policy {
            Policy::None => Durability::None,
            Policy::Interval(d) => Durability::Interval(d),
            Policy::Always => Durability::Always,
        },
        writer_epoch: WriterEpoch(1),
        zero_fill_segments: !args.no_zero_fill,
        ..JournalOptions::default()
    };
    let (mut j, _) = Journal::open(&jdir, options).context("opening the bench journal")?;
    let n = args.records as usize;
    let first = j.next_lsn().0;
    let mut append_ns = vec![0u64; n];
    let watcher = j.watcher();
    let start = Instant::now();
    // Durable times are taken on the journal's sync thread, right after its
    // flush (as the raw flusher takes them), through a chain of `on_durable`
    // callbacks: no observer thread whose wake-up delay would count.
    let events = Arc::new(Mutex::new(Vec::<(u64, u64)>::new()));
    if policy != Policy::None {
        observe_durable(watcher.clone(), Lsn(first), events.clone(), start);
    }
    let mut call_hist = histogram();
    let mut seqs = vec![0u64; ids.len()];
    let mut last = Lsn(0);
    for (i, slot) in append_ns.iter_mut().enumerate() {
        if policy == Policy::Always && i as u64 >= args.window {
            watcher
                .wait_durable(Lsn(first + i as u64 - args.window))
                .context("waiting for durability")?;
        }
        let k = i % ids.len();
        seqs[k] += 1;
        let t0 = pace(start, args.rate, i as u64);
        last = j
            .append(&ids[k], SequenceNr(seqs[k]), WriterEpoch(1), data)
            .context("append")?;
        let t1 = start.elapsed().as_nanos() as u64;
        *slot = t0;
        let _ = call_hist.record(t1.saturating_sub(t0).max(1));
    }
    let elapsed = if policy == Policy::None {
        start.elapsed()
    } else {
        watcher
            .wait_durable(last)
            .context("final durability wait")?;
        start.elapsed()
    };
    // Closing joins the sync thread: every callback has run.
    j.close().map_err(|e| anyhow::anyhow!("{e}"))?;
    let hist = if policy == Policy::None {
        call_hist.clone()
    } else {
        let events = events.lock().unwrap_or_else(|e| e.into_inner()).clone();
        durable_latencies(&append_ns, first, &events)
    };
    let _ = std::fs::remove_dir_all(&jdir);
    Ok((elapsed, hist, call_hist))
}

/// Records `(durable LSN, ns since start)` each time the journal publishes
/// a durable LSN at or past `next`, then waits for the one after it. The
/// callback runs on the sync thread (or here, when already durable); it
/// stops when the journal closes.
fn observe_durable(
    watcher: DurabilityWatcher,
    next: Lsn,
    events: Arc<Mutex<Vec<(u64, u64)>>>,
    start: Instant,
) {
    let w = watcher.clone();
    watcher.on_durable(next, move |r| {
        if r.is_ok() {
            let d = w.durable_lsn().0;
            events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((d, start.elapsed().as_nanos() as u64));
            observe_durable(w, Lsn(d + 1), events, start);
        }
    });
}

/// The raw flusher's output: (bytes durable, time ns) per flush, and the
/// histogram of `fdatasync` durations.
type FlushLog = (Vec<(u64, u64)>, Histogram<u64>);

struct RawShared {
    written_bytes: AtomicU64,
    synced: Mutex<u64>,
    cond: Condvar,
    stop: AtomicBool,
}

/// The raw baseline's flusher thread: `fdatasync` every `interval` (or,
/// with `None`, whenever the writer rings `bell_rx`) while bytes were written
/// since the last one; records each sync's latency and `(written bytes,
/// ns since start)` when it completed, and wakes writers waiting on
/// `shared.synced`. Returns once `shared.stop` is set and all is synced.
fn raw_flusher(
    file: &std::fs::File,
    shared: &RawShared,
    interval: Option<Duration>,
    bell_rx: &std::sync::mpsc::Receiver<()>,
    start: Instant,
) -> std::io::Result<FlushLog> {
    let mut events = Vec::new();
    let mut flush_hist = histogram();
    let mut synced = 0u64;
    let mut next_tick = Instant::now();
    loop {
        match interval {
            Some(d) => {
                next_tick += d;
                let now = Instant::now();
                if next_tick > now {
                    std::thread::sleep(next_tick - now);
                } else {
                    next_tick = now;
                }
            }
            None => {
                let _ = bell_rx.recv_timeout(Duration::from_millis(50));
            }
        }
        let w = shared.written_bytes.load(Ordering::SeqCst);
        if w > synced {
            let t0 = Instant::now();
            file.sync_data()?;
            let _ = flush_hist.record((t0.elapsed().as_nanos() as u64).max(1));
            events.push((w, start.elapsed().as_nanos() as u64));
            synced = w;
            *shared.synced.lock().unwrap_or_else(|e| e.into_inner()) = w;
            shared.cond.notify_all();
        } else if shared.stop.load(Ordering::SeqCst) {
            return Ok((events, flush_hist));
        }
    }
}

fn run_raw(
    dir: &Path,
    args: &JournalArgs,
    policy: Policy,
    ids: &[PersistenceId],
    data: &[u8],
) -> Result<(Duration, Histogram<u64>, Option<Histogram<u64>>)> {
    let path = dir.join(format!("raw-{}-{}.dat", policy.name(), data.len()));
    let n = args.records as usize;
    // The same encoded bytes the journal writes, record by record.
    let mut head = Vec::with_capacity(128);
    let record_len = format::record_len_bytes(ids[0].as_bytes().len(), data.len());
    let total = record_len * n as u64;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    // Prepared like the journal's segments: preallocated and zero-filled.
    storage::preallocate(&file, total)?;
    if !args.no_zero_fill {
        storage::zero_fill(&file, total)?;
    }
    let file = Arc::new(file);
    let shared = Arc::new(RawShared {
        written_bytes: AtomicU64::new(0),
        synced: Mutex::new(0),
        cond: Condvar::new(),
        stop: AtomicBool::new(false),
    });
    let (bell_tx, bell_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let start = Instant::now();
    let flusher = (policy != Policy::None).then(|| {
        let file = file.clone();
        let shared = shared.clone();
        std::thread::spawn(move || -> std::io::Result<FlushLog> {
            let interval = match policy {
                Policy::Interval(d) => Some(d),
                _ => None,
            };
            raw_flusher(&file, &shared, interval, &bell_rx, start)
        })
    });
    let mut append_ns = vec![0u64; n];
    let mut call_hist = histogram();
    let mut seqs = vec![0u64; ids.len()];
    let mut off = 0u64;
    for (i, slot) in append_ns.iter_mut().enumerate() {
        if policy == Policy::Always && i as u64 >= args.window {
            let need = (i as u64 - args.window + 1) * record_len;
            let mut g = shared.synced.lock().unwrap_or_else(|e| e.into_inner());
            while *g < need {
                g = shared.cond.wait(g).unwrap_or_else(|e| e.into_inner());
            }
        }
        let k = i % ids.len();
        seqs[k] += 1;
        let t0 = pace(start, args.rate, i as u64);
        let fields = RecordFields {
            lsn: Lsn(i as u64 + 1),
            sequence_nr: SequenceNr(seqs[k]),
            writer_epoch: WriterEpoch(1),
            timestamp_ms: 0,
            kind: RecordKind::Event,
            persistence_id: ids[k].as_bytes(),
        };
        format::encode_record_head(&fields, data, &mut head);
        file.write_all_at(&head, off)?;
        file.write_all_at(data, off + head.len() as u64)?;
        off += record_len;
        let t1 = start.elapsed().as_nanos() as u64;
        *slot = t0;
        shared.written_bytes.store(off, Ordering::SeqCst);
        if policy == Policy::Always {
            let _ = bell_tx.try_send(());
        } else if policy == Policy::None {
            let _ = call_hist.record((t1 - t0).max(1));
        }
    }
    let elapsed = if policy == Policy::None {
        start.elapsed()
    } else {
        let _ = bell_tx.try_send(());
        let mut g = shared.synced.lock().unwrap_or_else(|e| e.into_inner());
        while *g < off {
            g = shared.cond.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        start.elapsed()
    };
    shared.stop.store(true, Ordering::SeqCst);
    let result = match flusher {
        Some(f) => {
            let (events, flush_hist) = f
                .join()
                .map_err(|_| anyhow::anyhow!("flusher panicked"))??;
            // Events are in bytes; convert to record indexes (LSN = i + 1).
            let events: Vec<(u64, u64)> = events
                .into_iter()
                .map(|(bytes, t)| (bytes / record_len, t))
                .collect();
            (
                elapsed,
                durable_latencies(&append_ns, 1, &events),
                Some(flush_hist),
            )
        }
        None => (elapsed, call_hist, None),
    };
    drop(file);
    let _ = std::fs::remove_file(&path);
    Ok(result)
}

/// Times `msync(MS_SYNC)` of one dirtied 4 KiB page of a shared mapping
/// against `fdatasync` of the file after dirtying one page the same way.
fn sync_comparison(dir: &Path) -> Result<SyncComparison> {
    const PAGES: usize = 256;
    const ROUNDS: usize = 500;
    let path = dir.join("sync-compare.dat");
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)?;
    let len = (PAGES * 4096) as u64;
    storage::preallocate(&file, len)?;
    storage::zero_fill(&file, len)?;
    let map_len = len as usize;
    // SAFETY: maps `map_len` bytes of an open file we just sized; the
    // mapping is private to this function and unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mmap");
    }
    let base = map.cast::<u8>();
    let mut msync = histogram();
    let mut fsync = histogram();
    let mut outcome = Ok(());
    for round in 0..ROUNDS {
        let page = (round * 2) % PAGES;
        // SAFETY: the byte is inside the live mapping.
        unsafe { base.add(page * 4096).write_volatile(round as u8) };
        let t0 = Instant::now();
        // SAFETY: the range is inside the live mapping and page aligned.
        let rc = unsafe { libc::msync(base.add(page * 4096).cast(), 4096, libc::MS_SYNC) };
        if rc != 0 {
            outcome = Err(std::io::Error::last_os_error()).context("msync");
            break;
        }
        let _ = msync.record((t0.elapsed().as_nanos() as u64).max(1));
        let page = (round * 2 + 1) % PAGES;
        // SAFETY: as above.
        unsafe { base.add(page * 4096).write_volatile(round as u8) };
        let t0 = Instant::now();
        // SAFETY: plain syscall on an open descriptor.
        let rc = unsafe { libc::fdatasync(file.as_raw_fd()) };
        if rc != 0 {
            outcome = Err(std::io::Error::last_os_error()).context("fdatasync");
            break;
        }
        let _ = fsync.record((t0.elapsed().as_nanos() as u64).max(1));
    }
    // SAFETY: unmaps exactly the mapping created above; `base` is not used
    // afterwards.
    unsafe { libc::munmap(map, map_len) };
    drop(file);
    let _ = std::fs::remove_file(&path);
    outcome?;
    Ok(SyncComparison {
        msync: Percentiles::of(&msync),
        fdatasync: Percentiles::of(&fsync),
    })
}

/// Figures of [`raw_closed_loop`].
#[derive(Debug)]
pub struct RawLoop {
    /// Records written and made durable (count).
    pub records: u64,
    /// From the first write to the last record durable.
    pub elapsed: Duration,
    /// Write-to-durable latency per record (ns).
    pub latency_ns: Histogram<u64>,
}

impl RawLoop {
    /// Records per second.
    pub fn records_per_s(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Size of the file [`raw_closed_loop`] writes, in bytes (the node's
/// segment size: 16 MiB); it wraps around at the end.
pub const RAW_LOOP_FILE_BYTES: u64 = 16 << 20;

/// The raw baseline of a closed-loop client: `pwrite` of one encoded record
/// (persistence id `pid`, `payload`) at a time into a preallocated,
/// zero-filled file in `dir`, with at most `window` records written and not
/// yet durable (the writer waits for the oldest, like `window` clients each
/// waiting for its acknowledgement). A flusher thread calls `fdatasync` every
/// `interval` (`Some`, like `Durability::Interval`) or as soon as anything
/// is written (`None`, like `Durability::Always`: writes that arrive during
/// a flush share the next one). Runs for `duration`, then waits for the last
/// record to be durable. The file is removed afterwards.
///
/// # Errors
/// I/O errors on the file; `window` of 0.
pub fn raw_closed_loop(
    dir: &Path,
    interval: Option<Duration>,
    window: u64,
    pid: &PersistenceId,
    payload: &[u8],
    duration: Duration,
) -> Result<RawLoop> {
    anyhow::ensure!(window > 0, "the raw baseline needs a window of at least 1");
    let path = dir.join(format!("raw-loop-{}.dat", std::process::id()));
    let record_len = format::record_len_bytes(pid.as_bytes().len(), payload.len());
    let slots = (RAW_LOOP_FILE_BYTES / record_len).max(1);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    let outcome = (|| {
        storage::preallocate(&file, slots * record_len)?;
        storage::zero_fill(&file, slots * record_len)?;
        raw_loop_on(&file, interval, window, pid, payload, duration, slots)
    })();
    drop(file);
    let _ = std::fs::remove_file(&path);
    outcome
}

fn raw_loop_on(
    file: &File,
    interval: Option<Duration>,
    window: u64,
    pid: &PersistenceId,
    payload: &[u8],
    duration: Duration,
    slots: u64,
) -> Result<RawLoop> {
    let record_len = format::record_len_bytes(pid.as_bytes().len(), payload.len());
    // Counts of records, not bytes: the file wraps around.
    let shared = RawShared {
        written_bytes: AtomicU64::new(0),
        synced: Mutex::new(0),
        cond: Condvar::new(),
        stop: AtomicBool::new(false),
    };
    let (bell_tx, bell_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let start = Instant::now();
    let mut head = Vec::with_capacity(128);
    let mut append_ns: Vec<u64> = Vec::new();
    let sh = &shared;
    std::thread::scope(|s| -> Result<RawLoop> {
        let flusher = s.spawn(move || -> std::io::Result<FlushLog> {
            raw_flusher(file, sh, interval, &bell_rx, start)
        });
        let written = (|| -> Result<u64> {
            let mut i = 0u64;
            while start.elapsed() < duration {
                if i >= window {
                    let mut g = shared.synced.lock().unwrap_or_else(|e| e.into_inner());
                    while *g < i + 1 - window {
                        g = shared.cond.wait(g).unwrap_or_else(|e| e.into_inner());
                    }
                }
                let t0 = start.elapsed().as_nanos() as u64;
                let fields = RecordFields {
                    lsn: Lsn(i + 1),
                    sequence_nr: SequenceNr(i + 1),
                    writer_epoch: WriterEpoch(1),
                    timestamp_ms: 0,
                    kind: RecordKind::Event,
                    persistence_id: pid.as_bytes(),
                };
                format::encode_record_head(&fields, payload, &mut head);
                let off = (i % slots) * record_len;
                file.write_all_at(&head, off)?;
                file.write_all_at(payload, off + head.len() as u64)?;
                append_ns.push(t0);
                i += 1;
                shared.written_bytes.store(i, Ordering::SeqCst);
                if interval.is_none() {
                    let _ = bell_tx.try_send(());
                }
            }
            Ok(i)
        })();
        // Let the flusher finish whatever happened above.
        let n = written.as_ref().copied().unwrap_or(0);
        let _ = bell_tx.try_send(());
        {
            let mut g = shared.synced.lock().unwrap_or_else(|e| e.into_inner());
            while *g < n && !flusher.is_finished() {
                g = shared
                    .cond
                    .wait_timeout(g, Duration::from_millis(50))
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let elapsed = start.elapsed();
        shared.stop.store(true, Ordering::SeqCst);
        let (events, _flush_ns) = flusher
            .join()
            .map_err(|_| anyhow::anyhow!("flusher panicked"))??;
        let n = written?;
        Ok(RawLoop {
            records: n,
            elapsed,
            latency_ns: durable_latencies(&append_ns, 1, &events),
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid() -> PersistenceId {
        PersistenceId::new("counter|7").unwrap()
    }

    #[test]
    fn raw_closed_loop_times_every_record_it_wrote() {
        let dir = tempfile::tempdir().unwrap();
        for interval in [None, Some(Duration::from_millis(1))] {
            let r = raw_closed_loop(
                dir.path(),
                interval,
                4,
                &pid(),
                &1i64.to_le_bytes(),
                Duration::from_millis(150),
            )
            .unwrap();
            assert!(r.records > 0);
            // Every record became durable and got one latency.
            assert_eq!(r.latency_ns.len(), r.records, "{interval:?}");
            assert!(r.records_per_s() > 0.0);
        }
        // The file is removed afterwards.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(
            raw_closed_loop(dir.path(), None, 0, &pid(), b"x", Duration::from_millis(10)).is_err()
        );
    }

    #[test]
    fn durable_latencies_use_the_first_flush_covering_each_record() {
        // Records 1..=4 appended at 10, 20, 30, 40 ns; LSNs 1-2 durable at
        // 100, 3-4 at 200.
        let h = durable_latencies(&[10, 20, 30, 40], 1, &[(2, 100), (4, 200)]);
        assert_eq!(h.len(), 4);
        assert_eq!(h.min(), 80);
        assert_eq!(h.max(), 170);
    }
}
