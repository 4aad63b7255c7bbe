//! HAProxy in front of three nodes, with the shipped `configs/haproxy.cfg`
//! (ports rewritten for the test): 10,000 counter adds through HAProxy by
//! four clients; halfway, one node is SIGKILLed; HAProxy's health check on
//! `/health/ready` takes it out; the adds keep succeeding (a client retries
//! a `503`, HAProxy retries refused connections on another node), and at
//! the end every counter equals the number of acknowledged adds.
//!
//! The counters are chosen among entities whose shards live on the two
//! surviving nodes (counters are not persistent: an entity on the killed
//! node would restart from zero elsewhere). The kill happens while the
//! clients are paused between requests, so no add is in flight on the
//! killed node (its outcome would be unknown).
//!
//! Needs Debian's `haproxy` (installed by `.ci/run`); the test fails when
//! it is missing.

mod http_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use http_support::{start_nodes, wait_ready, Conn, Ports};
use shardline::client::Client;

const TOTAL_ADDS: usize = 10_000;
const CLIENTS: usize = 4;
const COUNTERS_PER_CLIENT: usize = 5;

fn haproxy_bin() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d: PathBuf| d.join("haproxy"));
    for c in candidates {
        if c.is_file() {
            return c;
        }
    }
    panic!("haproxy is not installed: this test needs Debian's `haproxy` (apt-get install haproxy; .ci/run installs it)");
}

struct HaProxy(Child);

impl Drop for HaProxy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The shipped config with this test's ports.
fn haproxy_config(ports: Ports, front: SocketAddr, stats: SocketAddr) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/haproxy.cfg");
    let text = std::fs::read_to_string(&path).expect("read configs/haproxy.cfg");
    let text = text
        .replace("127.0.0.1:8080", &front.to_string())
        .replace("127.0.0.1:8404", &stats.to_string())
        .replace("127.0.0.1:7301", &ports.http(0).to_string())
        .replace("127.0.0.1:7302", &ports.http(1).to_string())
        .replace("127.0.0.1:7303", &ports.http(2).to_string())
        .replace("log stdout format raw local0 warning", "");
    assert!(
        text.contains(&ports.http(2).to_string()),
        "config layout changed"
    );
    text
}

/// Server name -> status ("UP", "DOWN", ...) from HAProxy's CSV stats.
fn server_states(stats: SocketAddr) -> Vec<(String, String)> {
    let Ok(mut s) = TcpStream::connect(stats) else {
        return Vec::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let _ = s.write_all(b"GET /stats;csv HTTP/1.0\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.lines()
        .filter(|l| l.starts_with("shardline_nodes,node-"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            Some((f.get(1)?.to_string(), f.get(17)?.to_string()))
        })
        .collect()
}

fn wait_states(stats: SocketAddr, want: &[(&str, &str)], timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let st = server_states(stats);
        let ok = want
            .iter()
            .all(|(name, state)| st.iter().any(|(n, s)| n == name && s.starts_with(state)));
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "HAProxy servers not {want:?} within {timeout:?}: {st:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sends one add through HAProxy to counter `id`, whose value is `before`
/// (this client is its only writer); retries `503`. HAProxy closes a reused
/// client connection without a response when the server connection it
/// used failed before answering (the node was killed with the request in
/// flight; HAProxy leaves the retry to the client, as the server would
/// have): the add's outcome is unknown, so the counter is read: one more
/// than `before` means the add was applied (acknowledged now), `before`
/// that it was not (sent again). Panics on any other outcome.
fn add(
    conn: &mut Option<Conn>,
    front: SocketAddr,
    id: &str,
    before: i64,
    retries: &mut u64,
) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        assert!(Instant::now() < deadline, "add {id}: no answer for 30 s");
        let c = conn.get_or_insert_with(|| Conn::open(front));
        c.send(&http_support::post_bytes(
            &format!("/v1/entities/counter/{id}"),
            b"add 1",
        ));
        match c.read_response() {
            Some(r) if r.code == 200 => {
                if r.header("connection") == Some("close") {
                    *conn = None;
                }
                return r
                    .text()
                    .parse()
                    .unwrap_or_else(|_| panic!("reply {:?}", r.text()));
            }
            Some(r) if r.code == 503 => {
                *retries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            Some(r) => panic!(
                "add {id}: status {} ({}) — outcome unknown",
                r.code,
                r.text()
            ),
            None => {
                *conn = None;
                *retries += 1;
                let now = get(front, id, deadline);
                if now == before + 1 {
                    return now;
                }
                assert_eq!(now, before, "counter {id}: neither applied nor not");
            }
        }
    }
}

/// The value of counter `id` through HAProxy on a new connection, retrying
/// `503` and a close without a response until `deadline`.
fn get(front: SocketAddr, id: &str, deadline: Instant) -> i64 {
    loop {
        assert!(Instant::now() < deadline, "get {id}: no answer");
        let mut c = Conn::open(front);
        c.send(&http_support::post_bytes(
            &format!("/v1/entities/counter/{id}"),
            b"get",
        ));
        match c.read_response() {
            Some(r) if r.code == 200 => {
                return r
                    .text()
                    .parse()
                    .unwrap_or_else(|_| panic!("reply {:?}", r.text()))
            }
            Some(r) if r.code == 503 => std::thread::sleep(Duration::from_millis(20)),
            Some(r) => panic!("get {id}: status {} ({})", r.code, r.text()),
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

#[test]
fn haproxy_takes_a_killed_node_out_and_every_counter_equals_its_acknowledged_adds() {
    let haproxy = haproxy_bin();
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 24_500 };
    let front = SocketAddr::from(([127, 0, 0, 1], 24_690));
    let stats = SocketAddr::from(([127, 0, 0, 1], 24_691));
    let mut nodes = start_nodes(dir.path(), ports, 3, 1);
    for n in &nodes {
        wait_ready(n.http, Duration::from_secs(30));
    }
    let cfg = dir.path().join("haproxy.cfg");
    std::fs::write(&cfg, haproxy_config(ports, front, stats)).expect("write haproxy.cfg");
    let check = Command::new(&haproxy)
        .args(["-c", "-f"])
        .arg(&cfg)
        .output()
        .expect("run haproxy -c");
    assert!(
        check.status.success(),
        "haproxy refuses the config: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    let _hap = HaProxy(
        Command::new(&haproxy)
            .args(["-db", "-f"])
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start haproxy"),
    );
    wait_states(
        stats,
        &[("node-1", "UP"), ("node-2", "UP"), ("node-3", "UP")],
        Duration::from_secs(20),
    );

    // Warm allocation gives every shard to the regions registered when it
    // ran; a node that registered later gets its share by rebalance after
    // ready. Wait until every node hosts counter shards and the layout holds.
    let layout = || -> Vec<Vec<u32>> {
        (0..3)
            .map(|i| {
                Client::connect(ports.client(i))
                    .and_then(|mut c| c.node_status(Duration::from_secs(5)))
                    .map(|st| {
                        st.regions
                            .iter()
                            .filter(|r| r.type_name == "counter" && !r.proxy)
                            .flat_map(|r| r.shards.keys().copied())
                            .collect()
                    })
                    .unwrap_or_default()
            })
            .collect()
    };
    let spread_by = Instant::now() + Duration::from_secs(40);
    let mut last = Vec::new();
    loop {
        let now = layout();
        if now.iter().all(|s| !s.is_empty()) && now == last {
            break;
        }
        assert!(
            Instant::now() < spread_by,
            "counter shards not spread over the nodes: {now:?}"
        );
        last = now;
        std::thread::sleep(Duration::from_millis(500));
    }

    // Place candidate counters (a `get` allocates their shards), then keep
    // those whose shard lives on node 0 or 1; node 2 will be killed.
    let mut c = Conn::open(front);
    let candidates: Vec<String> = (0..120).map(|i| format!("ctr-{i}")).collect();
    for id in &candidates {
        let r = c.post(&format!("/v1/entities/counter/{id}"), b"get");
        assert_eq!((r.code, r.text()), (200, "0".to_string()), "{id}");
    }
    let victim = 2;
    let mut victim_shards = std::collections::BTreeSet::new();
    let mut survivor_entities = std::collections::BTreeSet::new();
    for i in 0..3 {
        let st = Client::connect(ports.client(i))
            .and_then(|mut c| c.node_status(Duration::from_secs(5)))
            .expect("node status");
        for r in st.regions.iter().filter(|r| r.type_name == "counter") {
            for (shard, ids) in &r.shards {
                if i == victim {
                    victim_shards.insert(*shard);
                } else {
                    survivor_entities.extend(ids.iter().cloned());
                }
            }
        }
    }
    let counters: Vec<String> = candidates
        .iter()
        .filter(|id| survivor_entities.contains(*id))
        .take(CLIENTS * COUNTERS_PER_CLIENT)
        .cloned()
        .collect();
    assert_eq!(
        counters.len(),
        CLIENTS * COUNTERS_PER_CLIENT,
        "too few counters on the survivors"
    );
    assert!(
        !victim_shards.is_empty(),
        "the victim hosts no shard: placement is not spread"
    );

    // Four clients, each adding to its own counters; all pause halfway.
    let barrier = Arc::new(Barrier::new(CLIENTS + 1));
    let per_client = TOTAL_ADDS / CLIENTS;
    let mut workers = Vec::new();
    for w in 0..CLIENTS {
        let ids: Vec<String> =
            counters[w * COUNTERS_PER_CLIENT..(w + 1) * COUNTERS_PER_CLIENT].to_vec();
        let barrier = barrier.clone();
        workers.push(std::thread::spawn(move || {
            let mut acked = vec![0i64; ids.len()];
            let mut conn = None;
            let mut retries = 0u64;
            for k in 0..per_client {
                if k == per_client / 2 {
                    conn = None; // no keep-alive connection across the kill
                    barrier.wait(); // paused: the node is killed
                    barrier.wait(); // resumed
                }
                let j = k % ids.len();
                let v = add(&mut conn, front, &ids[j], acked[j], &mut retries);
                acked[j] += 1;
                assert_eq!(v, acked[j], "counter {} skipped or repeated an add", ids[j]);
            }
            (ids, acked, retries)
        }));
    }
    barrier.wait();
    nodes[victim].kill();
    std::thread::sleep(Duration::from_millis(100));
    let killed_at = Instant::now();
    barrier.wait();
    // HAProxy's health check takes the node out while the adds go on.
    wait_states(
        stats,
        &[("node-1", "UP"), ("node-2", "UP"), ("node-3", "DOWN")],
        Duration::from_secs(15),
    );
    let taken_out_after = killed_at.elapsed();

    let mut total_acked = 0;
    let mut total_retries = 0;
    let mut c = Conn::open(front);
    for wk in workers {
        let (ids, acked, retries) = wk.join().expect("client thread");
        total_retries += retries;
        for (id, n) in ids.iter().zip(&acked) {
            let r = c.post(&format!("/v1/entities/counter/{id}"), b"get");
            assert_eq!(r.code, 200);
            assert_eq!(r.text(), n.to_string(), "counter {id}");
            total_acked += n;
        }
    }
    assert_eq!(total_acked, TOTAL_ADDS as i64);
    println!(
        "haproxy: {TOTAL_ADDS} adds acknowledged, {total_retries} retries (503, or a close with the outcome read back), node taken out {} ms after the kill",
        taken_out_after.as_millis()
    );
}
