//! The HTTP front against bad and unusual input, on one node with two data
//! cores: slow headers, oversized headers and bodies, invalid UTF-8, empty
//! and NUL ids, ids with `/` and `..`, pipelined garbage after a valid
//! request, a client that closes mid-body, chunked bodies. Each gets its
//! status code or a closed connection, and a keep-alive connection opened
//! before all of them keeps being served (asserted after every case).
//! Also: pipelined requests answered in order, the admin routes, metrics.

mod http_support;

use std::io::Write;
use std::time::{Duration, Instant};

use http_support::{post_bytes, start_nodes, wait_ready, Conn, Ports};

fn counter(c: &mut Conn, id_path: &str) -> i64 {
    let r = c.post(&format!("/v1/entities/counter/{id_path}"), b"get");
    assert_eq!(r.code, 200, "{}", r.text());
    r.text().parse().expect("counter value")
}

#[test]
fn bad_http_input_gets_its_status_or_a_close_and_other_connections_are_unaffected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 24_000 };
    let nodes = start_nodes(dir.path(), ports, 1, 2);
    let addr = nodes[0].http;
    wait_ready(addr, Duration::from_secs(20));

    // The bystander: one keep-alive connection used between all cases.
    let mut keep = Conn::open(addr);
    let mut probe_n = 0i64;
    let mut probe = |keep: &mut Conn, case: &str| {
        probe_n += 1;
        let r = keep.post("/v1/entities/counter/bystander", b"add 1");
        assert_eq!(r.code, 200, "bystander after {case}: {}", r.text());
        assert_eq!(r.text(), probe_n.to_string(), "bystander after {case}");
    };
    probe(&mut keep, "start");

    // Basic routes and the status mapping.
    let mut c = Conn::open(addr);
    let r = c.post("/v1/entities/echo/x", b"hello");
    assert_eq!((r.code, r.body.as_slice()), (200, &b"hello"[..]));
    let r = c.post("/v1/entities/nope/x", b"hello");
    assert_eq!(r.code, 404, "{}", r.text());
    assert!(r.text().contains("nope"));
    let r = c.get("/v1/entities/echo/x");
    assert_eq!((r.code, r.header("allow")), (405, Some("POST")));
    let r = c.get("/nothing/here");
    assert_eq!(r.code, 404);
    assert!(!r.body.is_empty());
    let r = c.post("/v1/entities/counter/m", b"mul 2");
    assert_eq!(r.code, 200);
    assert!(r.text().starts_with("error:"), "{}", r.text());
    for path in [
        "/health/live",
        "/health/ready",
        "/v1/cluster/members",
        "/v1/sharding/counter/stats",
        "/v1/sharding/counter/region",
        "/v1/sharding/shard-of/abc?shards=60",
    ] {
        let r = c.get(path);
        assert_eq!(r.code, 200, "{path}: {}", r.text());
    }
    // Cores publish their counters every 250 ms.
    std::thread::sleep(Duration::from_millis(600));
    let r = c.get("/metrics");
    assert_eq!(r.code, 200);
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/plain; version=0.0.4"));
    for name in [
        "shardline_requests_total",
        "shardline_request_duration_seconds_bucket",
        "shardline_buffered_messages",
        "shardline_dead_letters_total",
        "shardline_shards",
        "shardline_active_entities",
        "shardline_hand_offs_total",
        "shardline_journal_flush_duration_seconds",
        "shardline_connections",
        "shardline_ready 1",
    ] {
        assert!(r.text().contains(name), "metrics lack {name}");
    }
    probe(&mut keep, "routes");

    // Ids: invalid UTF-8, empty, NUL, too long -> 400; `/` only as %2F;
    // `..` is an ordinary id.
    let mut c = Conn::open(addr);
    for path in [
        "/v1/entities/counter/%FF",
        "/v1/entities/counter/%C3%28",
        "/v1/entities/counter/",
        "/v1/entities/counter/%00",
        "/v1/entities/counter/a%00b",
        "/v1/entities/counter/%zz",
    ] {
        let r = c.post(path, b"add 1");
        assert_eq!(r.code, 400, "{path}: {}", r.text());
        assert!(!r.body.is_empty(), "{path}: no reason given");
    }
    let long = format!("/v1/entities/counter/{}", "a".repeat(256));
    assert_eq!(c.post(&long, b"add 1").code, 400);
    let r = c.post("/v1/entities/counter/a%2Fb", b"add 5");
    assert_eq!((r.code, r.text()), (200, "5".to_string()));
    let r = c.post("/v1/entities/counter/a/b", b"add 1");
    assert_eq!(r.code, 404, "a literal / is a path separator");
    let r = c.post("/v1/entities/counter/..", b"add 3");
    assert_eq!((r.code, r.text()), (200, "3".to_string()));
    let r = c.post("/v1/entities/counter/%2E%2E", b"add 1");
    assert_eq!(
        (r.code, r.text()),
        (200, "4".to_string()),
        "%2E%2E is the id .."
    );
    assert_eq!(counter(&mut c, "a%2Fb"), 5);
    assert_eq!(counter(&mut c, "a"), 0, "a/b and a are different entities");
    // Raw bytes that are not UTF-8 in the request target.
    let mut raw = Conn::open(addr);
    raw.send(b"POST /v1/entities/counter/\xff\xfe HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    let r = raw.read_response().expect("a response");
    assert_eq!(r.code, 400);
    assert!(raw.closed_within(Duration::from_secs(5)));
    probe(&mut keep, "ids");

    // Oversized headers: 431 and close.
    let mut c = Conn::open(addr);
    let big = format!(
        "GET /health/live HTTP/1.1\r\nX-Big: {}\r\n\r\n",
        "a".repeat(16 * 1024)
    );
    let _ = c.s.write_all(big.as_bytes());
    let r = c.read_response().expect("431 response");
    assert_eq!(r.code, 431, "{}", r.text());
    assert_eq!(r.header("connection"), Some("close"));
    assert!(c.closed_within(Duration::from_secs(5)));
    probe(&mut keep, "oversized headers");

    // Oversized body: 413 as soon as the headers are read, and close.
    let mut c = Conn::open(addr);
    c.send(b"POST /v1/entities/echo/x HTTP/1.1\r\nContent-Length: 2097152\r\n\r\n");
    let r = c.read_response().expect("413 response");
    assert_eq!(r.code, 413, "{}", r.text());
    assert!(c.closed_within(Duration::from_secs(5)));
    // A body of exactly 1 MiB is accepted.
    let mut c = Conn::open(addr);
    let body = vec![b'z'; 1 << 20];
    let r = c.post("/v1/entities/echo/big", &body);
    assert_eq!(r.code, 200);
    assert_eq!(r.body.len(), 1 << 20);
    probe(&mut keep, "oversized body");

    // Chunked bodies are refused with 411.
    let mut c = Conn::open(addr);
    c.send(b"POST /v1/entities/echo/x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
    let r = c.read_response().expect("411 response");
    assert_eq!(r.code, 411);
    assert!(c.closed_within(Duration::from_secs(5)));
    probe(&mut keep, "chunked");

    // Pipelined garbage after a valid request: 200, then 400, then close.
    let mut c = Conn::open(addr);
    let mut bytes = post_bytes("/v1/entities/counter/pipe", b"add 2");
    bytes.extend_from_slice(b"\x16\x03\x01\x02\x00garbage that is not HTTP\r\n\r\n");
    c.send(&bytes);
    let r = c.read_response().expect("first response");
    assert_eq!((r.code, r.text()), (200, "2".to_string()));
    let r = c.read_response().expect("second response");
    assert_eq!(r.code, 400, "{}", r.text());
    assert!(c.closed_within(Duration::from_secs(5)));
    probe(&mut keep, "pipelined garbage");

    // Pipelining: 64 requests in one write, answered in order.
    let mut c = Conn::open(addr);
    let mut bytes = Vec::new();
    for i in 0..64 {
        bytes.extend(post_bytes(
            &format!("/v1/entities/echo/p{i}"),
            format!("m{i}").as_bytes(),
        ));
    }
    c.send(&bytes);
    for i in 0..64 {
        let r = c.read_response().expect("pipelined response");
        assert_eq!((r.code, r.text()), (200, format!("m{i}")));
    }
    probe(&mut keep, "pipelining");

    // A client that closes mid-body: the request is not delivered.
    {
        let mut c = Conn::open(addr);
        c.send(b"POST /v1/entities/counter/midbody HTTP/1.1\r\nContent-Length: 100\r\n\r\nadd 1");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(200));
    let mut c = Conn::open(addr);
    assert_eq!(
        counter(&mut c, "midbody"),
        0,
        "a partial body must not be delivered"
    );
    probe(&mut keep, "close mid-body");

    // HTTP/1.0 and Connection: close end the connection after the response.
    let mut c = Conn::open(addr);
    c.send(b"GET /health/live HTTP/1.0\r\n\r\n");
    assert_eq!(c.read_response().expect("1.0 response").code, 200);
    assert!(c.closed_within(Duration::from_secs(5)));
    let mut c = Conn::open(addr);
    c.send(
        b"GET /health/live HTTP/1.1\r\nConnection: close\r\n\r\nGET /health/live HTTP/1.1\r\n\r\n",
    );
    assert_eq!(c.read_response().expect("response").code, 200);
    assert!(
        c.closed_within(Duration::from_secs(5)),
        "nothing after Connection: close"
    );

    // Slow headers: 408 after the header deadline, and close; the bystander
    // is served meanwhile.
    let mut slow = Conn::open(addr);
    slow.send(b"GET /health/live HTTP/1.1\r\nHost: slo");
    let start = Instant::now();
    probe(&mut keep, "slow headers (during)");
    let r = slow.read_response().expect("408 response");
    assert_eq!(r.code, 408, "{}", r.text());
    assert!(
        start.elapsed() >= Duration::from_secs(3),
        "answered before the deadline"
    );
    assert!(slow.closed_within(Duration::from_secs(5)));
    probe(&mut keep, "slow headers");

    // The bystander's count equals its adds.
    assert_eq!(counter(&mut keep, "bystander"), probe_n);
}
