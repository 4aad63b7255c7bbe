//! Warm routing before ready: three `shardline node` processes with two
//! data cores each, started at once. When each reports ready, every region
//! on it already knows the home of every shard (allocated by the
//! coordinator in one batch), and every shard is hosted by exactly one
//! region of the cluster — before any request was sent.

use std::collections::BTreeMap;
use std::time::Duration;

use shardline::client::{Client, Status};

use super::support::{status, Cluster};

/// `number_of_shards` in the test configs (`support::config_text`).
const SHARDS: usize = 60;

#[test]
fn after_ready_every_region_knows_every_shard_home() {
    let _one_at_a_time = super::support::serial();
    let cluster = Cluster::start_with_cores(23_900, 3, 2);
    cluster.wait_ready(Duration::from_secs(60));
    // Read each node's status right after its ready line: nothing has
    // been asked yet, so every home came from the coordinator's batch.
    let mut hosts: BTreeMap<(String, u32), Vec<(String, u16)>> = BTreeMap::new();
    for i in 0..3 {
        let st = status(cluster.ports.client(i)).expect("status");
        assert_eq!(st.regions.len(), 4, "two types on two cores: {st:?}");
        for r in &st.regions {
            assert!(
                r.registered,
                "{} core {} not registered",
                r.type_name, r.core
            );
            assert_eq!(
                r.homes_known, SHARDS,
                "node {i}: {} core {} knows {} of {SHARDS} homes right after ready",
                r.type_name, r.core, r.homes_known
            );
            for s in r.shards.keys() {
                hosts
                    .entry((r.type_name.clone(), *s))
                    .or_default()
                    .push((st.address.clone(), r.core));
            }
        }
    }
    // Every shard of both types is hosted, each by exactly one region.
    for t in ["counter", "echo"] {
        for s in 0..SHARDS as u32 {
            let h = hosts.get(&(t.to_string(), s)).cloned().unwrap_or_default();
            assert_eq!(h.len(), 1, "{t} shard {s} hosted by {h:?}");
        }
    }
    // And the homes are right: a request through each node is answered.
    for i in 0..3 {
        let mut c = Client::connect(cluster.ports.client(i)).expect("connect");
        for k in 0..20 {
            let r = c
                .ask(
                    "counter",
                    &format!("w-{i}-{k}"),
                    b"add 1",
                    Duration::from_secs(10),
                )
                .expect("ask");
            assert_eq!(r.status, Status::Ok);
            assert_eq!(r.payload, b"1");
        }
    }
}
