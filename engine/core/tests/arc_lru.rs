//! Passivation with an active-entity limit and LRU replacement, checked
//! against the published LRU hit ratios of the OLTP trace (Megiddo & Modha,
//! "ARC: A Self-Tuning, Low Overhead Replacement Cache", USENIX FAST '03,
//! Table IV). Each page is an entity id, each page reference one message to
//! it; a message that finds its entity active is a hit.
//!
//! The trace ships in the repository (`bench-harness/data/OLTP.lis.zst`);
//! `$SHARDLINE_ARC_DIR` points at another copy.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    Envelope, Generation, LruPolicy, PassivationSettings, RegionEffect, RegionMsg, RegionSettings,
    ShardRegion,
};

fn trace_path() -> PathBuf {
    match std::env::var_os("SHARDLINE_ARC_DIR") {
        Some(d) => PathBuf::from(d).join("OLTP.lis.zst"),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench-harness/data/OLTP.lis.zst")
        }
    }
}

/// Page references of the trace, in order.
fn load_trace() -> Vec<u64> {
    let path = trace_path();
    let file = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "cannot open {}: {e} (set SHARDLINE_ARC_DIR)",
            path.display()
        )
    });
    let bytes = zstd::decode_all(file).expect("valid zstd");
    let text = std::str::from_utf8(&bytes).expect("ASCII trace");
    let mut refs = Vec::with_capacity(1_000_000);
    for line in text.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(start), Some(n)) = (f.next(), f.next()) else {
            continue;
        };
        let start: u64 = start.parse().expect("starting block");
        let n: u64 = n.parse().expect("number of blocks");
        refs.extend(start..start + n);
    }
    refs
}

/// Drives one region hosting one shard with an active-entity limit of `c`;
/// returns (hits, messages).
fn replay(refs: &[u64], ids: &HashMap<u64, EntityId>, c: usize) -> (u64, u64) {
    let me = RegionId {
        member: UniqueAddress {
            address: Address("127.0.0.1:7101".into()),
            uid: MemberUid(1),
        },
        core: 0,
    };
    let settings = RegionSettings {
        passivation: PassivationSettings {
            idle_timeout: None,
            active_entity_limit: Some(c),
        },
        ..RegionSettings::default()
    };
    let now = Duration::ZERO;
    let mut region: ShardRegion<(), ()> =
        ShardRegion::new(me.clone(), settings, Box::new(LruPolicy::new()), now);
    region.handle_region_msg(now, RegionMsg::RegisterAck);
    region.handle_region_msg(
        now,
        RegionMsg::ShardHome {
            shard: ShardId(0),
            region: me,
            generation: Generation(1),
        },
    );
    let _ = region.drain_effects().count();
    let (mut hits, mut total) = (0u64, 0u64);
    let mut stopped = Vec::new();
    for page in refs {
        let envelope = Envelope {
            deadline: None,
            entity: ids[page].clone(),
            shard: ShardId(0),
            sender: (),
            payload: (),
        };
        region.handle_message(now, envelope);
        while let Some(e) = region.poll_effect() {
            match e {
                RegionEffect::Deliver {
                    new_incarnation, ..
                } => {
                    total += 1;
                    if !new_incarnation {
                        hits += 1;
                    }
                }
                RegionEffect::StopEntity { shard, entity, .. } => stopped.push((shard, entity)),
                other => panic!("unexpected effect {other:?}"),
            }
        }
        // The runtime stops the entity; it is gone before the next message.
        for (s, e) in stopped.drain(..) {
            region.handle_entity_stopped(now, s, &e);
        }
        let _ = region.drain_effects().count();
        assert!(region.active_entities() <= c);
    }
    (hits, total)
}

#[test]
#[cfg_attr(
    debug_assertions,
    ignore = "replays 914,145 messages per limit: about 1 s per limit in release, minutes in debug; CI runs it with cargo test --release"
)]
fn oltp_lru_hit_ratios_match_the_arc_paper() {
    let refs = load_trace();
    assert_eq!(refs.len(), 914_145);
    let ids: HashMap<u64, EntityId> = refs
        .iter()
        .map(|p| (*p, EntityId::new(p.to_string()).expect("valid id")))
        .collect();
    assert_eq!(ids.len(), 186_880);
    // Table IV, OLTP, LRU column.
    let published = [
        (1000, 32.83),
        (2000, 42.47),
        (5000, 53.65),
        (10000, 60.70),
        (15000, 64.63),
    ];
    for (c, want) in published {
        let (hits, total) = replay(&refs, &ids, c);
        assert_eq!(total, refs.len() as u64);
        let pct = hits as f64 * 100.0 / total as f64;
        let got = (pct * 100.0).round() / 100.0;
        println!("c={c}: hit ratio {pct:.4}% (published {want}%)");
        assert!((got - want).abs() < 0.005, "c={c}: {got} != {want}");
    }
}
