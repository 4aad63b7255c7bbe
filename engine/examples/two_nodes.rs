//! A two-node cluster in one process: both nodes host the built-in `counter`
//! type; asks through node A reach entities wherever their shard lives, and a
//! cluster event subscription shows the members coming Up. Node B then leaves
//! gracefully and its counters are served by A.
//!
//! Run: `cargo run -p shardline --example two_nodes`

use std::time::Duration;

use shardline::config::{Durability, DurabilityName, EntityKind, EntityTypeConfig};
use shardline::{Node, NodeConfig};
use shardline_core::cluster::ClusterEvent;

fn config(i: u16, dir: &std::path::Path) -> anyhow::Result<NodeConfig> {
    Ok(NodeConfig {
        cluster_address: format!("127.0.0.1:{}", 17_110 + i).parse()?,
        client_address: format!("127.0.0.1:{}", 17_210 + i).parse()?,
        http_address: None,
        seed_nodes: vec!["127.0.0.1:17110".parse()?, "127.0.0.1:17111".parse()?],
        data_cores: 1,
        pin_cores: false,
        cluster_name: shardline::config::DEFAULT_CLUSTER_NAME.to_string(),
        data_dir: dir.join(format!("node-{i}")),
        number_of_shards: 16,
        durability: Durability::Named(DurabilityName::None),
        entity_types: vec![EntityTypeConfig {
            idle_timeout_ms: 0,
            ..EntityTypeConfig::new("counter", EntityKind::Counter)
        }],
        downing_stable_after_ms: 5_000,
        heartbeat_pause_ms: 3_000,
        http: Default::default(),
        journal: Default::default(),
        requests: Default::default(),
        coordinator: Default::default(),
        cluster: Default::default(),
    })
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let a = Node::start(config(0, dir.path())?)?;
    let events = a.subscribe();
    let b = Node::start(config(1, dir.path())?)?;
    a.wait_ready(Duration::from_secs(30))?;
    b.wait_ready(Duration::from_secs(30))?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut up = 0;
    while up < 2 && std::time::Instant::now() < deadline {
        if let Ok(e) = events.recv_timeout(Duration::from_secs(1)) {
            match e {
                ClusterEvent::CurrentClusterState(s) => {
                    println!("event: current state, {} members", s.members.len())
                }
                ClusterEvent::MemberUp(m) => {
                    println!("event: {} is Up", m.unique_address);
                    up += 1;
                }
                other => println!("event: {other:?}"),
            }
        }
    }
    for i in 0..8 {
        let r = a.entity_ref("counter", &format!("c{i}"))?;
        let v = r.ask(format!("add {}", i + 1).as_bytes(), Duration::from_secs(5))?;
        println!("counter c{i} via A = {}", String::from_utf8_lossy(&v));
    }
    b.leave(Duration::from_secs(20));
    println!("B left");
    for i in 0..8 {
        let r = a.entity_ref("counter", &format!("c{i}"))?;
        let v = r.ask(b"get", Duration::from_secs(10))?;
        println!("counter c{i} via A after B left = {} (in-memory state of B's counters is not carried over)", String::from_utf8_lossy(&v));
    }
    a.leave(Duration::from_secs(10));
    Ok(())
}
