//! The host's slot in a live entity's table entry: created when the entity
//! becomes live, kept while it is active or stopping, dropped when the
//! region learns it stopped; `activate_for_host` makes an entity live only
//! in a shard that runs here.

use std::time::Duration;

use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    Envelope, Generation, LruPolicy, RegionEffect, RegionMsg, RegionSettings, ShardRegion,
};

fn me() -> RegionId {
    RegionId {
        member: UniqueAddress {
            address: Address("127.0.0.1:7101".into()),
            uid: MemberUid(1),
        },
        core: 0,
    }
}

/// A region hosting shard 0 whose host slot is a counter of what the host
/// wrote into it (`u32`).
fn region() -> ShardRegion<(), (), u32> {
    let now = Duration::ZERO;
    let mut r = ShardRegion::new(
        me(),
        RegionSettings::default(),
        Box::new(LruPolicy::new()),
        now,
    );
    r.handle_region_msg(now, RegionMsg::RegisterAck);
    r.handle_region_msg(
        now,
        RegionMsg::ShardHome {
            shard: ShardId(0),
            region: me(),
            generation: Generation(1),
        },
    );
    let _ = r.drain_effects().count();
    r
}

fn env(id: &EntityId) -> Envelope<(), ()> {
    Envelope {
        deadline: None,
        entity: id.clone(),
        shard: ShardId(0),
        sender: (),
        payload: (),
    }
}

#[test]
fn a_slot_lives_from_activation_to_the_reported_stop() {
    let mut r = region();
    let a = EntityId::new("a").expect("id");
    let s = ShardId(0);
    assert_eq!(r.host_slot(s, &a), None, "not live yet");
    r.handle_message(Duration::ZERO, env(&a));
    let _ = r.drain_effects().count();
    assert_eq!(r.host_slot(s, &a), Some(&0), "created with the default");
    *r.host_slot_mut(s, &a).expect("live") = 7;
    // A message to the active entity finds the same slot.
    r.handle_message(Duration::ZERO, env(&a));
    let _ = r.drain_effects().count();
    assert_eq!(r.host_slot(s, &a), Some(&7));
    assert!(!r.is_entity_stopping(s, &a), "active");
    // Stopping keeps it (the host still runs the incarnation)...
    r.handle_passivate(Duration::ZERO, s, &a, None);
    assert!(r.is_entity_stopping(s, &a));
    let effects: Vec<_> = r.drain_effects().collect();
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, RegionEffect::StopEntity { .. })),
        "{effects:?}"
    );
    assert_eq!(r.host_slot(s, &a), Some(&7), "kept while stopping");
    let all: Vec<(ShardId, String, u32)> = r
        .host_slots_mut()
        .map(|(s, id, h)| (s, id.as_str().to_string(), *h))
        .collect();
    assert_eq!(all, vec![(s, "a".to_string(), 7)]);
    // ...until the stop is reported; the next incarnation starts afresh.
    r.handle_entity_stopped(Duration::ZERO, s, &a);
    assert_eq!(r.host_slot(s, &a), None);
    assert!(!r.is_entity_stopping(s, &a), "gone");
    r.handle_message(Duration::ZERO, env(&a));
    let _ = r.drain_effects().count();
    assert_eq!(r.host_slot(s, &a), Some(&0));
}

#[test]
fn activate_for_host_needs_a_running_shard_here() {
    let mut r = region();
    let a = EntityId::new("a").expect("id");
    assert!(r.activate_for_host(Duration::ZERO, ShardId(0), &a));
    assert_eq!(r.active_entities(), 1, "counted as active");
    assert_eq!(r.host_slot(ShardId(0), &a), Some(&0));
    // Live already: nothing changes.
    assert!(r.activate_for_host(Duration::ZERO, ShardId(0), &a));
    assert_eq!(r.active_entities(), 1);
    // A shard not hosted here: refused, nothing created.
    let b = EntityId::new("b").expect("id");
    assert!(!r.activate_for_host(Duration::ZERO, ShardId(5), &b));
    assert_eq!(r.host_slot(ShardId(5), &b), None);
    // A shard handing off: refused too.
    r.handle_region_msg(
        Duration::ZERO,
        RegionMsg::HandOff {
            shard: ShardId(0),
            generation: Generation(1),
        },
    );
    let _ = r.drain_effects().count();
    assert!(!r.activate_for_host(Duration::ZERO, ShardId(0), &b));
    assert_eq!(r.host_slot(ShardId(0), &b), None);
}
