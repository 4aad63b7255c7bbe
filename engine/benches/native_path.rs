//! The native protocol's request path, measured: heap allocations per
//! request on the server side and latency, for a request to an entity on
//! the node the client talks to and for one forwarded to another node.
//!
//! Two embedded nodes in this process (A and B, one data core each,
//! durability `none`, built-in `echo` and `counter` types); one client
//! thread on a [`shardline::client::Client`] connection to A, one request
//! in flight (depth 1). Allocations are counted in every thread except the
//! client's (a counting global allocator around the system one), so the
//! figure is what the nodes (data cores, control threads, journals)
//! allocate per request. Latency is send-to-reply (HdrHistogram, ns).
//!
//! Rows:
//! - `reference loopback`: a thread echoing 32-byte messages over a
//!   loopback TCP connection (the round trip every row pays at least once);
//! - `echo`, `counter get`, `counter add`: an entity homed on A;
//! - `counter get, forwarded`: an entity homed on B (A forwards over its
//!   data lane and relays the reply): its p50 minus the local `counter
//!   get`'s is the hop's added latency, printed beside the loopback round
//!   trip.
//!
//! Run: `cargo bench -p shardline --bench native_path` (`NATIVE_BENCH_N`
//! requests per row, default 20000, after 2000 warm-up requests;
//! `NATIVE_BENCH_TRACE=K` also prints, per row, the engine's frames of
//! each allocation made during `K` more requests).
//! Targets (the data-path issue): 0 allocations per local `counter get`,
//! at most 2 per forwarded request.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardline::client::Client;
use shardline::envelope::Status;
use shardline::{Node, NodeConfig};

/// Counts allocations of every thread but those marked [`not_counted`].
struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static EXCLUDED: Cell<bool> = const { Cell::new(false) };
    /// Set while this thread records a backtrace (its own allocations are
    /// not traced).
    static IN_TRACE: Cell<bool> = const { Cell::new(false) };
}

/// While set, every counted allocation records its backtrace in [`TRACES`]
/// (`NATIVE_BENCH_TRACE`).
static TRACING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static TRACES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Marks this thread's allocations as not counted (the client's).
fn not_counted() {
    EXCLUDED.with(|e| e.set(true));
}

fn count() {
    if !EXCLUDED.try_with(Cell::get).unwrap_or(false) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        if TRACING.load(Ordering::Relaxed) {
            trace();
        }
    }
}

/// Records the calling allocation's backtrace (once per thread at a time).
fn trace() {
    if IN_TRACE.try_with(|t| t.replace(true)).unwrap_or(true) {
        return;
    }
    let bt = std::backtrace::Backtrace::force_capture().to_string();
    if let Ok(mut v) = TRACES.lock() {
        v.push(bt);
    }
    let _ = IN_TRACE.try_with(|t| t.set(false));
}

/// Prints the backtraces of the allocations made by `k` runs of `op`
/// (frames inside the allocator and the standard library's backtrace
/// machinery dropped, the engine's frames kept).
fn print_traces(name: &str, k: u64, mut op: impl FnMut(u64)) {
    TRACES.lock().expect("traces").clear();
    TRACING.store(true, Ordering::SeqCst);
    for i in 0..k {
        op(i);
    }
    TRACING.store(false, Ordering::SeqCst);
    let traces = std::mem::take(&mut *TRACES.lock().expect("traces"));
    println!("--- {name}: {} allocations in {k} requests", traces.len());
    if std::env::var_os("NATIVE_BENCH_TRACE_RAW").is_some() {
        for t in &traces {
            println!("{t}");
        }
    }
    for (i, t) in traces.iter().enumerate() {
        println!("  allocation {i}:");
        // The innermost source lines of the workspace (up to 6), below the
        // allocator's: a frame's `at FILE:LINE` line outside the standard
        // library, the registry's crates, libc and this bench.
        let mut frames: Vec<&str> = t
            .lines()
            .map(str::trim)
            .filter(|l| {
                l.starts_with("at ")
                    && !l.contains("/rustc/")
                    && !l.contains("/.cargo/")
                    && !l.contains("benches/")
                    && !l.contains("./nptl/")
                    && !l.contains("./misc/")
            })
            .collect();
        frames.dedup();
        frames.truncate(6);
        for f in frames {
            println!("    {f}");
        }
    }
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

struct Figures {
    name: String,
    hist: Histogram<u64>,
    allocs_per_op: f64,
}

/// Runs `op` `warmup + n` times, timing the last `n`.
fn measure(name: &str, n: u64, warmup: u64, mut op: impl FnMut(u64)) -> Figures {
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
        name: name.to_string(),
        hist,
        allocs_per_op: allocs as f64 / n as f64,
    }
}

fn config(dir: &std::path::Path, cluster: u16, client: u16, seed: u16) -> NodeConfig {
    let text = format!(
        r#"
cluster_address  = "127.0.0.1:{cluster}"
client_address   = "127.0.0.1:{client}"
seed_nodes       = ["127.0.0.1:{seed}"]
data_cores       = 1
pin_cores        = false
data_dir         = "{dir}"
number_of_shards = 100
durability       = "none"
[[entity_types]]
name = "echo"
kind = "echo"
idle_timeout_ms = 0
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
"#,
        dir = dir.display()
    );
    NodeConfig::from_toml(&text, std::path::Path::new("native_path.toml")).expect("config")
}

fn main() {
    not_counted();
    let n: u64 = std::env::var("NATIVE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    let warmup = 2_000;
    let t = Duration::from_secs(5);

    // Reference: a loopback TCP echo of 32-byte messages.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let echo = std::thread::spawn(move || {
        not_counted();
        let (mut s, _) = listener.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut buf = [0u8; 32];
        while s.read_exact(&mut buf).is_ok() {
            if s.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let mut buf = [7u8; 32];
    let loopback = measure("reference loopback", n, warmup, |_| {
        s.write_all(&buf).expect("write");
        s.read_exact(&mut buf).expect("read");
    });
    drop(s);
    let _ = echo.join();

    let root = tempfile::tempdir().expect("tmp");
    let (da, db) = (root.path().join("a"), root.path().join("b"));
    let a = Node::start(config(&da, 17160, 17260, 17160)).expect("start A");
    a.wait_ready(Duration::from_secs(30)).expect("A ready");
    let b = Node::start(config(&db, 17161, 17261, 17160)).expect("start B");
    b.wait_ready(Duration::from_secs(30)).expect("B ready");

    let mut c = Client::connect("127.0.0.1:17260".parse().expect("addr")).expect("connect");
    let ok = |c: &mut Client, ty: &str, id: &str, p: &[u8]| {
        let r = c.ask(ty, id, p, t).expect("ask");
        assert_eq!(r.status, Status::Ok, "{ty}/{id}: {:?}", r.payload);
    };
    // B joined after A was ready, so A placed every shard first (warm
    // allocation) and B gets its share by rebalance hand-offs: wait until
    // the counter shards are split evenly and the split held for 1 s, so
    // that no hand-off (nor the coordinator's rebalance rounds) falls into
    // the measured requests.
    let mut cb = Client::connect("127.0.0.1:17261".parse().expect("addr")).expect("connect B");
    let hosted = |c: &mut Client| -> usize {
        c.node_status(t)
            .expect("node status")
            .regions
            .iter()
            .filter(|r| r.type_name == "counter")
            .map(|r| r.shards.len())
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut held = 0;
    while held < 5 {
        let (on_a, on_b) = (hosted(&mut c), hosted(&mut cb));
        held = if on_a + on_b == 100 && on_a.abs_diff(on_b) <= 1 {
            held + 1
        } else {
            0
        };
        assert!(
            Instant::now() < deadline,
            "counter shards not balanced 60 s after B was ready: {on_a} on A, {on_b} on B"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Activate 200 counters through A, then ask B which it hosts.
    let ids: Vec<String> = (0..200).map(|i| format!("c{i}")).collect();
    for id in &ids {
        ok(&mut c, "counter", id, b"get");
    }
    let on_b: std::collections::BTreeSet<String> = cb
        .node_status(t)
        .expect("status of B")
        .regions
        .iter()
        .filter(|r| r.type_name == "counter")
        .flat_map(|r| r.shards.values().flatten().cloned())
        .collect();
    let local = ids
        .iter()
        .find(|i| !on_b.contains(*i))
        .expect("a counter on A");
    let remote = ids
        .iter()
        .find(|i| on_b.contains(*i))
        .expect("a counter on B");
    ok(&mut c, "echo", local, b"ping");

    let rows = [
        measure("echo", n, warmup, |_| ok(&mut c, "echo", local, b"ping")),
        measure("counter get", n, warmup, |_| {
            ok(&mut c, "counter", local, b"get")
        }),
        measure("counter add", n, warmup, |_| {
            ok(&mut c, "counter", local, b"add 1")
        }),
        measure("counter get, forwarded", n, warmup, |_| {
            ok(&mut c, "counter", remote, b"get")
        }),
    ];
    if let Some(k) = std::env::var("NATIVE_BENCH_TRACE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        print_traces("echo", k, |_| ok(&mut c, "echo", local, b"ping"));
        print_traces("counter get", k, |_| ok(&mut c, "counter", local, b"get"));
        print_traces("counter add", k, |_| ok(&mut c, "counter", local, b"add 1"));
        print_traces("counter get, forwarded", k, |_| {
            ok(&mut c, "counter", remote, b"get")
        });
    }
    drop(c);
    drop(cb);
    b.leave(Duration::from_secs(10));
    a.leave(Duration::from_secs(10));

    println!(
        "native path: {n} requests per row, {warmup} warm-up, one connection, depth 1; \
         allocations of the nodes' threads only"
    );
    println!(
        "{:<24} {:>9} {:>9} {:>9} {:>10} {:>13}",
        "row", "p50 ns", "p99 ns", "p99.9 ns", "max ns", "allocs/req"
    );
    for f in std::iter::once(&loopback).chain(rows.iter()) {
        println!(
            "{:<24} {:>9} {:>9} {:>9} {:>10} {:>13.2}",
            f.name,
            f.hist.value_at_quantile(0.5),
            f.hist.value_at_quantile(0.99),
            f.hist.value_at_quantile(0.999),
            f.hist.max(),
            f.allocs_per_op
        );
    }
    let p50 = |f: &Figures| f.hist.value_at_quantile(0.5) as i64;
    println!(
        "forward hop: +{} ns p50 over the local counter get; loopback round trip {} ns p50 \
         (ratio {:.2})",
        p50(&rows[3]) - p50(&rows[1]),
        p50(&loopback),
        (p50(&rows[3]) - p50(&rows[1])) as f64 / p50(&loopback).max(1) as f64
    );
    println!(
        "targets: counter get {:.2} allocs/req (goal 0), forwarded {:.2} (goal <= 2)",
        rows[1].allocs_per_op, rows[3].allocs_per_op
    );
}
