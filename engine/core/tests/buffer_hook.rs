//! The region's buffer hook: called on a message's payload when it is
//! buffered (no home known yet), not when it is delivered at once.

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

fn env(id: &EntityId, shard: u32, payload: u32) -> Envelope<u32, ()> {
    Envelope {
        deadline: None,
        entity: id.clone(),
        shard: ShardId(shard),
        sender: (),
        payload,
    }
}

/// Delivered payloads, in order.
fn delivered(r: &mut ShardRegion<u32, ()>) -> Vec<u32> {
    r.drain_effects()
        .filter_map(|e| match e {
            RegionEffect::Deliver { envelope, .. } => Some(envelope.payload),
            _ => None,
        })
        .collect()
}

#[test]
fn a_buffered_message_passes_through_the_hook_and_a_delivered_one_does_not() {
    let now = Duration::ZERO;
    let mut r = ShardRegion::new(
        me(),
        RegionSettings::default(),
        Box::new(LruPolicy::new()),
        now,
    );
    r.set_buffer_hook(|p| *p += 1000);
    r.handle_region_msg(now, RegionMsg::RegisterAck);
    let id = EntityId::new("a").expect("id");
    // Shard 0's home is not known: buffered (and its home asked for).
    r.handle_message(now, env(&id, 0, 1));
    assert!(delivered(&mut r).is_empty());
    r.handle_region_msg(
        now,
        RegionMsg::ShardHome {
            shard: ShardId(0),
            region: me(),
            generation: Generation(1),
        },
    );
    assert_eq!(
        delivered(&mut r),
        vec![1001],
        "the buffered one went through the hook"
    );
    // The shard runs now: delivered at once, untouched.
    r.handle_message(now, env(&id, 0, 2));
    assert_eq!(delivered(&mut r), vec![2]);
}
