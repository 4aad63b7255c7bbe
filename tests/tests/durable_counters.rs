//! Durable counters across crashes of `shardline node` processes:
//! kill -9 of a single-node cluster under load with `durability = "always"`,
//! restart, and every counter holds its acknowledged adds (nothing
//! acknowledged lost, nothing applied twice). Also prints the recovery
//! time of all entities (`SHARDLINE_DURABLE_ENTITIES`, default 300; the
//! note's figure uses 100,000 in a release build).

#[path = "node_cases/support.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use support::{shardline_bin, start_ready, NodeProc};

fn config(dir: &Path, port: u16, durability: &str, type_keys: &str) -> PathBuf {
    let text = format!(
        r#"cluster_address = "127.0.0.1:{port}"
client_address = "127.0.0.1:{}"
seed_nodes = ["127.0.0.1:{port}"]
data_cores = 2
pin_cores = false
data_dir = "{}"
number_of_shards = 60
durability = {durability}

[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0
{type_keys}
"#,
        port + 50,
        dir.join("node-0").display()
    );
    let p = dir.join("node-0.toml");
    std::fs::write(&p, text).expect("config");
    p
}

/// Starts the node and waits (bounded) for its ready line.
fn start(bin: &Path, cfg: &Path, log: &Path) -> NodeProc {
    start_ready(bin, cfg, log, "warn", Duration::from_secs(60))
}

/// Pipelined rounds of `payload` to every entity in `ids`; stops at the
/// first connection error. Returns per entity (sent, acknowledged values).
fn round(
    addr: SocketAddr,
    ids: &[String],
    payload: &str,
    window: usize,
) -> Result<Vec<(bool, Option<String>)>, String> {
    let c = Client::connect(addr).map_err(|e| e.to_string())?;
    let (mut w, mut r) = c.into_split();
    let mut out = vec![(false, None); ids.len()];
    for chunk_start in (0..ids.len()).step_by(window) {
        let end = (chunk_start + window).min(ids.len());
        for (i, id) in ids.iter().enumerate().take(end).skip(chunk_start) {
            w.send(i as u64, "counter", id, payload.as_bytes())
                .map_err(|e| e.to_string())?;
            out[i].0 = true;
        }
        w.flush().map_err(|e| e.to_string())?;
        for _ in chunk_start..end {
            let resp = r.recv().map_err(|e| e.to_string())?;
            let i = resp.request_id as usize;
            if resp.status == Status::Ok {
                out[i].1 = Some(String::from_utf8_lossy(&resp.payload).to_string());
            }
        }
    }
    Ok(out)
}

fn get_all(addr: SocketAddr, ids: &[String]) -> Vec<i64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match round(addr, ids, "get", 500) {
            Ok(v) if v.iter().all(|(_, r)| r.is_some()) => {
                return v
                    .into_iter()
                    .map(|(_, r)| r.unwrap_or_default().parse::<i64>().expect("number"))
                    .collect();
            }
            other => {
                let failed = other
                    .as_ref()
                    .map(|v| v.iter().filter(|(_, r)| r.is_none()).count());
                eprintln!("get round incomplete: {failed:?}");
                assert!(
                    Instant::now() < deadline,
                    "gets did not all succeed: {:?}",
                    other.err()
                );
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

#[test]
fn kill_9_under_load_with_always_then_every_counter_holds_its_acknowledged_adds() {
    let bin = shardline_bin();
    let dir = tempfile::tempdir().expect("tmp");
    let port = 24_100;
    let cfg = config(dir.path(), port, "\"always\"", "");
    let log = dir.path().join("node-0.log");
    let addr: SocketAddr = format!("127.0.0.1:{}", port + 50).parse().expect("addr");
    let n: usize = std::env::var("SHARDLINE_DURABLE_ENTITIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let ids: Vec<String> = (0..n).map(|i| format!("c-{i}")).collect();

    let mut node = start(&bin, &cfg, &log);
    // Some acknowledged rounds before the crash.
    let mut sent = vec![0i64; n];
    let mut acked = vec![0i64; n];
    for _ in 0..3 {
        let r = round(addr, &ids, "add 1", 500).expect("warm-up round");
        for (i, (s, a)) in r.into_iter().enumerate() {
            sent[i] += i64::from(s);
            let v = a.expect("warm-up add acknowledged");
            acked[i] += 1;
            assert_eq!(v.parse::<i64>().expect("value"), acked[i], "{}", ids[i]);
        }
    }
    // Load in a thread; kill -9 while it runs.
    let ids2 = ids.clone();
    let loader = std::thread::spawn(move || {
        let mut sent = vec![0i64; ids2.len()];
        let mut acked = vec![0i64; ids2.len()];
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let c = match Client::connect(addr) {
                Ok(c) => c,
                Err(_) => break,
            };
            let (mut w, mut r) = c.into_split();
            let mut i = 0usize;
            let mut ok = true;
            while ok && Instant::now() < deadline {
                let batch: Vec<usize> = (0..200).map(|k| (i + k) % ids2.len()).collect();
                i += 200;
                for (k, e) in batch.iter().enumerate() {
                    if w.send(k as u64, "counter", &ids2[*e], b"add 1").is_err() {
                        ok = false;
                    }
                    sent[*e] += 1;
                }
                if w.flush().is_err() {
                    ok = false;
                }
                for _ in 0..batch.len() {
                    match r.recv() {
                        Ok(resp) if resp.status == Status::Ok => {
                            acked[batch[resp.request_id as usize]] += 1
                        }
                        Ok(_) => {}
                        Err(_) => {
                            ok = false;
                            break;
                        }
                    }
                }
            }
            if !ok {
                break;
            }
        }
        (sent, acked)
    });
    std::thread::sleep(Duration::from_millis(1_500));
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(node.child.id() as i32, libc::SIGKILL);
    }
    let _ = node.child.wait();
    let (s2, a2) = loader.join().expect("loader");
    for i in 0..n {
        sent[i] += s2[i];
        acked[i] += a2[i];
    }
    let total_acked: i64 = a2.iter().sum();
    assert!(
        total_acked > 0,
        "the load acknowledged nothing before the kill"
    );
    drop(node);

    let t0 = Instant::now();
    let node = start(&bin, &cfg, &log);
    let ready = t0.elapsed();
    let values = get_all(addr, &ids);
    let recovered = t0.elapsed();
    let mut exact = 0usize;
    for i in 0..n {
        assert!(
            values[i] >= acked[i] && values[i] <= sent[i],
            "{}: value {} but {} acknowledged and {} sent",
            ids[i],
            values[i],
            acked[i],
            sent[i]
        );
        exact += usize::from(values[i] == acked[i]);
    }
    println!(
        "durable restart: {n} counters, {total_acked} adds acknowledged under load, \
         {exact} counters exactly equal to acknowledged (the rest had an add in flight at the kill); \
         ready after {:?}, all {n} recovered and read after {:?}",
        ready, recovered
    );
    drop(node);
}

#[test]
fn remembered_entities_start_again_without_a_message_after_a_crash() {
    let bin = shardline_bin();
    let dir = tempfile::tempdir().expect("tmp");
    let port = 24_200;
    let cfg = config(dir.path(), port, "\"always\"", "remember_entities = true");
    let log = dir.path().join("node-0.log");
    let addr: SocketAddr = format!("127.0.0.1:{}", port + 50).parse().expect("addr");
    let ids: Vec<String> = (0..120).map(|i| format!("r-{i}")).collect();
    let mut node = start(&bin, &cfg, &log);
    let r = round(addr, &ids, "add 2", 120).expect("adds");
    assert!(r.iter().all(|(_, v)| v.as_deref() == Some("2")), "{r:?}");
    // SAFETY: kill(2) on our own child.
    unsafe {
        libc::kill(node.child.id() as i32, libc::SIGKILL);
    }
    let _ = node.child.wait();
    drop(node);
    let node = start(&bin, &cfg, &log);
    // No message: the recovered coordinator allocates the shards of the
    // gone region again as soon as the new one registers, and each shard
    // restarts its remembered entities.
    let mut want = ids.clone();
    want.sort();
    // (The node may be too busy restarting them to answer a status request
    // at once: a missing answer is retried.)
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut live: Vec<String> = support::live_entities(addr, "counter").unwrap_or_default();
        live.sort();
        if live == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "live {} of {} remembered: {live:?}",
            live.len(),
            want.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Their values came back from the journal.
    let vals = round(addr, &want, "get", 100).expect("gets");
    assert!(
        vals.iter().all(|(_, v)| v.as_deref() == Some("2")),
        "{vals:?}"
    );
    drop(node);
}

/// Config of node `i` of a two-node cluster on `port`, `port + 1`.
fn config2(dir: &Path, port: u16, i: u16) -> PathBuf {
    let text = format!(
        r#"cluster_address = "127.0.0.1:{}"
client_address = "127.0.0.1:{}"
seed_nodes = ["127.0.0.1:{port}", "127.0.0.1:{}"]
data_cores = 1
pin_cores = false
data_dir = "{}"
number_of_shards = 60
durability = {{ interval_ms = 1 }}

[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0
"#,
        port + i,
        port + 50 + i,
        port + 1,
        dir.join(format!("node-{i}")).display()
    );
    let p = dir.join(format!("node-{i}.toml"));
    std::fs::write(&p, text).expect("config");
    p
}

#[test]
fn a_joining_node_takes_shards_and_durable_counters_keep_their_values() {
    let bin = shardline_bin();
    let dir = tempfile::tempdir().expect("tmp");
    let port = 24_300;
    let a_addr: SocketAddr = format!("127.0.0.1:{}", port + 50).parse().expect("addr");
    let b_addr: SocketAddr = format!("127.0.0.1:{}", port + 51).parse().expect("addr");
    let a = start(
        &bin,
        &config2(dir.path(), port, 0),
        &dir.path().join("a.log"),
    );
    let ids: Vec<String> = (0..200).map(|i| format!("m-{i}")).collect();
    for k in 1..=3 {
        let r = round(a_addr, &ids, "add 1", 200).expect("adds");
        assert!(
            r.iter().all(|(_, v)| v.as_deref() == Some(&k.to_string())),
            "round {k}"
        );
    }
    let b = start(
        &bin,
        &config2(dir.path(), port, 1),
        &dir.path().join("b.log"),
    );
    // Wait until the new node hosts some shards (the coordinator rebalances).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let hosted = Client::connect(b_addr)
            .and_then(|mut c| c.node_status(Duration::from_secs(5)))
            .map(|st| {
                st.regions
                    .iter()
                    .filter(|r| r.type_name == "counter" && !r.proxy)
                    .map(|r| r.shards.len())
                    .sum::<usize>()
            })
            .unwrap_or(0);
        if hosted > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no shard moved to the new node");
        // Keep traffic flowing so shards are (re)allocated.
        let _ = round(a_addr, &ids[..10], "get", 10);
        std::thread::sleep(Duration::from_millis(500));
    }
    let values = get_all(b_addr, &ids);
    assert!(values.iter().all(|v| *v == 3), "{values:?}");
    let values = get_all(a_addr, &ids);
    assert!(values.iter().all(|v| *v == 3), "{values:?}");
    drop(b);
    drop(a);
}
