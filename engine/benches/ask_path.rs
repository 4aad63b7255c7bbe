//! The embedding API's ask path, measured: an in-process ask to a local
//! entity from another thread (the caller is this thread, the entity runs
//! on the node's data core), against a bare cross-thread round trip
//! measured in the same run.
//!
//! Prints, per way of asking, p50 / p99 / p99.9 / max latency
//! (HdrHistogram, ns) and allocations per ask (every thread of the
//! process, so the data core's share is counted), and each p50 and p99 as
//! a ratio of the reference's.
//!
//! - `reference crossbeam`: a thread echoing requests from a bounded
//!   crossbeam channel, answered on a fresh `bounded(1)` channel per
//!   request (what the blocking ask did before the async API).
//! - `reference oneshot`: the same with a `tokio::sync::oneshot` reply,
//!   awaited with `shardline::api::block_on`.
//! - `ask (blocking)`: `EntityRef::ask`.
//! - `ask_async + block_on`: `EntityRef::ask_async`, awaited with an
//!   untimed park.
//! - `ask_async + wait`: the same future waited for with a timed park
//!   (`AskFuture::wait`, what the blocking ask does).
//! - `typed ask (postcard)`: `typed::EntityRef::ask` + `block_on`.
//!
//! Run: `cargo bench -p shardline --bench ask_path` (`ASK_BENCH_N` asks
//! per way, default 20000, after 2000 warm-up asks).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardline::api::block_on;
use shardline::typed::{self, Context, EntityTypeKey, Postcard, Protocol};
use shardline::{Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

/// Counts allocations of every thread.
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Replies with the message.
struct Echo;
impl Entity for Echo {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        ctx.reply(message);
        Ok(())
    }
}

struct Ping;
impl Protocol for Ping {
    type Command = u64;
    type Reply = u64;
    type Codec = Postcard;
}

struct TypedEcho;
impl typed::Entity for TypedEcho {
    type Protocol = Ping;
    fn handle(&mut self, _ctx: &mut Context<'_, '_, Ping>, n: u64) -> Result<u64, EntityError> {
        Ok(n)
    }
}

struct Figures {
    name: &'static str,
    hist: Histogram<u64>,
    allocs_per_op: f64,
}

/// Runs `op` `warmup + n` times, timing the last `n`.
fn measure(name: &'static str, n: u64, warmup: u64, mut op: impl FnMut(u64)) -> Figures {
    for i in 0..warmup {
        op(i);
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).expect("histogram");
    let a0 = ALLOCS.load(Ordering::Relaxed);
    for i in 0..n {
        let t0 = Instant::now();
        op(i);
        let ns = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        hist.saturating_record(ns.max(1));
    }
    let allocs = ALLOCS.load(Ordering::Relaxed) - a0;
    Figures {
        name,
        hist,
        allocs_per_op: allocs as f64 / n as f64,
    }
}

fn main() {
    let n: u64 = std::env::var("ASK_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let warmup = 2_000;
    let t = Duration::from_secs(5);
    let payload = b"ping".to_vec();

    // References: a bare echo thread.
    let (req_tx, req_rx) =
        crossbeam_channel::bounded::<(Vec<u8>, crossbeam_channel::Sender<Vec<u8>>)>(1024);
    let echo = std::thread::spawn(move || {
        while let Ok((m, reply)) = req_rx.recv() {
            let _ = reply.send(m);
        }
    });
    let crossbeam = measure("reference crossbeam", n, warmup, |_| {
        let (tx, rx) = crossbeam_channel::bounded(1);
        req_tx.send((payload.clone(), tx)).expect("send");
        rx.recv().expect("reply");
    });
    drop(req_tx);
    let _ = echo.join();
    let (req_tx, req_rx) =
        crossbeam_channel::bounded::<(Vec<u8>, tokio::sync::oneshot::Sender<Vec<u8>>)>(1024);
    let echo = std::thread::spawn(move || {
        while let Ok((m, reply)) = req_rx.recv() {
            let _ = reply.send(m);
        }
    });
    let oneshot = measure("reference oneshot", n, warmup, |_| {
        let (tx, rx) = tokio::sync::oneshot::channel();
        req_tx.send((payload.clone(), tx)).expect("send");
        block_on(rx).expect("reply");
    });
    drop(req_tx);
    let _ = echo.join();

    // The node: one data core, the entity local to it.
    let dir = tempfile::tempdir().expect("tmp");
    let config = NodeConfig::builder(
        "127.0.0.1:17150".parse().expect("addr"),
        "127.0.0.1:17250".parse().expect("addr"),
        dir.path(),
    )
    .seed_nodes(["127.0.0.1:17150".parse().expect("addr")])
    .pin_cores(false)
    .build()
    .expect("config");
    let node = Node::start(config).expect("start");
    node.sharding()
        .start(
            "echo",
            Arc::new(|_| Box::new(Echo)),
            EntitySettings::default(),
        )
        .expect("region");
    let key = EntityTypeKey::<Ping>::new("ping").expect("key");
    node.sharding()
        .start_typed(&key, |_| TypedEcho, EntitySettings::default())
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let r = node.entity_ref("echo", "e").expect("ref");
    let blocking = measure("ask (blocking)", n, warmup, |_| {
        r.ask(&payload, t).expect("ask");
    });
    let asynchronous = measure("ask_async + block_on", n, warmup, |_| {
        block_on(r.ask_async(payload.clone(), t).expect("sent")).expect("ask");
    });
    let timed = measure("ask_async + wait", n, warmup, |_| {
        r.ask_async(payload.clone(), t)
            .expect("sent")
            .wait(t)
            .expect("ask");
    });
    let tr = node.typed_ref(&key, "e").expect("ref");
    let typed_ask = measure("typed ask (postcard)", n, warmup, |i| {
        assert_eq!(block_on(tr.ask_within(i, t)).expect("ask"), i);
    });
    node.leave(Duration::from_secs(10));

    println!("ask path: {n} asks per way, {warmup} warm-up, one caller thread, 4-byte payload");
    println!(
        "{:<24} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>7} {:>7} {:>7}",
        "way",
        "p50 ns",
        "p99 ns",
        "p99.9 ns",
        "max ns",
        "allocs/ask",
        "p50 xc",
        "p99 xc",
        "p50 xo",
        "p99 xo"
    );
    let refp50 = crossbeam.hist.value_at_quantile(0.5) as f64;
    let refp99 = crossbeam.hist.value_at_quantile(0.99) as f64;
    let onep50 = oneshot.hist.value_at_quantile(0.5) as f64;
    let onep99 = oneshot.hist.value_at_quantile(0.99) as f64;
    for f in [
        &crossbeam,
        &oneshot,
        &blocking,
        &asynchronous,
        &timed,
        &typed_ask,
    ] {
        let p50 = f.hist.value_at_quantile(0.5);
        let p99 = f.hist.value_at_quantile(0.99);
        println!(
            "{:<24} {:>9} {:>9} {:>9} {:>9} {:>10.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2}",
            f.name,
            p50,
            p99,
            f.hist.value_at_quantile(0.999),
            f.hist.max(),
            f.allocs_per_op,
            p50 as f64 / refp50,
            p99 as f64 / refp99,
            p50 as f64 / onep50,
            p99 as f64 / onep99,
        );
    }
    println!("(xc: ratio to `reference crossbeam`, xo: to `reference oneshot`, of this run)");
}
