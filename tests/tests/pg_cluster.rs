//! Durable counters on the PostgreSQL journal across `shardline node`
//! processes whose `data_dir`s are under different parents (as on separate
//! machines: no node can read another's files), against a throwaway
//! PostgreSQL (`pg_support`):
//! - issue 12's reproduction: 20 counters given `add 7`, one node leaves
//!   gracefully (SIGTERM), every counter is still 7 on the survivor;
//! - kill -9 of a node under load: every counter holds its acknowledged
//!   adds (or up to as many more as adds whose answer was lost);
//! - the database restarted mid-load: durable commands are answered
//!   `JournalUnavailable` while it is down (HTTP: 503 with `Retry-After`),
//!   non-durable types keep serving, the node's status, `/health/ready`
//!   and `shardline status` name the cause, service resumes without a
//!   restart, and the same check holds;
//! - kill -9 of the coordinator's node under load, then whole-cluster
//!   restarts (SIGTERM onto the same data dirs, kill -9 onto empty new
//!   ones): the coordinator recovers from the database each time, the
//!   cluster keeps its id, and every counter keeps its value;
//! - remembered entities read while the database refuses (row locks): the
//!   cores keep answering, no shard starts empty, the retries start them;
//! - a hand-off of counters with adds in flight: answered and kept.

#[path = "node_cases/support.rs"]
mod support;

mod pg_support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pg_support::TempPg;
use shardline::client::{Client, Status};
use support::{shardline_bin, start_ready, status, NodeProc};

/// Node `i` of `n`: cluster port `base + i`, client port `base + 50 + i`,
/// HTTP port `base + 80 + i`, data_dir `{dir}/machine-{i}/node` (a parent
/// of its own; [`data_dir_of`]).
fn write_config(
    dir: &Path,
    base: u16,
    i: usize,
    n: usize,
    url: &str,
    counter_keys: &str,
) -> PathBuf {
    let all: Vec<usize> = (0..n).collect();
    write_config_at(dir, base, i, &all, url, counter_keys, &data_dir_of(dir, i))
}

/// Node `i`'s default data_dir under `dir`.
fn data_dir_of(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("machine-{i}")).join("node")
}

/// As [`write_config`], with the data_dir `data` and the seed nodes
/// `seeds` (indices).
fn write_config_at(
    dir: &Path,
    base: u16,
    i: usize,
    seeds: &[usize],
    url: &str,
    counter_keys: &str,
    data: &Path,
) -> PathBuf {
    let seeds: Vec<String> = seeds
        .iter()
        .map(|j| format!("\"127.0.0.1:{}\"", base + *j as u16))
        .collect();
    let text = format!(
        r#"cluster_address = "127.0.0.1:{}"
client_address = "127.0.0.1:{}"
http_address = "127.0.0.1:{}"
seed_nodes = [{}]
data_cores = 2
pin_cores = false
data_dir = "{}"
number_of_shards = 40
downing_stable_after_ms = 1500
heartbeat_pause_ms = 1000

[journal]
backend = "postgres"
url = "{url}"
connect_timeout_ms = 500

[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
active_entity_limit = 0
{counter_keys}

[[entity_types]]
name = "echo"
kind = "echo"
"#,
        base + i as u16,
        base + 50 + i as u16,
        base + 80 + i as u16,
        seeds.join(", "),
        data.display()
    );
    let p = dir.join(format!("node-{i}.toml"));
    std::fs::write(&p, text).expect("config");
    p
}

fn client_addr(base: u16, i: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], base + 50 + i as u16))
}

fn start_node(dir: &Path, base: u16, i: usize, n: usize, url: &str) -> NodeProc {
    start_node_with(dir, base, i, n, url, "")
}

fn start_node_with(
    dir: &Path,
    base: u16,
    i: usize,
    n: usize,
    url: &str,
    counter_keys: &str,
) -> NodeProc {
    let cfg = write_config(dir, base, i, n, url, counter_keys);
    start_ready(
        &shardline_bin(),
        &cfg,
        &dir.join(format!("node-{i}.log")),
        "warn",
        Duration::from_secs(60),
    )
}

fn http_addr(base: u16, i: usize) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], base + 80 + i as u16))
}

/// One HTTP/1.1 request (connection closed after): `(code, lower-case
/// headers, body)`.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect http");
    s.set_read_timeout(Some(Duration::from_secs(15)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, head.to_ascii_lowercase(), body.to_string())
}

/// `shardline status --node addr`'s output.
fn status_cli(addr: SocketAddr) -> String {
    let out = std::process::Command::new(shardline_bin())
        .args(["status", "--node", &addr.to_string()])
        .output()
        .expect("shardline status");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn wait_up(addrs: &[SocketAddr], n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !addrs.iter().all(|a| {
        status(*a).is_some_and(|s| s.members.iter().filter(|m| m.status == "Up").count() == n)
    }) {
        assert!(Instant::now() < deadline, "{n} members never Up");
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_balanced(addrs);
}

/// Waits until every entity type's 40 shards are hosted by the regions of
/// `addrs`, at most one apart, and the layout held for 400 ms (longer than
/// the coordinator's warm settle time). Warm allocation places every shard
/// on the regions registered when it runs; a member that joins later gets
/// its share by rebalance hand-offs: the tests load the cluster after
/// those, so that the homes they name (`live_entities`) stay put.
fn wait_balanced(addrs: &[SocketAddr]) {
    type Layout = std::collections::BTreeMap<String, Vec<Vec<u32>>>;
    let layout = || -> Option<Layout> {
        let mut l = Layout::new();
        for a in addrs {
            for r in status(*a)?.regions.into_iter().filter(|r| !r.proxy) {
                l.entry(r.type_name)
                    .or_default()
                    .push(r.shards.keys().copied().collect());
            }
        }
        Some(l)
    };
    let balanced = |l: &Layout| {
        l.values().all(|regions| {
            let counts: Vec<usize> = regions.iter().map(Vec::len).collect();
            let min = counts.iter().copied().min().unwrap_or(0);
            let max = counts.iter().copied().max().unwrap_or(0);
            counts.iter().sum::<usize>() == 40 && max <= min + 1
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last: Option<Layout> = None;
    loop {
        let now = layout();
        if now.as_ref().is_some_and(&balanced) && now == last {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "shards never balanced over {addrs:?}: {now:?}"
        );
        last = now;
        std::thread::sleep(Duration::from_millis(400));
    }
}

/// `get` of every counter through `addr`, retried (bounded) until all
/// answer.
fn get_all(addr: SocketAddr, ids: &[String]) -> Vec<i64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut c = Client::connect(addr).expect("connect");
    ids.iter()
        .map(|id| loop {
            match c.ask("counter", id, b"get", Duration::from_secs(5)) {
                Ok(r) if r.status == Status::Ok => {
                    break String::from_utf8_lossy(&r.payload)
                        .parse::<i64>()
                        .expect("number")
                }
                other => {
                    assert!(
                        Instant::now() < deadline,
                        "get {id} never answered: {other:?}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                    if let Ok(n) = Client::connect(addr) {
                        c = n;
                    }
                }
            }
        })
        .collect()
}

/// Per counter: adds acknowledged, adds whose outcome is unknown (error
/// status other than a clean refusal, timeout, lost connection), and the
/// statuses seen.
#[derive(Default, Clone)]
struct Tally {
    acked: Vec<i64>,
    unknown: Vec<i64>,
    unavailable: u64,
    errors: Vec<String>,
}

/// `add 1` to the counters round-robin through `addr` until `stop`.
fn load(
    addr: SocketAddr,
    ids: Vec<String>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Tally> {
    std::thread::spawn(move || {
        let mut t = Tally {
            acked: vec![0; ids.len()],
            unknown: vec![0; ids.len()],
            ..Tally::default()
        };
        let mut c = Client::connect(addr).ok();
        let mut i = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let k = i % ids.len();
            i += 1;
            let Some(cl) = c.as_mut() else {
                std::thread::sleep(Duration::from_millis(50));
                c = Client::connect(addr).ok();
                continue;
            };
            match cl.ask("counter", &ids[k], b"add 1", Duration::from_secs(5)) {
                Ok(r) if r.status == Status::Ok => t.acked[k] += 1,
                Ok(r) => {
                    // JournalUnavailable may hide a commit whose answer was
                    // lost with the database: counted as unknown too.
                    if r.status == Status::JournalUnavailable {
                        t.unavailable += 1;
                    }
                    t.unknown[k] += 1;
                    if t.errors.len() < 20 {
                        t.errors.push(format!(
                            "{:?} {}",
                            r.status,
                            String::from_utf8_lossy(&r.payload)
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => {
                    t.unknown[k] += 1;
                    if t.errors.len() < 20 {
                        t.errors.push(e.to_string());
                    }
                    c = None;
                }
            }
        }
        t
    })
}

/// Every counter equals its acknowledged adds, or up to as many more as
/// adds whose outcome is unknown; none acknowledged reads 0.
fn verify(values: &[i64], t: &Tally, ids: &[String]) {
    for (k, v) in values.iter().enumerate() {
        assert!(
            *v >= t.acked[k] && *v <= t.acked[k] + t.unknown[k],
            "{}: value {v}, acknowledged {}, unknown {}",
            ids[k],
            t.acked[k],
            t.unknown[k]
        );
    }
}

#[test]
fn graceful_leave_keeps_every_durable_counter_on_postgres() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 25_700;
    let mut a = start_node(dir.path(), base, 0, 2, &pg.url());
    let mut b = start_node(dir.path(), base, 1, 2, &pg.url());
    let addrs = [client_addr(base, 0), client_addr(base, 1)];
    wait_up(&addrs, 2);
    let ids: Vec<String> = (0..20).map(|i| format!("c-{i}")).collect();
    let mut c = Client::connect(addrs[0]).expect("connect");
    for id in &ids {
        let r = c
            .ask("counter", id, b"add 7", Duration::from_secs(20))
            .expect("add");
        assert_eq!(
            r.status,
            Status::Ok,
            "{id}: {:?}",
            String::from_utf8_lossy(&r.payload)
        );
        assert_eq!(r.payload, b"7");
    }
    let on_b: usize = status(addrs[1])
        .expect("status")
        .regions
        .iter()
        .map(|r| r.entities)
        .sum();
    assert!(on_b > 0, "node 1 hosts some counters before it leaves");
    b.signal(libc::SIGTERM);
    let st = b.wait_exit(Duration::from_secs(30)).expect("node 1 exits");
    assert!(st.success(), "graceful leave exits 0: {st}");
    let values = get_all(addrs[0], &ids);
    assert_eq!(values, vec![7; 20], "every counter is 7 on the survivor");
    assert_eq!(
        pg.psql("SELECT count(DISTINCT persistence_id) FROM shardline_events WHERE persistence_id LIKE 'counter|%'"),
        "20"
    );
    a.signal(libc::SIGTERM);
    let _ = a.wait_exit(Duration::from_secs(20));
}

#[test]
fn kill_9_of_a_node_under_load_loses_nothing_acknowledged() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 25_800;
    let _a = start_node(dir.path(), base, 0, 2, &pg.url());
    let b = start_node(dir.path(), base, 1, 2, &pg.url());
    let addrs = [client_addr(base, 0), client_addr(base, 1)];
    wait_up(&addrs, 2);
    let ids: Vec<String> = (0..40).map(|i| format!("k-{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let loader = load(addrs[0], ids.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(1500));
    b.signal(libc::SIGKILL);
    drop(b);
    // Until node 1 is downed and its shards are allocated on node 0, then
    // a little more.
    let deadline = Instant::now() + Duration::from_secs(30);
    while status(addrs[0])
        .is_none_or(|s| s.members.iter().filter(|m| m.status == "Up").count() != 1)
    {
        assert!(Instant::now() < deadline, "node 1 never removed");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(2000));
    stop.store(true, Ordering::Relaxed);
    let t = loader.join().expect("loader");
    let values = get_all(addrs[0], &ids);
    eprintln!(
        "acked {} unknown {} errors {:?}",
        t.acked.iter().sum::<i64>(),
        t.unknown.iter().sum::<i64>(),
        t.errors
    );
    assert!(
        t.acked.iter().all(|a| *a > 0),
        "every counter got acknowledged adds"
    );
    verify(&values, &t, &ids);
}

#[test]
fn database_restart_mid_load_answers_unavailable_then_resumes() {
    let _one = support::serial();
    let mut pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 25_900;
    let _a = start_node(dir.path(), base, 0, 1, &pg.url());
    let addr = client_addr(base, 0);
    wait_up(&[addr], 1);
    let ids: Vec<String> = (0..20).map(|i| format!("d-{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let loader = load(addr, ids.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(1000));
    pg.stop_server();
    // While it is down the node names the cause.
    let deadline = Instant::now() + Duration::from_secs(15);
    let why = loop {
        let st = status(addr).expect("status while the database is down");
        if let Some(e) = st.regions.iter().find_map(|r| r.journal_error.clone()) {
            break e;
        }
        assert!(Instant::now() < deadline, "status never named the outage");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(why.contains("journal unavailable"), "{why}");
    // Non-durable types keep serving meanwhile.
    let mut e = Client::connect(addr).expect("connect");
    let r = e
        .ask("echo", "e-1", b"still here", Duration::from_secs(5))
        .expect("echo while the database is down");
    assert_eq!(
        (r.status, r.payload.as_slice()),
        (Status::Ok, &b"still here"[..])
    );
    // Through HTTP: a durable command is answered 503 with Retry-After
    // and the cause, a non-durable one is served, and readiness and
    // `shardline status` name the cause.
    let web = http_addr(base, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    let (code, head, body) = loop {
        let r = http(web, "POST", "/v1/entities/counter/d-0", "add 1");
        if r.0 != 200 {
            break r;
        }
        assert!(Instant::now() < deadline, "a durable add kept succeeding");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(code, 503, "{head} {body}");
    assert!(head.contains("retry-after: 1"), "{head}");
    assert!(body.contains("journal unavailable"), "{body}");
    let (code, _, body) = http(web, "POST", "/v1/entities/echo/h-1", "over http");
    assert_eq!((code, body.as_str()), (200, "over http"));
    let (code, _, body) = http(web, "GET", "/health/ready", "");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("journal unavailable"), "{body}");
    let cli = status_cli(addr);
    assert!(
        cli.contains("JOURNAL ERROR") && cli.contains("journal unavailable"),
        "{cli}"
    );
    std::thread::sleep(Duration::from_millis(500));
    pg.start_server();
    // Service resumes: a fresh add succeeds within a bounded time.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut c = Client::connect(addr).expect("connect");
    loop {
        let r = c
            .ask("counter", "probe", b"add 1", Duration::from_secs(5))
            .expect("ask");
        if r.status == Status::Ok {
            break;
        }
        assert!(Instant::now() < deadline, "never resumed: {:?}", r.status);
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1000));
    stop.store(true, Ordering::Relaxed);
    let t = loader.join().expect("loader");
    eprintln!(
        "acked {} unknown {} unavailable {} errors {:?}",
        t.acked.iter().sum::<i64>(),
        t.unknown.iter().sum::<i64>(),
        t.unavailable,
        t.errors
    );
    assert!(
        t.unavailable > 0,
        "durable commands answered JournalUnavailable while down"
    );
    let st = status(addr).expect("status");
    assert!(
        st.regions.iter().all(|r| r.journal_error.is_none()),
        "the outage is cleared from the status"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    while http(http_addr(base, 0), "GET", "/health/ready", "").0 != 200 {
        assert!(Instant::now() < deadline, "never ready again");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!status_cli(addr).contains("JOURNAL ERROR"));
    let values = get_all(addr, &ids);
    verify(&values, &t, &ids);
}

/// Remember entities on PostgreSQL: the counters that lived on a node
/// killed with SIGKILL start on the survivor without a message for them
/// (their shard's remember-entities records are read from the database),
/// with their values.
#[test]
fn remembered_counters_of_a_killed_node_start_on_the_survivor_on_postgres() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 26_100;
    let keys = "remember_entities = true";
    let _a = start_node_with(dir.path(), base, 0, 2, &pg.url(), keys);
    let b = start_node_with(dir.path(), base, 1, 2, &pg.url(), keys);
    let addrs = [client_addr(base, 0), client_addr(base, 1)];
    wait_up(&addrs, 2);
    let ids: Vec<String> = (0..30).map(|i| format!("m-{i}")).collect();
    let mut c = Client::connect(addrs[0]).expect("connect");
    for id in &ids {
        let r = c
            .ask("counter", id, b"add 3", Duration::from_secs(20))
            .expect("add");
        assert_eq!(
            (r.status, r.payload.as_slice()),
            (Status::Ok, &b"3"[..]),
            "{id}"
        );
    }
    let on_b = support::live_entities(addrs[1], "counter").expect("status");
    assert!(!on_b.is_empty(), "node 1 hosts some counters");
    b.signal(libc::SIGKILL);
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let live = support::live_entities(addrs[0], "counter").unwrap_or_default();
        if on_b.iter().all(|id| live.contains(id)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "remembered counters of the killed node not started: {} of {} live",
            on_b.iter().filter(|id| live.contains(*id)).count(),
            on_b.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(get_all(addrs[0], &ids), vec![3; 30]);
}

/// The coordinator's view on the node that runs it, as seen from `addr`,
/// once it runs (bounded wait).
fn coordinator_view(addrs: &[SocketAddr], base: u16) -> shardline::node::CoordinatorStatusView {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = addrs.iter().find_map(|a| {
            let st = status(*a)?;
            if !st.coordinator_here {
                return None;
            }
            st.coordinators
                .into_iter()
                .find(|c| c.type_name == "counter" && c.recovered_from != "recovering")
        });
        if let Some(c) = found {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no coordinator runs (base {base})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Issue 12's coordinator cases on PostgreSQL, on one database: kill -9 of
/// the coordinator's node under load (the survivor's coordinator recovers
/// the allocation state from the database; verify holds), then the whole
/// cluster stopped and started again on the same data dirs, then killed
/// with SIGKILL and started onto empty new data dirs: each time the
/// coordinator recovered from the database, the cluster has its id, and
/// every counter has its value.
#[test]
fn coordinator_kill_9_and_whole_cluster_restarts_recover_from_the_database() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let d = dir.path();
    let base = 26_200;
    let url = pg.url();
    // Three nodes: the two survivors of a kill -9 are the majority (of
    // two, the survivor would be downed).
    // Started together, then waited for (one after the other, each would
    // wait for the seeds not started yet).
    let start_all = |data: &dyn Fn(usize) -> PathBuf, round: &str| -> Vec<NodeProc> {
        let nodes: Vec<NodeProc> = (0..3)
            .map(|i| {
                // Node 0 is the only seed: it forms the cluster at once.
                let cfg = write_config_at(d, base, i, &[0], &url, "", &data(i));
                support::spawn_node(
                    &shardline_bin(),
                    &cfg,
                    &d.join(format!("{round}-{i}.log")),
                    "warn",
                )
            })
            .collect();
        for n in &nodes {
            n.ready
                .recv_timeout(Duration::from_secs(60))
                .expect("node ready");
        }
        nodes
    };
    let addrs = [
        client_addr(base, 0),
        client_addr(base, 1),
        client_addr(base, 2),
    ];
    let mut nodes = start_all(&|i| data_dir_of(d, i), "r0");
    wait_up(&addrs, 3);
    let first = status(addrs[1]).expect("status");
    assert_eq!(
        first.coordinator.as_deref(),
        Some(format!("127.0.0.1:{base}").as_str()),
        "node 0 (the oldest) runs the coordinator"
    );
    let cluster_id = first.cluster_id.clone().expect("cluster id");
    let ids: Vec<String> = (0..30).map(|i| format!("w-{i}")).collect();

    // 1. kill -9 of the coordinator's node under load through node 1.
    let stop = Arc::new(AtomicBool::new(false));
    let loader = load(addrs[1], ids.clone(), stop.clone());
    std::thread::sleep(Duration::from_millis(1500));
    let a = nodes.remove(0);
    a.signal(libc::SIGKILL);
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(30);
    while status(addrs[1]).is_none_or(|s| {
        s.members.iter().filter(|m| m.status == "Up").count() != 2
            || s.coordinator.as_deref() == Some(format!("127.0.0.1:{base}").as_str())
    }) {
        assert!(
            Instant::now() < deadline,
            "node 0 never replaced: {:?}",
            status(addrs[1])
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    stop.store(true, Ordering::Relaxed);
    let t = loader.join().expect("loader");
    let c = coordinator_view(&addrs[1..], base);
    assert_eq!(c.recovered_from, "database", "{c:?}");
    assert!(c.recovered_shards > 0 && c.refused.is_none(), "{c:?}");
    let values = get_all(addrs[1], &ids);
    eprintln!(
        "acked {} unknown {} errors {:?}",
        t.acked.iter().sum::<i64>(),
        t.unknown.iter().sum::<i64>(),
        t.errors
    );
    assert!(t.acked.iter().all(|a| *a > 0), "every counter got adds");
    verify(&values, &t, &ids);

    // 2. The whole cluster stops (SIGTERM) and starts on the same dirs.
    for n in &nodes {
        n.signal(libc::SIGTERM);
    }
    for n in &mut nodes {
        assert!(n.wait_exit(Duration::from_secs(30)).is_some(), "exits");
    }
    drop(nodes);
    // `shards`: the allocated shards the coordinator must recover (after a
    // kill -9; a graceful leave hands shards off first).
    let check = |round: &str, shards: Option<u64>| {
        let c = coordinator_view(&addrs, base);
        assert_eq!(c.recovered_from, "database", "{round}: {c:?}");
        assert!(
            c.recovered_records > 0 && c.refused.is_none(),
            "{round}: {c:?}"
        );
        if let Some(n) = shards {
            assert_eq!(c.recovered_shards, n, "{round}: allocation state {c:?}");
        }
        assert_eq!(
            status(addrs[0]).and_then(|s| s.cluster_id).as_deref(),
            Some(cluster_id.as_str()),
            "{round}: the same cluster"
        );
        assert_eq!(get_all(addrs[0], &ids), values, "{round}: every counter");
    };
    let nodes = start_all(&|i| data_dir_of(d, i), "r1");
    wait_up(&addrs, 3);
    check("restart on the same data dirs", None);
    let shards = coordinator_view(&addrs, base).shards;
    assert!(shards > 0);

    // 3. kill -9 of every node, then onto empty data dirs.
    for n in &nodes {
        n.signal(libc::SIGKILL);
    }
    drop(nodes);
    let fresh = |i: usize| d.join(format!("new-machine-{i}")).join("node");
    assert!((0..3).all(|i| !fresh(i).exists()));
    let nodes = start_all(&fresh, "r2");
    wait_up(&addrs, 3);
    check("restart onto empty data dirs", Some(shards));
    for n in &nodes {
        n.signal(libc::SIGTERM);
    }
    for mut n in nodes {
        let _ = n.wait_exit(Duration::from_secs(20));
    }
}

/// Waits (bounded) until another session runs `pg_sleep` (the lock
/// holder of a test has taken its row locks and sleeps).
fn wait_for_lock_holder(pg: &TempPg) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while pg.psql(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' \
         AND query LIKE '%pg_sleep(%' AND pid <> pg_backend_pid()",
    ) != "1"
    {
        assert!(Instant::now() < deadline, "the lock holder never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(100));
}

/// Live `counter` entities at `addr` and the regions' journal errors.
fn live_and_errors(addr: SocketAddr) -> Option<(Vec<String>, Vec<String>)> {
    let s = status(addr)?;
    let live = s
        .regions
        .iter()
        .filter(|r| r.type_name == "counter")
        .flat_map(|r| r.shards.values().flatten().cloned())
        .collect();
    let errors = s
        .regions
        .iter()
        .filter_map(|r| r.journal_error.clone())
        .collect();
    Some((live, errors))
}

/// A shard's remembered entities are read off the data core: while the
/// database refuses the reads (their rows locked by another session, the
/// node's `lock_timeout` 300 ms) the node's cores keep answering a
/// non-durable `echo`, no remembered shard starts empty, the regions'
/// `journal_error` names the failed read, and once the rows are free the
/// retried reads start every remembered counter without a message.
#[test]
fn remembered_entities_read_while_the_database_refuses_do_not_block_the_core_nor_start_empty() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 26_500;
    let keys = "remember_entities = true";
    let mut a = start_node_with(dir.path(), base, 0, 1, &pg.url(), keys);
    let addr = client_addr(base, 0);
    wait_up(&[addr], 1);
    let ids: Vec<String> = (0..30).map(|i| format!("r-{i}")).collect();
    let mut c = Client::connect(addr).expect("connect");
    for id in &ids {
        let r = c
            .ask("counter", id, b"add 5", Duration::from_secs(20))
            .expect("add");
        assert_eq!(
            (r.status, r.payload.as_slice()),
            (Status::Ok, &b"5"[..]),
            "{id}"
        );
    }
    drop(c);
    a.signal(libc::SIGTERM);
    let st = a.wait_exit(Duration::from_secs(30)).expect("node exits");
    assert!(st.success(), "{st}");
    let shards: u32 = pg
        .psql(
            "SELECT count(*) FROM shardline_writers WHERE persistence_id LIKE '__shard|counter|%'",
        )
        .parse()
        .expect("count");
    assert!(shards > 1, "remember-entities records of several shards");
    // New connections (the restarted node's) give up on a lock after 300 ms.
    pg.psql("ALTER ROLE postgres SET lock_timeout = '300ms'");
    let mut a = std::thread::scope(|s| {
        let holder = s.spawn(|| {
            pg.psql(
                "BEGIN; SELECT persistence_id FROM shardline_writers \
                 WHERE persistence_id LIKE '__shard|%' FOR UPDATE; \
                 SELECT pg_sleep(6); COMMIT;",
            )
        });
        wait_for_lock_holder(&pg);
        let locked_until = Instant::now() + Duration::from_secs(6);
        let a = start_node_with(dir.path(), base, 0, 1, &pg.url(), keys);
        let mut c = Client::connect(addr).expect("connect");
        let (mut answered, mut named) = (0usize, false);
        while Instant::now() + Duration::from_millis(1500) < locked_until {
            for k in 0..8 {
                let id = format!("e-{answered}-{k}");
                let r = c
                    .ask("echo", &id, b"ping", Duration::from_secs(2))
                    .expect("echo answers while remembered entities cannot be read");
                assert_eq!((r.status, r.payload.as_slice()), (Status::Ok, &b"ping"[..]));
            }
            answered += 1;
            if let Some((live, errors)) = live_and_errors(addr) {
                assert!(
                    live.is_empty(),
                    "no remembered shard starts before its read succeeded: {live:?}"
                );
                named |= errors
                    .iter()
                    .any(|e| e.contains("remembered entities") && e.contains("lock timeout"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        assert!(answered >= 3, "echo rounds while locked: {answered}");
        assert!(
            named,
            "the status names the failed read of remembered entities"
        );
        holder.join().expect("lock holder");
        a
    });
    // The rows are free: the retried reads start every remembered counter.
    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let (live, errors) = live_and_errors(addr).unwrap_or_default();
        if ids.iter().all(|id| live.contains(id)) && errors.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "remembered counters not all started after the lock: {} of {} live, errors {errors:?}",
            ids.iter().filter(|id| live.contains(*id)).count(),
            ids.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(get_all(addr, &ids), vec![5; 30]);
    pg.psql("ALTER ROLE postgres RESET lock_timeout");
    a.signal(libc::SIGTERM);
    let _ = a.wait_exit(Duration::from_secs(20));
}

/// A graceful leave hands off shards whose counters have adds in flight
/// (their commits held back by a lock on the writers' table for 2 s):
/// the leaving node's entities stop only after those commits (the core is
/// woken by the journal, nothing waits on it), every add is answered `Ok`
/// (none "entity stopped" or fenced), and the new home reads every
/// acknowledged add.
#[test]
fn a_hand_off_with_events_in_flight_answers_them_and_loses_nothing() {
    let _one = support::serial();
    let pg = TempPg::start();
    let dir = tempfile::tempdir().expect("tmp");
    let base = 26_600;
    let mut a = start_node(dir.path(), base, 0, 2, &pg.url());
    let mut b = start_node(dir.path(), base, 1, 2, &pg.url());
    let addrs = [client_addr(base, 0), client_addr(base, 1)];
    wait_up(&addrs, 2);
    let ids: Vec<String> = (0..40).map(|i| format!("h-{i}")).collect();
    let mut c = Client::connect(addrs[0]).expect("connect");
    for id in &ids {
        let r = c
            .ask("counter", id, b"add 1", Duration::from_secs(20))
            .expect("add");
        assert_eq!(r.status, Status::Ok, "{id}");
    }
    let on_b = support::live_entities(addrs[1], "counter").expect("status");
    assert!(!on_b.is_empty(), "node 1 hosts some counters");
    let stop = Arc::new(AtomicBool::new(false));
    let chunks: Vec<Vec<String>> = ids.chunks(5).map(<[String]>::to_vec).collect();
    let loads: Vec<_> = chunks
        .iter()
        .map(|ch| load(addrs[0], ch.clone(), stop.clone()))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    std::thread::scope(|s| {
        let holder = s.spawn(|| {
            // One table lock: it waits for the appends in flight, then
            // holds back every new one (an insert's ROW EXCLUSIVE lock
            // conflicts with it).
            pg.psql(
                "BEGIN; LOCK TABLE shardline_events IN SHARE ROW EXCLUSIVE MODE; \
                 SELECT pg_sleep(2); COMMIT;",
            )
        });
        wait_for_lock_holder(&pg);
        // The loads' next adds are appended and wait for their commit.
        std::thread::sleep(Duration::from_millis(300));
        b.signal(libc::SIGTERM);
        holder.join().expect("lock holder");
    });
    let st = b.wait_exit(Duration::from_secs(60)).expect("node 1 exits");
    assert!(st.success(), "graceful leave exits 0: {st}");
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let mut t = Tally::default();
    for (ch, l) in chunks.iter().zip(loads) {
        let lt = l.join().expect("load");
        assert_eq!(lt.acked.len(), ch.len());
        t.acked.extend(lt.acked.iter().map(|n| n + 1));
        t.unknown.extend(lt.unknown);
        t.errors.extend(lt.errors);
    }
    let values = get_all(addrs[0], &ids);
    verify(&values, &t, &ids);
    assert_eq!(
        t.unknown.iter().sum::<i64>(),
        0,
        "every add through the surviving node is answered Ok: {:?}",
        t.errors
    );
    assert!(t.acked.iter().sum::<i64>() > 80, "adds: {:?}", t.acked);
    a.signal(libc::SIGTERM);
    let _ = a.wait_exit(Duration::from_secs(20));
}
