//! Remember entities across the loss of a node, in `shardline node`
//! processes: a two-node cluster with remembered, durable counters; the
//! node hosting some of them is killed with SIGKILL; once the split-brain
//! resolver removes it, the coordinator allocates its shards to the
//! survivor at once, and the counters are live there again without any
//! message for them, with their values (read from the dead node's journal
//! under the shared data root).
//!
//! Timeline with these settings (heartbeat pause 1.5 s, SBR `stable_after`
//! 2 s): the victim is removed about 6-10 s after the kill; the bound is
//! 60 s.

#[path = "node_cases/support.rs"]
mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};
use support::{allocate_and_balance, config_text, live_entities, spawn_node, status, Ports};

const COUNTERS: usize = 80;
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn remembered_counters_of_a_killed_node_start_on_the_survivor_without_a_message() {
    let dir = tempfile::tempdir().expect("tmp");
    let ports = Ports { base: 26_000 };
    let bin = support::shardline_bin();
    let mut nodes = Vec::new();
    for i in 0..2 {
        let text = config_text(ports, i, 2, 1, dir.path(), "")
            .replace("durability = \"none\"", "durability = \"always\"")
            .replace(
                "name = \"counter\"\nkind = \"counter\"\n",
                "name = \"counter\"\nkind = \"counter\"\nremember_entities = true\n",
            );
        assert!(text.contains("remember_entities = true"));
        let cfg = dir.path().join(format!("node-{i}.toml"));
        std::fs::write(&cfg, text).expect("config");
        nodes.push(spawn_node(
            &bin,
            &cfg,
            &dir.path().join(format!("node-{i}.log")),
            "info",
        ));
    }
    let log = |i: usize| {
        std::fs::read_to_string(dir.path().join(format!("node-{i}.log"))).unwrap_or_default()
    };
    for (i, n) in nodes.iter().enumerate() {
        assert!(
            n.ready.recv_timeout(BOUND).is_ok(),
            "node {i} not ready; log:\n{}",
            log(i)
        );
    }
    let deadline = Instant::now() + BOUND;
    while !(0..2).all(|i| {
        status(ports.client(i))
            .is_some_and(|s| s.members.iter().filter(|m| m.status == "Up").count() == 2)
    }) {
        assert!(Instant::now() < deadline, "two members never Up");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut clients: Vec<Client> = (0..2)
        .map(|i| Client::connect(ports.client(i)).expect("connect"))
        .collect();
    allocate_and_balance(
        &mut clients,
        &[ports.client(0), ports.client(1)],
        "rc",
        COUNTERS,
    );
    let ids: BTreeSet<String> = (0..COUNTERS).map(|c| format!("rc-{c}")).collect();
    for id in &ids {
        let r = clients[0]
            .ask("counter", id, b"add 3", Duration::from_secs(20))
            .expect("add");
        assert_eq!(r.status, Status::Ok, "add to {id}");
        assert_eq!(r.payload, b"3", "add to {id}");
    }
    let on_victim: BTreeSet<String> = live_entities(ports.client(1), "counter")
        .expect("victim status")
        .into_iter()
        .collect();
    assert!(!on_victim.is_empty(), "node 1 hosts some counters");
    drop(clients);

    // Node 1 (not the oldest, so the resolver keeps node 0) dies.
    let victim = nodes.pop().expect("node 1");
    victim.signal(libc::SIGKILL);
    let killed_at = Instant::now();
    drop(victim);

    // No message is sent for any counter: node 0's status must show them
    // all live again.
    let moved_after = loop {
        let live: BTreeSet<String> = live_entities(ports.client(0), "counter")
            .unwrap_or_default()
            .into_iter()
            .collect();
        if live == ids {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < BOUND,
            "{} of {} counters live on the survivor {:?} after the kill; missing {:?}\nlog:\n{}",
            live.len(),
            ids.len(),
            killed_at.elapsed(),
            ids.difference(&live).take(10).collect::<Vec<_>>(),
            log(0)
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "{} remembered counters of the killed node live on the survivor {moved_after:?} after SIGKILL",
        on_victim.len()
    );
    // Their values came back.
    let mut c = Client::connect(ports.client(0)).expect("connect");
    for id in &ids {
        let r = c
            .ask("counter", id, b"get", Duration::from_secs(20))
            .expect("get");
        assert_eq!(r.status, Status::Ok, "get {id}");
        assert_eq!(r.payload, b"3", "value of {id}");
    }
    drop(nodes);
}
