//! The coordinator with remember entities on: shards that lose their home
//! are allocated again at once, without a message (Akka's
//! `allocateShardHomesForRememberEntities`), and the region starts a shard
//! on its `ShardHome` with no message buffered.

use std::time::Duration;

use shardline_core::ids::{Address, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    CoordinatorEffect, CoordinatorEvent, CoordinatorMsg, CoordinatorSettings, CoordinatorState,
    Generation, LeastShardAllocationStrategy, LruPolicy, MemberStatus, MembershipEvent,
    RegionEffect, RegionMsg, RegionSettings, ShardCoordinator, ShardRegion,
};

fn member(n: u64) -> UniqueAddress {
    UniqueAddress {
        address: Address(format!("10.0.0.{n}:7101").into()),
        uid: MemberUid(n),
    }
}

fn rid(n: u64) -> RegionId {
    RegionId {
        member: member(n),
        core: 0,
    }
}

fn settings(remember: bool) -> CoordinatorSettings {
    CoordinatorSettings {
        remember_entities: remember,
        ..CoordinatorSettings::default()
    }
}

/// A coordinator with members `ms` Up and their regions registered.
fn coordinator(
    remember: bool,
    ms: &[u64],
    journal: &mut Vec<CoordinatorEvent>,
) -> ShardCoordinator {
    let now = Duration::ZERO;
    let mut c = ShardCoordinator::new(
        settings(remember),
        Box::new(LeastShardAllocationStrategy::default()),
        now,
    );
    c.handle_membership(
        now,
        MembershipEvent::CurrentMembers(
            ms.iter().map(|i| (member(*i), MemberStatus::Up)).collect(),
        ),
    );
    for i in ms {
        c.handle_message(
            now,
            CoordinatorMsg::Register {
                region: rid(*i),
                hosted: Vec::new(),
                stopping: Vec::new(),
            },
        );
    }
    drain(&mut c, journal);
    c
}

/// Drains the effects, appends the persisted events to `journal`, and
/// returns the `ShardHome` messages sent: (to, shard, home, generation).
fn drain(
    c: &mut ShardCoordinator,
    journal: &mut Vec<CoordinatorEvent>,
) -> Vec<(RegionId, ShardId, RegionId, Generation)> {
    let mut homes = Vec::new();
    for e in c.drain_effects() {
        match e {
            CoordinatorEffect::Persist(ev) => journal.push(ev),
            CoordinatorEffect::Send {
                to,
                msg:
                    RegionMsg::ShardHome {
                        shard,
                        region,
                        generation,
                    },
            } => homes.push((to, shard, region, generation)),
            CoordinatorEffect::Send { .. } => {}
        }
    }
    homes
}

fn get_home(c: &mut ShardCoordinator, region: u64, shard: u32) {
    c.handle_message(
        Duration::ZERO,
        CoordinatorMsg::GetShardHome {
            region: rid(region),
            shard: ShardId(shard),
        },
    );
}

#[test]
fn shards_of_a_removed_region_are_allocated_again_at_once() {
    for remember in [true, false] {
        let mut journal = Vec::new();
        let mut c = coordinator(remember, &[1, 2], &mut journal);
        for s in 0..4 {
            get_home(&mut c, 1 + u64::from(s % 2), s);
        }
        drain(&mut c, &mut journal);
        let on_2: Vec<ShardId> = c.state().regions[&rid(2)].iter().copied().collect();
        assert!(!on_2.is_empty());
        c.handle_membership(Duration::ZERO, MembershipEvent::MemberRemoved(member(2)));
        let homes = drain(&mut c, &mut journal);
        if remember {
            // Each of region 2's shards got a new home at region 1, which is
            // told (so it starts the shard), with no GetShardHome.
            for s in &on_2 {
                assert_eq!(c.state().shards[s].0, rid(1));
                assert!(
                    homes
                        .iter()
                        .any(|(to, sh, home, _)| to == &rid(1) && sh == s && home == &rid(1)),
                    "{s:?} not sent to its new home: {homes:?}"
                );
            }
            assert!(c.state().unallocated.is_empty());
        } else {
            assert!(homes.is_empty(), "allocated on demand only: {homes:?}");
            for s in &on_2 {
                assert!(!c.state().shards.contains_key(s));
            }
            assert!(c.state().unallocated.is_empty());
        }
        assert_eq!(&CoordinatorState::from_events(journal.iter()), c.state());
    }
}

#[test]
fn unallocated_shards_wait_for_a_region_and_min_nr_of_members() {
    let mut journal = Vec::new();
    let mut c = coordinator(true, &[1], &mut journal);
    get_home(&mut c, 1, 7);
    drain(&mut c, &mut journal);
    // The only region's member goes: nowhere to allocate, the shard is
    // recorded as unallocated.
    c.handle_membership(Duration::ZERO, MembershipEvent::MemberRemoved(member(1)));
    assert!(drain(&mut c, &mut journal).is_empty());
    assert!(c.state().unallocated.contains(&ShardId(7)));
    assert_eq!(&CoordinatorState::from_events(journal.iter()), c.state());
    // Member 3 comes up and registers: the shard goes there without a
    // message.
    c.handle_membership(Duration::ZERO, MembershipEvent::MemberUp(member(3)));
    c.handle_message(
        Duration::ZERO,
        CoordinatorMsg::Register {
            region: rid(3),
            hosted: Vec::new(),
            stopping: Vec::new(),
        },
    );
    let homes = drain(&mut c, &mut journal);
    assert_eq!(homes.len(), 1, "{homes:?}");
    assert_eq!((homes[0].0.clone(), homes[0].1), (rid(3), ShardId(7)));
    assert!(c.state().unallocated.is_empty());
    assert_eq!(&CoordinatorState::from_events(journal.iter()), c.state());
}

#[test]
fn a_rebalanced_shard_is_allocated_again_when_its_hand_off_completes() {
    let mut journal = Vec::new();
    let mut c = coordinator(true, &[1], &mut journal);
    for s in 0..6 {
        get_home(&mut c, 1, s);
    }
    drain(&mut c, &mut journal);
    // Region 2 joins: the next rebalance round moves shards to it.
    c.handle_membership(Duration::ZERO, MembershipEvent::MemberUp(member(2)));
    c.handle_message(
        Duration::ZERO,
        CoordinatorMsg::Register {
            region: rid(2),
            hosted: Vec::new(),
            stopping: Vec::new(),
        },
    );
    drain(&mut c, &mut journal);
    let now = Duration::from_secs(11);
    c.handle_timeout(now);
    let mut handoffs = Vec::new();
    let mut acks = Vec::new();
    for e in c.drain_effects() {
        match e {
            CoordinatorEffect::Persist(ev) => journal.push(ev),
            CoordinatorEffect::Send {
                to,
                msg:
                    RegionMsg::BeginHandOff {
                        shard, generation, ..
                    },
            } => acks.push((to, shard, generation)),
            CoordinatorEffect::Send { .. } => {}
        }
    }
    assert!(!acks.is_empty(), "a rebalance round started");
    for (region, shard, generation) in acks {
        c.handle_message(
            now,
            CoordinatorMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            },
        );
    }
    for e in c.drain_effects() {
        match e {
            CoordinatorEffect::Persist(ev) => journal.push(ev),
            CoordinatorEffect::Send {
                msg: RegionMsg::HandOff { shard, generation },
                ..
            } => handoffs.push((shard, generation)),
            CoordinatorEffect::Send { .. } => {}
        }
    }
    assert!(!handoffs.is_empty());
    for (shard, generation) in &handoffs {
        c.handle_message(
            now,
            CoordinatorMsg::ShardStopped {
                shard: *shard,
                generation: *generation,
                region: rid(1),
            },
        );
        let homes = drain(&mut c, &mut journal);
        // Allocated again at once, to the region the rebalance made room on,
        // and that region is told.
        let (home, g) = c.state().shards[shard].clone();
        assert_eq!(home, rid(2));
        assert!(g > *generation);
        assert!(
            homes
                .iter()
                .any(|(to, s, h, _)| to == &rid(2) && s == shard && h == &rid(2)),
            "{homes:?}"
        );
    }
    assert!(c.state().unallocated.is_empty());
    assert_eq!(&CoordinatorState::from_events(journal.iter()), c.state());
}

#[test]
fn a_recovered_coordinator_allocates_shards_of_gone_regions_once_regions_register() {
    let mut journal = Vec::new();
    let mut c = coordinator(true, &[1], &mut journal);
    for s in 0..3 {
        get_home(&mut c, 1, s);
    }
    drain(&mut c, &mut journal);
    // The whole cluster restarts: member 1 comes back as a new incarnation
    // (member 4), and min_nr_of_members is 2.
    let now = Duration::from_secs(100);
    let cs = CoordinatorSettings {
        min_nr_of_members: 2,
        ..settings(true)
    };
    let mut r = ShardCoordinator::recover(
        cs,
        Box::new(LeastShardAllocationStrategy::default()),
        journal.iter(),
        now,
    );
    let mut journal2 = journal.clone();
    r.handle_membership(
        now,
        MembershipEvent::CurrentMembers(vec![(member(4), MemberStatus::Up)]),
    );
    assert!(drain(&mut r, &mut journal2).is_empty());
    assert_eq!(r.state().unallocated.len(), 3, "the gone region's shards");
    r.handle_message(
        now,
        CoordinatorMsg::Register {
            region: rid(4),
            hosted: Vec::new(),
            stopping: Vec::new(),
        },
    );
    assert!(
        drain(&mut r, &mut journal2).is_empty(),
        "min_nr_of_members not reached"
    );
    // A journal replay in between keeps the record.
    assert_eq!(&CoordinatorState::from_events(journal2.iter()), r.state());
    r.handle_membership(now, MembershipEvent::MemberUp(member(5)));
    let homes = drain(&mut r, &mut journal2);
    assert_eq!(homes.len(), 3, "{homes:?}");
    assert!(homes.iter().all(|(to, _, h, _)| to == h && *h == rid(4)));
    assert!(r.state().unallocated.is_empty());
    assert_eq!(&CoordinatorState::from_events(journal2.iter()), r.state());
}

#[test]
fn a_region_with_remember_entities_starts_a_shard_on_its_home_without_a_message() {
    let now = Duration::ZERO;
    let settings = RegionSettings {
        remember_entities: true,
        ..RegionSettings::default()
    };
    let mut region: ShardRegion<u32, u32> =
        ShardRegion::new(rid(1), settings, Box::new(LruPolicy::new()), now);
    region.handle_region_msg(now, RegionMsg::RegisterAck);
    let _ = region.drain_effects().count();
    region.handle_region_msg(
        now,
        RegionMsg::ShardHome {
            shard: ShardId(3),
            region: rid(1),
            generation: Generation(9),
        },
    );
    let effects: Vec<_> = region.drain_effects().collect();
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, RegionEffect::RecoverRememberedEntities { shard } if *shard == ShardId(3))),
        "{effects:?}"
    );
}
