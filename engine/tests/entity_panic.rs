//! A panic in the code of an entity registered with the raw
//! `Sharding::start` (no supervisor) or of a stateless worker is caught on
//! its data core: the asker gets `EntityFailed` at once, the next message
//! starts a fresh incarnation, the other entities of the core keep
//! serving, and the node still leaves in time. One embedded node with one
//! data core in this process, ports 31600-31699 (below the kernel's
//! ephemeral range).

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::client::Status;
use shardline::entity::worker::WorkerSettings;
use shardline::{AskError, Entity, EntityContext, EntityError, EntityFactory, EntitySettings};
use shardline::{Node, NodeConfig};

/// `inc` answers how many `inc`s this incarnation had; `boom` panics in
/// the handler; `tick` arms a timer whose callback panics. The entity
/// `bad-start` panics in `on_start`.
#[derive(Default)]
struct Fragile {
    n: u64,
}

impl Entity for Fragile {
    fn on_start(&mut self, ctx: &mut EntityContext<'_>) {
        if ctx.self_id().as_str() == "bad-start" {
            panic!("start of bad-start");
        }
    }

    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        match message {
            b"inc" => {
                self.n += 1;
                ctx.reply(self.n.to_string());
            }
            b"boom" => panic!("boom requested"),
            b"tick" => {
                ctx.set_timer(7, Duration::from_millis(10));
                ctx.reply("armed");
            }
            _ => return Err(EntityError::Failed("unknown message".into())),
        }
        Ok(())
    }

    fn on_timer(&mut self, _ctx: &mut EntityContext<'_>, _key: u64) {
        panic!("timer of a fragile entity");
    }
}

/// A stateless worker: `boom` panics, anything else is echoed.
struct FragileWorker;

impl Entity for FragileWorker {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if message == b"boom" {
            panic!("worker boom");
        }
        ctx.reply(message.to_vec());
        Ok(())
    }
}

fn start(port: u16, dir: &std::path::Path) -> Node {
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    // One data core: every entity below shares the core that panics.
    let config = NodeConfig::builder(addr(port), addr(port + 50), dir.join(port.to_string()))
        .seed_nodes([addr(port)])
        .pin_cores(false)
        .data_cores(1)
        .number_of_shards(8)
        .build()
        .expect("config");
    let node = Node::start(config).expect("start");
    let fragile: EntityFactory = Arc::new(|_| Box::<Fragile>::default());
    node.sharding()
        .start("fragile", fragile, EntitySettings::default())
        .expect("fragile");
    let worker: EntityFactory = Arc::new(|_| Box::new(FragileWorker));
    node.sharding()
        .start_stateless_worker(
            "fragile_worker",
            worker,
            WorkerSettings::default(),
            EntitySettings::default(),
        )
        .expect("worker");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    node
}

fn ask(node: &Node, t: &str, id: &str, msg: &[u8]) -> Result<Vec<u8>, AskError> {
    node.entity_ref(t, id)
        .expect("ref")
        .ask(msg, Duration::from_secs(10))
}

/// Asks `msg` and expects `EntityFailed` well within the ask's 10 s.
fn expect_failed(node: &Node, t: &str, id: &str, msg: &[u8]) {
    let t0 = Instant::now();
    let r = ask(node, t, id, msg);
    let took = t0.elapsed();
    assert!(
        matches!(r, Err(AskError::Failed(Status::EntityFailed))),
        "{t}/{id} {}: {r:?} after {took:?}",
        String::from_utf8_lossy(msg)
    );
    assert!(took < Duration::from_secs(2), "{t}/{id}: took {took:?}");
}

fn expect_ok(node: &Node, t: &str, id: &str, msg: &[u8], want: &str) {
    let got = ask(node, t, id, msg).unwrap_or_else(|e| panic!("{t}/{id}: {e:?}"));
    assert_eq!(String::from_utf8_lossy(&got), want, "{t}/{id}");
}

#[test]
fn a_panicking_raw_entity_fails_its_incarnation_and_the_core_keeps_serving() {
    let dir = tempfile::tempdir().expect("tmp");
    let node = start(31_600, dir.path());

    expect_ok(&node, "fragile", "a", b"inc", "1");
    expect_ok(&node, "fragile", "a", b"inc", "2");
    expect_ok(&node, "fragile", "b", b"inc", "1");

    // The handler panics: the asker hears EntityFailed at once.
    expect_failed(&node, "fragile", "a", b"boom");
    // A fresh incarnation (its count starts again); the other entity of
    // the core kept its state.
    expect_ok(&node, "fragile", "a", b"inc", "1");
    expect_ok(&node, "fragile", "b", b"inc", "2");

    // Again, many times: every panic is caught.
    for _ in 0..20 {
        expect_failed(&node, "fragile", "a", b"boom");
    }
    expect_ok(&node, "fragile", "a", b"inc", "1");

    // `on_start` panics: the message that started it fails at once, and so
    // does the next (each one starts a fresh incarnation, which panics).
    expect_failed(&node, "fragile", "bad-start", b"inc");
    expect_failed(&node, "fragile", "bad-start", b"inc");
    expect_ok(&node, "fragile", "b", b"inc", "3");

    // A timer's callback panics: the incarnation fails (nobody to answer),
    // the next message starts a fresh one.
    expect_ok(&node, "fragile", "c", b"inc", "1");
    expect_ok(&node, "fragile", "c", b"tick", "armed");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // `inc` answers 1 once the failed incarnation is gone.
        let got = ask(&node, "fragile", "c", b"inc").expect("ask c");
        if got == b"1" {
            break;
        }
        assert!(Instant::now() < deadline, "c kept its state: {got:?}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // A stateless worker's handler panics: its request fails at once and
    // the pool keeps serving.
    expect_ok(&node, "fragile_worker", "w", b"hi", "hi");
    expect_failed(&node, "fragile_worker", "w", b"boom");
    expect_ok(&node, "fragile_worker", "w", b"again", "again");

    expect_ok(&node, "fragile", "b", b"inc", "4");
    assert!(!node.is_stopped());

    // The core still runs its control messages: the hand-off finishes and
    // the node leaves well within the timeout (a dead core made leave wait
    // all of it).
    let t0 = Instant::now();
    node.leave(Duration::from_secs(20));
    let took = t0.elapsed();
    assert!(took < Duration::from_secs(10), "leave took {took:?}");
}
