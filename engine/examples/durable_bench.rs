//! Durable counter throughput and latency of one data core, against the
//! raw journal under the same durability policy, in one run.
//!
//! ```text
//! cargo run --release -p shardline --example durable_bench -- \
//!     --durability always|interval1 --conns 8 --depth 32 --secs 5 --entities 10000
//! ```
//! Starts `shardline node` (built next to this example; one data core,
//! unpinned) with the policy, drives `add 1` to `--entities` counters over
//! `--conns` connections each keeping `--depth` requests in flight (send a
//! batch, flush, read the batch: latency per request = send to receive),
//! prints adds/s and HdrHistogram p50/p99/p999. Then appends the same
//! number of 8-byte events in batches of `conns * depth` to a bare journal
//! with the same policy, waiting for each batch to be durable, and prints
//! events/s and the batch latency percentiles (the raw baseline).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardline::client::{Client, Status};
use shardline_journal::{
    Durability, Journal, JournalOptions, PersistenceId, SequenceNr, WriterEpoch,
};

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn bin() -> PathBuf {
    let exe = std::env::current_exe().expect("exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("profile dir")
        .join("shardline")
}

/// Starts `shardline node` and waits for its ready line.
fn start_node(cfg: &Path) -> Proc {
    let mut child = Command::new(bin())
        .args(["node", "--config"])
        .arg(cfg)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn node");
    let out = child.stdout.take().expect("stdout");
    let node = Proc(child);
    let mut lines = BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("shardline: ready") => break,
            Some(Ok(_)) => {}
            _ => panic!("node exited before ready"),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    node
}

/// Sends `payload` to every entity `c-0..c-{n}` over one pipelined
/// connection (windows of 1,000); returns how many answered Ok.
fn sweep(addr: SocketAddr, n: usize, payload: &[u8]) -> usize {
    let client = Client::connect(addr).expect("connect");
    let (mut w, mut r) = client.into_split();
    let mut ok = 0;
    for start in (0..n).step_by(1000) {
        let end = (start + 1000).min(n);
        for i in start..end {
            w.send(i as u64, "counter", &format!("c-{i}"), payload)
                .expect("send");
        }
        w.flush().expect("flush");
        for _ in start..end {
            if r.recv().expect("recv").status == Status::Ok {
                ok += 1;
            }
        }
    }
    ok
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let durability = arg(&args, "--durability", "always");
    let conns: usize = arg(&args, "--conns", "8").parse().expect("conns");
    let depth: usize = arg(&args, "--depth", "32").parse().expect("depth");
    let secs: u64 = arg(&args, "--secs", "5").parse().expect("secs");
    let entities: usize = arg(&args, "--entities", "10000").parse().expect("entities");
    let port: u16 = arg(&args, "--port", "24500").parse().expect("port");
    let (toml_policy, policy) = match durability.as_str() {
        "always" => ("\"always\"".to_string(), Durability::Always),
        "interval1" => (
            "{ interval_ms = 1 }".to_string(),
            Durability::Interval(Duration::from_millis(1)),
        ),
        "none" => ("\"none\"".to_string(), Durability::None),
        other => panic!("unknown --durability {other}"),
    };
    let dir = tempfile::tempdir_in(".").expect("tmp");
    let cfg = dir.path().join("node.toml");
    std::fs::write(
        &cfg,
        format!(
            "cluster_address = \"127.0.0.1:{port}\"\nclient_address = \"127.0.0.1:{}\"\n\
             seed_nodes = [\"127.0.0.1:{port}\"]\ndata_cores = 1\npin_cores = false\n\
             data_dir = \"{}\"\nnumber_of_shards = 100\ndurability = {toml_policy}\n\
             [[entity_types]]\nname = \"counter\"\nkind = \"counter\"\nidle_timeout_ms = 0\n",
            port + 50,
            dir.path().join("node").display()
        ),
    )
    .expect("config");
    let node = start_node(&cfg);
    let addr: SocketAddr = format!("127.0.0.1:{}", port + 50).parse().expect("addr");

    let run = |secs: u64| -> (u64, Histogram<u64>) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        let handles: Vec<_> = (0..conns)
            .map(|c| {
                std::thread::spawn(move || {
                    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("h");
                    let client = Client::connect(addr).expect("connect");
                    let (mut w, mut r) = client.into_split();
                    let mut n = 0u64;
                    let mut k = c;
                    while Instant::now() < deadline {
                        let t0 = Instant::now();
                        for d in 0..depth {
                            let e = format!("c-{}", k % entities);
                            k += conns;
                            w.send(d as u64, "counter", &e, b"add 1").expect("send");
                        }
                        w.flush().expect("flush");
                        for _ in 0..depth {
                            let resp = r.recv().expect("recv");
                            assert_eq!(resp.status, Status::Ok, "add failed");
                            let us = t0.elapsed().as_micros() as u64;
                            h.record(us.max(1)).expect("record");
                            n += 1;
                        }
                    }
                    (n, h)
                })
            })
            .collect();
        let mut total = 0;
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("h");
        for t in handles {
            let (n, h) = t.join().expect("thread");
            total += n;
            hist.add(h).expect("add");
        }
        (total, hist)
    };
    // Activate every entity once (one event each), then warm up.
    let created = sweep(addr, entities, b"add 1");
    assert_eq!(created, entities, "every first add answered");
    let _ = run(1);
    let t0 = Instant::now();
    let (n, h) = run(secs);
    let el = t0.elapsed().as_secs_f64();
    println!(
        "durable counter ({durability}, 1 data core, {conns} conns x depth {depth}, {entities} entities): \
         {:.0} adds/s, latency p50 {} us, p99 {} us, p99.9 {} us",
        n as f64 / el,
        h.value_at_quantile(0.5),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999)
    );
    // Crash and recover: kill -9, restart, read every counter.
    drop(node);
    let t0 = Instant::now();
    let node = start_node(&cfg);
    let ready = t0.elapsed();
    let read = sweep(addr, entities, b"get");
    println!(
        "recovery after kill -9: ready in {:.2} s, all {entities} counters recovered and read in {:.2} s ({read} answered Ok)",
        ready.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    drop(node);

    // Raw baseline: the same number of events in batches of conns*depth.
    let jdir = dir.path().join("raw");
    let (mut j, _) = Journal::open(
        &jdir,
        JournalOptions {
            durability: policy,
            segment_size_bytes: 16 << 20,
            writer_epoch: WriterEpoch(1),
            ..JournalOptions::default()
        },
    )
    .expect("journal");
    let pids: Vec<PersistenceId> = (0..entities)
        .map(|i| PersistenceId::new(&format!("counter|c-{i}")).expect("pid"))
        .collect();
    let mut seqs = vec![0u64; entities];
    let batch = conns * depth;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("h");
    let t0 = Instant::now();
    let mut done = 0u64;
    let mut k = 0usize;
    while done < n {
        let b0 = Instant::now();
        let mut last = None;
        for _ in 0..batch {
            let i = k % entities;
            k += 1;
            seqs[i] += 1;
            last = Some(
                j.append(
                    &pids[i],
                    SequenceNr(seqs[i]),
                    WriterEpoch(1),
                    &1i64.to_le_bytes(),
                )
                .expect("append"),
            );
        }
        if let Some(l) = last {
            j.wait_durable(l).expect("durable");
        }
        hist.record((b0.elapsed().as_micros() as u64).max(1))
            .expect("record");
        done += batch as u64;
    }
    let el = t0.elapsed().as_secs_f64();
    println!(
        "raw journal ({durability}, batches of {batch} 8-byte events, wait durable per batch): \
         {:.0} events/s, batch latency p50 {} us, p99 {} us",
        done as f64 / el,
        hist.value_at_quantile(0.5),
        hist.value_at_quantile(0.99)
    );
}
