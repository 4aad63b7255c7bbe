//! The `[http]` config table in force on a running node (one data core):
//! a small `max_body_size_bytes` gives `413`, a short `header_timeout_ms`
//! and `body_timeout_ms` answer a slow client `408` and close it while
//! another connection keeps being served, `idle_timeout_ms` closes an idle
//! keep-alive connection, and `max_connections_per_core` refuses the
//! connections over it with `503`. Every timeout configured here is far
//! below its default (5 s, 15 s, 60 s), so a close within the asserted
//! bound shows the configured value is used.

mod http_support;

use std::time::{Duration, Instant};

use http_support::{post_bytes, start_nodes_with, wait_ready, Conn, Ports};

const HTTP_TABLE: &str = "max_body_size_bytes = 64
header_timeout_ms = 400
body_timeout_ms = 800
idle_timeout_ms = 2000
max_connections_per_core = 12";

#[test]
fn configured_http_limits_and_timeouts_are_enforced() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 25_600 };
    let nodes = start_nodes_with(dir.path(), ports, 1, 1, HTTP_TABLE);
    let addr = nodes[0].http;
    wait_ready(addr, Duration::from_secs(20));

    let mut keep = Conn::open(addr);
    let mut n = 0i64;
    // The bystander is used well within the idle timeout.
    let mut probe = |keep: &mut Conn, case: &str| {
        n += 1;
        let r = keep.post("/v1/entities/counter/bystander", b"add 1");
        assert_eq!(r.code, 200, "bystander after {case}: {}", r.text());
        assert_eq!(r.text(), n.to_string(), "bystander after {case}");
    };
    probe(&mut keep, "start");

    // max_body_size_bytes = 64: exactly 64 is served, 65 is 413 (answered
    // from the headers alone, before the body is sent).
    let mut c = Conn::open(addr);
    let r = c.post("/v1/entities/echo/x", &[b'a'; 64]);
    assert_eq!((r.code, r.body.len()), (200, 64), "{}", r.text());
    let r = c.post("/v1/entities/echo/x", &[b'a'; 65]);
    assert_eq!(r.code, 413, "{}", r.text());
    assert!(r.text().contains("64"), "{}", r.text());
    assert!(c.closed_within(Duration::from_secs(5)));
    let mut c = Conn::open(addr);
    c.send(b"POST /v1/entities/echo/x HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n");
    let r = c.read_response().expect("413 before the body");
    assert_eq!(r.code, 413);
    probe(&mut keep, "413");

    // header_timeout_ms = 400: a client that never ends its headers gets
    // 408 and a close; the bystander is served meanwhile.
    let mut slow = Conn::open(addr);
    let t0 = Instant::now();
    slow.send(b"GET /health/live HTTP/1.1\r\nHost: t\r\n");
    probe(&mut keep, "slow headers started");
    std::thread::sleep(Duration::from_millis(100));
    slow.send(b"X-Slow: 1\r\n");
    probe(&mut keep, "slow headers going on");
    let r = slow.read_response().expect("408 for slow headers");
    assert_eq!(r.code, 408, "{}", r.text());
    assert!(slow.closed_within(Duration::from_secs(5)));
    let waited = t0.elapsed();
    assert!(
        waited < Duration::from_secs(4),
        "closed after {waited:?}; the default header timeout is 5 s"
    );
    probe(&mut keep, "slow headers");

    // body_timeout_ms = 800: a body that stops arriving.
    let mut slow = Conn::open(addr);
    let t0 = Instant::now();
    let mut req = post_bytes("/v1/entities/echo/x", b"0123456789");
    req.truncate(req.len() - 7);
    slow.send(&req);
    probe(&mut keep, "slow body started");
    let r = slow.read_response().expect("408 for a slow body");
    assert_eq!(r.code, 408, "{}", r.text());
    assert!(slow.closed_within(Duration::from_secs(5)));
    assert!(t0.elapsed() < Duration::from_secs(10), "default is 15 s");
    probe(&mut keep, "slow body");

    // idle_timeout_ms = 2000: an idle keep-alive connection is closed.
    let mut idle = Conn::open(addr);
    assert_eq!(idle.get("/health/live").code, 200);
    let t0 = Instant::now();
    assert!(idle.closed_within(Duration::from_secs(10)));
    assert!(t0.elapsed() < Duration::from_secs(10), "default is 60 s");
    let mut keep = Conn::open(addr);
    n = 0;
    let mut probe = |keep: &mut Conn, case: &str| {
        n += 1;
        let r = keep.post("/v1/entities/counter/bystander2", b"add 1");
        assert_eq!(r.code, 200, "bystander after {case}: {}", r.text());
        assert_eq!(r.text(), n.to_string(), "bystander after {case}");
    };
    probe(&mut keep, "idle");

    // max_connections_per_core = 12: with `keep` open, opening 20 more
    // connections gets some answered 503 (and closed); the others and the
    // bystander are served.
    let mut extra: Vec<Conn> = (0..20).map(|_| Conn::open(addr)).collect();
    let mut refused = 0;
    let mut served = 0;
    for c in &mut extra {
        c.send(b"GET /health/live HTTP/1.1\r\nHost: t\r\n\r\n");
    }
    for c in &mut extra {
        match c.read_response() {
            Some(r) if r.code == 503 => {
                assert!(r.text().contains("too many connections"), "{}", r.text());
                refused += 1;
            }
            Some(r) if r.code == 200 => served += 1,
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert!(refused >= 9, "refused {refused}, served {served}");
    assert!(served <= 11, "served {served} with a limit of 12");
    probe(&mut keep, "connection limit");
    drop(extra);
    // Once they are closed, new connections are served again.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = Conn::open(addr);
        c.send(b"GET /health/live HTTP/1.1\r\nHost: t\r\n\r\n");
        match c.read_response() {
            Some(r) if r.code == 200 => break,
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "no connection served after the burst"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    probe(&mut keep, "end");
}
