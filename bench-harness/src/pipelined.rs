//! `shardline-bench pipelined`: closed-loop load in redis-benchmark's shape,
//! so that a node and redis can be compared under the same client.
//!
//! One thread runs one event loop (tokio's current-thread runtime: epoll)
//! over `--connections` connections. Each connection writes `--pipeline`
//! requests in one write, waits for their replies, and then writes the next
//! batch, as `redis-benchmark -c C -P P` does; every request's latency runs
//! from its batch's write, as redis-benchmark counts it (`ustime() -
//! c->start` per reply). Entities are drawn uniformly from `0..--entities`
//! per request, like `redis-benchmark -r N`'s `__rand_int__`.
//!
//! `shardline-bench run` differs in shape: a writer and a reader thread per
//! connection, a sliding window of requests in flight, and latency from each
//! request's intended send time. Its reader threads sleep in `recv` between
//! replies, so the node pays a thread wake-up on most replies, where
//! redis-benchmark's single event loop is woken once per batch of ready
//! sockets; the server CPU per request of the two clients is therefore not
//! comparable, and `bench-harness/scripts/native-vs-redis.sh` uses this one.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use shardline::client::encode_request;
use shardline::envelope::{
    access, next_frame, ServerFrame, Status, FRAME_HEADER_BYTES, MAX_FRAME_SIZE_BYTES,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::report::LatencySummary;
use crate::stats::latency_histogram;
use crate::units::{format_latency_us, parse_duration};
use crate::workload::OpKind;

/// Options of `shardline-bench pipelined`.
#[derive(Args, Clone, Debug, Serialize)]
pub struct PipelinedArgs {
    /// Client address of the node to drive (host:port).
    #[arg(long)]
    pub connect: SocketAddr,
    /// Request kind: echo, counter-add or counter-get.
    #[arg(long, value_parser = parse_op, default_value = "counter-add")]
    pub op: OpKind,
    /// Connections (like redis-benchmark -c).
    #[arg(long, default_value_t = 50)]
    pub connections: usize,
    /// Requests per batch on each connection (like redis-benchmark -P).
    #[arg(long, default_value_t = 1)]
    pub pipeline: usize,
    /// Entities drawn from uniformly (like redis-benchmark -r).
    #[arg(long, default_value_t = 10_000)]
    pub entities: u64,
    /// Measured time after the warm-up.
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub duration: Duration,
    /// Warm-up before the measured time (not in the figures).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub warmup: Duration,
    /// A batch not written, or without all its replies, this long after
    /// its write began fails the run.
    #[arg(long, value_parser = parse_duration, default_value = "5s")]
    pub request_timeout: Duration,
    /// Seed of the entity choices.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the figures as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

fn parse_op(text: &str) -> Result<OpKind, String> {
    match text {
        "echo" => Ok(OpKind::Echo),
        "counter-add" | "add" => Ok(OpKind::CounterAdd),
        "counter-get" | "get" => Ok(OpKind::CounterGet),
        other => Err(format!(
            "unknown op {other:?} (echo, counter-add or counter-get)"
        )),
    }
}

/// What `--json` writes.
#[derive(Debug, Serialize)]
pub struct PipelinedReport {
    /// The options.
    pub config: PipelinedArgs,
    /// Successes in the measured time (count).
    pub ok: u64,
    /// Error replies in the measured time (count).
    pub errors: u64,
    /// Measured time (s).
    pub measured_s: f64,
    /// Successes per second of measured time (requests/s).
    pub throughput_per_s: f64,
    /// Latency of successes from their batch's write (µs).
    pub latency: LatencySummary,
}

/// Counts and latencies of the measured time, shared by the connections
/// of the one event loop.
struct Tally {
    ok: u64,
    errors: u64,
    histogram: Histogram<u64>,
}

/// One connection's loop: write a batch, read its replies, until `end`.
async fn drive(
    args: Rc<PipelinedArgs>,
    index: usize,
    measure_from: Instant,
    end: Instant,
    tally: Rc<RefCell<Tally>>,
) -> Result<()> {
    let mut stream = tokio::net::TcpStream::connect(args.connect)
        .await
        .with_context(|| format!("connect {}", args.connect))?;
    stream.set_nodelay(true)?;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed.wrapping_add(index as u64));
    let (type_name, payload) = (args.op.type_name(), args.op.payload());
    let mut batch = Vec::with_capacity(args.pipeline * 64);
    let mut entity = String::with_capacity(20);
    let mut input = vec![0u8; 64 << 10];
    let (mut filled, mut next_id) = (0usize, 0u64);
    let mut body: Vec<u8> = Vec::with_capacity(128);
    loop {
        if Instant::now() >= end {
            return Ok(());
        }
        batch.clear();
        for _ in 0..args.pipeline {
            entity.clear();
            let _ = write!(entity, "{}", rng.gen_range(0..args.entities.max(1)));
            encode_request(&mut batch, next_id, type_name, &entity, payload)?;
            next_id += 1;
        }
        // The batch's time: after the encoding, as redis-benchmark's.
        let sent_at = Instant::now();
        let give_up = tokio::time::Instant::from_std(sent_at + args.request_timeout);
        tokio::time::timeout_at(give_up, stream.write_all(&batch))
            .await
            .with_context(|| {
                format!(
                    "connection {index}: batch not written within {:?}",
                    args.request_timeout
                )
            })??;
        let mut replies = 0;
        while replies < args.pipeline {
            // Every complete frame in the buffer first.
            let mut at = 0;
            while replies < args.pipeline {
                let Some(len) = next_frame(&input[at..filled], MAX_FRAME_SIZE_BYTES)
                    .with_context(|| format!("connection {index}: reply frame"))?
                else {
                    break;
                };
                let start = at + FRAME_HEADER_BYTES;
                // A copy, for the archive's alignment.
                body.clear();
                body.extend_from_slice(&input[start..start + len]);
                let reply = access::<ServerFrame>(&body)
                    .map_err(|e| anyhow::anyhow!("connection {index}: {e}"))?;
                at = start + len;
                replies += 1;
                if sent_at < measure_from {
                    continue;
                }
                let mut t = tally.borrow_mut();
                if Status::from_u8(reply.status) == Some(Status::Ok) {
                    t.ok += 1;
                    let us = sent_at.elapsed().as_micros() as u64;
                    t.histogram.saturating_record(us.max(1));
                } else {
                    t.errors += 1;
                }
            }
            input.copy_within(at..filled, 0);
            filled -= at;
            if replies == args.pipeline {
                break;
            }
            if filled == input.len() {
                let bigger = (input.len() * 2).min(MAX_FRAME_SIZE_BYTES + FRAME_HEADER_BYTES);
                if bigger == input.len() {
                    bail!("connection {index}: reply larger than the frame limit");
                }
                input.resize(bigger, 0);
            }
            let n = tokio::time::timeout_at(give_up, stream.read(&mut input[filled..]))
                .await
                .with_context(|| {
                    format!(
                        "connection {index}: the batch's replies not in within {:?}",
                        args.request_timeout
                    )
                })??;
            if n == 0 {
                bail!("connection {index}: closed by the node");
            }
            filled += n;
        }
    }
}

/// Runs the load and prints (and with `--json` writes) the figures.
///
/// # Errors
/// When a connection cannot be made, breaks, or a batch's replies do not
/// arrive within `--request-timeout`.
pub fn run(args: PipelinedArgs) -> Result<PipelinedReport> {
    if args.connections == 0 || args.pipeline == 0 {
        bail!("--connections and --pipeline must be at least 1");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let tally = Rc::new(RefCell::new(Tally {
        ok: 0,
        errors: 0,
        histogram: latency_histogram(3),
    }));
    let args = Rc::new(args);
    let start = Instant::now();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    let local = tokio::task::LocalSet::new();
    let results = local.block_on(&runtime, async {
        let tasks: Vec<_> = (0..args.connections)
            .map(|i| {
                tokio::task::spawn_local(drive(args.clone(), i, measure_from, end, tally.clone()))
            })
            .collect();
        let mut results = Vec::new();
        for t in tasks {
            results.push(t.await);
        }
        results
    });
    let measured_s = end
        .min(Instant::now())
        .saturating_duration_since(measure_from);
    for r in results {
        r.context("connection task")??;
    }
    let t = tally.borrow();
    let latency = LatencySummary::of(&t.histogram);
    let secs = measured_s.as_secs_f64().max(1e-9);
    let report = PipelinedReport {
        config: (*args).clone(),
        ok: t.ok,
        errors: t.errors,
        measured_s: secs,
        throughput_per_s: t.ok as f64 / secs,
        latency,
    };
    println!(
        "requests: {} ok, {} errors in {:.2} s ({} connections, batches of {})",
        report.ok, report.errors, secs, args.connections, args.pipeline
    );
    println!("throughput: {:.0} requests/s", report.throughput_per_s);
    let l = &report.latency;
    println!(
        "latency ({} samples, from each batch's write): p50 {}  p99 {}  p99.9 {}  max {}",
        l.count,
        format_latency_us(l.p50_us),
        format_latency_us(l.p99_us),
        format_latency_us(l.p99_9_us),
        format_latency_us(l.max_us)
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(report)
}
