//! `GET /v1/sharding/{type}/stats` is cluster-wide: on a three-node
//! cluster, any node answers with every member's regions (shard → live
//! entities), whose totals equal the entities the test started; after one
//! node is SIGKILLed, it is listed under `failed` (unreachable or no
//! answer), never silently dropped, and the live members still answer.

mod http_support;

use std::collections::BTreeSet;
use std::time::Duration;

use http_support::{start_nodes, start_nodes_with, wait_ready, Conn, Ports};
use serde_json::Value;

fn stats(addr: std::net::SocketAddr) -> Value {
    let mut c = Conn::open(addr);
    let r = c.get("/v1/sharding/counter/stats");
    assert_eq!(r.code, 200, "{}", r.text());
    serde_json::from_slice(&r.body).expect("stats JSON")
}

/// Waits until the node at `addr` sees exactly `all` as Up and reachable
/// (`GET /v1/cluster/members`).
fn wait_all_up(addr: std::net::SocketAddr, all: &BTreeSet<String>, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let r = Conn::open(addr).get("/v1/cluster/members");
        let up: BTreeSet<String> = serde_json::from_slice::<Value>(&r.body)
            .ok()
            .and_then(|v| v["members"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter(|m| m["status"] == "Up" && m["reachable"] == true)
            .filter_map(|m| m["address"].as_str().map(str::to_string))
            .collect();
        if &up == all {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{addr} sees {up:?} Up, not {all:?}, after {timeout:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn addresses(v: &Value, key: &str) -> BTreeSet<String> {
    v[key]
        .as_array()
        .expect(key)
        .iter()
        .map(|m| m["address"].as_str().expect("address").to_string())
        .collect()
}

#[test]
fn sharding_stats_cover_every_member_and_list_the_silent_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 25_610 };
    let mut nodes = start_nodes(dir.path(), ports, 3, 1);
    for n in &nodes {
        wait_ready(n.http, Duration::from_secs(30));
    }
    let all: BTreeSet<String> = (0..3).map(|i| ports.cluster(i).to_string()).collect();
    // Ready is per node (this member is Up and its regions registered);
    // the others learn that it is Up by gossip a round later. The stats
    // cover the members each node sees Up, so wait for every view.
    for n in &nodes {
        wait_all_up(n.http, &all, Duration::from_secs(30));
    }

    let mut c = Conn::open(nodes[0].http);
    const ENTITIES: u64 = 40;
    for i in 0..ENTITIES {
        let r = c.post(&format!("/v1/entities/counter/k{i}"), b"add 1");
        assert_eq!((r.code, r.text()), (200, "1".to_string()));
    }

    for n in &nodes {
        let v = stats(n.http);
        assert_eq!(addresses(&v, "members"), all, "{v:#}");
        assert!(addresses(&v, "failed").is_empty(), "{v:#}");
        assert_eq!(v["total_entities"], ENTITIES, "{v:#}");
        let mut shards = BTreeSet::new();
        let mut entities = 0;
        for m in v["members"].as_array().expect("members") {
            for r in m["regions"].as_array().expect("regions") {
                for (s, n) in r["shards"].as_object().expect("shards") {
                    assert!(shards.insert(s.clone()), "shard {s} hosted twice: {v:#}");
                    entities += n.as_u64().expect("count");
                }
            }
        }
        assert_eq!(entities, ENTITIES);
        assert_eq!(v["total_shards"], shards.len() as u64);
        // 40 ids over 60 shards land on more than one member.
        let hosting = v["members"]
            .as_array()
            .expect("members")
            .iter()
            .filter(|m| m["regions"][0]["shard_count"].as_u64().unwrap_or(0) > 0)
            .count();
        assert!(hosting >= 2, "{v:#}");
    }

    // A member that cannot answer is reported, not dropped.
    nodes[2].kill();
    let v = stats(nodes[0].http);
    let killed = ports.cluster(2).to_string();
    let failed = addresses(&v, "failed");
    let members = addresses(&v, "members");
    assert!(!members.contains(&killed), "{v:#}");
    assert!(members.contains(&ports.cluster(0).to_string()));
    assert!(members.contains(&ports.cluster(1).to_string()));
    let reasons: Vec<&str> = v["failed"]
        .as_array()
        .expect("failed")
        .iter()
        .filter_map(|f| f["reason"].as_str())
        .collect();
    assert!(
        reasons
            .iter()
            .all(|r| *r == "unreachable" || r.starts_with("no answer within")),
        "{v:#}"
    );
    assert!(
        failed.contains(&killed),
        "the killed member is listed as failed: {v:#}"
    );
}

/// A connection waiting for the cluster stats (up to 3 s while a member
/// does not answer) is not idle: it gets its answer even with an
/// `idle_timeout_ms` far below that wait.
#[test]
fn a_connection_owed_a_slow_answer_is_not_closed_as_idle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ports = Ports { base: 27_090 };
    let nodes = start_nodes_with(dir.path(), ports, 2, 1, "idle_timeout_ms = 200");
    for n in &nodes {
        wait_ready(n.http, Duration::from_secs(30));
    }
    // A stopped member keeps its connections open but answers nothing, so
    // the stats wait for it.
    let pid = nodes[1].node.child.id().to_string();
    let signal = |sig: &str| {
        let st = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill {sig} {pid}");
    };
    signal("-STOP");
    let mut c = Conn::open(nodes[0].http);
    c.send(b"GET /v1/sharding/counter/stats HTTP/1.1\r\n\r\n");
    let r = c.read_response();
    signal("-CONT");
    let r = r.expect("a response, not a close");
    assert_eq!(r.code, 200, "{}", r.text());
    let v: Value = serde_json::from_slice(&r.body).expect("stats JSON");
    assert!(
        addresses(&v, "failed").contains(&ports.cluster(1).to_string()),
        "{v:#}"
    );
}
