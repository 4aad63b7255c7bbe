//! One cluster per data directory, and no silent empty recovery with the
//! local journal (multi-process, `shardline node` children):
//!
//! - two single-node clusters started on one `data_dir`: the second is
//!   refused at start, naming the first one's pid; after the first stopped,
//!   a node of another `cluster_name` refuses to start on its data;
//! - a new node with a wrong `cluster_name`, refused at its first join,
//!   starts with the corrected name on the same `data_dir` and serves;
//! - two fresh single-node clusters whose `data_dir`s are siblings under one
//!   parent (the shipped configs' layout): nothing is read across them;
//! - two nodes whose `data_dir`s are under different parents (as on two
//!   machines) with durable counters on the local journal: the second is
//!   refused at join with an error naming `journal.backend`, and the first
//!   keeps every acknowledged value;
//! - the same two data roots with a durable type registered through the
//!   embedding API (not known to be durable at the handshake): the members
//!   join, and a durable entity's recovery fails with `EntityFailed`
//!   instead of starting empty (on one data root it answers).
//!
//! Ports 28000-28399.

#[path = "node_cases/support.rs"]
mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use support::{serial, shardline_bin, spawn_node, status, NodeProc};

const COUNTERS: usize = 20;

/// A node config: cluster port `port`, client port `port + 50`, seeds,
/// `data_dir`, and `extra` top-level keys.
fn config(port: u16, seeds: &[u16], data_dir: &Path, extra: &str) -> String {
    let seeds: Vec<String> = seeds.iter().map(|s| format!("\"127.0.0.1:{s}\"")).collect();
    format!(
        r#"cluster_address = "127.0.0.1:{port}"
client_address = "127.0.0.1:{client}"
seed_nodes = [{seeds}]
data_cores = 1
pin_cores = false
data_dir = "{dir}"
number_of_shards = 20
durability = "always"
downing_stable_after_ms = 2000
heartbeat_pause_ms = 1500
{extra}
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 0
"#,
        client = port + 50,
        seeds = seeds.join(", "),
        dir = data_dir.display(),
    )
}

fn client_addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port + 50))
}

/// Writes `text` to `{dir}/{name}.toml` and starts a node on it, its log in
/// `{dir}/{name}.log`.
fn start(dir: &Path, name: &str, text: &str) -> NodeProc {
    let cfg = dir.join(format!("{name}.toml"));
    std::fs::write(&cfg, text).expect("write config");
    spawn_node(
        &shardline_bin(),
        &cfg,
        &dir.join(format!("{name}.log")),
        "info",
    )
}

fn log(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default()
}

fn ready(n: &NodeProc, dir: &Path, name: &str) {
    if n.ready.recv_timeout(Duration::from_secs(30)).is_err() {
        panic!("{name} not ready; log:\n{}", log(dir, name));
    }
}

/// Waits for `n` to exit (within `timeout`) with a failure status.
fn exits_failing(n: &mut NodeProc, timeout: Duration, dir: &Path, name: &str) {
    let st = n
        .wait_exit(timeout)
        .unwrap_or_else(|| panic!("{name} still runs; log:\n{}", log(dir, name)));
    assert!(!st.success(), "{name} exited 0; log:\n{}", log(dir, name));
}

/// Asks `payload` of counters `c-0..COUNTERS` and asserts each answers
/// `want`.
fn ask_all(addr: SocketAddr, payload: &str, want: &str) {
    let mut c = Client::connect(addr).expect("connect");
    for i in 0..COUNTERS {
        let id = format!("c-{i}");
        let r = c
            .ask("counter", &id, payload.as_bytes(), Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("{payload} {id}: {e}"));
        assert_eq!(
            (r.status, String::from_utf8_lossy(&r.payload).as_ref()),
            (Status::Ok, want),
            "{payload} {id} at {addr}"
        );
    }
}

#[test]
fn a_second_node_on_one_data_dir_is_refused_and_another_cluster_cannot_use_it() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let data = dir.join("data").join("node-1");
    let mut a = start(dir, "a", &config(28_000, &[28_000], &data, ""));
    ready(&a, dir, "a");
    ask_all(client_addr(28_000), "add 7", "7");
    // A second single-node cluster on the same data_dir: refused at start.
    let mut b = start(dir, "b", &config(28_010, &[28_010], &data, ""));
    exits_failing(&mut b, Duration::from_secs(10), dir, "b");
    let lb = log(dir, "b");
    assert!(
        lb.contains(&format!("in use by another node (process {})", a.pid())),
        "{lb}"
    );
    // The first is unaffected.
    ask_all(client_addr(28_000), "get", "7");
    // After it stopped, a node of another cluster name refuses its data.
    a.signal(libc::SIGTERM);
    assert!(a
        .wait_exit(Duration::from_secs(20))
        .is_some_and(|s| s.success()));
    let mut c = start(
        dir,
        "c",
        &config(28_020, &[28_020], &data, "cluster_name = \"orders\""),
    );
    exits_failing(&mut c, Duration::from_secs(10), dir, "c");
    let lc = log(dir, "c");
    assert!(
        lc.contains("belongs to cluster \"shardline\"") && lc.contains("cluster_name = \"orders\""),
        "{lc}"
    );
    // The same cluster restarted on it recovers its values.
    let d = start(dir, "d", &config(28_030, &[28_030], &data, ""));
    ready(&d, dir, "d");
    ask_all(client_addr(28_030), "get", "7");
    eprintln!("data_dir lock and cluster name: {:?}", t0.elapsed());
}

#[test]
fn a_node_refused_for_a_wrong_cluster_name_joins_once_it_is_corrected() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let a = start(
        dir,
        "a",
        &config(28_040, &[28_040], &dir.join("data").join("node-1"), ""),
    );
    ready(&a, dir, "a");
    ask_all(client_addr(28_040), "add 3", "3");
    // A new node with a mistyped cluster_name: refused at its first join.
    let data = dir.join("data").join("node-2");
    let mut b = start(
        dir,
        "b",
        &config(28_060, &[28_040], &data, "cluster_name = \"shardlin\""),
    );
    exits_failing(&mut b, Duration::from_secs(20), dir, "b");
    let lb = log(dir, "b");
    assert!(lb.contains("refused to join"), "{lb}");
    // Corrected, it starts on the same data_dir (which never joined a
    // cluster and holds no event) and serves.
    let c = start(dir, "c", &config(28_060, &[28_040], &data, ""));
    ready(&c, dir, "c");
    ask_all(client_addr(28_060), "get", "3");
    let id = std::fs::read_to_string(data.join("identity.toml")).expect("identity");
    assert!(id.contains("cluster_name = \"shardline\""), "{id}");
    eprintln!("corrected cluster name: {:?}", t0.elapsed());
}

#[test]
fn fresh_clusters_with_sibling_data_dirs_read_nothing_of_each_other() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let root = dir.join("shardline");
    let a = start(
        dir,
        "a",
        &config(28_100, &[28_100], &root.join("node-1"), ""),
    );
    ready(&a, dir, "a");
    ask_all(client_addr(28_100), "add 7", "7");
    // A second cluster of the same (default) name on a sibling data_dir.
    let b = start(
        dir,
        "b",
        &config(28_110, &[28_110], &root.join("node-2"), ""),
    );
    ready(&b, dir, "b");
    ask_all(client_addr(28_110), "get", "0");
    ask_all(client_addr(28_110), "add 1", "1");
    ask_all(client_addr(28_100), "get", "7");
    // B's coordinator did not recover from A's control journal.
    let st = status(client_addr(28_110)).expect("status of b");
    let coord = st
        .coordinators
        .iter()
        .find(|c| c.type_name == "counter")
        .expect("b's counter coordinator");
    assert_eq!(coord.recovered_from, "empty", "{coord:?}");
    // Both know their own cluster id, the same journal identity (one data
    // root), and the ids differ.
    let sa = status(client_addr(28_100)).expect("status of a");
    assert_eq!(sa.cluster_name, "shardline");
    assert!(
        sa.journal_identity.starts_with("local:"),
        "{}",
        sa.journal_identity
    );
    assert_eq!(sa.journal_identity, st.journal_identity);
    assert!(sa.cluster_id.is_some() && st.cluster_id.is_some());
    assert_ne!(sa.cluster_id, st.cluster_id);
    // Each data_dir records its own cluster's id.
    let id = |n: &str| {
        std::fs::read_to_string(root.join(n).join("identity.toml")).expect("identity.toml")
    };
    let (ia, ib) = (id("node-1"), id("node-2"));
    assert!(
        ia.contains("cluster_id") && ib.contains("cluster_id"),
        "{ia}\n{ib}"
    );
    assert_ne!(ia, ib);
    // Restarted, B still reads only its own values.
    drop(b);
    let b = start(
        dir,
        "b2",
        &config(28_110, &[28_110], &root.join("node-2"), ""),
    );
    ready(&b, dir, "b2");
    ask_all(client_addr(28_110), "get", "1");
    drop(b);
    drop(a);
    eprintln!("sibling clusters: {:?}", t0.elapsed());
}

#[test]
fn nodes_on_different_data_roots_with_local_durable_types_are_refused_at_join() {
    let _one_at_a_time = serial();
    let t0 = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // Two "machines": the data_dirs are under different parents.
    let d0 = dir.join("machine-a").join("node-0");
    let d1 = dir.join("machine-b").join("node-1");
    let seeds = [28_200, 28_201];
    let n0 = start(dir, "n0", &config(28_200, &seeds, &d0, ""));
    ready(&n0, dir, "n0");
    ask_all(client_addr(28_200), "add 7", "7");
    let mut n1 = start(dir, "n1", &config(28_201, &seeds, &d1, ""));
    exits_failing(&mut n1, Duration::from_secs(15), dir, "n1");
    let l1 = log(dir, "n1");
    assert!(
        l1.contains("refused to join the cluster") && l1.contains("journal.backend"),
        "{l1}"
    );
    // The survivor is alone and answers every acknowledged add.
    let st = status(client_addr(28_200)).expect("status");
    assert_eq!(st.members.len(), 1, "{:?}", st.members);
    ask_all(client_addr(28_200), "get", "7");
    eprintln!("different data roots: {:?}", t0.elapsed());
}

/// An embedded node (no config entity types: a durable type registered
/// through the embedding API is not known to be durable at the handshake).
fn embedded(port: u16, seed: u16, data_dir: &Path) -> shardline::Node {
    let node = shardline::Node::start(shardline::NodeConfig {
        cluster_address: format!("127.0.0.1:{port}").parse().expect("addr"),
        client_address: format!("127.0.0.1:{}", port + 50).parse().expect("addr"),
        http_address: None,
        seed_nodes: vec![format!("127.0.0.1:{seed}").parse().expect("addr")],
        data_cores: 1,
        pin_cores: false,
        cluster_name: shardline::config::DEFAULT_CLUSTER_NAME.to_string(),
        data_dir: data_dir.to_path_buf(),
        number_of_shards: 8,
        durability: shardline::config::Durability::Named(shardline::config::DurabilityName::None),
        entity_types: Vec::new(),
        downing_stable_after_ms: 2_000,
        heartbeat_pause_ms: 1_500,
        http: Default::default(),
        journal: Default::default(),
        requests: Default::default(),
        coordinator: Default::default(),
        cluster: Default::default(),
    })
    .expect("start");
    node.sharding()
        .start(
            "counter",
            shardline::entity::builtin_factory(shardline::config::EntityKind::Counter),
            shardline::EntitySettings::default(),
        )
        .expect("region");
    node
}

/// Two embedded nodes on data_dirs `d0`, `d1`; returns each counter's
/// answer to `add 1` (asked through node 0).
fn add_one_on_two_nodes(base: u16, d0: &Path, d1: &Path) -> Vec<Result<Vec<u8>, String>> {
    let a = embedded(base, base, d0);
    a.wait_ready(Duration::from_secs(30)).expect("a ready");
    let b = embedded(base + 1, base, d1);
    b.wait_ready(Duration::from_secs(30)).expect("b ready");
    let deadline = Instant::now() + Duration::from_secs(20);
    while status(client_addr(base))
        .is_none_or(|s| s.members.iter().filter(|m| m.status == "Up").count() < 2)
    {
        assert!(Instant::now() < deadline, "b never Up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = (0..8)
        .map(|i| {
            let r = a.entity_ref("counter", &format!("c-{i}")).expect("ref");
            r.ask(b"add 1", Duration::from_secs(10))
                .map_err(|e| e.to_string())
        })
        .collect();
    b.leave(Duration::from_secs(5));
    a.leave(Duration::from_secs(5));
    out
}

#[test]
fn durable_recovery_fails_instead_of_starting_empty_when_a_member_journal_is_unreadable() {
    let _one_at_a_time = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    // One data root: every counter starts and answers.
    let same = add_one_on_two_nodes(
        28_300,
        &dir.join("root").join("n0"),
        &dir.join("root").join("n1"),
    );
    assert!(
        same.iter().all(|r| r.as_deref() == Ok(&b"1"[..])),
        "{same:?}"
    );
    // Different data roots, durable type not declared in the config: the
    // members join, and every durable recovery fails with EntityFailed
    // instead of starting empty.
    let split = add_one_on_two_nodes(
        28_310,
        &dir.join("machine-a").join("n0"),
        &dir.join("machine-b").join("n1"),
    );
    assert!(
        split
            .iter()
            .all(|r| matches!(r, Err(e) if e.contains("EntityFailed"))),
        "{split:?}"
    );
}
