//! The embedding API in one process: a user entity type with timers,
//! `passivate` and idle passivation, asked through `EntityRef` and through
//! the native client; a proxy-only node routes to it.

use std::sync::Arc;
use std::time::Duration;

use shardline::client::{Client, Status};
use shardline::config::{Durability, DurabilityName};
use shardline::{AskError, Entity, EntityContext, EntityError, EntitySettings, Node, NodeConfig};

/// Counts how often its timer fired; `fail` makes it fail.
#[derive(Default)]
pub(super) struct Ticker {
    fired: u64,
}

impl Entity for Ticker {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        match message {
            b"start" => {
                ctx.set_timer(1, Duration::from_millis(30));
                ctx.reply("started");
            }
            b"count" => ctx.reply(self.fired.to_string()),
            b"stop" => {
                ctx.passivate();
                ctx.reply("stopping");
            }
            b"fail" => return Err(EntityError::Failed("asked to fail".into())),
            _ => ctx.reply(format!(
                "{}:{}",
                ctx.self_id(),
                String::from_utf8_lossy(message)
            )),
        }
        Ok(())
    }

    fn on_timer(&mut self, _ctx: &mut EntityContext<'_>, key: u64) {
        assert_eq!(key, 1);
        self.fired += 1;
    }
}

pub(super) fn config(port: u16, seeds: &[u16], dir: &std::path::Path) -> NodeConfig {
    NodeConfig {
        cluster_address: format!("127.0.0.1:{port}").parse().expect("addr"),
        client_address: format!("127.0.0.1:{}", port + 50).parse().expect("addr"),
        http_address: None,
        seed_nodes: seeds
            .iter()
            .map(|p| format!("127.0.0.1:{p}").parse().expect("addr"))
            .collect(),
        data_cores: 1,
        pin_cores: false,
        cluster_name: shardline::config::DEFAULT_CLUSTER_NAME.to_string(),
        data_dir: dir.join(port.to_string()),
        number_of_shards: 8,
        durability: Durability::Named(DurabilityName::None),
        entity_types: Vec::new(),
        downing_stable_after_ms: 2_000,
        heartbeat_pause_ms: 1_500,
        http: Default::default(),
        journal: Default::default(),
        requests: Default::default(),
        coordinator: Default::default(),
        cluster: Default::default(),
    }
}

fn wait_for(node: &Node, id: &str, msg: &[u8], want: &str) {
    let r = node.entity_ref("ticker", id).expect("ref");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let got = r.ask(msg, Duration::from_secs(5)).expect("ask");
        if got == want.as_bytes() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id}: got {:?}, want {want}",
            String::from_utf8_lossy(&got)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The embedding API's asks carry the deadline of HTTP and native
/// requests: on a node that cannot join (its only seed does not answer),
/// so its region buffers every message while it asks for shard homes, an
/// ask is answered `Unavailable` (not delivered, safe to retry) at its
/// deadline — `requests.ask_timeout_ms` (300 ms here) when the caller's
/// timeout is longer, the caller's timeout when it is shorter — instead of
/// waiting out the caller's timeout and answering `TimedOut`.
#[test]
fn an_embedded_ask_buffered_past_its_deadline_is_answered_unavailable() {
    let _one_at_a_time = super::support::serial();
    let dir = tempfile::tempdir().expect("tmp");
    let mut cfg = config(23_720, &[23_721], dir.path());
    cfg.requests.ask_timeout_ms = 300;
    let node = Node::start(cfg).expect("start");
    node.sharding()
        .start(
            "ticker",
            Arc::new(|_| Box::<Ticker>::default()),
            EntitySettings::default(),
        )
        .expect("region");
    let t = node.entity_ref("ticker", "t1").expect("ref");
    for (timeout, at_least, below) in [
        (Duration::from_secs(10), 300, 1_300),
        (Duration::from_millis(150), 150, 1_150),
    ] {
        let t0 = std::time::Instant::now();
        let r = t.ask(b"start", timeout);
        let took = t0.elapsed().as_millis();
        assert!(
            matches!(r, Err(AskError::Failed(Status::Unavailable))),
            "timeout {timeout:?}: {r:?} after {took} ms"
        );
        assert!(
            (at_least..below).contains(&took),
            "timeout {timeout:?}: answered after {took} ms"
        );
    }
    let st = Client::connect("127.0.0.1:23770".parse().expect("addr"))
        .expect("connect")
        .node_status(Duration::from_secs(5))
        .expect("status");
    let passed: u64 = st
        .regions
        .iter()
        .filter_map(|r| r.dead_letter_reasons.get("deadline_passed"))
        .sum();
    assert_eq!(passed, 2, "{:?}", st.regions);
}

#[test]
fn embedded_entity_with_timers_passivation_and_a_proxy() {
    let _one_at_a_time = super::support::serial();
    let dir = tempfile::tempdir().expect("tmp");
    let node = Node::start(config(23_700, &[23_700], dir.path())).expect("start");
    node.sharding()
        .start(
            "ticker",
            Arc::new(|_| Box::<Ticker>::default()),
            EntitySettings {
                idle_timeout: Some(Duration::from_millis(400)),
                ..EntitySettings::default()
            },
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");

    let t = node.entity_ref("ticker", "t1").expect("ref");
    assert_eq!(
        t.ask(b"start", Duration::from_secs(5)).expect("ask"),
        b"started"
    );
    wait_for(&node, "t1", b"count", "1"); // the timer fired once
                                          // Passivate: the next message goes to a fresh incarnation.
    assert_eq!(
        t.ask(b"stop", Duration::from_secs(5)).expect("ask"),
        b"stopping"
    );
    wait_for(&node, "t1", b"count", "0");
    // A failing handler answers EntityFailed; the next message starts anew.
    assert_eq!(
        t.ask(b"start", Duration::from_secs(5)).expect("ask"),
        b"started"
    );
    wait_for(&node, "t1", b"count", "1");
    match t.ask(b"fail", Duration::from_secs(5)) {
        Err(AskError::Failed(Status::EntityFailed)) => {}
        other => panic!("expected EntityFailed, got {other:?}"),
    }
    wait_for(&node, "t1", b"count", "0");
    // Idle passivation (400 ms): the timer state is gone after idling.
    assert_eq!(
        t.ask(b"start", Duration::from_secs(5)).expect("ask"),
        b"started"
    );
    wait_for(&node, "t1", b"count", "1");
    std::thread::sleep(Duration::from_millis(1_500));
    assert_eq!(t.ask(b"count", Duration::from_secs(5)).expect("ask"), b"0");
    // tell: no reply, but delivered.
    t.tell(b"start").expect("tell");
    wait_for(&node, "t1", b"count", "1");

    // The native client reaches the user type too.
    let mut c = Client::connect("127.0.0.1:23750".parse().expect("addr")).expect("connect");
    let r = c
        .ask("ticker", "t2", b"hi", Duration::from_secs(5))
        .expect("ask");
    assert_eq!(
        (r.status, r.payload.as_slice()),
        (Status::Ok, &b"t2:hi"[..])
    );

    // A second node with only a proxy for the type routes to the first.
    let proxy = Node::start(config(23_701, &[23_700], dir.path())).expect("start proxy node");
    proxy.sharding().start_proxy("ticker").expect("proxy");
    proxy
        .wait_ready(Duration::from_secs(30))
        .expect("proxy ready");
    let via = proxy.entity_ref("ticker", "t3").expect("ref");
    assert_eq!(
        via.ask(b"x", Duration::from_secs(10))
            .expect("ask via proxy"),
        b"t3:x"
    );
    let st = Client::connect("127.0.0.1:23751".parse().expect("addr"))
        .expect("connect")
        .node_status(Duration::from_secs(5))
        .expect("status");
    assert!(st
        .regions
        .iter()
        .any(|r| r.type_name == "ticker" && r.proxy && r.entities == 0));

    proxy.leave(Duration::from_secs(10));
    node.leave(Duration::from_secs(10));
}
