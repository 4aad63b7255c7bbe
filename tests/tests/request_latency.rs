//! A request's latency in `shardline_request_duration_seconds` includes
//! its entity's handler, on both fronts: an embedded node hosts an entity
//! that takes 40 ms per message, one request goes through the native front
//! and one through HTTP, and `/metrics` must show at least 40 ms for each.
//! (The data plane takes a front's read time as its current time; a reply
//! measured to that time instead of its own would count about 0 µs.)

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use shardline::client::{Client, Status};
use shardline::{Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

const HANDLER: Duration = Duration::from_millis(40);

/// Replies `done` after [`HANDLER`].
struct Slow;

impl Entity for Slow {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, _message: &[u8]) -> Result<(), EntityError> {
        std::thread::sleep(HANDLER);
        ctx.reply(b"done".to_vec());
        Ok(())
    }
}

/// Sends one HTTP/1.1 request (`Connection: close`) and returns the whole
/// response as text.
fn http(addr: SocketAddr, head: &str, body: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let req = format!(
        "{head} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    s.write_all(body).expect("write body");
    let mut out = Vec::new();
    s.read_to_end(&mut out).expect("read");
    String::from_utf8(out).expect("utf-8")
}

/// The value of the sample `name{labels}` in a `/metrics` text.
fn sample(text: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    let line = text
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in\n{text}"));
    line[prefix.len()..].trim().parse().expect("number")
}

#[test]
fn a_requests_latency_includes_its_handler_on_both_fronts() {
    let dir = tempfile::tempdir().expect("tmp");
    let addr = |p: u16| -> SocketAddr { format!("127.0.0.1:{p}").parse().expect("addr") };
    let (cluster, client, web) = (addr(32_410), addr(32_411), addr(32_412));
    let config = NodeConfig::builder(cluster, client, dir.path().join("node"))
        .seed_nodes([cluster])
        .pin_cores(false)
        .number_of_shards(8)
        .http_address(web)
        .build()
        .expect("config");
    let node = Node::start(config).expect("start");
    node.sharding()
        .start(
            "slow",
            Arc::new(|_| Box::new(Slow)),
            EntitySettings::default(),
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");

    let mut c = Client::connect(client).expect("native connect");
    let r = c
        .ask("slow", "a", b"go", Duration::from_secs(10))
        .expect("native ask");
    assert_eq!((r.status, r.payload.as_slice()), (Status::Ok, &b"done"[..]));
    let r = http(web, "POST /v1/entities/slow/b", b"go");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(r.ends_with("done"), "{r}");

    // The fronts publish their counters on their executor's next tick.
    let wanted = HANDLER.as_secs_f64();
    let mut last = String::new();
    for _ in 0..50 {
        last = http(web, "GET /metrics", b"");
        let seen = |front: &str| {
            let labels = format!("front=\"{front}\",type=\"slow\"");
            let count_name = "shardline_request_duration_seconds_count";
            if !last.contains(&format!("{count_name}{{{labels}}} ")) {
                return None;
            }
            let count = sample(&last, count_name, &labels);
            let sum = sample(&last, "shardline_request_duration_seconds_sum", &labels);
            Some((count, sum))
        };
        if let (Some(native), Some(web)) = (seen("native"), seen("http")) {
            if native.0 >= 1.0 && web.0 >= 1.0 {
                assert_eq!(native.0, 1.0, "one native request");
                assert_eq!(web.0, 1.0, "one HTTP request");
                assert!(
                    native.1 >= wanted,
                    "native latency {} s < {wanted} s",
                    native.1
                );
                assert!(web.1 >= wanted, "HTTP latency {} s < {wanted} s", web.1);
                drop(node);
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("the requests never showed in /metrics:\n{last}");
}
