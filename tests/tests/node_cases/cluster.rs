//! Three `shardline node` processes on loopback, all started at the same
//! instant: they form one cluster, serve 10,000 requests to 1,000 counters
//! sent through random nodes with every reply right, and each entity lives on
//! exactly one node.

use std::collections::HashMap;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use shardline::client::{Client, Status};

use super::support::{allocate_and_balance, live_entities, status, Cluster};

const COUNTERS: usize = 1_000;
const ROUNDS: usize = 10;

#[test]
fn three_nodes_started_at_once_form_one_cluster_and_serve_counters() {
    let _one_at_a_time = super::support::serial();
    let cluster = Cluster::start(23_100, 3);
    cluster.wait_ready(Duration::from_secs(60));
    cluster.wait_members_up(3, Duration::from_secs(30));

    // Every node sees the same three members and the same coordinator.
    let views: Vec<_> = (0..3)
        .map(|i| status(cluster.ports.client(i)).expect("status"))
        .collect();
    let coord = views[0].coordinator.clone();
    assert!(coord.is_some(), "a coordinator is placed");
    for v in &views {
        assert_eq!(v.members.len(), 3, "{v:?}");
        assert_eq!(v.coordinator, coord, "one coordinator location");
    }
    assert_eq!(
        views.iter().filter(|v| v.coordinator_here).count(),
        1,
        "the coordinator runs once"
    );

    // 10 rounds; in each, every counter gets one `add k` through a random node
    // (pipelined on one connection per node); replies must be the running sum.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut expected = vec![0i64; COUNTERS];
    let mut splits: Vec<_> = (0..3)
        .map(|i| {
            Client::connect(cluster.ports.client(i))
                .expect("connect")
                .into_split()
        })
        .collect();
    let mut warm: Vec<Client> = (0..3)
        .map(|i| Client::connect(cluster.ports.client(i)).expect("connect"))
        .collect();
    let addrs: Vec<_> = (0..3).map(|i| cluster.ports.client(i)).collect();
    allocate_and_balance(&mut warm, &addrs, "c", COUNTERS);
    let mut total = 0;
    for round in 0..ROUNDS {
        let mut sent_on: Vec<Vec<(u64, usize, i64)>> = vec![Vec::new(); 3];
        for (c, exp) in expected.iter_mut().enumerate() {
            let node = rng.gen_range(0..3);
            let k = rng.gen_range(1..100i64);
            let id = (round * COUNTERS + c) as u64;
            splits[node]
                .0
                .send(
                    id,
                    "counter",
                    &format!("c-{c}"),
                    format!("add {k}").as_bytes(),
                )
                .expect("send");
            *exp += k;
            sent_on[node].push((id, c, *exp));
        }
        for (node, sent) in sent_on.iter().enumerate() {
            splits[node].0.flush().expect("flush");
            let mut want: HashMap<u64, (usize, i64)> =
                sent.iter().map(|(id, c, e)| (*id, (*c, *e))).collect();
            for _ in 0..sent.len() {
                let r = splits[node].1.recv().expect("response");
                let (c, e) = want.remove(&r.request_id).expect("known request id");
                assert_eq!(
                    r.status,
                    Status::Ok,
                    "counter c-{c}: {:?}",
                    String::from_utf8_lossy(&r.payload)
                );
                assert_eq!(
                    String::from_utf8_lossy(&r.payload),
                    e.to_string(),
                    "counter c-{c} in round {round}"
                );
                total += 1;
            }
        }
    }
    assert_eq!(total, COUNTERS * ROUNDS);

    // Each counter is live on exactly one node.
    let mut seen: HashMap<String, usize> = HashMap::new();
    for i in 0..3 {
        for id in live_entities(cluster.ports.client(i), "counter").expect("status") {
            *seen.entry(id).or_default() += 1;
        }
    }
    assert_eq!(seen.len(), COUNTERS, "every counter is live somewhere");
    assert!(
        seen.values().all(|n| *n == 1),
        "an entity is live on two nodes"
    );
    // The work is spread: every node hosts some counters.
    for i in 0..3 {
        let n = live_entities(cluster.ports.client(i), "counter")
            .expect("status")
            .len();
        assert!(n > 0, "node {i} hosts no counter");
    }
}
