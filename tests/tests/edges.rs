//! Nothing dropped at the edges (multi-process, loopback): the field cases
//! of a request that the engine could not deliver. Each asserts that every
//! request got an answer and that a "not delivered" answer (503
//! `Unavailable`, `ShuttingDown`, `BufferFull`; 413 `TooLarge`) was in
//! fact not applied.
//!
//! - a request buffered past its ask deadline during a coordinator
//!   failover is answered 503 and never applied later (it used to be
//!   answered 504 and applied afterwards);
//!
//! The cases run one at a time (several node processes each).

mod http_support;

#[path = "node_cases/support.rs"]
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use http_support::{post_bytes, start_nodes_with, Conn, Ports};

/// Runs the cases of this file one at a time.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Pipelines one request per `(path, body)` on one connection and reads
/// every response (in order); `None` for requests whose connection closed
/// before their response.
fn pipeline(conn: &mut Conn, reqs: &[(String, Vec<u8>)]) -> Vec<Option<http_support::Resp>> {
    let mut bytes = Vec::new();
    for (p, b) in reqs {
        bytes.extend_from_slice(&post_bytes(p, b));
    }
    conn.send(&bytes);
    let mut out = Vec::new();
    for _ in reqs {
        out.push(conn.read_response());
    }
    out
}

/// The counter's value read through `addr` (HTTP), retried until the
/// cluster answers 200 or `timeout` passes.
fn read_counter(addr: std::net::SocketAddr, id: &str, timeout: Duration) -> i64 {
    let deadline = Instant::now() + timeout;
    loop {
        let mut c = Conn::open(addr);
        let r = c.post(&format!("/v1/entities/counter/{id}"), b"get");
        if r.code == 200 {
            return r.text().trim().parse().expect("counter value");
        }
        assert!(
            Instant::now() < deadline,
            "{id} not readable in {timeout:?}: {} {}",
            r.code,
            r.text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Reproduction 3 of the issue: during a coordinator failover, requests
/// for shards without a home wait in the region's buffer longer than the
/// ask timeout. Each is answered `503` (not delivered, with `Retry-After`)
/// at its deadline, counted as a `deadline_passed` dead letter, and never
/// applied once the new coordinator allocates the shards.
#[test]
fn requests_buffered_past_their_deadline_are_answered_503_and_never_applied() {
    let _one = serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 28_000 };
    // ask_timeout_ms 1500: far below the failover (detection 1.5 s +
    // stable_after 2 s + removal), so every request waits past it.
    let mut nodes = start_nodes_with(
        dir.path(),
        ports,
        3,
        1,
        "\n[requests]\nask_timeout_ms = 1500",
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = support::status(ports.client(1));
        let ok = st.as_ref().is_some_and(|s| {
            s.members.iter().filter(|m| m.status == "Up").count() == 3
                && s.coordinator.as_deref() == Some(&ports.cluster(0).to_string())
        });
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "no 3-member cluster: {st:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The coordinator's node dies before any shard was allocated.
    nodes[0].kill();
    let t0 = Instant::now();
    const N: usize = 60;
    let reqs: Vec<(String, Vec<u8>)> = (0..N)
        .map(|i| (format!("/v1/entities/counter/d-{i}"), b"add 1".to_vec()))
        .collect();
    let mut conn = Conn::open(nodes[1].http);
    let resps = pipeline(&mut conn, &reqs);
    let took = t0.elapsed();
    let mut codes: BTreeMap<u16, usize> = BTreeMap::new();
    let mut applied = Vec::new();
    for (i, r) in resps.iter().enumerate() {
        let r = r
            .as_ref()
            .unwrap_or_else(|| panic!("request {i} got no answer"));
        *codes.entry(r.code).or_default() += 1;
        match r.code {
            200 => applied.push(i),
            503 => {
                assert_eq!(r.header("retry-after"), Some("1"), "{}", r.text());
                assert!(r.text().contains("deadline"), "{}", r.text());
            }
            c => panic!("request {i}: unexpected {c} {}", r.text()),
        }
    }
    assert_eq!(
        codes.get(&503).copied().unwrap_or(0),
        N,
        "every request waited past its deadline: {codes:?}"
    );
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(5),
        "answered at the deadline, not before or much later: {took:?}"
    );
    let st = support::status(ports.client(1)).expect("status of node 1");
    let dl: u64 = st
        .regions
        .iter()
        .filter(|r| r.type_name == "counter")
        .map(|r| {
            r.dead_letter_reasons
                .get("deadline_passed")
                .copied()
                .unwrap_or(0)
        })
        .sum();
    assert_eq!(dl, N as u64, "dead letters by reason: {:?}", st.regions);
    // The survivors take over; none of the refused adds was applied.
    for i in 0..N {
        let v = read_counter(nodes[1].http, &format!("d-{i}"), Duration::from_secs(40));
        assert_eq!(v, i64::from(applied.contains(&i)), "counter d-{i}");
    }
}
