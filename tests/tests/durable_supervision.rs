//! Supervision in a running node: a handler that panics answers its sender
//! `EntityFailed`, the entity restarts after its backoff with fresh state,
//! and its neighbours on the same core keep answering throughout; a typed
//! event-sourced entity's command that panics while queued behind a
//! persist in flight is answered at once too. Ports 24400-24499.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::client::Status;
use shardline::config::{Durability, DurabilityName};
use shardline::entity::supervision::{supervised, SupervisorSettings};
use shardline::{AskError, Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

/// Counts its messages; `boom` panics.
#[derive(Default)]
struct Fragile {
    n: u64,
}

impl Entity for Fragile {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if message == b"boom" {
            panic!("asked to panic");
        }
        self.n += 1;
        ctx.reply(self.n.to_string());
        Ok(())
    }
}

#[test]
fn a_panicking_handler_restarts_with_backoff_and_neighbours_keep_answering() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = 24_400;
    let node = Node::start(NodeConfig {
        cluster_address: format!("127.0.0.1:{port}").parse().expect("addr"),
        client_address: format!("127.0.0.1:{}", port + 50).parse().expect("addr"),
        http_address: None,
        seed_nodes: vec![format!("127.0.0.1:{port}").parse().expect("addr")],
        data_cores: 1,
        pin_cores: false,
        cluster_name: shardline::config::DEFAULT_CLUSTER_NAME.to_string(),
        data_dir: dir.path().join("node"),
        number_of_shards: 4,
        durability: Durability::Named(DurabilityName::None),
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
    let settings = SupervisorSettings {
        min_backoff: Duration::from_millis(300),
        max_backoff: Duration::from_secs(1),
        random_factor: 0.0,
        max_restarts: 3,
        window: Duration::from_secs(60),
    };
    node.sharding()
        .start(
            "fragile",
            supervised(Arc::new(|_| Box::<Fragile>::default()), settings),
            EntitySettings::default(),
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let t = Duration::from_secs(5);
    let victim = node.entity_ref("fragile", "victim").expect("ref");
    let neighbours: Vec<_> = (0..8)
        .map(|i| node.entity_ref("fragile", &format!("n-{i}")).expect("ref"))
        .collect();
    assert_eq!(victim.ask(b"x", t).expect("ask"), b"1");
    for n in &neighbours {
        assert_eq!(n.ask(b"x", t).expect("ask"), b"1");
    }
    match victim.ask(b"boom", t) {
        Err(AskError::Failed(Status::EntityFailed)) => {}
        other => panic!("expected EntityFailed, got {other:?}"),
    }
    // During the backoff the victim answers EntityFailed; neighbours answer.
    for n in &neighbours {
        assert_eq!(n.ask(b"x", t).expect("ask"), b"2");
    }
    let mut failed_while_backing_off = 0;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match victim.ask(b"x", t) {
            Ok(v) => {
                // A fresh incarnation: the failing message was not redelivered.
                assert_eq!(v, b"1");
                break;
            }
            Err(AskError::Failed(Status::EntityFailed)) => failed_while_backing_off += 1,
            Err(e) => panic!("unexpected {e:?}"),
        }
        assert!(Instant::now() < deadline, "victim never restarted");
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("victim answered EntityFailed {failed_while_backing_off} times during its backoff");
    for n in &neighbours {
        assert_eq!(n.ask(b"x", t).expect("ask"), b"3");
    }
    drop(node);
}

// ----- a typed event-sourced account whose command handler panics -----

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
enum AccountCmd {
    Deposit(u64),
    Balance,
    Boom,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
enum AccountEvent {
    Deposited(u64),
}

#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct AccountState {
    balance: u64,
}

struct Bank;

impl shardline::typed::Protocol for Bank {
    type Command = AccountCmd;
    type Reply = u64;
    type Codec = shardline::typed::Json;
}

struct Account;

impl shardline::typed::PersistentEntity for Account {
    type Protocol = Bank;
    type Event = AccountEvent;
    type State = AccountState;
    type EventCodec = shardline::typed::Json;
    type SnapshotCodec = shardline::typed::Json;

    fn on_command(
        &self,
        state: &AccountState,
        command: AccountCmd,
    ) -> shardline::typed::Effect<Self> {
        match command {
            AccountCmd::Deposit(n) => {
                shardline::typed::Effect::persist([AccountEvent::Deposited(n)])
                    .then_reply(|s: &AccountState| s.balance)
            }
            AccountCmd::Balance => shardline::typed::Effect::reply(state.balance),
            AccountCmd::Boom => panic!("asked to panic"),
        }
    }

    fn apply(&self, state: &mut AccountState, event: &AccountEvent) {
        match event {
            AccountEvent::Deposited(n) => state.balance += n,
        }
    }
}

#[test]
fn a_persistent_command_that_panics_behind_a_persist_in_flight_is_answered_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let port = 24_420;
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    // Group commit: a command that persists waits for the next commit, and
    // the commands behind it are queued and run from the durability
    // notice (where the panic happens).
    let node = Node::start(
        NodeConfig::builder(addr(port), addr(port + 50), dir.path().join("node"))
            .seed_nodes([addr(port)])
            .pin_cores(false)
            .data_cores(1)
            .number_of_shards(4)
            .group_commit(Duration::from_millis(30))
            .build()
            .expect("config"),
    )
    .expect("start");
    let key = shardline::typed::EntityTypeKey::<Bank>::new("account").expect("key");
    node.sharding()
        .start_persistent(&key, |_| Account, 1_000, EntitySettings::default())
        .expect("type");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let account = node.typed_ref(&key, "a").expect("ref");
    let timeout = Duration::from_secs(10);
    for round in 0..3 {
        let began = Instant::now();
        let mut asks = Vec::new();
        for i in 0..20 {
            asks.push((false, account.ask_within(AccountCmd::Deposit(1), timeout)));
            if i == 10 {
                asks.push((true, account.ask_within(AccountCmd::Boom, timeout)));
            }
        }
        let mut boom = None;
        for (is_boom, ask) in asks {
            let r = shardline::api::block_on(ask);
            if is_boom {
                boom = Some((r, began.elapsed()));
            } else if let Err(e) = &r {
                // A deposit queued behind the panic is answered too: not
                // delivered (safe to retry), never left without an answer.
                assert!(
                    !matches!(e, shardline::typed::AskError::TimedOut),
                    "round {round}: a deposit got no answer: {e:?}"
                );
            }
        }
        let (r, took) = boom.expect("the panicking command was asked");
        match r {
            Err(shardline::typed::AskError::Failed { status, .. }) => {
                assert_eq!(status, Status::EntityFailed, "round {round}")
            }
            other => panic!("round {round}: the panicking command: {other:?}"),
        }
        assert!(
            took < Duration::from_secs(5),
            "round {round}: answered after {took:?}, not at once"
        );
    }
    drop(node);
}
