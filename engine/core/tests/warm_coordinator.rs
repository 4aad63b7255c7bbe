//! Warm allocation (`CoordinatorSettings::number_of_shards`): once its
//! regions have settled, the coordinator allocates every shard without a
//! home in one batch, persists the batch as one group of events before any
//! region message (one durability round for the runtime), and tells every
//! registered region all the homes, so regions route without asking.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use shardline_core::ids::{Address, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    CoordinatorEffect, CoordinatorEvent, CoordinatorMsg, CoordinatorSettings, Generation,
    LeastShardAllocationStrategy, LruPolicy, MemberStatus, MembershipEvent, RegionMsg,
    RegionSettings, ShardCoordinator, ShardRegion,
};

const SHARDS: u32 = 60;
const SETTLE: Duration = Duration::from_millis(200);

fn member(n: u64) -> UniqueAddress {
    UniqueAddress {
        address: Address(format!("10.0.0.{n}:7101").into()),
        uid: MemberUid(n),
    }
}

fn rid(n: u64, core: u16) -> RegionId {
    RegionId {
        member: member(n),
        core,
    }
}

fn settings(shards: u32) -> CoordinatorSettings {
    CoordinatorSettings {
        number_of_shards: shards,
        warm_settle: SETTLE,
        ..CoordinatorSettings::default()
    }
}

fn up(ms: &[u64]) -> MembershipEvent {
    MembershipEvent::CurrentMembers(ms.iter().map(|i| (member(*i), MemberStatus::Up)).collect())
}

fn register(c: &mut ShardCoordinator, now: Duration, r: RegionId) {
    c.handle_message(
        now,
        CoordinatorMsg::Register {
            region: r,
            hosted: Vec::new(),
            stopping: Vec::new(),
        },
    );
}

/// What one drain of the coordinator produced.
#[derive(Default)]
struct Drained {
    /// Every effect in order: `true` for a `Persist`, `false` for a `Send`.
    order: Vec<bool>,
    /// The `ShardHomeAllocated` events: shard → (home, generation).
    allocated: BTreeMap<ShardId, (RegionId, Generation)>,
    /// Every region message, by destination.
    sent: BTreeMap<RegionId, Vec<RegionMsg>>,
    /// Every persisted event.
    events: Vec<CoordinatorEvent>,
}

impl Drained {
    /// The homes the region `r` was told about (`ShardHome` and
    /// `ShardHomes`).
    fn homes_told(&self, r: &RegionId) -> BTreeMap<ShardId, RegionId> {
        let mut out = BTreeMap::new();
        for m in self.sent.get(r).into_iter().flatten() {
            match m {
                RegionMsg::ShardHome { shard, region, .. } => {
                    out.insert(*shard, region.clone());
                }
                RegionMsg::ShardHomes { homes } => {
                    for (s, h, _) in homes {
                        out.insert(*s, h.clone());
                    }
                }
                _ => {}
            }
        }
        out
    }
}

fn drain(c: &mut ShardCoordinator) -> Drained {
    let mut d = Drained::default();
    for e in c.drain_effects() {
        match e {
            CoordinatorEffect::Persist(ev) => {
                d.order.push(true);
                if let CoordinatorEvent::ShardHomeAllocated {
                    shard,
                    region,
                    generation,
                } = &ev
                {
                    d.allocated.insert(*shard, (region.clone(), *generation));
                }
                d.events.push(ev);
            }
            CoordinatorEffect::Send { to, msg } => {
                d.order.push(false);
                d.sent.entry(to).or_default().push(msg);
            }
        }
    }
    d
}

/// Three members with two regions each, registered at `t0`; returns the
/// coordinator, the regions and what registering produced.
fn three_members(t0: Duration) -> (ShardCoordinator, Vec<RegionId>, Drained) {
    let mut c = ShardCoordinator::new(
        settings(SHARDS),
        Box::new(LeastShardAllocationStrategy::default()),
        t0,
    );
    c.handle_membership(t0, up(&[1, 2, 3]));
    let regions: Vec<RegionId> = (1..=3)
        .flat_map(|m| (0..2).map(move |core| rid(m, core)))
        .collect();
    for r in &regions {
        register(&mut c, t0, r.clone());
    }
    let d = drain(&mut c);
    (c, regions, d)
}

#[test]
fn batch_allocation_is_balanced_and_one_durability_round() {
    let t0 = Duration::from_secs(1);
    let (mut c, regions, d) = three_members(t0);
    assert!(
        d.allocated.is_empty(),
        "nothing is allocated before the regions settle"
    );
    assert_eq!(c.warm_batches(), 0);
    // The batch waits for the settle time after the last registration.
    let due = c.poll_timeout().expect("a timer");
    assert!(due <= t0 + SETTLE, "warm batch armed: {due:?}");
    c.handle_timeout(due.max(t0 + SETTLE));
    let d = drain(&mut c);
    assert_eq!(c.warm_batches(), 1);
    // Every shard got a home, balanced over the six regions (10 each).
    assert_eq!(d.allocated.len(), SHARDS as usize);
    let mut per_region: BTreeMap<&RegionId, usize> = BTreeMap::new();
    for (home, _) in d.allocated.values() {
        *per_region.entry(home).or_default() += 1;
    }
    assert_eq!(per_region.len(), regions.len());
    assert!(per_region.values().all(|n| *n == 10), "{per_region:?}");
    // Generations increase and are distinct.
    let gens: BTreeSet<Generation> = d.allocated.values().map(|(_, g)| *g).collect();
    assert_eq!(gens.len(), SHARDS as usize);
    // One group of events: every Persist comes before the first Send, so
    // the runtime waits for one durability round before the regions hear.
    let first_send = d.order.iter().position(|p| !p).expect("homes sent");
    assert_eq!(first_send, SHARDS as usize);
    assert!(d.order[first_send..].iter().all(|p| !p));
    // Every region is told every home, in one ShardHomes message.
    for r in &regions {
        let told = d.homes_told(r);
        assert_eq!(told.len(), SHARDS as usize, "{r}");
        for (s, h) in &told {
            assert_eq!(&d.allocated[s].0, h);
        }
        assert_eq!(d.sent[r].len(), 1);
    }
    // A region fed the messages knows every home and hosts its own ten.
    let mut region: ShardRegion<(), ()> = ShardRegion::new(
        regions[0].clone(),
        RegionSettings::default(),
        Box::new(LruPolicy::new()),
        t0,
    );
    region.handle_region_msg(t0, RegionMsg::RegisterAck);
    for m in d.sent[&regions[0]].clone() {
        region.handle_region_msg(t0, m);
    }
    assert_eq!(region.known_homes(), SHARDS as usize);
    assert_eq!(region.hosted_shards().count(), 10);
    // Nothing more to do: no timer for the batch, no further allocation.
    c.handle_timeout(t0 + SETTLE * 3);
    assert!(drain(&mut c).allocated.is_empty());
}

#[test]
fn registrations_push_the_batch_back_until_they_settle() {
    let t0 = Duration::ZERO;
    let mut c = ShardCoordinator::new(
        settings(SHARDS),
        Box::new(LeastShardAllocationStrategy::default()),
        t0,
    );
    c.handle_membership(t0, up(&[1, 2]));
    register(&mut c, t0, rid(1, 0));
    let t1 = t0 + SETTLE / 2;
    c.handle_timeout(t1);
    register(&mut c, t1, rid(2, 0));
    // The first region's settle time passed, but the second registered since.
    c.handle_timeout(t0 + SETTLE);
    assert!(drain(&mut c).allocated.is_empty());
    c.handle_timeout(t1 + SETTLE);
    let d = drain(&mut c);
    assert_eq!(d.allocated.len(), SHARDS as usize);
    let on_two = d
        .allocated
        .values()
        .filter(|(h, _)| *h == rid(2, 0))
        .count();
    assert_eq!(on_two, SHARDS as usize / 2);
}

#[test]
fn a_late_region_gets_every_home_without_allocations() {
    let t0 = Duration::ZERO;
    let (mut c, _, _) = three_members(t0);
    c.handle_timeout(t0 + SETTLE);
    let batch = drain(&mut c);
    assert_eq!(batch.allocated.len(), SHARDS as usize);
    // Member 4 joins later; its region registers.
    let t1 = t0 + Duration::from_secs(5);
    c.handle_membership(t1, MembershipEvent::MemberUp(member(4)));
    register(&mut c, t1, rid(4, 0));
    let d = drain(&mut c);
    assert!(d.allocated.is_empty(), "nothing re-allocated");
    assert!(matches!(
        d.events.as_slice(),
        [CoordinatorEvent::ShardRegionRegistered { .. }]
    ));
    let told = d.homes_told(&rid(4, 0));
    assert_eq!(told.len(), SHARDS as usize);
    for (s, h) in told {
        assert_eq!(batch.allocated[&s].0, h);
    }
    assert!(matches!(
        d.sent[&rid(4, 0)].first(),
        Some(RegionMsg::RegisterAck)
    ));
}

#[test]
fn a_recovered_coordinator_resends_homes_and_reallocates_a_dead_members_shards() {
    let t0 = Duration::ZERO;
    let (mut c, regions, reg) = three_members(t0);
    c.handle_timeout(t0 + SETTLE);
    let batch = drain(&mut c);
    let journal: Vec<CoordinatorEvent> = reg.events.into_iter().chain(batch.events).collect();
    // A new coordinator recovers the journal; member 3 is gone.
    let t1 = Duration::from_secs(30);
    let mut c2 = ShardCoordinator::recover(
        settings(SHARDS),
        Box::new(LeastShardAllocationStrategy::default()),
        &journal,
        t1,
    );
    c2.handle_membership(t1, up(&[1, 2]));
    let dead = drain(&mut c2);
    let freed: BTreeSet<ShardId> = batch
        .allocated
        .iter()
        .filter(|(_, (h, _))| h.member == member(3))
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(freed.len(), 20);
    assert!(dead.allocated.is_empty());
    // The survivors' regions register again: each hears every home known.
    let alive: Vec<RegionId> = regions
        .iter()
        .filter(|r| r.member != member(3))
        .cloned()
        .collect();
    for r in &alive {
        let hosted: Vec<(ShardId, Generation)> = batch
            .allocated
            .iter()
            .filter(|(_, (h, _))| h == r)
            .map(|(s, (_, g))| (*s, *g))
            .collect();
        c2.handle_message(
            t1,
            CoordinatorMsg::Register {
                region: r.clone(),
                hosted,
                stopping: Vec::new(),
            },
        );
    }
    let d = drain(&mut c2);
    for r in &alive {
        let told = d.homes_told(r);
        assert_eq!(told.len(), SHARDS as usize - freed.len(), "{r}");
        assert!(told.keys().all(|s| !freed.contains(s)));
        assert!(
            !d.sent[r]
                .iter()
                .any(|m| matches!(m, RegionMsg::HandOff { .. })),
            "nothing stale"
        );
    }
    // After the settle time the freed shards are allocated in one batch,
    // five to each surviving region, and every region hears them.
    c2.handle_timeout(t1 + SETTLE);
    let d = drain(&mut c2);
    assert_eq!(d.allocated.keys().copied().collect::<BTreeSet<_>>(), freed);
    for r in &alive {
        let n = d.allocated.values().filter(|(h, _)| h == r).count();
        assert_eq!(n, 5, "{r}");
        assert_eq!(d.homes_told(r).len(), freed.len());
    }
    let first_send = d.order.iter().position(|p| !p).expect("homes sent");
    assert_eq!(first_send, freed.len());
    // Generations stay above the recovered ones.
    let old_max = batch.allocated.values().map(|(_, g)| *g).max().unwrap();
    assert!(d.allocated.values().all(|(_, g)| *g > old_max));
}

#[test]
fn shards_are_still_allocated_on_demand_before_the_batch_and_without_regions() {
    let t0 = Duration::ZERO;
    let mut c = ShardCoordinator::new(
        settings(SHARDS),
        Box::new(LeastShardAllocationStrategy::default()),
        t0,
    );
    c.handle_membership(t0, up(&[1]));
    // No region yet: the batch has nowhere to go.
    c.handle_timeout(t0 + SETTLE);
    assert!(drain(&mut c).allocated.is_empty());
    // A region registers and asks at once: answered without waiting.
    let t1 = t0 + Duration::from_secs(1);
    register(&mut c, t1, rid(1, 0));
    c.handle_message(
        t1,
        CoordinatorMsg::GetShardHome {
            region: rid(1, 0),
            shard: ShardId(7),
        },
    );
    let d = drain(&mut c);
    assert_eq!(d.allocated.len(), 1);
    assert_eq!(d.homes_told(&rid(1, 0)).get(&ShardId(7)), Some(&rid(1, 0)));
    // The batch allocates the other shards later.
    c.handle_timeout(t1 + SETTLE);
    let d = drain(&mut c);
    assert_eq!(d.allocated.len(), SHARDS as usize - 1);
    assert!(!d.allocated.contains_key(&ShardId(7)));
}

#[test]
fn warm_allocation_is_off_without_a_number_of_shards() {
    let t0 = Duration::ZERO;
    let mut c = ShardCoordinator::new(
        settings(0),
        Box::new(LeastShardAllocationStrategy::default()),
        t0,
    );
    c.handle_membership(t0, up(&[1]));
    register(&mut c, t0, rid(1, 0));
    c.handle_timeout(t0 + Duration::from_secs(5));
    assert!(drain(&mut c).allocated.is_empty());
    assert_eq!(c.warm_batches(), 0);
}

/// Answers every `BeginHandOff` with the region's ack and every `HandOff`
/// with `ShardStopped` (regions whose shards have no entities); returns the
/// allocations seen and the most hand-offs begun for one round.
fn answer_hand_offs(c: &mut ShardCoordinator, now: Duration, d: Drained) -> Drained {
    let mut all = d;
    loop {
        let mut inputs = Vec::new();
        for (to, msgs) in std::mem::take(&mut all.sent) {
            for m in msgs {
                match m {
                    RegionMsg::BeginHandOff {
                        shard, generation, ..
                    } => inputs.push(CoordinatorMsg::BeginHandOffAck {
                        shard,
                        generation,
                        region: to.clone(),
                    }),
                    RegionMsg::HandOff { shard, generation } => {
                        inputs.push(CoordinatorMsg::ShardStopped {
                            shard,
                            generation,
                            region: to.clone(),
                        })
                    }
                    _ => {}
                }
            }
        }
        if inputs.is_empty() {
            return all;
        }
        for m in inputs {
            c.handle_message(now, m);
        }
        let d = drain(c);
        all.allocated.extend(d.allocated);
        all.sent = d.sent;
    }
}

/// A coordinator of `n` shards, all allocated in one warm batch to the
/// one region of member 1 (time 0 + the settle time).
fn warm_on_member_1(n: u32) -> ShardCoordinator {
    let t0 = Duration::ZERO;
    let mut c = ShardCoordinator::new(
        settings(n),
        Box::new(LeastShardAllocationStrategy::default()),
        t0,
    );
    c.handle_membership(t0, up(&[1]));
    register(&mut c, t0, rid(1, 0));
    c.handle_timeout(t0 + SETTLE);
    assert_eq!(drain(&mut c).allocated.len(), n as usize);
    c
}

#[test]
fn a_member_joining_a_warm_cluster_gets_its_share_in_fast_rounds() {
    let mut c = warm_on_member_1(SHARDS);
    // Member 2 joins; its region registers.
    let t1 = Duration::from_secs(3);
    c.handle_membership(t1, MembershipEvent::MemberUp(member(2)));
    register(&mut c, t1, rid(2, 0));
    drain(&mut c);
    let mut now = t1;
    let mut most_per_round = 0;
    let balanced_at = loop {
        now += SETTLE;
        assert!(now < t1 + Duration::from_secs(10), "not balanced in time");
        c.handle_timeout(now);
        let d = drain(&mut c);
        let begun: BTreeSet<ShardId> = d
            .sent
            .values()
            .flatten()
            .filter_map(|m| match m {
                RegionMsg::HandOff { shard, .. } => Some(*shard),
                _ => None,
            })
            .collect();
        most_per_round = most_per_round.max(begun.len());
        answer_hand_offs(&mut c, now, d);
        let on: BTreeMap<RegionId, usize> = c
            .state()
            .regions
            .iter()
            .map(|(r, s)| (r.clone(), s.len()))
            .collect();
        if on.get(&rid(2, 0)) == Some(&(SHARDS as usize / 2)) {
            break now;
        }
    };
    // Each round kept the limits (10 % of 60 = 6 shards), every shard has
    // a home again, and the join was balanced within seconds, not the
    // five 10 s rounds of the rebalance interval.
    assert!(
        most_per_round <= 6,
        "{most_per_round} hand-offs in one round"
    );
    assert_eq!(c.state().shards.len(), SHARDS as usize);
    assert!(
        balanced_at - t1 < Duration::from_secs(5),
        "{:?}",
        balanced_at - t1
    );
}

#[test]
fn a_registering_proxy_gets_every_home() {
    let t0 = Duration::ZERO;
    let (mut c, _, _) = three_members(t0);
    c.handle_timeout(t0 + SETTLE);
    let batch = drain(&mut c);
    let proxy = rid(9, 0);
    c.handle_membership(t0, MembershipEvent::MemberUp(member(9)));
    c.handle_message(
        t0 + SETTLE,
        CoordinatorMsg::RegisterProxy {
            proxy: proxy.clone(),
        },
    );
    let d = drain(&mut c);
    let told = d.homes_told(&proxy);
    assert_eq!(told.len(), SHARDS as usize);
    for (s, h) in told {
        assert_eq!(batch.allocated[&s].0, h);
    }
}

#[test]
fn a_recovered_coordinator_names_no_home_before_that_region_registers_again() {
    let t0 = Duration::ZERO;
    let (mut c, regions, reg) = three_members(t0);
    c.handle_timeout(t0 + SETTLE);
    let batch = drain(&mut c);
    let journal: Vec<CoordinatorEvent> = reg.events.into_iter().chain(batch.events).collect();
    let t1 = Duration::from_secs(30);
    let mut c2 = ShardCoordinator::recover(
        settings(SHARDS),
        Box::new(LeastShardAllocationStrategy::default()),
        &journal,
        t1,
    );
    c2.handle_membership(t1, up(&[1, 2, 3]));
    drain(&mut c2);
    let hosted_by = |r: &RegionId| -> Vec<(ShardId, Generation)> {
        batch
            .allocated
            .iter()
            .filter(|(_, (h, _))| h == r)
            .map(|(s, (_, g))| (*s, *g))
            .collect()
    };
    // The first region to register hears only its own homes: the others'
    // regions may still be stopping theirs after an earlier hand-off.
    let first = regions[0].clone();
    c2.handle_message(
        t1,
        CoordinatorMsg::Register {
            region: first.clone(),
            hosted: hosted_by(&first),
            stopping: Vec::new(),
        },
    );
    let d = drain(&mut c2);
    let told = d.homes_told(&first);
    assert_eq!(told.len(), hosted_by(&first).len());
    assert!(told.values().all(|h| *h == first));
    // A second region registers, stopping one of its shards: the first
    // region now hears its other homes, never the stopping shard's.
    let second = regions[2].clone();
    let own = hosted_by(&second);
    let stopping = own[0].0;
    c2.handle_message(
        t1,
        CoordinatorMsg::Register {
            region: second.clone(),
            hosted: own.clone(),
            stopping: vec![stopping],
        },
    );
    let d = drain(&mut c2);
    let pushed = d.homes_told(&first);
    assert_eq!(pushed.len(), own.len() - 1);
    assert!(pushed.values().all(|h| *h == second));
    assert!(!pushed.contains_key(&stopping));
    assert!(!d.homes_told(&second).contains_key(&stopping));
}

/// Shards per region of the coordinator's state.
fn loads(c: &ShardCoordinator) -> BTreeMap<RegionId, usize> {
    c.state()
        .regions
        .iter()
        .map(|(r, s)| (r.clone(), s.len()))
        .collect()
}

/// Runs the coordinator's timers from `from` to `until` in `step`s, every
/// hand-off answered at once, with `membership` (in time order) fed at its
/// time; returns the time the regions first differed by at most one shard
/// once every event was fed, if they did.
fn run_rounds(
    c: &mut ShardCoordinator,
    from: Duration,
    until: Duration,
    step: Duration,
    mut membership: Vec<(Duration, MembershipEvent)>,
) -> Option<Duration> {
    let mut now = from;
    let mut balanced_at = None;
    while now <= until {
        while membership.first().is_some_and(|(at, _)| *at <= now) {
            let (_, e) = membership.remove(0);
            c.handle_membership(now, e);
            let d = drain(c);
            answer_hand_offs(c, now, d);
        }
        if c.poll_timeout().is_some_and(|t| t <= now) {
            c.handle_timeout(now);
            let d = drain(c);
            answer_hand_offs(c, now, d);
        }
        let l = loads(c);
        let (min, max) = (l.values().min().unwrap(), l.values().max().unwrap());
        let every_region_up = membership.is_empty();
        if every_region_up && max - min <= 1 && balanced_at.is_none() {
            balanced_at = Some(now);
        }
        now += step;
    }
    balanced_at
}

/// Member 1 hosts every shard of a warm cluster; members 2 and 3 start
/// together: their regions register while both are Joining, member 2 is
/// Up 50 ms later and member 3 two seconds later (`up3`, the membership
/// input that makes it Up). Returns how long after that member 3's region
/// was balanced with the others (`None`: not within 35 s) and the loads.
fn join_while_joining(up3: MembershipEvent) -> (Option<Duration>, BTreeMap<RegionId, usize>) {
    const N: u32 = 100;
    let mut c = warm_on_member_1(N);
    let t1 = Duration::from_secs(3);
    register(&mut c, t1, rid(2, 0));
    register(&mut c, t1, rid(3, 0));
    drain(&mut c);
    let up3_at = t1 + Duration::from_secs(2);
    let balanced_at = run_rounds(
        &mut c,
        t1,
        up3_at + Duration::from_secs(35),
        Duration::from_millis(50),
        vec![
            (
                t1 + Duration::from_millis(50),
                MembershipEvent::MemberUp(member(2)),
            ),
            (up3_at, up3),
        ],
    );
    assert_eq!(c.state().shards.len(), N as usize);
    assert!(c.rebalance_in_progress().next().is_none());
    (balanced_at.map(|t| t - up3_at), loads(&c))
}

/// The regions of joining members register as soon as their node learns
/// where the coordinator runs, which can be before the leader makes the
/// member Up; they may host shards only once it is Up. A round of the fast
/// window that ran in between found nothing to move and ended the window,
/// so the joiner got its share at one round per `rebalance_interval` (10 s,
/// 10 shards each): 35/35/30 thirty seconds after the join (the spawned
/// three-node cluster's `wait_balanced` timeout). The fast rounds start
/// when the joiner is Up.
#[test]
fn a_joiner_whose_region_registered_before_it_was_up_gets_its_share_in_fast_rounds() {
    let (took, loads) = join_while_joining(MembershipEvent::MemberUp(member(3)));
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(5)),
        "member 3 balanced {took:?} after it was Up (fast rounds take a second or two): {loads:?}"
    );
    // The same when the coordinator learns it from a whole membership view.
    let (took, loads) = join_while_joining(up(&[1, 2, 3]));
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(5)),
        "member 3 balanced {took:?} after it was Up: {loads:?}"
    );
}
