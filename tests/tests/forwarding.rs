//! `EntityContext::forward` through the public embedding API: the target
//! answers the original sender, and a forward keeps the ask deadline of
//! the message being handled, so a forward still waiting when its sender
//! stopped waiting is answered `Unavailable` and never delivered later.
//! One embedded node in this process, ports 31400-31599 (fixed test ports
//! stay below 32768, where the kernel's ephemeral range begins: an outgoing
//! connection elsewhere in the run can hold a port above it).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline::client::Status;
use shardline::{AskError, Entity, EntityContext, EntityError, EntityId, EntitySettings, Node};
use shardline::{EntityFactory, NodeConfig};

/// `fwd <ms> <id>`: sleeps `ms` (blocking its core, as a slow handler
/// does), then forwards `add` to `sink/<id>`.
struct Relay;

impl Entity for Relay {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let text = std::str::from_utf8(message).map_err(|e| EntityError::Failed(e.to_string()))?;
        let words: Vec<&str> = text.split(' ').collect();
        let ["fwd", ms, id] = words.as_slice() else {
            return Err(EntityError::Failed(format!("unknown message {text:?}")));
        };
        let ms: u64 = ms
            .parse()
            .map_err(|_| EntityError::Failed("bad ms".into()))?;
        let id = EntityId::new(*id).map_err(|e| EntityError::Failed(e.to_string()))?;
        std::thread::sleep(Duration::from_millis(ms));
        ctx.forward("sink", &id, "add");
        Ok(())
    }
}

/// Counts the `add`s it was given (across all sinks) and answers
/// `added <n>` with its own count.
struct Sink {
    mine: u64,
    all: Arc<AtomicU64>,
}

impl Entity for Sink {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if message != b"add" {
            return Err(EntityError::Failed("unknown message".into()));
        }
        self.mine += 1;
        self.all.fetch_add(1, Ordering::SeqCst);
        ctx.reply(format!("added {}", self.mine));
        Ok(())
    }
}

fn start(port: u16, dir: &std::path::Path) -> (Node, Arc<AtomicU64>) {
    let addr = |p: u16| format!("127.0.0.1:{p}").parse().expect("addr");
    // One data core: the relay's sleep holds the sink's core too.
    let config = NodeConfig::builder(addr(port), addr(port + 100), dir.join(port.to_string()))
        .seed_nodes([addr(port)])
        .pin_cores(false)
        .data_cores(1)
        .number_of_shards(8)
        .build()
        .expect("config");
    let node = Node::start(config).expect("start");
    let all = Arc::new(AtomicU64::new(0));
    let relay: EntityFactory = Arc::new(|_| Box::new(Relay));
    let counted = all.clone();
    let sink: EntityFactory = Arc::new(move |_| {
        Box::new(Sink {
            mine: 0,
            all: counted.clone(),
        })
    });
    node.sharding()
        .start("relay", relay, EntitySettings::default())
        .expect("relay");
    node.sharding()
        .start("sink", sink, EntitySettings::default())
        .expect("sink");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    (node, all)
}

#[test]
fn a_forward_is_answered_by_its_target_and_keeps_the_senders_deadline() {
    let dir = tempfile::tempdir().expect("tmp");
    let (node, all) = start(31_400, dir.path());
    let relay = node.entity_ref("relay", "r1").expect("ref");

    // The target's reply goes to the original sender.
    let reply = relay
        .ask(b"fwd 0 s1", Duration::from_secs(10))
        .expect("forwarded ask");
    assert_eq!(reply, b"added 1");
    let reply = relay
        .ask(b"fwd 0 s1", Duration::from_secs(10))
        .expect("forwarded ask");
    assert_eq!(reply, b"added 2");
    assert_eq!(all.load(Ordering::SeqCst), 2);

    // The relay takes 400 ms; the sender waits 100 ms. The forward then
    // carries a deadline that has passed: it is refused as not delivered,
    // and the sink never sees it.
    let began = Instant::now();
    match relay.ask(b"fwd 400 s1", Duration::from_millis(100)) {
        Err(AskError::Failed(Status::Unavailable)) | Err(AskError::TimedOut) => {}
        r => panic!("expected Unavailable or TimedOut, got {r:?}"),
    }
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "{:?}",
        began.elapsed()
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        all.load(Ordering::SeqCst),
        2,
        "a forward past its sender's deadline was delivered"
    );
    // The sink is intact and counts on from where it was.
    let reply = relay
        .ask(b"fwd 0 s1", Duration::from_secs(10))
        .expect("forwarded ask");
    assert_eq!(reply, b"added 3");
    drop(node);
}
