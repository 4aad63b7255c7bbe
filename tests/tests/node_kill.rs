//! SIGKILL one of three nodes under load: its shards are re-homed after the
//! split-brain resolver downs it, requests through the survivors succeed
//! again within `RECOVERY_BOUND`, and no entity is ever live on two nodes.
//!
//! Timeline with the test's settings (heartbeat pause 1.5 s, SBR
//! `stable_after` 2 s, down-removal margin = stable_after): unreachable after
//! about 2-4 s, downed 2 s later, removed 2 s after that, then the shards are
//! allocated anew on first use. The stated bound is 30 s.

mod node_support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shardline::client::{Client, Status};

use node_support::{live_entities, status, Cluster};

const ENTITIES: usize = 150;
const RECOVERY_BOUND: Duration = Duration::from_secs(30);

fn round(clients: &mut [Client], r: usize) -> (usize, usize) {
    let mut ok = 0;
    let mut failed = 0;
    for e in 0..ENTITIES {
        let c = &mut clients[(e + r) % clients.len()];
        let payload = format!("r{r}-e{e}");
        match c.ask(
            "echo",
            &format!("e-{e}"),
            payload.as_bytes(),
            Duration::from_secs(15),
        ) {
            Ok(resp) if resp.status == Status::Ok => {
                assert_eq!(resp.payload, payload.as_bytes(), "echo of e-{e} is wrong");
                ok += 1;
            }
            Ok(_) => failed += 1,
            Err(e) => panic!("client error: {e}"),
        }
    }
    (ok, failed)
}

fn assert_no_duplicates(cluster: &Cluster, nodes: &[usize]) {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for &i in nodes {
        if let Some(ids) = live_entities(cluster.ports.client(i), "echo") {
            for id in ids {
                let prev = seen.insert(id.clone(), i);
                assert!(
                    prev.is_none(),
                    "entity {id} live on nodes {} and {i}",
                    prev.unwrap_or(0)
                );
            }
        }
    }
}

#[test]
fn killed_node_is_downed_and_its_entities_rehomed() {
    let mut cluster = Cluster::start(23_200, 3);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(3, Duration::from_secs(30));
    let mut clients: Vec<Client> = (0..2)
        .map(|i| Client::connect(cluster.ports.client(i)).expect("connect"))
        .collect();
    let (ok, failed) = round(&mut clients, 0);
    assert_eq!((ok, failed), (ENTITIES, 0), "warm-up round");
    let on_victim = live_entities(cluster.ports.client(2), "echo").expect("status of node 2");
    assert!(!on_victim.is_empty(), "node 2 hosts some entities");
    assert_no_duplicates(&cluster, &[0, 1, 2]);

    let victim = cluster.nodes[2].take().expect("node 2");
    victim.signal(libc::SIGKILL);
    let killed_at = Instant::now();
    drop(victim);

    let mut r = 1;
    let recovered_after = loop {
        let (ok, failed) = round(&mut clients, r);
        assert_no_duplicates(&cluster, &[0, 1]);
        if failed == 0 && ok == ENTITIES {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < RECOVERY_BOUND,
            "requests still failing {:?} after the kill ({failed} of {ENTITIES} in the last round)\nnode 0 log:\n{}",
            killed_at.elapsed(),
            cluster.log(0)
        );
        std::thread::sleep(Duration::from_millis(100));
        r += 1;
    };
    eprintln!("all requests succeed again {recovered_after:?} after SIGKILL");

    // The victim is gone from the survivors' view, its entities live once.
    let st = status(cluster.ports.client(0)).expect("status");
    assert!(
        !st.members
            .iter()
            .any(|m| m.address == cluster.ports.cluster(2).to_string() && m.status == "Up"),
        "node 2 still Up: {:?}",
        st.members
    );
    let mut all: Vec<String> = Vec::new();
    for i in 0..2 {
        all.extend(live_entities(cluster.ports.client(i), "echo").expect("status"));
    }
    for id in &on_victim {
        assert_eq!(
            all.iter().filter(|x| *x == id).count(),
            1,
            "{id} re-homed once"
        );
    }
    assert_no_duplicates(&cluster, &[0, 1]);
}
