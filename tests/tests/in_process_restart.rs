//! A node stopped in process (left, or dropped) releases its connections,
//! and a node started again in the same process at the same addresses
//! joins; a type started twice is refused; `Node::status` shows the node
//! its own view: embedded nodes in this process, ports 30100-30199.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::{Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

const SEED: u16 = 30_100;
const SECOND: u16 = 30_101;

fn config(port: u16, dir: &std::path::Path) -> NodeConfig {
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    NodeConfig::builder(addr(port), addr(port + 50), dir.join(port.to_string()))
        .seed_nodes([addr(SEED)])
        .pin_cores(false)
        .number_of_shards(8)
        .downing_stable_after(Duration::from_secs(2))
        .heartbeat_pause(Duration::from_millis(1_500))
        .build()
        .expect("config")
}

/// Answers `port` with the node's cluster port it runs on.
struct Where(u16);

impl Entity for Where {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, _message: &[u8]) -> Result<(), EntityError> {
        ctx.reply(self.0.to_string());
        Ok(())
    }
}

fn start(port: u16, dir: &std::path::Path) -> Node {
    let node = Node::start(config(port, dir)).expect("start");
    node.sharding()
        .start(
            "where",
            Arc::new(move |_| Box::new(Where(port))),
            EntitySettings::default(),
        )
        .expect("type");
    node
}

/// TCP connections of this machine in state ESTABLISHED whose local port
/// is `port` (`/proc/net/tcp`: addresses in hex, state `01`).
fn established_on(port: u16) -> usize {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    table
        .lines()
        .skip(1)
        .filter(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port = fields
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            local_port == Some(port) && fields.get(3) == Some(&"01")
        })
        .count()
}

/// Waits (up to 5 s) until no connection is established on `port`.
fn wait_released(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while established_on(port) > 0 {
        assert!(
            Instant::now() < deadline,
            "{what}: {} connection(s) still established on port {port}",
            established_on(port)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Asks every id until each answered (up to 20 s per id); returns the
/// ports that answered.
fn ask_all(node: &Node, ids: &[String]) -> Vec<u16> {
    ids.iter()
        .map(|id| {
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let r = node
                    .entity_ref("where", id)
                    .expect("ref")
                    .ask(b"where", Duration::from_secs(2));
                match r {
                    Ok(port) => {
                        break String::from_utf8(port)
                            .expect("utf-8")
                            .parse()
                            .expect("port")
                    }
                    Err(e) => {
                        assert!(Instant::now() < deadline, "{id}: {e:?}");
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        })
        .collect()
}

#[test]
fn a_node_stopped_in_process_closes_its_connections_and_joins_again_at_the_same_address() {
    let dir = tempfile::tempdir().expect("tmp");
    let first = start(SEED, dir.path());
    first
        .wait_ready(Duration::from_secs(30))
        .expect("seed ready");
    let second = start(SECOND, dir.path());
    second
        .wait_ready(Duration::from_secs(30))
        .expect("second ready");
    let ids: Vec<String> = (0..24).map(|i| format!("e-{i}")).collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    // Both nodes host some of the entities once the shards are balanced.
    while !ask_all(&first, &ids).contains(&SECOND) {
        assert!(
            Instant::now() < deadline,
            "the second node never hosted a shard"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // A client of the native front, connected while the node runs.
    let client_port = SECOND + 50;
    let mut client = shardline::client::Client::connect(
        format!("127.0.0.1:{client_port}").parse().expect("addr"),
    )
    .expect("client connects");
    client
        .ask("where", "e-0", b"where", Duration::from_secs(5))
        .expect("client ask");

    // A graceful leave: the seed's connections to it end with it, and so
    // does the client's.
    second.leave(Duration::from_secs(20));
    wait_released(SECOND, "after the leave");
    wait_released(client_port, "the client's connection after the leave");
    drop(client);

    // Started again at the same addresses and data_dir, it is heard.
    let again = start(SECOND, dir.path());
    again
        .wait_ready(Duration::from_secs(20))
        .expect("the node started again in process is ready");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ask_all(&first, &ids).contains(&SECOND) {
        assert!(
            Instant::now() < deadline,
            "the node started again never hosted a shard"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // Dropped without a leave: its connections go too, and its shards
    // move to the seed.
    drop(again);
    wait_released(SECOND, "after the drop");
    assert_eq!(
        ask_all(&first, &ids),
        vec![SEED; ids.len()],
        "every entity answers from the seed once the second node is gone"
    );
    first.leave(Duration::from_secs(10));
}

#[test]
fn a_type_started_twice_is_refused_and_the_first_start_stays_as_the_status_shows() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = 30_120;
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    let node = Node::start(
        NodeConfig::builder(addr(port), addr(port + 50), dir.path().join("n"))
            .seed_nodes([addr(port)])
            .pin_cores(false)
            .number_of_shards(8)
            .build()
            .expect("config"),
    )
    .expect("start");
    node.sharding()
        .start(
            "where",
            Arc::new(|_| Box::new(Where(1))),
            EntitySettings::default(),
        )
        .expect("first start");
    let again = node.sharding().start(
        "where",
        Arc::new(|_| Box::new(Where(2))),
        EntitySettings::default(),
    );
    assert!(
        matches!(&again, Err(shardline::NodeError::AlreadyStarted(t)) if t == "where"),
        "{again:?}"
    );
    let proxy = node.sharding().start_proxy("where");
    assert!(
        matches!(proxy, Err(shardline::NodeError::AlreadyStarted(_))),
        "{proxy:?}"
    );
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let answer = node
        .entity_ref("where", "a")
        .expect("ref")
        .ask(b"where", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(answer, b"1", "the first start's factory serves");

    // The node's own view, in process.
    let status = node.status(Duration::from_secs(5)).expect("status");
    assert_eq!(status.address, format!("127.0.0.1:{port}"));
    assert_eq!(status.client_address, format!("127.0.0.1:{}", port + 50));
    assert!(status.coordinator_here, "{status:?}");
    assert!(
        status
            .members
            .iter()
            .any(|m| m.address == status.address && m.status == "Up" && m.reachable),
        "{:?}",
        status.members
    );
    let regions: Vec<_> = status
        .regions
        .iter()
        .filter(|r| r.type_name == "where")
        .collect();
    assert!(!regions.is_empty(), "{:?}", status.regions);
    assert!(
        regions
            .iter()
            .all(|r| r.registered && !r.proxy && r.homes_known == 8),
        "{regions:?}"
    );
    node.leave(Duration::from_secs(10));
}
