//! A typed, durable bank account in a three-node in-process cluster.
//!
//! `Account` is a typed event-sourced entity: commands and replies are
//! Rust enums (postcard on the wire), events are persisted to each node's
//! journal before the reply goes out, and the state is snapshotted as JSON
//! every 4 events. Asks go through any node and reach the account
//! wherever its shard lives; when node 3 leaves, its shards move and the
//! accounts recover there from the journal.
//!
//! Run: `cargo run --release -p shardline --example bank_cluster`

use std::time::Duration;

use serde::{Deserialize, Serialize};
use shardline::typed::{self, Effect, EntityTypeKey, Json, Postcard, Protocol};
use shardline::{EntitySettings, Node, NodeConfig};

/// What an account is sent.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Command {
    Deposit(u64),
    Withdraw(u64),
    Balance,
}

/// What an account persists.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Event {
    Deposited(u64),
    Withdrawn(u64),
}

/// An account's state (its snapshot).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct State {
    balance: u64,
}

/// The protocol: the reply is the new balance or why it was refused.
struct Bank;
impl Protocol for Bank {
    type Command = Command;
    type Reply = Result<u64, String>;
    type Codec = Postcard;
}

struct Account;

impl typed::PersistentEntity for Account {
    type Protocol = Bank;
    type Event = Event;
    type State = State;
    type EventCodec = Postcard;
    type SnapshotCodec = Json;

    fn on_command(&self, state: &State, command: Command) -> Effect<Self> {
        match command {
            Command::Deposit(n) => {
                Effect::persist([Event::Deposited(n)]).then_reply(|s: &State| Ok(s.balance))
            }
            Command::Withdraw(n) if n > state.balance => {
                Effect::reply(Err(format!("insufficient funds ({})", state.balance)))
            }
            Command::Withdraw(n) => {
                Effect::persist([Event::Withdrawn(n)]).then_reply(|s: &State| Ok(s.balance))
            }
            Command::Balance => Effect::reply(Ok(state.balance)),
        }
    }

    fn apply(&self, state: &mut State, event: &Event) {
        match event {
            Event::Deposited(n) => state.balance += n,
            Event::Withdrawn(n) => state.balance -= n,
        }
    }
}

fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let key = EntityTypeKey::<Bank>::new("account")?;
    let mut nodes = Vec::new();
    for i in 0..3u16 {
        let config = NodeConfig::builder(
            format!("127.0.0.1:{}", 17_130 + i).parse()?,
            format!("127.0.0.1:{}", 17_230 + i).parse()?,
            // Every node's data_dir under one parent: the local journals
            // read each other's when shards move.
            dir.path().join(format!("node-{i}")),
        )
        .seed_nodes(["127.0.0.1:17130".parse()?])
        .pin_cores(false)
        .number_of_shards(30)
        .group_commit(Duration::from_millis(2))
        .build()?;
        let node = Node::start(config)?;
        node.sharding()
            .start_persistent(&key, |_| Account, 4, EntitySettings::default())?;
        nodes.push(node);
    }
    for n in &nodes {
        n.wait_ready(Duration::from_secs(30))?;
    }
    println!("three nodes up");

    let t = Duration::from_secs(5);
    let names = ["alice", "bob", "carol", "dave", "erin", "frank"];
    for (i, name) in names.iter().enumerate() {
        // Through a different node each time: routing finds the home.
        let r = nodes[i % 3].typed_ref(&key, name)?;
        r.ask_blocking(Command::Deposit(100), t)?
            .map_err(anyhow::Error::msg)?;
        let after = r.ask_blocking(Command::Withdraw(30 + i as u64), t)?;
        println!("{name}: deposit 100, withdraw {} -> {after:?}", 30 + i);
    }
    let r = nodes[1].typed_ref(&key, "alice")?;
    println!(
        "alice: withdraw 1000 -> {:?}",
        r.ask_blocking(Command::Withdraw(1_000), t)?
    );

    // Node 3 leaves: its shards are handed off and its accounts recover
    // on the others from the journal.
    let last = nodes.pop().expect("three nodes");
    last.leave(Duration::from_secs(20));
    println!("node 3 left");
    for name in names {
        let b = nodes[0]
            .typed_ref(&key, name)?
            .ask_blocking(Command::Balance, t)?;
        println!("{name}: balance {b:?}");
    }
    for n in nodes {
        n.leave(Duration::from_secs(10));
    }
    Ok(())
}
