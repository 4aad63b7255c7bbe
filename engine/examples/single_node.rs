//! An embedded single node: starts a node in this process with a user entity
//! type, asks it through the embedding API and through the native client.
//!
//! Run: `cargo run -p shardline --example single_node`

use std::sync::Arc;
use std::time::Duration;

use shardline::client::{Client, Status};
use shardline::{Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

/// A greeter that counts how often it was greeted.
struct Greeter {
    greeted: u64,
}

impl Entity for Greeter {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        self.greeted += 1;
        let name = String::from_utf8_lossy(message);
        ctx.reply(format!(
            "hello {name}, from {} (greeting #{})",
            ctx.self_id(),
            self.greeted
        ));
        Ok(())
    }
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    // Every key not set keeps the config file's default (see
    // `NodeConfig::builder`); `build` runs the config file's checks.
    let config = NodeConfig::builder(
        "127.0.0.1:17100".parse()?,
        "127.0.0.1:17200".parse()?,
        dir.path(),
    )
    .seed_nodes(["127.0.0.1:17100".parse()?])
    .pin_cores(false)
    .number_of_shards(32)
    .build()?;
    let node = Node::start(config)?;
    node.sharding().start(
        "greeter",
        Arc::new(|_id| Box::new(Greeter { greeted: 0 })),
        EntitySettings::default(),
    )?;
    node.wait_ready(Duration::from_secs(30))?;

    let alice = node.entity_ref("greeter", "alice")?;
    for _ in 0..2 {
        let reply = alice.ask(b"world", Duration::from_secs(5))?;
        println!("embedded ask: {}", String::from_utf8_lossy(&reply));
    }

    let mut client = Client::connect("127.0.0.1:17200".parse()?)?;
    let r = client.ask("greeter", "bob", b"client", Duration::from_secs(5))?;
    assert_eq!(r.status, Status::Ok);
    println!("client ask: {}", String::from_utf8_lossy(&r.payload));
    let r = client.ask("nosuchtype", "bob", b"x", Duration::from_secs(5))?;
    println!("unknown type -> {:?}", r.status);

    node.leave(Duration::from_secs(10));
    println!("left");
    Ok(())
}
