//! A node killed (SIGKILL) and started again at once on the same addresses
//! binds them and gets ready, 20 times in a row.
//!
//! A process that used io_uring keeps its listening sockets for a moment
//! after it was reaped (the kernel tears its rings down on a worker after
//! the exit, and a pending accept holds the listener until then), so the
//! new process can find its cluster, client and HTTP addresses in use. The
//! node retries such a bind for up to `shardline::BIND_RETRY_TIMEOUT`
//! (10 s); before it did, the restarted node exited at once with
//! `cannot bind cluster_address …: Address already in use`.
//!
//! Each round also adds 1 to a counter through the native port and reads
//! it back through the HTTP port of the new process: the counter (in the
//! same `data_dir`) keeps every add of the rounds before.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use shardline::{EntitySettings, Node, NodeError, BIND_RETRY_TIMEOUT};

use super::support::{config_text, serial, shardline_bin, spawn_node, Ports};

/// Restarts in a row.
const ROUNDS: u64 = 20;
/// Most time from spawning a restarted node to its ready line. A single
/// node is ready in about 0.3-1 s on a quiet machine; the bound leaves
/// room for a loaded one and for the bind retries.
const READY_BOUND: Duration = Duration::from_secs(20);

fn http_post(addr: SocketAddr, path: &str, body: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out
}

#[test]
fn a_node_killed_and_restarted_at_once_binds_its_addresses_and_serves() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 27_300 };
    let http = SocketAddr::from(([127, 0, 0, 1], 27_400));
    let extra = format!("http_address = \"{http}\"\n");
    let cfg = dir.path().join("node-0.toml");
    let log = dir.path().join("node-0.log");
    std::fs::write(&cfg, config_text(ports, 0, 1, 1, dir.path(), &extra)).expect("config");
    let bin = shardline_bin();
    let mut ready_ms = Vec::new();
    for round in 1..=ROUNDS {
        let t0 = Instant::now();
        let mut node = spawn_node(&bin, &cfg, &log, "info");
        if node.ready.recv_timeout(READY_BOUND).is_err() {
            let exit = node.child.try_wait().ok().flatten();
            panic!(
                "round {round}: not ready within {READY_BOUND:?} (exit: {exit:?}); log:\n{}",
                tail(&log)
            );
        }
        let ready = t0.elapsed().as_millis();
        let mut c = Client::connect(ports.client(0)).expect("connect native port");
        let r = c
            .ask("counter", "restarts", b"add 1", Duration::from_secs(10))
            .expect("add");
        assert_eq!(r.status, Status::Ok, "round {round}: add answered {r:?}");
        assert_eq!(
            r.payload,
            round.to_string().as_bytes(),
            "round {round}: the counter lost adds of earlier rounds"
        );
        let got = http_post(http, "/v1/entities/counter/restarts", "get");
        assert!(
            got.starts_with("HTTP/1.1 200") && got.ends_with(&round.to_string()),
            "round {round}: HTTP read answered {got:?}"
        );
        drop(c);
        ready_ms.push((ready, t0.elapsed().as_millis()));
        // Kill hard and reap; the next round spawns at once.
        node.signal(libc::SIGKILL);
        node.wait_exit(Duration::from_secs(10))
            .expect("killed node exits");
    }
    let retried = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .matches("address in use; retrying")
        .count();
    println!("(ready, served) after restart (ms): {ready_ms:?}; bind attempts retried: {retried}");
}

fn tail(log: &std::path::Path) -> String {
    let s = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(60)..].join("\n")
}

/// The embedding API: `Node::start` waits for an address that is in use
/// and binds it once it is free; one held for longer than
/// `BIND_RETRY_TIMEOUT` fails with `NodeError::Bind` (`AddrInUse`) naming
/// the address.
#[test]
fn an_address_in_use_is_retried_then_refused_after_the_bind_timeout() {
    let _one_at_a_time = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = super::embedded::config(27_450, &[27_450], dir.path());

    let held = std::net::TcpListener::bind(cfg.cluster_address).expect("hold cluster address");
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(800));
        drop(held);
    });
    let t0 = Instant::now();
    let node = Node::start(cfg.clone()).expect("start once the address is free");
    let waited = t0.elapsed();
    release.join().expect("release thread");
    assert!(
        waited >= Duration::from_millis(800),
        "started after {waited:?}, while the address was still held"
    );
    node.sharding()
        .start(
            "ticker",
            std::sync::Arc::new(|_| Box::<super::embedded::Ticker>::default()),
            EntitySettings::default(),
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let r = node.entity_ref("ticker", "t").expect("ref");
    assert_eq!(r.ask(b"count", Duration::from_secs(10)).expect("ask"), b"0");
    drop(node);

    // The stopped node's listeners outlive its executor threads for a
    // moment (the rings are torn down after them): wait for the address.
    let deadline = Instant::now() + Duration::from_secs(10);
    let held = loop {
        match std::net::TcpListener::bind(cfg.client_address) {
            Ok(l) => break l,
            Err(e) if Instant::now() < deadline => {
                assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("client address still held 10 s after the node stopped: {e}"),
        }
    };
    let t0 = Instant::now();
    match Node::start(cfg.clone()) {
        Err(NodeError::Bind { what, addr, source }) => {
            assert_eq!(what, "client_address");
            assert_eq!(addr, cfg.client_address);
            assert_eq!(source.kind(), std::io::ErrorKind::AddrInUse, "{source}");
        }
        Err(e) => panic!("expected a bind error, got {e}"),
        Ok(_) => panic!("started on a client address held by another socket"),
    }
    assert!(
        t0.elapsed() >= BIND_RETRY_TIMEOUT,
        "gave up after {:?}, before the retry timeout",
        t0.elapsed()
    );
    drop(held);
}
