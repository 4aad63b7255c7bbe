//! Limits of the embedding API through its public surface: the message
//! size limit is applied at `EntityRef`'s entry (raw and typed, sync and
//! async, ask and tell) whether the entity is homed on this node or on
//! another; a small message limit builds and runs without an HTTP front;
//! and a typed persistent entity answers bytes that are not one of its
//! commands as a typed in-memory one does, without a restart.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use shardline::api::{block_on, NotSent};
use shardline::client::Status;
use shardline::typed::{self, AskError, Context, Effect, EntityTypeKey, Json, Postcard, Protocol};
use shardline::{Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

/// Default `requests.max_message_size_bytes`: 16 MiB less 1 KiB.
const LIMIT: usize = (16 << 20) - 1024;

fn builder(port: u16, seed: u16, dir: &std::path::Path) -> shardline::config::NodeConfigBuilder {
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    NodeConfig::builder(addr(port), addr(port + 50), dir.join(port.to_string()))
        .seed_nodes([addr(seed)])
        .pin_cores(false)
        .number_of_shards(8)
        .downing_stable_after(Duration::from_secs(2))
        .heartbeat_pause(Duration::from_millis(1_500))
}

/// Answers `{messages it got}:{length of this one}`.
#[derive(Default)]
struct Sizer {
    seen: u64,
}

impl Entity for Sizer {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        self.seen += 1;
        ctx.reply(format!("{}:{}", self.seen, message.len()));
        Ok(())
    }
}

struct BlobProtocol;
impl Protocol for BlobProtocol {
    type Command = Vec<u8>;
    /// Messages handled so far.
    type Reply = u64;
    type Codec = Postcard;
}

#[derive(Default)]
struct TypedSizer {
    seen: u64,
}

impl typed::Entity for TypedSizer {
    type Protocol = BlobProtocol;
    fn handle(
        &mut self,
        _ctx: &mut Context<'_, '_, BlobProtocol>,
        _command: Vec<u8>,
    ) -> Result<u64, EntityError> {
        self.seen += 1;
        Ok(self.seen)
    }
}

/// Every way of the embedding API refuses `big` on `node` for entity `id`
/// with the same error, and nothing reaches the entity.
fn refused_everywhere(node: &Node, id: &str, big: &[u8]) {
    let t = Duration::from_secs(10);
    let raw = node.entity_ref("sizer", id).expect("ref");
    match raw.ask(big, t) {
        Err(shardline::AskError::Failed(Status::TooLarge)) => {}
        other => panic!("{id}: raw ask: expected Failed(TooLarge), got {other:?}"),
    }
    match raw.tell(big) {
        Err(shardline::AskError::Failed(Status::TooLarge)) => {}
        other => panic!("{id}: raw tell: expected Failed(TooLarge), got {other:?}"),
    }
    let too_large = NotSent::TooLarge {
        size: big.len() as u64,
        limit: LIMIT as u64,
    };
    match raw.ask_async(big.to_vec(), t) {
        Err(e) => {
            assert_eq!(e.reason, too_large, "{id}: ask_async");
            assert_eq!(e.message.len(), big.len(), "{id}: handed back");
        }
        Ok(_) => panic!("{id}: ask_async sent a message over the limit"),
    }
    match raw.try_tell(big.to_vec()) {
        Err(e) => assert_eq!(e.reason, too_large, "{id}: try_tell"),
        Ok(()) => panic!("{id}: try_tell sent a message over the limit"),
    }
    // Nothing reached the entity: its next message is its first.
    assert_eq!(raw.ask(b"x", t).expect("small ask"), b"1:1", "{id}");

    let key = EntityTypeKey::<BlobProtocol>::new("tsizer").expect("key");
    let typed = node.typed_ref(&key, id).expect("typed ref");
    // Postcard: the bytes and their varint length (4 bytes for 17 MiB).
    let encoded = |n: usize| n as u64 + 4;
    let command = big.to_vec();
    let n = command.len();
    let check = |e: AskError<Vec<u8>>, way: &str| match e {
        AskError::NotSent { command, reason } => {
            assert_eq!(
                reason,
                NotSent::TooLarge {
                    size: encoded(n),
                    limit: LIMIT as u64
                },
                "{id}: typed {way}"
            );
            assert_eq!(command.len(), n, "{id}: typed {way} hands the command back");
        }
        other => panic!("{id}: typed {way}: expected NotSent(TooLarge), got {other:?}"),
    };
    check(
        typed
            .ask_blocking(command.clone(), t)
            .expect_err("typed ask_blocking"),
        "ask_blocking",
    );
    check(
        block_on(typed.ask(command.clone())).expect_err("typed ask"),
        "ask",
    );
    check(typed.tell(command).expect_err("typed tell"), "tell");
    assert_eq!(
        typed.ask_blocking(vec![1], t).expect("small typed ask"),
        1,
        "{id}: nothing reached the typed entity"
    );
}

#[test]
fn a_message_over_the_limit_is_refused_alike_for_local_and_remote_entities() {
    let dir = tempfile::tempdir().expect("tmp");
    // a hosts both types; b only proxies them: from a every entity is
    // local, from b every entity is on another node.
    let a = Node::start(builder(31_200, 31_200, dir.path()).build().expect("config")).expect("a");
    a.sharding()
        .start(
            "sizer",
            Arc::new(|_| Box::<Sizer>::default()),
            EntitySettings::default(),
        )
        .expect("sizer");
    let key = EntityTypeKey::<BlobProtocol>::new("tsizer").expect("key");
    a.sharding()
        .start_typed(&key, |_| TypedSizer::default(), EntitySettings::default())
        .expect("tsizer");
    a.wait_ready(Duration::from_secs(30)).expect("a ready");
    let b = Node::start(builder(31_201, 31_200, dir.path()).build().expect("config")).expect("b");
    b.sharding().start_proxy("sizer").expect("proxy");
    b.sharding().start_proxy("tsizer").expect("proxy");
    b.wait_ready(Duration::from_secs(30)).expect("b ready");

    let big = vec![7u8; 17 << 20];
    refused_everywhere(&a, "local", &big);
    refused_everywhere(&b, "remote", &big);

    // A message of exactly the limit is carried both ways.
    let t = Duration::from_secs(10);
    let at_limit = vec![7u8; LIMIT];
    for (node, id) in [(&a, "local"), (&b, "remote")] {
        let r = node.entity_ref("sizer", id).expect("ref");
        assert_eq!(
            r.ask(&at_limit, t).expect("ask at the limit"),
            format!("2:{LIMIT}").into_bytes(),
            "{id}"
        );
    }
    b.leave(Duration::from_secs(10));
    a.leave(Duration::from_secs(10));
}

#[test]
fn a_small_message_limit_without_an_http_front_builds_and_is_applied() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = builder(31_210, 31_210, dir.path())
        .max_message_size_bytes(1024)
        .build()
        .expect("no HTTP front: its 1 MiB body limit bounds nothing");
    let node = Node::start(config).expect("start");
    node.sharding()
        .start(
            "sizer",
            Arc::new(|_| Box::<Sizer>::default()),
            EntitySettings::default(),
        )
        .expect("sizer");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let t = Duration::from_secs(5);
    let r = node.entity_ref("sizer", "s").expect("ref");
    assert_eq!(r.ask(&[0; 1024], t).expect("at the limit"), b"1:1024");
    match r.ask(&[0; 1025], t) {
        Err(shardline::AskError::Failed(Status::TooLarge)) => {}
        other => panic!("expected Failed(TooLarge), got {other:?}"),
    }
    match r.try_tell(vec![0; 1025]) {
        Err(e) => assert_eq!(
            e.reason,
            NotSent::TooLarge {
                size: 1025,
                limit: 1024
            }
        ),
        Ok(()) => panic!("sent a message over the limit"),
    }
    node.leave(Duration::from_secs(10));
}

// ----- undecodable commands -----

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum LedgerCmd {
    Deposit(u64),
    Balance,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum LedgerEvent {
    Deposited(u64),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct LedgerState {
    balance: u64,
    /// Events applied.
    events: u32,
}

struct LedgerProtocol;
impl Protocol for LedgerProtocol {
    type Command = LedgerCmd;
    /// Balance and events applied.
    type Reply = (u64, u32);
    type Codec = Json;
}

struct Ledger;

impl typed::PersistentEntity for Ledger {
    type Protocol = LedgerProtocol;
    type Event = LedgerEvent;
    type State = LedgerState;
    type EventCodec = Postcard;
    type SnapshotCodec = Json;

    fn on_command(&self, state: &LedgerState, command: LedgerCmd) -> Effect<Self> {
        match command {
            LedgerCmd::Deposit(n) => Effect::persist([LedgerEvent::Deposited(n)])
                .then_reply(|s: &LedgerState| (s.balance, s.events)),
            LedgerCmd::Balance => Effect::reply((state.balance, state.events)),
        }
    }

    fn apply(&self, state: &mut LedgerState, event: &LedgerEvent) {
        match event {
            LedgerEvent::Deposited(n) => state.balance += n,
        }
        state.events += 1;
    }
}

/// Another client's protocol, spoken to the same type name by mistake.
struct WrongProtocol;
impl Protocol for WrongProtocol {
    type Command = String;
    type Reply = String;
    type Codec = Json;
}

/// A typed in-memory entity of the same protocol as the ledger.
struct MemLedger(u64);

impl typed::Entity for MemLedger {
    type Protocol = LedgerProtocol;
    fn handle(
        &mut self,
        _ctx: &mut Context<'_, '_, LedgerProtocol>,
        command: LedgerCmd,
    ) -> Result<(u64, u32), EntityError> {
        if let LedgerCmd::Deposit(n) = command {
            self.0 += n;
        }
        Ok((self.0, 0))
    }
}

/// The `EntityFailed` text of a wrong-protocol command to type `name`.
fn wrong_protocol_answer(node: &Node, name: &str) -> String {
    let key = EntityTypeKey::<WrongProtocol>::new(name).expect("key");
    let r = node.typed_ref(&key, "e").expect("ref");
    match r.ask_blocking("hello".into(), Duration::from_secs(5)) {
        Err(AskError::Failed { status, payload }) => {
            assert_eq!(status, Status::EntityFailed, "{name}");
            String::from_utf8(payload).expect("utf-8")
        }
        other => panic!("{name}: expected Failed, got {other:?}"),
    }
}

/// Garbage and a wrong protocol to a typed persistent entity: each is
/// answered `EntityFailed` as the in-memory typed entity answers it, the
/// very next command is served, more of them than the supervisor's
/// restart limit (10) stop nothing, and nothing is appended.
fn undecodable_commands_leave_the_persistent_entity_serving(port: u16, group_commit: bool) {
    let dir = tempfile::tempdir().expect("tmp");
    let mut b = builder(port, port, dir.path());
    if group_commit {
        b = b.group_commit(Duration::from_millis(2));
    }
    let node = Node::start(b.build().expect("config")).expect("start");
    let key = EntityTypeKey::<LedgerProtocol>::new("ledger").expect("key");
    node.sharding()
        .start_persistent(&key, |_| Ledger, 0, EntitySettings::default())
        .expect("ledger");
    let mem = EntityTypeKey::<LedgerProtocol>::new("memledger").expect("key");
    node.sharding()
        .start_typed(&mem, |_| MemLedger(0), EntitySettings::default())
        .expect("memledger");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let t = Duration::from_secs(5);
    let e = node.typed_ref(&key, "e").expect("ref");
    assert_eq!(
        e.ask_blocking(LedgerCmd::Deposit(5), t).expect("ask"),
        (5, 1)
    );

    let persistent = wrong_protocol_answer(&node, "ledger");
    let in_memory = wrong_protocol_answer(&node, "memledger");
    assert!(
        persistent.starts_with("not a command of this type"),
        "{persistent}"
    );
    assert_eq!(persistent, in_memory, "the same answer from both kinds");

    for i in 1..=15u64 {
        match e.raw().ask(&[0xff, 0x00, 0x13], t) {
            Err(shardline::AskError::Failed(Status::EntityFailed)) => {}
            other => panic!("garbage {i}: expected EntityFailed, got {other:?}"),
        }
        // Served at once: no restart, no backoff.
        assert_eq!(
            e.ask_blocking(LedgerCmd::Deposit(1), t)
                .unwrap_or_else(|err| panic!("the command after garbage {i}: {err:?}")),
            (5 + i, 1 + i as u32),
            "garbage appended nothing"
        );
    }
    assert_eq!(
        wrong_protocol_answer(&node, "ledger"),
        persistent,
        "still the same answer"
    );
    assert_eq!(
        e.ask_blocking(LedgerCmd::Balance, t).expect("ask"),
        (20, 16)
    );
    node.leave(Duration::from_secs(10));
}

#[test]
fn an_undecodable_command_leaves_a_typed_persistent_entity_serving() {
    undecodable_commands_leave_the_persistent_entity_serving(31_220, false);
}

#[test]
fn an_undecodable_command_leaves_a_typed_persistent_entity_serving_under_group_commit() {
    undecodable_commands_leave_the_persistent_entity_serving(31_230, true);
}
