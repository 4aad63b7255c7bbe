//! Stateless workers across `shardline node` processes (2 nodes, 2 data
//! cores each, ports 25000-25199): concurrent load on one node's client
//! port makes the worker pool grow but never past `max_local_workers`, no
//! request crosses to the other node, and the pool shrinks after the load
//! stops; the `aggregate` built-in's totals are right after adds through
//! both nodes. In one process (embedding API, ports 25150-25171): a worker
//! whose handler defers its reply keeps its activation busy, so one core's
//! pool grows to the limit, then queues, then refuses, and shrinks after.

#[path = "node_cases/support.rs"]
mod support;

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use shardline::{
    AskError, Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig,
    WorkerPoolStatus, WorkerSettings,
};
use support::{status, Cluster};

const ASK_TIMEOUT: Duration = Duration::from_secs(10);

const WORKER_TYPES: &str = r#"
[[entity_types]]
name = "work"
kind = "echo"
max_local_workers = 2
idle_timeout_ms = 400

[[entity_types]]
name = "work1"
kind = "echo"
max_local_workers = 1
idle_timeout_ms = 400

[[entity_types]]
name = "agg"
kind = "aggregate"
aggregate_to = "counter"
aggregate_interval_ms = 200
"#;

/// The pools of `type_name` on the node at `addr`, one per core.
fn pools(addr: SocketAddr, type_name: &str) -> Vec<WorkerPoolStatus> {
    let st = status(addr).expect("node status");
    st.regions
        .iter()
        .filter(|r| r.type_name == type_name)
        .map(|r| r.worker.expect("a stateless worker type reports its pool"))
        .collect()
}

fn sum(p: &[WorkerPoolStatus], f: impl Fn(&WorkerPoolStatus) -> u64) -> u64 {
    p.iter().map(f).sum()
}

fn start() -> Cluster {
    let cluster = Cluster::start_with_extra(25_000, 2, 2, WORKER_TYPES);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(2, Duration::from_secs(60));
    cluster
}

#[test]
fn worker_pool_grows_within_the_limit_stays_local_and_shrinks() {
    let _serial = support::serial();
    let cluster = start();
    let (a, b) = (cluster.ports.client(0), cluster.ports.client(1));
    for t in ["work", "work1"] {
        let p = pools(a, t);
        assert_eq!(p.len(), 2, "one pool per data core");
        assert_eq!(sum(&p, |w| w.activations as u64), 0, "{t}: no load yet");
    }
    // Concurrent load on node 0 only: 8 connections (SO_REUSEPORT spreads
    // them over both cores), each 300 asks on distinct ids of both types.
    let threads: Vec<_> = (0..8)
        .map(|c| {
            std::thread::spawn(move || {
                let mut cl = Client::connect(a).expect("connect");
                let mut n = 0u64;
                for i in 0..300 {
                    let t = if i % 3 == 0 { "work1" } else { "work" };
                    let payload = format!("{c}-{i}");
                    let r = cl
                        .ask(t, &format!("id-{c}-{i}"), payload.as_bytes(), ASK_TIMEOUT)
                        .expect("ask");
                    assert_eq!(r.status, Status::Ok);
                    assert_eq!(r.payload, payload.as_bytes());
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut peak = 0u64;
    while !threads.iter().all(|t| t.is_finished()) {
        let p = pools(a, "work");
        let now = sum(&p, |w| w.activations as u64);
        assert!(now <= 2, "activations {now} > max_local_workers 2: {p:?}");
        peak = peak.max(now);
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent: u64 = threads
        .into_iter()
        .map(|t| t.join().expect("load thread"))
        .sum();
    assert_eq!(sent, 2400);
    let (work, work1) = (pools(a, "work"), pools(a, "work1"));
    eprintln!("work pools on node 0 after the load: {work:?} (peak seen by polling {peak})");
    // Grew under load, never past the limit (per core and node-wide).
    let max_seen = sum(&work, |w| w.max_activations_seen as u64);
    assert!((1..=2).contains(&max_seen), "{work:?}");
    assert!(work.iter().all(|w| w.max_activations_seen <= w.core_limit));
    assert_eq!(
        sum(&work1, |w| w.max_activations_seen as u64),
        1,
        "{work1:?}"
    );
    // Every request ran on node 0: 1600 + 800 executions there.
    assert_eq!(sum(&work, |w| w.executed_locally), 1600);
    assert_eq!(sum(&work1, |w| w.executed_locally), 800);
    // max_local_workers = 1 on 2 cores: core 1 hands its requests to core 0.
    assert_eq!(work1[1].core_limit, 0);
    assert_eq!(work1[1].executed_locally, 0);
    // Nothing crossed to node 1.
    for t in ["work", "work1"] {
        let p = pools(b, t);
        assert_eq!(sum(&p, |w| w.executed_locally), 0, "{t} on node 1: {p:?}");
        assert_eq!(sum(&p, |w| w.created), 0, "{t} on node 1: {p:?}");
    }
    // The pool shrinks to nothing after the 400 ms idle timeout.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = pools(a, "work");
        if sum(&p, |w| w.activations as u64) == 0 {
            assert_eq!(sum(&p, |w| w.collected), sum(&p, |w| w.created), "{p:?}");
            break;
        }
        assert!(Instant::now() < deadline, "pool never shrank: {p:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn aggregate_totals_are_right_after_the_interval() {
    let _serial = support::serial();
    let cluster = start();
    let nodes = [cluster.ports.client(0), cluster.ports.client(1)];
    let mut clients: Vec<Client> = nodes
        .iter()
        .map(|a| Client::connect(*a).expect("connect"))
        .collect();
    // The aggregators are counters `key-0..10`: give their shards a home and
    // wait for a balanced allocation, so that no rebalance moves one (and
    // its value, kept in a node's own journal here) during the test.
    support::allocate_and_balance(&mut clients, &nodes, "key", 10);
    // 10 keys; through both nodes; key k gets 1 + 2 + ... (k + 1) per node
    // pass, 3 passes.
    let mut expected = [0i64; 10];
    for pass in 0..3 {
        for (ni, cl) in clients.iter_mut().enumerate() {
            for (k, total) in expected.iter_mut().enumerate() {
                for n in 1..=(k as i64 + 1) {
                    let msg = format!("add key-{k} {n}");
                    let r = cl
                        .ask(
                            "agg",
                            &format!("w-{pass}-{ni}"),
                            msg.as_bytes(),
                            ASK_TIMEOUT,
                        )
                        .expect("add");
                    assert_eq!((r.status, r.payload.as_slice()), (Status::Ok, &b"ok"[..]));
                    *total += n;
                }
            }
        }
    }
    let bad = clients[0]
        .ask("agg", "w", b"add key-0 x", ASK_TIMEOUT)
        .expect("bad add");
    assert!(bad.payload.starts_with(b"error: "));
    // After the 200 ms interval every partial sum reached its aggregator;
    // `get` through either node reads the totals.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut got = Vec::new();
        for k in 0..10 {
            let cl = &mut clients[k % 2];
            let r = cl
                .ask(
                    "agg",
                    "reader",
                    format!("get key-{k}").as_bytes(),
                    ASK_TIMEOUT,
                )
                .expect("get");
            assert_eq!(r.status, Status::Ok);
            got.push(
                String::from_utf8_lossy(&r.payload)
                    .parse::<i64>()
                    .unwrap_or(-1),
            );
        }
        if got == expected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "totals {got:?}, expected {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The aggregator is the sharded counter: read directly, same totals.
    for (k, want) in expected.iter().enumerate() {
        let r = clients[1]
            .ask("counter", &format!("key-{k}"), b"get", ASK_TIMEOUT)
            .expect("counter get");
        assert_eq!(String::from_utf8_lossy(&r.payload), want.to_string());
    }
    // The adds ran on the worker pools of the nodes that received them.
    for a in nodes {
        let p = pools(a, "agg");
        assert!(sum(&p, |w| w.executed_locally) >= 165, "{p:?}");
    }
}

thread_local! {
    /// Reply tokens of the `slow` workers' deferred replies (the node's
    /// single data core runs every entity, so one thread-local list).
    static HELD: RefCell<Vec<(u64, Vec<u8>)>> = const { RefCell::new(Vec::new()) };
}

/// A worker that holds its reply until a `release` entity answers it.
struct Slow;

impl Entity for Slow {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if let Some(token) = ctx.defer_reply() {
            HELD.with(|h| h.borrow_mut().push((token, message.to_vec())));
        }
        Ok(())
    }
}

/// Answers every held reply of the `slow` workers, and itself with their
/// number.
struct Release;

impl Entity for Release {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, _: &[u8]) -> Result<(), EntityError> {
        let held = HELD.with(|h| std::mem::take(&mut *h.borrow_mut()));
        let n = held.len();
        for (token, payload) in held {
            ctx.complete(token, Status::Ok, payload);
        }
        if let Some(me) = ctx.defer_reply() {
            ctx.complete(me, Status::Ok, n.to_string().into_bytes());
        }
        Ok(())
    }
}

#[test]
fn a_busy_worker_makes_the_pool_grow_then_queue_then_refuse() {
    let _serial = support::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    let text = format!(
        "cluster_address = \"127.0.0.1:25150\"\nclient_address = \"127.0.0.1:25151\"\n\
         seed_nodes = [\"127.0.0.1:25150\"]\ndata_cores = 1\npin_cores = false\n\
         data_dir = \"{}\"\nnumber_of_shards = 8\n",
        dir.path().join("n").display()
    );
    let node = Node::start(NodeConfig::from_toml(&text, "<test>".as_ref()).expect("config"))
        .expect("start");
    let sharding = node.sharding();
    sharding
        .start_stateless_worker(
            "slow",
            Arc::new(|_| Box::new(Slow)),
            WorkerSettings {
                max_local_workers: Some(3),
                queue_size: 2,
            },
            EntitySettings {
                idle_timeout: Some(Duration::from_millis(300)),
                ..EntitySettings::default()
            },
        )
        .expect("start slow");
    sharding
        .start(
            "release",
            Arc::new(|_| Box::new(Release)),
            EntitySettings::default(),
        )
        .expect("start release");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let client = node.config().client_address;
    // Five asks at once: three busy activations, two queued.
    let asks: Vec<_> = (0..5)
        .map(|i| {
            let r = node.entity_ref("slow", &format!("s{i}")).expect("ref");
            std::thread::spawn(move || r.ask(format!("m{i}").as_bytes(), Duration::from_secs(20)))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = pools(client, "slow");
        assert!(p[0].activations <= 3, "{p:?}");
        if p[0].activations == 3 && p[0].queued == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "pool never filled: {p:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The sixth is refused: the queue is full.
    let sixth = node
        .entity_ref("slow", "s5")
        .expect("ref")
        .ask(b"m5", Duration::from_secs(10));
    assert!(
        matches!(sixth, Err(AskError::Failed(Status::BufferFull))),
        "{sixth:?}"
    );
    // Release the three; the two queued run on freed activations; release them.
    let release = node.entity_ref("release", "r").expect("ref");
    let mut released = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while released < 5 {
        let n: usize = String::from_utf8_lossy(
            &release
                .ask(b"go", Duration::from_secs(10))
                .expect("release"),
        )
        .parse()
        .expect("count");
        released += n;
        assert!(Instant::now() < deadline, "released {released} of 5");
        std::thread::sleep(Duration::from_millis(10));
    }
    for (i, a) in asks.into_iter().enumerate() {
        let got = a.join().expect("ask thread").expect("ask");
        assert_eq!(got, format!("m{i}").as_bytes());
    }
    let p = pools(client, "slow")[0];
    assert_eq!(
        (
            p.created,
            p.max_activations_seen,
            p.executed_locally,
            p.rejected
        ),
        (3, 3, 5, 1),
        "{p:?}"
    );
    // Idle for 300 ms: collected.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pools(client, "slow")[0].activations > 0 {
        assert!(Instant::now() < deadline, "pool never shrank");
        std::thread::sleep(Duration::from_millis(50));
    }
    node.leave(Duration::from_secs(5));
}

#[test]
fn aggregate_sends_its_partial_sums_when_the_node_leaves() {
    let _serial = support::serial();
    let dir = tempfile::tempdir().expect("tempdir");
    // A flush interval of 10 minutes: only the leave sends the sums; the
    // totals are durable counters, read after a restart on the same data.
    let text = format!(
        "cluster_address = \"127.0.0.1:25160\"\nclient_address = \"127.0.0.1:25161\"\n\
         seed_nodes = [\"127.0.0.1:25160\"]\ndata_cores = 1\npin_cores = false\n\
         data_dir = \"{}\"\nnumber_of_shards = 8\ndurability = \"always\"\n\
         [[entity_types]]\nname = \"totals\"\nkind = \"counter\"\n\
         [[entity_types]]\nname = \"agg\"\nkind = \"aggregate\"\naggregate_to = \"totals\"\n\
         aggregate_interval_ms = 600000\n",
        dir.path().join("n").display()
    );
    let config = NodeConfig::from_toml(&text, "<test>".as_ref()).expect("config");
    let node = Node::start(config).expect("start");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let agg = node.entity_ref("agg", "any").expect("ref");
    for k in 0..4 {
        for n in 1..=10 {
            let r = agg
                .ask(format!("add k{k} {n}").as_bytes(), Duration::from_secs(10))
                .expect("add");
            assert_eq!(r, b"ok");
        }
    }
    // Nothing sent before the interval or a leave. (This also gives the
    // totals' shards a home: a leaving node cannot allocate new shards.)
    for k in 0..4 {
        let before = node
            .entity_ref("totals", &format!("k{k}"))
            .expect("ref")
            .ask(b"get", Duration::from_secs(10))
            .expect("get");
        assert_eq!(before, b"0", "k{k}");
    }
    // Adds to k0 keep coming while the node leaves: each is either answered
    // `ok` (and then in the total) or refused `ShuttingDown`; none is
    // acknowledged and then lost.
    let hammer = node.entity_ref("agg", "any").expect("ref");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = stop.clone();
    let during = std::thread::spawn(move || {
        let (mut ok, mut refused) = (0u64, 0u64);
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            match hammer.ask(b"add k0 1", Duration::from_secs(5)) {
                Ok(r) if r == b"ok" => ok += 1,
                Ok(r) => panic!("unexpected reply {r:?}"),
                Err(shardline::AskError::Failed(shardline::client::Status::ShuttingDown)) => {
                    refused += 1
                }
                Err(_) => break,
            }
        }
        (ok, refused)
    });
    std::thread::sleep(Duration::from_millis(200));
    node.leave(Duration::from_secs(10));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (extra, refused) = during.join().expect("hammer thread");
    assert!(extra > 0, "no add was answered before the leave");
    eprintln!("adds during the leave: {extra} ok, {refused} refused");
    // Restarted on other ports (the old listener may linger), same data.
    let restarted = text.replace("2516", "2517");
    let config = NodeConfig::from_toml(&restarted, "<test>".as_ref()).expect("config");
    let node = Node::start(config).expect("restart");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    for k in 0..4 {
        let got = node
            .entity_ref("totals", &format!("k{k}"))
            .expect("ref")
            .ask(b"get", Duration::from_secs(10))
            .expect("get");
        let want = if k == 0 { 55 + extra } else { 55 };
        assert_eq!(got, want.to_string().as_bytes(), "k{k}");
    }
    node.leave(Duration::from_secs(10));
}
