//! One node with two data cores: client connections land on either core
//! (SO_REUSEPORT), messages for a shard homed on the other core cross the
//! core ring, every reply is right, and each entity lives in one region.

use std::collections::HashMap;
use std::time::Duration;

use shardline::client::{Client, Status};

use super::support::{allocate_and_balance, status, Cluster};

#[test]
fn two_data_cores_route_across_the_core_ring() {
    let _one_at_a_time = super::support::serial();
    let cluster = Cluster::start_with_cores(23_500, 1, 2);
    cluster.wait_ready(Duration::from_secs(60));
    let addr = cluster.ports.client(0);
    let mut clients: Vec<Client> = (0..6)
        .map(|_| Client::connect(addr).expect("connect"))
        .collect();
    allocate_and_balance(&mut clients, &[addr], "m", 200);
    let mut expected = vec![0i64; 200];
    for round in 0..5 {
        for (c, exp) in expected.iter_mut().enumerate() {
            let k = (round * 7 + c % 13) as i64 + 1;
            *exp += k;
            let cl = &mut clients[(c + round) % 6];
            let r = cl
                .ask(
                    "counter",
                    &format!("m-{c}"),
                    format!("add {k}").as_bytes(),
                    Duration::from_secs(10),
                )
                .expect("ask");
            assert_eq!(r.status, Status::Ok);
            assert_eq!(
                String::from_utf8_lossy(&r.payload),
                exp.to_string(),
                "counter m-{c}"
            );
        }
    }
    let st = status(addr).expect("status");
    let regions: Vec<_> = st
        .regions
        .iter()
        .filter(|r| r.type_name == "counter")
        .collect();
    assert_eq!(regions.len(), 2, "one counter region per core");
    let mut seen: HashMap<String, u16> = HashMap::new();
    for r in &regions {
        for id in r.shards.values().flatten() {
            assert!(
                seen.insert(id.clone(), r.core).is_none(),
                "{id} live in two regions"
            );
        }
    }
    assert_eq!(seen.len(), 200);
    assert!(
        regions.iter().all(|r| r.entities > 0),
        "both cores host entities: {regions:?}"
    );
}
