//! Passive messages (lifecycle watches): routed like user messages, but at
//! the home region delivered only to an active entity, never creating one
//! and never refreshing its idle timer.

use std::time::Duration;

use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    Envelope, Generation, LruPolicy, PassivationSettings, RegionEffect, RegionMsg, RegionSettings,
    ShardRegion,
};

/// Payload `true` marks a passive message.
fn region(idle: Option<Duration>) -> ShardRegion<bool, ()> {
    let me = RegionId {
        member: UniqueAddress {
            address: Address("127.0.0.1:7101".into()),
            uid: MemberUid(1),
        },
        core: 0,
    };
    let settings = RegionSettings {
        passivation: PassivationSettings {
            idle_timeout: idle,
            active_entity_limit: None,
        },
        ..RegionSettings::default()
    };
    let now = Duration::ZERO;
    let mut r = ShardRegion::new(me.clone(), settings, Box::new(LruPolicy::new()), now);
    r.set_passive_filter(|e| e.payload);
    r.handle_region_msg(now, RegionMsg::RegisterAck);
    r.handle_region_msg(
        now,
        RegionMsg::ShardHome {
            shard: ShardId(0),
            region: me,
            generation: Generation(1),
        },
    );
    let _ = r.drain_effects().count();
    r
}

fn env(id: &EntityId, passive: bool) -> Envelope<bool, ()> {
    Envelope {
        deadline: None,
        entity: id.clone(),
        shard: ShardId(0),
        sender: (),
        payload: passive,
    }
}

#[test]
fn passive_message_does_not_create_an_entity() {
    let mut r = region(None);
    let id = EntityId::new("a").expect("id");
    r.handle_message(Duration::ZERO, env(&id, true));
    let effects: Vec<_> = r.drain_effects().collect();
    assert!(
        matches!(effects.as_slice(), [RegionEffect::NotActive { .. }]),
        "{effects:?}"
    );
    assert_eq!(r.active_entities(), 0);
    // A user message creates it; a passive one is then delivered to it.
    r.handle_message(Duration::ZERO, env(&id, false));
    r.handle_message(Duration::ZERO, env(&id, true));
    let effects: Vec<_> = r.drain_effects().collect();
    assert!(
        matches!(
            effects.as_slice(),
            [
                RegionEffect::Deliver {
                    new_incarnation: true,
                    ..
                },
                RegionEffect::Deliver {
                    new_incarnation: false,
                    ..
                }
            ]
        ),
        "{effects:?}"
    );
}

#[test]
fn passive_message_does_not_keep_an_entity_alive() {
    let idle = Duration::from_secs(10);
    let mut r = region(Some(idle));
    let id = EntityId::new("a").expect("id");
    r.handle_message(Duration::ZERO, env(&id, false));
    let _ = r.drain_effects().count();
    // Passive traffic every second does not refresh the idle timer.
    for s in 1..=30 {
        let now = Duration::from_secs(s);
        r.handle_message(now, env(&id, true));
        r.handle_timeout(now);
    }
    let stopped = r
        .drain_effects()
        .filter(|e| matches!(e, RegionEffect::StopEntity { .. }))
        .count();
    assert_eq!(stopped, 1, "idle passivation despite passive messages");
}
