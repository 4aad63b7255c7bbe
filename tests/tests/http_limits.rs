//! The `[http]` config table in force on a running node (one data core):
//! a small `max_body_size_bytes` gives `413`, a short `header_timeout_ms`
//! and `body_timeout_ms` answer a slow client `408` and close it while
//! another connection keeps being served, `idle_timeout_ms` closes an idle
//! keep-alive connection, and `max_connections_per_core` refuses the
//! connections over it with `503`; on the native port,
//! `requests.max_native_connections_per_core` refuses a connection over it
//! with an `Unavailable` frame and a close, and both refusals are counted
//! in `/metrics`; a client of either front that stops reading its
//! responses is closed after `requests.send_timeout_ms`; a node whose open
//! file limit cannot hold its connection limits lowers them to fit, so a
//! flood of connections is refused by the limit instead of failing
//! `accept` with `EMFILE`. Every timeout configured here is far
//! below its default (5 s, 15 s, 60 s), so a close within the asserted
//! bound shows the configured value is used.

mod http_support;

use std::time::{Duration, Instant};

use http_support::{
    config_text, post_bytes, shardline_bin, spawn_node_under, start_nodes_with, wait_ready, Conn,
    Ports,
};

const HTTP_TABLE: &str = "max_body_size_bytes = 64
header_timeout_ms = 400
body_timeout_ms = 800
idle_timeout_ms = 2000
max_connections_per_core = 12
[requests]
max_native_connections_per_core = 3
send_timeout_ms = 500";

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
    probe(&mut keep, "http end");

    // requests.max_native_connections_per_core = 3: three native
    // connections are served; a fourth gets one frame (request id 0,
    // `Unavailable`, naming the key) and is closed, and the three keep
    // serving.
    let client = ports.client(0);
    let t = Duration::from_secs(10);
    let mut held: Vec<shardline::client::Client> = (0..3)
        .map(|i| {
            let mut c = shardline::client::Client::connect(client).expect("connect");
            let r = c
                .ask("echo", "n", format!("{i}").as_bytes(), t)
                .expect("ask");
            assert_eq!(r.status, shardline::client::Status::Ok, "connection {i}");
            c
        })
        .collect();
    let mut over = shardline::client::Client::connect(client).expect("connect");
    let r = over
        .ask("counter", "native-over", b"add 1", t)
        .expect("refusal frame");
    assert_eq!(
        (r.request_id, r.status),
        (0, shardline::client::Status::Unavailable),
        "{}",
        String::from_utf8_lossy(&r.payload)
    );
    assert!(
        String::from_utf8_lossy(&r.payload).contains("max_native_connections_per_core"),
        "{}",
        String::from_utf8_lossy(&r.payload)
    );
    assert!(over.ask("echo", "n", b"after", t).is_err(), "closed");
    // A refused client whose first request is 8 MiB still reads the frame
    // (the node discards up to a whole frame before it closes).
    let mut big = shardline::client::Client::connect(client).expect("connect");
    let r = big
        .ask("echo", "native-over", &vec![b'b'; 8 << 20], t)
        .expect("refusal frame after a large request");
    assert_eq!(
        (r.request_id, r.status),
        (0, shardline::client::Status::Unavailable)
    );
    for (i, c) in held.iter_mut().enumerate() {
        let r = c.ask("echo", "n", b"still", t).expect("ask");
        assert_eq!(
            r.status,
            shardline::client::Status::Ok,
            "held connection {i}"
        );
    }
    // Once one closes, a new connection is served; the refused request was
    // never delivered.
    held.pop();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = shardline::client::Client::connect(client).expect("connect");
        match c.ask("counter", "native-over", b"get", t) {
            Ok(r) if r.status == shardline::client::Status::Ok => {
                assert_eq!(r.payload, b"0", "the refused add was not applied");
                break;
            }
            _ => {}
        }
        assert!(
            Instant::now() < deadline,
            "no native connection served after one closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = keep.get("/metrics");
    assert_eq!(r.code, 200);
    let text = r.text();
    let refused = |front: &str| -> f64 {
        let prefix =
            format!("shardline_connections_refused_total{{front=\"{front}\",core=\"0\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} sample in:\n{text}"))
    };
    assert!(refused("native") >= 1.0);
    assert!(refused("http") >= 9.0);
    probe(&mut keep, "connection refusals");
    drop(held);
    // The gauges are published every 250 ms.
    std::thread::sleep(Duration::from_millis(800));

    // requests.send_timeout_ms = 500: a slow native reader that keeps
    // taking bytes (64 KiB every 100 ms: 3 MiB of answers, with a 64 KiB
    // receive buffer, so that the node's writes block; a blocked write
    // resumes once a third of the node's 2 MiB send buffer drained, about
    // 1 s at this pace) is not cut off.
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(64 << 10).expect("SO_RCVBUF");
    socket
        .connect_timeout(&client.into(), Duration::from_secs(5))
        .expect("connect");
    let (mut slow_w, mut slow_r) = shardline::client::Client::from_stream(socket.into())
        .expect("client")
        .into_split();
    let chunk = vec![b's'; 64 << 10];
    for i in 0..48 {
        slow_w.send(i + 1, "echo", "slow", &chunk).expect("send");
    }
    slow_w.flush().expect("flush");
    probe(&mut keep, "slow reader starts");
    for i in 0..48 {
        std::thread::sleep(Duration::from_millis(100));
        let r = slow_r
            .recv()
            .unwrap_or_else(|e| panic!("slow reader cut off after {i} answers: {e}"));
        assert_eq!(
            (r.request_id, r.status, r.payload.len()),
            (i + 1, shardline::client::Status::Ok, 64 << 10)
        );
        if i % 5 == 4 {
            // Within the bystander's idle timeout (2 s).
            probe(&mut keep, "slow reader");
        }
    }
    drop((slow_w, slow_r));

    // requests.send_timeout_ms = 500: a native client that pipelines
    // 24 MiB of echo requests and reads none of the answers, and an HTTP
    // client that pipelines 5,000 `/metrics` requests and reads none, are
    // closed once their output moved no byte for 0.5 s; the others are
    // served meanwhile.
    // A connection of its own per look: the writes below may take longer
    // than the bystander's idle timeout on a loaded machine.
    let open = |_: &mut Conn, front: &str| -> f64 {
        let text = Conn::open(addr).get("/metrics").text();
        let prefix = format!("shardline_connections{{front=\"{front}\",core=\"0\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} sample in:\n{text}"))
    };
    let native_before = open(&mut keep, "native");
    let http_before = open(&mut keep, "http");
    let mut bytes = Vec::new();
    let payload = vec![b'p'; 1 << 20];
    for i in 0..24 {
        shardline::client::encode_request(&mut bytes, i + 1, "echo", "stalled", &payload)
            .expect("encode");
    }
    let mut native = std::net::TcpStream::connect(client).expect("connect");
    native
        .set_write_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    std::io::Write::write_all(&mut native, &bytes).expect("the node reads 24 MiB");
    let mut http = Conn::open(addr);
    http.send(&b"GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n".repeat(5_000));
    let t0 = Instant::now();
    loop {
        let (n, h) = (open(&mut keep, "native"), open(&mut keep, "http"));
        if n <= native_before && h <= http_before {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "still open after {:?}: native {n} (before {native_before}), http {h} (before {http_before})",
            t0.elapsed()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Both were closed by the node: their reads end (after what was sent).
    native
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut sink = vec![0u8; 1 << 20];
    loop {
        match std::io::Read::read(&mut native, &mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) => panic!("the stalled native connection is still open: {e}"),
        }
    }
    assert!(http.closed_within(Duration::from_secs(10)));
    let log = std::fs::read_to_string(dir.path().join("node-0.log")).unwrap_or_default();
    assert_eq!(
        log.matches("client takes no responses (requests.send_timeout_ms)")
            .count(),
        2,
        "{log}"
    );
    // The bystander may have idled out (2 s) during the writes above.
    keep = Conn::open(addr);
    probe(&mut keep, "end");
}

/// A node run with an open file limit of 600 (soft and hard, as a service
/// manager may set it) and the default connection limits (10,000 native
/// and 10,000 HTTP connections per core) lowers them to fit and says so;
/// 700 native connections (more than the file limit) then get 172 served and the rest an
/// `Unavailable` frame, none an `accept` failure, and the node keeps
/// serving. The node logs in JSON (`--log-format json`): every line is
/// one object, and the lowering's event carries its figures as fields.
#[test]
fn connection_limits_are_lowered_to_the_open_file_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    // 25603, 25653, 25703: apart from the other test of this file (25600,
    // 25650, 25700), which runs at the same time.
    let ports = Ports { base: 25_603 };
    let cfg = dir.path().join("node-0.toml");
    std::fs::write(&cfg, config_text(ports, 0, 1, 1, dir.path())).expect("config");
    let log = dir.path().join("node-0.log");
    let mut node = spawn_node_under(
        &["prlimit", "--nofile=600:600", "--"],
        &shardline_bin(),
        &cfg,
        &log,
        "info",
        &["--log-format", "json"],
    );
    let ready = node.ready.recv_timeout(Duration::from_secs(30));
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(ready.is_ok(), "not ready:\n{text}");
    let events: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for e in &events {
        assert!(
            e["level"].is_string() && e["fields"]["message"].is_string(),
            "{e}"
        );
    }
    assert!(events
        .iter()
        .any(|e| e["fields"]["message"] == "node started"));
    // 600 less a reserve of 256: 344 descriptors for 20,000 connections.
    let lowered = events
        .iter()
        .find(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("lowered to fit"))
        })
        .unwrap_or_else(|| panic!("no lowering event:\n{text}"));
    assert_eq!(lowered["level"], "WARN");
    let f = &lowered["fields"];
    assert_eq!(
        (
            &f["open_files"],
            &f["max_native_connections_per_core"],
            &f["max_http_connections_per_core"]
        ),
        (&600.into(), &172.into(), &172.into()),
        "{lowered}"
    );
    let t = Duration::from_secs(10);
    let mut served = Vec::new();
    let mut refused = 0;
    // Refused connections are kept open too, as a flood's would be: the
    // node must not hold a descriptor for each of them meanwhile.
    let mut refused_conns = Vec::new();
    for i in 0..700 {
        let mut c = shardline::client::Client::connect(ports.client(0)).expect("connect");
        let r = c
            .ask("echo", "flood", b"x", t)
            .unwrap_or_else(|e| panic!("connection {i}: no answer: {e}"));
        match (r.request_id, r.status) {
            (0, shardline::client::Status::Unavailable) => {
                refused += 1;
                refused_conns.push(c);
            }
            (_, shardline::client::Status::Ok) => served.push(c),
            other => panic!("connection {i}: {other:?}"),
        }
    }
    assert_eq!((served.len(), refused), (172, 528));
    for (i, c) in served.iter_mut().enumerate() {
        let r = c.ask("counter", "flood", b"add 1", t).expect("ask");
        assert_eq!(r.status, shardline::client::Status::Ok, "connection {i}");
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!text.contains("accept failed"), "{text}");
    drop((served, refused_conns));
    let _ = node.child.kill();
    let _ = node.child.wait();
    // An error that ends the node is a JSON line too (a config that cannot
    // be read), with exit code 1.
    let out = std::process::Command::new(shardline_bin())
        .args(["node", "--log-format", "json", "--config"])
        .arg(dir.path().join("missing.toml"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert_eq!(lines[0]["level"], "ERROR");
    assert!(
        lines[0]["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("missing.toml")),
        "{stderr}"
    );
}
