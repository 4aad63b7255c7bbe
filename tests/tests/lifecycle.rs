//! Lifecycle monitoring (watch / `Terminated`) and supervision settings
//! from the config, through the public embedding API: embedded nodes in
//! this process, ports 25200-25399.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardline::client::Status;
use shardline::entity::supervision::supervised;
use shardline::{
    AskError, Entity, EntityContext, EntityError, EntityFactory, EntitySettings, Node, NodeConfig,
    TerminatedReason,
};
use shardline_core::ids::EntityId;

/// What the probes saw (`"<watcher> saw <type>/<id> <reason>"`) and where
/// each incarnation was created (`id -> [place]`).
#[derive(Default)]
struct Log {
    seen: Mutex<Vec<String>>,
    created: Mutex<HashMap<String, Vec<String>>>,
}

impl Log {
    fn saw(&self, line: &str) -> bool {
        self.seen.lock().expect("lock").iter().any(|l| l == line)
    }

    fn created(&self, id: &str) -> Vec<String> {
        self.created
            .lock()
            .expect("lock")
            .get(id)
            .cloned()
            .unwrap_or_default()
    }

    /// Waits (up to 30 s) until `line` was seen.
    fn wait_saw(&self, line: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.saw(line) {
            assert!(
                Instant::now() < deadline,
                "never saw `{line}`; seen: {:?}",
                self.seen.lock().expect("lock")
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// `watch T ID`, `unwatch T ID`, `stop` (passivate), `fail` (handler
/// error), `boom` (panic), else `pong`. Records its `Terminated` notices.
struct Probe {
    log: Arc<Log>,
}

impl Entity for Probe {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let text = std::str::from_utf8(message).map_err(|e| EntityError::Failed(e.to_string()))?;
        let words: Vec<&str> = text.split(' ').collect();
        match words.as_slice() {
            ["watch", t, id] | ["unwatch", t, id] => {
                let id = EntityId::new(*id).map_err(|e| EntityError::Failed(e.to_string()))?;
                if words[0] == "watch" {
                    ctx.watch(t, &id);
                } else {
                    ctx.unwatch(t, &id);
                }
                ctx.reply("ok");
            }
            ["stop"] => {
                ctx.passivate();
                ctx.reply("stopping");
            }
            ["fail"] => return Err(EntityError::Failed("asked to fail".into())),
            ["boom"] => panic!("asked to panic"),
            _ => ctx.reply("pong"),
        }
        Ok(())
    }

    fn on_terminated(
        &mut self,
        ctx: &mut EntityContext<'_>,
        type_name: &str,
        entity_id: &EntityId,
        reason: TerminatedReason,
    ) {
        let line = format!("{} saw {type_name}/{entity_id} {reason:?}", ctx.self_id());
        self.log.seen.lock().expect("lock").push(line);
    }
}

/// A probe factory recording where each incarnation starts: `label` plus
/// the executor thread's name (one per data core).
fn probes(log: &Arc<Log>, label: &'static str) -> EntityFactory {
    let log = log.clone();
    Arc::new(move |id| {
        let place = format!("{label}/{}", std::thread::current().name().unwrap_or("?"));
        log.created
            .lock()
            .expect("lock")
            .entry(id.as_str().to_string())
            .or_default()
            .push(place);
        Box::new(Probe { log: log.clone() })
    })
}

fn config(port: u16, seed: u16, data_cores: u16, dir: &Path) -> NodeConfig {
    let text = format!(
        r#"
cluster_address = "127.0.0.1:{port}"
client_address = "127.0.0.1:{client}"
seed_nodes = ["127.0.0.1:{seed}"]
data_cores = {data_cores}
pin_cores = false
data_dir = "{dir}"
number_of_shards = 16
downing_stable_after_ms = 1000
heartbeat_pause_ms = 1000
# These tests place entities by on-demand allocation (a shard goes to the
# region with the fewest shards when first used), not by a warm batch.
[coordinator]
warm_allocation = false
"#,
        client = port + 100,
        dir = dir.join(port.to_string()).display(),
    );
    NodeConfig::from_toml(&text, Path::new("lifecycle.toml")).expect("config")
}

fn ask(node: &Node, t: &str, id: &str, msg: &str) -> Result<String, AskError> {
    let r = node.entity_ref(t, id).expect("ref");
    r.ask(msg.as_bytes(), Duration::from_secs(10))
        .map(|v| String::from_utf8_lossy(&v).into_owned())
}

fn ok(node: &Node, id: &str, msg: &str) -> String {
    ask(node, "w", id, msg).unwrap_or_else(|e| panic!("{id} {msg}: {e:?}"))
}

#[test]
fn watch_on_one_core_across_cores_after_stop_unwatch_and_watcher_stop() {
    let dir = tempfile::tempdir().expect("tmp");
    let log = Arc::new(Log::default());
    let node = Node::start(config(25_200, 25_200, 2, dir.path())).expect("start");
    node.sharding()
        .start("w", probes(&log, "n"), EntitySettings::default())
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let ids: Vec<String> = (0..24).map(|i| format!("p{i}")).collect();
    for id in &ids {
        assert_eq!(ok(&node, id, "ping"), "pong");
    }
    let place = |id: &str| log.created(id)[0].clone();
    let watcher = ids[0].as_str();
    let same: Vec<&str> = ids[1..]
        .iter()
        .map(|s| s.as_str())
        .filter(|id| place(id) == place(watcher))
        .collect();
    let other: Vec<&str> = ids[1..]
        .iter()
        .map(|s| s.as_str())
        .filter(|id| place(id) != place(watcher))
        .collect();
    assert!(
        same.len() >= 2 && other.len() >= 5,
        "entities on both cores: same {same:?}, other {other:?}"
    );

    // Same core and across cores: passivation of the watched entity.
    for target in [same[0], other[0]] {
        assert_eq!(ok(&node, watcher, &format!("watch w {target}")), "ok");
        assert_eq!(ok(&node, target, "stop"), "stopping");
        log.wait_saw(&format!("{watcher} saw w/{target} Stopped"));
    }

    // Watch after stop (and of an entity that never ran): at once, and
    // the watch creates nothing.
    assert_eq!(ok(&node, watcher, &format!("watch w {}", other[0])), "ok");
    log.wait_saw(&format!("{watcher} saw w/{} NotActive", other[0]));
    assert_eq!(ok(&node, watcher, "watch w never-started"), "ok");
    log.wait_saw(&format!("{watcher} saw w/never-started NotActive"));
    assert!(
        log.created("never-started").is_empty(),
        "a watch created it"
    );
    assert_eq!(log.created(other[0]).len(), 1, "a watch restarted it");
    // Nor does any region count it as live.
    let mut client =
        shardline::client::Client::connect(node.config().client_address).expect("connect");
    let status = client.node_status(Duration::from_secs(10)).expect("status");
    for r in &status.regions {
        for ids in r.shards.values() {
            for gone in ["never-started", other[0]] {
                assert!(!ids.iter().any(|i| i == gone), "{gone} live in {r:?}");
            }
        }
    }

    // A handler error stops the (unsupervised) entity: reason Failed.
    assert_eq!(ok(&node, watcher, &format!("watch w {}", other[1])), "ok");
    match ask(&node, "w", other[1], "fail") {
        Err(AskError::Failed(Status::EntityFailed)) => {}
        r => panic!("expected EntityFailed, got {r:?}"),
    }
    log.wait_saw(&format!("{watcher} saw w/{} Failed", other[1]));

    // Unwatch: no notice, even though the entity stops afterwards.
    let (unwatched, sentinel) = (other[2], other[3]);
    assert_eq!(ok(&node, watcher, &format!("watch w {unwatched}")), "ok");
    assert_eq!(ok(&node, watcher, &format!("unwatch w {unwatched}")), "ok");
    assert_eq!(ok(&node, unwatched, "stop"), "stopping");

    // The watcher stops: its watches are dropped, and the target's stop
    // neither reaches it nor starts it again.
    let (quitter, target) = (same[1], other[4]);
    assert_eq!(ok(&node, quitter, &format!("watch w {target}")), "ok");
    assert_eq!(ok(&node, quitter, "stop"), "stopping");
    assert_eq!(ok(&node, target, "stop"), "stopping");

    // A later watch's notice arrives; the others never do.
    assert_eq!(ok(&node, watcher, &format!("watch w {sentinel}")), "ok");
    assert_eq!(ok(&node, sentinel, "stop"), "stopping");
    log.wait_saw(&format!("{watcher} saw w/{sentinel} Stopped"));
    std::thread::sleep(Duration::from_millis(200));
    let seen = log.seen.lock().expect("lock").clone();
    assert!(
        !seen.iter().any(|l| l.contains(&format!("w/{unwatched} "))),
        "unwatched notice delivered: {seen:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|l| l.starts_with(&format!("{quitter} saw"))),
        "stopped watcher got a notice: {seen:?}"
    );
    assert_eq!(
        log.created(quitter).len(),
        1,
        "a notice restarted the watcher"
    );
    // Every watch got at most one notice.
    let mut dedup = seen.clone();
    dedup.sort();
    dedup.dedup();
    assert_eq!(dedup.len(), seen.len(), "{seen:?}");
    drop(node);
}

#[test]
fn configured_max_restarts_stop_a_panicking_entity_and_watchers_hear_failed() {
    let dir = tempfile::tempdir().expect("tmp");
    let log = Arc::new(Log::default());
    let mut cfg = config(25_210, 25_210, 1, dir.path());
    // The supervision keys of an [[entity_types]] table, as an operator
    // writes them; the settings drive a user type's supervisor here.
    let text = r#"
cluster_address = "127.0.0.1:25210"
client_address = "127.0.0.1:25310"
data_dir = "/unused"
seed_nodes = ["127.0.0.1:25210"]
[[entity_types]]
name = "fragile"
kind = "echo"
restart_min_backoff_ms = 2000
restart_max_backoff_ms = 2000
restart_random_factor = 0.0
max_restarts = 2
restart_window_ms = 60000
"#;
    let parsed = NodeConfig::from_toml(text, Path::new("fragile.toml")).expect("config");
    let settings =
        shardline::entity::supervision::SupervisorSettings::of_type(&parsed.entity_types[0]);
    assert_eq!(settings.max_restarts, 2);
    cfg.entity_types.clear();
    let node = Node::start(cfg).expect("start");
    node.sharding()
        .start("w", probes(&log, "n"), EntitySettings::default())
        .expect("region");
    node.sharding()
        .start(
            "fragile",
            supervised(probes(&log, "n"), settings),
            EntitySettings::default(),
        )
        .expect("region");
    node.wait_ready(Duration::from_secs(30)).expect("ready");
    let fragile = |msg: &str| ask(&node, "fragile", "victim", msg);
    assert_eq!(fragile("ping").expect("ping"), "pong");
    assert_eq!(ok(&node, "watcher", "watch fragile victim"), "ok");
    let failed = |r: Result<String, AskError>| {
        assert!(
            matches!(r, Err(AskError::Failed(Status::EntityFailed))),
            "expected EntityFailed, got {r:?}"
        )
    };
    for round in 0..2 {
        failed(fragile("boom"));
        // Backing off (2 s): answered EntityFailed, not restarted yet.
        failed(fragile("ping"));
        let deadline = Instant::now() + Duration::from_secs(20);
        while fragile("ping").is_err() {
            assert!(Instant::now() < deadline, "round {round}: never restarted");
            std::thread::sleep(Duration::from_millis(50));
        }
        // A supervisor restart is not a termination.
        assert!(!log.saw("watcher saw fragile/victim Failed"));
    }
    // The third failure within the window is more than max_restarts = 2:
    // the entity stops (no backoff) and its watcher hears `Failed`.
    failed(fragile("boom"));
    log.wait_saw("watcher saw fragile/victim Failed");
    // The next message starts a fresh incarnation at once (documented).
    assert_eq!(fragile("ping").expect("fresh incarnation"), "pong");
    assert_eq!(
        log.created("victim").len(),
        4,
        "3 supervisor starts + 1 new"
    );
    drop(node);
}

#[test]
fn watch_across_nodes_and_a_crashed_node_is_removed() {
    let dir = tempfile::tempdir().expect("tmp");
    let log = Arc::new(Log::default());
    let a = Node::start(config(25_220, 25_220, 1, dir.path())).expect("start a");
    a.sharding()
        .start("w", probes(&log, "a"), EntitySettings::default())
        .expect("region a");
    a.wait_ready(Duration::from_secs(30)).expect("a ready");
    let b = Node::start(config(25_221, 25_220, 1, dir.path())).expect("start b");
    b.sharding()
        .start("w", probes(&log, "b"), EntitySettings::default())
        .expect("region b");
    b.wait_ready(Duration::from_secs(30)).expect("b ready");
    // Shards are allocated on first use, to the region with fewest shards.
    let ids: Vec<String> = (0..24).map(|i| format!("x{i}")).collect();
    for id in &ids {
        assert_eq!(ok(&a, id, "ping"), "pong");
    }
    let on = |n: &str| -> Vec<&str> {
        ids.iter()
            .map(|s| s.as_str())
            .filter(|id| log.created(id)[0].starts_with(n))
            .collect()
    };
    let (on_a, on_b) = (on("a/"), on("b/"));
    assert!(!on_a.is_empty() && on_b.len() >= 2, "a {on_a:?} b {on_b:?}");
    let watcher = on_a[0];
    for t in [on_b[0], on_b[1]] {
        assert_eq!(ok(&a, watcher, &format!("watch w {t}")), "ok");
    }
    assert_eq!(ok(&a, on_b[0], "stop"), "stopping");
    log.wait_saw(&format!("{watcher} saw w/{} Stopped", on_b[0]));
    assert_eq!(ok(&a, watcher, &format!("watch w {}", on_b[0])), "ok");
    log.wait_saw(&format!("{watcher} saw w/{} NotActive", on_b[0]));
    // Node b crashes (its executors stop without leaving): once it is
    // downed and removed, the watcher hears NodeRemoved.
    let started = Instant::now();
    drop(b);
    log.wait_saw(&format!("{watcher} saw w/{} NodeRemoved", on_b[1]));
    println!(
        "NodeRemoved notice {} ms after the crash",
        started.elapsed().as_millis()
    );
    drop(a);
}
