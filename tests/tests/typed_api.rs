//! The typed, async embedding API through its public surface: typed ask
//! and tell from `block_on` and tokio, a typed event-sourced entity that
//! recovers after its node restarts on the same `data_dir`, the ask
//! timeout and a dropped (cancelled) ask future, and an ask between
//! entities on two in-process nodes (Akka's `context.ask`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use shardline::api::{block_on, NotSent};
use shardline::client::Status;
use shardline::typed::{
    self, AskError, Context, Effect, EntityAskFailure, EntityTypeKey, Json, Postcard, Protocol,
};
use shardline::{Entity, EntityContext, EntityError, EntityId, EntitySettings, Node, NodeConfig};

fn config(port: u16, seed: u16, dir: &std::path::Path) -> NodeConfig {
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    NodeConfig::builder(addr(port), addr(port + 50), dir.join(port.to_string()))
        .seed_nodes([addr(seed)])
        .pin_cores(false)
        .number_of_shards(8)
        .downing_stable_after(Duration::from_secs(2))
        .heartbeat_pause(Duration::from_millis(1_500))
        .build()
        .expect("config")
}

// ----- a typed in-memory counter -----

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum CounterCmd {
    Add(i64),
    Get,
    Fail,
    Panic,
}

struct CounterProtocol;
impl Protocol for CounterProtocol {
    type Command = CounterCmd;
    type Reply = i64;
    type Codec = Postcard;
}

#[derive(Default)]
struct TypedCounter {
    value: i64,
}

impl typed::Entity for TypedCounter {
    type Protocol = CounterProtocol;
    fn handle(
        &mut self,
        _ctx: &mut Context<'_, '_, CounterProtocol>,
        command: CounterCmd,
    ) -> Result<i64, EntityError> {
        match command {
            CounterCmd::Add(n) => self.value += n,
            CounterCmd::Get => {}
            CounterCmd::Fail => return Err(EntityError::Failed("asked to fail".into())),
            CounterCmd::Panic => panic!("asked to panic"),
        }
        Ok(self.value)
    }
}

fn counter_key() -> EntityTypeKey<CounterProtocol> {
    EntityTypeKey::new("tcounter").expect("key")
}

#[test]
fn typed_ask_and_tell_from_block_on_and_tokio() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(config(31_100, 31_100, dir.path())).expect("start");
    let key = counter_key();
    node.sharding()
        .start_typed(&key, |_| TypedCounter::default(), EntitySettings::default())
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");

    let a = node.typed_ref(&key, "a").expect("ref");
    assert_eq!(block_on(a.ask(CounterCmd::Add(2))).expect("ask"), 2);
    a.tell(CounterCmd::Add(3)).expect("tell");
    // The tell and the ask travel the same ring to the same entity, in order.
    assert_eq!(
        a.ask_blocking(CounterCmd::Get, Duration::from_secs(5))
            .expect("ask"),
        5
    );

    // A timeout too long for a clock waits for the answer.
    assert_eq!(
        block_on(a.ask_within(CounterCmd::Get, Duration::MAX)).expect("ask"),
        5
    );
    assert_eq!(
        a.raw().ask(&[1], Duration::MAX).expect("raw ask"),
        [10],
        "postcard: Get is variant 1; the reply 5 is the zigzag varint 10"
    );

    // From tokio: 200 concurrent asks on one thread, none blocks it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let refs: Vec<_> = (0..20)
        .map(|i| node.typed_ref(&key, &format!("t{i}")).expect("ref"))
        .collect();
    let sums = rt.block_on(async {
        let mut tasks = Vec::new();
        for r in refs.iter().cycle().take(200) {
            let r = r.clone();
            tasks.push(tokio::spawn(async move { r.ask(CounterCmd::Add(1)).await }));
        }
        for t in tasks {
            t.await.expect("task").expect("ask");
        }
        let mut sums = Vec::new();
        for r in &refs {
            sums.push(r.ask(CounterCmd::Get).await.expect("get"));
        }
        sums
    });
    assert_eq!(sums, vec![10; 20]);

    // The entity's failure keeps its message; bad bytes do not stop it.
    match a.ask_blocking(CounterCmd::Fail, Duration::from_secs(5)) {
        Err(AskError::Failed { status, payload }) => {
            assert_eq!(status, Status::EntityFailed);
            assert!(
                String::from_utf8_lossy(&payload).contains("asked to fail"),
                "{payload:?}"
            );
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    // A handler that panics fails its message; the entity is restarted by
    // its supervisor (its in-memory state starts again) and the data core
    // keeps serving every other entity.
    match a.ask_blocking(CounterCmd::Panic, Duration::from_secs(5)) {
        Err(AskError::Failed { status, .. }) => assert_eq!(status, Status::EntityFailed),
        other => panic!("expected Failed for a panicking handler, got {other:?}"),
    }
    assert_eq!(
        refs[0]
            .ask_blocking(CounterCmd::Get, Duration::from_secs(5))
            .expect("another entity after the panic"),
        10
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match a.ask_blocking(CounterCmd::Get, Duration::from_secs(2)) {
            Ok(v) => {
                assert_eq!(v, 0, "the restarted entity starts from its factory");
                break;
            }
            Err(e) => assert!(Instant::now() < deadline, "not restarted: {e:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let b = node.typed_ref(&key, "b").expect("ref");
    b.tell(CounterCmd::Add(7)).expect("tell");
    match b.raw().ask(&[0xff, 0xff, 0xff], Duration::from_secs(5)) {
        Err(shardline::AskError::Failed(Status::EntityFailed)) => {}
        other => panic!("expected EntityFailed for bad bytes, got {other:?}"),
    }
    assert_eq!(
        b.ask_blocking(CounterCmd::Get, Duration::from_secs(5))
            .expect("get"),
        7,
        "an undecodable message left the entity running"
    );

    // A command that cannot be sent is handed back.
    drop(node);
    match b.tell(CounterCmd::Add(9)) {
        Err(AskError::NotSent { command, reason }) => {
            assert_eq!(command, CounterCmd::Add(9));
            assert_eq!(reason, NotSent::Stopped);
        }
        other => panic!("expected NotSent, got {other:?}"),
    }
    match block_on(b.ask(CounterCmd::Add(4))) {
        Err(e) => assert_eq!(e.into_command(), Some(CounterCmd::Add(4))),
        Ok(v) => panic!("asked a stopped node: {v}"),
    }
}

// ----- a typed durable bank account -----

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum AccountCmd {
    Deposit(u64),
    Withdraw(u64),
    Balance,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum AccountEvent {
    Deposited(u64),
    Withdrawn(u64),
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
struct AccountState {
    balance: u64,
    operations: u32,
}

struct AccountProtocol;
impl Protocol for AccountProtocol {
    type Command = AccountCmd;
    /// The balance, or why the command was refused.
    type Reply = Result<u64, String>;
    type Codec = Postcard;
}

struct Account;

impl typed::PersistentEntity for Account {
    type Protocol = AccountProtocol;
    type Event = AccountEvent;
    type State = AccountState;
    type EventCodec = Postcard;
    type SnapshotCodec = Json;

    fn on_command(&self, state: &AccountState, command: AccountCmd) -> Effect<Self> {
        match command {
            AccountCmd::Deposit(n) => Effect::persist([AccountEvent::Deposited(n)])
                .then_reply(|s: &AccountState| Ok(s.balance)),
            AccountCmd::Withdraw(n) if n > state.balance => {
                Effect::reply(Err(format!("insufficient funds: {}", state.balance)))
            }
            AccountCmd::Withdraw(n) => Effect::persist([AccountEvent::Withdrawn(n)])
                .then_reply(|s: &AccountState| Ok(s.balance)),
            AccountCmd::Balance => Effect::reply(Ok(state.balance)),
        }
    }

    fn apply(&self, state: &mut AccountState, event: &AccountEvent) {
        match event {
            AccountEvent::Deposited(n) => state.balance += n,
            AccountEvent::Withdrawn(n) => state.balance -= n,
        }
        state.operations += 1;
    }
}

#[test]
fn a_typed_persistent_entity_recovers_after_its_node_restarts() {
    let dir = tempfile::tempdir().expect("tmp");
    let key = EntityTypeKey::<AccountProtocol>::new("account").expect("key");
    let start = || {
        let node = Node::start(config(31_110, 31_110, dir.path())).expect("start");
        node.sharding()
            .start_persistent(&key, |_| Account, 3, EntitySettings::default())
            .expect("region");
        node.wait_ready(Duration::from_secs(30)).expect("ready");
        node
    };
    let t = Duration::from_secs(5);
    let node = start();
    let alice = node.typed_ref(&key, "alice").expect("ref");
    for n in [10, 20, 30, 40] {
        let got = alice
            .ask_blocking(AccountCmd::Deposit(n), t)
            .expect("deposit");
        assert!(got.is_ok(), "{got:?}");
    }
    assert_eq!(
        alice
            .ask_blocking(AccountCmd::Withdraw(25), t)
            .expect("ask"),
        Ok(75)
    );
    assert_eq!(
        alice
            .ask_blocking(AccountCmd::Withdraw(1_000), t)
            .expect("ask"),
        Err("insufficient funds: 75".to_string())
    );
    let bob = node.typed_ref(&key, "bob").expect("ref");
    assert_eq!(
        block_on(bob.ask(AccountCmd::Deposit(5))).expect("ask"),
        Ok(5)
    );
    node.leave(Duration::from_secs(10));

    // Same data_dir: 5 events of alice (a snapshot after 3), 1 of bob.
    let node = start();
    let alice = node.typed_ref(&key, "alice").expect("ref");
    let bob = node.typed_ref(&key, "bob").expect("ref");
    assert_eq!(
        alice.ask_blocking(AccountCmd::Balance, t).expect("ask"),
        Ok(75)
    );
    assert_eq!(
        bob.ask_blocking(AccountCmd::Balance, t).expect("ask"),
        Ok(5)
    );
    assert_eq!(
        alice.ask_blocking(AccountCmd::Deposit(1), t).expect("ask"),
        Ok(76)
    );
    node.leave(Duration::from_secs(10));
}

// ----- timeouts and cancellation -----

/// Never answers: takes over each reply and drops it (counts messages).
#[derive(Default)]
struct Blackhole {
    seen: u64,
}

impl Entity for Blackhole {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if message == b"seen" {
            ctx.reply(self.seen.to_string());
            return Ok(());
        }
        self.seen += 1;
        let _never_completed = ctx.defer_reply();
        Ok(())
    }
}

struct BlackholeProtocol;
impl Protocol for BlackholeProtocol {
    type Command = String;
    type Reply = String;
    type Codec = Json;
}

#[test]
fn an_ask_times_out_and_a_dropped_ask_is_still_handled_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(config(31_130, 31_130, dir.path())).expect("start");
    let key = counter_key();
    node.sharding()
        .start_typed(&key, |_| TypedCounter::default(), EntitySettings::default())
        .expect("region");
    node.sharding()
        .start(
            "blackhole",
            Arc::new(|_| Box::<Blackhole>::default()),
            EntitySettings::default(),
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");

    // Typed: no answer by the wait (timeout 300 ms, at least 1 s past the
    // deadline) resolves the future to TimedOut, from the data core.
    let hole = node
        .typed_ref(
            &EntityTypeKey::<BlackholeProtocol>::new("blackhole").expect("key"),
            "h",
        )
        .expect("ref");
    let t0 = Instant::now();
    let r = block_on(hole.ask_within("x".to_string(), Duration::from_millis(300)));
    let took = t0.elapsed();
    assert!(matches!(r, Err(AskError::TimedOut)), "{r:?}");
    assert!(
        (Duration::from_millis(1_250)..Duration::from_secs(5)).contains(&took),
        "{took:?}"
    );
    // Byte level, async and blocking.
    let raw = node.entity_ref("blackhole", "h").expect("ref");
    let fut = raw
        .ask_async(b"y".to_vec(), Duration::from_secs(2))
        .expect("sent");
    let t0 = Instant::now();
    assert!(matches!(block_on(fut), Err(shardline::AskError::TimedOut)));
    assert!(t0.elapsed() >= Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(matches!(
        raw.ask(b"z", Duration::from_millis(200)),
        Err(shardline::AskError::TimedOut)
    ));
    assert_eq!(raw.ask(b"seen", Duration::from_secs(5)).expect("ask"), b"3");

    // A dropped future: the command is still handled, once; its reply is
    // discarded and the next asks are answered as usual.
    let c = node.typed_ref(&key, "c").expect("ref");
    let fut = c.ask(CounterCmd::Add(10));
    drop(fut);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    rt.block_on(async {
        // A pending future cancelled by a timeout: its command was
        // handled (the blackhole counted it) although nobody waits.
        let r = tokio::time::timeout(
            Duration::from_millis(50),
            hole.ask_within("w".to_string(), Duration::from_secs(5)),
        )
        .await;
        assert!(r.is_err(), "the blackhole answered: {r:?}");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let v = c.ask(CounterCmd::Get).await.expect("get");
            if v == 10 {
                break;
            }
            assert!(v < 10 && Instant::now() < deadline, "value {v}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(c.ask(CounterCmd::Add(1)).await.expect("add"), 11);
    });
    assert_eq!(raw.ask(b"seen", Duration::from_secs(5)).expect("ask"), b"4");
    node.leave(Duration::from_secs(10));
}

// ----- an ask between entities on two nodes -----

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum AskerCmd {
    /// Ask counter `target` to add `n` (on whichever node it lives).
    AddVia { target: String, n: i64 },
    /// Ask the blackhole (times out after 300 ms).
    AskHole,
    /// The adapted answer of an ask.
    Got(Result<i64, String>),
    /// The last answer so far.
    Last,
}

/// What an asker answers: the last answer of its asks.
type Last = Option<Result<i64, String>>;

struct AskerProtocol;
impl Protocol for AskerProtocol {
    type Command = AskerCmd;
    type Reply = Option<Result<i64, String>>;
    type Codec = Postcard;
}

#[derive(Default)]
struct Asker {
    last: Option<Result<i64, String>>,
}

impl typed::Entity for Asker {
    type Protocol = AskerProtocol;
    fn handle(
        &mut self,
        ctx: &mut Context<'_, '_, AskerProtocol>,
        command: AskerCmd,
    ) -> Result<Option<Result<i64, String>>, EntityError> {
        let adapt = |r: Result<i64, EntityAskFailure>| AskerCmd::Got(r.map_err(|e| e.to_string()));
        match command {
            AskerCmd::AddVia { target, n } => {
                let id = EntityId::new(target).map_err(|e| EntityError::Failed(e.to_string()))?;
                ctx.ask(
                    &counter_key(),
                    &id,
                    &CounterCmd::Add(n),
                    Duration::from_secs(5),
                    adapt,
                )
                .map_err(|e| EntityError::Failed(e.to_string()))?;
            }
            AskerCmd::AskHole => {
                let key = EntityTypeKey::<BlackholeProtocol>::new("blackhole").expect("key");
                let id = EntityId::new("h").expect("id");
                ctx.ask(
                    &key,
                    &id,
                    &"ping".to_string(),
                    Duration::from_millis(300),
                    |r| AskerCmd::Got(r.map(|s| s.len() as i64).map_err(|e| e.to_string())),
                )
                .map_err(|e| EntityError::Failed(e.to_string()))?;
            }
            AskerCmd::Got(r) => self.last = Some(r),
            AskerCmd::Last => {}
        }
        Ok(self.last.clone())
    }
}

#[test]
fn an_entity_asks_an_entity_on_another_node() {
    let dir = tempfile::tempdir().expect("tmp");
    let a = Node::start(config(31_140, 31_140, dir.path())).expect("start a");
    let counters = counter_key();
    let askers = EntityTypeKey::<AskerProtocol>::new("asker").expect("key");
    a.sharding()
        .start_typed(&askers, |_| Asker::default(), EntitySettings::default())
        .expect("askers");
    a.sharding().start_proxy("tcounter").expect("proxy");
    a.sharding().start_proxy("blackhole").expect("proxy");
    a.wait_ready(Duration::from_secs(30)).expect("a ready");
    let b = Node::start(config(31_141, 31_140, dir.path())).expect("start b");
    // The counters and the blackhole live on b only, the askers on a only.
    b.sharding()
        .start_typed(
            &counters,
            |_| TypedCounter::default(),
            EntitySettings::default(),
        )
        .expect("counters");
    b.sharding()
        .start(
            "blackhole",
            Arc::new(|_| Box::<Blackhole>::default()),
            EntitySettings::default(),
        )
        .expect("blackhole");
    b.sharding().start_proxy("asker").expect("proxy");
    b.wait_ready(Duration::from_secs(30)).expect("b ready");
    a.wait_ready(Duration::from_secs(30)).expect("a ready");

    let t = Duration::from_secs(5);
    let x = a.typed_ref(&askers, "x").expect("ref");
    let wait_last = |want: &dyn Fn(&Last) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let last = x.ask_blocking(AskerCmd::Last, t).expect("last");
            if want(&last) {
                return last;
            }
            assert!(Instant::now() < deadline, "last answer {last:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    x.ask_blocking(
        AskerCmd::AddVia {
            target: "c1".into(),
            n: 4,
        },
        t,
    )
    .expect("ask");
    assert_eq!(wait_last(&|l| l.is_some()), Some(Ok(4)));
    x.ask_blocking(
        AskerCmd::AddVia {
            target: "c1".into(),
            n: 3,
        },
        t,
    )
    .expect("ask");
    assert_eq!(wait_last(&|l| *l == Some(Ok(7))), Some(Ok(7)));
    // The counter is on b: asked there, it has both adds.
    let c1 = b.typed_ref(&counters, "c1").expect("ref");
    assert_eq!(c1.ask_blocking(CounterCmd::Get, t).expect("get"), 7);
    // The entity's ask times out after its 300 ms: the adapter gets TimedOut.
    let t0 = Instant::now();
    x.ask_blocking(AskerCmd::AskHole, t).expect("ask");
    let last = wait_last(&|l| matches!(l, Some(Err(_))));
    assert_eq!(last, Some(Err("ask timed out".to_string())));
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    b.leave(Duration::from_secs(10));
    a.leave(Duration::from_secs(10));
}
