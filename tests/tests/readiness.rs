//! When an embedded node is ready, through the public API: a node with no
//! entity types (a pure routing node) is ready once Up; a type started
//! only on a member that is not the oldest (where the coordinators run)
//! gets its coordinator there anyway, so its node is ready and its
//! entities answer; a configuration without seed nodes is refused at
//! `build()`, since a node joins only through its seeds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::client::Status;
use shardline::config::ConfigError;
use shardline::{AskError, Entity, EntityContext, EntityError, EntitySettings};
use shardline::{EntityFactory, Node, NodeConfig};

/// Cluster port of the first node; client ports are `+ 50`.
const BASE_PORT: u16 = 26_820;

fn addr(p: u16) -> std::net::SocketAddr {
    format!("127.0.0.1:{p}").parse().expect("addr")
}

fn config(port: u16, seed: u16, dir: &std::path::Path) -> NodeConfig {
    NodeConfig::builder(addr(port), addr(port + 50), dir.join(port.to_string()))
        .seed_nodes([addr(seed)])
        .pin_cores(false)
        .data_cores(1)
        .number_of_shards(8)
        .build()
        .expect("config")
}

struct Echo;

impl Entity for Echo {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        ctx.reply(message.to_vec());
        Ok(())
    }
}

fn echo() -> EntityFactory {
    Arc::new(|_| Box::new(Echo))
}

#[test]
fn a_node_without_entity_types_is_ready_once_up() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(config(BASE_PORT, BASE_PORT, dir.path())).expect("start");
    let t = Instant::now();
    // Before: never ready (the readiness waited for regions it has none of).
    node.wait_ready(Duration::from_secs(5))
        .expect("a node without types is ready once Up");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_type_started_only_on_a_younger_node_is_ready_and_answers() {
    let dir = tempfile::tempdir().expect("tmp");
    let (p1, p2) = (BASE_PORT + 1, BASE_PORT + 2);
    // Node 1, the oldest (its coordinators run there), runs `both` only.
    let n1 = Node::start(config(p1, p1, dir.path())).expect("start 1");
    n1.sharding()
        .start("both", echo(), EntitySettings::default())
        .expect("both on 1");
    n1.wait_ready(Duration::from_secs(8)).expect("1 ready");
    let n2 = Node::start(config(p2, p1, dir.path())).expect("start 2");
    n2.sharding()
        .start("both", echo(), EntitySettings::default())
        .expect("both on 2");
    n2.sharding()
        .start("only2", echo(), EntitySettings::default())
        .expect("only2 on 2");
    // Before: never ready (its `only2` regions waited for a coordinator
    // that never started), and asks timed out with `Unavailable`. Within
    // the 10 s warm bound: its coordinator answered.
    n2.wait_ready(Duration::from_secs(8)).expect("2 ready");
    let r = n2.entity_ref("only2", "e1").expect("ref");
    let answer = r
        .ask(b"hello", Duration::from_secs(3))
        .expect("only2 answers through node 2");
    assert_eq!(answer, b"hello");
    // Node 1 does not run the type: it says so at once.
    let t = Instant::now();
    match n1
        .entity_ref("only2", "e1")
        .expect("ref")
        .ask(b"hello", Duration::from_secs(3))
    {
        Err(AskError::Failed(Status::UnknownEntityType)) => {}
        other => panic!("node 1: {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(1));
    drop(n2);
    drop(n1);
}

#[test]
fn a_config_without_seed_nodes_is_refused() {
    let e = NodeConfig::builder(addr(BASE_PORT + 3), addr(BASE_PORT + 53), "/unused")
        .build()
        .expect_err("no seeds");
    let ConfigError::Invalid { key, reason, .. } = &e else {
        panic!("{e}");
    };
    assert_eq!(key, "seed_nodes");
    assert!(
        reason.contains(&format!("[\"127.0.0.1:{}\"]", BASE_PORT + 3)),
        "{reason}"
    );
}
