//! `GET /metrics` on a running node: the exposition parses by the
//! Prometheus text format (version 0.0.4) with a small strict parser
//! written here, and the counters move: requests and latency of the HTTP
//! and the native front, connections, journal `fdatasync` latency (with
//! `durability = "always"`), and shard hand-offs after a second node joins
//! and the coordinator rebalances (every 10 s).

mod http_support;

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use http_support::{config_text_with, shardline_bin, wait_ready, Conn, HttpNode, Ports};

/// One series: name and sorted labels.
type Key = (String, Vec<(String, String)>);

/// Parses the text exposition strictly: `# HELP` / `# TYPE` lines, samples
/// `name{label="value",...} value`, label values with `\\`, `\"`, `\n`
/// escapes; every sample's family has a `# TYPE` before it, no series
/// twice; histogram buckets have ascending `le` ending in `+Inf`,
/// cumulative counts, and the `+Inf` bucket equals `_count`.
fn parse(text: &str) -> HashMap<Key, f64> {
    let mut types: HashMap<String, String> = HashMap::new();
    let mut out: HashMap<Key, f64> = HashMap::new();
    let mut order: Vec<Key> = Vec::new();
    assert!(text.ends_with('\n'), "exposition ends with a line feed");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut parts = rest.splitn(3, ' ');
            let kind = parts.next().expect("comment kind");
            let name = parts.next().expect("metric name");
            assert!(valid_name(name), "bad name in {line:?}");
            if kind == "TYPE" {
                let t = parts.next().expect("type");
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                    "{line:?}"
                );
                assert!(
                    types.insert(name.to_string(), t.to_string()).is_none(),
                    "TYPE twice: {line:?}"
                );
            } else {
                assert_eq!(kind, "HELP", "{line:?}");
            }
            continue;
        }
        assert!(!line.is_empty() && !line.starts_with('#'), "{line:?}");
        let (name, labels, rest) = match line.find('{') {
            Some(b) => {
                let (labels, after) = parse_labels(&line[b + 1..]);
                (&line[..b], labels, after)
            }
            None => {
                let sp = line.find(' ').expect("value");
                (&line[..sp], Vec::new(), &line[sp..])
            }
        };
        assert!(valid_name(name), "bad name in {line:?}");
        let value = rest.strip_prefix(' ').expect("space before value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                name.strip_suffix(s)
                    .filter(|b| types.get(*b).is_some_and(|t| t == "histogram"))
            })
            .unwrap_or(name);
        let t = types
            .get(family)
            .unwrap_or_else(|| panic!("sample before its TYPE: {line:?}"));
        if t == "counter" {
            assert!(name.ends_with("_total"), "counter {name} without _total");
            assert!(value >= 0.0);
        }
        let mut labels = labels;
        labels.sort();
        let key = (name.to_string(), labels);
        assert!(
            out.insert(key.clone(), value).is_none(),
            "series twice: {line:?}"
        );
        order.push(key);
    }
    // Histogram structure.
    let mut buckets: BTreeMap<Key, Vec<(f64, f64)>> = BTreeMap::new();
    for (name, labels) in &order {
        if let Some(base) = name.strip_suffix("_bucket") {
            let le = labels
                .iter()
                .find(|(k, _)| k == "le")
                .map(|(_, v)| v.clone())
                .expect("bucket without le");
            let le: f64 = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().expect("le")
            };
            let rest: Vec<_> = labels.iter().filter(|(k, _)| k != "le").cloned().collect();
            let v = out[&(name.clone(), labels.clone())];
            buckets
                .entry((base.to_string(), rest))
                .or_default()
                .push((le, v));
        }
    }
    for ((base, labels), b) in &buckets {
        assert!(
            b.windows(2).all(|w| w[0].0 < w[1].0),
            "{base}: le not ascending"
        );
        assert!(
            b.windows(2).all(|w| w[0].1 <= w[1].1),
            "{base}: not cumulative"
        );
        let last = b.last().expect("buckets");
        assert!(last.0.is_infinite(), "{base}: no +Inf bucket");
        let count = out
            .get(&(format!("{base}_count"), labels.clone()))
            .unwrap_or_else(|| panic!("{base}: no _count"));
        assert_eq!(last.1, *count, "{base}: +Inf bucket != _count");
        assert!(out.contains_key(&(format!("{base}_sum"), labels.clone())));
    }
    out
}

fn valid_name(n: &str) -> bool {
    let mut c = n.chars();
    c.next()
        .is_some_and(|f| f.is_ascii_alphabetic() || f == '_' || f == ':')
        && c.all(|x| x.is_ascii_alphanumeric() || x == '_' || x == ':')
}

/// Parses `k="v",...}` and returns the labels and the text after `}`.
fn parse_labels(s: &str) -> (Vec<(String, String)>, &str) {
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        if let Some(after) = rest.strip_prefix('}') {
            return (labels, after);
        }
        let eq = rest.find("=\"").expect("label =\"");
        let k = &rest[..eq];
        assert!(
            valid_name(k) && !k.starts_with("__"),
            "bad label name {k:?}"
        );
        let mut v = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let end = loop {
            let (i, ch) = chars.next().expect("unterminated label value");
            match ch {
                '\\' => match chars.next().expect("escape").1 {
                    '\\' => v.push('\\'),
                    '"' => v.push('"'),
                    'n' => v.push('\n'),
                    e => panic!("bad escape \\{e}"),
                },
                '"' => break eq + 2 + i + 1,
                '\n' => panic!("raw line feed in a label value"),
                c => v.push(c),
            }
        };
        labels.push((k.to_string(), v));
        rest = &rest[end..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

fn get(m: &HashMap<Key, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    l.sort();
    m.get(&(name.to_string(), l)).copied().unwrap_or(0.0)
}

fn scrape(c: &mut Conn) -> HashMap<Key, f64> {
    let r = c.get("/metrics");
    assert_eq!(r.code, 200);
    assert!(r
        .header("content-type")
        .unwrap_or("")
        .starts_with("text/plain; version=0.0.4"));
    parse(&r.text())
}

fn start(dir: &Path, ports: Ports, i: usize, n: usize) -> HttpNode {
    let text = config_text_with(ports, i, n, 1, dir, "")
        .replace("durability = \"none\"", "durability = \"always\"");
    assert!(text.contains("\"always\""));
    let cfg = dir.join(format!("node-{i}.toml"));
    std::fs::write(&cfg, text).expect("config");
    let log = dir.join(format!("node-{i}.log"));
    let node = http_support::spawn_node(&shardline_bin(), &cfg, &log, "info");
    if node.ready.recv_timeout(Duration::from_secs(30)).is_err() {
        panic!(
            "node {i} not ready:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }
    HttpNode {
        node,
        http: ports.http(i),
    }
}

#[test]
fn metrics_parse_and_counters_move() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 25_620 };
    // Node 0 forms its cluster alone (its only seed is itself).
    let n0 = start(dir.path(), ports, 0, 1);
    wait_ready(n0.http, Duration::from_secs(20));
    let mut c = Conn::open(n0.http);
    // Cores publish their counters every 250 ms.
    std::thread::sleep(Duration::from_millis(600));
    let before = scrape(&mut c);
    assert_eq!(get(&before, "shardline_ready", &[]), 1.0);

    const N: u32 = 30;
    for i in 0..N {
        let r = c.post(&format!("/v1/entities/counter/h{i}"), b"add 1");
        assert_eq!(r.code, 200, "{}", r.text());
    }
    let mut native = shardline::client::Client::connect(ports.client(0)).expect("native");
    for i in 0..N {
        let r = native
            .ask(
                "counter",
                &format!("n{i}"),
                b"add 2",
                Duration::from_secs(10),
            )
            .expect("native ask");
        assert_eq!(r.payload, b"2");
    }
    let r = native
        .ask("nope", "x", b"", Duration::from_secs(10))
        .expect("native ask");
    assert_ne!(r.payload, b"");
    std::thread::sleep(Duration::from_millis(600));
    let after = scrape(&mut c);

    let delta = |name: &str, labels: &[(&str, &str)]| {
        get(&after, name, labels) - get(&before, name, labels)
    };
    let n = f64::from(N);
    let ok = [("front", "http"), ("type", "counter"), ("code", "200")];
    assert_eq!(delta("shardline_requests_total", &ok), n);
    let ok = [("front", "native"), ("type", "counter"), ("code", "200")];
    assert_eq!(delta("shardline_requests_total", &ok), n);
    let unknown = [("front", "native"), ("type", "_unknown"), ("code", "404")];
    assert_eq!(delta("shardline_requests_total", &unknown), 1.0);
    for front in ["http", "native"] {
        let l = [("front", front), ("type", "counter")];
        assert_eq!(delta("shardline_request_duration_seconds_count", &l), n);
        assert!(delta("shardline_request_duration_seconds_sum", &l) > 0.0);
        let conn = [("front", front), ("core", "0")];
        assert!(
            get(&after, "shardline_connections", &conn) >= 1.0,
            "{front}"
        );
        assert!(get(&after, "shardline_connections_accepted_total", &conn) >= 1.0);
    }
    // Durable counters: every add is an fdatasync (group commit).
    let j = [("core", "0")];
    let flushes = delta("shardline_journal_flush_duration_seconds_count", &j);
    assert!(flushes >= 1.0, "journal flushes: {flushes}");
    assert_eq!(
        get(
            &after,
            "shardline_active_entities",
            &[("type", "counter"), ("core", "0")]
        ),
        2.0 * n
    );
    let begun = [("type", "counter"), ("core", "0"), ("phase", "begun")];
    let completed = [("type", "counter"), ("core", "0"), ("phase", "completed")];
    assert_eq!(get(&after, "shardline_hand_offs_total", &completed), 0.0);

    // A second node joins; the coordinator (on node 0) moves shards to it
    // in its next rebalance rounds: node 0's hand-off counters move.
    let n1 = start(dir.path(), ports, 1, 2);
    wait_ready(n1.http, Duration::from_secs(20));
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let m = scrape(&mut c);
        let done = get(&m, "shardline_hand_offs_total", &completed);
        if done >= 1.0 {
            assert!(get(&m, "shardline_hand_offs_total", &begun) >= done);
            break;
        }
        assert!(Instant::now() < deadline, "no hand-off within 40 s");
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(n1);
}
